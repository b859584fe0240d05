"""Optional NVIDIA (Hopper) fast path for the routed experts' grouped GEMM: Pallas Mosaic GPU.

The Triton grouped GEMM (`kernels_pallas.moe`) stays the portable path (CUDA and ROCm). This one
adds what Triton's lowering does not give on Hopper: warp specialisation. Per SM, one persistent
CTA of three warpgroups: a memory warpgroup issues TMA loads of the next K steps into a
`steps`-deep shared-memory ring while two compute warpgroups run wgmma on the current one (they
split the CTA's block by rows or by columns), so weight streaming and MMA overlap instead of
alternating. H200, 2K tokens x top-6 of 64 experts: 51-53% of the measured bf16 GEMM peak
against the Triton path's 45-50% (BENCHMARKS.md).

Layout: the expert-sorted pairs are dispatched into tile-aligned rows (each expert's group padded
to whole `tile_m` tiles, `moe.tile_table` / `moe.dispatch_rows`), so every tile is one expert and
one rectangular TMA block; tiles past the live count are skipped. Two kernels:
  grouped_swiglu  x_pad [M_pad, D] with w1, w3 [E, F, D] -> a [M_pad, F] bf16, the SwiGLU
                  epilogue fused (two fp32 accumulators per warpgroup)
  grouped_matmul  x_pad [M_pad, K] @ w[e]^T, w [E, N, K] (the checkpoint's layout) -> bf16
Rounding points are the Triton path's: fp32 accumulation, g / u / a / y rounded to bf16; the fp8
fake-quant of a between them stays in XLA. Each has a pure-jnp reference (`*_ref`), which the
CPU tests run in its place.

bf16 experts only (held FP8 / FP4 experts take the Triton path, which decodes them in registers).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernels_pallas import reference as ref

try:   # the Mosaic GPU dialect ships with jaxlib; lowering works without a GPU (jax.export)
    from jax.experimental.pallas import mosaic_gpu as plgpu
except ImportError:  # pragma: no cover - a jax without Mosaic GPU
    plgpu = None

_N_MINOR = 1   # planar_snake: the column index runs fastest (a tile's rows stay in L2)


def _num_sms() -> int:
    return getattr(jax.devices()[0], "core_count", 132) or 132


def _swizzled(cols: int, dtype) -> tuple:
    """Shared-memory transforms for a tile whose rows hold `cols` elements of `dtype`."""
    swizzle = plgpu.find_swizzle(cols * jnp.dtype(dtype).itemsize * 8)
    return (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)),
            plgpu.SwizzleTransform(swizzle))


def _silu_glu(g, u, wt, limit: float):
    """fp32 g, u (GEMM outputs), wt (routing weight per row) -> bf16 a, as `moe._swiglu_epilogue`:
    g and u rounded to bf16 first, then the reference's `swiglu` in fp32."""
    g, u = (v.astype(jnp.bfloat16).astype(jnp.float32) for v in (g, u))
    return ref.swiglu(g, u, limit, wt).astype(jnp.bfloat16)


def _wg_tile(tile_m: int, tile_n: int, split: str) -> tuple[int, int]:
    """A compute warpgroup's share of the CTA's [tile_m, tile_n] block."""
    if split not in ("m", "n"):
        raise ValueError(f"grouped_matmul: split={split!r} is not 'm' or 'n'")
    return (tile_m // 2, tile_n) if split == "m" else (tile_m, tile_n // 2)


def preset(tile_m: int) -> dict:
    """Launch per dispatch-tile height, from the H200 sweeps (BENCHMARKS.md): 256-row CTAs split
    by rows (each warpgroup 128 x 128 for the down GEMM, 128 x 64 x 2 accumulators for gate/up);
    shorter tiles split by columns."""
    if tile_m >= 256:
        return dict(split="m", down_n=128, glu_n=64)
    return dict(split="n", down_n=256, glu_n=128)


def _kernel(te_gmem, *refs, glu, tile_m, tile_n, tile_k, split, steps, epi, snake, limit):
    """refs = (x_gmem, w_gmem, out_gmem): out = x @ w[e]^T; with `glu`, (wt_gmem, x_gmem, w1_gmem,
    w3_gmem, out_gmem): out = the SwiGLU of x @ w1[e]^T and x @ w3[e]^T with routing weights
    wt_gmem [M_pad, epi] (each row one weight repeated, so an epilogue tile reads it in the
    accumulator's own shape). A CTA computes a [tile_m, tile_n] block; its two compute
    warpgroups split it by rows (split "m") or by columns ("n")."""
    wt_gmem, x_gmem, *w_gmems, out_gmem = refs if glu else (None, *refs)
    m_pad, k = x_gmem.shape
    n = w_gmems[0].shape[1]
    m_iters, n_iters = m_pad // tile_m, n // tile_n
    wg_m, wg_n = _wg_tile(tile_m, tile_n, split)
    tr = _swizzled(tile_k, x_gmem.dtype)

    def pipeline(body, context):
        b_spec = plgpu.BlockSpec((tile_n, tile_k), lambda kk: (0, kk), transforms=tr, memory_space=plgpu.SMEM)
        return plgpu.emit_pipeline_warp_specialized(
            body, grid=(k // tile_k,), memory_registers=40, wg_axis="wg", num_compute_wgs=2,
            max_concurrent_steps=steps, compute_context=context,
            in_specs=[plgpu.BlockSpec((tile_m, tile_k), lambda kk: (0, kk), transforms=tr,
                                      memory_space=plgpu.SMEM)] + [b_spec] * len(w_gmems))

    ignore = lambda *_, **__: None

    @functools.partial(
        pl.run_scoped,
        allocs=pipeline(ignore, ignore).get_allocations(x_gmem, *(w.at[0] for w in w_gmems)),
        out_smem=plgpu.SMEM((2, 2, epi, epi), out_gmem.dtype, transforms=_swizzled(epi, out_gmem.dtype)),
        wt_smem=plgpu.SMEM((2, epi, epi), jnp.float32) if glu else None,
        wt_barrier=plgpu.Barrier(num_barriers=2) if glu else None,
        collective_axes="wg")
    def _scope(allocs, out_smem, wt_smem, wt_barrier):
        wg = jax.lax.axis_index("wg")
        wg_rows = pl.ds(wg * wg_m, wg_m) if split == "m" else slice(None)     # of the CTA block
        wg_cols = pl.ds(wg * wg_n, wg_n) if split == "n" else slice(None)
        row0 = wg * wg_m if split == "m" else 0
        col0 = wg * wg_n if split == "n" else 0

        @plgpu.nd_loop((m_iters * n_iters,), collective_axes="sm")
        def _tiles(info):
            (lin,) = info.index
            mi, ni = plgpu.planar_snake(lin, (m_iters, n_iters), _N_MINOR, snake)
            e = te_gmem[mi]
            rows = pl.ds(mi * tile_m, tile_m)

            @pl.when(e >= 0)
            def _live():
                def context(eval_pipeline):
                    @functools.partial(pl.run_scoped,
                                       accs=[plgpu.ACC((wg_m, wg_n), jnp.float32) for _ in w_gmems])
                    def _acc(accs):
                        eval_pipeline(accs)
                        vals = [acc[...] for acc in accs]
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                        for i in range(wg_m // epi):
                            r0 = mi * tile_m + row0 + i * epi
                            if glu:   # this row block's routing weights
                                plgpu.copy_gmem_to_smem(wt_gmem.at[pl.ds(r0, epi)], wt_smem.at[wg],
                                                        wt_barrier.at[wg])
                                plgpu.barrier_wait(wt_barrier.at[wg])
                            for j in range(wg_n // epi):
                                blk = [v[i * epi:(i + 1) * epi, j * epi:(j + 1) * epi] for v in vals]
                                out = (_silu_glu(*blk, wt_smem[wg], limit) if glu
                                       else blk[0].astype(out_gmem.dtype))
                                slot = (i * (wg_n // epi) + j) % 2
                                plgpu.wait_smem_to_gmem(1, wait_read_only=True)
                                out_smem[wg, slot] = out
                                plgpu.commit_smem()
                                plgpu.copy_smem_to_gmem(
                                    out_smem.at[wg, slot],
                                    out_gmem.at[pl.ds(r0, epi), pl.ds(ni * tile_n + col0 + j * epi, epi)])

                def mma(_, a_smem, *rest):
                    *b_smems, accs = rest
                    for acc, b_smem in zip(accs, b_smems):
                        plgpu.wgmma(acc, a_smem.at[wg_rows], b_smem.at[wg_cols].transpose((1, 0)))
                    plgpu.wgmma_wait(0)
                    return accs

                pipeline(mma, context)(x_gmem.at[rows, :],
                                       *(w.at[e, pl.ds(ni * tile_n, tile_n), :] for w in w_gmems),
                                       allocations=allocs)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _launch(kernel_args, out_shape, **kw):
    return plgpu.kernel(
        functools.partial(_kernel, **kw), out_type=out_shape,
        grid=(_num_sms(),), grid_names=("sm",), num_threads=3, thread_name="wg",
        kernel_name="moe_mgpu_gate_up" if kw["glu"] else "moe_mgpu_down",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )(*kernel_args)


def _check_tiles(x_pad, ws, tile_m, tile_n, tile_k, split, epi):
    m_pad, k = x_pad.shape
    n = ws[0].shape[1]
    wg_m, wg_n = _wg_tile(tile_m, tile_n, split)
    if any(w.dtype != x_pad.dtype or w.shape[2] != k for w in ws):
        raise ValueError(f"grouped_matmul: x {x_pad.shape} {x_pad.dtype} vs w "
                         f"{[(w.shape, str(w.dtype)) for w in ws]}")
    if m_pad % tile_m or n % tile_n or k % tile_k or wg_m % epi or wg_n % epi or wg_m % 64:
        raise ValueError(f"grouped_matmul: M={m_pad}, N={n}, K={k} do not tile by {tile_m} x "
                         f"{tile_n} x {tile_k} (split {split}: {wg_m} x {wg_n} per warpgroup, "
                         f"a multiple of 64 rows and of the {epi}-wide epilogue)")


_STATIC = ("tile_m", "tile_n", "tile_k", "split", "steps", "epi", "snake")


@functools.partial(jax.jit, static_argnames=_STATIC)
def grouped_matmul(x_pad: jax.Array, w: jax.Array, tile_expert: jax.Array, *, tile_m: int = 256,
                   tile_n: int = 128, tile_k: int = 64, split: str = "m", steps: int = 3,
                   epi: int = 64, snake: int = 16) -> jax.Array:
    """x_pad [M_pad, K] bf16 (tile i = rows [i*tile_m, (i+1)*tile_m), all one expert), w [E, N, K]
    bf16, tile_expert [M_pad / tile_m] int32 (-1 = no rows) -> [M_pad, N] bf16 (fp32 accumulation);
    the rows of skipped tiles are left unwritten."""
    epi = min(epi, _wg_tile(tile_m, tile_n, split)[1])
    _check_tiles(x_pad, [w], tile_m, tile_n, tile_k, split, epi)
    return _launch((tile_expert, x_pad, w), jax.ShapeDtypeStruct((x_pad.shape[0], w.shape[1]), x_pad.dtype),
                   glu=False, tile_m=tile_m, tile_n=tile_n, tile_k=tile_k, split=split, steps=steps,
                   epi=epi, snake=snake, limit=0.0)


@functools.partial(jax.jit, static_argnames=_STATIC + ("limit",))
def grouped_swiglu(x_pad: jax.Array, w1: jax.Array, w3: jax.Array, row_weight: jax.Array,
                   tile_expert: jax.Array, *, limit: float, tile_m: int = 256, tile_n: int = 64,
                   tile_k: int = 64, split: str = "m", steps: int = 3, epi: int = 64,
                   snake: int = 16) -> jax.Array:
    """The gate/up GEMMs with the SwiGLU epilogue: row_weight [M_pad] fp32 -> bf16 [M_pad, F]
    a = bf16(row_weight * silu(min(g, limit)) * clip(u, ±limit)), g, u = bf16(x @ w1[e]^T),
    bf16(x @ w3[e]^T). Two fp32 accumulators per warpgroup, so half the columns of
    `grouped_matmul` per tile."""
    epi = min(epi, _wg_tile(tile_m, tile_n, split)[1])
    _check_tiles(x_pad, [w1, w3], tile_m, tile_n, tile_k, split, epi)
    wt = jnp.broadcast_to(row_weight.astype(jnp.float32)[:, None], (x_pad.shape[0], epi))
    return _launch((tile_expert, wt, x_pad, w1, w3), jax.ShapeDtypeStruct((x_pad.shape[0], w1.shape[1]), x_pad.dtype),
                   glu=True, tile_m=tile_m, tile_n=tile_n, tile_k=tile_k, split=split, steps=steps,
                   epi=epi, snake=snake, limit=limit)


def grouped_matmul_ref(x_pad: jax.Array, w: jax.Array, tile_expert: jax.Array, *, tile_m: int = 256,
                       **_) -> jax.Array:
    """Pure-jnp `grouped_matmul` (skipped tiles give 0 here instead of being left unwritten)."""
    xt = x_pad.reshape(tile_expert.shape[0], tile_m, -1)
    we = w[jnp.maximum(tile_expert, 0)]                               # [tiles, N, K]
    out = jnp.einsum("tmk,tnk->tmn", xt, we, preferred_element_type=jnp.float32)
    out = jnp.where((tile_expert >= 0)[:, None, None], out, 0)
    return out.astype(x_pad.dtype).reshape(x_pad.shape[0], -1)


def grouped_swiglu_ref(x_pad: jax.Array, w1: jax.Array, w3: jax.Array, row_weight: jax.Array,
                       tile_expert: jax.Array, *, limit: float, tile_m: int = 256, **_) -> jax.Array:
    """Pure-jnp `grouped_swiglu` (skipped tiles give 0)."""
    g, u = (grouped_matmul_ref(x_pad, w, tile_expert, tile_m=tile_m).astype(jnp.float32) for w in (w1, w3))
    return _silu_glu(g, u, row_weight.astype(jnp.float32)[:, None], limit)
