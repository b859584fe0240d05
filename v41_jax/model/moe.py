"""Mixture of experts: sqrtsoftplus router, routed SwiGLU experts, one shared expert (docs/MODEL.md §3.10).

API
  score(logits [T, E] fp32, cfg) -> fp32     sqrt(softplus(logits / gate_temp))
  route(logits, bias [T|1, E], k, cfg, idx=None) -> (weights [T, k] fp32, idx [T, k] int32)
      the bias steers selection only; ties go to the lower expert id (`numerics.top_k`); idx in
      selection order; weights renormalised (+1e-20) when k > 1, times route_scale. A given idx
      (teacher forcing, e.g. the reference's picks) replaces the selection, not the weights' math.
  swiglu_ffn(x, w1, w3, w2, numerics, limit, weight=None) -> act dtype
      up clamped to [-limit, limit], gate to <= limit (limit 0 = no clamp); the routing weight
      multiplies the fp32 activation before its rounding to the activation dtype.
  routed_experts(x [T, D], idx [T, k], w [T, k], w1 [E, F, D], w3 [E, F, D], w2 [E, D, F],
                 numerics, swiglu_limit) -> fp32 [T, D]
      the jnp reference for the expert kernels: each token's k expert outputs (act dtype) summed
      in fp32 in ascending expert id, the order the reference's expert loop adds them. The expert
      weights are bf16 arrays or `quant.Fp4Weight`s (held as published, dequantized per pick).
  moe(p, cfg, layer, x [T, D], numerics, image_mask=None, forced_idx=None)
      -> (y act dtype [T, D], idx [T, k], select [T, E])   idx: the router's own selection (also
      when forced); select: the scores it was taken from (bias included), for tie diagnostics.
      p = params["layers"][l]["ffn"] (gate.weight/bias[/bias_vl], experts.{w1,w3,w2}, shared_experts).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from v41_jax.model.linear import lin4, lin_f32
from v41_jax.model.numerics import Numerics, exact_div, top_k
from v41_jax.quant import held

if TYPE_CHECKING:
    from v41_jax.config import ModelConfig


def _softplus(x: jax.Array) -> jax.Array:
    # torch.nn.functional.softplus (beta 1, threshold 20)
    return jnp.where(x > 20, x, jnp.log1p(jnp.exp(x)))


def score(logits: jax.Array, cfg: ModelConfig) -> jax.Array:
    if cfg.score_func != "sqrtsoftplus":  # the only scoring V4.1 checkpoints use
        raise ValueError(f"score_func: only 'sqrtsoftplus' is implemented, got {cfg.score_func!r}")
    return jnp.sqrt(_softplus(exact_div(logits, cfg.gate_temp)))


def route(logits: jax.Array, bias: jax.Array, k: int, cfg: ModelConfig,
          idx: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    s = score(logits, cfg)
    if idx is None:
        _, idx = top_k(s + bias, k)  # descending; equal scores: lower expert id first
    w = jnp.take_along_axis(s, idx, axis=-1)
    if cfg.norm_topk_prob and k > 1:
        w = exact_div(w, jnp.sum(w, axis=-1, keepdims=True) + 1e-20)  # 1e-20, not norm_eps: as in training
    return w * cfg.route_scale, idx.astype(jnp.int32)


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
    order = jnp.argsort(idx, axis=-1)
    idx = jnp.take_along_axis(idx, order, axis=-1)
    w = jnp.take_along_axis(w, order, axis=-1)

    def one_token(xt, e, wt):  # [D], expert id, routing weight -> [D]
        return swiglu_ffn(xt[None], held(w1[e]), held(w3[e]), held(w2[e]), numerics, swiglu_limit,
                          wt)[0]

    return add_slots(jnp.stack([jax.vmap(one_token)(x, idx[:, j], w[:, j]) for j in range(idx.shape[-1])], 1))


def add_slots(pairs: jax.Array) -> jax.Array:
    """[T, k, D] expert outputs, slots in ascending expert id -> fp32 [T, D], added slot by slot
    (the reference's expert loop)."""
    out = jnp.zeros(pairs[:, 0].shape, jnp.float32)
    for j in range(pairs.shape[1]):
        out = out + pairs[:, j].astype(jnp.float32)
    return out


def moe(p: dict, cfg: ModelConfig, layer: int, x: jax.Array, numerics: Numerics,
        image_mask: jax.Array | None = None,
        forced_idx: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    _, k = cfg.moe_experts(layer)
    bias = p["gate"]["bias"]
    if image_mask is not None and "bias_vl" in p["gate"]:
        bias = jnp.where(image_mask[:, None], p["gate"]["bias_vl"], bias)
    logits = lin_f32(x, p["gate"]["weight"])
    _, own = route(logits, bias, k, cfg)
    w, idx = route(logits, bias, k, cfg, own if forced_idx is None else forced_idx)
    ex, sh = p["experts"], p["shared_experts"]
    # The kernels' dispatcher: the per-token loop below under the XLA switch or the reference's
    # block GEMM order, else the fastest exact grouped GEMM (the loop gathers a weight copy per pick).
    from kernels_pallas import moe as kernel_moe  # late: kernels_pallas.moe imports this module
    y = kernel_moe.routed_experts(x, idx, w, ex["w1"], ex["w3"], ex["w2"], numerics, cfg.swiglu_limit)
    shared = swiglu_ffn(x, sh["w1"]["weight"], sh["w3"]["weight"], sh["w2"]["weight"], numerics,
                        cfg.swiglu_limit)
    return numerics.act(y + shared.astype(jnp.float32)), own, score(logits, cfg) + bias
