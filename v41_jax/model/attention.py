"""The attention sublayer (docs/MODEL.md §3.4, §3.8) for the full-sequence forward, all four CSA2
modes, and the DSpark draft attention (docs/MODEL.md §5.3).

The compressed branch shares work down the stack: a FULL layer publishes its compressed rows and
index keys, an index source its selection, the candidate source its blocks. `AttnContext` carries
them; the caller threads it through the layers (it also is what the checker records). Every layer
reads the rows and index keys of its own kv owner (the prefill-consistent semantics, docs/MODEL.md §3.8).

API (B batch, S sequence from position 0, D model width, H x Dh heads, K = min(index_topk, S // r))
  AttnContext(rows, keys, selected, candidates)   dicts keyed by the owning layer:
      rows[kv_owner]         [B, S//r, Dh]  compressed KV rows (RoPE'd at r*j, fp4 QDQ)
      keys[kv_owner]         [B, S//r, Di]  index keys
      selected[topk_owner]   [B, S, K]      compressed row ids, ascending, -1 past visible
      candidates[source]     [B, S, Kb]     candidate block ids, ascending, -1 for dropped picks
  empty_context() -> AttnContext
  full_attention(p, cfg, topo, h, ctx, numerics) -> (out [B, S, D], ctx, record)
      p = params["layers"][l]["attn"], topo = resolve_topology(cfg)[l], h = attn_norm output,
      ctx = the context so far (None or empty at the first layer). record: this layer's own
      choices: index sources {"index_topk": [B, S, K], "index_scores": [B, S, S//r] (the scores
      it selected from: -inf past visible and, for candidate consumers, outside the blocks)},
      the candidate source also {"candidate_blocks": [B, S, Kb]}.
  query(p, cfg, h, cos, sin, numerics) -> (c_q [B, T, Q], q [B, T, H, Dh])
  window_kv(p, cfg, h, cos, sin, numerics) -> [B, T, Dh]   kv_norm(Lin8(h, wkv)) -> RoPE -> fp8 QDQ:
      the window cache row (and, on a draft stage's params, its context row from main_x).
  output_proj(p, cfg, o, cos, sin, numerics) -> [B, T, D]  inverse RoPE, grouped wo_a, wo_b.
  draft_attention(p, cfg, x, ctx_kv, anchor, numerics, *, ctx_idx=None) -> [B, blk, D]
      a draft stage's attention: every block row sees the context rows (anchor - window, anchor]
      and all block rows.
  (cos, sin come from rope.rope_cos_sin at the rows' positions, the layer's table.)

The compressed-branch rules, shared with the cached step (`runtime.step`), which differs only in
where keys come from and where rows go (cache pages instead of the context):
  compressed_entries(p, cfg, ratio, latent, row_ids, numerics) -> (rows, keys)
      what a FULL layer publishes for compressed latents [..., G, Dh] at row ids [..., G]: the
      stored KV rows and their index keys.
  index_select(p, cfg, topo, h, c_q, positions, visible, score, candidates, numerics)
      -> (selected [..., Q, K], scores [..., Q, N], candidates)
      an index source's rule: its query and head weights, score(q, w) over the kv owner's keys
      (the caller's key source, -inf past `visible` [..., Q]), the candidate source's blocks
      published into `candidates` (a dict by source layer), a consumer's scores masked to them,
      then the top-k.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from v41_jax.config import ModelConfig
from v41_jax.model.compressor import compress, init_state, stored_rows
from v41_jax.model.indexer import (candidate_blocks, candidate_mask, index_keys, index_query, index_scores,
                                   index_weights, select_topk, visible_rows)
from v41_jax.model.linear import lin8, lin_grouped
from v41_jax.model.norm import rms_norm
from v41_jax.model.numerics import Numerics
from v41_jax.model.rope import apply_rope, rope_cos_sin
from v41_jax.model.sparse_attn import sparse_attn
from v41_jax.model.window import draft_context_idx, window_idx
from v41_jax.quant import KV_FP8_GROUP, fp8_act_qdq
from v41_jax.topology import Candidates, LayerTopology, Mode



class AttnContext(NamedTuple):
    rows: dict
    keys: dict
    selected: dict
    candidates: dict


def empty_context() -> AttnContext:
    return AttnContext({}, {}, {}, {})


def _heads(cos: jax.Array, sin: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per-row angles [..., T, R/2] -> broadcastable over a head axis."""
    return cos[..., None, :], sin[..., None, :]


def query(p: dict, cfg: ModelConfig, h: jax.Array, cos: jax.Array, sin: jax.Array,
          numerics: Numerics) -> tuple[jax.Array, jax.Array]:
    c_q = rms_norm(lin8(h, p["wq_a"]["weight"], numerics), p["q_norm"]["weight"], cfg.norm_eps, numerics)
    q = lin8(c_q, p["wq_b"]["weight"], numerics)
    q = q.reshape(*q.shape[:-1], cfg.n_heads, cfg.head_dim)
    return c_q, apply_rope(q, *_heads(cos, sin), in_place=True)


def window_kv(p: dict, cfg: ModelConfig, h: jax.Array, cos: jax.Array, sin: jax.Array,
              numerics: Numerics) -> jax.Array:
    kv = rms_norm(lin8(h, p["wkv"]["weight"], numerics), p["kv_norm"]["weight"], cfg.norm_eps, numerics)
    kv = apply_rope(kv, cos, sin)
    # the whole row, RoPE lanes included
    return fp8_act_qdq(kv, KV_FP8_GROUP) if numerics.fake_quant else kv


def output_proj(p: dict, cfg: ModelConfig, o: jax.Array, cos: jax.Array, sin: jax.Array,
                numerics: Numerics) -> jax.Array:
    # K = V carries RoPE: rotating back by the query's angle leaves a position-free output
    o = apply_rope(o, *_heads(cos, sin), inverse=True, in_place=True)
    g = cfg.o_groups
    o = o.reshape(*o.shape[:-2], g, -1)                                  # [B, T, G, H/G * Dh]
    u = lin_grouped(o, p["wo_a"]["weight"], g, numerics)                 # [B, T, G, R]
    return lin8(u.reshape(*u.shape[:-2], -1), p["wo_b"]["weight"], numerics)


def _publish(table: dict, layer: int, value: jax.Array) -> dict:
    return {**table, layer: value}


def compressed_entries(p: dict, cfg: ModelConfig, ratio: int, latent: jax.Array, row_ids: jax.Array,
                       numerics: Numerics) -> tuple[jax.Array, jax.Array]:
    """A FULL layer's compressed latents -> (stored KV rows, index keys), both from the pre-RoPE
    latent at the group's row id."""
    return (stored_rows(cfg, ratio, latent, row_ids, numerics),
            index_keys(p["indexer"], cfg, latent, row_ids, ratio, numerics))


def index_select(p: dict, cfg: ModelConfig, topo: LayerTopology, h: jax.Array, c_q: jax.Array,
                 positions: jax.Array, visible: jax.Array, score: Callable[[jax.Array, jax.Array], jax.Array],
                 candidates: dict, numerics: Numerics) -> tuple[jax.Array, jax.Array, dict]:
    """FULL / REINDEX: own indexer over the kv owner's keys; the candidate source publishes its
    blocks from the unrestricted scores, later scorers keep only rows inside them.
    -> (the top-k, the scores it was taken from, candidates)."""
    scores = score(index_query(p["indexer"], cfg, c_q, positions, numerics),
                   index_weights(p["indexer"], cfg, h, numerics))
    # one materialised copy feeds the candidate blocks, the top-k and the recorded scores: XLA
    # would otherwise recompute the scores inside each consumer's fusion, whose fp contraction can
    # differ in the last bit, and an exact tie that the reference breaks to the lower block could
    # then go to the higher one (seen through the cache path on farm v4, prefill row 22, L5)
    scores = jax.lax.optimization_barrier(scores)
    if topo.candidates is Candidates.PRODUCE:
        blocks = candidate_blocks(scores, visible, cfg.candidate_topk_blocks, cfg.candidate_block_size)
        candidates = _publish(candidates, topo.layer, blocks)
    elif topo.candidates is Candidates.CONSUME:
        # the reference's rule: mask the full scan to the kept blocks (not a compacted scorer,
        # whose picks differ when fewer than k kept rows are visible)
        keep = candidate_mask(candidates[cfg.candidate_source_layer], scores.shape[-1], cfg.candidate_block_size)
        scores = jnp.where(keep, scores, -jnp.inf)
    return select_topk(scores, visible, cfg.index_topk), scores, candidates


def _compress(p: dict, cfg: ModelConfig, topo: LayerTopology, h: jax.Array, ctx: AttnContext,
              numerics: Numerics) -> AttnContext:
    """FULL: the rows of every complete group, and their index keys."""
    b, s, _ = h.shape
    r = topo.ratio
    state = None if r == 1 else init_state(b, r, cfg.head_dim)
    latent, row_ids, _ = compress(p["compressor"], cfg, r, h, state, jnp.zeros(b, jnp.int32), numerics)
    rows, keys = compressed_entries(p, cfg, r, latent[:, : s // r], row_ids[:, : s // r], numerics)
    return ctx._replace(rows=_publish(ctx.rows, topo.layer, rows), keys=_publish(ctx.keys, topo.layer, keys))


def _select(p: dict, cfg: ModelConfig, topo: LayerTopology, h: jax.Array, c_q: jax.Array,
            positions: jax.Array, ctx: AttnContext, numerics: Numerics) -> tuple[AttnContext, jax.Array]:
    """`index_select` over the context's keys of the kv owner -> (ctx, the scores selected from)."""
    visible = jnp.broadcast_to(visible_rows(positions, topo.ratio), h.shape[:2])
    keys = ctx.keys[topo.kv_owner]
    sel, scores, candidates = index_select(p, cfg, topo, h, c_q, positions, visible,
                                           lambda q, w: index_scores(q, keys, w, visible, numerics),
                                           ctx.candidates, numerics)
    return ctx._replace(selected=_publish(ctx.selected, topo.layer, sel), candidates=candidates), scores


def _record(topo: LayerTopology, ctx: AttnContext, scores: jax.Array | None) -> dict:
    """What this layer chose, for the checker (unused entries cost nothing under jit)."""
    aux = {}
    if scores is not None:
        aux["index_topk"], aux["index_scores"] = ctx.selected[topo.layer], scores
    if topo.candidates is Candidates.PRODUCE and topo.layer in ctx.candidates:  # (a scanned layer's id is traced)
        aux["candidate_blocks"] = ctx.candidates[topo.layer]
    return aux


def full_attention(p: dict, cfg: ModelConfig, topo: LayerTopology, h: jax.Array, ctx: AttnContext | None,
                   numerics: Numerics) -> tuple[jax.Array, AttnContext, dict]:
    ctx = ctx or empty_context()  # the first layer may pass None or {}
    b, s, _ = h.shape
    positions = jnp.arange(s)
    cos, sin = rope_cos_sin(cfg, positions, global_table=topo.rope_global)
    c_q, q = query(p, cfg, h, cos, sin, numerics)
    kv = window_kv(p, cfg, h, cos, sin, numerics)                         # [B, S, Dh], row i = position i
    w = min(s, cfg.window_size)
    idx = jnp.broadcast_to(window_idx(positions, cfg.window_size, w), (b, s, w))
    scores = None
    # no complete group yet: the reference attends over the window alone
    if topo.mode is not Mode.WINDOW and s // topo.ratio:
        if topo.mode is Mode.FULL:
            ctx = _compress(p, cfg, topo, h, ctx, numerics)
        if topo.scores:
            ctx, scores = _select(p, cfg, topo, h, c_q, positions, ctx, numerics)
        sel = ctx.selected[topo.topk_owner]
        # the compressed rows follow the window rows in one list, ids offset by its length
        kv = jnp.concatenate([kv, ctx.rows[topo.kv_owner]], axis=1)
        idx = jnp.concatenate([idx, jnp.where(sel >= 0, sel + s, -1)], axis=-1)
    o = sparse_attn(q, kv, p["attn_sink"], idx, cfg.head_dim ** -0.5, numerics=numerics)
    return output_proj(p, cfg, o, cos, sin, numerics), ctx, _record(topo, ctx, scores)


def draft_attention(p: dict, cfg: ModelConfig, x: jax.Array, ctx_kv: jax.Array, anchor: jax.Array,
                    numerics: Numerics, *, ctx_idx: jax.Array | None = None) -> jax.Array:
    """x [B, blk, D] (attn_norm output of the draft rows, positions anchor+1 .. anchor+blk),
    ctx_kv [B, Nc, Dh] this stage's context rows (window_kv of main_x), anchor [B] the last position
    the target processed. ctx_idx [B, Kc]: the rows of ctx_kv the block sees, valid ones first then
    -1; by default the linear layout (row i = position i) in the reference's ring-slot order; a
    ring-resident context passes its own. No causal mask inside the block. Window RoPE table."""
    b, blk, _ = x.shape
    if ctx_idx is None:
        ctx_idx = draft_context_idx(anchor, cfg.window_size)
    cos, sin = rope_cos_sin(cfg, anchor[:, None] + 1 + jnp.arange(blk), global_table=False)
    _, q = query(p, cfg, x, cos, sin, numerics)
    kv = jnp.concatenate([ctx_kv, window_kv(p, cfg, x, cos, sin, numerics)], axis=1)
    # the block rows directly after the valid context entries, as the reference lists them
    n_ctx = (ctx_idx >= 0).sum(-1, keepdims=True)
    col = jnp.arange(ctx_idx.shape[-1] + blk)
    listed = jnp.pad(ctx_idx, ((0, 0), (0, blk)), constant_values=-1)
    block_rows = jnp.where(col < n_ctx + blk, ctx_kv.shape[1] + col - n_ctx, -1)
    idx = jnp.where(col < n_ctx, listed, block_rows).astype(jnp.int32)
    o = sparse_attn(q, kv, p["attn_sink"], jnp.broadcast_to(idx[:, None], (b, blk, idx.shape[-1])),
                    cfg.head_dim ** -0.5, numerics=numerics)
    return output_proj(p, cfg, o, cos, sin, numerics)
