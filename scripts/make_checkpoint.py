"""Write a seeded random checkpoint in the published layout (HF root; official fixtures' format).

    python -m scripts.make_checkpoint --config v41_jax/configs/tiny.config.json --out DIR --seed 0 [--shards N]

Every tensor of `checkpoint_schema(cfg)` gets seeded random values at sensible scales (linears
normal / sqrt(fan_in), norms ~1, hc parameters and gate biases small), and is really quantized with
`v41_jax.quant`: FP8 E4M3 32x32 blocks with E8M0 scales for dense linears, FP4 E2M1 1x32 with E8M0
for routed experts, FP8 rows with E8M0 per 32 lanes for Engram tables. DIR receives:

  model.safetensors | model-0000k-of-0000N.safetensors   shards (sorted names, 8-byte aligned header)
  model.safetensors.index.json                          weight_map + metadata.total_size
  config.json                                           HF root layout
  engram_token_map.json                                 token 2k, 2k+1 -> k (mod the compressed vocab)
  parameter_aliases.json                                mtp.N.{embed,head}.weight -> the backbone's
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Mapping, Sequence

import ml_dtypes
import numpy as np

from v41_jax import quant
from v41_jax.config import CONFIG_MAX_BYTES, ModelConfig, exit_2_on_refusal, read_json, to_hf_root
from v41_jax.checkpoint.safetensors_io import write_checkpoint
from v41_jax.checkpoint.schema import SchemaOptions, TensorSpec, checkpoint_schema, parameter_aliases


def logical_shape(spec: TensorSpec) -> tuple[int, ...]:
    """Shape of the unquantized tensor a stored weight encodes (FP4 packs two inputs per byte)."""
    return (spec.shape[0], 2 * spec.shape[1]) if spec.dtype == "I8" else spec.shape


def init_affine(name: str, shape: tuple[int, ...]) -> tuple[float, float]:
    """(offset, scale): the writer draws offset + scale * N(0, 1) for this tensor (norm weights
    near 1, inputs of a linear at 1/sqrt(fan-in), small hyper-connection and bias terms)."""
    if name.endswith("norm.weight") or name.endswith(("q_weight", "k_weight")):
        return 1.0, 0.1
    if ".hc_" in name:
        return 0.0, 0.1 / np.sqrt(shape[1]) if name.endswith("_fn") else 0.1
    if name.endswith(("attn_sink", "gate.bias", "gate.bias_vl")):
        return 0.0, 0.01 if "gate" in name else 0.1
    if name in ("embed.weight",) or name.endswith(("markov_head.embed.weight", "engram.embed.weight")):
        return 0.0, 1.0
    return 0.0, 1 / np.sqrt(shape[-1])


def _init(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """One tensor's random values, fp32."""
    offset, scale = init_affine(name, shape)
    return np.float32(offset) + np.float32(scale) * rng.standard_normal(shape, dtype=np.float32)


def random_weights(schema: Mapping[str, TensorSpec], seed: int) -> dict[str, np.ndarray]:
    """Unquantized fp32 values of every stored weight (not the scales), seeded, in name order."""
    rng = np.random.default_rng(seed)
    return {name: _init(name, logical_shape(spec), rng)
            for name, spec in schema.items() if not name.endswith(".scale")}


def encode(schema: Mapping[str, TensorSpec], weights: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """fp32 weights -> the stored tensors (quantized with their scales, or cast), by schema dtype."""
    out: dict[str, np.ndarray] = {}
    for name, w in weights.items():
        spec = schema[name]
        scale_name = name.removesuffix(".weight") + ".scale"
        if spec.dtype == "F8_E4M3":
            encoder = quant.quant_fp8_ue8m0 if spec.held == "host" else quant.quant_weight_fp8
            codes, scales = encoder(w)
            out[name] = np.asarray(codes).view(ml_dtypes.float8_e4m3fn)
        elif spec.dtype == "I8":
            codes, scales = quant.quant_weight_fp4(w)
            out[name] = np.asarray(codes).view(np.int8)
        elif spec.dtype == "BF16":
            out[name] = w.astype(ml_dtypes.bfloat16)
            continue
        else:
            out[name] = w.astype(np.float32)
            continue
        out[scale_name] = np.asarray(scales).view(ml_dtypes.float8_e8m0fnu)
    missing = set(schema) ^ set(out)
    if missing:
        raise ValueError(f"encode: tensors {sorted(missing)[:4]} do not match the schema")
    return out


def hf_root_config(raw: Mapping, cfg: ModelConfig) -> dict:
    """The HF root config.json for `cfg`: `raw` itself when it already is one, else built from cfg."""
    if "text_config" in raw:
        return dict(raw)
    return to_hf_root(cfg)


def engram_token_map(cfg: ModelConfig) -> list[int]:
    """The official fixtures' stub tokenizer: token 2k and 2k+1 normalize to k."""
    return [(t // 2) % cfg.engram_compressed_vocab_size for t in range(cfg.vocab_size)]


def make_checkpoint(config_path: str, out_dir: str, seed: int, shards: int = 1,
                    opts: SchemaOptions = SchemaOptions()) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Write the checkpoint; returns the config and the fp32 weights it was quantized from."""
    raw = read_json(config_path, CONFIG_MAX_BYTES)
    cfg = ModelConfig.from_dict(raw, config_path)
    schema = checkpoint_schema(cfg, opts)
    weights = random_weights(schema, seed)
    write_checkpoint(out_dir, encode(schema, weights), shards)
    for fname, obj in (("config.json", hf_root_config(raw, cfg)),
                       ("engram_token_map.json", engram_token_map(cfg)),
                       ("parameter_aliases.json", parameter_aliases(cfg))):
        with open(os.path.join(out_dir, fname), "w") as f:
            json.dump(obj, f, indent=1)
    return cfg, weights


@exit_2_on_refusal
def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True, help="config JSON (HF root, flat HF text, or reference names)")
    ap.add_argument("--out", required=True, help="output checkpoint directory")
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--shards", type=int, default=1)
    ap.add_argument("--wo-a-fp8", action="store_true",
                    help="store attn.wo_a FP8 + scale (HF release layout) instead of BF16 (fixtures)")
    args = ap.parse_args(argv)
    make_checkpoint(args.config, args.out, args.seed, args.shards, SchemaOptions(wo_a_fp8=args.wo_a_fp8))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
