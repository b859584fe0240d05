"""The RMSNorm statistic kernel (`kernels_pallas.rmsnorm`) against its XLA path, bit for bit, and
the XLA path against torch's CPU `rsqrt(x.square().mean(-1) + eps)` (the reference's own ops), bit
for bit. On CPU the kernel runs in Pallas interpret mode, where its output starts as NaN, so
equality also proves every row was written; its fp64 division and square root run on XLA:CPU
there, which checks the double-rounding argument of `_ieee` on these inputs. Exact equality is the
tolerance: every side rounds the same fp32 operations in the same order. On a GPU the XLA path is
not exact (XLA:GPU's fp32 sqrt is approximate whatever the NVPTX options, `v41_jax.xla_env`; the
model's exact statistic takes the kernel there): the kernel is held to torch itself, and the XLA
path's own equality with torch is a CPU test.

The widths reach every part of torch's sum order (`numerics.cascade_rows` / `combine_lanes`):
no full 32-wide chunk (1, 7, 20), whole 8-lane vectors past the chunks (8, 56), a scalar tail
(7, 20, 100, 1000, 9000), exact multiples of 32 (32, 256), an open level-0 run (100, 1000), and
level-1 groups of 16 runs beside an open run (9000: 281 chunks), a level-2 group moved up into
level 3 (131211: 4100 chunks, 256 runs); rows of >= 32 runs (the kernel sums 8 runs side by side:
the mHC width 4 x 5120 = 20480, 40 runs, and 131211) and of fewer (one run a loop step).
"""

from __future__ import annotations

import collections
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.lib.triton import dialect as tt_dialect   # internal: what Pallas' Triton lowering registers
from jax.extend.mlir import ir
from jax.interpreters import mlir

from kernels_common import fresh_rng
from kernels_pallas import backend
from kernels_pallas._compat import TRITON_CUSTOM_CALL, on_gpu
from kernels_pallas.rmsnorm import _rms_inv_pallas, rms_inv
from v41_jax.model import norm
from v41_jax.model.norm import rms_norm
from v41_jax.numerics import Numerics

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


def _torch_statistic(x) -> np.ndarray:
    """The reference's ops on torch's CPU, one thread (its sum order): squares, mean, + eps, rsqrt."""
    torch = pytest.importorskip("torch")
    torch.set_num_threads(1)
    x = torch.from_numpy(np.asarray(x, np.float32))
    return torch.rsqrt(x.square().mean(-1, keepdim=True) + EPS).numpy()


def _exact_statistic(x) -> np.ndarray:
    """What the kernel must equal bit for bit: the XLA path on XLA:CPU (itself held to torch by
    test_xla_path_is_torch_cpu_bit_for_bit), torch's on a GPU, where XLA's sqrt is approximate."""
    if on_gpu():
        return _torch_statistic(x)
    return np.asarray(jax.jit(lambda x: rms_inv(x, EPS, backend="xla"))(x))


def _assert_same_bits(got, want, seed) -> None:
    """Equal bits, NaN rows apart: those only NaN on both sides (a NaN's payload is the backend's)."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan, err_msg=f"seed {seed}")
    np.testing.assert_array_equal(_bits(got[~nan]), _bits(want[~nan]), err_msg=f"seed {seed}")


@pytest.mark.parametrize("d,t,bt,dtype", [
    (1, 1, 1, jnp.float32), (7, 3, 1, jnp.bfloat16), (8, 33, 4, jnp.float32),
    (20, 33, 4, jnp.bfloat16), (32, 1, 1, jnp.bfloat16), (56, 3, 2, jnp.float32),
    (100, 33, 4, jnp.float32), (256, 3, 1, jnp.bfloat16), (1000, 3, 2, jnp.bfloat16),
    (9000, 3, 2, jnp.float32), (20480, 5, 2, jnp.float32), (131211, 2, 1, jnp.float32),
])
def test_kernel_is_the_exact_statistic_bit_for_bit(d, t, bt, dtype):
    rng, seed = fresh_rng()
    x = _rows(rng, t, d, dtype)
    want = _exact_statistic(x)
    got = jax.jit(lambda x: rms_inv(x, EPS, backend="pallas", block_rows=bt))(x)   # interpret mode on CPU
    assert got.shape == want.shape == (t, 1) and got.dtype == want.dtype == jnp.float32
    _assert_same_bits(got, want, seed)


def _walk(op):
    """The operations nested in op, depth first."""
    for region in op.regions:
        for block in region.blocks:
            for child in block.operations:
                yield child.operation
                yield from _walk(child.operation)


def _triton_ops(d: int) -> collections.Counter:
    """Op names (with multiplicity) of the kernel's Triton module at width d: the module is the `ir`
    bytecode of the Triton custom call in the kernel's ROCm export (the Pallas Triton lowering
    runs on CPU there), parsed with the Triton dialect registered (as unregistered ops, the
    unrolled kernel's bytecode did not parse)."""
    fn = functools.partial(_rms_inv_pallas, eps=EPS, block_rows=1, interpret=False)
    allow = [jax.export.DisabledSafetyCheck.custom_call(TRITON_CUSTOM_CALL)]
    exported = jax.export.export(jax.jit(fn), platforms=["rocm"], disabled_checks=allow)(
        jax.ShapeDtypeStruct((3, d), jnp.float32))
    with mlir.make_ir_context() as ctx:
        tt_dialect.register_dialect(ctx)
        call = next(op for op in _walk(ir.Module.parse(exported.mlir_module()).operation)
                    if op.name == "stablehlo.custom_call")
        kernel = ir.Module.parse(call.attributes["mhlo.backend_config"]["ir"].value_bytes)
        return collections.Counter(op.name for op in _walk(kernel.operation))


@pytest.mark.parametrize("widths", [(1024, 5120), (16384, 20480, 32768), (1000, 9000)])
def test_kernel_size_does_not_grow_with_the_width(widths):
    """The kernel loops over the cascade's runs, one run's (or, from `rmsnorm.WIDE_RUNS` runs, 8
    runs') loads in its body. Widths with the same rest (D mod 32), run length
    (`numerics.cascade_step`: 16 chunks for all of these) and runs per step trace to the same kernel
    with other constants (D, the chunk count, the loop's trip count), so their Triton modules hold
    exactly the same ops; unrolled chunk loads (the kernel before this test) grew from 33 loads at
    D = 1024 to 641 at 20480."""
    ops = [_triton_ops(d) for d in widths]
    for d, o in zip(widths[1:], ops[1:]):
        assert o == ops[0], f"D={d}: {sum(o.values())} ops ({o['tt.load']} loads), " \
                            f"D={widths[0]}: {sum(ops[0].values())} ({ops[0]['tt.load']} loads)"
    assert ops[0]["scf.for"] == 1


@pytest.mark.skipif(on_gpu(), reason="XLA:GPU's fp32 sqrt is approximate: the XLA path is exact on XLA:CPU only "
                                      "(on a GPU the exact statistic is the kernel's, held to torch above)")
@pytest.mark.parametrize("d", [3, 100, 256, 1000, 5120])
def test_xla_path_is_torch_cpu_bit_for_bit(d):
    """torch squares into a tensor of its own, sums in its cascade order, divides by D and takes
    1 / sqrt, each rounded to fp32: the XLA path must round the squares alone too (XLA:CPU fused
    them into the sum's adds as FMAs at D = 256 before `numerics.rounded`)."""
    rng, seed = fresh_rng()
    x = np.array(_rows(rng, 16, d, jnp.float32))
    want = _torch_statistic(x)
    got = jax.jit(lambda x: rms_inv(x, EPS, backend="xla"))(x)
    _assert_same_bits(got, want, seed)


def test_rms_norm_takes_the_kernel_under_its_per_kernel_switch():
    rng, seed = fresh_rng()
    x = _rows(rng, 5, 40, jnp.bfloat16).reshape(5, 1, 40)
    w = jnp.asarray(rng.standard_normal(40), jnp.float32)
    norm = lambda: jax.jit(lambda x: rms_norm(x, w, EPS, Numerics.reference()))   # a new trace each call
    with backend.use_backend("xla"):   # process-wide (auto is Pallas on a GPU), then one kernel's switch
        with backend.use_backend("pallas", kernel="rmsnorm"):
            assert backend.resolve(kernel="rmsnorm") == "pallas" and backend.resolve(kernel="sinkhorn") == "xla"
            assert "pallas_call" in str(jax.make_jaxpr(norm())(x))
            got = norm()(x)
        assert "pallas_call" not in str(jax.make_jaxpr(norm())(x))
        want = norm()(x)
    if on_gpu():   # the XLA path's sqrt is approximate there (module docstring): torch's statistic
        want = (w * (np.asarray(x, np.float32) * _torch_statistic(x))).astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(got).view(np.uint16), np.asarray(want).view(np.uint16),
                                  err_msg=f"seed {seed}")


@pytest.mark.parametrize("d", [7, 4096, 20480])
def test_fast_statistic_is_one_reduction_within_its_rounding_bound(d):
    """Numerics.fast (exact_rms off): no kernel even where the kernel is selected, and the statistic
    within its rounding bound of the fp64 one over the fp32 squares. Relative bound: the d squares
    summed in any order (at most (d - 1) u, u = 2^-24, all terms >= 0), the mean's scaling by 1 / d
    (XLA multiplies by the rounded reciprocal: two roundings) and + eps one, so the mean is within
    (d + 2) u; its rsqrt within half of that plus the rsqrt's own rounding (XLA's may be off by
    2 ulps: 2 u). The squares overflow in fp32 on one row (statistic 0): no relative bound there."""
    rng, seed = fresh_rng()
    x = _rows(rng, 5, d, jnp.float32)[:4]          # the NaN row apart: no bound to state for it
    sq = np.square(np.asarray(x, np.float32))
    truth = 1.0 / np.sqrt(sq.astype(np.float64).mean(-1) + EPS)
    fast = jax.jit(lambda x: norm.rms_inv(x, EPS, Numerics.fast()))
    with backend.use_backend("pallas", kernel="rmsnorm"):
        assert "pallas_call" not in str(jax.make_jaxpr(fast)(x))
        got = np.asarray(fast(x), np.float64)[:, 0]
    u = 2.0 ** -24
    finite = np.all(np.isfinite(sq), -1)
    rel = np.abs(got[finite] / truth[finite] - 1)
    assert finite.sum() >= 2 and np.all(rel <= ((d + 2) / 2 + 2) * u), (rel, seed)


def test_auto_takes_every_kernel_on_a_gpu_only(monkeypatch):
    """auto: Pallas on a GPU for every named kernel (the RMS norm measured on the H200, 2026-12-03),
    XLA elsewhere; a per-kernel choice still wins."""
    monkeypatch.delenv(backend.ENV_BACKEND, raising=False)
    for gpu, want in ((True, "pallas"), (False, "xla")):
        monkeypatch.setattr(backend, "on_gpu", lambda gpu=gpu: gpu)
        assert [backend.resolve(kernel=k) for k in backend.KERNELS] == [want] * len(backend.KERNELS)
    monkeypatch.setattr(backend, "on_gpu", lambda: True)
    with backend.use_backend("xla", kernel="rmsnorm"):
        assert backend.resolve(kernel="rmsnorm") == "xla" and backend.resolve(kernel="sinkhorn") == "pallas"
    monkeypatch.setenv(backend.ENV_BACKEND, "pallas")
    assert backend.resolve(kernel="rmsnorm") == "pallas"
