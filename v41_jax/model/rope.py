"""Rotary embedding: the two tables and the interleaved rotation of the last R lanes.

API
  rope_freqs(cfg, global_table) -> np.float32 [R/2]
      global_table=False: theta = rope_theta, no YaRN (ratio-0 layers, draft stages).
      global_table=True:  theta = compress_rope_theta with YaRN when original_seq_len > 0
                          (ratio > 0 layers). No mscale: cos/sin are unscaled.
  rope_cos_sin(cfg, positions, global_table) -> (cos, sin), fp32 [*positions.shape, R/2]
  apply_rope(x, cos, sin, inverse=False, in_place=False) -> x.dtype
      rotates adjacent lane pairs (2i, 2i+1) of the last 2*cos.shape[-1] lanes of x by the angle;
      cos/sin must broadcast against x[..., :R/2] (add a head axis for [T, H, D]). Computed in
      fp32, one cast back. inverse rotates by the negative angle. The rule:
      `kernels_pallas.reference.apply_rope`; in_place: the Pallas backend rewrites only the
      rotated lanes of x (`kernels_pallas.rope`), for an x nothing reads afterwards.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas import reference as ref
from kernels_pallas import rope as kernel_rope

if TYPE_CHECKING:
    from v41_jax.config import ModelConfig


def _yarn(freqs: np.ndarray, dim: int, base: float, cfg: ModelConfig) -> np.ndarray:
    """Keep high frequencies, divide low ones by rope_factor, ramp linearly in between."""
    def corrected_dim(rotations: float) -> float:
        # the lane pair whose wavelength turns `rotations` times over the original context
        return dim * math.log(cfg.original_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(corrected_dim(cfg.beta_fast)), 0)
    high = min(math.ceil(corrected_dim(cfg.beta_slow)), dim - 1)
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low))
                   / np.float32(max(high - low, 1e-3)), 0, 1).astype(np.float32)
    smooth = np.float32(1) - ramp
    # same fp32 operation order as the reference: freqs / factor * (1 - smooth) + freqs * smooth
    return (freqs / np.float32(cfg.rope_factor) * (np.float32(1) - smooth) + freqs * smooth).astype(np.float32)


def rope_freqs(cfg: ModelConfig, global_table: bool) -> np.ndarray:
    dim = cfg.rope_head_dim
    base = cfg.compress_rope_theta if global_table else cfg.rope_theta
    # torch evaluates `python_float ** fp32_tensor` in double and rounds once to fp32; a float32
    # power differs from it in the last bit for a few lanes (2 of 32 at theta 1e4, 6 at 1.6e5)
    exponent = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
    freqs = np.float32(1) / np.power(np.float64(base), exponent.astype(np.float64)).astype(np.float32)
    if global_table and cfg.original_seq_len > 0:
        freqs = _yarn(freqs, dim, base, cfg)
    return freqs


def rope_cos_sin(cfg: ModelConfig, positions: jax.Array, global_table: bool) -> tuple[jax.Array, jax.Array]:
    angle = positions.astype(jnp.float32)[..., None] * jnp.asarray(rope_freqs(cfg, global_table))
    return jnp.cos(angle), jnp.sin(angle)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array, inverse: bool = False,
               in_place: bool = False) -> jax.Array:
    # in_place where the rotation is x's last use and x is wide (the attention's queries and
    # outputs): the kernel rewrites only the rotated lanes; elsewhere the XLA rule fuses into
    # what follows it (the index and KV rows' quantization)
    if in_place:
        return kernel_rope.apply_rope(x, cos, sin, inverse)
    return ref.apply_rope(x, cos, sin, inverse)
