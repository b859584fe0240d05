"""Index keys held as packed FP4 rows (docs/CACHE.md §1.3; `--index-format fp4`, a choice for
memory): the keys the model stores are on the fp4 grid, so a row of Di/2 E2M1 bytes
and Di/32 E8M0 codes holds exactly the values of the typed row (a quarter of bf16's bytes). The
engine with packed rows must therefore run the typed engine's computation bit for bit: the same
tokens and log-probabilities, and index planes that decode to the typed engine's planes
(tests/test_kv_rows_packed.py runs that, with the main and window rows packed as well: one pair
of engine compiles for both). Without fake-quant the keys are off the grid, and the step refuses
packed rows."""

from dataclasses import replace

import pytest

from tests.engine_common import SETTINGS, build_model, make_engine
from v41_jax.cache.geometry import INDEX_PACKED, row_formats
from v41_jax.model.numerics import Numerics

FAST = Numerics.fast()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("tiny"), "tiny", seed=0)


def test_formats_follow_the_numerics():
    assert row_formats(FAST) == row_formats(FAST, "typed") == dict(kv_format="bf16", index_format="bf16")
    assert row_formats(FAST, INDEX_PACKED) == dict(kv_format="bf16", index_format=INDEX_PACKED)
    assert row_formats(Numerics.fp32()) == dict(kv_format="f32", index_format="f32")


def test_packed_index_rows_are_refused_without_fake_quant(model):
    with pytest.raises(ValueError, match="index_format.*without fake-quant.*'fp4'"):
        make_engine(*model, settings=replace(SETTINGS, index_format=INDEX_PACKED))
