"""Routed-expert grouped GEMM (Pallas, and the ragged_dot / dense / capacity XLA alternatives) vs the model's
`routed_experts` and the moe_exec.json fixture.

On CPU the kernels run in Pallas interpret mode (outputs start as NaN there; each sorted pair row
is written by exactly one tile, so a finite result proves every row was written); on a GPU the
same tests compile them for real.
Tolerances: each expert output is bf16 (2^-8 relative step) before the fp32 sum; the kernel and
the reference differ only in fp32 summation order inside the GEMMs, which can move a bf16
rounding (of g, u, a or y) by one step, so rtol = 2^-6 with atol = 2^-7 of the largest |y|.
The fp32 policy is held to 1e-5 relative to the largest |y| (fp32 sums of a few hundred terms).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_common import assert_close, fresh_rng, load_fixture
from kernels_pallas import _codecs
from kernels_pallas import moe as kmoe
from kernels_pallas import backend, moe_mgpu
from v41_jax.model import moe as ref
from v41_jax.model.numerics import Numerics
from v41_jax.quant import (Fp4Weight, Fp8RowWeight, dequant_fp4_e4m3_rows, dequant_fp4_rows, dequant_fp8_rows,
                           quant_weight_fp4)

FAST = Numerics.fast()
F32 = Numerics.fp32()


def _fp4_experts(rng, shape):
    """Random expert weights quantized as the checkpoint holds them: rows of different magnitudes,
    so the E8M0 scales vary per 32-input group (codes cover all 16 nibbles)."""
    mag = 2.0 ** rng.integers(-6, 0, size=(*shape[:-1], shape[-1] // 32, 1))
    w = (rng.standard_normal((*shape[:-1], shape[-1] // 32, 32)) * mag).reshape(shape)
    codes, scale = jax.vmap(quant_weight_fp4)(jnp.asarray(w, jnp.float32))
    return Fp4Weight(codes, scale)


def _case(rng, t=17, d=64, f=128, e=6, k=2, skew=False, dtype=jnp.bfloat16, held="bf16"):
    if skew:   # one hot expert spanning several tiles, others empty
        idx = np.stack([np.r_[0, rng.choice(np.arange(1, 3), k - 1, replace=False)] for _ in range(t)])
    else:
        idx = np.stack([rng.choice(e, k, replace=False) for _ in range(t)])
    x = jnp.asarray(rng.standard_normal((t, d)), dtype)
    w = jnp.asarray(rng.random((t, k)) + 0.1, jnp.float32)
    shapes = ((e, f, d), (e, f, d), (e, d, f))
    if held == "fp4":
        ws = [_fp4_experts(rng, s) for s in shapes]
    elif held == "fp8":
        ws = [Fp8RowWeight.from_fp4(_fp4_experts(rng, s)) for s in shapes]
    else:
        ws = [jnp.asarray(rng.standard_normal(s) * 0.15, jnp.bfloat16) for s in shapes]
    return x, jnp.asarray(idx, jnp.int32), w, *ws


def _check(got, want, seed, numerics):
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == np.float32 and np.isfinite(got).all(), f"unwritten row (seed {seed})"
    top = np.abs(want).max()
    if numerics is F32:
        assert_close(got, want, rtol=1e-5, atol=1e-5 * top, seed=seed)
    else:
        assert_close(got, want, rtol=2 ** -6, atol=2 ** -7 * top, seed=seed)


@pytest.mark.parametrize("impl", kmoe.IMPLS)
@pytest.mark.parametrize("numerics", [FAST, F32], ids=["fast", "fp32"])
def test_matches_reference(impl, numerics):
    rng, seed = fresh_rng()
    dtype = jnp.float32 if numerics is F32 else jnp.bfloat16
    case = _case(rng, dtype=dtype, d=128 if impl == "mgpu" else 64)   # mgpu: 128 columns per CTA
    if impl == "mgpu" and numerics is F32:
        with pytest.raises(ValueError, match="bf16 experts and bf16 activations"):
            kmoe.routed_experts(*case, numerics, 1.0, backend="pallas", impl=impl)
        return
    got = kmoe.routed_experts(*case, numerics, 1.0, backend="pallas", impl=impl, block_n=64)
    _check(got, ref.routed_experts(*case, numerics, 1.0), seed, numerics)


@pytest.mark.parametrize("held", ["fp4", "fp8"])
@pytest.mark.parametrize("impl", ["pallas", "gemv"])
def test_held_experts_match_their_bf16_decode(impl, held):
    """Experts held as published (FP4 codes + E8M0 scales) or re-coded (E4M3 + a power of two per
    row) are decoded in the kernels' registers: the result equals the same kernel on the bf16
    decode, bit for bit (the MMA gets the identical bf16 tile; a row scale is applied exactly after
    the sum), except the FP4 GEMV, which sums even and odd inputs apart (an fp32 order change);
    and the reference loop on the held weights equals it on the bf16 decode."""
    rng, seed = fresh_rng()
    x, idx, w, *ws = _case(rng, t=9, d=128, f=64, held=held)
    bf = [q.dequant() for q in ws]
    got = kmoe.routed_experts(x, idx, w, *ws, FAST, 1.0, backend="pallas", impl=impl, block_n=32,
                              block_k=64)
    on_bf16 = kmoe.routed_experts(x, idx, w, *bf, FAST, 1.0, backend="pallas", impl=impl, block_n=32,
                                  block_k=64)
    if (impl, held) != ("gemv", "fp4"):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(on_bf16), err_msg=f"seed {seed}")
    else:
        _check(got, on_bf16, seed, FAST)
    want = ref.routed_experts(x, idx, w, *ws, FAST, 1.0)
    np.testing.assert_array_equal(np.asarray(want), np.asarray(ref.routed_experts(x, idx, w, *bf, FAST, 1.0)))
    _check(got, want, seed, FAST)


def test_the_gate_up_epilogue_quantizes_as_fp8_act_qdq():
    """The gate/up kernel fake-quantizes its output tile for the down GEMM (each 32-lane group's
    max by a masked row max), inside a kernel as the gate/up epilogue runs it (interpret mode
    here, compiled on a GPU): bit-equal to `fp8_act_qdq` on groups of very different scales, a
    zero group, -0.0 and a whole group under the amax floor."""
    from jax.experimental import pallas as pl

    from kernels_pallas import backend
    from v41_jax.quant import fp8_act_qdq

    rng, seed = fresh_rng()
    a = rng.standard_normal((16, 128)) * np.exp2(rng.integers(-30, 12, size=(16, 4)))[:, :, None].repeat(32, 2).reshape(16, 128)
    a[0, :32], a[1, 5], a[2, 64:96] = 0.0, -0.0, 1e-7 * rng.standard_normal(32)
    a = jnp.asarray(a, jnp.bfloat16)

    def kernel(a_ref, o_ref):
        o_ref[...] = kmoe._tile_act_qdq(a_ref[...])

    got = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(a.shape, a.dtype),
                         interpret=backend.interpret())(a)
    want = fp8_act_qdq(a, 32)
    assert got.dtype == jnp.bfloat16
    assert (np.asarray(want) != np.asarray(a)).any()                   # the QDQ moves values
    np.testing.assert_array_equal(np.asarray(got).view(np.uint16), np.asarray(want).view(np.uint16),
                                  err_msg=f"seed {seed}")


def test_fp4_tile_decode_is_exact_for_every_byte_and_scale():
    """The in-register decode (nibble -> E4M3 byte -> fp32, times 2^(c-121)) against the loader's
    table decode, for all 256 code bytes under scale codes from 2^-20 to 2^+20."""
    codes = jnp.tile(jnp.arange(256, dtype=jnp.uint8), (41, 1))                  # [41, 256]
    scale = jnp.repeat(jnp.arange(107, 148, dtype=jnp.uint8)[:, None], 16, axis=1)  # [41, 16]
    even, odd = _codecs.fp4_halves(codes, scale)
    want = np.asarray(dequant_fp4_rows(codes, scale, dtype=jnp.float32))
    np.testing.assert_array_equal(np.asarray(even), want[:, 0::2])
    np.testing.assert_array_equal(np.asarray(odd), want[:, 1::2])
    assert np.signbit(np.asarray(even)[0, 8])                                  # code 8 is -0.0


def test_fp4_decode_with_e4m3_scales_is_exact_for_every_byte_and_scale():
    """The compressed KV rows' format (E4M3 scales, groups of 16 lanes) decoded in registers
    against the loader's table decode: all 256 code bytes under all 256 E4M3 scale codes (negative,
    -0 and NaN ones included; NaN equals NaN here)."""
    codes = jnp.tile(jnp.arange(256, dtype=jnp.uint8), (256, 1))                 # [256, 256]
    scale = jnp.repeat(jnp.arange(256, dtype=jnp.uint8)[:, None], 32, axis=1)    # [256, 32]
    even, odd = _codecs.fp4_halves(codes, scale, group=16, e4m3_scales=True)
    want = np.asarray(dequant_fp4_e4m3_rows(codes, scale, dtype=jnp.float32))
    np.testing.assert_array_equal(np.asarray(even), want[:, 0::2])
    np.testing.assert_array_equal(np.asarray(odd), want[:, 1::2])
    bf16 = np.asarray(_codecs.fp4_values(codes, scale, jnp.bfloat16, group=16, e4m3_scales=True))
    np.testing.assert_array_equal(bf16.astype(np.float32), want)                   # exact in bf16


def test_fp8_decode_with_e8m0_scales_is_exact_for_every_code_and_scale():
    """The window rows' format (E4M3 codes, E8M0 scales in groups of 32) decoded in registers
    against the loader's table decode: all 256 codes under all 256 scale codes (2^-127, a
    subnormal, and NaN included), in fp32, and in bf16 where the value is a normal bf16."""
    codes = jnp.tile(jnp.repeat(jnp.arange(256, dtype=jnp.uint8), 1), (256, 1))  # [256, 256]
    scale = jnp.repeat(jnp.arange(256, dtype=jnp.uint8)[:, None], 8, axis=1)     # [256, 8]
    got = np.asarray(_codecs.fp8_values(codes, scale, jnp.float32))
    want = np.asarray(dequant_fp8_rows(codes, scale, dtype=jnp.float32))
    np.testing.assert_array_equal(got, want)
    assert np.isnan(got[255]).all()         # (code 0's 2^-127 is a subnormal XLA:CPU flushes, both ways)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_e4m3_decode_is_exact_for_every_code(dtype):
    """The kernels decode E4M3 to 16 bits through fp16 (a faster conversion on the GPU): each of the 256
    codes, NaNs and -0.0 included, must come out with the bits of ml_dtypes' direct decode."""
    codes = np.arange(256, dtype=np.uint8)
    got = np.asarray(jax.jit(_codecs.e4m3_as, static_argnums=1)(jnp.asarray(codes), dtype))
    want = codes.view(jnp.float8_e4m3fn).astype(dtype)
    nan = np.isnan(want.astype(np.float32))
    assert nan.sum() == 2 and np.isnan(got.astype(np.float32)[nan]).all()
    np.testing.assert_array_equal(got[~nan].view(np.uint16 if dtype == jnp.bfloat16 else np.uint32),
                                  want[~nan].view(np.uint16 if dtype == jnp.bfloat16 else np.uint32))


def test_fp8_rows_refuse_what_one_row_scale_cannot_hold():
    """A row whose nonzero groups span 2^-20 .. 2^0 does not fit E4M3 under one scale: re-coding it
    must fail loudly, not round."""
    w = np.full((2, 64), 0.5, np.float32)
    w[1, :32] = 2.0 ** -20
    codes, scale = quant_weight_fp4(jnp.asarray(w))
    with pytest.raises(ValueError, match="experts.w1: 1 rows"):
        Fp8RowWeight.from_fp4(Fp4Weight(codes, scale), "experts.w1")


@pytest.mark.parametrize("gap,exact", [(14, True), (15, False)])
def test_fp8_rows_hold_scales_within_14(gap, exact):
    """The boundary: a group at scale 2^0 and one at 2^-gap holding E2M1 0.5 (the smallest
    nonzero) re-code exactly at gap 14 (0.5 lands on E4M3's 2^-9 step) and not at 15."""
    w = np.zeros((1, 64), np.float32)
    w[0, :32] = 6.0
    w[0, 32], w[0, 33] = 6.0 * 2.0 ** -gap, 0.5 * 2.0 ** -gap
    packed = Fp4Weight(*quant_weight_fp4(jnp.asarray(w)))
    assert np.asarray(packed.scale).tolist() == [[127, 127 - gap]]
    if exact:
        np.testing.assert_array_equal(np.asarray(Fp8RowWeight.from_fp4(packed).dequant(jnp.float32)), w)
    else:
        with pytest.raises(ValueError, match="1 rows"):
            Fp8RowWeight.from_fp4(packed)


def test_the_loader_keeps_fp4_where_fp8_rows_cannot_hold_it():
    from v41_jax.checkpoint.load import recode_fp8
    w = np.full((2, 3, 64), 0.5, np.float32)
    fine = recode_fp8(Fp4Weight(*jax.vmap(quant_weight_fp4)(jnp.asarray(w))), "layers.1.ffn.experts.*.w1")
    assert isinstance(fine, Fp8RowWeight)
    w[1, 2, :32] = 2.0 ** -20
    packed = Fp4Weight(*jax.vmap(quant_weight_fp4)(jnp.asarray(w)))
    with pytest.warns(UserWarning, match=r"layers.1.ffn.experts.\*.w1: 1 rows .* kept as fp4"):
        kept = recode_fp8(packed, "layers.1.ffn.experts.*.w1")
    assert kept is packed


@pytest.mark.parametrize("impl", ["gemv", "pallas"])
def test_default_tiles_divide_widths_that_are_not_powers_of_two(impl):
    """The demo model's widths (D=256, F=96): the default tiles must divide both (32 here)."""
    rng, seed = fresh_rng()
    case = _case(rng, t=3 if impl == "gemv" else 17, d=256, f=96, held="fp4")
    got = kmoe.routed_experts(*case, FAST, 10.0, backend="pallas", impl=impl)
    _check(got, ref.routed_experts(*case, FAST, 10.0), seed, FAST)


def test_widths_without_a_16_tile_are_refused():
    case = _case(np.random.default_rng(0), d=72, f=40)
    with pytest.raises(ValueError, match="no tile of >= 16"):
        kmoe.routed_experts(*case, FAST, 10.0, backend="pallas", impl="pallas")


def test_skewed_groups_span_tiles():
    """One expert takes every token (several 16-row tiles, the last partial), most are empty."""
    rng, seed = fresh_rng()
    case = _case(rng, skew=True)    # 17 pairs on expert 0: a full 16-row tile and a 1-row tile
    got = kmoe.routed_experts(*case, FAST, 10.0, backend="pallas", impl="pallas", block_m=16,
                              block_n=64)
    _check(got, ref.routed_experts(*case, FAST, 10.0), seed, FAST)


@pytest.mark.parametrize("held", ["fp8", "fp4"])
def test_gate_up_column_blocks_of_their_own_change_nothing(held):
    """128-row tiles of coded experts run gate/up on 64-column blocks and down on 128
    (`launch_config`); an explicit block_n sets both. Column blocks split the outputs only, so
    the pairs are the same bit for bit."""
    rng, seed = fresh_rng()
    x, idx, w, *ws = _case(rng, t=90, d=256, f=128, e=4, k=3, skew=True, held=held)
    assert kmoe.launch_config(128, coded=True)["gate_up_block_n"] == 64
    run = lambda **kw: np.asarray(kmoe.routed_pairs(x, idx, w, *ws, FAST, 10.0, backend="pallas", impl="pallas",
                                                    block_m=128, **kw))
    own = run()
    assert np.isfinite(own).all() and np.abs(own).max() > 0, f"seed {seed}"
    np.testing.assert_array_equal(own, run(block_n=128), err_msg=f"seed {seed}")
    # 16 columns hold no whole 32-lane group: the down GEMM's input QDQ is then XLA's, same bits
    np.testing.assert_array_equal(own, run(block_n=16), err_msg=f"seed {seed}")


def test_mgpu_dispatch_covers_every_tile_layout():
    """The Mosaic path's tile-aligned dispatch (on CPU with the kernels' jnp references): a hot
    expert over three 128-row tiles (300 pairs: 128 + 128 + 44), empty experts, pad rows."""
    rng, seed = fresh_rng()
    case = _case(rng, t=300, skew=True, d=256)
    got = kmoe.routed_experts(*case, FAST, 10.0, backend="pallas", impl="mgpu", block_m=128)
    _check(got, ref.routed_experts(*case, FAST, 10.0), seed, FAST)


@pytest.mark.parametrize("tile_m", [256, 128])
def test_mgpu_kernels_lower_for_cuda_at_real_widths(tile_m):
    """Without a GPU: the Mosaic GPU lowering (layouts, TMA descriptors, the shared-memory budget
    of the three-warpgroup ring) runs at export time, so a launch the H200 could not take fails
    here. Both presets, gate/up (F = 2304 from D = 5120) and down (D from F)."""
    cfg = moe_mgpu.preset(tile_m)
    kw = dict(tile_m=tile_m, split=cfg["split"])
    spec = lambda *shape, dt=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dt)
    te, rows = spec(20, dt=jnp.int32), 20 * tile_m
    export = lambda fn, *args: jax.export.export(jax.jit(fn), platforms=["cuda"])(*args).mlir_module()
    glu = export(functools.partial(moe_mgpu.grouped_swiglu, limit=10.0, tile_n=cfg["glu_n"], **kw),
                 spec(rows, 5120), spec(4, 2304, 5120), spec(4, 2304, 5120), spec(rows, dt=jnp.float32), te)
    down = export(functools.partial(moe_mgpu.grouped_matmul, tile_n=cfg["down_n"], **kw),
                  spec(rows, 2304), spec(4, 5120, 2304), te)
    assert glu.count("custom_call @mosaic_gpu") == 1 and down.count("custom_call @mosaic_gpu") == 1
    with pytest.raises(ValueError, match="exceeds available shared memory"):
        export(functools.partial(moe_mgpu.grouped_matmul, tile_n=cfg["down_n"], steps=6, **kw),
               spec(rows, 2304), spec(4, 5120, 2304), te)


@pytest.mark.skipif(not backend.mosaic_gpu(), reason="needs an NVIDIA Hopper GPU (wgmma, TMA)")
@pytest.mark.parametrize("tile_m", [256, 128])
def test_mgpu_grouped_matmul_matches_its_reference(tile_m):
    """Compiled Mosaic GPU kernel vs its jnp reference on live tiles (skipped tiles are unwritten).
    Both accumulate in fp32 and round once to bf16; summation order differs, so a bf16 output
    may move by one step: rtol 2^-7."""
    rng, seed = fresh_rng()
    n_tiles, k, n, e = 6, 512, 512, 3
    x = jnp.asarray(rng.standard_normal((n_tiles * tile_m, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((e, n, k)) * 0.05, jnp.bfloat16)
    te = jnp.asarray([0, 2, 2, 1, -1, -1], jnp.int32)
    cfg = moe_mgpu.preset(tile_m)
    kw = dict(tile_m=tile_m, tile_n=cfg["down_n"], split=cfg["split"])
    got = np.asarray(moe_mgpu.grouped_matmul(x, w, te, **kw).astype(jnp.float32))[:4 * tile_m]
    want = np.asarray(moe_mgpu.grouped_matmul_ref(x, w, te, **kw).astype(jnp.float32))[:4 * tile_m]
    assert_close(got, want, rtol=2 ** -7, atol=2 ** -7 * np.abs(want).max(), seed=seed)
    # the fused gate/up: bf16 g, u may each move one step, then silu * u * weight (rtol 2^-6)
    w3 = jnp.asarray(rng.standard_normal((e, n, k)) * 0.05, jnp.bfloat16)
    rw = jnp.asarray(rng.random(n_tiles * tile_m) + 0.1, jnp.float32)
    kw["tile_n"] = cfg["glu_n"]
    got = np.asarray(moe_mgpu.grouped_swiglu(x, w, w3, rw, te, limit=2.0, **kw).astype(jnp.float32))[:4 * tile_m]
    want = np.asarray(moe_mgpu.grouped_swiglu_ref(x, w, w3, rw, te, limit=2.0, **kw).astype(jnp.float32))[:4 * tile_m]
    assert_close(got, want, rtol=2 ** -6, atol=2 ** -7 * np.abs(want).max(), seed=seed)


def test_capacity_rounds_take_the_overflow():
    """Expert 0 holds all 17 pairs: with 8 rows per expert it takes three rounds (8 + 8 + 1), the
    other experts one or none; every pair must come back once."""
    rng, seed = fresh_rng()
    case = _case(rng, skew=True)
    got = kmoe.routed_experts(*case, FAST, 10.0, backend="pallas", impl="capacity", block_m=8)
    _check(got, ref.routed_experts(*case, FAST, 10.0), seed, FAST)


def test_capacity_rows_cover_uniform_routing():
    assert kmoe.capacity_rows(2048 * 6, 64) == 256      # mean 192 + 4 sd = 247
    assert kmoe.capacity_rows(8192 * 6, 64) == 960      # 1.25 x 768
    assert kmoe.capacity_rows(12, 64) == 64


@pytest.mark.parametrize("impl", ["pallas", "gemv"])
def test_single_token_decode(impl):
    rng, seed = fresh_rng()
    case = _case(rng, t=1, k=3)
    got = kmoe.routed_experts(*case, FAST, 10.0, backend="pallas", impl=impl, block_n=64)
    _check(got, ref.routed_experts(*case, FAST, 10.0), seed, FAST)


def test_choose_impl_follows_the_measurements():
    assert kmoe.choose_impl(1) == "gemv"
    assert kmoe.choose_impl(2) == "gemv"         # 12 pairs: one weight stream each
    assert kmoe.choose_impl(4) == "pallas"       # from here the grouped GEMM's shared tiles win
    assert kmoe.choose_impl(8) == "pallas"
    assert kmoe.choose_impl(32) == "pallas"      # every expert busy: still ahead of dense
    assert kmoe.choose_impl(2048) == "pallas"
    assert kmoe.choose_impl(2, mosaic=True) == "gemv"
    assert kmoe.choose_impl(512, mosaic=True) == "pallas"   # the Mosaic path is slower there
    assert kmoe.choose_impl(2048, mosaic=True) == "mgpu"


def test_mgpu_takes_bf16_experts_only():
    rng, _ = fresh_rng()
    _, _, _, *bf = _case(rng)
    _, _, _, *fp8 = _case(rng, held="fp8")
    assert kmoe.mgpu_ok(*bf, FAST)
    assert not kmoe.mgpu_ok(*fp8, FAST)
    assert not kmoe.mgpu_ok(*bf, F32)


def test_tile_table():
    sizes = jnp.asarray([0, 5, 16, 17, 0], jnp.int32)
    e, first, end = (np.asarray(a) for a in kmoe.tile_table(sizes, 16, 38))
    assert len(e) == -(-38 // 16) + 5
    live = e >= 0
    np.testing.assert_array_equal(e[live], [1, 2, 3, 3])
    np.testing.assert_array_equal(first[live], [0, 5, 21, 37])
    np.testing.assert_array_equal(end[live], [5, 21, 38, 38])


def test_tile_table_matches_a_binary_search_and_compiles_without_a_loop():
    """Random group sizes (empty groups, groups past one tile): the tile -> expert map equals
    numpy's binary search; the compiled table has no while loop (each cost a GPU step ~75 us)."""
    rng = np.random.default_rng(7)
    table = jax.jit(kmoe.tile_table, static_argnums=(1, 2))   # one compile a shape, not one an op
    for _ in range(20):
        n_exp, bm = int(rng.integers(1, 70)), int(rng.choice([16, 32, 64]))
        sizes = rng.integers(0, 3 * bm, n_exp) * (rng.random(n_exp) < 0.7)
        n_pairs = int(sizes.sum())
        e, first, end = (np.asarray(a) for a in table(jnp.asarray(sizes, jnp.int32), bm, n_pairs))
        ends = np.cumsum(-(-sizes // bm))
        want = np.searchsorted(ends, np.arange(len(e)), side="right")
        np.testing.assert_array_equal(e, np.where(want < n_exp, want, -1))
    text = jax.jit(lambda s: kmoe.tile_table(s, 16, 192)).lower(jnp.ones(64, jnp.int32)).compile().as_text()
    assert " while(" not in text


def test_block_gemm_numerics_take_the_reference_path(monkeypatch):
    """The kernels sum each GEMM in one fp32 dot; the reference's K-block order of quantized
    experts is the XLA path's. A bf16 checkpoint's experts have no K blocks under any policy
    (`Numerics.for_model`), so the reference policy takes the kernels there."""
    monkeypatch.setattr(kmoe.ref, "routed_pairs", lambda *a: "reference path")
    monkeypatch.setattr(kmoe, "auto_impl", lambda *a: "ragged_dot")
    monkeypatch.setattr(kmoe, "_routed_ragged_dot", lambda *a, **k: "kernel path")
    x, w = jnp.zeros((3, 4), jnp.bfloat16), jnp.zeros((2, 4, 4), jnp.bfloat16)   # shapes only
    pairs = lambda numerics: kmoe.routed_pairs(x, None, None, w, w, w, numerics, 10.0, backend="pallas")
    assert pairs(Numerics.reference()) == "reference path"
    assert pairs(Numerics.reference().for_model(False)) == "kernel path"
    assert pairs(Numerics.fast()) == "kernel path"


def test_the_model_moe_layer_dispatches_here(monkeypatch):
    """`model.moe.moe` (the MoE sublayer of the forward and of the step) routes its experts through
    this dispatcher, so the one switch picks the grouped GEMM on a GPU and the loop elsewhere."""
    from pathlib import Path
    from v41_jax.config import ModelConfig
    cfg = ModelConfig.from_file(Path(__file__).parent.parent / "v41_jax/configs/tiny.config.json")
    e, k = cfg.moe_experts(0)
    rng, _ = fresh_rng()
    bf = lambda *shape: jnp.asarray(rng.standard_normal(shape) * 0.1, jnp.bfloat16)
    p = {"gate": {"weight": bf(e, cfg.dim), "bias": jnp.zeros((e,), jnp.float32)},
         "experts": {"w1": bf(e, cfg.moe_inter_dim, cfg.dim), "w3": bf(e, cfg.moe_inter_dim, cfg.dim),
                     "w2": bf(e, cfg.dim, cfg.moe_inter_dim)},
         "shared_experts": {n: {"weight": bf(*s)} for n, s in
                            (("w1", (cfg.moe_inter_dim, cfg.dim)), ("w3", (cfg.moe_inter_dim, cfg.dim)),
                             ("w2", (cfg.dim, cfg.moe_inter_dim)))}}
    x = bf(5, cfg.dim)
    calls, real = [], kmoe.routed_experts
    monkeypatch.setattr(kmoe, "routed_experts", lambda *a, **kw: calls.append(a[1].shape) or real(*a, **kw))
    y, idx, _ = ref.moe(p, cfg, 0, x, FAST)
    assert calls == [(5, k)] and y.shape == x.shape and np.isfinite(np.asarray(y, np.float32)).all()


def _silu(v):
    return v / (1 + np.exp(-v))


@pytest.mark.parametrize("name", ["limit", "nolimit", "top1"])
def test_fixture_moe_exec(name):
    """moe_exec.json (fp32 weights): y minus the shared expert (computed here in float64) is the
    routed sum; dims are zero-padded to the kernel's 16-lane tiles, which adds exact zeros."""
    c = next(c for c in load_fixture("moe_exec.json")["cases"] if c["name"] == name)
    t, d, f, e, k, lim = c["tokens"], c["dim"], c["inter"], c["experts"], c["topk"], c["limit"]
    x = np.asarray(c["x"], np.float64).reshape(t, d)
    sw1, sw3 = (np.asarray(c[n], np.float64).reshape(f, d) for n in ("sw1", "sw3"))
    sw2 = np.asarray(c["sw2"], np.float64).reshape(d, f)
    g, u = x @ sw1.T, x @ sw3.T
    if lim > 0:
        g, u = np.minimum(g, lim), np.clip(u, -lim, lim)
    routed_want = np.asarray(c["y"], np.float64).reshape(t, d) - (_silu(g) * u) @ sw2.T

    dp, fp = 16, 16
    pad = lambda a, shape: jnp.asarray(np.pad(a, [(0, s - n) for n, s in zip(a.shape, shape)]), jnp.float32)
    w1 = pad(np.asarray(c["w1"], np.float32).reshape(e, f, d), (e, fp, dp))
    w3 = pad(np.asarray(c["w3"], np.float32).reshape(e, f, d), (e, fp, dp))
    w2 = pad(np.asarray(c["w2"], np.float32).reshape(e, d, f), (e, dp, fp))
    idx = jnp.asarray(c["indices"], jnp.int32).reshape(t, k)
    w = jnp.asarray(c["weights"], jnp.float32).reshape(t, k)
    got = kmoe.routed_experts(pad(x.astype(np.float32), (t, dp)), idx, w, w1, w3, w2, F32, lim,
                              backend="pallas", impl="pallas", block_n=16, block_k=16)
    got = np.asarray(got)[:, :d]
    assert_close(got, routed_want, rtol=1e-5, atol=1e-5 * np.abs(routed_want).max())


@pytest.mark.parametrize("impl, held", [(i, "bf16") for i in ("xla",) + kmoe.IMPLS]
                         + [("pallas", "fp4"), ("gemv", "fp4")])   # held experts: the decode kernels
def test_a_stacked_run_reads_its_layer_in_place_bit_for_bit(impl, held):
    """A scanned run's experts stay one [L, E, ...] stack (`stack_index`, model/layer_runs.py):
    every path, given the stack and a traced layer index, returns bit for bit what it returns on
    that layer's own [E, ...] experts, for every layer of the stack (a wrong offset would read
    another layer's experts, which are drawn independently here)."""
    rng, seed = fresh_rng()
    layers = [_case(rng, t=5, d=128, held=held) for _ in range(3)]
    x, idx, w = layers[1][:3]
    stack = [jax.tree.map(lambda *a: jnp.stack(a), *(c[3 + i] for c in layers)) for i in range(3)]
    backend = dict(backend="xla") if impl == "xla" else dict(backend="pallas", impl=impl)
    run = jax.jit(lambda j, *ws: kmoe.routed_experts(x, idx, w, *ws, FAST, 10.0, stack_index=j, **backend))
    # the layer's own call jitted as well: XLA:CPU sums a GEMM in an order set by the program around
    # it, so an eager call (its ops dispatched one by one) can differ from any jitted one by an ulp
    # (seed 3626812738131485526, xla path: one bf16 pair output); jitted vs jitted it did not in 40 seeds
    one = jax.jit(lambda *ws: kmoe.routed_experts(x, idx, w, *ws, FAST, 10.0, **backend))
    for j, case in enumerate(layers):
        want = one(*case[3:])
        got = run(jnp.int32(j), *stack)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=f"layer {j} (seed {seed})")
