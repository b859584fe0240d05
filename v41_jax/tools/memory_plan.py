"""Memory plan for N devices: bytes per device of every parameter group and of the cache, for each
mesh layout and held expert format, and the largest batch at a context that fits (docs/PARALLEL.md).

Layouts (`runtime/mesh.py` builds "dp"):

* "dp" (data-parallel attention, expert-parallel MoE; what SGLang and vLLM deploy for DeepSeek):
  the routed experts split over the devices (E/N each, the expert weights never move), every other
  weight replicated; each device owns the STATE slots and pages of its own requests, so the cache
  is split and the batch grows with N.
* "tp" (tensor-parallel attention, expert-parallel MoE): as "dp" but the per-head attention
  weights (query heads, output groups, sinks, indexer heads) split too; V4.1 has one latent KV
  head shared by every query head, so each device holds the cache of every request: the batch
  does not grow with N.

Bytes are exact for the params (`checkpoint.load.held_as` / `held_bytes`, the leaves a load
makes) and the cache (`CacheGeometry.total_bytes`, page 0 included). The "fp8" expert format
assumes every tensor re-codes (a tensor whose rows span too many binades stays fp4, smaller).
The Engram tables stay on the host (page cache of the memory-mapped checkpoint) unless they are at
most `runner.DEVICE_ENGRAM_BYTES`. The fit subtracts a workspace reserve (activations, XLA
temporaries, allocator slack), an input here, not a measurement of the released model.
Host memory while loading: `host_read_bytes`, the largest single read (one device's block of an
expert stack as stored), beyond the memory-mapped file pages.

Run `python -m v41_jax.tools.memory_plan --config C [--devices 1,2,4,8] [--markdown]`.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass

from v41_jax.cache.geometry import INDEX_FORMATS, KV_FORMATS, CacheGeometry, EngineSettings
from v41_jax.checkpoint.load import held_as, held_bytes, param_units
from v41_jax.checkpoint.safetensors_io import DTYPES
from v41_jax.checkpoint.schema import checkpoint_schema
from v41_jax.config import ModelConfig, exit_2_on_refusal
from v41_jax.runtime.runner import DEVICE_ENGRAM_BYTES

LAYOUTS = ("dp", "tp")
EXPERT_FORMATS = ("fp4", "fp8", "bf16")
GROUPS = ("embed", "head", "attention", "mhc_norms", "router", "shared_expert", "routed_experts",
          "engram_dense", "draft_dense", "draft_routed_experts")
# attention weights with one slice per query head / output group / index head: split by "tp"
PER_HEAD = ("attn.wq_b", "attn.wo_a", "attn.wo_b", "attn.attn_sink", "attn.indexer.wq_b",
            "attn.indexer.weights_proj")
GiB = 1 << 30


def group_of(path: str) -> str:
    """The parameter group of a dotted params path (`load.param_units` keys)."""
    draft = path.startswith("mtp.")
    if ".ffn.experts." in path:
        return "draft_routed_experts" if draft else "routed_experts"
    if draft:
        return "draft_dense"
    if path in ("embed.weight", "head.weight"):
        return path.split(".")[0]
    for part, group in ((".attn.", "attention"), (".ffn.gate", "router"), (".ffn.shared_experts.", "shared_expert"),
                        (".engram.", "engram_dense")):
        if part in path:
            return group
    return "mhc_norms"


def split_ways(path: str, shape: tuple[int, ...], layout: str, n: int) -> int:
    """Over how many devices a leaf is split (1 = replicated): a stack of routed experts whose count
    the devices divide (`runtime.mesh.expert_split`, the same rule), per-head attention under "tp"."""
    if ".ffn.experts." in path:
        return n if shape[0] % n == 0 else 1
    if layout == "tp" and any(f".{p}." in path or path.endswith(f".{p}") for p in PER_HEAD):
        return n
    return 1


def param_leaves(cfg: ModelConfig) -> list[tuple[str, tuple[int, ...], dict[str, str]]]:
    """(params path, logical shape, expert format -> held format) of every leaf a
    load makes (`load.param_units`; routed experts stacked on a leading axis)."""
    schema = checkpoint_schema(cfg)
    out = []
    for path, unit in param_units(schema).items():
        spec = schema[unit.names[0]]
        shape = (spec.shape[0], 2 * spec.shape[1]) if spec.dtype == "I8" else spec.shape   # FP4: 2 a byte
        full = ((len(unit.names),) if unit.stacked else ()) + tuple(shape)
        out.append((path, full, {e: held_as(spec, unit, e) for e in EXPERT_FORMATS}))
    return out


def param_bytes(leaves, experts: str, layout: str, n: int) -> dict[str, int]:
    """group -> device bytes per device of `param_leaves(cfg)` held with `experts` in `layout`."""
    if layout not in LAYOUTS or experts not in EXPERT_FORMATS:
        raise ValueError(f"layout / experts: one of {LAYOUTS} / {EXPERT_FORMATS}")
    out = dict.fromkeys(GROUPS, 0)
    for path, full, held in leaves:
        ways = split_ways(path, full, layout, n)
        if full[0] % ways:
            raise ValueError(f"{path}: leading dim {full[0]} does not split over {ways} devices")
        out[group_of(path)] += held_bytes(held[experts], full) // ways
    return out


def host_read_bytes(cfg: ModelConfig, n: int) -> int:
    """The loader's host transient on n devices (`load._convert`): its largest read, one at a time.

    A stack of routed experts is read with `np.stack` into one host buffer: one device's block of
    E/n experts when the stack splits (`split_ways`, `runtime.mesh.expert_sharding`), else all E,
    as stored (E2M1 codes and their E8M0 scales). That is the loader's only host copy: every other
    tensor is a zero-copy view of the memory map (file pages, which the kernel may drop), the
    conversion to the held format runs in XLA (device memory; host memory on a CPU mesh), and
    `_convert` waits for each conversion, so no two reads are held at once. The Engram tables stay
    memory-mapped and unread. Measured against this: `scripts/load_memory.py`."""
    schema = checkpoint_schema(cfg)
    stored = lambda name: math.prod(schema[name].shape) * DTYPES[schema[name].dtype].itemsize
    largest = 0
    for path, unit in param_units(schema).items():
        if unit.stacked:
            scale = unit.names[0].removesuffix(".weight") + ".scale"
            expert = stored(unit.names[0]) + (stored(scale) if scale in schema else 0)
            largest = max(largest, expert * len(unit.names) // split_ways(path, (len(unit.names),), "dp", n))
    return largest


def engram_table_bytes(cfg: ModelConfig) -> int:
    """FP8 rows + E8M0 per 32 lanes of every backbone Engram table."""
    hd = cfg.engram_head_dim
    return sum(rows * (hd + hd // 32) for l, rows in zip(cfg.engram_layer_ids, cfg.engram_num_embeddings)
               if l < cfg.n_layers)


def cache_bytes(cfg: ModelConfig, batch: int, context: int, page_tokens: int, kv_format: str,
                index_format: str) -> int:
    """Bytes of one device's cache holding `batch` requests of `context` tokens (page 0 included)."""
    pages = -(-context // page_tokens)
    return CacheGeometry.build(cfg, EngineSettings(page_tokens=page_tokens, num_pages=batch * pages + 1,
                                                   slots=batch, max_context=context, kv_format=kv_format,
                                                   index_format=index_format)).total_bytes


def largest_batch(cfg: ModelConfig, free: int, context: int, page_tokens: int, kv_format: str,
                  index_format: str) -> int:
    """The most requests of `context` tokens one device's cache holds in `free` bytes (0 if none)."""
    fits = lambda b: cache_bytes(cfg, b, context, page_tokens, kv_format, index_format) <= free
    if free <= 0 or not fits(1):
        return 0
    lo, hi = 1, 2
    while fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:                       # fits(lo), not fits(hi): the bytes grow with the batch
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


@dataclass(frozen=True)
class PlanRow:
    layout: str
    experts: str
    devices: int
    params: dict            # group -> bytes per device
    engram_device: int      # Engram tables copied to each device (0: host-resident)
    free: int               # bytes per device left for the cache
    batch_per_device: dict  # context -> largest batch one device's cache holds
    batch_total: dict       # context -> requests the mesh serves at once

    @property
    def param_total(self) -> int:
        return sum(self.params.values()) + self.engram_device


def plan(cfg: ModelConfig, devices=(1, 2, 4, 8), contexts=(8192, 65536), hbm: int = 139 * GiB,
         reserve: int = 8 * GiB, page_tokens: int = 256, kv_format: str = "bf16",
         index_format: str = "bf16") -> list[PlanRow]:
    leaves = param_leaves(cfg)
    engram = engram_table_bytes(cfg)
    engram_device = engram if engram <= DEVICE_ENGRAM_BYTES else 0
    rows = []
    for layout in LAYOUTS:
        for experts in EXPERT_FORMATS:
            for n in devices:
                params = param_bytes(leaves, experts, layout, n)
                free = hbm - reserve - sum(params.values()) - engram_device
                per = {c: largest_batch(cfg, free, c, page_tokens, kv_format, index_format) for c in contexts}
                total = {c: b * n if layout == "dp" else b for c, b in per.items()}
                rows.append(PlanRow(layout, experts, n, params, engram_device, free, per, total))
    return rows


def _gb(n: int) -> str:
    return f"{n / 1e9:,.2f}"


def markdown(rows: list[PlanRow], contexts) -> str:
    head = (["layout", "experts", "N"] + [f"{g} GB" for g in GROUPS] + ["params GB", "free GB"]
            + [f"batch @ {c:,} (per dev / total)" for c in contexts])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r.layout, r.experts, str(r.devices), *(_gb(r.params[g]) for g in GROUPS),
                 _gb(r.param_total), _gb(r.free) if r.free > 0 else f"**{_gb(r.free)}**",
                 *(f"{r.batch_per_device[c]:,} / {r.batch_total[c]:,}" for c in contexts)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


@exit_2_on_refusal
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True, help="config.json (any accepted layout) or checkpoint dir")
    p.add_argument("--devices", default="1,2,4,8", help="comma-separated device counts")
    p.add_argument("--contexts", default="8192,65536", help="comma-separated tokens per request")
    p.add_argument("--hbm-gib", type=float, default=139.0, help="device memory (H200: about 139 GiB usable)")
    p.add_argument("--reserve-gib", type=float, default=8.0, help="workspace kept out of the cache")
    p.add_argument("--page-tokens", type=int, default=256)
    p.add_argument("--kv-format", default="bf16", choices=KV_FORMATS)
    p.add_argument("--index-format", default="bf16", choices=INDEX_FORMATS)
    p.add_argument("--markdown", action="store_true", help="a markdown table (docs/PARALLEL.md)")
    a = p.parse_args(argv)
    cfg = ModelConfig.from_file(a.config)
    devices = tuple(int(x) for x in a.devices.split(","))
    contexts = tuple(int(x) for x in a.contexts.split(","))
    rows = plan(cfg, devices, contexts, int(a.hbm_gib * GiB), int(a.reserve_gib * GiB), a.page_tokens,
                a.kv_format, a.index_format)
    if a.markdown:
        print(markdown(rows, contexts))
        print(f"\nEngram tables: {_gb(engram_table_bytes(cfg))} GB "
              f"({'on each device' if rows[0].engram_device else 'host memory, per host'})")
        print("Largest host read while loading (the loader's host transient, per process): "
              + ", ".join(f"N = {n}: {_gb(host_read_bytes(cfg, n))} GB" for n in devices))
        return 0
    for r in rows:
        print(json.dumps({"layout": r.layout, "experts": r.experts, "devices": r.devices, "params": r.params,
                          "engram_device": r.engram_device, "param_total": r.param_total, "free": r.free,
                          "batch_per_device": r.batch_per_device, "batch_total": r.batch_total}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
