"""Expert-parallel routed experts, run per device inside `shard_map` (docs/PARALLEL.md §2, §3).

API
  ExpertAxis(name, size)   a static params node (`params[...]["ffn"]["expert_axis"]`, put there by
      `runtime.mesh`): this MoE's routed experts are split in `size` contiguous blocks over the
      mesh axis `name`; device i holds experts [i * E/size, (i + 1) * E/size).
  routed_experts(x [T, D], idx [T, k], w [T, k], experts, numerics, limit, axis) -> fp32 [T, D]
      the same value as `kernels_pallas.moe.routed_experts` over all E experts, for this device's
      T tokens (each device of the axis holds its own tokens: data-parallel attention).
  own_pairs(xs, ids, wts, mine, experts, numerics, limit, rows) -> [M, k, D]
      the pair outputs of this device's picks only, `rows` pairs a round; exact zeros elsewhere.
  round_rows(share, total) -> int   the pairs one round of `own_pairs` computes.

How: every device's tokens and picks are gathered (all_gather, T * size rows); each device
computes only the picks of its own experts: their pair ids are packed to the front (a stable sort
on "not mine"), and the kernels' `routed_pairs` runs on them `rows` at a time, each pair as a
token of one pick (every implementation computes a pair's row from its own token row and expert
alone, so its value does not depend on which other pairs share the call), in as many rounds as
this device has picks (a while loop: usually one). Their outputs are scattered to their place in
a zero [T * size, k, D] buffer; a reduce-scatter over the axis hands every device its own tokens'
[T, k, D] pair outputs, in which each pair has exactly one nonzero term, so the sum is exact; the
k pairs are then added in ascending expert id (`add_slots`) as on one device. The expert weights
never move; the bytes that do are the tokens in and the pair outputs out.

Work: a device computes `round_rows` pairs a round where the gathered batch holds size * T * k,
about 1.25 / size of them (docs/PARALLEL.md §2). An all-to-all dispatch that sends each pick only
to its expert's device (`jax.lax.ragged_all_to_all`) would also cut the bytes moved; XLA:CPU in
jax 0.10.2 does not implement it ("HLO opcode ragged-all-to-all is not supported"), so the CPU
tests could not run it.
"""

from __future__ import annotations

import math
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


def round_rows(share: int, total: int) -> int:
    """Pairs per round, for a device whose expected share of the `total` gathered pairs is `share`
    (T * k under uniform routing): its share plus 4 standard deviations of a binomial count
    (sigma <= sqrt(share)) and at least 1.25x the share for uneven routing, at most all of them. A
    device with more picks takes more rounds, so this sets only the speed, never the value."""
    return min(total, math.ceil(max(1.25 * share, share + 4 * math.sqrt(share))))


def own_pairs(xs: jax.Array, ids: jax.Array, wts: jax.Array, mine: jax.Array, experts: dict,
              numerics: Numerics, limit: float, rows: int) -> jax.Array:
    """xs [M, D] gathered tokens, ids [M, k] this device's expert ids of its picks, wts [M, k]
    routing weights, mine [M, k] bool -> [M, k, D] activation dtype: the routed pair output of
    every pick in `mine`, computed `rows` pairs a round; exactly zero at every other pick."""
    m, k = ids.shape
    n_local = experts["w1"].shape[0]
    flat_ids, flat_w, flat_mine = ids.reshape(-1), wts.reshape(-1), mine.reshape(-1)
    packed = jnp.argsort(~flat_mine, stable=True)                 # this device's pairs first
    count = flat_mine.sum(dtype=jnp.int32)

    def one_round(r):
        """-> (pair ids [rows], live [rows], their outputs [rows, D]); past `count`: weight 0."""
        at = r * rows + jnp.arange(rows, dtype=jnp.int32)
        live = at < count
        pair = packed[jnp.minimum(at, m * k - 1)]
        y = kernel_moe.routed_pairs(xs[pair // k], jnp.clip(flat_ids[pair], 0, n_local - 1)[:, None],
                                    jnp.where(live, flat_w[pair], 0.0)[:, None],
                                    experts["w1"], experts["w3"], experts["w2"], numerics, limit)
        return pair, live, y[:, 0]

    def body(r, out):
        pair, live, y = one_round(r)
        return out.at[jnp.where(live, pair, m * k)].set(y, mode="drop")

    y_type = jax.eval_shape(lambda: one_round(0)[2])
    out = jnp.zeros((m * k, y_type.shape[-1]), y_type.dtype)
    return jax.lax.fori_loop(0, (count + rows - 1) // rows, body, out).reshape(m, k, -1)


def routed_experts(x: jax.Array, idx: jax.Array, w: jax.Array, experts: dict, numerics: Numerics,
                   limit: float, axis: ExpertAxis) -> jax.Array:
    n_local = experts["w1"].shape[0]
    order = jnp.argsort(idx, axis=-1, stable=True)          # each token's picks in ascending id
    idx, w = jnp.take_along_axis(idx, order, -1), jnp.take_along_axis(w, order, -1)
    xs, idxs, ws = (jax.lax.all_gather(a, axis.name, tiled=True) for a in (x, idx, w))
    first = jax.lax.axis_index(axis.name) * n_local
    mine = (idxs >= first) & (idxs < first + n_local)
    pairs = own_pairs(xs, idxs - first, ws, mine, experts, numerics, limit,
                      round_rows(idx.size, idxs.size))
    own = jax.lax.psum_scatter(pairs, axis.name, scatter_dimension=0, tiled=True)   # [T, k, D]
    return add_slots(own)
