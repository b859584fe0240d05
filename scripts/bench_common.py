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
from v41_jax.linear import lin_f32


def copy_bandwidth(mib: int, reps: int = 10) -> dict:
    """The memory ceiling, three ways over `mib` MiB, each timed by `queued_median_s` (`reps` calls
    queued a round: a call waited for alone paid 0.15-0.2 ms of sync latency on an H100's host,
    13 % of a 4 GiB GEMV, BENCHMARKS.md r): a copy of fp32 (`a * 2`, bytes read +
    written), a read (row sums of fp32 [n / 4096, 4096], the 1/4096 written left out), and a
    one-row GEMV (`lin_f32`, the LM head's product: x [1, 4096] bf16 against a bf16 weight of
    `mib` MiB, rows of 4,096), the read a decode step is made of. `ceiling_gbs`, the largest, is
    the one an ideal time divides by: a step must not outrun its ideal (a copy probe of 2,443 GB/s
    was outrun by up to 5 %, BENCHMARKS.md k), and the step's own LM head streamed 4.65 TB/s on
    the H200 whose copy and row-sum probes read 3.58-3.70 (BENCHMARKS.md q)."""
    n = mib * (1 << 20) // 4
    a = jax.random.normal(jax.random.key(0, impl="rbg"), (n,), jnp.float32)

    t_copy = queued_median_s(jax.jit(lambda x: x * 2.0), a, reps=reps)
    # n: MiB of fp32, so 4096 | n
    t_read = queued_median_s(jax.jit(lambda x: x.reshape(-1, 4096).sum(axis=1)), a, reps=reps)
    del a
    w = jax.random.normal(jax.random.key(1, impl="rbg"), (2 * n // 4096, 4096), jnp.bfloat16)
    t_gemv = queued_median_s(jax.jit(lin_f32), jnp.ones((1, 4096), jnp.bfloat16), w, reps=reps)
    del w
    copy_gbs, read_gbs, gemv_gbs = 2 * n * 4 / t_copy / 1e9, n * 4 / t_read / 1e9, n * 4 / t_gemv / 1e9
    return {"copy_gbs_read_plus_write": round(copy_gbs, 1), "copy_bytes": 2 * n * 4,
            "copy_ms": round(t_copy * 1e3, 4), "read_gbs": round(read_gbs, 1),
            "read_ms": round(t_read * 1e3, 4), "gemv_gbs": round(gemv_gbs, 1), "gemv_ms": round(t_gemv * 1e3, 4),
            "ceiling_gbs": round(max(copy_gbs, read_gbs, gemv_gbs), 1)}


def queued_median_s(fn, *args, reps: int = 10, rounds: int = 5) -> float:
    """Median seconds of one call of `fn(*args)`, device-bound: two calls to warm up, then each
    round queues `reps` calls and waits once, so the host's dispatch overlaps the device's work
    and the per-call sync latency (tens of microseconds, the size of a decode kernel) is paid once
    a round instead of once a call."""
    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(reps):
            out = fn(*args)
        jax.block_until_ready(out)
        ts.append((time.perf_counter() - t0) / reps)
    return float(np.median(ts))


def gemm_peak(n: int, reps: int = 10) -> dict:
    """The GEMM ceiling: a bf16 [n, n] @ [n, n] through `jnp.dot`, 2 n^3 FLOPs a call, timed by
    `queued_median_s` after 20 calls to let the clocks ramp up."""
    x = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    y = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    mm = jax.jit(lambda a, c: jnp.dot(a, c))
    for _ in range(20):
        jax.block_until_ready(mm(x, y))
    t = queued_median_s(mm, x, y, reps=reps)
    return {"bf16_gemm_tflops": 2 * n ** 3 / t / 1e12, "gemm_n": n, "gemm_ms": t * 1e3}


# ---- where a kernel comes from: the optimized HLO's instructions by the model function that traced them ----

KERNEL_OPS = re.compile(r" (fusion|custom-call|sort|scatter|gather|dot|reduce|convolution)\(")
HELPERS = ("v41_jax/numerics.py", "v41_jax/linear.py", "v41_jax/quant.py", "<string>")   # attributed to their caller


def _table(text: str, name: str) -> list[str]:
    part = text.split(f"\n{name}\n", 1)
    return part[1].split("\n\n", 1)[0].splitlines() if len(part) == 2 else []


def _frames(text: str) -> tuple[dict, dict]:
    """(stack frame id -> (file, function), -> parent frame id) from the module's source tables."""
    ids = lambda rows: {int(r.split()[0]): r.split(None, 1)[1].strip('"') for r in rows}
    files, funcs = ids(_table(text, "FileNames")), ids(_table(text, "FunctionNames"))
    loc = {int(m[1]): (files[int(m[2])], funcs[int(m[3])]) for m in
           (re.match(r"(\d+) \{file_name_id=(\d+) function_name_id=(\d+)", r) for r in _table(text, "FileLocations"))}
    where, parent = {}, {}
    for m in (re.match(r"(\d+) \{file_location_id=(\d+) parent_frame_id=(\d+)", r) for r in _table(text, "StackFrames")):
        where[int(m[1])], parent[int(m[1])] = loc[int(m[2])], int(m[3]) - 1   # printed: 1 + parent id, 0 = none
    return where, parent


def source_owner(text: str):
    """frame id -> "folder/file.py:function", the innermost model function of that stack frame
    (the numerics / linear / quant helpers count for their caller)."""
    where, parent = _frames(text)

    def owner(frame: int) -> str:
        seen = []
        while frame in where:
            f, fn = where[frame]
            seen.append(f"{'/'.join(f.split('/')[-2:])}:{fn}")
            if not f.endswith(HELPERS):
                return seen[-1]
            frame = parent[frame]
        return seen[0] if seen else "?"
    return owner


def hlo_computations(text: str) -> dict[str, list[str]]:
    """An HLO module's text -> computation name -> its instruction lines."""
    comps, cur = {}, None
    for line in text.splitlines():
        m = re.match(r"^(?:ENTRY )?%(\S+) ", line)
        if m and line.rstrip().endswith("{"):
            cur = comps.setdefault(m[1], [])
        elif cur is not None and line.startswith("  "):
            cur.append(line)
    return comps


def applied_computations(comps: dict[str, list[str]]) -> set[str]:
    """The computations an instruction calls (a fusion's body, a reducer, a loop's condition):
    their instructions are not kernels of their own."""
    return {c for lines in comps.values() for line in lines
            for c in re.findall(r"(?:calls|to_apply|condition)=%([\w.\-]+)", line)}


def kernel_sources(text: str) -> dict[str, str]:
    """Every kernel instruction of an optimized HLO module (a loop body's too) by the
    name its launches carry in a GPU trace (the instruction's name, '.' and '-' as '_') -> its
    source (`source_owner`)."""
    owner = source_owner(text)
    comps = hlo_computations(text)
    applied = applied_computations(comps)
    out = {}
    for name, lines in comps.items():
        if name in applied:
            continue                                  # fused, reducer and condition computations
        for line in lines:
            m = re.match(r"\s+(?:ROOT )?%([\w.\-]+) = ", line)
            if m and KERNEL_OPS.search(line):
                frame = re.search(r"stack_frame_id=(\d+)", line)
                out[re.sub(r"[.\-]", "_", m[1])] = owner(int(frame[1])) if frame else "?"
    return out


def time_by_source(instances: dict[str, list[float]], sources: dict[str, str], calls: int,
                   top: int = 30) -> list[dict]:
    """A profile's kernel instances (trace name -> [total ns, launches]) summed by the source
    of their HLO instruction (`kernel_sources`; a Pallas or library kernel, whose trace name is
    not an instruction's, stays under its own report name): ms and launches per call, the kernel
    kinds and each kind's [ms, launches] per call, largest first."""
    source = lambda name: sources.get(name) or sources.get(re.sub(r"[.\-]", "_", name)) or f"[{kernel_group(name)}]"
    by = _sum_by(instances, source)
    parts = _sum_by(instances, lambda name: (source(name), kernel_group(name)))
    ranked = sorted(by.items(), key=lambda kv: -kv[1][0])[:top]
    per_call = lambda ns, n: [round(ns / calls / 1e6, 4), n / calls]
    rows = []
    for s, (ns, n) in ranked:
        by_kind = {k: per_call(*parts[src, k]) for src, k in sorted(parts) if src == s}
        ms, launches = per_call(ns, n)
        rows.append({"source": s, "ms_per_call": ms, "launches_per_call": launches,
                     "kinds": list(by_kind), "by_kind": by_kind})
    return rows


def _sum_by(instances: dict[str, list[float]], key) -> dict:
    """Kernel instances (trace name -> [total ns, launches]) summed by key(name)."""
    out: dict[str, list[float]] = {}
    for name, (ns, n) in instances.items():
        slot = out.setdefault(key(name), [0.0, 0])
        slot[0] += ns
        slot[1] += n
    return out


# ---- where a step's device time goes ---------------------------------------------------------------

# the `name=` of every pallas_call and the `kernel_name=` of every Mosaic GPU kernel in
# kernels_pallas: their launches are reported under these names
PALLAS_KERNELS = ("sparse_latent_attn", "index_scores", "moe_gemv_gate_up", "moe_gemv_down",
                  "moe_gate_up", "moe_down", "moe_dispatch", "moe_mgpu_gate_up", "moe_mgpu_down",
                  "mhc_sinkhorn", "rms_inv", "rope_in_place", "hc_expand")


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


def _kernel_events(profile) -> tuple[dict[str, list[float]], list[str], list[tuple]]:
    """(trace name -> [total ns, launches], the lines read, every event as (start ns, end ns,
    report name)). GPU: the stream lines of the device planes (one event per kernel launch);
    without a device plane (CPU), the XLA CPU client's op events on the host plane."""
    totals: dict[str, list[float]] = {}
    used, spans = [], []

    def add(line, keep):
        used.append(line.name)
        for ev in line.events:
            if keep(ev):
                slot = totals.setdefault(ev.name, [0.0, 0])
                slot[0] += ev.duration_ns
                slot[1] += 1
                spans.append((ev.start_ns, ev.start_ns + ev.duration_ns, kernel_group(ev.name)))

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
    return totals, used, spans


# the host's pause between traced calls: longer than any gap inside one call, so the device
# timeline splits into calls at the gaps longer than half of it
CALL_PAUSE_S = 0.01


GAP_EDGES_US = (2.0, 5.0, 20.0, 100.0)


def device_timeline(spans: list[tuple], calls: int, top: int = 12) -> dict:
    """Where a call's device span is idle: the events split into calls at gaps longer than half of
    CALL_PAUSE_S; per call (medians) the span from the first kernel's start to the last one's end,
    the time some kernel runs (the union of the events: streams may overlap) and the idle rest;
    the idle gaps by length (counts and ms per call in the bins of GAP_EDGES_US) and the `top`
    longest gaps with the kernels on either side (all calls)."""
    spans = sorted(spans)
    groups, end = [], None
    for ev in spans:
        if end is None or ev[0] - end > CALL_PAUSE_S * 0.5e9:
            groups.append([])
        groups[-1].append(ev)
        end = ev[1] if end is None else max(end, ev[1])
    per_call, gaps = [], []
    for g in groups:
        busy, last, prev = 0, g[0][0], g[0]
        for ev in g:
            if ev[0] > last:
                gaps.append((ev[0] - last, prev[2], ev[2]))
                busy += ev[1] - ev[0]
            else:
                busy += max(0, ev[1] - last)
            if ev[1] >= last:
                last, prev = ev[1], ev
        per_call.append((last - g[0][0], busy))
    if not groups:           # no kernel events (XLA:CPU): nothing ran on a device
        return {"calls_found": 0, "calls": calls}
    ms = lambda ns: round(ns / 1e6, 4)
    edges = (0.0,) + GAP_EDGES_US + (float("inf"),)
    bins = []
    for lo, hi in zip(edges, edges[1:]):
        sel = [d for d, _, _ in gaps if lo * 1e3 <= d < hi * 1e3]
        bins.append({"us": [lo, hi if hi < float("inf") else None], "per_call": round(len(sel) / len(groups), 1), "ms_per_call": ms(sum(sel) / len(groups))})
    return {"calls_found": len(groups), "calls": calls,
            "span_ms": ms(float(np.median([s for s, _ in per_call]))),
            "busy_ms": ms(float(np.median([b for _, b in per_call]))),
            "idle_ms": ms(float(np.median([s - b for s, b in per_call]))),
            "gaps": bins,
            "longest_gaps": [{"us": round(d / 1e3, 1), "after": a, "before": b}
                             for d, a, b in sorted(gaps, reverse=True)[:top]]}


def _traced(run, calls: int):
    """jax.profiler's trace of `calls` calls of `run()` (each followed by CALL_PAUSE_S of host
    sleep), read back whole (ProfileData), or None."""
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            for _ in range(calls):
                run()
                time.sleep(CALL_PAUSE_S)
        paths = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)
        return jax.profiler.ProfileData.from_file(paths[0]) if paths else None


def kernel_profile(run, calls: int, top: int = 12, sources: dict[str, str] | None = None) -> dict:
    """Device time by kernel over `calls` calls of `run()` (launch and wait), from a jax.profiler
    trace: the total per call, the `top` kernels by time (per call: ms, launches, share), every
    Pallas kernel's time per call, the 4 * `top` largest kernel instances, and the device timeline
    of a call (`device_timeline`: its span, and the idle gaps between kernels that the kernel time
    leaves out). With `sources` (the
    compiled module's `kernel_sources`), also the time by the model function that traced each
    kernel (`time_by_source`)."""
    profile = _traced(run, calls)
    if profile is None:
        return {"error": "the profiler wrote no trace"}
    instances, lines, spans = _kernel_events(profile)
    totals = _sum_by(instances, kernel_group)
    total_ns = sum(t for t, _ in totals.values())
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][0])
    per_call = lambda ns: round(ns / calls / 1e6, 4)
    out = {"calls": calls, "lines": sorted(set(lines)), "device_ms_per_call": per_call(total_ns),
           "launches_per_call": sum(c for _, c in totals.values()) / calls,
           "kernels": [{"name": n, "ms_per_call": per_call(t), "launches_per_call": c / calls,
                        "share": round(t / total_ns, 4) if total_ns else 0.0} for n, (t, c) in ranked[:top]],
           "pallas_ms_per_call": {k: per_call(totals[k][0]) for k in PALLAS_KERNELS if k in totals},
           "timeline": device_timeline(spans, calls)}
    if sources is not None:
        out["by_source"] = time_by_source(instances, sources, calls, top)
    # the largest launches one by one (a kind's total hides which instruction is slow)
    ranked = sorted(instances.items(), key=lambda kv: -kv[1][0])
    out["instances"] = [{"name": n, "ms_per_call": per_call(t), "launches_per_call": c / calls,
                         "source": (sources or {}).get(re.sub(r"[.\-]", "_", n), "")} for n, (t, c) in ranked[:4 * top]]
    rest = [tc for _, tc in ranked[4 * top:]]
    out["instances_left_out"] = {"count": len(rest), "ms_per_call": per_call(sum(t for t, _ in rest)),
                                 "launches_per_call": sum(c for _, c in rest) / calls}
    return out


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
