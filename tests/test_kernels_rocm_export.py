"""ROCm readiness without AMD hardware: every kernel, at real V4.1 widths, is exported for the
`rocm` platform with jax.export and must lower to the Triton custom call (the Pallas Triton
lowering runs at export time, so a kernel the Triton path cannot express fails here).
The Triton custom call is not on export's stable list, hence the one disabled check.
A pallas_call without Triton compiler params is refused for ROCm (it would go to Mosaic GPU):
that is why every kernel passes `compiler_params` explicitly.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl

from kernels_pallas._compat import TRITON_CUSTOM_CALL
from kernels_pallas.hc_expand import _expand_collapse_pallas
from kernels_pallas.indexer import _index_scores_pallas
from kernels_pallas.moe import _routed_gemv, _routed_pallas, dispatch_rows
from kernels_pallas.rmsnorm import _rms_inv_pallas
from kernels_pallas.rope import _rope_pallas
from kernels_pallas.sinkhorn import _sinkhorn_pallas
from kernels_pallas.sparse_attn import _sparse_attn_pallas, launch_config
from v41_jax.model.numerics import Numerics
from v41_jax.quant import Fp4Weight, Fp8RowWeight

S = jax.ShapeDtypeStruct
BF16, I32, F32, U8 = jnp.bfloat16, jnp.int32, jnp.float32, jnp.uint8
ALLOW_TRITON = [jax.export.DisabledSafetyCheck.custom_call(TRITON_CUSTOM_CALL)]


def _export_rocm(fn, *args):
    return jax.export.export(jax.jit(fn), platforms=["rocm"], disabled_checks=ALLOW_TRITON)(*args)


def _triton_calls(exported) -> int:
    return exported.mlir_module().count(f"custom_call @{TRITON_CUSTOM_CALL}")


@pytest.mark.parametrize("t,splits,loads", [(8, 1, {}), (8, 2, {}), (32, 2, {}), (128, 1, {}),
                                            (128, 2, dict(prefetch_ids=True)), (64, 1, {}), (64, 2, {}),
                                            (64, 2, dict(head_block=64, num_warps=4, num_stages=3,
                                                         prefetch_ids=False, value_parts=2, lane_pairs=False)),
                                            (32, 2, dict(lane_pairs=True)), (32, 2, dict(value_parts=2))])
@pytest.mark.parametrize("kv_rows", ["bf16", "packed"])
def test_sparse_attn_lowers_for_rocm(t, splits, loads, kv_rows):
    # H=64, Dh=512, window 128 + 512 compressed ids; every launch config `launch_config` gives
    # (16-head programs, merging their 2 splits in the kernel, value halves at 64 tokens, 64-head
    # 8-warp programs, and for packed rows those from 32 tokens, as lane pairs from 64), a
    # load-placement variant, packed rows in value halves, the rows as lane pairs, and value halves
    # merged in the kernel; rows typed, or packed (window FP8, compressed FP4)
    launch = {**launch_config(t, packed=kv_rows == "packed"), **loads}
    launch.setdefault("merge_in_kernel", None)
    f = functools.partial(_sparse_attn_pallas, scale=512 ** -0.5, bf16_probs=True,
                          num_splits=splits, interpret=False, **launch)
    rows = ((S((4096, 512), BF16), S((65536, 512), BF16)) if kv_rows == "bf16"
            else (S((4096, 512 + 16), U8), S((65536, 256 + 32), U8)))
    e = _export_rocm(f, S((t, 64, 512), BF16), S((64,), F32), rows, (S((t, 128), I32), S((t, 512), I32)))
    assert e.platforms == ("rocm",)
    assert _triton_calls(e) == 1


@pytest.mark.parametrize("with_cand, packed, tiles, block", [(False, False, 4, 4), (True, False, 1, 1),
                                                           (False, True, 8, 4), (False, False, 8, 1)])
def test_indexer_lowers_for_rocm(with_cand, packed, tiles, block):
    """Typed and packed FP4 key planes (decoded in the kernel), one tile and several a program,
    query blocks of 4 tokens (a pass per request a block) and of one (the step's default; the
    candidates' only)."""
    t = 24
    cand = S((t, 2048), I32) if with_cand else None
    keys = S((512, 256, 68), jnp.uint8) if packed else S((512, 256, 128), BF16)
    f = functools.partial(_index_scores_pallas, ts=block, tn=128, tp=tiles, bs=8, dt=BF16,
                          num_warps=4, num_stages=2, interpret=False)
    e = _export_rocm(f, S((t, 32, 128), BF16), S((t, 32), BF16), keys, S((4, 64), I32), S((t,), I32),
                     S((t,), I32), cand)
    assert _triton_calls(e) == 1


def _experts(held: str, e_: int, d: int, f_: int):
    """w1, w3, w2 shape structs: bf16 as dequantized, FP4 as published (codes + E8M0 scales), or
    FP8 rows (E4M3 codes + an fp32 scale per row)."""
    def one(n, k):
        if held == "bf16":
            return S((e_, n, k), BF16)
        if held == "fp8":
            return Fp8RowWeight(S((e_, n, k), U8), S((e_, n), F32))
        return Fp4Weight(S((e_, n, k // 2), U8), S((e_, n, k // 32), U8))
    return one(f_, d), one(f_, d), one(d, f_)


@pytest.mark.parametrize("held", ["bf16", "fp8", "fp4"])
@pytest.mark.parametrize("bm", [16, 128])   # decode- and 2K-token tiles (gate/up on 64 columns)
def test_moe_lowers_for_rocm(bm, held):
    t, d, f_, e_, k = 64, 5120, 2304, 64, 6
    fn = functools.partial(_routed_pallas, numerics=Numerics.fast(), limit=10.0, bm=bm, bn=128,
                           bk=64, num_warps=4, num_stages=3, interpret=False, bn_gate_up=64 if bm == 128 else None)
    e = _export_rocm(fn, S((t, d), BF16), S((t, k), I32), S((t, k), F32), *_experts(held, e_, d, f_))
    assert _triton_calls(e) == 2          # gate/up and down


@pytest.mark.parametrize("held", ["bf16", "fp8", "fp4"])
def test_moe_gemv_lowers_for_rocm(held):
    t, d, f_, e_, k = 1, 5120, 2304, 64, 6
    fn = functools.partial(_routed_gemv, numerics=Numerics.fast(), limit=10.0, bn=32, bk=256,
                           num_warps=4, num_stages=3, interpret=False)
    e = _export_rocm(fn, S((t, d), BF16), S((t, k), I32), S((t, k), F32), *_experts(held, e_, d, f_))
    assert _triton_calls(e) == 2          # gate/up and down


def test_moe_dispatch_lowers_for_rocm():
    """The Mosaic path's row dispatch is a Triton kernel too (the GEMMs after it are NVIDIA-only)."""
    fn = functools.partial(dispatch_rows, tile_m=256, interpret=False)
    e = _export_rocm(fn, S((112,), I32), S((112 * 256,), I32), S((2048, 5120), BF16))
    assert _triton_calls(e) == 1


@pytest.mark.parametrize("t,bt,exact", [(1, 1, True), (4096, 32, True), (37, 32, True), (37, 32, False)])
def test_sinkhorn_lowers_for_rocm(t, bt, exact):
    """The fp64 divisions (`_ieee.div_rn`) lower through Triton for ROCm too, and the fast policy's
    fp32 reciprocal; rows past T masked."""
    fn = functools.partial(_sinkhorn_pallas, iters=20, eps=1e-6, block_rows=bt, num_warps=1, interpret=False,
                           exact=exact)
    e = _export_rocm(fn, S((t, 16), F32))
    assert _triton_calls(e) == 1


@pytest.mark.parametrize("t,d,bt,dt", [(1, 20480, 1, F32), (37, 5120, 4, BF16), (3, 1000, 1, BF16)])
def test_rmsnorm_lowers_for_rocm(t, d, bt, dt):
    """The mHC width (4 x 5120, fp32) and the hidden width (bf16); the fp64 division and square
    root lower through Triton for ROCm too; a width with a masked rest; rows past T masked."""
    fn = functools.partial(_rms_inv_pallas, eps=1e-20, block_rows=bt, interpret=False)
    e = _export_rocm(fn, S((t, d), dt))
    assert _triton_calls(e) == 1


@pytest.mark.parametrize("t,heads,width,inverse", [(8192, 64, 512, False), (37, 64, 512, True), (5, 1, 512, False)])
def test_rope_lowers_for_rocm(t, heads, width, inverse):
    """The attention's queries and outputs (64 heads of 512 lanes, the last 64 rotated), rows past
    the last block masked, one head (a KV row's layout)."""
    fn = functools.partial(_rope_pallas, heads=heads, inverse=inverse, interpret=False)
    e = _export_rocm(fn, S((t, heads * width), BF16), S((t, 32), F32), S((t, 32), F32))
    assert _triton_calls(e) == 1


@pytest.mark.parametrize("t,d,bt,bd", [(8192, 5120, 8, 128), (1, 5120, 8, 128), (37, 300, 8, 256)])
def test_hc_expand_lowers_for_rocm(t, d, bt, bd):
    """The mHC expand + collapse at the hidden width (4 streams), a prefill and one decode row,
    then rows and columns past the last block masked."""
    fn = functools.partial(_expand_collapse_pallas, bt=bt, bd=bd, warps=4, interpret=False)
    e = _export_rocm(fn, S((t, d), BF16), S((t, 4 * d), BF16), S((t, 4), F32), S((t, 16), F32), S((t, 4), F32))
    assert _triton_calls(e) == 1


def test_pallas_call_without_triton_params_is_refused_for_rocm():
    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 2

    def f(x):
        return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x)

    if jax.__version_info__[:2] == (0, 10):   # CI's jax: routed to Mosaic GPU, which refuses ROCm
        with pytest.raises(ValueError, match="ROCm"):
            _export_rocm(f, S((16, 16), F32))
    else:  # other releases choose differently (0.12 defaults to Triton); never silently non-Triton
        try:
            e = _export_rocm(f, S((16, 16), F32))
        except ValueError as err:
            assert "ROCm" in str(err)
        else:
            assert _triton_calls(e) == 1


@pytest.mark.parametrize("m, n, k, x_dtype", [(1, 1280, 5120, BF16), (8, 32768, 1280, BF16),
                                             (40, 2304, 5120, BF16), (64, 5120, 2304, BF16), (4, 512, 5120, F32)])
def test_dense_fp8_lowers_for_rocm(m, n, k, x_dtype):
    """The dense FP8 linear at the model's query / output / shared-expert widths: one row
    (elementwise products), MMA rows in bf16 (40 rows: padded to 64, a power of two) and in fp32."""
    from kernels_pallas.dense_fp8 import _dense_fp8_pallas
    f = functools.partial(_dense_fp8_pallas, interpret=False)
    e = _export_rocm(f, S((m, k), x_dtype), S((n, k), U8), S((n // 32, k // 32), U8))
    assert _triton_calls(e) == 1


@pytest.mark.parametrize("m", [1, 8])
def test_grouped_dense_fp8_lowers_for_rocm(m):
    """The block-diagonal form at the released `wo_a` (8 groups of 1,024 rows over 4,096 inputs)."""
    from kernels_pallas.dense_fp8 import _dense_fp8_pallas
    f = functools.partial(_dense_fp8_pallas, groups=8, interpret=False)
    e = _export_rocm(f, S((m, 8 * 4096), BF16), S((8 * 1024, 4096), U8), S((8 * 1024 // 32, 4096 // 32), U8))
    assert _triton_calls(e) == 1
