"""Main and window rows held packed (docs/CACHE.md §1.3; `kv_format="packed"`, a choice for
memory and bytes read): the model puts compressed rows on the FP4 grid (E4M3 scales, groups of
16) and window rows on the FP8 grid (E8M0 scales, groups of 32), so packed rows of 0.28 and 0.52
of bf16's bytes hold exactly the typed rows' values. The engine with packed rows must therefore
run the typed engine's computation bit for bit, with DSpark's draft rings too: the same tokens and log-probabilities, and planes that decode to
the typed engine's. Without fake-quant the rows are off the grids, and the step refuses them.

The bit-for-bit run holds every packable plane packed at once (main and window rows here, the
index keys as packed FP4 rows too, tests/test_index_rows_packed.py's format): one pair of engine
compiles for both formats (suite time), and an interaction of the two would show as well."""

from dataclasses import replace

import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.sparse_attn import decode_rows
from tests.engine_common import SETTINGS, assert_packed_runs_typed, build_model, make_engine
from v41_jax.cache.geometry import INDEX_PACKED, KV_PACKED, row_formats
from v41_jax.model.numerics import Numerics
from v41_jax.quant import unpack_fp4_ue8m0_rows
from v41_jax.runtime.request import Request
from v41_jax.runtime.sampling import SamplingParams

FAST = Numerics.fast()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("tiny"), "tiny", seed=0)


def _engine(model, kv_format, index_format=None, **kw):
    cfg = model[0]
    settings = replace(SETTINGS, draft_slack=cfg.dspark_block_size,
                       **row_formats(FAST, index_format=index_format, kv_format=kv_format))
    return make_engine(*model, settings=settings, numerics=FAST, **kw)


def _requests(vocab, speculative):
    rng = np.random.default_rng(5)
    # prompts past the window (8) and past several compressed rows of each owner, greedy and
    # sampled, with log-probabilities
    return [Request(rng.integers(3, vocab - 1, n).tolist(), 10, s, ignore_eos=True, request_id=i,
                    logprobs=True, speculative=speculative)
            for i, (n, s) in enumerate([(37, SamplingParams()), (21, SamplingParams(temperature=0.8, seed=1)),
                                        (50, SamplingParams())])]


def test_formats_follow_the_numerics():
    assert row_formats(FAST, kv_format=KV_PACKED) == dict(kv_format=KV_PACKED, index_format="bf16")
    assert row_formats(FAST, kv_format="typed") == row_formats(FAST)


def test_packed_rows_run_the_typed_computation_bit_for_bit(model):
    # the XLA path (the CPU's); the kernel reads packed rows to the typed rows' output bit for bit
    # (tests/test_kernels_sparse_attn.py), and through the engine in interpret mode too (133 s of
    # CPU, run once: 2026-12-06)
    typed, packed = _engine(model, None), _engine(model, KV_PACKED, INDEX_PACKED)
    assert packed.cache.main[0].dtype == packed.cache.window.dtype == packed.cache.index[0].dtype == jnp.uint8
    assert typed.cache.main[0].dtype == typed.cache.index[0].dtype == jnp.bfloat16
    reqs = _requests(typed.cfg.vocab_size, speculative=True)              # DSpark's rings too
    kv = lambda b: decode_rows(b, typed.cfg.head_dim, jnp.float32)
    index = lambda b: unpack_fp4_ue8m0_rows(b, dtype=jnp.bfloat16)
    assert_packed_runs_typed(typed, packed, reqs, lambda: [
        *[(a, b, kv) for a, b in [*zip(typed.cache.main, packed.cache.main), (typed.cache.window, packed.cache.window)]],
        *[(a, b, index) for a, b in zip(typed.cache.index, packed.cache.index)]])


def test_packed_kv_rows_are_refused_without_fake_quant(model):
    with pytest.raises(ValueError, match="kv_format.*without fake-quant.*'packed'"):
        make_engine(*model, settings=replace(SETTINGS, kv_format=KV_PACKED))
