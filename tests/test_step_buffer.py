"""The cache is one donated buffer: consumed by the step, updated in place (no second copy), and
padding rows touch nothing (docs/CACHE.md INV-6)."""

from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.engine_common import BUCKETS, FP32, SETTINGS, build_model, make_engine
from v41_jax.model.numerics import Numerics
from v41_jax.runtime.metadata import build_step


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("tiny"), "tiny", seed=0)


def _compiled(engine):
    bucket = BUCKETS.buckets[-1]
    packed = engine.runner.send(bucket, build_step(engine.geom, engine.cfg, bucket, []).batch)
    return engine.step_fn.lower(engine.params, engine.cache, packed, layout=engine.runner.layout(bucket)).compile()


def test_donated_cache_is_consumed(model):
    engine = make_engine(*model)
    before = engine.cache
    span = engine.make_span("r", 0, 0, [5, 6, 7], engine.pages.allocate(1), None)
    engine.run([span])
    assert all(x.is_deleted() for x in jax.tree_util.tree_leaves(before))
    assert not any(x.is_deleted() for x in jax.tree_util.tree_leaves(engine.cache))


@pytest.mark.parametrize("rows", ["f32", "bf16"])
def test_no_second_copy_of_the_cache(model, rows):
    """Every cache leaf is aliased input->output, and the scratch memory does not grow with the
    cache: quadrupling the page pool adds nothing to the temporaries (a hidden copy would add at
    least the grown PAGE arrays)."""
    if rows == "bf16" and jax.default_backend() == "cpu":
        pytest.skip("XLA:CPU upcasts bf16 scatters to f32 through a temporary; GPUs scatter bf16 in place")
    numerics = FP32 if rows == "f32" else Numerics.fast()
    settings = replace(SETTINGS, kv_format=rows, index_format=rows)
    small = make_engine(*model, settings=settings, numerics=numerics)
    large = make_engine(*model, settings=replace(settings, num_pages=4 * settings.num_pages), numerics=numerics)
    m_small, m_large = _compiled(small).memory_analysis(), _compiled(large).memory_analysis()
    for engine, mem in ((small, m_small), (large, m_large)):
        assert mem.alias_size_in_bytes == engine.cache.nbytes
    grown = large.cache.nbytes - small.cache.nbytes
    assert grown > large.cache.nbytes // 2                  # the PAGE arrays dominate the large cache
    assert m_large.temp_size_in_bytes - m_small.temp_size_in_bytes < 0.01 * grown


def test_padding_rows_are_inert(model):
    engine = make_engine(*model)
    g = engine.geom
    # garbage everywhere (finite, so byte comparison is exact)
    engine.cache = jax.tree_util.tree_map(lambda x: jnp.full_like(x, 3), engine.cache)
    before = g.to_image(engine.cache)
    engine.run([], BUCKETS.buckets[-1])              # an all-padding step
    assert np.array_equal(g.to_image(engine.cache), before)

    # a real request next to padding rows writes its own slot and pages only
    pages = [5, 6]
    engine.run([engine.make_span("r", 2, 0, np.arange(3, 12), pages, None)], BUCKETS.buckets[-1])
    after = g.to_image(engine.cache)
    touched = np.zeros(g.total_bytes, bool)
    touched[g.slot_address(2): g.slot_address(3)] = True
    for k, o in enumerate(g.owners):
        for p in pages:
            touched[g.main_row_address(k, p, 0): g.main_row_address(k, p, 0) + o.rows_per_page * g.main_row_bytes] = True
            touched[g.index_row_address(k, p, 0): g.index_row_address(k, p, o.rows_per_page)] = True
    assert np.array_equal(after[~touched], before[~touched])
    assert not np.array_equal(after[touched], before[touched])
