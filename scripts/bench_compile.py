"""Compile time of the jitted cache step against depth: the step lowered on abstract params and
cache (`jax.ShapeDtypeStruct`s: no weights, no device memory) and compiled, for a config cut to
each layer count.

    python -m scripts.bench_compile --config v41_jax/configs/bench_slice.config.json \
        --layers 1,2,4,6 --out R.json [--bucket 1x1x1] [--numerics fast] [--experts auto]

Cutting a config to n layers (`cut`) keeps its first n backbone layers and its draft stages, and
drops every layer id >= n from the source lists (kv, index, candidate, Engram, DSpark taps; taps
left empty move to the last layer). Per depth: seconds to trace + lower, seconds to compile
(`lowered.compile` with the engine's compiler options), and the size of the optimized HLO
(instructions, fusions, while loops), in one process, depths in the given order; the process's
CPU seconds too, which a shared host does not inflate. The compile cache is not used (each
compile is a real one).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import re
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # python scripts/bench_compile.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402

from scripts.bench_step import NUMERICS, param_leaf_specs  # noqa: E402
from v41_jax.cache.buffer import allocate  # noqa: E402
from v41_jax.cache.geometry import CacheGeometry, EngineSettings, typed_format  # noqa: E402
from v41_jax.checkpoint.load import EXPERT_HOLDS, HELD_DTYPES, nest  # noqa: E402
from v41_jax.config import ModelConfig, validate  # noqa: E402
from v41_jax.quant import Fp4Weight, Fp8RowWeight  # noqa: E402
from v41_jax.runtime import compile_cache  # noqa: E402
from v41_jax.runtime.metadata import Bucket, build_step  # noqa: E402
from v41_jax.runtime.packed import BatchLayout  # noqa: E402
from v41_jax.runtime.step import make_step  # noqa: E402


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


def abstract_params(cfg: ModelConfig, experts: str) -> dict:
    """The loader's params pytree as ShapeDtypeStructs (no Engram tables: the step reads its rows
    from the batch)."""
    def leaf(s):
        sds = jax.ShapeDtypeStruct
        if s.held == "fp4":
            return Fp4Weight(sds((*s.shape[:-1], s.shape[-1] // 2), "uint8"), sds((*s.shape[:-1], s.shape[-1] // 32), "uint8"))
        if s.held == "fp8":
            return Fp8RowWeight(sds(s.shape, "uint8"), sds(s.shape[:-1], "float32"))
        return sds(s.shape, HELD_DTYPES[s.held])
    return nest({p: leaf(s) for p, s in param_leaf_specs(cfg, experts).items()})


def hlo_counts(text: str) -> dict:
    ops = [ln for ln in text.splitlines() if " = " in ln and not ln.lstrip().startswith(("HloModule", "//"))]
    return {"instructions": len(ops), "fusions": sum(" fusion(" in ln for ln in ops),
            "while_loops": sum(" while(" in ln for ln in ops)}


def compile_depth(cfg: ModelConfig, n: int, bucket: Bucket, numerics, experts: str, context: int) -> dict:
    c = cut(cfg, n)
    fmt = typed_format(numerics.act_dtype)
    settings = EngineSettings(page_tokens=256, num_pages=1 + bucket.requests * -(-context // 256),
                              slots=bucket.requests, max_context=context, kv_format=fmt, index_format=fmt)
    geom = CacheGeometry.build(c, settings)
    host = build_step(geom, c, bucket, []).batch
    layout = BatchLayout.of(host)
    cache = jax.eval_shape(lambda: allocate(geom))
    t0, c0 = time.perf_counter(), time.process_time()
    lowered = make_step(c, geom, numerics).lower(abstract_params(c, experts), cache, layout.pack(host), layout=layout)
    t1, c1 = time.perf_counter(), time.process_time()
    compiled = lowered.compile(compiler_options=compile_cache.compiler_options())
    t2, c2 = time.perf_counter(), time.process_time()
    # CPU seconds beside wall seconds: on a shared host the wall clock also counts other jobs
    return {"layers": n, "lower_s": round(t1 - t0, 2), "compile_s": round(t2 - t1, 2),
            "lower_cpu_s": round(c1 - c0, 2), "compile_cpu_s": round(c2 - c1, 2), **hlo_counts(compiled.as_text() or "")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--layers", required=True, help="layer counts, comma separated")
    ap.add_argument("--out", required=True)
    ap.add_argument("--bucket", default="1x1x1", help="tokens x requests x logits rows")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--numerics", choices=sorted(NUMERICS), default="fast")
    ap.add_argument("--experts", choices=EXPERT_HOLDS, default="auto")
    args = ap.parse_args(argv)
    cfg = ModelConfig.from_file(args.config)
    bucket = Bucket(*(int(x) for x in args.bucket.split("x")))
    rows = []
    out = {"config": args.config, "bucket": args.bucket, "numerics": args.numerics, "experts": args.experts,
           "platform": jax.default_backend(), "device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
           "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S"), "rows": rows}
    for n in (int(x) for x in args.layers.split(",")):
        rows.append(compile_depth(cfg, n, bucket, NUMERICS[args.numerics](), args.experts, args.context))
        print(json.dumps(rows[-1]), flush=True)
        Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
