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


def test_splits_fill_the_device_and_divide_k():
    """About TARGET_PROGRAMS programs: a narrow weight splits its K steps, a wide one does not."""
    assert kd._splits(1280, 20) == 10          # 40 row blocks x 10 ranges of 2 steps
    assert kd._splits(32768, 5) == 1           # 1,024 row blocks already
    assert kd._splits(512, 20) == 20           # 16 row blocks x 20 ranges of one step
    assert kd._splits(5120, 9) == 3            # 160 x 3 (9 steps: divisors 1, 3, 9)
    for n, steps in ((1280, 20), (2304, 20), (5120, 32), (64, 7)):
        s = kd._splits(n, steps)
        assert steps % s == 0 and (n // kd.BN) * s <= max(kd.TARGET_PROGRAMS, n // kd.BN)


def test_takes_decode_rows_of_whole_blocks_on_the_pallas_backend():
    w = weight(64, 256)
    assert kd.takes(1, w, "pallas") and kd.takes(kd.MAX_ROWS, w, "pallas")
    assert not kd.takes(kd.MAX_ROWS + 1, w, "pallas")           # prefill: XLA's GEMM
    assert not kd.takes(1, w, "xla")
    stacked = Fp8BlockWeight(w.codes[None], w.block_scale[None])
    assert not kd.takes(1, stacked, "pallas")                   # a scanned stack is sliced first
    odd = Fp8BlockWeight(*quant_weight_fp8(jnp.ones((48, 256), jnp.float32)))
    assert not kd.takes(1, odd, "pallas")                       # a partial block of rows


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
