"""RMSNorm as the reference computes it.

API
  rms_inv(x, eps, numerics, sumsq=None) -> fp32 [..., 1]   rsqrt(mean(x^2) + eps) over the last axis, in fp32.
                                     Shared by RMSNorm, the mHC mixes and the Engram gate. With
                                     `numerics.exact_rms` the reference's bits: the rule and the XLA
                                     path are `kernels_pallas.reference.rms_inv`, the Pallas backend
                                     runs it as one kernel per call (`kernels_pallas.rmsnorm`).
                                     Without, one backend reduction and rsqrt.
                                     `sumsq` [..., 1]: x's sum of squares, already computed
                                     (`mhc.expand_collapse`); the fast statistic only.
  sum_sq(x) -> fp32 [..., 1]         that sum where it is computed ahead of the statistic.
  rms_norm(x, w, eps, numerics, sumsq=None) -> x.dtype   w * x * rms_inv(x), all fp32, one cast
                                     back to x's dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas import rmsnorm as kernel_rmsnorm
from v41_jax.model.numerics import Numerics


def sum_sq(x: jax.Array) -> jax.Array:
    """fp32 sum of squares over the last axis, [..., 1]: the fast statistic's sum, in the backend's order."""
    return jnp.sum(jnp.square(x.astype(jnp.float32)), axis=-1, keepdims=True)


def rms_inv(x: jax.Array, eps: float, numerics: Numerics, sumsq: jax.Array | None = None) -> jax.Array:
    if numerics.exact_rms:
        return kernel_rmsnorm.rms_inv(x, eps)
    # the same squares, mean and eps in fp32, in the backend's order: a plain reduction XLA fuses
    # with the ops around it, where the exact statistic is one latency-bound launch per call
    # (~40 a decode step; BENCHMARKS.md, 2026-12-05 d)
    if sumsq is None:
        sumsq = sum_sq(x)
    return jax.lax.rsqrt(sumsq / x.shape[-1] + eps)


def rms_norm(x: jax.Array, w: jax.Array, eps: float, numerics: Numerics, sumsq: jax.Array | None = None) -> jax.Array:
    # the weight multiplies the fp32 normalised value; the single rounding is the final cast
    y = w.astype(jnp.float32) * (x.astype(jnp.float32) * rms_inv(x, eps, numerics, sumsq))
    return y.astype(x.dtype)
