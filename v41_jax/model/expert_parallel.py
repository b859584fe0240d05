"""Expert-parallel routed experts, run per device inside `shard_map` (docs/PARALLEL.md §2, §3).

API
  ExpertAxis(name, size)   a static params node (`params[...]["ffn"]["expert_axis"]`, put there by
      `runtime.mesh`): this MoE's routed experts are split in `size` contiguous blocks over the
      mesh axis `name`; device i holds experts [i * E/size, (i + 1) * E/size).
  routed_experts(x [T, D], idx [T, k], w [T, k], experts, numerics, limit, axis) -> fp32 [T, D]
      the same value as `kernels_pallas.moe.routed_experts` over all E experts, for this device's
      T tokens (each device of the axis holds its own tokens: data-parallel attention).

How: every device's tokens and picks are gathered (all_gather, T * size rows); each device runs
its own experts' picks of all of them through the kernels' `routed_pairs` (the other picks get
weight 0 and are masked to exact zeros); a reduce-scatter over the axis hands every device its own
tokens' [T, k, D] pair outputs, in which each pair has exactly one nonzero term, so the sum is
exact; the k pairs are then added in ascending expert id (`add_slots`) as on one device. The
expert weights never move; the bytes that do are the tokens in and the pair outputs out.

A pick of another device's expert is clipped to this device's first or last expert: the ids stay
in ascending order, so the kernels' stable per-token sort keeps the given pick order and the pair
outputs line up across devices. Those picks are computed with weight 0 and thrown away (the
kernels have no "skip this pair" id yet): (size - 1) / size of the pairs are wasted work on two
experts per device (docs/PARALLEL.md §2 gives the cost).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from kernels_pallas import moe as kernel_moe
from kernels_pallas.reference import add_slots
from v41_jax.model.numerics import Numerics


@jax.tree_util.register_static
@dataclass(frozen=True)
class ExpertAxis:
    name: str
    size: int


def local_picks(idx: jax.Array, w: jax.Array, first: jax.Array, n_local: int):
    """Picks sorted by global expert id -> (this device's ids, clipped into [0, n_local): ascending
    still; weights, 0 for another device's expert; mine [T, k] bool)."""
    mine = (idx >= first) & (idx < first + n_local)
    return jnp.clip(idx - first, 0, n_local - 1), jnp.where(mine, w, 0.0), mine


def routed_experts(x: jax.Array, idx: jax.Array, w: jax.Array, experts: dict, numerics: Numerics,
                   limit: float, axis: ExpertAxis) -> jax.Array:
    w1, w3, w2 = experts["w1"], experts["w3"], experts["w2"]
    n_local = w1.shape[0]
    order = jnp.argsort(idx, axis=-1, stable=True)          # the pair order every device shares
    idx, w = jnp.take_along_axis(idx, order, -1), jnp.take_along_axis(w, order, -1)
    xs, idxs, ws = (jax.lax.all_gather(a, axis.name, tiled=True) for a in (x, idx, w))
    ids, wts, mine = local_picks(idxs, ws, jax.lax.axis_index(axis.name) * n_local, n_local)
    pairs = kernel_moe.routed_pairs(xs, ids, wts, w1, w3, w2, numerics, limit)
    pairs = jnp.where(mine[..., None], pairs, jnp.zeros((), pairs.dtype))
    own = jax.lax.psum_scatter(pairs, axis.name, scatter_dimension=0, tiled=True)   # [T, k, D]
    return add_slots(own)
