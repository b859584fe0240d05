"""Manifold-constrained hyper-connections (mHC), single-pass variant (docs/MODEL.md §3.2).

The residual is N = hc_mult parallel streams. Each sublayer predicts (pre, post, comb) from its
input streams; it expands with its own post/comb but hands `pre` on: the collapse feeding a
sublayer always uses the pre the previous sublayer computed (block.py wires that).

API (X [..., N, D] in the activation dtype; coefficients fp32)
  hc_mixes(X, fn [M, N*D], base [M], scale [3], cfg, numerics, sumsq=None)
      -> (pre [..., N], post [..., N], comb [..., N, N])   sumsq: X's, where an expand gave it
  split_sinkhorn(m [..., M], scale, base, hc, iters, eps, backend=None, exact=True) -> (pre, post, comb)
      comb[i, j]: i = input stream, j = output stream; doubly stochastic after Sinkhorn
      (`kernels_pallas.sinkhorn`: one Pallas kernel per call, or its XLA path).
  one_hot_pre(lead_shape, hc) -> fp32 [..., N]   (1, 0, ..., 0): the first collapse returns stream 0.
  stream_mean(X) -> [..., D]      mean over the streams (fp32 sum in order, one division, one cast).
  collapse(X, pre) -> [..., D]    sum_s pre[s] X[s] in fp32, streams added in order, one cast.
  expand(f [..., D], X, post, comb) -> [..., N, D]
      X'[j] = post[j] f + sum_i comb[i, j] X[i], fp32, one cast to f's dtype.
  Collapsed(c [..., D], x_sumsq [..., 1] | None, c_sumsq [..., 1] | None)   a sublayer's input:
      the collapse of its streams, and the fp32 sums of squares of the streams (its mixes' RMS) and
      of c (its norm's), or None where their consumers compute them (`rms_inv(sumsq=)`).
  expand_collapse(f, X, post, comb, pre, numerics) -> (X', Collapsed of X' by pre)
      Under the fast RMS (`Numerics.exact_rms` off) on the Pallas backend one pass
      (`kernels_pallas.hc_expand`) writes the streams and the collapse and hands both sums on, so
      the next sublayer does not read the streams for them again; otherwise no sums.
  input_collapse(X, pre, numerics) -> Collapsed   the same for streams no expand wrote (the
      embeddings, an Engram's output), with the sums exactly where expand_collapse gives them, so a
      scanned run's carry keeps one structure.
  (expand and collapse are `kernels_pallas.reference`'s stream rules, which the kernel runs too.)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import jax
import jax.numpy as jnp

from kernels_pallas import hc_expand as kernel_hc_expand
from kernels_pallas import reference as ref
from kernels_pallas import sinkhorn as kernel_sinkhorn
from v41_jax.model.linear import lin_f32
from v41_jax.model.norm import rms_inv, sum_sq
from v41_jax.model.numerics import Numerics, exact_div, ordered_sum, rounded

if TYPE_CHECKING:
    from v41_jax.config import ModelConfig


def split_sinkhorn(m: jax.Array, scale: jax.Array, base: jax.Array, hc: int, iters: int,
                   eps: float, backend: str | None = None,
                   exact: bool = True) -> tuple[jax.Array, jax.Array, jax.Array]:
    # each product rounded before its bias is added (the reference's two operations, no FMA)
    pre = jax.nn.sigmoid(rounded(m[..., :hc] * scale[0]) + base[:hc]) + eps
    post = 2 * jax.nn.sigmoid(rounded(m[..., hc:2 * hc] * scale[1]) + base[hc:2 * hc])
    comb = (rounded(m[..., 2 * hc:] * scale[2]) + base[2 * hc:]).reshape(*m.shape[:-1], hc, hc)
    # the row softmax's numerator here; its normalisation and the Sinkhorn rounds in one kernel
    e = jnp.exp(comb - jnp.max(comb, axis=-1, keepdims=True))
    return pre, post, kernel_sinkhorn.sinkhorn(e, iters, eps, exact=exact, backend=backend)


def hc_mixes(x: jax.Array, fn: jax.Array, base: jax.Array, scale: jax.Array, cfg: ModelConfig,
             numerics: Numerics, sumsq: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    flat = x.reshape(*x.shape[:-2], -1)                                    # [..., N*D]
    # one RMS statistic over all streams jointly, no learned weight; the reference's fp32 GEMM
    # of these values (`lin_f32` takes the bf16 rows as they are: from SPLIT_ROWS rows it needs
    # no fp32 copy of them)
    m = lin_f32(flat, fn) * rms_inv(flat, cfg.norm_eps, numerics, sumsq)             # [..., M]
    return split_sinkhorn(m, scale.astype(jnp.float32), base.astype(jnp.float32), cfg.hc_mult,
                          cfg.hc_sinkhorn_iters, cfg.hc_eps, exact=numerics.exact_sinkhorn)


def one_hot_pre(lead_shape: tuple[int, ...], hc: int) -> jax.Array:
    return jnp.broadcast_to(jnp.eye(hc, dtype=jnp.float32)[0], (*lead_shape, hc))


collapse, expand = ref.collapse, ref.expand     # the rules the kernel runs too, on arrays


class Collapsed(NamedTuple):
    c: jax.Array
    x_sumsq: jax.Array | None
    c_sumsq: jax.Array | None


def _with_sums(numerics: Numerics) -> bool:
    return not numerics.exact_rms and kernel_hc_expand.sums_computed()


def expand_collapse(f: jax.Array, x: jax.Array, post: jax.Array, comb: jax.Array, pre: jax.Array,
                    numerics: Numerics) -> tuple[jax.Array, Collapsed]:
    if not _with_sums(numerics):
        y, c = ref.expand_collapse(f, x, post, comb, pre)
        return y, Collapsed(c, None, None)
    lead, (n, d) = x.shape[:-2], x.shape[-2:]
    y, c, ss, css = kernel_hc_expand.expand_collapse(f.reshape(-1, d), x.reshape(-1, n, d), post.reshape(-1, n),
                                                     comb.reshape(-1, n, n), pre.reshape(-1, n))
    return y.reshape(x.shape), Collapsed(c.reshape(f.shape), ss.reshape(*lead, 1), css.reshape(*lead, 1))


def input_collapse(x: jax.Array, pre: jax.Array, numerics: Numerics) -> Collapsed:
    c = collapse(x, pre)
    if not _with_sums(numerics):
        return Collapsed(c, None, None)
    return Collapsed(c, sum_sq(x.reshape(*x.shape[:-2], -1)), sum_sq(c))


def stream_mean(x: jax.Array) -> jax.Array:
    return exact_div(ordered_sum(x.astype(jnp.float32), -2), x.shape[-2]).astype(x.dtype)
