"""Speculative rejection sampling (`sampling.speculative_sample`) leaves the emitted tokens
distributed exactly as the target's sampler: over many seeds, the first emitted token's
empirical distribution on a small vocabulary matches the target's (masked) softmax by a
chi-square test at significance ALPHA; the same test rejects a sampler with the classic bug
(a rejected draft redrawn from p instead of p without the draft)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from v41_jax.runtime.sampling import _masked, draws, sample, speculative_sample, verify_drafts

V, K, N = 8, 3, 40_000          # vocabulary, drafts per verify, seeds
ALPHA = 1e-3                    # chance of failing a correct sampler (each case is one test)


def _chi_square_p(counts: np.ndarray, probs: np.ndarray) -> float:
    """p-value of the counts under probs (bins of zero probability must be empty: checked apart)."""
    keep = probs > 0
    expected = counts.sum() * probs[keep]
    stat = float((((counts[keep] - expected) ** 2) / expected).sum())
    df = int(keep.sum()) - 1
    return float(jax.scipy.special.gammaincc(df / 2, stat / 2))


def _case(temperature: float, top_k: int, top_p: float, draft_rank: int):
    logits = jnp.asarray(np.random.default_rng(7).normal(0, 1.5, (K + 1, V)), jnp.float32)
    target = np.asarray(jax.nn.softmax(_masked(logits[0], jnp.float32(temperature), jnp.int32(top_k),
                                               jnp.float32(top_p))), np.float64)
    d1 = int(np.argsort(-np.asarray(logits[0]), kind="stable")[draft_rank])
    drafts = jnp.asarray([d1, 0, 1], jnp.int32)
    rows = lambda a, dtype: jnp.full((N,), a, dtype)
    args = (jnp.broadcast_to(logits, (N, K + 1, V)), jnp.broadcast_to(drafts, (N, K)), rows(K, jnp.int32),
            rows(temperature, jnp.float32), rows(top_k, jnp.int32), rows(top_p, jnp.float32),
            jnp.arange(N, dtype=jnp.uint32), rows(100, jnp.int32))
    return target, d1, args


@pytest.mark.parametrize("temperature,top_k,top_p,draft_rank", [
    (0.8, 0, 1.0, 1),     # plain temperature, a likely draft
    (1.3, 5, 0.9, 0),     # top-k and top-p, the argmax drafted
    (1.0, 4, 1.0, 6),     # the draft outside the kept set: always rejected
])
def test_first_token_follows_the_target(temperature, top_k, top_p, draft_rank):
    target, d1, args = _case(temperature, top_k, top_p, draft_rank)
    n, tokens = speculative_sample(*args)
    first = np.asarray(tokens[:, 0])
    counts = np.bincount(first, minlength=V)
    assert counts[target == 0].sum() == 0, "a token outside the sampler's set was emitted"
    assert _chi_square_p(counts, target) > ALPHA
    # the draft is accepted with probability p(d): a binomial count inside 5 sigma
    acc = int((np.asarray(n) > 0).sum())
    assert abs(acc - N * target[d1]) <= 5 * np.sqrt(N * target[d1] * (1 - target[d1])) + 1e-9
    assert np.all(first[np.asarray(n) > 0] == d1) and np.all(first[np.asarray(n) == 0] != d1)


def test_the_test_catches_a_biased_sampler():
    """Control: redrawing a rejected draft from p itself (not p without the draft) over-weights the
    draft to p(d) + (1 - p(d)) p(d); the same test at the same ALPHA rejects it."""
    target, d1, args = _case(0.8, 0, 1.0, 1)
    n, tokens = speculative_sample(*args)
    logits, _, _, temperature, top_k, top_p, seed, position = args
    redrawn = sample(logits[:, 0], temperature, top_k, top_p, seed, position)
    biased = np.where(np.asarray(n) > 0, np.asarray(tokens[:, 0]), np.asarray(redrawn))
    assert _chi_square_p(np.bincount(biased, minlength=V), target) < ALPHA


def test_greedy_rows_accept_the_argmax_prefix():
    logits = jnp.asarray(np.random.default_rng(3).normal(size=(2, K + 1, V)), jnp.float32)
    best = np.asarray(jnp.argmax(logits, -1))
    drafts = jnp.asarray([[best[0, 0], best[0, 1], (best[0, 2] + 1) % V], best[1, :K]], jnp.int32)
    z = jnp.zeros(2, jnp.float32)
    n, tokens = speculative_sample(logits, drafts, jnp.asarray([K, 1], jnp.int32), z, jnp.zeros(2, jnp.int32),
                                   jnp.ones(2, jnp.float32), jnp.zeros(2, jnp.uint32), jnp.zeros(2, jnp.int32))
    assert np.asarray(n).tolist() == [2, 1]              # the second row checks one draft only
    assert np.asarray(tokens[0, :3]).tolist() == best[0, :3].tolist()
    assert np.asarray(tokens[1, :2]).tolist() == best[1, :2].tolist()


def test_the_steps_shared_draws_verify_as_speculative_sample():
    """The step draws each logits row once (`draws` at the row's position + 1) and verifies a span
    against its rows of those draws: the same counts and tokens, bit for bit, as
    `speculative_sample` on the span's logits (sampled rows, so every key and noise draw counts)."""
    n, rng = 200, np.random.default_rng(11)
    logits = jnp.asarray(rng.normal(0, 1.5, (n * (K + 1), V)), jnp.float32)       # span i: rows i(K+1)..
    per_span = lambda a: jnp.repeat(a, K + 1)
    temperature, top_p = (jnp.asarray(rng.uniform(lo, hi, n), jnp.float32) for lo, hi in ((0.5, 2.0), (0.5, 1.0)))
    top_k, seed = jnp.asarray(rng.integers(0, V, n), jnp.int32), jnp.arange(n, dtype=jnp.uint32)
    start = jnp.asarray(rng.integers(0, 100, n), jnp.int32)                       # each span's first position
    drafts = jnp.asarray(rng.integers(0, V, (n, K)), jnp.int32)
    k = jnp.asarray(rng.integers(0, K + 1, n), jnp.int32)
    rows = jnp.arange(n)[:, None] * (K + 1) + jnp.arange(K + 1)

    @jax.jit
    def step_like(logits, drafts, k, temperature, top_k, top_p, seed, start):
        drawn = draws(logits, per_span(temperature), per_span(top_k), per_span(top_p), per_span(seed),
                      per_span(start) + jnp.tile(jnp.arange(K + 1), n) + 1)
        return verify_drafts(jax.tree.map(lambda a: a[rows], drawn), drafts, k, temperature)
    got = step_like(logits, drafts, k, temperature, top_k, top_p, seed, start)
    want = speculative_sample(logits[rows], drafts, k, temperature, top_k, top_p, seed, start + 1)
    assert np.asarray(got[0]).tolist() == np.asarray(want[0]).tolist()
    assert np.asarray(got[1]).tolist() == np.asarray(want[1]).tolist()
