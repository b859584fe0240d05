"""DSpark draft head: the reference `forward_spec` at a decode step (docs/MODEL.md §5.1-5.3).

The target's main hidden (mean-of-streams inputs of the target layers) is projected once
(`main_proj` + `main_norm` of stage 0) into context rows; every stage turns them into its own
window KV (kv_norm, window RoPE, fp8 QDQ). A draft block of `dspark_block_size` rows
[x_{a+1}, noise, ...] at positions a+1.. runs through the stages (window-only attention over the
context rows (a - window, a] plus all draft rows, bidirectional inside the block), then the last
stage's norm + the shared LM head, a Markov bias chain, greedy drafts and the confidence head.

API
  context_x(params, cfg, main_hidden [B, Sc, nT*D], numerics) -> [B, Sc, D]
  draft(params, cfg, ctx_x [B, Sc, D], anchor [B], first_ids [B], numerics, forced_gate=None,
        forced_prev=None) -> Draft
      ctx_x row i is position i (the context of every anchor lies inside it); anchor = the last
      position the target processed; first_ids = the target's token for anchor + 1.
      Teacher forcing (checking against a reference): forced_gate {stage layer id: [B, blk, k]}
      expert picks; forced_prev [B, blk] the tokens the Markov rows condition on (row k's previous
      token; the model's own chain is first_ids then its greedy drafts).
  draft_block(params, cfg, context, anchor, first_ids, numerics, forced_gate=None, forced_prev=None) -> Draft
      the same with each stage's context given by the caller: context(m, stage m's params) -> (ctx_kv [B, Nc, Dh],
      ctx_idx [B, Kc] or None) as `attention.draft_attention` takes them (the engine's step passes
      the rows it gathers from the slot's draft-stage rings and its own rows).
  Draft(ids [B, blk+1] (first_ids, then the greedy drafts), logits fp32 [B, blk, V] (Markov bias
        included), confidence fp32 [B, blk] (pre-sigmoid), hidden [B, blk, D] (the collapsed,
        pre-norm draft hidden the confidence head reads), gate_idx / gate_scores
        {stage layer id: [B, blk, k] / [B, blk, E]})
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import jax
import jax.numpy as jnp

from v41_jax.model.attention import draft_attention, window_kv
from v41_jax.model.block import block
from v41_jax.model.forward import embed
from v41_jax.model.head import lm_head
from v41_jax.model.linear import lin8, lin_f32
from v41_jax.model.mhc import one_hot_pre
from v41_jax.model.norm import rms_norm
from v41_jax.model.numerics import Numerics
from v41_jax.model.rope import rope_cos_sin

if TYPE_CHECKING:
    from v41_jax.config import ModelConfig


class Draft(NamedTuple):
    ids: jax.Array
    logits: jax.Array
    confidence: jax.Array
    hidden: jax.Array
    gate_idx: dict
    gate_scores: dict


def context_x(params: dict, cfg: ModelConfig, main_hidden: jax.Array, numerics: Numerics) -> jax.Array:
    numerics, p0 = numerics.for_model(cfg.quantized), params["mtp"][0]
    return rms_norm(lin8(main_hidden, p0["main_proj"]["weight"], numerics), p0["main_norm"]["weight"],
                    cfg.norm_eps, numerics)


def _markov_chain(p: dict, logits: jax.Array, first_ids: jax.Array,
                  forced_prev: jax.Array | None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Add each row's Markov bias (from the previous token) and draft greedily, row by row."""
    ids, rows, embeds = [first_ids], [], []
    for k in range(logits.shape[1]):
        prev = ids[-1] if forced_prev is None else forced_prev[:, k]
        me = p["markov_head"]["embed"]["weight"][prev]                         # [B, r] bf16
        row = logits[:, k] + lm_head(p["markov_head"]["head"]["weight"], me)
        rows.append(row)
        embeds.append(me)
        ids.append(jnp.argmax(row, axis=-1).astype(first_ids.dtype))
    return jnp.stack(ids, 1), jnp.stack(rows, 1), jnp.stack(embeds, 1)


def draft(params: dict, cfg: ModelConfig, ctx_x: jax.Array, anchor: jax.Array, first_ids: jax.Array,
          numerics: Numerics, forced_gate: dict | None = None, forced_prev: jax.Array | None = None) -> Draft:
    numerics = numerics.for_model(cfg.quantized)
    cos, sin = rope_cos_sin(cfg, jnp.arange(ctx_x.shape[1]), global_table=False)

    def context(m, p):                                                          # this stage's context rows
        return window_kv(p["attn"], cfg, ctx_x, cos, sin, numerics), None
    return draft_block(params, cfg, context, anchor, first_ids, numerics, forced_gate, forced_prev)


def draft_block(params: dict, cfg: ModelConfig, context, anchor: jax.Array, first_ids: jax.Array,
                numerics: Numerics, forced_gate: dict | None = None, forced_prev: jax.Array | None = None) -> Draft:
    numerics = numerics.for_model(cfg.quantized)
    b, blk = first_ids.shape[0], cfg.dspark_block_size
    ids = jnp.full((b, blk), cfg.dspark_noise_token_id, first_ids.dtype).at[:, 0].set(first_ids)
    x = embed(params, ids, cfg.hc_mult, numerics)
    pre = one_hot_pre((b, blk), cfg.hc_mult)
    gate_idx, gate_scores, collapsed = {}, {}, None
    for m, p in enumerate(params["mtp"]):
        layer = cfg.n_layers + m
        ctx_kv, ctx_idx = context(m, p)

        def attend(h, p=p, ctx_kv=ctx_kv, ctx_idx=ctx_idx):
            return draft_attention(p["attn"], cfg, h, ctx_kv, anchor, numerics, ctx_idx=ctx_idx), None

        out = block(p, cfg, layer, x, pre, attend, numerics,
                    forced_gate=None if forced_gate is None else forced_gate.get(layer), collapsed=collapsed)
        x, pre, collapsed = out.x, out.pre, out.collapsed
        gate_idx[layer], gate_scores[layer] = out.gate_idx, out.gate_scores
    last = params["mtp"][-1]
    hd = collapsed.c                                       # pre-norm draft hidden: x collapsed by pre
    base = lm_head(params["head"]["weight"], rms_norm(hd, last["norm"]["weight"], cfg.norm_eps, numerics,
                                                      collapsed.c_sumsq))
    out_ids, logits, markov = _markov_chain(last, base, first_ids, forced_prev)
    confidence = lin_f32(jnp.concatenate([hd, markov.astype(hd.dtype)], -1),
                         last["confidence_head"]["proj"]["weight"])[..., 0]
    return Draft(out_ids, logits, confidence, hd, gate_idx, gate_scores)
