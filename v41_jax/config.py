"""Model configuration: one frozen dataclass, loaded from any of the three published layouts.

Accepted inputs (see docs/MODEL.md §1.1):
  * the released HF `config.json` (root with `text_config` and `quantization_config`),
  * a flat HF text config (`hidden_size`, `num_hidden_layers`, ...),
  * the official reference's own `ModelArgs` field names (`dim`, `n_layers`, ...).

Field names follow the official `inference/model.py` (`ModelArgs`), because the model code reads
like the reference that way. `validate()` is fail-closed: every rule raises a ValueError that names
the field and the rule. The per-layer attention topology is resolved once, in `topology.py`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any, Mapping, NoReturn

from .engram_hash import engram_primes

# HF text_config name -> reference (ModelArgs) name. Names absent here are the same in both.
_HF_TO_REF = {
    "hidden_size": "dim",
    "num_hidden_layers": "n_layers",
    "num_attention_heads": "n_heads",
    "qk_rope_head_dim": "rope_head_dim",
    "rms_norm_eps": "norm_eps",
    "num_experts_per_tok": "n_activated_experts",
    "moe_intermediate_size": "moe_inter_dim",
    "scoring_func": "score_func",
    "routed_scaling_factor": "route_scale",
    "sliding_window": "window_size",
    "kv_source_layer_ids": "kv_source_layers",
    "index_source_layer_ids": "index_source_layers",
    "candidate_source_layer_id": "candidate_source_layer",
    "num_nextn_predict_layers": "n_mtp_layers",
    "engram_pad_token_id": "engram_pad_id",
    "dspark_num_experts_per_tok": "dspark_n_activated_experts",
    "max_position_embeddings": "max_seq_len",
}

# The only quantization_config the published checkpoint format has (docs/MODEL.md §1.1).
PUBLISHED_QUANTIZATION = {
    "quant_method": "fp8",
    "activation_scheme": "dynamic",
    "weight_block_size": [32, 32],
    "scale_fmt": "ue8m0",
    "expert_dtype": "fp4",
}

# Keys a config may carry that this text-only engine ignores on purpose.
_IGNORED_KEYS = {
    "model_type", "architectures", "dtype", "torch_dtype", "transformers_version", "hidden_act",
    "attention_bias", "tie_word_embeddings", "num_key_value_heads", "topk_method", "rope_scaling",
    "vision_config", "text_config", "quantization_config", "max_batch_size", "temperature",
    "expert_dtype", "vision_n_layers", "vision_dim", "vision_n_heads", "vision_inter_dim",
    "vision_patch_size", "vision_rope_theta", "vision_downsample_ratio", "vision_max_n_token",
    "vision_min_pixels", "vision_max_wh_ratio", "image_token_id",
}


@dataclass(frozen=True)
class ModelConfig:
    # vocabulary and widths
    vocab_size: int
    dim: int                                  # D, width of one mHC stream
    n_layers: int                             # backbone blocks
    n_heads: int                              # H query heads (one shared K=V latent)
    head_dim: int                             # Dh, query and latent width
    rope_head_dim: int                        # R, RoPE on the last R lanes
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    norm_eps: float
    # attention topology (CSA2)
    window_size: int
    compress_ratios: tuple[int, ...]          # n_layers + n_mtp_layers entries, values 0/1/2
    kv_source_layers: tuple[int, ...]
    index_source_layers: tuple[int, ...]
    candidate_source_layer: int               # -1 disables candidate blocks
    candidate_topk_blocks: int
    candidate_block_size: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    # rope
    rope_theta: float
    compress_rope_theta: float
    rope_factor: float
    original_seq_len: int                     # 0 disables YaRN
    beta_fast: int
    beta_slow: int
    max_seq_len: int
    # MoE
    moe_inter_dim: int
    n_routed_experts: int
    n_shared_experts: int
    n_activated_experts: int
    score_func: str
    gate_temp: float
    norm_topk_prob: bool
    route_scale: float
    swiglu_limit: float
    # mHC
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    # Engram
    engram_layer_ids: tuple[int, ...]
    engram_num_embeddings: tuple[int, ...]
    engram_max_ngram_size: int
    engram_vocab_size: int
    engram_n_heads: int
    engram_head_dim: int
    engram_pad_id: int
    engram_compressed_vocab_size: int
    # DSpark draft stages (mtp.*)
    n_mtp_layers: int
    dspark_block_size: int
    dspark_noise_token_id: int
    dspark_target_layer_ids: tuple[int, ...]
    dspark_markov_rank: int
    dspark_n_routed_experts: int              # 0 = same as the backbone (reference rule)
    dspark_n_activated_experts: int           # 0 = same as the backbone
    # special tokens
    bos_token_id: int = 0
    eos_token_id: int = 1
    pad_token_id: int = 2
    # the published quantization: fp8 dense weights + fp4 routed experts
    quantized: bool = True

    # ---- derived -------------------------------------------------------------------------
    @property
    def n_total_layers(self) -> int:
        """Backbone blocks plus DSpark draft stages (the length of `compress_ratios`)."""
        return self.n_layers + self.n_mtp_layers

    def moe_experts(self, layer_id: int) -> tuple[int, int]:
        """(routed experts, activated experts) of a backbone layer or a draft stage."""
        if layer_id < self.n_layers:
            return self.n_routed_experts, self.n_activated_experts
        return (self.dspark_n_routed_experts or self.n_routed_experts,
                self.dspark_n_activated_experts or self.n_activated_experts)

    @property
    def engram_hash_cols(self) -> int:
        return (self.engram_max_ngram_size - 1) * self.engram_n_heads

    def replace(self, **changes: Any) -> "ModelConfig":
        """A changed copy, validated like a loaded one."""
        cfg = dataclasses.replace(self, **changes)
        validate(cfg)
        return cfg

    # ---- loading -------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> "ModelConfig":
        """Load the HF root layout, a flat HF text config, or reference ModelArgs names."""
        cfg = cls(**_normalise(raw))
        validate(cfg)
        return cfg

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "ModelConfig":
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        with open(path) as f:
            raw = json.load(f)
        try:
            return cls.from_dict(raw)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{path}: {e}") from e


def _normalise(raw: Mapping[str, Any]) -> dict[str, Any]:
    """Map any accepted layout onto ModelConfig field names; refuse unknown or missing fields."""
    out: dict[str, Any] = {}
    root = dict(raw)
    text = dict(root.get("text_config", root))
    quant = root.get("quantization_config")
    if quant is not None:
        if dict(quant) != PUBLISHED_QUANTIZATION:
            raise ValueError(
                f"quantization_config: must be exactly the published {PUBLISHED_QUANTIZATION}, "
                f"got {dict(quant)}")
        out["quantized"] = True
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if k in root:
            out[k] = root[k]
    if "dtype" in text and text["dtype"] in ("bf16",):
        out["quantized"] = False
    rs = text.get("rope_scaling")
    if rs is not None:
        if rs.get("rope_type", "yarn") != "yarn":
            raise ValueError(f"rope_scaling.rope_type: only 'yarn' is supported, got {rs.get('rope_type')!r}")
        out["rope_factor"] = rs["factor"]
        out["beta_fast"] = rs["beta_fast"]
        out["beta_slow"] = rs["beta_slow"]
        out["original_seq_len"] = rs["original_max_position_embeddings"]
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    for k, v in text.items():
        name = _HF_TO_REF.get(k, k)
        if name in fields:
            out[name] = v
        elif k not in _IGNORED_KEYS:
            raise ValueError(f"{k}: unknown config field")
    if int(text.get("num_key_value_heads", 1)) != 1:
        raise ValueError("num_key_value_heads: must be 1 (one shared K=V latent)")
    # ModelArgs defaults for fields the reference's own config.json leaves out.
    out.setdefault("gate_temp", 1.0)
    out.setdefault("norm_topk_prob", True)
    out.setdefault("max_seq_len", 4096)
    for k, default in (("candidate_source_layer", -1), ("candidate_topk_blocks", 0),
                       ("candidate_block_size", 0), ("original_seq_len", 0),
                       ("dspark_n_routed_experts", 0), ("dspark_n_activated_experts", 0)):
        out.setdefault(k, default)
    missing = sorted(f for f in fields if f not in out and
                     ModelConfig.__dataclass_fields__[f].default is dataclasses.MISSING)
    if missing:
        raise ValueError(f"{missing[0]}: missing config field (also missing: {missing[1:]})")
    for k in ("compress_ratios", "kv_source_layers", "index_source_layers", "engram_layer_ids",
              "engram_num_embeddings", "dspark_target_layer_ids"):
        out[k] = tuple(int(x) for x in out[k])
    return out


# ---- validation ----------------------------------------------------------------------------
# Fail-closed: every rule raises ValueError("<field>: <rule>"). The attention rules are those the
# topology resolver relies on (docs/MODEL.md §1.2); the width rules are those the
# published quantization needs (A8 activation scales per 32 lanes, FP4 weight scales per 32 inputs).

def validate(cfg: ModelConfig) -> None:
    """Raise ValueError naming the first field that breaks a rule; return None if all hold."""
    for check in (_check_layer_counts, _check_ratios, _check_kv_sources, _check_index_sources,
                  _check_kv_owners, _check_candidates, _check_attention_shape, _check_moe,
                  _check_engram, _check_dspark, _check_quantized_widths):
        check(cfg)


def _fail(field_name: str, rule: str) -> NoReturn:
    raise ValueError(f"{field_name}: {rule}")


def _check_layer_ids(field_name: str, ids: tuple[int, ...], n_layers: int) -> None:
    """Strictly increasing backbone layer ids: the reference visits them in layer order."""
    if any(not 0 <= i < n_layers for i in ids):
        _fail(field_name, f"every id must be a backbone layer in [0, {n_layers}), got {list(ids)}")
    if any(a >= b for a, b in zip(ids, ids[1:])):
        _fail(field_name, f"ids must be strictly increasing, got {list(ids)}")


def _check_layer_counts(cfg: ModelConfig) -> None:
    if cfg.n_layers < 1:
        _fail("n_layers", f"must be >= 1, got {cfg.n_layers}")
    if cfg.n_mtp_layers < 0:
        _fail("n_mtp_layers", f"must be >= 0, got {cfg.n_mtp_layers}")


def _check_ratios(cfg: ModelConfig) -> None:
    ratios = cfg.compress_ratios
    if len(ratios) != cfg.n_total_layers:
        _fail("compress_ratios", f"must have n_layers + n_mtp_layers = {cfg.n_total_layers} "
              f"entries, got {len(ratios)}")
    if any(r not in (0, 1, 2) for r in ratios):
        _fail("compress_ratios", f"values must be 0, 1 or 2 (CSA2), got {sorted(set(ratios))}")
    draft = [l for l in range(cfg.n_layers, cfg.n_total_layers) if ratios[l] != 0]
    if draft:
        _fail("compress_ratios", f"DSpark draft layers must be ratio 0 (window only), got "
              f"non-zero ratio at layers {draft}")


def _check_sources_compressed(cfg: ModelConfig, field_name: str, ids: tuple[int, ...]) -> None:
    window_only = [l for l in ids if cfg.compress_ratios[l] == 0]
    if window_only:
        _fail(field_name, f"a ratio-0 (window-only) layer cannot be a source, got {window_only}")


def _check_kv_sources(cfg: ModelConfig) -> None:
    _check_layer_ids("kv_source_layers", cfg.kv_source_layers, cfg.n_layers)
    _check_sources_compressed(cfg, "kv_source_layers", cfg.kv_source_layers)
    missing = [l for l in cfg.kv_source_layers if l not in cfg.index_source_layers]
    if missing:
        _fail("kv_source_layers", f"every KV source must also be an index source; {missing} "
              f"are not in index_source_layers")


def _check_index_sources(cfg: ModelConfig) -> None:
    _check_layer_ids("index_source_layers", cfg.index_source_layers, cfg.n_layers)
    _check_sources_compressed(cfg, "index_source_layers", cfg.index_source_layers)


def _kv_owner(cfg: ModelConfig, layer: int) -> int | None:
    """The most recent KV source at or before `layer` with the same ratio (None if there is none)."""
    ratio = cfg.compress_ratios[layer]
    owners = [s for s in cfg.kv_source_layers if s <= layer and cfg.compress_ratios[s] == ratio]
    return owners[-1] if owners else None


def _check_kv_owners(cfg: ModelConfig) -> None:
    """Owners precede consumers with the same ratio; this also puts every top-k owner at or after
    its kv owner, because each KV source is itself an index source."""
    for layer, ratio in enumerate(cfg.compress_ratios):
        if ratio and _kv_owner(cfg, layer) is None:
            _fail("kv_source_layers", f"layer {layer} (ratio {ratio}) has no KV source with ratio "
                  f"{ratio} at or before it")


def _check_candidates(cfg: ModelConfig) -> None:
    cand = cfg.candidate_source_layer
    if cand == -1:
        return
    if not 0 <= cand < cfg.n_layers:
        _fail("candidate_source_layer", f"must be -1 or a backbone layer in [0, {cfg.n_layers}), "
              f"got {cand}")
    if cand not in cfg.index_source_layers:
        _fail("candidate_source_layer", f"layer {cand} must be an index source")
    if cfg.candidate_topk_blocks < 1 or cfg.candidate_block_size < 1:
        _fail("candidate_topk_blocks", f"candidate_topk_blocks and candidate_block_size must be >= 1 "
              f"with a candidate source, got {cfg.candidate_topk_blocks} x "
              f"{cfg.candidate_block_size}")
    # per-row selection counts are computed in closed form from a full pool (docs/CACHE.md INV-10)
    if cfg.candidate_topk_blocks * cfg.candidate_block_size < cfg.index_topk:
        _fail("candidate_topk_blocks", f"candidate_topk_blocks * candidate_block_size = "
              f"{cfg.candidate_topk_blocks * cfg.candidate_block_size} must be >= index_topk "
              f"= {cfg.index_topk}")
    # the published blocks index the source's kv owner's rows, so every consumer must read those
    owner = _kv_owner(cfg, cand)
    foreign = [l for l in range(cand + 1, cfg.n_layers)
               if cfg.compress_ratios[l] and _kv_owner(cfg, l) != owner]
    if foreign:
        _fail("candidate_source_layer", f"candidate consumers must share the source's kv owner "
              f"{owner}; layers {foreign} read another")


def _check_attention_shape(cfg: ModelConfig) -> None:
    for name in ("n_heads", "head_dim", "q_lora_rank", "o_groups", "o_lora_rank", "window_size",
                 "index_n_heads", "index_head_dim", "index_topk", "max_seq_len", "hc_mult",
                 "hc_sinkhorn_iters", "vocab_size", "dim"):
        if getattr(cfg, name) < 1:
            _fail(name, f"must be >= 1, got {getattr(cfg, name)}")
    if cfg.n_heads % cfg.o_groups:
        _fail("o_groups", f"n_heads = {cfg.n_heads} must be divisible by o_groups = {cfg.o_groups}")
    r = cfg.rope_head_dim
    if r < 2 or r % 2:
        _fail("rope_head_dim", f"must be even and >= 2 (rotated in pairs), got {r}")
    if r > cfg.head_dim or r > cfg.index_head_dim:
        _fail("rope_head_dim", f"{r} must be <= head_dim = {cfg.head_dim} and <= index_head_dim "
              f"= {cfg.index_head_dim}")


def _check_moe(cfg: ModelConfig) -> None:
    if cfg.n_shared_experts != 1:
        _fail("n_shared_experts", f"must be exactly 1, got {cfg.n_shared_experts}")
    if cfg.score_func != "sqrtsoftplus":
        _fail("score_func", f"must be 'sqrtsoftplus', got {cfg.score_func!r}")
    if cfg.moe_inter_dim < 1:
        _fail("moe_inter_dim", f"must be >= 1, got {cfg.moe_inter_dim}")
    if not 1 <= cfg.n_activated_experts <= cfg.n_routed_experts:
        _fail("n_activated_experts", f"must be in [1, n_routed_experts = {cfg.n_routed_experts}], "
              f"got {cfg.n_activated_experts}")
    if cfg.dspark_n_routed_experts < 0 or cfg.dspark_n_activated_experts < 0:
        _fail("dspark_n_routed_experts", "dspark expert counts must be >= 0 (0 = as the backbone)")
    if cfg.n_mtp_layers:
        routed, active = cfg.moe_experts(cfg.n_layers)
        if not 1 <= active <= routed:
            _fail("dspark_n_activated_experts", f"the draft stages' activated experts {active} must "
                  f"be in [1, routed = {routed}]")


def _check_engram(cfg: ModelConfig) -> None:
    ids = cfg.engram_layer_ids
    _check_layer_ids("engram_layer_ids", ids, cfg.n_layers)
    if len(cfg.engram_num_embeddings) != len(ids):
        _fail("engram_num_embeddings", f"needs one entry per Engram layer ({len(ids)}), got "
              f"{len(cfg.engram_num_embeddings)}")
    if not ids:
        return
    for name, low in (("engram_max_ngram_size", 2), ("engram_n_heads", 1), ("engram_head_dim", 1),
                      ("engram_vocab_size", 1), ("engram_compressed_vocab_size", 1)):
        if getattr(cfg, name) < low:
            _fail(name, f"must be >= {low} with Engram layers, got {getattr(cfg, name)}")
    if not 0 <= cfg.engram_pad_id < cfg.vocab_size:
        _fail("engram_pad_id", f"must be a token id in [0, {cfg.vocab_size}), got {cfg.engram_pad_id}")
    if cfg.engram_compressed_vocab_size > cfg.vocab_size:
        _fail("engram_compressed_vocab_size", f"{cfg.engram_compressed_vocab_size} cannot exceed "
              f"vocab_size = {cfg.vocab_size}")
    rows = tuple(int(x) for x in engram_primes(len(ids), cfg.engram_max_ngram_size,
                                                cfg.engram_n_heads, cfg.engram_vocab_size)
                 .sum(axis=(1, 2)))
    if rows != cfg.engram_num_embeddings:
        _fail("engram_num_embeddings", f"must equal each layer's sum of bucket primes "
              f"{list(rows)} (from engram_vocab_size, engram_n_heads, engram_max_ngram_size), got "
              f"{list(cfg.engram_num_embeddings)}")


def _check_dspark(cfg: ModelConfig) -> None:
    targets = cfg.dspark_target_layer_ids
    # taps are collected in layer order, one per target, into main_proj's len(targets) * dim input
    _check_layer_ids("dspark_target_layer_ids", targets, cfg.n_layers)
    if not cfg.n_mtp_layers:
        return
    if not targets:
        _fail("dspark_target_layer_ids", "DSpark draft stages need at least one target layer")
    if cfg.dspark_block_size < 1:
        _fail("dspark_block_size", f"must be >= 1 with draft stages, got {cfg.dspark_block_size}")
    if not 0 <= cfg.dspark_noise_token_id < cfg.vocab_size:
        _fail("dspark_noise_token_id", f"must be a token id in [0, {cfg.vocab_size}), got "
              f"{cfg.dspark_noise_token_id}")
    if cfg.dspark_markov_rank < 1:
        _fail("dspark_markov_rank", f"must be >= 1, got {cfg.dspark_markov_rank}")


def _check_quantized_widths(cfg: ModelConfig) -> None:
    """Every quantized GEMM's input width takes whole A8 groups of 32, and the FP4/Engram rows whole
    E8M0 groups of 32; head_dim also covers the FP4 x 16 compressed-KV groups."""
    if not cfg.quantized:
        return
    widths = {"dim": cfg.dim, "q_lora_rank": cfg.q_lora_rank, "head_dim": cfg.head_dim,
              "index_head_dim": cfg.index_head_dim, "moe_inter_dim": cfg.moe_inter_dim,
              "o_lora_rank": cfg.o_groups * cfg.o_lora_rank}  # wo_b's input: o_groups * o_lora_rank
    if cfg.engram_layer_ids:
        widths["engram_head_dim"] = cfg.engram_head_dim
    for name, width in widths.items():
        if width % 32:
            _fail(name, f"width {width} must be a multiple of 32 for the published quantization")


def to_hf_root(cfg: ModelConfig) -> dict[str, Any]:
    """The HF root `config.json` layout for `cfg` (the inverse of `from_dict`, checked)."""
    ref_to_hf = {v: k for k, v in _HF_TO_REF.items()}
    text = {"model_type": "deepseek_v41_text", "num_key_value_heads": 1}
    for k, v in vars(cfg).items():
        if k in ("quantized", "bos_token_id", "eos_token_id", "pad_token_id",
                 "rope_factor", "beta_fast", "beta_slow", "original_seq_len"):
            continue
        text[ref_to_hf.get(k, k)] = list(v) if isinstance(v, tuple) else v
    text["rope_scaling"] = {"rope_type": "yarn", "factor": cfg.rope_factor, "beta_fast": cfg.beta_fast,
                            "beta_slow": cfg.beta_slow, "original_max_position_embeddings": cfg.original_seq_len}
    root = {"model_type": "deepseek_v41", "architectures": ["DeepseekV41ForCausalLM"], "dtype": "bfloat16",
            "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id, "pad_token_id": cfg.pad_token_id}
    if cfg.quantized:
        root["quantization_config"] = dict(PUBLISHED_QUANTIZATION)
    else:
        text["dtype"] = "bf16"
    root["text_config"] = text
    if ModelConfig.from_dict(root) != cfg:
        raise ValueError("config: the HF root layout built for this config does not load back equal")
    return root
