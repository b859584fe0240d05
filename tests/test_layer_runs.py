"""Scanned layer runs (v41_jax/model/layer_runs.py): which layers stack, and that scanning them
changes nothing — the full forward's every intermediate and the engine's tokens, log-probabilities
and cache are bit for bit those of the unrolled stack (the same ops on the same values; only the
loop structure differs, and XLA:CPU does not re-associate fp32 sums across it).

The test model is `tiny` re-wired (written to a temporary config) so that it has all three kinds
of run: two WINDOW layers (0-1), three REUSE layers of ratio 2 with DSpark taps inside (3-5), two
REUSE layers of ratio 1 that consume the candidate blocks under a REINDEX owner (9-10), next to a
lone REUSE layer (7) and Engram on kv owners (2, 6).
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.engine_common import ROOT, forward_logits, make_engine
from v41_jax.checkpoint.load import ENGRAM_KEY, load_params, load_token_map
from v41_jax.config import ModelConfig
from v41_jax.engram_hash import EngramHasher
from v41_jax.model.engram import sequence_rows
from v41_jax.model.forward import forward
from v41_jax.model.layer_runs import RUNS_KEY, layer_params, layer_runs, stack_runs
from v41_jax.model.numerics import Numerics
from v41_jax.quant import Fp8BlockWeight
from v41_jax.runtime.request import Request
from v41_jax.runtime.sampling import SamplingParams
from scripts.make_checkpoint import make_checkpoint
from scripts.scan_rounding import RUNS_WIRING

EXPECTED_RUNS = [(0, 1), (3, 5), (9, 10)]


def test_the_released_stack_has_eight_runs_of_30_layers():
    cfg = ModelConfig.from_file(ROOT / "v41_jax/configs/deepseek_v41_flash.config.json")
    runs = [(r.start, r.stop - 1) for r in layer_runs(cfg)]
    assert runs == [(3, 7), (9, 13), (15, 19), (21, 23), (25, 27), (29, 31), (33, 35), (37, 39)]
    assert sum(len(r) for r in layer_runs(cfg)) == 30


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    raw = json.loads((ROOT / "v41_jax/configs/tiny.config.json").read_text())
    raw["text_config"].update(RUNS_WIRING)
    path = tmp_path_factory.mktemp("runs_cfg") / "runs.config.json"
    path.write_text(json.dumps(raw))
    out = tmp_path_factory.mktemp("runs_ckpt")
    make_checkpoint(str(path), str(out), 0)
    return out


@pytest.fixture(scope="module")
def model(model_dir):
    out = model_dir
    cfg, params = load_params(out, progress=False)
    return cfg, params, load_token_map(out, cfg)


def test_runs_and_the_stacked_layout(model):
    cfg, params, _ = model
    assert [(r.start, r.stop - 1) for r in layer_runs(cfg, params)] == EXPECTED_RUNS
    stacked = stack_runs(params, cfg)
    assert sorted(stacked[RUNS_KEY]) == [0, 3, 9]
    assert [l for l, p in enumerate(stacked["layers"]) if p is None] == [0, 1, 3, 4, 5, 9, 10]
    for layer in range(cfg.n_layers):   # every layer's params come back out of the stack unchanged
        for a, b in zip(jax.tree.leaves(layer_params(stacked, layer)), jax.tree.leaves(params["layers"][layer])):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_different_shape_breaks_a_run(model):
    cfg, params, _ = model
    layers = list(params["layers"])
    layers[4] = {**layers[4], "attn_norm": {"weight": jnp.zeros(7)}}
    assert [(r.start, r.stop - 1) for r in layer_runs(cfg, {**params, "layers": layers})] == [(0, 1), (9, 10)]


def _engram_rows(params, cfg, token_map, tokens) -> dict:
    _, rows = sequence_rows(params[ENGRAM_KEY], EngramHasher(cfg, token_map), cfg, tokens[None])
    return {k: jnp.asarray(v) for k, v in rows.items()}


def test_forward_scanned_equals_unrolled_bit_for_bit(model):
    """fp32 numerics (the fast policy's bf16 path is compared on the GPU by `scripts/bench_step
    --scan-layers`, where it runs; on XLA:CPU it compiles for minutes)."""
    cfg, params, token_map = model
    tokens = np.random.default_rng(1).integers(3, cfg.vocab_size, 40)
    rows = _engram_rows(params, cfg, token_map, tokens)
    run = jax.jit(lambda p: forward(p, cfg, jnp.asarray(tokens)[None], numerics=Numerics.fp32(),
                                    return_intermediates=True, engram_rows=rows))
    (want, want_inter), (got, got_inter) = run(params), run(stack_runs(params, cfg))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    paths = jax.tree_util.tree_flatten_with_path(want_inter)[0]
    assert any("main_hidden" in jax.tree_util.keystr(p) for p, _ in paths)   # the taps inside run 3-5 included
    assert jax.tree.structure(got_inter) == jax.tree.structure(want_inter)
    for (path, w), g in zip(paths, jax.tree.leaves(got_inter)):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=jax.tree_util.keystr(path))


def test_dense_fp8_held_as_published_equals_the_bf16_decode(model, model_dir):
    """Dense FP8 weights held as E4M3 codes + block scales (`load_params(dense="fp8")`) decode
    inside the jitted forward to the bf16 hold's values (XLA's route: on CPU the kernel is not
    taken): the same logits bit for bit."""
    cfg, params, token_map = model
    _, held = load_params(model_dir, cfg, progress=False, dense="fp8")
    assert isinstance(held["layers"][4]["attn"]["wq_b"]["weight"], Fp8BlockWeight)
    tokens = np.random.default_rng(3).integers(3, cfg.vocab_size, 24)
    rows = _engram_rows(params, cfg, token_map, tokens)
    run = jax.jit(lambda p: forward(p, cfg, jnp.asarray(tokens)[None], numerics=Numerics.fp32(),
                                    engram_rows=rows))
    # the codes stacked into the scanned runs against the unrolled bf16 hold: the decode and the
    # stacking of a held weight at once (scanned = unrolled itself: the test above)
    np.testing.assert_array_equal(np.asarray(run(stack_runs(held, cfg))), np.asarray(run(params)))


def test_forced_gates_on_part_of_a_run_are_refused(model):
    cfg, params, token_map = model
    tokens = np.arange(3, 7)
    gate = jnp.zeros((1, 4, cfg.n_activated_experts), jnp.int32)
    rows = _engram_rows(params, cfg, token_map, tokens)
    with pytest.raises(ValueError, match="part of the scanned run of layers 3-5"):
        jax.eval_shape(lambda p: forward(p, cfg, jnp.asarray(tokens)[None], numerics=Numerics.fp32(),
                                         forced={"gate_topk": {4: gate}}, engram_rows=rows),
                       stack_runs(params, cfg))


def test_engine_scanned_equals_unrolled(model):
    """Chunked prefill, decode and slot reuse through the cache: the same tokens, log-probabilities
    and final cache, bit for bit, and the same logits as the full forward's last row."""
    cfg, params, token_map = model
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, cfg.vocab_size, n).tolist() for n in (5, 30, 17, 9, 44)]   # 4 slots: one reused

    def run(scan: bool):
        engine = make_engine(cfg, params, token_map, scan_layers=scan, prefill_chunk=16)
        assert (RUNS_KEY in engine.params) is scan
        reqs = [Request(p, 8, SamplingParams(temperature=0.0), ignore_eos=True, logprobs=True,
                        request_id=i) for i, p in enumerate(prompts)]
        got = engine.generate(reqs)
        return [(r.tokens, r.logprobs) for r in got], jax.tree.leaves(engine.cache)

    (want, want_cache), (got, got_cache) = run(False), run(True)
    assert got == want
    for g, w in zip(got_cache, want_cache):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    # and the scanned engine's first greedy token is the oracle's argmax
    oracle = forward_logits(params, cfg, token_map, prompts[1])
    assert got[1][0][0] == int(np.argmax(oracle[-1]))
