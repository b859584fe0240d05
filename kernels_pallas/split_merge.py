"""The merge of a split attention's partials: each split (a contiguous part of a token's chunk
list) leaves an fp32 accumulator and its softmax statistics (running max, denominator); the merge
rescales them to the common max, folds in the sink and normalises. `combine` is the one formula:
the Triton kernel runs it in the last program of a token's head block to finish (`sparse_attn`,
`merge_in_kernel`), `merge_splits` as an XLA epilogue over partials (both kernels otherwise)."""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp


def combine(accs: Sequence[jax.Array], maxes: Sequence[jax.Array], denoms: Sequence[jax.Array],
            sink: jax.Array, dtype) -> jax.Array:
    """One split each: acc [..., H, Dv] fp32, max and denominator [..., H]; sink broadcast to
    [..., H] -> the normalised output [..., H, Dv] in dtype. Splits summed in their order."""
    top = functools.reduce(jnp.maximum, maxes)
    ws = [jnp.exp(m - top) for m in maxes]
    den = functools.reduce(jnp.add, [l * w for l, w in zip(denoms, ws)]) + jnp.exp(sink - top)
    out = functools.reduce(jnp.add, [a * w[..., None] for a, w in zip(accs, ws)])
    return (out / den[..., None]).astype(dtype)


def merge_splits(acc, run_max, denom, sink, dtype):
    """acc [T, P, H, D], run_max/denom [T, P, V, H] partials (V value parts, each with its own
    statistics for its D/V columns) -> [T, H, D] with the sink folded in."""
    t, p, h, d = acc.shape
    v = run_max.shape[2]
    acc = acc.reshape(t, p, h, v, d // v)
    run_max, denom = run_max.swapaxes(2, 3), denom.swapaxes(2, 3)      # [T, P, H, V]
    out = combine([acc[:, s] for s in range(p)], [run_max[:, s] for s in range(p)],
                  [denom[:, s] for s in range(p)], sink[None, :, None], dtype)   # [T, H, V, D/V]
    return out.reshape(t, h, d)
