"""scripts/bench_launch.py runs on CPU and its accounting holds (the figures are the H200's,
BENCHMARKS.md; here only that the parts it times are parts of the step it reports)."""

import json

import pytest

from scripts import bench_launch
from tests.engine_common import WHOLE


@pytest.mark.skipif(not WHOLE, reason="whole run only (V41_FARM=all): a benchmark script end to end, ~35-40 CPU-s (suite time)")
def test_loop_parts_add_up_within_the_step(tmp_path):
    out = tmp_path / "L.json"
    assert bench_launch.main(["--checkpoint", "models/demo", "--out", str(out), "--new", "6", "--rounds", "1",
                              "--calls", "3", "--compile-cache", ""]) == 0   # '': the suite's cache
    rep = json.loads(out.read_text())
    (loop,) = rep["loop"]
    assert loop["steps"] >= 6
    # the launch is inside dispatch, and plan + prepare + dispatch + collect + update inside the step
    assert 0 < loop["_launch_ms"] <= loop["dispatch_ms"]
    parts = sum(loop[f"{k}_ms"] for k in ("schedule", "prepare", "dispatch", "collect", "update"))
    assert parts <= loop["ms_per_step"]
    call = rep["call"]
    assert 0 < call["launch_ms"] <= call["synced_ms"] and call["param_leaves"] > 100
