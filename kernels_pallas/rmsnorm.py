"""The RMSNorm statistic rsqrt(mean(x^2) + eps) as one Pallas kernel (Triton lowering) per call.

docs/MODEL.md §3.1; jnp reference and XLA path: `kernels_pallas.reference.rms_inv`.

  rms_inv(x [..., D] any float dtype, eps, *, backend=None) -> fp32 [..., 1]
      Bit-equal to the reference. RMSNorm, the mHC mixes and the Engram gate call it.

Why a kernel: on the XLA path the two correctly rounded divisions (by D, and 1 / sqrt) sit behind
optimization barriers, so one call is 2-3 unfused kernels, ~20 calls a decode step: the largest
source of launches left (BENCHMARKS.md, issue 16: 130 of ~520 in the demo model's plain step).
Here one program owns a block of rows (`x` as [T, D] in place; rows past T masked) and computes
the whole statistic.

Order: torch's CPU sum (`numerics.cascade_sum`). Up to its last stage that sum is elementwise over
rows of 32 values (4 accumulators of 8 lanes), so the program holds [rows, 32] partial sums. The
first stage goes by runs (`numerics.cascade_step` chunks of 32: 16 up to D = 2^24): a loop whose
step sums the chunks of one run, or of 8 runs side by side on wide rows, each run in order, then
folds them into the cascade's levels in run order (`numerics.cascade_fold`, the step the XLA
path's `cascade_rows` unrolls; a run is taken out of the side-by-side sums by a masked sum), so
the kernel holds one step's loads whatever D (the loads of every chunk, unrolled, kept Triton's
compile past 470 s at the mHC width). The chunks of a short last run past D, and the runs past the
last, are masked loads of +0. The last stage (`numerics.combine_lanes`) takes 8-wide windows and
single columns of those register tensors, which Triton cannot slice: a masked sum picks them out.
These maskings are exact, because every added term is +0 and v + 0 = v for every v except -0.0,
which no value here is (a square is >= +0, a sum of such too; the masked loads give +0). The < 32
values past the last full chunk come in as one masked load.

Exactness: each square rounded to fp32 on its own (`numerics.rounded`: Triton, like XLA:CPU,
contracts a product into the add after it as an FMA; torch rounds the square first), every add in
fp32 in the reference's order, the division by D and the square root correctly rounded
(`_ieee.div_rn`, `_ieee.sqrt_rn`: Triton's fp32 `/` and `sqrt` are not), eps added in fp32, then
1 / root correctly rounded: the reference's rsqrt, two roundings.
"""

from __future__ import annotations

import functools
import operator

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernels_pallas import backend as _backend
from kernels_pallas import reference as ref
from kernels_pallas._compat import compiler_params, load, store
from kernels_pallas._ieee import div_rn, sqrt_rn
from v41_jax.numerics import CHUNK, LANES, cascade_fold, cascade_step, cascade_total, combine_lanes, rounded


def _col(a: jax.Array, c: int) -> jax.Array:
    """Column c of a [R, W] register tensor -> [R]."""
    cols = jax.lax.broadcasted_iota(jnp.int32, a.shape, 1)
    return jnp.sum(jnp.where(cols == c, a, 0.0), axis=1)


def _window(a: jax.Array, p: int) -> jax.Array:
    """Columns p .. p+7 of a [R, W] register tensor -> [R, 8]."""
    shape = (a.shape[1], LANES)
    take = jax.lax.broadcasted_iota(jnp.int32, shape, 0) == p + jax.lax.broadcasted_iota(jnp.int32, shape, 1)
    return jnp.sum(jnp.where(take[None], a[:, :, None], 0.0), axis=1)


# runs of the cascade summed side by side in one loop step where a row has many: their loads are
# independent, so the row waits for a few dependent steps, not one per run. H200, one warp a row:
# the mHC width (40 runs) 10.6-12.1 -> 6.4-7.5 us a call at 1-64 rows; the hidden width (10 runs)
# ran 3.4-3.8 us run by run and 5.0-5.3 side by side, so rows of fewer than WIDE_RUNS runs go one
# run a step (BENCHMARKS.md, 2026-12-04 b). Runs past the last are masked, so the kernel's size
# depends on D only through that choice.
RUNS_AT_ONCE, WIDE_RUNS = 8, 32


def _rms_inv_kernel(x_ref, o_ref, *, eps: float, bt: int):
    t, d = x_ref.shape
    first = pl.program_id(0) * bt
    r = first + jax.lax.broadcasted_iota(jnp.int32, (bt,), 0)
    live = r < t
    lane = jax.lax.broadcasted_iota(jnp.int32, (CHUNK,), 0)

    def squares(at: tuple, mask: jax.Array) -> jax.Array:
        v = load(x_ref.at[at], mask=mask, other=0).astype(jnp.float32)
        return rounded(v * v)

    n_chunks, n_rest = divmod(d, CHUNK)
    step = cascade_step(n_chunks)
    n_runs = pl.cdiv(n_chunks, step)
    g = RUNS_AT_ONCE if n_runs >= WIDE_RUNS else 1
    slot = jax.lax.broadcasted_iota(jnp.int32, (g,), 0)

    def add_runs(i, levels: tuple) -> tuple:
        """Runs i*G .. i*G+G-1: each one's chunks summed in order, side by side, then folded into
        the cascade in run order (those past the last run leave the levels as they are)."""
        runs = i * g + slot                                              # [G] run ids

        def chunk(j) -> jax.Array:
            # chunk j of each run, [bt, G, 32]; past the last chunk (a short last run, runs past
            # the last) masked to +0
            c = runs * step + j
            cols = c[None, :, None] * CHUNK + lane[None, None, :]
            mask = jnp.broadcast_to(live[:, None, None] & (c < n_chunks)[None, :, None], (bt, g, CHUNK))
            return squares((r[:, None, None], cols), mask)

        sums = functools.reduce(operator.add, [chunk(j) for j in range(step)])  # each run in order
        for s_ in range(g):
            k = i * g + s_
            run = jnp.sum(jnp.where((slot == s_)[None, :, None], sums, 0.0), axis=1)   # [bt, 32]
            folded = cascade_fold(levels, run, k, (k + 1) * step <= n_chunks, step)
            levels = tuple(jnp.where(k < n_runs, a, b) for a, b in zip(folded, levels))
        return levels

    zero = jnp.zeros((bt, CHUNK), jnp.float32)
    part = cascade_total(jax.lax.fori_loop(0, pl.cdiv(n_runs, g), add_runs, (zero,) * 4))
    # the values past the last full chunk, +0 after them: addressed by index vectors, because a
    # static slice reaching past D is refused even where masked
    rest = squares((r[:, None], n_chunks * CHUNK + lane[None, :]),
                   live[:, None] & (lane < n_rest)[None, :]) if n_rest else None
    total = combine_lanes(lambda k: _window(part, k * LANES), lambda p: _window(rest, p),
                          lambda p: _col(rest, p), _col, n_rest)
    root = sqrt_rn(div_rn(total, jnp.float32(d)) + eps)
    store(o_ref.at[r], div_rn(jnp.ones_like(root), root), mask=live)


@functools.partial(jax.jit, static_argnames=("eps", "block_rows", "interpret"))
def _rms_inv_pallas(x2, *, eps, block_rows, interpret):
    t, d = x2.shape
    kernel = functools.partial(_rms_inv_kernel, eps=eps, bt=block_rows)
    return pl.pallas_call(
        kernel, grid=(pl.cdiv(t, block_rows),),
        in_specs=[pl.BlockSpec((t, d), lambda i: (0, 0))],   # rows addressed (and masked) in the kernel
        out_specs=pl.BlockSpec((t,), lambda i: (0,)),
        out_shape=jax.ShapeDtypeStruct((t,), jnp.float32),
        compiler_params=compiler_params(1, 1), interpret=interpret, name="rms_inv",
    )(x2)


def rms_inv(x: jax.Array, eps: float, *, backend: str | None = None, block_rows: int = 1) -> jax.Array:
    """The statistic of `kernels_pallas.reference.rms_inv` over x's last axis.

    block_rows: rows a program (one warp; the lanes take a chunk's 32 columns). One by default:
    a decode batch's rows spread over the SMs, and a prefill's thousands of one-warp programs
    still fill them (scripts/bench_kernels.py --sections rmsnorm times 1 and 4)."""
    if _backend.resolve(backend, kernel="rmsnorm") == "xla":
        return ref.rms_inv(x, eps)
    out = _rms_inv_pallas(x.reshape(-1, x.shape[-1]), eps=float(eps), block_rows=block_rows,
                          interpret=_backend.interpret())
    return out.reshape(*x.shape[:-1], 1)
