"""The linear layers, as the model's modules import them. They live in `v41_jax.linear`, below
both the model and `kernels_pallas` (the routed-expert reference loop runs `lin4`); this module
re-exports them."""

from v41_jax.linear import K_BLOCK, gemm_out_dtype, k_block_dot, lin4, lin8, lin_bf, lin_f32, lin_grouped

__all__ = ["K_BLOCK", "gemm_out_dtype", "k_block_dot", "lin4", "lin8", "lin_bf", "lin_f32", "lin_grouped"]
