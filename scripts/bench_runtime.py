"""Host overhead of the engine loop, and what a second start costs.

    python -m scripts.bench_runtime --config v41_jax/configs/bench_slice.config.json \
        --batches 1,8,32,64 --prompt 16 --new 48 --out R.json [--compile-cache DIR]

One engine (random weights on the device, as scripts/bench_step.py draws them; host Engram
tables) with one decode bucket per batch and one prefill bucket. Per batch b, three figures of a
decode step in the same bucket, measured in the same process:

* `generate`: a real `Engine.generate` of b requests (prompt `--prompt` tokens, `--new` new
  tokens, greedy, EOS ignored); the time per step over the steady decode phase (every request
  decoding, the b-row bucket), i.e. the period of the pipelined loop;
* `alone`: the same compiled executable called back to back on a decode batch of b requests with
  its inputs already on the device (no host work at all): the device's own step time;
* `steps_reusing_batch`: steps launched on the batch already on the device (steady decoding,
  `Runner.steady`: nothing built or sent), of `steps_prepared`;
* `sync`: the loop the engine had before the Scheduler/Runner split, rebuilt from the same
  pieces: per step a blocking read of the cursors, the batch built on the host, the step, and a
  blocking read of its tokens before the next step is built.

overhead = generate / alone - 1 (the issue's target: <= 5 %); sync / alone - 1 beside it.
`--profile N`: the device's kernel time per step of the same executable (N calls traced,
`bench_common.kernel_profile`) over the `generate` period: the share of the engine's step the
kernels fill (issue 16's >= 90 %).
Also: warm-up seconds and XLA compilations of this start (run it twice with one --compile-cache
folder: the second start's figures are the compile-once result).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time

import jax
import numpy as np

from scripts.bench_common import back_to_back_s, kernel_profile, timed_calls
from scripts.bench_step import engram_token_map, param_leaf_specs, random_params
from v41_jax.cache.geometry import EngineSettings, row_formats
from v41_jax.config import ModelConfig
from v41_jax.runtime import compile_cache
from v41_jax.runtime.engine import NUMERICS, Engine
from v41_jax.runtime.metadata import Bucket, BucketSet, build_step
from v41_jax.runtime.request import Request


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True, help="config.json of the model (random weights)")
    ap.add_argument("--batches", default="1,8,32,64", help="decode batch sizes, comma separated")
    ap.add_argument("--measure", default=None,
                    help="batch sizes to measure (default: all of --batches; the buckets always follow --batches, "
                         "so a second start with a subset loads the first start's executables)")
    ap.add_argument("--prompt", type=int, default=16, help="prompt tokens per request")
    ap.add_argument("--new", type=int, default=48, help="new tokens per request")
    ap.add_argument("--iters", type=int, default=30, help="calls of the alone / sync loops")
    ap.add_argument("--numerics", choices=sorted(NUMERICS), default="fast")
    ap.add_argument("--experts", default="auto", help="held expert format (auto: fp8 on a GPU, bf16 on CPU)")
    ap.add_argument("--page-tokens", type=int, default=16)
    ap.add_argument("--compile-cache", default=None, help="compile cache folder ('' off; default as the engine)")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="trace N calls of each decode executable: kernel time per step over the generate period")
    ap.add_argument("--out", required=True, help="JSON results")
    return ap.parse_args(argv)


def _per_step(fn, iters: int) -> float:
    fn()                                                  # one untimed call
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t) / iters


def main(argv=None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    compile_cache.enable(args.compile_cache)
    cfg = ModelConfig.from_file(args.config)
    batches = sorted(int(b) for b in args.batches.split(","))
    numerics = NUMERICS[args.numerics]()
    context = -(-(args.prompt + args.new + 1) // args.page_tokens) * args.page_tokens
    r_max = max(batches)
    buckets = BucketSet(tuple(Bucket(b, b, b) for b in batches) + (Bucket(args.prompt * r_max, r_max, r_max),))
    settings = EngineSettings(page_tokens=args.page_tokens, num_pages=r_max * context // args.page_tokens + 1,
                              slots=r_max, max_context=context, **row_formats(numerics))
    params = random_params(cfg, 0, param_leaf_specs(cfg, args.experts))
    jax.block_until_ready(params)
    token_map = np.asarray(engram_token_map(cfg)) if cfg.engram_layer_ids else None
    engine = Engine(params, cfg, settings=settings, buckets=buckets, numerics=numerics, token_map=token_map,
                    prefill_chunk=args.prompt * r_max)
    c0 = compile_cache.CompileMeter.xla_compiles()
    t = time.perf_counter()
    engine.warmup()
    warmup_s = time.perf_counter() - t
    rows = []
    rng = np.random.default_rng(0)
    measured = batches if args.measure is None else sorted(int(b) for b in args.measure.split(","))
    for b in measured:
        engine.reset()
        reqs = [Request(rng.integers(3, cfg.vocab_size - 1, args.prompt).tolist(), args.new, ignore_eos=True,
                        request_id=i) for i in range(b)]
        for r in reqs:
            engine.add(r)
        phases: dict = {}                                 # host ms per call of each phase of a step
        for obj, names in ((engine.runner, ("prepare", "collect", "dispatch", "_launch")),
                           (engine.scheduler, ("schedule", "update"))):
            for name in names:
                timed_calls(obj, name, phases)
        reused = []                                       # per prepare: the batch on the device served again
        steady = engine.runner.steady

        def counted(plan):
            prep = steady(plan)
            reused.append(prep is not None)
            return prep
        engine.runner.steady = counted
        marks = []                                        # (time, the step just launched is a full decode)
        while engine.has_work:
            engine.step()
            plan = engine._flight_plan
            marks.append((time.perf_counter(), plan is not None and len(plan.spans) == b
                          and all(sp.length == 1 for sp in plan.spans)))
        steady = [t for t, full in marks if full][2:-2]   # drop the hand-over from prefill and the tail
        gen = (steady[-1] - steady[0]) / (len(steady) - 1)

        # a decode batch of the same shape for the executable alone and the synchronous loop
        sched = engine.scheduler
        pages = [sched.pages.allocate(context // args.page_tokens) for _ in range(b)]
        pos = args.prompt + args.new // 2
        toks = [rng.integers(3, cfg.vocab_size - 1, pos + 1).tolist() for _ in range(b)]
        runner = engine.runner

        def spans():
            return [runner.span(i, i, pos, toks[i][pos:pos + 1], pages[i], runner.cursor_row(toks[i], pos))
                    for i in range(b)]

        bucket = Bucket(b, b, b)
        fn = runner.compiled[bucket]
        dev_batch = runner.send(bucket, build_step(engine.geom, cfg, bucket, spans()).batch)

        for name in ("prepare", "collect", "dispatch", "_launch", "steady"):
            del runner.__dict__[name]                     # unwrap

        calls = []

        def alone():
            t = time.perf_counter()
            out = fn(engine.params, runner.cache, dev_batch)
            calls.append(time.perf_counter() - t)
            runner.cache = out.cache
        alone_s = back_to_back_s(alone, lambda: runner.cache, args.iters)

        host_batch = build_step(engine.geom, cfg, bucket, spans()).batch
        fresh_calls = []

        def alone_fresh():                                # inputs transferred just before the call
            batch = runner.send(bucket, host_batch)
            t = time.perf_counter()
            out = fn(engine.params, runner.cache, batch)
            fresh_calls.append(time.perf_counter() - t)
            runner.cache = out.cache
        fresh_s = _per_step(alone_fresh, args.iters)

        def sync():
            np.asarray(runner.cache.cursor)               # the blocking cursor probe
            built = build_step(engine.geom, cfg, bucket, spans())
            out = fn(engine.params, runner.cache, runner.send(bucket, built.batch))
            runner.cache = out.cache
            np.asarray(out.tokens)                        # tokens on the host before the next step
        sync_s = _per_step(sync, args.iters)
        row = {"batch": b, "bucket": f"{b}x{b}x{b}", "generate_ms": gen * 1e3, "alone_ms": alone_s * 1e3,
               "sync_ms": sync_s * 1e3, "overhead": gen / alone_s - 1, "sync_overhead": sync_s / alone_s - 1,
               "steady_steps": len(steady), "alone_call_return_ms": float(np.median(calls[1:]) * 1e3),
               "alone_fresh_inputs_ms": fresh_s * 1e3,
               "alone_fresh_call_return_ms": float(np.median(fresh_calls[1:]) * 1e3),
               "host_ms_median": {k: float(np.median(v) * 1e3) for k, v in phases.items()},
               "steps_reusing_batch": int(sum(reused)), "steps_prepared": len(reused)}
        if args.profile:
            def traced():
                alone()
                jax.block_until_ready(runner.cache)
            prof = kernel_profile(traced, args.profile, top=15)
            row["profile"] = prof
            if "device_ms_per_call" in prof:
                row["kernel_ms_per_step"] = prof["device_ms_per_call"]
                row["kernel_share_of_generate"] = prof["device_ms_per_call"] / row["generate_ms"]
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "profile"}), flush=True)
    out = {"config": args.config, "device": jax.devices()[0].device_kind, "jax": jax.__version__,
           "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S"),
           "args": vars(args), "warmup_s": warmup_s, "xla_compiles_warmup_and_run":
           compile_cache.CompileMeter.xla_compiles() - c0, "process_s": time.perf_counter() - start, "rows": rows}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"warm-up {warmup_s:.1f} s, XLA compilations {out['xla_compiles_warmup_and_run']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
