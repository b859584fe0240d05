"""The step's attention lists against brute force: ring rows vs this step's rows (prefill from 0,
a continuation whose window wraps the ring, a decode), compressed rows through the block table,
on both paths (XLA: one list in the reference's layout; Pallas, interpreted: two paged sources)."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import backend
from v41_jax.cache.geometry import CacheGeometry, EngineSettings
from v41_jax.config import ModelConfig
from v41_jax.model.numerics import Numerics
from v41_jax.runtime.metadata import Bucket, Span, build_step
from v41_jax.runtime.step import _attend, _compressed_source, _window_source

TINY = Path(__file__).resolve().parents[1] / "v41_jax/configs/tiny.config.json"
LAYER, H = 3, 4


def _setup():
    cfg = ModelConfig.from_file(TINY)
    geom = CacheGeometry.build(cfg, EngineSettings(page_tokens=8, num_pages=16, slots=4, max_context=64,
                                                   kv_format="f32", index_format="f32"))
    rng = np.random.default_rng(0)
    d, ring = cfg.head_dim, geom.ring_slots
    ne, cols, hd = len(cfg.engram_layer_ids), cfg.engram_hash_cols, cfg.engram_head_dim

    def span(rid, slot, pos, n, pages):
        return Span(rid, slot, pos, np.full(n, 3), np.asarray(pages), np.zeros(4),
                    tuple(np.zeros((n, cols, hd), np.uint8) for _ in range(ne)),
                    tuple(np.zeros((n, cols, hd // 32), np.uint8) for _ in range(ne)))

    spans = [span("a", 1, 0, 5, [2]), span("b", 3, 21, 6, [4, 5, 6, 7]), span("c", 0, 40, 1, [8, 9, 10, 11, 12, 13])]
    built = build_step(geom, cfg, Bucket(16, 4, 4), spans)
    true = {s.request_id: rng.normal(size=(s.end, d)).astype(np.float32) for s in spans}
    window = rng.normal(size=(4, geom.window_layers, ring, d)).astype(np.float32)   # garbage elsewhere
    kv = rng.normal(size=(16, d)).astype(np.float32)
    main = rng.normal(size=(16, 8, d)).astype(np.float32)            # the ratio-1 owner's plane
    k = cfg.index_topk
    selected = np.full((16, k), -1, np.int32)
    for s in spans:
        for p in range(s.position, s.end):
            t = int(np.flatnonzero((built.batch.token_req == spans.index(s)) & (built.batch.positions == p))[0])
            kv[t] = true[s.request_id][p]
            n_vis = p + 1                                            # ratio 1: every earlier row
            pick = np.sort(rng.choice(n_vis, min(k, n_vis), replace=False))
            selected[t, : len(pick)] = pick
        for p in range(max(0, s.position - ring), s.position):
            window[s.slot, LAYER, p % ring] = true[s.request_id][p]
    q = rng.normal(size=(1, 16, H, d)).astype(np.float32)
    sink = rng.normal(size=H).astype(np.float32)
    return cfg, geom, spans, built, true, window, kv, main, selected, q, sink


def _brute(cfg, spans, built, true, main, selected, q, sink):
    w, scale = cfg.window_size, cfg.head_dim ** -0.5
    out = np.zeros((16, H, cfg.head_dim), np.float32)
    for b, s in enumerate(spans):
        for t in np.flatnonzero(built.batch.token_req == b):
            p = built.batch.positions[t]
            rows = [true[s.request_id][j] for j in range(max(0, p - w + 1), p + 1)]
            for c in selected[t][selected[t] >= 0]:
                rows.append(main[s.pages[c // 8], c % 8])
            rows = np.stack(rows)
            logits = q[0, t] @ rows.T * scale                                  # [H, n]
            m = np.maximum(logits.max(-1), sink)
            e, es = np.exp(logits - m[:, None]), np.exp(sink - m)
            out[t] = (e @ rows) / (e.sum(-1) + es)[:, None]
    return out


@pytest.mark.parametrize("path", ["xla", "pallas"])
def test_lists_match_brute_force(path):
    cfg, geom, spans, built, true, window, kv, main, selected, q, sink = _setup()
    batch = jax.tree_util.tree_map(jnp.asarray, built.batch)
    with backend.use_backend(path):
        win = _window_source(jnp.asarray(window), LAYER, jnp.asarray(kv), batch, cfg.window_size)
        comp = _compressed_source(jnp.asarray(main), jnp.asarray(selected), batch)
        got = np.asarray(_attend(jnp.asarray(q), jnp.asarray(sink), win, comp, batch, cfg, Numerics.fp32()))[0]
    want = _brute(cfg, spans, built, true, main, selected, q, sink)
    real = built.batch.token_req >= 0
    # fp32 throughout; only the summation order differs (online softmax in chunks of 64)
    np.testing.assert_allclose(got[real], want[real], rtol=1e-5, atol=1e-5)
    assert not got[~real].any()                                   # padding queries attend to nothing
