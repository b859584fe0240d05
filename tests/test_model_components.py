"""Model components against the independent component fixtures (tests/fixtures/dsv41_reference).

Those fixtures hold fp32 values (computed in fp32 or float64 and rounded), so the bound is a few fp32
ulps of the largest magnitude involved: the only freedom left is summation order and exp/sigmoid
implementations.
"""

import json
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from v41_jax.model.engram import engram
from v41_jax.linear import GEMM_OUT_ROWS, SPLIT_ROWS, bf16_parts, gemm_out_dtype
from v41_jax.model.linear import k_block_dot, lin8, lin_bf, lin_f32
from v41_jax.model.mhc import collapse, expand, hc_mixes, one_hot_pre, split_sinkhorn
from v41_jax.model.moe import route, routed_experts, score, swiglu_ffn
from v41_jax.model.norm import rms_norm
from v41_jax.model.numerics import Numerics, cascade_sum, exact_div
from v41_jax.model.rope import apply_rope, rope_freqs
from v41_jax.quant import fp8_act_qdq

REF = Path(__file__).parent / "fixtures" / "dsv41_reference"
F32_EPS = float(np.finfo(np.float32).eps)


def load(name):
    return json.loads((REF / name).read_text())


def arr(values, *shape):
    return np.asarray(values, np.float32).reshape(*shape)


def assert_ulps(actual, expected, ulps):
    """|actual - expected| <= ulps fp32 ulps of the largest |expected|."""
    expected = np.asarray(expected, np.float32)
    bound = ulps * F32_EPS * max(float(np.abs(expected).max()), 1.0)
    np.testing.assert_allclose(np.asarray(actual, np.float32), expected, rtol=0, atol=bound)


# ---- numerics -----------------------------------------------------------------------------------

def test_exact_div_is_correctly_rounded_under_jit():
    x = np.random.default_rng(0).random((512, 4), np.float32) + 0.1
    got = jax.jit(lambda a: exact_div(a, a[:, :1] + 1e-6))(x)
    np.testing.assert_array_equal(np.asarray(got), x / (x[:, :1] + np.float32(1e-6)))


# ---- RMSNorm ------------------------------------------------------------------------------------

@pytest.mark.parametrize("numerics", [Numerics.reference(), Numerics.fast()], ids=["exact", "fast"])
def test_rms_norm_rounds_once_from_fp32(numerics):
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((3, 96)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal(96), jnp.bfloat16)
    y = rms_norm(x, w, 1e-20, numerics)
    assert y.dtype == jnp.bfloat16
    xf = np.asarray(x, np.float64)
    want = np.asarray(w, np.float64) * xf / np.sqrt((xf ** 2).mean(-1, keepdims=True) + 1e-20)
    # one rounding to bf16 of a value exact to fp32 precision: within half a bf16 ulp (+ fp32 noise)
    np.testing.assert_allclose(np.asarray(y, np.float64), want, rtol=2 ** -8 + 1e-6, atol=0)


# ---- RoPE ---------------------------------------------------------------------------------------

def test_rope_interleaved_on_last_lanes_and_inverse():
    d = load("rope_interleaved_offset.json")
    L, H, D, R = d["length"], d["heads"], d["dim"], d["rotaryDim"]
    assert d["dimOffset"] == D - R  # the rotation sits on the last R lanes
    cos, sin = arr(d["cos"], L, R // 2), arr(d["sin"], L, R // 2)
    q, k = jnp.asarray(arr(d["q"], L, H, D)), jnp.asarray(arr(d["k"], L, D))
    q_rot = apply_rope(q, cos[:, None], sin[:, None])
    k_rot = apply_rope(k, cos, sin)
    assert_ulps(q_rot, arr(d["qRotated"], L, H, D), 2)
    assert_ulps(k_rot, arr(d["kRotated"], L, D), 2)
    assert_ulps(apply_rope(q_rot, cos[:, None], sin[:, None], inverse=True), arr(d["qInverse"], L, H, D), 2)
    assert_ulps(apply_rope(k_rot, cos, sin, inverse=True), arr(d["kInverse"], L, D), 2)
    np.testing.assert_array_equal(np.asarray(q_rot)[..., : D - R], np.asarray(q)[..., : D - R])


def test_rope_yarn_band_for_released_config():
    # docs/MODEL.md §3.1: dim 64, base 160000, L0 65536, factor 16 -> ramp lo 15, hi 25
    cfg = SimpleNamespace(rope_head_dim=64, rope_theta=10000.0, compress_rope_theta=160000.0,
                          original_seq_len=65536, rope_factor=16.0, beta_fast=32, beta_slow=1)
    plain = 1.0 / 160000.0 ** (np.arange(0, 64, 2) / 64)
    yarn = rope_freqs(cfg, global_table=True)
    np.testing.assert_allclose(yarn[:16], plain[:16], rtol=1e-6)     # i <= lo: unchanged
    np.testing.assert_allclose(yarn[25:], plain[25:] / 16, rtol=1e-6)  # i >= hi: divided by factor
    assert np.all(yarn[16:25] < plain[16:25]) and np.all(yarn[16:25] > plain[16:25] / 16)
    np.testing.assert_allclose(rope_freqs(cfg, global_table=False),
                               1.0 / 10000.0 ** (np.arange(0, 64, 2) / 64), rtol=1e-6)


def test_rope_frequencies_are_the_references_bits():
    """The reference evaluates `1.0 / (base ** (arange(0, dim, 2, fp32) / dim))` in torch, whose
    scalar ** fp32-tensor power runs in double; an fp32 power differs in the last bit on a few
    lanes at the released widths (and moves every rotated value in those lanes)."""
    import torch

    for theta in (10000.0, 160000.0, 40000.0):
        for dim in (64, 32):
            cfg = SimpleNamespace(rope_head_dim=dim, rope_theta=theta, compress_rope_theta=theta,
                                  original_seq_len=0)
            want = (1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))).numpy()
            np.testing.assert_array_equal(rope_freqs(cfg, global_table=False), want)


def test_rope_rotation_is_the_references_complex_multiply_bit_for_bit():
    """torch multiplies complex64 as (ac - bd, ad + bc) with every product rounded; XLA:CPU would
    contract a product into an FMA (24% of fp32 results differed) unless `numerics.rounded` stops it."""
    import torch

    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 64, 3, 32)).astype(np.float32)
    ang = np.outer(np.arange(64), rng.random(16)).astype(np.float32)
    cis = torch.polar(torch.ones(ang.shape), torch.from_numpy(ang))
    want = torch.view_as_real(torch.view_as_complex(torch.from_numpy(x).unflatten(-1, (-1, 2)))
                              * cis.view(1, 64, 1, 16)).flatten(-2).numpy()
    cos, sin = jnp.asarray(cis.real.numpy())[None, :, None], jnp.asarray(cis.imag.numpy())[None, :, None]
    got = np.asarray(jax.jit(apply_rope)(jnp.asarray(x), cos, sin))
    np.testing.assert_array_equal(got, want)


# ---- linear -------------------------------------------------------------------------------------

def test_k_block_dot_sums_blocks_in_k_order():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((3, 128)).astype(np.float32)
    w = rng.standard_normal((5, 128)).astype(np.float32)
    want = np.zeros((3, 5), np.float32)
    for b in range(4):  # the reference kernel: fp32 block partial, added to the fp32 accumulator
        want += x[:, 32 * b:32 * (b + 1)] @ w[:, 32 * b:32 * (b + 1)].T
    got = np.asarray(k_block_dot(jnp.asarray(x), jnp.asarray(w)))
    # block partials themselves may sum in another order: a few fp32 ulps of each partial
    np.testing.assert_allclose(got, want, rtol=0, atol=8 * F32_EPS * np.abs(x).max() * np.abs(w).max() * 32)


def test_lin8_quantizes_the_activation_and_rounds_once():
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((4, 64)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((8, 64)) * 0.1, jnp.bfloat16)
    ref, fast = Numerics.reference(), Numerics.fast()
    y = lin8(x, w, ref)
    xq = np.asarray(fp8_act_qdq(x), np.float64)
    want = xq @ np.asarray(w, np.float64).T
    assert y.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(y, np.float64), want, rtol=2 ** -8, atol=1e-6)
    # the fast policy differs only in fp32 summation order: at most one bf16 ulp
    np.testing.assert_allclose(np.asarray(lin8(x, w, fast), np.float64), np.asarray(y, np.float64), rtol=2 ** -7)
    # the fp32 policy does not quantize: differs from the quantized product by the fp8 error
    y32 = lin8(x, w, Numerics.fp32())
    assert y32.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(y32), np.asarray(x, np.float64) @ np.asarray(w, np.float64).T,
                               rtol=1e-5, atol=1e-5)
    assert lin_bf(x, w, ref).dtype == jnp.bfloat16


@pytest.mark.parametrize("m, k, n", [(1, 5120, 1280), (2, 1280, 4096), (300, 4096, 512)])
def test_gemm_writing_the_activation_dtype_rounds_its_fp32_sum_once(m, k, n):
    """Without `exact_gemm_out` the GEMM writes bf16 itself from GEMM_OUT_ROWS rows (no fp32
    tensor in the program) and rounds the same fp32 sum once: on XLA:CPU bit-equal to the fp32
    result cast afterwards."""
    from dataclasses import replace

    rng = np.random.default_rng(m)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((n, k)) * 0.05, jnp.bfloat16)
    fast = Numerics.fast()
    exact = replace(fast, exact_gemm_out=True)
    own = m >= GEMM_OUT_ROWS      # below: fp32 both ways, only the HLO assertion can tell them apart
    assert gemm_out_dtype(fast, m) == (jnp.bfloat16 if own else jnp.float32)
    assert gemm_out_dtype(exact, m) == jnp.float32
    for f in (lin8, lin_bf):
        hlo = jax.jit(lambda x, w, f=f: f(x, w, fast)).lower(x, w).as_text()
        dots = [ln for ln in hlo.splitlines() if "dot_general" in ln]
        assert dots and all(f"tensor<{m}x{n}x{'bf16' if own else 'f32'}>" in ln for ln in dots), dots
        got = jax.jit(lambda x, w, f=f: f(x, w, fast))(x, w)
        want = jax.jit(lambda x, w, f=f: f(x, w, exact))(x, w)
        assert got.dtype == want.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


# ---- mHC ----------------------------------------------------------------------------------------

def test_sinkhorn_collapse_expand_hc_mix():
    d = load("hc_mix.json")
    hc, T, D = d["hc"], d["tokens"], d["dim"]
    m = jnp.asarray(arr(d["mixes"], T, -1))
    streams, x = jnp.asarray(arr(d["streams"], T, hc, D)), jnp.asarray(arr(d["x"], T, D))
    for case in d["cases"]:
        pre, post, comb = split_sinkhorn(m, jnp.asarray(arr(d["scale"], 3)), jnp.asarray(arr(d["bias"], -1)),
                                         hc, case["iters"], d["eps"])
        assert_ulps(pre, arr(case["pre"], T, hc), 1)
        assert_ulps(post, arr(case["post"], T, hc), 1)
        assert_ulps(comb, arr(case["comb"], T, hc, hc), 2)
        assert_ulps(collapse(streams, pre), arr(case["preMix"], T, D), 2)
        assert_ulps(expand(x, streams, post, comb), arr(case["postMix"], T, hc, D), 4)


@pytest.mark.parametrize("case", load("hyper_connection.json")["cases"], ids=lambda c: c["name"])
def test_hc_mixes_from_raw_streams(case):
    hc, D, T = case["hc"], case["dim"], case["tokens"]
    cfg = SimpleNamespace(norm_eps=case["normEps"], hc_mult=hc, hc_sinkhorn_iters=case["iters"],
                          hc_eps=case["hcEps"])
    x = jnp.asarray(arr(case["x"], T, hc, D))
    pre, post, comb = hc_mixes(x, jnp.asarray(arr(case["fn"], -1, hc * D)), jnp.asarray(arr(case["base"], -1)),
                               jnp.asarray(arr(case["scale"], 3)), cfg, Numerics.reference())
    assert_ulps(pre, arr(case["pre"], T, hc), 2)
    assert_ulps(post, arr(case["post"], T, hc), 2)
    assert_ulps(comb, arr(case["comb"], T, hc, hc), 2)
    assert_ulps(collapse(x, pre), arr(case["collapsed"], T, D), 2)
    assert_ulps(expand(jnp.asarray(arr(case["sub"], T, D)), x, post, comb), arr(case["expanded"], T, hc, D), 4)


def test_one_hot_pre_collapse_returns_stream_zero():
    x = jnp.asarray(np.random.default_rng(4).standard_normal((2, 3, 4, 8)), jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(collapse(x, one_hot_pre((2, 3), 4))), np.asarray(x[..., 0, :]))


# ---- MoE ----------------------------------------------------------------------------------------

def test_route_sqrtsoftplus_with_selection_only_bias():
    d = load("moe_route_sqrtsoftplus.json")
    T, E, k = d["tokens"], d["experts"], d["topk"]
    cfg = SimpleNamespace(score_func="sqrtsoftplus", gate_temp=d["gateTemp"], norm_topk_prob=True,
                          route_scale=d["routeScale"])
    image = np.asarray(d["tokenKinds"])[:, None] == 1
    bias = np.where(image, arr(d["biasVl"], E), arr(d["bias"], E))
    w, idx = route(jnp.asarray(arr(d["logits"], T, E)), jnp.asarray(bias), k, cfg)
    np.testing.assert_array_equal(np.asarray(idx), np.asarray(d["indices"]).reshape(T, k))
    assert_ulps(w, arr(d["weights"], T, k), 2)


@pytest.mark.parametrize("func", ["softmax", "sigmoid", "sqrtsoftplus"])
def test_router_score_functions_match_float64(func):
    """The reference's three router scores (torch: softmax over the experts, sigmoid, sqrt of
    softplus with threshold 20) of x = logits / gate_temp, each within 4 fp32 ulps of float64 on
    the same fp32 x (and x - max, for softmax): past those two roundings, which both compute, exp,
    log1p, the division and the sum each round once."""
    rng = np.random.default_rng(7)
    logits = rng.standard_normal((5, 16)).astype(np.float32) * 8
    cfg = SimpleNamespace(score_func=func, gate_temp=0.75)
    x32 = logits / np.float32(0.75)
    x = x32.astype(np.float64)
    shifted = (x32 - x32.max(-1, keepdims=True)).astype(np.float64)
    want = {"softmax": lambda: np.exp(shifted) / np.exp(shifted).sum(-1, keepdims=True),
            "sigmoid": lambda: 1 / (1 + np.exp(-x)),
            "sqrtsoftplus": lambda: np.sqrt(np.where(x > 20, x, np.log1p(np.exp(x))))}[func]()
    got = np.asarray(score(jnp.asarray(logits), cfg), np.float64)
    assert np.all(np.abs(got - want) <= 4 * np.spacing(np.abs(want).astype(np.float32)))
    if func == "softmax":
        assert np.allclose(got.sum(-1), 1, atol=1e-6)


def test_route_ties_go_to_the_lower_expert():
    cfg = SimpleNamespace(score_func="sqrtsoftplus", gate_temp=1.0, norm_topk_prob=True, route_scale=1.5)
    logits = jnp.asarray([[0.5, 1.0, 1.0, 1.0, 0.2]], jnp.float32)
    _, idx = route(logits, jnp.zeros(5), 2, cfg)
    np.testing.assert_array_equal(np.asarray(idx), [[1, 2]])


@pytest.mark.parametrize("case", load("moe_exec.json")["cases"], ids=lambda c: c["name"])
def test_moe_exec_fp32(case):
    T, D, F, E, k = case["tokens"], case["dim"], case["inter"], case["experts"], case["topk"]
    x = jnp.asarray(arr(case["x"], T, D))
    cfg = SimpleNamespace(score_func="sqrtsoftplus", gate_temp=1.0, norm_topk_prob=True, route_scale=1.0)
    # the recorded routing (the fixture's gate uses its own route_scale); our gate must pick the same experts
    _, idx_gate = route(x @ jnp.asarray(arr(case["gateWeight"], E, D)).T, jnp.asarray(arr(case["gateBias"], E)), k, cfg)
    idx = np.asarray(case["indices"]).reshape(T, k)
    np.testing.assert_array_equal(np.sort(np.asarray(idx_gate), -1), np.sort(idx, -1))
    num = Numerics.fp32()
    y = routed_experts(x, jnp.asarray(idx), jnp.asarray(arr(case["weights"], T, k)), jnp.asarray(arr(case["w1"], E, F, D)),
                       jnp.asarray(arr(case["w3"], E, F, D)), jnp.asarray(arr(case["w2"], E, D, F)), num, case["limit"])
    y = y + swiglu_ffn(x, jnp.asarray(arr(case["sw1"], F, D)), jnp.asarray(arr(case["sw3"], F, D)),
                       jnp.asarray(arr(case["sw2"], D, F)), num, case["limit"])
    assert_ulps(y, arr(case["y"], T, D), 32)  # sums of k+1 expert outputs, each through 3 fp32 GEMMs


# ---- torch-CPU parity of the reductions the reference performs (rms_inv: test_kernels_rmsnorm) --

@pytest.mark.parametrize("n", [3, 8, 33, 64, 256, 1000, 5120, 20480, 131211])
def test_cascade_sum_is_torch_cpu_sum_bit_for_bit(n):
    """131211 = 4100 rows of 32 and 11: level 3 of the cascade holds a sum (256 runs of 16 rows)."""
    torch = pytest.importorskip("torch")
    torch.set_num_threads(1)
    rng = np.random.default_rng(n)
    x = (rng.standard_normal((16, n)) * np.exp(rng.standard_normal((16, n)))).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(jax.jit(cascade_sum)(x)), torch.from_numpy(x).sum(-1).numpy())


# ---- Engram -------------------------------------------------------------------------------------

def test_engram_closed_gate_passes_streams_through_and_open_gate_adds_value():
    n, d, cols, hd = 4, 32, 6, 32
    cfg = SimpleNamespace(hc_mult=n, dim=d, norm_eps=1e-20)
    rng = np.random.default_rng(6)
    p = {"wkv": {"weight": jnp.asarray(rng.standard_normal(((n + 1) * d, cols * hd)) / 16, jnp.float32)},
         "q_weight": jnp.ones((n, d)), "k_weight": jnp.ones((n, d))}
    x = jnp.asarray(rng.standard_normal((2, 3, n, d)), jnp.float32)
    rows = jnp.asarray(rng.standard_normal((2, 3, cols, hd)), jnp.float32)
    mask = jnp.asarray([[True, False, True], [False, True, True]])
    y = engram(p, cfg, x, rows, Numerics.fp32(), mask)
    np.testing.assert_array_equal(np.asarray(y)[~np.asarray(mask)], np.asarray(x)[~np.asarray(mask)])
    # open gate: y = x + sigmoid(signed sqrt of the normalised dot) * value, per stream
    kv = np.asarray(rows).reshape(2, 3, -1) @ np.asarray(p["wkv"]["weight"]).T
    key, value = kv[..., : n * d].reshape(2, 3, n, d), kv[..., n * d:]
    xf = np.asarray(x, np.float64)
    dot = (xf * key).sum(-1) / np.sqrt((xf ** 2).mean(-1) * (key ** 2).mean(-1)) / np.sqrt(d)
    gate = 1 / (1 + np.exp(-np.sign(dot) * np.sqrt(np.maximum(np.abs(dot), 1e-6))))
    want = xf + gate[..., None] * value[..., None, :]
    np.testing.assert_allclose(np.asarray(y)[np.asarray(mask)], want[np.asarray(mask)], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_top_k_by_ranks_picks_what_lax_top_k_picks(dtype):
    """Short rows take `top_k` by ranks (no sort launch); its picks and values must be lax.top_k's
    (total order after the zero fold, ties to the lower index) bit for bit, NaNs of both signs,
    infinities and signed zeros included. (Rows past the size bounds call lax.top_k itself.)"""
    from v41_jax import numerics as nm

    rng = np.random.default_rng(7)
    special = np.array([0.0, -0.0, 1.0, -1.0, np.inf, -np.inf, np.nan, -np.nan, 1e-30, -1e-30], np.float32)
    picks = jax.jit(nm.top_k, static_argnums=1)
    want = jax.jit(lambda x, k: jax.lax.top_k(jnp.where(x == 0, jnp.zeros_like(x), x), k), static_argnums=1)
    for t, n, k in [(1, 1, 1), (3, 7, 2), (8, 64, 6), (5, 33, 33)] * 10:
        x = np.where(rng.random((t, n)) < 0.5, rng.choice(special, (t, n)),
                     rng.integers(-3, 4, (t, n)).astype(np.float32))
        x = jnp.asarray(x, dtype)
        assert t * n * n <= nm.RANK_PAIRS and n <= nm.RANK_TOPK_MAX      # the ranks route
        values, ids = picks(x, k)
        want_v, want_i = want(x, k)
        np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_i))
        assert values.dtype == want_v.dtype and ids.dtype == want_i.dtype
        np.testing.assert_array_equal(np.asarray(values, np.float32).view(np.uint32),
                                      np.asarray(want_v, np.float32).view(np.uint32))


@pytest.mark.parametrize("n,rows", [(1, 3), (6, 8), (384, 1), (512, 32), (512, 33), (1024, 1), (1025, 1)])
def test_stable_argsort_is_numpys_stable_argsort(n, rows):
    """Both routes (ranks by comparison within RANK_SORT_MAX keys and RANK_PAIRS comparisons, a
    sort past them) give numpy's stable order: many ties (8 distinct keys), negative keys, rows
    batched; the first k of it when asked."""
    from v41_jax import numerics as nm

    keys = np.random.default_rng(n + rows).integers(-1, 7, (rows, n)).astype(np.int32)
    want = np.argsort(keys, axis=-1, kind="stable")
    got = np.asarray(nm.stable_argsort(jnp.asarray(keys)))
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.asarray(nm.stable_argsort(jnp.asarray(keys), max(1, n // 3))),
                                  want[:, :max(1, n // 3)])


def test_top_k_treats_signed_zeros_as_ties():
    """ReLU zeros times a negative head weight give -0.0; the reference's comparisons (and its
    lowest-index tie run) see -0.0 == +0.0, lax.top_k's total order would put +0.0 first."""
    from v41_jax.model.indexer import select_topk
    from v41_jax.model.numerics import top_k

    x = jnp.array([-0.0, -0.0, 0.0, 0.0, -1.0])
    assert top_k(x, 2)[1].tolist() == [0, 1]
    assert jax.lax.top_k(x, 2)[1].tolist() == [2, 3]       # why the wrapper exists
    assert select_topk(x[None], jnp.array([5]), 2).tolist() == [[0, 1]]


def test_bf16_parts_sum_back_to_the_fp32_weight():
    """`bf16_parts`: hi + mid + lo == w bit for bit over 2^-100 .. 2^100 (its promise: magnitudes
    >= 2^-103), both signs; the parts are bf16 (so the split GEMM's products are exact in fp32)."""
    rng = np.random.default_rng(0)
    w = (rng.uniform(1, 2, 1 << 16) * rng.choice([-1, 1], 1 << 16)
         * 2.0 ** rng.integers(-100, 100, 1 << 16)).astype(np.float32)
    w[:4] = [0.0, -0.0, 1.0, -3.0]
    parts = bf16_parts(jnp.asarray(w))
    assert all(p.dtype == jnp.bfloat16 for p in parts)
    hi, mid, lo = (np.asarray(p, np.float32) for p in parts)
    np.testing.assert_array_equal((hi + mid) + lo, w)


@pytest.mark.parametrize("rows", [SPLIT_ROWS - 1, SPLIT_ROWS])
def test_lin_f32_of_bf16_rows_by_an_fp32_weight_keeps_every_weight_bit(rows):
    """Both routes of `lin_f32` for bf16 x by fp32 w (the fp32 GEMM below SPLIT_ROWS rows, the
    three-part bf16 GEMM from there): a row with one power of two at column j gives that power
    times w[:, j] exactly (one nonzero product, sums with +0 exact), so a part dropped or rounded
    shows; random rows stay within the fp32 accumulation bound K * 2^-24 * sum |x w| of the
    float64 dot."""
    rng = np.random.default_rng(rows)
    k, n = 512, 24
    w = rng.standard_normal((n, k)).astype(np.float32)
    # the route taken: a bf16 dot of 3N outputs from SPLIT_ROWS rows, an fp32 dot of N below
    jaxpr = jax.make_jaxpr(lin_f32)(jnp.zeros((rows, k), jnp.bfloat16), jnp.asarray(w))
    dots = [e for e in jaxpr.eqns if e.primitive.name == "dot_general"]
    split = rows >= SPLIT_ROWS
    assert [(e.invars[1].aval.dtype, e.outvars[0].aval.shape[-1]) for e in dots] == \
        [(jnp.bfloat16 if split else jnp.float32, 3 * n if split else n)]
    cols = rng.integers(0, k, rows)
    x = np.zeros((rows, k), np.float32)
    x[np.arange(rows), cols] = 2.0 ** rng.integers(-8, 8, rows)
    got = np.asarray(lin_f32(jnp.asarray(x, jnp.bfloat16), jnp.asarray(w)))
    np.testing.assert_array_equal(got, x[np.arange(rows), cols][:, None] * w[:, cols].T)
    xr = rng.standard_normal((rows, k)).astype(jnp.bfloat16).astype(np.float32)
    got = np.asarray(lin_f32(jnp.asarray(xr, jnp.bfloat16), jnp.asarray(w)), np.float64)
    exact = xr.astype(np.float64) @ w.T.astype(np.float64)
    bound = (k + 2) * 2.0 ** -24 * (np.abs(xr).astype(np.float64) @ np.abs(w.T).astype(np.float64))
    assert (np.abs(got - exact) <= bound).all()
