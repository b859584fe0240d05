"""Model configuration: one frozen dataclass, loaded from any of the three published layouts.

Accepted inputs (see ARCHITECTURE.md §1):
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
from dataclasses import dataclass, field
from typing import Any, Mapping

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

# The only quantization_config the published checkpoint format has (ARCHITECTURE.md §1.1).
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
        return dataclasses.replace(self, **changes)

    # ---- loading -------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> "ModelConfig":
        """Load the HF root layout, a flat HF text config, or reference ModelArgs names."""
        return cls(**_normalise(raw))

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
