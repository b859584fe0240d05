"""Routed-expert SwiGLU FFN as a grouped GEMM over expert-sorted (token, expert) pairs.

docs/MODEL.md §3.10; jnp reference: `kernels_pallas.reference.routed_experts` (same signature here,
plus `backend=` / `impl=`).

Steps (one call):
  1. XLA: each token's k picks sorted by expert id (the reference's combine order), the T*k pairs
     stably sorted by expert; group sizes -> a static-length tile table (tile -> expert, first
     row, group end); fp8 fake-quant of x once per token (A8 per 32 lanes, as `lin4`).
  2. Pallas gate/up kernel, grid (F/BN, tiles): rows of one expert's group gathered from x by
     token id (no sorted copy of x in HBM), [BM, D] @ w1[e]^T and w3[e]^T in one K loop; epilogue:
     g, u rounded to the activation dtype, u clamped to ±limit, g to <= limit,
     a = act(routing weight * silu(g) * u), then (fake-quant policies) the down GEMM's A8 input
     fake-quant of a per 32 lanes in the same epilogue, stored to the pair's sorted row.
  3. (a column block that is not whole 32-lane groups, and the other impls: that fake-quant in XLA.)
  4. Pallas down kernel, grid (D/BN, tiles): a rows [BM, F] @ w2[e]^T -> act dtype, stored at the
     pair's own row (token * k + slot), so no gather puts the rows back in token order.
  5. XLA: [T, k, D] summed in fp32 in ascending expert order.
Column blocks run fastest in both grids, so a tile's gathered rows come from L2 after the first.
Tiles never straddle two experts; the last tile of a group stores only its group's rows; tiles
past the live count (the table has a static length) and empty experts read no weights.

Held expert formats (`load_params(experts=)`, the same values in each): a bf16 [E, N, K] array;
`Fp8RowWeight` (E4M3 codes, one fp8 conversion per weight in registers, the row's power-of-two
scale on the GEMM's output columns after the K loop: exact); `Fp4Weight` (the published E2M1 +
E8M0 per 32, decoded in registers). Every kernel takes each of w1, w3, w2 in any of them. H200:
FP8 rows 1.4-1.9x faster than bf16 at 1-128 tokens (half the bytes), 0.66x at >= 2K (the decode
in the MMA path); FP4 slower than bf16 everywhere (BENCHMARKS.md).

Accumulation: one fp32 dot per GEMM (the `fast` policy; only fp32 summation order differs from the
XLA path). Under `numerics.gemm_blocks` (the reference's K-block order, for quantized experts)
the dispatcher takes the XLA path, which implements that order; a bf16 checkpoint's experts have
no K blocks (`Numerics.for_model`), so they take the kernels under every policy.

Decode path (impl="gemv"): one program per (token, expert) pair and column block streams the
expert's weight rows against the token's row as elementwise fp32 products summed over K (an MMA
would waste 15 of its 16 rows on one token); same rounding points and fp8 fake-quant of `a`.

NVIDIA Hopper fast path (impl="mgpu", `moe_mgpu`): the same pairs dispatched into tile-aligned
rows (`dispatch_rows`, a Triton kernel that writes live tiles only), then warp-specialised Mosaic
GPU kernels (gate/up with the SwiGLU epilogue, down); bf16 experts. 1.08-1.11x the grouped GEMM
at 2K tokens, 1.13-1.16x at 8K, slower at 512 (H200).

Alternatives measured by scripts/bench_kernels.py (impl=): "ragged_dot" (jax.lax.ragged_dot_general
on the sorted pairs), "dense" (every expert on every token, unrouted pairs weighted 0),
"capacity" (each expert's pairs in C rows of an [E, C, D] block, batched dense GEMMs, overflow
rounds), and the reference's per-token loop (backend "xla"). All are exact (same rounding points;
only fp32 summation order differs); `choose_impl` picks per step from the H200 measurements.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernels_pallas import backend as _backend
from kernels_pallas import moe_mgpu
from kernels_pallas import reference as ref
from kernels_pallas._codecs import e4m3_as, fp4_halves, fp4_values
from kernels_pallas._compat import compiler_params, load, store
from v41_jax.linear import K_BLOCK as _K_BLOCK  # A8 fake-quant group
from v41_jax.numerics import HIGHEST, Numerics, stable_argsort
from v41_jax.quant import Fp4Weight, Fp8RowWeight, fp8_act_qdq, fp8_act_qdq_by_amax, held

IMPLS = ("pallas", "gemv", "ragged_dot", "dense", "capacity", "mgpu")


def _act_in(x: jax.Array, numerics: Numerics) -> jax.Array:
    """The input side of a `lin4` site: activation dtype, then A8 fake-quant."""
    x = numerics.act(x)
    return fp8_act_qdq(x, _K_BLOCK) if numerics.gemm_fake_quant else x


def _swiglu_epilogue(g, u, weight, numerics: Numerics, limit: float):
    """g, u fp32 GEMM outputs, weight [rows] -> act(weight * silu(g) * u), as `swiglu_ffn`."""
    g = numerics.act(g).astype(jnp.float32)
    u = numerics.act(u).astype(jnp.float32)
    return numerics.act(ref.swiglu(g, u, limit, weight[:, None]))


def _tile_act_qdq(a: jax.Array) -> jax.Array:
    """The down projection's A8 fake-quant (`fp8_act_qdq` per K_BLOCK lanes) of a [rows, bn] tile
    whose columns are whole groups: each group's max |a| by a masked row max (a kernel cannot
    reshape the tile into groups), then the shared rule. Saves the separate QDQ's two passes over
    the [T k, F] intermediate (a 4,096-token prefill: 0.75 ms, BENCHMARKS.md 2026-12-05 i).
    Equal to `fp8_act_qdq` for finite values; a NaN lane, which XLA's max propagates, Triton's
    max skips (its group's scale then comes from the other lanes)."""
    v = a.astype(jnp.float32)
    mag = jnp.abs(v)
    group = jax.lax.broadcasted_iota(jnp.int32, v.shape, 1) // _K_BLOCK
    amax = jnp.zeros_like(v)
    for g in range(v.shape[1] // _K_BLOCK):
        mine = group == g
        amax = jnp.where(mine, jnp.max(jnp.where(mine, mag, 0.0), axis=1, keepdims=True), amax)
    return fp8_act_qdq_by_amax(v, amax).astype(a.dtype)


# ---- routing bookkeeping (XLA) ----------------------------------------------------------------

def sort_pairs(idx: jax.Array, w: jax.Array, n_experts: int):
    """idx, w [T, k] -> per-token ascending picks and the expert-sorted pair order.

    Returns (idx_t [T, k], w_t [T, k], order [T*k] pair ids by expert, sizes [E] int32)."""
    per_tok = stable_argsort(idx)
    idx_t = jnp.take_along_axis(idx, per_tok, -1).astype(jnp.int32)
    w_t = jnp.take_along_axis(w, per_tok, -1)
    order = stable_argsort(idx_t.reshape(-1))
    sizes = jnp.bincount(idx_t.reshape(-1), length=n_experts).astype(jnp.int32)
    return idx_t, w_t, order, sizes


def in_stack(ids: jax.Array, base: jax.Array | None) -> jax.Array:
    """Expert ids (-1 = none) -> rows of a flattened [L * E] stack starting at `base` (None: as given)."""
    return ids if base is None else jnp.where(ids >= 0, ids + base, ids)


def tile_table(sizes: jax.Array, block_m: int, n_pairs: int):
    """Group sizes [E] -> (expert, first row, group end) per tile, static length
    ceil(n_pairs / BM) + min(E, n_pairs); unused tiles get expert -1 and an empty row range."""
    n_exp = sizes.shape[0]
    n_tiles = -(-n_pairs // block_m) + min(n_exp, n_pairs)
    per = -(-sizes // block_m)                                        # tiles per expert
    ends = jnp.cumsum(per)
    starts = jnp.cumsum(sizes) - sizes                                # first sorted row per expert
    i = jnp.arange(n_tiles, dtype=jnp.int32)
    # compare_all: one [tiles, E] comparison fusion. The default binary search is a while loop,
    # and on the H200 each such loop of a step (one per MoE layer) left the GPU idle ~75 us
    # between its graph's condition node and its body (bench_step's timeline, 2026-12-04)
    e = jnp.searchsorted(ends, i, side="right", method="compare_all").astype(jnp.int32)
    live = e < n_exp
    ec = jnp.minimum(e, n_exp - 1)
    first = starts[ec] + (i - (ends[ec] - per[ec])) * block_m
    end = starts[ec] + sizes[ec]
    return (jnp.where(live, e, -1), jnp.where(live, first, 0).astype(jnp.int32),
            jnp.where(live, end, 0).astype(jnp.int32))


def where_is(ids: jax.Array, n: int) -> jax.Array:
    """ids [M] int32, each of 0..n-1 at most once (values >= n: pad, ignored) -> [n] int32, the
    index in `ids` of each id: the inverse of a pair order, as a gather table."""
    return jnp.zeros((n,), jnp.int32).at[ids].set(jnp.arange(ids.shape[0], dtype=jnp.int32), mode="drop")


def _padded_weights(w_t: jax.Array) -> jax.Array:
    """Per-token routing weights [T, k] -> fp32 per pair [T*k + 1]; the extra 0 is the weight of
    pad id T*k (a zero row's pair: its a is exactly 0)."""
    return jnp.concatenate([w_t.reshape(-1).astype(jnp.float32), jnp.zeros((1,), jnp.float32)])


def unsort(y_sorted: jax.Array, order: jax.Array, t: int, k: int) -> jax.Array:
    """Pair outputs in sorted order [T*k, D] -> [T, k, D], each token's picks in ascending expert id."""
    return y_sorted[where_is(order, order.shape[0])].reshape(t, k, -1)


# ---- expert weight tiles: as held (bf16, FP8 rows, FP4), decoded in registers --------------------

def _fp4_codes(w_ref, e, rows, k0, bk):
    """FP4 expert e, weight rows `rows`, inputs [k0, k0 + BK) -> (E2M1 bytes [BN, BK/2], E8M0
    codes [BN, BK/32])."""
    return (w_ref.codes[e, rows, pl.ds(pl.multiple_of(k0 // 2, bk // 2), bk // 2)],
            w_ref.scale[e, rows, pl.ds(pl.multiple_of(k0 // 32, bk // 32), bk // 32)])


def _weight_tile(w_ref, e, rows, k0, bk, dtype):
    """Expert e's weight rows `rows` (BN), inputs [k0, k0 + BK) -> [BN, BK] in `dtype` for the MMA:
    a held bf16 / fp32 ref as is; FP8 rows as their E4M3 values (the row scale comes after the
    GEMM, `_row_scale`); FP4 decoded and its even and odd inputs interleaved back in place."""
    ks = pl.ds(pl.multiple_of(k0, bk), bk)
    if isinstance(w_ref, Fp8RowWeight):
        return e4m3_as(w_ref.codes[e, rows, ks], dtype)
    if not isinstance(w_ref, Fp4Weight):
        return w_ref[e, rows, ks].astype(dtype)
    return fp4_values(*_fp4_codes(w_ref, e, rows, k0, bk), dtype)


def _row_scale(w_ref, e, rows, out):
    """A GEMM's fp32 output columns [..., BN] for weight rows `rows`, times their FP8 row scales
    (exact: powers of two); other formats are already scaled."""
    return out * w_ref.row_scale[e, rows] if isinstance(w_ref, Fp8RowWeight) else out


def _gemv_block(w_ref, e, rows, k0, bk, v_ref, r):
    """Σ over inputs [k0, k0 + BK) of expert e's weight rows `rows` times row r of v -> fp32 [BN]
    (before `_row_scale`), as elementwise products (no MMA for one row). FP4 weights are summed as
    their even and odd halves against v's even and odd lanes: no interleave for a plain sum."""
    if not isinstance(w_ref, Fp4Weight):
        w = _weight_tile(w_ref, e, rows, k0, bk, jnp.float32)
        ks = pl.ds(pl.multiple_of(k0, bk), bk)
        return jnp.sum(w * v_ref[r, ks].astype(jnp.float32)[None, :], axis=1)
    even, odd = fp4_halves(*_fp4_codes(w_ref, e, rows, k0, bk))
    lanes = lambda first: v_ref[r, pl.ds(first, bk // 2, stride=2)].astype(jnp.float32)[None, :]
    return jnp.sum(even * lanes(k0) + odd * lanes(k0 + 1), axis=1)


def _specs(w):
    """Whole-array block specs for a weight: one for a bf16 array, one per part of a held format."""
    return jax.tree.map(lambda a: _full(a.shape), w)


# ---- Pallas kernels -------------------------------------------------------------------------

def _dot_t(a, b, dt):
    """a [M, K] @ b[N, K]^T in fp32 (fp32 operands stay IEEE, no TF32)."""
    return jax.lax.dot_general(a, b.astype(dt), (((1,), (1,)), ((), ())), precision=HIGHEST,
                               preferred_element_type=jnp.float32)


def _tile_setup(te_ref, tf_ref, tend_ref, bm: int, bn: int, bk: int):
    """This program's (column block, tile): the tile's expert (< 0: no tile), its sorted pair
    rows [bm] and which of them are the tile's (`live`: before its group's end), the block's output
    columns [bn], K lanes [bk] and weight column slice."""
    j, i = pl.program_id(0), pl.program_id(1)
    cols = j * bn + jax.lax.broadcasted_iota(jnp.int32, (bn,), 0)
    rows = tf_ref[i] + jax.lax.broadcasted_iota(jnp.int32, (bm,), 0)
    return (te_ref[i], rows, rows < tend_ref[i], cols, jax.lax.broadcasted_iota(jnp.int32, (bk,), 0),
            pl.ds(pl.multiple_of(j * bn, bn), bn))


def _gate_up_kernel(te_ref, tf_ref, tend_ref, tok_ref, pw_ref, x_ref, w1_ref, w3_ref, a_ref, *,
                    bm, bn, bk, limit, numerics, qdq):
    e, rows, live, cols, kk, wcols = _tile_setup(te_ref, tf_ref, tend_ref, bm, bn, bk)

    @pl.when(e >= 0)
    def _():
        tok = load(tok_ref.at[rows], mask=live, other=0)                # token of each pair

        def body(kb, acc):
            acc_g, acc_u = acc
            k0 = kb * bk
            xt = load(x_ref.at[tok[:, None], (k0 + kk)[None, :]], mask=live[:, None], other=0)
            mma = lambda w_ref: _dot_t(xt, _weight_tile(w_ref, e, wcols, k0, bk, x_ref.dtype), x_ref.dtype)
            return acc_g + mma(w1_ref), acc_u + mma(w3_ref)

        zero = jnp.zeros((bm, bn), jnp.float32)
        acc_g, acc_u = jax.lax.fori_loop(0, x_ref.shape[1] // bk, body, (zero, zero))
        acc_g, acc_u = _row_scale(w1_ref, e, wcols, acc_g), _row_scale(w3_ref, e, wcols, acc_u)
        wt = load(pw_ref.at[rows], mask=live, other=0).astype(jnp.float32)
        a = _swiglu_epilogue(acc_g, acc_u, wt, numerics, limit)
        if qdq:                                                        # the down GEMM's input QDQ
            a = _tile_act_qdq(a)
        store(a_ref.at[rows[:, None], cols[None, :]], a.astype(a_ref.dtype), mask=live[:, None])


def _down_kernel(te_ref, tf_ref, tend_ref, pair_ref, a_ref, w2_ref, y_ref, *, bm, bn, bk, numerics):
    """y rows are stored at their pair's place (token * k + slot), so the combine reads them in
    place instead of gathering the sorted rows back. A tile's rows past its group go to BM spare
    rows after the pairs: each lane keeps a row of its own, also under a masked store."""
    e, rows, live, cols, kk, wcols = _tile_setup(te_ref, tf_ref, tend_ref, bm, bn, bk)

    @pl.when(e >= 0)
    def _():
        safe = jnp.where(live, rows, 0)

        def body(kb, acc):
            k0 = kb * bk
            at = load(a_ref.at[safe[:, None], (k0 + kk)[None, :]], mask=live[:, None], other=0)
            return acc + _dot_t(at, _weight_tile(w2_ref, e, wcols, k0, bk, a_ref.dtype), a_ref.dtype)

        acc = jax.lax.fori_loop(0, a_ref.shape[1] // bk, body, jnp.zeros((bm, bn), jnp.float32))
        acc = _row_scale(w2_ref, e, wcols, acc)
        spare = pair_ref.shape[0] + jax.lax.broadcasted_iota(jnp.int32, (bm,), 0)
        dst = jnp.where(live, load(pair_ref.at[safe], mask=live, other=0), spare)
        store(y_ref.at[dst[:, None], cols[None, :]], numerics.act(acc).astype(y_ref.dtype),
              mask=live[:, None])


def _full(shape):
    return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))


def default_block_m(n_pairs: int, n_experts: int) -> int:
    """Rows per tile: the mean group size rounded up to a power of two, within [16, 128]
    (16 = the smallest MMA M; past 128 the fp32 accumulators crowd the registers)."""
    mean = max(1, -(-n_pairs // n_experts))
    return int(min(128, max(16, 1 << (mean - 1).bit_length())))


@functools.partial(jax.jit, static_argnames=("numerics", "limit", "bm", "bn", "bk", "num_warps",
                                             "num_stages", "interpret", "n_exp", "bn_gate_up"))
def _routed_pallas(x, idx, w, w1, w3, w2, base=None, *, numerics, limit, bm, bn, bk, num_warps, num_stages,
                   interpret, n_exp=None, bn_gate_up=None):
    t, d = x.shape
    k = idx.shape[1]
    n_exp = n_exp or w1.shape[0]
    _, w_t, order, sizes = sort_pairs(idx, w, n_exp)
    te, tf, tend = tile_table(sizes, bm, t * k)
    f, te = w1.shape[1], in_stack(te, base)
    tok = order // k                                                  # token of each sorted pair
    pw = w_t.reshape(-1)[order].astype(jnp.float32)                  # its routing weight
    xq = _act_in(x, numerics)
    cp = compiler_params(num_warps, num_stages)
    tables = [_full(te.shape)] * 3
    # column blocks fastest: a tile's column blocks run side by side, so its gathered rows come
    # from L2 after the first (tiles fastest re-read them from HBM per column block: 1.14-1.24x
    # slower at 512-8192 tokens on the H200)
    bn_gu = bn_gate_up or bn
    qdq_in_epilogue = numerics.gemm_fake_quant and bn_gu % _K_BLOCK == 0   # whole groups per tile
    a = pl.pallas_call(
        functools.partial(_gate_up_kernel, bm=bm, bn=bn_gu, bk=bk, limit=limit, numerics=numerics,
                          qdq=qdq_in_epilogue),
        grid=(f // bn_gu, te.shape[0]),
        in_specs=tables + [_full(tok.shape), _full(pw.shape), _full(xq.shape), _specs(w1), _specs(w3)],
        out_specs=_full((t * k, f)), out_shape=jax.ShapeDtypeStruct((t * k, f), numerics.act_dtype),
        compiler_params=cp, interpret=interpret, name="moe_gate_up",
    )(te, tf, tend, tok, pw, xq, w1, w3)
    if numerics.gemm_fake_quant and not qdq_in_epilogue:
        a = fp8_act_qdq(a, _K_BLOCK)
    y = pl.pallas_call(
        functools.partial(_down_kernel, bm=bm, bn=bn, bk=bk, numerics=numerics),
        grid=(d // bn, te.shape[0]),
        in_specs=tables + [_full(order.shape), _full(a.shape), _specs(w2)],
        out_specs=_full((t * k + bm, d)), out_shape=jax.ShapeDtypeStruct((t * k + bm, d), numerics.act_dtype),
        compiler_params=cp, interpret=interpret, name="moe_down",
    )(te, tf, tend, order, a, w2)
    return y[:t * k].reshape(t, k, d)


# ---- decode: one weight stream per (token, expert) pair ------------------------------------------

def _gemv_gate_up_kernel(pe_ref, pw_ref, x_ref, w1_ref, w3_ref, a_ref, *, k, bn, bk, limit,
                         numerics):
    """Pair p (token p // k), columns j: w1[e] / w3[e] rows [BN, D] against the token's row, as
    elementwise fp32 products summed per K step (no MMA: one row would waste 15 of 16 MMA rows).
    Summing lane-wise over K and reducing once at the end measured no faster (1-8 tokens)."""
    p, j = pl.program_id(0), pl.program_id(1)
    e, t = pe_ref[p], p // k
    rows = pl.ds(pl.multiple_of(j * bn, bn), bn)

    def body(kb, acc):
        acc_g, acc_u = acc
        return (acc_g + _gemv_block(w1_ref, e, rows, kb * bk, bk, x_ref, t),
                acc_u + _gemv_block(w3_ref, e, rows, kb * bk, bk, x_ref, t))

    zero = jnp.zeros((bn,), jnp.float32)
    g, u = jax.lax.fori_loop(0, x_ref.shape[1] // bk, body, (zero, zero))
    g, u = _row_scale(w1_ref, e, rows, g), _row_scale(w3_ref, e, rows, u)
    wt = jnp.full((1,), pw_ref[p], jnp.float32)
    a_ref[p, rows] = _swiglu_epilogue(g[None, :], u[None, :], wt, numerics, limit)[0].astype(a_ref.dtype)


def _gemv_down_kernel(pe_ref, a_ref, w2_ref, y_ref, *, bn, bk, numerics):
    p, j = pl.program_id(0), pl.program_id(1)
    e = pe_ref[p]
    rows = pl.ds(pl.multiple_of(j * bn, bn), bn)

    def body(kb, acc):
        return acc + _gemv_block(w2_ref, e, rows, kb * bk, bk, a_ref, p)

    acc = _row_scale(w2_ref, e, rows, jax.lax.fori_loop(0, a_ref.shape[1] // bk, body,
                                                        jnp.zeros((bn,), jnp.float32)))
    y_ref[p, rows] = numerics.act(acc).astype(y_ref.dtype)


def gemv_gate_up(pe, pw, xq, w1, w3, *, numerics, limit, bn, bk, num_warps, num_stages, interpret):
    """pe [P] expert of pair p = token * k + slot, pw [P] its routing weight, xq [T, D] -> a [P, F]."""
    n_pairs, f = pe.shape[0], w1.shape[1]
    return pl.pallas_call(
        functools.partial(_gemv_gate_up_kernel, k=n_pairs // xq.shape[0], bn=bn, bk=bk, limit=limit,
                          numerics=numerics),
        grid=(n_pairs, f // bn),
        in_specs=[_full(pe.shape), _full(pw.shape), _full(xq.shape), _specs(w1), _specs(w3)],
        out_specs=_full((n_pairs, f)), out_shape=jax.ShapeDtypeStruct((n_pairs, f), numerics.act_dtype),
        compiler_params=compiler_params(num_warps, num_stages), interpret=interpret,
        name="moe_gemv_gate_up",
    )(pe, pw, xq, w1, w3)


def gemv_down(pe, a, w2, *, numerics, bn, bk, num_warps, num_stages, interpret):
    """pe [P], a [P, F] -> y [P, D] in the activation dtype."""
    n_pairs, d = pe.shape[0], w2.shape[1]
    return pl.pallas_call(
        functools.partial(_gemv_down_kernel, bn=bn, bk=bk, numerics=numerics),
        grid=(n_pairs, d // bn),
        in_specs=[_full(pe.shape), _full(a.shape), _specs(w2)],
        out_specs=_full((n_pairs, d)), out_shape=jax.ShapeDtypeStruct((n_pairs, d), numerics.act_dtype),
        compiler_params=compiler_params(num_warps, num_stages), interpret=interpret,
        name="moe_gemv_down",
    )(pe, a, w2)


@functools.partial(jax.jit, static_argnames=("numerics", "limit", "bn", "bk", "num_warps", "num_stages",
                                             "interpret", "n_exp"))
def _routed_gemv(x, idx, w, w1, w3, w2, base=None, *, numerics, limit, bn, bk, num_warps, num_stages, interpret,
                 n_exp=None):
    t, d = x.shape
    k = idx.shape[1]
    idx_t, w_t, _, _ = sort_pairs(idx, w, n_exp or w1.shape[0])      # per token: ascending experts
    pe = in_stack(idx_t.reshape(-1), base)                            # pair p = token * k + slot
    pw = w_t.reshape(-1).astype(jnp.float32)
    launch = dict(numerics=numerics, bn=bn, bk=bk, num_warps=num_warps, num_stages=num_stages,
                  interpret=interpret)
    a = gemv_gate_up(pe, pw, _act_in(x, numerics), w1, w3, limit=limit, **launch)
    a = fp8_act_qdq(a, _K_BLOCK) if numerics.gemm_fake_quant else a
    return gemv_down(pe, a, w2, **launch).reshape(t, k, d)


# ---- XLA alternatives (benchmarked against the kernel) ----------------------------------------

def _ragged(lhs, rhs, sizes):
    """lhs [M, K] grouped rows, rhs [E, N, K] -> [M, N] fp32 (rhs contracted on its last dim)."""
    dn = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((1,), (2,)), ((), ())), lhs_ragged_dimensions=[0],
        rhs_group_dimensions=[0])
    return jax.lax.ragged_dot_general(lhs, rhs.astype(lhs.dtype), sizes, dn, precision=HIGHEST,
                                      preferred_element_type=jnp.float32)


@functools.partial(jax.jit, static_argnames=("numerics", "limit"))
def _routed_ragged_dot(x, idx, w, w1, w3, w2, *, numerics, limit):
    t, k = idx.shape
    w1, w3, w2 = held(w1), held(w3), held(w2)
    _, w_t, order, sizes = sort_pairs(idx, w, w1.shape[0])
    xs = _act_in(x, numerics)[order // k]                              # [T*k, D] sorted copy
    pw = w_t.reshape(-1)[order].astype(jnp.float32)
    a = _swiglu_epilogue(_ragged(xs, w1, sizes), _ragged(xs, w3, sizes), pw, numerics, limit)
    y = numerics.act(_ragged(_act_in(a, numerics), w2, sizes))
    return unsort(y, order, t, k)


@functools.partial(jax.jit, static_argnames=("numerics", "limit"))
def _routed_dense(x, idx, w, w1, w3, w2, *, numerics, limit):
    """Every expert on every token; an unrouted pair has weight 0, so its a and y are exactly 0
    and add nothing to the fp32 sum."""
    t, k = idx.shape
    n_exp = w1.shape[0]
    w1, w3, w2 = held(w1), held(w3), held(w2)
    idx_t, w_t, _, _ = sort_pairs(idx, w, n_exp)
    xq = _act_in(x, numerics)
    dense_w = jnp.zeros((t, n_exp), jnp.float32).at[jnp.arange(t)[:, None], idx_t].add(w_t.astype(jnp.float32))
    mm = lambda a, b: jnp.einsum("tk,enk->ten", a, b.astype(a.dtype), precision=HIGHEST,
                                 preferred_element_type=jnp.float32)
    g, u = mm(xq, w1), mm(xq, w3)                                     # [T, E, F]
    a = _swiglu_epilogue(g.reshape(t * n_exp, -1), u.reshape(t * n_exp, -1), dense_w.reshape(-1),
                         numerics, limit).reshape(t, n_exp, -1)
    aq = _act_in(a, numerics)
    y = numerics.act(jnp.einsum("tef,edf->ted", aq, w2.astype(aq.dtype), precision=HIGHEST,
                                preferred_element_type=jnp.float32))
    # ascending expert order per token: only the k routed terms are nonzero
    return jnp.take_along_axis(y, idx_t[..., None], axis=1)  # [T, k, D]


def _dispatch_kernel(te_ref, tok_ref, x_ref, xs_ref, *, tile_m, bd):
    i, j = pl.program_id(0), pl.program_id(1)

    @pl.when(te_ref[i] >= 0)
    def _():
        tok = tok_ref[pl.ds(pl.multiple_of(i * tile_m, tile_m), tile_m)]
        live = tok < x_ref.shape[0]
        cols = j * bd + jax.lax.broadcasted_iota(jnp.int32, (bd,), 0)
        rows = load(x_ref.at[jnp.where(live, tok, 0)[:, None], cols[None, :]], mask=live[:, None], other=0)
        xs_ref[pl.ds(pl.multiple_of(i * tile_m, tile_m), tile_m), pl.ds(pl.multiple_of(j * bd, bd), bd)] = rows


def dispatch_rows(te: jax.Array, tok: jax.Array, x: jax.Array, tile_m: int, *, interpret: bool,
                  bd: int = 128) -> jax.Array:
    """x [T, D] -> [M_pad, D] tile-aligned rows: row r of tile i is x[tok[i * tile_m + r]], or zero
    where tok >= T (a pad row). Tiles with te < 0 are not written (the grouped GEMMs skip them):
    as an XLA gather every row of the static M_pad is written, 0.18 ms at 2K tokens on the H200
    with 56% of them dead."""
    m_pad, d = tok.shape[0], x.shape[1]
    bd = min(bd, d)
    return pl.pallas_call(
        functools.partial(_dispatch_kernel, tile_m=tile_m, bd=bd),
        grid=(te.shape[0], d // bd),
        in_specs=[_full(te.shape), _full(tok.shape), _full(x.shape)],
        out_specs=_full((m_pad, d)), out_shape=jax.ShapeDtypeStruct((m_pad, d), x.dtype),
        compiler_params=compiler_params(8, 1), interpret=interpret, name="moe_dispatch",
    )(te, tok, x)


@functools.partial(jax.jit, static_argnames=("numerics", "limit", "tile_m", "steps", "reference", "n_exp"))
def _routed_mgpu(x, idx, w, w1, w3, w2, base=None, *, numerics, limit, tile_m, steps, reference, n_exp=None):
    """The Mosaic GPU path (`moe_mgpu`): pairs dispatched into tile-aligned rows [M_pad, D] (the
    tile table's tiles, each one expert), the warp-specialised gate/up GEMM with the SwiGLU
    epilogue (`moe_mgpu.preset` launches), fp8 fake-quant of a in XLA, the
    down GEMM, each pair's row gathered back (pad rows and skipped tiles are never read).
    `reference` runs the kernels' jnp references instead (CPU tests of the dispatch)."""
    t, k = idx.shape
    n_pairs = t * k
    _, w_t, order, sizes = sort_pairs(idx, w, n_exp or w1.shape[0])
    te, tf, tend = tile_table(sizes, tile_m, n_pairs)
    rows = tf[:, None] + jnp.arange(tile_m, dtype=jnp.int32)[None, :]  # [tiles, tile_m] sorted rows
    pair = jnp.where(rows < tend[:, None], order[jnp.minimum(rows, n_pairs - 1)], n_pairs).reshape(-1)
    pw = _padded_weights(w_t)                                          # [T*k + 1], pad id T*k -> 0
    cfg = moe_mgpu.preset(tile_m)
    tiles = dict(tile_expert=in_stack(te, base), tile_m=tile_m, steps=steps, split=cfg["split"])
    xs = dispatch_rows(te, jnp.where(pair < n_pairs, pair // k, t), _act_in(x, numerics), tile_m,
                       interpret=reference)                           # [M_pad, D]
    swiglu = moe_mgpu.grouped_swiglu_ref if reference else moe_mgpu.grouped_swiglu
    gemm = moe_mgpu.grouped_matmul_ref if reference else moe_mgpu.grouped_matmul
    a = swiglu(xs, w1, w3, pw[pair], limit=limit, tile_n=cfg["glu_n"], **tiles)
    a = fp8_act_qdq(a, _K_BLOCK) if numerics.gemm_fake_quant else a
    # back to pair order by a gather (an XLA scatter of the [M_pad, D] rows took 0.5 ms at 2K
    # tokens on the H200, more than the down GEMM)
    y = gemm(a, w2, tile_n=cfg["down_n"], **tiles)
    return y[where_is(pair, n_pairs)].reshape(t, k, -1)


def capacity_rows(n_pairs: int, n_experts: int) -> int:
    """Static rows per expert of the capacity path: the mean group plus 4 standard deviations of
    uniform routing (and at least 1.25x the mean), rounded up to 64 (the MMA tile height). A group
    past it takes another round, so the size only sets the speed."""
    mean = n_pairs / n_experts
    return int(-(-max(1.25 * mean, mean + 4 * mean ** 0.5) // 64) * 64)


@functools.partial(jax.jit, static_argnames=("numerics", "limit", "capacity"))
def _routed_capacity(x, idx, w, w1, w3, w2, *, numerics, limit, capacity):
    """Each expert's pairs dispatched into C = `capacity` rows of an [E, C, D] block, then three
    batched dense GEMMs (the vendor GEMM library through XLA). Slot c of round r holds the pair at
    position r * C + c of the expert's group; a group longer than C takes more rounds (a while
    loop, one round when routing fits). An empty slot reads a zero row with weight 0. Each pair
    takes its row back from its round by a gather (an XLA scatter of [rows, D] cost 0.5 ms at 2K
    tokens on the H200)."""
    t, k = idx.shape
    n_exp = w1.shape[0]
    w1, w3, w2 = held(w1), held(w3), held(w2)
    idx_t, w_t, order, sizes = sort_pairs(idx, w, n_exp)
    starts = jnp.cumsum(sizes) - sizes
    n_pairs = t * k
    e_of = idx_t.reshape(-1)                                          # pair -> expert
    pos_of = where_is(order, n_pairs) - starts[e_of]                  # pair -> place in its group
    xq = jnp.concatenate([_act_in(x, numerics), jnp.zeros((1, x.shape[1]), numerics.act_dtype)])
    pw = _padded_weights(w_t)                                          # [T*k + 1], pad id T*k -> 0
    mm = lambda a, b, spec: jnp.einsum(spec, a, b.astype(a.dtype), precision=HIGHEST,
                                       preferred_element_type=jnp.float32)

    def one_round(r, y):                                              # y [T*k, D] pair outputs
        pos = r * capacity + jnp.arange(capacity, dtype=jnp.int32)
        live = pos[None, :] < sizes[:, None]                          # [E, C]
        pair = jnp.where(live, order[jnp.minimum(starts[:, None] + pos[None, :], n_pairs - 1)], n_pairs)
        xs = xq[jnp.where(live, pair // k, t)]                        # [E, C, D]; row t of xq is zero
        g, u = mm(xs, w1, "ecd,efd->ecf"), mm(xs, w3, "ecd,efd->ecf")
        a = _swiglu_epilogue(g.reshape(-1, g.shape[-1]), u.reshape(-1, u.shape[-1]), pw[pair].reshape(-1),
                             numerics, limit).reshape(g.shape)
        ys = numerics.act(mm(_act_in(a, numerics), w2, "ecf,edf->ecd")).reshape(n_exp * capacity, -1)
        mine = (pos_of // capacity == r)[:, None]                     # pairs served this round
        return jnp.where(mine, ys[e_of * capacity + pos_of % capacity].astype(y.dtype), y)

    rounds = (jnp.max(sizes) + capacity - 1) // capacity
    y = jax.lax.fori_loop(0, rounds, one_round, jnp.zeros((n_pairs, x.shape[1]), numerics.act_dtype))
    return y.reshape(t, k, -1)


def choose_impl(tokens: int, mosaic: bool = False) -> str:
    """The fastest exact implementation for a step, from the H200 measurements (BENCHMARKS.md,
    5120 / 2304, top-6, 64 and 384 experts): up to 2 tokens -> "gemv" (one weight stream per
    pair: FP8 rows 0.100 / 0.154 ms at 1 / 2 tokens against the grouped GEMM's 0.118 / 0.186; from
    4 tokens the grouped GEMM leads, 0.212 vs 0.226 at 4, 0.365 vs 0.405 at 8, and bf16 the same
    way; 3 was not measured); from 2,048 tokens, where `mosaic` (the Mosaic GPU path can run:
    `mgpu_ok`) -> "mgpu" (2.27-2.33 vs 2.46-2.58 ms at 2K tokens, 7.0 vs 7.8-8.0 at 8K; slower at
    512: 1.5-2.0 vs 1.36-1.41); otherwise the Pallas grouped GEMM, which also beats the dense
    all-experts GEMM where every expert is busy (1.12 / 1.20 vs 1.17 / 1.38 ms at 32 / 128 tokens
    with 64 experts; 5.3 / 6.1 vs 7.8 / 12.2 ms at 128 / 256 tokens with 384) and the
    fixed-capacity dispatch (1.36 / 2.53 / 7.85 vs 1.70 / 2.94 / 9.39 ms at 512 / 2K / 8K)."""
    if tokens <= 2:
        return "gemv"
    return "mgpu" if mosaic and tokens >= 2048 else "pallas"


def mgpu_ok(w1, w3, w2, numerics: Numerics) -> bool:
    """Whether the Mosaic GPU path takes these experts: bf16 arrays, bf16 activations."""
    return (numerics.act_dtype == jnp.bfloat16
            and all(isinstance(w_, jax.Array) and w_.dtype == jnp.bfloat16 for w_ in (w1, w3, w2)))


def auto_impl(tokens: int, w1, w3, w2, numerics: Numerics) -> str:
    """What `routed_experts` runs for impl=None: `choose_impl`, with the Mosaic path where it can
    run on this machine and takes these experts."""
    return choose_impl(tokens, _backend.mosaic_gpu() and mgpu_ok(w1, w3, w2, numerics))


def launch_config(block_m: int, coded: bool = False) -> dict:
    """Measured Triton parameters per tile height: 128-row tiles need 8 warps for their two fp32
    [128, 128] accumulators (2.2x over 4 warps at 2048 tokens); short decode tiles are weight
    streams that like a deeper K step. `coded`: the experts are held as FP8 rows / FP4, decoded in
    registers; their short tiles run 4-8 % faster on 64-column blocks (more programs in flight for
    the decode work; H200, 16-128 tokens, 64 experts: 0.62 -> 0.59, 0.77 -> 0.71, 0.79 -> 0.74,
    0.86 -> 0.83 ms), while bf16 tiles stream at the bandwidth limit with any width
    (BENCHMARKS.md, 2026-12-04)."""
    if block_m >= 128:
        # FP8 / FP4 gate/up on 64-column blocks: its two fp32 accumulators half as wide; down keeps
        # 128 (H200, 2K / 4K / 8K tokens, 64 experts, gate/up 2.17 -> 1.93, 3.79 -> 3.31,
        # 7.02 -> 6.07 ms; down at 64 columns 0.85 -> 1.00, 1.47 -> 1.71 ms; BENCHMARKS.md 2026-12-05)
        return dict(block_n=128, block_k=64, num_warps=8, num_stages=3, gate_up_block_n=64 if coded else None)
    if block_m <= 32:
        return dict(block_n=64 if coded else 128, block_k=128, num_warps=4, num_stages=4, gate_up_block_n=None)
    return dict(block_n=128, block_k=64, num_warps=4, num_stages=3, gate_up_block_n=None)


def routed_experts(x: jax.Array, idx: jax.Array, w: jax.Array, w1: jax.Array, w3: jax.Array,
                   w2: jax.Array, numerics: Numerics, swiglu_limit: float, **kw) -> jax.Array:
    """x [T, D], idx [T, k] int32, w [T, k] fp32 routing weights, w1/w3 [E, F, D], w2 [E, D, F]
    (each bf16 / fp32, `Fp8RowWeight` or `Fp4Weight`) -> fp32 [T, D]: Σ over each token's experts
    (ascending id) of the SwiGLU expert output (`ref.add_slots` of `routed_pairs`; kw as there)."""
    return ref.add_slots(routed_pairs(x, idx, w, w1, w3, w2, numerics, swiglu_limit, **kw))


def routed_pairs(x: jax.Array, idx: jax.Array, w: jax.Array, w1: jax.Array, w3: jax.Array,
                 w2: jax.Array, numerics: Numerics, swiglu_limit: float, *,
                 backend: str | None = None, impl: str | None = None, block_m: int | None = None,
                 block_n: int | None = None, block_k: int | None = None, num_warps: int | None = None,
                 num_stages: int | None = None,
                 stack_index: jax.Array | None = None) -> jax.Array:
    """The SwiGLU output of every (token, pick) pair before the combine -> [T, k, D] in the
    activation dtype, each token's picks in ascending expert id (ties in the given order: every
    path sorts stably). Expert parallelism sums these across devices (`model/expert_parallel.py`).

    backend "xla" (or numerics.gemm_blocks) -> the reference's per-token loop; "pallas" -> `impl`
    ("pallas" | "gemv" | "ragged_dot" | "dense" | "capacity" | "mgpu"; None = `choose_impl`, the fastest exact
    one measured on the H200). Launch parameters default to `launch_config(block_m, coded)` (its
    gate/up column block too, unless block_n sets both); for
    "capacity", block_m is the rows per expert and round (default `capacity_rows`). (Each tile's
    product computed as its transpose, the weight the MMA's first operand, was measured slower on
    the H200 for FP8 rows at 32-8,192 tokens and removed: BENCHMARKS.md, 2026-12-05.)

    stack_index: w1/w3/w2 are [L, E, ...] stacks (a scanned run's, `v41_jax/model/layer_runs.py`)
    and this traced int32 picks the layer. The reference loop and the grouped / GEMV / Mosaic
    kernels read the layer's experts in place (ids offset into the flattened [L * E] stack); the
    XLA alternatives that take a whole [E] block (ragged_dot, dense, capacity) get a sliced copy."""
    base = None
    if stack_index is not None:
        n_exp, base = w1.shape[1], stack_index.astype(jnp.int32) * w1.shape[1]
        w1, w3, w2 = (jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), w_) for w_ in (w1, w3, w2))
    if _backend.resolve(backend) == "xla" or numerics.gemm_blocks:
        return ref.routed_pairs(x, idx, w, w1, w3, w2, numerics, swiglu_limit, *(() if base is None else (base,)))
    if base is None:
        n_exp = w1.shape[0]
    impl = impl or auto_impl(x.shape[0], w1, w3, w2, numerics)
    kw = dict(numerics=numerics, limit=float(swiglu_limit))
    if impl in ("ragged_dot", "dense", "capacity") and base is not None:
        w1, w3, w2 = (jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, base, n_exp), w_)
                      for w_ in (w1, w3, w2))
    if impl == "ragged_dot":
        return _routed_ragged_dot(x, idx, w, w1, w3, w2, **kw)
    if impl == "dense":
        return _routed_dense(x, idx, w, w1, w3, w2, **kw)
    if impl == "capacity":
        return _routed_capacity(x, idx, w, w1, w3, w2, **kw, capacity=block_m or capacity_rows(idx.size, n_exp))
    kw.update(n_exp=n_exp)
    if impl == "mgpu":
        if not mgpu_ok(w1, w3, w2, numerics):
            raise ValueError("impl='mgpu' takes bf16 experts and bf16 activations; held FP8 / FP4 "
                             "experts and fp32 numerics take impl='pallas'")
        # off an NVIDIA Hopper GPU (CPU tests) the GEMMs run as their jnp reference
        return _routed_mgpu(x, idx, w, w1, w3, w2, base, **kw, tile_m=block_m or 256, steps=num_stages or 3,
                            reference=not _backend.mosaic_gpu())
    d, f = x.shape[1], w1.shape[1]

    def fit(default: int) -> int:
        """The largest power of two <= default dividing both D and F: each tile size splits D in
        one GEMM and F in the other (D=256, F=96 takes 32, where min(default, D, F) = 96 does not
        divide D)."""
        t = default
        while t > 1 and (d % t or f % t):
            t //= 2
        return t

    def tiles(bn: int, bk: int) -> dict:
        if d % bn or f % bn or d % bk or f % bk:
            raise ValueError(f"D={d}, F={f}: need multiples of block_n={bn} and block_k={bk}")
        if min(bn, bk) < 16:
            raise ValueError(f"D={d}, F={f}: no tile of >= 16 (Triton's smallest dot) divides both; "
                             "use the XLA fallback (V41_KERNELS=xla)")
        if any(isinstance(w_, Fp4Weight) for w_ in (w1, w3, w2)) and bk % 32:
            raise ValueError(f"FP4 experts: block_k={bk} must cover whole 32-input scale groups")
        return dict(bn=bn, bk=bk)

    if impl == "gemv":
        # 32 x 256 weight tiles, 8 warps: the fastest of the H200 sweep at 1 and 8 tokens
        return _routed_gemv(x, idx, w, w1, w3, w2, base, **tiles(block_n or fit(32), block_k or fit(256)),
                            num_warps=num_warps or 8, num_stages=num_stages or 3,
                            interpret=_backend.interpret(), **kw)
    if impl != "pallas":
        raise ValueError(f"impl: {impl!r} is not one of {IMPLS}")
    bm = block_m or default_block_m(idx.size, n_exp)
    cfg = launch_config(bm, coded=any(isinstance(w_, (Fp8RowWeight, Fp4Weight)) for w_ in (w1, w3, w2)))
    return _routed_pallas(x, idx, w, w1, w3, w2, base, bm=bm,
                          **tiles(block_n or fit(cfg["block_n"]), block_k or fit(cfg["block_k"])),
                          num_warps=num_warps or cfg["num_warps"],
                          num_stages=num_stages or cfg["num_stages"],
                          # an explicit block_n sets both kernels' column blocks
                          bn_gate_up=None if block_n or not cfg["gate_up_block_n"] else fit(cfg["gate_up_block_n"]),
                          interpret=_backend.interpret(), **kw)
