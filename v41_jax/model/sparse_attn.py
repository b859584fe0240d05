"""Sparse single-latent attention with a per-head sink (docs/MODEL.md §3.5),
as the model's modules import it. The core is the jnp reference of the Pallas kernel and lives
with it, below the model: `kernels_pallas.reference.sparse_attn` (the chunked online softmax of
the reference kernel, bit for bit); this module re-exports it.
"""

from kernels_pallas.reference import CHUNK, sparse_attn

__all__ = ["CHUNK", "sparse_attn"]
