"""The sparse attention's row gather alone, by TMA (Mosaic GPU, NVIDIA Hopper): how fast can a
decode step's rows reach shared memory when each 1 KiB row is copied as 8 TMA boxes of 128 B
(Hopper has no gather TMA)? The gather of `kernels_pallas.sparse_attn_mgpu` without its MMAs.

    python -m scripts.bench_tma_gather --out gather.json      # a Hopper GPU
    python -m scripts.bench_tma_gather --export               # CPU: lower every variant for CUDA

Per case (tokens x splits: one CTA per token and split, each walking its part of the token's
640 ids, 128 window + 512 compressed rows of a 4 GiB pool, 64 rows a chunk into a 2-deep ring):
device µs per call (jax.profiler), GB/s of rows, and whether the last chunk's tile equals the
rows numpy gathers (the swizzle of a 1-row box). Variants: one issuing thread or 4 issuing warps
(16 rows each), Pallas' automatic barriers on or off.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from kernels_pallas.sparse_attn_mgpu import SEG, copy_rows, ring_views  # noqa: E402
from scripts.bench_common import kernel_profile  # noqa: E402

C, D, IDS = 64, 512, 640


def gather(rows, ids, *, splits: int, warps: int, auto_barriers: bool, steps: int = 2):
    """rows [R, D] bf16, ids [T, 640] -> [T, splits, 64, D]: each CTA's last chunk as gathered."""
    t = ids.shape[0]
    per = IDS // C // splits
    segs = D // SEG

    def kernel(rows_ref, ids_ref, out_ref):
        def scoped(ring, ids_smem, bars, ibar):
            tiles, raw = ring
            ti, si = lax.axis_index("t"), lax.axis_index("s")
            plgpu.copy_gmem_to_smem(ids_ref.at[ti, si], ids_smem, ibar)
            plgpu.barrier_wait(ibar)

            def issue_rows(c, slot, first, n):
                copy_rows(rows_ref, ids_smem, c, raw.at[slot], bars.at[slot], first, n)

            def issue(c, slot):
                if warps == 1:
                    issue_rows(c, slot, 0, C)
                    return

                @pl.core_map(plgpu.WarpMesh(axis_name="warp"))
                def _():
                    issue_rows(c, slot, lax.axis_index("warp") * (C // 4), C // 4)
            for i in range(steps):
                issue(i, i)

            @pl.loop(0, per)
            def _(c):
                slot = c % steps
                plgpu.barrier_wait(bars.at[slot])

                @pl.when(c + steps < per)
                def _():
                    issue(c + steps, slot)
            plgpu.copy_smem_to_gmem(tiles.at[(per - 1) % steps], out_ref.at[ti, si])
            plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(scoped,
                      plgpu.RefUnion(*ring_views(steps)),
                      plgpu.SMEM((per, C), jnp.int32),
                      plgpu.Barrier(num_arrivals=C * segs, num_barriers=steps),
                      plgpu.Barrier(num_arrivals=1))

    return plgpu.kernel(kernel, out_type=jax.ShapeDtypeStruct((t, splits, C, D), jnp.bfloat16),
                        grid=(t, splits), grid_names=("t", "s"),
                        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane,
                                                             unsafe_no_auto_barriers=not auto_barriers),
                        )(rows, ids.reshape(t, splits, per, C))


VARIANTS = [dict(warps=1, auto_barriers=False), dict(warps=4, auto_barriers=False),
            dict(warps=4, auto_barriers=True)]
SHAPES = [(32, 2), (32, 5), (64, 1), (64, 2), (128, 1), (128, 2)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="tma_gather.json")
    ap.add_argument("--export", action="store_true", help="lower every variant for CUDA, run nothing")
    args = ap.parse_args()
    if args.export:
        for kw in VARIANTS:
            jax.export.export(jax.jit(functools.partial(gather, splits=2, **kw)), platforms=["cuda"])(
                jax.ShapeDtypeStruct((4096, D), jnp.bfloat16), jax.ShapeDtypeStruct((32, IDS), jnp.int32))
            print("lowered", kw)
        return
    r = 1 << 22
    rows = jax.random.normal(jax.random.key(2), (r, D), jnp.bfloat16)
    rows_np = np.asarray(rows)
    res = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "cases": []}
    for t, splits in SHAPES:
        rng = np.random.default_rng(t)
        win = (np.arange(t)[:, None] * 133 + np.arange(128)[None]) % 16384
        ids = jnp.asarray(np.concatenate([win, np.sort(rng.integers(0, r, (t, IDS - 128)), axis=1)], 1), jnp.int32)
        for kw in VARIANTS:
            case = dict(tokens=t, splits=splits, **kw)
            try:
                f = jax.jit(functools.partial(gather, splits=splits, **kw))
                got = np.asarray(f(rows, ids))
                last = np.asarray(ids).reshape(t, splits, -1, C)[:, :, -1]
                case["exact"] = bool((got.view(np.uint16) == rows_np[last].view(np.uint16)).all())
                s = kernel_profile(lambda: jax.block_until_ready(f(rows, ids)), 5, top=3)["device_ms_per_call"] * 1e-3
                case.update(us=round(s * 1e6, 2), gb_s=round(t * IDS * D * 2 / s / 1e9, 1))
            except Exception as err:  # one failing variant must not end the run
                case["error"] = f"{type(err).__name__}: {str(err)[:400]}"
            print(case, flush=True)
            res["cases"].append(case)
            with open(args.out, "w") as fh:
                json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
