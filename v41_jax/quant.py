"""Quantization codecs: the published checkpoint formats and the reference's QAT round-trips.

Bit-exact ports of the reference quantizers (`act_quant`, `fp4_act_quant` in the official
`kernel_cpu.py`) and decoders of every stored format (docs/MODEL.md §2.1, §4.2):

  * E8M0 ("ue8m0") scale byte c -> 2^(c-127); c = 0 is 2^-127 (not zero), c = 255 is NaN.
  * E4M3FN (OCP fp8, bias 7, max 448, no inf; 0x7f/0xff are NaN).
  * E2M1 (OCP fp4) nibble: bit 3 = sign, bits 0-2 index {0, .5, 1, 1.5, 2, 3, 4, 6}; packed two per
    byte with the even element in the low nibble.

Every function is jax.numpy, so it traces under jit; the public encoders, QDQ helpers and
dequantizers are jitted themselves (one compile per shape when called eagerly) and take numpy input
too (the writer quantizes host arrays with the same code). Codes come back as uint8 bit patterns,
E8M0 / E4M3 scales as uint8 codes too, so Pallas kernels, numpy and safetensors views read them alike.

Rounding is done arithmetically (scale by the grid's power-of-two step, `round` half to even,
scale back), never by an fp32 -> fp8 dtype conversion: the result is then independent of how a
backend lowers float8 conversions, and the cast of the already-on-grid value is exact. Scaling by a
power of two multiplies by its exact reciprocal.

Two XLA behaviours this module works around or states, and callers elsewhere should know:
  * XLA's fp32 division is not always correctly rounded: it rewrites `a / c` (c a constant or a
    broadcast) into `a * (1/c)`, and division on GPU is approximate (H200, jax 0.11.2: a third of
    quotients differ by an ulp). The reference divides in IEEE fp32 by the non-power-of-two e4m3
    scale (and amax by 6); `_round_quotient` reproduces the rounded result from an approximate
    quotient with exact comparisons.
  * XLA on CPU flushes fp32 subnormals to zero (inputs and results). The codecs here only touch
    subnormals for |x| < 2^-126 or E8M0 codes below ~10 (scales < 2^-117), which no real weight or
    activation reaches; `e8m0_to_f32` itself returns 2^-127 exactly for code 0.

The QDQ helpers (`fp8_act_qdq`, `fp4_qdq_e4m3`, `fp4_qdq_ue8m0`) compute in fp32 and return
x.dtype, exactly like the reference's `inplace=True` calls on bf16 tensors; their derivative is the
identity (straight-through), so training can run under the fake-quantizing numerics.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

FP8_MAX = 448.0
FP4_MAX = 6.0
# lanes per E8M0 scale of the FP4 formats: the published FP4 weights, the index keys and queries'
# fake-quant, and so the cache's packed index rows
FP4_GROUP = 32
FP8_WEIGHT_BLOCK = 32  # edge of the dense FP8 weights' square E8M0 scale blocks
# The reference multiplies amax by fp32 reciprocals rather than dividing (kernel_cpu fast_round_scale).
_FP8_MAX_INV = np.float32(1.0 / FP8_MAX)
_FP4_MAX_INV = np.float32(1.0 / FP4_MAX)
# amax floors (K41): A8 activations, fp4 with e4m3 scale, fp4 with ue8m0 scale.
_FP8_AMAX_FLOOR = np.float32(1e-4)
_FP4_E4M3_AMAX_FLOOR = np.float32(6 * 2.0**-9)
_FP4_UE8M0_AMAX_FLOOR = np.float32(6 * 2.0**-126)

# Signed E2M1 decode table, code 8 = -0.0 like the reference's FP4_TABLE.
E2M1_TABLE = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                       -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=np.float32)

_F32_NAN_BITS = 0x7FC00000
_F32_2POW_M127_BITS = 0x00400000  # 2^-127 is an fp32 subnormal: exponent field 0, top mantissa bit


# ---- bit helpers ---------------------------------------------------------------------------------

def as_u8(x) -> jax.Array:
    """View any one-byte array (uint8, int8, float8_e4m3fn, float8_e8m0fnu, numpy or jax) as uint8."""
    if isinstance(x, np.ndarray):
        if x.dtype.itemsize != 1:
            raise ValueError(f"expected a one-byte dtype, got {x.dtype}")
        return jnp.asarray(x.view(np.uint8))
    x = jnp.asarray(x)
    if x.dtype.itemsize != 1:
        raise ValueError(f"expected a one-byte dtype, got {x.dtype}")
    return x if x.dtype == jnp.uint8 else jax.lax.bitcast_convert_type(x, jnp.uint8)


def _f32_from_bits(bits) -> jax.Array:
    return jax.lax.bitcast_convert_type(bits.astype(jnp.uint32), jnp.float32)


def _bits_from_f32(x) -> jax.Array:
    return jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)


# ---- decoders ------------------------------------------------------------------------------------

def e8m0_to_f32(codes) -> jax.Array:
    """E8M0 scale codes -> fp32 2^(c-127); code 0 -> 2^-127, code 255 -> NaN."""
    c = as_u8(codes).astype(jnp.uint32)
    bits = jnp.where(c == 0, jnp.uint32(_F32_2POW_M127_BITS), c << 23)
    return _f32_from_bits(jnp.where(c == 255, jnp.uint32(_F32_NAN_BITS), bits))


def e4m3_to_f32(codes) -> jax.Array:
    """E4M3FN bit patterns -> fp32 (widening is exact; 0x7f / 0xff are NaN)."""
    return jax.lax.bitcast_convert_type(as_u8(codes), jnp.float8_e4m3fn).astype(jnp.float32)


def e2m1_to_f32(nibbles) -> jax.Array:
    """4-bit E2M1 codes (one per uint8) -> fp32."""
    return jnp.asarray(E2M1_TABLE)[as_u8(nibbles) & 0xF]


def unpack_fp4(packed) -> jax.Array:
    """Packed E2M1 [..., K/2] -> nibble codes uint8 [..., K]; the low nibble is the even element."""
    b = as_u8(packed)
    return jnp.stack([b & 0xF, b >> 4], axis=-1).reshape(*b.shape[:-1], 2 * b.shape[-1])


def pack_fp4(codes) -> jax.Array:
    """Nibble codes uint8 [..., K] (K even) -> packed uint8 [..., K/2], even element low."""
    c = as_u8(codes)
    if c.shape[-1] % 2:
        raise ValueError(f"pack_fp4: last dim {c.shape[-1]} is odd")
    return (c[..., 0::2] & 0xF) | ((c[..., 1::2] & 0xF) << 4)


def _repeat_to(scale, block: tuple[int, ...], shape: tuple[int, ...]) -> jax.Array:
    """Broadcast per-block scales [ceil(n0/b0), ...] over element shape `shape` (partial edge blocks)."""
    for axis in range(scale.ndim):
        if block[axis] > 1:
            scale = jnp.repeat(scale, block[axis], axis=axis)
    return scale[tuple(slice(0, n) for n in shape)]


@partial(jax.jit, static_argnames=("block", "dtype"))
def dequant_fp8_blocks(weight, scale, block: int = FP8_WEIGHT_BLOCK, dtype=jnp.bfloat16) -> jax.Array:
    """FP8 weight [..., out, in] x E8M0 [..., ceil(out/b), ceil(in/b)] (one scale per b x b block)
    -> dtype. Leading axes (a stack of layers) pair one to one.

    e4m3 times a power of two is exact in bf16 (barring underflow below 2^-133)."""
    w = e4m3_to_f32(weight)
    *lead, out_f, in_f = w.shape
    want = (*lead, -(-out_f // block), -(-in_f // block))
    if tuple(scale.shape) != want:
        raise ValueError(f"dequant_fp8_blocks: weight {w.shape} needs scale {want}, got {tuple(scale.shape)}")
    return (w * _repeat_to(e8m0_to_f32(scale), (*(1,) * len(lead), block, block), w.shape)).astype(dtype)


@partial(jax.jit, static_argnames=("group", "dtype"))
def dequant_fp4_rows(weight, scale, group: int = 32, dtype=jnp.bfloat16) -> jax.Array:
    """Packed FP4 weight [..., out, in/2] (I8) x E8M0 [..., out, in/group] -> dtype [..., out, in].

    Leading dims stack experts: one call dequantizes a whole layer's routed experts."""
    w = e2m1_to_f32(unpack_fp4(weight))
    want = (*w.shape[:-1], w.shape[-1] // group)
    if tuple(scale.shape) != want or w.shape[-1] % group:
        raise ValueError(f"dequant_fp4_rows: weight {w.shape} (packed {tuple(weight.shape)}) "
                         f"needs scale {want}, got {tuple(scale.shape)}")
    wg = w.reshape(*want, group) * e8m0_to_f32(scale)[..., None]
    return wg.reshape(w.shape).astype(dtype)


@partial(jax.jit, static_argnames=("group", "dtype"))
def dequant_fp8_rows(weight, scale, group: int = 32, dtype=jnp.bfloat16) -> jax.Array:
    """FP8 rows [..., d] x E8M0 [..., d/group] (Engram table rows, window-KV rows) -> dtype."""
    w = e4m3_to_f32(weight)
    if w.shape[-1] % group or tuple(scale.shape) != (*w.shape[:-1], w.shape[-1] // group):
        raise ValueError(f"dequant_fp8_rows: rows {w.shape} need scale "
                         f"{(*w.shape[:-1], w.shape[-1] // group)}, got {tuple(scale.shape)}")
    wg = w.reshape(*w.shape[:-1], -1, group) * e8m0_to_f32(scale)[..., None]
    return wg.reshape(w.shape).astype(dtype)


@partial(jax.jit, static_argnames=("group", "dtype"))
def dequant_fp4_e4m3_rows(packed, scale, group: int = 16, dtype=jnp.bfloat16) -> jax.Array:
    """Packed FP4 rows [..., d/2] x E4M3 scales [..., d/group] (compressed KV rows) -> dtype."""
    v = e2m1_to_f32(unpack_fp4(packed))
    vg = v.reshape(*v.shape[:-1], -1, group) * e4m3_to_f32(scale)[..., None]
    return vg.reshape(v.shape).astype(dtype)


@partial(jax.jit, static_argnames=("group", "dtype"))
def dequant_fp4_ue8m0_rows(packed, scale, group: int = 32, dtype=jnp.bfloat16) -> jax.Array:
    """Packed FP4 rows [..., d/2] x E8M0 scales [..., d/group] (index keys) -> dtype."""
    v = e2m1_to_f32(unpack_fp4(packed))
    vg = v.reshape(*v.shape[:-1], -1, group) * e8m0_to_f32(scale)[..., None]
    return vg.reshape(v.shape).astype(dtype)


# ---- rounding onto the grids (fp32 in, fp32 on-grid out) -----------------------------------------

def _pow2(e) -> jax.Array:
    """2^e as fp32 for integer e in the normal range (built from bits: exact on every backend)."""
    return _f32_from_bits((jnp.asarray(e, jnp.int32) + 127).astype(jnp.uint32) << 23)


def _ulp(x) -> jax.Array:
    """Unit in the last place of normal fp32 x > 0."""
    return _f32_from_bits((_bits_from_f32(x) & 0x7F800000) - (23 << 23))


def _e4m3_step_exp(a) -> jax.Array:
    """log2 of the E4M3 grid step at |a|: 3 mantissa bits, subnormal step 2^-9 below 2^-6."""
    return jnp.maximum(((_bits_from_f32(a) >> 23) & 0xFF).astype(jnp.int32) - 127, -6) - 3


def _e2m1_step_exp(a) -> jax.Array:
    """log2 of the E2M1 grid step at |a|: 0.5 below 2, 1 below 4, 2 up to 6."""
    return jnp.where(a < 2, -1, jnp.where(a < 4, 0, 1))


def _round_steps(t) -> jax.Array:
    """t in [0, 16) or NaN -> the nearest integer, ties to even (`jnp.round`), in integer ops: a
    kernel's Triton lowering has no round, and XLA folds (t + 2^23) - 2^23 back into t."""
    i = t.astype(jnp.int32)                                            # t >= 0: the floor
    frac = t - i.astype(jnp.float32)                                   # exact
    up = (frac > 0.5) | ((frac == 0.5) & ((i & 1) == 1))
    return jnp.where(t != t, t, (i + up.astype(jnp.int32)).astype(jnp.float32))


def _round_grid(x, step_exp, max_val: float) -> jax.Array:
    """fp32 -> nearest grid value, ties to even, |x| saturated at max_val (the satfinite cast)."""
    a = jnp.minimum(jnp.abs(x.astype(jnp.float32)), max_val)
    k = step_exp(a)
    return jnp.copysign(_round_steps(a * _pow2(-k)) * _pow2(k), x)


def round_e4m3(x) -> jax.Array:
    """fp32 -> nearest E4M3FN value (RNE), saturating at +-448 like the CUDA satfinite cast."""
    return _round_grid(x, _e4m3_step_exp, FP8_MAX)


def round_e2m1(x) -> jax.Array:
    """fp32 -> nearest E2M1 value, ties to the even code (0.25->0, 0.75->1, 5->4), saturating at +-6."""
    return _round_grid(x, _e2m1_step_exp, FP4_MAX)


def _round_quotient(num, den, q, step_exp, max_val: float) -> jax.Array:
    """The grid rounding (RNE, saturating) of fl32(num / den), den > 0 with few significant bits.

    The reference divides in IEEE fp32 and then rounds onto the grid. XLA's divisions are not all
    correctly rounded (GPU division is approximate; division by a constant or a broadcast becomes a
    reciprocal multiply), and an error of one ulp flips exact ties such as 2.5 -> 2 or 3, which are
    common with bf16 data. So `q` may be any approximation of num / den within a small fraction of a
    grid step; the decision is made exactly: the two grid points around q and their midpoint m;
    a correctly rounded quotient lands on m iff |num/den - m| <= ulp(m)/2 (m has few bits, so its
    last bit is even and halfway cases round onto it), i.e. iff |num - m*den| <= den*ulp(m)/2.
    m*den and den*ulp(m)/2 are exact (few-bit factors); the difference is exact where it matters
    (Sterbenz), so the comparisons are exact on every backend. (Just below a power-of-two m the
    fp32 spacing halves and the tie band is narrower, but such an m only sits above lo = 0, the
    even point, so a tie and a round-down agree.)"""
    a = jnp.minimum(jnp.abs(q), max_val)
    k = step_exp(a)
    step = _pow2(k)
    lo_index = jnp.floor(a * _pow2(-k))
    lo = lo_index * step
    mid = lo + step * 0.5
    d = jnp.abs(num) - mid * den
    h = den * (_ulp(mid) * 0.5)
    up = (d > h) | ((d >= -h) & (jnp.mod(lo_index, 2) == 1))          # a tie goes to the even point
    return jnp.copysign(jnp.minimum(jnp.where(up, lo + step, lo), max_val), num)


def e4m3_codes(x_on_grid) -> jax.Array:
    """On-grid fp32 (from round_e4m3) -> E4M3FN bit patterns uint8; the cast is exact."""
    return jax.lax.bitcast_convert_type(x_on_grid.astype(jnp.float8_e4m3fn), jnp.uint8)


def e2m1_codes(x_on_grid) -> jax.Array:
    """On-grid fp32 (from round_e2m1) -> 4-bit codes uint8; -0.0 keeps its sign bit (code 8)."""
    m = jnp.abs(x_on_grid)
    mag = jnp.where(m < 2, 2 * m, jnp.where(m < 4, m + 2, m / 2 + 4)).astype(jnp.uint8)
    return mag | (jnp.signbit(x_on_grid).astype(jnp.uint8) << 3)


def ue8m0_scale(amax, max_inv) -> tuple[jax.Array, jax.Array, jax.Array]:
    """2^ceil(log2(amax * max_inv)) as (fp32 scale, its exact reciprocal, E8M0 code): the exponent of
    the product, plus one when its mantissa is non-zero (the reference's fast_round_scale). Dividing
    by the scale is multiplying by the reciprocal, exactly (codes 1..253; finite amax stays inside)."""
    bits = _bits_from_f32(amax.astype(jnp.float32) * max_inv)
    code = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).astype(jnp.uint32)
    return _f32_from_bits(code << 23), _f32_from_bits((254 - code) << 23), code.astype(jnp.uint8)


# ---- grouped encoders (shared by QDQ, cache writers and the weight writer) -----------------------

def _groups(x, group: int, what: str) -> jax.Array:
    x = jnp.asarray(x)
    if x.shape[-1] % group:
        raise ValueError(f"{what}: last dim {x.shape[-1]} is not a multiple of {group}")
    return x.astype(jnp.float32).reshape(*x.shape[:-1], -1, group)


def _fp8_ue8m0_groups(xg) -> tuple[jax.Array, jax.Array, jax.Array]:
    """xg fp32 [..., g] -> (on-grid e4m3 values [..., g], fp32 scale [...], E8M0 code [...])."""
    s, inv, code = _fp8_ue8m0_scale(jnp.max(jnp.abs(xg), axis=-1))
    return round_e4m3(xg * inv[..., None]), s, code


def _fp8_ue8m0_scale(amax) -> tuple[jax.Array, jax.Array, jax.Array]:
    return ue8m0_scale(jnp.maximum(amax, _FP8_AMAX_FLOOR), _FP8_MAX_INV)


def fp8_act_qdq_by_amax(x, group_amax) -> jax.Array:
    """`fp8_act_qdq`'s value of fp32 x given its group's max |x| in x's shape (fp32): for a kernel
    that holds a tile of whole groups and takes their max its own way."""
    s, inv, _ = _fp8_ue8m0_scale(group_amax)
    return round_e4m3(x * inv) * s


def _fp4_e4m3_groups(xg) -> tuple[jax.Array, jax.Array, jax.Array]:
    """xg fp32 [..., g] -> (on-grid e2m1 values, fp32 scale = e4m3(amax/6) saturating, E4M3 code)."""
    amax = jnp.maximum(jnp.max(jnp.abs(xg), axis=-1), _FP4_E4M3_AMAX_FLOOR)
    six = np.float32(FP4_MAX)
    s = _round_quotient(amax, six, amax / six, _e4m3_step_exp, FP8_MAX)
    sg = s[..., None]
    return _round_quotient(xg, sg, xg / sg, _e2m1_step_exp, FP4_MAX), s, e4m3_codes(s)


def _fp4_ue8m0_groups(xg) -> tuple[jax.Array, jax.Array, jax.Array]:
    """xg fp32 [..., g] -> (on-grid e2m1 values, fp32 power-of-two scale, E8M0 code)."""
    amax = jnp.maximum(jnp.max(jnp.abs(xg), axis=-1), _FP4_UE8M0_AMAX_FLOOR)
    s, inv, code = ue8m0_scale(amax, _FP4_MAX_INV)
    return round_e2m1(xg * inv[..., None]), s, code


@partial(jax.jit, static_argnames=("block",))
def quant_fp8_ue8m0(x, block: int = 32) -> tuple[jax.Array, jax.Array]:
    """A8 / window-KV / Engram-row encoder: x [..., n] -> (E4M3 codes uint8 [..., n],
    E8M0 codes uint8 [..., n/block])."""
    q, _, code = _fp8_ue8m0_groups(_groups(x, block, "quant_fp8_ue8m0"))
    return e4m3_codes(q).reshape(jnp.shape(x)), code


@partial(jax.jit, static_argnames=("group",))
def quant_fp4_e4m3(x, group: int = 16) -> tuple[jax.Array, jax.Array]:
    """Compressed-KV encoder: x [..., n] -> (packed E2M1 uint8 [..., n/2], E4M3 codes uint8 [..., n/group])."""
    q, _, code = _fp4_e4m3_groups(_groups(x, group, "quant_fp4_e4m3"))
    return pack_fp4(e2m1_codes(q).reshape(jnp.shape(x))), code


@partial(jax.jit, static_argnames=("group",))
def quant_fp4_ue8m0(x, group: int = 32) -> tuple[jax.Array, jax.Array]:
    """Index-key/query encoder: x [..., n] -> (packed E2M1 uint8 [..., n/2], E8M0 codes uint8 [..., n/group])."""
    q, _, code = _fp4_ue8m0_groups(_groups(x, group, "quant_fp4_ue8m0"))
    return pack_fp4(e2m1_codes(q).reshape(jnp.shape(x))), code


def pack_fp4_ue8m0_rows(x, group: int = FP4_GROUP) -> jax.Array:
    """Rows an `fp4_qdq_ue8m0` put on its grid [..., n] -> packed rows uint8 [..., n/2 + n/group]:
    the E2M1 bytes, then the E8M0 codes (the cache's packed index rows, docs/CACHE.md §1.3).
    Exact for such rows (`unpack_fp4_ue8m0_rows` gives back their values, -0.0 included): the
    re-quantized group's largest code m is 4 or 6 (the same scale) or m <= 3, where the scale drops
    by 2^j (j = 1, 2, 3 for m in [2, 3], [1, 1.5], 0.5) and every code of the group, at most m,
    times 2^j is again an E2M1 value; an all-zero group (m = 0) keeps its zeros and their signs
    whatever the floor's scale."""
    codes, scale = quant_fp4_ue8m0(x, group)
    return jnp.concatenate([codes, scale], axis=-1)


# The reference's KV round trips, and the cache's packed rows of them (docs/CACHE.md §1.3): window
# (and draft) rows FP8 with one E8M0 scale per 32 lanes, compressed rows FP4 with one E4M3 scale
# per 16 lanes.
KV_FP8_GROUP = 32
KV_FP4_GROUP = 16


def packed_fp8_row_bytes(d: int) -> int:
    """A packed window row of d lanes: d E4M3 codes + d/32 E8M0 scale codes."""
    return d + d // KV_FP8_GROUP


def packed_fp4_row_bytes(d: int) -> int:
    """A packed compressed row of d lanes: d/2 bytes of E2M1 pairs + d/16 E4M3 scale codes."""
    return d // 2 + d // KV_FP4_GROUP


def pack_fp8_ue8m0_rows(x, group: int = KV_FP8_GROUP) -> jax.Array:
    """Rows an `fp8_act_qdq` put on its grid [..., n] -> packed rows uint8 [..., n + n/group]: the
    E4M3 codes, then the E8M0 codes (the cache's packed window rows, docs/CACHE.md §1.3). Exact
    for such rows: re-quantized, a group keeps its power-of-two scale or takes a smaller one,
    which doubles every code, still an E4M3 value (tests/test_quant.py)."""
    return jnp.concatenate(quant_fp8_ue8m0(x, group), axis=-1)


def pack_fp4_e4m3_rows(x, group: int = KV_FP4_GROUP) -> jax.Array:
    """Rows [..., n] -> their FP4 round trip packed, uint8 [..., n/2 + n/group]: the E2M1 bytes,
    then the E4M3 scale codes (the cache's packed compressed rows). Pass the rows *before* the
    round trip: re-quantizing on-grid values is not exact where the scale is an E4M3 subnormal
    (a group's largest code can be 4, and another scale then represents it; docs/CACHE.md §1.3)."""
    return jnp.concatenate(quant_fp4_e4m3(x, group), axis=-1)


def packed_fp4_lanes(row_bytes: int, group: int = FP4_GROUP) -> int:
    """n, the values of a `pack_fp4_ue8m0_rows` row of n/2 + n/group bytes (ValueError for a width
    no row has)."""
    n = row_bytes * 2 * group // (group + 2)
    if n % group or n // 2 + n // group != row_bytes:
        raise ValueError(f"packed FP4 rows: {row_bytes} bytes is no row of n/2 E2M1 bytes + n/{group} E8M0 codes")
    return n


def unpack_fp4_ue8m0_rows(rows, group: int = FP4_GROUP, dtype=jnp.bfloat16) -> jax.Array:
    """Packed rows uint8 [..., n/2 + n/group] (`pack_fp4_ue8m0_rows`) -> their values [..., n]."""
    half = packed_fp4_lanes(rows.shape[-1], group) // 2
    return dequant_fp4_ue8m0_rows(rows[..., :half], rows[..., half:], group, dtype)


# ---- fake-quant (QDQ) at the reference's QAT points ----------------------------------------------

@partial(jax.custom_jvp, nondiff_argnums=(1, 2, 3))
def _qdq(x, group: int, encode, what: str) -> jax.Array:
    x = jnp.asarray(x)
    q, s, _ = encode(_groups(x, group, what))
    return (q * s[..., None]).reshape(x.shape).astype(x.dtype)


@_qdq.defjvp
def _qdq_straight_through(group, encode, what, primals, tangents):
    # Differentiated, a QDQ is the identity (the straight-through estimator): rounding onto a grid
    # has a zero derivative almost everywhere, which would stop every gradient behind a
    # fake-quantized activation when training under the engine's numerics (scripts/train_demo.py's
    # draft phase). The values are the QDQ's own.
    (x,), (t,) = primals, tangents
    return _qdq(x, group, encode, what), t


@partial(jax.jit, static_argnames=("block",))
def fp8_act_qdq(x, block: int = 32) -> jax.Array:
    """act_quant(x, block, "ue8m0", inplace=True): fp8 e4m3 per `block` lanes, power-of-two scale."""
    return _qdq(x, block, _fp8_ue8m0_groups, "fp8_act_qdq")


@partial(jax.jit, static_argnames=("group",))
def fp4_qdq_e4m3(x, group: int = 16) -> jax.Array:
    """fp4_act_quant(x, group, inplace=True, scale_dtype=e4m3): compressed KV rows."""
    return _qdq(x, group, _fp4_e4m3_groups, "fp4_qdq_e4m3")


@partial(jax.jit, static_argnames=("group",))
def fp4_qdq_ue8m0(x, group: int = 32) -> jax.Array:
    """fp4_act_quant(x, group, inplace=True) with E8M0 scales: index keys and queries."""
    return _qdq(x, group, _fp4_ue8m0_groups, "fp4_qdq_ue8m0")


# ---- weight quantizers (the checkpoint writer) ---------------------------------------------------

@partial(jax.jit, static_argnames=("block",))
def quant_weight_fp8(w, block: int = FP8_WEIGHT_BLOCK) -> tuple[jax.Array, jax.Array]:
    """Dense weight [out, in] -> (E4M3 codes uint8 [out, in], E8M0 codes [ceil(out/b), ceil(in/b)]).

    One power-of-two scale per b x b block, partial edge blocks included; the block amax gets the
    A8 floor so an all-zero block has a finite scale."""
    w = jnp.asarray(w, jnp.float32)
    out_f, in_f = w.shape
    pad = ((0, -out_f % block), (0, -in_f % block))
    blocks = jnp.pad(w, pad).reshape(-(-out_f // block), block, -(-in_f // block), block)
    amax = jnp.maximum(jnp.max(jnp.abs(blocks), axis=(1, 3)), _FP8_AMAX_FLOOR)
    _, inv, code = ue8m0_scale(amax, _FP8_MAX_INV)
    q = round_e4m3(w * _repeat_to(inv, (block, block), w.shape))
    return e4m3_codes(q), code


@partial(jax.jit, static_argnames=("group",))
def quant_weight_fp4(w, group: int = 32) -> tuple[jax.Array, jax.Array]:
    """Expert weight [out, in] -> (packed E2M1 uint8 [out, in/2], E8M0 codes [out, in/group])."""
    return quant_fp4_ue8m0(jnp.asarray(w, jnp.float32), group)


# ---- held expert weights -------------------------------------------------------------------------

class HeldWeight:
    """What the held formats share: each is a pytree of its parts, and `w[e]` indexes every part
    (expert e of a stack; e may be traced)."""

    def __getitem__(self, i):
        return jax.tree.map(lambda part: part[i], self)


@partial(jax.tree_util.register_dataclass, data_fields=["codes", "scale"], meta_fields=[])
@dataclass(frozen=True)
class Fp4Weight(HeldWeight):
    """A weight held on the device as published: packed E2M1 codes uint8 [..., out, in/2] (even
    input in the low nibble) and E8M0 codes uint8 [..., out, in/32]: a quarter of the bf16 bytes
    (plus 1/64 for the scales), the smallest form. Routed experts stack on a leading axis; `w[e]`
    is expert e (e may be traced)."""
    codes: jax.Array
    scale: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.codes.shape[:-1], 2 * self.codes.shape[-1])

    def dequant(self, dtype=jnp.bfloat16) -> jax.Array:
        return dequant_fp4_rows(self.codes, self.scale, dtype=dtype)


@partial(jax.tree_util.register_dataclass, data_fields=["codes", "row_scale"], meta_fields=[])
@dataclass(frozen=True)
class Fp8RowWeight(HeldWeight):
    """The same values re-coded for the kernels: E4M3 codes uint8 [..., out, in] and one fp32 power
    of two per output row [..., out]. Half the bf16 bytes; a kernel decodes a weight with one fp8
    conversion and scales its GEMM output columns by the row's power of two, which is exact, so it
    computes bit for bit what it computes on the bf16 decode. `from_fp4` re-codes a published FP4
    weight exactly when each row's values fit E4M3 under one power of two, which rows whose
    nonzero 32-groups have E8M0 scales within 14 of each other always do (checked per row)."""
    codes: jax.Array
    row_scale: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.codes.shape)

    def dequant(self, dtype=jnp.bfloat16) -> jax.Array:
        return (e4m3_to_f32(self.codes) * self.row_scale[..., None]).astype(dtype)

    @classmethod
    def from_fp4(cls, w: Fp4Weight, what: str = "weight") -> "Fp8RowWeight":
        """Exact re-coding, one leading index at a time (a stack of experts never needs its fp32
        copy whole); ValueError naming `what` if some row does not fit E4M3 under one scale."""
        lead = w.codes.shape[:-2]
        flat = Fp4Weight(w.codes.reshape(-1, *w.codes.shape[-2:]), w.scale.reshape(-1, *w.scale.shape[-2:]))
        codes, row_scale, bad = jax.lax.map(lambda m: _fp4_to_fp8_rows(m.codes, m.scale), flat)
        if int(bad.sum()):
            raise ValueError(f"{what}: {int(bad.sum())} rows of FP4 values span too many binades for "
                             "one E4M3 scale per row; hold these experts as 'fp4' or 'bf16'")
        return cls(codes.reshape(*lead, *codes.shape[-2:]), row_scale.reshape(*lead, -1))


@jax.jit
def _fp4_to_fp8_rows(codes, scale):
    """One [out, in/2] FP4 matrix -> (E4M3 codes [out, in], row scales [out], rows not exact [])."""
    v = dequant_fp4_rows(codes, scale, dtype=jnp.float32)                      # exact
    live = ((unpack_fp4(codes) & 7) != 0).reshape(*scale.shape, -1).any(-1)     # groups with a nonzero
    top = jnp.max(jnp.where(live, as_u8(scale).astype(jnp.int32), 0), axis=-1)
    # the largest value, 6 * 2^(top-127), becomes 384 * 2^r <= 448: r = top - 133
    r = jnp.clip(top - 133, -126, 126)
    q = v * _pow2(-r)[:, None]
    on_grid = round_e4m3(q)             # arithmetic: an fp8 cast round trip may be folded away
    bad = jnp.sum(jnp.any(on_grid != q, axis=-1))
    return e4m3_codes(on_grid), _pow2(r), bad


def fp8_block_scale_shape(shape) -> tuple[int, ...]:
    """The E8M0 block scales' shape of a dense FP8 weight [..., out, in]: one per block."""
    *lead, out_f, in_f = shape
    return (*lead, -(-out_f // FP8_WEIGHT_BLOCK), -(-in_f // FP8_WEIGHT_BLOCK))


@partial(jax.tree_util.register_dataclass, data_fields=["codes", "block_scale"], meta_fields=[])
@dataclass(frozen=True)
class Fp8BlockWeight(HeldWeight):
    """A dense FP8 weight held as published: E4M3 codes uint8 [..., out, in] and E8M0 codes uint8
    [..., ceil(out/32), ceil(in/32)], one per 32 x 32 block: half the bf16 bytes. `linear.lin8`
    reads the codes with `kernels_pallas.dense_fp8` at decode row counts and gives XLA's GEMM
    `dequant()` otherwise, whose values are the bf16 hold's bit for bit."""
    codes: jax.Array
    block_scale: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.codes.shape)

    def dequant(self, dtype=jnp.bfloat16) -> jax.Array:
        return dequant_fp8_blocks(self.codes, self.block_scale, dtype=dtype)


def held(w) -> jax.Array:
    """A params weight as the GEMM takes it: an `Fp4Weight` / `Fp8RowWeight` / `Fp8BlockWeight`
    decoded to bf16 (exact), anything else as is."""
    return w.dequant() if isinstance(w, HeldWeight) else w
