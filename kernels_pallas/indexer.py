"""Lightning-indexer scores straight from the paged index plane, and the top-k on top of them.

docs/MODEL.md §3.7, docs/CACHE.md §3; jnp reference: `kernels_pallas.reference` (index_scores, select_topk).

Cache-side input layout
-----------------------
  key_pages    [P, rpp, Di]  one owner's index plane (`cache.index[o]`), rpp rows/page: typed rows,
               or [P, rpp, Di/2 + Di/32] uint8 packed FP4 rows (`quant.pack_fp4_ue8m0_rows`),
               decoded after the load (exactly the typed rows' values, a quarter of the bytes)
  block_table  [B, MP] int32 page ids of each request (logical row j lives in page
               block_table[b, j // rpp] at row j % rpp)
  visible      [B, S] int32  rows each query may see, (p + 1) // r
  candidates   [B, S, NB] int32, optional: ascending logical block ids (block_size rows each) kept
               by the candidate source for each query, -1 padded (REINDEX consumers).
Without candidates the score columns are the logical rows 0 .. MP*rpp-1 (a FULL layer's scan);
with them the columns are the kept blocks' rows, compacted: column c is row
candidates[c // bs] * bs + c % bs (ATOM's "kept list as block table", docs/CACHE.md §3.2), so a
consumer reads 16,384 key rows per query however long the context is.

Scores are Σ_h w_h · ReLU(q_h · k) with the reference's rounding points (the dot, each weighted
term and the head sum round once to the score dtype; bf16 in reference numerics), -inf where the
row is not visible (or the candidate slot is empty).

Kernel (Pallas, Triton lowering), on a flat token list (`index_scores_tokens`: a step's batch;
`index_scores_paged` lays its [B, S] queries out as one, each request padded to whole blocks): grid
(query blocks, groups of TP column tiles). A query block of TS consecutive tokens stacks TS x Hi
query heads as the M dimension of one [TS*Hi, Di] @ [Di, TN] product per key tile, so the tokens of
one request (a prefill chunk, a verify span) can read each key tile once a block (`query_block`;
the default is one query a block: blocks of 4 measured slower on the H200, BENCHMARKS.md
2026-12-05); the key rows of a tile
are gathered through the request's block table (no dense copy of the keys). A block holding tokens
of several requests does one such pass per request, each keeping its own tokens' scores. A program
loads its queries once and loops over its TP tiles (`tiles_per_program`: large batches amortize the
query loads and the set-up, small ones keep one tile a program to fill the GPU). Tiles wholly past
every query's visible count skip the loads. With candidates each query has its own columns (TS = 1).
Top-k is `numerics.top_k` (ties to the lower column = lower row, since the compaction keeps row
order), optionally in two exact stages over column tiles (`topk_ids`), followed by an ascending
sort, as the reference's `select_topk`; over a full scan the Pallas backend selects without a sort
(`kernels_pallas.select`, the same ids).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernels_pallas import backend as _backend
from kernels_pallas import reference as ref
from kernels_pallas._codecs import fp4_values
from kernels_pallas._compat import SQUEEZED, compiler_params, load
from kernels_pallas.select import kernel_selects, select_ascending
from v41_jax.numerics import HIGHEST, Numerics, top_k
from v41_jax.quant import FP4_GROUP, packed_fp4_lanes, unpack_fp4_ue8m0_rows

# two-stage top-k tile for the Pallas backend (rows no longer than a tile use one lax.top_k);
# H200: 1.08 -> 0.45 ms at 32 x 131072, 0.24 -> 0.16 ms at 32 x 32768 (BENCHMARKS.md)
TOPK_TILE: int | None = 8192


def _score_tile(q, w, keys, dt):
    """q [M, Di] (M = TS*Hi), w [M] fp32, keys [TN, Di] -> weighted terms [M, TN] fp32."""
    dots = jax.lax.dot_general(q, keys, (((1,), (1,)), ((), ())), precision=HIGHEST,
                               preferred_element_type=jnp.float32).astype(dt)
    return (jnp.maximum(dots, 0).astype(jnp.float32) * w[:, None]).astype(dt).astype(jnp.float32)


def _key_tile(keys_ref, phys, live, di: int, dtype):
    """Key rows `phys` [TN] of the flat plane (rows not `live` read as 0) -> [TN, Di] in dtype:
    typed rows as stored; packed FP4 rows (uint8, `quant.pack_fp4_ue8m0_rows`: Di/2 E2M1 bytes,
    then Di/32 E8M0 codes) decoded in registers to the very values the typed rows hold."""
    def cols(first: int, n: int):
        lanes = first + jax.lax.broadcasted_iota(jnp.int32, (n,), 0)
        return load(keys_ref.at[phys[:, None], lanes[None, :]], mask=live[:, None], other=0)

    if keys_ref.dtype != jnp.uint8:
        return cols(0, di).astype(dtype)
    return fp4_values(cols(0, di // 2), cols(di // 2, di // FP4_GROUP), dtype)


def _index_kernel(*refs, ts: int, hi: int, tn: int, tp: int, n_cols: int, mp: int, rpp: int, bs: int,
                  with_cand: bool, dt):
    if with_cand:
        q_ref, w_ref, vis_ref, req_ref, bt_ref, cand_ref, keys_ref, o_ref = refs
    else:
        q_ref, w_ref, vis_ref, req_ref, bt_ref, keys_ref, o_ref = refs
    vis = vis_ref[...]                                                  # [TS]
    req = req_ref[...]                                                  # [TS] each query's request row
    q = q_ref[...].reshape(ts * hi, -1)                                 # [TS*Hi, Di], once for TP tiles
    w = w_ref[...].reshape(ts * hi).astype(jnp.float32)
    group = pl.program_id(1)                                            # (interpret mode: outside the loop)
    lane = jax.lax.broadcasted_iota(jnp.int32, (ts,), 0)

    def tile(t, carry):
        col = (group * tp + t) * tn + jax.lax.broadcasted_iota(jnp.int32, (tn,), 0)
        if with_cand:
            block = load(cand_ref.at[col // bs])                        # logical block per column
            row = jnp.where(block >= 0, block * bs + col % bs, -1)
        else:
            row = col
        # past n_cols: a group's padding columns, never read whatever `visible` says
        live = ((row >= 0) & (col < n_cols))[None, :] & (row[None, :] < vis[:, None])   # [TS, TN]
        safe = jnp.maximum(row, 0)

        def request(u, out):
            """The keys of query u's request, for every query of the block in that request; a
            request met earlier in the block was done then (one pass per request a block)."""
            r = jnp.sum(jnp.where(lane == u, req, 0))
            mine = live & (req == r)[:, None]
            mine_i = mine.astype(jnp.int32)                             # (no i1 reductions in Triton)
            done = jnp.max(jnp.where((lane < u) & (req == r), 1, 0)) > 0

            def compute():
                any_live = mine_i.max(axis=0) > 0                       # rows some query sees
                page = load(bt_ref.at[r * mp + safe // rpp], mask=any_live, other=0)
                phys = page * rpp + safe % rpp
                terms = _score_tile(q, w, _key_tile(keys_ref, phys, any_live, q.shape[1], q.dtype), dt)
                scores = terms.reshape(ts, hi, tn).sum(axis=1).astype(dt)   # fp32 head sum, one rounding
                return jnp.where(mine, scores, out)

            # a tile no query can see reads nothing (short requests in a long block table)
            return jax.lax.cond(jnp.logical_not(done) & (mine_i.max() > 0), compute, lambda: out)

        init = jnp.full((ts, tn), -jnp.inf, dt)
        out = request(0, init) if ts == 1 else jax.lax.fori_loop(0, ts, request, init)
        o_ref[:, pl.ds(pl.multiple_of(t * tn, tn), tn)] = out
        return carry

    jax.lax.fori_loop(0, tp, tile, 0)


def tiles_per_program(programs: int, tiles: int) -> int:
    """Key tiles one program scores (its queries loaded once): the most, up to 16, that leave at
    least 1,024 programs (a few per SM), so a large batch amortizes the query loads and the
    program's set-up while a small one still spreads over the GPU. H200, 128-column tiles
    (BENCHMARKS.md, 2026-12-04 e): 16 tiles 10-20 % faster than one wherever >= 512 programs
    remain (32 x 32,768 keys 0.099 -> 0.088 ms; 4,096 prefill queries in blocks of 4 x 16,384
    keys 3.20 -> 2.55 ms), slower where fewer do (1 x 32,768 keys 0.025 -> 0.034 ms). Not
    re-measured with one query a block (the default since 2026-12-05)."""
    tp = 1
    while tp < 16 and programs * -(-tiles // (2 * tp)) >= 1024:
        tp *= 2
    return tp


@functools.partial(jax.jit, static_argnames=("ts", "tn", "tp", "bs", "dt", "num_warps", "num_stages",
                                             "interpret"))
def _index_scores_pallas(q, w, key_pages, block_tables, token_req, visible, candidates, *, ts, tn, tp, bs, dt,
                         num_warps, num_stages, interpret):
    """Token-major: q [T, Hi, Di], w [T, Hi], block_tables [R, MP], token_req [T] in [0, R),
    visible [T], candidates [T, NB] or None -> [T, N]."""
    t, hi, di = q.shape
    _, rpp, _ = key_pages.shape
    mp = block_tables.shape[1]
    with_cand = candidates is not None
    n_cols = candidates.shape[-1] * bs if with_cand else mp * rpp
    if tp is None:
        tp = tiles_per_program(-(-t // ts), -(-n_cols // tn))
    t_pad, n_pad = -t % ts, -n_cols % (tn * tp)
    # the dot's M = ts*hi must be a power of two >= 16: zero heads with zero weight add exact zeros
    h_pad = max(1 << (hi - 1).bit_length(), -(-16 // ts)) - hi
    q = jnp.pad(q, ((0, t_pad), (0, h_pad), (0, 0)))
    w = jnp.pad(w, ((0, t_pad), (0, h_pad)))
    hi += h_pad
    visible = jnp.pad(visible.astype(jnp.int32), (0, t_pad))            # padded queries see nothing
    token_req = jnp.pad(token_req.astype(jnp.int32), (0, t_pad))
    tables = block_tables.astype(jnp.int32).reshape(-1)                 # request r's page j at r*MP + j
    keys = key_pages.reshape(-1, key_pages.shape[-1])                   # free: contiguous pages
    grid = ((t + t_pad) // ts, (n_cols + n_pad) // (tn * tp))
    in_specs = [pl.BlockSpec((ts, hi, di), lambda i, j: (i, 0, 0)),
                pl.BlockSpec((ts, hi), lambda i, j: (i, 0)),
                pl.BlockSpec((ts,), lambda i, j: (i,)),
                pl.BlockSpec((ts,), lambda i, j: (i,)),
                pl.BlockSpec(tables.shape, lambda i, j: (0,))]
    args = [q, w, visible, token_req, tables]
    if with_cand:
        cand = jnp.pad(candidates.astype(jnp.int32), ((0, t_pad), (0, -(-n_pad // bs))), constant_values=-1)
        in_specs.append(pl.BlockSpec((SQUEEZED, cand.shape[-1]), lambda i, j: (i, 0)))
        args.append(cand)
    in_specs.append(pl.BlockSpec(keys.shape, lambda i, j: (0, 0)))
    args.append(keys)
    kernel = functools.partial(_index_kernel, ts=ts, hi=hi, tn=tn, tp=tp, n_cols=n_cols, mp=mp, rpp=rpp,
                               bs=bs, with_cand=with_cand, dt=dt)
    out = pl.pallas_call(
        kernel, grid=grid, in_specs=in_specs,
        out_specs=pl.BlockSpec((ts, tn * tp), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((t + t_pad, n_cols + n_pad), dt),
        compiler_params=compiler_params(num_warps, num_stages), interpret=interpret,
        name="index_scores",
    )(*args)
    return out[:t, :n_cols]


def _gather_keys_xla(key_pages, block_table, candidates, bs):
    """Dense keys per request [B, N, Di] (or per query [B, S, N, Di] with candidates)."""
    _, rpp, di = key_pages.shape
    if candidates is None:
        return key_pages[block_table].reshape(block_table.shape[0], -1, di)
    rows = candidates[..., None] * bs + jnp.arange(bs)                  # [B, S, NB, bs]
    safe = jnp.maximum(rows, 0)
    pages = jax.vmap(lambda bt, r: bt[r // rpp])(block_table, safe)
    return key_pages[pages, safe % rpp].reshape(*candidates.shape[:2], -1, di)


def candidate_rows(candidates: jax.Array, block_size: int) -> jax.Array:
    """[B, S, NB] kept block ids -> [B, S, NB*bs] logical row per compacted column (-1 empty)."""
    rows = candidates[..., None] * block_size + jnp.arange(block_size, dtype=jnp.int32)
    return jnp.where(candidates[..., None] >= 0, rows, -1).reshape(*candidates.shape[:-1], -1)


def index_scores_paged_xla(q, w, key_pages, block_table, visible, *, numerics: Numerics,
                           candidates=None, block_size: int = 8):
    """The XLA path: gather the keys (packed rows decoded after the gather), then the reference's
    `index_scores`."""
    keys = _gather_keys_xla(key_pages, block_table, candidates, block_size)
    if keys.dtype == jnp.uint8:
        keys = unpack_fp4_ue8m0_rows(keys, dtype=q.dtype)
    if candidates is None:
        return ref.index_scores(q, keys, w, visible, numerics)
    b, s = q.shape[:2]
    flat = lambda x: x.reshape(b * s, 1, *x.shape[2:])
    rows = candidate_rows(candidates, block_size)
    # per query its own keys: one "request" per query; visibility by row id, not column
    scores = ref.index_scores(flat(q), keys.reshape(b * s, -1, keys.shape[-1]), flat(w),
                              jnp.full((b * s, 1), rows.shape[-1], jnp.int32), numerics)
    scores = scores.reshape(b, s, -1)
    return jnp.where((rows >= 0) & (rows < visible[..., None]), scores, -jnp.inf)


def _check_planes(q: jax.Array, key_pages: jax.Array, tiles: int | None) -> None:
    if key_pages.dtype == jnp.uint8 and packed_fp4_lanes(key_pages.shape[-1]) != q.shape[-1]:
        raise ValueError(f"index plane: packed rows of {key_pages.shape[-1]} bytes hold "
                         f"{packed_fp4_lanes(key_pages.shape[-1])} lanes, the queries {q.shape[-1]}")
    if tiles is not None and (tiles < 1 or tiles & (tiles - 1)):
        raise ValueError(f"tiles: {tiles} is not a power of two")


def index_scores_paged(q: jax.Array, w: jax.Array, key_pages: jax.Array, block_table: jax.Array,
                       visible: jax.Array, *, numerics: Numerics, candidates: jax.Array | None = None,
                       block_size: int = 8, backend: str | None = None, query_block: int = 1,
                       col_tile: int = 128, tiles: int | None = None, num_warps: int = 4,
                       num_stages: int = 2) -> jax.Array:
    """Indexer scores of each query over its request's paged index keys.

    q [B, S, Hi, Di], w [B, S, Hi] (already scaled by Di^-0.5 Hi^-0.5), key_pages [P, rpp, Di]
    (or packed, see the module doc),
    block_table [B, MP] int32, visible [B, S] int32, candidates [B, S, NB] int32 or None.
    Returns [B, S, N] in the score dtype: N = MP*rpp logical rows, or NB*block_size compacted
    candidate columns (see `candidate_rows`); -inf where not visible. tiles: key tiles a program
    scores, a power of two (a Triton block width; None: `tiles_per_program`). query_block: as
    `index_scores_tokens` (candidate columns: always 1).
    """
    _check_planes(q, key_pages, tiles)
    if _backend.resolve(backend) == "xla":
        return index_scores_paged_xla(q, w, key_pages, block_table, visible, numerics=numerics,
                                      candidates=candidates, block_size=block_size)
    b, s = q.shape[:2]
    ts = 1 if candidates is not None else query_block
    # request b's queries as tokens, padded to whole query blocks (so no block holds two requests)
    sp = s + -s % ts
    tokens = lambda x, fill=0: jnp.pad(x, ((0, 0), (0, sp - s)) + ((0, 0),) * (x.ndim - 2),
                                       constant_values=fill).reshape(b * sp, *x.shape[2:])
    out = _index_scores_pallas(tokens(q), tokens(w), key_pages, block_table,
                               jnp.repeat(jnp.arange(b, dtype=jnp.int32), sp), tokens(visible),
                               None if candidates is None else tokens(candidates, -1), ts=ts, tn=col_tile,
                               tp=tiles, bs=block_size, dt=numerics.index_score_dtype,
                               num_warps=num_warps, num_stages=num_stages, interpret=_backend.interpret())
    return out.reshape(b, sp, -1)[:, :s]


def index_scores_tokens(q: jax.Array, w: jax.Array, key_pages: jax.Array, block_tables: jax.Array,
                        token_req: jax.Array, visible: jax.Array, *, numerics: Numerics,
                        backend: str | None = None, query_block: int = 1, col_tile: int = 128,
                        tiles: int | None = None, num_warps: int = 4, num_stages: int = 2) -> jax.Array:
    """Indexer scores of a flat token list (a step's batch), each token over its request's keys.

    q [T, Hi, Di], w [T, Hi], key_pages as `index_scores_paged`, block_tables [R, MP] int32,
    token_req [T] int32 in [0, R) (the token's row of block_tables; a padding token names any row
    and sees nothing), visible [T] int32 -> [T, MP*rpp] in the score dtype, -inf where not visible.
    With query_block > 1, consecutive tokens of one request share a block and its key tiles are
    read once for the block; bit-equal either way. One query a block by default: on the H200
    (BENCHMARKS.md, 2026-12-05) blocks of 4 made the step's index scoring slower, 4K prefill 1.94 ->
    3.06 ms, 8K 6.73 -> 8.07 ms, a verify of 32 x 6 tokens 0.37 -> 0.68 ms.
    """
    _check_planes(q, key_pages, tiles)
    if _backend.resolve(backend) == "xla":
        tables = block_tables[token_req]                                # [T, MP]
        return index_scores_paged_xla(q[:, None], w[:, None], key_pages, tables, visible[:, None],
                                      numerics=numerics)[:, 0]
    ts = query_block
    return _index_scores_pallas(q, w, key_pages, block_tables, token_req, visible, None, ts=ts, tn=col_tile,
                                tp=tiles, bs=1, dt=numerics.index_score_dtype, num_warps=num_warps,
                                num_stages=num_stages, interpret=_backend.interpret())


def topk_ids(scores: jax.Array, k: int, tile: int | None = None) -> jax.Array:
    """Column ids of the k largest scores per row, ties to the lower column (`numerics.top_k`).

    tile=None: one `lax.top_k` over the row. tile=c: exact two-stage selection: top-k inside each
    c-column tile, then top-k over the tiles' picks. The global top-k is inside the union of the
    per-tile ones, and the union keeps column order among equal scores (tiles in column order,
    ties inside a tile in column order), so the tie rule survives. Pays when rows are long."""
    n = scores.shape[-1]
    k = min(k, n)
    s = scores.astype(jnp.float32)
    if tile is None or n <= tile or tile < k:
        return top_k(s, k)[1].astype(jnp.int32)
    lead = s.shape[:-1]
    s = jnp.pad(s, [(0, 0)] * len(lead) + [(0, -n % tile)], constant_values=-jnp.inf)
    v, i = top_k(s.reshape(*lead, -1, tile), k)               # [..., n_tiles, k]
    i = i + (jnp.arange(v.shape[-2], dtype=i.dtype) * tile)[:, None]
    _, j = top_k(v.reshape(*lead, -1), k)
    return jnp.take_along_axis(i.reshape(*lead, -1), j, axis=-1).astype(jnp.int32)


def select_topk(scores: jax.Array, visible: jax.Array, k: int, tile: int | None = None) -> jax.Array:
    """The reference's `select_topk` (ascending ids, -1 where id >= visible) on `topk_ids`."""
    ids = topk_ids(scores, k, tile)
    return ref.ascending(ids, ids < visible[..., None])


def select_topk_compacted(scores: jax.Array, rows: jax.Array, visible: jax.Array, k: int,
                          tile: int | None = None) -> jax.Array:
    """Top-k over compacted candidate columns, lifted to row ids: ascending, -1 padded.

    Columns keep row order, so top_k's lower-column tie rule is the lower-row rule. A pick is kept
    when its row is a real, visible row (the reference's by-position validity)."""
    picked = jnp.take_along_axis(rows, topk_ids(scores, k, tile), axis=-1)
    return ref.ascending(picked, (picked >= 0) & (picked < visible[..., None]))


def index_topk_paged(q, w, key_pages, block_table, visible, k: int, *, numerics: Numerics,
                     candidates=None, block_size: int = 8, backend: str | None = None,
                     topk_tile: int | None = TOPK_TILE, **kernel_kw):
    """Selected row ids [B, S, min(k, N)] ascending, -1 padded (a FULL or REINDEX layer's pick).
    Returns (ids, scores); a candidate source (FULL layer 20) feeds the scores to
    `v41_jax.model.indexer.candidate_blocks`. The XLA backend selects with the reference's
    `select_topk`; the Pallas backend without a sort over a full scan (`kernels_pallas.select`,
    where `kernel_selects`) and otherwise with `topk_ids(tile=topk_tile)` (same picks)."""
    scores = index_scores_paged(q, w, key_pages, block_table, visible, numerics=numerics,
                                candidates=candidates, block_size=block_size, backend=backend,
                                **kernel_kw)
    xla = _backend.resolve(backend) == "xla"
    if candidates is None:
        # rows the kernel cannot take: the two-stage top-k (select_ascending would take one sort)
        wide = not xla and not kernel_selects(math.prod(scores.shape[:-1]), scores.shape[-1], k)
        ids = (select_topk(scores, visible, k, topk_tile) if wide
               else select_ascending(scores, visible, k, backend=backend))
        return ids, scores
    rows = candidate_rows(candidates, block_size)
    return select_topk_compacted(scores, rows, visible, k, None if xla else topk_tile), scores
