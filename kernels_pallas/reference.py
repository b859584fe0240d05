"""The jnp references of the kernels: the math each kernel reproduces (bit for bit under
`Numerics.reference()`, the rounding points everywhere) and what each kernel entry point runs on
the XLA backend. The model runs these same functions: `v41_jax.model.sparse_attn`, `.indexer` and
`.moe` import them from here. This module sits below both the model and the kernels: it imports
`v41_jax.numerics`, `v41_jax.linear` and `v41_jax.quant`, and of the kernels only their plain-jnp
arithmetic (`kernels_pallas._ieee`) (tests/test_layering.py).

Sparse attention (docs/MODEL.md §3.5; kernel: `kernels_pallas.sparse_attn`)
  Every query head attends over its own list of latent rows (K = V, one shared latent per row).
  The reference kernel walks the list in chunks of 64 with an online softmax; the chunking is part
  of the numerics, because the probabilities are rounded to bf16 relative to the *running* max
  before they meet the values. `sparse_attn` reproduces that walk exactly.
  sparse_attn(q [B, S, H, D], kv [B, N, D], sink [H], idx [B, S, K], scale, *, numerics)
      -> [B, S, H, D] act dtype

Lightning indexer (docs/MODEL.md §3.7; kernel: `kernels_pallas.indexer`)
  index_scores(q, keys, weights, visible, numerics) -> [B, T, N]
      sum_h w_h * ReLU(q_h . k) in the score dtype (bf16 in the reference: the dot, the weighting
      and the head sum each round once); -inf at rows j >= visible.
  ascending(ids, keep) -> int32   kept ids sorted ascending, -1 after them
  select_topk(scores, visible, k, finite_only) -> int32 [B, T, min(k, N)]   ascending row ids, -1 past
      visible (and, finite_only, for -inf / NaN picks)

Routed experts (docs/MODEL.md §3.10; kernels: `kernels_pallas.moe`, `kernels_pallas.moe_mgpu`)
  swiglu(gate, up, limit, weight=None) -> fp32   the SwiGLU activation of fp32 GEMM outputs
  swiglu_ffn(x, w1, w3, w2, numerics, limit, weight=None) -> act dtype
      up clamped to [-limit, limit], gate to <= limit (limit 0 = no clamp); the routing weight
      multiplies the fp32 activation before its rounding to the activation dtype.
  routed_experts(x [T, D], idx [T, k], w [T, k], w1 [E, F, D], w3 [E, F, D], w2 [E, D, F],
                 numerics, swiglu_limit) -> fp32 [T, D]
      each token's k expert outputs (act dtype) summed in fp32 in ascending expert id, the order
      the reference's expert loop adds them. The expert weights are bf16 arrays or
      `quant.Fp4Weight`s (held as published, dequantized per pick).
  routed_pairs(same) -> [T, k, D]   the k expert outputs before that sum (expert parallelism
      sums them across devices first)
  add_slots(pairs [T, k, D]) -> fp32 [T, D]   that sum

mHC Sinkhorn (docs/MODEL.md §3.2; kernel: `kernels_pallas.sinkhorn`)
  sinkhorn(e [..., N, N] fp32, iters, eps, exact=True) -> [..., N, N] fp32
      e = exp(logits - row max). Rows normalised (+eps after), columns normalised (+eps in the
      divisor), then iters-1 rounds of (rows, columns) with +eps in both divisors; every sum over
      the N entries strictly left to right, every division correctly rounded fp32 (exact=False,
      `Numerics.exact_sinkhorn` off: by the kernel's fp32 reciprocal, `_ieee.div_near_by`).

Rotary embedding (docs/MODEL.md §3.1; kernel: `kernels_pallas.rope`)
  apply_rope(x [..., W], cos, sin, inverse=False) -> x.dtype
      rotates adjacent lane pairs (2i, 2i+1) of the last 2 * cos.shape[-1] lanes of x by the angle
      (cos / sin broadcast against x[..., :R/2]): four products each rounded to fp32, one add each
      (the reference's complex multiply), one cast back; inverse by the negative angle.

mHC expand and collapse (docs/MODEL.md §3.2; kernel: `kernels_pallas.hc_expand`)
  expand_streams(f, xs, post, comb) -> [N] fp32   X'[j] = post[j] f + sum_i comb[i][j] X[i]: every
      product rounded to fp32 on its own, the N products of comb summed in stream order, then
      added to post's (fp32 operands broadcast against each other; lists of the N streams).
  collapse_streams(xs, pre) -> fp32   sum_s pre[s] X[s], products rounded, streams in order.
  expand(f [..., D], x [..., N, D], post [..., N], comb [..., N, N]) -> [..., N, D] f's dtype
  collapse(x [..., N, D], pre [..., N]) -> [..., D] x's dtype   (the model's `mhc.expand` / `collapse`)
  expand_collapse(f, x, post, comb, pre) -> (x', collapse(x', pre))
  streams(a, axis) -> list   a's slices along axis (the rules' stream lists)

RMSNorm statistic (docs/MODEL.md §3.1; kernel: `kernels_pallas.rmsnorm`)
  rsqrt(v) -> fp32   1 / sqrt(v), each step correctly rounded: torch's CPU rsqrt bit for bit
      (XLA's own rsqrt differs in ~1/3 of the cases).
  rms_inv(x [..., D], eps) -> fp32 [..., 1]   rsqrt(mean(x^2) + eps) over the last axis in fp32:
      each square rounded to fp32, summed in torch's CPU order (`numerics.cascade_sum`), divided by
      D correctly rounded. RMSNorm, the mHC mixes and the Engram gate take it.
"""

from __future__ import annotations

import functools
import operator

import jax
import jax.numpy as jnp

from kernels_pallas._ieee import div_near_by
from v41_jax.linear import lin4
from v41_jax.numerics import HIGHEST, Numerics, cascade_sum, exact_div, ordered_sum, rounded, top_k
from v41_jax.quant import held


# ---- sparse attention ---------------------------------------------------------------------------

CHUNK = 64  # indices per online-softmax step, as the reference kernel
NO_MAX = -1e30  # finite start of the running max: an all-skip row ends with exp(sink + 1e30) = inf -> 0


def _gather_rows(kv: jax.Array, idx: jax.Array) -> jax.Array:
    """kv [B, N, D], idx [B, S, C] (>= 0) -> [B, S, C, D]."""
    return jax.vmap(lambda rows, i: rows[i])(kv, idx)


def _chunked(idx: jax.Array) -> jax.Array:
    """[B, S, K] -> [n_chunks, B, S, CHUNK], padded with -1 (a skipped index changes nothing)."""
    b, s, k = idx.shape
    idx = jnp.pad(idx, ((0, 0), (0, 0), (0, -k % CHUNK)), constant_values=-1)
    return jnp.moveaxis(idx.reshape(b, s, -1, CHUNK), 2, 0)


def sparse_attn(q: jax.Array, kv: jax.Array, sink: jax.Array, idx: jax.Array, scale: float,
                *, numerics: Numerics) -> jax.Array:
    """Attention of each query row over the latent rows its index list names.

    q [B, S, H, D], kv [B, N, D], sink [H] fp32 (an unscaled logit, denominator only),
    idx [B, S, K] int32 (any negative = skip; duplicates count twice), scale: softmax scale of q.k.
    Returns [B, S, H, D] in the activation dtype; a row with no valid index gives 0.

    numerics.attn_probs_bf16 is the reference kernel: the unnormalised probabilities are rounded to
    bf16 before P.V while the denominator keeps them in fp32. Scores and sums are fp32 either way.
    """
    qf = q.astype(jnp.float32)
    kvf = kv.astype(jnp.float32)
    b, s, h, d = q.shape

    def step(carry, idx_c):
        run_max, denom, acc = carry                                   # [B,S,H], [B,S,H], [B,S,H,D]
        valid = idx_c >= 0                                            # [B,S,C]
        # where, not multiply: an unused row (e.g. an unwritten cache page) may hold NaN
        rows = jnp.where(valid[..., None], _gather_rows(kvf, jnp.maximum(idx_c, 0)), 0.0)
        logits = jnp.einsum("bshd,bscd->bshc", qf, rows, precision=HIGHEST)
        logits = jnp.where(valid[:, :, None, :], logits, -jnp.inf) * scale
        new_max = jnp.maximum(run_max, logits.max(-1))
        rescale = jnp.exp(run_max - new_max)
        p = jnp.exp(logits - new_max[..., None])                      # [B,S,H,C]
        denom = denom * rescale + p.sum(-1)
        pv = p.astype(jnp.bfloat16).astype(jnp.float32) if numerics.attn_probs_bf16 else p
        acc = acc * rescale[..., None] + jnp.einsum("bshc,bscd->bshd", pv, rows, precision=HIGHEST)
        return (new_max, denom, acc), None

    init = (jnp.full((b, s, h), NO_MAX, jnp.float32), jnp.zeros((b, s, h), jnp.float32),
            jnp.zeros((b, s, h, d), jnp.float32))
    (run_max, denom, acc), _ = jax.lax.scan(step, init, _chunked(idx))
    denom = denom + jnp.exp(sink.astype(jnp.float32) - run_max)
    return numerics.act(acc / denom[..., None])


# ---- lightning indexer --------------------------------------------------------------------------

def index_scores(q: jax.Array, keys: jax.Array, weights: jax.Array, visible: jax.Array,
                 numerics: Numerics) -> jax.Array:
    """q [B, T, Hi, Di], keys [B, N, Di], weights [B, T, Hi], visible [B, T] -> [B, T, N]."""
    dt = numerics.index_score_dtype
    dots = jnp.einsum("bthd,bnd->bthn", q, keys, precision=HIGHEST,
                      preferred_element_type=jnp.float32).astype(dt)
    # each product rounds to the score dtype once; the head sum accumulates in fp32, rounds once
    terms = (jnp.maximum(dots, 0).astype(jnp.float32) * weights.astype(jnp.float32)[..., None]).astype(dt)
    scores = terms.astype(jnp.float32).sum(axis=2).astype(dt)
    rows = jnp.arange(keys.shape[1])
    return jnp.where(rows < visible[..., None], scores, -jnp.inf)


def ascending(ids: jax.Array, keep: jax.Array) -> jax.Array:
    """Kept ids sorted ascending, -1 after them."""
    big = jnp.iinfo(jnp.int32).max
    ids = jnp.sort(jnp.where(keep, ids, big), axis=-1)
    return jnp.where(ids == big, -1, ids).astype(jnp.int32)


def select_topk(scores: jax.Array, visible: jax.Array, k: int, finite_only: bool = False) -> jax.Array:
    """The k best rows, re-sorted by position. As in the reference, validity is by position
    (id < visible) only: when fewer than k rows score finite, -inf fillers below `visible` stay.
    finite_only: picks scoring -inf or NaN are dropped too (the candidate source's blocks)."""
    values, ids = top_k(scores.astype(jnp.float32), min(k, scores.shape[-1]))
    keep = ids < visible[..., None]
    return ascending(ids, keep & (values > -jnp.inf) if finite_only else keep)


# ---- routed experts -----------------------------------------------------------------------------

def silu(x: jax.Array) -> jax.Array:
    return x / (1 + jnp.exp(-x))


def swiglu(gate: jax.Array, up: jax.Array, limit: float, weight: jax.Array | None = None) -> jax.Array:
    """fp32 gate / up GEMM outputs -> weight * silu(min(gate, limit)) * clip(up, ±limit): the clamp
    is asymmetric (gate from above only); limit 0 = no clamp; the routing weight before any cast."""
    if limit > 0:
        up = jnp.clip(up, -limit, limit)
        gate = jnp.minimum(gate, limit)
    h = silu(gate) * up
    return h if weight is None else weight * h


def swiglu_ffn(x: jax.Array, w1: jax.Array, w3: jax.Array, w2: jax.Array, numerics: Numerics,
               limit: float, weight: jax.Array | None = None) -> jax.Array:
    gate = lin4(x, w1, numerics).astype(jnp.float32)
    up = lin4(x, w3, numerics).astype(jnp.float32)
    return lin4(numerics.act(swiglu(gate, up, limit, weight)), w2, numerics)


def routed_experts(x: jax.Array, idx: jax.Array, w: jax.Array, w1: jax.Array, w3: jax.Array,
                   w2: jax.Array, numerics: Numerics, swiglu_limit: float) -> jax.Array:
    return add_slots(routed_pairs(x, idx, w, w1, w3, w2, numerics, swiglu_limit))


def routed_pairs(x: jax.Array, idx: jax.Array, w: jax.Array, w1: jax.Array, w3: jax.Array,
                 w2: jax.Array, numerics: Numerics, swiglu_limit: float,
                 base: jax.Array | int = 0) -> jax.Array:
    """Each (token, pick) pair's expert output [T, k, D], picks in ascending expert id (stable).
    base: the first row of this call's experts in w1/w3/w2 (a scanned run's flattened stack)."""
    order = jnp.argsort(idx, axis=-1, stable=True)
    idx = jnp.take_along_axis(idx, order, axis=-1)
    w = jnp.take_along_axis(w, order, axis=-1)

    def one_token(xt, e, wt):  # [D], expert id, routing weight -> [D]
        e = e + base
        return swiglu_ffn(xt[None], held(w1[e]), held(w3[e]), held(w2[e]), numerics, swiglu_limit,
                          wt)[0]

    return jnp.stack([jax.vmap(one_token)(x, idx[:, j], w[:, j]) for j in range(idx.shape[-1])], 1)


def add_slots(pairs: jax.Array) -> jax.Array:
    """[T, k, D] expert outputs, slots in ascending expert id -> fp32 [T, D], added slot by slot
    (the reference's expert loop)."""
    out = jnp.zeros(pairs[:, 0].shape, jnp.float32)
    for j in range(pairs.shape[1]):
        out = out + pairs[:, j].astype(jnp.float32)
    return out


# ---- mHC Sinkhorn -------------------------------------------------------------------------------

def sinkhorn(e: jax.Array, iters: int, eps: float, exact: bool = True) -> jax.Array:
    # not exact: the kernel's reciprocal division (each quotient within 3 ulps), the same bits
    div = exact_div if exact else (lambda a, b: div_near_by([a], b)[0])
    c = div(e, ordered_sum(e, -1)[..., None]) + eps
    c = div(c, ordered_sum(c, -2)[..., None, :] + eps)

    def rows_then_columns(_, c):
        c = div(c, ordered_sum(c, -1)[..., None] + eps)
        return div(c, ordered_sum(c, -2)[..., None, :] + eps)

    # a loop, not an unrolled chain: same operations, a fraction of the compile time
    return jax.lax.fori_loop(0, iters - 1, rows_then_columns, c)


# ---- rotary embedding ---------------------------------------------------------------------------

def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array, inverse: bool = False) -> jax.Array:
    half = cos.shape[-1]
    head, tail = x[..., : x.shape[-1] - 2 * half], x[..., x.shape[-1] - 2 * half:]
    pairs = tail.astype(jnp.float32).reshape(*tail.shape[:-1], half, 2)
    a, b = pairs[..., 0], pairs[..., 1]
    if inverse:
        sin = -sin
    rotated = jnp.stack([rounded(a * cos) - rounded(b * sin), rounded(a * sin) + rounded(b * cos)],
                        axis=-1).reshape(tail.shape)
    return jnp.concatenate([head, rotated.astype(x.dtype)], axis=-1)


# ---- mHC expand and collapse ----------------------------------------------------------------------

def expand_streams(f: jax.Array, xs: list, post: list, comb: list) -> list:
    n = len(xs)
    return [rounded(post[j] * f) + functools.reduce(operator.add, [rounded(comb[i][j] * xs[i]) for i in range(n)])
            for j in range(n)]


def collapse_streams(xs: list, pre: list) -> jax.Array:
    return functools.reduce(operator.add, [rounded(p * x) for p, x in zip(pre, xs)])


def streams(a: jax.Array, axis: int) -> list:
    return [jnp.take(a, i, axis=axis) for i in range(a.shape[axis])]


def collapse(x: jax.Array, pre: jax.Array) -> jax.Array:
    return collapse_streams(streams(x.astype(jnp.float32), -2), streams(pre[..., None], -2)).astype(x.dtype)


def expand(f: jax.Array, x: jax.Array, post: jax.Array, comb: jax.Array) -> jax.Array:
    n = x.shape[-2]
    combs = [[comb[..., i, j, None] for j in range(n)] for i in range(n)]
    ys = expand_streams(f.astype(jnp.float32), streams(x.astype(jnp.float32), -2), streams(post[..., None], -2), combs)
    return jnp.stack(ys, axis=-2).astype(f.dtype)


def expand_collapse(f: jax.Array, x: jax.Array, post: jax.Array, comb: jax.Array,
                    pre: jax.Array) -> tuple[jax.Array, jax.Array]:
    y = expand(f, x, post, comb)
    return y, collapse(y, pre)


# ---- RMSNorm statistic --------------------------------------------------------------------------

def rsqrt(v: jax.Array) -> jax.Array:
    # exact_div keeps XLA from fusing 1 / sqrt into its approximate rsqrt
    return exact_div(jnp.ones_like(v), jnp.sqrt(v))


def rms_inv(x: jax.Array, eps: float) -> jax.Array:
    x = x.astype(jnp.float32)
    # torch squares into a tensor of its own (each square rounded; XLA:CPU would otherwise fuse a
    # square into the sum's add as an FMA), then its mean: the cascade sum and a true division
    mean_sq = exact_div(cascade_sum(rounded(jnp.square(x)))[..., None], x.shape[-1])
    return rsqrt(mean_sq + eps)
