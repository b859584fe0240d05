"""The step on a one-device mesh against the plain one-device step (issue 17's "a one-device mesh
costs <= 2 % over today's unsharded step on the bench slice").

Two engines over the same random params (`bench_step.random_params`, the loader's layout) and the
same synthetic cache (`bench_step.randomize_cache`, the same key): `Engine(...)` and
`Engine(..., mesh=make_mesh(1))` (MeshRunner: the step under `shard_map` on a mesh of one
device, its batch stacked on a rank axis, jitted with explicit shardings; a mesh of one splits no
experts). Each compiles its buckets as the engine does (`runner.warmup()`), then the same decode
spans (request i: slot i, its own pages, position context - 1, as bench_step) are launched through
each runner's `_launch` with the batch already on the device, in alternating rounds of `--iters`
calls (block_until_ready on the tokens and the cache each): median and min per engine, and the
ratio mesh / plain. The first call's tokens are compared (the same step: equal).

    python -m scripts.bench_mesh --config v41_jax/configs/bench_slice.config.json --out M.json
        [--batches 1,32] [--context 8192] [--iters 20] [--rounds 4] [--total-s 110]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from scripts.bench_step import NUMERICS, decode_cursors, param_leaf_specs, random_params, randomize_cache
from scripts.make_checkpoint import engram_token_map
from v41_jax.cache.geometry import EngineSettings, row_formats
from v41_jax.checkpoint.load import EXPERT_HOLDS
from v41_jax.config import ModelConfig
from v41_jax.runtime.engine import Engine
from v41_jax.runtime.mesh import AXIS, make_mesh
from v41_jax.runtime.metadata import Bucket, BucketSet, build_step


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--page-tokens", type=int, default=256)
    ap.add_argument("--numerics", choices=sorted(NUMERICS), default="fast")
    ap.add_argument("--experts", choices=EXPERT_HOLDS, default="auto")
    ap.add_argument("--total-s", type=float, default=110.0, help="end the process here (JSON kept)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    cfg = ModelConfig.from_file(args.config)
    numerics = NUMERICS[args.numerics]()
    batches = sorted({int(b) for b in args.batches.split(",")})
    page = args.page_tokens
    per_req = -(-args.context // page)
    settings = EngineSettings(page_tokens=page, num_pages=1 + max(batches) * per_req, slots=max(batches),
                              max_context=per_req * page, **row_formats(numerics))
    report = {"config": args.config, "device": jax.devices()[0].device_kind, "jax": jax.__version__,
              "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S"),
              "args": vars(args), "cases": []}

    def save():
        with open(args.out + ".tmp", "w") as f:
            json.dump(report, f, indent=1, default=str)
        os.replace(args.out + ".tmp", args.out)

    def abort():
        report["aborted"] = f"--total-s {args.total_s} reached"
        save()
        os._exit(3)
    watchdog = threading.Timer(args.total_s, abort)
    watchdog.daemon = True
    watchdog.start()

    params = random_params(cfg, args.seed, param_leaf_specs(cfg, args.experts))
    token_map = np.asarray(engram_token_map(cfg)) if cfg.engram_layer_ids else None
    buckets = BucketSet(tuple(Bucket(b, b, b) for b in batches))
    kw = dict(settings=settings, buckets=buckets, numerics=numerics, token_map=token_map, speculative=False)
    engines = {"plain": Engine(params, cfg, **kw), "mesh1": Engine(params, cfg, mesh=make_mesh(1), **kw)}
    t0 = time.perf_counter()
    with ThreadPoolExecutor(2) as pool:                     # both compile as the engine does
        list(pool.map(lambda e: e.runner.warmup(), engines.values()))
    report["warmup_s"] = round(time.perf_counter() - t0, 1)
    save()

    rng = np.random.default_rng(args.seed)
    pages = {name: [e.pages.allocate(per_req) for _ in range(max(batches))] for name, e in engines.items()}
    cursor = decode_cursors(rng, cfg, settings.slots, engines["plain"].geom.history,
                            args.context, max(batches))
    key = jax.random.key(args.seed + 1, impl="rbg")
    for name, e in engines.items():
        cache = randomize_cache(e.runner.cache, key, jnp.asarray(cursor))
        if name == "mesh1":
            cache = jax.device_put(cache, NamedSharding(e.runner.mesh, P(AXIS)))
        e.runner.cache = cache
    toks = rng.integers(3, cfg.vocab_size - 1, max(batches)).astype(np.int32)

    # every case's batch built before any step runs (a step moves the cursors the spans are checked
    # against; re-running a batch rewrites the same rows, as bench_step's timed loop does)
    sent = {}
    for name, e in engines.items():
        cursors = e.cursors()
        for b in batches:
            bucket = Bucket(b, b, b)
            spans = [e.make_span(f"d{i}", i, args.context - 1, toks[i:i + 1], pages[name][i], cursors[i])
                     for i in range(b)]
            if name == "plain":
                sent[b, name] = e.runner.send(bucket, build_step(e.geom, cfg, bucket, spans).batch)
            else:
                sent[b, name] = e.runner.send(bucket, [x.batch for x in e.runner.split(spans, bucket).built])
    for b in batches:
        bucket = Bucket(b, b, b)
        fresh = np.zeros(settings.slots, bool)
        first = {name: np.asarray(e.runner._launch(bucket, sent[b, name], fresh).tokens).reshape(-1)[:b]
                 for name, e in engines.items()}
        times = {name: [] for name in engines}
        for r in range(args.rounds):
            for name in (list(engines) if r % 2 == 0 else list(engines)[::-1]):
                runner = engines[name].runner
                for _ in range(args.iters):
                    t1 = time.perf_counter()
                    out = runner._launch(bucket, sent[b, name], fresh)
                    jax.block_until_ready((out.tokens, runner.cache))
                    times[name].append(time.perf_counter() - t1)
        row = {"case": f"decode b={b} ctx={args.context}",
               "tokens_equal": bool(np.array_equal(first["plain"], first["mesh1"]))}
        for name, ts in times.items():
            row[f"{name}_ms_median"] = 1e3 * float(np.median(ts))
            row[f"{name}_ms_min"] = 1e3 * float(np.min(ts))
        row["mesh1_over_plain_median"] = row["mesh1_ms_median"] / row["plain_ms_median"]
        row["mesh1_over_plain_min"] = row["mesh1_ms_min"] / row["plain_ms_min"]
        report["cases"].append(row)
        save()
        print(json.dumps(row), flush=True)
    report["total_s"] = round(time.perf_counter() - t_start, 1)
    save()
    return report


if __name__ == "__main__":
    main()
