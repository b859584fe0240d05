"""The mHC Sinkhorn normalisation as one Pallas kernel (Triton lowering) per call.

docs/MODEL.md §3.2; jnp reference and XLA path: `kernels_pallas.reference.sinkhorn`.

  sinkhorn(e [..., N, N] fp32, iters, eps, *, exact=True, backend=None) -> [..., N, N] fp32
      e = exp(logits - row max) (computed by the caller, in XLA). Bit-equal to the reference;
      exact=False (`Numerics.fast`): each division within 3 fp32 ulps (`_ieee.div_near_by`: an
      fp32 reciprocal, no fp64), the sums and eps as before.

Why a kernel: the XLA path is a `fori_loop` of iters-1 rounds over [T, N, N], each round a few
tiny fusions: ~60 launches a call for microseconds of arithmetic, 12-14 calls a decode step
(BENCHMARKS.md, issue 16). Here one program owns a block of rows and keeps each row's N x N matrix
in registers for all the rounds: N*N vectors of `block_rows` lanes, entry (i, j) of every row's
matrix in one vector (Triton cannot slice a tensor held in registers, so the matrix is never one
tensor and every sum is an explicit chain of adds). Input and output are [T, N*N] in place (the
reshape is free); rows past T are masked.

Exactness: the reference's operations in its order. A row or column sum adds its N entries left to
right in fp32 (as `ordered_sum`), eps is added in fp32 where the reference adds it, and every
division is correctly rounded fp32 (Triton's fp32 `/` is not). No products outside the divisions,
so no FMA contraction can change a rounding (the fast policy's division rounds its own products,
`_ieee.div_near_by`: kernel and XLA path agree bit for bit while its quotients are normal, which
the released eps and 20 rounds keep them, `_fast_divisions_exact`; XLA:CPU flushes subnormals). The first division (e by its row sums) is `_ieee.div_rn`: its quotients may
be subnormal. Every later one divides the N entries sharing a sum by one reciprocal
(`_ieee.div_rn_by`, no division instruction: on CUDA a chain of `div.rn.f32` made the kernel 5x
slower at one row, BENCHMARKS.md 2026-12-03), which is exact for normal quotients. Their range,
for e >= 0 (exp of something, or NaN): after the first step every entry is in [eps, 1 + eps], and
a normalisation divides by a sum plus eps of at most S = N (1 + eps) + eps and leaves every entry
<= 1, so after k of them every entry is >= eps / S^k; `_fast_divisions_exact` checks the 2 iters
- 1 divisions that follow against the smallest normal fp32 (N = 4, eps = 1e-6, 20 iterations:
2^-98), and the kernel keeps `div_rn` everywhere when it fails (eps = 0, many iterations).
"""

from __future__ import annotations

import functools
import math
import operator

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernels_pallas import backend as _backend
from kernels_pallas import reference as ref
from kernels_pallas._compat import compiler_params, load, store
from kernels_pallas._ieee import div_near_by, div_rn, div_rn_by

ROW_BLOCK = 32   # rows per program (one warp, a row per lane): 4,096 rows are 128 programs, one wave


def _sum(xs: list) -> jax.Array:
    return functools.reduce(operator.add, xs)      # left to right, as `ordered_sum`


def _fast_divisions_exact(hc: int, iters: int, eps: float) -> bool:
    """Whether every division after the first has a normal fp32 quotient (module docstring)."""
    smallest_normal = float(jnp.finfo(jnp.float32).tiny)
    return eps > 0 and math.log2(eps) - (2 * iters - 1) * math.log2(hc * (1 + eps) + eps) > math.log2(smallest_normal)


def _each_rn(xs: list, b: jax.Array) -> list:
    return [div_rn(x, b) for x in xs]


def _divider(hc: int, iters: int, eps: float, exact: bool):
    """divide(xs, b) -> [x / b ...] for the divisions after the first: correctly rounded (by one
    reciprocal where the quotients are provably normal), or within 3 ulps (`exact` off)."""
    if not exact:
        return div_near_by
    return div_rn_by if _fast_divisions_exact(hc, iters, eps) else _each_rn


def _columns(c: list[list], eps: float, divide) -> list[list]:
    cols = [divide(list(col), _sum(list(col)) + eps) for col in zip(*c)]
    return [list(row) for row in zip(*cols)]


def _rows_then_columns(_, c: list[list], eps: float, divide) -> list[list]:
    return _columns([divide(row, _sum(row) + eps) for row in c], eps, divide)


def _sinkhorn_kernel(e_ref, o_ref, *, hc: int, iters: int, eps: float, bt: int, exact: bool):
    r = pl.program_id(0) * bt + jax.lax.broadcasted_iota(jnp.int32, (bt,), 0)
    live = r < e_ref.shape[0]
    divide = _divider(hc, iters, eps, exact)
    c = [[load(e_ref.at[r, i * hc + j], mask=live, other=1.0) for j in range(hc)] for i in range(hc)]
    # the first division's quotients may be subnormal: each one correctly rounded when exact
    first = _each_rn if exact else div_near_by        # a row sum is >= 1 (its max term is exp(0))
    c = _columns([[x + eps for x in first(row, _sum(row))] for row in c], eps, divide)
    c = jax.lax.fori_loop(0, iters - 1, functools.partial(_rows_then_columns, eps=eps, divide=divide), c)
    for i in range(hc):
        for j in range(hc):
            store(o_ref.at[r, i * hc + j], c[i][j], mask=live)


@functools.partial(jax.jit, static_argnames=("iters", "eps", "block_rows", "num_warps", "interpret", "exact"))
def _sinkhorn_pallas(e2, *, iters, eps, block_rows, num_warps, interpret, exact=True):
    t, n = e2.shape
    whole = pl.BlockSpec((t, n), lambda i: (0, 0))      # rows addressed (and masked) in the kernel
    kernel = functools.partial(_sinkhorn_kernel, hc=math.isqrt(n), iters=iters, eps=eps, bt=block_rows,
                               exact=exact)
    return pl.pallas_call(
        kernel, grid=(pl.cdiv(t, block_rows),), in_specs=[whole], out_specs=whole,
        out_shape=jax.ShapeDtypeStruct((t, n), jnp.float32),
        compiler_params=compiler_params(num_warps, 1), interpret=interpret, name="mhc_sinkhorn",
    )(e2)


def sinkhorn(e: jax.Array, iters: int, eps: float, *, exact: bool = True, backend: str | None = None,
             block_rows: int | None = None, num_warps: int = 1) -> jax.Array:
    """The Sinkhorn of `kernels_pallas.reference.sinkhorn` on e [..., N, N] fp32; exact off: its
    divisions each within 3 fp32 ulps (`Numerics.exact_sinkhorn`)."""
    if _backend.resolve(backend, kernel="sinkhorn") == "xla":
        return ref.sinkhorn(e, iters, eps, exact)
    hc = e.shape[-1]
    e2 = e.reshape(-1, hc * hc)
    bt = block_rows or min(ROW_BLOCK, 1 << (e2.shape[0] - 1).bit_length())
    out = _sinkhorn_pallas(e2, iters=iters, eps=eps, block_rows=bt, num_warps=num_warps,
                           interpret=_backend.interpret(), exact=exact)
    return out.reshape(e.shape)
