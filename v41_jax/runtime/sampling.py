"""Token sampling: greedy, temperature, top-k, top-p, seeded.

Every parameter is a per-row array, so one compiled function serves any mix of settings. A row's
randomness is keyed by (its request's seed, the position it samples for), never by batch row or
step: a request draws the same tokens alone as inside any batch (continuous batching stays exact).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from v41_jax.brief import show


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0    # 0 = greedy (argmax, ties to the lower id)
    top_k: int = 0              # keep the k most likely tokens; 0 = off
    top_p: float = 1.0          # keep the smallest prefix of likely tokens with mass >= top_p
    seed: int = 0

    def __post_init__(self):
        """Strict: bools and non-numbers refused, NaN/inf refused, top_k and seed integers (numpy scalars
        accepted); the values are stored as Python float/int."""
        t, k, p, s = self.temperature, self.top_k, self.top_p, self.seed
        if not _real(t) or not finite(t) or t < 0:
            raise ValueError(f"SamplingParams.temperature: must be a finite number >= 0, got {show(t)}")
        if not _integral(k) or not 0 <= k < 2 ** 31:
            raise ValueError(f"SamplingParams.top_k: must be an integer in [0, 2**31), got {show(k)}")
        if not _real(p) or not 0 < p <= 1:                      # NaN fails the comparison
            raise ValueError(f"SamplingParams.top_p: must be a number in (0, 1], got {show(p)}")
        if not _integral(s) or not 0 <= s < 2 ** 32:
            raise ValueError(f"SamplingParams.seed: must be an integer in [0, 2**32), got {show(s)}")
        for name, value in (("temperature", float(t)), ("top_k", int(k)), ("top_p", float(p)), ("seed", int(s))):
            object.__setattr__(self, name, value)


def _real(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, (bool, np.bool_))


def _integral(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, (bool, np.bool_))


def finite(v) -> bool:
    """A real number that is finite (an int too large for a float is not)."""
    try:
        return math.isfinite(float(v))
    except OverflowError:                                       # an int beyond float range
        return False


def _masked(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """logits [..., V] scaled by each row's temperature, -inf outside its top-k / top-p set: the
    distribution a sampled row draws from is softmax of this. The sets are cut on the logits
    themselves (a temperature > 0 keeps their order): scaled by a huge temperature they would all
    round to one value and tie, and every token would pass top-k. Temperatures past 1e30 act as
    1e30 (the kept tokens are already equally likely there; XLA divides by a reciprocal, which
    past ~1e38 is 0 and turns -inf into NaN)."""
    v = logits.shape[-1]
    t = jnp.clip(temperature, 1e-5, 1e30)[..., None]
    ordered = -jnp.sort(-logits, axis=-1)                                      # descending
    # top-k: everything below the k-th largest goes
    kth = jnp.take_along_axis(ordered, jnp.clip(top_k - 1, 0, v - 1)[..., None], axis=-1)
    kth = jnp.where(top_k[..., None] > 0, kth, -jnp.inf)
    ordered = jnp.where(ordered >= kth, ordered, -jnp.inf)
    # top-p over what top-k kept: keep a token while the mass before it is < top_p
    probs = jax.nn.softmax(ordered / t, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs
    n_keep = jnp.maximum(jnp.sum(before < top_p[..., None], axis=-1), 1)
    floor = jnp.take_along_axis(ordered, (n_keep - 1)[..., None], axis=-1)
    return jnp.where((logits >= floor) & (logits >= kth), logits / t, -jnp.inf)


def _key(seed: jax.Array, position: jax.Array) -> jax.Array:
    return jax.random.fold_in(jax.random.key(seed.astype(jnp.uint32)), position)


class Draws(NamedTuple):
    """What a row's sampler draws from, per logits row (any leading shape): greedy (the argmax),
    masked (`_masked`), key (the row's PRNG key) and gumbel [..., V] (its Gumbel noise). The step
    computes them once for all its logits rows; `pick` samples from them and `verify_drafts`
    checks drafts against a verify span's rows of them."""
    greedy: jax.Array
    masked: jax.Array
    key: jax.Array
    gumbel: jax.Array


def draws(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array, seed: jax.Array,
          position: jax.Array) -> Draws:
    """logits [..., V] fp32, the sampler and the position sampled for per row [...]. A row's key
    depends on (seed, position) alone, so a row gives the same draws in any batch shape."""
    lead, v = logits.shape[:-1], logits.shape[-1]
    key = jax.vmap(_key)(seed.reshape(-1), position.reshape(-1))

    def sampled() -> tuple[jax.Array, jax.Array]:
        gumbel = jax.vmap(lambda k: jax.random.gumbel(k, (v,), jnp.float32))(key)
        return _masked(logits, temperature, top_k, top_p), gumbel.reshape(*lead, v)

    def greedy() -> tuple[jax.Array, jax.Array]:
        # greedy rows read only the argmax (`pick`, `verify_drafts`): a batch of them skips the
        # vocabulary's sort and noise (on the H200 bench slice ~0.9 ms of a 10 ms step at 32 rows)
        return logits, jnp.zeros_like(logits)

    masked, gumbel = jax.lax.cond(jnp.any(temperature > 0), sampled, greedy)
    return Draws(jnp.argmax(logits, axis=-1), masked, key.reshape(lead), gumbel)


def pick(d: Draws, temperature: jax.Array) -> jax.Array:
    """The token each row samples: Gumbel-max over its masked logits, or (temperature 0) the argmax."""
    return jnp.where(temperature > 0, jnp.argmax(d.masked + d.gumbel, axis=-1), d.greedy).astype(jnp.int32)


@jax.jit
def sample(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
           seed: jax.Array, position: jax.Array) -> jax.Array:
    """logits [R, V] fp32; temperature/top_p [R] f32, top_k/seed/position [R] int32 -> tokens [R] int32."""
    return pick(draws(logits, temperature, top_k, top_p, seed, position), temperature)


@jax.jit
def speculative_sample(logits: jax.Array, drafts: jax.Array, k: jax.Array, temperature: jax.Array,
                       top_k: jax.Array, top_p: jax.Array, seed: jax.Array,
                       position: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Verify drafts by speculative rejection sampling; the tokens emitted are distributed exactly
    as the target's sampler would draw them one at a time.

    logits [R, K + 1, V] fp32: the target's rows of each verify span (row j predicts the token
    after its j-th draft); drafts [R, K], the first k [R] of them checked; the sampler per request
    row; position [R]: the position row 0 samples for (row j: position + j).
    -> (accepted n [R], tokens [R, K + 1]: the drafts accepted, then at row n the target's token).
    """
    r, k1, _ = logits.shape
    per_row = lambda a: jnp.broadcast_to(a[:, None], (r, k1))
    d = draws(logits, per_row(temperature), per_row(top_k), per_row(top_p), per_row(seed),
              position[:, None] + jnp.arange(k1))
    return verify_drafts(d, drafts, k, temperature)


def verify_drafts(d: Draws, drafts: jax.Array, k: jax.Array, temperature: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`speculative_sample` from the verify rows' draws d [R, K + 1, ...] (`draws` of each row).

    The drafts are the head's greedy chain, a point mass q = 1[d], so the rule of Leviathan et al.
    / Chen et al. (accept d with probability min(1, p(d) / q(d)), else draw from max(0, p - q)
    renormalised) is: accept d with probability p(d), else draw from p with d removed; with all k
    accepted, row k draws from p. Then P(first token = x) = p(d) 1[x = d] + (1 - p(d)) p(x) /
    (1 - p(d)) 1[x != d] = p(x). Greedy rows (temperature 0) accept d iff it is the argmax and
    emit the argmax, as plain greedy. Each row's randomness is keyed by (seed, the position it
    samples for), the acceptance uniform on a stream of its own.
    """
    r, k1, v = d.masked.shape
    j = jnp.arange(k1)
    dr = jnp.concatenate([drafts, jnp.zeros((r, 1), drafts.dtype)], axis=1)      # [R, K + 1]: row j checks dr[j]
    checked = j[None] < k[:, None]
    p_d = jnp.take_along_axis(jax.nn.softmax(d.masked, axis=-1), dr[..., None], axis=-1)[..., 0]
    u = jax.vmap(lambda key: jax.random.uniform(jax.random.fold_in(key, 1)))(d.key.reshape(-1)).reshape(r, k1)
    sampled = temperature[:, None] > 0
    ok = jnp.where(sampled, u < p_d, d.greedy == dr) & checked
    n = jnp.sum(jnp.cumprod(ok, axis=1), axis=1)
    # the residual: d removed where it was checked (and rejected, at row n)
    residual = jnp.where(checked[..., None] & (jnp.arange(v) == dr[..., None]), -jnp.inf, d.masked)
    drawn = jnp.where(sampled, jnp.argmax(residual + d.gumbel, axis=-1), d.greedy)
    tokens = jnp.where(j[None] < n[:, None], dr, drawn)
    return n.astype(jnp.int32), tokens.astype(jnp.int32)
