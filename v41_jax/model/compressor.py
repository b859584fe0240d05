"""KV compressor of a FULL layer (docs/MODEL.md §3.6): one latent row per complete group of
`ratio` consecutive tokens, row j covering positions r*j .. r*j + r - 1.

The cores take the new tokens plus the carried partial group, so the same functions serve the full
forward (start 0, empty state) and the cache path (any start, state from the compressor ring).

API
  CompressorState(kv, score)       fp32 [B, r, C] raw wkv / wgate projections of the partial group,
                                   slot = position % r (slots >= start % r are don't-care).
  init_state(batch, ratio, dim)    an empty state (start positions that are multiples of r).
  pool_groups(kv, score, state, start, ratio) -> (pooled [B, G, C] fp32, row_ids [B, G], state)
                                   per-lane softmax pooling over each group completed by the
                                   new tokens; G = (r - 1 + T) // r slots, row id -1 (and zeros)
                                   past the completed ones. Any ratio >= 1.
  compress(p, cfg, ratio, h, state, start, numerics) -> (latent [B, G, Dh], row_ids [B, G], state)
                                   the pre-RoPE latent (post-norm, act dtype): ratio 1 is
                                   norm(LinBF(h)); ratio > 1 pools fp32 projections, rounds to the
                                   act dtype, then norms. It feeds the index keys and `stored_rows`.
  projections(p, h) -> (kv, score) fp32 [..., C]   the raw wkv / wgate projections (ratio > 1)
  group_latent(p, cfg, pooled, numerics) -> [..., C]  a pooled group -> its latent (act round, norm)
                                   compress = projections -> pool_groups -> group_latent; the cache
                                   path pools groups gathered from its ring between the two.
  stored_rows(cfg, ratio, latent, row_ids, numerics) -> [B, G, Dh]
                                   RoPE (global table) at the group's first position r*j, then the
                                   fp4 QDQ (group 16, e4m3 scale): the compressed KV cache rows.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from v41_jax.config import ModelConfig
from v41_jax.model.linear import lin_bf, lin_f32
from v41_jax.model.norm import rms_norm
from v41_jax.model.numerics import Numerics, rounded
from v41_jax.model.rope import apply_rope, rope_cos_sin
from v41_jax.quant import KV_FP4_GROUP, fp4_qdq_e4m3, pack_fp4_e4m3_rows



class CompressorState(NamedTuple):
    kv: jax.Array     # [B, r, C] fp32
    score: jax.Array  # [B, r, C] fp32


def init_state(batch: int, ratio: int, dim: int) -> CompressorState:
    zeros = jnp.zeros((batch, ratio, dim), jnp.float32)
    return CompressorState(zeros, zeros)


def _pool_one(kv, score, st_kv, st_score, start, ratio):
    """One sequence: kv/score [T, C], state [r, C], start scalar."""
    t, c = kv.shape
    carried = start % ratio                       # tokens of the open group already in the state
    n_groups = (ratio - 1 + t) // ratio           # most groups T new tokens can complete
    length = (n_groups + 1) * ratio               # room for carried + new + the next open group

    def buffer(state, new):
        # zeros, not the state's stale slots: a garbage group then pools to a finite value
        keep = (jnp.arange(ratio) < carried)[:, None]
        buf = jnp.zeros((length, c), jnp.float32).at[:ratio].set(jnp.where(keep, state, 0.0))
        return jax.lax.dynamic_update_slice(buf, new, (carried, 0))

    buf_kv, buf_score = buffer(st_kv, kv), buffer(st_score, score)
    groups = lambda b: b[: n_groups * ratio].reshape(n_groups, ratio, c)
    pooled = rounded(groups(buf_kv) * jax.nn.softmax(groups(buf_score), axis=1)).sum(axis=1)
    done = (carried + t) // ratio
    valid = jnp.arange(n_groups) < done
    row_ids = jnp.where(valid, start // ratio + jnp.arange(n_groups), -1)
    open_group = lambda b: jax.lax.dynamic_slice(b, (done * ratio, 0), (ratio, c))
    return (jnp.where(valid[:, None], pooled, 0.0), row_ids.astype(jnp.int32),
            open_group(buf_kv), open_group(buf_score))


def pool_groups(kv: jax.Array, score: jax.Array, state: CompressorState, start: jax.Array, ratio: int
                ) -> tuple[jax.Array, jax.Array, CompressorState]:
    """kv/score fp32 [B, T, C] of positions start..start+T-1, start [B] int."""
    pooled, row_ids, st_kv, st_score = jax.vmap(_pool_one, in_axes=(0, 0, 0, 0, 0, None))(
        kv, score, state.kv, state.score, start, ratio)
    return pooled, row_ids, CompressorState(st_kv, st_score)


def compress(p: dict, cfg: ModelConfig, ratio: int, h: jax.Array, state: CompressorState | None,
             start: jax.Array, numerics: Numerics) -> tuple[jax.Array, jax.Array, CompressorState | None]:
    """h [B, T, D] (the attention input), start [B]. Ratio 1 carries no state (pass None)."""
    b, t, _ = h.shape
    if ratio == 1:  # one token per group: no gate, no fp32 promotion
        latent = rms_norm(lin_bf(h, p["wkv"]["weight"], numerics), p["norm"]["weight"], cfg.norm_eps, numerics)
        return latent, (start[:, None] + jnp.arange(t)).astype(jnp.int32), state
    pooled, row_ids, state = pool_groups(*projections(p, h), state, start, ratio)
    return group_latent(p, cfg, pooled, numerics), row_ids, state


def projections(p: dict, h: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The fp32 inputs of the pooling: raw wkv (the values) and wgate (the pooling scores)."""
    return lin_f32(h, p["wkv"]["weight"]), lin_f32(h, p["wgate"]["weight"])


def group_latent(p: dict, cfg: ModelConfig, pooled: jax.Array, numerics: Numerics) -> jax.Array:
    # the pooled sum is rounded to the activation dtype before the norm, as the reference does
    return rms_norm(numerics.act(pooled), p["norm"]["weight"], cfg.norm_eps, numerics)


def _rotated_rows(cfg: ModelConfig, ratio: int, latent: jax.Array, row_ids: jax.Array) -> jax.Array:
    """A latent stands for its group's first token: rotate at r*j (global table)."""
    cos, sin = rope_cos_sin(cfg, ratio * jnp.maximum(row_ids, 0), global_table=True)
    return apply_rope(latent, cos, sin)


def stored_rows(cfg: ModelConfig, ratio: int, latent: jax.Array, row_ids: jax.Array,
                numerics: Numerics) -> jax.Array:
    """The compressed KV rows the attention reads: rotated, then their FP4 round trip."""
    rows = _rotated_rows(cfg, ratio, latent, row_ids)
    return fp4_qdq_e4m3(rows, KV_FP4_GROUP) if numerics.fake_quant else rows


def packed_stored_rows(cfg: ModelConfig, ratio: int, latent: jax.Array, row_ids: jax.Array) -> jax.Array:
    """`stored_rows` under fake-quant as packed FP4 bytes (the cache's packed main rows): the codes
    of the round trip itself, which decode to exactly its values."""
    return pack_fp4_e4m3_rows(_rotated_rows(cfg, ratio, latent, row_ids), KV_FP4_GROUP)
