"""Pallas (Triton lowering) kernels behind the signatures of their jnp references.

Entry points (each takes `backend=`; the process-wide switch is `kernels_pallas.backend`, env
V41_KERNELS = xla | pallas | auto):
  sparse_attn.sparse_attn_paged   sparse latent attention with sink over cache row views
                                  (impl="mgpu": `sparse_attn_mgpu`, an optional NVIDIA Hopper
                                  kernel with rows copied by TMA; not the default, not faster yet)
  indexer.index_scores_paged      lightning-indexer scores from the paged index plane
  indexer.index_scores_tokens     ... of a step's flat token list (one query a block by default)
  indexer.index_topk_paged        ... plus the top-k (full scan, or REINDEX candidate columns)
  select.select_ascending         the indexer's top-k ids in position order without a sort (per
                                  row a bisection over the total-order key bits); the model's
                                  `indexer.select_topk` runs it
  moe.routed_experts              routed SwiGLU experts as a grouped GEMM (or the fastest exact
                                  alternative per step, `moe.choose_impl`; from 2K tokens on
                                  NVIDIA Hopper the Mosaic GPU kernels of `moe_mgpu`, an optional
                                  fast path, V41_MOSAIC_GPU=0 to keep Triton)
  sinkhorn.sinkhorn               the mHC Sinkhorn, one launch per call, rows in registers, every
                                  division in fp64 rounded once to fp32 (correctly rounded, as
                                  the reference; Triton's fp32 `/` is approximate on NVIDIA), or
                                  (exact=False, the fast policy) by an fp32 reciprocal, 3 ulps
  dense_fp8.dense_fp8             the dense FP8 linears at decode row counts, reading the weight
                                  as published (E4M3 codes + E8M0 per 32 x 32 block, decoded in
                                  registers): half the bf16 hold's bytes; `linear.lin8` runs it
  rope.apply_rope                 RoPE of the last lanes of wide rows written in place (the
                                  attention's queries and outputs: 1/8 of the bytes)
  hc_expand.expand_collapse       the mHC expand, the next collapse and both sums of squares in
                                  one pass (the fast RMS's statistics, handed to their consumers)
  rmsnorm.rms_inv                 the RMSNorm statistic rsqrt(mean(x^2) + eps), one launch per
                                  call: torch's sum order over 32-wide chunks in registers, the
                                  division, sqrt and 1 / sqrt correctly rounded as the Sinkhorn's
Measurements: BENCHMARKS.md (Kernels); CPU CI runs them in interpret mode and exports each one
for ROCm (tests/test_kernels_*.py).
"""
