"""The merge of a split attention's partials: each split (a contiguous part of a token's chunk
list) leaves an fp32 accumulator and its softmax statistics (running max, denominator); the merge
rescales them to the common max, folds in the sink and normalises. Both sparse attention kernels
(`sparse_attn`, `sparse_attn_mgpu`) write these partials."""

from __future__ import annotations

import jax.numpy as jnp


def merge_splits(acc, run_max, denom, sink, dtype):
    """acc [T, P, H, D], run_max/denom [T, P, V, H] partials (V value parts, each with its own
    statistics for its D/V columns) -> [T, H, D] with the sink folded in."""
    t, p, h, d = acc.shape
    v = run_max.shape[2]
    acc = acc.reshape(t, p, h, v, d // v)
    run_max, denom = run_max.swapaxes(2, 3), denom.swapaxes(2, 3)      # [T, P, H, V]
    top = run_max.max(axis=1)                                          # [T, H, V]
    w = jnp.exp(run_max - top[:, None])                                # [T, P, H, V]
    den = (denom * w).sum(1) + jnp.exp(sink[None, :, None] - top)
    out = (acc * w[..., None]).sum(1) / den[..., None]                 # [T, H, V, D/V]
    return out.reshape(t, h, d).astype(dtype)
