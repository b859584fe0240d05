"""The cache buffer: one preallocated pytree of typed arrays, shaped by `CacheGeometry`.

The step takes it donated and returns it updated in place (docs/CACHE.md §1.8): every write is a
scatter whose padding rows carry an out-of-range index and are dropped, never wrapped onto a live
row. Layout (bf16 / f32 rows; packed rows are uint8 of the packed row width):

  main[k]     [P, B/r_k, D]            compressed rows of owner k, page-major
  index[k]    [P, B/r_k, Di]           index keys of owner k
  window      [N, L_win, W+S, D]       window rings, slot-major (one STATE entry per slot)
  comp_kv     [N, n_ring, max_r+S, D]  fp32 raw compressor projections of the ratio > 1 owners
  comp_score  [N, n_ring, max_r+S, D]  fp32 gate scores, same addressing
  cursor      [N, H+1] int32           Engram cursor: committed position, last H compressed ids
  sampled     [N, 1 + blk] int32       the token last sampled for the slot, then (speculating) the
                                       block drafted after it: a pending span's input tokens
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp

from .geometry import CacheGeometry

DEAD = -1  # cursor history entry for a missing token (before the start, or an image token)


@partial(jax.tree_util.register_dataclass,
         data_fields=["main", "index", "window", "comp_kv", "comp_score", "cursor", "sampled"],
         meta_fields=[])
@dataclass(frozen=True)
class Cache:
    main: tuple[jax.Array, ...]
    index: tuple[jax.Array, ...]
    window: jax.Array
    comp_kv: jax.Array
    comp_score: jax.Array
    cursor: jax.Array
    sampled: jax.Array

    def __getitem__(self, name: str):
        """Mapping-style access, so `CacheGeometry.to_image` reads a Cache and a dict alike."""
        return getattr(self, name)

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in jax.tree_util.tree_leaves(self))


def allocate(geom: CacheGeometry) -> Cache:
    """Zeros everywhere; cursor history DEAD, position 0 (every slot looks freshly reset)."""
    specs = geom.array_specs()

    @jax.jit
    def zeros() -> Cache:
        z = lambda s: jnp.zeros(s.shape, s.dtype)
        cursor = jnp.full(specs["cursor"].shape, DEAD, specs["cursor"].dtype).at[:, 0].set(0)
        return Cache(main=tuple(map(z, specs["main"])), index=tuple(map(z, specs["index"])),
                     window=z(specs["window"]), comp_kv=z(specs["comp_kv"]),
                     comp_score=z(specs["comp_score"]), cursor=cursor, sampled=z(specs["sampled"]))

    return zeros()


@partial(jax.jit, donate_argnums=(0,))
def reset_slots(cache: Cache, fresh: jax.Array) -> Cache:
    """Zero whole STATE entries (window rings, compressor rings) and reset their cursors to
    [0, DEAD...]: the fresh-slot rule for a request starting at position 0 (docs/CACHE.md §1.9, INV-2).

    fresh [N] bool, one flag per slot (a fixed shape, so this compiles once). A select over the
    STATE arrays rather than a scatter of zero slots: it updates in place with no temporary, where
    a scatter would materialise its [n, slot] zero updates.
    """
    def zero(x):
        return jnp.where(fresh.reshape(-1, *[1] * (x.ndim - 1)), jnp.zeros((), x.dtype), x)

    fresh_cursor = jnp.full(cache.cursor.shape[1:], DEAD, cache.cursor.dtype).at[0].set(0)
    return Cache(main=cache.main, index=cache.index, window=zero(cache.window),
                 comp_kv=zero(cache.comp_kv), comp_score=zero(cache.comp_score),
                 cursor=jnp.where(fresh[:, None], fresh_cursor, cache.cursor),
                 sampled=jnp.where(fresh[:, None], jnp.zeros((), cache.sampled.dtype), cache.sampled))
