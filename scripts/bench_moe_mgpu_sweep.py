"""The Mosaic GPU MoE kernels alone (`moe_mgpu.grouped_swiglu` / `grouped_matmul`) on the tile
table of a 2K-token step (64 experts, 5120 / 2304, top-6; T env), over a few CTA tiles, splits
and ring depths: ms and TFLOP/s on the computed and on the real rows; writes
$OUT/sweep_gemm_T{T}.json. As run for BENCHMARKS.md (H200 call 6):
    python3 scripts/bench_moe_mgpu_sweep.py
"""
import json, os, sys, functools, jax, jax.numpy as jnp
sys.path.insert(0, ".")
from kernels_pallas import moe_mgpu, moe as kmoe
from scripts.bench_common import queued_median_s as tm_
e, d, f, k = 64, 5120, 2304, 6
T = int(os.environ.get("T", "2048"))
idx = jax.lax.top_k(jax.random.uniform(jax.random.key(4), (T, e)), k)[1].astype(jnp.int32)
sizes = jnp.bincount(idx.reshape(-1), length=e).astype(jnp.int32)
rows = []
w1 = (jax.random.normal(jax.random.key(1), (e, f, d), jnp.bfloat16) * 0.02).astype(jnp.bfloat16)
w3 = (jax.random.normal(jax.random.key(3), (e, f, d), jnp.bfloat16) * 0.02).astype(jnp.bfloat16)
w2 = (jax.random.normal(jax.random.key(5), (e, d, f), jnp.bfloat16) * 0.02).astype(jnp.bfloat16)
cfgs = [("glu", 256, 64, "m", 3), ("glu", 256, 64, "m", 4), ("glu", 128, 128, "n", 3), ("glu", 256, 128, "n", 2),
        ("down", 256, 128, "m", 3), ("down", 256, 128, "m", 4), ("down", 128, 256, "n", 3), ("down", 256, 256, "n", 2)]
for name, tmm, tn, sp, st in cfgs:
    te, _, _ = kmoe.tile_table(sizes, tmm, T * k)
    live = int(jnp.sum(te >= 0))
    kk = d if name == "glu" else f
    n = f if name == "glu" else d
    x = jax.random.normal(jax.random.key(2), (te.shape[0] * tmm, kk), jnp.bfloat16)
    kw = dict(tile_m=tmm, tile_n=tn, split=sp, steps=st)
    try:
        if name == "glu":
            rw = jnp.ones((x.shape[0],), jnp.float32)
            fn = jax.jit(functools.partial(moe_mgpu.grouped_swiglu, limit=10.0, **kw)); args = (x, w1, w3, rw, te); fl = 4
        else:
            fn = jax.jit(functools.partial(moe_mgpu.grouped_matmul, **kw)); args = (x, w2, te); fl = 2
        s = tm_(fn, *args)
        row = dict(gemm=name, **kw, live_tiles=live, ms=round(s*1e3, 4),
                   tflops_computed=round(fl*live*tmm*n*kk/s/1e12, 1), tflops_real=round(fl*T*k*n*kk/s/1e12, 1))
    except Exception as ex:
        row = dict(gemm=name, **kw, error=str(ex)[:300])
    print(row, flush=True); rows.append(row)
json.dump(rows, open(os.environ["OUT"] + f"/sweep_gemm_T{T}.json", "w"), indent=1)
