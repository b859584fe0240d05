"""The RMSNorm statistic kernel (`kernels_pallas.rmsnorm`) against its XLA path, bit for bit, and
the XLA path against torch's CPU `rsqrt(x.square().mean(-1) + eps)` (the reference's own ops), bit
for bit. On CPU the kernel runs in Pallas interpret mode, where its output starts as NaN, so
equality also proves every row was written; its fp64 division and square root run on XLA:CPU
there, which checks the double-rounding argument of `_ieee` on these inputs. Exact equality is the
tolerance: every side rounds the same fp32 operations in the same order.

The widths reach every part of torch's sum order (`numerics.cascade_chunks` / `combine_lanes`):
no full 32-wide chunk (1, 7, 20), whole 8-lane vectors past the chunks (8, 56), a scalar tail
(7, 20, 100, 1000, 9000), exact multiples of 32 (32, 256), an open level-0 run (100, 1000), and
level-1 groups of 16 runs beside an open run (9000: 281 chunks). The real mHC width (4 x 5120 =
20480) is checked on the GPU by scripts/bench_kernels.py --sections rmsnorm.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_common import fresh_rng
from kernels_pallas import backend
from kernels_pallas.rmsnorm import rms_inv
from v41_jax.model.norm import rms_norm

EPS = 1e-20   # the checkpoints' rms_norm_eps


def _rows(rng, t: int, d: int, dtype) -> jax.Array:
    """[t, d] values over many magnitudes; among the rows (when there are enough): all zeros (the
    statistic is rsqrt(eps)), squares that are fp32 subnormal or zero, squares that overflow to inf
    (statistic 0), and a NaN."""
    x = rng.standard_normal((t, d)) * np.exp(3 * rng.standard_normal((t, d)))
    special = [np.zeros(d), x[0] * 1e-22, x[0] * 1e19]
    for i, row in enumerate(special[: max(t - 1, 0)]):
        x[1 + i] = row
    if t > 4:
        x[4, d // 2] = np.nan
    return jnp.asarray(x.astype(np.float32), dtype)


def _bits(a) -> np.ndarray:
    return np.asarray(a, np.float32).view(np.uint32)


@pytest.mark.parametrize("d,t,bt,dtype", [
    (1, 1, 1, jnp.float32), (7, 3, 1, jnp.bfloat16), (8, 33, 4, jnp.float32),
    (20, 33, 4, jnp.bfloat16), (32, 1, 1, jnp.bfloat16), (56, 3, 2, jnp.float32),
    (100, 33, 4, jnp.float32), (256, 3, 1, jnp.bfloat16), (1000, 3, 2, jnp.bfloat16),
    (9000, 3, 2, jnp.float32),
])
def test_kernel_equals_xla_path_bit_for_bit(d, t, bt, dtype):
    rng, seed = fresh_rng()
    x = _rows(rng, t, d, dtype)
    want = jax.jit(lambda x: rms_inv(x, EPS, backend="xla"))(x)
    got = jax.jit(lambda x: rms_inv(x, EPS, backend="pallas", block_rows=bt))(x)   # interpret mode on CPU
    assert got.shape == want.shape == (t, 1) and got.dtype == want.dtype == jnp.float32
    np.testing.assert_array_equal(_bits(got), _bits(want), err_msg=f"seed {seed}")


@pytest.mark.parametrize("d", [3, 100, 256, 1000, 5120])
def test_xla_path_is_torch_cpu_bit_for_bit(d):
    """torch squares into a tensor of its own, sums in its cascade order, divides by D and takes
    1 / sqrt, each rounded to fp32: the XLA path must round the squares alone too (XLA:CPU fused
    them into the sum's adds as FMAs at D = 256 before `numerics.rounded`)."""
    torch = pytest.importorskip("torch")
    torch.set_num_threads(1)
    rng, seed = fresh_rng()
    x = np.array(_rows(rng, 16, d, jnp.float32))
    want = torch.rsqrt(torch.from_numpy(x).square().mean(-1, keepdim=True) + EPS).numpy()
    got = jax.jit(lambda x: rms_inv(x, EPS, backend="xla"))(x)
    np.testing.assert_array_equal(_bits(got), _bits(want), err_msg=f"seed {seed}")


def test_rms_norm_takes_the_kernel_under_its_per_kernel_switch():
    rng, seed = fresh_rng()
    x = _rows(rng, 5, 40, jnp.bfloat16).reshape(5, 1, 40)
    w = jnp.asarray(rng.standard_normal(40), jnp.float32)
    norm = lambda: jax.jit(lambda x: rms_norm(x, w, EPS))   # a new trace each call
    with backend.use_backend("pallas", kernel="rmsnorm"):
        assert backend.resolve(kernel="rmsnorm") == "pallas" and backend.resolve(kernel="sinkhorn") == "xla"
        assert "pallas_call" in str(jax.make_jaxpr(norm())(x))
        got = norm()(x)
    assert "pallas_call" not in str(jax.make_jaxpr(norm())(x))
    np.testing.assert_array_equal(np.asarray(got).view(np.uint16), np.asarray(norm()(x)).view(np.uint16),
                                  err_msg=f"seed {seed}")


def test_auto_keeps_unmeasured_kernels_on_xla_on_a_gpu(monkeypatch):
    """auto takes Pallas on a GPU except for a kernel not yet measured there (backend.UNMEASURED);
    an explicit choice still takes it."""
    monkeypatch.setattr(backend, "on_gpu", lambda: True)
    assert backend.resolve(kernel="sinkhorn") == "pallas"
    assert backend.resolve(kernel="rmsnorm") == "xla"
    with backend.use_backend("pallas", kernel="rmsnorm"):
        assert backend.resolve(kernel="rmsnorm") == "pallas"
    monkeypatch.setenv(backend.ENV_BACKEND, "pallas")
    assert backend.resolve(kernel="rmsnorm") == "pallas"
