"""Linear layers at the reference's four kinds of sites.

Weights arrive dequantized (bf16 [out, in]; exact, see DESIGN.md) or fp32 where the reference
holds them in fp32. The activation fake-quant happens here, so the products equal the reference's
FP8/FP4 block GEMM products exactly; under `numerics.block_gemm` the fp32 accumulation order is
the reference kernels' too (kernel_cpu._block_scaled_gemm): every 32-wide K block summed in fp32,
the block partials added in fp32 in K order.

API (x [..., K], w [N, K]; outputs [..., N])
  lin8(x, w, numerics) -> act dtype   FP8 dense site: fp8_act_qdq(x) per 32, GEMM, one rounding.
  lin4                                 FP4 expert site; identical once the weight is dequantized.
  lin_bf(x, w, numerics) -> act dtype  plain bf16 linear with fp32 accumulation (no quant).
  lin_f32(x, w) -> fp32                 fp32 linear (router, LM head, ratio-2 compressor, ...): when x
                                        and w are both bf16, one bf16 GEMM accumulating in fp32.
  k_block_dot(x, w) -> fp32             the block-ordered fp32 GEMM itself.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from v41_jax.numerics import HIGHEST, Numerics
from v41_jax.quant import fp8_act_qdq

K_BLOCK = 32  # one activation scale and one weight scale per 32 inputs


def k_block_dot(x: jax.Array, w: jax.Array) -> jax.Array:
    lead, k = x.shape[:-1], x.shape[-1]
    n, nb = w.shape[0], k // K_BLOCK
    xb = x.astype(jnp.float32).reshape(-1, nb, K_BLOCK).transpose(1, 0, 2)  # [nb, M, 32]
    wb = w.astype(jnp.float32).reshape(n, nb, K_BLOCK).transpose(1, 0, 2)   # [nb, N, 32]

    def add_block(acc, blk):
        xk, wk = blk
        return acc + jnp.dot(xk, wk.T, precision=HIGHEST), None

    acc, _ = jax.lax.scan(add_block, jnp.zeros((xb.shape[1], n), jnp.float32), (xb, wb))
    return acc.reshape(*lead, n)


def _dot_f32(x: jax.Array, w: jax.Array) -> jax.Array:
    return jnp.dot(x, w.T.astype(x.dtype), precision=HIGHEST, preferred_element_type=jnp.float32)


def lin8(x: jax.Array, w: jax.Array, numerics: Numerics) -> jax.Array:
    x = numerics.act(x)
    if numerics.fake_quant:
        x = fp8_act_qdq(x, K_BLOCK)
    y = k_block_dot(x, w) if numerics.block_gemm else _dot_f32(x, w)
    return numerics.act(y)


lin4 = lin8  # FP4 expert weights arrive decoded to bf16 (at load or by `quant.held`): the FP8 GEMM


def lin_bf(x: jax.Array, w: jax.Array, numerics: Numerics) -> jax.Array:
    return numerics.act(_dot_f32(numerics.act(x), w))


def lin_f32(x: jax.Array, w: jax.Array) -> jax.Array:
    # A bf16 x bf16 product is exact in fp32 (8 + 8 significand bits), so the bf16 GEMM that
    # accumulates in fp32 is the fp32 GEMM of the same values (only the backend's accumulation
    # order is its own, as for any fp32 GEMM), on the tensor cores and from half the weight bytes.
    if x.dtype == w.dtype == jnp.bfloat16:
        return _dot_f32(x, w)
    return _dot_f32(x.astype(jnp.float32), w.astype(jnp.float32))
