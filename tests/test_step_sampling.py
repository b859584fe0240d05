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


def test_params_validated():
    with pytest.raises(ValueError):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError):
        SamplingParams(temperature=-1.0)
