"""Numerics policy: where the forward rounds, quantizes and how it accumulates.

API
  Numerics(act_dtype, fake_quant, block_gemm, index_score_bf16, attn_probs_bf16)
      frozen, hashable: pass it as a static argument under jit.
  Numerics.reference()  bit-level policy of the official reference (ARCHITECTURE.md §4):
      bf16 activations, fp8/fp4 fake-quant at the reference's points, FP8/FP4 GEMMs summed per
      32-wide K block in fp32 in K order, bf16 index scores, bf16 attention probabilities.
  Numerics.fast()       same rounding points, but GEMMs are one fp32-accumulating dot (the order
      of the fp32 sum is the backend's). For serving.
  Numerics.fp32()       same graph with fp32 activations and no fake-quant / bf16 rounding; used to
      compare the cache path with the full forward without rounding noise.
  numerics.act(x)       cast to the activation dtype (the reference's bf16 rounding points).
  HIGHEST               the dot precision for every fp32 product (no TF32 / bf16 passes on GPU).
  exact_div(a, b)       a / b correctly rounded. XLA rewrites a division by a constant or by a
                        broadcast operand into a multiplication by its (inexact) reciprocal; the
                        reference divides. Use it wherever b is broadcast and not a power of two.

Fields
  act_dtype        dtype of everything the reference holds in bf16: residual streams, sublayer
                   inputs/outputs, linear outputs, KV rows. fp32-by-design quantities (mHC
                   coefficients, router, logits, Engram gate) are fp32 in every policy.
  fake_quant       fp8 (per 32, ue8m0) QDQ of every FP8/FP4 linear input and of window/draft KV rows,
                   fp4 QDQ of compressed KV rows (group 16, e4m3 scale) and index q/k (group 32, ue8m0).
  block_gemm       FP8/FP4 linears reproduce the reference kernels' accumulation: each 32-wide K
                   block summed exactly in fp32, block partials added in fp32 in K order.
  index_score_bf16 indexer einsum -> ReLU -> weighted head sum in bf16 (the reference), else fp32.
  attn_probs_bf16  sparse attention rounds unnormalised probabilities to bf16 before P.V.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

HIGHEST = jax.lax.Precision.HIGHEST


def exact_div(a: jax.Array, b: jax.Array | float) -> jax.Array:
    # a full-shape divisor behind an optimization barrier is neither a constant nor a broadcast
    shape = jnp.broadcast_shapes(jnp.shape(a), jnp.shape(b))
    return a / jax.lax.optimization_barrier(jnp.broadcast_to(jnp.asarray(b, a.dtype), shape))


@dataclass(frozen=True)
class Numerics:
    act_dtype: np.dtype
    fake_quant: bool
    block_gemm: bool
    index_score_bf16: bool
    attn_probs_bf16: bool

    @classmethod
    def reference(cls) -> "Numerics":
        return cls(np.dtype(jnp.bfloat16), True, True, True, True)

    @classmethod
    def fast(cls) -> "Numerics":
        return cls(np.dtype(jnp.bfloat16), True, False, True, True)

    @classmethod
    def fp32(cls) -> "Numerics":
        return cls(np.dtype(jnp.float32), False, False, False, False)

    def act(self, x: jax.Array) -> jax.Array:
        return x.astype(self.act_dtype)

    @property
    def index_score_dtype(self) -> np.dtype:
        return np.dtype(jnp.bfloat16) if self.index_score_bf16 else np.dtype(jnp.float32)
