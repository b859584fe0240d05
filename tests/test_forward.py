"""The jitted full forward (and the DSpark draft head) on the repo's small configs.

The modes checkpoint is written by scripts.make_checkpoint from v41_jax/configs: every layer mode
runs (WINDOW, FULL at ratios 1 and 2, REINDEX, REUSE; candidate producer and consumers; Engram
before a WINDOW and a REUSE block; three draft stages). Not tiny: it has the same modes in the
same order less two layers, and asserted the same things again (~40 s of the suite's CPU); the
forward applies Engram alike before every mode, and Engram before FULL blocks (tiny's, the
demo model's) runs in tests/test_engine_golden.py and tests/test_demo_model.py.
"""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import v41_jax.model.forward as fwd_module
from scripts.make_checkpoint import make_checkpoint
from v41_jax.checkpoint.load import ENGRAM_KEY, load_params, load_token_map
from v41_jax.engram_hash import EngramHasher
from v41_jax.model import dspark
from v41_jax.model.engram import sequence_rows
from v41_jax.model.numerics import Numerics
from v41_jax.topology import Candidates, Mode, resolve_topology

CONFIGS = Path(__file__).parent.parent / "v41_jax" / "configs"
B, S = 2, 19  # odd: the last ratio-2 group is still open at the end of the sequence


def _tokens(cfg):
    return np.random.default_rng(0).integers(0, cfg.vocab_size - 1, (B, S))


@pytest.fixture(scope="module", params=["modes"])
def run(request, tmp_path_factory):
    """Checkpoint -> params -> one jitted forward, recording the mode each attention layer traced."""
    out = tmp_path_factory.mktemp(request.param)
    make_checkpoint(str(CONFIGS / f"{request.param}.config.json"), str(out), seed=3)
    cfg, params = load_params(out, progress=False)
    tokens = _tokens(cfg)
    hasher = EngramHasher(cfg, load_token_map(out, cfg))
    _, rows = sequence_rows(params[ENGRAM_KEY], hasher, cfg, tokens)
    seen, real = [], fwd_module.full_attention

    def spy(p, cfg_, topo, h, ctx, numerics):
        seen.append((topo.layer, topo.mode, topo.candidates))
        return real(p, cfg_, topo, h, ctx, numerics)

    fwd_module.full_attention = spy
    try:
        f = jax.jit(fwd_module.forward, static_argnames=("cfg", "numerics", "return_intermediates"))
        logits, inter = f(params, cfg, jnp.asarray(tokens), numerics=Numerics.reference(),
                          engram_rows={l: jnp.asarray(r) for l, r in rows.items()}, return_intermediates=True)
    finally:
        fwd_module.full_attention = real
    return request.param, cfg, params, seen, logits, inter


def test_forward_runs_every_mode(run):
    name, cfg, params, seen, logits, inter = run
    backbone = resolve_topology(cfg)[: cfg.n_layers]
    # the forward traced each backbone layer once, in its own mode
    assert seen == [(t.layer, t.mode, t.candidates) for t in backbone]
    modes = {(t.mode, t.ratio) for t in backbone}
    assert {(Mode.WINDOW, 0), (Mode.FULL, 1), (Mode.FULL, 2), (Mode.REINDEX, 1), (Mode.REUSE, 1),
            (Mode.REUSE, 2)} <= modes
    assert any(t.candidates is Candidates.CONSUME and t.mode is Mode.REINDEX for t in backbone)

    logits = np.asarray(logits)
    assert logits.shape == (B, S, cfg.vocab_size) and logits.dtype == np.float32
    assert np.isfinite(logits).all()
    assert inter["block_out"].shape == (cfg.n_layers, B, S, cfg.hc_mult, cfg.dim)
    assert set(inter["engram_out"]) == set(cfg.engram_layer_ids)
    scorers = [t for t in backbone if t.scores]
    assert set(inter["index_topk"]) == {t.layer for t in scorers}
    assert set(inter["candidate_blocks"]) == {cfg.candidate_source_layer}
    for t in scorers:
        picks = np.asarray(inter["index_topk"][t.layer])
        visible = (np.arange(S) + 1) // t.ratio
        # picks are visible rows (or -1), ascending, and as many as the row can see (up to K)
        assert (picks < visible[None, :, None]).all() and (picks >= -1).all()
        big = np.iinfo(np.int32).max
        valid = np.where(picks < 0, big, picks)
        assert ((np.diff(valid, axis=-1) > 0) | (valid[..., 1:] == big)).all()
        assert ((picks >= 0).sum(-1) == np.minimum(visible, picks.shape[-1])[None]).all()
    gate = np.asarray(inter["gate_topk"][0])
    assert gate.shape == (B, S, cfg.n_activated_experts) and (gate < cfg.n_routed_experts).all()
    assert inter["main_hidden"].shape == (B, S, len(cfg.dspark_target_layer_ids) * cfg.dim)


def test_dspark_draft_runs(run):
    _, cfg, params, _, _, inter = run
    num = Numerics.reference()
    ctx = dspark.context_x(params, cfg, inter["main_hidden"], num)
    anchor = jnp.asarray([S - 1, S // 2])
    first = jnp.asarray([5, 7])
    d = jax.jit(dspark.draft, static_argnames=("cfg", "numerics"))(params, cfg, ctx, anchor, first, num)
    blk = cfg.dspark_block_size
    assert d.ids.shape == (B, blk + 1) and (np.asarray(d.ids[:, 0]) == [5, 7]).all()
    logits = np.asarray(d.logits)
    assert logits.shape == (B, blk, cfg.vocab_size) and np.isfinite(logits).all()
    # greedy: each draft is the argmax of its row (Markov bias included)
    np.testing.assert_array_equal(np.asarray(d.ids[:, 1:]), logits.argmax(-1))
    assert d.confidence.shape == (B, blk) and np.isfinite(np.asarray(d.confidence)).all()
    assert set(d.gate_idx) == set(range(cfg.n_layers, cfg.n_total_layers))


