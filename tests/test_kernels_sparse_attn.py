"""Pallas sparse latent attention vs its XLA path (gather + the model's core) and the fixture.

On CPU the kernel runs in Pallas interpret mode; on a GPU the same tests compile it for real.
Interpret mode starts every output at NaN, so a finite result also proves every element written.
Tolerances: `BF16_TOL` (rtol = atol = 2^-7, derived where it is defined) against the XLA path;
the fp32-policy fixture check is held to 1e-5.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_common import assert_close, fp4_rows, fp8_rows, fresh_rng, load_fixture
from kernels_pallas import backend
from kernels_pallas.sparse_attn import BF16_TOL, default_splits, launch_config, sparse_attn_paged
from kernels_pallas.split_merge import merge_splits
from v41_jax.quant import (KV_FP4_GROUP, KV_FP8_GROUP, dequant_fp4_e4m3_rows, dequant_fp8_rows, quant_fp4_e4m3,
                           quant_fp8_ue8m0)
from v41_jax.model.numerics import Numerics

REF = Numerics.reference()
F32 = Numerics.fp32()


def _case(rng, t=6, h=4, d=64, rows=(40, 150), k=(20, 70), p_skip=0.2, dtype=jnp.bfloat16):
    q = jnp.asarray(rng.standard_normal((t, h, d)), dtype)
    sink = jnp.asarray(rng.standard_normal(h), jnp.float32)
    sources = []
    for r, kk in zip(rows, k):
        kv = jnp.asarray(rng.standard_normal((r, d)) * 0.5, dtype)
        idx = rng.integers(0, r, (t, kk))
        idx[rng.random((t, kk)) < p_skip] = -1
        sources.append((kv, jnp.asarray(idx, jnp.int32)))
    return q, sink, sources


def _both(q, sink, sources, numerics=REF, **kw):
    scale = q.shape[-1] ** -0.5
    got = sparse_attn_paged(q, sink, sources, scale, numerics=numerics, backend="pallas", **kw)
    want = sparse_attn_paged(q, sink, sources, scale, numerics=numerics, backend="xla")
    return np.asarray(got, np.float32), np.asarray(want, np.float32)


@pytest.mark.parametrize("splits", [1, 3])
def test_matches_xla_path(splits):
    rng, seed = fresh_rng()
    got, want = _both(*_case(rng), num_splits=splits)
    assert np.isfinite(got).all(), f"unwritten or NaN output (seed {seed})"
    assert_close(got, want, rtol=BF16_TOL, atol=BF16_TOL, seed=seed, what=f"splits={splits}")
    if splits == 1:
        # one split walks the same chunks with the same running max as the reference: the only
        # freedom left is the dot's fp32 summation order, so nearly every element is identical
        assert np.mean(got == want) > 0.95, f"seed {seed}"


def test_head_blocks():
    """32 heads in two programs of 16 per token: each reads the rows, each writes its heads."""
    rng, seed = fresh_rng()
    got, want = _both(*_case(rng, h=32), head_block=16)
    assert_close(got, want, rtol=BF16_TOL, atol=BF16_TOL, seed=seed)


KMERGE_LAUNCH = [dict(head_block=16), dict(head_block=16, value_parts=2), dict(head_block=32, lane_pairs=True)]


@pytest.mark.parametrize("splits,launch", [(2, KMERGE_LAUNCH[0]), (3, KMERGE_LAUNCH[0]), (2, KMERGE_LAUNCH[1]),
                                          (3, KMERGE_LAUNCH[2])], ids=["h16-2", "h16-3", "halves-2", "pairs-3"])
def test_split_merge_in_kernel(splits, launch):
    """The merge in the last program of a token's head block to finish (`merge_in_kernel`, the
    default for 16-head programs at 2 splits) against the XLA epilogue over the same partials: one
    formula (`split_merge.combine`) reading every split in index order, whichever program merges.
    In interpret mode equal to the epilogue bit for bit; compiled (where Triton's exp and divide
    are not XLA's) within `BF16_TOL` of the XLA path and the same bits in a second run (a merger
    that read a partial before it was whole would not be). With value halves each part merges its
    own statistics; with lane pairs the lanes are put back after the kernel. The flag reaches the
    kernel: its call aliases the arrival counters, and only then."""
    rng, seed = fresh_rng()
    q, sink, sources = _case(rng, h=32)
    got, want = _both(q, sink, sources, num_splits=splits, merge_in_kernel=True, **launch)
    assert np.isfinite(got).all(), f"seed {seed}"
    assert_close(got, want, rtol=BF16_TOL, atol=BF16_TOL, seed=seed, what=f"splits={splits}")
    if backend.interpret():
        epilogue, _ = _both(q, sink, sources, num_splits=splits, merge_in_kernel=False, **launch)
        np.testing.assert_array_equal(got, epilogue, err_msg=f"seed {seed}")
    else:
        again, _ = _both(q, sink, sources, num_splits=splits, merge_in_kernel=True, **launch)
        np.testing.assert_array_equal(got, again, err_msg=f"seed {seed}")
    for merge in (True, False):
        jaxpr = str(jax.make_jaxpr(lambda q: sparse_attn_paged(
            q, sink, sources, 0.125, numerics=REF, backend="pallas", num_splits=splits,
            merge_in_kernel=merge, **launch))(q))
        assert ("input_output_aliases=()" not in jaxpr) == merge


HALVES_LAUNCH = [dict(head_block=16), dict(head_block=64, num_warps=4, num_stages=3, prefetch_ids=False)]


@pytest.mark.parametrize("launch", HALVES_LAUNCH, ids=["h16", "h64w4s3"])
@pytest.mark.parametrize("splits", [1, 3])
def test_value_halves(splits, launch):
    """The output's columns in two programs (`value_parts=2`), each summing the logits from the
    rows' two halves and keeping its own softmax statistics: against the XLA path within the
    kernel's tolerance, 64 heads in 16-head blocks (four blocks: a statistics block written to
    another block's place shows) or in one, and splits; a half narrower than 16 lanes, or 3-4
    parts, are refused."""
    rng, seed = fresh_rng()
    case = _case(rng, h=64, rows=(40, 150, 30), k=(20, 70, 64))
    got, want = _both(*case, num_splits=splits, value_parts=2, **launch)
    assert np.isfinite(got).all(), f"unwritten or NaN output (seed {seed})"
    assert_close(got, want, rtol=BF16_TOL, atol=BF16_TOL, seed=seed, what=f"splits={splits}")
    whole, _ = _both(*case, num_splits=splits, value_parts=1, **launch)
    # the halves move only the logits' fp32 summation order: most elements equal the one-product
    # kernel's
    assert np.mean(got == whole) > 0.95, f"seed {seed}"
    with pytest.raises(ValueError, match="value_parts 4"):
        _both(*case, value_parts=4)
    q, sink, sources = _case(rng, d=16)
    with pytest.raises(ValueError, match="value_parts 2"):
        _both(q, sink, sources, value_parts=2)


def test_value_halves_fp32_policy():
    rng, seed = fresh_rng()
    got, want = _both(*_case(rng, h=32, dtype=jnp.float32), numerics=F32, num_splits=2,
                      head_block=16, value_parts=2)
    assert got.dtype == np.float32
    assert_close(got, want, rtol=1e-5, atol=1e-6, seed=seed)


def _packed(sources, formats):
    """The sources with rows packed per `formats` ("fp8" window format, "fp4" compressed format,
    None: typed), and the same with typed rows holding the packed rows' values."""
    packed, typed = [], []
    rng = np.random.default_rng(0)
    for fmt, (kv, idx) in zip(formats, sources):
        # every 16-lane group at its own magnitude, 2^-14..2^5: each scale column differs, and
        # some E4M3 scales are subnormal
        x = kv.astype(jnp.float32)
        x = x * jnp.repeat(jnp.asarray(2.0 ** rng.integers(-14, 6, (x.shape[0], x.shape[1] // 16)),
                                       jnp.float32), 16, axis=1)
        if fmt == "fp8":
            codes, scale = quant_fp8_ue8m0(x, KV_FP8_GROUP)
            values = dequant_fp8_rows(codes, scale, KV_FP8_GROUP, kv.dtype)
        elif fmt == "fp4":
            codes, scale = quant_fp4_e4m3(x, KV_FP4_GROUP)
            values = dequant_fp4_e4m3_rows(codes, scale, KV_FP4_GROUP, kv.dtype)
        else:
            packed.append((kv, idx))
            typed.append((kv, idx))
            continue
        packed.append((jnp.concatenate([codes, scale], axis=-1), idx))
        typed.append((values, idx))
    return packed, typed


def _weighted_magnitude(q, sink, sources, scale) -> np.ndarray:
    """sum_j p_j |v_j| / den per output element [T, H, D], in float64: the attention's output with
    every value row replaced by its magnitudes (the probabilities still from the real rows)."""
    q = np.asarray(q, np.float64)
    out = np.zeros(q.shape)
    for t in range(q.shape[0]):
        rows = np.concatenate([np.asarray(kv, np.float64)[np.asarray(idx)[t][np.asarray(idx)[t] >= 0]]
                               for kv, idx in sources])                                   # [K, D]
        logits = q[t] @ rows.T * scale                                                    # [H, K]
        top = np.maximum(logits.max(axis=1), np.asarray(sink, np.float64))
        p = np.exp(logits - top[:, None])
        den = p.sum(axis=1) + np.exp(np.asarray(sink, np.float64) - top)
        out[t] = p @ np.abs(rows) / den[:, None]
    return out


# (tokens, heads, launch): 16-head programs with splits and value parts given, and the engine's
# default for packed rows from 32 tokens (`launch_config`: every head in one program, 2 splits);
# rows as lane pairs (each row its even and odd lanes): 16-head programs at one split (the lanes
# put back after the kernel; whole rows at one split are test_matches_xla_path's), and 64 heads
# in one program at 2 splits (put back after the merge); the default from 64 tokens (lane pairs,
# one split)
PACKED_CASES = [(6, 32, dict(num_splits=s, head_block=16, value_parts=v)) for s, v in ((3, 1), (1, 2), (3, 2))]
PACKED_CASES += [(32, 64, {}), (6, 32, dict(num_splits=1, head_block=16, lane_pairs=True)),
                 (32, 64, dict(lane_pairs=True)), (64, 16, {})]


@pytest.mark.parametrize("t,h,launch", PACKED_CASES, ids=lambda c: str(c).replace(" ", ""))
def test_packed_rows(t, h, launch):
    """Sources held as packed rows, the window's FP8 (D E4M3 codes + D/32 E8M0 scales) and the
    compressed rows' FP4 (D/2 bytes of E2M1 pairs + D/16 E4M3 scales), mixed with a typed source,
    skipped ids (which read no bytes) included: the XLA path decodes after its gather to the
    typed rows' output bit for bit; the kernel decodes them to the very values a typed row holds,
    so in interpret mode it equals its typed run bit for bit. Compiled, the packed and typed
    kernels are two programs (on an H100 not bit-equal at 3 splits, 2026-12-06), so the kernel is
    held to the XLA path by a bound derived for these rows of spread magnitudes (every 16 lanes at
    2^-14..2^5, where `BF16_TOL` around |o| does not hold: outputs cancel): each side rounds every
    probability to bf16 within 2^-8 of its exact value (relative to any running max), so their
    value sums differ by at most 2^-7 sum_j p_j |v_j| / den, and each bf16 output adds 2^-8 |o| <=
    2^-8 of that weighted magnitude: 2^-6 of it. Plus 2^-12 of it for the fp32 arithmetic, which
    stays below 2^-14: the scaled logits (up to ~52 here) carry 52 * 2^-24 ~ 2^-18 of relative
    error into each exponential, the fp32 sums of P.V and of the denominator over <= 154 ids
    154 * 2^-24 < 2^-16 a side, the splits' merge a few roundings. A width no format has is
    refused."""
    rng, seed = fresh_rng()
    q, sink, sources = _case(rng, t=t, h=h, rows=(40, 150, 30), k=(20, 70, 64))
    packed, typed = _packed(sources, ("fp8", "fp4", None))
    scale = q.shape[-1] ** -0.5
    run = lambda src, backend="pallas", **kw: np.asarray(sparse_attn_paged(
        q, sink, src, scale, numerics=REF, backend=backend, **launch, **kw), np.float32)
    got, want = run(packed), run(typed, "xla")
    assert np.isfinite(got).all() and np.abs(got).max() > 0, f"seed {seed}"
    np.testing.assert_array_equal(run(packed, "xla"), want, err_msg=f"seed {seed}")
    if backend.interpret():
        # the typed rows in the program packed rows get (by default typed rows get another one
        # at 32 tokens, whose other dot shapes sum in another order)
        same = {k: v for k, v in launch_config(t, packed=True).items() if k not in launch}
        np.testing.assert_array_equal(got, run(typed, **same), err_msg=f"seed {seed}")
    bound = (2.0 ** -6 + 2.0 ** -12) * _weighted_magnitude(q, sink, typed, scale)
    excess = np.abs(got.astype(np.float64) - want) - bound
    assert excess.max() <= 0, (f"seed {seed}: {int((excess > 0).sum())} elements past the bound, "
                               f"worst by {excess.max():.3g}")
    bad = [(r[:, :-1], i) if n == 0 else (r, i) for n, (r, i) in enumerate(packed)]
    with pytest.raises(ValueError, match=r"66 \(FP8\) or 36 \(FP4\) bytes, got 65"):
        run(bad)


def test_packed_rows_narrower_than_a_scale_group_are_refused():
    rng, _ = fresh_rng()
    q, sink, sources = _case(rng, d=32)
    packed, _ = _packed(sources, ("fp8", None))
    with pytest.raises(ValueError, match="packed fp8 rows: D/value_parts = 16 lanes"):
        _both(q, sink, packed, value_parts=2)


def test_split_merge_takes_each_value_parts_own_statistics():
    """`merge_splits` with two value parts whose statistics differ: each half of the columns is
    merged with its own part's (max, denominator), as a per-half numpy merge."""
    rng = np.random.default_rng(1)
    t, p, h, v, d = 3, 2, 4, 2, 8
    acc = rng.standard_normal((t, p, h, d)).astype(np.float32)
    run_max = rng.standard_normal((t, p, v, h)).astype(np.float32)
    denom = rng.uniform(1, 2, (t, p, v, h)).astype(np.float32)
    sink = rng.standard_normal(h).astype(np.float32)
    got = np.asarray(merge_splits(*map(jnp.asarray, (acc, run_max, denom, sink)), jnp.float32))
    for part in range(v):
        cols = slice(part * d // v, (part + 1) * d // v)
        m = run_max[:, :, part]                                        # [T, P, H]
        top = m.max(1)
        w = np.exp(m - top[:, None])
        den = (denom[:, :, part] * w).sum(1) + np.exp(sink[None] - top)
        want = (acc[..., cols] * w[..., None]).sum(1) / den[..., None]
        np.testing.assert_allclose(got[..., cols], want, rtol=1e-6)


@pytest.mark.parametrize("splits", [1, 3])
def test_ids_loaded_a_step_ahead_change_nothing(splits):
    """Each chunk's ids loaded one loop step ahead of its gather (`prefetch_ids`): the same rows
    in the same products, so the output is the plain kernel's bit for bit, sources of any chunk
    count (one-chunk sources too) and split bounds included. (In interpret mode the traces differ
    in the loop's carry and where the loads sit; compiled on a GPU, where the suite runs too, in
    the loads' schedule.)"""
    rng, seed = fresh_rng()
    q, sink, sources = _case(rng, h=32, rows=(40, 150, 30), k=(20, 70, 64))
    run = lambda ahead: np.asarray(sparse_attn_paged(
        q, sink, sources, q.shape[-1] ** -0.5, numerics=REF, backend="pallas", num_splits=splits,
        head_block=16, prefetch_ids=ahead), np.float32)
    plain = run(False)
    assert np.isfinite(plain).all() and np.abs(plain).max() > 0, f"seed {seed}"
    np.testing.assert_array_equal(run(True), plain, err_msg=f"seed {seed}")


def test_fp32_policy():
    rng, seed = fresh_rng()
    got, want = _both(*_case(rng, dtype=jnp.float32), numerics=F32, num_splits=1)
    assert got.dtype == np.float32
    assert_close(got, want, rtol=1e-5, atol=1e-6, seed=seed)


def test_skips_empty_window_and_fully_masked_rows():
    rng, seed = fresh_rng()
    q, sink, (win, comp) = _case(rng)
    win_idx = np.asarray(win[1]).copy()
    comp_idx = np.asarray(comp[1]).copy()
    win_idx[:3] = -1                      # tokens 0-2: empty window
    comp_idx[0] = -1                      # token 0: nothing valid at all
    comp_idx[4, 5:] = -1                  # token 4: ragged, 5 compressed ids left
    sources = [(win[0], jnp.asarray(win_idx)), (comp[0], jnp.asarray(comp_idx))]
    got, want = _both(q, sink, sources)
    assert (got[0] == 0).all(), "a token with no valid id must give exactly 0"
    assert_close(got, want, rtol=BF16_TOL, atol=BF16_TOL, seed=seed)


def test_unnamed_rows_are_never_read():
    """Pages the lists do not name (and the rows behind skipped ids) may hold NaN."""
    rng, seed = fresh_rng()
    q, sink, sources = _case(rng)
    poisoned = []
    for kv, idx in sources:
        named = np.zeros(kv.shape[0], bool)
        named[np.asarray(idx)[np.asarray(idx) >= 0]] = True
        kv = jnp.where(jnp.asarray(named)[:, None], kv, jnp.nan)
        poisoned.append((kv, idx))
    got, want = _both(q, sink, poisoned, num_splits=2)
    assert np.isfinite(got).all(), f"seed {seed}"
    assert_close(got, want, rtol=BF16_TOL, atol=BF16_TOL, seed=seed)


def test_batched_leading_dims_and_verify_width():
    """q [B, S, H, D] with S = 6 (a verify step), three sources (ring, extend rows, compressed)."""
    rng, seed = fresh_rng()
    q, sink, sources = _case(rng, t=12, rows=(30, 12, 90), k=(16, 6, 64))
    q = q.reshape(2, 6, *q.shape[1:])
    sources = [(kv, idx.reshape(2, 6, -1)) for kv, idx in sources]
    got, want = _both(q, sink, sources)
    assert got.shape == (2, 6, 4, 64)
    assert_close(got, want, rtol=BF16_TOL, atol=BF16_TOL, seed=seed)


def _fixture_rows():
    f = load_fixture("sparse_latent_attention.json")
    d = f["dim"]
    win = fp8_rows(f["window"]["codes"], f["window"]["scales"], d, 32)
    main = fp4_rows(f["main"]["codes"], f["main"]["scales"], d, 16, "e4m3")
    q = np.asarray(f["query"], np.float32).reshape(f["tokens"], f["heads"], d)
    idx = np.asarray(f["indices"], np.int32).reshape(f["tokens"], f["k"])
    want = np.asarray(f["expected"], np.float64).reshape(q.shape)
    return f, win, main, q, idx, want


def test_fixture_one_row_space():
    """The fixture's ids index window slots then main rows: one flat row view, as the BF16 pool's
    single row space (docs/CACHE.md §1.7). Float64 expected, no bf16 probabilities: fp32 policy."""
    f, win, main, q, idx, want = _fixture_rows()
    rows = jnp.asarray(np.concatenate([win, main]))
    got = sparse_attn_paged(jnp.asarray(q), jnp.asarray(f["sink"], jnp.float32),
                            [(rows, jnp.asarray(idx))], f["scale"], numerics=F32, backend="pallas")
    assert (np.asarray(got)[0] == 0).all()
    assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_fixture_split_sources_reference_numerics():
    """Same fixture through two sources (window plane, main plane); reference numerics (bf16 q,
    bf16 probabilities) stay within bf16 tolerance of the exact float64 result."""
    f, win, main, q, idx, want = _fixture_rows()
    n_win = f["windowSlots"]
    win_idx = np.where((idx >= 0) & (idx < n_win), idx, -1)
    main_idx = np.where(idx >= n_win, idx - n_win, -1)
    sources = [(jnp.asarray(win, jnp.bfloat16), jnp.asarray(win_idx)),
               (jnp.asarray(main, jnp.bfloat16), jnp.asarray(main_idx))]
    got = sparse_attn_paged(jnp.asarray(q, jnp.bfloat16), jnp.asarray(f["sink"], jnp.float32),
                            sources, f["scale"], numerics=REF, backend="pallas")
    scale = np.abs(want).max()
    assert_close(np.asarray(got, np.float32), want, rtol=2 ** -6, atol=2 ** -6 * scale)


def test_backend_switch(monkeypatch):
    rng, _ = fresh_rng()
    q, sink, sources = _case(rng)
    monkeypatch.setenv(backend.ENV_BACKEND, "xla")
    assert backend.resolve() == "xla"
    with backend.use_backend("pallas"):
        assert backend.resolve() == "pallas"
        assert backend.resolve("xla") == "xla"
    with pytest.raises(ValueError, match="kernel backend"):
        backend.resolve("triton")
    out = sparse_attn_paged(q, sink, sources, 0.125, numerics=REF)
    assert out.shape == q.shape


def test_default_splits():
    assert default_splits(1, 10) == 4
    assert default_splits(32, 10) == 2
    assert default_splits(64, 10) == 1
    assert default_splits(1, 2) == 2
