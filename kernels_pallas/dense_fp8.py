"""Dense FP8 linears at decode row counts, reading the weight as published: one Pallas kernel
(Triton lowering) per call.

  dense_fp8(x [M, K], w `quant.Fp8BlockWeight` [N, K], *, groups=1, backend=None) -> fp32 [M, N]
      x @ decode(w)^T accumulated in fp32. XLA path: the decode (`w.dequant`) and one `jnp.dot`.
      groups = G: block-diagonal, x [M, G K'] and w [G R, K'] (K = G K'): group g's R rows of w
      against x's g-th K' columns (attention's grouped `wo_a`); XLA path: one einsum.
  takes(rows, w, groups=1, backend=None) -> bool: whether `dense_fp8` runs the kernel for `rows`
      rows (`linear.lin8` / `lin_grouped` send the rest, prefill's GEMMs, to XLA's decode and dot).

Why a kernel: the dense FP8 weights (query, kv, output, shared expert, indexer query, Engram and
draft projections) held as bf16 are two bytes a weight, and a decode step is a stream over them.
Held as published (E4M3 codes + one E8M0 per 32 x 32 block, 1 byte a weight) XLA does not read
them so: it writes the decoded weight out before its GEMM from 8 rows on and was slower at every
row count (H100, BENCHMARKS.md, "dense FP8 weights held as published"). Here the decode is in
registers: a program owns 32 output rows (one row of block scales) and one of S equal ranges of
K, streams [32, BK] code tiles, scales each 32-lane group by its power of two (exact) and
multiplies by the rows of x; the S fp32 partials are added afterwards (one XLA reduction). S is
chosen so that about TARGET_PROGRAMS programs are in flight (a 1,280 x 5,120 weight has only 40 row
blocks) while the partials, written and read again, stay under a quarter of the weight's bytes.

  M = 1: elementwise fp32 products summed per row (an MMA would waste 15 of its 16 rows);
  M > 1: the rows padded to a power of two >= 16 and one MMA per tile in x's dtype (the decoded
         weight is exact in bf16; fp32 x keeps an fp32 MMA at HIGHEST precision, no TF32).

Exactness: each product is the one XLA's dot forms (bf16 x times a 4-bit significand times a power
of two is exact in fp32); only the fp32 summation order differs, as between any two GEMM routes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernels_pallas import backend as _backend
from kernels_pallas._codecs import per_lane, e4m3_as, e8m0_as_f32
from kernels_pallas._compat import compiler_params
from v41_jax.numerics import HIGHEST
from v41_jax.quant import FP8_WEIGHT_BLOCK, Fp8BlockWeight

BN = FP8_WEIGHT_BLOCK       # output rows a program: one row of block scales
K_STEPS = (256, 128, 64, 32)  # the K step: the largest of these that divides K
MAX_ROWS = 64               # decode row counts; from here on the GEMM is not a weight stream
MMA_ROWS = 16               # the MMA's smallest M
TARGET_PROGRAMS = 512       # ~4 a streaming multiprocessor on an H100 / H200 (132)
WARPS, STAGES = 4, 3


def _splits(n: int, k: int, bk: int, rows: int) -> int:
    """The largest divisor S of the K steps with (n / BN) x S <= TARGET_PROGRAMS and partials
    that cost at most a quarter of the weight's bytes: S fp32 [rows, n] written and read again,
    8 S rows n <= n k / 4, so S <= k / (32 rows). At least 1."""
    steps = k // bk
    want = max(1, min(TARGET_PROGRAMS // (n // BN), k // (32 * rows)))
    return max(s for s in range(1, steps + 1) if steps % s == 0 and s <= want)


def _kernel(x_ref, codes_ref, scale_ref, o_ref, *, bk: int, steps: int, group_rows: int):
    j, s = pl.program_id(0), pl.program_id(1)
    m, k = x_ref.shape[0], codes_ref.shape[1]
    rows = pl.ds(pl.multiple_of(j * BN, BN), BN)
    x0 = (j * BN // group_rows) * k                 # where this row block's group starts in x

    def body(i, acc):
        k0 = pl.multiple_of((s * steps + i) * bk, bk)
        scale = e8m0_as_f32(scale_ref[pl.ds(j, 1), pl.ds(pl.multiple_of(k0 // BN, bk // BN), bk // BN)])
        w = e4m3_as(codes_ref[rows, pl.ds(k0, bk)], jnp.float32) * per_lane(scale, BN)   # [BN, BK], exact
        x = x_ref[:, pl.ds(pl.multiple_of(x0 + k0, bk), bk)]                              # [M, BK]
        if m == 1:
            return acc + jnp.sum(w * x.astype(jnp.float32), axis=1)[None, :]
        return acc + jax.lax.dot_general(x, w.astype(x.dtype), (((1,), (1,)), ((), ())), precision=HIGHEST,
                                         preferred_element_type=jnp.float32)

    acc = jax.lax.fori_loop(0, steps, body, jnp.zeros((m, BN), jnp.float32))
    o_ref[pl.ds(pl.multiple_of(s * m, m), m), rows] = acc


@functools.partial(jax.jit, static_argnames=("groups", "interpret"))
def _dense_fp8_pallas(x, codes, block_scale, *, groups: int = 1, interpret: bool):
    m = x.shape[0]
    n, k = codes.shape
    bk = next(b for b in K_STEPS if k % b == 0)
    rows = m if m == 1 else max(MMA_ROWS, 1 << (m - 1).bit_length())   # Triton tiles: powers of two
    splits = _splits(n, k, bk, rows)
    xp = jnp.pad(x, ((0, rows - m), (0, 0)))
    whole = lambda a: pl.BlockSpec(a.shape, lambda i, s: (0,) * a.ndim)   # addressed in the kernel
    out = pl.pallas_call(
        functools.partial(_kernel, bk=bk, steps=k // bk // splits, group_rows=n // groups),
        grid=(n // BN, splits),
        in_specs=[whole(xp), whole(codes), whole(block_scale)],
        out_specs=pl.BlockSpec((splits * rows, n), lambda i, s: (0, 0)),
        out_shape=jax.ShapeDtypeStruct((splits * rows, n), jnp.float32),
        compiler_params=compiler_params(WARPS, STAGES), interpret=interpret, name="dense_fp8",
    )(xp, codes, block_scale)
    return out.reshape(splits, rows, n).sum(axis=0)[:m]        # the ranges' partials (XLA's order)


def _dense_fp8_xla(x, w: Fp8BlockWeight, groups: int):
    wd = w.dequant(x.dtype)
    if groups == 1:
        return jnp.dot(x, wd.T, precision=HIGHEST, preferred_element_type=jnp.float32)
    xg = x.reshape(*x.shape[:-1], groups, -1)
    out = jnp.einsum("...gd,grd->...gr", xg, wd.reshape(groups, -1, xg.shape[-1]), precision=HIGHEST,
                     preferred_element_type=jnp.float32)
    return out.reshape(*x.shape[:-1], -1)


def takes(rows: int, w: Fp8BlockWeight, groups: int = 1, backend: str | None = None) -> bool:
    """Whether `dense_fp8` runs the kernel: the Pallas backend, a single [N, K] weight of whole
    blocks (each group's rows whole blocks too), at most MAX_ROWS rows."""
    n, k = w.codes.shape[-2:]
    return (_backend.resolve(backend, kernel="dense_fp8") == "pallas" and w.codes.ndim == 2
            and rows <= MAX_ROWS and n % (groups * BN) == 0 and k % K_STEPS[-1] == 0)


def dense_fp8(x: jax.Array, w: Fp8BlockWeight, *, groups: int = 1, backend: str | None = None) -> jax.Array:
    """x [..., G K'] @ w^T -> fp32 [..., N]; block-diagonal over `groups` (module docstring)."""
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    if not takes(x2.shape[0], w, groups, backend):
        return _dense_fp8_xla(x, w, groups)
    out = _dense_fp8_pallas(x2, w.codes, w.block_scale, groups=groups, interpret=_backend.interpret())
    return out.reshape(*lead, out.shape[-1])
