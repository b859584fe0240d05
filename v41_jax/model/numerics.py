"""The numerics policy, as the model's modules import it. It lives in `v41_jax.numerics`, below
both the model and `kernels_pallas` (which use the same policy); this module re-exports it."""

from v41_jax.numerics import HIGHEST, Numerics, cascade_sum, exact_div, ordered_sum, rounded, top_k

__all__ = ["HIGHEST", "Numerics", "cascade_sum", "exact_div", "ordered_sum", "rounded", "top_k"]
