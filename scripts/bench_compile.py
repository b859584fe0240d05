"""Compile time of the jitted cache step against depth: the step lowered on abstract params and
cache (`jax.ShapeDtypeStruct`s: no weights, no device memory) and compiled, for a config cut to
each layer count.

    python -m scripts.bench_compile --config v41_jax/configs/bench_slice.config.json \
        --layers 1,2,4,6 --out R.json [--bucket 1x1x1] [--numerics fast] [--experts auto] [--by-source N]
        [--speculative] [--scan-layers off|on|both] [--host-events N]

Cutting a config to n layers (`cut`) keeps its first n backbone layers and its draft stages, and
drops every layer id >= n from the source lists (kv, index, candidate, Engram, DSpark taps; taps
left empty move to the last layer). Per depth: seconds to trace + lower, seconds to compile
(`lowered.compile` with the engine's compiler options), and the size of the optimized HLO
(instructions, fusions, while loops), in one process, depths in the given order; the process's
CPU seconds too, which a shared host does not inflate. The compile cache is not used (each
compile is a real one). `--by-source N`: the optimized HLO's kernels (fusions, custom calls, sorts,
...) by the model function that traced them, times the trip counts of the loops around them: the
launches one call makes, on the backend that compiled (`kernels_by_source`; a loop whose trip
count XLA does not record counts once). `--scan-layers on`: the params in the scanned layout
(`v41_jax/model/layer_runs.py`: each run of identical layers stacked and compiled once, as
`Engine(scan_layers=True)` runs it); `both`: each depth unrolled, then scanned. `--host-events N`:
the compile under jax.profiler, the N host trace events (XLA's passes, autotuning, Triton and
LLVM / ptxas work) with the most time, summed over the compiler's threads.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # python scripts/bench_compile.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from scripts.bench_common import KERNEL_OPS, applied_computations, cut, hlo_computations, host_events, source_owner  # noqa: E402
from scripts.bench_step import NUMERICS, param_leaf_specs  # noqa: E402
from v41_jax.cache.buffer import allocate  # noqa: E402
from v41_jax.cache.geometry import CacheGeometry, EngineSettings, row_formats  # noqa: E402
from v41_jax.checkpoint.load import EXPERT_HOLDS, HELD_DTYPES, nest  # noqa: E402
from v41_jax.config import ModelConfig  # noqa: E402
from v41_jax.model.layer_runs import layer_runs, stack_runs  # noqa: E402
from v41_jax.quant import Fp4Weight, Fp8BlockWeight, Fp8RowWeight, fp8_block_scale_shape  # noqa: E402
from v41_jax.runtime import compile_cache  # noqa: E402
from v41_jax.runtime.metadata import Bucket, build_step  # noqa: E402
from v41_jax.runtime.packed import BatchLayout  # noqa: E402
from v41_jax.runtime.step import make_step  # noqa: E402


def abstract_params(cfg: ModelConfig, experts: str) -> dict:
    """The loader's params pytree as ShapeDtypeStructs (no Engram tables: the step reads its rows
    from the batch)."""
    def leaf(s):
        sds = jax.ShapeDtypeStruct
        if s.held == "fp4":
            return Fp4Weight(sds((*s.shape[:-1], s.shape[-1] // 2), "uint8"), sds((*s.shape[:-1], s.shape[-1] // 32), "uint8"))
        if s.held == "fp8":
            return Fp8RowWeight(sds(s.shape, "uint8"), sds(s.shape[:-1], "float32"))
        if s.held == "fp8_blocks":
            return Fp8BlockWeight(sds(s.shape, "uint8"), sds(fp8_block_scale_shape(s.shape), "uint8"))
        return sds(s.shape, HELD_DTYPES[s.held])
    return nest({p: leaf(s) for p, s in param_leaf_specs(cfg, experts).items()})


def hlo_counts(text: str) -> dict:
    ops = [ln for ln in text.splitlines() if " = " in ln and not ln.lstrip().startswith(("HloModule", "//"))]
    return {"instructions": len(ops), "fusions": sum(" fusion(" in ln for ln in ops),
            "while_loops": sum(" while(" in ln for ln in ops)}


# ---- where the kernels come from: the optimized HLO's top-level kernels by the source function ----

def _element_bytes(hlo_type: str) -> int:
    """Bytes of one element of an HLO element type: its first number is its width in bits
    (f32, bf16, s8, f8e4m3fn, ...); pred is a byte."""
    return 1 if hlo_type == "pred" else max(1, int(re.search(r"\d+", hlo_type)[0]) // 8)


def kernels_by_source(text: str, top: int = 25) -> dict:
    """Top-level kernel instructions of an optimized HLO module (fusions, custom calls, sorts, ...;
    not the instructions inside a fusion) by the innermost model function that traced them (the
    numerics / linear / quant helpers count for their caller), each weighted by the trip counts
    of the while loops around it (once where XLA records no trip count): launches per call
    (`kernels`); and every while loop and conditional with its source, the computation holding it,
    its known trip count and how often one call reaches it (`loops`); every top-level copy (a
    memcpy on a GPU) with its shape, bytes and source, largest traffic first (`copies`)."""
    owner = source_owner(text)
    comps = hlo_computations(text)
    body_of, applied = {}, applied_computations(comps)
    for name, lines in comps.items():
        for line in lines:
            if " while(" in line:
                trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
                body_of[re.search(r"body=%([\w.\-]+)", line)[1]] = (name, int(trips[1]) if trips else 1)

    def weight(name: str) -> int:
        w = 1
        while name in body_of:
            name, n = body_of[name]
            w *= n
        return w

    static, launches = {}, {}
    for name, lines in comps.items():
        if name in applied:
            continue                                  # fused, reducer and condition computations
        for line in lines:
            if KERNEL_OPS.search(line):
                m = re.search(r"stack_frame_id=(\d+)", line)
                o = owner(int(m[1])) if m else "?"
                static[o] = static.get(o, 0) + 1
                launches[o] = launches.get(o, 0) + weight(name)
    ranked = sorted(launches, key=lambda o: -launches[o])
    loops, copies = [], []
    for name, lines in comps.items():
        for line in lines:
            m = re.search(r"stack_frame_id=(\d+)", line)
            source = owner(int(m[1])) if m else "?"
            if " while(" in line or " conditional(" in line:
                trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
                loops.append({"op": "while" if " while(" in line else "conditional", "source": source, "in": name,
                              "trip_count": int(trips[1]) if trips else None, "times_per_call": weight(name)})
            shape = re.search(r"= (\w+)\[([\d,]*)\]\S* copy(?:-start)?\(", line)
            if shape and name not in applied:
                n = int(np.prod([int(x) for x in shape[2].split(",") if x]))
                copies.append({"shape": f"{shape[1]}[{shape[2]}]", "bytes": n * _element_bytes(shape[1]),
                               "source": source, "times_per_call": weight(name)})
    return {"kernels": [{"source": o, "launches": launches[o], "instructions": static[o]} for o in ranked[:top]],
            "loops": loops, "copies": sorted(copies, key=lambda c: -c["bytes"] * c["times_per_call"])}


def compile_depth(cfg: ModelConfig, n: int, bucket: Bucket, numerics, experts: str, context: int,
                  by_source: int = 0, speculative: bool = False, scan: bool = False,
                  events: int = 0) -> dict:
    c = cut(cfg, n)
    # speculative: the step as a DSpark engine compiles it (draft slack of one block, verify + draft)
    settings = EngineSettings(page_tokens=256, num_pages=1 + bucket.requests * -(-context // 256),
                              slots=bucket.requests, max_context=context,
                              draft_slack=c.dspark_block_size if speculative else 0, **row_formats(numerics))
    geom = CacheGeometry.build(c, settings)
    host = build_step(geom, c, bucket, []).batch
    layout = BatchLayout.of(host)
    cache = jax.eval_shape(lambda: allocate(geom))
    params = abstract_params(c, experts)
    if scan:
        params = jax.eval_shape(lambda p: stack_runs(p, c), params)
    t0, c0 = time.perf_counter(), time.process_time()
    lowered = make_step(c, geom, numerics, speculative=speculative).lower(params, cache, layout.pack(host),
                                                                          layout=layout)
    t1, c1 = time.perf_counter(), time.process_time()
    done = []

    def run():   # the clocks read right after the compile: the trace's pause and parse left out
        done.append((lowered.compile(compiler_options=compile_cache.compiler_options()),
                     time.perf_counter(), time.process_time()))
    trace = host_events(run, 1, events) if events else run()
    compiled, t2, c2 = done[0]
    # CPU seconds beside wall seconds: on a shared host the wall clock also counts other jobs
    text = compiled.as_text() or ""
    row = {"layers": n, "scan": scan, "runs": [[r.start, r.stop - 1] for r in layer_runs(c)] if scan else [],
           "lower_s": round(t1 - t0, 2), "compile_s": round(t2 - t1, 2),
           "lower_cpu_s": round(c1 - c0, 2), "compile_cpu_s": round(c2 - c1, 2), **hlo_counts(text)}
    if by_source:
        row["kernels_by_source"] = kernels_by_source(text, by_source)
    if events:   # the profiler's own cost while it records is in compile_s
        row["host_events"] = trace
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--layers", required=True, help="layer counts, comma separated")
    ap.add_argument("--out", required=True)
    ap.add_argument("--bucket", default="1x1x1", help="tokens x requests x logits rows")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--numerics", choices=sorted(NUMERICS), default="fast")
    ap.add_argument("--experts", choices=EXPERT_HOLDS, default="auto")
    ap.add_argument("--speculative", action="store_true",
                    help="the DSpark step (verify spans, then the draft); bucket e.g. 6x1x6 = block + 1 rows")
    ap.add_argument("--by-source", type=int, default=0, metavar="N",
                    help="also list the N source functions with the most kernel launches per call")
    ap.add_argument("--host-events", type=int, default=0, metavar="N",
                    help="trace the compile and list its N host events with the most time")
    ap.add_argument("--scan-layers", choices=("off", "on", "both"), default="off",
                    help="compile with the runs of identical layers stacked and scanned (both: each depth twice)")
    args = ap.parse_args(argv)
    cfg = ModelConfig.from_file(args.config)
    bucket = Bucket(*(int(x) for x in args.bucket.split("x")))
    rows = []
    out = {"config": args.config, "bucket": args.bucket, "speculative": args.speculative,
           "numerics": args.numerics, "experts": args.experts,
           "platform": jax.default_backend(), "device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
           "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S"), "rows": rows}
    scans = {"off": (False,), "on": (True,), "both": (False, True)}[args.scan_layers]
    for n, scan in ((int(x), s) for x in args.layers.split(",") for s in scans):
        rows.append(compile_depth(cfg, n, bucket, NUMERICS[args.numerics](), args.experts, args.context,
                                  args.by_source, args.speculative, scan, args.host_events))
        print(json.dumps({k: v for k, v in rows[-1].items() if k not in ("kernels_by_source", "host_events")}), flush=True)
        for ev in rows[-1].get("host_events", []):
            print(f"  {ev.get('ms_per_call', 0) / 1e3:9.2f} s  x{ev.get('per_call', 0):<6g} {ev.get('name', ev)}", flush=True)
        by = rows[-1].get("kernels_by_source", {})
        for k in by.get("kernels", []):
            print(f"  {k['launches']:6d} launches ({k['instructions']:4d} in the HLO)  {k['source']}", flush=True)
        for lp in by.get("loops", []):
            print(f"  {lp['op']} x{lp['times_per_call']} (trips {lp['trip_count']}) in {lp['in']}: {lp['source']}", flush=True)
        for cp in by.get("copies", [])[:args.by_source]:
            print(f"  copy x{cp['times_per_call']} {cp['shape']} ({cp['bytes'] / 2**20:.2f} MiB): {cp['source']}", flush=True)
        Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
