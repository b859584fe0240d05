"""RMSNorm as the reference computes it.

API
  rms_inv(x, eps) -> fp32 [..., 1]   rsqrt(mean(x^2) + eps) over the last axis, in fp32. Shared by
                                     RMSNorm, the mHC mixes and the Engram gate. The rule and the
                                     XLA path: `kernels_pallas.reference.rms_inv`; the Pallas
                                     backend runs it as one kernel per call (`kernels_pallas.rmsnorm`).
  rms_norm(x, w, eps) -> x.dtype     w * x * rms_inv(x), all fp32, one cast back to x's dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas import rmsnorm as kernel_rmsnorm


def rms_inv(x: jax.Array, eps: float) -> jax.Array:
    return kernel_rmsnorm.rms_inv(x, eps)


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    # the weight multiplies the fp32 normalised value; the single rounding is the final cast
    y = w.astype(jnp.float32) * (x.astype(jnp.float32) * rms_inv(x, eps))
    return y.astype(x.dtype)
