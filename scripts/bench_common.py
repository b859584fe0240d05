"""Measurement helpers shared by the benchmark scripts."""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from v41_jax.config import ModelConfig, validate


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


# ---- where a step's device time goes ---------------------------------------------------------------

# the `name=` of every pallas_call and the `kernel_name=` of every Mosaic GPU kernel in
# kernels_pallas: their launches are reported under these names
PALLAS_KERNELS = ("sparse_latent_attn", "index_scores", "moe_gemv_gate_up", "moe_gemv_down",
                  "moe_gate_up", "moe_down", "moe_dispatch", "moe_mgpu_gate_up", "moe_mgpu_down",
                  "mhc_sinkhorn", "rms_inv")


def timed_calls(obj, name: str, acc: dict) -> None:
    """Wrap obj.name to record the host seconds of each call in acc[name] (a list)."""
    f = getattr(obj, name)

    def wrapper(*a, **kw):
        t = time.perf_counter()
        try:
            return f(*a, **kw)
        finally:
            acc.setdefault(name, []).append(time.perf_counter() - t)
    setattr(obj, name, wrapper)


def back_to_back_s(call, drained, iters: int) -> float:
    """Seconds per call of `call` run `iters` times back to back, after one untimed call, the
    device drained (`block_until_ready(drained())`) before the clock starts and before it stops."""
    call()
    jax.block_until_ready(drained())
    t = time.perf_counter()
    for _ in range(iters):
        call()
    jax.block_until_ready(drained())
    return (time.perf_counter() - t) / iters


def kernel_group(name: str) -> str:
    """A kernel's report name: the Pallas kernel it launches, else its name without the numeric
    suffix XLA gives each fusion (`loop_fusion_12` -> `loop_fusion`)."""
    for k in PALLAS_KERNELS:
        if k in name:
            return k
    return re.sub(r"([._-]?\d+)+$", "", name) or name


def _kernel_events(profile) -> tuple[dict[str, list[float]], list[str]]:
    """(report name -> [total ns, launches], the lines read). GPU: the stream lines of the device
    planes (one event per kernel launch); without a device plane (CPU), the XLA CPU client's op
    events on the host plane."""
    totals: dict[str, list[float]] = {}
    used = []

    def add(line, keep):
        used.append(line.name)
        for ev in line.events:
            if keep(ev):
                slot = totals.setdefault(kernel_group(ev.name), [0.0, 0])
                slot[0] += ev.duration_ns
                slot[1] += 1

    planes = list(profile.planes)
    for plane in planes:
        if plane.name.startswith("/device:"):
            for line in plane.lines:
                if line.name.startswith("Stream"):
                    add(line, lambda ev: ev.duration_ns > 0)
    if not used:
        for plane in planes:
            for line in plane.lines:
                if line.name.startswith("tf_XLA") and "Eigen" not in line.name:
                    add(line, lambda ev: ev.duration_ns > 0 and not ev.name.startswith(("Threadpool", "ThunkExecutor", "end:")))
    return totals, used


def _traced(run, calls: int):
    """jax.profiler's trace of `calls` calls of `run()`, read back whole (ProfileData), or None."""
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            for _ in range(calls):
                run()
        paths = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)
        return jax.profiler.ProfileData.from_file(paths[0]) if paths else None


def kernel_profile(run, calls: int, top: int = 12) -> dict:
    """Device time by kernel over `calls` calls of `run()` (launch and wait), from a jax.profiler
    trace: the total per call, the `top` kernels by time (per call: ms, launches, share) and every
    Pallas kernel's time per call. Kernel time, not wall time: gaps between launches are left out."""
    profile = _traced(run, calls)
    if profile is None:
        return {"error": "the profiler wrote no trace"}
    totals, lines = _kernel_events(profile)
    total_ns = sum(t for t, _ in totals.values())
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][0])
    per_call = lambda ns: round(ns / calls / 1e6, 4)
    return {"calls": calls, "lines": sorted(set(lines)), "device_ms_per_call": per_call(total_ns),
            "launches_per_call": sum(c for _, c in totals.values()) / calls,
            "kernels": [{"name": n, "ms_per_call": per_call(t), "launches_per_call": c / calls,
                         "share": round(t / total_ns, 4) if total_ns else 0.0} for n, (t, c) in ranked[:top]],
            "pallas_ms_per_call": {k: per_call(totals[k][0]) for k in PALLAS_KERNELS if k in totals}}


def host_events(run, calls: int, top: int = 60) -> list[dict]:
    """The host's trace events over `calls` calls of `run()` (jax.profiler), by name: ms and
    count per call, the `top` names by total time. Events nest (a launch holds its parts), so the
    totals overlap; the list shows where inside a call the host's time goes."""
    profile = _traced(run, calls)
    if profile is None:
        return [{"error": "the profiler wrote no trace"}]
    totals: dict[str, list[float]] = {}
    for plane in profile.planes:
        if plane.name.startswith("/host"):
            for line in plane.lines:
                for ev in line.events:
                    slot = totals.setdefault(ev.name, [0.0, 0])
                    slot[0] += ev.duration_ns
                    slot[1] += 1
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]
    return [{"name": n, "ms_per_call": round(t / calls / 1e6, 4), "per_call": c / calls} for n, (t, c) in ranked]


def print_and_save(report: dict, out: str | None) -> None:
    """The report on stdout, and as JSON at `out` when given."""
    print(json.dumps(report, indent=1))
    if out:
        with open(out, "w") as f:
            json.dump(report, f, indent=1)


def cut(cfg: ModelConfig, n: int) -> ModelConfig:
    """`cfg` with its first n backbone layers (and all its draft stages)."""
    keep = lambda ids: tuple(i for i in ids if i < n)
    engram = [(l, rows) for l, rows in zip(cfg.engram_layer_ids, cfg.engram_num_embeddings) if l < n]
    out = dataclasses.replace(
        cfg, n_layers=n, compress_ratios=cfg.compress_ratios[:n] + cfg.compress_ratios[cfg.n_layers:],
        kv_source_layers=keep(cfg.kv_source_layers), index_source_layers=keep(cfg.index_source_layers),
        candidate_source_layer=cfg.candidate_source_layer if cfg.candidate_source_layer < n else -1,
        engram_layer_ids=tuple(l for l, _ in engram), engram_num_embeddings=tuple(r for _, r in engram),
        dspark_target_layer_ids=keep(cfg.dspark_target_layer_ids) or (n - 1,))
    validate(out)
    return out
