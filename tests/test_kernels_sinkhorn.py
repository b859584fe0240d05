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
from kernels_pallas.sinkhorn import sinkhorn
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


@pytest.mark.parametrize("t,hc,iters", [(1, 4, 20), (37, 4, 20), (70, 2, 3), (5, 3, 1)])
def test_kernel_equals_xla_path_bit_for_bit(t, hc, iters):
    rng, seed = fresh_rng()
    e = _exp(_logits(rng, t, hc))
    want = jax.jit(lambda e: sinkhorn(e, iters, EPS, backend="xla"))(e)
    got = jax.jit(lambda e: sinkhorn(e, iters, EPS, backend="pallas"))(e)     # interpret mode on CPU
    np.testing.assert_array_equal(_bits(got), _bits(want), err_msg=f"seed {seed}")
    np.testing.assert_array_equal(_bits(want), _bits(_numpy_sinkhorn(np.asarray(e), iters, EPS)),
                                  err_msg=f"XLA path vs numpy, seed {seed}")


def test_split_sinkhorn_takes_the_kernel_under_its_per_kernel_switch():
    rng, seed = fresh_rng()
    hc, t = 4, 9
    m = jnp.asarray(rng.standard_normal((t, (2 + hc) * hc)).astype(np.float32))
    scale, base = jnp.asarray([0.5, 1.5, 2.0], jnp.float32), jnp.asarray(rng.standard_normal((2 + hc) * hc), jnp.float32)
    split = lambda: jax.jit(lambda m: split_sinkhorn(m, scale, base, hc, 20, EPS))(m)   # a new trace each call
    with backend.use_backend("pallas", kernel="sinkhorn"):
        assert backend.resolve(kernel="sinkhorn") == "pallas" and backend.resolve() == "xla"
        assert backend.resolve("xla", kernel="sinkhorn") == "xla"       # the call's own argument first
        got = split()
    assert backend.resolve(kernel="sinkhorn") == "xla"
    for g, w in zip(got, split()):
        np.testing.assert_array_equal(_bits(g), _bits(w), err_msg=f"seed {seed}")
    with pytest.raises(ValueError, match="not one of"):
        with backend.use_backend("pallas", kernel="no_such_kernel"):
            pass
