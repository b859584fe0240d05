"""One block: optional Engram, the attention sublayer and the MoE sublayer, wired by single-pass mHC
(docs/MODEL.md §3.2, §3.3).

The attention sublayer is passed in as a callable, so the full forward, the DSpark draft stages and
the cache step share this wiring and differ only in how they attend.

API
  Attend = Callable[[h], tuple[out, aux]]    h [B, T, D] (attn_norm output) -> out [B, T, D], any aux
  block(p, cfg, layer, x [B, T, N, D], pre [B, T, N], attend, numerics, image_mask=None,
        forced_gate=None, expert_layer=None, collapsed=None)
        -> BlockOut(x, pre, gate_idx [B, T, k], gate_scores [B, T, E], attn_aux, collapsed)
      p = params["layers"][l] (or params["mtp"][m]). `pre` is the collapse weight handed in by the
      previous sublayer; the returned `pre` (this block's FFN-side pre) collapses the next block.
      forced_gate [B, T, k]: route with these experts (teacher forcing); gate_idx stays the router's own.
      expert_layer: inside a scanned run (model/layer_runs.py), p's routed experts are the run's
      [L, E, ...] stack and this traced index picks the layer's.
      collapsed: the previous block's `collapsed` (x collapsed by pre, and the sums of squares
      the expand that wrote x computed: `mhc.expand_collapse`), None where x is fresh.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, NamedTuple

import jax

from v41_jax.model.mhc import Collapsed, expand_collapse, hc_mixes, input_collapse
from v41_jax.model.moe import moe
from v41_jax.model.norm import rms_norm
from v41_jax.model.numerics import Numerics

if TYPE_CHECKING:
    from v41_jax.config import ModelConfig

Attend = Callable[[jax.Array], tuple[jax.Array, Any]]


class BlockOut(NamedTuple):
    x: jax.Array          # [B, T, N, D] output streams
    pre: jax.Array        # [B, T, N] fp32, collapses the next sublayer's input
    gate_idx: jax.Array   # [B, T, k] routed experts, selection order
    gate_scores: jax.Array  # [B, T, E] the scores they were selected by (bias included)
    attn_aux: Any         # whatever `attend` returned beside its output
    collapsed: Collapsed  # x collapsed by pre (and its sums): the next block's input, or the head's


def _mixes(p: dict, sub: str, x: jax.Array, cfg: ModelConfig, numerics: Numerics, sumsq=None):
    return hc_mixes(x, p[f"hc_{sub}_fn"], p[f"hc_{sub}_base"], p[f"hc_{sub}_scale"], cfg, numerics, sumsq)


def block(p: dict, cfg: ModelConfig, layer: int, x: jax.Array, pre: jax.Array, attend: Attend,
          numerics: Numerics, image_mask: jax.Array | None = None,
          forced_gate: jax.Array | None = None, expert_layer: jax.Array | None = None,
          collapsed: Collapsed | None = None) -> BlockOut:
    b, t, _, d = x.shape
    cin = input_collapse(x, pre, numerics) if collapsed is None else collapsed
    # the attention side's pre is not used here: it collapses the FFN input below
    pre_a, post_a, comb_a = _mixes(p, "attn", x, cfg, numerics, cin.x_sumsq)
    a, aux = attend(rms_norm(cin.c, p["attn_norm"]["weight"], cfg.norm_eps, numerics, cin.c_sumsq))
    x, cf = expand_collapse(a, x, post_a, comb_a, pre_a, numerics)

    pre_f, post_f, comb_f = _mixes(p, "ffn", x, cfg, numerics, cf.x_sumsq)
    h = rms_norm(cf.c, p["ffn_norm"]["weight"], cfg.norm_eps, numerics, cf.c_sumsq)
    flat = lambda a: None if a is None else a.reshape(b * t, *a.shape[2:])
    m, gate_idx, gate_scores = moe(p["ffn"], cfg, layer, h.reshape(b * t, d), numerics, flat(image_mask),
                                   flat(forced_gate), expert_layer)
    x, cnext = expand_collapse(m.reshape(b, t, d), x, post_f, comb_f, pre_f, numerics)
    return BlockOut(x, pre_f, gate_idx.reshape(b, t, -1), gate_scores.reshape(b, t, -1), aux, cnext)
