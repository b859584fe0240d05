"""The cached step's control flow outside its kernels, as a GPU command buffer sees it.

A CUDA graph holds a step whole only if its loops and conditionals can be graph nodes; each one
that cannot ran on the host mid-step, and even a captured while loop cost ~75 us of idle GPU per
trip start on the H200 (BENCHMARKS.md, 2026-12-04: the sampler's conditional and the MoE tile
table's binary search). So with the Pallas kernels selected (as on a GPU), the decode and mixed
steps' jaxprs hold no loop outside the kernels and exactly one conditional, the sampler's
(a batch of greedy rows skips the vocabulary's sort). Traced only, on abstract params and cache.
"""

from __future__ import annotations

import collections
from pathlib import Path

import jax
import jax.extend.core
import pytest

from kernels_pallas import backend as kernel_backend
from scripts.bench_compile import abstract_params
from v41_jax.cache.buffer import allocate
from v41_jax.cache.geometry import CacheGeometry, EngineSettings, typed_format
from v41_jax.config import ModelConfig
from v41_jax.numerics import Numerics
from v41_jax.runtime.metadata import Bucket, build_step
from v41_jax.runtime.packed import BatchLayout
from v41_jax.runtime.step import make_step

CONFIGS = Path(__file__).resolve().parents[1] / "v41_jax" / "configs"
LOOPS = ("while", "scan")


def control_flow(jaxpr) -> collections.Counter:
    """Loop / conditional primitives of a closed jaxpr and its sub-jaxprs, by name, not looking
    inside pallas_call kernels (their loops are the kernel's own)."""
    found = collections.Counter()
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "pallas_call":
            continue
        if name in LOOPS + ("cond",):
            found[name] += 1
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            found += control_flow(sub)
    return found


def traced_step(config: str, bucket: Bucket):
    """(config, the decode / mixed step's closed jaxpr on abstract params and cache, the cache's
    abstract value), with the Pallas kernels selected as on a GPU."""
    cfg = ModelConfig.from_file(str(CONFIGS / f"{config}.config.json"))
    numerics = Numerics.fast()
    fmt = typed_format(numerics.act_dtype)
    settings = EngineSettings(page_tokens=16, num_pages=1 + bucket.requests * 8, slots=bucket.requests,
                              max_context=128, kv_format=fmt, index_format=fmt)
    geom = CacheGeometry.build(cfg, settings)
    host = build_step(geom, cfg, bucket, []).batch
    layout = BatchLayout.of(host)
    cache = jax.eval_shape(lambda: allocate(geom))
    with kernel_backend.use_backend("pallas"):
        traced = make_step(cfg, geom, numerics).trace(abstract_params(cfg, "fp8"), cache, layout.pack(host),
                                                      layout=layout)
    return cfg, traced.jaxpr, cache


@pytest.mark.parametrize("config,bucket", [("tiny", Bucket(1, 1, 1)), ("tiny", Bucket(32, 32, 32)),
                                           ("modes", Bucket(16, 4, 4))])
def test_the_step_has_no_loop_and_one_conditional_outside_its_kernels(config, bucket):
    found = control_flow(traced_step(config, bucket)[1].jaxpr)
    assert {k: found[k] for k in LOOPS if found[k]} == {}
    assert found["cond"] == 1


def test_each_window_ring_write_follows_its_read():
    """Each layer's ring scatter takes the ring from the optimization barrier that also passes the
    rows the layer read from it (`step._read_before_write`): without that order XLA:GPU copied the
    rings whole, three 6 MiB memcpys a decode step on the bench slice (BENCHMARKS.md, 2026-12-04 c).
    XLA:CPU does not copy them either way, so the order is checked in the jaxpr."""
    cfg, closed, cache = traced_step("tiny", Bucket(4, 4, 4))
    jaxpr = closed.jaxpr
    ring = tuple(cache.window.shape)
    made_by = {id(v): eqn for eqn in jaxpr.eqns for v in eqn.outvars}
    writes = [eqn for eqn in jaxpr.eqns if eqn.primitive.name == "scatter"
              and tuple(eqn.invars[0].aval.shape) == ring]
    assert len(writes) == cfg.n_layers
    for eqn in writes:
        barrier = made_by.get(id(eqn.invars[0]))
        assert barrier is not None and barrier.primitive.name == "optimization_barrier"
        assert len(barrier.invars) == 2 and tuple(barrier.invars[1].aval.shape) == ring
