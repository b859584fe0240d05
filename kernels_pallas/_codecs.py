"""Decoding the published FP8 / FP4 codes inside a kernel (Triton lowering), exactly.

Shared by the MoE kernels (expert weights held as FP8 rows or FP4), the indexer (index keys held
packed in the cache) and the sparse attention (main and window rows held packed; docs/CACHE.md
§1.3). jnp references: `v41_jax.quant` (`e4m3_to_f32`, `dequant_fp4_ue8m0_rows`,
`dequant_fp4_e4m3_rows`, `dequant_fp8_rows`).

  e4m3_as(codes uint8 [...], dtype) -> the E4M3 values in dtype
  fp4_halves(codes uint8 [N, K/2], scale uint8 [N, K/group]) -> fp32 (even, odd) [N, K/2] each
  fp4_values(codes, scale, dtype) -> [N, K] in dtype, the even and odd inputs back in place
  (scales E8M0 in groups of 32, or E4M3 in groups of 16: `group=16, e4m3_scales=True`)
  fp8_values(codes uint8 [N, K], scale uint8 [N, K/32], dtype) -> [N, K] (E8M0 scales)
  fp8_halves(codes, scale) -> fp32 (even, odd) [N, K/2] each
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from v41_jax.quant import FP4_GROUP, KV_FP8_GROUP


def e4m3_as(codes, dtype):
    """E4M3 codes (uint8) -> their values in `dtype`, exactly. A 16-bit target goes by way of fp16:
    every E4M3 value is an fp16 (3 mantissa bits, exponents -9..8), E4M3 -> fp16 is one hardware
    conversion per two values on sm89+, and Triton's direct E4M3 -> bf16 takes a longer route
    (H200, FP8-row grouped GEMM at 16 / 32 / 128 decode tokens: 0.63 -> 0.49, 0.77 -> 0.59,
    0.82 -> 0.64 ms). An fp32 target converts directly: by way of fp16 the one-token GEMV ran
    0.097 -> 0.106 ms (BENCHMARKS.md, 2026-12-04 b)."""
    e4m3 = jax.lax.bitcast_convert_type(codes, jnp.float8_e4m3fn)
    return e4m3.astype(jnp.float16 if jnp.dtype(dtype).itemsize == 2 else dtype).astype(dtype)


def e8m0_as_f32(codes):
    """E8M0 scale codes (uint8) -> 2^(c - 127) in fp32, exactly: the exponent field c, and for the
    two codes it cannot hold as one, 2^-127 (a subnormal) and NaN (code 255)."""
    c = codes.astype(jnp.int32)
    bits = jnp.where(c == 0, 0x00400000, jnp.where(c == 255, 0x7FC00000, c << 23))
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def per_lane(scale, lanes: int):
    """Per-group scales [N, G] -> [N, G * lanes], each repeated over its group's lanes (or its
    group's byte pairs)."""
    n, g = scale.shape
    return jnp.broadcast_to(scale[:, :, None], (n, g, lanes)).reshape(n, g * lanes)


def fp8_values(codes, scale, dtype, *, group: int = KV_FP8_GROUP):
    """E4M3 codes uint8 [N, K] x E8M0 scale codes [N, K/group] -> [N, K] in dtype, exactly (an
    E4M3 value times a power of two: 4 significant bits, a bf16 down to 2^-133)."""
    s = per_lane(e8m0_as_f32(scale), group)
    return (e4m3_as(codes, jnp.float32) * s).astype(dtype)


def fp8_halves(codes, scale, *, group: int = KV_FP8_GROUP):
    """`fp8_values` as its (even, odd) inputs, fp32 [N, K/2] each, exactly: the codes split in
    registers (each byte pair stays in one thread), each scale broadcast over its group's pairs."""
    even, odd = jnp.unstack(codes.reshape(codes.shape[0], codes.shape[1] // 2, 2), axis=-1)
    s = per_lane(e8m0_as_f32(scale), group // 2)
    return e4m3_as(even, jnp.float32) * s, e4m3_as(odd, jnp.float32) * s


def fp4_halves(codes, scale, *, group: int = FP4_GROUP, e4m3_scales: bool = False):
    """Packed E2M1 codes uint8 [N, K/2] (even input in the low nibble), scale codes uint8
    [N, K/group] (E8M0, or E4M3 with `e4m3_scales`: the compressed KV rows' group-16 format)
    -> fp32 (even, odd) inputs, each [N, K/2]; exact. A nibble's bits moved into an E4M3 byte
    (sign to bit 7, exponent and mantissa to bits 4..2) are its E2M1 value times 2^-6, normal or
    not, so one hardware fp8 conversion decodes it; an E8M0 scale 2^(c-127) times 2^6 is the
    fp32 with exponent field c + 6 (codes up to 248; the formats' scales stay far below: 255 is
    NaN, and a larger code here spills into the sign bit); an E4M3 scale times 2^6 is exact in
    fp32 (4 significant bits), and so is its product with an E2M1 value (6 bits)."""
    lo = ((codes << 4) & 0x80) | ((codes << 2) & 0x1C)
    hi = (codes & 0x80) | ((codes >> 2) & 0x1C)
    if e4m3_scales:
        s = e4m3_as(scale, jnp.float32) * 64.0
    else:
        s = jax.lax.bitcast_convert_type((scale.astype(jnp.int32) + 6) << 23, jnp.float32)
    s = per_lane(s, group // 2)                                           # a byte holds 2 lanes
    return e4m3_as(lo, jnp.float32) * s, e4m3_as(hi, jnp.float32) * s


def fp4_values(codes, scale, dtype, **fmt):
    """`fp4_halves` (its scale format keywords `fmt`) with the even and odd inputs interleaved
    back in place -> [N, K] in dtype (exact in bf16 too: an E2M1 value times a power of two is a
    bf16 down to 2^-133, times an E4M3 scale 6 significant bits)."""
    even, odd = fp4_halves(codes, scale, **fmt)
    n, half = even.shape
    return jnp.stack([even, odd], axis=-1).reshape(n, 2 * half).astype(dtype)
