"""Final collapse, norm and LM head (docs/MODEL.md §3.12).

There are no separate hc_head parameters: the last block's FFN-side pre-mix collapses the streams.

API
  final_hidden(params, cfg, x [..., N, D], pre [..., N], numerics) -> (collapsed [..., D], normed [..., D])
  lm_head(w [V, D] bf16, h [..., D]) -> fp32 [..., V]     logits in fp32 (the reference's fp32 head:
                                                           `lin_f32`, exact products of bf16 values)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax

from v41_jax.model.linear import lin_f32
from v41_jax.model.mhc import collapse
from v41_jax.model.norm import rms_norm

if TYPE_CHECKING:
    from v41_jax.config import ModelConfig
    from v41_jax.model.numerics import Numerics


def final_hidden(params: dict, cfg: ModelConfig, x: jax.Array, pre: jax.Array,
                 numerics: Numerics) -> tuple[jax.Array, jax.Array]:
    collapsed = collapse(x, pre)
    return collapsed, rms_norm(collapsed, params["norm"]["weight"], cfg.norm_eps, numerics)


def lm_head(w: jax.Array, h: jax.Array) -> jax.Array:
    return lin_f32(h, w)
