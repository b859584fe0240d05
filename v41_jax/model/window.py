"""Sliding-window index lists (docs/MODEL.md §3.9; the reference's get_window_topk_idxs).

Two address spaces:
  * linear: row i of the KV buffer holds position i (the full forward, draft context rows);
  * ring:   slot s of a `window`-slot ring holds the newest position p with p % window == s (decode).
Every list is left-packed (valid entries first, -1 after), in the order the reference lists them:
the order is part of the numerics, because sparse attention rounds per chunk of 64 entries.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def window_idx(positions: jax.Array, window: int, cols: int) -> jax.Array:
    """Linear rows of each query's causal window, oldest first.

    positions [...] int -> [..., cols] int32: max(0, p-window+1) + c for c < cols, -1 past p.
    With positions = arange(S) and cols = min(S, window) this is the reference's prefill matrix.
    """
    p = positions.astype(jnp.int32)[..., None]
    idx = jnp.maximum(p - window + 1, 0) + jnp.arange(cols, dtype=jnp.int32)
    return jnp.where(idx > p, -1, idx)


def ring_idx(position: jax.Array, window: int) -> jax.Array:
    """Ring slots a decode query at `position` attends to, oldest first (slots never written: -1).

    position [...] int -> [..., window] int32. The ring already holds this position's row.
    """
    p = position.astype(jnp.int32)[..., None]
    slots = (p % window + 1 + jnp.arange(window, dtype=jnp.int32)) % window
    return jnp.where(slots > p, -1, slots)


def draft_context_idx(anchor: jax.Array, window: int) -> jax.Array:
    """Linear rows of the draft context for an anchor position, in ring-slot order (DraftAttention).

    The reference lists its context ring by slot, 0..min(window, a+1)-1; slot s holds the newest
    position <= a congruent to s. anchor [...] int -> [..., window] int32, -1 past a + 1 entries.
    """
    a = anchor.astype(jnp.int32)[..., None]
    s = jnp.arange(window, dtype=jnp.int32)
    return jnp.where(s > a, -1, a - (a - s) % window)
