"""Engram module: n-gram hash rows -> per-stream key + shared value -> gated residual update (docs/MODEL.md §3.11.4).

The hash ids come from `v41_jax/engram_hash.py`; the FP8 tables stay on the host
(`params["engram_tables"]`). Rows are gathered there and passed into the jitted forward.

API
  sequence_rows(tables, hasher, cfg, tokens [B, S], image_mask=None) -> (ids int64 [B, S, nE, cols],
                {layer: rows})
      hash ids of whole sequences from position 0 and their rows, bf16 [B, S, cols, hd]: e4m3 x
      2^(e8m0-127) per 32 lanes in fp32, one cast (the reference's lookup). Image-span tokens
      (image_mask True) take part in no n-gram.
  engram(p, cfg, x [..., N, D], rows [..., cols, hd], numerics, token_mask=None) -> [..., N, D]
      p = params["layers"][l]["engram"] (wkv, q_weight, k_weight). token_mask False (image-span
      tokens) closes the gate, so those streams pass through bit-identically.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from v41_jax.model.linear import lin8
from v41_jax.model.norm import rms_inv
from v41_jax.model.numerics import Numerics, cascade_sum, rounded
from v41_jax.quant import dequant_fp8_rows

if TYPE_CHECKING:
    from v41_jax.checkpoint.load import EngramTables
    from v41_jax.config import ModelConfig
    from v41_jax.engram_hash import EngramHasher

_GATE_FLOOR = 1e-6  # |dot| floor under the signed square root


def sequence_rows(tables: EngramTables, hasher: EngramHasher, cfg: ModelConfig, tokens: np.ndarray,
                  image_mask: np.ndarray | None = None) -> tuple[np.ndarray, dict[int, np.ndarray]]:
    tokens = np.asarray(tokens)
    text = np.ones(tokens.shape, bool) if image_mask is None else ~np.asarray(image_mask, bool)
    ids = np.stack([hasher.hash_ids(hasher.start(), seq, keep)[0]
                    for seq, keep in zip(tokens, text)])                      # [B, S, nE, cols]
    rows = {layer: np.asarray(dequant_fp8_rows(*tables.gather(layer, ids[:, :, i]), 32, jnp.bfloat16))
            for i, layer in enumerate(cfg.engram_layer_ids)}
    return ids, rows


def engram(p: dict, cfg: ModelConfig, x: jax.Array, rows: jax.Array, numerics: Numerics,
           token_mask: jax.Array | None = None) -> jax.Array:
    n, d = cfg.hc_mult, cfg.dim
    kv = lin8(rows.reshape(*rows.shape[:-2], -1), p["wkv"]["weight"], numerics)      # [..., (N+1) D]
    key = kv[..., : n * d].astype(jnp.float32).reshape(*kv.shape[:-1], n, d)
    value = kv[..., n * d:].astype(jnp.float32)                            # [..., D]
    weight = p["q_weight"].astype(jnp.float32) * p["k_weight"].astype(jnp.float32)  # only the product is used
    h = x.astype(jnp.float32)
    # normalised per (token, stream) over D, not jointly over the streams
    rstd = rms_inv(h, cfg.norm_eps, numerics)[..., 0] * rms_inv(key, cfg.norm_eps, numerics)[..., 0]     # [..., N]
    dot = cascade_sum(rounded(h * weight * key)) * rstd * d ** -0.5
    gate = jax.nn.sigmoid(jnp.copysign(jnp.sqrt(jnp.maximum(jnp.abs(dot), _GATE_FLOOR)), dot))
    if token_mask is not None:
        gate = jnp.where(token_mask[..., None], gate, 0.0)
    return (h + rounded(gate[..., None] * value[..., None, :])).astype(x.dtype)
