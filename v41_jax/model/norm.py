"""RMSNorm as the reference computes it.

API
  rsqrt(v) -> fp32                   1 / sqrt(v), each step correctly rounded: torch's CPU rsqrt
                                     bit for bit (XLA's own rsqrt differs in ~1/3 of the cases).
  rms_inv(x, eps) -> fp32 [..., 1]   rsqrt(mean(x^2) + eps) over the last axis, in fp32. Shared by
                                     RMSNorm, the mHC mixes and the Engram gate.
  rms_norm(x, w, eps) -> x.dtype     w * x * rms_inv(x), all fp32, one cast back to x's dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from v41_jax.model.numerics import cascade_sum, exact_div


def rsqrt(v: jax.Array) -> jax.Array:
    # exact_div keeps XLA from fusing 1 / sqrt into its approximate rsqrt
    return exact_div(jnp.ones_like(v), jnp.sqrt(v))


def rms_inv(x: jax.Array, eps: float) -> jax.Array:
    x = x.astype(jnp.float32)
    # torch's mean: its cascade sum, then a true division by the lane count
    mean_sq = exact_div(cascade_sum(jnp.square(x))[..., None], x.shape[-1])
    return rsqrt(mean_sq + eps)


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    # the weight multiplies the fp32 normalised value; the single rounding is the final cast
    y = w.astype(jnp.float32) * (x.astype(jnp.float32) * rms_inv(x, eps))
    return y.astype(x.dtype)
