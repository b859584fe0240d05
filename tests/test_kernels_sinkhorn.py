"""The mHC Sinkhorn kernel (`kernels_pallas.sinkhorn`) against its XLA path, bit for bit, and the
XLA path against the rule written out step by step in numpy (IEEE fp32 divisions, sums left to
right). On CPU the kernel runs in Pallas interpret mode, where its outputs start as NaN, so
equality also proves every element was written; its fp64 divisions run on XLA:CPU there, which
checks the double-rounding argument of `_ieee.div_rn` on these inputs. Exact equality is the
tolerance: both sides do the same fp32 operations in the same order.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_common import fresh_rng
from kernels_pallas import backend
from kernels_pallas._ieee import div_near_by, div_rn_by
from kernels_pallas.sinkhorn import _fast_divisions_exact, sinkhorn
from v41_jax.model.mhc import split_sinkhorn

EPS = 1e-6


def _logits(rng, t: int, hc: int) -> np.ndarray:
    """Random [T, hc, hc] logits; row 0 extreme (exp gives exact zeros), row 1 with entries ~100
    below its max (exp gives fp32 subnormals)."""
    x = rng.standard_normal((t, hc, hc)).astype(np.float32) * 3
    x[0] *= 400
    if t > 1:
        x[1, :, 1:] -= 100
    return x


def _exp(x: np.ndarray) -> jax.Array:
    x = jnp.asarray(x)
    return jnp.exp(x - jnp.max(x, axis=-1, keepdims=True))


def _bits(a) -> np.ndarray:
    return np.asarray(a, np.float32).view(np.uint32)


def _numpy_sinkhorn(e: np.ndarray, iters: int, eps: float) -> np.ndarray:
    f32 = np.float32
    rows = lambda c: sum((c[..., j] for j in range(1, c.shape[-1])), start=c[..., 0])[..., None]
    cols = lambda c: sum((c[..., i, :] for i in range(1, c.shape[-2])), start=c[..., 0, :])[..., None, :]
    c = e / rows(e) + f32(eps)
    c = c / (cols(c) + f32(eps))
    for _ in range(iters - 1):
        c = c / (rows(c) + f32(eps))
        c = c / (cols(c) + f32(eps))
    return c


# the last two keep `div_rn` for every division (eps = 0: no lower bound on the entries; 40
# iterations at N = 4: the bound passes below the smallest normal), the others take `div_rn_by`
@pytest.mark.parametrize("t,hc,iters,eps", [(1, 4, 20, EPS), (37, 4, 20, EPS), (70, 2, 3, EPS), (5, 3, 1, EPS),
                                            (6, 4, 20, 0.0), (6, 4, 40, EPS)])
def test_kernel_equals_xla_path_bit_for_bit(t, hc, iters, eps):
    rng, seed = fresh_rng()
    e = _exp(_logits(rng, t, hc))
    assert _fast_divisions_exact(hc, iters, eps) == (eps > 0 and iters < 40)
    want = jax.jit(lambda e: sinkhorn(e, iters, eps, backend="xla"))(e)
    got = jax.jit(lambda e: sinkhorn(e, iters, eps, backend="pallas"))(e)     # interpret mode on CPU
    # NaN (eps = 0: 0 / 0) compares as NaN: its sign and payload are the backend's
    same = lambda a, b, msg: (np.testing.assert_array_equal(np.isnan(a), np.isnan(b), err_msg=msg),
                              np.testing.assert_array_equal(_bits(a)[~np.isnan(a)], _bits(b)[~np.isnan(b)], err_msg=msg))
    got, want = np.asarray(got), np.asarray(want)
    same(got, want, f"seed {seed}")
    with np.errstate(invalid="ignore"):          # eps = 0: the 0 / 0 the comparison expects
        plain = _numpy_sinkhorn(np.asarray(e), iters, eps)
    same(want, plain, f"XLA path vs numpy, seed {seed}")


def _near_midpoints(rng, n: int, lo: float, hi: float) -> tuple[np.ndarray, np.ndarray]:
    """Divisors in [lo, hi] and dividends whose quotient lies within an ulp of an fp32 rounding
    midpoint (a = RN(m b) for a midpoint m), where a quotient wrong in its last bit shows."""
    b = np.exp(rng.uniform(np.log(lo), np.log(hi), n)).astype(np.float32)
    q = np.exp(rng.uniform(np.log(1e-30), np.log(1e3), n)).astype(np.float32)
    m = q.astype(np.float64) + np.spacing(q).astype(np.float64) / 2
    return (m * b).astype(np.float32), b


def test_division_by_a_reciprocal_is_correctly_rounded():
    """`_ieee.div_rn_by` against numpy's IEEE fp32 division, over the Sinkhorn kernel's range of
    divisors (eps .. N (1 + eps) + eps) and far beyond it, near rounding midpoints and at random,
    traced as in the kernel (fp64 inside `enable_x64`), on XLA:CPU; its range: normal dividends
    and quotients. Tolerance: none."""
    rng, seed = fresh_rng()
    near = _near_midpoints(rng, 1 << 18, 1e-6, 5.0)
    wide = _near_midpoints(rng, 1 << 18, 1e-30, 1e30)
    anywhere = (rng.uniform(0, 1, 1 << 18).astype(np.float32),
                np.exp(rng.uniform(np.log(1e-6), np.log(5.0), 1 << 18)).astype(np.float32))
    divide = jax.jit(lambda a, b: div_rn_by([a, -a], b))
    for name, (a, b) in {"near midpoints": near, "wide divisors": wide, "random": anywhere}.items():
        want = a / b
        tiny = np.finfo(np.float32).tiny
        normal = (np.abs(want) >= tiny) & (np.abs(a) >= tiny)
        got, neg = (np.asarray(g) for g in divide(a, b))
        assert normal.mean() > 0.8          # most cases are in the range checked
        np.testing.assert_array_equal(_bits(got[normal]), _bits(want[normal]), err_msg=f"{name}, seed {seed}")
        np.testing.assert_array_equal(_bits(neg[normal]), _bits(-want[normal]), err_msg=f"{name}, seed {seed}")


def test_split_sinkhorn_takes_the_kernel_under_its_per_kernel_switch():
    rng, seed = fresh_rng()
    hc, t = 4, 9
    m = jnp.asarray(rng.standard_normal((t, (2 + hc) * hc)).astype(np.float32))
    scale, base = jnp.asarray([0.5, 1.5, 2.0], jnp.float32), jnp.asarray(rng.standard_normal((2 + hc) * hc), jnp.float32)
    split = lambda: jax.jit(lambda m: split_sinkhorn(m, scale, base, hc, 20, EPS))(m)   # a new trace each call
    default = backend.resolve()                   # "auto": xla on CPU, pallas on a GPU
    with backend.use_backend("pallas", kernel="sinkhorn"):
        assert backend.resolve(kernel="sinkhorn") == "pallas" and backend.resolve() == default
        assert backend.resolve("xla", kernel="sinkhorn") == "xla"       # the call's own argument first
        got = split()
    assert backend.resolve(kernel="sinkhorn") == default
    for g, w in zip(got, split()):
        np.testing.assert_array_equal(_bits(g), _bits(w), err_msg=f"seed {seed}")
    with pytest.raises(ValueError, match="not one of"):
        with backend.use_backend("pallas", kernel="no_such_kernel"):
            pass


def test_near_division_is_within_three_ulps():
    """`_ieee.div_near_by` (the fast policy's Sinkhorn division) against numpy's IEEE fp32
    division, over the kernel's divisor range and far beyond it: every normal quotient of a normal
    dividend within the 3 ulps its docstring derives, and not always the correctly rounded one."""
    rng, seed = fresh_rng()
    for lo, hi in ((1e-6, 5.0), (1e-30, 1e30)):
        a, b = _near_midpoints(rng, 1 << 18, lo, hi)
        want = a / b
        # normal dividends and quotients (XLA:CPU flushes subnormals to zero)
        tiny = np.finfo(np.float32).tiny
        ok = (np.abs(want) >= tiny) & (np.abs(a) >= tiny)
        got = np.asarray(jax.jit(lambda a, b: div_near_by([a], b)[0])(a, b))
        ulps = np.abs(got[ok].astype(np.float64) - want[ok]) / np.spacing(np.abs(want[ok])).astype(np.float64)
        assert ulps.max() <= 3, (ulps.max(), seed)
        assert (ulps > 0).any()


@pytest.mark.parametrize("t,hc,iters", [(1, 4, 20), (37, 4, 20), (70, 2, 3)])
def test_fast_kernel_equals_its_xla_path_bit_for_bit(t, hc, iters):
    """exact=False (Numerics.fast): the kernel and the XLA path divide by the same fp32
    reciprocal, so they agree bit for bit (the test). And the switch does something, within the
    first-order rounding budget of the iteration: each of the 2 x iters normalisations moves an
    entry by at most its sum's hc - 1 roundings, + eps's one and the division (exact: 1/2 ulp; fast:
    3 ulps = 6 u), so each side is within 2 iters (hc + 6) u of the rounding-free iteration and the
    two within twice that (u = 2^-24; entries of the doubly stochastic scale, > 1e-3)."""
    rng, seed = fresh_rng()
    e = _exp(_logits(rng, t, hc))
    want = np.asarray(jax.jit(lambda e: sinkhorn(e, iters, EPS, exact=False, backend="xla"))(e))
    got = np.asarray(jax.jit(lambda e: sinkhorn(e, iters, EPS, exact=False, backend="pallas"))(e))
    np.testing.assert_array_equal(_bits(got), _bits(want), err_msg=f"seed {seed}")
    exact = np.asarray(jax.jit(lambda e: sinkhorn(e, iters, EPS, backend="xla"))(e))
    assert not np.array_equal(_bits(exact), _bits(got))
    big = exact > 1e-3           # entries of the doubly stochastic scale (the rest are eps-sized)
    rel = np.abs(got[big] / exact[big] - 1)
    assert rel.max() <= 2 * (2 * iters * (hc + 6) * 2.0 ** -24), (rel.max(), seed)
