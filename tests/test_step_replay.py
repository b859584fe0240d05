"""`check_reference` through the cache and the jitted step (prefill + 16 teacher-forced decode
steps) passes on the official fixtures at the checker's own tolerances."""

import json
from pathlib import Path

import pytest

from tests.engine_common import WHOLE  # also: the persistent compilation cache
from v41_jax.tools.check_reference import main

FIXTURES = Path(__file__).resolve().parent / "fixtures/dsv41_official"


# whole-farm runs only (V41_FARM=all; ~2 min of CPU each, the suite's 25-minute budget): the suite
# checks the engine path through `check_reference` on a farm fixture with every part (f03: DSpark,
# Engram, 8 index heads; tests/test_check_reference_farm.py, with the injected defects the check
# must catch there) and the official fixtures forward (tests/test_check_reference.py); small_a's
# schedule runs through the engine in the whole farm also as f04 and v1, v2 (its shape, other
# seeds and weights). A cache of packed main and window rows runs the typed computation bit for bit
# (tests/test_kv_rows_packed.py), so its replay is the whole farm's too (~80 s of CPU)
@pytest.mark.skipif(not WHOLE, reason="whole-farm run only (V41_FARM=all): "
                    "the official fixtures through the engine")
@pytest.mark.parametrize("name", ["small_a", "small_b"])
@pytest.mark.parametrize("kv_format", ["typed", "packed"])
def test_engine_replay_passes_the_checker(name, kv_format, capsys):
    """`check_reference DIR --engine` (CPU tolerance profile, as on the machine running it), the
    cache's main and window rows typed or packed (FP4 / FP8: the same values)."""
    code = main([str(FIXTURES / name), "--engine", "--json", "--tolerance", "cpu", "--kv-format", kv_format])
    report = json.loads(capsys.readouterr().out)
    failed = [(c["key"], c["stats"]) for c in report["checks"] if not c["passed"]]
    assert code == 0 and not failed
    keys = {c["key"] for c in report["checks"]}
    # the incremental path was compared, not only the prompt
    assert {"decode.logits", "decode.output_ids", "decode.block_out", "decode.engram_hash_ids"} <= keys


def test_kv_format_needs_the_engine(capsys):
    with pytest.raises(SystemExit) as e:
        main([str(FIXTURES / "small_b"), "--kv-format", "packed"])
    assert e.value.code == 2 and "--kv-format packed: a cache format, so only with --engine" in capsys.readouterr().err
