"""The jitted step: `step(params, cache, batch) -> StepOutput` (cache, sampled tokens, ...), cache donated.

One forward over a flat, bucket-shaped batch of token rows from several requests (chunked prefill
of any length, single-token decode, or both mixed), reading and writing the CSA2 cache in place.
It is the full forward (`v41_jax.model.forward`) with every piece of context the forward computes
from the whole sequence read from the cache instead:

* window rows: a query at position x attends to positions max(0, x-W+1)..x; those before its
  span's first position come from the slot's ring (written by earlier steps), the rest from this
  step's own rows. The ring is written after every layer's attention has read it (each request's
  last W+S rows only), in prefill and decode alike: a decode row reads its own new row from this
  step's rows rather than from the ring, which is the same value, so one ordering serves every
  batch composition and a chunk wider than the ring still reads the old ring;
* compressed rows (FULL layers): each group completed in this step pools its r raw projections,
  the leading ones from the compressor ring when the group straddles the span start; the rows and
  index keys go to the owner's pages before any scorer reads them (REUSE/REINDEX layers later in
  the stack see them); the span's last max_r + S projections go to the ring for the next step;
* scores: each query scores its own request's index keys through the paged scorer
  (`kernels_pallas.indexer.index_scores_tokens`, keys read via the block table), visible columns
  only, then the same candidate / top-k cores as the forward.

Attention: the window list (ring rows of this step's requests, then this step's rows), then the
kv owner's compressed rows; on the Pallas backend two paged sources of
`kernels_pallas.sparse_attn.sparse_attn_paged` (compressed rows read in place from the page
plane), on XLA one list per query in the reference's column layout (see `_attend`).

The Engram cursor rows the host computed are written exactly once, at the end (docs/CACHE.md §2.5,
INV-3; the model never reads them). Every scatter drops its padding rows through an out-of-range
index (slot N, page P), never a negative one that would wrap onto a live row (docs/CACHE.md INV-6).
"""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

import jax
import jax.numpy as jnp

from kernels_pallas import backend as kernel_backend
from kernels_pallas.indexer import index_scores_tokens
from kernels_pallas.sparse_attn import decode_rows, sparse_attn_paged
from v41_jax.cache.buffer import DEAD, Cache
from v41_jax.checkpoint.load import ENGRAM_DEVICE_KEY
from v41_jax.cache.geometry import INDEX_PACKED, KV_PACKED, CacheGeometry, typed_format
from v41_jax.config import ModelConfig
from v41_jax.engram_hash import device_bucket_ids, device_lookback
from v41_jax.model.attention import compressed_entries, index_select, output_proj, query, window_kv
from v41_jax.model.compressor import compress, group_latent, init_state, packed_stored_rows, pool_groups, projections
from v41_jax.model.dspark import context_x, draft_block
from v41_jax.model.forward import embed, force_picks, run_layers
from v41_jax.model.head import final_hidden, lm_head
from v41_jax.model.mhc import one_hot_pre
from v41_jax.model.numerics import Numerics
from v41_jax.model.rope import rope_cos_sin
from v41_jax.model.sparse_attn import sparse_attn
from v41_jax.model.window import draft_context_idx
from v41_jax.quant import dequant_fp8_rows, pack_fp4_ue8m0_rows, pack_fp8_ue8m0_rows
from v41_jax.runtime.metadata import StepBatch
from v41_jax.runtime.packed import BatchLayout, PackedBatch
from v41_jax.runtime.sampling import Draws, draws, pick, verify_drafts
from v41_jax.topology import Candidates, LayerTopology, Mode



class StepState(NamedTuple):
    """What flows down the stack inside one step: the cache and this forward's memos."""
    cache: Cache
    selected: dict      # topk owner layer -> [T, K] compressed ids, ascending, -1 padded
    candidates: dict    # candidate source layer -> [T, 1, Kb] block ids (the scorer's query axis kept)


def _drop(valid: jax.Array, index: jax.Array, bound: int) -> jax.Array:
    """A scatter index that sends invalid rows out of range (dropped, never wrapped)."""
    return jnp.where(valid, index, bound)


def _window_source(window: jax.Array, layer: int, kv: jax.Array, batch: StepBatch,
                   w: int) -> tuple[jax.Array, jax.Array]:
    """(rows, idx [T, W]): rows = the ring rows of this step's requests, then this step's rows.

    idx follows the reference's column layout (it fixes which rows share an online-softmax chunk):
    a span starting at position 0 lists its window left-packed (the prefill matrix), any other
    span right-aligned with the holes first (the decode ring, oldest slot first).
    """
    r, ring = batch.slots.shape[0], window.shape[2]
    rows = jnp.concatenate([window[batch.slots, layer].reshape(r * ring, -1), _window_rows(kv, window.dtype)])
    pos, req = batch.positions, batch.token_req
    b = jnp.maximum(req, 0)
    n_valid = jnp.minimum(pos + 1, w)
    shift = jnp.where(batch.req_pos[b] == 0, 0, w - n_valid)[:, None]
    k = jnp.arange(w) - shift                                           # [T, W] entry, oldest = 0
    j = (pos - n_valid + 1)[:, None] + k                                # its position
    ok = (k >= 0) & (k < n_valid[:, None]) & (req[:, None] >= 0)
    t = jnp.arange(pos.shape[0])[:, None]
    from_ring = j < batch.req_pos[b][:, None]
    idx = jnp.where(from_ring, b[:, None] * ring + j % ring, r * ring + t - (pos[:, None] - j))
    return rows, jnp.where(ok, idx, -1)


def _read_before_write(rows: jax.Array, ring: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The ring rows a layer read, and the ring to write: the write depends on the read, so the
    scatter runs in place after it. With no such order XLA:GPU copied the [N, L_win, W+S, D]
    rings whole, three times a decode step on the bench slice (0.073 ms at b=8; BENCHMARKS.md,
    2026-12-04 c)."""
    return jax.lax.optimization_barrier((rows, ring))


def _write_window(window: jax.Array, layer: int, kv: jax.Array, batch: StepBatch) -> jax.Array:
    """This step's rows into `layer`'s ring, every span's last W + S rows, rejected drafts included:
    a ring holds S rows past the W a later query reads, so a rejected row only ever lands on a
    position no later query reads and is rewritten before any does (docs/CACHE.md §4.1)."""
    t, slot, row = batch.window_writes.T
    slot = _drop(t >= 0, slot, window.shape[0])
    return window.at[slot, layer, row].set(_window_rows(kv[t], window.dtype), mode="drop")


def _window_rows(kv: jax.Array, ring_dtype) -> jax.Array:
    """Window rows [T, Dh] -> rows of the ring: typed as they are; packed FP8 rows, exact because
    `check_row_formats` admits packed rows only under fake-quant numerics (rows on the fp8 grid)."""
    if ring_dtype == jnp.uint8:
        return pack_fp8_ue8m0_rows(kv)
    return kv.astype(ring_dtype)


def _page_rows(batch: StepBatch, b: jax.Array, c: jax.Array, rows_per_page: int) -> tuple[jax.Array, jax.Array]:
    """(page, row in page) of compressed id c of request row b."""
    return batch.block_tables[b, c // rows_per_page], c % rows_per_page


def _group_inputs(raw: jax.Array, ring: jax.Array, plan: jax.Array, batch: StepBatch, ring_owner: int,
                  ratio: int) -> jax.Array:
    """The r raw projections of each planned group -> [C, r, Dh]: a group's leading inputs that
    precede its span come from the slot's compressor ring, the others from this step's rows."""
    t, b, x, n_ring = plan.T
    k = jnp.arange(ratio)
    pos = x[:, None] - ratio + 1 + k                                    # [C, r] group positions
    from_ring = k < n_ring[:, None]
    ring_rows = ring[batch.slots[b][:, None], ring_owner, pos % ring.shape[2]]
    step_rows = raw[t[:, None] - (ratio - 1 - k)]
    return jnp.where(from_ring[..., None], ring_rows, step_rows)


def _compress_and_store(p: dict, cfg: ModelConfig, geom: CacheGeometry, topo: LayerTopology,
                        h: jax.Array, batch: StepBatch, cache: Cache, numerics: Numerics) -> Cache:
    """FULL layer: every group this step completes -> its compressed row and index key in the
    owner's pages; then the span's newest raw projections into the compressor ring."""
    r, k = topo.ratio, geom.owner_index(topo.layer)
    plan = batch.compress_plans[geom.ratios.index(r)]
    t, b, x, _ = plan.T
    valid = b >= 0
    if r == 1:  # one token per group: the forward's latent of each planned token
        latent, _, _ = compress(p["compressor"], cfg, 1, h[None], None, jnp.zeros(1, jnp.int32), numerics)
        latent = latent[0, t]
    else:  # compressor.compress, its groups' inputs gathered from the ring and this step's rows
        raw_kv, raw_score = projections(p["compressor"], h)                # [T, Dh] fp32
        j = geom.ring_index(topo.layer)
        g_kv = _group_inputs(raw_kv, cache.comp_kv, plan, batch, j, r)
        g_score = _group_inputs(raw_score, cache.comp_score, plan, batch, j, r)
        pooled, _, _ = pool_groups(g_kv, g_score, init_state(plan.shape[0], r, cfg.head_dim), x - r + 1, r)
        latent = group_latent(p["compressor"], cfg, pooled[:, 0], numerics)
        wt, slot, row = batch.ring_writes.T
        slot = _drop(wt >= 0, slot, cache.comp_kv.shape[0])
        cache = replace(cache, comp_kv=cache.comp_kv.at[slot, j, row].set(raw_kv[wt], mode="drop"),
                        comp_score=cache.comp_score.at[slot, j, row].set(raw_score[wt], mode="drop"))
    c = x // r
    stored, keys = (a[0] for a in compressed_entries(p, cfg, r, latent[None], c[None], numerics))
    if cache.main[k].dtype == jnp.uint8:   # the round trip's own codes (re-quantizing is not exact)
        stored = packed_stored_rows(cfg, r, latent, c)
    page, row = _page_rows(batch, b, c, geom.owners[k].rows_per_page)
    page = _drop(valid, page, geom.settings.num_pages)
    main = cache.main[k].at[page, row].set(stored.astype(cache.main[k].dtype), mode="drop")
    index = cache.index[k].at[page, row].set(_index_rows(keys, cache.index[k].dtype), mode="drop")
    return replace(cache, main=_swap(cache.main, k, main), index=_swap(cache.index, k, index))


def _index_rows(keys: jax.Array, plane_dtype) -> jax.Array:
    """Index keys [T, Di] -> rows of the plane: typed as they are; packed FP4 rows, exact because
    `check_row_formats` admits packed planes only under fake-quant numerics (keys on the fp4 grid)."""
    if plane_dtype == jnp.uint8:
        return pack_fp4_ue8m0_rows(keys)
    return keys.astype(plane_dtype)


def _swap(arrays: tuple, k: int, new: jax.Array) -> tuple:
    return arrays[:k] + (new,) + arrays[k + 1:]


def _select(p: dict, cfg: ModelConfig, geom: CacheGeometry, topo: LayerTopology, h: jax.Array,
            c_q: jax.Array, batch: StepBatch, state: StepState, numerics: Numerics) -> tuple[StepState, dict]:
    """FULL / REINDEX: `index_select` over the kv owner's index keys of each query's own request
    (visible columns only) -> (state, this layer's picks and scores {kind: [1, T, ...]})."""
    key_pages = state.cache.index[geom.owner_index(topo.kv_owner)]
    visible = batch.visible[geom.ratios.index(topo.ratio)][:, None]        # [T, 1]
    # one query a block (`query_block=1`): blocks of a request's consecutive tokens, which read a key
    # tile once a block, measured slower on the H200 (BENCHMARKS.md, 2026-12-05)
    req = jnp.maximum(batch.token_req, 0)
    score = lambda q, w: index_scores_tokens(q, w, key_pages, batch.block_tables, req, visible[:, 0],
                                             numerics=numerics)[:, None]   # [T, 1, M*rpp]
    selected, scores, candidates = index_select(p, cfg, topo, h, c_q, batch.positions, visible, score,
                                                state.candidates, numerics)
    selected = selected[:, 0]
    picks = {"index_topk": selected[None], "index_scores": scores[:, 0][None]}
    if topo.candidates is Candidates.PRODUCE:
        picks["candidate_blocks"] = candidates[topo.layer][:, 0][None]
    return state._replace(selected={**state.selected, topo.layer: selected}, candidates=candidates), picks


def _compressed_source(main: jax.Array, selected: jax.Array, batch: StepBatch) -> tuple[jax.Array, jax.Array]:
    """(the owner's page plane as flat rows, each query's selected ids as flat row ids)."""
    pages, rpp = main.shape[0], main.shape[1]
    b = jnp.maximum(batch.token_req, 0)[:, None]
    page, row = _page_rows(batch, b, jnp.maximum(selected, 0), rpp)
    ok = (selected >= 0) & (batch.token_req[:, None] >= 0)
    return main.reshape(pages * rpp, -1), jnp.where(ok, page * rpp + row, -1)


def _attend(q: jax.Array, sink: jax.Array, window: tuple, compressed: tuple | None, batch: StepBatch,
            cfg: ModelConfig, numerics: Numerics) -> jax.Array:
    """Sparse attention over the window list, then the compressed list. q [1, T, H, Dh].

    Pallas: the two lists are two paged sources (rows read in place; each list starts a chunk).
    XLA: one list per query laid out as the reference lays out its concatenation, so the chunked
    online softmax rounds at the same points: the compressed part starts right after the window
    part, at column min(span length, W) for a span at position 0 (the reference's prefill) and
    W otherwise (its decode). The XLA path gathers every listed row either way.
    """
    scale = cfg.head_dim ** -0.5
    if compressed is None:
        return sparse_attn_paged(q, sink, [window], scale, numerics=numerics)
    if kernel_backend.resolve() == "pallas":
        return sparse_attn_paged(q, sink, [window, compressed], scale, numerics=numerics)
    (w_rows, w_idx), (c_rows, c_idx) = window, compressed
    w, k = w_idx.shape[1], c_idx.shape[1]
    b = jnp.maximum(batch.token_req, 0)
    start = jnp.where(batch.req_pos[b] == 0, jnp.minimum(batch.req_len[b], w), w)[:, None]
    d, dt = q.shape[-1], q.dtype
    kv = jnp.concatenate([decode_rows(w_rows[jnp.maximum(w_idx, 0)], d, dt),
                          decode_rows(c_rows[jnp.maximum(c_idx, 0)], d, dt)], axis=1)
    col = jnp.arange(w + k)
    w_ok = jnp.pad(w_idx, ((0, 0), (0, k)), constant_values=-1) >= 0            # holes stay holes
    c_ok = jnp.take_along_axis(c_idx, jnp.clip(col - start, 0, k - 1), axis=1) >= 0
    idx = jnp.where((col < start) & w_ok, col,
                    jnp.where((col >= start) & (col - start < k) & c_ok, w + col - start, -1))
    o = sparse_attn(q[0][:, None], kv, sink, idx[:, None], scale, numerics=numerics)  # one query per row
    return o[:, 0][None]


def cached_attention(p: dict, cfg: ModelConfig, geom: CacheGeometry, topo: LayerTopology, h: jax.Array,
                     batch: StepBatch, state: StepState, numerics: Numerics,
                     forced: dict | None = None) -> tuple[jax.Array, tuple[StepState, dict]]:
    """One layer's attention sublayer over the cache. h [1, T, D] (attn_norm output) ->
    ([1, T, D], (state, this layer's own picks {kind: [1, T, ...]}))."""
    cos, sin = rope_cos_sin(cfg, batch.positions, global_table=topo.rope_global)
    c_q, q = query(p, cfg, h, cos, sin, numerics)                                  # [1, T, Q], [1, T, H, Dh]
    kv = window_kv(p, cfg, h, cos, sin, numerics)[0]                               # [T, Dh]
    w_rows, w_idx = _window_source(state.cache.window, topo.layer, kv, batch, cfg.window_size)
    w_rows, ring = _read_before_write(w_rows, state.cache.window)
    window = (w_rows, w_idx)
    compressed, picks = None, {}
    if topo.mode is not Mode.WINDOW:
        if topo.mode is Mode.FULL:
            state = state._replace(cache=_compress_and_store(p, cfg, geom, topo, h[0], batch, state.cache,
                                                             numerics))
        if topo.scores:
            state, picks = _select(p, cfg, geom, topo, h[0], c_q[0], batch, state, numerics)
            if forced:  # the published picks become the forced ones; the recorded stay the layer's own
                candidates, selected = force_picks(state.candidates, state.selected, topo.layer, forced)
                state = state._replace(candidates=candidates, selected=selected)
        main = state.cache.main[geom.owner_index(topo.kv_owner)]
        compressed = _compressed_source(main, state.selected[topo.topk_owner], batch)
    o = _attend(q, p["attn_sink"], window, compressed, batch, cfg, numerics)
    cache = replace(state.cache, window=_write_window(ring, topo.layer, kv, batch))
    return output_proj(p, cfg, o, cos, sin, numerics), (state._replace(cache=cache), picks)


class StepOutput(NamedTuple):
    """What one step returns (one type whatever the flags). Only `tokens`, `found`, when a
    request asks, `logprobs`, and when one speculates, `accepted` / `drafts` leave the device in
    the generation loop."""
    cache: Cache
    tokens: jax.Array        # int32 [O] the token sampled from each logits row
    logprobs: jax.Array      # fp32 [O] its log-probability under the unmodified softmax
    found: jax.Array         # int32 [R] each request row's slot cursor position as this step read it (-1 pad)
    logits: jax.Array        # fp32 [O, V]
    inter: dict | None       # per-token-row intermediates (record=True), else None
    accepted: jax.Array      # int32 [R] drafts each verify span accepted (0 for other spans)
    drafts: jax.Array        # int32 [R, blk] the block drafted after this step ([R, 0] not speculating)


def _resolve_pending(params: dict, cfg: ModelConfig, geom: CacheGeometry, cache: Cache,
                     batch: StepBatch) -> StepBatch:
    """The batch with its pending spans (`Span.pending`) filled in from their slots' state: a
    pending span starts at its slot's committed cursor position, its first token is the slot's
    `sampled` (the token the previous step sampled for it, which the host has not read yet), a
    verify span's drafts the block the previous step drafted after it (also in `sampled`), and
    everything that follows from positions and tokens is computed here by the same rules the host
    uses (runtime/metadata.py): positions, visible columns, the compress-plan rows it reserved,
    ring rows, its Engram ids (hashed from the cursor's history and the span's own tokens, rows
    gathered from the tables' device copy) and its cursors. So the host never needs the previous
    step's outputs to launch the next one, and a step of pending spans only takes a batch that
    does not change from step to step. Other rows are returned as the host built them."""
    t_cap = batch.tokens.shape[0]
    pend, pend_req = batch.pending, batch.pending_req
    cur = jnp.take(cache.cursor, batch.slots, axis=0, mode="fill", fill_value=0)         # [R, H + 1]
    req = jnp.maximum(batch.token_req, 0)
    rows = jnp.arange(t_cap)
    j = rows - batch.req_offset[req]                                                     # row in its span
    fed = jnp.take(cache.sampled, batch.slots, axis=0, mode="fill", fill_value=0)        # [R, 1 + blk]
    tokens = jnp.where(pend, fed[req, jnp.clip(j, 0, fed.shape[1] - 1)], batch.tokens)
    req_pos = jnp.where(pend_req, cur[:, 0], batch.req_pos)
    positions = jnp.where(pend, req_pos[req] + j, batch.positions)

    def plan(p: jax.Array, r: int) -> jax.Array:
        # a pending span's e-th reserved row (on its e-th token row) is its e-th completed group
        t, b, x, n = p.T
        mine = (t >= 0) & pend[jnp.maximum(t, 0)]
        bb = jnp.maximum(b, 0)
        start, off = req_pos[bb], batch.req_offset[bb]
        gx = start + jnp.remainder(r - 1 - start, r) + (t - off) * r                     # its last position
        ok = gx < start + batch.req_len[bb]
        new = jnp.stack([off + gx - start, b, gx, jnp.maximum(0, start - (gx - r + 1))], axis=1)
        return jnp.where((mine & ok)[:, None], new, jnp.where(mine[:, None], -1, p))

    def ring_rows(w: jax.Array, ring: int) -> jax.Array:
        t, slot, row = w.T
        mine = (t >= 0) & pend[jnp.maximum(t, 0)]
        return jnp.stack([t, slot, jnp.where(mine, positions[jnp.maximum(t, 0)] % max(ring, 1), row)], axis=1)

    # Engram: lookback slot s of row j is the span's own token j - s, or the cursor's history
    # before the span (oldest first, so entry H - (s - j)); the cursor after m rows is the
    # position + m and the last H ids of history ++ the span's ids.
    h = geom.history
    dev = params.get(ENGRAM_DEVICE_KEY)
    codes, scales = batch.engram_codes, batch.engram_scales
    comp = jnp.full((t_cap,), DEAD, jnp.int32) if dev is None else dev["consts"]["token_map"][tokens]
    if dev is not None and cfg.engram_layer_ids:
        s = jnp.arange(h + 1)[None, :]
        own = comp[jnp.clip(rows[:, None] - s, 0, t_cap - 1)]
        before = cur[:, 1:][req[:, None], jnp.clip(h - (s - j[:, None]), 0, h - 1)]
        lookback = device_lookback(dev["consts"], jnp.where(s <= j[:, None], own, before), positions)
        ids = device_bucket_ids(dev["consts"], lookback, cfg.engram_n_heads)              # [T, L, cols]
        fill = lambda tables, held: tuple(jnp.where(pend[:, None, None], w[ids[:, i]], c)
                                          for i, (w, c) in enumerate(zip(tables, held)))
        codes, scales = fill(dev["weight"], codes), fill(dev["scale"], scales)
    width = batch.spec_cursors.shape[1]
    span = comp[jnp.minimum(batch.req_offset[:, None] + jnp.arange(width + 1), t_cap - 1)]   # [R, width + 1]
    ext = jnp.concatenate([cur[:, 1:], span], axis=1)

    spec_after = jnp.stack([_cursor_after(cur, ext, jnp.full_like(batch.req_len, i + 1), h)
                            for i in range(width)], axis=1)                              # after rows 0..i
    return replace(batch, tokens=tokens, positions=positions, req_pos=req_pos,
                   visible=tuple(jnp.where(pend, (positions + 1) // r, v) for r, v in zip(geom.ratios, batch.visible)),
                   compress_plans=tuple(plan(p, r) for r, p in zip(geom.ratios, batch.compress_plans)),
                   window_writes=ring_rows(batch.window_writes, geom.ring_slots),
                   ring_writes=ring_rows(batch.ring_writes, geom.comp_ring),
                   engram_codes=codes, engram_scales=scales,
                   cursor_rows=jnp.where(pend_req[:, None], _cursor_after(cur, ext, batch.req_len, h),
                                         batch.cursor_rows),
                   spec_cursors=jnp.where(pend_req[:, None, None], spec_after, batch.spec_cursors))


def _cursor_after(cur: jax.Array, ext: jax.Array, m: jax.Array, h: int) -> jax.Array:
    """[R, H + 1] each request's cursor once m [R] more rows are committed: position + m, and the
    last H compressed ids of ext [R, H + width + 1] (the cursor's history, then the span's ids)."""
    hist = jnp.take_along_axis(ext, m[:, None] + jnp.arange(h)[None, :], axis=1)
    return jnp.concatenate([cur[:, :1] + m[:, None], hist], axis=1).astype(cur.dtype)


def step(params: dict, cache: Cache, batch: StepBatch, forced: dict | None = None, *, cfg: ModelConfig,
         geom: CacheGeometry, numerics: Numerics, record: bool = False, speculative: bool = False) -> StepOutput:
    """One forward over the batch, the cache read and written in place, and the next token of every
    logits row sampled with its request's parameters (seeded by (seed, position sampled for)).

    `found` is the cursor position of each request row's slot before this step writes it: the host
    compares it with where the request's committed state ends after the steps read before this
    one, i.e. where this same step's span starts (a pending span starts at that very cursor;
    docs/CACHE.md INV-1, INV-4), so the check needs no probe of its own and is never judged
    against another step.

    forced (teacher forcing, for checking against a reference): {"index_topk": {l: [T, K]},
    "candidate_blocks": {l: [T, Kb]}, "gate_topk": {l: [T, k]}} per token row, any subset.
    record=True also returns, per token row, what the full forward's intermediates hold:
    block_out [L, T, N, D], next_pre [L, T, N], engram_out {l: [T, N, D]}, final_collapsed /
    final_normed [T, D], main_hidden [T, nT * D], and each selection's own picks and scores
    (index_topk, index_scores, candidate_blocks, gate_topk, gate_scores; dicts by layer).
    speculative=True (static; the geometry has the draft stages' rings): verify spans accept drafts
    (`_verify`) and commit only the rows accepted (cursor, `sampled`), and every request row
    drafts a block after the step (`_draft`); the host keeps the drafts of the rows that asked.
    """
    forced = forced or {}
    found = jnp.take(cache.cursor[:, 0], batch.slots, mode="fill", fill_value=-1)
    batch = _resolve_pending(params, cfg, geom, cache, batch)
    tokens, engram_codes, engram_scales, cursor_rows = (batch.tokens, batch.engram_codes, batch.engram_scales,
                                                        batch.cursor_rows)
    x = embed(params, tokens[None], cfg.hc_mult, numerics)                         # [1, T, N, D]
    pre = one_hot_pre((1, tokens.shape[0]), cfg.hc_mult)
    rows = {layer: dequant_fp8_rows(codes, scales)[None]
            for layer, codes, scales in zip(cfg.engram_layer_ids, engram_codes, engram_scales)}
    attend = lambda p, topo, h, state: cached_attention(p, cfg, geom, topo, h, batch, state, numerics, forced)
    x, collapsed, state, inter = run_layers(params, cfg, x, pre, StepState(cache, {}, {}), attend, numerics,
                                      engram_rows=rows,
                                      forced_gates={l: g[None] for l, g in forced.get("gate_topk", {}).items()})
    collapsed, normed = final_hidden(params, cfg, collapsed, numerics)
    logits = lm_head(params["head"]["weight"], normed[0, batch.logit_rows])
    # each logits row's draws once: a verify span's rows check their drafts against the same ones
    drawn = draws(logits, batch.temperature, batch.top_k, batch.top_p, batch.seed,
                  batch.positions[batch.logit_rows] + 1)
    sampled = pick(drawn, batch.temperature)
    cache = state.cache
    slot = _drop(batch.req_len > 0, batch.slots, cache.cursor.shape[0])
    # each request's token from its last committed row's logits (the first logits row naming that
    # row): a verify span commits its first row and the drafts accepted, the others every row
    first = jnp.argmax(batch.logit_rows[None, :] == (batch.req_offset + batch.req_len - 1 - batch.spec_k)[:, None],
                       axis=1)
    accepted = jnp.zeros_like(first)
    if speculative:
        accepted, sampled = _verify(batch, tokens, drawn, sampled, first)
    logprobs = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), sampled[:, None], axis=-1)[:, 0]
    at = first + accepted
    cursor_rows = jnp.where((accepted < batch.spec_k)[:, None],
                            jnp.take_along_axis(batch.spec_cursors, accepted[:, None, None], axis=1)[:, 0],
                            cursor_rows)
    drafts = jnp.zeros((first.shape[0], 0), jnp.int32)
    if speculative:
        committed = batch.req_len - batch.spec_k + accepted
        cache, drafts = _draft(params, cfg, geom, numerics, cache, batch, inter["main_hidden"][0],
                               batch.req_pos + committed - 1, sampled[at])
    # the slot's next input tokens: the one sampled after the committed rows, then the block drafted
    # after it (a pending span reads them, `_resolve_pending`)
    nxt = jnp.concatenate([sampled[at][:, None], drafts], axis=1)
    cache = replace(cache, cursor=cache.cursor.at[slot].set(cursor_rows, mode="drop"),
                    sampled=cache.sampled.at[slot, :nxt.shape[1]].set(nxt, mode="drop"))
    if record:
        # per token row: drop the batch axis of one
        inter = {k: ({l: a[0] for l, a in v.items()} if isinstance(v, dict) else v) for k, v in inter.items()}
        inter.update(block_out=inter["block_out"][:, 0], next_pre=inter["next_pre"][:, 0],
                     main_hidden=None if inter["main_hidden"] is None else inter["main_hidden"][0],
                     final_collapsed=collapsed[0], final_normed=normed[0])
    return StepOutput(cache, sampled, logprobs, found, logits, inter if record else None,
                      accepted.astype(jnp.int32), drafts)


def _verify(batch: StepBatch, tokens: jax.Array, drawn: Draws, sampled: jax.Array,
            first: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Each verify span's drafts checked against its rows' draws (`sampling.verify_drafts`:
    greedy, the longest prefix equal to the argmax; sampled, rejection sampling) -> (accepted [R],
    sampled [O] with a verify span's rows holding what it emits: the drafts accepted, then the
    target's token). Other spans: 0 accepted, rows unchanged. A verify span's logits rows are its
    rows 0..k at positions req_pos + j with its request's sampler, so their draws (keyed by
    (seed, position + 1)) are the ones `sampling.speculative_sample` would draw for them."""
    width = batch.spec_cursors.shape[1]
    j = jnp.arange(width + 1)
    rows = jnp.minimum(first[:, None] + j, sampled.shape[0] - 1)                        # [R, blk + 1]
    drafts = tokens[jnp.minimum(batch.req_offset[:, None] + 1 + j[:-1], tokens.shape[0] - 1)]
    accepted, emitted = verify_drafts(jax.tree.map(lambda a: a[rows], drawn), drafts, batch.spec_k,
                                      batch.temperature[first])
    verify = (batch.spec_k > 0)[:, None] & (j <= batch.spec_k[:, None])
    return accepted, sampled.at[jnp.where(verify, rows, sampled.shape[0])].set(emitted, mode="drop")


def _draft(params: dict, cfg: ModelConfig, geom: CacheGeometry, numerics: Numerics, cache: Cache,
           batch: StepBatch, main_hidden: jax.Array, anchor: jax.Array, first: jax.Array) -> tuple[Cache, jax.Array]:
    """The draft stages after the target (docs/CACHE.md §4.1): every token row's context row per
    stage (`dspark.context_x`, the stage's window_kv at its position), a block drafted from each
    request's committed end (anchor [R], first [R] the token committed after it) over the context
    rows (anchor - W, anchor] read from the slot's draft-stage ring (positions before the span)
    and this step's rows (the rest), then this step's rows written to the rings like a backbone
    layer's. -> (cache, drafts [R, blk])."""
    ctx = context_x(params, cfg, main_hidden[None], numerics)                          # [1, T, D]
    cos, sin = rope_cos_sin(cfg, batch.positions, global_table=False)
    kvs = [window_kv(p["attn"], cfg, ctx, cos, sin, numerics)[0] for p in params["mtp"]]   # [T, Dh] each
    r, ring = batch.slots.shape[0], cache.window.shape[2]
    pos = draft_context_idx(anchor, cfg.window_size)                                   # [R, W], -1 pad
    own = jnp.arange(r)[:, None]
    src = jnp.where(pos < batch.req_pos[:, None], own * ring + pos % ring,
                    r * ring + batch.req_offset[:, None] + pos - batch.req_pos[:, None])
    src = jnp.where(pos >= 0, src, 0)
    ctx_idx = jnp.where(pos >= 0, jnp.arange(pos.shape[1]), -1).astype(jnp.int32)

    def context(m, p):
        rows = jnp.concatenate([cache.window[batch.slots, cfg.n_layers + m].reshape(r * ring, -1),
                                _window_rows(kvs[m], cache.window.dtype)])
        return decode_rows(rows[src], cfg.head_dim, numerics.act_dtype), ctx_idx

    out = draft_block(params, cfg, context, anchor, first, numerics)
    window = cache.window
    for m, kv in enumerate(kvs):
        window = _write_window(window, cfg.n_layers + m, kv, batch)
    return replace(cache, window=window), out.ids[:, 1:].astype(jnp.int32)


def check_row_formats(numerics: Numerics, kv_format: str, index_format: str) -> None:
    """The cache holds rows it reads back exactly: main, window and index rows in the activation
    dtype, or packed (main FP4, window FP8, index FP4) where the numerics put them on those grids."""
    want = typed_format(numerics.act_dtype)
    kv_ok = (want, KV_PACKED) if numerics.fake_quant else (want,)
    index_ok = (want, INDEX_PACKED) if numerics.fake_quant else (want,)
    if kv_format not in kv_ok or index_format not in index_ok:
        raise ValueError(f"kv_format/index_format: {numerics.act_dtype.name} activations"
                         f"{'' if numerics.fake_quant else ' without fake-quant'} need main and window "
                         f"rows in one of {kv_ok} and index rows in one of {index_ok}, got "
                         f"{kv_format!r}/{index_format!r}")


def check_speculative(cfg: ModelConfig, geom: CacheGeometry, speculative: bool) -> None:
    """Speculation needs draft stages and S >= block rows of ring slack: a verify step writes up to
    block rows past what it commits (docs/CACHE.md §4.1)."""
    if not speculative:
        return
    if not cfg.n_mtp_layers:
        raise ValueError("speculative decoding: this checkpoint has no DSpark draft stages (n_mtp_layers = 0)")
    if geom.settings.draft_slack < cfg.dspark_block_size:
        raise ValueError(f"speculative decoding: draft_slack {geom.settings.draft_slack} is below the "
                         f"draft block {cfg.dspark_block_size} (rejected rows would overwrite read ones)")


def make_step(cfg: ModelConfig, geom: CacheGeometry, numerics: Numerics, record: bool = False,
              speculative: bool = False):
    """The jitted step for one (config, geometry, numerics), over a packed batch (runtime/packed.py):
    fn(params, cache, packed, forced=None, *, layout) -> StepOutput, the cache donated; one
    executable per bucket (the layout, static, follows from the bucket)."""
    check_row_formats(numerics, geom.settings.kv_format, geom.settings.index_format)
    check_speculative(cfg, geom, speculative)
    numerics = numerics.for_model(cfg.quantized)

    def packed_step(params, cache, packed: PackedBatch, forced=None, *, layout: BatchLayout) -> StepOutput:
        return step(params, cache, layout.unpack(packed), forced, cfg=cfg, geom=geom, numerics=numerics,
                    record=record, speculative=speculative)
    return jax.jit(packed_step, donate_argnums=(1,), static_argnames=("layout",))
