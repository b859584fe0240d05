"""Correctly rounded fp32 division and square root inside Triton kernels (and one division that is
not: `div_near_by`, the fast policy's).

Triton's fp32 `/` and `sqrt` are approximate on NVIDIA (`div.full.f32`, up to 2 ulp; libdevice's
`sqrtf` without the precise-sqrt reflection); their fp64 forms are IEEE (`div.rn.f64`,
`sqrt.rn.f64`; on ROCm LLVM's `fdiv` without fast-math flags and OCML's `sqrt`, both correctly
rounded). So both take their result in fp64 and round it to fp32 once, and that double rounding
equals the single correct rounding: Figueroa's rule, a p'-bit intermediate is harmless for +, -,
*, / and sqrt of p-bit operands when p' >= 2p + 2 (53 >= 50); `div_rn` spells the argument out.
fp64 is traced inside `jax.enable_x64`: the kernel's own dtypes, whatever the process's flag.
On CUDA LLVM folds fptrunc(fdiv(fpext a, fpext b)) into an fp32 fdiv (the same value in IEEE
arithmetic, by this rule), and XLA lowers an fp32 fdiv to `div.full` unless its LLVM option
-nvptx-prec-divf32=2 is set: `v41_jax.xla_env` sets it (without it, 20 % of `div_rn`'s quotients
were 1 ulp off on the H200; the square root is not folded this way and was exact either way).

  div_rn(a, b)          a / b, fp32 operands
  div_rn_by(xs, b)      [x / b for x in xs] without a division, for a positive normal b, normal
                        x and normal quotients (the caller proves that range)
  div_near_by(xs, b)    [x / b for x in xs] within 3 fp32 ulps, for a positive normal b: one fp32
                        reciprocal by three Newton steps, no fp64 (not correctly rounded); plain
                        jnp, the same bits in a kernel and on the XLA path
  sqrt_rn(v)            sqrt(v), fp32 operand
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from v41_jax.numerics import rounded


def div_rn(a: jax.Array, b: jax.Array) -> jax.Array:
    """a / b correctly rounded to fp32, for fp32 a, b, inside a Triton kernel.

    RN24(RN53(a / b)) (a, b are exact in fp64; fptrunc rounds to nearest even) equals RN24(a / b).
    The arithmetic: it can only differ if the fp64 rounding moves q = a/b onto or across an fp32
    rounding midpoint m. Scale a, b by powers of two (exact) so that b = B 2^-23 in [1, 2) and
    q in [1, 2); then a = A 2^-23 (A integer), m = M 2^-24 (M odd) and a - m b = 2^-47
    (A 2^24 - M B), where M B has at most 23 factors of two and A 2^24 at least 24: never 0, so
    |q - m| = |a - m b| / b > 2^-48, while |RN53(q) - q| <= 2^-53. A subnormal fp32 q (midpoints
    the multiples of 2^-150; no scaling) keeps a margin: a - m b is a multiple of
    2^min(ea, eb - 150) (a = A 2^ea, b = B 2^eb, A, B < 2^24), larger than 2^-53 a because
    a < 2^(ea + 24) and a = q b < 2^(eb - 102); an exact midpoint q is exact in fp64 and ties
    alike. fp64 never underflows here (|q| >= 2^-277).
    """
    with jax.enable_x64(True):
        return (a.astype(jnp.float64) / b.astype(jnp.float64)).astype(jnp.float32)


# The classic bit-level guess of 1 / b for a positive normal fp32 b: within 5.06 % (every fp32
# significand checked), then Newton steps y <- y (2 - b y), each squaring the relative error.
_RECIPROCAL_GUESS = 0x7EF311C3


def _reciprocal_f32(b: jax.Array, steps: int) -> jax.Array:
    bits = jnp.int32(_RECIPROCAL_GUESS) - jax.lax.bitcast_convert_type(b, jnp.int32)
    y = jax.lax.bitcast_convert_type(bits, jnp.float32)
    for _ in range(steps):
        # b y rounded on its own: the same operations under Triton and XLA:CPU, which would each
        # contract it into 2 - b y as an FMA
        y = y * (2.0 - rounded(b * y))
    return y


def div_rn_by(xs: list, b: jax.Array) -> list:
    """[RN24(x / b) for x in xs], fp32, with no division, for a positive normal fp32 b, normal (or
    zero) x and quotients that are normal fp32 numbers (or 0; NaN when an operand is NaN): the
    caller proves that range. (A subnormal x is out of it also because XLA:CPU flushes it to 0.)

    Why: a correctly rounded fp32 division is a long instruction sequence on CUDA (`div.rn.f32`),
    and a chain of them is what an N x N Sinkhorn round waits on; here one reciprocal serves the N
    entries that share a divisor, and the rest is fp64 multiply-adds, exact on every backend.
    The arithmetic: two fp32 Newton steps from the guess (5.06 % -> 2.6e-3 -> 7e-6), then two in
    fp64, e = 1 - b y (b y rounded once: 2^-53; 1 - b y exact by Sterbenz), y + y e (rounded
    once: 2^-53), leave y = (1 + d) / b with |d| <= 2^-52 + 2^-68. Then RN53(x y) = (x / b)(1 + d'),
    |d'| < 1.6 * 2^-52 < 2^-50. A normal fp32 quotient q lies more than 2^-49 q from every fp32
    rounding midpoint (`div_rn`: |q - m| > 2^-48 once q is scaled into [1, 2)), so RN24 of it is
    RN24(x / b). Subnormal quotients lack that margin (an exact midpoint can be a quotient there),
    hence the caller's range.
    """
    y = _reciprocal_f32(b, 2)
    with jax.enable_x64(True):
        b64, y = b.astype(jnp.float64), y.astype(jnp.float64)
        for _ in range(2):
            y = y + y * (1.0 - b64 * y)
        return [(x.astype(jnp.float64) * y).astype(jnp.float32) for x in xs]


def div_near_by(xs: list, b: jax.Array) -> list:
    """[x / b for x in xs], each within 3 ulps, for a positive normal fp32 b (NaN in, NaN out).
    Three Newton steps from the 5.06 % guess leave 5.06 % -> 2.6e-3 -> 6.6e-6 -> 4.4e-11 relative
    error before fp32 rounding; each step's rounding (b y, 2 - b y, the product: <= 1.5 ulp, the
    last step's only surviving) and the final product's (0.5 ulp) keep x y within 3 ulps of x / b.
    Plain jnp with every product rounded on its own (`numerics.rounded`), so a kernel and the XLA
    path compute the same bits (`kernels_pallas.reference.sinkhorn` with exact off)."""
    y = _reciprocal_f32(b, 3)
    return [rounded(x * y) for x in xs]


def sqrt_rn(v: jax.Array) -> jax.Array:
    """sqrt(v) correctly rounded to fp32, for fp32 v >= 0 (or NaN / inf), inside a Triton kernel.

    RN24(RN53(sqrt v)) = RN24(sqrt v) by the rule above (53 >= 2 * 24 + 2). Directly: scaled by
    a power of four so that an fp32 rounding midpoint m = M 2^-24 (M odd) is in [1, 2), v = V 2^-23
    (V integer) and v - m^2 = 2^-48 (V 2^25 - M^2) != 0 (M^2 is odd), so |sqrt v - m| =
    |v - m^2| / (sqrt v + m) > 2^-50, while |RN53(sqrt v) - sqrt v| <= 2^-53. The square root of
    a subnormal v is a normal number, so the scaling argument covers it too.
    """
    with jax.enable_x64(True):
        return jnp.sqrt(v.astype(jnp.float64)).astype(jnp.float32)
