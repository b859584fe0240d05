"""`check_reference` through the cache and the jitted step (prefill + 16 teacher-forced decode
steps) passes on the official fixtures at the checker's own tolerances."""

import json
import os
from pathlib import Path

import pytest

from tests import engine_common  # noqa: F401 (the persistent compilation cache)
from v41_jax.tools.check_reference import main

FIXTURES = Path(__file__).resolve().parent / "fixtures/dsv41_official"


# small_a's schedule runs through the engine in the whole-farm run (f04 and v1, v2: its shape, other
# seeds and weights; V41_FARM=all); by default only small_b's (~1 min of CPU each: the suite's budget)
@pytest.mark.parametrize("name", ["small_a", "small_b"] if os.environ.get("V41_FARM") == "all" else ["small_b"])
def test_engine_replay_passes_the_checker(name, capsys):
    """`check_reference DIR --engine` (CPU tolerance profile, as on the machine running it)."""
    code = main([str(FIXTURES / name), "--engine", "--json", "--tolerance", "cpu"])
    report = json.loads(capsys.readouterr().out)
    failed = [(c["key"], c["stats"]) for c in report["checks"] if not c["passed"]]
    assert code == 0 and not failed
    keys = {c["key"] for c in report["checks"]}
    # the incremental path was compared, not only the prompt
    assert {"decode.logits", "decode.output_ids", "decode.block_out", "decode.engram_hash_ids"} <= keys
