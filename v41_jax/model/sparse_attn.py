"""Sparse single-latent attention with a per-head sink (docs/MODEL.md §3.5).

Every query head attends over its own list of latent rows (K = V, one shared latent per row).
The reference kernel walks the list in chunks of 64 with an online softmax; the chunking is part of
the numerics, because the probabilities are rounded to bf16 relative to the *running* max before
they meet the values. This module reproduces that walk exactly and is the jnp reference the Pallas
kernel is checked against.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from v41_jax.model.numerics import HIGHEST, Numerics

CHUNK = 64  # indices per online-softmax step, as the reference kernel
_NO_MAX = -1e30  # finite start of the running max: an all-skip row ends with exp(sink + 1e30) = inf -> 0


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

    init = (jnp.full((b, s, h), _NO_MAX, jnp.float32), jnp.zeros((b, s, h), jnp.float32),
            jnp.zeros((b, s, h, d), jnp.float32))
    (run_max, denom, acc), _ = jax.lax.scan(step, init, _chunked(idx))
    denom = denom + jnp.exp(sink.astype(jnp.float32) - run_max)
    return numerics.act(acc / denom[..., None])
