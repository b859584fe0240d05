"""The expert-parallel MoE's work per device: every gathered pick (the previous implementation)
against this device's picks only (`model.expert_parallel.own_pairs`), on a mesh of N devices.

Each of N data-parallel ranks holds T tokens (a prefill chunk) with k picks each over E experts,
E/N per device. The previous `expert_parallel.routed_experts` ran every rank's T * k picks on every
device with weight 0 for another device's experts: N * T * k pairs per device, (N - 1) / N of them
thrown away. Now a device runs only its own picks, `round_rows(T * k, N * T * k)` pairs a round:
predicted work ratio rounds * rows / (N * T * k), 1.25 / N for large T under uniform routing
(8 devices: 0.156, 6.4x less). Both are timed in the same run, with the one-device MoE on all
N * T tokens (the same total work as all ranks of the new path together, less the 1.25 slack)
as a yardstick, and all three outputs compared (bit-equal in bf16 numerics).

On CPU the N devices share the host's cores, so a mesh step's time is the sum of all devices' work:
the previous path costs about N times the one-device MoE, the new one about 1.25 times.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m scripts.bench_expert_parallel \\
        --out benchmarks/expert_parallel_cpu.json
"""

from __future__ import annotations

import argparse
import math
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from kernels_pallas import moe as kernel_moe
from kernels_pallas.reference import add_slots
from v41_jax.model import expert_parallel as ep
from v41_jax.model.numerics import Numerics
from scripts import bench_common
from v41_jax.runtime.mesh import AXIS, make_mesh


def every_pick(x, idx, w, experts, numerics, limit, axis):
    """The previous expert-parallel MoE (before this benchmark's change): every gathered pick run
    on every device, another device's with weight 0 (clipped to this device's first or last
    expert, so the ids stay ascending), masked, reduce-scattered."""
    n_local = experts["w1"].shape[0]
    order = jnp.argsort(idx, axis=-1, stable=True)
    idx, w = jnp.take_along_axis(idx, order, -1), jnp.take_along_axis(w, order, -1)
    xs, idxs, ws = (jax.lax.all_gather(a, axis.name, tiled=True) for a in (x, idx, w))
    first = jax.lax.axis_index(axis.name) * n_local
    mine = (idxs >= first) & (idxs < first + n_local)
    pairs = kernel_moe.routed_pairs(xs, jnp.clip(idxs - first, 0, n_local - 1), jnp.where(mine, ws, 0.0),
                                    experts["w1"], experts["w3"], experts["w2"], numerics, limit)
    pairs = jnp.where(mine[..., None], pairs, jnp.zeros((), pairs.dtype))
    return add_slots(jax.lax.psum_scatter(pairs, axis.name, scatter_dimension=0, tiled=True))


def timed(fn, args, reps: int) -> tuple[float, np.ndarray]:
    """Median seconds of `reps` calls after one warm (compile) call, and the output."""
    out = jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times)), np.asarray(out)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128, help="tokens per rank (a prefill chunk)")
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--ffn", type=int, default=64)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=6)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", help="write the JSON here")
    args = ap.parse_args(argv)

    n, t, k, e = args.devices, args.tokens, args.top_k, args.experts
    numerics, limit = Numerics.fast(), 10.0
    rng = np.random.default_rng(0)
    idx = jnp.asarray(np.stack([rng.choice(e, k, replace=False) for _ in range(n * t)]), jnp.int32)
    w = jnp.asarray(rng.random((n * t, k)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((n * t, args.dim)), numerics.act_dtype)
    experts = {m: jnp.asarray(rng.standard_normal(s) * 0.1, jnp.bfloat16)
               for m, s in (("w1", (e, args.ffn, args.dim)), ("w3", (e, args.ffn, args.dim)),
                            ("w2", (e, args.dim, args.ffn)))}
    axis = ep.ExpertAxis(AXIS, n)

    def on_mesh(body):
        return jax.jit(jax.shard_map(lambda x, i, w, ex: body(x, i, w, ex, numerics, limit, axis),
                                     mesh=make_mesh(n), in_specs=(P(AXIS),) * 4, out_specs=P(AXIS),
                                     check_vma=False))

    one_s, one = timed(jax.jit(lambda x, i, w, ex: kernel_moe.routed_experts(
        x, i, w, ex["w1"], ex["w3"], ex["w2"], numerics, limit)), (x, idx, w, experts), args.reps)
    before_s, before = timed(on_mesh(every_pick), (x, idx, w, experts), args.reps)
    after_s, after = timed(on_mesh(ep.routed_experts), (x, idx, w, experts), args.reps)

    # pairs each device computes: all gathered ones before; whole rounds of its own picks after
    rows = ep.round_rows(t * k, n * t * k)
    per_device = np.bincount(np.asarray(idx).reshape(-1) // (e // n), minlength=n)
    computed = [math.ceil(c / rows) * rows for c in per_device]
    flops_pair = 3 * 2 * args.dim * args.ffn
    report = {
        "device": jax.devices()[0].device_kind, "backend": jax.default_backend(), "host": platform.node(),
        "jax": jax.__version__, "date": time.strftime("%Y-%m-%d"), "args": vars(args),
        "rows_per_round": rows, "own_picks_per_device": per_device.tolist(),
        "pairs_per_device": {"before": n * t * k, "after": computed},
        "expert_gflop_all_devices": {"one_device": n * t * k * flops_pair / 1e9,
                                     "before": n * n * t * k * flops_pair / 1e9,
                                     "after": sum(computed) * flops_pair / 1e9},
        "work_ratio_after_over_before": sum(computed) / (n * n * t * k),
        "predicted_ratio": rows / (n * t * k),
        "seconds": {"one_device": one_s, "before": before_s, "after": after_s},
        "speedup_after_over_before": before_s / after_s,
        "bit_equal": {"before": bool(np.array_equal(before, one)), "after": bool(np.array_equal(after, one))},
    }
    bench_common.print_and_save(report, args.out)
    return report


if __name__ == "__main__":
    main()
