"""The indexer's selection without a sort: the k best columns of each row, re-sorted by position,
as one Pallas program (Triton lowering) per row, or, with few rows or rows past one program's
MAX_COLUMNS, in two stages (the k best of each chunk of a row, then the k best of those:
`two_stage_chunk`).

XLA path: `kernels_pallas.reference.select_topk` (top_k, then a sort of the picks by position).

  select_ascending(scores [R, n] fp32, visible [R] int32, k, chunk=None, finite_only=False)
      -> ids [R, min(k, n)] int32
      = reference.select_topk: the k best columns (IEEE total order after -0.0 -> +0.0, ties to
      the lower column: `numerics.top_k`), those below `visible` (and, finite_only, scoring above
      -inf) ascending, -1 after; chunk: the first stage's columns (`two_stage_chunk`).

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
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernels_pallas import backend as _backend
from kernels_pallas import reference as ref
from kernels_pallas._compat import compiler_params, load, store
from v41_jax.numerics import total_order

MAX_COLUMNS = 32768   # a row in one program's registers (16 warps past 16,384: 64 fp32 a thread)
CHUNK = 4096          # first-stage columns a program (`two_stage_chunk`)
TWO_STAGE_PROGRAMS = 512   # first-stage programs at most (64 rows x 8 chunks, the widest measured)
MIN_CHUNKS = 4        # fewer: one stage (8,192 columns, 1-64 rows: 0.015-0.017 ms one stage, 0.017-0.019 two)
_SIGN = -(1 << 31)     # int32 with the sign bit alone


def _unsigned_order(x: jax.Array) -> jax.Array:
    """fp32 -> int32 whose bits, read unsigned, are in IEEE total order (`numerics.total_order`
    with its sign bit flipped), so the bisection can set the key's bits from the top."""
    return total_order(x) ^ jnp.int32(_SIGN)


def _at_least(u: jax.Array, t: jax.Array) -> jax.Array:
    """u >= t, both int32 read as unsigned (flip the sign bits and compare signed)."""
    return (u ^ jnp.int32(_SIGN)) >= (t ^ jnp.int32(_SIGN))


def _keys(x: jax.Array, real: jax.Array) -> jax.Array:
    """Scores -> unsigned-order keys, -0.0 as +0.0; pads (not `real`) the lowest key."""
    return jnp.where(real, _unsigned_order(jnp.where(x == 0, 0.0, x)), 0)


def _best(u: jax.Array, k: int) -> jax.Array:
    """Keys [width] -> bool: the k largest, ties to the lower column (steps (1) and (2) above)."""
    def bit(b, t):          # the largest t (unsigned) with at least k keys >= t, one bit at a time
        cand = t | jax.lax.shift_left(jnp.int32(1), 31 - b)
        return jnp.where(jnp.sum(_at_least(u, cand).astype(jnp.int32)) >= k, cand, t)

    t = jax.lax.fori_loop(0, 32, bit, jnp.int32(0))
    above = _at_least(u, t) & (u != t)
    equal = u == t
    first_equal = jnp.cumsum(equal.astype(jnp.int32)) - equal.astype(jnp.int32)
    return above | (equal & (first_equal < k - jnp.sum(above.astype(jnp.int32))))


def _before(mask: jax.Array) -> jax.Array:
    """Exclusive running count: each true lane's rank among the true lanes."""
    return jnp.cumsum(mask.astype(jnp.int32)) - mask.astype(jnp.int32)


def _kernel(s_ref, vis_ref, *refs, n: int, width: int, k: int, k_width: int, scratch: bool,
            with_ids: bool, finite_only: bool):
    """One row. with_ids: the row holds candidates whose column ids (ascending) are in the extra
    input, and the visibility test and the output are in those ids (the second stage).
    finite_only: picks scoring -inf or NaN are not kept either."""
    id_ref, o_ref = refs if with_ids else (None, refs[0])
    r = pl.program_id(0)
    cols = jax.lax.broadcasted_iota(jnp.int32, (width,), 0)
    real = cols < n
    x = load(s_ref.at[r, cols], mask=real, other=0.0)
    ids = load(id_ref.at[r, cols], mask=real, other=0) if with_ids else cols
    kept = _best(_keys(x, real), k) & (ids < vis_ref[r])
    if finite_only:
        kept = kept & (x > -jnp.inf)
    # masked lanes store nothing on a GPU; interpret mode's masked scatter is a read-modify-write
    # of every addressed element, so there each lane not kept addresses a scratch column of its
    # own past the k_width slots and never a kept slot
    store(o_ref.at[r, jnp.where(kept, _before(kept), k_width + cols if scratch else 0)], ids, mask=kept)
    slots = jax.lax.broadcasted_iota(jnp.int32, (k_width,), 0)
    store(o_ref.at[r, slots], jnp.full((k_width,), -1, jnp.int32),
          mask=(slots >= jnp.sum(kept.astype(jnp.int32))) & (slots < k))


def _chunk_kernel(s_ref, id_ref, v_ref, *, chunk: int, k: int, chunks: int, scratch: bool):
    """First stage: the k best of one row's chunk, their column ids and scores in column order
    at [c*k, (c+1)*k) of the row's candidates."""
    r, c = pl.program_id(0), pl.program_id(1)
    cols = c * chunk + jax.lax.broadcasted_iota(jnp.int32, (chunk,), 0)
    x = load(s_ref.at[r, cols])
    picked = _best(_keys(x, True), k)
    slot = jnp.where(picked, c * k + _before(picked), chunks * k + cols if scratch else 0)
    store(id_ref.at[r, slot], cols, mask=picked)
    store(v_ref.at[r, slot], x, mask=picked)


def _full(shape):
    return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))


@functools.partial(jax.jit, static_argnames=("k", "num_warps", "interpret", "finite_only"))
def _select_pallas(scores, visible, ids=None, *, k: int, num_warps: int, interpret: bool,
                   finite_only: bool = False):
    rows, n = scores.shape
    width, k_width = pl.next_power_of_2(n), pl.next_power_of_2(k)
    out = (rows, k_width + width if interpret else k_width)        # scratch columns: see _kernel
    ins = (scores, visible) if ids is None else (scores, visible, ids)
    return pl.pallas_call(
        functools.partial(_kernel, n=n, width=width, k=k, k_width=k_width, scratch=interpret,
                          with_ids=ids is not None, finite_only=finite_only),
        grid=(rows,), in_specs=[_full(a.shape) for a in ins],
        out_specs=_full(out), out_shape=jax.ShapeDtypeStruct(out, jnp.int32),
        compiler_params=compiler_params(num_warps, 1), interpret=interpret, name="select_ascending",
    )(*ins)[:, :k]


@functools.partial(jax.jit, static_argnames=("k", "chunk", "num_warps", "interpret"))
def _chunks_pallas(scores, *, k: int, chunk: int, num_warps: int, interpret: bool):
    rows, n = scores.shape
    chunks = n // chunk
    width = chunks * k + (n if interpret else 0)                    # scratch columns: see _kernel
    ids, vals = pl.pallas_call(
        functools.partial(_chunk_kernel, chunk=chunk, k=k, chunks=chunks, scratch=interpret),
        grid=(rows, chunks), in_specs=[_full(scores.shape)],
        out_specs=[_full((rows, width))] * 2,
        out_shape=[jax.ShapeDtypeStruct((rows, width), jnp.int32),
                   jax.ShapeDtypeStruct((rows, width), jnp.float32)],
        compiler_params=compiler_params(num_warps, 1), interpret=interpret, name="select_chunks",
    )(scores)
    return ids[:, :chunks * k], vals[:, :chunks * k]


def _warps(width: int) -> int:
    """8 up to 16,384 columns a program, 16 past them (H200, bench_kernels --sections indexer: 32 x
    8,192 0.025 / 0.019 / 0.019 ms at 4 / 8 / 16 warps; 32 x 32,768 1.22 / 0.075 / 0.058 ms, 4
    warps spilling their 256 values a thread)."""
    return 8 if width <= 16384 else 16


def chunk_fits(n: int, k: int, chunk: int) -> bool:
    """Whether first-stage programs of `chunk` columns can select k of a row of n: a power of two
    (a Triton block) dividing the row, holding k, and leaving the second stage at most
    MAX_COLUMNS candidates."""
    return chunk > 0 and not chunk & (chunk - 1) and n % chunk == 0 and chunk >= k and n // chunk * k <= MAX_COLUMNS


def two_stage_chunk(rows: int, n: int, k: int) -> int:
    """The first stage's columns a program, or 0 for one stage. A row's program costs about its
    columns per thread times 32 passes whatever the row count, so with few rows (decode at batch
    1-8) most of the GPU idles: the first stage spreads each row over n / CHUNK programs and the
    second sees only their k best each. Taken for rows of at least MIN_CHUNKS chunks while the first
    stage stays within TWO_STAGE_PROGRAMS programs and leaves the second at most half the columns.
    H100, bench_kernels --sections select, k = 512, ms a selection one stage / two: 1 x 32,768
    0.055 / 0.020, 64 x 32,768 0.061 / 0.039, 1 x 16,384 0.025 / 0.018, 64 x 16,384 0.029 / 0.024
    (BENCHMARKS.md 2026-12-06 p). Rows past MAX_COLUMNS, which one program cannot hold, take two
    stages at any row count whenever the candidates fit one (n / chunk * k <= MAX_COLUMNS): in
    chunks of 2 x CHUNK while those stay within TWO_STAGE_PROGRAMS programs (few rows: the second
    stage, one program over the candidates, is the longer one, and halving them gained more than
    the wider first stage cost: 1 / 8 x 131,072 0.038 / 0.044 -> 0.031 / 0.032 ms, 1 x 262,144
    0.071 -> 0.043; 64 x 131,072 0.128 -> 0.139, so 64 rows keep CHUNK; H100, BENCHMARKS.md
    2026-12-06 s, v), else in chunks of CHUNK, else (candidates of CHUNK chunks past one program)
    of 2 x CHUNK again (64 x 524,288: 0.53 ms against 4.18 for XLA's top_k + sort, v): up to
    524,288 columns at k = 512, a 2M context at ratio 4; else 0 (`kernel_selects` false)."""
    if n > MAX_COLUMNS:
        fits = [c for c in (CHUNK, 2 * CHUNK) if chunk_fits(n, k, c) and c >= 2 * k]
        few = [c for c in fits[::-1] if rows * (n // c) <= TWO_STAGE_PROGRAMS]
        return (few or fits or [0])[0]
    chunks = n // CHUNK
    ok = chunk_fits(n, k, CHUNK) and CHUNK >= 2 * k and chunks >= MIN_CHUNKS and rows * chunks <= TWO_STAGE_PROGRAMS
    return CHUNK if ok else 0


def kernel_selects(rows: int, n: int, k: int) -> bool:
    """Whether `select_ascending`'s Pallas backend takes rows of n columns (the rest: the
    reference's sort)."""
    return n <= MAX_COLUMNS or two_stage_chunk(rows, n, min(k, n)) > 0


def select_ascending(scores: jax.Array, visible: jax.Array, k: int, *, backend: str | None = None,
                     num_warps: int | None = None, chunk: int | None = None,
                     finite_only: bool = False) -> jax.Array:
    """`reference.select_topk(scores, visible, k, finite_only)` for scores [..., n], visible [...]
    (or broadcast to them).

    chunk: columns a first-stage program takes (0: one stage; None: `two_stage_chunk`; unused on
    the XLA path, and rows that neither one stage nor two can hold take the reference's sort). Two
    stages pick the same ids: every column of the k best of a row is among the k best of its chunk
    (a column beaten by k others of its chunk is beaten by them in the row, in the same order of
    value then column), and the second stage sees the candidates in column order, so its ties
    also go to the lower column. num_warps: the last stage's (default `_warps`)."""
    n = scores.shape[-1]
    k = min(k, n)
    lead = scores.shape[:-1]
    rows = math.prod(lead)
    if chunk is None:
        chunk = two_stage_chunk(rows, n, k)
    if _backend.resolve(backend, kernel="select") == "xla" or (n > MAX_COLUMNS and not chunk):
        return ref.select_topk(scores, visible, k, finite_only)
    if chunk and not chunk_fits(n, k, chunk):
        raise ValueError(f"select_ascending: chunk {chunk} must be a power of two (a Triton block) "
                         f"dividing the row's {n} columns, holding k = {k}, and leaving the second "
                         f"stage at most {MAX_COLUMNS} candidates")
    s = scores.astype(jnp.float32).reshape(-1, n)
    vis = jnp.broadcast_to(visible, lead).reshape(-1).astype(jnp.int32)
    interpret = _backend.interpret()
    ids = None
    if chunk:
        ids, s = _chunks_pallas(s, k=k, chunk=chunk, num_warps=_warps(chunk), interpret=interpret)
    out = _select_pallas(s, vis, ids, k=k, num_warps=num_warps or _warps(s.shape[-1]), interpret=interpret,
                         finite_only=finite_only)
    return out.reshape(*lead, k)
