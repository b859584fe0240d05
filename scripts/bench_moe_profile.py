"""MoE device time by kernel at real widths (64 experts, 5120 / 2304, top-6; T env, default 2048):
each argument NAME=JSON runs `routed_experts(..., backend="pallas", **JSON)` 5 times under
`bench_common.kernel_profile`; prints the top kernels and the max |diff| against the first
argument's output; writes $OUT/prof_moe_T{T}.json. As run for BENCHMARKS.md (H200 calls 3-7):
    python3 scripts/bench_moe_profile.py 'pallas={"impl":"pallas"}' 'mgpu={"impl":"mgpu"}'
"""
import json, os, sys, jax, jax.numpy as jnp
sys.path.insert(0, ".")
from scripts.bench_common import kernel_profile
from kernels_pallas import moe as kmoe
from v41_jax.model.numerics import Numerics
FAST = Numerics.fast()
e, d, f, k, t = 64, 5120, 2304, 6, int(os.environ.get("T", "2048"))
ks = jax.random.split(jax.random.key(0), 6)
w1 = (jax.random.normal(ks[0], (e, f, d), jnp.bfloat16) * 0.02).astype(jnp.bfloat16)
w3 = (jax.random.normal(ks[1], (e, f, d), jnp.bfloat16) * 0.02).astype(jnp.bfloat16)
w2 = (jax.random.normal(ks[2], (e, d, f), jnp.bfloat16) * 0.02).astype(jnp.bfloat16)
x = jax.random.normal(ks[3], (t, d), jnp.bfloat16)
idx = jax.lax.top_k(jax.random.uniform(ks[4], (t, e)), k)[1].astype(jnp.int32)
wt = jax.random.uniform(ks[5], (t, k), jnp.float32)
out = {}
want = None
for name, kw in [(a, json.loads(b)) for a, b in (s.split("=", 1) for s in sys.argv[1:])]:
    fn = jax.jit(lambda x, idx, wt, w1, w3, w2: kmoe.routed_experts(x, idx, wt, w1, w3, w2, FAST, 10.0, backend="pallas", **kw))
    got = fn(x, idx, wt, w1, w3, w2)
    if want is None:
        want = got
    err = float(jnp.max(jnp.abs(got - want)))
    prof = kernel_profile(lambda: jax.block_until_ready(fn(x, idx, wt, w1, w3, w2)), 5)
    out[name] = dict(err_vs_first=err, max_out=float(jnp.max(jnp.abs(want))), **prof)
    print(name, "err", err, "device ms", prof.get("device_ms_per_call"))
    for r in prof.get("kernels", [])[:8]:
        print("   ", r)
json.dump(out, open(os.environ["OUT"] + f"/prof_moe_T{t}.json", "w"), indent=1)
