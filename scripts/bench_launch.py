"""Where a decode step's wall time goes at batch 1: the host's launch of the executable, the device,
and the engine loop's own parts.

    python -m scripts.bench_launch --checkpoint models/demo --out L.json [--speculative]

`call`: the step's compiled executable (the engine's decode bucket, the inputs of its last decode
step) called with the device idle before each call: how long the call holds the host (`launch`),
when its result is ready (`synced`), and calls back to back. `loop`: `Engine.generate` of one
request with each part of `Engine.step` timed (plan, prepare, the launch inside dispatch, collect),
in ms per step, over `--rounds` runs. On 2026-12-03 (H200, demo model) the launch held the host
1.7 ms of a 2.2 ms step (BENCHMARKS.md, issue 14).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time

import jax
import numpy as np

from scripts.bench_common import host_events, timed_calls
from v41_jax.runtime.engine import Engine, Stats


def call_costs(eng: Engine, bucket, packed, n: int) -> dict:
    r, fn = eng.runner, eng.runner.compiled[bucket]
    launch, synced = [], []
    for _ in range(n):
        jax.block_until_ready(r.cache)
        t = time.perf_counter()
        out = fn(r.params, r.cache, packed)
        t1 = time.perf_counter()
        jax.block_until_ready(out.cache)
        launch.append(t1 - t)
        synced.append(time.perf_counter() - t)
        r.cache = out.cache
    t = time.perf_counter()
    for _ in range(n):
        r.cache = fn(r.params, r.cache, packed).cache
    jax.block_until_ready(r.cache)
    return {"launch_ms": float(np.median(launch)) * 1e3, "synced_ms": float(np.median(synced)) * 1e3,
            "back_to_back_ms": (time.perf_counter() - t) / n * 1e3, "param_leaves": len(jax.tree.leaves(r.params))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--speculative", action="store_true", help="a DSpark engine (else plain)")
    ap.add_argument("--prompt", default="The module provides")
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--trace", type=int, default=0,
                    help="also trace this many idle-device calls: the host's events by name, ms per call")
    ap.add_argument("--compile-cache", default=None, help="compile cache folder ('' off; default as the engine)")
    args = ap.parse_args(argv)
    eng = Engine.from_checkpoint(args.checkpoint, numerics="fast", max_batch=1,
                                 speculative=None if args.speculative else False, progress=False,
                                 compile_cache_dir=args.compile_cache)
    eng.warmup()
    launched = []
    launch = eng.runner._launch
    eng.runner._launch = lambda bucket, packed, *a, **k: (launched.append((bucket, packed)), launch(bucket, packed, *a, **k))[1]
    eng.generate([args.prompt], max_new_tokens=args.new, ignore_eos=True)      # untimed: first calls
    parts: dict = {}
    for name in ("prepare", "dispatch", "collect", "_launch"):
        timed_calls(eng.runner, name, parts)
    loop = []
    for _ in range(args.rounds):
        eng.reset()                        # a new scheduler: its methods wrapped afresh
        timed_calls(eng.scheduler, "schedule", parts)
        timed_calls(eng.scheduler, "update", parts)
        parts.clear()
        stats = Stats()
        eng.generate([args.prompt], max_new_tokens=args.new, ignore_eos=True, stats=stats)
        loop.append({"steps": stats.steps, "ms_per_step": stats.run_s / stats.steps * 1e3,
                     **{f"{k}_ms": sum(v) / stats.steps * 1e3 for k, v in parts.items()}})
        print(json.dumps(loop[-1]), flush=True)
    bucket, packed = launched[-1]
    call = call_costs(eng, bucket, packed, args.calls)
    print(json.dumps(call), flush=True)
    if args.trace:
        r, fn = eng.runner, eng.runner.compiled[bucket]

        def one():
            jax.block_until_ready(r.cache)
            r.cache = fn(r.params, r.cache, packed).cache
        call["host_events"] = host_events(one, args.trace)
        print(json.dumps(call["host_events"][:25], indent=0), flush=True)
    out = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "args": vars(args),
           "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S"),
           "bucket": repr(bucket), "loop": loop, "call": call}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
