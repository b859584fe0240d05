"""The indexer's selection without a sort (`kernels_pallas.select`) against the reference's
`select_topk` (top_k, then the picks re-sorted by position): equal ids, exactly, with NaNs of
both signs, infinities, signed zeros, subnormals and heavy ties among the scores, `visible`
cutting the picks (below 0 and past n too), k past the row length, in one stage and in two; and
lowered for ROCm and CUDA at the 32K / 128K-context decode widths."""

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
        for finite_only in (False, True):       # True: the candidate source's rule (no -inf, NaN)
            got = select.select_ascending(jnp.asarray(x), jnp.asarray(vis), k, backend="pallas",
                                          finite_only=finite_only)
            want = ref.select_topk(jnp.asarray(x), jnp.asarray(vis), min(k, n), finite_only)
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=f"seed {seed}")


@pytest.mark.parametrize("rows,n,k,chunk", [(2, 64, 8, 16), (3, 256, 16, 64), (1, 2048, 512, 512),
                                            (2, 4096, 300, 1024)])
def test_two_stages_pick_the_references_ids(rows, n, k, chunk):
    """The k best of each chunk, then the k best of those: the same ids, the ties (many: few
    distinct values) to the lower column across chunks too."""
    rng, seed = fresh_rng()
    for _ in range(2):
        x = np.where(rng.random((rows, n)) < 0.3, rng.choice(SPECIAL, (rows, n)),
                     rng.integers(-2, 3, (rows, n)).astype(np.float32))
        vis = rng.integers(-1, n + 3, (rows,)).astype(np.int32)
        for finite_only in (False, True):
            got = select.select_ascending(jnp.asarray(x), jnp.asarray(vis), k, backend="pallas", chunk=chunk,
                                          finite_only=finite_only)
            want = ref.select_topk(jnp.asarray(x), jnp.asarray(vis), k, finite_only)
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=f"seed {seed}")


def test_two_stages_are_taken_for_few_long_rows_only():
    k = 512
    assert select.two_stage_chunk(1, 32768, k) == select.CHUNK
    assert select.two_stage_chunk(8, 16384, k) == select.CHUNK
    assert select.two_stage_chunk(8192, 32768, k) == 0                 # many rows fill the GPU
    assert select.two_stage_chunk(64, 32768, k) == select.CHUNK
    assert select.two_stage_chunk(1, (select.MIN_CHUNKS - 1) * select.CHUNK, k) == 0   # too few chunks
    assert select.two_stage_chunk(1, 8 * select.CHUNK + 8, k) == 0     # chunks must tile the row
    assert select.two_stage_chunk(select.TWO_STAGE_PROGRAMS // 8 + 1, 8 * select.CHUNK, k) == 0   # programs
    assert select.two_stage_chunk(1, 32768, select.CHUNK) == 0         # the second stage no smaller
    for bad in (1000, 3072):                                              # not dividing; not a power of 2
        with pytest.raises(ValueError, match=f"chunk {bad} must be a power of two"):
            select.select_ascending(jnp.zeros((1, 12288)), jnp.zeros((1,), jnp.int32), 8, backend="pallas",
                                    chunk=bad)
    # rows one program cannot hold: two stages at any row count while the candidates fit one, in
    # chunks of 2 x CHUNK while those stay within TWO_STAGE_PROGRAMS programs
    wide = 8 * select.MAX_COLUMNS                                         # 262,144: a 1M context at ratio 4
    assert select.two_stage_chunk(1, wide, k) == select.two_stage_chunk(16, wide, k) == 2 * select.CHUNK
    assert select.two_stage_chunk(17, wide, k) == select.two_stage_chunk(4096, wide, k) == select.CHUNK
    assert select.two_stage_chunk(1, wide + select.CHUNK, k) == 0         # 65 x 512 candidates, 8,192 not dividing
    assert select.two_stage_chunk(64, wide // 2, k) == select.CHUNK       # many rows: the smaller chunk
    assert select.two_stage_chunk(4096, 2 * wide, k) == 2 * select.CHUNK  # 128 x 512 candidates at CHUNK
    assert select.two_stage_chunk(1, 4 * wide, k) == 0                    # 128 x 512 candidates at 2 x CHUNK
    assert select.kernel_selects(1, wide, k) and not select.kernel_selects(1, wide + select.CHUNK, k)
    assert select.kernel_selects(8192, select.MAX_COLUMNS, k)             # one stage


@pytest.mark.parametrize("programs,chunk", [(512, 512), (8, 256)])
def test_rows_past_one_programs_width_take_two_stages(monkeypatch, programs, chunk):
    """With one program's width cut to 1,024 columns (and chunks of 256), rows of 4,096 columns
    run both kernels (not the reference's sort) and pick the reference's ids, in chunks of 512
    while 3 rows x 8 of them fit the programs' limit, else of 256; 16,384 columns at k = 64 would
    leave 2,048 candidates, which no program holds: the reference's sort."""
    monkeypatch.setattr(select, "MAX_COLUMNS", 1024)
    monkeypatch.setattr(select, "CHUNK", 256)
    monkeypatch.setattr(select, "TWO_STAGE_PROGRAMS", programs)
    assert select.two_stage_chunk(3, 4096, 64) == chunk
    rng, seed = fresh_rng()
    x = np.where(rng.random((3, 4096)) < 0.3, rng.choice(SPECIAL, (3, 4096)),
                 rng.integers(-2, 3, (3, 4096)).astype(np.float32))
    vis = np.asarray([-1, 2000, 5000], np.int32)
    run = lambda s, v: select.select_ascending(s, v, 64, backend="pallas")
    assert "select_chunks" in str(jax.make_jaxpr(run)(jnp.asarray(x), jnp.asarray(vis)))
    np.testing.assert_array_equal(np.asarray(run(jnp.asarray(x), jnp.asarray(vis))),
                                  np.asarray(ref.select_topk(jnp.asarray(x), jnp.asarray(vis), 64)),
                                  err_msg=f"seed {seed}")
    assert not select.kernel_selects(1, 16384, 64)
    assert "select_ascending" not in str(jax.make_jaxpr(run)(jnp.zeros((1, 16384)), jnp.zeros((1,), jnp.int32)))


@pytest.mark.parametrize("platform", ["rocm", "cuda"])
@pytest.mark.parametrize("n", [8192, 32768])
def test_lowers_to_one_triton_call(platform, n):
    f = functools.partial(select._select_pallas, k=512, num_warps=4, interpret=False)
    allow = [jax.export.DisabledSafetyCheck.custom_call(TRITON_CUSTOM_CALL)]
    e = jax.export.export(jax.jit(f), platforms=[platform], disabled_checks=allow)(
        jax.ShapeDtypeStruct((192, n), jnp.float32), jax.ShapeDtypeStruct((192,), jnp.int32))
    assert e.mlir_module().count(f"custom_call @{TRITON_CUSTOM_CALL}") == 1


@pytest.mark.parametrize("platform", ["rocm", "cuda"])
def test_two_stages_lower_to_two_triton_calls(platform):
    def f(s, v):
        ids, vals = select._chunks_pallas(s, k=512, chunk=select.CHUNK, num_warps=8, interpret=False)
        return select._select_pallas(vals, v, ids, k=512, num_warps=8, interpret=False)
    allow = [jax.export.DisabledSafetyCheck.custom_call(TRITON_CUSTOM_CALL)]
    e = jax.export.export(jax.jit(f), platforms=[platform], disabled_checks=allow)(
        jax.ShapeDtypeStruct((2, 32768), jnp.float32), jax.ShapeDtypeStruct((2,), jnp.int32))
    assert e.mlir_module().count(f"custom_call @{TRITON_CUSTOM_CALL}") == 2


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


def test_candidate_blocks_take_the_kernel_under_its_switch():
    """The candidate source's blocks (best row per block, the newest pinned, -inf and NaN blocks
    dropped) through the kernel when kernel "select" is on Pallas, equal to the reference's
    top_k + sort, with -inf rows past `visible` and some NaN rows."""
    from kernels_pallas import backend
    from v41_jax.model.indexer import candidate_blocks

    rng, seed = fresh_rng()
    x = rng.integers(-3, 4, (2, 3, 512)).astype(np.float32)
    x[rng.random(x.shape) < 0.01] = np.nan
    vis = rng.integers(0, 513, (2, 3)).astype(np.int32)
    x = jnp.asarray(np.where(np.arange(512) < vis[..., None], x, -np.inf))
    got, jaxprs = {}, {}
    for name in ("xla", "pallas"):
        with backend.use_backend(name, kernel="select"):
            jaxprs[name] = str(jax.make_jaxpr(lambda s, v: candidate_blocks(s, v, 24, 8))(x, jnp.asarray(vis)))
            got[name] = np.asarray(candidate_blocks(x, jnp.asarray(vis), 24, 8))
    assert "select_ascending" in jaxprs["pallas"] and "select_ascending" not in jaxprs["xla"]
    assert (got["xla"] == -1).any()                    # some rows see fewer than 24 blocks
    np.testing.assert_array_equal(got["pallas"], got["xla"], err_msg=f"seed {seed}")
