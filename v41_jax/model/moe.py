"""Mixture of experts: sqrtsoftplus router, routed SwiGLU experts, one shared expert (docs/MODEL.md §3.10).

API
  score(logits [T, E] fp32, cfg) -> fp32     sqrt(softplus(logits / gate_temp)); the reference's
      other score functions too: softmax over the experts, or sigmoid (`score_func`)
  route(logits, bias [T|1, E], k, cfg, idx=None) -> (weights [T, k] fp32, idx [T, k] int32)
      the bias steers selection only; ties go to the lower expert id (`numerics.top_k`); idx in
      selection order; weights renormalised (+1e-20) when k > 1, times route_scale. A given idx
      (teacher forcing, e.g. the reference's picks) replaces the selection, not the weights' math.
  swiglu_ffn, routed_experts   the SwiGLU expert FFN and the reference's routed-expert loop: the
      kernels' jnp references, defined (and documented) in `kernels_pallas.reference`, below both
      the model and the kernels; re-exported here.
  moe(p, cfg, layer, x [T, D], numerics, image_mask=None, forced_idx=None, expert_layer=None)
      -> (y act dtype [T, D], idx [T, k], select [T, E])   idx: the router's own selection (also
      when forced); select: the scores it was taken from (bias included), for tie diagnostics.
      expert_layer: p's experts are a scanned run's [L, E, ...] stack; this traced index is the layer.
      p = params["layers"][l]["ffn"] (gate.weight/bias[/bias_vl], experts.{w1,w3,w2}, shared_experts,
      and under a mesh `expert_axis`: the experts are this device's block, `model/expert_parallel.py`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from kernels_pallas import moe as kernel_moe
from kernels_pallas.reference import routed_experts, swiglu_ffn  # routed_experts: re-exported
from v41_jax.model import expert_parallel
from v41_jax.model.linear import lin_f32
from v41_jax.model.numerics import Numerics, exact_div, top_k

if TYPE_CHECKING:
    from v41_jax.config import ModelConfig


def _softplus(x: jax.Array) -> jax.Array:
    # torch.nn.functional.softplus (beta 1, threshold 20)
    return jnp.where(x > 20, x, jnp.log1p(jnp.exp(x)))


def score(logits: jax.Array, cfg: ModelConfig) -> jax.Array:
    x = exact_div(logits, cfg.gate_temp)
    if cfg.score_func == "softmax":       # the reference's other two (V4.1 checkpoints: sqrtsoftplus)
        e = jnp.exp(x - jnp.max(x, axis=-1, keepdims=True))
        return exact_div(e, jnp.sum(e, axis=-1, keepdims=True))
    if cfg.score_func == "sigmoid":
        return jax.nn.sigmoid(x)
    return jnp.sqrt(_softplus(x))


def route(logits: jax.Array, bias: jax.Array, k: int, cfg: ModelConfig,
          idx: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    s = score(logits, cfg)
    if idx is None:
        _, idx = top_k(s + bias, k)  # descending; equal scores: lower expert id first
    w = jnp.take_along_axis(s, idx, axis=-1)
    if cfg.norm_topk_prob and k > 1:
        w = exact_div(w, jnp.sum(w, axis=-1, keepdims=True) + 1e-20)  # 1e-20, not norm_eps: as in training
    return w * cfg.route_scale, idx.astype(jnp.int32)


def moe(p: dict, cfg: ModelConfig, layer: int, x: jax.Array, numerics: Numerics,
        image_mask: jax.Array | None = None,
        forced_idx: jax.Array | None = None,
        expert_layer: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    _, k = cfg.moe_experts(layer)
    bias = p["gate"]["bias"]
    if image_mask is not None and "bias_vl" in p["gate"]:
        bias = jnp.where(image_mask[:, None], p["gate"]["bias_vl"], bias)
    logits = lin_f32(x, p["gate"]["weight"])
    _, own = route(logits, bias, k, cfg)
    w, idx = route(logits, bias, k, cfg, own if forced_idx is None else forced_idx)
    ex, sh = p["experts"], p["shared_experts"]
    # The kernels' dispatcher: the reference's per-token loop (`routed_experts`) under the XLA
    # switch or the reference's block GEMM order, else the fastest exact grouped GEMM (the loop
    # gathers a weight copy per pick).
    # Under a mesh (`expert_axis`, docs/PARALLEL.md) this device holds a block of the experts.
    axis = p.get("expert_axis")
    y = (expert_parallel.routed_experts(x, idx, w, ex, numerics, cfg.swiglu_limit, axis) if axis else
         kernel_moe.routed_experts(x, idx, w, ex["w1"], ex["w3"], ex["w2"], numerics, cfg.swiglu_limit,
                                   stack_index=expert_layer))
    shared = swiglu_ffn(x, sh["w1"]["weight"], sh["w3"]["weight"], sh["w2"]["weight"], numerics,
                        cfg.swiglu_limit)
    return numerics.act(y + shared.astype(jnp.float32)), own, score(logits, cfg) + bias
