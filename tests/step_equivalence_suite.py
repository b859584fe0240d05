"""Cache path == full forward, fp32 numerics (test_step_equivalence_modes.py: the modes config;
tiny, the same attention modes in the same order less two layers, no longer runs it too).

One 40-token prompt; the engine generates 32 greedy tokens (prefill in chunks of 16 through
`generate`); then the full forward runs once over the 72 tokens. Every other arm feeds the same 72
tokens through the cache teacher-forced and must reproduce the forward's logits at every position:
one-shot prefill, chunks of 1, 3, 7 and 16, prefill + token-by-token decode.

Tolerance: |dlogit| <= 1e-4. In fp32 numerics the cache holds fp32 rows, so the two paths compute
the same values and differ only in fp32 summation order (GEMMs of a different row count, gathered
vs contiguous rows), observed <= 5e-6 on logits of magnitude <= 5: a 20x margin that still fails
on any real error (a wrong row, position or group moves logits by >= 1e-2).
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.engine_common import build_model, chunked, forward_logits, make_engine, teacher_forced
from v41_jax.runtime.request import Request

ATOL = 1e-4
PROMPT, NEW = 40, 32


@pytest.fixture(scope="class")
def run(request, tmp_path_factory):
    """(cfg, engine, the 72 tokens, the generation result, forward logits [72, V])."""
    config = request.cls.CONFIG
    cfg, params, token_map = build_model(tmp_path_factory.mktemp(config), config, seed=0)
    engine = make_engine(cfg, params, token_map, prefill_chunk=16)
    prompt = np.random.default_rng(7).integers(3, cfg.vocab_size - 1, PROMPT)
    res = engine.generate([Request(prompt.tolist(), NEW, ignore_eos=True)])[0]
    seq = np.concatenate([prompt, res.tokens]).astype(np.int32)
    return cfg, engine, seq, res, forward_logits(params, cfg, token_map, seq)


class EquivalenceSuite:
    CONFIG: str

    def test_prompt_exercises_every_state(self, run):
        cfg, engine, seq, _, _ = run
        geom = engine.geom
        assert len(seq) > 2 * geom.ring_slots                     # the window ring wraps
        assert 7 % 2 and 3 % 2                                     # 3- and 7-chunks end on odd positions:
        # their ratio-2 groups straddle chunk ends and complete from the compressor ring
        rows_ratio1 = len(seq) - 1                                 # compressed rows a late ratio-1 query sees
        assert rows_ratio1 > cfg.candidate_topk_blocks * cfg.candidate_block_size  # candidates restrict
        assert rows_ratio1 > cfg.index_topk                        # top-k selects

    def test_greedy_continuation_matches_forward(self, run):
        _, _, seq, res, ref = run
        assert res.finish_reason == "length" and len(res.tokens) == NEW
        # greedy token at position p is the argmax of the forward's logits at p - 1
        assert np.array_equal(ref[PROMPT - 1: PROMPT - 1 + NEW].argmax(-1), seq[PROMPT:])

    @pytest.mark.parametrize("chunks", ["one-shot", 1, 3, 7, 16, "prefill+decode"])
    def test_teacher_forced_logits_match_forward(self, run, chunks):
        _, engine, seq, _, ref = run
        n = len(seq)
        lengths = {"one-shot": [n], "prefill+decode": [PROMPT] + [1] * (n - PROMPT)}.get(chunks) \
            or chunked(n, chunks)
        got = teacher_forced(engine, seq, lengths)
        assert np.abs(got - ref).max() <= ATOL
