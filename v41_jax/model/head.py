"""Final collapse, norm and LM head (docs/MODEL.md §3.12).

There are no separate hc_head parameters: the last block's FFN-side pre-mix collapses the streams.

API
  final_hidden(params, cfg, collapsed, numerics) -> (collapsed [..., D], normed [..., D])
      collapsed: `mhc.Collapsed`, the last block's streams collapsed by its pre (`run_layers`).
  lm_head(w [V, D] bf16, h [..., D]) -> fp32 [..., V]     logits in fp32 (the reference's fp32 head:
                                                           `lin_f32`, exact products of bf16 values)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax

from v41_jax.model.linear import lin_f32
from v41_jax.model.norm import rms_norm

if TYPE_CHECKING:
    from v41_jax.config import ModelConfig
    from v41_jax.model.mhc import Collapsed
    from v41_jax.model.numerics import Numerics


def final_hidden(params: dict, cfg: ModelConfig, collapsed: Collapsed,
                 numerics: Numerics) -> tuple[jax.Array, jax.Array]:
    return collapsed.c, rms_norm(collapsed.c, params["norm"]["weight"], cfg.norm_eps, numerics, collapsed.c_sumsq)


def lm_head(w: jax.Array, h: jax.Array) -> jax.Array:
    return lin_f32(h, w)
