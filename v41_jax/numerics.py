"""Numerics policy: where the forward rounds, quantizes and how it accumulates.

API
  Numerics(act_dtype, fake_quant, block_gemm, index_score_bf16, attn_probs_bf16, quantized=True,
           exact_rms=True, exact_sinkhorn=True, exact_gemm_out=True)
      frozen, hashable: pass it as a static argument under jit.
  numerics.for_model(cfg.quantized)   the policy for this checkpoint; the model's entry points
      (forward, make_step, the draft head's) apply it, so callers pass a policy only.
  gemm_fake_quant, gemm_blocks   fake_quant / block_gemm where they touch a linear: only for a
      quantized checkpoint (the reference's bf16 linears neither quantize nor block-sum).
  Numerics.reference()  bit-level policy of the official reference (docs/MODEL.md §4):
      bf16 activations, fp8/fp4 fake-quant at the reference's points, FP8/FP4 GEMMs summed per
      32-wide K block in fp32 in K order, bf16 index scores, bf16 attention probabilities.
  Numerics.fast()       same rounding points, but GEMMs are one fp32-accumulating dot and the RMS
      statistic one reduction and rsqrt (the order of each fp32 sum and the rsqrt's last bits are
      the backend's), and the mHC Sinkhorn divides by an fp32 reciprocal (each quotient within 3
      ulps, the same bits on every backend), and a GEMM whose output the reference rounds to bf16
      writes bf16 from its fp32 accumulator (from `linear.GEMM_OUT_ROWS` rows). For serving.
  Numerics.fp32()       same graph with fp32 activations and no fake-quant / bf16 rounding; used to
      compare the cache path with the full forward without rounding noise.
  numerics.act(x)       cast to the activation dtype (the reference's bf16 rounding points).
  HIGHEST               the dot precision for every fp32 product (no TF32 / bf16 passes on GPU).
  exact_div(a, b)       a / b correctly rounded. XLA rewrites a division by a constant or by a
                        broadcast operand into a multiplication by its (inexact) reciprocal, and a
                        quotient divided again, (x / y) / z, into x / (y * z); the reference
                        divides. Use it wherever b is broadcast and not a power of two, or a is a
                        quotient.
  ordered_sum(x, axis)  sum over a short axis strictly left to right (XLA's reduce order is unspecified).
  rounded(p)            the product p rounded to fp32 on its own: XLA:CPU contracts a*b+c into an FMA
                        (no flag stops it, nor an optimization_barrier), torch's eager ops round the
                        product first. Wrap the products of such sums where the reference has them.
  top_k(x, k) -> (values, ids)   lax.top_k with -0.0 and +0.0 equal, so that ties go to the lower
                        index as with IEEE comparisons (torch.topk; the fixtures' lowest-index run):
                        lax.top_k orders floats totally and ranks +0.0 above -0.0, and -0.0 is
                        common here (a negative weight times a ReLU zero). Short rows (the
                        router's) take the same picks as ranks by comparison, no sort launch.
  stable_argsort(keys, k=None)   integer keys: the first k of jnp.argsort(stable=True), short
                        rows by ranks by comparison (the MoE's pair order), no sort launch.
  cascade_sum(x) -> [...]   fp32 sum over the last axis in the exact order of torch's CPU sum
                        kernel (8-lane vectors, 4 interleaved accumulators, 4-level cascade, then
                        the scalar tail and the lanes in order): the reference's `.sum(-1)` /
                        `.mean(-1)` bit for bit. XLA's reduce order is unspecified. Not for
                        rows of 5-7 values: torch sums those on its scalar path (one row of 4
                        accumulators, the rest into the first), another order; no reduction of
                        the model is that short.
  cascade_rows(rows), combine_lanes(...)   its two stages, for values held in another layout;
                        CHUNK = 32 values a cascade row, LANES = 8 a vector.
                        cascade_step / cascade_fold / cascade_total: the first stage run by run,
                        for a kernel that loops over the runs (kernels_pallas.rmsnorm;
                        cascade_rows is their unrolled form).

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
  quantized        the checkpoint's linears are FP8/FP4 (else bf16: fake_quant and block_gemm then
                   leave the GEMMs alone and keep to the KV / index rows).
  exact_rms        the RMS statistic (RMSNorm, mHC mixes, Engram gate) bit for bit as the reference
                   computes it (torch's CPU sum order, correctly rounded division and rsqrt: a
                   kernel of its own, `kernels_pallas.rmsnorm`), else one backend reduction that
                   XLA fuses with its neighbours, or on the Pallas backend the mHC expand
                   kernel's sums of squares (`kernels_pallas.hc_expand`): the statistic within
                   (D + 2) / 2 + 2 fp32 ulps relative whatever the order
                   (tests/test_kernels_rmsnorm.py).
  exact_sinkhorn   the mHC Sinkhorn's divisions correctly rounded (the reference's), else each within
                   3 fp32 ulps for normal quotients (an fp32 reciprocal; `kernels_pallas.sinkhorn`).
  exact_gemm_out   a linear whose output the reference rounds to the activation dtype computes an
                   fp32 result and rounds it in a separate cast; else the GEMM writes the
                   activation dtype straight from its fp32 accumulator, from
                   `linear.GEMM_OUT_ROWS` rows (`linear.gemm_out_dtype`). Measured, not
                   guaranteed by XLA: on the H100 (jax 0.11.2) at the model's dense shapes, 2 to
                   8,192 rows, every output equals the fp32 result's cast, one fp32 sum rounded
                   once; XLA:CPU likewise (tested). Without the fp32 tensor: at a 4,096-token
                   prefill the queries' [T, 64 x 512] fp32 output and its cast were ~0.8 GB of
                   traffic a layer (BENCHMARKS.md, 2026-12-05 g, i).
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass, replace

import jax
import jax.numpy as jnp
import numpy as np

HIGHEST = jax.lax.Precision.HIGHEST


def exact_div(a: jax.Array, b: jax.Array | float) -> jax.Array:
    # a full-shape divisor behind an optimization barrier is neither a constant nor a broadcast;
    # the dividend goes behind the same barrier, else XLA turns (x / y) / z into x / (y * z)
    shape = jnp.broadcast_shapes(jnp.shape(a), jnp.shape(b))
    a, b = jax.lax.optimization_barrier((a, jnp.broadcast_to(jnp.asarray(b, a.dtype), shape)))
    return a / b


def ordered_sum(x: jax.Array, axis: int) -> jax.Array:
    parts = [jnp.take(x, i, axis=axis) for i in range(x.shape[axis])]
    return functools.reduce(operator.add, parts)


def rounded(p: jax.Array) -> jax.Array:
    # p != p only for NaN, where p + 1 is NaN as well: no value changes, but LLVM cannot fold the
    # select, so the product p keeps its own fp32 rounding instead of fusing into an FMA
    return jnp.where(p != p, p + 1, p)


# `top_k` and `stable_argsort` rank by comparison (no sort launch) rows of up to RANK_TOPK_MAX /
# RANK_SORT_MAX values whose [rows, n, n] comparison has at most RANK_PAIRS elements: on the H200
# a GPU sort or top_k is one launch of 7-16 us where the two comparison fusions of the MoE's
# 6- to 384-key rows take a few (BENCHMARKS.md, 2026-12-04 c); longer rows and prefill sizes sort.
# The indexer's 512 picks stay a sort (`reference.ascending`): their comparisons cost what it does.
RANK_TOPK_MAX, RANK_SORT_MAX, RANK_PAIRS = 256, 1024, 1 << 23


def total_order(x: jax.Array) -> jax.Array:
    """Floats -> int32 keys in IEEE total order (-NaN < -inf < ... < -0 < +0 < ... < +inf < +NaN):
    a negative float's magnitude bits reversed, so larger magnitudes compare lower."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
    return jnp.where(bits < 0, bits ^ jnp.int32(0x7FFFFFFF), bits)


def top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    x = jnp.where(x == 0, jnp.zeros_like(x), x)
    n = x.shape[-1]
    if n > RANK_TOPK_MAX or x.size * n > RANK_PAIRS:
        return jax.lax.top_k(x, k)
    # lax.top_k's order is descending total order, ties to the lower index: the ascending stable
    # order of the negated total-order keys (bitwise not: no overflow)
    ids = stable_argsort(~total_order(x), k)
    return jnp.take_along_axis(x, ids, axis=-1), ids


def stable_argsort(keys: jax.Array, k: int | None = None) -> jax.Array:
    """Integer keys [..., n] -> int32 [..., k or n]: the first k of the stable ascending argsort
    along the last axis. Short rows by ranks (RANK_SORT_MAX, RANK_PAIRS): a key's rank is the
    count of keys before it (smaller, or equal at a lower index), and the argsort is the
    permutation that inverts the ranks; integer comparisons, so the permutation is the sort's."""
    n = keys.shape[-1]
    k = n if k is None else k
    if n > RANK_SORT_MAX or keys.size * n > RANK_PAIRS:
        return jnp.argsort(keys, axis=-1, stable=True)[..., :k].astype(jnp.int32)
    i = jnp.arange(n, dtype=jnp.int32)
    a, b = keys[..., :, None], keys[..., None, :]                      # [..., j, i]: key j against i
    rank = jnp.sum((b < a) | ((b == a) & (i[None, :] < i[:, None])), axis=-1, dtype=jnp.int32)
    return jnp.sum(jnp.where(rank[..., None, :] == i[:k, None], i[None, :], 0), axis=-1, dtype=jnp.int32)


@dataclass(frozen=True)
class Numerics:
    act_dtype: np.dtype
    fake_quant: bool
    block_gemm: bool
    index_score_bf16: bool
    attn_probs_bf16: bool
    quantized: bool = True
    exact_rms: bool = True
    exact_sinkhorn: bool = True
    exact_gemm_out: bool = True

    @classmethod
    def reference(cls) -> "Numerics":
        return cls(np.dtype(jnp.bfloat16), True, True, True, True)

    @classmethod
    def fast(cls) -> "Numerics":
        return cls(np.dtype(jnp.bfloat16), True, False, True, True, exact_rms=False, exact_sinkhorn=False,
                   exact_gemm_out=False)

    @classmethod
    def fp32(cls) -> "Numerics":
        return cls(np.dtype(jnp.float32), False, False, False, False)

    def for_model(self, quantized: bool) -> "Numerics":
        """This policy for a checkpoint with FP8/FP4 linears (`cfg.quantized`) or plain bf16 ones."""
        return self if quantized == self.quantized else replace(self, quantized=quantized)

    @property
    def gemm_fake_quant(self) -> bool:
        # the reference's bf16 `linear` is F.linear: no activation quant before an unquantized GEMM
        return self.fake_quant and self.quantized

    @property
    def gemm_blocks(self) -> bool:
        return self.block_gemm and self.quantized

    def act(self, x: jax.Array) -> jax.Array:
        return x.astype(self.act_dtype)

    @property
    def index_score_dtype(self) -> np.dtype:
        return np.dtype(jnp.bfloat16) if self.index_score_bf16 else np.dtype(jnp.float32)


LANES, _ILP, _LEVELS = 8, 4, 4  # torch's Vectorized<float> on its (AVX2) reduce kernels; SumKernel.cpp
CHUNK = _ILP * LANES             # 32: one row of the cascade, its 4 accumulators of 8 lanes


def _in_order(parts: list, zero: jax.Array) -> jax.Array:
    """0 + p0 + p1 + ... left to right (the first add is exact, so start from p0)."""
    return functools.reduce(operator.add, parts) if parts else zero


def cascade_step(n_rows: int) -> int:
    """Rows in a run (level_step) of torch's cascade over n_rows rows: 16 up to 2^19 rows."""
    return 1 << max(4, (n_rows - 1).bit_length() // _LEVELS)


def _pick(c, a, b):
    # a Python bool (the unrolled cascade of the XLA path) picks at trace time, a traced one (a
    # kernel's loop over runs) selects
    return (a if c else b) if isinstance(c, bool) else jnp.where(c, a, b)


def cascade_fold(levels: tuple, run, r, closed, step: int) -> tuple:
    """torch's multi_row_sum after its run r (0-based), `run` being that run's rows summed in order.
    levels: (open run, level 1, 2, 3), each starting at zero. A closed run (all `step` rows) is
    added to level 1; a level holding `step` sums then moves up (added to the next, restarting at
    zero): level 1 after every step-th run, level 2 after every step^2-th. The open run (the last
    one, short) stays apart. r and closed: ints (unrolled) or traced scalars (a loop)."""
    open_run, l1, l2, l3 = levels
    # torch's mask test on its row count (step is a power of two); jnp's `%` on a loop index
    # does not lower through Pallas' Triton lowering
    up1 = closed & (((r + 1) & (step - 1)) == 0)
    up2 = up1 & (((r + 1) & (step * step - 1)) == 0)
    open_run, l1 = _pick(closed, open_run, run), _pick(closed, l1 + run, l1)
    l1, l2 = _pick(up1, jnp.zeros_like(l1), l1), _pick(up1, l2 + l1, l2)
    l2, l3 = _pick(up2, jnp.zeros_like(l2), l2), _pick(up2, l3 + l2, l3)
    return open_run, l1, l2, l3


def cascade_total(levels: tuple):
    """The end of multi_row_sum: the open run, then levels 1-3 added in order."""
    return _in_order(list(levels), None)


def cascade_rows(rows: jax.Array) -> jax.Array:
    """torch's multi_row_sum over rows [..., n_rows, 4, 8] (each one row's 32 values) -> [..., 4,
    8]: `cascade_fold` over its runs in order. The closed runs are summed side by side, each run's
    rows still in order, so `step` slices and adds however many runs there are (a row at a time,
    unrolled, lowered to 424 ops at 4,096 values and 1,968 at the released mHC width of 20,480;
    side by side 114 and 216). A kernel that loops over the runs folds them itself."""
    lead, n_rows = rows.shape[:-3], rows.shape[-3]
    zero = jnp.zeros((*lead, _ILP, LANES), jnp.float32)
    step = cascade_step(n_rows)
    closed, left = divmod(n_rows, step)
    runs = rows[..., : closed * step, :, :].reshape(*lead, closed, step, _ILP, LANES)
    run_sums = _in_order([runs[..., i, :, :] for i in range(step)], None) if closed else None
    levels = (zero,) * _LEVELS
    for r in range(closed):
        levels = cascade_fold(levels, run_sums[..., r, :, :], r, True, step)
    if left:
        open_run = _in_order([rows[..., closed * step + i, :, :] for i in range(left)], zero)
        levels = cascade_fold(levels, open_run, closed, False, step)
    return cascade_total(levels)


def combine_lanes(part, rest_vec, tail, lane, n_rest: int):
    """The end of torch's sum after the cascade: accumulator 0's lanes plus the 8-lane vectors past
    the cascade's rows, then accumulators 1-3, then the scalars past the vectors and the 8 lanes in
    order. part(k): [..., 8] lanes of accumulator k; rest_vec(p) / tail(p): the 8 values from /
    the value at position p past the rows; lane(v, l): lane l of an [..., 8] vector; n_rest: the
    number of values past the rows (< 32)."""
    first = _in_order([part(0)] + [rest_vec(i * LANES) for i in range(n_rest // LANES)], None)
    lanes = _in_order([first] + [part(k) for k in range(1, _ILP)], None)
    tails = [tail(n_rest // LANES * LANES + j) for j in range(n_rest % LANES)]
    return _in_order(tails + [lane(lanes, k) for k in range(LANES)], None)


def cascade_sum(x: jax.Array) -> jax.Array:
    x = x.astype(jnp.float32)
    n_rows = x.shape[-1] // CHUNK
    lead = x.shape[:-1]
    rows = x[..., : n_rows * CHUNK].reshape(*lead, n_rows, _ILP, LANES)
    part = cascade_rows(rows)                                                  # [..., 4, 8]
    rest = x[..., n_rows * CHUNK:]
    return combine_lanes(lambda k: part[..., k, :], lambda p: rest[..., p:p + LANES],
                         lambda j: rest[..., j], lambda v, k: v[..., k], rest.shape[-1])
