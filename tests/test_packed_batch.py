"""The batch crosses to the device packed in two buffers (runtime/packed.py): unpacking inside a
jit gives back every leaf bit for bit, in its dtype and shape, for every bucket of the engine's
configs (bools, -0.0 and NaN bit patterns included), and a batch of another structure is refused."""

import jax
import numpy as np
import pytest

from tests.engine_common import BUCKETS, build_model, make_engine
from v41_jax.runtime.metadata import Bucket, build_step
from v41_jax.runtime.packed import BatchLayout


@pytest.fixture(scope="module", params=["tiny", "modes"])
def engine(request, tmp_path_factory):
    return make_engine(*build_model(tmp_path_factory.mktemp(request.param), request.param, seed=0))


def _random_like(batch, rng):
    """Every leaf filled with random bits of its dtype (floats include -0.0 and a NaN pattern)."""
    def fill(x):
        x = np.asarray(x)
        if x.dtype == bool:
            return rng.random(x.shape) < 0.5
        bits = rng.integers(0, 256, x.size * x.dtype.itemsize, dtype=np.uint8).view(x.dtype).reshape(x.shape)
        if x.dtype == np.float32 and x.size >= 2:
            bits.reshape(-1)[:2] = np.array([-0.0, np.nan], np.float32)
        return bits
    return jax.tree_util.tree_map(fill, batch)


def test_unpack_inverts_pack(engine):
    rng = np.random.default_rng(0)
    for bucket in BUCKETS.buckets + (Bucket(1, 1, 1), Bucket(8, 2, 2)):
        batch = _random_like(build_step(engine.geom, engine.cfg, bucket, []).batch, rng)
        layout = BatchLayout.of(batch)
        assert layout == engine.runner.layout(bucket)
        words, raw = layout.pack(batch)
        assert words.dtype == np.int32 and raw.dtype == np.uint8
        n_leaves = len(jax.tree_util.tree_leaves(batch))
        assert words.nbytes + raw.nbytes == sum(np.asarray(x).nbytes for x in jax.tree_util.tree_leaves(batch))
        back = jax.jit(layout.unpack)(jax.device_put((words, raw)))
        got, want = jax.tree_util.tree_leaves(back), jax.tree_util.tree_leaves(batch)
        assert len(got) == len(want) == n_leaves
        for g, w in zip(got, want):
            g = np.asarray(g)
            assert g.dtype == w.dtype and g.shape == w.shape
            assert np.array_equal(g.view(np.uint8), np.asarray(w).view(np.uint8))


def test_other_structure_refused(engine):
    small, large = Bucket(1, 1, 1), BUCKETS.buckets[0]
    layout = engine.runner.layout(small)
    with pytest.raises(ValueError, match="layout has"):
        layout.pack(build_step(engine.geom, engine.cfg, large, []).batch)
    with pytest.raises(ValueError, match="structure"):
        layout.pack({"tokens": np.zeros(3, np.int32)})
    with pytest.raises(TypeError, match="no packed form"):
        BatchLayout.of({"x": np.zeros(2, np.float64)})
