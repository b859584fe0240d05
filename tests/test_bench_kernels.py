"""scripts/bench_kernels.py: every timed attention variant is checked against the XLA path in the
same run, and a variant whose output is wrong is flagged in its row and in the table."""

from __future__ import annotations

import json

from scripts import bench_kernels as bk

ARGS = ["--smoke", "--sections", "attn-sweep", "--cases", r"decode32/pallas\[h16w4\]", "--reps", "2",
        "--budget", "120"]


def _rows(path):
    return [c for c in json.loads(path.read_text())["cases"] if "ms" in c]


def test_a_timed_variant_is_checked(tmp_path, capsys, monkeypatch):
    out = tmp_path / "k.json"
    bk.main(ARGS + ["--out", str(out)])
    (row,) = _rows(out)
    assert row["agrees_xla"] is True and 0 <= row["max_abs_diff_xla"] <= bk.BF16_TOL * 2
    assert "DISAGREES" not in capsys.readouterr().out

    # the same variant with its output off by 10 %: flagged, the timing still recorded
    real = bk.sparse_attn_paged

    def off(q, sink, sources, scale, *, backend=None, **kw):
        o = real(q, sink, sources, scale, backend=backend, **kw)
        return o * 1.1 if backend == "pallas" else o

    monkeypatch.setattr(bk, "sparse_attn_paged", off)
    bk.main(ARGS + ["--out", str(out)])
    (row,) = _rows(out)
    assert row["agrees_xla"] is False and row["max_abs_diff_xla"] > bk.BF16_TOL and row["ms"] > 0
    assert "h16w4]" in capsys.readouterr().out.split("DISAGREES")[0].splitlines()[-1]


def test_a_check_that_cannot_run_keeps_the_timing(tmp_path, monkeypatch):
    """The XLA path failing (e.g. its gathered rows do not fit) leaves the variant's timing in
    its row with the reason, tried once a shape."""
    real, calls = bk.sparse_attn_paged, []

    def xla_fails(q, sink, sources, scale, *, backend=None, **kw):
        if backend == "xla":
            calls.append(1)
            raise MemoryError("gathered rows do not fit")
        return real(q, sink, sources, scale, backend=backend, **kw)

    monkeypatch.setattr(bk, "sparse_attn_paged", xla_fails)
    out = tmp_path / "k.json"
    bk.main(ARGS[:4] + [r"decode32/pallas\[(h16w4|h16w4-plain)\]"] + ARGS[5:] + ["--out", str(out)])
    rows = _rows(out)
    assert len(rows) == 2 and all(r["ms"] > 0 and "MemoryError" in r["check_error"] for r in rows)
    assert "agrees_xla" not in rows[0] and len(calls) == 1     # the XLA path tried once a shape
