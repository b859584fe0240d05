"""Decoders for derivative (re-quantized) checkpoints: ModelOpt NVFP4, AMD Quark MXFP4, MLX affine.

These are not the published format; they let a converter read community re-quantizations on the
host. They are numpy on purpose: bit-exactness with the fixture
(tests/fixtures/dsv41_reference/derivative_quant_codecs.json) needs subnormal results (E8M0 code 0
is 2^-127), which XLA on CPU flushes to zero, and separately rounded multiply and add, which XLA
may contract into an FMA under jit. Outputs are fp32:

  * NVFP4: e2m1 x (e4m3 scale per 16 x fp32 global scale), the two scales multiplied first.
  * Quark MXFP4: e2m1 x e8m0 scale per 32 (code 255 -> NaN).
  * MLX affine (bits 2, 4 or 8; group 64): q * scale + bias, each operation rounded; q unpacked
    from little-endian uint32 words, low bits first.

Unlike the published E2M1 table (code 8 = -0.0), these decoders give code 8 as +0.0, so a zero
times a negative scale is -0.0 and times a positive one +0.0.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from ..quant import E2M1_TABLE

_E2M1_UNSIGNED_ZERO = np.where(E2M1_TABLE == 0, np.float32(0), E2M1_TABLE)


def _e2m1(packed: np.ndarray) -> np.ndarray:
    """packed uint8 [..., n/2] -> fp32 [..., n], the low nibble is the even element."""
    b = np.asarray(packed).view(np.uint8)
    return _E2M1_UNSIGNED_ZERO[np.stack([b & 0xF, b >> 4], axis=-1).reshape(*b.shape[:-1], -1)]


def _per_group(scale: np.ndarray, group: int) -> np.ndarray:
    return np.repeat(scale, group, axis=-1)


def decode_nvfp4(packed, scales, global_scale) -> np.ndarray:
    """packed uint8 [rows, cols/2], E4M3 scales [rows, cols/16], fp32 global scale -> fp32 [rows, cols]."""
    s = np.asarray(scales).view(np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    return _e2m1(packed) * _per_group(s * np.float32(global_scale), 16)


def decode_mxfp4(packed, scales) -> np.ndarray:
    """packed uint8 [rows, cols/2], E8M0 scales [rows, cols/32] -> fp32 [rows, cols]."""
    s = np.asarray(scales).view(np.uint8).view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    return _e2m1(packed) * _per_group(s, 32)


def decode_mlx_affine(words, scales, biases, bits: int, group: int = 64) -> np.ndarray:
    """uint32 words [rows, cols*bits/32], fp32 scales and biases [rows, cols/group] -> fp32 [rows, cols]."""
    if bits not in (2, 4, 8):
        raise ValueError(f"decode_mlx_affine: bits must be 2, 4 or 8, got {bits}")
    w = np.asarray(words, dtype=np.uint32)
    shifts = np.arange(32 // bits, dtype=np.uint32) * np.uint32(bits)
    q = ((w[..., None] >> shifts) & np.uint32((1 << bits) - 1)).reshape(*w.shape[:-1], -1).astype(np.float32)
    return q * _per_group(np.asarray(scales, np.float32), group) + _per_group(np.asarray(biases, np.float32), group)
