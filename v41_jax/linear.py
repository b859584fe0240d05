"""Linear layers at the reference's four kinds of sites.

Weights arrive dequantized (bf16 [out, in]; exact, see DESIGN.md), fp32 where the reference
holds them in fp32, or, at the FP8 sites (`lin8`, `lin_grouped`), as published
(`quant.Fp8BlockWeight`: read by `kernels_pallas.dense_fp8` at decode row counts, decoded for
XLA's GEMM otherwise). The activation fake-quant happens here, so the products equal the
reference's FP8/FP4 block GEMM products exactly; under `numerics.block_gemm` the fp32
accumulation order is the reference kernels' too (kernel_cpu._block_scaled_gemm): every 32-wide K
block summed in fp32, the block partials added in fp32 in K order.

API (x [..., K], w [N, K]; outputs [..., N])
  lin8(x, w, numerics) -> act dtype   FP8 dense site: fp8_act_qdq(x) per 32, GEMM, one rounding.
  lin4                                 FP4 expert site; identical once the weight is dequantized.
  lin_bf(x, w, numerics) -> act dtype  plain bf16 linear with fp32 accumulation (no quant).
  lin_grouped(x, w, groups, numerics)  a block-diagonal linear ([..., G, D] by [G R, D]): `wo_a`.
  lin_f32(x, w) -> fp32                 fp32 linear (router, LM head, ratio-2 compressor, mHC mixes):
                                        when x and w are both bf16, one bf16 GEMM accumulating in
                                        fp32; bf16 x by an fp32 w, from SPLIT_ROWS rows, one bf16
                                        GEMM against w's three bf16 parts (`bf16_parts`).
  k_block_dot(x, w) -> fp32             the block-ordered fp32 GEMM itself.
  gemm_out_dtype(numerics, rows)        the preferred_element_type of a GEMM that `numerics.act`
                                        rounds next (fp32, or the act dtype: GEMM_OUT_ROWS).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from v41_jax.numerics import HIGHEST, Numerics
from kernels_pallas.dense_fp8 import dense_fp8, takes as takes_dense_fp8
from v41_jax.quant import Fp8BlockWeight, fp8_act_qdq, held

K_BLOCK = 32  # one activation scale and one weight scale per 32 inputs
SPLIT_ROWS = 256  # lin_f32 of bf16 rows by an fp32 weight: the three-part bf16 GEMM from here
# GEMMs write the activation dtype themselves (`Numerics.exact_gemm_out` off) from this many rows:
# XLA:GPU's one-row GEMV rounds a bf16 output apart from the fp32 result's cast (on the H100, 42 %
# of a row's outputs one bf16 ulp away); at 2 to 8,192 rows (13 counts, the model's six dense
# shapes) every output is the cast's (BENCHMARKS.md 2026-12-05 i).
GEMM_OUT_ROWS = 2


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


def gemm_out_dtype(numerics: Numerics, rows: int) -> np.dtype:
    """What an fp32-accumulating GEMM of `rows` rows, rounded to the activation dtype next, writes:
    fp32, or the activation dtype itself (`Numerics.exact_gemm_out` off, from GEMM_OUT_ROWS rows)."""
    own = not numerics.exact_gemm_out and rows >= GEMM_OUT_ROWS
    return numerics.act_dtype if own else np.dtype(jnp.float32)


def _dot_act(x: jax.Array, w: jax.Array, numerics: Numerics) -> jax.Array:
    """The fp32-accumulating GEMM of a linear the reference rounds to the activation dtype. The
    rows are counted as traced: under vmap (the routed experts' reference loop) one instance's,
    so those one-row GEMVs keep the fp32 output."""
    return jnp.dot(x, w.T.astype(x.dtype), precision=HIGHEST,
                   preferred_element_type=gemm_out_dtype(numerics, x.size // x.shape[-1]))


def lin8(x: jax.Array, w, numerics: Numerics) -> jax.Array:
    x = numerics.act(x)
    if numerics.gemm_fake_quant:
        x = fp8_act_qdq(x, K_BLOCK)
    if numerics.gemm_blocks:
        return numerics.act(k_block_dot(x, held(w)))
    if isinstance(w, Fp8BlockWeight):
        # held as published: the kernel reads the codes at decode row counts; otherwise XLA's
        # GEMM takes the decode (writing the activation dtype itself, as for a bf16 weight)
        if takes_dense_fp8(x.size // x.shape[-1], w):
            return numerics.act(dense_fp8(x, w))
        w = w.dequant()
    return numerics.act(_dot_act(x, w, numerics))


def lin_grouped(x: jax.Array, w, groups: int, numerics: Numerics) -> jax.Array:
    """x [..., G, D] by a block-diagonal weight w [G R, D] (group g's R rows against x's group g)
    -> [..., G, R] in the activation dtype: fp32 accumulation, one rounding (attention's `wo_a`).
    Held as published (`quant.Fp8BlockWeight`, the HF layout), the kernel reads the codes at decode
    row counts."""
    lead = x.shape[:-2]
    rows = x.size // (groups * x.shape[-1])
    if isinstance(w, Fp8BlockWeight) and takes_dense_fp8(rows, w, groups):
        return numerics.act(dense_fp8(x.reshape(*lead, -1), w, groups=groups).reshape(*lead, groups, -1))
    wg = held(w).reshape(groups, -1, x.shape[-1])
    return numerics.act(jnp.einsum("...gd,grd->...gr", x, wg.astype(x.dtype), precision=HIGHEST,
                                   preferred_element_type=gemm_out_dtype(numerics, rows)))


lin4 = lin8  # FP4 expert weights arrive decoded to bf16 (at load or by `quant.held`): the FP8 GEMM


def lin_bf(x: jax.Array, w: jax.Array, numerics: Numerics) -> jax.Array:
    return numerics.act(_dot_act(numerics.act(x), w, numerics))


def _top_bits(w: jax.Array) -> jax.Array:
    """fp32 w with all but its 8 leading significand bits cleared: a bf16 value, by truncation."""
    bits = jax.lax.bitcast_convert_type(w, jnp.uint32) & jnp.uint32(0xFFFF0000)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def bf16_parts(w: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """fp32 -> (hi, mid, lo) bf16 with hi + mid + lo == w exactly in fp32: hi is w's 8 leading
    significand bits, r = w - hi is exact with at most 16 significant bits, mid is r's 8 leading
    ones, and r - mid, a multiple of w's last bit with at most 8 significant bits, is lo exactly.
    For finite w of magnitude >= 2^-103, where that last bit, and so every nonzero part, is a
    normal number (XLA flushes subnormals to zero). The parts are cut by clearing bits,
    not by an fp32 -> bf16 -> fp32 round trip: XLA:GPU removes such a pair as excess precision
    (`xla_allow_excess_precision`), which made every remainder 0."""
    hi = _top_bits(w)
    r = w - hi                                                       # exact: <= 16 significant bits
    mid = _top_bits(r)
    return hi.astype(jnp.bfloat16), mid.astype(jnp.bfloat16), (r - mid).astype(jnp.bfloat16)


def lin_f32(x: jax.Array, w: jax.Array) -> jax.Array:
    # A bf16 x bf16 product is exact in fp32 (8 + 8 significand bits), so the bf16 GEMM that
    # accumulates in fp32 is the fp32 GEMM of the same values (only the backend's accumulation
    # order is its own, as for any fp32 GEMM), on the tensor cores and from half the weight bytes.
    if x.dtype == w.dtype == jnp.bfloat16:
        return _dot_f32(x, w)
    if x.dtype == jnp.bfloat16 and w.dtype == jnp.float32 and x.size // x.shape[-1] >= SPLIT_ROWS:
        # bf16 values times an fp32 weight (the mHC mixes): the weight as three bf16 parts stacked
        # along N, one tensor-core GEMM whose every product is exact, the three partial outputs
        # added in fp32 (two roundings more than the fp32 GEMM's K; no backend's K order is the
        # reference's either). Rows >= SPLIT_ROWS only: a decode step's few rows are bound by
        # reading the weight (6 bytes a value as parts against 4, cut again every call), a
        # prefill's by the fp32 CUDA-core GEMM (issue 16: 2.0 ms of a 4,096-token prefill, 12
        # launches). So one token's mixes may differ in the last bits between a step of 255 rows
        # and one of 256, as any backend's GEMM may with its row count.
        return dot_bf16_parts(x, w)
    return _dot_f32(x.astype(jnp.float32), w.astype(jnp.float32))


def dot_bf16_parts(x: jax.Array, w: jax.Array) -> jax.Array:
    """bf16 x [..., K] by fp32 w [N, K] -> fp32: the split route of `lin_f32`."""
    n = w.shape[0]
    y = _dot_f32(x, jnp.concatenate(bf16_parts(w), axis=0))             # [..., 3N]
    return (y[..., :n] + y[..., n:2 * n]) + y[..., 2 * n:]
