"""Sampling: greedy, temperature, top-k, top-p, seeding and batch independence."""

import jax.numpy as jnp
import numpy as np
import pytest

from v41_jax.runtime.sampling import SamplingParams, sample


def _run(logits, temperature=0.0, top_k=0, top_p=1.0, seed=0, position=0):
    logits = jnp.asarray(logits, jnp.float32)
    r = logits.shape[0]
    full = lambda v, dt: jnp.broadcast_to(jnp.asarray(v, dt), (r,))
    return np.asarray(sample(logits, full(temperature, jnp.float32), full(top_k, jnp.int32),
                             full(top_p, jnp.float32), full(seed, jnp.int32), full(position, jnp.int32)))


def _draws(logits, n, **kw):
    """n independent draws of one row: same seed, n positions (one batch of n rows)."""
    rows = np.repeat(np.asarray(logits, np.float32)[None], n, 0)
    return _run(rows, position=jnp.arange(n), **kw)


def test_greedy_is_argmax_with_lower_id_ties():
    assert list(_run([[0.0, 3.0, 3.0, 1.0], [5.0, 0.0, 0.0, 5.0]])) == [1, 0]


def test_top_k_one_and_tiny_top_p_are_greedy():
    logits = np.random.default_rng(0).normal(size=(6, 50))
    g = _run(logits)
    assert np.array_equal(_run(logits, temperature=1.0, top_k=1, seed=3), g)
    assert np.array_equal(_run(logits, temperature=1.0, top_p=1e-6, seed=3), g)


def test_a_huge_temperature_keeps_top_k():
    """Scaled by 1e38 every logit rounds to about one value; the top-k / top-p sets are cut on the
    logits themselves, so top-k 1 stays greedy and top-k 3 draws only the three largest."""
    logits = np.random.default_rng(1).normal(size=(6, 50))
    assert np.array_equal(_run(logits, temperature=1e38, top_k=1, seed=3), _run(logits))
    row = np.log([0.05, 0.3, 0.1, 0.25, 0.2, 0.1])
    assert set(_draws(row, 400, temperature=3e38, top_k=3).tolist()) == {1, 3, 4}


def test_top_k_restricts_support():
    logits = np.log([0.05, 0.3, 0.1, 0.25, 0.2, 0.1])
    got = set(_draws(logits, 400, temperature=1.0, top_k=3).tolist())
    assert got == {1, 3, 4}     # the three most likely, each drawn at least once in 400


def test_top_p_keeps_smallest_prefix_reaching_p():
    logits = np.log([0.4, 0.3, 0.2, 0.1])
    # mass before each token: 0, .4, .7, .9 -> with p = .5 tokens 0 and 1 stay
    assert set(_draws(logits, 400, temperature=1.0, top_p=0.5).tolist()) == {0, 1}


def test_temperature_one_matches_softmax():
    p = np.array([0.5, 0.25, 0.15, 0.1])
    n = 4000
    freq = np.bincount(_draws(np.log(p), n, temperature=1.0, seed=11), minlength=4) / n
    # binomial std <= sqrt(.25 / 4000) = 0.008; 0.04 is five of them
    assert np.abs(freq - p).max() < 0.04


def test_seeded_and_independent_of_the_batch():
    logits = np.random.default_rng(1).normal(size=(1, 100))
    one = _run(logits, temperature=1.0, seed=7, position=12)
    many = np.concatenate([np.random.default_rng(2).normal(size=(5, 100)), logits])
    batch = _run(many, temperature=1.0, seed=7, position=12)
    assert batch[-1] == one[0]                                      # same key -> same draw
    assert len(set(_draws(logits[0], 64, temperature=1.0, seed=7).tolist())) > 5   # positions vary it


def test_a_sampled_row_draws_alike_among_greedy_rows():
    """A batch of greedy rows skips the vocabulary's sort and noise (`sampling.draws`); one sampled
    row among them must still draw exactly what it draws in an all-sampled batch, and the greedy
    rows stay argmax."""
    rng = np.random.default_rng(3)
    logits = jnp.asarray(rng.normal(size=(4, 100)), jnp.float32)
    row = lambda *v: jnp.asarray(v)
    args = dict(top_k=row(0, 0, 5, 0).astype(jnp.int32), top_p=row(1.0, 1.0, 0.9, 1.0).astype(jnp.float32),
                seed=row(7, 7, 7, 7).astype(jnp.int32), position=row(3, 4, 5, 6).astype(jnp.int32))
    mixed = np.asarray(sample(logits, row(0.0, 0.0, 1.3, 0.0).astype(jnp.float32), **args))
    alone = np.asarray(sample(logits, jnp.full((4,), 1.3, jnp.float32), **args))
    greedy = np.asarray(sample(logits, jnp.zeros((4,), jnp.float32), **args))
    assert mixed[2] == alone[2]
    assert list(mixed[[0, 1, 3]]) == list(greedy[[0, 1, 3]]) == list(np.argmax(np.asarray(logits), -1)[[0, 1, 3]])
    # over 20 positions the sampled row draws more than one token: the sampled path really ran
    draws = {int(sample(logits, row(0.0, 0.0, 1.3, 0.0).astype(jnp.float32),
                        **{**args, "position": row(3, 4, p, 6).astype(jnp.int32)})[2]) for p in range(5, 25)}
    assert len(draws) > 1


def test_params_validated():
    with pytest.raises(ValueError):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError):
        SamplingParams(temperature=-1.0)
