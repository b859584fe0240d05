"""The indexer's selection without a sort: the k best columns of each row, re-sorted by position,
as one Pallas program (Triton lowering) per row.

XLA path: `kernels_pallas.reference.select_topk` (top_k, then a sort of the picks by position).

  select_ascending(scores [R, n] fp32, visible [R] int32, k) -> ids [R, min(k, n)] int32
      = reference.select_topk: the k best columns (IEEE total order after -0.0 -> +0.0, ties to
      the lower column: `numerics.top_k`), those below `visible` ascending, -1 after.

Why: at long context the selection is XLA sorts of every candidate column in several passes per
row (32K decode on the H200: 0.67 ms of sorts a step at b=64, BENCHMARKS.md 2026-12-04 c). Here a
program holds its row in registers and (1) finds the k-th largest key by bisection over the 32
bits of the total-order key (32 counts over the row), (2) takes every column above it and the
first (k - those) columns equal to it (an exclusive running count of the equal ones), (3) keeps
those below `visible` and stores each at its rank among the kept (an exclusive running count
again), then -1 in the slots past them. No comparison of two columns is needed, so the picks are
the reference's set exactly; the output order is by position, as the reference's re-sort.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernels_pallas import backend as _backend
from kernels_pallas import reference as ref
from kernels_pallas._compat import compiler_params, load, store
from v41_jax.numerics import total_order

MAX_COLUMNS = 32768   # a row in one program's registers (16 warps past 16,384: 64 fp32 a thread)
_SIGN = -(1 << 31)     # int32 with the sign bit alone


def _unsigned_order(x: jax.Array) -> jax.Array:
    """fp32 -> int32 whose bits, read unsigned, are in IEEE total order (`numerics.total_order`
    with its sign bit flipped), so the bisection can set the key's bits from the top."""
    return total_order(x) ^ jnp.int32(_SIGN)


def _at_least(u: jax.Array, t: jax.Array) -> jax.Array:
    """u >= t, both int32 read as unsigned (flip the sign bits and compare signed)."""
    return (u ^ jnp.int32(_SIGN)) >= (t ^ jnp.int32(_SIGN))


def _kernel(s_ref, vis_ref, o_ref, *, n: int, width: int, k: int, k_width: int, scratch: bool):
    r = pl.program_id(0)
    cols = jax.lax.broadcasted_iota(jnp.int32, (width,), 0)
    real = cols < n
    x = load(s_ref.at[r, cols], mask=real, other=0.0)
    u = jnp.where(real, _unsigned_order(jnp.where(x == 0, 0.0, x)), 0)   # pads: the lowest key, last

    def bit(b, t):          # the largest t (unsigned) with at least k keys >= t, one bit at a time
        cand = t | jax.lax.shift_left(jnp.int32(1), 31 - b)
        return jnp.where(jnp.sum(_at_least(u, cand).astype(jnp.int32)) >= k, cand, t)

    t = jax.lax.fori_loop(0, 32, bit, jnp.int32(0))
    above = _at_least(u, t) & (u != t)
    equal = u == t
    first_equal = jnp.cumsum(equal.astype(jnp.int32)) - equal.astype(jnp.int32)
    picked = above | (equal & (first_equal < k - jnp.sum(above.astype(jnp.int32))))
    kept = picked & (cols < vis_ref[r])
    rank = jnp.cumsum(kept.astype(jnp.int32)) - kept.astype(jnp.int32)
    # masked lanes store nothing on a GPU; interpret mode's masked scatter is a read-modify-write
    # of every addressed element, so there each lane not kept addresses a scratch column of its
    # own past the k_width slots and never a kept slot
    store(o_ref.at[r, jnp.where(kept, rank, k_width + cols if scratch else 0)], cols, mask=kept)
    slots = jax.lax.broadcasted_iota(jnp.int32, (k_width,), 0)
    store(o_ref.at[r, slots], jnp.full((k_width,), -1, jnp.int32),
          mask=(slots >= jnp.sum(kept.astype(jnp.int32))) & (slots < k))


@functools.partial(jax.jit, static_argnames=("k", "num_warps", "interpret"))
def _select_pallas(scores, visible, *, k: int, num_warps: int, interpret: bool):
    rows, n = scores.shape
    width, k_width = pl.next_power_of_2(n), pl.next_power_of_2(k)
    out = (rows, k_width + width if interpret else k_width)        # scratch columns: see _kernel
    full = lambda shape: pl.BlockSpec(shape, lambda *_: (0,) * len(shape))
    return pl.pallas_call(
        functools.partial(_kernel, n=n, width=width, k=k, k_width=k_width, scratch=interpret),
        grid=(rows,), in_specs=[full(scores.shape), full(visible.shape)],
        out_specs=full(out), out_shape=jax.ShapeDtypeStruct(out, jnp.int32),
        compiler_params=compiler_params(num_warps, 1), interpret=interpret, name="select_ascending",
    )(scores, visible)[:, :k]


def select_ascending(scores: jax.Array, visible: jax.Array, k: int, *, backend: str | None = None,
                     num_warps: int | None = None) -> jax.Array:
    """`reference.select_topk(scores, visible, k)` for scores [..., n], visible [...].

    num_warps: 8 up to 16,384 columns, 16 past them (H200, bench_kernels --sections indexer: 32 x
    8,192 0.025 / 0.019 / 0.019 ms at 4 / 8 / 16 warps; 32 x 32,768 1.22 / 0.075 / 0.058 ms, 4
    warps spilling their 256 values a thread)."""
    n = scores.shape[-1]
    k = min(k, n)
    if _backend.resolve(backend, kernel="select") == "xla" or n > MAX_COLUMNS:
        return ref.select_topk(scores, visible, k)
    lead = scores.shape[:-1]
    ids = _select_pallas(scores.astype(jnp.float32).reshape(-1, n),
                         jnp.broadcast_to(visible, lead).reshape(-1).astype(jnp.int32), k=k,
                         num_warps=num_warps or (8 if n <= 16384 else 16), interpret=_backend.interpret())
    return ids.reshape(*lead, k)
