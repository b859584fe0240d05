"""The dense FP8 linear kernel (`kernels_pallas.dense_fp8`) against its rule, in Pallas interpret
mode on CPU (on a GPU, the kernel itself), and where `linear.lin8` sends each call.

The kernel forms the products XLA's dot forms (a bf16 x times an E4M3 value times a power of two
is exact in fp32) and sums them in another order: S range partials of K / S terms, each a sum of
K-step tiles. So it is held to the exact (float64) dot within the fp32 summation bound
(K + 1) * 2^-24 * sum |x w| (each of at most K additions rounds once, relative 2^-24 of a partial
sum that is at most sum |x w|; one more for fp32 x, whose products with a 4-bit significand are
rounded once each), not to XLA bit for bit; the same bound holds XLA's result.
"""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from kernels_pallas import backend
from kernels_pallas import dense_fp8 as kd
from v41_jax.linear import lin8
from v41_jax.model.numerics import Numerics
from v41_jax.quant import Fp8BlockWeight, quant_weight_fp8


def weight(n: int, k: int, seed: int = 0) -> Fp8BlockWeight:
    """Random FP8 blocks whose scales span 2^-12 .. 2^4 (rows and K blocks of unlike magnitude)."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)) * np.exp2(rng.integers(-12, 4, (n // 32, k // 32))).repeat(32, 0).repeat(32, 1)
    codes, scale = quant_weight_fp8(jnp.asarray(w, jnp.float32))
    return Fp8BlockWeight(codes, scale)


def exact(x, w: Fp8BlockWeight):
    xd, wd = np.asarray(x, np.float64), np.asarray(w.dequant(jnp.float32), np.float64)
    return xd @ wd.T, np.abs(xd) @ np.abs(wd).T


@pytest.mark.parametrize("m, n, k, dtype", [(1, 64, 256, jnp.bfloat16), (1, 96, 320, jnp.float32),
                                            (3, 64, 512, jnp.bfloat16), (17, 32, 96, jnp.bfloat16),
                                            (5, 64, 256, jnp.float32)])
def test_kernel_within_the_fp32_summation_bound(m, n, k, dtype):
    w = weight(n, k, seed=m)
    x = jnp.asarray(np.random.default_rng(k).standard_normal((m, k)), dtype)
    got = np.asarray(kd.dense_fp8(x, w, backend="pallas"), np.float64)
    xla = np.asarray(kd.dense_fp8(x, w, backend="xla"), np.float64)
    want, mag = exact(x, w)
    bound = (k + 1) * 2.0 ** -24 * mag
    assert got.shape == (m, n)
    assert np.all(np.abs(got - want) <= bound), np.max(np.abs(got - want) / bound)
    assert np.all(np.abs(xla - want) <= bound)
    # a decode error (a scale of the wrong block, a code misread) is far outside the bound
    wrong = Fp8BlockWeight(w.codes, jnp.roll(w.block_scale, 1, axis=1))
    off = np.asarray(kd.dense_fp8(x, wrong, backend="pallas"), np.float64)
    assert np.any(np.abs(off - want) > bound)


def test_splits_fill_the_device_divide_k_and_bound_the_partials():
    """About TARGET_PROGRAMS programs: a narrow weight splits its K steps, a wide one does not; the
    partials (S x rows x N fp32, written and read) stay under a quarter of the weight's bytes."""
    assert kd._splits(1280, 5120, 256, 1) == 10      # 40 row blocks x 10 ranges of 2 steps
    assert kd._splits(32768, 1280, 256, 1) == 1      # 1,024 row blocks already
    assert kd._splits(512, 5120, 256, 1) == 20       # 16 row blocks x 20 ranges of one step
    assert kd._splits(5120, 2304, 256, 1) == 3       # 160 x 3 (9 steps: divisors 1, 3, 9)
    assert kd._splits(512, 5120, 256, 16) == 10      # the partials' bound: S <= 5120 / (32 x 16)
    assert kd._splits(512, 5120, 256, 64) == 2
    for n, k, rows in ((1280, 5120, 1), (2304, 5120, 16), (5120, 8192, 64), (512, 5120, 32), (64, 224, 1)):
        bk = next(b for b in kd.K_STEPS if k % b == 0)
        s = kd._splits(n, k, bk, rows)
        assert (k // bk) % s == 0 and (n // kd.BN) * s <= max(kd.TARGET_PROGRAMS, n // kd.BN)
        assert s == 1 or 8 * s * rows * n <= n * k / 4


@pytest.mark.parametrize("m, n, k, target", [(1, 64, 1024, 2), (1, 64, 1024, 4), (5, 32, 2304, 1),
                                             (40, 96, 512, 3), (64, 32, 8192, 8)])
def test_sums_that_fp32_holds_exactly_are_exact(monkeypatch, m, n, k, target):
    """Integers in x (|x| <= 8) and in the E4M3 codes (|c| <= 16) under block scales 2^-1 .. 2^1:
    every product a multiple of 2^-1 of magnitude <= 256, so every partial sum of at most K = 8,192
    of them a multiple of 2^-1 below 2^21, which fp32 (24 significant bits) holds exactly in any
    order: the kernel must equal the exact dot bit for bit (an MMA's accumulation too), and a
    block's scale misread shows. TARGET_PROGRAMS lowered so that each K range runs several steps
    (4, 2, 9, 2 and 8 steps of 256 a range)."""
    monkeypatch.setattr(kd, "TARGET_PROGRAMS", target)
    rng = np.random.default_rng(m + n + k)
    ints = rng.integers(-16, 17, (n, k)).astype(ml_dtypes.float8_e4m3fn)          # exact in E4M3
    scale = rng.integers(127 - 1, 127 + 2, (n // 32, k // 32)).astype(np.uint8)
    w = Fp8BlockWeight(jnp.asarray(ints.view(np.uint8)), jnp.asarray(scale))
    x = jnp.asarray(rng.integers(-8, 9, (m, k)), jnp.bfloat16)
    want, _ = exact(x, w)
    got = np.asarray(kd.dense_fp8(x, w, backend="pallas"), np.float64)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("m, groups, r, kg", [(1, 4, 32, 64), (3, 2, 64, 96), (1, 8, 64, 256)])
def test_grouped_sums_are_exact_and_block_diagonal(m, groups, r, kg):
    """Block-diagonal (attention's `wo_a`): group g's R rows of w against x's g-th K' columns only.
    The exact-sum setting of the test above, against the float64 block-diagonal product; a weight
    read against the wrong group's columns shows."""
    rng = np.random.default_rng(m + groups + r)
    ints = rng.integers(-16, 17, (groups * r, kg)).astype(ml_dtypes.float8_e4m3fn)
    scale = rng.integers(127 - 1, 127 + 2, (groups * r // 32, kg // 32)).astype(np.uint8)
    w = Fp8BlockWeight(jnp.asarray(ints.view(np.uint8)), jnp.asarray(scale))
    x = jnp.asarray(rng.integers(-8, 9, (m, groups * kg)), jnp.bfloat16)
    wd = np.asarray(w.dequant(jnp.float32), np.float64).reshape(groups, r, kg)
    xg = np.asarray(x, np.float64).reshape(m, groups, kg)
    want = np.einsum("mgd,grd->mgr", xg, wd).reshape(m, groups * r)
    for route in ("pallas", "xla"):
        got = np.asarray(kd.dense_fp8(x, w, groups=groups, backend=route), np.float64)
        np.testing.assert_array_equal(got, want, err_msg=route)


def test_lin_grouped_of_the_held_weight_equals_lin_grouped_of_its_decode():
    """`linear.lin_grouped` (attention's `wo_a`): the kernel at a decode row count within one bf16
    ulp of the bf16-held einsum (the sum order differs), the same shape."""
    from v41_jax.linear import lin_grouped
    w = weight(4 * 64, 128, seed=7)
    x = jnp.asarray(np.random.default_rng(7).standard_normal((2, 3, 4, 128)), jnp.bfloat16)
    with backend.use_backend("pallas", kernel="dense_fp8"):
        got = np.asarray(lin_grouped(x, w, 4, Numerics.fast()).astype(jnp.float32))
    want = np.asarray(lin_grouped(x, w.dequant(), 4, Numerics.fast()).astype(jnp.float32))
    assert got.shape == want.shape == (2, 3, 4, 64)
    assert (np.abs(got.view(np.int32) - want.view(np.int32)) >> 16).max() <= 1


def test_takes_decode_rows_of_whole_blocks_on_the_pallas_backend():
    w = weight(64, 256)
    assert kd.takes(1, w, backend="pallas") and kd.takes(kd.MAX_ROWS, w, backend="pallas")
    assert not kd.takes(kd.MAX_ROWS + 1, w, backend="pallas")   # prefill: XLA's GEMM
    assert not kd.takes(1, w, backend="xla")
    stacked = Fp8BlockWeight(w.codes[None], w.block_scale[None])
    assert not kd.takes(1, stacked, backend="pallas")           # a scanned stack is sliced first
    odd = Fp8BlockWeight(*quant_weight_fp8(jnp.ones((48, 256), jnp.float32)))
    assert not kd.takes(1, odd, backend="pallas")               # a partial block of rows
    assert kd.takes(1, w, 2, "pallas") and not kd.takes(1, w, 4, "pallas")   # groups of 32 rows, not 16


@pytest.mark.parametrize("rows", [1, 4, 80])
def test_lin8_of_the_held_weight_equals_lin8_of_its_decode(rows):
    """`linear.lin8` under the fast policy: the kernel's rows (1, 4) within the bound of the
    bf16-held route before the activation rounding, so at most one bf16 ulp apart after it; the
    XLA route past MAX_ROWS (80 rows) bit for bit."""
    w = weight(64, 256, seed=rows)
    x = jnp.asarray(np.random.default_rng(rows).standard_normal((rows, 256)), jnp.bfloat16)
    with backend.use_backend("pallas", kernel="dense_fp8"):
        got = np.asarray(lin8(x, w, Numerics.fast()).astype(jnp.float32))
    want = np.asarray(lin8(x, w.dequant(), Numerics.fast()).astype(jnp.float32))
    if rows > kd.MAX_ROWS:
        np.testing.assert_array_equal(got, want)
    else:
        ulps = np.abs(got.view(np.int32) - want.view(np.int32)) >> 16
        assert ulps.max() <= 1
