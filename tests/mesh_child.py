"""The mesh checks, run by tests/test_mesh.py in a child process of 8 CPU devices.

jax fixes its device count when its backend starts, so these run in their own process with
`XLA_FLAGS=--xla_force_host_platform_device_count=8` (the rest of the suite keeps one device). The
child runs every check and prints one JSON report on its last line; the parent asserts on it. It
does not join a `jax.distributed` run: that switches even one process's CPU collectives to gloo
over TCP; the two-process test (tests/mesh_hosts_child.py) covers that path.

    python -m tests.mesh_child OUT_DIR
"""

from __future__ import annotations

import faulthandler
import json
import socket
import sys
import time
from dataclasses import replace
from pathlib import Path

import jax
import numpy as np

from kernels_pallas.sparse_attn import decode_rows
from scripts.make_checkpoint import make_checkpoint
from v41_jax.cache.geometry import KV_PACKED, EngineSettings, row_formats
from v41_jax.checkpoint import load as load_mod
from v41_jax.model.numerics import Numerics
from v41_jax.runtime.engine import Engine, Stats
from v41_jax.runtime.metadata import Bucket, BucketSet
from v41_jax.runtime.request import Request
from v41_jax.runtime.sampling import SamplingParams
from tests.engine_common import ROOT  # also: the suite's persistent compilation cache


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


# the tiny engine both children run: 8 slots, two small buckets, prompts of mixed lengths (their
# chunked prefills and decodes share steps)
BUCKETS = BucketSet((Bucket(tokens=8, requests=4, logits=8), Bucket(tokens=24, requests=4, logits=8)))
# the larger bucket alone: the same steps (the largest bucket sets a step's limits), padded to it,
# one compile per engine instead of two; the mesh of 8 keeps both (a rank's bucket choice)
ONE_BUCKET = BucketSet(BUCKETS.buckets[-1:])
SETTINGS = EngineSettings(page_tokens=8, num_pages=96, slots=8, max_context=128, kv_format="f32",
                          index_format="f32")
PROMPT_LENGTHS = (5, 23, 40, 9)


def tiny_engine(cfg, params, token_map, mesh=None, device_engram=None, buckets=BUCKETS) -> Engine:
    return Engine(params, cfg, settings=SETTINGS, buckets=buckets, numerics=Numerics.fp32(),
                  token_map=token_map, prefill_chunk=16, speculative=False, mesh=mesh,
                  device_engram=device_engram)


def generate(eng: Engine) -> list[list[int]]:
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, eng.cfg.vocab_size - 1, n).tolist() for n in PROMPT_LENGTHS]
    return [r.tokens for r in eng.generate([Request(p, 6, ignore_eos=True) for p in prompts])]


def main(out: Path) -> dict:
    report = {"seconds": {}}
    clock = [time.perf_counter()]

    def lap(name):
        now = time.perf_counter()
        report["seconds"][name] = round(now - clock[0], 1)
        clock[0] = now
        # on stderr as it happens: the parent shows the stderr tail when the child fails, so a hang
        # names the section after the last one listed
        print(f"mesh_child: {name} done in {report['seconds'][name]} s", file=sys.stderr, flush=True)
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    from kernels_pallas import backend as kernel_backend
    from kernels_pallas import moe as kmoe
    from v41_jax.checkpoint import converted
    from v41_jax.model import expert_parallel as ep
    from v41_jax.runtime.mesh import AXIS, expert_sharding, make_mesh
    from v41_jax.tools import memory_plan

    # ---- expert-parallel MoE alone: one device's result, for every device count ---------------
    rng = np.random.default_rng(0)
    t, d, f, e, k = 24, 64, 32, 16, 3
    idx = jnp.asarray(np.stack([rng.choice(e, k, replace=False) for _ in range(t)]), jnp.int32)
    wts = jnp.asarray(rng.random((t, k)), jnp.float32)
    experts = {n: jnp.asarray(rng.standard_normal(s) * 0.1, jnp.bfloat16)
               for n, s in (("w1", (e, f, d)), ("w3", (e, f, d)), ("w2", (e, d, f)))}
    # every pick on experts 0-3 (devices 0 and 1 of 8): each of the two holds half the 72 picks, 4x
    # its uniform share (9), and computes them in two rounds of 21 (`ep.round_rows`)
    skewed = jnp.asarray(np.stack([rng.permutation(4)[:k] for _ in range(t)]), jnp.int32)
    moe = {}
    # fp32 numerics only on the Pallas path: XLA:CPU's fp32 GEMMs sum in an order that depends on
    # the program around them (one device alone, jitted vs eager: 3.6e-7 apart), so there neither
    # side is a fixed value to equal; the fp32 XLA path is covered end to end by the tiny logits
    cases = (("fast", "xla", (2, 4, 8)), ("fast", "pallas", (8,)), ("fp32", "pallas", (8,)))
    for name, backend, counts in cases:                   # Pallas: interpret mode is slow
        numerics = Numerics.fast() if name == "fast" else Numerics.fp32()
        x = jnp.asarray(rng.standard_normal((t, d)), numerics.act_dtype)
        with kernel_backend.use_backend(backend):
            for n in counts:
                axis = ep.ExpertAxis(AXIS, n)
                fn = jax.jit(jax.shard_map(lambda x, i, w, ex: ep.routed_experts(x, i, w, ex, numerics, 10.0, axis),
                                           mesh=make_mesh(n), in_specs=(P(AXIS),) * 4, out_specs=P(AXIS),
                                           check_vma=False))
                for label, picks in (("", idx), ("/skewed", skewed)) if backend == "xla" and n == 8 else (("", idx),):
                    one = np.asarray(kmoe.routed_experts(x, picks, wts, experts["w1"], experts["w3"], experts["w2"],
                                                         numerics, 10.0))
                    got = np.asarray(fn(x, picks, wts, experts))
                    moe[f"{name}/{backend}/{n}{label}"] = {"equal": bool(np.array_equal(got, one)),
                                                           "max_abs": float(np.abs(got - one).max())}
    report["moe"] = moe
    lap("moe")

    # ---- tiny through generate and teacher-forced runs, a mesh of 8 ------------------------------
    make_checkpoint(str(ROOT / "v41_jax/configs/tiny.config.json"), str(out / "tiny"), 0)
    cfg, params = load_mod.load_params(out / "tiny", progress=False)
    token_map = load_mod.load_token_map(out / "tiny", cfg)
    tf_tokens = rng.integers(3, cfg.vocab_size - 1, 24)
    engine = lambda mesh=None, **kw: tiny_engine(cfg, params, token_map, mesh, buckets=ONE_BUCKET, **kw)

    def teacher_forced(eng, slot):
        """24 tokens in spans of 8 on `slot` (its rank's pages), every row's logits -> [24, V]."""
        rank = slot // (SETTINGS.slots // eng.runner.ranks)
        pages = eng.pages.allocate(eng.geom.pages_for(len(tf_tokens)), rank)
        out = []
        for pos in range(0, len(tf_tokens), 8):
            span = eng.make_span("tf", slot, pos, tf_tokens[pos: pos + 8], pages, eng.cursors()[slot], all_logits=True)
            out.append(np.asarray(eng.run([span]).logits[:8]))
        return np.concatenate(out)

    def split(eng, before) -> dict:
        """`before` (a cache array a later step took) donated; every cache array and the experts split."""
        spec = NamedSharding(eng.runner.mesh, P(AXIS))
        return {"donated": before.is_deleted(),
                "cache_split": all(a.sharding.is_equivalent_to(spec, a.ndim) for a in jax.tree.leaves(eng.cache)),
                "experts_split": eng.params["layers"][0]["ffn"]["experts"]["w1"].sharding.is_equivalent_to(spec, 3)}

    single = engine()
    want_tokens, want_logits = generate(single), teacher_forced(single, SETTINGS.slots - 1)
    lap("tiny one device")
    # 8 devices (the released model's count with FP8 experts), two buckets (each rank's step takes
    # the bucket its rows need), on the released model's path: Engram tables on the host, each
    # step's decode tokens and their Engram rows handed off through it. The device feedback path
    # (Engram on the device) is the demo model's on 4 below. (A mesh of 2 ran the host path here
    # before 2026-12-07: one more compile, 20-25 s of the suite's 2 busy cores.)
    eng = tiny_engine(cfg, params, token_map, make_mesh(8), device_engram=False)
    got = generate(eng)
    before = eng.cache.window
    logits = teacher_forced(eng, SETTINGS.slots - 1)           # the last rank's last slot
    tiny = {8: {"tokens_equal": got == want_tokens, "tokens": got, "device_feedback": eng.runner.device_feedback,
                "logits_max_abs": float(np.abs(logits - want_logits).max()), **split(eng, before)}}
    lap("tiny/8")
    report["tiny"] = {"want_tokens": want_tokens, "meshes": tiny}

    # ---- main and window rows packed on a mesh of 2: the typed mesh's computation bit for bit -
    # (tests/test_kv_rows_packed.py's property, each rank's cache shard packed: FP4 main, FP8
    # window rows need the fake-quant numerics, so bf16 ones here)
    fast = Numerics.fast()
    row_engine = lambda kv: Engine(params, cfg, settings=replace(SETTINGS, **row_formats(fast, kv_format=kv)),
                                   buckets=ONE_BUCKET, numerics=fast, token_map=token_map, prefill_chunk=16,
                                   speculative=False, mesh=make_mesh(2))
    typed, packed = row_engine(None), row_engine(KV_PACKED)
    # two prompts past the window and several compressed rows (a chunked prefill), one greedy, one
    # sampled; 4 new tokens (the two engines' compiles are most of this section's time)
    prompts = [rng.integers(3, cfg.vocab_size - 1, n).tolist() for n in (23, 40)]
    reqs = lambda: [Request(p, 4, SamplingParams(temperature=0.8, seed=i) if i % 2 else SamplingParams(),
                            ignore_eos=True, request_id=i, logprobs=True) for i, p in enumerate(prompts)]
    want_r, got_r = typed.generate(reqs()), packed.generate(reqs())
    planes = [*zip(typed.cache.main, packed.cache.main), (typed.cache.window, packed.cache.window)]
    bits = lambda x: np.asarray(x, np.float32).view(np.uint32)
    report["packed"] = {
        "tokens_equal": [g.tokens for g in got_r] == [w.tokens for w in want_r],
        "logprobs_equal": all(np.array_equal(bits(g.logprobs), bits(w.logprobs)) for g, w in zip(got_r, want_r)),
        "planes_equal": all(np.array_equal(bits(decode_rows(b, cfg.head_dim, jnp.float32)), bits(a))
                            for a, b in planes),
        "rows_written": sum(int(np.count_nonzero(np.asarray(a, np.float32))) for a, _ in planes),
        "packed_dtypes": sorted({str(b.dtype) for _, b in planes}),
        "cache_split": all(b.sharding.is_equivalent_to(NamedSharding(packed.runner.mesh, P(AXIS)), b.ndim)
                           for _, b in planes)}
    lap("tiny/2 packed rows")

    # ---- loading: each device's experts read alone, values equal, bytes as the plan ----------
    reads = []
    real = load_mod._convert
    load_mod._convert = lambda ckpt, unit, spec, *hold: (reads.append((unit.stacked, len(unit.names))),
                                                          real(ckpt, unit, spec, *hold))[1]
    mesh = make_mesh(8)
    _, sharded = load_mod.load_params(out / "tiny", progress=False, experts="fp4",
                                      expert_sharding=expert_sharding(mesh))
    load_mod._convert = real
    _, whole = load_mod.load_params(out / "tiny", progress=False, experts="fp4")
    same = all(np.array_equal(np.asarray(a), np.asarray(b))
               for a, b in zip(jax.tree.leaves(sharded), jax.tree.leaves(whole)))
    per_device = {dev: 0 for dev in mesh.devices.flat}
    for layer in sharded["layers"]:
        for leaf in jax.tree.leaves(layer["ffn"]["experts"]):
            for shard in leaf.addressable_shards:
                per_device[shard.device] += shard.data.nbytes
    plan = memory_plan.param_bytes(memory_plan.param_leaves(cfg), "fp4", "dp", 8)["routed_experts"]
    # the orbax cache of converted params: saved sharded, restored into the same shardings
    cached = [converted.load_params_cached(out / "tiny", out / "orbax", progress=False, experts="fp4",
                                           expert_sharding=expert_sharding(mesh))[1] for _ in range(2)]
    codes = cached[1]["layers"][0]["ffn"]["experts"]["w1"].codes
    report["load"] = {"stack_reads": sorted({n for stacked, n in reads if stacked}), "values_equal": same,
                      "expert_bytes_per_device": sorted(set(per_device.values())), "plan_bytes": plan,
                      "restored_equal": all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in
                                            zip(jax.tree.leaves(cached[1]), jax.tree.leaves(whole))),
                      "restored_split": codes.sharding.is_equivalent_to(NamedSharding(mesh, P(AXIS)), codes.ndim)}
    lap("load")

    # ---- the demo model from its checkpoint, mesh of 4 vs one device, DSpark speculation on ----
    # The demo has every attention mode, candidates and Engram on two layers, so this also covers
    # what a `modes` section on 4 devices did (~44 s of the child); on 4 its 4 draft-stage experts
    # split one a device, as the released model's do over 8 (on 8 they stayed whole, replicated).
    # Its prompts fit one chunk and its window: chunked prefill and window wraps on a mesh are
    # tiny/8's (and the packed rows on 2).
    # compile_cache_dir "": keep the suite's compilation cache (engine_common), not the user's;
    # decode_sizes (): one bucket, one compile per engine (both engines pad the same steps alike)
    kw = dict(numerics="fp32", max_batch=4, chunk=32, max_context=128, speculative=True, compile_cache_dir="",
              decode_sizes=())
    texts = ["The module provides", "If you do much work on computers,", "The Python standard library"]

    # 8 new tokens a request: the mesh still verifies and accepts drafts (on 4 devices: 12
    # verifies, 6 drafts accepted); a step on several CPU devices is slow on the suite's 2 cores
    def speculate(eng):
        stats = Stats()
        toks = [r.tokens for r in eng.generate(texts, max_new_tokens=8, ignore_eos=True, stats=stats)]
        return toks, {"verifies": stats.verifies, "proposed": stats.drafts_proposed, "accepted": stats.drafts_accepted}
    want, want_spec = speculate(Engine.from_checkpoint(ROOT / "models/demo", **kw))
    lap("demo/1")
    eng = Engine.from_checkpoint(ROOT / "models/demo", mesh=make_mesh(4), **kw)
    before = eng.cache.window                                  # the fresh cache, donated to the first step
    got, spec = speculate(eng)
    held = {dev: 0 for dev in eng.runner.mesh.devices.flat}        # every params leaf's shards
    for leaf in jax.tree.leaves(eng.params):
        for shard in leaf.addressable_shards:
            held[shard.device] += shard.data.nbytes
    experts = load_mod.resolve_experts("auto")
    plan = (sum(memory_plan.param_bytes(memory_plan.param_leaves(eng.cfg), experts, "dp", 4).values())
            + memory_plan.engram_table_bytes(eng.cfg))
    demo = {"tokens": got, "want": want, "spec": spec, "want_spec": want_spec, "speculative": eng.speculative,
            "device_feedback": eng.runner.device_feedback, "device_bytes": sorted(set(held.values())),
            "plan_bytes": plan, **split(eng, before)}
    report["demo"] = demo
    lap("demo/4")
    return report


# Before XLA:CPU's 600 s collective timeout ends a hung child: every Python thread's stack, on
# stderr, once (the intermittent "7 of 8 threads arrived" hang of 2026-12-04 was XLA:CPU's pool
# one thread short; `v41_jax.xla_env` sizes it now)
HANG_DUMP_S = 480

if __name__ == "__main__":
    faulthandler.dump_traceback_later(HANG_DUMP_S, exit=False)
    print(json.dumps(main(Path(sys.argv[1])), default=str))
