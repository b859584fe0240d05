"""`check_reference` over the whole fixture farm, forward and through the engine, one process per
fixture in parallel (each compiles its own programs: on a many-core accelerator host the compiles
are the cost) -> one JSON line per fixture and mode.

    python -m scripts.check_farm [--farm tests/fixtures/dsv41_farm] --out FILE.jsonl [-j 12]
                                 [--timeout 300] [--modes forward,engine]

Each fixture measures its selection conditioning once and checks every mode against it (what
`check_reference` does per mode), at the default tolerance profile of the backend (GPU on a GPU).
The run's fixtures x modes are the family whose false-fail rate the rank rules' second stage holds
to FALSE_FAIL (`selection_conditioning`'s `family`; docs/MODEL.md §6.3).
A fixture that runs past --timeout keeps the modes it finished. The tests run the farm on CPU
(tests/test_check_reference_farm.py); this is for the accelerator (docs/MODEL.md §6.6).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict

FARM = os.path.join("tests", "fixtures", "dsv41_farm")
OUTPUTS = "outputs_lowest_index_ties.npz"


def check_one(folder: str, modes: list[str], out: str, family: int) -> None:
    """Every mode on one fixture, a JSON line each, written as soon as the mode is done; `family`:
    how many fixture checks the whole run makes."""
    import jax

    from v41_jax.model.numerics import Numerics
    from v41_jax.tools import check_reference as cr
    from v41_jax.tools.engine_replay import run_engine

    fx, numerics = cr.load_fixture(folder), Numerics.reference()
    t = time.perf_counter()
    cond = cr.selection_conditioning(fx, numerics, cr.CONDITIONING_RUNS, family=family)
    cond_seconds = round(time.perf_counter() - t, 1)  # a second stage's draws count in its mode's seconds
    tol = cr.default_tolerance()
    for mode in modes:
        t = time.perf_counter()
        checks = cr.check_folder(fx, numerics, tol, run_engine if mode == "engine" else None, cond)
        row = {"fixture": os.path.basename(folder.rstrip("/")), "mode": mode, "device": str(jax.devices()[0]),
               "tolerance": asdict(tol), "seconds": round(time.perf_counter() - t, 1),
               "passed": all(c.passed for c in checks), "checks": [asdict(c) for c in checks],
               "conditioning_seconds": cond_seconds, "conditioning": cr._jsonable(cond)}
        with open(out, "a") as f:
            f.write(json.dumps(row, default=float) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--farm", default=FARM)
    ap.add_argument("--out", required=True)
    ap.add_argument("-j", "--jobs", type=int, default=12)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per fixture")
    ap.add_argument("--modes", default="forward,engine")
    ap.add_argument("--fixture", help=argparse.SUPPRESS)  # the per-fixture child process ...
    ap.add_argument("--family", type=int, default=1, help=argparse.SUPPRESS)  # ... and its run's checks
    args = ap.parse_args(argv)
    modes = args.modes.split(",")
    if not set(modes) <= {"forward", "engine"}:
        ap.error(f"--modes: forward and/or engine, got {args.modes!r}")
    if args.fixture:
        check_one(args.fixture, modes, args.out, args.family)
        return 0
    names = sorted(n for n in os.listdir(args.farm) if os.path.exists(os.path.join(args.farm, n, OUTPUTS)))
    tmp = tempfile.mkdtemp(prefix="check_farm_")

    def child(name: str) -> tuple[str, str]:
        part = os.path.join(tmp, name + ".jsonl")
        cmd = [sys.executable, "-m", "scripts.check_farm", "--fixture", os.path.join(args.farm, name),
               "--out", part, "--modes", args.modes, "--family", str(len(names) * len(modes))]
        with open(os.path.join(tmp, name + ".err"), "w") as err:
            try:
                # the processes share one accelerator: each taking 75 % of its memory up front would not fit
                rc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=err, timeout=args.timeout,
                                    env={**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}).returncode
                return name, f"rc={rc}"
            except subprocess.TimeoutExpired:
                return name, f"timed out after {args.timeout:.0f} s"

    with ThreadPoolExecutor(args.jobs) as pool:
        statuses = list(pool.map(child, names))
    ok = True
    with open(args.out, "w") as out:
        for name, status in statuses:
            part = os.path.join(tmp, name + ".jsonl")
            rows = [json.loads(line) for line in open(part)] if os.path.exists(part) else []
            for row in rows:
                out.write(json.dumps(row) + "\n")
            done = {r["mode"]: r for r in rows}
            summary = " ".join(f"{m} {'PASS' if done[m]['passed'] else 'FAIL'} {done[m]['seconds']} s" if m in done
                               else f"{m} not run" for m in modes)
            failed = sorted({c["key"] for r in rows for c in r["checks"] if not c["passed"]})
            second = sorted({f"{r['mode']} {c['key']}" for r in rows for c in r["checks"]
                             if c["stats"].get("stage") == 2})
            print(f"{name:36s} {status:22s} {summary}" + (f"  failed: {', '.join(failed)}" if failed else "")
                  + (f"  decided by stage 2: {', '.join(second)}" if second else ""))
            if status != "rc=0":  # say why
                print("    " + "".join(open(os.path.join(tmp, name + ".err")).readlines()[-5:]).replace("\n", "\n    "))
            ok = ok and len(done) == len(modes) and all(r["passed"] for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
