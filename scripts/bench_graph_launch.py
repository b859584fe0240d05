"""What a CUDA graph costs the host to launch, by how many kernels it holds, straight-line and as a
while loop, compiled with the engine's XLA options (one command buffer a call).

    python -m scripts.bench_graph_launch --out G.json [--kernels 50,200,400,800]

Why: a waited decode step at batch 1 spends ~0.9 ms in `cuGraphLaunch` for its ~430 kernels, and
freeing the previous outputs (no command-buffer update) does not shorten it (BENCHMARKS.md i1).
A program of n dependent reduce-then-add pairs (2n tiny kernels) is timed waited (each call
`block_until_ready`, its output freed) and back to back (each call's output kept until the next
returns, as the engine does, so the command buffer is updated every call). Back to back, a
straight-line program this small is bound by the host's launch (update included): ms per call
over kernels is the launch cost a kernel; waited, launch and execution overlap. The same pairs as a
`fori_loop` body (trip count n) show what a loop costs instead: one body graph, launched once, and a
conditional node per trip — what laying the layer stack out as `lax.scan` would buy. Kernels a
call, from the profiler, confirm the 2n.
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
from scripts.bench_common import back_to_back_s, host_events, kernel_profile  # noqa: E402
from v41_jax.runtime.compile_cache import compiler_options  # noqa: E402

# the host events that tell a graph's update from its launch
GRAPH_EVENTS = ("cuGraphLaunch", "command_buffer")


def pair(x: jax.Array) -> jax.Array:
    """A column reduction, then a broadcast add that needs it: two kernels XLA cannot fuse."""
    return x * 0.999 + jnp.cumsum(x, axis=0)[-1:] * 1e-6


def straight(x: jax.Array, n: int) -> jax.Array:
    for _ in range(n):
        x = pair(x)
    return x


def looped(x: jax.Array, n: int) -> jax.Array:
    return jax.lax.fori_loop(0, n, lambda _, y: pair(y), x)


def measure(fn, x: jax.Array, n: int, iters: int) -> dict:
    compiled = jax.jit(fn, static_argnums=1).lower(x, n).compile(compiler_options=compiler_options())
    call = lambda: compiled(x)
    for _ in range(3):
        jax.block_until_ready(call())
    waited = []
    for _ in range(iters):
        t = time.perf_counter()
        jax.block_until_ready(call())
        waited.append(time.perf_counter() - t)
    out = [None]
    b2b = back_to_back_s(lambda: out.__setitem__(0, call()), lambda: out[0], iters)
    events = host_events(lambda: jax.block_until_ready(call()), 5)
    launches = kernel_profile(lambda: jax.block_until_ready(call()), 3, top=0).get("launches_per_call")
    return {"pairs": n, "kernels_per_call": launches, "waited_ms": 1e3 * float(np.median(waited)),
            "back_to_back_ms": 1e3 * b2b,
            "host_events": {e["name"]: {"ms_per_call": e["ms_per_call"], "per_call": e["per_call"]}
                            for e in events if any(s in e["name"] for s in GRAPH_EVENTS)}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--kernels", default="50,200,400,800", help="kernels a straight-line program holds")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--shape", default="256,1024", help="the fp32 array each kernel reads")
    args = ap.parse_args(argv)
    try:
        sizes = [int(k) // 2 for k in args.kernels.split(",")]
        shape = tuple(int(s) for s in args.shape.split(","))
    except ValueError:
        ap.error(f"--kernels / --shape: comma-separated integers (got {args.kernels!r} / {args.shape!r})")
    x = jnp.ones(shape, jnp.float32)
    res = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
           "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "options": {k: str(v) for k, v in compiler_options().items()}, "cases": []}
    for kind, fn in (("straight", straight), ("loop", looped)):
        for n in sizes:
            row = {"kind": kind, **measure(fn, x, n, args.iters)}
            res["cases"].append(row)
            print(json.dumps(row), flush=True)
            Path(args.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
