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


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """config name -> (cfg, params, token_map), built once per module."""
    built = {}

    def get(config):
        if config not in built:
            built[config] = build_model(tmp_path_factory.mktemp(config), config, seed=0)
        return built[config]
    return get


# every scenario on both configs with decode tokens fed back on the device; the host hand-off
# (device_engram False) on `modes` alone, whose Engram sits on two layers: each case is one more
# step compile (~50 s of the suite's CPU); tiny takes the hand-off on a mesh of 8 (tests/mesh_child.py)
CASES = [(c, s, None) for c in ("tiny", "modes") for s in ("chunk16", "chunk7_2buckets", "oneshot")] \
    + [("modes", "chunk7_2buckets", False)]


@pytest.mark.parametrize("config,scenario,device_engram", CASES)
def test_tokens_equal_the_previous_engine(models, config, scenario, device_engram):
    """device_engram None: the tables fit, decode tokens are fed back on the device; False: the
    host hand-off the released model's host-resident tables take."""
    cfg, params, token_map = models(config)
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
