"""End-to-end baseline of the jitted cache step: decode latency, prefill throughput, compile time
and an HBM roofline ratio, on random weights generated on the device.

    python -m scripts.bench_step --config v41_jax/configs/bench_slice.config.json --out results.json
        [--batches 1,8,32] [--context 8192] [--prefill 1024,4096] [--iters 20]
        [--budget-s 100] [--total-s 170] [--numerics fast] [--kernels auto] [--experts fp8] [--dense fp8]
        [--profile N [--host-events N]] [--compare-kernel sinkhorn|rmsnorm|select|rope|hc_expand|dense_fp8 | --compare-numerics FIELD | --compare-scan | --compare-option KEY=VALUE | --compare-dense] [--option KEY=VALUE ...] [--layers N] [--routed-experts E]
    CPU smoke run (~1 min): --config v41_jax/configs/tiny.config.json --batches 1,2 --context 64
        --prefill 32 --iters 2

What runs: the engine's own pieces. `Engine` (geometry, allocator, Engram hasher, the jitted
`step` with the cache donated) builds each case's batch with `Engine.make_span` + `build_step`
exactly as `Engine.run` does; the step executable per bucket comes from
`engine.step_fn.lower(...).compile()`, and the timed loop calls it with the batch already on the
device (host build time is reported separately).

Params: random values in exactly the loader's pytree layout (`checkpoint_schema` -> `param_units`
-> `nest`, shapes from `make_checkpoint.logical_shape`, dtypes from `TensorSpec.held`: bf16 for
every dequantized weight, fp32 where the loader holds fp32), drawn on the device with
`jax.random` at the scales of `make_checkpoint`'s writer (`_init` is affine in its normal draw:
its offset and scale are read off it). No checkpoint is written or quantized. The Engram tables
are host numpy arrays (FP8 codes + E8M0 scales) in an `EngramTables`, as `load_params` gives.

Cache: synthetic. Every PAGE/STATE row is random (never zeros: the index scores, top-k picks and
so the gathered rows then look like real ones); each decode request's Engram cursor is set to its
position so the engine's host-side check passes. Decode rows sit at position `context - 1` (each
attends to `context` positions); the timing depends on shapes and visible counts, not on the
rows' values (except through which rows the top-k picks).

Cases, in this order: decode at each batch (bucket T = R = O = batch), then one prefill chunk per
size (batch 1, position 0, one logits row). Each case is lowered in the main thread and its XLA
compile starts at once in a thread of its own (so compiles overlap each other and the next
lowerings: per-bucket compile seconds include that contention). Cases are then timed in order as
soon as each compile is done: the first call, `--warmup` calls, then the median of up to `--iters`
calls (`block_until_ready` on the logits and the cache), and `back_to_back_ms`: `--iters` calls
queued without a wait, each on the previous call's cache, as the engine's loop runs them (the
previous call's logits stay alive here, so each call's outputs land at new addresses and XLA
re-records its command buffer: at batch 1 that host work, not the device, can bound the figure),
and `back_to_back_outputs_dropped_ms`, the same with each call's logits dropped at once
(`step_ms_outputs_dropped_median`: the waited calls so; with `--host-events` its host trace and
device timeline too) (scripts/bench_runtime.py times the engine's own loop). `--profile N` adds the device time by kernel
and the device timeline (`bench_common.device_timeline`), `--host-events N` the host's trace. A case timed while other compiles were
still running (XLA's autotuning runs on the GPU) is timed again at the end when time is left; the
first figures stay under `during_compiles`. Also per case: the executable's memory analysis and the
host time to build one batch (`make_span` + `build_step`: Engram hashing and table gathers).

Roofline (decode): bytes a step must read (every weight the step touches: the layers' dense
weights, the LM head and the norm, embedding rows; the routed experts of the expected number of
distinct experts a batch activates, E (1 - (1 - k/E)^b), uniform routing assumed; per request and
layer the window rows, the selected compressed rows and the index keys its scorer scans) over the
memory ceiling measured in the same run (`bench_common.copy_bandwidth` over `--copy-mib`: the largest
of a copy's bytes read + written, a row-sum read's and a one-row GEMV's, before the cases and again
after them, the larger of the two) -> ideal ms; reported measured / ideal. The draft stages (`mtp`) are
generated (the layout is the loader's) but the step does not touch them.

Compare one kernel (`--compare-kernel NAME`, a name of `kernels_pallas.backend.KERNELS`): every
case runs twice, NAME on its XLA path and on its Pallas kernel (`backend.use_backend(..., kernel=
NAME)` around the lowering of a step function of its own; every other kernel as `--kernels`). After
the timing above, each pair is timed again interleaved (5 rounds, each variant `--iters` / 5 calls
in turn, then as many back to back): `comparisons` in the JSON, per variant the median and spread
of those calls and each round's back-to-back ms, and the medians' differences.
`--compare-numerics FIELD` pairs the policy with one of its boolean fields off and on (e.g.
`exact_rms`: the RMS statistic's kernel against one XLA reduction; a step function of its own per
variant) the same way. `--compare-scan` pairs the unrolled layer stack with the scanned one (`Engine(scan_layers=True)`:
the same params stacked per run of identical layers, `v41_jax/model/layer_runs.py`) the same way,
and first runs each from a copy of one cache: `differing_outputs` lists the outputs (logits,
cache fields) whose bytes differ between the variants and, as controls, between two runs of each
(per output: the elements, and for floats the largest difference and magnitude among them).
`--compare-dense` pairs the dense FP8 weights held as bf16 with the same values held as published
(`load_params(dense=)`; the fp8 variant's weights drawn, the bf16 variant's their decode) the
same way; each variant's ideal counts its own bytes.
`--option KEY=VALUE` (repeatable) sets an XLA compile option over the engine's for every case.
`--compare-option KEY=VALUE` pairs the engine's XLA compile options
(`compile_cache.compiler_options`) with the same options and KEY set to VALUE (e.g.
`xla_gpu_command_buffer_scheduling_mode=LHS`): one lowering, two executables, timed interleaved in
one process (an XLA_FLAGS comparison needs a process per variant, and processes on one machine
differed by 0.17 ms at batch 1, BENCHMARKS.md 2026-12-06 q), outputs compared as --compare-scan's.

Smaller models of a config's layer pattern: `--layers N` keeps its first N layers (the cut of
`scripts/bench_compile.py`), `--routed-experts E` holds E routed experts per layer (so a cut of the
released config fits one device).

Profile (`--profile N`, after all timing): N more steps per case under `jax.profiler.trace`; the
kernel time per step by kernel (Pallas kernels by their names, XLA fusions without their numeric
suffix), from the trace's device stream lines (`bench_common.kernel_profile`), and by the model
function that traced each kernel's HLO instruction (`by_source`, from the compiled module's source
tables: which `loop_convert_fusion`s are whose).

Time limits (the GPU run has one shot): a case whose compile exceeds `--budget-s` is skipped; a
watchdog ends the process at `--total-s` (the JSON is rewritten after every case, so what was
measured survives); each case's timed loop stops after `--case-s`; a case whose executable would
not fit the device's memory (memory analysis) is skipped instead of run.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import sys
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields, replace
from functools import partial
from pathlib import Path

if __package__ in (None, ""):  # python scripts/bench_step.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402

from kernels_pallas import backend as kernel_backend  # noqa: E402
from scripts.bench_common import (back_to_back_s, copy_bandwidth, cut, gemm_peak, host_events,  # noqa: E402
                                  kernel_profile, kernel_sources)
from scripts.make_checkpoint import init_affine  # noqa: E402
from scripts.make_checkpoint import engram_token_map, logical_shape  # noqa: E402
from v41_jax.cache.buffer import DEAD, Cache, allocate  # noqa: E402
from scripts.generate import INDEX_CHOICES, KV_CHOICES  # noqa: E402
from v41_jax.cache.geometry import CacheGeometry, EngineSettings, row_formats  # noqa: E402
from v41_jax.checkpoint.load import (DENSE_HOLDS, ENGRAM_KEY, EXPERT_HOLDS, HELD_DTYPES, EngramTables,  # noqa: E402
                                     held_as, held_bytes, nest, param_units, resolve_dense)
from v41_jax.quant import (Fp4Weight, Fp8BlockWeight, Fp8RowWeight, fp4_qdq_ue8m0, fp8_act_qdq, fp8_block_scale_shape,  # noqa: E402
                           held, packed_fp4_lanes,
                           packed_fp4_row_bytes, packed_fp8_row_bytes,
                           pack_fp4_e4m3_rows, pack_fp4_ue8m0_rows, pack_fp8_ue8m0_rows)
from v41_jax.checkpoint.schema import checkpoint_schema  # noqa: E402
from v41_jax.config import ModelConfig  # noqa: E402
from v41_jax.model.layer_runs import stack_runs  # noqa: E402
from v41_jax.model.numerics import Numerics  # noqa: E402
from v41_jax.runtime import compile_cache  # noqa: E402
from v41_jax.runtime.engine import NUMERICS, Engine  # noqa: E402
from v41_jax.runtime.metadata import Bucket, BucketSet, build_step  # noqa: E402
from v41_jax.runtime.step import make_step  # noqa: E402
from v41_jax.topology import Mode, resolve_topology  # noqa: E402

SCAN_VARIANTS = ("unrolled", "scanned")
SWITCH_VARIANTS = ("off", "on")
DENSE_VARIANTS = ("bf16", "fp8")
# the policy's switches a run can compare (`--compare-numerics`): its boolean fields but
# `quantized`, which the checkpoint sets (`make_step` applies `for_model`)
POLICY_SWITCHES = tuple(f.name for f in fields(Numerics) if f.type in (bool, "bool") and f.name != "quantized")
# HBM bandwidth on the vendors' data sheets, GB/s, by a part of the device's name (the physical
# limit a decode ratio is also reported against; the in-run probe reaches ~80 % of it on an H100)
# (None: a name of several parts, e.g. the GH200's 96 GB HBM3 and 144 GB HBM3e; checked first)
DATASHEET_GBS = (("GH200", None), ("H100 80GB HBM3", 3350.0), ("H100 NVL", 3900.0), ("H100 PCIe", 2000.0),
                 ("H200", 4800.0), ("MI300X", 5300.0), ("MI325X", 6000.0))
GiB = float(1 << 30)


# ---- params: the loader's layout, random values on the device ----------------------------------

@dataclass(frozen=True)
class LeafSpec:
    path: str                  # dotted params path (`nest` turns it into the pytree)
    shape: tuple[int, ...]
    held: str                  # "bf16" | "f32" | "fp4" | "fp8" | "fp8_blocks" (`load.held_as`)
    offset: float              # value = offset + scale * N(0, 1), as the writer draws it
    scale: float

    @property
    def nbytes(self) -> int:
        return held_bytes(self.held, self.shape)


def param_leaf_specs(cfg: ModelConfig, experts: str = "auto", dense: str = "auto") -> dict[str, LeafSpec]:
    """Every params leaf `load_params(..., experts=experts, dense=dense)` would produce for `cfg`:
    path -> LeafSpec."""
    schema = checkpoint_schema(cfg)
    out = {}
    for path, unit in param_units(schema).items():
        spec = schema[unit.names[0]]
        shape = tuple(logical_shape(spec))               # the dequantized [out, in]
        offset, scale = init_affine(unit.names[0], shape)
        full = ((len(unit.names),) if unit.stacked else ()) + shape
        out[path] = LeafSpec(path, full, held_as(spec, unit, experts, dense), offset, scale)
    return out


@partial(jax.jit, static_argnums=(1, 2))
def _draw(key, shape, held, offset, scale):
    if held == "fp4":
        # uniform codes (E2M1 magnitudes have an rms of 2.93) under one E8M0 scale that gives
        # the writer's rms `scale`
        code = jnp.clip(jnp.round(127 + jnp.log2(scale / 2.93)), 1, 254).astype(jnp.uint8)
        codes = jax.random.bits(key, (*shape[:-1], shape[-1] // 2), jnp.uint8)
        return Fp4Weight(codes, jnp.full((*shape[:-1], shape[-1] // 32), code, jnp.uint8))
    if held == "fp8":
        # uniform E4M3 codes but the NaNs (|x| up to 240, rms ~60) under one power of two per row
        codes = jax.random.bits(key, shape, jnp.uint8) & 0xF7
        row = jnp.exp2(jnp.round(jnp.log2(scale / 60.0))).astype(jnp.float32)
        return Fp8RowWeight(codes, jnp.full(shape[:-1], row, jnp.float32))
    if held == "fp8_blocks":
        # the same codes under one E8M0 per 32 x 32 block
        codes = jax.random.bits(key, shape, jnp.uint8) & 0xF7
        code = jnp.clip(jnp.round(127 + jnp.log2(scale / 60.0)), 1, 254).astype(jnp.uint8)
        return Fp8BlockWeight(codes, jnp.full(fp8_block_scale_shape(shape), code))
    dt = HELD_DTYPES[held]
    return (jax.random.normal(key, shape, dt) * scale.astype(dt) + offset.astype(dt)).astype(dt)


def random_params(cfg: ModelConfig, seed: int = 0, specs: dict[str, LeafSpec] | None = None,
                  workers: int = 16) -> dict:
    """A params pytree with the loader's structure, shapes and dtypes, drawn on the default
    device, plus host Engram tables. One small RNG program per distinct (shape, dtype): the first
    leaf of each is drawn from a thread pool so those compiles overlap."""
    specs = specs or param_leaf_specs(cfg)
    root = jax.random.key(seed, impl="rbg")
    items = list(specs.items())

    def draw(i: int):
        s = items[i][1]
        return _draw(jax.random.fold_in(root, i), s.shape, s.held, np.float32(s.offset), np.float32(s.scale))

    first: dict[tuple, int] = {}
    for i, (_, s) in enumerate(items):
        first.setdefault((s.shape, s.held), i)
    flat: dict[str, jax.Array] = {}
    with ThreadPoolExecutor(max(1, workers)) as pool:
        for i, arr in zip(first.values(), pool.map(draw, first.values())):
            flat[items[i][0]] = arr
    for i, (path, _) in enumerate(items):
        if path not in flat:
            flat[path] = draw(i)
    params = nest({path: flat[path] for path, _ in items})
    params[ENGRAM_KEY] = random_engram_tables(cfg, seed)
    return params


def engram_table_bytes(cfg: ModelConfig) -> int:
    hd = cfg.engram_head_dim
    return sum(n * (hd + hd // 32) for l, n in zip(cfg.engram_layer_ids, cfg.engram_num_embeddings)
               if l < cfg.n_layers)


def random_engram_tables(cfg: ModelConfig, seed: int = 0) -> EngramTables:
    """Host FP8 E4M3 rows (codes 0x30-0x3f: |x| in [0.5, 1.875], random signs; a random block of
    64Ki rows repeated, which the host gather cannot tell apart) with E8M0 scale 1.0, typed like
    the checkpoint's memmap views."""
    rng = np.random.default_rng(seed)
    weight, scale, source = {}, {}, []
    for layer, rows in zip(cfg.engram_layer_ids, cfg.engram_num_embeddings):
        if layer >= cfg.n_layers:
            continue
        block = rng.integers(0, 32, (min(rows, 1 << 16), cfg.engram_head_dim), dtype=np.uint8)
        block = (block & 0x0F) | 0x30 | ((block & 0x10) << 3)
        weight[layer] = np.resize(block, (rows, cfg.engram_head_dim)).view(ml_dtypes.float8_e4m3fn)
        scale[layer] = np.full((rows, cfg.engram_head_dim // 32), 127, np.uint8).view(ml_dtypes.float8_e8m0fnu)
        source += [(f"layers.{layer}.engram.embed.{w}", f"random:seed={seed}", 0) for w in ("weight", "scale")]
    return EngramTables(weight, scale, tuple(source))


# ---- bytes a decode step must read ---------------------------------------------------------------

def expected_experts(n_experts: int, k: int, tokens: int) -> float:
    """Expected distinct experts `tokens` tokens activate, each picking k of E uniformly."""
    return n_experts * (1.0 - (1.0 - k / n_experts) ** tokens)


def decode_bytes(cfg: ModelConfig, geom: CacheGeometry, specs: dict[str, LeafSpec], batch: int,
                 context: int) -> dict:
    """Bytes one decode step of `batch` requests (query at position context - 1) must read."""
    topo = resolve_topology(cfg)
    dense = sum(s.nbytes for p, s in specs.items()
                if p.startswith("layers.") and ".ffn.experts." not in p)
    dense += specs["head.weight"].nbytes + specs["norm.weight"].nbytes
    dense += batch * specs["embed.weight"].nbytes // specs["embed.weight"].shape[0]
    experts = experts_ub = 0.0
    for layer in range(cfg.n_layers):
        n_e, k = cfg.moe_experts(layer)
        per_expert = sum(specs[f"layers.{layer}.ffn.experts.{w}"].nbytes for w in ("w1", "w2", "w3")) / n_e
        experts += expected_experts(n_e, k, batch) * per_expert
        experts_ub += min(n_e, batch * k) * per_expert
    pos = context - 1
    window = compressed = index = 0
    for t in topo[: cfg.n_layers]:
        window += min(cfg.window_size, pos + 1) * geom.window_row_bytes
        if t.mode is Mode.WINDOW:
            continue
        visible = (pos + 1) // t.ratio
        compressed += min(cfg.index_topk, visible) * geom.main_row_bytes
        if t.scores:
            scanned = visible if t.mode is Mode.FULL else min(
                visible, cfg.candidate_topk_blocks * cfg.candidate_block_size)
            index += scanned * geom.index_row_bytes
    kv = batch * (window + compressed + index)
    return {"dense_weights": int(dense), "experts_expected": int(experts), "experts_upper": int(experts_ub),
            "kv_window": batch * window, "kv_compressed": batch * compressed, "kv_index_keys": batch * index,
            "kv_total": int(kv), "total": int(dense + experts + kv)}


def prefill_weight_flops(cfg: ModelConfig, specs: dict[str, LeafSpec], tokens: int) -> float:
    """2 x (weights each token multiplies) x tokens: the layers' dense weights (the Engram and
    compressor projections included) and k experts per layer, plus the head for one logits row.
    Attention's own FLOPs and the embedding gather are left out (an approximation)."""
    per_tok = sum(int(np.prod(s.shape)) for p, s in specs.items()
                  if p.startswith("layers.") and ".ffn.experts." not in p)
    for layer in range(cfg.n_layers):
        n_e, k = cfg.moe_experts(layer)
        per_tok += k * sum(int(np.prod(specs[f"layers.{layer}.ffn.experts.{w}"].shape)) for w in ("w1", "w2", "w3")) // n_e
    return 2.0 * (per_tok * tokens + int(np.prod(specs["head.weight"].shape)))


def prefill_attention_flops(cfg: ModelConfig, tokens: int) -> float:
    """The attention FLOPs a prefill of `tokens` tokens (positions 0..tokens-1) must compute, by
    the same position rules as `decode_bytes`: per layer and token, q.k and p.v over the ids it
    attends (its window rows, then min(top-k, visible) compressed rows), 2 x H x Dh each, and the
    indexer's scores (2 x index heads x index dim per scanned key) where the layer scores. Ids
    the kernels pad or skip are not counted."""
    pos = np.arange(tokens, dtype=np.float64)
    total = 0.0
    for t in resolve_topology(cfg)[: cfg.n_layers]:
        ids = np.minimum(cfg.window_size, pos + 1)
        if t.mode is not Mode.WINDOW:
            visible = (pos + 1) // t.ratio
            ids = ids + np.minimum(cfg.index_topk, visible)
            if t.scores:
                scanned = visible if t.mode is Mode.FULL else np.minimum(
                    visible, cfg.candidate_topk_blocks * cfg.candidate_block_size)
                total += 2.0 * cfg.index_n_heads * cfg.index_head_dim * scanned.sum()
        total += 2.0 * 2 * cfg.n_heads * cfg.head_dim * ids.sum()
    return total


# ---- measurement helpers -------------------------------------------------------------------------

def device_memory_limit() -> int | None:
    try:
        stats = jax.devices()[0].memory_stats()
    except Exception:  # noqa: BLE001 - not every backend reports
        return None
    return int(stats["bytes_limit"]) if stats and "bytes_limit" in stats else None


def memory_analysis(compiled) -> dict:
    try:
        m = compiled.memory_analysis()
    except Exception:  # noqa: BLE001
        return {}
    if m is None:
        return {}
    keys = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes",
            "generated_code_size_in_bytes")
    return {k: int(getattr(m, k)) for k in keys if hasattr(m, k)}


def decode_cursors(rng: np.random.Generator, cfg: ModelConfig, slots: int, history: int, context: int,
                   n: int) -> np.ndarray:
    """Cursor rows [slots, history + 1] for a synthetic cache: slots 0..n-1 decoding at position
    context - 1 with a random Engram history, the others at position 0 with none (DEAD)."""
    cursor = np.zeros((slots, history + 1), np.int64)
    cursor[:, 1:] = DEAD
    for i in range(n):
        cursor[i] = [context - 1, *rng.integers(0, cfg.engram_compressed_vocab_size, history)]
    return cursor


def _random_packed_index(key, plane: jax.Array) -> jax.Array:
    """A packed FP4 index plane [..., Di/2 + Di/32] of N(0, 1) keys put on the fp4 grid."""
    keys = jax.random.normal(key, (*plane.shape[:-1], packed_fp4_lanes(plane.shape[-1])))
    return pack_fp4_ue8m0_rows(fp4_qdq_ue8m0(keys))


def _random_packed_kv(key, plane: jax.Array, window: bool) -> jax.Array:
    """A packed main plane [..., D/2 + D/16] (FP4, E4M3 scales) or window ring [..., D + D/32]
    (FP8, E8M0 scales) of N(0, 1) rows' round trips."""
    w = plane.shape[-1]
    d = w * 32 // 33 if window else w * 16 // 9            # the inverses of quant's row widths
    if (packed_fp8_row_bytes if window else packed_fp4_row_bytes)(d) != w:
        raise ValueError(f"{w} B is no packed {'window' if window else 'main'} row")
    rows = jax.random.normal(key, (*plane.shape[:-1], d), jnp.bfloat16)
    return pack_fp8_ue8m0_rows(fp8_act_qdq(rows)) if window else pack_fp4_e4m3_rows(rows)


@partial(jax.jit, donate_argnums=(0,))
def randomize_cache(cache: Cache, key, cursor) -> Cache:
    """Random rows in every PAGE / STATE array (N(0, 1) in its dtype; packed planes: N(0, 1) rows
    on their grids, packed); cursor rows as given."""
    leaves, treedef = jax.tree_util.tree_flatten(cache)
    out = []
    for i, x in enumerate(leaves):
        if jnp.issubdtype(x.dtype, jnp.floating):
            x = jax.random.normal(jax.random.fold_in(key, i), x.shape, x.dtype)
        out.append(x)
    cache = jax.tree_util.tree_unflatten(treedef, out)
    index = tuple(_random_packed_index(jax.random.fold_in(key, len(leaves) + k), x) if x.dtype == jnp.uint8
                  else x for k, x in enumerate(cache.index))
    packed = cache.window.dtype == jnp.uint8
    main = tuple(_random_packed_kv(jax.random.fold_in(key, 2 * len(leaves) + k), x, window=False) if packed
                 else x for k, x in enumerate(cache.main))
    window = _random_packed_kv(jax.random.fold_in(key, 3 * len(leaves)), cache.window, True) if packed else cache.window
    return Cache(main=main, index=index, window=window, comp_kv=cache.comp_kv,
                 comp_score=cache.comp_score, cursor=cursor.astype(cache.cursor.dtype), sampled=cache.sampled)


@dataclass
class Case:
    name: str
    kind: str                  # "decode" | "prefill"
    batch: int                 # requests
    tokens: int                # token rows
    bucket: Bucket
    variant: str | None = None  # --compare-kernel: that kernel's backend; --compare-numerics: off | on;
                                # --compare-scan: unrolled | scanned; --compare-option: engine | VALUE;
                                # --compare-dense: bf16 | fp8
    device_batch: object = None
    host_build_ms: float = 0.0
    lowered: object = None
    lower_s: float = 0.0
    compiled: object = None
    compile_s: float | None = None
    error: str | None = None
    done: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None
    compile_t0: float = 0.0


class Results:
    def __init__(self, path: str, meta: dict):
        self.path, self.lock = path, threading.Lock()
        self.data = dict(meta, cases=[])

    def save(self) -> None:
        with self.lock:
            tmp = self.path + ".tmp"
            with open(tmp, "w") as f:
                json.dump(self.data, f, indent=1, default=str)
            os.replace(tmp, self.path)

    def record(self, row: dict) -> None:
        with self.lock:
            self.data["cases"].append(row)
        self.save()
        print(json.dumps({k: v for k, v in row.items() if k not in ("bytes", "memory")}, default=str), flush=True)


def _jaxlib_version():
    try:
        import jaxlib
        return jaxlib.__version__
    except Exception:  # noqa: BLE001
        return None


def base_options(args) -> dict:
    """The XLA compile options every case takes: the engine's, then each --option over them."""
    return {**compile_cache.compiler_options(), **dict(args.option)}


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def _option(text: str) -> tuple[str, object]:
    """KEY=VALUE -> (KEY, VALUE as bool, int or str, as XLA's option parser takes them)."""
    key, sep, value = text.partition("=")
    if not sep or not key.startswith("xla_"):
        raise argparse.ArgumentTypeError(f"{text!r}: expected an XLA option as KEY=VALUE, e.g. "
                                         "xla_gpu_command_buffer_scheduling_mode=LHS")
    lowered = value.lower()
    return key, (lowered == "true" if lowered in ("true", "false") else
                 int(value) if value.lstrip("-").isdigit() else value)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--out", required=True, help="results JSON (rewritten after every case)")
    ap.add_argument("--batches", type=_ints, default=[1, 8, 32], help="decode batches, comma separated")
    ap.add_argument("--context", type=int, default=8192, help="positions each decode query attends to")
    ap.add_argument("--prefill", type=_ints, default=[1024, 4096], help="prefill chunk sizes ('' = none)")
    ap.add_argument("--iters", type=int, default=20, help="timed calls per case (median reported)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed calls after the first one")
    ap.add_argument("--case-s", type=float, default=8.0, help="stop a case's timed loop after this long")
    ap.add_argument("--budget-s", type=float, default=100.0,
                    help="skip a case whose compile takes longer than this")
    ap.add_argument("--total-s", type=float, default=170.0,
                    help="watchdog: end the whole run this long after start (partial JSON stays)")
    ap.add_argument("--compile-workers", type=int, default=0, help="concurrent compiles (0 = one per case)")
    ap.add_argument("--page-tokens", type=int, default=256)
    ap.add_argument("--numerics", choices=sorted(NUMERICS), default="fast")
    ap.add_argument("--index-format", choices=INDEX_CHOICES, default=None,
                    help="index rows (default: typed, as the engine's, `geometry.row_formats`)")
    ap.add_argument("--kv-format", choices=KV_CHOICES, default=None,
                    help="main and window rows (default: typed; packed: FP4 main, FP8 window rows)")
    ap.add_argument("--kernels", choices=("auto", "xla", "pallas"), default="auto")
    ap.add_argument("--experts", choices=EXPERT_HOLDS, default="auto",
                    help="how the routed experts are held (load_params' experts=)")
    ap.add_argument("--dense", choices=DENSE_HOLDS, default="auto",
                    help="how the dense FP8 weights are held (load_params' dense=)")
    ap.add_argument("--copy-mib", type=int, default=0, help="copy-probe size (0: 4096 on GPU, 64 elsewhere)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--compare-scan", action="store_true",
                    help="every case unrolled and with the layer runs scanned; timed interleaved, outputs compared")
    ap.add_argument("--compare-dense", action="store_true",
                    help="every case with the dense FP8 weights held bf16 and held as published; timed interleaved")
    ap.add_argument("--layers", type=int, default=0, help="keep the config's first N layers (0 = all)")
    ap.add_argument("--routed-experts", type=int, default=0, help="routed experts per layer (0 = the config's)")
    ap.add_argument("--compare-kernel", choices=kernel_backend.KERNELS, default=None,
                    help="run every case with this kernel on xla and on pallas, then time each pair interleaved")
    ap.add_argument("--compare-numerics", choices=POLICY_SWITCHES, default=None,
                    help="run every case with this Numerics field off and on, then time each pair interleaved")
    ap.add_argument("--option", type=_option, action="append", default=[], metavar="KEY=VALUE",
                    help="XLA compile option over the engine's, for every case (repeatable)")
    ap.add_argument("--compare-option", type=_option, default=None, metavar="KEY=VALUE",
                    help="run every case with the engine's XLA options and with KEY set to VALUE; "
                         "timed interleaved, outputs compared")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="also trace N steps per case and record the device time by kernel")
    ap.add_argument("--host-events", type=int, default=0, metavar="N",
                    help="with --profile: also trace N steps per case and record the host's events by name")
    ap.add_argument("--dry-run", action="store_true", help="print the estimates and stop")
    return ap.parse_args(argv)


def _fmt(x, nd=3):
    return "–" if x is None else (f"{x:.{nd}f}" if isinstance(x, float) else str(x))


def markdown_table(data: dict) -> str:
    lines = ["| case | bucket T/R/O | lower s | compile s | first call s | step ms (median) | tokens/s | "
             "back to back ms | ideal ms | measured / ideal | note |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in data["cases"]:
        note = r.get("skipped") or r.get("error") or r.get("note") or ""
        if r.get("model_flops_of_in_run_gemm_peak") is not None:
            note = f"model {r['model_tflops']:.1f} TFLOP/s = {100 * r['model_flops_of_in_run_gemm_peak']:.1f} % of the GEMM probe; {note}"
        lines.append(f"| {r['name']} | {r.get('bucket', '')} | {_fmt(r.get('lower_s'), 1)} | "
                     f"{_fmt(r.get('compile_s'), 1)} | {_fmt(r.get('first_call_s'), 2)} | "
                     f"{_fmt(r.get('step_ms_median'), 3)} | {_fmt(r.get('tokens_per_s'), 1)} | "
                     f"{_fmt(r.get('back_to_back_ms'), 3)} | {_fmt(r.get('ideal_ms'), 3)} | "
                     f"{_fmt(r.get('measured_over_ideal'), 2)} | {note[:90]} |")
    return "\n".join(lines)


class Clock:
    def __init__(self):
        self.t0 = time.perf_counter()

    def __call__(self) -> float:
        return time.perf_counter() - self.t0

    def log(self, msg: str) -> None:
        print(f"[bench_step {self():6.1f}s] {msg}", flush=True)


def time_calls(fn, state: dict, iters: int, max_s: float, drop: bool = False) -> list[float]:
    """Seconds of up to `iters` calls (block_until_ready on logits and cache each), stopping once
    `max_s` has passed; `state` carries the donated cache from call to call. `drop`: the previous
    call's logits are freed before each call (untimed), so its outputs can land where they did."""
    ts, t_case = [], time.perf_counter()
    for _ in range(iters):
        if drop:
            state["logits"] = None
        t1 = time.perf_counter()
        state["logits"], state["cache"] = fn(state["cache"])
        jax.block_until_ready((state["logits"], state["cache"]))
        ts.append(time.perf_counter() - t1)
        if time.perf_counter() - t_case > max_s:
            break
    return ts


def main(argv=None) -> int:
    clock = Clock()
    args = parse_args(argv)
    cfg = ModelConfig.from_file(args.config)
    if sum(map(bool, (args.compare_scan, args.compare_kernel, args.compare_numerics, args.compare_option,
                      args.compare_dense))) > 1:
        raise SystemExit("--compare-scan, --compare-kernel, --compare-numerics, --compare-option, "
                         "--compare-dense: one comparison per run")
    if args.compare_kernel == "dense_fp8" and resolve_dense(args.dense) != "fp8":
        raise SystemExit("--compare-kernel dense_fp8: the kernel reads dense weights held as published; add --dense fp8")
    if args.compare_option and str(args.compare_option[1]) == "engine":
        raise SystemExit("--compare-option: 'engine' names the engine's own options; give another value")
    if args.layers:
        cfg = cut(cfg, args.layers)
    if args.routed_experts:
        cfg = cfg.replace(n_routed_experts=args.routed_experts,
                          dspark_n_routed_experts=min(cfg.moe_experts(cfg.n_layers)[0], args.routed_experts))
    numerics = NUMERICS[args.numerics]()
    if args.kernels != "auto":
        kernel_backend.set_backend(args.kernels)
    formats = row_formats(numerics, args.index_format, args.kv_format)
    batches, prefills = sorted(set(args.batches)), sorted(set(args.prefill))
    if not batches and not prefills:
        raise SystemExit("nothing to run: --batches and --prefill are both empty")
    page = args.page_tokens
    max_context = max([args.context] + prefills)
    max_context = -(-max_context // page) * page
    pages_decode = -(-args.context // page)
    pages_prefill = -(-max(prefills) // page) if prefills else 0
    settings = EngineSettings(page_tokens=page, num_pages=1 + max(batches, default=0) * pages_decode + pages_prefill,
                              slots=max(batches + [1]), max_context=max_context, **formats)
    geom = CacheGeometry.build(cfg, settings)
    specs = param_leaf_specs(cfg, args.experts, "fp8" if args.compare_dense else args.dense)
    # each variant's leaves (their bytes: the ideal's); the params themselves are the fp8 variant's
    specs_of = {"bf16": param_leaf_specs(cfg, args.experts, "bf16"), "fp8": specs} if args.compare_dense else {}

    # ---- estimates first ----------------------------------------------------------------------
    p_bytes = sum(s.nbytes for s in specs.values())
    mtp_bytes = sum(s.nbytes for p, s in specs.items() if p.startswith("mtp."))
    limit = device_memory_limit()
    copy_mib = args.copy_mib or (4096 if kernel_backend.on_gpu() else 64)
    est = {"params_bytes": p_bytes, "params_gib": round(p_bytes / GiB, 2), "params_mtp_bytes": mtp_bytes,
           "params_count": int(sum(np.prod(s.shape) for s in specs.values())),
           "engram_tables_host_bytes": engram_table_bytes(cfg), "cache_bytes": geom.total_bytes,
           "copy_probe_bytes": 2 * copy_mib << 20, "device_bytes_limit": limit}
    clock.log(f"{args.config}: params {est['params_count'] / 1e9:.2f} B elements = {p_bytes / GiB:.2f} GiB on "
              f"device ({mtp_bytes / GiB:.2f} GiB of it draft stages, unused by the step); Engram tables "
              f"{est['engram_tables_host_bytes'] / GiB:.2f} GiB on the host; cache {geom.total_bytes / GiB:.3f} GiB; "
              f"copy probe {2 * copy_mib / 1024:.2f} GiB (freed before the params); device limit "
              f"{'unknown' if limit is None else f'{limit / GiB:.1f} GiB'}")
    print(geom.summary(), flush=True)
    if limit is not None and p_bytes + geom.total_bytes > 0.92 * limit:
        raise SystemExit(f"params + cache ({(p_bytes + geom.total_bytes) / GiB:.1f} GiB) exceed 92% of the "
                         f"device's {limit / GiB:.1f} GiB")
    meta = {"config": args.config, "device": str(jax.devices()[0].device_kind), "platform": jax.default_backend(),
            "jax": jax.__version__, "jaxlib": _jaxlib_version(), "python": sys.version.split()[0],
            "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S"),
            "numerics": args.numerics, "kernels_backend": kernel_backend.resolve(), "experts_held": args.experts,
            "dense_held": resolve_dense(args.dense),
            "xla_flags": os.environ.get("XLA_FLAGS", ""), "compile_options": base_options(args),
            "args": vars(args), "estimates": est,
            "geometry": {"page_tokens": page, "num_pages": settings.num_pages, "slots": settings.slots,
                         "max_context": max_context, **formats,
                         "summary": geom.summary()},
            "synthetic": "weights random at the writer's scales; every PAGE/STATE row random N(0,1); Engram "
                         "cursors set to each decode request's position; tokens random",
            "decode_position": args.context - 1,
            "compile_note": "each bucket's compile runs in its own thread as soon as it is lowered; compile "
                            "seconds include contention with the other compiles and lowerings"}
    res = Results(args.out, meta)
    res.save()
    if args.dry_run:
        for b in batches:
            print(f"decode b={b}: bytes {decode_bytes(cfg, geom, specs, b, args.context)}")
        return 0

    # ---- watchdog: the JSON is current after every case; past --total-s the process ends ----------
    def abort():
        res.data["aborted"] = f"--total-s {args.total_s} reached at {clock():.1f} s"
        try:
            res.save()
            clock.log(f"watchdog: --total-s {args.total_s} reached; partial results in {args.out}")
            print(markdown_table(res.data), flush=True)
        finally:
            os._exit(3)
    watchdog = threading.Timer(max(0.0, args.total_s - clock()), abort)
    watchdog.daemon = True
    watchdog.start()

    # ---- ceilings, params, engine, cache -------------------------------------------------------
    res.data["copy"] = copy_bandwidth(copy_mib)
    ceiling_gbs = res.data["copy"]["ceiling_gbs"]
    clock.log(f"memory probe: copy {res.data['copy']['copy_gbs_read_plus_write']:.1f} GB/s read+write, "
              f"read {res.data['copy']['read_gbs']:.1f}, GEMV {res.data['copy']['gemv_gbs']:.1f} GB/s over {copy_mib} MiB")
    peak_tflops = None
    probe_n = 8192 if kernel_backend.on_gpu() else 256
    if prefills:     # the prefill's model FLOPs are read against the GEMM ceiling of the same run
        res.data["gemm_peak"] = gemm_peak(probe_n)
        peak_tflops = res.data["gemm_peak"]["bf16_gemm_tflops"]
        clock.log(f"GEMM probe: {peak_tflops:.1f} TFLOP/s")
    t0 = time.perf_counter()
    params = random_params(cfg, args.seed, specs)
    jax.block_until_ready(params)
    res.data["params_gen_s"] = round(time.perf_counter() - t0, 2)
    clock.log(f"params generated in {res.data['params_gen_s']} s")

    cases = [Case(f"decode b={b} ctx={args.context}", "decode", b, b, Bucket(b, b, b))
             for b in batches]
    cases += [Case(f"prefill {n} (b=1, pos 0)", "prefill", 1, n, Bucket(n, 1, 1))
              for n in prefills]
    compared, variants = (("scan", SCAN_VARIANTS) if args.compare_scan else
                          (args.compare_kernel, kernel_backend.CHOICES) if args.compare_kernel else
                          (args.compare_numerics, SWITCH_VARIANTS) if args.compare_numerics else
                          (args.compare_option[0], ("engine", str(args.compare_option[1]) or "''"))
                          if args.compare_option else ("dense", DENSE_VARIANTS) if args.compare_dense else (None, ()))
    if compared:
        cases = [Case(f"{c.name} [{compared}={v}]", c.kind, c.batch, c.tokens, c.bucket, v)
                 for c in cases for v in variants]
    token_map = np.asarray(engram_token_map(cfg)) if cfg.engram_layer_ids else None
    engine = Engine(params, cfg, settings=settings, buckets=BucketSet(tuple(c.bucket for c in cases)),
                    numerics=numerics, token_map=token_map)
    # the params each case runs with: the scanned variant's stacked per run (a second copy of those layers)
    by_variant = ({"scanned": stack_runs(params, cfg)} if args.compare_scan else
                  {"bf16": jax.tree.map(held, params, is_leaf=lambda x: isinstance(x, Fp8BlockWeight))}
                  if args.compare_dense else {})
    params_of = lambda c: by_variant.get(c.variant, params)

    # decode request i: slot i, its own pages, position context - 1; the prefill request: slot 0,
    # pages of its own, position 0. Cursor rows: each decode slot at its position.
    rng = np.random.default_rng(args.seed)
    decode_pages = [engine.pages.allocate(pages_decode) for _ in range(max(batches, default=0))]
    cursor = decode_cursors(rng, cfg, settings.slots, geom.history, args.context,
                            len(decode_pages))
    prefill_pages = engine.pages.allocate(pages_prefill) if prefills else []
    fill_key = jax.random.key(args.seed + 1, impl="rbg")
    engine.cache = randomize_cache(engine.cache, fill_key, jnp.asarray(cursor))
    cursors = engine.cursors()
    clock.log("cache filled")

    def tokens(n):
        return rng.integers(3, cfg.vocab_size - 1, n).astype(np.int32)

    inputs: dict[tuple, tuple] = {}     # the variants of a case share its input tokens (outputs compared)
    for c in cases:
        t0 = time.perf_counter()
        shape = (c.kind, c.batch, c.tokens)
        if shape not in inputs:
            n = 1 if c.kind == "decode" else c.tokens
            inputs[shape] = tuple(tokens(n) for _ in range(c.batch))
        if c.kind == "decode":
            spans = [engine.make_span(f"d{i}", i, args.context - 1, t, decode_pages[i], cursors[i])
                     for i, t in enumerate(inputs[shape])]
        else:
            spans = [engine.make_span("p0", 0, 0, inputs[shape][0], prefill_pages, cursors[0])]
        built = build_step(geom, cfg, c.bucket, spans)
        c.host_build_ms = (time.perf_counter() - t0) * 1e3
        c.device_batch = engine.runner.send(c.bucket, built.batch)      # packed, as the engine sends it

    # ---- lower each case (main thread), compile it in its own thread at once ----------------------
    sem = threading.Semaphore(args.compile_workers or len(cases))

    def compile_case(c: Case):
        with sem:
            t1 = time.perf_counter()
            try:
                options = base_options(args)                            # as the engine, with --option
                if args.compare_option and c.variant != "engine":
                    options = {**options, args.compare_option[0]: args.compare_option[1]}
                c.compiled = c.lowered.compile(compiler_options=options)
                c.compile_s = time.perf_counter() - t1
            except Exception as err:  # noqa: BLE001 - one failing case must not end the run
                c.error = f"compile: {type(err).__name__}: {str(err)[:400]}"
                traceback.print_exc()
            finally:
                c.done.set()

    # a step function per variant: jit caches a trace, and the backend is read while tracing
    step_fns = {v: engine.runner.make_step_fn() for v in kernel_backend.CHOICES} if args.compare_kernel else {}
    if args.compare_numerics:
        r = engine.runner
        step_fns = {v: make_step(r.cfg, r.geom, replace(r.numerics, **{args.compare_numerics: v == "on"}),
                                 r.record, r.speculative) for v in SWITCH_VARIANTS}
    for c in cases:
        t1 = time.perf_counter()
        try:
            with (kernel_backend.use_backend(c.variant, kernel=args.compare_kernel) if args.compare_kernel
                  else contextlib.nullcontext()):
                c.lowered = step_fns.get(c.variant, engine.step_fn).lower(
                    params_of(c), engine.cache, c.device_batch, layout=engine.runner.layout(c.bucket))
        except Exception as err:  # noqa: BLE001
            c.error = f"lower: {type(err).__name__}: {str(err)[:400]}"
            traceback.print_exc()
            c.done.set()
        c.lower_s = time.perf_counter() - t1
        clock.log(f"lowered {c.name} in {c.lower_s:.1f} s")
        if c.lowered is not None:
            c.thread = threading.Thread(target=compile_case, args=(c,), daemon=True, name=f"compile:{c.name}")
            c.compile_t0 = time.perf_counter()
            c.thread.start()

    # ---- measure in order, each as soon as its compile is done ------------------------------------
    state = {"cache": engine.cache, "logits": None}
    engine.cache = None                       # the timed calls own (and donate) the cache from here

    def back_to_back_ms(fn, iters: int) -> float:
        """ms per step of `fn` queued back to back on the timed cache, its outputs kept."""
        return 1e3 * back_to_back_s(lambda: state.update(zip(("logits", "cache"), fn(state["cache"]))),
                                    lambda: (state["logits"], state["cache"]), iters)

    def outputs_dropped(fn) -> dict:
        """The waited and back-to-back timings again with each call's logits dropped before the next
        call: its outputs then land where the previous call's did, so XLA need not update the
        command buffer (BENCHMARKS.md i1)."""
        waited = time_calls(fn, state, args.iters, args.case_s, drop=True)
        return {"step_ms_outputs_dropped_median": float(np.median(waited)) * 1e3,
                "back_to_back_outputs_dropped_ms": 1e3 * back_to_back_s(
                    lambda: state.update(cache=fn(state["cache"])[1]), lambda: state["cache"], args.iters)}

    def refill():
        if any(x.is_deleted() for x in jax.tree_util.tree_leaves(state["cache"])):
            state["cache"] = randomize_cache(allocate(geom), fill_key, jnp.asarray(cursor))

    def busy() -> int:
        return sum(1 for c in cases if c.thread is not None and c.thread.is_alive())

    rows = {}
    for c in cases:
        row = {"name": c.name, "kind": c.kind, "batch": c.batch, "tokens": c.tokens,
               "bucket": f"{c.bucket.tokens}/{c.bucket.requests}/{c.bucket.logits}",
               "lower_s": round(c.lower_s, 2), "host_build_ms": round(c.host_build_ms, 2)}
        if c.variant:
            row["variant"] = {compared: c.variant}
        if c.kind == "decode":
            nbytes = decode_bytes(cfg, geom, specs_of.get(c.variant, specs), c.batch, args.context)
            row["bytes"] = nbytes
            row["ideal_ms"] = ideal_ms(nbytes, ceiling_gbs)
            sheet = next((g for part, g in DATASHEET_GBS if part in meta["device"]), None)
            if sheet:
                row["ideal_ms_at_datasheet"] = ideal_ms(nbytes, sheet)
                row["datasheet_gbs"] = sheet
        left = args.budget_s - (time.perf_counter() - c.compile_t0) if c.thread is not None else 0.0
        if not c.done.wait(timeout=max(0.0, left)):
            row["skipped"] = f"compile not done within --budget-s {args.budget_s} s"
            res.record(row)
            continue
        row["compile_s"] = None if c.compile_s is None else round(c.compile_s, 2)
        if c.compiled is None:
            row["error"] = c.error
            res.record(row)
            continue
        clock.log(f"compiled {c.name} in {c.compile_s:.1f} s")
        row["memory"] = mem = memory_analysis(c.compiled)
        need = sum(mem.get(k, 0) for k in ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes"))
        need -= mem.get("alias_size_in_bytes", 0)
        if limit is not None and mem and need > limit:
            row["skipped"] = (f"does not fit: needs {need / GiB:.2f} GiB (temp "
                              f"{mem.get('temp_size_in_bytes', 0) / GiB:.2f}) > device {limit / GiB:.2f} GiB")
            res.record(row)
            continue

        def fn(cache, c=c):
            out = c.compiled(params_of(c), cache, c.device_batch)
            return out.logits, out.cache

        try:
            row["compiles_running"] = busy()
            t1 = time.perf_counter()
            state["logits"], state["cache"] = fn(state["cache"])
            jax.block_until_ready((state["logits"], state["cache"]))
            row["first_call_s"] = time.perf_counter() - t1
            for _ in range(args.warmup):
                state["logits"], state["cache"] = fn(state["cache"])
            jax.block_until_ready((state["logits"], state["cache"]))
            ts = time_calls(fn, state, args.iters, args.case_s)
            row["back_to_back_ms"] = back_to_back_ms(fn, args.iters)
            row.update(outputs_dropped(fn))
            if not np.isfinite(np.asarray(state["logits"], np.float32)).all():
                row["warning"] = "non-finite logits"
        except Exception as err:  # noqa: BLE001
            row["error"] = f"run: {type(err).__name__}: {str(err)[:400]}"
            traceback.print_exc()
            refill()
            res.record(row)
            continue
        if peak_tflops and c.kind == "prefill":
            # the probe again right after the case: the clocks drift within a run (an H100's
            # probe read 687 and 791 TFLOP/s in one run), and the highest the device showed is
            # the run's ceiling (`run_peak` below)
            row["gemm_probe_after_tflops"] = gemm_peak(probe_n)["bf16_gemm_tflops"]
        _timing(row, ts, c, cfg, specs, peak_tflops)
        rows[c.name] = (row, fn)
        res.record(row)

    # ---- re-time what ran while other compiles were still going (XLA autotuning uses the GPU) ----
    for name, (row, fn) in rows.items():
        if not row.get("compiles_running") or args.total_s - clock() < args.case_s + 10:
            continue
        try:
            ts = time_calls(fn, state, args.iters, args.case_s)
            back_to_back = back_to_back_ms(fn, args.iters)
            dropped = outputs_dropped(fn)
        except Exception as err:  # noqa: BLE001
            row["retime_error"] = f"{type(err).__name__}: {str(err)[:200]}"
            refill()
            continue
        row["during_compiles"] = {k: row[k] for k in ("iters", "step_ms_median", "step_ms_min", "back_to_back_ms",
                                                      *dropped, "compiles_running")}
        row.update(back_to_back_ms=back_to_back, **dropped)
        _timing(row, ts, next(c for c in cases if c.name == name), cfg, specs, peak_tflops)
        row["compiles_running"] = busy()
        res.save()
        clock.log(f"re-timed {name}: {row['step_ms_median']:.3f} ms (was {row['during_compiles']['step_ms_median']:.3f} "
                  f"with {row['during_compiles']['compiles_running']} compiles running)")

    # ---- every prefill's share against the highest GEMM probe of the run (the conservative ceiling:
    # a higher one can only lower the share) ----
    if peak_tflops:
        run_peak = max([peak_tflops] + [r.get("gemm_probe_after_tflops", 0) for r, _ in rows.values()])
        res.data["gemm_peak"]["run_max_tflops"] = run_peak
        for row, _ in rows.values():
            if "model_tflops" in row:
                row["model_flops_of_in_run_gemm_peak"] = row["model_tflops"] / run_peak
        res.save()

    # ---- --compare-*: each pair timed again, interleaved (the machine drifts between cases) ----
    pairs: dict[str, dict] = {}
    checked = args.compare_scan or args.compare_option or args.compare_dense     # outputs compared too
    for c in cases:
        if c.variant and c.name in rows:
            pairs.setdefault(c.name.rsplit(" [", 1)[0], {})[c.variant] = rows[c.name][1]
    for base, fns in pairs.items():
        if len(fns) < 2 or args.total_s - clock() < 2 * args.case_s + 10:
            continue
        ts = {v: [] for v in fns}
        b2b = {v: [] for v in fns}            # back to back (the decode target's measure), per round
        first, second = variants
        try:
            if checked:   # each twice from a copy of one cache (the controls: each against itself)
                start = jax.tree.map(jnp.copy, state["cache"])
                run = lambda v: fns[v](jax.tree.map(jnp.copy, start))
                ref_out, equal = run(first), {}      # at most the start, it and one more output held
                equal["control"] = differing(ref_out, run(first))
                other = run(second)
                equal["control_second"] = differing(other, run(second))
                equal["variants"] = differing(ref_out, other)
                del start, ref_out, other
            for _ in range(5):
                for v, fn in fns.items():
                    ts[v] += time_calls(fn, state, max(1, args.iters // 5), args.case_s / 5)
                    b2b[v].append(back_to_back_ms(fn, max(1, args.iters // 5)))
        except Exception as err:  # noqa: BLE001
            res.data.setdefault("comparisons", {})[base] = {"error": f"{type(err).__name__}: {str(err)[:200]}"}
            refill()
            continue
        comp = {v: dict(zip(("min_ms", "p25_ms", "median_ms", "p75_ms", "max_ms"),
                            (round(float(q), 4) for q in np.percentile(np.asarray(t) * 1e3, [0, 25, 50, 75, 100]))),
                        calls=len(t), back_to_back_ms=[round(x, 4) for x in b2b[v]]) for v, t in ts.items()}
        comp[f"{second}_minus_{first}_ms"] = round(comp[second]["median_ms"] - comp[first]["median_ms"], 4)
        comp[f"{second}_minus_{first}_back_to_back_ms"] = round(
            float(np.median(b2b[second]) - np.median(b2b[first])), 4)
        if checked:
            comp["differing_outputs"] = equal
        res.data.setdefault("comparisons", {})[base] = dict(compared=compared, **comp)
        res.save()
        clock.log(f"{base}, {compared} interleaved: {first} {comp[first]['median_ms']:.3f} ms, {second} "
                  f"{comp[second]['median_ms']:.3f} ms ({comp[f'{second}_minus_{first}_ms']:+.3f})"
                  + (f"; outputs differing {equal}" if checked else ""))

    # ---- where the device time goes (after every compile: autotuning would show up) ----
    for name, (row, fn) in rows.items() if args.profile else ():
        if args.total_s - clock() < args.case_s + 10:
            break

        def run(fn=fn, drop=False):
            if drop:
                state["logits"] = None
            state["logits"], state["cache"] = fn(state["cache"])
            jax.block_until_ready((state["logits"], state["cache"]))

        try:      # the kernels' sources are extra: a module text it cannot read costs them only
            sources = kernel_sources(next(c for c in cases if c.name == name).compiled.as_text())
        except Exception as err:  # noqa: BLE001
            sources, row["sources_error"] = None, f"{type(err).__name__}: {str(err)[:200]}"
        try:
            row["profile"] = prof = kernel_profile(run, args.profile, top=30, sources=sources)
            if args.host_events:
                row["host_events"] = host_events(run, args.host_events)
                row["host_events_outputs_dropped"] = host_events(lambda: run(drop=True), args.host_events)
                # the device's timeline with the previous logits freed before each call too
                dropped = kernel_profile(lambda: run(drop=True), args.profile, top=0)
                row["profile_outputs_dropped"] = {k: dropped.get(k) for k in ("device_ms_per_call", "timeline")}
        except Exception as err:  # noqa: BLE001
            row["profile_error"] = f"{type(err).__name__}: {str(err)[:200]}"
            refill()
            continue
        res.save()
        clock.log(f"profile {name}: {prof.get('device_ms_per_call')} ms of kernels per step in "
                  f"{prof.get('launches_per_call')} launches; "
                  + ", ".join(f"{k['name']} {k['ms_per_call']:.3f}" for k in prof.get("kernels", [])[:8])
                  + (f"; device span {tl['span_ms']} ms, idle {tl['idle_ms']} ms" if "span_ms" in (tl := prof.get("timeline", {})) else ""))

    ceiling_gbs = _ideal_at_ceiling(res.data, copy_mib, ceiling_gbs)
    res.data["wall_s"] = round(clock(), 1)
    res.data["table_md"] = markdown_table(res.data)
    res.save()
    watchdog.cancel()
    print(f"\n{meta['device']} ({meta['platform']}), jax {meta['jax']}, {args.numerics} numerics, kernels "
          f"{meta['kernels_backend']}; memory ceiling {ceiling_gbs:.0f} GB/s; decode rows at "
          f"position {args.context - 1}; synthetic weights and cache; wall {res.data['wall_s']} s\n", flush=True)
    print(res.data["table_md"], flush=True)
    return 0


def _ideal_at_ceiling(data: dict, copy_mib: int, start_gbs: float) -> float:
    """The memory probe again after the cases (a probe taken once read up to 13 % below another
    machine's and below what the step itself achieved, BENCHMARKS.md k): the decode rows' ideal
    and ratio at the larger of the two ceilings, which is returned. Only when there are decode rows
    (the probe holds 8 GiB beside the run's arrays; a failed probe keeps the first figure)."""
    rows = [r for r in data.get("cases", []) if "ideal_ms" in r]
    if not rows:
        return start_gbs
    try:
        data["copy_end"] = copy_bandwidth(copy_mib)
    except Exception as err:  # noqa: BLE001 - e.g. out of memory beside a large cache
        data["copy_end"] = {"error": f"{type(err).__name__}: {str(err)[:200]}"}
        return start_gbs
    gbs = max(start_gbs, data["copy_end"]["ceiling_gbs"])
    for r in rows:
        r["ideal_ms"] = ideal_ms(r["bytes"], gbs)
        if "step_ms_median" in r:
            r["measured_over_ideal"] = r["step_ms_median"] / r["ideal_ms"]
    return gbs


def ideal_ms(nbytes: dict, gbs: float) -> float:
    """A decode step's ideal: its bytes (`decode_bytes`) at `gbs` GB/s."""
    return nbytes["total"] / (gbs * 1e9) * 1e3


def differing(a, b) -> dict[str, dict]:
    """The leaves of two pytrees (same structure) that differ -> by path, how many elements differ
    and, for floating leaves, the largest |a - b| among those finite in both, the largest |a| there
    (a rounding difference reads a few ulps of it; a race or a wrong kernel, far more) and how many
    differ where either side is NaN or infinite; NaN equals NaN whatever its payload (the random
    cache holds NaN bit patterns)."""
    out = {}
    for (p, x), y in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b)):
        x, y = np.asarray(x), np.asarray(y)
        floating = jnp.issubdtype(x.dtype, jnp.inexact)       # ml_dtypes' floats too (not numpy's view)
        same = (x == y) | ((x != x) & (y != y)) if floating else x == y
        if same.all():
            continue
        row = {"elements": int((~same).sum())}
        if floating:
            wide = np.complex128 if jnp.issubdtype(x.dtype, jnp.complexfloating) else np.float64
            xf, yf = x.astype(wide), y.astype(wide)
            finite = np.isfinite(xf) & np.isfinite(yf)
            row["max_abs_diff"] = float(np.abs(xf - yf)[~same & finite].max(initial=0.0))
            row["max_abs"] = float(np.abs(xf)[~same & finite].max(initial=0.0))
            row["nonfinite"] = int((~same & ~finite).sum())
        out[jax.tree_util.keystr(p)] = row
    return out


def _timing(row: dict, ts: list[float], c: Case, cfg: ModelConfig, specs: dict,
            gemm_peak_tflops: float | None = None) -> None:
    med = float(np.median(ts))
    row.update(iters=len(ts), step_ms_median=med * 1e3, step_ms_min=float(np.min(ts)) * 1e3,
               step_ms_mean=float(np.mean(ts)) * 1e3, tokens_per_s=c.tokens / med)
    if "first_call_s" in row:
        row["first_call_minus_steady_s"] = row["first_call_s"] - med
    if c.kind == "decode":
        row["measured_over_ideal"] = med * 1e3 / row["ideal_ms"]
        row["achieved_gbs_of_ideal_bytes"] = row["bytes"]["total"] / med / 1e9
    else:
        weights = prefill_weight_flops(cfg, specs, c.tokens)
        row["weight_gemm_tflops"] = weights / med / 1e12
        # model FLOPs over the back-to-back time (the engine's loop; the synchronous median adds
        # the host's call), weights and attention both
        over = "back_to_back_ms" if row.get("back_to_back_ms") else "step_ms_median"
        row["model_tflops"] = (weights + prefill_attention_flops(cfg, c.tokens)) / (row[over] / 1e3) / 1e12
        row["model_tflops_over"] = over
        if gemm_peak_tflops:
            row["model_flops_of_in_run_gemm_peak"] = row["model_tflops"] / gemm_peak_tflops


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    # a compile thread past --budget-s may still be running: do not wait for it at exit
    if any(t.name.startswith("compile:") and t.is_alive() for t in threading.enumerate()):
        os._exit(code)
    sys.exit(code)
