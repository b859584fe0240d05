"""How a pipelined step's fresh inputs should cross to the device: a synthetic ~4 ms step (the
bench slice's batch-1 decode) launched back to back, each launch with a new small int32 input, as
the engine loop does.

Ways to send the input, timed in the same run:
* `resident`: the same input every step, already on the device (the floor: no transfer at all);
* `device`:   `jax.device_put` to device memory, then the launch (the engine's way today);
* `pinned`:   `jax.device_put` to the device's pinned host memory, and the step copies it to
              device memory itself (in stream order, inside the executable);
* `mailbox`:  `jax.device_put` to device memory, then a small donated update writes it into a
              buffer whose address never changes, which the step reads.

With `--command-buffers` the step is compiled as the engine compiles it (XLA command buffers:
CUDA graphs), and `--kernels` small kernels each read the input, as the step's unpacked batch
leaves are read by every layer: a command buffer whose argument moved must be updated before it
runs, and an argument that stays put (resident, mailbox) needs no update.

The question (BENCHMARKS.md, issue 12): the engine's launch with freshly sent inputs took
1.8-3.1 ms against 0.5-1.0 ms on resident ones, and a sent batch became ready only after the
running step ended. If a transfer into device memory waits for the step in flight, a put to
pinned host memory (a host copy) cannot, and the step's own copy is in stream order anyway.

    python -m scripts.bench_send --out benchmarks/send.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import SingleDeviceSharding


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300, help="timed launches per way")
    ap.add_argument("--dim", type=int, default=4096, help="the synthetic step's square matmul size")
    ap.add_argument("--depth", type=int, default=20, help="matmuls per step (sets the step's time)")
    ap.add_argument("--words", type=int, default=2048, help="int32 words sent per step")
    ap.add_argument("--kernels", type=int, default=0, help="small kernels that each read the input")
    ap.add_argument("--command-buffers", action="store_true", help="compile with the engine's XLA options")
    ap.add_argument("--out", help="write the JSON here")
    args = ap.parse_args(argv)

    dev = jax.devices()[0]
    kinds = {m.kind for m in dev.addressable_memories()}
    on_device = SingleDeviceSharding(dev, memory_kind="device" if "device" in kinds else None)

    def body(w, y, words):
        words = jax.device_put(words, on_device)        # a no-op when the input is on the device already
        y = y + (words[:1].astype(y.dtype) * 0)         # the step depends on its input
        for _ in range(args.depth):
            y = jnp.tanh(y @ w)
        acc = jnp.zeros((), jnp.int32)
        for k in range(args.kernels):                   # small kernels, each reading the input
            acc = jax.lax.optimization_barrier(acc + words[k % args.words] * k)
        return y, words.sum() + acc

    from v41_jax.runtime import compile_cache

    options = compile_cache.compiler_options() if args.command_buffers else {}
    jitted = jax.jit(body, donate_argnums=(1,))
    compiled = {}

    def step(w, y, x):
        key = (x.sharding.memory_kind if hasattr(x, "sharding") else None)
        if key not in compiled:
            compiled[key] = jitted.lower(w, y, x).compile(compiler_options=options)
        return compiled[key](w, y, x)

    def _post(mail, x):
        return jax.lax.dynamic_update_slice(mail, x, (0,))
    post = jax.jit(_post, donate_argnums=(0,))
    w = jnp.full((args.dim, args.dim), 1e-3, jnp.bfloat16)
    rng = np.random.default_rng(0)
    host = [rng.integers(0, 1 << 20, args.words, dtype=np.int32) for _ in range(8)]
    ways = {"resident": None, "device": SingleDeviceSharding(dev), "mailbox": "mailbox"}
    if "pinned_host" in kinds:
        ways["pinned"] = SingleDeviceSharding(dev, memory_kind="pinned_host")

    report = {"device": dev.device_kind, "platform": dev.platform, "jax": jax.__version__,
              "host": platform.node(), "date": time.strftime("%Y-%m-%d"), "args": vars(args), "ways": {}}
    for name, sharding in ways.items():
        resident = jax.device_put(host[0], ways["device"])
        if sharding is None:
            send = lambda i: resident
        elif sharding == "mailbox":
            box = [jax.device_put(host[0], ways["device"])]

            def send(i):
                box[0] = post(box[0], jax.device_put(host[i % 8], ways["device"]))
                return box[0]
        else:
            send = lambda i, sharding=sharding: jax.device_put(host[i % 8], sharding)
        y = jnp.zeros((args.dim, args.dim), jnp.bfloat16)
        for x in (lambda: send(0), lambda: send(1), lambda: resident):   # compile both input placements
            y, s = step(w, y, x())
        jax.block_until_ready(y)
        # the step alone, back to back on one resident input
        t = time.perf_counter()
        for i in range(args.steps):
            y, s = step(w, y, resident)
        jax.block_until_ready(y)
        alone = (time.perf_counter() - t) / args.steps
        # the loop: send, launch, then read the previous step's result (one step late)
        puts, launches, prev = [], [], None
        t = time.perf_counter()
        for i in range(args.steps):
            t0 = time.perf_counter()
            x = send(i)
            t1 = time.perf_counter()
            y, s = step(w, y, x)
            t2 = time.perf_counter()
            s.copy_to_host_async()
            if prev is not None:
                int(prev)
            prev = s
            puts.append(t1 - t0)
            launches.append(t2 - t1)
        int(prev)
        loop = (time.perf_counter() - t) / args.steps
        ms = lambda xs: round(1e3 * float(np.median(xs)), 3)
        report["ways"][name] = {"step_alone_ms": round(1e3 * alone, 3), "loop_ms": round(1e3 * loop, 3),
                                "overhead_pct": round(100 * (loop / alone - 1), 2),
                                "put_ms_p50": ms(puts), "launch_ms_p50": ms(launches)}
        print(name, report["ways"][name], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
