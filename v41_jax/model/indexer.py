"""Lightning indexer: which compressed rows each query attends to (docs/MODEL.md §3.7).

Pure cores over explicit arrays: query rows at their positions, key rows of the kv owner, and
per-query visible counts, so the full forward and the cache path call the same functions.
Selections tie toward the lower index everywhere (`numerics.top_k`: lax.top_k with -0.0 == +0.0; docs/MODEL.md §4.3).

API (B batch, T queries, N key rows, Hi/Di indexer heads/width)
  visible_rows(positions, ratio) -> int32 [...]        (p + 1) // r: rows whose group is complete
  index_keys(p, cfg, latent, row_ids, ratio, numerics) -> [B, G, Di]
      k_norm(LinBF(latent, wk)) -> RoPE at r*j (global table) -> fp4 QDQ (group 32, ue8m0);
      latent is the compressor's pre-RoPE latent.
  index_query(p, cfg, c_q, positions, numerics) -> [B, T, Hi, Di]
      Lin8(c_q, wq_b) -> RoPE at p -> fp4 QDQ (group 32, ue8m0).
  index_weights(p, cfg, h, numerics) -> [B, T, Hi]     LinBF(h, weights_proj) * Di^-0.5 * Hi^-0.5
  index_scores              the indexer scores: the kernels' jnp reference,
      defined (and documented) in `kernels_pallas.reference`; re-exported here.
  select_topk(scores, visible, k, finite_only) -> int32 [..., min(k, N)]   the k best rows, ascending, -1 past
      visible. The rule and the XLA path: `kernels_pallas.reference.select_topk`; the Pallas
      backend selects without a sort (`kernels_pallas.select`, same ids).
  candidate_blocks(scores, visible, topk_blocks, block_size) -> int32 [B, T, min(topk_blocks, nb)]
      block ids kept by the candidate source, ascending, -1 for dropped (-inf) picks.
  candidate_mask(blocks, n_rows, block_size) -> bool [B, T, N]   rows inside the kept blocks
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas import select as kernel_select
from kernels_pallas.reference import index_scores
from v41_jax.config import ModelConfig
from v41_jax.model.linear import lin8, lin_bf
from v41_jax.model.norm import rms_norm
from v41_jax.model.numerics import Numerics
from v41_jax.model.rope import apply_rope, rope_cos_sin
from v41_jax.quant import FP4_GROUP, fp4_qdq_ue8m0

INDEX_FP4_GROUP = FP4_GROUP  # index keys and queries: fp4 with one ue8m0 scale per 32 lanes


def select_topk(scores: jax.Array, visible: jax.Array, k: int, finite_only: bool = False) -> jax.Array:
    return kernel_select.select_ascending(scores, visible, k, finite_only=finite_only)


def visible_rows(positions: jax.Array, ratio: int) -> jax.Array:
    return ((positions + 1) // ratio).astype(jnp.int32)


def _fp4(x: jax.Array, numerics: Numerics) -> jax.Array:
    return fp4_qdq_ue8m0(x, INDEX_FP4_GROUP) if numerics.fake_quant else x


def index_keys(p: dict, cfg: ModelConfig, latent: jax.Array, row_ids: jax.Array, ratio: int,
               numerics: Numerics) -> jax.Array:
    k = rms_norm(lin_bf(latent, p["wk"]["weight"], numerics), p["k_norm"]["weight"], cfg.norm_eps, numerics)
    cos, sin = rope_cos_sin(cfg, ratio * jnp.maximum(row_ids, 0), global_table=True)
    return _fp4(apply_rope(k, cos, sin), numerics)


def index_query(p: dict, cfg: ModelConfig, c_q: jax.Array, positions: jax.Array,
                numerics: Numerics) -> jax.Array:
    q = lin8(c_q, p["wq_b"]["weight"], numerics)
    q = q.reshape(*q.shape[:-1], cfg.index_n_heads, cfg.index_head_dim)
    cos, sin = rope_cos_sin(cfg, positions, global_table=True)
    return _fp4(apply_rope(q, cos[..., None, :], sin[..., None, :]), numerics)


def index_weights(p: dict, cfg: ModelConfig, h: jax.Array, numerics: Numerics) -> jax.Array:
    w = lin_bf(h, p["weights_proj"]["weight"], numerics)
    scale = cfg.index_head_dim ** -0.5 * cfg.index_n_heads ** -0.5
    return numerics.act(w.astype(jnp.float32) * scale)


def candidate_blocks(scores: jax.Array, visible: jax.Array, topk_blocks: int, block_size: int) -> jax.Array:
    """Level one of the two-level top-k: each block scored by its best visible row."""
    n = scores.shape[-1]
    padded = jnp.pad(scores.astype(jnp.float32), [(0, 0)] * (scores.ndim - 1) + [(0, -n % block_size)],
                     constant_values=-jnp.inf)
    block_score = padded.reshape(*scores.shape[:-1], -1, block_size).max(-1)
    n_blocks = block_score.shape[-1]
    # the newest block is only partly filled: pin it so an older full block cannot outscore it
    newest = (visible[..., None] - 1) // block_size
    block_score = jnp.where(jnp.arange(n_blocks) == newest, jnp.inf, block_score)
    return select_topk(block_score, jnp.int32(n_blocks), topk_blocks, finite_only=True)


def candidate_mask(blocks: jax.Array, n_rows: int, block_size: int) -> jax.Array:
    n_blocks = -(-n_rows // block_size)
    lead = blocks.shape[:-1]
    flat = blocks.reshape(-1, blocks.shape[-1])
    # dropped picks (-1) land in a spare column that is cut off
    kept = jax.vmap(lambda b: jnp.zeros(n_blocks + 1, bool).at[jnp.where(b < 0, n_blocks, b)].set(True))(flat)
    return jnp.repeat(kept[:, :n_blocks], block_size, axis=-1)[:, :n_rows].reshape(*lead, n_rows)
