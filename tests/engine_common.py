"""Shared set-up for the cache / step / generation tests: a seeded checkpoint, an engine with the
standard test geometry and buckets, the full-forward oracle and a teacher-forced run through the
cache.

Every engine here uses the same geometry, numerics and bucket set, so the step compiles to the
same executables in every test file; the persistent XLA cache below then compiles each once.
"""

from __future__ import annotations

import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from scripts.make_checkpoint import make_checkpoint
from v41_jax.cache.geometry import EngineSettings
from v41_jax.checkpoint.load import ENGRAM_KEY, load_params, load_token_map
from v41_jax.engram_hash import EngramHasher
from v41_jax.model.engram import sequence_rows
from v41_jax.model.forward import forward
from v41_jax.model.numerics import Numerics
from v41_jax.runtime.engine import Engine
from v41_jax.runtime.metadata import Bucket, BucketSet

ROOT = Path(__file__).resolve().parents[1]
SUITE_CACHE = ROOT / ".pytest_cache" / "xla"          # the suite's persistent compilation cache
# The whole run (`V41_FARM=all make test`, README): every farm fixture on every path, the step
# replays, and the benchmark scripts' end-to-end smoke runs; the default suite keeps a covering
# subset within its 25-minute budget on 2 cores
WHOLE = os.environ.get("V41_FARM") == "all"
jax.config.update("jax_compilation_cache_dir", str(SUITE_CACHE))
# every executable, however fast it compiled, as the engine's own cache does (compile_cache.enable):
# the suite's two workers and its child processes compile the same small programs (eager ops, the
# loader's dequantization) and would each pay XLA:CPU's ~0.1 s per program
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

# One bucket for every step (72-token one-shot prefills with every row's logits, decodes, mixes):
# a single compile per config.
BUCKETS = BucketSet((Bucket(tokens=80, requests=4, logits=80),))
SETTINGS = EngineSettings(page_tokens=8, num_pages=96, slots=4, max_context=128,
                          kv_format="f32", index_format="f32")
FP32 = Numerics.fp32()


def build_model(out_dir: Path, config: str, seed: int = 0):
    """(cfg, params, token_map) of a seeded checkpoint of v41_jax/configs/<config>.config.json."""
    make_checkpoint(str(ROOT / f"v41_jax/configs/{config}.config.json"), str(out_dir), seed)
    cfg, params = load_params(out_dir, progress=False)
    return cfg, params, load_token_map(out_dir, cfg)


def make_engine(cfg, params, token_map, settings=SETTINGS, buckets=BUCKETS, numerics=FP32, **kw) -> Engine:
    return Engine(params, cfg, settings=settings, buckets=buckets, numerics=numerics,
                  token_map=token_map, **kw)


def forward_logits(params, cfg, token_map, tokens, numerics=FP32) -> np.ndarray:
    """The full forward from position 0 (the oracle), one jitted program: fp32 logits [S, V].
    Jitted, not eager: eagerly each op is its own XLA:CPU compile (~300 of them, ~27 s per new
    sequence length) and the forward's loops re-compile on every call."""
    hasher = EngramHasher(cfg, token_map)
    _, rows = sequence_rows(params[ENGRAM_KEY], hasher, cfg, np.asarray(tokens)[None])
    run = jax.jit(lambda p, t, r: forward(p, cfg, t, numerics=numerics, engram_rows=r))
    logits = run(params, jnp.asarray(tokens)[None], {k: jnp.asarray(v) for k, v in rows.items()})
    return np.asarray(logits[0])


def teacher_forced(engine: Engine, tokens, chunks, slot: int = 0) -> np.ndarray:
    """Feed `tokens` through the cache in spans of the given lengths (one request, every row's
    logits) -> fp32 logits [S, V]. The request's pages come from the engine's allocator."""
    tokens = np.asarray(tokens)
    assert sum(chunks) == len(tokens)
    pages = engine.pages.allocate(engine.geom.pages_for(len(tokens)))
    out, pos = [], 0
    for n in chunks:
        span = engine.make_span("tf", slot, pos, tokens[pos: pos + n], pages,
                                engine.cursors()[slot], all_logits=True)
        out.append(np.asarray(engine.run([span], BUCKETS.buckets[-1]).logits[:n]))
        pos += n
    engine.pages.free(pages, engine.step_id)
    engine.pages.retire(engine.step_id)
    return np.concatenate(out)


def chunked(length: int, size: int) -> list[int]:
    return [size] * (length // size) + ([length % size] if length % size else [])


def assert_packed_runs_typed(typed: Engine, packed: Engine, requests, planes) -> None:
    """A cache holding some planes packed runs the typed cache's computation bit for bit: the same
    tokens and log-probabilities for `requests`, and each (typed plane, packed plane, decode) of
    `planes` (read after the run) decodes to the typed plane, which holds rows, not only zeros."""
    want, got = typed.generate(requests), packed.generate(requests)
    for w, g in zip(want, got):
        assert g.tokens == w.tokens
        np.testing.assert_array_equal(np.asarray(g.logprobs, np.float32), np.asarray(w.logprobs, np.float32))
    written = 0
    for a, b, decode in planes():
        decoded = np.asarray(decode(b), np.float32)
        np.testing.assert_array_equal(decoded.view(np.uint32), np.asarray(a, np.float32).view(np.uint32))
        written += int(np.count_nonzero(np.asarray(a, np.float32)))
    assert written > 0
