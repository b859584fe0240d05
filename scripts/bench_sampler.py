"""The sampler alone (`runtime.sampling.sample` over [rows, vocab] fp32 logits): greedy and sampled
rows, compiled with the engine's XLA options and with CUB's radix sort put back, each timed
synchronously and back to back, with the host's trace events that show where its conditional ran.

    python -m scripts.bench_sampler --out S.json [--rows 1,8,32] [--vocab 129280]

Why: the sampler's `lax.cond` (a batch of greedy rows skips the vocabulary's sort) stays inside
the step's command buffer only if every kernel of its branches can; a CUB sort cannot, and then
XLA runs the conditional on the host, which waits for the predicate mid-step (a host event named
after the conditional, `cond.N`, and several command buffers per call; BENCHMARKS.md, 2026-12-04).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from scripts.bench_common import back_to_back_s, host_events  # noqa: E402
from v41_jax.runtime import compile_cache, sampling  # noqa: E402

# host events that tell where the conditional and the graphs ran
WATCH = ("cond", "command_buffer", "cuGraph", "Conditional", "sort")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", default="1,8,32")
    ap.add_argument("--vocab", type=int, default=129280)
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args(argv)
    engine = compile_cache.compiler_options()
    variants = {"engine": engine, "cub": {**engine, "xla_gpu_enable_cub_radix_sort": True}}
    out = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__, "vocab": args.vocab,
           "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S"),
           "variants": {k: {o: str(v) for o, v in opts.items()} for k, opts in variants.items()}, "cases": []}
    for variant, opts in variants.items():
        for r in (int(x) for x in args.rows.split(",")):
            logits = jax.random.normal(jax.random.key(0), (r, args.vocab), jnp.float32)
            k, p = jnp.zeros((r,), jnp.int32), jnp.ones((r,), jnp.float32)
            seed, pos = jnp.arange(r, dtype=jnp.uint32), jnp.arange(r, dtype=jnp.int32)
            f = jax.jit(lambda lg, t, k, p, s, pos: sampling.sample(lg * 1.0001, t, k, p, s, pos))
            compiled = f.lower(logits, k.astype(jnp.float32), k, p, seed, pos).compile(compiler_options=opts)
            for temp in (0.0, 1.0):
                t = jnp.full((r,), temp, jnp.float32)
                run = lambda: compiled(logits, t, k, p, seed, pos)   # noqa: E731
                jax.block_until_ready(run())
                ts = []
                for _ in range(args.iters):
                    t0 = time.perf_counter()
                    jax.block_until_ready(run())
                    ts.append(time.perf_counter() - t0)
                b2b = back_to_back_s(run, run, 50)
                events = host_events(lambda: jax.block_until_ready(run()), 3)
                row = {"variant": variant, "rows": r, "temperature": temp,
                       "sync_ms": round(float(np.median(ts)) * 1e3, 4), "back_to_back_ms": round(b2b * 1e3, 4),
                       "host_events": {e["name"]: e["ms_per_call"] for e in events
                                       if any(w in e["name"] for w in WATCH)}}
                out["cases"].append(row)
                print(json.dumps(row)[:400], flush=True)
                Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
