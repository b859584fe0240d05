"""Index keys held as packed FP4 rows (docs/CACHE.md §1.3; `--index-format fp4`, a choice for
memory): the keys the model stores are on the fp4 grid, so a row of Di/2 E2M1 bytes
and Di/32 E8M0 codes holds exactly the values of the typed row (a quarter of bf16's bytes). The
engine with packed rows must therefore run the typed engine's computation bit for bit: the same
tokens and log-probabilities, and index planes that decode to the typed engine's planes. Without
fake-quant the keys are off the grid, and the step refuses packed rows."""

from dataclasses import replace

import jax.numpy as jnp
import numpy as np
import pytest

from tests.engine_common import SETTINGS, assert_packed_runs_typed, build_model, make_engine
from v41_jax.cache.geometry import INDEX_PACKED, row_formats
from v41_jax.model.numerics import Numerics
from v41_jax.quant import unpack_fp4_ue8m0_rows
from v41_jax.runtime.request import Request
from v41_jax.runtime.sampling import SamplingParams

FAST = Numerics.fast()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("tiny"), "tiny", seed=0)


def _engine(model, index_format):
    return make_engine(*model, settings=replace(SETTINGS, **row_formats(FAST, index_format)), numerics=FAST)


def test_formats_follow_the_numerics():
    assert row_formats(FAST) == row_formats(FAST, "typed") == dict(kv_format="bf16", index_format="bf16")
    assert row_formats(FAST, INDEX_PACKED) == dict(kv_format="bf16", index_format=INDEX_PACKED)
    assert row_formats(Numerics.fp32()) == dict(kv_format="f32", index_format="f32")


def test_packed_index_rows_run_the_typed_computation_bit_for_bit(model):
    typed, packed = _engine(model, None), _engine(model, INDEX_PACKED)
    assert packed.cache.index[0].dtype == jnp.uint8 and typed.cache.index[0].dtype == jnp.bfloat16
    rng = np.random.default_rng(3)
    vocab = typed.cfg.vocab_size
    # prompts past several index rows of each owner, greedy and sampled, with log-probabilities
    reqs = [Request(rng.integers(3, vocab - 1, n).tolist(), 12, s, ignore_eos=True, request_id=i, logprobs=True)
            for i, (n, s) in enumerate([(40, SamplingParams()), (23, SamplingParams(temperature=0.8, seed=1)),
                                        (57, SamplingParams())])]
    decode = lambda b: unpack_fp4_ue8m0_rows(b, dtype=jnp.bfloat16)
    assert_packed_runs_typed(typed, packed, reqs,
                             lambda: [(a, b, decode) for a, b in zip(typed.cache.index, packed.cache.index)])


def test_packed_index_rows_are_refused_without_fake_quant(model):
    with pytest.raises(ValueError, match="index_format.*without fake-quant.*'fp4'"):
        make_engine(*model, settings=replace(SETTINGS, index_format=INDEX_PACKED))
