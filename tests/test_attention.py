"""CSA2 attention stack: sparse attention, window indices, compressor, indexer, attention sublayer."""

from __future__ import annotations

import json
import pathlib

import ml_dtypes
import numpy as np
import jax
import jax.numpy as jnp
import pytest

from v41_jax.config import ModelConfig
from v41_jax.model.compressor import compress, init_state, pool_groups
from v41_jax.model.indexer import (candidate_blocks, candidate_mask, index_scores, select_topk,
                                   visible_rows)
from v41_jax.model.linear import lin_f32
from v41_jax.model.numerics import Numerics
from v41_jax.model.sparse_attn import sparse_attn
from v41_jax.model.window import draft_context_idx, ring_idx, window_idx

REF, F32 = Numerics.reference(), Numerics.fp32()

FIX = pathlib.Path(__file__).parent / "fixtures" / "dsv41_reference"
CONFIGS = pathlib.Path(__file__).parent.parent / "v41_jax" / "configs"
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float64)


def _cfg(**changes) -> ModelConfig:
    return ModelConfig.from_file(CONFIGS / "tiny.config.json").replace(**changes)


def _w(rng, *shape, scale=None, dtype=jnp.bfloat16):
    """Random weight [out, in] with unit-variance outputs (bf16 unless the site is fp32)."""
    scale = shape[-1] ** -0.5 if scale is None else scale
    return jnp.asarray(rng.normal(size=shape) * scale, dtype)


def _norm_w(rng, n):
    return {"weight": jnp.asarray(1 + 0.1 * rng.normal(size=n), jnp.bfloat16)}


def _compressor_params(rng, cfg, ratio):
    dt = jnp.bfloat16 if ratio == 1 else jnp.float32
    p = {"wkv": {"weight": _w(rng, cfg.head_dim, cfg.dim, dtype=dt)}, "norm": _norm_w(rng, cfg.head_dim)}
    if ratio > 1:
        p["wgate"] = {"weight": _w(rng, cfg.head_dim, cfg.dim, dtype=dt)}
    return p


def _fixture(name):
    return json.loads((FIX / name).read_text())


def _bf16_ulp(x):
    """Spacing of bf16 numbers at |x| (8 significant bits)."""
    return 2.0 ** (np.floor(np.log2(np.maximum(np.abs(x), 1e-30))) - 7)


def _fp4_unpack(codes):
    """Packed e2m1 bytes [..., n] -> values [..., 2n]; the low nibble is the even element."""
    codes = np.asarray(codes, np.uint8)
    return np.stack([E2M1[codes & 15], E2M1[codes >> 4]], -1).reshape(*codes.shape[:-1], -1)


def _exact_sparse_attn(q, kv, sink, idx, scale):
    """float64 oracle: softmax over the listed rows plus the sink in the denominator."""
    b, s, h, d = q.shape
    out = np.zeros((b, s, h, d))
    for bi in range(b):
        for si in range(s):
            ids = idx[bi, si][idx[bi, si] >= 0]
            if ids.size == 0:
                continue
            rows = kv[bi, ids].astype(np.float64)                         # [k, d]
            z = q[bi, si].astype(np.float64) @ rows.T * scale             # [h, k]
            m = np.maximum(z.max(-1), sink)                               # any common shift works
            e = np.exp(z - m[:, None])
            out[bi, si] = e @ rows / (e.sum(-1) + np.exp(sink - m))[:, None]
    return out


# ---- sparse attention ------------------------------------------------------------------------

def test_sparse_attn_fixture():
    """Exact-softmax fixture over FP8 window rows + FP4/E4M3 compressed rows, -1 skipping."""
    f = _fixture("sparse_latent_attention.json")
    d, t, h, k = f["dim"], f["tokens"], f["heads"], f["k"]
    win = np.asarray(f["window"]["codes"], np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    win = win.reshape(f["windowSlots"], d // 32, 32) * 2.0 ** (
        np.asarray(f["window"]["scales"], np.float64).reshape(-1, d // 32, 1) - 127)
    main = _fp4_unpack(np.reshape(f["main"]["codes"], (f["mainRows"], d // 2))).reshape(-1, d // 16, 16)
    main = main * np.asarray(f["main"]["scales"], np.uint8).view(ml_dtypes.float8_e4m3fn).astype(
        np.float64).reshape(-1, d // 16, 1)
    kv = np.concatenate([win.reshape(-1, d), main.reshape(-1, d)])[None]   # [1, 20, d], bf16-exact
    q = np.asarray(f["query"], np.float32).reshape(1, t, h, d)
    idx = np.asarray(f["indices"], np.int32).reshape(1, t, k)
    sink = np.asarray(f["sink"], np.float32)
    want = np.asarray(f["expected"]).reshape(1, t, h, d)
    assert np.array_equal(kv.astype(ml_dtypes.bfloat16).astype(np.float64), kv)
    # the expected values are float64 results stored as float32
    np.testing.assert_allclose(_exact_sparse_attn(q, kv, sink, idx, f["scale"]), want, rtol=1e-6, atol=1e-7)

    kv_bf = jnp.asarray(kv, jnp.bfloat16)
    ref = np.asarray(sparse_attn(jnp.asarray(q), kv_bf, jnp.asarray(sink), jnp.asarray(idx),
                                 f["scale"], numerics=REF), np.float64)
    # bf16 probabilities (rel. error <= 2^-9 each) plus one output rounding: within one bf16 ulp of
    # each (token, head) row's magnitude; the reference itself measured 0.68 ulp on this fixture.
    mag = np.abs(want).max(-1, keepdims=True)
    assert np.all(np.abs(ref - want) <= _bf16_ulp(mag)), np.abs(ref - want).max()
    assert np.all(ref[0, 0] == 0)  # token 0: every index -1

    f32 = np.asarray(sparse_attn(jnp.asarray(q), jnp.asarray(kv, jnp.float32), jnp.asarray(sink),
                                 jnp.asarray(idx), f["scale"], numerics=F32), np.float64)
    np.testing.assert_allclose(f32, want, rtol=2e-6, atol=2e-6 * mag.max())


@pytest.mark.parametrize("k", [5, 64, 150])
def test_sparse_attn_random_vs_exact(k):
    """Several chunks (k=150 -> 3), random -1 holes, duplicates, one all-skip row."""
    rng = np.random.default_rng(k)
    b, s, h, d, n = 2, 3, 4, 32, 40
    q = rng.normal(size=(b, s, h, d)).astype(np.float32)
    kv = rng.normal(size=(b, n, d)).astype(ml_dtypes.bfloat16).astype(np.float32)
    sink = rng.normal(size=h).astype(np.float32)
    idx = rng.integers(0, n, size=(b, s, k)).astype(np.int32)
    idx[rng.random(idx.shape) < 0.3] = -1
    idx[1, 2] = -1
    want = _exact_sparse_attn(q, kv, sink, idx, 0.3)

    f32 = np.asarray(sparse_attn(jnp.asarray(q), jnp.asarray(kv), jnp.asarray(sink), jnp.asarray(idx),
                                 0.3, numerics=F32))
    np.testing.assert_allclose(f32, want, rtol=1e-5, atol=1e-5)

    ref = sparse_attn(jnp.asarray(q, jnp.bfloat16), jnp.asarray(kv, jnp.bfloat16), jnp.asarray(sink),
                      jnp.asarray(idx), 0.3, numerics=REF)
    assert ref.dtype == jnp.bfloat16
    ref = np.asarray(ref, np.float64)
    want_bq = _exact_sparse_attn(np.asarray(jnp.asarray(q, jnp.bfloat16), np.float32), kv, sink, idx, 0.3)
    # bf16 probabilities: <= 2^-9 relative per weight, so <= 2^-9 * max|v| in the weighted mean,
    # plus half an ulp of output rounding
    bound = 2.0 ** -9 * np.abs(kv).max() + 0.5 * _bf16_ulp(want_bq)
    assert np.all(np.abs(ref - want_bq) <= bound)
    assert np.all(ref[1, 2] == 0) and np.all(f32[1, 2] == 0)


def test_sparse_attn_skip_equals_absent():
    """A -1 entry is exactly the same as leaving the row out (fp32 mode, same chunk layout)."""
    rng = np.random.default_rng(7)
    q = jnp.asarray(rng.normal(size=(1, 2, 2, 16)), jnp.float32)
    kv = jnp.asarray(rng.normal(size=(1, 10, 16)), jnp.float32)
    sink = jnp.asarray([0.5, -1.0], jnp.float32)
    idx = jnp.asarray([[[3, 1, 4, 7], [0, 2, 9, 5]]], jnp.int32)
    holed = idx.at[0, :, 1].set(-1)
    dropped = jnp.asarray([[[3, 4, 7, -1], [0, 9, 5, -1]]], jnp.int32)
    a = sparse_attn(q, kv.at[0, 1].set(jnp.nan).at[0, 2].set(jnp.nan), sink, holed, 0.25, numerics=F32)
    c = sparse_attn(q, kv, sink, dropped, 0.25, numerics=F32)
    # fp32 sums over a different chunk layout: equal up to summation order; NaN in skipped rows never leaks
    np.testing.assert_allclose(np.asarray(a), np.asarray(c), rtol=1e-6, atol=1e-6)
    # the sink: one zero-logit row and a sink of 0 split the weight evenly
    one = sparse_attn(jnp.zeros((1, 1, 1, 4)), jnp.ones((1, 1, 4)), jnp.zeros(1), jnp.zeros((1, 1, 1), jnp.int32),
                      1.0, numerics=F32)
    np.testing.assert_array_equal(np.asarray(one), 0.5)


# ---- window indices --------------------------------------------------------------------------

def test_window_indices_fixture():
    for c in _fixture("window_indices.json")["cases"]:
        want = np.asarray(c["indices"]).reshape(c["rows"], c["cols"])
        if c["startPos"] == 0:
            got = window_idx(jnp.arange(c["seqLen"]), c["window"], min(c["seqLen"], c["window"]))
        else:
            got = ring_idx(jnp.asarray([c["startPos"]]), c["window"])
        np.testing.assert_array_equal(np.asarray(got), want, err_msg=str(c))


def test_draft_context_idx_is_ring_slot_order():
    """Replaying the ring writes 0..a and listing slots 0..min(W, a+1)-1 gives the same rows."""
    w = 5
    for a in range(13):
        ring = {}
        for p in range(a + 1):
            ring[p % w] = p
        want = [ring[s] for s in range(min(w, a + 1))]
        got = np.asarray(draft_context_idx(jnp.asarray(a), w))
        assert list(got[: len(want)]) == want and np.all(got[len(want):] == -1), (a, got)


# ---- compressor ------------------------------------------------------------------------------

def test_compressor_pool_fixture():
    """Prefill then one-token steps, the partial group carried in the state (norm bypassed)."""
    for c in _fixture("compressor_pool.json")["cases"]:
        r, dim, hd = c["ratio"], c["dim"], c["headDim"]
        x = np.asarray(c["x"], np.float32).reshape(1, -1, dim)
        wkv = np.asarray(c["wkv"], np.float32).reshape(hd, dim)
        wgate = np.asarray(c["wgate"], np.float32).reshape(hd, dim)
        state = init_state(1, r, hd)
        for st in c["steps"]:
            xs = jnp.asarray(x[:, st["startPos"]: st["startPos"] + st["len"]])
            pooled, row_ids, state = pool_groups(lin_f32(xs, wkv), lin_f32(xs, wgate), state,
                                                 jnp.asarray([st["startPos"]]), r)
            n = int((row_ids >= 0).sum())
            assert n == st["rows"], (c["name"], st)
            assert list(np.asarray(row_ids[0, :n])) == list(range(st["startPos"] // r, st["startPos"] // r + n))
            if n:  # fp32 projections and softmax: agreement to fp32 rounding
                np.testing.assert_allclose(np.asarray(pooled[0, :n]), np.reshape(st["out"], (n, hd)),
                                           rtol=1e-5, atol=1e-6, err_msg=c["name"])
            assert np.all(np.asarray(pooled[0, n:]) == 0)


@pytest.mark.parametrize("ratio", [1, 2, 3])
def test_compressor_chunking_invariant(ratio):
    """Any split of the sequence into calls gives the rows of one call (fp32 mode, bit-exact)."""
    rng = np.random.default_rng(ratio)
    cfg = _cfg()
    p = _compressor_params(rng, cfg, ratio)
    h = jnp.asarray(rng.normal(size=(2, 11, cfg.dim)), jnp.float32)
    start0 = jnp.zeros(2, jnp.int32)
    state0 = None if ratio == 1 else init_state(2, ratio, cfg.head_dim)
    whole, ids, _ = compress(p, cfg, ratio, h, state0, start0, F32)
    want = np.asarray(whole[:, : 11 // ratio])
    got, state, pos = [], state0, 0
    for n in (3, 1, 4, 2, 1):
        lat, ids, state = compress(p, cfg, ratio, h[:, pos: pos + n], state, start0 + pos, F32)
        got += [np.asarray(lat[:, j]) for j in range(lat.shape[1]) if ids[0, j] >= 0]
        pos += n
    np.testing.assert_array_equal(np.stack(got, 1), want)


# ---- indexer ---------------------------------------------------------------------------------

def _indexer_fixture():
    f = _fixture("indexer_scores.json")
    d, h, t, n = f["dim"], f["heads"], f["tokens"], f["keys"]
    keys = _fp4_unpack(np.reshape(f["keyCodes"], (n, d // 2))).reshape(n, d // 32, 32)
    keys = (keys * 2.0 ** (np.reshape(f["keyScales"], (n, d // 32, 1)) - 127)).reshape(1, n, d)
    q = np.asarray(f["query"], np.float32).reshape(1, t, h, d)
    w = np.asarray(f["headWeights"], np.float32).reshape(1, t, h)
    vis = np.asarray(f["compressLens"], np.int32).reshape(1, t)
    return f, q, keys.astype(np.float32), w, vis


def test_index_scores_fixture():
    f, q, keys, w, vis = _indexer_fixture()
    t, n = f["tokens"], f["keys"]
    assert list(vis[0]) == list(np.asarray(visible_rows(jnp.arange(t), f["ratio"])))
    got = np.asarray(index_scores(jnp.asarray(q), jnp.asarray(keys), jnp.asarray(w), jnp.asarray(vis), F32))
    masked = np.asarray(f["masked"]).reshape(1, t, n).astype(bool)
    np.testing.assert_array_equal(np.isneginf(got), masked)
    # fp32 dots of fp4-grid values and an fp32 head sum: fp32 rounding only
    np.testing.assert_allclose(np.where(masked, 0, got), np.reshape(f["scores"], (1, t, n)), rtol=1e-6, atol=1e-7)


def test_index_scores_reference_rounding_matches_torch_bf16():
    """Reference mode equals the reference's op sequence run by torch on bf16 tensors, bit for bit:
    einsum -> relu -> * weights -> sum over heads (each a bf16 result)."""
    torch = pytest.importorskip("torch")
    f, q, keys, w, vis = _indexer_fixture()
    rng = np.random.default_rng(0)
    keys = np.concatenate([keys, rng.normal(size=(1, 30, keys.shape[-1])).astype(np.float32)], 1)
    vis = np.full_like(vis, keys.shape[1])
    qb, kb, wb = (np.asarray(jnp.asarray(a, jnp.bfloat16), np.float32) for a in (q, keys, w * 7))
    tq, tk, tw = (torch.tensor(a).bfloat16() for a in (qb, kb, wb))
    want = (torch.einsum("bshd,btd->bsht", tq, tk).relu_() * tw.unsqueeze(-1)).sum(dim=2).float().numpy()
    got = index_scores(jnp.asarray(qb, jnp.bfloat16), jnp.asarray(kb, jnp.bfloat16), jnp.asarray(wb, jnp.bfloat16),
                       jnp.asarray(vis), REF)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got, np.float32), want)


def _masked_scores(values, visible):
    return np.asarray([-np.inf if v is None else v for v in values], np.float32), visible


def test_candidate_blocks_fixture():
    for c in _fixture("candidate_select.json")["blocks"]:
        s, vis = _masked_scores(c["logits"], c["compressLen"])
        blocks = candidate_blocks(jnp.asarray(s)[None], jnp.asarray([vis]), c["topkBlocks"], c["blockSize"])
        got = candidate_mask(blocks, c["width"], c["blockSize"])[0]
        np.testing.assert_array_equal(np.asarray(got), np.asarray(c["mask"]), err_msg=str(c))
        b = np.asarray(blocks[0])
        kept = b[b >= 0]
        assert np.all(np.diff(kept) > 0) and np.all(b[len(kept):] == -1)
        assert (vis - 1) // c["blockSize"] in kept  # newest block pinned


def test_select_topk_fixture():
    for c in _fixture("candidate_select.json")["picks"]:
        s, vis = _masked_scores(c["scores"], c["compressLen"])
        ids = np.asarray(select_topk(jnp.asarray(s)[None], jnp.asarray([vis]), c["indexTopk"])[0])
        np.testing.assert_array_equal(np.where(ids >= 0, ids + c["offset"], -1), c["indices"], err_msg=str(c))


def test_topk_ties_go_to_lower_index():
    scores = jnp.asarray([[[0.0, 2.0, 0.0, 2.0, 0.0, 0.0, 1.0, 0.0]]], jnp.bfloat16)
    vis = jnp.asarray([[8]])
    np.testing.assert_array_equal(np.asarray(select_topk(scores, vis, 4)), [[[0, 1, 3, 6]]])
    # blocks of 2: scores 2, 2, 1, 0 -> newest block (3) pinned, then the tie 0 vs 1 goes to 0
    np.testing.assert_array_equal(np.asarray(candidate_blocks(scores, vis, 2, 2)), [[[0, 3]]])
