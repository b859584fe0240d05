"""The exact checkpoint key -> (shape, dtype) table of a config (docs/MODEL.md §2.2).

Names are the reference's `state_dict` names (no `model.` prefix). The table follows the reference
modules, and the official fixture checkpoints (tests/fixtures/dsv41_official) are the ground truth:

  * quantized linear = `<name>.weight` + `<name>.scale`: FP8 E4M3 [out, in] with E8M0
    [ceil(out/32), ceil(in/32)]; routed experts FP4 as I8 [out, in/2] with E8M0 [out, in/32];
  * `attn.wo_a` is BF16 without a scale (the reference converter dequantizes it; the fixtures store
    it so). ATOM's schema for the HF release keeps it FP8 + scale: `SchemaOptions.wo_a_fp8`;
  * `ffn.gate.bias_vl` exists only when the vision tower does (not in the fixtures):
    `SchemaOptions.gate_bias_vl`;
  * the compressor exists only in kv-source layers, its `wgate` only at ratio > 1; the indexer in
    index-source layers, its `wk` / `k_norm` only in kv sources; draft stages have neither;
  * draft stage 0 holds `main_proj` / `main_norm`, the last stage `norm`, `markov_head.*`,
    `confidence_head.proj`; `mtp.N.embed/head` alias the backbone's and are not stored
    (`parameter_aliases.json`).

`TensorSpec.held` is the dtype a tensor has in the params pytree after load (DESIGN.md,
"Checkpoint -> params"): "bf16" (also every dequantized weight, and the BF16 tensors the
reference holds in fp32: their fp32 GEMMs take bf16 values, `linear.lin_f32`), "f32" (fp32 in
the file), "scale" (consumed by dequantization) or
"host" (Engram tables, kept as FP8 + E8M0 on the host). The routed experts' "bf16" is the
dequantized choice; `load.held_as` swaps in the format the loader was asked for.

Vision tensors (`vision.*`, `aligner.*`, `image_*`) are outside this text engine; the validator
skips them and refuses every other unknown name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from ..config import ModelConfig
from ..topology import Mode, resolve_topology
from .safetensors_io import Checkpoint, CheckpointError

BLOCK = 32  # FP8 weight block edge and FP4 / Engram scale group
VISION_PREFIXES = ("vision.", "aligner.", "image_start", "image_end", "image_newline")


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: str       # safetensors dtype string
    held: str        # "bf16" | "f32" | "scale" | "host"


@dataclass(frozen=True)
class SchemaOptions:
    wo_a_fp8: bool = False       # attn.wo_a stored FP8 + scale (HF release) instead of BF16 (fixtures)
    gate_bias_vl: bool = False   # ffn.gate.bias_vl stored (vision-enabled release)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class SchemaTooLarge(Exception):
    """The schema grew past its `limit` of tensors: `names` are the first limit + 1."""

    def __init__(self, names: list[str]):
        super().__init__(names)
        self.names = names


class _Table:
    """Collects the specs of one checkpoint; one method per kind of parameter."""

    def __init__(self, cfg: ModelConfig, limit: int | None):
        self.cfg = cfg
        self.limit = limit
        self.specs: dict[str, TensorSpec] = {}

    def add(self, name: str, shape: tuple[int, ...], dtype: str, held: str) -> None:
        if self.limit is not None and len(self.specs) >= self.limit:
            raise SchemaTooLarge([*self.specs, name])
        self.specs[name] = TensorSpec(tuple(int(d) for d in shape), dtype, held)

    def norm(self, name: str, dim: int) -> None:
        self.add(f"{name}.weight", (dim,), "BF16", "bf16")

    def bf16(self, name: str, out_f: int, in_f: int) -> None:
        self.add(f"{name}.weight", (out_f, in_f), "BF16", "bf16")

    def fp8(self, name: str, out_f: int, in_f: int) -> None:
        """A default-dtype Linear: FP8 32x32 blocks in the published (quantized) format."""
        if not self.cfg.quantized:
            return self.bf16(name, out_f, in_f)
        self.add(f"{name}.weight", (out_f, in_f), "F8_E4M3", "bf16")
        self.add(f"{name}.scale", (_cdiv(out_f, BLOCK), _cdiv(in_f, BLOCK)), "F8_E8M0", "scale")

    def fp4(self, name: str, out_f: int, in_f: int) -> None:
        """A routed-expert Linear: FP4 packed two per byte, one E8M0 scale per row per 32 inputs."""
        if not self.cfg.quantized:
            return self.bf16(name, out_f, in_f)
        self.add(f"{name}.weight", (out_f, in_f // 2), "I8", "bf16")
        self.add(f"{name}.scale", (out_f, in_f // BLOCK), "F8_E8M0", "scale")

    def f32(self, name: str, shape: tuple[int, ...]) -> None:
        self.add(name, shape, "F32", "f32")


def _attention(t: _Table, p: str, layer, opts: SchemaOptions) -> None:
    cfg = t.cfg
    hd = cfg.n_heads * cfg.head_dim
    t.f32(f"{p}.attn_sink", (cfg.n_heads,))
    t.fp8(f"{p}.wq_a", cfg.q_lora_rank, cfg.dim)
    t.norm(f"{p}.q_norm", cfg.q_lora_rank)
    t.fp8(f"{p}.wq_b", hd, cfg.q_lora_rank)
    t.fp8(f"{p}.wkv", cfg.head_dim, cfg.dim)
    t.norm(f"{p}.kv_norm", cfg.head_dim)
    wo_a = (t.fp8 if opts.wo_a_fp8 else t.bf16)
    wo_a(f"{p}.wo_a", cfg.o_groups * cfg.o_lora_rank, hd // cfg.o_groups)
    t.fp8(f"{p}.wo_b", cfg.dim, cfg.o_groups * cfg.o_lora_rank)
    if layer.mode == Mode.FULL:
        # ratio 1 is a plain bf16 projection; at ratio > 1 the reference holds both in fp32 and
        # pools fp32 projections (`lin_f32` of the same bf16 values)
        t.bf16(f"{p}.compressor.wkv", cfg.head_dim, cfg.dim)
        if layer.ratio > 1:
            t.bf16(f"{p}.compressor.wgate", cfg.head_dim, cfg.dim)
        t.norm(f"{p}.compressor.norm", cfg.head_dim)
        t.bf16(f"{p}.indexer.wk", cfg.index_head_dim, cfg.head_dim)
        t.norm(f"{p}.indexer.k_norm", cfg.index_head_dim)
    if layer.scores:
        t.fp8(f"{p}.indexer.wq_b", cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank)
        t.bf16(f"{p}.indexer.weights_proj", cfg.index_n_heads, cfg.dim)


def _moe(t: _Table, p: str, layer_id: int, opts: SchemaOptions) -> None:
    cfg = t.cfg
    n_experts, _ = cfg.moe_experts(layer_id)
    t.bf16(f"{p}.gate", n_experts, cfg.dim)
    t.f32(f"{p}.gate.bias", (n_experts,))
    if opts.gate_bias_vl:
        t.f32(f"{p}.gate.bias_vl", (n_experts,))
    for e in range(n_experts):
        t.fp4(f"{p}.experts.{e}.w1", cfg.moe_inter_dim, cfg.dim)
        t.fp4(f"{p}.experts.{e}.w2", cfg.dim, cfg.moe_inter_dim)
        t.fp4(f"{p}.experts.{e}.w3", cfg.moe_inter_dim, cfg.dim)
    t.fp8(f"{p}.shared_experts.w1", cfg.moe_inter_dim, cfg.dim)
    t.fp8(f"{p}.shared_experts.w2", cfg.dim, cfg.moe_inter_dim)
    t.fp8(f"{p}.shared_experts.w3", cfg.moe_inter_dim, cfg.dim)


def _engram(t: _Table, p: str, layer_id: int) -> None:
    cfg = t.cfg
    rows = cfg.engram_num_embeddings[cfg.engram_layer_ids.index(layer_id)]
    # the table is FP8 with one E8M0 per 32 lanes whatever the dense dtype (reference)
    t.add(f"{p}.embed.weight", (rows, cfg.engram_head_dim), "F8_E4M3", "host")
    t.add(f"{p}.embed.scale", (rows, cfg.engram_head_dim // BLOCK), "F8_E8M0", "host")
    t.fp8(f"{p}.wkv", cfg.dim * (cfg.hc_mult + 1), cfg.engram_hash_cols * cfg.engram_head_dim)
    t.add(f"{p}.q_weight", (cfg.hc_mult, cfg.dim), "BF16", "bf16")
    t.add(f"{p}.k_weight", (cfg.hc_mult, cfg.dim), "BF16", "bf16")


def _block(t: _Table, p: str, layer, opts: SchemaOptions) -> None:
    cfg = t.cfg
    mix = (2 + cfg.hc_mult) * cfg.hc_mult
    t.norm(f"{p}.attn_norm", cfg.dim)
    t.norm(f"{p}.ffn_norm", cfg.dim)
    for s in ("attn", "ffn"):
        t.f32(f"{p}.hc_{s}_fn", (mix, cfg.hc_mult * cfg.dim))
        t.f32(f"{p}.hc_{s}_base", (mix,))
        t.f32(f"{p}.hc_{s}_scale", (3,))
    _attention(t, f"{p}.attn", layer, opts)
    _moe(t, f"{p}.ffn", layer.layer, opts)
    if layer.engram and not layer.is_draft:
        _engram(t, f"{p}.engram", layer.layer)


def _draft_extras(t: _Table, p: str, stage: int) -> None:
    cfg = t.cfg
    if stage == 0:
        t.fp8(f"{p}.main_proj", cfg.dim, cfg.dim * len(cfg.dspark_target_layer_ids))
        t.norm(f"{p}.main_norm", cfg.dim)
    if stage == cfg.n_mtp_layers - 1:
        t.norm(f"{p}.norm", cfg.dim)
        t.bf16(f"{p}.markov_head.embed", cfg.vocab_size, cfg.dspark_markov_rank)
        # the reference holds these two in fp32 (fp32 logits / confidence): `lin_f32` of their bf16 values
        t.bf16(f"{p}.markov_head.head", cfg.vocab_size, cfg.dspark_markov_rank)
        t.bf16(f"{p}.confidence_head.proj", 1, cfg.dim + cfg.dspark_markov_rank)


def checkpoint_schema(cfg: ModelConfig, opts: SchemaOptions = SchemaOptions(),
                      limit: int | None = None) -> dict[str, TensorSpec]:
    """name -> TensorSpec for every stored tensor of the text model, sorted by name. With `limit`,
    raise SchemaTooLarge as soon as the schema would hold more tensors than that."""
    t = _Table(cfg, limit)
    t.bf16("embed", cfg.vocab_size, cfg.dim)
    t.bf16("head", cfg.vocab_size, cfg.dim)   # fp32 in the reference: `lin_f32` of its bf16 values
    t.norm("norm", cfg.dim)
    for layer in resolve_topology(cfg):
        if layer.is_draft:
            stage = layer.layer - cfg.n_layers
            _block(t, f"mtp.{stage}", layer, opts)
            _draft_extras(t, f"mtp.{stage}", stage)
        else:
            _block(t, f"layers.{layer.layer}", layer, opts)
    return dict(sorted(t.specs.items()))


def parameter_aliases(cfg: ModelConfig) -> dict[str, str]:
    """State-dict names that alias a stored tensor (the drafter shares embed and head)."""
    return {f"mtp.{m}.{w}.weight": f"{w}.weight" for m in range(cfg.n_mtp_layers) for w in ("embed", "head")}


def detect_options(names: Iterable[str]) -> SchemaOptions:
    """The variant a checkpoint is written in, read off its layer-0 names (validation then demands
    every layer agree)."""
    names = set(names)
    return SchemaOptions(wo_a_fp8="layers.0.attn.wo_a.scale" in names,
                         gate_bias_vl="layers.0.ffn.gate.bias_vl" in names)


def validate_checkpoint(ckpt: Checkpoint, cfg: ModelConfig) -> tuple[SchemaOptions, dict[str, TensorSpec]]:
    """Refuse a checkpoint whose text key set, shapes or dtypes differ from the schema of `cfg`.
    Returns the detected options and the schema they give.

    The schema is built with the checkpoint's own tensor count as its limit: a config that asks for
    more tensors than the files hold is refused when the limit is reached, so a hostile size (within
    the config's bounds, e.g. 40 layers x 3072 experts) costs no more than the checkpoint's headers."""
    opts = detect_options(ckpt.tensors)
    try:
        schema = checkpoint_schema(cfg, opts, limit=len(ckpt.tensors))
    except SchemaTooLarge as e:
        first = next(n for n in e.names if n not in ckpt.tensors)
        raise CheckpointError(ckpt.source, first, f"missing from the checkpoint (the config asks for "
                                                  f"more than the {len(ckpt.tensors)} tensors it "
                                                  "holds)") from None
    text_names = {n for n in ckpt.tensors if not n.startswith(VISION_PREFIXES)}
    missing = sorted(set(schema) - text_names)
    if missing:
        raise CheckpointError(ckpt.source, missing[0], f"missing from the checkpoint ({len(missing)} "
                                                       f"missing in all: {missing[:8]})")
    extra = sorted(text_names - set(schema))
    if extra:
        raise CheckpointError(ckpt.info(extra[0]).path, extra[0], f"not in the schema of this config "
                                                                  f"({len(extra)} unexpected in all: {extra[:8]})")
    for name, spec in schema.items():
        info = ckpt.info(name)
        if info.dtype != spec.dtype:
            raise CheckpointError(info.path, name, f"dtype {info.dtype}, expected {spec.dtype}")
        if info.shape != spec.shape:
            raise CheckpointError(info.path, name, f"shape {list(info.shape)}, expected {list(spec.shape)}")
    return opts, schema
