"""Optional NVIDIA (Hopper) sparse latent attention: Pallas Mosaic GPU, rows gathered by TMA.

The portable kernel (`kernels_pallas.sparse_attn`, Triton lowering) gathers a chunk's rows with
per-thread loads and computes in the same warps, so gathers and MMAs alternate; at 32 decode
tokens it reaches ~90 TFLOP/s on an H100 (BENCHMARKS.md). This one specialises warps: per CTA
(one token, one split of its chunk list) a memory warpgroup copies each chunk's 64 rows into a
shared-memory ring while two compute warpgroups run wgmma on the previous chunk.

Hopper has no gather TMA (sm_100's gather4), so a row is copied as 8 TMA boxes of [1, 64] bf16
(128 B: a 128-byte-swizzled row segment of the [64, 512] tile's (8, 64) tiling), written through
an untiled alias of the tile's memory, 512 boxes a chunk; the memory warpgroup's 4 warps each issue
16 rows'. Measured as a pure gather (H100, 2026-12-06, BENCHMARKS.md): 2.6-3.8 us a chunk a CTA,
1.5-2.4 TB/s over the GPU, bit-exact tiles. A skipped id (negative) copies the row one past the
source's end: TMA fills an out-of-bounds box with zeros, so a skipped row is 0, never an unwritten
page's NaN, and a -inf bias on its logit gives it probability 0.

Measured (BENCHMARKS.md g, h; ms a layer at the bench's decode shapes): equal to the Triton
kernel at 128 tokens (H100 58.4 vs 58.9 µs, H200 60.3 vs 58.4), slower at 32 (H100 30.6 with 4
splits vs 27.3; H200 35.7 vs 29.1) and 64 (H200 43.0 with 2 splits vs 38.2), so it is not the
default (`sparse_attn_paged(impl="mgpu")` asks for it). Each compute warpgroup computes the logits
of half the chunk's rows (both halves meet in a shared-memory tile), which took the wgmma work a
warpgroup from 6.3 to 4.2 MFLOP a chunk and changed nothing (H200, same call): with its compute
warpgroups idle the kernel takes as long at 32 tokens (30.1 µs, H100), where the split merge, the
ids' preparation and the q and partials' traffic decide; at 128 tokens its memory path alone takes
43.5 µs and the compute adds ~15 on top instead of hiding under it (a 2-deep ring: 64 KiB of q in
shared memory leave no room for a third slot).

Numerics are the portable kernel's: logits fp32 (wgmma, bf16 products exact), the online softmax
in fp32 per 64-row chunk in the reference's order, probabilities rounded to bf16 for P.V relative
to the running max, the sink in the denominator at the end; splits write fp32 partials (m, l, acc)
that `split_merge.merge_splits` combines. Each compute warpgroup owns 256 of the 512 output
columns; the logits of a row are one wgmma over all of D (by the warpgroup owning that row half),
so both warpgroups read the same values.

Scope: bf16 rows and queries (typed cache rows; packed rows take the Triton kernel), 64 heads
(fewer are padded), D = 512 (the model's latent), probabilities rounded to bf16 (the reference
numerics and the fast policy). `supported` says whether a call qualifies.
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kernels_pallas.reference import CHUNK, NO_MAX
from kernels_pallas.split_merge import merge_splits

try:   # the Mosaic GPU dialect ships with jaxlib; lowering works without a GPU (jax.export)
    from jax.experimental.pallas import mosaic_gpu as plgpu
except ImportError:  # pragma: no cover - a jax without Mosaic GPU
    plgpu = None

HEADS = 64          # a warpgroup's wgmma M: every head of a token in one CTA
D = 512             # latent width: 8 column tiles of 64, two warpgroups of 256 output columns
SEG = 64            # bf16 lanes of one TMA box: one 128-byte swizzle row
WG_COLS = D // 2
HALF = CHUNK // 2   # chunk rows whose logits one compute warpgroup computes (the other's read from smem)
STEPS = 2           # ring depth: q (64 KiB) + 2 x 64 KiB rows fill ~200 of 227 KiB of smem
ISSUE_WARPS = 4     # warps of the memory warpgroup issuing row copies (4x one thread's rate)


def supported(q: jax.Array, rows: Sequence[jax.Array]) -> bool:
    """Whether this kernel takes a call: bf16 q [T, H <= 64, 512] and bf16 typed rows."""
    return (plgpu is not None and q.dtype == jnp.bfloat16 and q.shape[-1] == D
            and q.shape[-2] <= HEADS and all(r.dtype == jnp.bfloat16 and r.shape[-1] == D for r in rows))


def default_splits(tokens: int, n_chunks: int) -> int:
    """Splits: 4 up to 32 tokens (32 x 4 = 128 CTAs for 132 SMs), 2 up to 64, none past (a CTA a
    token). H200, 2026-12-06 h1, ms a layer: 32 tokens 0.0574 / 0.0385 / 0.0354 / 0.0526 with
    1 / 2 / 4 / 8 splits, 64 tokens 0.0579 / 0.0430 / 0.0605 / 0.0865, 128 tokens 0.0597 / 0.0773
    / 0.1110 / 0.1510; other token counts not measured."""
    return max(1, min(4 if tokens <= 32 else 2 if tokens <= 64 else 1, n_chunks))


def _tile_transforms(dtype) -> tuple:
    """A [rows, cols] smem tile as wgmma and TMA want it: (8, 128 B) tiles, 128-byte swizzle."""
    lanes = 128 // jnp.dtype(dtype).itemsize
    return plgpu.TilingTransform((8, lanes)), plgpu.SwizzleTransform(128)


def ring_views(steps: int) -> tuple:
    """A `steps`-deep ring of [64, 512] bf16 row tiles, two views of the same bytes for a
    `plgpu.RefUnion`: the tiled, swizzled tiles wgmma reads, and the untiled [slot, row tile,
    column tile, row, 64 lanes] a 1-row TMA box writes (`copy_rows`)."""
    return (plgpu.SMEM((steps, CHUNK, D), jnp.bfloat16, transforms=_tile_transforms(jnp.bfloat16)),
            plgpu.SMEM((steps, CHUNK // 8, D // SEG, 8, SEG), jnp.bfloat16,
                       transforms=(plgpu.SwizzleTransform(128),)))


def copy_rows(rows_ref, ids_smem, chunk, raw_slot, barrier, first, count: int) -> None:
    """Rows rows_ref[ids_smem[chunk, j]] for j in [first, first + count) into a ring slot's
    untiled view `raw_slot` at tile rows j, each row as 8 TMA boxes of [1, 64], all arriving on
    `barrier`."""
    @pl.loop(first, first + count)
    def _(j):
        row = ids_smem[chunk, j]
        tile_row, sub = lax.shift_right_logical(j, 3), lax.bitwise_and(j, 7)   # no signed // in warp code
        for seg in range(D // SEG):
            plgpu.copy_gmem_to_smem(rows_ref.at[pl.ds(row, 1), pl.ds(seg * SEG, SEG)],
                                    raw_slot.at[tile_row, seg, pl.ds(sub, 1), :], barrier)


def _kernel(q_ref, sink_ref, ids_ref, bias_ref, *refs, starts: tuple[int, ...], per: int,
            total: int, scale: float, n_splits: int):
    """refs = (*rows_refs, *outs): outs (o [T, 64, D] bf16,) with one split, else (acc [T, P, 64,
    D] fp32, m [T, P, 64], l [T, P, 64])."""
    n_src = len(starts)
    rows_refs, outs = refs[:n_src], refs[n_src:]
    t, s, wg = lax.axis_index("t"), lax.axis_index("s"), lax.axis_index("wg")
    lo = s * per
    n = jnp.minimum(total - lo, per)                                   # this CTA's chunks

    def scoped(ring, q_smem, ids_smem, bias_smem, sink_smem, stat_smem, xchg, rows_bar, consumed, in_bar,
               done_bar, half_bar, read_bar):
        tiles, raw, stage32, stage16 = ring

        def issue(i, slot):
            """Chunk lo + i's 64 rows into ring slot `slot`: 8 boxes a row, 16 rows a warp."""
            c = lo + i

            @pl.core_map(plgpu.WarpMesh(axis_name="warp"))
            def _():
                first = lax.axis_index("warp") * (CHUNK // ISSUE_WARPS)
                for k, rows_ref in enumerate(rows_refs):
                    end = starts[k + 1] if k + 1 < n_src else total

                    @pl.when((c >= starts[k]) & (c < end))
                    def _():
                        copy_rows(rows_ref, ids_smem, i, raw.at[slot], rows_bar.at[slot], first,
                                  CHUNK // ISSUE_WARPS)

        @pl.when(wg == 2)
        def _memory():
            plgpu.set_max_registers(40, action="decrease")
            plgpu.copy_gmem_to_smem(q_ref.at[t], q_smem, in_bar)
            plgpu.copy_gmem_to_smem(ids_ref.at[t, s], ids_smem, in_bar)
            plgpu.copy_gmem_to_smem(bias_ref.at[t, s], bias_smem, in_bar)
            plgpu.copy_gmem_to_smem(sink_ref, sink_smem, in_bar)
            plgpu.barrier_wait(in_bar)

            @pl.loop(0, n)
            def _(i):
                slot = lax.rem(i, STEPS)

                @pl.when(i >= STEPS)
                def _():
                    plgpu.barrier_wait(consumed.at[slot])
                issue(i, slot)

        def compute(w: int):
            """Compute warpgroup w: output columns [w * 256, (w + 1) * 256)."""
            cols = pl.ds(w * WG_COLS, WG_COLS)
            plgpu.set_max_registers(232, action="increase")
            plgpu.barrier_wait(in_bar)
            row_vec = plgpu.Layout.WGMMA.reduce(1)                     # one value a head
            m = plgpu.layout_cast(jnp.full((HEADS,), NO_MAX, jnp.float32), row_vec)
            l = plgpu.layout_cast(jnp.zeros((HEADS,), jnp.float32), row_vec)
            acc = plgpu.layout_cast(jnp.zeros((HEADS, WG_COLS), jnp.float32), plgpu.Layout.WGMMA)

            def own_logits(slot, i):
                """This warpgroup's half of the chunk's rows: scaled logits [H, 32] fp32 with the bias."""
                rows = pl.ds(w * HALF, HALF)

                def qk(acc_ref):
                    plgpu.wgmma(acc_ref, q_smem, plgpu.transpose_ref(tiles.at[slot, rows], (1, 0)))
                    return acc_ref[...]
                logits = pl.run_scoped(qk, plgpu.ACC((HEADS, HALF), jnp.float32))
                bias = plgpu.load(bias_smem.at[i, rows], (), layout=plgpu.Layout.WGMMA.reduce(0))
                return logits * scale + lax.broadcast_in_dim(bias, logits.shape, [1])

            def step(i, carry):
                acc, m, l = carry
                slot = lax.rem(i, STEPS)
                plgpu.barrier_wait(rows_bar.at[slot])
                own = own_logits(slot, i)

                @pl.when(i > 0)   # the other warpgroup has read the last chunk's logits
                def _():
                    plgpu.barrier_wait(read_bar)
                xchg.at[:, pl.ds(w * HALF, HALF)][...] = own
                plgpu.barrier_arrive(half_bar)
                plgpu.barrier_wait(half_bar)
                logits = plgpu.load(xchg, (), layout=plgpu.Layout.WGMMA)          # [H, C]
                plgpu.barrier_arrive(read_bar)
                new_m = jnp.maximum(m, logits.max(axis=1))
                rescale = jnp.exp(m - new_m)
                p = jnp.exp(logits - lax.broadcast_in_dim(new_m, logits.shape, [0]))
                l = l * rescale + p.sum(axis=1)
                acc = acc * lax.broadcast_in_dim(rescale, acc.shape, [0])

                def pv(acc_ref):
                    plgpu.wgmma(acc_ref, p.astype(jnp.bfloat16), tiles.at[slot, :, cols])
                acc = pl.run_state(pv)(plgpu.ACC.init(acc))
                plgpu.barrier_arrive(consumed.at[slot])
                return acc, new_m, l

            acc, m, l = lax.fori_loop(0, n, step, (acc, m, l))
            # both warpgroups past their last wgmma before either stages its output in the ring
            plgpu.barrier_arrive(done_bar)
            plgpu.barrier_wait(done_bar)
            if n_splits == 1:
                (o_ref,) = outs
                sink = plgpu.load(sink_smem, (), layout=row_vec)
                den = l + jnp.exp(sink - m)
                stage16.at[w][...] = (acc / lax.broadcast_in_dim(den, acc.shape, [0])).astype(jnp.bfloat16)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(stage16.at[w], o_ref.at[t, :, cols])
            else:
                acc_ref, m_ref, l_ref = outs
                stage32.at[w][...] = acc
                if w == 0:
                    stat_smem.at[0][...] = m
                    stat_smem.at[1][...] = l
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(stage32.at[w], acc_ref.at[t, s, :, cols])
                if w == 0:
                    plgpu.copy_smem_to_gmem(stat_smem.at[0], m_ref.at[t, s])
                    plgpu.copy_smem_to_gmem(stat_smem.at[1], l_ref.at[t, s])
            plgpu.wait_smem_to_gmem(0)

        pl.when(wg == 0)(lambda: compute(0))
        pl.when(wg == 1)(lambda: compute(1))

    pl.run_scoped(
        scoped,
        plgpu.RefUnion(
            *ring_views(STEPS),
            plgpu.SMEM((2, HEADS, WG_COLS), jnp.float32, transforms=_tile_transforms(jnp.float32)),
            plgpu.SMEM((2, HEADS, WG_COLS), jnp.bfloat16, transforms=_tile_transforms(jnp.bfloat16))),
        plgpu.SMEM((HEADS, D), jnp.bfloat16, transforms=_tile_transforms(jnp.bfloat16)),
        plgpu.SMEM((per, CHUNK), jnp.int32),
        plgpu.SMEM((per, CHUNK), jnp.float32),
        plgpu.SMEM((HEADS,), jnp.float32),
        plgpu.SMEM((2, HEADS), jnp.float32),
        plgpu.SMEM((HEADS, CHUNK), jnp.float32, transforms=_tile_transforms(jnp.float32)),
        plgpu.Barrier(num_arrivals=CHUNK * (D // SEG), num_barriers=STEPS),
        plgpu.Barrier(num_arrivals=2, num_barriers=STEPS),
        plgpu.Barrier(num_arrivals=4),
        plgpu.Barrier(num_arrivals=2),
        plgpu.Barrier(num_arrivals=2),
        plgpu.Barrier(num_arrivals=2),
        collective_axes="wg",
    )


@functools.partial(jax.jit, static_argnames=("scale", "num_splits"))
def sparse_attn_mgpu(q: jax.Array, sink: jax.Array, rows: tuple[jax.Array, ...],
                     idx: tuple[jax.Array, ...], *, scale: float, num_splits: int):
    """q [T, H, 512] bf16 (H <= 64), sink [H] fp32, rows ([R_i, 512] bf16, ...), idx ([T, K_i]
    int32 padded to multiples of 64 with -1, ...) walked in order -> [T, H, 512] bf16; the
    reference numerics of `sparse_attn.sparse_attn_paged` with bf16 probabilities."""
    t, h, _ = q.shape
    q = jnp.pad(q, ((0, 0), (0, HEADS - h), (0, 0)))
    sink_p = jnp.pad(sink.astype(jnp.float32), (0, HEADS - h))
    # a skipped id copies row R_i (one past the end: TMA zero-fills it) and biases its logit -inf
    ids = jnp.concatenate([jnp.where(i >= 0, i, r.shape[0]) for r, i in zip(rows, idx)], axis=1)
    valid = jnp.concatenate([i >= 0 for i in idx], axis=1)
    counts = [i.shape[1] // CHUNK for i in idx]
    starts = tuple(sum(counts[:k]) for k in range(len(counts)))
    total = sum(counts)
    n_splits = max(1, min(num_splits, total))
    per = -(-total // n_splits)
    pad = n_splits * per * CHUNK - ids.shape[1]
    ids = jnp.pad(ids, ((0, 0), (0, pad))).reshape(t, n_splits, per, CHUNK).astype(jnp.int32)
    bias = jnp.pad(jnp.where(valid, 0.0, -jnp.inf).astype(jnp.float32), ((0, 0), (0, pad)),
                   constant_values=-jnp.inf).reshape(t, n_splits, per, CHUNK)
    if n_splits == 1:
        out_type = jax.ShapeDtypeStruct((t, HEADS, D), jnp.bfloat16)
    else:
        out_type = (jax.ShapeDtypeStruct((t, n_splits, HEADS, D), jnp.float32),
                    jax.ShapeDtypeStruct((t, n_splits, HEADS), jnp.float32),
                    jax.ShapeDtypeStruct((t, n_splits, HEADS), jnp.float32))
    out = plgpu.kernel(
        functools.partial(_kernel, starts=starts, per=per, total=total, scale=scale, n_splits=n_splits),
        out_type=out_type, grid=(t, n_splits), grid_names=("t", "s"), num_threads=3, thread_name="wg",
        kernel_name="sparse_latent_attn_mgpu",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
    )(q, sink_p, ids, bias, *rows)
    if n_splits > 1:
        acc, m, l = out
        out = merge_splits(acc, m[:, :, None], l[:, :, None], sink_p, jnp.bfloat16)
    return out[:, :h]
