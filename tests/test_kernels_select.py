"""The indexer's selection without a sort (`kernels_pallas.select`) against the reference's
`select_topk` (top_k, then the picks re-sorted by position): equal ids, exactly, with NaNs of
both signs, infinities, signed zeros, subnormals and heavy ties among the scores, `visible`
cutting the picks (below 0 and past n too), k past the row length; and lowered for ROCm and CUDA
at the 32K / 128K-context decode widths."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_common import fresh_rng
from kernels_pallas import reference as ref
from kernels_pallas import select
from kernels_pallas._compat import TRITON_CUSTOM_CALL

SPECIAL = np.concatenate([np.array([0.0, -0.0, 1.0, -1.0, np.inf, -np.inf, np.nan, -np.nan, 1e-40, -1e-40],
                                   np.float32),
                          np.array([0xFFFFFFFF, 0x7FFFFFFF], np.uint32).view(np.float32)])  # NaNs, all bits


@pytest.mark.parametrize("rows,n,k", [(3, 37, 5), (4, 64, 64), (2, 100, 200), (5, 1000, 128), (2, 2048, 512)])
def test_picks_equal_the_references(rows, n, k):
    rng, seed = fresh_rng()
    for _ in range(3):
        x = np.where(rng.random((rows, n)) < 0.3, rng.choice(SPECIAL, (rows, n)),
                     rng.integers(-4, 5, (rows, n)).astype(np.float32))       # few values: many ties
        vis = rng.integers(-1, n + 3, (rows,)).astype(np.int32)                  # past both ends too
        got = select.select_ascending(jnp.asarray(x), jnp.asarray(vis), k, backend="pallas")
        want = ref.select_topk(jnp.asarray(x), jnp.asarray(vis), min(k, n))
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=f"seed {seed}")


@pytest.mark.parametrize("platform", ["rocm", "cuda"])
@pytest.mark.parametrize("n", [8192, 32768])
def test_lowers_to_one_triton_call(platform, n):
    f = functools.partial(select._select_pallas, k=512, num_warps=4, interpret=False)
    allow = [jax.export.DisabledSafetyCheck.custom_call(TRITON_CUSTOM_CALL)]
    e = jax.export.export(jax.jit(f), platforms=[platform], disabled_checks=allow)(
        jax.ShapeDtypeStruct((192, n), jnp.float32), jax.ShapeDtypeStruct((192,), jnp.int32))
    assert e.mlir_module().count(f"custom_call @{TRITON_CUSTOM_CALL}") == 1


def test_the_models_selection_runs_the_kernel_under_its_switch():
    """`v41_jax.model.indexer.select_topk` (the full forward's and the step's selection) takes the
    kernel when kernel "select" is on Pallas, the reference's sort otherwise; same ids."""
    from kernels_pallas import backend
    from v41_jax.model.indexer import select_topk

    rng, seed = fresh_rng()
    x = jnp.asarray(rng.integers(-3, 4, (2, 3, 300)).astype(np.float32))
    vis = jnp.asarray(rng.integers(0, 301, (2, 3)).astype(np.int32))
    calls = {}
    for name in ("xla", "pallas"):
        with backend.use_backend(name, kernel="select"):
            calls[name] = (str(jax.make_jaxpr(lambda s, v: select_topk(s, v, 16))(x, vis)),
                           np.asarray(select_topk(x, vis, 16)))
    assert "select_ascending" in calls["pallas"][0] and "select_ascending" not in calls["xla"][0]
    np.testing.assert_array_equal(calls["pallas"][1], calls["xla"][1], err_msg=f"seed {seed}")
