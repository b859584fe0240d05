"""scripts/bench_targets.py: the verdict read back from each benchmark's JSON (written here in
the benchmarks' own formats), and one stage run for real on the tiny config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from scripts import bench_step
from scripts import bench_targets as bt
from tests.engine_common import WHOLE


def _write(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data))


def test_verdict_reads_each_benchmarks_json_and_says_what_is_missing(tmp_path):
    dev = {"device": "NVIDIA H200"}
    _write(tmp_path / "decode_8192.json", dict(dev, cases=[
        {"name": "decode b=1 ctx=8192", "back_to_back_ms": 2.0, "ideal_ms": 1.6,        # 1.25: met
         "ideal_ms_at_datasheet": 1.25},                                                 # 1.6: reported
        {"name": "decode b=8 ctx=8192", "back_to_back_ms": 5.4, "ideal_ms": 4.0},       # 1.35: not
        {"name": "decode b=32 ctx=8192", "error": "compile: out of memory"},           # not measured
        {"name": "decode b=64 ctx=8192", "back_to_back_ms": 3.9, "ideal_ms": 4.0}]))    # 0.975: no verdict
    _write(tmp_path / "prefill.json", dict(dev, cases=[
        {"name": "prefill 4096 (b=1, pos 0)", "model_flops_of_in_run_gemm_peak": 0.452},
        {"name": "prefill 8192 (b=1, pos 0)", "model_flops_of_in_run_gemm_peak": 0.449}]))
    _write(tmp_path / "profile.json", dict(dev, cases=[
        {"name": "decode b=1 ctx=8192", "back_to_back_ms": 2.5, "profile": {"timeline": {"span_ms": 2.0, "busy_ms": 1.9}}}]))
    _write(tmp_path / "attn.json", dict(dev, cases=[{"name": "attn/decode32/pallas[auto]", "tflops": 86.3, "ctx": 32768},
                                                    {"name": "attn/decode64/pallas[auto]", "tflops": 210.0},
                                                    {"name": "attn/decode32/pallas[auto]", "tflops": 201.0, "ctx": 131072}]))
    _write(tmp_path / "compile_1x1x1.json", dict(dev, rows=[{"lower_s": 2.1, "compile_s": 8.9}]))
    _write(tmp_path / "compile_4096x1x1.json", dict(dev, rows=[{"lower_s": 2.2, "compile_s": 18.3}]))
    sheet = {r["case"]: r for r in bt.verdict(tmp_path) if "data-sheet" in r["target"]}
    rows = {(r["target"].split()[0], r["case"]): r for r in bt.verdict(tmp_path)
            if not r["target"].startswith("kernel") and "data-sheet" not in r["target"]}
    kernel = {r["target"]: r for r in bt.verdict(tmp_path) if r["target"].startswith("kernel")}
    assert len(rows) == 8 + 2 + 3 + 4 and len(kernel) == 2
    met = {k: r["met"] for k, r in rows.items()}
    assert met[("decode", "b=1 ctx=8192")] is True and rows[("decode", "b=1 ctx=8192")]["measured"] == 1.25
    assert len(sheet) == 8 and sheet["b=1 ctx=8192"]["measured"] == 1.6 and sheet["b=1 ctx=8192"]["met"] is None
    assert all(r["measured"] is None for c, r in sheet.items() if c != "b=1 ctx=8192")
    assert met[("decode", "b=8 ctx=8192")] is False
    assert met[("decode", "b=32 ctx=8192")] is None and met[("decode", "b=64 ctx=32768")] is None
    # a step faster than its ideal: the probe read low (or the byte count is high), no verdict
    assert met[("decode", "b=64 ctx=8192")] is None and rows[("decode", "b=64 ctx=8192")]["measured"] == 0.975
    assert met[("prefill", "4096 tokens")] is True and met[("prefill", "8192 tokens")] is False
    span, queued = kernel["kernel time / waited call's span"], kernel["kernel time / back-to-back step"]
    assert queued["met"] is False and queued["measured"] == 0.76 and queued["case"] == "b=1 ctx=8192"
    assert span["met"] is None and span["measured"] == 0.95 and span["limit"] is None   # reported only
    assert met[("sparse", "32 decode tokens")] is False and met[("sparse", "64 decode tokens")] is True
    assert rows[("sparse", "32 decode tokens")]["measured"] == 86.3      # the 32K row, not the 128K one
    assert met[("sparse", "128 decode tokens")] is None
    assert met[("compile", "1x1x1")] is True and met[("compile", "4096x1x1")] is False   # 20.5 s
    assert met[("compile", "32x32x32")] is None
    md = bt.table(bt.verdict(tmp_path))
    assert "| decode back to back / ideal | b=8 ctx=8192 | 1.35 | <= 1.33 | **no** | NVIDIA H200 |" in md
    assert md.count("not measured") == 5 + 7 + 1 + 2   # decode, its data-sheet rows, attention, compile
    assert "| b=64 ctx=8192 (faster than its ideal: no verdict) | 0.975 | <= 1.33 | - |" in md
    assert "| kernel time / waited call's span | b=1 ctx=8192 | 0.95 | reported | - |" in md


@pytest.mark.skipif(not WHOLE, reason="whole run only (V41_FARM=all): a benchmark script end to end, ~40-55 CPU-s (suite time)")
def test_commands_parse_and_a_stage_runs(tmp_path):
    """Every bench_step command a full run would start parses; an unknown stage is refused; the
    decode stage runs on the tiny config and its verdict rows carry numbers."""
    for stage in ("decode", "prefill", "profile"):
        for argv, path in bt.commands(stage, bt.SLICE, tmp_path, smoke=False):
            args = bench_step.parse_args(argv[3:])
            assert Path(args.out) == path
    with pytest.raises(SystemExit):
        bt.main(["--out-dir", str(tmp_path), "--only", "decode,speed"])
    assert bt.main(["--out-dir", str(tmp_path), "--smoke", "--only", "decode"]) == 0
    out = json.loads((tmp_path / "targets.json").read_text())
    decode = [r for r in out["targets"] if r["target"] == "decode back to back / ideal"]
    assert len(decode) == 2 and all(r["measured"] > 0 and r["met"] in (True, False) for r in decode)
    sheet = [r for r in out["targets"] if "data-sheet" in r["target"]]     # a CPU has no data sheet
    assert len(sheet) == 2 and all(r["measured"] is None for r in sheet)
    assert out["runs"]["decode_64.json"]["rc"] == 0
    assert (tmp_path / "targets.md").read_text().startswith("| target |")
    # no stage: the folder's JSONs read again, nothing run
    assert bt.main(["--out-dir", str(tmp_path), "--smoke", "--only", ""]) == 0
    again = json.loads((tmp_path / "targets.json").read_text())
    assert again["runs"] == {} and again["targets"] == out["targets"]
