"""CSA2 attention stack: sparse attention, window indices, compressor, indexer, attention sublayer."""

from __future__ import annotations

import functools
import json
import pathlib

import ml_dtypes
import numpy as np
import jax
import jax.numpy as jnp
import pytest

import v41_jax.model.attention as attention_mod
from v41_jax.config import ModelConfig
from v41_jax.model.attention import draft_attention, empty_context, full_attention
from v41_jax.model.compressor import compress, init_state, pool_groups, stored_rows
from v41_jax.model.indexer import (candidate_blocks, candidate_mask, index_scores, select_topk,
                                   visible_rows)
from v41_jax.model.linear import lin_f32
from v41_jax.model.numerics import Numerics
from v41_jax.model.sparse_attn import sparse_attn
from v41_jax.model.window import draft_context_idx, ring_idx, window_idx
from v41_jax.quant import (dequant_fp4_e4m3_rows, dequant_fp4_ue8m0_rows, dequant_fp8_rows, fp4_qdq_e4m3,
                           fp4_qdq_ue8m0)
from v41_jax.topology import Candidates, Mode, resolve_topology

REF, F32 = Numerics.reference(), Numerics.fp32()

FIX = pathlib.Path(__file__).parent / "fixtures" / "dsv41_reference"
CONFIGS = pathlib.Path(__file__).parent.parent / "v41_jax" / "configs"


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


def _u8(values, shape):
    return np.asarray(values, np.uint8).reshape(shape)


def _bf16_ulp(x):
    """Spacing of bf16 numbers at |x| (8 significant bits)."""
    return 2.0 ** (np.floor(np.log2(np.maximum(np.abs(x), 1e-30))) - 7)


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

_sparse_attn = jax.jit(sparse_attn, static_argnums=4, static_argnames="numerics")


def test_sparse_attn_fixture():
    """Exact-softmax fixture over FP8 window rows + FP4/E4M3 compressed rows, -1 skipping."""
    f = _fixture("sparse_latent_attention.json")
    d, t, h, k = f["dim"], f["tokens"], f["heads"], f["k"]
    win = dequant_fp8_rows(_u8(f["window"]["codes"], (f["windowSlots"], d)),
                           _u8(f["window"]["scales"], (f["windowSlots"], d // 32)), 32, jnp.float32)
    main = dequant_fp4_e4m3_rows(_u8(f["main"]["codes"], (f["mainRows"], d // 2)),
                                 _u8(f["main"]["scales"], (f["mainRows"], d // 16)), 16, jnp.float32)
    kv = np.concatenate([win, main]).astype(np.float64)[None]                 # [1, 20, d], bf16-exact
    q = np.asarray(f["query"], np.float32).reshape(1, t, h, d)
    idx = np.asarray(f["indices"], np.int32).reshape(1, t, k)
    sink = np.asarray(f["sink"], np.float32)
    want = np.asarray(f["expected"]).reshape(1, t, h, d)
    assert np.array_equal(kv.astype(ml_dtypes.bfloat16).astype(np.float64), kv)
    # the expected values are float64 results stored as float32
    np.testing.assert_allclose(_exact_sparse_attn(q, kv, sink, idx, f["scale"]), want, rtol=1e-6, atol=1e-7)

    kv_bf = jnp.asarray(kv, jnp.bfloat16)
    ref = np.asarray(_sparse_attn(jnp.asarray(q), kv_bf, jnp.asarray(sink), jnp.asarray(idx),
                                 f["scale"], numerics=REF), np.float64)
    # bf16 probabilities (rel. error <= 2^-9 each) plus one output rounding: within one bf16 ulp of
    # each (token, head) row's magnitude; the reference itself measured 0.68 ulp on this fixture.
    mag = np.abs(want).max(-1, keepdims=True)
    assert np.all(np.abs(ref - want) <= _bf16_ulp(mag)), np.abs(ref - want).max()
    assert np.all(ref[0, 0] == 0)  # token 0: every index -1

    f32 = np.asarray(_sparse_attn(jnp.asarray(q), jnp.asarray(kv, jnp.float32), jnp.asarray(sink),
                                 jnp.asarray(idx), f["scale"], numerics=F32), np.float64)
    np.testing.assert_allclose(f32, want, rtol=2e-6, atol=2e-6 * mag.max())


@pytest.mark.parametrize("k", [64, 150])
def test_sparse_attn_random_vs_exact(k):
    """One full chunk, or three with a partial last one; random -1 holes, duplicates, an all-skip row."""
    rng = np.random.default_rng(k)
    b, s, h, d, n = 2, 3, 4, 32, 40
    q = rng.normal(size=(b, s, h, d)).astype(np.float32)
    kv = rng.normal(size=(b, n, d)).astype(ml_dtypes.bfloat16).astype(np.float32)
    sink = rng.normal(size=h).astype(np.float32)
    idx = rng.integers(0, n, size=(b, s, k)).astype(np.int32)
    idx[rng.random(idx.shape) < 0.3] = -1
    idx[1, 2] = -1
    want = _exact_sparse_attn(q, kv, sink, idx, 0.3)

    f32 = np.asarray(_sparse_attn(jnp.asarray(q), jnp.asarray(kv), jnp.asarray(sink), jnp.asarray(idx),
                                 0.3, numerics=F32))
    np.testing.assert_allclose(f32, want, rtol=1e-5, atol=1e-5)

    ref = _sparse_attn(jnp.asarray(q, jnp.bfloat16), jnp.asarray(kv, jnp.bfloat16), jnp.asarray(sink),
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
    """A -1 entry contributes nothing, even over a NaN row: the same as leaving it out (up to fp32
    summation order, since the surviving entries sit at other places in the chunk)."""
    rng = np.random.default_rng(7)
    q = jnp.asarray(rng.normal(size=(1, 2, 2, 16)), jnp.float32)
    kv = jnp.asarray(rng.normal(size=(1, 10, 16)), jnp.float32)
    sink = jnp.asarray([0.5, -1.0], jnp.float32)
    idx = jnp.asarray([[[3, 1, 4, 7], [0, 2, 9, 5]]], jnp.int32)
    holed = idx.at[0, :, 1].set(-1)
    dropped = jnp.asarray([[[3, 4, 7, -1], [0, 9, 5, -1]]], jnp.int32)
    a = _sparse_attn(q, kv.at[0, 1].set(jnp.nan).at[0, 2].set(jnp.nan), sink, holed, 0.25, numerics=F32)
    c = _sparse_attn(q, kv, sink, dropped, 0.25, numerics=F32)
    np.testing.assert_allclose(np.asarray(a), np.asarray(c), rtol=1e-6, atol=1e-6)
    # the sink: one zero-logit row and a sink of 0 split the weight evenly
    one = _sparse_attn(jnp.zeros((1, 1, 1, 4)), jnp.ones((1, 1, 4)), jnp.zeros(1), jnp.zeros((1, 1, 1), jnp.int32),
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

@functools.partial(jax.jit, static_argnums=5)
def _pool(x, wkv, wgate, state, start, ratio):
    return pool_groups(lin_f32(x, wkv), lin_f32(x, wgate), state, start, ratio)


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
            pooled, row_ids, state = _pool(xs, wkv, wgate, state, jnp.asarray([st["startPos"]]), r)
            n = int((row_ids >= 0).sum())
            assert n == st["rows"], (c["name"], st)
            assert list(np.asarray(row_ids[0, :n])) == list(range(st["startPos"] // r, st["startPos"] // r + n))
            if n:  # fp32 projections and softmax: agreement to fp32 rounding
                np.testing.assert_allclose(np.asarray(pooled[0, :n]), np.reshape(st["out"], (n, hd)),
                                           rtol=1e-5, atol=1e-6, err_msg=c["name"])
            assert np.all(np.asarray(pooled[0, n:]) == 0)


@pytest.mark.parametrize("ratio", [2, 3])
def test_compressor_chunking_invariant(ratio):
    """Any split of the sequence into calls gives the rows of one call (fp32 mode, bit-exact)."""
    rng = np.random.default_rng(ratio)
    cfg = _cfg()
    p = _compressor_params(rng, cfg, ratio)
    h = jnp.asarray(rng.normal(size=(2, 11, cfg.dim)), jnp.float32)
    start0 = jnp.zeros(2, jnp.int32)
    state0 = None if ratio == 1 else init_state(2, ratio, cfg.head_dim)
    run = jax.jit(compress, static_argnums=(1, 2, 6))
    whole, ids, _ = run(p, cfg, ratio, h, state0, start0, F32)
    want = np.asarray(whole[:, : 11 // ratio])
    got, state, pos = [], state0, 0
    for n in (5, 1, 5):  # carries a partial group across both cuts for r = 2 and the first for r = 3
        lat, ids, state = run(p, cfg, ratio, h[:, pos: pos + n], state, start0 + pos, F32)
        got += [np.asarray(lat[:, j]) for j in range(lat.shape[1]) if ids[0, j] >= 0]
        pos += n
    np.testing.assert_array_equal(np.stack(got, 1), want)


# ---- indexer ---------------------------------------------------------------------------------

def _indexer_fixture():
    f = _fixture("indexer_scores.json")
    d, h, t, n = f["dim"], f["heads"], f["tokens"], f["keys"]
    keys = np.asarray(dequant_fp4_ue8m0_rows(_u8(f["keyCodes"], (n, d // 2)), _u8(f["keyScales"], (n, d // 32)),
                                             32, jnp.float32))[None]
    q = np.asarray(f["query"], np.float32).reshape(1, t, h, d)
    w = np.asarray(f["headWeights"], np.float32).reshape(1, t, h)
    vis = np.asarray(f["compressLens"], np.int32).reshape(1, t)
    return f, q, keys, w, vis


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


def _masked_scores(values):
    """The fixtures write unreachable (-inf) scores as null."""
    return np.asarray([-np.inf if v is None else v for v in values], np.float32)


def test_candidate_blocks_fixture():
    for c in _fixture("candidate_select.json")["blocks"]:
        s, vis = _masked_scores(c["logits"]), c["compressLen"]
        blocks = jax.jit(candidate_blocks, static_argnums=(2, 3))(
            jnp.asarray(s)[None], jnp.asarray([vis]), c["topkBlocks"], c["blockSize"])
        got = jax.jit(candidate_mask, static_argnums=(1, 2))(blocks, c["width"], c["blockSize"])[0]
        np.testing.assert_array_equal(np.asarray(got), np.asarray(c["mask"]), err_msg=str(c))
        b = np.asarray(blocks[0])
        kept = b[b >= 0]
        assert np.all(np.diff(kept) > 0) and np.all(b[len(kept):] == -1)
        assert (vis - 1) // c["blockSize"] in kept  # newest block pinned


def test_select_topk_fixture():
    for c in _fixture("candidate_select.json")["picks"]:
        s, vis = _masked_scores(c["scores"]), c["compressLen"]
        ids = np.asarray(select_topk(jnp.asarray(s)[None], jnp.asarray([vis]), c["indexTopk"])[0])
        np.testing.assert_array_equal(np.where(ids >= 0, ids + c["offset"], -1), c["indices"], err_msg=str(c))


def test_topk_ties_go_to_lower_index():
    scores = jnp.asarray([[[0.0, 2.0, 0.0, 2.0, 0.0, 0.0, 1.0, 0.0]]], jnp.bfloat16)
    vis = jnp.asarray([[8]])
    np.testing.assert_array_equal(np.asarray(select_topk(scores, vis, 4)), [[[0, 1, 3, 6]]])
    # blocks of 2: scores 2, 2, 1, 0 -> newest block (3) pinned, then the tie 0 vs 1 goes to 0
    np.testing.assert_array_equal(np.asarray(candidate_blocks(scores, vis, 2, 2)), [[[0, 3]]])


# ---- attention sublayer ----------------------------------------------------------------------

def _attn_params(rng, cfg, topo):
    """Random weights with the loader's layout (bf16 [out, in]; fp32 sink and ratio-2 compressor)."""
    hd, q, g = cfg.n_heads * cfg.head_dim, cfg.q_lora_rank, cfg.o_groups
    p = {"wq_a": {"weight": _w(rng, q, cfg.dim)}, "q_norm": _norm_w(rng, q),
         "wq_b": {"weight": _w(rng, hd, q)}, "wkv": {"weight": _w(rng, cfg.head_dim, cfg.dim)},
         "kv_norm": _norm_w(rng, cfg.head_dim), "wo_a": {"weight": _w(rng, g * cfg.o_lora_rank, hd // g)},
         "wo_b": {"weight": _w(rng, cfg.dim, g * cfg.o_lora_rank)},
         "attn_sink": jnp.asarray(rng.normal(size=cfg.n_heads), jnp.float32)}
    if topo.scores:
        # a large query scale spreads the index scores, so that top-k choices are not all ties
        p["indexer"] = {"wq_b": {"weight": _w(rng, cfg.index_n_heads * cfg.index_head_dim, q, scale=0.5)},
                        "weights_proj": {"weight": _w(rng, cfg.index_n_heads, cfg.dim)}}
    if topo.mode is Mode.FULL:
        p["compressor"] = _compressor_params(rng, cfg, topo.ratio)
        p["indexer"].update(wk={"weight": _w(rng, cfg.index_head_dim, cfg.head_dim)},
                            k_norm=_norm_w(rng, cfg.index_head_dim))
    return p


class _Stack:
    """The backbone's attention sublayers alone (each fed its own input), jitted per layer, with a
    spy on what each layer hands to sparse_attn."""

    def __init__(self, cfg, numerics, b, s, seed=0):
        rng = np.random.default_rng(seed)
        self.cfg, self.numerics = cfg, numerics
        self.topos = [t for t in resolve_topology(cfg) if not t.is_draft]
        self.params = [_attn_params(rng, cfg, t) for t in self.topos]
        self.calls = []

        def recording(q, kv, sink, idx, scale, *, numerics):
            jax.debug.callback(lambda kv, idx: self.calls.append((np.asarray(kv, np.float32), np.asarray(idx))),
                               kv, idx)
            return sparse_attn(q, kv, sink, idx, scale, numerics=numerics)

        def attend(p, topo, h, ctx):
            return full_attention(p, cfg, topo, h, ctx, numerics)

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(attention_mod, "sparse_attn", recording)
            self._attend = jax.jit(attend, static_argnums=1)
            self.run(self.inputs(b, s, seed=2))  # trace every layer at (b, s) while the spy is in place
        self.calls.clear()

    def inputs(self, b, s, seed=1):
        rng = np.random.default_rng(seed)
        return [jnp.asarray(rng.normal(size=(b, s, self.cfg.dim)), self.numerics.act_dtype) for _ in self.topos]

    def run(self, hs):
        ctx, outs, self.records = empty_context(), [], []
        for topo, p, h in zip(self.topos, self.params, hs):
            out, ctx, record = self._attend(p, topo, h, ctx)
            outs.append(out.block_until_ready())
            self.records.append(record)
        return outs, ctx


# candidate_topk_blocks 5 x 2 >= index_topk + block_size - 1: the kept blocks always hold at least
# index_topk rows (the tiny config's 4 x 2 does not when the newest block is partial, see
# test_select_topk_fills_by_position_like_the_reference)
CAND_CFG = dict(candidate_topk_blocks=5)
B, S = 2, 40


@pytest.fixture(scope="module")
def fp32_run():
    stack = _Stack(_cfg(**CAND_CFG), F32, B, S)
    hs = stack.inputs(B, S)
    outs, ctx = stack.run(hs)
    return stack, hs, outs, ctx, list(stack.calls), list(stack.records)


def test_attention_modes_wiring(fp32_run):
    stack, _, _, ctx, calls, records = fp32_run
    cfg, topos, w = stack.cfg, stack.topos, stack.cfg.window_size
    assert set(ctx.rows) == set(ctx.keys) == set(cfg.kv_source_layers)
    assert set(ctx.selected) == set(cfg.index_source_layers)
    assert set(ctx.candidates) == {cfg.candidate_source_layer}
    for topo, record in zip(topos, records):  # each layer records its own choices only
        want = {"index_topk": ctx.selected, "candidate_blocks": ctx.candidates}
        assert set(record) - {"index_scores"} == {k for k, table in want.items() if topo.layer in table}
        for k in set(record) & set(want):
            np.testing.assert_array_equal(np.asarray(record[k]), np.asarray(want[k][topo.layer]))
        if topo.scores:  # the selection is the top-k of the recorded scores
            sel = np.asarray(record["index_topk"])
            vis = np.broadcast_to((np.arange(S) + 1) // topo.ratio, (B, S))
            np.testing.assert_array_equal(sel, np.asarray(select_topk(record["index_scores"], jnp.asarray(vis),
                                                                      cfg.index_topk)))
            if topo.candidates is Candidates.CONSUME:  # rows outside the kept blocks were masked
                blocks = np.asarray(ctx.candidates[cfg.candidate_source_layer])
                outside = ~np.asarray(candidate_mask(jnp.asarray(blocks), S // topo.ratio, cfg.candidate_block_size))
                assert np.all(np.isneginf(np.asarray(record["index_scores"])[outside]))
    win = np.broadcast_to(np.asarray(window_idx(jnp.arange(S), w, w)), (B, S, w))
    assert len(calls) == len(topos)
    for topo, (kv, idx) in zip(topos, calls):
        np.testing.assert_array_equal(idx[..., :w], win)
        if topo.mode is Mode.WINDOW:
            assert idx.shape[-1] == w and kv.shape[1] == S
            continue
        sel = np.asarray(ctx.selected[topo.topk_owner])
        assert sel.shape == (B, S, min(cfg.index_topk, S // topo.ratio))
        # every compressed layer reads its kv owner's rows with exactly its top-k owner's ids,
        # offset past the window part
        np.testing.assert_array_equal(kv[:, S:], np.asarray(ctx.rows[topo.kv_owner]))
        np.testing.assert_array_equal(idx[..., w:], np.where(sel >= 0, sel + S, -1))


def test_selections_visible_ascending_full(fp32_run):
    stack, _, _, ctx, _, _ = fp32_run
    for l, sel in ctx.selected.items():
        sel = np.asarray(sel)
        vis = (np.arange(S) + 1) // stack.topos[l].ratio
        valid = sel >= 0
        assert np.all(np.where(valid[..., 1:], np.diff(sel, axis=-1) > 0, True))   # ascending
        assert np.all(valid[..., :-1] >= valid[..., 1:])                            # -1 only at the end
        assert np.all(np.where(valid, sel < vis[:, None], True))                    # visible only
        np.testing.assert_array_equal(valid.sum(-1), np.broadcast_to(np.minimum(vis, sel.shape[-1]), (B, S)))


def _check_candidates(cfg, topos, ctx, b, s):
    src = cfg.candidate_source_layer
    blocks = np.asarray(ctx.candidates[src])
    vis = (np.arange(s) + 1) // topos[src].ratio
    n_blocks = -(-vis // cfg.candidate_block_size)
    assert n_blocks.max() > cfg.candidate_topk_blocks  # the restriction does bite somewhere
    # all visible blocks while they fit, else exactly candidate_topk_blocks; newest always kept
    np.testing.assert_array_equal((blocks >= 0).sum(-1), np.broadcast_to(
        np.minimum(n_blocks, cfg.candidate_topk_blocks), (b, s)))
    assert all((v - 1) // cfg.candidate_block_size in blocks[bi, i] for bi in range(b) for i, v in enumerate(vis))
    consumers = [t.layer for t in topos if t.scores and t.candidates is Candidates.CONSUME]
    assert consumers
    for l in consumers:
        sel = np.asarray(ctx.selected[l])
        inside = (sel[..., :, None] // cfg.candidate_block_size == blocks[..., None, :]).any(-1)
        assert np.all(inside | (sel < 0)), l


def test_reindex_selects_inside_candidate_blocks(fp32_run):
    stack, _, _, ctx, _, _ = fp32_run
    _check_candidates(stack.cfg, stack.topos, ctx, B, S)


def _check_causal(stack, hs, outs, ctx, t):
    """Changing every input at positions >= t leaves everything before t unchanged, bit for bit
    (same shapes, so the same compiled program and the same index-list layout)."""
    moved = [h.at[:, t:].set(jnp.asarray(np.random.default_rng(9).normal(size=h[:, t:].shape), h.dtype))
             for h in hs]
    outs2, ctx2 = stack.run(moved)
    for a, c in zip(outs, outs2):
        np.testing.assert_array_equal(np.asarray(a[:, :t], np.float32), np.asarray(c[:, :t], np.float32))
        assert not np.array_equal(np.asarray(a[:, t:], np.float32), np.asarray(c[:, t:], np.float32))
    for table, table2 in ((ctx.selected, ctx2.selected), (ctx.candidates, ctx2.candidates)):
        for l in table:
            np.testing.assert_array_equal(np.asarray(table[l][:, :t]), np.asarray(table2[l][:, :t]))
    for l in ctx.rows:
        n = t // stack.topos[l].ratio
        np.testing.assert_array_equal(np.asarray(ctx.rows[l][:, :n], np.float32), np.asarray(ctx2.rows[l][:, :n], np.float32))
        np.testing.assert_array_equal(np.asarray(ctx.keys[l][:, :n], np.float32), np.asarray(ctx2.keys[l][:, :n], np.float32))


def test_attention_is_causal_fp32(fp32_run):
    stack, hs, outs, ctx, _, _ = fp32_run
    _check_causal(stack, hs, outs, ctx, 23)  # odd: splits a ratio-2 group


def test_full_layer_rows_and_keys(fp32_run):
    """One row per complete group, equal to the compressor's latent rotated at r*j (fp32 mode: no
    QDQ); the reference-mode grids are checked in test_reference_mode_stack."""
    stack, hs, _, ctx, _, _ = fp32_run
    cfg = stack.cfg
    for l in cfg.kv_source_layers:
        r, p = stack.topos[l].ratio, stack.params[l]
        state = None if r == 1 else init_state(B, r, cfg.head_dim)

        @jax.jit
        def want(p, h):
            lat, ids, _ = compress(p["compressor"], cfg, r, h, state, jnp.zeros(B, jnp.int32), F32)
            return stored_rows(cfg, r, lat, ids, F32)[:, : S // r]

        rows = np.asarray(ctx.rows[l])
        assert rows.shape == (B, S // r, cfg.head_dim)
        assert ctx.keys[l].shape == (B, S // r, cfg.index_head_dim)
        np.testing.assert_allclose(rows, np.asarray(want(p, hs[l])), rtol=1e-6, atol=1e-6)


def test_reference_mode_stack():
    """Reference numerics on the ratio-1 candidate pair (FULL producer + REINDEX consumer):
    bf16 activations, fp4 grids of stored rows / keys, candidate restriction and causality."""
    cfg = _cfg(**CAND_CFG).replace(n_layers=2, n_mtp_layers=0, compress_ratios=(1, 1), kv_source_layers=(0,),
                                   index_source_layers=(0, 1), candidate_source_layer=0, engram_layer_ids=(),
                                   engram_num_embeddings=(), dspark_target_layer_ids=())
    b, s = 1, 24
    stack = _Stack(cfg, REF, b, s)
    assert [t.mode for t in stack.topos] == [Mode.FULL, Mode.REINDEX]
    hs = stack.inputs(b, s)
    outs, ctx = stack.run(hs)
    assert all(o.dtype == jnp.bfloat16 for o in outs)
    rows, keys = ctx.rows[0], ctx.keys[0]
    assert rows.dtype == keys.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(rows, np.float32), np.asarray(fp4_qdq_e4m3(rows, 16), np.float32))
    np.testing.assert_array_equal(np.asarray(keys, np.float32), np.asarray(fp4_qdq_ue8m0(keys, 32), np.float32))
    _check_candidates(cfg, stack.topos, ctx, b, s)
    _check_causal(stack, hs, outs, ctx, 13)


def test_select_topk_fills_by_position_like_the_reference():
    """When the candidate blocks hold fewer finite rows than k (tiny config: 4 blocks x 2 rows with a
    partial newest block = 7 rows < index_topk 8), the reference keeps its -inf filler picks that
    lie below the visible count as valid ids: lowest index first under the lower-index tie rule."""
    vis = 21
    scores = np.random.default_rng(0).normal(size=vis).astype(np.float32)
    blocks = jnp.asarray([[1, 4, 6, 10]])
    keep = np.asarray(candidate_mask(blocks, vis, 2))
    masked = jnp.asarray(np.where(keep, scores, -np.inf))
    sel = np.asarray(select_topk(masked, jnp.asarray([vis]), 8))[0]
    inside = np.flatnonzero(keep[0])
    assert len(inside) == 7
    np.testing.assert_array_equal(sel, np.sort(np.append(inside, 0)))


# ---- draft attention -------------------------------------------------------------------------

def test_draft_attention(monkeypatch):
    cfg = _cfg()
    rng = np.random.default_rng(3)
    topo = resolve_topology(cfg)[cfg.n_layers]
    assert topo.is_draft and topo.mode is Mode.WINDOW
    p = _attn_params(rng, cfg, topo)
    b, blk, w, anchor = 2, cfg.dspark_block_size, cfg.window_size, 11
    n_ctx = anchor + 1
    ctx_kv = jnp.asarray(rng.normal(size=(b, n_ctx, cfg.head_dim)), jnp.float32)
    x = jnp.asarray(rng.normal(size=(b, blk, cfg.dim)), jnp.float32)
    anchors = jnp.full((b,), anchor, jnp.int32)
    seen = []

    def recording(q, kv, sink, idx, scale, *, numerics):
        jax.debug.callback(lambda i: seen.append(np.asarray(i)), idx)
        return sparse_attn(q, kv, sink, idx, scale, numerics=numerics)

    monkeypatch.setattr(attention_mod, "sparse_attn", recording)
    draft = jax.jit(lambda x, ctx_kv: draft_attention(p, cfg, x, ctx_kv, anchors, F32))
    out = draft(x, ctx_kv).block_until_ready()
    assert out.shape == (b, blk, cfg.dim)
    # every block row lists the context rows (anchor - w, anchor] in ring-slot order (slot s holds
    # the newest position = s mod w), then the block rows right after them
    slots = [anchor - (anchor - s_) % w for s_ in range(w)]
    assert seen[0].shape == (b, blk, w + blk)
    assert np.all(seen[0] == np.asarray(slots + list(range(n_ctx, n_ctx + blk))))
    # bidirectional inside the block: the last draft row moves the first row's output
    moved = draft(x.at[:, -1].add(1.0), ctx_kv)
    assert not np.allclose(np.asarray(moved[:, 0]), np.asarray(out[:, 0]))
    # rows outside the window are never read
    np.testing.assert_array_equal(np.asarray(draft(x, ctx_kv.at[:, : anchor + 1 - w].set(jnp.nan))), np.asarray(out))
    # a ring-resident context listed by slot is the same attention, bit for bit
    ring = jax.jit(lambda x, ring: draft_attention(p, cfg, x, ring, anchors, F32,
                                                   ctx_idx=jnp.broadcast_to(jnp.arange(w), (b, w))))
    np.testing.assert_array_equal(np.asarray(ring(x, ctx_kv[:, np.asarray(slots)])), np.asarray(out))

