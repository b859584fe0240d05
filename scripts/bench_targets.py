"""The step's performance targets (issue 16) measured in one command, each by its own benchmark,
and read back into one verdict table.

    python -m scripts.bench_targets --out-dir T [--only decode,prefill,profile,attn,compile]
        [--config v41_jax/configs/bench_slice.config.json] [--smoke]

What runs (one process each, in this order, every JSON under --out-dir):
  decode   `bench_step`, batches 1 / 8 / 32 / 64 at 8K and at 32K context (one process a context):
           back to back / ideal <= DECODE_RATIO (the ideal: the step's bytes at the process's
           memory-probe ceiling, the fastest of a copy, a row-sum read and a one-row GEMV, the
           read a decode step is made of; back to back: calls queued without waiting, as the engine runs);
           a ratio below 1 (the step outran its ideal: the probe read low, or the step read fewer
           bytes than its count) is no verdict: not met, not failed, said in the case. Reported
           beside it, no target: the same bytes at the device's data-sheet bandwidth
  prefill  `bench_step`, 4,096 and 8,192-token chunks: model FLOPs / time >= PREFILL_SHARE of the
           run's own bf16 GEMM probe
  profile  `bench_step --profile 5`, batch 1 at 8K: busy kernel time >= KERNEL_SHARE of the step's
           time back to back (the engine's way, and the step time the decode rows take: the issue
           reads both decode ratios off one step time); the share of a call launched and waited
           for is reported beside it, no target (its gap is the host's launch of the step's CUDA
           graph, BENCHMARKS.md i1)
  attn     `bench_kernels --sections attn`, the sparse attention at 32 / 64 / 128 decode tokens
           with its launch defaults: >= ATTN_TFLOPS
  compile  `bench_compile`, the decode buckets 1 / 32 / 64 and the 4,096-token prefill, each in a
           fresh process: trace + lower + compile <= COMPILE_S
A stage that fails or runs out of its time keeps what it wrote; the verdict lists a target with
no number as not measured. `--smoke`: the tiny config at toy sizes (the CPU test of this
plumbing; its numbers mean nothing). Writes `targets.json` and `targets.md` under --out-dir.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # python scripts/bench_targets.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from v41_jax.config import ModelConfig  # noqa: E402

DECODE_RATIO = 1.33
PREFILL_SHARE = 0.45
KERNEL_SHARE = 0.90
ATTN_TFLOPS = 200.0
COMPILE_S = 20.0
STAGES = ("decode", "prefill", "profile", "attn", "compile")
SLICE = "v41_jax/configs/bench_slice.config.json"
TINY = "v41_jax/configs/tiny.config.json"


def sizes(smoke: bool) -> dict:
    """Contexts, batches, prefill chunks, attention tokens and compile buckets of a run."""
    if smoke:
        return dict(contexts=(64,), batches=(1, 2), prefill=(32,), attn_tokens=(32,), buckets=("1x1x1",),
                    stage_s=240)
    return dict(contexts=(8192, 32768), batches=(1, 8, 32, 64), prefill=(4096, 8192), attn_tokens=(32, 64, 128),
                buckets=("1x1x1", "32x32x32", "64x64x64", "4096x1x1"), stage_s=200)


def _csv(xs) -> str:
    return ",".join(map(str, xs))


def commands(stage: str, config: str, out: Path, smoke: bool) -> list[tuple[list[str], Path]]:
    """The (argv, JSON) pairs one stage runs."""
    z, py = sizes(smoke), [sys.executable, "-m"]
    step = py + ["scripts.bench_step", "--config", config, "--total-s", str(z["stage_s"] - 10)]
    if stage == "decode":
        return [(step + ["--prefill=", "--batches", _csv(z["batches"]), "--context", str(c), "--iters", "20",
                         "--case-s", "3", "--out", str(out / f"decode_{c}.json")], out / f"decode_{c}.json")
                for c in z["contexts"]]
    if stage == "prefill":
        return [(step + ["--batches=", "--prefill", _csv(z["prefill"]), "--iters", "5",
                         "--out", str(out / "prefill.json")], out / "prefill.json")]
    if stage == "profile":
        return [(step + ["--prefill=", "--batches", "1", "--context", str(z["contexts"][0]), "--profile", "5",
                         "--out", str(out / "profile.json")], out / "profile.json")]
    if stage == "attn":
        tokens = "|".join(map(str, z["attn_tokens"]))
        return [(py + ["scripts.bench_kernels", "--sections", "attn", "--cases", rf"attn/decode({tokens})/pallas\[auto\]",
                       "--budget", str(z["stage_s"] - 20), "--out", str(out / "attn.json")]
                 + (["--smoke"] if smoke else []), out / "attn.json")]
    if stage == "compile":
        layers = str(ModelConfig.from_file(config).n_layers)      # the whole config
        return [(py + ["scripts.bench_compile", "--config", config, "--layers", layers, "--bucket", b,
                       "--out", str(out / f"compile_{b}.json")], out / f"compile_{b}.json")
                for b in z["buckets"]]
    raise ValueError(f"unknown stage {stage!r}; stages: {', '.join(STAGES)}")


def _load(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _by_name(d: dict) -> dict[str, dict]:
    """A benchmark JSON's case rows by name, the first of a name (bench_kernels times 32 attention
    tokens at 32K, then again at 128K)."""
    cases: dict[str, dict] = {}
    for x in d.get("cases", []):
        cases.setdefault(x["name"], x)
    return cases


def verdict(out: Path, smoke: bool = False) -> list[dict]:
    """One row per target case: what was measured, the limit, whether it is met (None: not
    measured, or a row reported with no limit)."""
    z, rows = sizes(smoke), []

    def row(target, case, value, limit, at_most, device=None, unit=""):
        """limit None: reported, no target."""
        met = None if value is None or limit is None else (value <= limit if at_most else value >= limit)
        rows.append(dict(target=target, case=case, measured=None if value is None else round(float(value), 4),
                         limit=limit, at_most=at_most, met=met, unit=unit, device=device, note=""))

    for c in z["contexts"]:
        d = _load(out / f"decode_{c}.json") or {}
        cases = _by_name(d)
        for b in z["batches"]:
            x = cases.get(f"decode b={b} ctx={c}", {})
            ratio = x["back_to_back_ms"] / x["ideal_ms"] if "back_to_back_ms" in x and x.get("ideal_ms") else None
            row("decode back to back / ideal", f"b={b} ctx={c}", ratio, DECODE_RATIO, True, d.get("device"))
            if ratio is not None and ratio < 1:
                rows[-1].update(met=None, note="faster than its ideal: no verdict")
            sheet = x["back_to_back_ms"] / x["ideal_ms_at_datasheet"] if x.get("ideal_ms_at_datasheet") else None
            row("decode back to back / data-sheet ideal", f"b={b} ctx={c}", sheet, None, True, d.get("device"))
    d = _load(out / "prefill.json") or {}
    cases = _by_name(d)
    for n in z["prefill"]:
        x = cases.get(f"prefill {n} (b=1, pos 0)", {})
        row("prefill model FLOPs / in-run GEMM peak", f"{n} tokens", x.get("model_flops_of_in_run_gemm_peak"),
            PREFILL_SHARE, False, d.get("device"))
    d = _load(out / "profile.json") or {}
    case = next(iter(d.get("cases", [])), {})
    tl = case.get("profile", {}).get("timeline", {})
    # the kernels against the step queued back to back, as the engine's runner issues it and as the
    # decode rows above time it
    share = tl["busy_ms"] / case["back_to_back_ms"] if tl.get("busy_ms") and case.get("back_to_back_ms") else None
    row("kernel time / back-to-back step", f"b=1 ctx={z['contexts'][0]}", share, KERNEL_SHARE, False,
        d.get("device"))
    # reported: the span of a call launched and waited for also holds the time the host's launch of
    # the step's one CUDA graph (~430 kernels) takes to hand the device the rest of it
    share = tl["busy_ms"] / tl["span_ms"] if tl.get("span_ms") else None
    row("kernel time / waited call's span", f"b=1 ctx={z['contexts'][0]}", share, None, False, d.get("device"))
    d = _load(out / "attn.json") or {}
    cases = _by_name(d)
    for t in z["attn_tokens"]:
        x = cases.get(f"attn/decode{t}/pallas[auto]", {})
        row("sparse attention", f"{t} decode tokens", x.get("tflops"), ATTN_TFLOPS, False, d.get("device"), "TFLOP/s")
    for b in z["buckets"]:
        d = _load(out / f"compile_{b}.json") or {}
        r = (d.get("rows") or [{}])[-1]
        total = r["lower_s"] + r["compile_s"] if "compile_s" in r else None
        row("compile a bucket", b, total, COMPILE_S, True, d.get("device"), "s")
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| target | case | measured | limit | met | device |", "|---|---|---|---|---|---|"]
    for r in rows:
        m = "not measured" if r["measured"] is None else f"{r['measured']:g} {r['unit']}".strip()
        lim = ("reported" if r["limit"] is None
               else f"{'<=' if r['at_most'] else '>='} {r['limit']:g} {r['unit']}".strip())
        met = {True: "yes", False: "**no**", None: "-"}[r["met"]]
        case = f"{r['case']} ({r['note']})" if r.get("note") else r["case"]
        lines.append(f"| {r['target']} | {case} | {m} | {lim} | {met} | {r['device'] or '-'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--only", default=",".join(STAGES), help=f"stages, comma separated: {', '.join(STAGES)}; empty: run none, only read "
                    "the JSONs already in --out-dir (e.g. two calls' files copied together)")
    ap.add_argument("--config", default=None, help=f"default: {SLICE} ({TINY} with --smoke)")
    ap.add_argument("--smoke", action="store_true", help="the tiny config at toy sizes (tests the plumbing)")
    args = ap.parse_args(argv)
    stages = [s for s in args.only.split(",") if s]
    unknown = sorted(set(stages) - set(STAGES))
    if unknown:
        ap.error(f"--only: unknown stage(s) {', '.join(unknown)}; stages: {', '.join(STAGES)}")
    config = args.config or (TINY if args.smoke else SLICE)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    log = {}
    for stage in stages:
        for argv_, path in commands(stage, config, out, args.smoke):
            t0 = time.perf_counter()
            try:
                rc = subprocess.run(argv_, timeout=sizes(args.smoke)["stage_s"]).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
            log[path.name] = dict(argv=argv_[2:], rc=rc, seconds=round(time.perf_counter() - t0, 1))
            print(f"[bench_targets] {path.name}: rc {rc} in {log[path.name]['seconds']} s", flush=True)
    rows = verdict(out, args.smoke)
    md = table(rows)
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
    (out / "targets.json").write_text(json.dumps(dict(date_utc=date, config=config, runs=log, targets=rows), indent=1))
    (out / "targets.md").write_text(md + "\n")
    print(md, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
