"""Pallas paged indexer scores / top-k vs the XLA path (key gather + the model's indexer) and the
indexer_scores.json / candidate_select.json fixtures.

On CPU the kernel runs in Pallas interpret mode (outputs start as NaN there, so finite / -inf
everywhere proves every element was written); on a GPU the same tests compile it for real.
Tolerances: reference scores are bf16 and round three times (dot, weighted term, head sum); the
kernel differs only in fp32 summation order inside the dot and the head sum, which can move a
rounding by one bf16 step, so scores are compared at 2^-7 relative (two steps) plus 2^-7 of the
largest score absolute. Top-k ids are compared exactly where the scores are bitwise equal (CPU),
and by overlap otherwise. fp32-policy fixture scores are held to 1e-5.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_common import assert_close, fp4_rows, fresh_rng, load_fixture
from kernels_pallas import backend
from kernels_pallas.indexer import (candidate_rows, index_scores_paged, index_scores_tokens, index_topk_paged,
                                    select_topk, select_topk_compacted, tiles_per_program,
                                    topk_ids)
from v41_jax.model import indexer as ref
from v41_jax.model.numerics import Numerics
from v41_jax.quant import fp4_qdq_ue8m0, pack_fp4_ue8m0_rows

REF = Numerics.reference()
F32 = Numerics.fp32()


def _paged_case(rng, b=2, s=3, hi=4, di=32, rpp=8, mp=6, vis_max=None, dtype=jnp.bfloat16):
    """Random queries/keys; each request owns mp shuffled pages, unused pages hold NaN."""
    n_pages = b * mp + 3
    keys = rng.standard_normal((n_pages, rpp, di)).astype(np.float32)
    perm = rng.permutation(np.arange(1, n_pages))[: b * mp]
    table = perm.reshape(b, mp).astype(np.int32)
    keys[0] = np.nan                                            # the null page is never read
    vis = rng.integers(0, (vis_max or mp * rpp) + 1, (b, s)).astype(np.int32)
    # rows past every query's visible count are unwritten: poison them
    for i in range(b):
        for r in range(vis[i].max(initial=0), mp * rpp):
            keys[table[i, r // rpp], r % rpp] = np.nan
    q = jnp.asarray(rng.standard_normal((b, s, hi, di)), dtype)
    w = jnp.asarray(rng.standard_normal((b, s, hi)) * 0.3, dtype)
    return q, w, jnp.asarray(keys, dtype), jnp.asarray(table), jnp.asarray(vis)


def _scores_both(*case, numerics=REF, **kw):
    got = index_scores_paged(*case, numerics=numerics, backend="pallas", **kw)
    want = index_scores_paged(*case, numerics=numerics, backend="xla", **kw)
    return np.asarray(got, np.float32), np.asarray(want, np.float32)


def _check_scores(got, want, seed):
    assert not np.isnan(got).any(), f"unwritten or NaN score (seed {seed})"
    np.testing.assert_array_equal(np.isinf(got), np.isinf(want), err_msg=f"mask (seed {seed})")
    fin = np.isfinite(want)
    top = np.abs(want[fin]).max(initial=1.0)
    assert_close(got[fin], want[fin], rtol=2 ** -7, atol=2 ** -7 * top, seed=seed)


@pytest.mark.parametrize("query_block", [1, 4])
def test_full_scan_scores(query_block):
    rng, seed = fresh_rng()
    case = _paged_case(rng, s=5)
    got, want = _scores_both(*case, query_block=query_block, col_tile=16)
    _check_scores(got, want, seed)


def test_tiles_past_every_visible_count():
    """Short requests in a long block table: whole tiles are skipped and must still be -inf."""
    rng, seed = fresh_rng()
    case = _paged_case(rng, mp=8, vis_max=10)
    got, want = _scores_both(*case, col_tile=16)
    assert np.isneginf(got[..., 16:][np.isneginf(want[..., 16:])]).all()
    _check_scores(got, want, seed)


def _candidates(rng, b, s, n_blocks, keep):
    """Ascending kept block ids per query, -1 padded (some queries keep fewer)."""
    out = np.full((b, s, keep), -1, np.int32)
    for i in range(b):
        for t in range(s):
            n = rng.integers(0, keep + 1)
            out[i, t, :n] = np.sort(rng.choice(n_blocks, n, replace=False))
    return jnp.asarray(out)


def test_candidate_scores_and_topk():
    """REINDEX consumer: compacted candidate columns vs the XLA path, then the lifted top-k vs
    the reference rule (full scores masked to the kept blocks, `select_topk`)."""
    rng, seed = fresh_rng()
    bs = 8
    q, w, keys, table, vis = _paged_case(rng, s=4, rpp=16, mp=4)
    cand = _candidates(rng, 2, 4, n_blocks=8, keep=5)
    got, want = _scores_both(q, w, keys, table, vis, candidates=cand, block_size=bs, col_tile=16)
    _check_scores(got, want, seed)

    ids, _ = index_topk_paged(q, w, keys, table, vis, 12, numerics=REF, candidates=cand,
                              block_size=bs, backend="pallas", col_tile=16)
    full = index_scores_paged(q, w, keys, table, vis, numerics=REF, backend="pallas", col_tile=16)
    mask = ref.candidate_mask(cand, full.shape[-1], bs)
    want_ids = np.asarray(ref.select_topk(jnp.where(mask, full, -jnp.inf), vis, 12))
    ids = np.asarray(ids)
    rows = np.asarray(candidate_rows(cand, bs))
    n_live = ((rows >= 0) & (rows < np.asarray(vis)[..., None])).sum(-1)
    for i, t in np.ndindex(*n_live.shape):
        # the reference pads a short pick with -inf rows below `visible` (by-position validity);
        # the compacted scan has no such rows: compare the real picks only
        if n_live[i, t] >= 12:
            np.testing.assert_array_equal(ids[i, t], want_ids[i, t], err_msg=f"seed {seed}")
        else:
            w_it = want_ids[i, t]
            real = w_it[(w_it >= 0) & np.isin(w_it, rows[i, t])]
            np.testing.assert_array_equal(ids[i, t][ids[i, t] >= 0], real, err_msg=f"seed {seed}")


def test_full_topk_matches_reference():
    rng, seed = fresh_rng()
    case = _paged_case(rng, s=6, mp=8)
    ids, scores = index_topk_paged(*case, 20, numerics=REF, backend="pallas", col_tile=32)
    want_ids, want_scores = index_topk_paged(*case, 20, numerics=REF, backend="xla")
    got, want = np.asarray(scores, np.float32), np.asarray(want_scores, np.float32)
    _check_scores(got, want, seed)
    ids, want_ids = np.asarray(ids), np.asarray(want_ids)
    vis = np.asarray(case[-1])
    assert ((ids >= 0).sum(-1) == np.minimum(vis, 20)).all(), "count must be min(visible, k)"
    if np.array_equal(got, want):
        np.testing.assert_array_equal(ids, want_ids, err_msg=f"seed {seed}")
    else:  # a one-step rounding difference can swap near-tied picks, never many
        overlap = np.mean([len(np.intersect1d(a, b)) / max(len(b), 1) for a, b in
                           zip(ids.reshape(-1, 20), want_ids.reshape(-1, 20))])
        assert overlap > 0.95, f"seed {seed}"


@pytest.mark.parametrize("tile", [8, 64, 100])
def test_two_stage_topk_is_exact_with_ties(tile):
    """bf16 scores on a coarse grid with many exact ties (ReLU zeros, repeated values)."""
    rng, seed = fresh_rng()
    scores = jnp.asarray(np.round(rng.standard_normal((5, 700)) * 2) / 2, jnp.bfloat16)
    scores = jnp.maximum(scores, 0)
    np.testing.assert_array_equal(topk_ids(scores, 40, tile), topk_ids(scores, 40), err_msg=f"seed {seed}")
    vis = jnp.asarray(rng.integers(0, 701, 5), jnp.int32)
    np.testing.assert_array_equal(select_topk(scores, vis, 40, tile), ref.select_topk(scores, vis, 40))


def test_fixture_indexer_scores():
    """indexer_scores.json: fp4 keys (ue8m0, group 32), fp32 expected scores; keys paged into
    shuffled pages of 4 rows; visible = compressLens."""
    f = load_fixture("indexer_scores.json")
    d, h, t, n = f["dim"], f["heads"], f["tokens"], f["keys"]
    keys = fp4_rows(f["keyCodes"], f["keyScales"], d, 32, "ue8m0")
    pages = np.full((4, 4, d), np.nan, np.float32)
    table = np.array([[2, 0]], np.int32)                       # logical page 0 -> 2, 1 -> 0
    pages[2], pages[0, : n - 4] = keys[:4], keys[4:]
    q = jnp.asarray(f["query"], jnp.float32).reshape(1, t, h, d)
    w = jnp.asarray(f["headWeights"], jnp.float32).reshape(1, t, h)
    vis = jnp.asarray(f["compressLens"], jnp.int32).reshape(1, t)
    got = np.asarray(index_scores_paged(q, w, jnp.asarray(pages), jnp.asarray(table), vis,
                                        numerics=F32, backend="pallas", col_tile=16))[0, :, :n]
    masked = np.asarray(f["masked"], bool).reshape(t, n)
    np.testing.assert_array_equal(np.isneginf(got), masked)
    want = np.asarray(f["scores"], np.float64).reshape(t, n)
    assert_close(np.where(masked, 0, got), want, rtol=1e-5, atol=1e-5)


def test_fixture_candidate_blocks():
    """candidate_select.json `blocks`: the kept blocks (the model's `candidate_blocks`) lifted to
    rows by `candidate_rows` cover exactly the fixture's mask."""
    for c in load_fixture("candidate_select.json")["blocks"]:
        logits = np.array([-np.inf if v is None else v for v in c["logits"]], np.float32)
        vis = jnp.asarray([[c["compressLen"]]], jnp.int32)
        blocks = ref.candidate_blocks(jnp.asarray(logits)[None, None], vis, c["topkBlocks"], c["blockSize"])
        rows = np.asarray(candidate_rows(blocks, c["blockSize"]))[0, 0]
        mask = np.zeros(len(logits), bool)
        mask[rows[(rows >= 0) & (rows < len(logits))]] = True
        np.testing.assert_array_equal(mask, c["mask"], err_msg=str(c["width"]))


def test_fixture_picks():
    """candidate_select.json `picks` through the compacted selection with identity columns."""
    for c in load_fixture("candidate_select.json")["picks"]:
        scores = np.array([-np.inf if v is None else v for v in c["scores"]], np.float32)
        rows = jnp.arange(len(scores), dtype=jnp.int32)[None, None]
        ids = select_topk_compacted(jnp.asarray(scores)[None, None], rows,
                                    jnp.asarray([[c["compressLen"]]]), c["indexTopk"])
        ids = np.asarray(ids)[0, 0]
        ids = np.where(ids >= 0, ids + c["offset"], -1)
        np.testing.assert_array_equal(ids, c["indices"])   # min(k, positions) wide, like the fixture


def test_switch_selects_xla(monkeypatch):
    rng, _ = fresh_rng()
    case = _paged_case(rng)
    monkeypatch.setenv(backend.ENV_BACKEND, "xla")
    out = index_scores_paged(*case, numerics=REF)
    assert out.shape == (2, 3, 48)


def _packed_plane(keys: jax.Array) -> jax.Array:
    """A typed plane of on-grid keys (NaN = poisoned rows) -> its packed FP4 plane, poisoned rows as
    0xFF bytes (codes -6, scale code 255: NaN on the XLA path, a huge value in the kernel's decode,
    either way a read of such a row changes the scores)."""
    k = np.asarray(keys, np.float32)
    bad = np.isnan(k).any(-1)
    packed = np.array(pack_fp4_ue8m0_rows(jnp.asarray(np.where(bad[..., None], 0, k))))
    packed[bad] = 0xFF
    return jnp.asarray(packed)


@pytest.mark.parametrize("with_candidates", [False, True])
@pytest.mark.parametrize("backend_name, tiles", [("xla", None), ("pallas", 1), ("pallas", 4)])
def test_packed_fp4_keys_score_bit_equal_to_their_typed_rows(backend_name, tiles, with_candidates):
    """Index keys on the fp4 grid (what the model stores: `fp4_qdq_ue8m0`) held as packed rows
    (a quarter of the bytes) give every score of the typed bf16 rows bit for bit, on each path:
    the decode (in registers in the kernel, one tile or several a program; after the gather in XLA)
    is exact, and nothing else changes. Unwritten rows are poisoned in both planes (`_packed_plane`),
    so a read of one would show."""
    rng, seed = fresh_rng()
    q, w, keys, table, vis = _paged_case(rng, s=4, di=64, rpp=16, mp=4)
    keys = fp4_qdq_ue8m0(keys.astype(jnp.float32)).astype(jnp.bfloat16)   # NaN rows stay NaN
    packed = _packed_plane(keys)
    assert packed.shape == (*keys.shape[:2], 64 // 2 + 64 // 32) and packed.dtype == jnp.uint8
    kw = dict(candidates=_candidates(rng, 2, 4, n_blocks=8, keep=5), block_size=8) if with_candidates else {}
    kw.update(numerics=REF, backend=backend_name, col_tile=16, tiles=tiles)
    typed = index_scores_paged(q, w, keys, table, vis, **kw)
    got = index_scores_paged(q, w, packed, table, vis, **kw)
    typed, got = np.asarray(typed, np.float32), np.asarray(got, np.float32)
    assert not np.isnan(typed).any() and np.isfinite(typed).any(), f"seed {seed}"
    np.testing.assert_array_equal(got.view(np.uint32), typed.view(np.uint32), err_msg=f"seed {seed}")


@pytest.mark.parametrize("with_candidates", [False, True])
def test_tiles_per_program_change_nothing_but_the_grid(with_candidates):
    """A program scoring several key tiles in a loop (queries loaded once) writes every tile as a
    program of one tile does, bit for bit: groups past the last column, partial groups and tiles
    past every query's visible count included (2, 4 and 8 tiles over 6 tiles of 16, or 3 of the
    candidates' columns)."""
    rng, seed = fresh_rng()
    q, w, keys, table, vis = _paged_case(rng, s=4, rpp=16, mp=6, vis_max=70)
    kw = dict(candidates=_candidates(rng, 2, 4, n_blocks=12, keep=5), block_size=8) if with_candidates else {}
    run = lambda tiles: np.asarray(index_scores_paged(q, w, keys, table, vis, numerics=REF, backend="pallas",
                                                      col_tile=16, tiles=tiles, **kw), np.float32)
    one = run(1)
    assert not np.isnan(one).any() and np.isinf(one).any() and np.isfinite(one).any(), f"seed {seed}"
    for tiles in (2, 4, 8):
        np.testing.assert_array_equal(run(tiles).view(np.uint32), one.view(np.uint32),
                                      err_msg=f"{tiles} tiles (seed {seed})")


def test_bad_planes_and_tile_counts_are_refused():
    rng, _ = fresh_rng()
    q, w, keys, table, vis = _paged_case(rng, di=64)
    with pytest.raises(ValueError, match="power of two"):
        index_scores_paged(q, w, keys, table, vis, numerics=REF, backend="pallas", tiles=3)
    packed = _packed_plane(fp4_qdq_ue8m0(keys.astype(jnp.float32)).astype(jnp.bfloat16))
    wide = jnp.zeros((*packed.shape[:2], 68), jnp.uint8)                 # rows of 128 lanes, queries of 64
    for plane in (packed[..., :-1], wide):                                # 33 bytes: no row at all
        for backend_name in ("xla", "pallas"):
            with pytest.raises(ValueError, match="packed"):
                index_scores_paged(q, w, plane, table, vis, numerics=REF, backend=backend_name)


def test_tiles_per_program_fill_the_gpu_first():
    assert tiles_per_program(1, 256) == 1                     # one 32K decode row: every tile a program
    assert tiles_per_program(32, 256) == 8                    # 32 rows: 1,024 programs of 8 tiles
    assert tiles_per_program(128, 256) == 16                  # capped
    assert tiles_per_program(1024, 128) == 16                 # 4,096 prefill queries: 8,192 programs
    assert tiles_per_program(64, 100) == 4                    # 64 x 25 groups (8 would leave 832)


def _token_case(rng, lengths, pad=3, hi=4, di=32, rpp=8, mp=5, order=None):
    """A step's flat token list: requests of `lengths` tokens, consecutive (or in `order`, a
    permutation of the token rows), then `pad` padding tokens (request 0, nothing visible). Each
    request owns mp shuffled pages; rows past its tokens' largest visible count are NaN."""
    r = len(lengths)
    case = _paged_case(rng, b=r, s=max(lengths), hi=hi, di=di, rpp=rpp, mp=mp)
    q, w, keys, table, vis = (np.asarray(x) for x in case)
    req = np.concatenate([np.full(n, i) for i, n in enumerate(lengths)] + [np.zeros(pad, int)])
    col = np.concatenate([np.arange(n) for n in lengths] + [np.zeros(pad, int)])
    real = np.arange(len(req)) < sum(lengths)
    order = np.arange(len(req)) if order is None else order
    req, col, real = req[order], col[order], real[order]
    tok = lambda x: jnp.asarray(x[req, col])
    return (tok(q), tok(w), jnp.asarray(keys), jnp.asarray(table), jnp.asarray(req.astype(np.int32)),
            jnp.asarray(np.where(real, vis[req, col], 0).astype(np.int32)))


@pytest.mark.parametrize("query_block", [1, 2, 4])
@pytest.mark.parametrize("shuffled", [False, True])
def test_token_list_scores_each_token_over_its_own_request(query_block, shuffled):
    """A flat token list (the step's layout): query blocks straddle request boundaries (lengths
    5, 6, 1, 3 at blocks of 2 and 4) and padding tokens, or hold a request's tokens apart
    (shuffled); each token must score its own request's keys only (another request's unwritten
    rows are NaN and would show) and match the XLA path (the tolerance of `_check_scores`)."""
    rng, seed = fresh_rng()
    lengths = (5, 6, 1, 3)
    order = rng.permutation(sum(lengths) + 3) if shuffled else None
    case = _token_case(rng, lengths, order=order)
    got = np.asarray(index_scores_tokens(*case, numerics=REF, backend="pallas", query_block=query_block,
                                         col_tile=16), np.float32)
    want = np.asarray(index_scores_tokens(*case, numerics=REF, backend="xla"), np.float32)
    assert got.shape == (18, 40) and np.isfinite(want).any()
    _check_scores(got, want, seed)


def test_token_list_blocks_change_nothing_but_the_grid():
    """Scoring a token list in blocks of 4 (several requests a block, one pass per request) writes
    what blocks of one query do, bit for bit (the same dot per query; only the grid differs)."""
    rng, seed = fresh_rng()
    case = _token_case(rng, (5, 6, 1, 3), di=64, rpp=16, mp=4)
    run = lambda qb: np.asarray(index_scores_tokens(*case, numerics=REF, backend="pallas", query_block=qb,
                                                    col_tile=16), np.float32)
    one = run(1)
    assert not np.isnan(one).any() and np.isinf(one).any() and np.isfinite(one).any(), f"seed {seed}"
    np.testing.assert_array_equal(run(4).view(np.uint32), one.view(np.uint32), err_msg=f"seed {seed}")


