"""Choices inside the decode and prefill kernels, each timed against the alternatives, interleaved
in one process (the machine's spread between processes is larger than these differences).

    python -m scripts.bench_decode_choices --out C.json [--sections e4m3,moe-impl,rms-runs,moe-prefill] [--smoke]

  e4m3      `kernels_pallas._codecs.e4m3_as`: E4M3 codes decoded by the code's rule (by way of
            fp16 for 16-bit targets, the grouped GEMM's bf16 MMA operands; directly for fp32, the
            GEMV's and FP4's), always directly, and always by way of fp16, for the GEMV and the
            grouped GEMM, FP8 rows and FP4 (decoded through E4M3 too), 1-512 tokens.
  moe-impl  `moe.choose_impl` at 1-16 tokens: the GEMV path against the grouped GEMM (64 and
            32 columns), FP8 rows and bf16.
  rms-runs  `kernels_pallas.rmsnorm.WIDE_RUNS`: the kernel time (profiler) of rms_inv at the mHC,
            hidden and query-latent widths with the code's rule, with one run a loop step at
            every width, and with 8 runs side by side at every width. Outputs compared bit for bit.
  moe-prefill  the grouped GEMM at 2K-8K tokens (prefill chunks): FP8 rows with the default tiles,
            64-column tiles (gate/up holds two fp32 accumulators a tile) and 256-row tiles (a
            weight tile decoded once for twice the rows), outputs compared bit for bit with the
            default's; bf16 experts with the default tiles beside them. Each case's gate/up and
            down kernel times from a trace of 3 more calls.

MoE cases run one layer per call at the bench slice's widths (5120 / 2304, 64 experts, top-6),
weights random E2M1 codes under one E8M0 scale (FP8 rows re-coded from them), synthetic routing;
bytes are the weights of the experts the routing touched.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kernels_pallas import _codecs  # noqa: E402
from kernels_pallas import moe as kmoe  # noqa: E402
from kernels_pallas import rmsnorm  # noqa: E402
from scripts.bench_common import kernel_profile  # noqa: E402
from scripts.bench_kernels import CONFIG, FAST, Bench, fp4_weight  # noqa: E402
from v41_jax.quant import Fp8RowWeight  # noqa: E402


def _direct_e4m3(codes, dtype):
    """One conversion straight to the target dtype (what `_codecs.e4m3_as` does for fp32)."""
    return jax.lax.bitcast_convert_type(codes, jnp.float8_e4m3fn).astype(dtype)


def _fp16_e4m3(codes, dtype):
    """By way of fp16 for every target (what `_codecs.e4m3_as` does for 16-bit ones)."""
    return jax.lax.bitcast_convert_type(codes, jnp.float8_e4m3fn).astype(jnp.float16).astype(dtype)


def _experts(d: int, f: int, e: int) -> dict:
    """The same expert values held as FP4, FP8 rows and bf16."""
    keys = jax.random.split(jax.random.key(6), 3)
    fp4 = tuple(fp4_weight(k, s) for k, s in zip(keys, ((e, f, d), (e, f, d), (e, d, f))))
    fp8 = tuple(Fp8RowWeight.from_fp4(w) for w in fp4)
    return {"fp4": fp4, "fp8": fp8, "bf16": tuple(w.dequant().astype(jnp.bfloat16) for w in fp8)}


_BYTES_PER_WEIGHT = {"fp4": 17 / 32, "fp8": 1.0, "bf16": 2.0}   # FP4: half a byte + a scale per 32


def _routing(t: int, d: int, e: int, k: int):
    k1, k2, k3 = jax.random.split(jax.random.key(t), 3)
    x = jax.random.normal(k1, (t, d), jnp.bfloat16)
    idx = jax.lax.top_k(jax.random.uniform(k2, (t, e)), k)[1].astype(jnp.int32)
    return x, idx, jax.random.uniform(k3, (t, k), jnp.float32)


def _moe_case(b: Bench, name: str, shape: tuple, held: str, ws, t: int, profile: int = 0, **kw):
    """Time one routed-experts call; returns its output (for bit comparisons). profile: trace that
    many calls more and record each Pallas kernel's time (gate/up apart from down)."""
    d, f, e, k = shape
    x, idx, wt = _routing(t, d, e, k)
    fn = jax.jit(lambda x, idx, wt, ws: kmoe.routed_experts(x, idx, wt, *ws, FAST, 10.0, backend="pallas", **kw))
    out = jax.block_until_ready(fn(x, idx, wt, ws))
    active = len(set(np.asarray(idx).reshape(-1).tolist()))
    b.case(name, fn, (x, idx, wt, ws), layers=1, flops=6.0 * t * k * d * f,
           bytes_=active * 3 * d * f * _BYTES_PER_WEIGHT[held], tokens=t, held=held, active_experts=active)
    if profile and b.results["cases"][-1]["name"] == name:
        prof = kernel_profile(lambda: jax.block_until_ready(fn(x, idx, wt, ws)), profile)
        b.results["cases"][-1]["kernel_ms"] = prof.get("pallas_ms_per_call", prof)
        b.save()
    return np.asarray(out)


def bench_e4m3(b: Bench, shape: tuple, experts: dict):
    tokens = ((1, "gemv"), (16, "pallas")) if b.smoke else \
        ((1, "gemv"), (8, "gemv"), (16, "pallas"), (32, "pallas"), (128, "pallas"), (512, "pallas"))
    code = _codecs.e4m3_as

    def routed(conv):     # the MoE module's name decodes FP8 rows, the codecs' own decodes FP4
        for module in (_codecs, kmoe):
            module.e4m3_as = conv
    for t, impl in tokens:
        for held in ("fp8",) if b.smoke else ("fp8", "fp4"):
            outs = {}
            for route, conv in (("rule", code), ("direct", _direct_e4m3), ("via-fp16", _fp16_e4m3)):
                routed(conv)
                jax.clear_caches()                # the kernels are traced again with this route
                try:
                    outs[route] = _moe_case(b, f"e4m3/T{t}/{impl}/{held}/{route}", shape, held,
                                            experts[held], t, impl=impl)
                finally:
                    routed(code)
            b.results["cases"][-1]["bit_equal"] = all((o == outs["rule"]).all() for o in outs.values())
            b.save()


def bench_moe_impl(b: Bench, shape: tuple, experts: dict):
    for t in ((4,) if b.smoke else (1, 2, 4, 8, 12, 16)):
        for held in ("fp8",) if b.smoke else ("fp8", "bf16"):
            for label, kw in (("gemv", dict(impl="gemv")), ("grouped", dict(impl="pallas")),
                              ("grouped-bn32", dict(impl="pallas", block_n=32))):
                _moe_case(b, f"moe-impl/T{t}/{held}/{label}", shape, held, experts[held], t, **kw)


def bench_moe_prefill(b: Bench, shape: tuple, experts: dict):
    """FP8 rows ran at 0.66x the bf16 experts' speed from 2K tokens (the decode in the MMA path,
    BENCHMARKS.md 2026-11-30): where does the decode's cost go away."""
    variants = (("default", {}),
                ("bn64", dict(block_n=64)),             # gate/up's two fp32 accumulators half as wide
                ("bm256-bn64", dict(block_m=256, block_n=64)),
                # the K step and the pipeline depth around the 64-column blocks (2026-12-05 c)
                ("bn64-k128", dict(block_n=64, block_k=128)),
                ("bn64-s4", dict(block_n=64, num_stages=4)),
                ("bn64-w4", dict(block_n=64, num_warps=4)))
    for t in ((64,) if b.smoke else (2048, 4096, 8192)):
        for held in ("fp8", "bf16"):
            outs = {}
            for label, kw in variants if held == "fp8" else variants[:1]:
                if b.left() < 0:
                    return
                if b.smoke and "block_m" in kw:
                    kw = {**kw, "block_m": 32, "block_n": 32}
                outs[label] = _moe_case(b, f"moe-prefill/T{t}/{held}/{label}", shape, held, experts[held], t,
                                        profile=3, impl="pallas", **kw)
                if label != "default":
                    b.results["cases"][-1]["bit_equal_to_default"] = bool((outs[label] == outs["default"]).all())
            b.save()


def bench_rms_runs(b: Bench, cfg: dict):
    hidden, eps = cfg["hidden_size"], cfg["rms_norm_eps"]
    widths = (("mhc", cfg["hc_mult"] * hidden, jnp.float32), ("hidden", hidden, jnp.bfloat16),
              ("q_lora", cfg["q_lora_rank"], jnp.bfloat16))
    rng, rule = np.random.default_rng(1), rmsnorm.WIDE_RUNS
    for wname, d, dt in widths:
        for t in ((2,) if b.smoke else (1, 8, 64)):
            x = jnp.asarray(rng.standard_normal((t, d)) * np.exp(rng.standard_normal((t, d))), dt)
            bits = {}
            for label, wide in (("rule", rule), ("run-by-run", 1 << 30), ("side-by-side", 1)):
                rmsnorm.WIDE_RUNS = wide
                jax.clear_caches()
                try:
                    fn = jax.jit(lambda x: rmsnorm.rms_inv(x, eps, backend="pallas"))
                    bits[label] = np.asarray(fn(x)).view(np.uint32)
                    prof = kernel_profile(lambda: jax.block_until_ready(fn(x)), 20, top=2)
                finally:
                    rmsnorm.WIDE_RUNS = rule
                b.record(name=f"rms-runs/{wname}{d}/T{t}/{label}", width=d, tokens=t,
                         kernel_ms=prof.get("pallas_ms_per_call", {}).get("rms_inv"),
                         bit_equal_to_rule=bool((bits[label] == bits["rule"]).all()))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--sections", default="e4m3,moe-impl,rms-runs,moe-prefill")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--budget", type=float, default=500.0, help="seconds; later cases are skipped")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, for CPU checks")
    args = ap.parse_args(argv)
    with open(CONFIG) as f:
        cfg = json.load(f)["text_config"]
    b = Bench(args.out, args.budget, args.reps, args.smoke)
    shape = (256, 128, 8, 2) if args.smoke else \
        (cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["n_routed_experts"], cfg["num_experts_per_tok"])
    sections = args.sections.split(",")
    experts = _experts(*shape[:3]) if {"e4m3", "moe-impl", "moe-prefill"} & set(sections) else None
    for name in sections:
        if name == "e4m3":
            bench_e4m3(b, shape, experts)
        elif name == "moe-impl":
            bench_moe_impl(b, shape, experts)
        elif name == "rms-runs":
            bench_rms_runs(b, cfg)
        elif name == "moe-prefill":
            bench_moe_prefill(b, shape, experts)
        else:
            raise SystemExit(f"--sections: unknown section {name!r} (e4m3, moe-impl, rms-runs, moe-prefill)")
    b.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
