"""The mHC expand, the next collapse and both RMS statistics in one pass: one Pallas kernel (Triton
lowering) per call.

docs/MODEL.md §3.2; jnp reference and XLA path: `kernels_pallas.reference.expand_collapse`.

  expand_collapse(f [R, D], x [R, N, D], post [R, N], comb [R, N, N], pre [R, N], *, backend=None)
      -> (x' [R, N, D], c [R, D], sumsq(x') [R] fp32 | None, sumsq(c) [R] fp32 | None)
      x' = expand(f, x, post, comb) and c = collapse(x', pre) in f's dtype, bit-equal to the
      reference; the sums of squares of those rounded values in fp32, in this kernel's order. The
      XLA path returns no sums (None): XLA fuses each with its consumer on its own.
  sums_computed(backend=None) -> bool   whether `expand_collapse` returns the sums.

Why a kernel: each sublayer's output is expanded into the streams, and the next sublayer then
reads the new streams twice more, for its mixes' RMS statistic and for its collapse and RMSNorm
(its pre is already known: the single pass). XLA fuses the expand with the statistic but runs that
fusion at ~62 % of HBM bandwidth on the H100 (0.22 ms a call at a 4,096-token prefill against
~0.14 ms of bytes), and the collapse + norm fusion reads the streams again (BENCHMARKS.md,
2026-12-05 j, k). Here one program owns a block of rows and of columns of all N streams: it reads
x and f once, writes x' and c, and hands the row statistics on as per-column-block partial sums (a
few values a row, added by the consumer's fusion). The mixes' GEMM still reads x' (cuBLAS, at
bandwidth). The model calls it for both expands of every block (`mhc.expand_collapse`).

Exactness: x' and c are the reference's operations (`reference.expand_streams`,
`collapse_streams`: products rounded on their own, `numerics.rounded`, since Triton contracts a
product into the add after it as an FMA); the statistics are fp32 sums in another order than
XLA's, which only the fast policy's RMS (`Numerics.exact_rms` off) accepts.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernels_pallas import backend as _backend
from kernels_pallas import reference as ref
from kernels_pallas._compat import compiler_params, load, store

# rows x columns of every stream a program. H100, [T, 4, 5,120] bf16: 8 x 128 at 4 warps 0.189 /
# 0.360 ms at 4K / 8K rows (2.2-2.3 TB/s of reads and writes), 8 x 256 0.199 / 0.378, 16 x 256 at
# 8 warps 0.200 / 0.383, 4 x 512 0.194 / 0.363; XLA's fusion of the same 0.411 / 0.823
# (`scripts/bench_kernels.py --sections hc-expand`, BENCHMARKS.md 2026-12-05 k)
ROW_BLOCK, COL_BLOCK, WARPS = 8, 128, 4


def _kernel(f_ref, x_ref, post_ref, comb_ref, pre_ref, y_ref, c_ref, ss_ref, css_ref, *, n: int, bt: int,
            bd: int, col_blocks: int):
    rows, d = f_ref.shape
    r = pl.program_id(0) * bt + jax.lax.broadcasted_iota(jnp.int32, (bt, 1), 0)
    col = pl.program_id(1) * bd + jax.lax.broadcasted_iota(jnp.int32, (1, bd), 1)
    live = r < rows                                                              # [bt, 1]
    m = live & (col < d)                                                         # [bt, bd]
    f32 = lambda v: v.astype(jnp.float32)
    coef = lambda a_ref, k: load(a_ref.at[r, k], mask=live, other=0)             # [bt, 1] fp32
    f = f32(load(f_ref.at[r, col], mask=m, other=0))
    xs = [f32(load(x_ref.at[r, i * d + col], mask=m, other=0)) for i in range(n)]
    comb = [[coef(comb_ref, i * n + j) for j in range(n)] for i in range(n)]
    ys = [y.astype(y_ref.dtype) for y in ref.expand_streams(f, xs, [coef(post_ref, j) for j in range(n)], comb)]
    for j, y in enumerate(ys):
        store(y_ref.at[r, j * d + col], y, mask=m)
    y32 = [f32(y) for y in ys]
    c = ref.collapse_streams(y32, [coef(pre_ref, j) for j in range(n)]).astype(c_ref.dtype)
    store(c_ref.at[r, col], c, mask=m)
    # masked lanes hold +0 (masked loads): they add nothing to the sums
    at = r[:, 0] * col_blocks + pl.program_id(1)
    store(ss_ref.at[at], sum(jnp.sum(v * v, axis=1) for v in y32), mask=live[:, 0])
    store(css_ref.at[at], jnp.sum(f32(c) * f32(c), axis=1), mask=live[:, 0])


@functools.partial(jax.jit, static_argnames=("bt", "bd", "warps", "interpret"))
def _expand_collapse_pallas(f, x2, post, comb2, pre, *, bt, bd, warps, interpret):
    rows, d = f.shape
    n = post.shape[1]
    col_blocks = pl.cdiv(d, bd)
    kernel = functools.partial(_kernel, n=n, bt=bt, bd=bd, col_blocks=col_blocks)
    whole = lambda shape: pl.BlockSpec(shape, lambda i, k: (0,) * len(shape))   # addressed in the kernel
    args = (f, x2, post, comb2, pre)
    sums = jax.ShapeDtypeStruct((rows * col_blocks,), jnp.float32)
    outs = (jax.ShapeDtypeStruct(x2.shape, f.dtype), jax.ShapeDtypeStruct(f.shape, f.dtype), sums, sums)
    y, c, ss, css = pl.pallas_call(
        kernel, grid=(pl.cdiv(rows, bt), col_blocks),
        in_specs=[whole(a.shape) for a in args], out_specs=[whole(o.shape) for o in outs], out_shape=outs,
        compiler_params=compiler_params(warps, 1), interpret=interpret, name="hc_expand",
    )(*args)
    # the per-column-block partials: a [R, blocks] sum that fuses into the statistic's consumer
    return y, c, ss.reshape(rows, col_blocks).sum(-1), css.reshape(rows, col_blocks).sum(-1)


def sums_computed(backend: str | None = None) -> bool:
    return _backend.resolve(backend, kernel="hc_expand") == "pallas"


def expand_collapse(f: jax.Array, x: jax.Array, post: jax.Array, comb: jax.Array, pre: jax.Array, *,
                    backend: str | None = None, block_rows: int = ROW_BLOCK, block_cols: int = COL_BLOCK,
                    warps: int = WARPS):
    """`kernels_pallas.reference.expand_collapse` and the sums (module docstring); block_cols a
    power of two (columns past D are masked)."""
    if not sums_computed(backend):
        return (*ref.expand_collapse(f, x, post, comb, pre), None, None)
    rows, n, d = x.shape
    f32 = lambda a: a.astype(jnp.float32)
    y, c, ss, css = _expand_collapse_pallas(f, x.reshape(rows, n * d), f32(post), f32(comb).reshape(rows, n * n),
                                            f32(pre), bt=block_rows, bd=min(block_cols, 1 << (d - 1).bit_length()),
                                            warps=warps, interpret=_backend.interpret())
    return y.reshape(rows, n, d), c, ss, css
