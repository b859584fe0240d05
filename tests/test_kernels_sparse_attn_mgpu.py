"""The optional Mosaic GPU sparse attention (`kernels_pallas.sparse_attn_mgpu`, NVIDIA Hopper).

Without a GPU the kernel cannot run (its ring is a `RefUnion`, which Mosaic GPU's interpret mode
does not model), so the CPU tests lower it for CUDA (layouts, TMA boxes, the shared-memory budget
are all checked at export) and test the host-side preparation; on a Hopper GPU it is held to the
XLA path by the derived bound of `test_kernels_sparse_attn.test_packed_rows`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_common import fresh_rng
from kernels_pallas import backend
from kernels_pallas.sparse_attn import _pad_ids, sparse_attn_paged
from kernels_pallas.sparse_attn_mgpu import default_splits, sparse_attn_mgpu, supported
from test_kernels_sparse_attn import _weighted_magnitude
from v41_jax.model.numerics import Numerics

REF = Numerics.reference()
spec = lambda *shape, dt=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dt)


@pytest.mark.parametrize("splits", [1, 4])
def test_lowers_for_cuda_at_real_widths(splits):
    """64 heads of 512 lanes, a window source of 128 ids and a compressed one of 512, one split
    (bf16 output from the kernel) and four (fp32 partials, merged after)."""
    t = 32
    fn = functools.partial(sparse_attn_mgpu, scale=512 ** -0.5, num_splits=splits)
    mod = jax.export.export(jax.jit(fn), platforms=["cuda"])(
        spec(t, 64, 512), spec(64, dt=jnp.float32), (spec(16384, 512), spec(1 << 20, 512)),
        (spec(t, 128, dt=jnp.int32), spec(t, 512, dt=jnp.int32))).mlir_module()
    assert mod.count("custom_call @mosaic_gpu") == 1


def test_supported_takes_bf16_rows_of_512_lanes_and_at_most_64_heads():
    rows = [jnp.zeros((8, 512), jnp.bfloat16)]
    assert supported(jnp.zeros((2, 64, 512), jnp.bfloat16), rows)
    assert supported(jnp.zeros((2, 8, 512), jnp.bfloat16), rows)
    assert not supported(jnp.zeros((2, 128, 512), jnp.bfloat16), rows)
    assert not supported(jnp.zeros((2, 64, 256), jnp.bfloat16), [jnp.zeros((8, 256), jnp.bfloat16)])
    assert not supported(jnp.zeros((2, 64, 512), jnp.float32), rows)
    assert not supported(jnp.zeros((2, 64, 512), jnp.bfloat16), [jnp.zeros((8, 528), jnp.uint8)])


@pytest.mark.skipif(not backend.mosaic_gpu(), reason="needs an NVIDIA Hopper GPU (wgmma, TMA)")
@pytest.mark.parametrize("splits", [1, 2, 3])
def test_matches_xla_path_within_the_derived_bound(splits):
    """Skipped ids in both sources (a token with none valid in its window, one with a run of 300
    skipped compressed ids) and NaN in the rows no list names: a skipped id must read zeros, not
    the NaN page. Bound: (2^-6 + 2^-12) * sum_j p_j |v_j| / den, as derived in test_packed_rows."""
    rng, seed = fresh_rng()
    t, h, d = 5, 64, 512
    q = jnp.asarray(rng.standard_normal((t, h, d)), jnp.bfloat16)
    sink = jnp.asarray(rng.standard_normal(h), jnp.float32)
    sources = []
    for r, k in ((300, 128), (4096, 512)):
        kv = jnp.asarray(rng.standard_normal((r, d)) * rng.uniform(0.1, 2, (r, 1)), jnp.bfloat16)
        idx = rng.integers(1, r, (t, k))
        idx[rng.random((t, k)) < 0.2] = -1
        sources.append((kv.at[0].set(jnp.nan), idx))
    sources[0][1][0] = -1
    sources[1][1][1, :300] = -1
    sources = [(kv, jnp.asarray(i, jnp.int32)) for kv, i in sources]
    scale = d ** -0.5
    got = np.asarray(sparse_attn_mgpu(q, sink, tuple(r for r, _ in sources),
                                      tuple(_pad_ids(i) for _, i in sources), scale=scale,
                                      num_splits=splits), np.float64)
    want = np.asarray(sparse_attn_paged(q, sink, sources, scale, numerics=REF, backend="xla"), np.float64)
    assert np.isfinite(got).all(), f"seed {seed}"
    bound = (2.0 ** -6 + 2.0 ** -12) * _weighted_magnitude(q, sink, sources, scale)
    excess = np.abs(got - want) - bound
    assert excess.max() <= 0, f"seed {seed}: {int((excess > 0).sum())} past the bound by {excess.max():.3g}"


def test_impl_mgpu_refuses_what_it_cannot_compute():
    """impl="mgpu" names what it takes; an unknown impl is refused (no silent fallback)."""
    rng, _ = fresh_rng()
    q = jnp.asarray(rng.standard_normal((2, 4, 64)), jnp.bfloat16)
    sources = [(jnp.zeros((16, 64), jnp.bfloat16), jnp.zeros((2, 8), jnp.int32))]
    with pytest.raises(ValueError, match="typed bf16 rows of 512 lanes"):
        sparse_attn_paged(q, jnp.zeros(4), sources, 0.125, numerics=REF, backend="pallas", impl="mgpu")
    with pytest.raises(ValueError, match="typed bf16 rows of 512 lanes"):
        sparse_attn_paged(q.astype(jnp.float32), jnp.zeros(4), sources, 0.125, numerics=Numerics.fp32(),
                          backend="pallas", impl="mgpu")
    rows512 = [(jnp.zeros((16, 512), jnp.bfloat16), jnp.zeros((2, 8), jnp.int32))]
    with pytest.raises(ValueError, match="no Triton launch parameters: num_warps, head_block"):
        sparse_attn_paged(jnp.zeros((2, 4, 512), jnp.bfloat16), jnp.zeros(4), rows512, 0.125, numerics=REF,
                          backend="pallas", impl="mgpu", num_warps=4, head_block=16)
    with pytest.raises(ValueError, match="'triton' \\(the default\\) or 'mgpu'"):
        sparse_attn_paged(q, jnp.zeros(4), sources, 0.125, numerics=REF, backend="pallas", impl="cuda")


def test_default_splits_fill_the_gpu_at_32_tokens_and_stop_past_64():
    assert default_splits(32, 10) == 4 and default_splits(1, 10) == 4 and default_splits(1, 2) == 2
    assert default_splits(33, 10) == 2 and default_splits(64, 10) == 2 and default_splits(64, 1) == 1
    assert default_splits(65, 10) == 1 and default_splits(128, 10) == 1


def test_the_gather_benchmark_lowers_for_cuda():
    """`scripts/bench_tma_gather.py` (the kernel's row gather without its MMAs): every variant
    lowers, so the benchmark a Hopper runs is the one committed."""
    from scripts.bench_tma_gather import IDS, VARIANTS, gather
    for kw in VARIANTS:
        mod = jax.export.export(jax.jit(functools.partial(gather, splits=2, **kw)), platforms=["cuda"])(
            spec(4096, 512), spec(32, IDS, dt=jnp.int32)).mlir_module()
        assert mod.count("custom_call @mosaic_gpu") == 1
