"""DSpark speculative decoding on an engine that feeds decode tokens from the host (Engram rows
looked up there, `device_engram=False`; tests/test_speculative.py covers the device-fed engine,
whose oracle and helpers this file uses)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tests.engine_common import SETTINGS, build_model, make_engine
from tests.test_speculative import Oracle, _plain, _requests
from v41_jax.runtime.engine import Stats


@pytest.fixture(scope="module")
def host_fed(tmp_path_factory):
    """The modes model on an engine whose Engram rows are looked up on the host: each decode's
    token (and its rows) comes from the host's copy of the step before, not from the slot."""
    cfg, params, token_map = build_model(tmp_path_factory.mktemp("host_fed"), "modes", seed=0)
    settings = replace(SETTINGS, draft_slack=cfg.dspark_block_size)
    engine = make_engine(cfg, params, token_map, settings=settings, prefill_chunk=7, device_engram=False)
    assert engine.speculative and not engine.runner.device_feedback
    return cfg, engine


def test_host_fed_speculation_equals_plain_greedy(host_fed):
    """Speculative and plain requests mixed on the host-fed engine, with the head's drafts and
    then the oracle's forced acceptances of every length: every request emits what greedy
    without drafts emits. Here every verify span makes its request await its step, so the next
    step is planned after that step's tokens are read; the plans include a plain request's last
    prefill chunk behind a verify span (its token then read from the row after the verify's
    1 + k rows). `StepPlan.next_tokens`' rows behind a verify span, which only a host-fed step
    planned before its predecessor is read would use, are tested in tests/test_scheduler_property.py."""
    cfg, engine = host_fed
    reqs = _requests(cfg, 5, seed=3)
    want = _plain(engine, reqs)
    mixed = [replace(q, speculative=None if i % 2 == 0 else False) for i, q in enumerate(reqs)]
    engine.reset()
    stats = Stats()
    assert {r.request_id: r.tokens for r in engine.generate(mixed, stats=stats)} == want
    assert stats.verifies > 0
    engine.reset()
    oracle = Oracle(engine, want, {q.request_id: q.prompt for q in reqs})
    try:
        assert {r.request_id: r.tokens for r in engine.generate(mixed)} == want
    finally:
        engine.runner.__dict__.pop("collect", None)      # (reset drops the scheduler's wrapper)
    assert {n for _, n in oracle.seen} - {0}, oracle.seen        # some drafts accepted
