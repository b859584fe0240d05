"""Token sampling: greedy, temperature, top-k, top-p, seeded.

Every parameter is a per-row array, so one compiled function serves any mix of settings. A row's
randomness is keyed by (its request's seed, the position it samples for), never by batch row or
step: a request draws the same tokens alone as inside any batch (continuous batching stays exact).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np


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
            raise ValueError(f"SamplingParams.temperature: must be a finite number >= 0, got {_brief(t)}")
        if not _integral(k) or not 0 <= k < 2 ** 31:
            raise ValueError(f"SamplingParams.top_k: must be an integer in [0, 2**31), got {_brief(k)}")
        if not _real(p) or not 0 < p <= 1:                      # NaN fails the comparison
            raise ValueError(f"SamplingParams.top_p: must be a number in (0, 1], got {_brief(p)}")
        if not _integral(s) or not 0 <= s < 2 ** 32:
            raise ValueError(f"SamplingParams.seed: must be an integer in [0, 2**32), got {_brief(s)}")
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


def _brief(v) -> str:
    if isinstance(v, numbers.Integral) and not isinstance(v, bool) and int(v).bit_length() > 128:
        return f"an integer of {int(v).bit_length()} bits"
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


@jax.jit
def sample(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
           seed: jax.Array, position: jax.Array) -> jax.Array:
    """logits [R, V] fp32; temperature/top_p [R] f32, top_k/seed/position [R] int32 -> tokens [R] int32."""
    v = logits.shape[-1]
    greedy = jnp.argmax(logits, axis=-1)
    scaled = logits / jnp.maximum(temperature, 1e-5)[:, None]
    ordered = -jnp.sort(-scaled, axis=-1)                                      # descending
    # top-k: everything below the k-th largest goes
    kth = jnp.take_along_axis(ordered, jnp.clip(top_k - 1, 0, v - 1)[:, None], axis=-1)
    kth = jnp.where(top_k[:, None] > 0, kth, -jnp.inf)
    ordered = jnp.where(ordered >= kth, ordered, -jnp.inf)
    # top-p over what top-k kept: keep a token while the mass before it is < top_p
    probs = jax.nn.softmax(ordered, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs
    n_keep = jnp.maximum(jnp.sum(before < top_p[:, None], axis=-1), 1)
    floor = jnp.take_along_axis(ordered, (n_keep - 1)[:, None], axis=-1)
    masked = jnp.where((scaled >= floor) & (scaled >= kth), scaled, -jnp.inf)
    keys = jax.vmap(lambda s, p: jax.random.fold_in(jax.random.key(s), p))(
        seed.astype(jnp.uint32), position)
    gumbel = jax.vmap(lambda k: jax.random.gumbel(k, (v,), jnp.float32))(keys)
    drawn = jnp.argmax(masked + gumbel, axis=-1)
    return jnp.where(temperature > 0, drawn, greedy).astype(jnp.int32)
