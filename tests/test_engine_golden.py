"""The Scheduler + Runner engine produces, token for token, what the closed-loop engine before it
produced (tests/fixtures/engine_golden/SOURCE.md): chunked prefill, two buckets, one-shot
prefills, greedy and sampled requests, more requests than slots (queueing and slot reuse)."""

import json
from pathlib import Path

import pytest

from tests.engine_common import BUCKETS, build_model, make_engine
from v41_jax.runtime.metadata import Bucket, BucketSet
from v41_jax.runtime.request import Request
from v41_jax.runtime.sampling import SamplingParams

GOLDEN = json.loads((Path(__file__).parent / "fixtures/engine_golden/tokens.json").read_text())


@pytest.fixture(scope="module", params=["tiny", "modes"])
def model(request, tmp_path_factory):
    return request.param, build_model(tmp_path_factory.mktemp(request.param), request.param, seed=0)


@pytest.mark.parametrize("scenario,device_engram", [("chunk16", None), ("chunk7_2buckets", None), ("oneshot", None),
                                                    ("chunk7_2buckets", False)])
def test_tokens_equal_the_previous_engine(model, scenario, device_engram):
    """device_engram None: the tables fit, decode tokens are fed back on the device; False: the
    host hand-off the released model's host-resident tables take."""
    config, (cfg, params, token_map) = model
    case = GOLDEN[f"{config}/{scenario}"]
    kw = {}
    if case["kw"]["prefill_chunk"]:
        kw["prefill_chunk"] = case["kw"]["prefill_chunk"]
    if case["kw"]["two_buckets"]:
        kw["buckets"] = BucketSet((BUCKETS.buckets[-1], Bucket(4, 4, 4)))
    engine = make_engine(cfg, params, token_map, device_engram=device_engram, **kw)
    assert engine.runner.device_feedback is (device_engram is None)
    reqs = [Request(r["prompt"], r["max_new_tokens"], SamplingParams(**r["sampling"]), ignore_eos=True,
                    request_id=r["request_id"]) for r in case["requests"]]
    got = engine.generate(reqs)
    assert [r.tokens for r in got] == case["tokens"]
    assert [r.finish_reason for r in got] == case["finish"]
