"""Measurement helpers shared by the benchmark scripts."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np


def copy_bandwidth(mib: int, reps: int = 10) -> dict:
    """The copy ceiling: fp32 `a * 2` over `mib` MiB, bytes read + written over the median time
    of `reps` calls (each waited for: one call moves GiBs, so the sync latency is noise)."""
    n = mib * (1 << 20) // 4
    a = jax.random.normal(jax.random.key(0, impl="rbg"), (n,), jnp.float32)
    f = jax.jit(lambda x: x * 2.0)
    for _ in range(3):
        jax.block_until_ready(f(a))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(f(a))
        ts.append(time.perf_counter() - t0)
    del a
    t = float(np.median(ts))
    return {"copy_gbs_read_plus_write": round(2 * n * 4 / t / 1e9, 1), "copy_bytes": 2 * n * 4,
            "copy_ms": round(t * 1e3, 4)}
