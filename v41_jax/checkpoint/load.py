"""Published checkpoint -> params pytree (DESIGN.md, "Checkpoint -> params").

`load_params(ckpt_dir, cfg=None, experts="auto", dense="auto") -> (cfg, params)`:

  * config from `ckpt_dir/config.json` (ModelConfig.from_file) unless given, then `validate(cfg)`;
  * every tensor checked against `checkpoint_schema(cfg)` before any data is read;
  * params are nested dicts mirroring the checkpoint names, `layers` and `mtp` Python lists:
      params["embed"]["weight"]                          bf16 [V, D]
      params["head"]["weight"]                           bf16 [V, D]
      params["layers"][i]["attn"]["wq_a"]["weight"]      bf16 [Q, D] or `quant.Fp8BlockWeight` (`dense=`)
      params["layers"][i]["hc_attn_fn"]                  f32  [24, 4D]
      params["layers"][i]["ffn"]["gate"]["bias"]         f32  [E]
      params["layers"][i]["ffn"]["experts"]              {"w1": [E, F, D], "w3": [E, F, D], "w2": [E, D, F]}
                                                         as `quant.Fp8RowWeight`s, `Fp4Weight`s or bf16
      params["mtp"][m]["markov_head"]["head"]["weight"]  bf16 [V, R]
    A quantized weight's `.scale` is consumed by its dequantization and has no leaf. Routed experts
    are stacked along a new leading axis (`.weight` dropped), as DESIGN.md specifies.
  * routed experts (`experts=`), each format holding the same exact values, so all give identical
    outputs (the MoE kernels decode in registers, the reference loop per pick):
      "auto"  (default) "fp8" on a GPU, where the MoE kernels decode it; "bf16" on CPU, where
              the XLA loop would decode every pick again (22% slower tests, no memory to save);
      "fp8"   re-coded exactly to E4M3 + one power of two per row, an `Fp8RowWeight`
              (1 byte a weight, one fp8 conversion to decode: the fastest decode measured); a
              tensor with a row whose values span too many binades stays "fp4", with a warning;
      "fp4"   as published, E2M1 codes + E8M0 scales stacked in an `Fp4Weight` (0.53 bytes a
              weight; slower to decode in a Triton kernel);
      "bf16"  dequantized (2 bytes a weight: the fastest prefill measured; the released
              model's experts do not fit one 8-GPU node this way).
  * dense FP8 weights (`dense=`): "fp8" held as published, E4M3 codes + one E8M0 per 32 x 32
    block in a `quant.Fp8BlockWeight` (1 byte a weight; `linear.lin8` runs the
    `kernels_pallas.dense_fp8` kernel on them at decode row counts); "bf16" dequantized at load;
    "auto": "bf16" until the kernel is measured (`resolve_dense`). The same values either way.
  * dtypes: every dequantized weight and every BF16 tensor is bf16 (exact: e4m3 / e2m1 times a
    power of two fits in bf16), the BF16 tensors the reference holds in fp32 (`head`,
    `markov_head.head`, ratio > 1 `compressor.wkv/wgate`, `confidence_head.proj`) included: their
    fp32 GEMMs (`linear.lin_f32`) see the same values from half the bytes. The F32 tensors
    (`hc_*`, `attn_sink`, `gate.bias[_vl]`) stay fp32. `TensorSpec.held` owns this.
  * Engram tables (`layers.L.engram.embed.weight/scale`) are NOT device arrays: they stay on the host
    as read-only memmaps (FP8 E4M3 rows, one E8M0 per 32 lanes) in `params["engram_tables"]`, an
    `EngramTables` registered as a static pytree node. It has no leaves, so `jax.jit`,
    `jax.tree.map` and `device_put` over params pass it through untouched (it compares and hashes
    by the file bytes it maps, so two loads of one checkpoint have equal treedefs); the model gathers
    rows on the host with `EngramTables.gather` and dequantizes them with `quant.dequant_fp8_rows`.
"""

from __future__ import annotations

import math
import os
import re
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, NoReturn

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from tqdm.auto import tqdm

from .. import quant
from ..config import CONFIG_NAME, ModelConfig, read_json, validate
from .safetensors_io import Checkpoint, CheckpointError, inside
from .schema import TensorSpec, validate_checkpoint

_EXPERT = re.compile(r"(.+\.experts)\.(\d+)\.(w[123])\.weight")
HELD_DTYPES = {"bf16": jnp.bfloat16, "f32": jnp.float32}   # a params leaf's dtype by TensorSpec.held
EXPERT_HOLDS = ("auto", "fp8", "fp4", "bf16")
DENSE_HOLDS = ("auto", "fp8", "bf16")


def held_bytes(held: str, shape) -> int:
    """Device bytes of a leaf of logical shape [..., out, in] held as `held` (`held_as`)."""
    n = int(np.prod(shape))
    if held == "fp4":
        return n // 2 + n // 32                                       # codes + E8M0 per 32
    if held == "fp8":
        return n + 4 * (n // shape[-1])                               # codes + fp32 per row
    if held == "fp8_blocks":                                          # codes + E8M0 per 32 x 32
        return n + int(np.prod(quant.fp8_block_scale_shape(shape)))
    return n * jnp.dtype(HELD_DTYPES[held]).itemsize
ENGRAM_KEY = "engram_tables"
ENGRAM_DEVICE_KEY = "engram_device"   # the Runner's device copy of the tables (decode rows hashed on device)


@jax.tree_util.register_static
@dataclass(frozen=True, repr=False)
class EngramTables:
    """Host-resident Engram tables per Engram layer id: FP8 E4M3 [rows, head_dim] and E8M0
    [rows, head_dim/32], zero-copy views of the checkpoint's memmap. Equal (and hashing equal,
    as jit's cache needs) when they map the same bytes of the same files."""
    weight: Mapping[int, np.ndarray] = field(compare=False)
    scale: Mapping[int, np.ndarray] = field(compare=False)
    source: tuple[tuple[str, str, int], ...]   # (tensor name, file, byte offset) of every table

    @classmethod
    def from_checkpoint(cls, ckpt: Checkpoint, cfg: ModelConfig) -> "EngramTables":
        names = {l: (f"layers.{l}.engram.embed.weight", f"layers.{l}.engram.embed.scale")
                 for l in cfg.engram_layer_ids if l < cfg.n_layers}
        infos = [ckpt.info(n) for pair in names.values() for n in pair]
        return cls({l: ckpt.get(w) for l, (w, _) in names.items()},
                   {l: ckpt.get(s) for l, (_, s) in names.items()},
                   tuple((t.name, os.path.abspath(t.path), t.begin) for t in infos))

    def __repr__(self) -> str:
        shapes = {l: (tuple(w.shape), str(w.dtype)) for l, w in self.weight.items()}
        return f"EngramTables({shapes})"

    def gather(self, layer_id: int, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Rows for hash ids [...] -> (E4M3 [..., head_dim], E8M0 [..., head_dim/32]) as numpy;
        dequantize on device with `quant.dequant_fp8_rows`."""
        ids = np.asarray(ids)
        return self.weight[layer_id][ids], self.scale[layer_id][ids]


@dataclass(frozen=True)
class Unit:
    """One params leaf and the stored weights it is built from."""
    names: tuple[str, ...]    # `.weight` (or plain) names; E of them, in expert order, when stacked
    stacked: bool             # routed experts: stacked on a new leading axis


def param_units(schema: Mapping[str, TensorSpec]) -> dict[str, Unit]:
    """Dotted params path -> Unit. Scales and Engram tables build no leaf."""
    units: dict[str, list[tuple[int, str]]] = {}
    stacked: set[str] = set()
    for name, spec in schema.items():
        if spec.held not in HELD_DTYPES:
            continue
        m = _EXPERT.fullmatch(name)
        if m:
            key, order = f"{m[1]}.{m[3]}", int(m[2])
            stacked.add(key)
        else:
            key, order = name, 0
        units.setdefault(key, []).append((order, name))
    return {k: Unit(tuple(n for _, n in sorted(v)), k in stacked) for k, v in units.items()}


def held_as(spec: TensorSpec, unit: Unit, experts: str, dense: str = "auto") -> str:
    """A leaf's held format: `resolve_experts(experts)` ("fp8" | "fp4" | "bf16") for the FP4 routed
    experts, "fp8_blocks" for a dense FP8 weight held as published (`resolve_dense(dense)`), else
    the schema's `spec.held` ("bf16" | "f32")."""
    if unit.stacked and spec.dtype == "I8":
        return resolve_experts(experts)
    if spec.dtype == "F8_E4M3" and resolve_dense(dense) == "fp8":
        return "fp8_blocks"
    return spec.held


def resolve_experts(experts: str = "auto") -> str:
    """One of EXPERT_HOLDS -> the format the experts are held in ("auto": by the default backend)."""
    if experts not in EXPERT_HOLDS:
        raise ValueError(f"experts: {experts!r} is not one of {EXPERT_HOLDS}")
    if experts == "auto":
        return "bf16" if jax.default_backend() == "cpu" else "fp8"
    return experts


def resolve_dense(dense: str = "auto") -> str:
    """One of DENSE_HOLDS -> how the dense FP8 weights are held: "fp8" as published (E4M3 codes +
    E8M0 per 32 x 32 block, `quant.Fp8BlockWeight`: `kernels_pallas.dense_fp8` reads the codes at
    decode row counts, XLA's GEMM takes them decoded otherwise) or "bf16" decoded at load.
    "auto": "bf16" on every backend until the kernel's step time is measured on a device
    (BENCHMARKS.md, "dense FP8 weights held as published": XLA's own decode of the codes was
    slower; the kernel's prediction stands unmeasured); on CPU XLA would decode every step."""
    if dense not in DENSE_HOLDS:
        raise ValueError(f"dense: {dense!r} is not one of {DENSE_HOLDS}")
    return "bf16" if dense == "auto" else dense


def recode_fp8(fp4: quant.Fp4Weight, what: str):
    """FP4 experts re-coded to FP8 rows, or kept as published (with a warning naming them) when a
    row does not fit one E4M3 scale: the kernels take either per tensor, with the same values."""
    try:
        return quant.Fp8RowWeight.from_fp4(fp4, what)
    except ValueError as err:
        warnings.warn(f"{err}; kept as fp4", stacklevel=2)
        return fp4


def _max_scale_code(largest: float) -> int:
    """The largest E8M0 code c with largest * 2^(c - 127) finite in bf16 (the dequantized dtype)."""
    return 127 + math.floor(math.log2(float(ml_dtypes.finfo(ml_dtypes.bfloat16).max) / largest))


# Per quantized weight dtype, the largest E8M0 scale code a published checkpoint can hold: above it
# the format's largest value (E4M3 448, E2M1 6) times the scale overflows bf16 (246 and 252; a real
# checkpoint's scales sit near 2^0, code 127). 255 is E8M0's NaN.
MAX_SCALE_CODE = {"F8_E4M3": _max_scale_code(float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)),
                  "I8": _max_scale_code(float(quant.E2M1_TABLE.max()))}


def _refuse_scales(ckpt: Checkpoint, names: list[str], top: int) -> NoReturn:
    """Name the first scale tensor holding a code above `top` (found again tensor by tensor)."""
    codes_of = lambda n: np.asarray(ckpt.get(n)).view(np.uint8)
    bad = next(n for n in names if (codes_of(n) > top).any())
    codes = codes_of(bad)
    if (codes == 255).any():
        rule = f"{int((codes == 255).sum())} E8M0 scale bytes are 255, the NaN code (a corrupt scale)"
    else:
        rule = (f"{int((codes > top).sum())} E8M0 scale bytes are above {top}: with them the format's "
                "largest value overflows bf16 (a corrupt scale)")
    raise CheckpointError(ckpt.info(bad).path, bad, rule)


def _convert(ckpt: Checkpoint, unit: Unit, spec: TensorSpec, experts: str, dense: str = "bf16"):
    """Read (and stack) the stored tensors of one unit; keep FP4 experts packed or dequantize and
    cast to `spec.held`. Returns once the conversion has run, so the host buffers it read into (the
    stacked experts) are freed before the caller reads the next unit: under async dispatch a
    conversion still queued keeps its input alive, and two or more reads would be held at once."""
    return jax.block_until_ready(_convert_async(ckpt, unit, spec, experts, dense))


def _convert_async(ckpt: Checkpoint, unit: Unit, spec: TensorSpec, experts: str, dense: str):
    def read(names) -> np.ndarray:
        return np.stack([ckpt.get(n) for n in names]) if unit.stacked else ckpt.get(names[0])

    def read_scales() -> np.ndarray:
        """The units' E8M0 scales as uint8, checked against MAX_SCALE_CODE."""
        names = [n.removesuffix(".weight") + ".scale" for n in unit.names]
        codes = read(names).view(np.uint8)
        # on the host, where the bytes are: a device check would be one more XLA program per shape
        if (codes > MAX_SCALE_CODE[spec.dtype]).any():
            _refuse_scales(ckpt, names, MAX_SCALE_CODE[spec.dtype])
        return quant.as_u8(codes)

    # a jax array before any jitted call: a numpy argument of a jitted call outlives it until the
    # garbage collector runs (measured: the stacked read stays held into the next unit's read)
    w = jnp.asarray(read(unit.names))
    held = held_as(spec, unit, experts, dense)
    if held == "fp8_blocks":
        return quant.Fp8BlockWeight(quant.as_u8(w), read_scales())
    if held in ("fp4", "fp8"):
        fp4 = quant.Fp4Weight(quant.as_u8(w), read_scales())
        return fp4 if held == "fp4" else recode_fp8(fp4, _EXPERT.sub(r"\1.*.\3", unit.names[0]))
    if spec.dtype == "F8_E4M3":
        out = quant.dequant_fp8_blocks(w, read_scales())
    elif spec.dtype == "I8":
        out = quant.dequant_fp4_rows(w, read_scales())
    else:
        out = w
    return out.astype(HELD_DTYPES[held])


def _convert_sharded(ckpt: Checkpoint, unit: Unit, spec: TensorSpec, experts: str, sharding):
    """A stack of routed experts straight into `sharding` (split along the expert axis): each
    distinct block of experts is read from the memory-mapped files and converted alone, then put
    on the devices that hold it, so the host never holds more than one block of the stack."""
    n = len(unit.names)
    shape = (n, *spec.shape[:-1], spec.shape[-1] * (2 if spec.dtype == "I8" else 1))
    blocks: dict[tuple[int, int], list] = {}
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        first, stop, _ = index[0].indices(n)
        blocks.setdefault((first, stop), []).append(device)
    shards = []
    for (first, stop), devices in blocks.items():
        held = _convert(ckpt, Unit(unit.names[first:stop], True), spec, experts)
        shards += [(d, jax.device_put(held, d)) for d in devices]
    order = {d: i for i, d in enumerate(sharding.addressable_devices)}
    shards.sort(key=lambda x: order[x[0]])
    leaves = [jax.tree.leaves(h) for _, h in shards]
    whole = [jax.make_array_from_single_device_arrays((n, *parts[0].shape[1:]), sharding, list(parts))
             for parts in zip(*leaves)]
    return jax.tree.unflatten(jax.tree.structure(shards[0][1]), whole)


def nest(flat: Mapping[str, Any]) -> dict:
    """Dotted names -> nested dicts; a dict whose keys are all integers becomes a list."""
    tree: dict = {}
    for name, value in flat.items():
        node = tree
        *parents, leaf = name.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value

    def listify(node):
        if not isinstance(node, dict):
            return node
        node = {k: listify(v) for k, v in node.items()}
        if node and all(k.isdigit() for k in node):
            return [node[str(i)] for i in range(len(node))]
        return node

    return listify(tree)


@jax.jit
def _all_finite(leaves: list[jax.Array]) -> jax.Array:
    """[len(leaves)] bool: whether each leaf holds only finite values; a uint8 leaf is the E4M3
    codes of a dense weight held as published (NaN: 0x7F / 0xFF), read as such in place."""
    return jnp.stack([jnp.isfinite(jax.lax.bitcast_convert_type(x, jnp.float8_e4m3fn) if x.dtype == jnp.uint8
                                   else x).all() for x in leaves])


def _check_finite(ckpt: Checkpoint, units: Mapping[str, Unit], schema: Mapping[str, TensorSpec],
                  flat: Mapping[str, Any]) -> None:
    """Refuse a device leaf holding NaN or Inf, naming the stored tensor it came from.

    A published checkpoint never holds one: not in a BF16 or F32 tensor, not as an E4M3 NaN code
    (0x7F / 0xFF). The check runs on the device over the leaves the load has just made (one
    program per placement, then one wait), so it costs no second pass over the files. Routed
    experts held as FP4 / FP8 codes need none: every E2M1 code is finite, and their scales were
    checked against MAX_SCALE_CODE when read."""
    # a dense FP8 weight held as published is checked as its codes (`_all_finite`)
    leaves = {path: leaf.codes if isinstance(leaf, quant.Fp8BlockWeight) else leaf
              for path, leaf in flat.items() if isinstance(leaf, (jax.Array, quant.Fp8BlockWeight))}
    if not leaves:
        return
    # one program per placement (the leaves on one device, the experts split over a mesh): a
    # reduction per leaf launched alone would be one XLA compile per shape
    groups: dict[Any, list[str]] = {}
    for path, leaf in leaves.items():
        groups.setdefault(leaf.sharding, []).append(path)
    launched = [(paths, _all_finite([leaves[p] for p in paths])) for paths in groups.values()]
    flags = {p: ok for paths, out in launched for p, ok in zip(paths, np.asarray(out))}
    if all(flags.values()):
        return
    unit = units[next(p for p in leaves if not flags[p])]            # the first in checkpoint order
    spec = schema[unit.names[0]]
    # the one bad unit: convert its tensors one by one to name the first that is not finite
    bad = next((n for n in unit.names
                if not jnp.isfinite(_convert(ckpt, Unit((n,), False), spec, "bf16")).all()), unit.names[0])
    rule = ("holds NaN or infinite values" if spec.dtype in ("BF16", "F32") else
            "dequantizes to NaN or infinite values (an E4M3 NaN code)")
    raise CheckpointError(ckpt.info(bad).path, bad, f"{rule}; a published checkpoint never does")


ENGRAM_VERIFY_ROWS = 1 << 18   # rows a verify step reads at once (64 MiB of released table)
# Engram table -> (the bits that make a NaN, their NaN pattern, its name): E4M3 S.1111.111, E8M0 255
_ENGRAM_NAN = {"weight": (0x7F, 0x7F, "E4M3 NaN code 0x7F/0xFF"), "scale": (0xFF, 0xFF, "E8M0 NaN code 255")}


def verify_engram(tables: EngramTables) -> None:
    """Refuse an Engram table holding an E4M3 NaN code or an E8M0 NaN scale, naming the tensor.
    The tables stay on the host, unread at load (200 GB in the released model), so this is a
    separate full pass over them: `load_params(..., verify=True)`."""
    files = {name: file for name, file, _ in tables.source}
    for layer in tables.weight:
        for suffix, (mask, nan, code) in _ENGRAM_NAN.items():
            table = getattr(tables, suffix)[layer]
            name = f"layers.{layer}.engram.embed.{suffix}"
            for start in range(0, table.shape[0], ENGRAM_VERIFY_ROWS):
                codes = np.asarray(table[start:start + ENGRAM_VERIFY_ROWS]).view(np.uint8)
                if ((codes & mask) == nan).any():
                    raise CheckpointError(files[name], name, f"holds the {code} (in rows {start}.."
                                                             f"{start + len(codes) - 1}); a published "
                                                             "checkpoint never does")


def config_path(ckpt_dir: str) -> str:
    """The checkpoint folder's config.json, refused unless a regular file inside the folder."""
    return inside(ckpt_dir, CONFIG_NAME, os.path.join(ckpt_dir, CONFIG_NAME), "file")


TOKEN_MAP_NAME = "engram_token_map.json"
TOKEN_ID_BYTES = 16      # one compressed id as JSON text with its separator, generously


def load_token_map(ckpt_dir: str | os.PathLike, cfg: ModelConfig) -> np.ndarray | None:
    """The folder's Engram token map (`engram_token_map.json`: one compressed id per token id), or
    None where the folder has none. Refused, naming the file, unless a regular file inside the
    folder of at most TOKEN_ID_BYTES a token holding a JSON list of vocab_size integers in
    [0, engram_compressed_vocab_size); cheap next to the weights, so callers read it first."""
    ckpt_dir = os.fspath(ckpt_dir)
    where = os.path.join(ckpt_dir, TOKEN_MAP_NAME)
    if not os.path.lexists(where):
        return None
    path = inside(ckpt_dir, TOKEN_MAP_NAME, where, "file")
    ids = read_json(path, 64 + TOKEN_ID_BYTES * cfg.vocab_size)
    if not isinstance(ids, list) or len(ids) != cfg.vocab_size:
        got = f"a list of {len(ids)}" if isinstance(ids, list) else f"a JSON {type(ids).__name__}"
        raise CheckpointError(path, "token map", f"must be a list of vocab_size = {cfg.vocab_size} "
                                                 f"compressed ids, got {got}")
    top = cfg.engram_compressed_vocab_size
    for i, v in enumerate(ids):
        if type(v) is not int or not 0 <= v < top:      # bool is not an id
            raise CheckpointError(path, f"token map[{i}]", f"must be an integer in [0, "
                                                           f"engram_compressed_vocab_size = {top}), got {v!r:.40}")
    return np.asarray(ids, np.int64)


def load_params(ckpt_dir: str | os.PathLike, cfg: ModelConfig | None = None, *,
                progress: bool = True, experts: str = "auto", dense: str = "auto",
                verify: bool = False, expert_sharding: Callable[[int], Any] | None = None
                ) -> tuple[ModelConfig, dict]:
    """Read, check and convert a published checkpoint; see the module docstring for the layout.
    Every refusal is a CheckpointError `<file>: <tensor or field>: <rule>`. `verify` also reads the
    host Engram tables whole for NaN codes (`verify_engram`), which a plain load never reads.
    expert_sharding(n_experts) -> a `jax.sharding.Sharding` splitting a stack of that many routed
    experts along its expert axis, or None (`runtime.mesh.expert_sharding`): such stacks are read
    block by block straight onto their devices (`_convert_sharded`)."""
    experts, dense = resolve_experts(experts), resolve_dense(dense)
    ckpt_dir = os.fspath(ckpt_dir)
    if cfg is None:
        cfg = ModelConfig.from_file(config_path(ckpt_dir))
    validate(cfg)
    ckpt = Checkpoint(ckpt_dir)
    _, schema = validate_checkpoint(ckpt, cfg)
    units = param_units(schema)
    def convert(unit: Unit):
        sharding = expert_sharding(len(unit.names)) if unit.stacked and expert_sharding else None
        if sharding is None:
            return _convert(ckpt, unit, schema[unit.names[0]], experts, dense)
        return _convert_sharded(ckpt, unit, schema[unit.names[0]], experts, sharding)

    flat = {path: convert(unit)
            for path, unit in tqdm(units.items(), desc="checkpoint", unit="param", disable=not progress)}
    _check_finite(ckpt, units, schema, flat)
    params = nest(flat)
    params[ENGRAM_KEY] = EngramTables.from_checkpoint(ckpt, cfg)
    if verify:
        verify_engram(params[ENGRAM_KEY])
    return cfg, params
