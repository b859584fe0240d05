"""Cache buffer: allocation from the geometry, fresh-slot reset, in-place donation."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from v41_jax.cache.buffer import DEAD, allocate, reset_slots
from v41_jax.cache.geometry import CacheGeometry, EngineSettings
from v41_jax.config import ModelConfig

SMALL_B = Path(__file__).resolve().parents[1] / "tests/fixtures/dsv41_official/small_b/checkpoint"


def _geom():
    return CacheGeometry.build(ModelConfig.from_file(SMALL_B),
                               EngineSettings(page_tokens=8, num_pages=6, slots=4))


def _fill(cache, value):
    return jax.tree_util.tree_map(lambda x: jnp.full_like(x, value), cache)


def test_allocate_matches_geometry():
    g = _geom()
    cache = allocate(g)
    specs = g.array_specs()
    assert [x.shape for x in cache.main] == [s.shape for s in specs["main"]]
    assert cache.window.shape == specs["window"].shape and cache.window.dtype == jnp.bfloat16
    assert cache.comp_kv.dtype == jnp.float32
    assert np.array_equal(np.asarray(cache.cursor), np.tile([0, DEAD, DEAD, DEAD], (4, 1)))
    assert g.to_image(cache).size == g.total_bytes


def test_reset_zeroes_only_named_slots_and_consumes_input():
    g = _geom()
    cache = _fill(allocate(g), 7)
    before = g.to_image(cache)
    out = reset_slots(cache, jnp.array([False, False, True, False]))
    assert cache.window.is_deleted()                 # donated: updated in place
    after = g.to_image(out)
    s2 = slice(g.slot_address(2), g.slot_address(3))
    assert np.array_equal(np.asarray(out.cursor[2]), [0, DEAD, DEAD, DEAD])
    assert not np.asarray(out.window[2]).any() and not np.asarray(out.comp_kv[2]).any()
    outside = np.ones(g.total_bytes, bool)
    outside[s2] = False
    assert np.array_equal(after[outside], before[outside])   # PAGE and every other slot untouched


def test_reset_aliases_the_whole_cache():
    g = _geom()
    cache = allocate(g)
    compiled = reset_slots.lower(cache, jnp.zeros(4, bool)).compile()
    mem = compiled.memory_analysis()
    assert mem.alias_size_in_bytes == cache.nbytes    # every output buffer is its input buffer
    assert mem.temp_size_in_bytes < 1024              # and no scratch copy of any STATE array
