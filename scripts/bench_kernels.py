"""Benchmark the Pallas kernels against their XLA paths at real V4.1 widths (bench_slice config).

    python scripts/bench_kernels.py --out bench.json [--sections peak,head,attn,indexer,select,moe,sinkhorn,rmsnorm,hc-expand,mhc-mix]
                                    [--budget SECONDS] [--smoke]

Every case: after warm-up, five rounds of `--reps` calls queued back to back with one
block_until_ready per round; the median round's time per call. One call runs L independent
"layers" (separate inputs, one jit); times are per layer. Reported: ms, achieved TFLOP/s and
GB/s (minimum bytes: every input row read once, every output written once), ratio to the measured bf16 GEMM peak and copy bandwidth, and the
speed-up over the XLA path in the same run; the sinkhorn and rmsnorm sections also give each
variant's compile seconds. Sections stop starting new cases once the time
budget is spent; results are written after every case. --smoke: tiny shapes, for CPU checks.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kernels_pallas import dense_fp8 as kdense  # noqa: E402
from kernels_pallas import hc_expand as khc  # noqa: E402
from kernels_pallas import indexer as kidx  # noqa: E402
from kernels_pallas import moe as kmoe  # noqa: E402
from kernels_pallas import select as ksel  # noqa: E402
from kernels_pallas.rmsnorm import rms_inv  # noqa: E402
from kernels_pallas.sparse_attn import BF16_TOL, sparse_attn_paged  # noqa: E402
from scripts.bench_common import copy_bandwidth, gemm_peak, kernel_profile, queued_median_s  # noqa: E402
from v41_jax.model.mhc import split_sinkhorn  # noqa: E402
from v41_jax.runtime.compile_cache import compiler_options  # noqa: E402
from v41_jax import linear  # noqa: E402
from v41_jax.linear import lin_f32  # noqa: E402
from v41_jax.model.numerics import HIGHEST, Numerics  # noqa: E402
from v41_jax.checkpoint.load import held_bytes  # noqa: E402
from v41_jax.quant import (Fp4Weight, Fp8BlockWeight, Fp8RowWeight, dequant_fp8_blocks, fp4_qdq_ue8m0, fp8_act_qdq,  # noqa: E402
                           pack_fp4_ue8m0_rows, pack_fp4_e4m3_rows, pack_fp8_ue8m0_rows, quant_weight_fp8)

REF = Numerics.reference()
FAST = Numerics.fast()
CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                      "v41_jax", "configs", "bench_slice.config.json")


class Bench:
    def __init__(self, out: str, budget: float, reps: int, smoke: bool, only: str | None = None):
        self.out, self.deadline, self.reps, self.smoke = out, time.time() + budget, reps, smoke
        self.only = re.compile(only) if only else None
        self.results = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
                        "backend": jax.default_backend(), "date": time.strftime("%Y-%m-%d %H:%M"),
                        "cases": []}
        self.peak_tflops = self.peak_gbs = None

    def left(self) -> float:
        return self.deadline - time.time()

    def save(self):
        with open(self.out, "w") as f:
            json.dump(self.results, f, indent=1)

    def time(self, fn, *args) -> float:
        """Median seconds of one call (compile and warm-up excluded; `queued_median_s`)."""
        return queued_median_s(fn, *args, reps=self.reps)

    def record(self, **row):
        if self.peak_tflops and row.get("tflops") is not None:
            row["pct_peak_flops"] = round(100 * row["tflops"] / self.peak_tflops, 1)
        if self.peak_gbs and row.get("gbs") is not None:
            row["pct_copy_bw"] = round(100 * row["gbs"] / self.peak_gbs, 1)
        self.results["cases"].append(row)
        self.save()
        print(json.dumps(row), flush=True)

    def case(self, name: str, fn, args, *, layers: int, flops: float, bytes_: float, check=None, **meta):
        """Time fn(*args) (which runs `layers` layers) -> per-layer row; errors are recorded.
        check(out) -> dict: fields added to the row from one call's output (a variant timed is a
        variant checked)."""
        if self.only and not self.only.search(name):
            return None
        if self.left() < 0:
            self.record(name=name, skipped="time budget", **meta)
            return None
        try:
            t = self.time(fn, *args) / layers
        except Exception as err:  # one failing variant must not end the run
            self.record(name=name, error=f"{type(err).__name__}: {str(err)[:400]}", **meta)
            traceback.print_exc()
            return None
        try:
            checked = check(fn(*args)) if check is not None else {}
        except Exception as err:  # the timing stands; the row says the check could not run
            checked = dict(check_error=f"{type(err).__name__}: {str(err)[:400]}")
            traceback.print_exc()
        self.record(name=name, ms=round(t * 1e3, 4), tflops=round(flops / t / 1e12, 2),
                    gbs=round(bytes_ / t / 1e9, 1), **checked, **meta)
        return t


# ---- ceilings ---------------------------------------------------------------------------------

def bench_peak(b: Bench):
    peak = gemm_peak(512 if b.smoke else 8192, b.reps)
    b.peak_tflops = peak["bf16_gemm_tflops"]
    n = peak["gemm_n"]
    copy = copy_bandwidth(4 if b.smoke else 4096, b.reps)
    b.peak_gbs = copy["copy_gbs_read_plus_write"]
    b.results["peak"] = {"bf16_gemm_tflops": round(b.peak_tflops, 1), "gemm_n": n,
                         "copy_gbs_read_plus_write": b.peak_gbs, "copy_bytes": copy["copy_bytes"]}
    b.save()
    print("peak", b.results["peak"], flush=True)


# ---- sparse attention -------------------------------------------------------------------------

def _attn_inputs(key, layers, t, h, d, n_win, n_comp, ring_rows, comp_rows, ctx, per_token_req, window_kind):
    """Per layer: q [T,H,D], window ids [T,n_win], compressed ids [T,n_comp] (ascending, random)."""
    qs, wids, cids = [], [], []
    tok = jnp.arange(t, dtype=jnp.int32)
    req = tok if per_token_req else jnp.zeros_like(tok)
    for l in range(layers):
        k1, k2, key = jax.random.split(key, 3)
        qs.append(jax.random.normal(k1, (t, h, d), jnp.bfloat16))
        c = jnp.sort(jax.random.randint(k2, (t, n_comp), 0, ctx), axis=-1) + req[:, None] * ctx
        cids.append(c.astype(jnp.int32) % comp_rows)
        if window_kind == "ring":    # decode/verify: the request's ring slots
            w = (req[:, None] * 133 + jnp.arange(n_win)[None, :]) % ring_rows
        else:                        # prefill: positions p-127..p of this chunk's rows
            w = jnp.clip(tok[:, None] - jnp.arange(n_win)[None, ::-1], 0, ring_rows - 1)
        wids.append(w.astype(jnp.int32))
    return tuple(qs), tuple(wids), tuple(cids)


LAUNCH_KEYS = {"head_block", "num_warps", "num_stages", "prefetch_ids", "value_parts", "lane_pairs",
               "merge_in_kernel"}


def _variant_base(tokens: int) -> dict:
    """What a sweep variant naming some launch parameters takes the rest from: `launch_config` as
    it stood on 2026-12-05, fixed, so a variant's name means one program in every run's JSON
    (variants naming none, "auto", "packed-auto", take today's `launch_config`)."""
    if tokens <= 64:
        return dict(head_block=16, num_warps=4, num_stages=2, prefetch_ids=True, value_parts=1, lane_pairs=False,
                    merge_in_kernel=False)
    return dict(head_block=64, num_warps=8, num_stages=3, prefetch_ids=False, value_parts=1, lane_pairs=False,
                merge_in_kernel=False)


def bench_attn(b: Bench, cfg: dict, sweep_only: bool = False):
    h, d, w, k = cfg["num_attention_heads"], cfg["head_dim"], cfg["sliding_window"], cfg["index_topk"]
    if b.smoke:
        h, d, w, k = 16, 64, 64, 128
    scale = d ** -0.5
    key = jax.random.key(2)
    comp_rows = (1 << 14) if b.smoke else (1 << 22)                   # 4M rows x 1 KiB = 4 GiB pool
    comp = jax.random.normal(key, (comp_rows, d), jnp.bfloat16)
    ring_rows = 8192 * 2 if not b.smoke else 1024
    ring = jax.random.normal(jax.random.key(3), (ring_rows, d), jnp.bfloat16)
    sink = jax.random.normal(jax.random.key(4), (h,), jnp.float32)
    pools = {"bf16": (ring, comp)}

    fp8 = jax.jit(lambda x: pack_fp8_ue8m0_rows(x.astype(jnp.float32)))
    fp4 = jax.jit(lambda x: pack_fp4_e4m3_rows(x.astype(jnp.float32)))

    def pool(rows):
        """The (ring, compressed) pools, the same random rows typed bf16 ("bf16"), both packed
        FP8 ("fp8": D E4M3 codes + D/32 E8M0 scales) or each in the format the reference's round
        trip allows exactly ("packed": the window FP8, the compressed rows FP4, D/2 E2M1 bytes +
        D/16 E4M3 scales); made on first use, the 4 GiB pool in 16 slices."""
        if rows not in pools:
            comp_enc = fp8 if rows == "fp8" else fp4
            pools[rows] = (fp8(ring), jnp.concatenate([comp_enc(c) for c in jnp.split(comp, 16)]))
        return pools[rows]

    def runner(backend, rows="bf16", **kw):
        # pools are arguments, never closure constants (a captured 4 GiB pool is baked into HLO)
        def run(qs, wids, cids, ring_, comp_, sink_):
            return tuple(sparse_attn_paged(q, sink_, [(ring_, wi), (comp_, ci)], scale, numerics=REF,
                                           backend=backend, **kw) for q, wi, ci in zip(qs, wids, cids))
        jitted = jax.jit(run)
        return lambda qs, wids, cids: jitted(qs, wids, cids, *pool(rows), sink)

    def shape_case(kind, t, ctx, per_tok, wkind, variants, xla=True, layers=None):
        layers = layers or (8 if t <= 256 else 2)
        ins = _attn_inputs(jax.random.key(t + ctx), layers, t, h, d, w, k, ring_rows, comp_rows, ctx,
                           per_tok, wkind)
        flops = 4.0 * t * h * (w + k) * d
        row_bytes = {"bf16": (d * 2, d * 2), "fp8": (d + d // 32,) * 2,        # (window, compressed)
                     "packed": (d + d // 32, d // 2 + d // 16)}
        bytes_ = lambda rows: (t * (w * row_bytes[rows][0] + k * row_bytes[rows][1])
                               + 2 * t * h * d * 2 + t * (w + k) * 4)
        meta = dict(kernel="sparse_attn", kind=kind, tokens=t, ctx=ctx, heads=h, dh=d, ids=w + k)
        want = {}                                      # the XLA path's output, once a shape and pool

        def agrees(rows):
            def check(out):
                if rows not in want:
                    try:
                        want[rows] = [np.asarray(o, np.float32) for o in runner("xla", rows)(*ins)]
                    except Exception as err:   # e.g. its gathered rows do not fit: once a shape
                        want[rows] = err
                if isinstance(want[rows], Exception):
                    raise want[rows]
                diff = [np.abs(np.asarray(o, np.float32) - r) for o, r in zip(out, want[rows])]
                return dict(max_abs_diff_xla=float(max(x.max() for x in diff)),
                            agrees_xla=all(bool((x <= BF16_TOL * (1 + np.abs(r))).all())
                                           for x, r in zip(diff, want[rows])))
            return check

        times = {}
        for label, kw in variants:
            rows = kw.get("rows", "bf16")
            if LAUNCH_KEYS & set(kw):                  # a named program: the same one in every run
                kw = {**_variant_base(t), **kw}
            times[label] = b.case(f"attn/{kind}{t}/pallas[{label}]", runner("pallas", **kw), ins,
                                  layers=layers, flops=flops, bytes_=bytes_(rows), check=agrees(rows),
                                  variant=label, rows=rows, **meta)
        if xla:
            tx = b.case(f"attn/{kind}{t}/xla", runner("xla"), ins, layers=layers, flops=flops,
                        bytes_=bytes_("bf16"), variant="xla", **meta)
            best = min((v for v in times.values() if v), default=None)
            if tx and best:
                b.results["cases"][-1]["pallas_speedup"] = round(tx / best, 2)
                b.save()
        return times

    if sweep_only:
        variants = [("auto", {}), ("h16w4", dict(head_block=16, num_warps=4)),
                    ("h32w4", dict(head_block=32, num_warps=4)), ("h32w8", dict(head_block=32, num_warps=8)),
                    ("h64w8", dict(head_block=64, num_warps=8)),
                    ("h64w8s3", dict(head_block=64, num_warps=8, num_stages=3)),
                    # each chunk's ids loaded one loop step ahead of its gather, or not
                    ("h16w4-plain", dict(head_block=16, num_warps=4, prefetch_ids=False)),
                    ("h64w8s2-prefetch", dict(head_block=64, num_warps=8, num_stages=2, prefetch_ids=True)),
                    # 16 warps: the [64, 512] fp32 accumulator at 64 registers a thread, not 128 (the
                    # 8-warp program spills); one program an SM, each row read once per token
                    ("h64w16", dict(head_block=64, num_warps=16)),
                    ("h64w16s3", dict(head_block=64, num_warps=16, num_stages=3)),
                    ("h16w8", dict(head_block=16, num_warps=8)),
                    # the output's columns in two programs, each gathering both halves of the rows
                    # as two tiles (no more bytes a program) for the logits and its own half for
                    # P.V: a [64, 256] fp32 accumulator, which the 8-warp program need not spill
                    ("h64w8-v2s3", dict(head_block=64, num_warps=8, num_stages=3, prefetch_ids=False, value_parts=2)),
                    ("h64w4-v2s3", dict(head_block=64, num_warps=4, num_stages=3, prefetch_ids=False, value_parts=2)),
                    ("h64w4-v2s2", dict(head_block=64, num_warps=4, num_stages=2, prefetch_ids=False, value_parts=2)),
                    ("h64w4-v2s4", dict(head_block=64, num_warps=4, num_stages=4, prefetch_ids=False, value_parts=2)),
                    ("h64w4-v2s3-split2", dict(head_block=64, num_warps=4, num_stages=3, prefetch_ids=False,
                                               value_parts=2, num_splits=2)),
                    ("h64w4-v2s3-split4", dict(head_block=64, num_warps=4, num_stages=3, prefetch_ids=False,
                                               value_parts=2, num_splits=4)),
                    ("h32w4-v2s2", dict(head_block=32, num_warps=4, num_stages=2, prefetch_ids=True, value_parts=2)),
                    ("h16w4-v2", dict(head_block=16, num_warps=4, value_parts=2)),
                    # the Mosaic GPU kernel (NVIDIA Hopper): rows copied by TMA, warp specialised
                    ("mgpu", dict(impl="mgpu")),
                    *[(f"mgpu-split{n}", dict(impl="mgpu", num_splits=n)) for n in (1, 2, 4, 8)],
                    # rows packed: both FP8 (528 B, not 1 KiB), or the window FP8 and the compressed
                    # rows FP4 (288 B), the formats the reference's round trips allow exactly
                    ("fp8-auto", dict(rows="fp8")),
                    ("fp8-h64w8s3", dict(rows="fp8", head_block=64, num_warps=8, num_stages=3, prefetch_ids=False)),
                    ("packed-auto", dict(rows="packed")),
                    ("packed-h16w4", dict(rows="packed", head_block=16, num_warps=4)),
                    ("packed-h64w8s3", dict(rows="packed", head_block=64, num_warps=8, num_stages=3,
                                            prefetch_ids=False)),
                    ("packed-h64w4-v2s3", dict(rows="packed", head_block=64, num_warps=4, num_stages=3,
                                               prefetch_ids=False, value_parts=2)),
                    # every row as its even and odd lanes (two half tiles, nothing interleaved after
                    # the decode), and the decode spread over 16 warps
                    ("packed-h64w8s3-pairs", dict(rows="packed", head_block=64, num_warps=8, num_stages=3,
                                                  prefetch_ids=False, lane_pairs=True)),
                    ("packed-h64w16s3", dict(rows="packed", head_block=64, num_warps=16, num_stages=3,
                                             prefetch_ids=False)),
                    ("packed-h64w16s3-pairs", dict(rows="packed", head_block=64, num_warps=16, num_stages=3,
                                                   prefetch_ids=False, lane_pairs=True)),
                    ("packed-h64w8s3-pairs-split4", dict(rows="packed", head_block=64, num_warps=8,
                                                         num_stages=3, prefetch_ids=False, lane_pairs=True,
                                                         num_splits=4)),
                    # the split merge in the kernel's last program of a token's head block
                    ("h16w4-kmerge", dict(head_block=16, num_warps=4, merge_in_kernel=True)),
                    ("h64w8-split4-kmerge", dict(head_block=64, num_warps=8, num_splits=4, merge_in_kernel=True))]
        # more splits for the wide programs: every head of a token in one program reads its rows
        # once, and 4 splits give 32 tokens 128 programs (2 splits left half of the GPU idle)
        variants += [(f"{name}-split{n}", dict(kw, num_splits=n)) for n in (4, 8)
                     for name, kw in (("h16w4", dict(head_block=16, num_warps=4)),
                                      ("h32w4", dict(head_block=32, num_warps=4)),
                                      ("h64w8", dict(head_block=64, num_warps=8)),
                                      ("h64w16", dict(head_block=64, num_warps=16)))]
        for kind, t, wkind in (("decode", 1, "ring"), ("decode", 8, "ring"), ("decode", 32, "ring"),
                               ("decode", 48, "ring"), ("decode", 64, "ring"),
                               ("decode", 96, "ring"), ("decode", 128, "ring"),
                               ("verify", 192, "ring"), ("prefill", 4096, "extend")):
            if b.left() < 0:
                break
            shape_case(kind, t, 32768, wkind == "ring", wkind, variants, xla=False)
        return
    # launch parameters: `launch_config` / `default_splits` ("auto"); splits compared at <= 32 tokens
    auto = [("auto", {})]
    splits = auto + [(f"split{n}", dict(num_splits=n)) for n in (1, 2, 4)]
    ctx_s = 64 if b.smoke else 32768
    shapes = ([("decode", bb, ctx_s, True, "ring", splits if bb <= 32 else auto) for bb in (1, 8, 32, 64, 128)]
              + [("decode", 32, c, True, "ring", auto) for c in ((131072,) if not b.smoke else (32,))]
              + [("verify", bb * 6, ctx_s, True, "ring", auto) for bb in (8, 32)]
              + [("prefill", tt, c, False, "extend", auto) for tt, c in
                 (((1024, 32768), (4096, 32768), (8192, 131072)) if not b.smoke else ((64, 64),))])
    for kind, t, ctx, per_tok, wkind, variants in shapes:
        if b.left() < 0:
            break
        shape_case(kind, t, ctx, per_tok, wkind, variants, xla=t <= 1024)

    # correctness at real size: kernel vs XLA path
    t = 8
    ins = _attn_inputs(jax.random.key(99), 1, t, h, d, w, k, ring_rows, comp_rows, 4096, True, "ring")
    got = runner("pallas", num_splits=1)(*ins)[0]
    want = runner("xla")(*ins)[0]
    err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32))))
    b.results["attn_check"] = {"tokens": t, "max_abs_diff_vs_xla": err,
                               "max_abs_out": float(jnp.max(jnp.abs(want.astype(jnp.float32))))}
    b.save()


# ---- indexer ----------------------------------------------------------------------------------

def bench_indexer(b: Bench, cfg: dict):
    hi, di, k = cfg["index_n_heads"], cfg["index_head_dim"], cfg["index_topk"]
    nblk, bs = cfg["candidate_topk_blocks"], cfg["candidate_block_size"]
    rpp = 256                                                          # page of 256 tokens, ratio 1
    if b.smoke:
        hi, di, k, nblk, rpp = 8, 32, 16, 8, 16
    n_pages = (1 << 14) + 1 if not b.smoke else 257
    # keys on the fp4 grid, as the model stores them: typed bf16 rows, and the same rows packed
    # (`quant.pack_fp4_ue8m0_rows`, the cache's "fp4" index format)
    pages = fp4_qdq_ue8m0(jax.random.normal(jax.random.key(5), (n_pages, rpp, di), jnp.float32))
    packed = pack_fp4_ue8m0_rows(pages)
    pages = pages.astype(jnp.bfloat16)

    def inputs(key, layers, bsz, s, ctx):
        mp = ctx // rpp
        out = []
        for _ in range(layers):
            k1, k2, k3, key = jax.random.split(key, 4)
            q = jax.random.normal(k1, (bsz, s, hi, di), jnp.bfloat16)
            wt = jax.random.normal(k2, (bsz, s, hi), jnp.bfloat16) * 0.1
            table = (1 + jax.random.permutation(k3, n_pages - 1)[: bsz * mp]).reshape(bsz, mp).astype(jnp.int32)
            vis = jnp.broadcast_to(ctx - s + 1 + jnp.arange(s, dtype=jnp.int32), (bsz, s))
            out.append((q, wt, table, vis))
        return tuple(out)

    def cands(key, bsz, s, ctx):
        n_all = ctx // bs
        r = jax.random.uniform(key, (bsz, s, n_all))
        return jnp.sort(jax.lax.top_k(r, min(nblk, n_all))[1], axis=-1).astype(jnp.int32)

    def runner(backend, what, cand=None, tile=None, keys=pages, **kw):
        def run(layers, pages, cand):
            outs = []
            for q, wt, table, vis in layers:
                if what == "scores":
                    outs.append(kidx.index_scores_paged(q, wt, pages, table, vis, numerics=REF,
                                                        candidates=cand, block_size=bs,
                                                        backend=backend, **kw))
                else:
                    outs.append(kidx.index_topk_paged(q, wt, pages, table, vis, k, numerics=REF,
                                                      candidates=cand, block_size=bs, backend=backend,
                                                      topk_tile=tile, **kw)[0])
            return tuple(outs)
        jitted = jax.jit(run)
        return lambda layers: jitted(layers, keys, cand)

    def topk_runner(tile):
        return jax.jit(lambda ss, vv: tuple(kidx.select_topk(s_, v_, k, tile) for s_, v_ in zip(ss, vv)))

    def shape_case(kind, bsz, s, ctx, reindex=False, sweep=(), xla=True):
        layers = 4 if bsz * s <= 256 else 1
        ins = inputs(jax.random.key(bsz * 7 + s + ctx), layers, bsz, s, ctx)
        cand = cands(jax.random.key(11), bsz, s, ctx) if reindex else None
        n_cols = nblk * bs if reindex else ctx
        flops = 2.0 * bsz * s * hi * n_cols * di
        key_bytes = (bsz * s if reindex else bsz) * n_cols * di * 2
        bytes_ = key_bytes + bsz * s * n_cols * 2
        meta = dict(kernel="indexer", kind=kind, batch=bsz, queries=s, ctx=ctx, cols=n_cols)
        times = {}
        for label, kw in (sweep or [("tn128w4", dict(col_tile=128, num_warps=4))]):
            times[label] = b.case(f"index/{kind}/pallas-scores[{label}]",
                                  runner("pallas", "scores", cand, **kw), (ins,), layers=layers,
                                  flops=flops, bytes_=bytes_, variant=label, **meta)
        ok = {k_: v for k_, v in times.items() if v}
        best = dict(sweep)[min(ok, key=ok.get)] if (sweep and ok) else dict(col_tile=128, num_warps=4)
        typed_run = runner("pallas", "scores", cand, **best)
        scores = typed_run(ins)
        # the same keys packed: 68 of 256 bytes a row at Di = 128, decoded in registers
        packed_run = runner("pallas", "scores", cand, keys=packed, **best)
        packed_bytes = bytes_ - key_bytes + key_bytes * packed.shape[-1] // (2 * di)
        tp = b.case(f"index/{kind}/pallas-scores[packed fp4]", packed_run, (ins,), layers=layers, flops=flops,
                    bytes_=packed_bytes, variant="packed fp4", **meta)
        if tp and ok:
            b.results["cases"][-1]["typed_over_packed"] = round(min(ok.values()) / tp, 2)
            b.results.setdefault("packed_scores_equal_typed", {})[f"{kind}/{bsz}x{s}/{ctx}"] = bool(all(
                jnp.array_equal(a_, c_) for a_, c_ in zip(packed_run(ins), scores)))
        if xla:
            tx = b.case(f"index/{kind}/xla-scores", runner("xla", "scores", cand), (ins,),
                        layers=layers, flops=flops, bytes_=bytes_, variant="xla", **meta)
            if tx and ok:
                b.results["cases"][-1]["pallas_speedup"] = round(tx / min(ok.values()), 2)
        # selection alone, on fixed scores (the typed keys')
        vis = tuple(v for *_, v in ins)
        for tile in (None, 2048, 8192):
            if tile and tile >= n_cols:
                continue
            b.case(f"index/{kind}/topk[tile={tile}]", topk_runner(tile), (scores, vis), layers=layers,
                   flops=0.0, bytes_=bsz * s * n_cols * 2, variant=f"topk tile={tile}", **meta)
        def select_runner(warps):
            return jax.jit(lambda ss, vv: tuple(ksel.select_ascending(s_, v_, k, backend="pallas",
                                                                      num_warps=warps)
                                                for s_, v_ in zip(ss, vv)))
        kernel = ksel.kernel_selects(bsz * s, n_cols, k)                 # else: XLA's sort, not the kernel
        for warps in (4, 8, 16) if kernel else ():
            b.case(f"index/{kind}/select_ascending[w={warps}]", select_runner(warps), (scores, vis),
                   layers=layers, flops=0.0, bytes_=bsz * s * n_cols * 2,
                   variant=f"select_ascending w={warps} (no sort)", **meta)
        if kernel:
            sel = select_runner(None)
            b.results.setdefault("select_ascending_equals_select_topk", {})[f"{kind}/{bsz}x{s}/{ctx}"] = bool(all(
                jnp.array_equal(a_, c_) for a_, c_ in zip(sel(scores, vis), topk_runner(None)(scores, vis))))
        # where the select kernel takes the rows a full scan's tile is unused (`index_topk_paged`)
        for tile in (None, 8192) if (reindex or not kernel) else (None,):
            if tile and tile >= n_cols:
                continue
            b.case(f"index/{kind}/pallas-scores+topk[tile={tile}]",
                   runner("pallas", "topk", cand, tile, **best), (ins,), layers=layers, flops=flops,
                   bytes_=bytes_, variant=f"scores+topk tile={tile}", **meta)
        if xla:
            b.case(f"index/{kind}/xla-scores+topk", runner("xla", "topk", cand), (ins,),
                   layers=layers, flops=flops, bytes_=bytes_, variant="xla scores+topk", **meta)
        return best

    # correctness at real widths: kernel scores vs the XLA path, and the picks they give
    ins = inputs(jax.random.key(77), 1, 4, 2, 8192 if not b.smoke else 64)
    got = runner("pallas", "scores")(ins)[0].astype(jnp.float32)
    want = runner("xla", "scores")(ins)[0].astype(jnp.float32)
    fin = jnp.isfinite(want)
    ids_p = runner("pallas", "topk")(ins)[0]
    ids_x = runner("xla", "topk")(ins)[0]
    b.results["index_check"] = {
        "max_abs_diff_vs_xla": float(jnp.max(jnp.where(fin, jnp.abs(got - want), 0))),
        "max_abs_score": float(jnp.max(jnp.where(fin, jnp.abs(want), 0))),
        "same_inf_mask": bool(jnp.all(jnp.isinf(got) == jnp.isinf(want))),
        # near-ties (bf16 scores) may swap picks between equal-quality rows: report set overlap
        "ids_overlap": float(jnp.mean(jax.vmap(lambda a, c: jnp.isin(a, c))(
            ids_p.reshape(-1, ids_p.shape[-1]), ids_x.reshape(-1, ids_x.shape[-1]))))}
    b.save()

    # tiles a program: `tiles_per_program` (the default) unless named (t1: a program a tile)
    sw = [("tn128w4", dict(col_tile=128, num_warps=4)), ("tn256w4", dict(col_tile=256, num_warps=4)),
          ("tn128w8", dict(col_tile=128, num_warps=8)), ("tn128w4t1", dict(col_tile=128, num_warps=4, tiles=1)),
          ("tn256w4t1", dict(col_tile=256, num_warps=4, tiles=1)), ("tn128w4t16", dict(col_tile=128, num_warps=4, tiles=16))]
    if b.smoke:
        shape_case("decode", 4, 1, 64, sweep=sw[:2])
        shape_case("reindex", 2, 1, 128, reindex=True)
        shape_case("prefill", 1, 16, 64,
                   sweep=[("qb1", dict(col_tile=16)), ("qb4", dict(col_tile=16, query_block=4))])
        return
    best = shape_case("decode", 32, 1, 32768, sweep=sw)
    for bsz, ctx in ((1, 32768), (128, 32768), (32, 8192), (32, 131072)):
        if b.left() < 0:
            return
        shape_case("decode", bsz, 1, ctx, sweep=[("best", best), ("best-t1", {**best, "tiles": 1})])
    for kind, bsz, s, ctx, reindex in (("verify", 32, 6, 32768, False), ("reindex", 32, 1, 131072, True),
                                  ("prefill", 1, 1024, 16384, False), ("prefill", 1, 4096, 16384, False)):
        if b.left() < 0:
            return
        # qb4: blocks of 4 queries (the step's default 2026-12-04 f; slower on the H200, 2026-12-05)
        extra = [("best-qb4", {**best, "query_block": 4})] if s > 1 else []
        shape_case(kind, bsz, s, ctx, reindex=reindex, xla=bsz * s <= 1024,
                   sweep=[("best", best), ("best-t1", {**best, "tiles": 1})] + extra)


def bench_select(b: Bench, cfg: dict):
    """The indexer's selection alone at decode row counts: one stage, two stages (first-stage
    chunk 2048 / 4096 / 8192), the default (`two_stage_chunk`) and XLA's top_k + sort; the
    candidate source's block selection (k = candidate_topk_blocks, finite picks only) likewise.
    Every variant's ids are checked equal to XLA's."""
    k = cfg["index_topk"]
    key = jax.random.PRNGKey(7)
    rows_set, widths = ((1, 4), (2048,)) if b.smoke else ((1, 8, 32, 64), (8192, 16384, 32768))
    chunks = (512,) if b.smoke else (2048, 4096, 8192)
    shapes = [(r, n, k, False) for n in widths for r in rows_set]
    kb = cfg["candidate_topk_blocks"]
    shapes += [(r, n // cfg["candidate_block_size"], kb, True) for n in widths[-1:] for r in rows_set]
    # past one program's width (contexts past 128K at ratio 4): two stages or XLA's sort
    shapes += [] if b.smoke else [(r, n, k, False) for n in (131072, 262144, 524288) for r in (1, 8, 64)]
    layers = 2 if b.smoke else 16       # independent selections a call: µs kernels, not dispatch
    for rows, n, kk, finite in shapes:
        key, k1, k2 = jax.random.split(key, 3)
        scores = tuple(jax.random.normal(k1, (layers, rows, n), jnp.float32))
        vis = tuple(jax.random.randint(k2, (layers, rows), n // 2, n + 1))

        def runner(**kw):
            return jax.jit(lambda ss, vv: tuple(ksel.select_ascending(s_, v_, kk, finite_only=finite, **kw)
                                                for s_, v_ in zip(ss, vv)))
        xla = runner(backend="xla")
        want = xla(scores, vis)
        name = f"select/{'blocks' if finite else 'rows'}/{rows}x{n}/k{kk}"
        meta = dict(kernel="select", rows=rows, columns=n, k=kk, finite_only=finite)
        variants = [("xla", xla)]
        for label, chunk in [("auto", None), ("one-stage", 0)] + [(f"chunk{c}", c) for c in chunks]:
            if (chunk == 0 and n > ksel.MAX_COLUMNS) or chunk and (chunk >= n or not ksel.chunk_fits(n, kk, chunk)):
                continue
            variants.append((label, runner(backend="pallas", chunk=chunk)))
        for label, fn in variants:
            t = b.case(f"{name}/{label}", fn, (scores, vis), layers=layers, flops=0.0, bytes_=rows * n * 4,
                       variant=label, **meta)
            if t:
                b.results["cases"][-1]["equal_xla"] = all(
                    bool(jnp.array_equal(g, w)) for g, w in zip(fn(scores, vis), want))


# ---- LM head ------------------------------------------------------------------------------------

def bench_head(b: Bench, cfg: dict):
    """The LM head (`linear.lin_f32`, bf16 normed rows) with the weight held in fp32 (an fp32 GEMM:
    before) and in bf16 (one bf16 GEMM accumulating in fp32: the same products), interleaved per
    row count; the largest |difference| of the two logits beside the largest |logit|."""
    v, d = (1024, 256) if b.smoke else (cfg["vocab_size"], cfg["hidden_size"])
    w16 = (jax.random.normal(jax.random.key(0), (v, d), jnp.float32) * d ** -0.5).astype(jnp.bfloat16)
    w32 = w16.astype(jnp.float32)
    head = jax.jit(lin_f32)
    diffs = {}
    for m in (1, 8, 32, 64):
        x = jax.random.normal(jax.random.key(m), (m, d), jnp.bfloat16)
        for name, w in (("fp32", w32), ("bf16", w16)):
            b.case(f"head {name} weight M={m}", head, (x, w), layers=1, flops=2.0 * m * v * d,
                   bytes_=w.nbytes + x.nbytes + 4 * m * v, rows=m, weight=name)
        got, want = np.asarray(head(x, w16)), np.asarray(head(x, w32))
        diffs[m] = {"max_abs_diff": float(np.abs(got - want).max()), "max_abs_logit": float(np.abs(want).max())}
    b.results["head_check"] = diffs
    b.save()


def bench_gemm_out(b: Bench, cfg: dict):
    """The FP8 dense linears (`linear.lin8` under fast numerics, restated here to force each
    route at every row count: A8 QDQ, one fp32-accumulating GEMM) with the GEMM's fp32 result
    cast afterwards and with the GEMM writing bf16 itself, at the model's query, kv, output and
    shared-expert shapes per row count; how many outputs differ between the two
    (`linear.GEMM_OUT_ROWS` takes the second from where none do)."""
    d, q, h = cfg["hidden_size"], cfg["q_lora_rank"], cfg["num_attention_heads"] * cfg["head_dim"]
    o, f = cfg["o_groups"] * cfg["o_lora_rank"], cfg["moe_intermediate_size"]
    sites = {"wq_a": (q, d), "wq_b": (h, q), "wkv": (cfg["head_dim"], d), "wo_b": (d, o), "w1": (f, d), "w2": (d, f)}
    if b.smoke:
        sites = {"wq_b": (256, 128)}
    out = {"f32_out": jnp.float32, "bf16_out": jnp.bfloat16}

    def route(x, w, dt):
        return jnp.dot(fp8_act_qdq(x), w.T, precision=HIGHEST, preferred_element_type=dt).astype(jnp.bfloat16)

    runs = {name: jax.jit(functools.partial(route, dt=dt)) for name, dt in out.items()}
    timed = (8,) if b.smoke else (1, 8, 4096, 8192)
    checked = (1, 2, 8) if b.smoke else (1, 2, 3, 4, 7, 8, 16, 32, 64, 128, 256, 1024, 4096, 8192)
    # every checked row count's GEMM in one program per route (one compile each; XLA picks each
    # dot's algorithm by its own shape, as in a program of one)
    each = {name: jax.jit(lambda xs, w, dt=dt: [route(x, w, dt) for x in xs]) for name, dt in out.items()}
    diffs = {}
    for site, (n, k) in sites.items():
        w = (jax.random.normal(jax.random.key(n + k), (n, k), jnp.float32) * k ** -0.5).astype(jnp.bfloat16)
        xs = [jax.random.normal(jax.random.key(m), (m, k), jnp.bfloat16) for m in checked]
        for x in xs:
            m = x.shape[0]
            if m in timed:
                for name, fn in runs.items():
                    b.case(f"lin8 {site} {name} M={m}", fn, (x, w), layers=1, flops=2.0 * m * n * k,
                           bytes_=w.nbytes + x.nbytes + m * n * jnp.dtype(out[name]).itemsize, rows=m,
                           site=site, route=name)
        outs = {r: each[r](xs, w) for r in runs}
        for x, got, want in zip(xs, outs["bf16_out"], outs["f32_out"]):
            ulps = np.abs(np.asarray(got).view(np.int16).astype(np.int32) - np.asarray(want).view(np.int16))
            diffs[f"{site} M={x.shape[0]}"] = {"outputs": got.size, "differ": int((ulps != 0).sum()),
                                               "max_bf16_ulps": int(ulps.max())}
        b.results["gemm_out_check"] = diffs
        b.save()


def bench_dense_fp8(b: Bench, cfg: dict):
    """The FP8 dense linears (`linear.lin8` under fast numerics) with the weight held as bf16 (its
    exact decode) and held as published (E4M3 codes + one E8M0 per 32 x 32 block): decoded inside
    the jitted call for XLA's GEMM, and read by `kernels_pallas.dense_fp8` (decode rows only), at
    the model's query, kv, output and shared-expert shapes per row count. Per pair: whether the
    outputs are bit-equal, and each compile's temp bytes (a materialized decode shows as a
    weight-sized temp)."""
    d, q, h = cfg["hidden_size"], cfg["q_lora_rank"], cfg["num_attention_heads"] * cfg["head_dim"]
    o, f = cfg["o_groups"] * cfg["o_lora_rank"], cfg["moe_intermediate_size"]
    sites = {"wq_a": (q, d), "wq_b": (h, q), "wkv": (cfg["head_dim"], d), "wo_b": (d, o), "w1": (f, d), "w2": (d, f)}
    if b.smoke:
        sites = {"wq_b": (256, 128)}

    def route(x, w):
        return jnp.dot(fp8_act_qdq(x), w.T, precision=HIGHEST, preferred_element_type=jnp.float32).astype(jnp.bfloat16)

    def kernel(x, codes, scale):
        return kdense.dense_fp8(fp8_act_qdq(x), Fp8BlockWeight(codes, scale), backend="pallas").astype(jnp.bfloat16)

    runs = {"bf16": jax.jit(route),
            "fp8_blocks": jax.jit(lambda x, codes, scale: route(x, dequant_fp8_blocks(codes, scale))),
            "fp8_kernel": jax.jit(kernel)}
    rows = (8,) if b.smoke else (1, 8, 32, 64, 4096)
    checks = {}
    for site, (n, k) in sites.items():
        w = (jax.random.normal(jax.random.key(n + k), (n, k), jnp.float32) * k ** -0.5)
        codes, scale = quant_weight_fp8(w)
        w16 = dequant_fp8_blocks(codes, scale)
        for m in rows:
            x = jax.random.normal(jax.random.key(m), (m, k), jnp.bfloat16)
            args = {"bf16": (x, w16), "fp8_blocks": (x, codes, scale), "fp8_kernel": (x, codes, scale)}
            wbytes = {"bf16": w16.nbytes, "fp8_blocks": codes.nbytes + scale.nbytes,
                      "fp8_kernel": codes.nbytes + scale.nbytes}
            for name, fn in runs.items():
                if name == "fp8_kernel" and m > kdense.MAX_ROWS:
                    continue
                temp = fn.lower(*args[name]).compile().memory_analysis()
                b.case(f"dense {site} {name} M={m}", fn, args[name], layers=1, flops=2.0 * m * n * k,
                       bytes_=wbytes[name] + x.nbytes + 2 * m * n, rows=m, site=site, hold=name,
                       temp_bytes=int(getattr(temp, "temp_size_in_bytes", -1)))
            got, want = (np.asarray(runs[r](*args[r])).view(np.int16) for r in ("fp8_blocks", "bf16"))
            checks[f"{site} M={m}"] = {"outputs": got.size, "differ": int((got != want).sum())}
            if m <= kdense.MAX_ROWS:      # the kernel sums in another order: bf16 ulps from XLA's
                ulps = np.abs(np.asarray(runs["fp8_kernel"](*args["fp8_kernel"])).view(np.int16).astype(np.int32) - want)
                checks[f"{site} M={m}"].update(kernel_differ=int((ulps != 0).sum()), kernel_max_ulps=int(ulps.max()))
        b.results["dense_fp8_check"] = checks
        b.save()


def bench_mhc_mix(b: Bench, cfg: dict):
    """The mHC mixes' GEMM (`linear.lin_f32`: bf16 stream rows [M, hc*D] by the fp32 weight
    [hc*(2+hc), hc*D]) on its two routes per row count: the fp32 GEMM, and one bf16 GEMM against
    the weight's three bf16 parts (`linear.dot_bf16_parts`); the largest |difference| of the two
    beside the largest |output|. `linear.SPLIT_ROWS` picks between them."""
    hc = cfg["hc_mult"]
    k, n = (4 * 256, hc * (2 + hc)) if b.smoke else (hc * cfg["hidden_size"], hc * (2 + hc))
    w = jax.random.normal(jax.random.key(0), (n, k), jnp.float32) * k ** -0.5
    routes = {"fp32": jax.jit(lambda x, w: linear._dot_f32(x.astype(jnp.float32), w)),
              "bf16x3": jax.jit(linear.dot_bf16_parts)}
    diffs = {}
    for m in ((8, 256) if b.smoke else (1, 8, 64, 128, 256, 512, 1024, 4096, 8192)):
        x = jax.random.normal(jax.random.key(m), (m, k), jnp.bfloat16)
        for name, f in routes.items():
            b.case(f"mhc mix {name} M={m}", f, (x, w), layers=1, flops=2.0 * m * n * k,
                   bytes_=w.nbytes + x.nbytes + 4 * m * n, rows=m, route=name)
        got, want = np.asarray(routes["bf16x3"](x, w)), np.asarray(routes["fp32"](x, w))
        exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
        # each route's largest error against the float64 dot, in units of 2^-24 sum |x w|
        # (fp32 accumulation over K terms: at most ~K of them, typically ~sqrt(K))
        unit = 2.0 ** -24 * (np.abs(np.asarray(x, np.float64)) @ np.abs(np.asarray(w, np.float64)).T)
        diffs[m] = {"max_abs_diff": float(np.abs(got - want).max()), "max_abs_out": float(np.abs(want).max()),
                    "bf16x3_error_units": float((np.abs(got - exact) / unit).max()),
                    "fp32_error_units": float((np.abs(want - exact) / unit).max())}
    b.results["mhc_mix_check"] = diffs
    b.save()


# ---- one small kernel against its XLA path (mHC Sinkhorn, RMSNorm statistic) ---------------------

def compile_variants(fns: dict, args: tuple) -> tuple[dict, dict]:
    """{backend: jitted fn} -> ({"backend/options": compiled call on args}, {same: seconds of its
    compile}): each lowered once and compiled with jit's default options and with the engine's
    (`compile_cache.compiler_options`: command buffers with WHILE / CONDITIONAL, on CUDA only). The
    compile seconds include a Pallas kernel's Triton compile (XLA runs it while compiling)."""
    opts = {"default": {}, "engine": compiler_options()} if compiler_options() else {"default": {}}
    calls, seconds = {}, {}
    for backend, f in fns.items():
        lowered = f.lower(*args)
        for oname, o in opts.items():
            t0 = time.perf_counter()
            compiled = lowered.compile(compiler_options=o) if o else lowered.compile()
            seconds[f"{backend}/{oname}"] = time.perf_counter() - t0
            calls[f"{backend}/{oname}"] = functools.partial(compiled, *args)
    return calls, seconds


def compare_variants(b: Bench, kernel: str, case: str, variants: tuple[dict, dict], **meta):
    """Time the variants of one case (`compile_variants`' calls and compile seconds; "xla/default"
    the baseline) interleaved: 15 rounds, each variant's `--reps` calls queued back to back in
    turn; median and spread of the rounds. At one token a profiler trace of each variant gives its
    launches and kernel time per call. Every variant's outputs compared bit for bit with the
    baseline's (b.results[kernel + "_check"][case]: the count of differing elements per variant)."""
    fns, compile_s = variants
    bits = lambda outs: [np.asarray(x).view(np.uint32) for x in jax.tree_util.tree_leaves(outs)]
    want = bits(fns["xla/default"]())
    check = {k: int(sum((g != w).sum() for g, w in zip(bits(f()), want)))
             for k, f in fns.items() if k != "xla/default"}
    b.results.setdefault(f"{kernel}_check", {})[case] = check
    ts = {k: [] for k in fns}
    for f in fns.values():
        jax.block_until_ready(f())
    for _ in range(15):
        for k, f in fns.items():
            t0 = time.perf_counter()
            for _ in range(b.reps):
                out = f()
            jax.block_until_ready(out)
            ts[k].append((time.perf_counter() - t0) / b.reps)
    med = {k: float(np.median(v)) * 1e3 for k, v in ts.items()}
    for k, f in fns.items():
        q = np.percentile(np.asarray(ts[k]) * 1e3, [0, 25, 50, 75, 100])
        base = "xla/" + k.split("/")[1]
        row = dict(name=f"{kernel}/{case}/{k}", kernel=kernel, variant=k, **meta,
                   ms=round(float(q[2]), 4), ms_min=round(float(q[0]), 4), ms_p25=round(float(q[1]), 4),
                   ms_p75=round(float(q[3]), 4), ms_max=round(float(q[4]), 4),
                   ms_over_xla=round(med[k] / med[base], 3), bit_differences=check.get(k, 0),
                   compile_s=round(compile_s[k], 2))
        if meta.get("tokens") == 1:
            prof = kernel_profile(lambda f=f: jax.block_until_ready(f()), 5, top=6)
            row.update(launches_per_call=prof.get("launches_per_call"),
                       kernel_ms_per_call=prof.get("device_ms_per_call"),
                       top_kernels=[(x["name"], x["ms_per_call"], x["launches_per_call"])
                                    for x in prof.get("kernels", [])])
        b.record(**row)
    b.results[f"{kernel}_bit_equal"] = all(v == 0 for c in b.results[f"{kernel}_check"].values()
                                           for v in c.values())
    b.save()


def bench_sinkhorn(b: Bench, cfg: dict):
    """One `mhc.split_sinkhorn` call (sigmoids, exp, Sinkhorn) on [T, (2 + N) N] mixes, XLA path vs
    the Pallas kernel (`compare_variants`)."""
    hc, iters, eps = cfg["hc_mult"], cfg["hc_sinkhorn_iters"], cfg["hc_eps"]
    rng = np.random.default_rng(16)
    scale = jnp.asarray([0.8, 1.0, 1.6], jnp.float32)
    base = jnp.asarray(rng.standard_normal((2 + hc) * hc), jnp.float32)
    for t in (1, 8, 32, 64) if b.smoke else (1, 8, 32, 4096):
        if b.left() < 0:
            b.record(name=f"sinkhorn/T{t}", skipped="time budget")
            continue
        m = rng.standard_normal((t, (2 + hc) * hc)).astype(np.float32) * 2
        m[::7] *= 30                                   # extreme rows: exact zeros and subnormals after exp
        fns = {backend: jax.jit(functools.partial(split_sinkhorn, hc=hc, iters=iters, eps=eps, backend=backend))
               for backend in ("xla", "pallas")}
        compare_variants(b, "sinkhorn", f"T{t}", compile_variants(fns, (jnp.asarray(m), scale, base)), tokens=t)


def bench_rmsnorm(b: Bench, cfg: dict):
    """One `rmsnorm.rms_inv` call on [T, D] rows, XLA path vs the Pallas kernel at one and at four
    rows a program (`compare_variants`), at the widths the model normalises: the mHC mixes'
    flattened streams (N x hidden, fp32), the hidden state and the query latent (bf16)."""
    hidden, eps = cfg["hidden_size"], cfg["rms_norm_eps"]
    widths = {"mhc": (cfg["hc_mult"] * hidden, jnp.float32), "hidden": (hidden, jnp.bfloat16),
              "q_lora": (cfg["q_lora_rank"], jnp.bfloat16)}
    rng = np.random.default_rng(17)
    for wname, (d, dt) in widths.items():
        for t in (1, 8, 33) if b.smoke else (1, 32, 4096):
            case = f"{wname}{d}/T{t}"
            if b.left() < 0:
                b.record(name=f"rmsnorm/{case}", skipped="time budget")
                continue
            x = rng.standard_normal((t, d)) * np.exp(2 * rng.standard_normal((t, d)))
            fns = {"xla": jax.jit(functools.partial(rms_inv, eps=eps, backend="xla"))}
            for bt in (1, 4):
                fns[f"pallas-rows{bt}"] = jax.jit(functools.partial(rms_inv, eps=eps, backend="pallas",
                                                                    block_rows=bt))
            compare_variants(b, "rmsnorm", case, compile_variants(fns, (jnp.asarray(x, dt),)),
                             tokens=t, width=d, dtype=jnp.dtype(dt).name)


def bench_hc_expand(b: Bench, cfg: dict):
    """One `hc_expand.expand_collapse` call (the mHC expand, the next collapse and both sums of
    squares) on [T, N, hidden] bf16 streams, against XLA computing the same four outputs (its rule
    and two reductions, which the model's XLA path leaves to their consumers), the kernel at a few
    block shapes (`compare_variants`; the sums differ from XLA's in their last bits: the order)."""
    hc, d = cfg["hc_mult"], cfg["hidden_size"]
    rng = np.random.default_rng(18)
    blocks = ((8, 256, 4), (16, 256, 8), (4, 512, 4), (8, 128, 4))
    for t in (1, 8, 64) if b.smoke else (1, 64, 4096, 8192):
        if b.left() < 0:
            b.record(name=f"hc_expand/T{t}", skipped="time budget")
            continue
        post = rng.random((t, hc)) * 2
        comb = rng.random((t, hc, hc))
        args = tuple(jnp.asarray(a, dt) for a, dt in (
            (rng.standard_normal((t, d)), jnp.bfloat16), (rng.standard_normal((t, hc, d)), jnp.bfloat16),
            (post, jnp.float32), (comb / comb.sum(-1, keepdims=True), jnp.float32), (rng.random((t, hc)), jnp.float32)))
        sumsq = lambda v: jnp.sum(jnp.square(v.astype(jnp.float32)), axis=tuple(range(1, v.ndim)))
        fns = {"xla": jax.jit(lambda *a: (lambda y, c: (y, c, sumsq(y), sumsq(c)))(*khc.expand_collapse(*a, backend="xla")[:2]))}
        for bt, bd, w in blocks:
            fns[f"pallas-{bt}x{bd}w{w}"] = jax.jit(functools.partial(
                khc.expand_collapse, backend="pallas", block_rows=bt, block_cols=bd, warps=w))
        # bytes: x and f read, x' and c written
        compare_variants(b, "hc_expand", f"T{t}", compile_variants(fns, args), tokens=t,
                         bytes=int(2 * t * d * (2 * hc + 2)))


# ---- MoE ----------------------------------------------------------------------------------------

# launch parameters of the grouped GEMM tried at batched-decode sizes (`--sections moe-sweep-decode`,
# FP8 rows and bf16)
# (a first sweep, 2026-12-04, FP8 rows at 32 / 64 tokens: 256-column blocks, a K step of 256
# with any stages / warps, and 6 stages were 1.2-1.4x slower than the default; 64 columns faster;
# a second, the weight tile as the MMA's first operand (transposed product, 64 / 128 weight rows):
# 1.2-1.5x slower for FP8 rows, equal for bf16)
DECODE_SWEEP = [("auto", {}), ("bn64", dict(block_n=64)), ("bn32", dict(block_n=32)),
                ("bn64w8", dict(block_n=64, num_warps=8)), ("bn64s3", dict(block_n=64, num_stages=3)),
                ("bn64bk64", dict(block_n=64, block_k=64))]
# launch parameters of the decode GEMVs tried at 1-2 tokens (`--sections moe-sweep-gemv`, FP8 rows;
# the K step must divide F = 2304 = 9 x 256)
GEMV_SWEEP = [("gemv", {}), ("gemv-bn64", dict(block_n=64)), ("gemv-bn16", dict(block_n=16)),
              ("gemv-bk128", dict(block_k=128)), ("gemv-w4", dict(num_warps=4)),
              ("gemv-s4", dict(num_stages=4)), ("gemv-s2", dict(num_stages=2)),
              ("gemv-bn64w4", dict(block_n=64, num_warps=4)), ("gemv-bn16w4", dict(block_n=16, num_warps=4))]


# launch shapes of the two decode GEMV kernels timed alone (`--sections moe-gemv-parts`, FP8 rows,
# 1 token): (block_n, block_k, warps, stages); gate/up's K is D = 5,120, down's is F = 2,304 = 9 x
# 256, which no K step past 256 divides. Longer K steps put more bytes in flight a program (the
# kernels read 3.0-3.2 TB/s on the H200 where XLA's one-row GEMVs reach 3.3-4.65, BENCHMARKS.md q)
GEMV_PARTS = {"gate_up": [(32, 256, 8, 3), (32, 512, 8, 3), (16, 1024, 8, 3), (32, 1024, 8, 2), (16, 512, 4, 3),
                          (64, 512, 8, 2), (16, 256, 4, 3)],
              "down": [(32, 256, 8, 3), (16, 256, 4, 3), (64, 256, 8, 3), (32, 128, 4, 4), (128, 256, 8, 2)]}


def fp4_weight(key, shape) -> Fp4Weight:
    """Random experts held as published: uniform E2M1 codes (rms 2.93) under E8M0 2^-7 (rms ~0.023)."""
    return Fp4Weight(jax.random.bits(key, (*shape[:-1], shape[-1] // 2), jnp.uint8),
                     jnp.full((*shape[:-1], shape[-1] // 32), 120, jnp.uint8))


def bench_moe(b: Bench, cfg: dict, decode_only: bool = False, sweep_only: bool = False,
              helds: tuple[str, ...] = ("bf16", "fp8", "fp4"), decode_sweep: bool = False,
              gemv_sweep: bool = False, gemv_parts_sweep: bool = False):
    d, f, e, k = cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["n_routed_experts"], cfg["num_experts_per_tok"]
    limit = cfg["swiglu_limit"]
    if b.smoke:
        d, f, e, k = 256, 128, 8, 2
    kw1, kw3, kw2 = jax.random.split(jax.random.key(6), 3)
    w1 = (jax.random.normal(kw1, (e, f, d), jnp.bfloat16) * 0.02).astype(jnp.bfloat16)
    w3 = (jax.random.normal(kw3, (e, f, d), jnp.bfloat16) * 0.02).astype(jnp.bfloat16)
    w2 = (jax.random.normal(kw2, (e, d, f), jnp.bfloat16) * 0.02).astype(jnp.bfloat16)

    @functools.cache
    def weights(held):
        """(w1, w3, w2) as held, built on first use (a run filtered to bf16 builds no other)."""
        if held == "bf16":
            return w1, w3, w2
        if held == "fp4":
            return fp4_weight(kw1, (e, f, d)), fp4_weight(kw3, (e, f, d)), fp4_weight(kw2, (e, d, f))
        return tuple(Fp8RowWeight.from_fp4(w) for w in weights("fp4"))

    def inputs(key, t, layers=1):
        """`layers` independent (x, idx, wt) triples; one timed call runs them all."""
        out = []
        for key in jax.random.split(key, layers):
            k1, k2, k3 = jax.random.split(key, 3)
            out.append((jax.random.normal(k1, (t, d), jnp.bfloat16),
                        jax.lax.top_k(jax.random.uniform(k2, (t, e)), k)[1].astype(jnp.int32),
                        jax.random.uniform(k3, (t, k), jnp.float32)))
        return tuple(out)

    def runner(backend, impl=None, held="bf16", **kw):
        jitted = jax.jit(lambda ins, w1_, w3_, w2_: tuple(kmoe.routed_experts(
            x, idx, wt, w1_, w3_, w2_, FAST, limit, backend=backend, impl=impl, **kw) for x, idx, wt in ins))
        return lambda ins: jitted(ins, *weights(held))

    def shape_case(t, sweep=None, others=True):
        # one layer per call: the layers would share the weights here, and XLA merges dots with a
        # shared operand (the dense and loop paths then read the weights once for all layers);
        # the queued timing already keeps host dispatch out of the device time
        ins = inputs(jax.random.key(t), t)
        active = int(jnp.sum(jnp.bincount(ins[0][1].reshape(-1), length=e) > 0))
        flops = 6.0 * t * k * d * f
        wbytes = {h: active * (2 * held_bytes(h, (f, d)) + held_bytes(h, (d, f))) for h in ("bf16", "fp8", "fp4")}

        def case(name, fn, variant, held="bf16"):
            return b.case(f"moe/T{t}/{name}", fn, (ins,), layers=1, flops=flops, bytes_=wbytes[held],
                          variant=variant, kernel="moe", tokens=t, experts=e, topk=k,
                          active_experts=float(active), weight_bytes=wbytes[held], experts_held=held)

        times = {}
        for label, kw in (sweep or [("auto", {})]):
            for held in helds:
                kw_ = dict(kw)
                tag = label if held == "bf16" else f"{held}-{label}"     # bf16 names as in earlier runs
                impl = kw_.pop("impl", None)
                chosen = impl or kmoe.auto_impl(t, *weights(held), FAST)
                times[tag] = case(f"pallas[{tag}]", runner("pallas", impl, held, **kw_),
                                  f"pallas {tag} ({chosen})", held)
        if not others:
            return times
        tr = case("ragged_dot", runner("pallas", "ragged_dot"), "ragged_dot")
        td = case("dense", runner("pallas", "dense"), "dense all-experts") if t <= (64 if b.smoke else 2048) else None
        if t >= (16 if b.smoke else 512):   # Mosaic GPU (NVIDIA-only) warp-specialised GEMMs
            mg = [case(label, runner("pallas", "mgpu", **kw), f"mosaic-gpu {label}")
                  for label, kw in (("mgpu", {}), ("mgpu-m128", dict(block_m=128)))]
            if times.get("auto") and any(mg):
                b.results.setdefault("moe_speedups", {})[f"T{t}/mgpu_vs_pallas"] = \
                    round(times["auto"] / min(m for m in mg if m), 2)
        tc = None
        if t >= 16:   # fixed-capacity dispatch + batched vendor GEMMs; C = kmoe.capacity_rows
            tc = case("capacity", runner("pallas", "capacity"), "capacity dispatch")
            for held in helds:
                if held != "bf16" and t >= (16 if b.smoke else 512):
                    case(f"capacity[{held}]", runner("pallas", "capacity", held), f"capacity {held}", held)
        if t <= 8:
            case("xla-reference", runner("xla"), "xla reference loop")
        ok = {k_: v for k_, v in times.items() if v and not k_.startswith("fp")}   # vs the bf16 XLA paths
        if ok:
            for other, name in ((tr, "ragged_dot"), (td, "dense"), (tc, "capacity")):
                if other:
                    b.results.setdefault("moe_speedups", {})[f"T{t}/pallas_vs_{name}"] = round(other / min(ok.values()), 2)
            b.save()
        return times

    def gemv_parts(t, held="bf16", shapes=None):
        """The two GEMV kernels alone (no routing bookkeeping, no fp8 fake-quant between them),
        with the default launch, or with each of `shapes` ({"gate_up": [...], "down": [...]} of
        (block_n, block_k, warps, stages)), each checked against the first one checked (named in the row)."""
        layers = 8
        ins = inputs(jax.random.key(t + 1), t, layers)
        pes = tuple(jnp.sort(idx, axis=-1).reshape(-1) for _, idx, _ in ins)
        pws = tuple(wt.reshape(-1) for _, _, wt in ins)
        xs = tuple(x for x, _, _ in ins)
        a_s = tuple(jnp.ones((t * k, f), jnp.bfloat16) * 0.01 for _ in ins)
        w1_, w3_, w2_ = weights(held)
        meta = dict(kernel="moe-part", tokens=t, experts=e, topk=k, experts_held=held)
        default = (32, 128 if b.smoke else 256, 8, 3)
        # part -> (kernel on one layer's inputs, the weights and a launch; the layers' inputs, the
        # weights (jit arguments, not constants); K, N, FLOPs, weight bytes)
        parts = {"gate_up": (lambda pe, pw, x, a, c, launch: kmoe.gemv_gate_up(pe, pw, x, a, c, limit=limit, **launch),
                             (pes, pws, xs), (w1_, w3_), d, f, 4.0 * t * k * d * f, t * k * 2 * held_bytes(held, (f, d))),
                 "down": (lambda pe, a, w, launch: kmoe.gemv_down(pe, a, w, **launch),
                          (pes, a_s), (w2_,), f, d, 2.0 * t * k * d * f, t * k * held_bytes(held, (d, f)))}
        for part, (call, per_layer, shared, kdim, ndim, flops, nbytes) in parts.items():
            first = []

            def check(out, shape, first=first):
                y = np.asarray(out[0], np.float32)
                first[:] = first or [shape, y]               # the first launch checked is the reference
                return {"max_abs_vs_reference_launch": float(np.max(np.abs(y - first[1]))),
                        "reference_launch": first[0]}

            for bn, bk, warps, stages in (shapes[part] if shapes else [default]):
                if kdim % bk or ndim % bn:
                    continue                                  # smoke widths: the launch does not divide them
                shape = [bn, bk, warps, stages]
                launch = dict(numerics=FAST, bn=bn, bk=bk, num_warps=warps, num_stages=stages,
                              interpret=kmoe._backend.interpret())
                name = f"moe/T{t}/gemv_{part}_only" + (f"[{held}-{bn}x{bk}w{warps}s{stages}]" if shapes else "")
                fn = jax.jit(lambda per, ws, call=call, launch=launch: tuple(
                    call(*(p[i] for p in per), *ws, launch) for i in range(layers)))
                b.case(name, fn, (per_layer, shared), layers=layers, check=functools.partial(check, shape=shape),
                       flops=flops, bytes_=nbytes, launch=shape, **meta)

    if gemv_sweep:         # decode at 1-2 tokens: one weight stream per (token, expert) pair
        for t in ((1,) if b.smoke else (1, 2)):
            shape_case(t, [(label, dict(impl="gemv", **kw)) for label, kw in GEMV_SWEEP], others=False)
        return
    if gemv_parts_sweep:   # each GEMV kernel alone at 1 token over launch shapes, FP8 rows
        gemv_parts(1, "fp8", GEMV_PARTS)
        return
    if decode_sweep:       # batched decode: the grouped GEMM streams the weights of ~all experts
        grouped = lambda kw: dict(impl="pallas", **kw)
        for t in ((16,) if b.smoke else (16, 32, 64, 128)):
            shape_case(t, [(label, grouped(kw)) for label, kw in DECODE_SWEEP], others=False)
        return
    if b.smoke and not sweep_only:
        shape_case(16, [("auto", {}), ("bm32", dict(block_m=32))])
    elif sweep_only:
        gemv = lambda **kw: dict(impl="gemv", **kw)
        for t in (1, 8):
            shape_case(t, [("auto", {}), ("gemv-bn16", gemv(block_n=16))], others=t == 1)
            gemv_parts(t)
        if b.smoke:
            return
        grouped = lambda **kw: dict(impl="pallas", **kw)
        # one 256-row tile per expert (192 rows at 2K tokens): each weight tile is read by one
        # program instead of two, at the same MMA padding as two 128-row tiles
        for t in (2048, 8192):
            shape_case(t, [("auto", {}), ("bm256bn64", grouped(block_m=256, block_n=64)),
                           ("bm256bn64s2", grouped(block_m=256, block_n=64, num_stages=2)),
                           ("bm256bn128", grouped(block_m=256, block_n=128))], others=False)
        return
    else:
        for t in (1, 8):                                       # decode: weight streams
            shape_case(t, [("auto", {})])
        x, idx, wt = inputs(jax.random.key(77), 1)[0]
        got, want = runner("pallas", "gemv")(((x, idx, wt),))[0], runner("xla")(((x, idx, wt),))[0]
        b.results["moe_gemv_check"] = {"tokens": 1, "max_abs_diff_vs_reference": float(jnp.max(jnp.abs(got - want))),
                                       "max_abs_out": float(jnp.max(jnp.abs(want)))}
        for held in ("fp8", "fp4"):
            got = runner("pallas", "gemv", held)(((x, idx, wt),))[0]
            want = runner("xla", held=held)(((x, idx, wt),))[0]
            b.results[f"moe_gemv_{held}_check"] = {"tokens": 1, "max_abs_diff_vs_reference": float(jnp.max(jnp.abs(got - want))),
                                                   "max_abs_out": float(jnp.max(jnp.abs(want)))}
        b.save()
        if decode_only:
            return
        for t in (32, 128, 256, 512, 2048, 8192):
            if b.left() < 0:
                break
            # where the auto choice is not the Triton grouped GEMM (GEMV, or the Mosaic path), time
            # it too
            grouped = [] if kmoe.auto_impl(t, *weights("bf16"), FAST) == "pallas" else [("grouped", dict(impl="pallas"))]
            shape_case(t, [("auto", {})] + grouped)
    ins = inputs(jax.random.key(1234), 64)
    got = runner("pallas", "pallas")(ins)[0]
    want = runner("pallas", "ragged_dot")(ins)[0]
    b.results["moe_check"] = {"tokens": 64, "max_abs_diff_vs_ragged_dot": float(jnp.max(jnp.abs(got - want))),
                              "max_abs_out": float(jnp.max(jnp.abs(want)))}
    for held in ("fp8", "fp4"):
        got = runner("pallas", "pallas", held)(ins)[0]
        want = runner("pallas", "ragged_dot", held)(ins)[0]
        b.results[f"moe_{held}_check"] = {"tokens": 64, "max_abs_diff_vs_ragged_dot": float(jnp.max(jnp.abs(got - want))),
                                          "max_abs_out": float(jnp.max(jnp.abs(want)))}
    b.save()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench_kernels.json")
    ap.add_argument("--sections", default="peak,attn,indexer,moe")
    ap.add_argument("--budget", type=float, default=420.0, help="seconds; later cases are skipped")
    ap.add_argument("--section-budget", type=str, default="", help="e.g. attn=150,indexer=120")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--experts", type=int, default=None,
                    help="routed experts for the MoE sections (default: the config's)")
    ap.add_argument("--cases", default=None, help="regex: time only the cases whose name matches "
                    "(e.g. to profile one kernel under ncu)")
    args = ap.parse_args(argv)
    with open(CONFIG) as f:
        cfg = json.load(f)["text_config"]
    if args.experts:
        cfg["n_routed_experts"] = args.experts
    b = Bench(args.out, args.budget, args.reps, args.smoke, args.cases)
    caps = dict(kv.split("=") for kv in args.section_budget.split(",") if kv)
    funcs = {"peak": bench_peak, "head": bench_head, "select": bench_select, "attn": bench_attn, "indexer": bench_indexer, "moe": bench_moe,
             "sinkhorn": bench_sinkhorn, "rmsnorm": bench_rmsnorm, "hc-expand": bench_hc_expand, "mhc-mix": bench_mhc_mix, "gemm-out": bench_gemm_out, "dense-fp8": bench_dense_fp8,
             "moe-decode": functools.partial(bench_moe, decode_only=True),
             "moe-sweep": functools.partial(bench_moe, sweep_only=True),
             "moe-sweep-decode": functools.partial(bench_moe, decode_sweep=True, helds=("fp8", "bf16")),
             "moe-sweep-gemv": functools.partial(bench_moe, gemv_sweep=True, helds=("fp8",)),
             "moe-gemv-parts": functools.partial(bench_moe, gemv_parts_sweep=True), "attn-sweep": functools.partial(bench_attn, sweep_only=True)}
    for name in args.sections.split(","):
        if b.left() < 0:
            print(f"skip {name}: budget", flush=True)
            continue
        start_deadline = b.deadline
        if name in caps:
            b.deadline = min(b.deadline, time.time() + float(caps[name]))
        t0 = time.time()
        try:
            fn = funcs[name]
            fn(b) if name == "peak" else fn(b, cfg)
        except Exception:
            traceback.print_exc()
            b.results.setdefault("section_errors", {})[name] = traceback.format_exc()[-1500:]
        b.deadline = start_deadline
        b.results.setdefault("section_seconds", {})[name] = round(time.time() - t0, 1)
        b.save()
    print_table(b.results)


def print_table(res):
    print(f"\n{res['device']} jax {res['jax']} {res['date']}  peak {res.get('peak')}")
    for c in res["cases"]:
        if "ms" in c and "tflops" not in c:
            print(f"{c['name']:<48} {c['ms']:>9.4f} ms (rounds {c['ms_min']:.4f}-{c['ms_max']:.4f}) "
                  f"x{c['ms_over_xla']} of XLA; launches/call {c.get('launches_per_call', '-')}; "
                  f"compile {c.get('compile_s', '-')} s")
        elif "ms" in c:
            extra = f" x{c['pallas_speedup']}" if "pallas_speedup" in c else ""
            if c.get("agrees_xla") is False:
                extra += f"  DISAGREES with the XLA path (max |diff| {c['max_abs_diff_xla']:.3g})"
            print(f"{c['name']:<48} {c['ms']:>9.4f} ms {c['tflops']:>7.1f} TF/s {c['gbs']:>8.1f} GB/s{extra}")
        else:
            print(f"{c['name']:<48} {c.get('error') or c.get('skipped')}"[:160])
    for k in ("head_check", "attn_check", "index_check", "moe_check", "moe_gemv_check", "moe_speedups",
              "sinkhorn_check", "sinkhorn_bit_equal", "rmsnorm_check", "rmsnorm_bit_equal", "gemm_out_check"):
        if k in res:
            print(k, res[k])


if __name__ == "__main__":
    main()
