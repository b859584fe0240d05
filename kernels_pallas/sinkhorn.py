"""The mHC Sinkhorn normalisation as one Pallas kernel (Triton lowering) per call.

docs/MODEL.md §3.2; jnp reference and XLA path: `kernels_pallas.reference.sinkhorn`.

  sinkhorn(e [..., N, N] fp32, iters, eps, *, backend=None) -> [..., N, N] fp32
      e = exp(logits - row max) (computed by the caller, in XLA). Bit-equal to the reference.

Why a kernel: the XLA path is a `fori_loop` of iters-1 rounds over [T, N, N], each round a few
tiny fusions: ~60 launches a call for microseconds of arithmetic, 12-14 calls a decode step
(BENCHMARKS.md, issue 16). Here one program owns a block of rows and keeps each row's N x N matrix
in registers for all the rounds: N*N vectors of `block_rows` lanes, entry (i, j) of every row's
matrix in one vector (Triton cannot slice a tensor held in registers, so the matrix is never one
tensor and every sum is an explicit chain of adds). Input and output are [T, N*N] in place (the
reshape is free); rows past T are masked.

Exactness: the reference's operations in its order. A row or column sum adds its N entries left to
right in fp32 (as `ordered_sum`), eps is added in fp32 where the reference adds it, and every
division is correctly rounded fp32 (`_ieee.div_rn`: Triton's fp32 `/` is not). No products, so no FMA
contraction can change a rounding.
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
from kernels_pallas._ieee import div_rn

ROW_BLOCK = 32   # rows per program (one warp, a row per lane): 4,096 rows are 128 programs, one wave


def _sum(xs: list) -> jax.Array:
    return functools.reduce(operator.add, xs)      # left to right, as `ordered_sum`


def _columns(c: list[list], eps: float) -> list[list]:
    d = [_sum(list(col)) + eps for col in zip(*c)]
    return [[div_rn(x, d[j]) for j, x in enumerate(row)] for row in c]


def _rows_then_columns(_, c: list[list], eps: float) -> list[list]:
    return _columns([[div_rn(x, _sum(row) + eps) for x in row] for row in c], eps)


def _sinkhorn_kernel(e_ref, o_ref, *, hc: int, iters: int, eps: float, bt: int):
    r = pl.program_id(0) * bt + jax.lax.broadcasted_iota(jnp.int32, (bt,), 0)
    live = r < e_ref.shape[0]
    c = [[load(e_ref.at[r, i * hc + j], mask=live, other=1.0) for j in range(hc)] for i in range(hc)]
    c = _columns([[div_rn(x, _sum(row)) + eps for x in row] for row in c], eps)
    c = jax.lax.fori_loop(0, iters - 1, functools.partial(_rows_then_columns, eps=eps), c)
    for i in range(hc):
        for j in range(hc):
            store(o_ref.at[r, i * hc + j], c[i][j], mask=live)


@functools.partial(jax.jit, static_argnames=("iters", "eps", "block_rows", "num_warps", "interpret"))
def _sinkhorn_pallas(e2, *, iters, eps, block_rows, num_warps, interpret):
    t, n = e2.shape
    whole = pl.BlockSpec((t, n), lambda i: (0, 0))      # rows addressed (and masked) in the kernel
    kernel = functools.partial(_sinkhorn_kernel, hc=math.isqrt(n), iters=iters, eps=eps, bt=block_rows)
    return pl.pallas_call(
        kernel, grid=(pl.cdiv(t, block_rows),), in_specs=[whole], out_specs=whole,
        out_shape=jax.ShapeDtypeStruct((t, n), jnp.float32),
        compiler_params=compiler_params(num_warps, 1), interpret=interpret, name="mhc_sinkhorn",
    )(e2)


def sinkhorn(e: jax.Array, iters: int, eps: float, *, backend: str | None = None,
             block_rows: int | None = None, num_warps: int = 1) -> jax.Array:
    """The Sinkhorn of `kernels_pallas.reference.sinkhorn` on e [..., N, N] fp32."""
    if _backend.resolve(backend, kernel="sinkhorn") == "xla":
        return ref.sinkhorn(e, iters, eps)
    hc = e.shape[-1]
    e2 = e.reshape(-1, hc * hc)
    bt = block_rows or min(ROW_BLOCK, 1 << (e2.shape[0] - 1).bit_length())
    out = _sinkhorn_pallas(e2, iters=iters, eps=eps, block_rows=bt, num_warps=num_warps,
                           interpret=_backend.interpret())
    return out.reshape(e.shape)
