"""Quantization codecs: fixture bytes, independent ml_dtypes oracles, hand-computed edge cases."""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from v41_jax import quant
from v41_jax.checkpoint import derivative_codecs as dc

FIX = Path(__file__).parent / "fixtures" / "dsv41_reference"


def bits(a) -> np.ndarray:
    return np.asarray(a, np.float32).view(np.uint32)


def same_bits(a, b) -> bool:
    """Bit-identical fp32 (so -0.0 != +0.0), NaN matching NaN."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return a.shape == b.shape and bool(np.all((bits(a) == bits(b)) | (np.isnan(a) & np.isnan(b))))


# ---- independent numpy oracles (ml_dtypes casts are RNE; e4m3fn overflow is NaN, hence the clip) --

def oracle_fp8(x, block=32):
    xg = x.reshape(*x.shape[:-1], -1, block)
    amax = np.maximum(np.abs(xg).max(-1), np.float32(1e-4))
    s = np.exp2(np.ceil(np.log2((amax * np.float32(1 / 448)).astype(np.float64)))).astype(np.float32)
    q = np.clip(xg / s[..., None], -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    return (q * s[..., None]).reshape(x.shape)


def oracle_fp4_e4m3(x, group=16):
    xg = x.reshape(*x.shape[:-1], -1, group)
    amax = np.maximum(np.abs(xg).max(-1), np.float32(6 * 2.0**-9))
    s = np.clip(amax / np.float32(6), -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    v = np.clip(xg / s[..., None], -6, 6).astype(ml_dtypes.float4_e2m1fn).astype(np.float32)
    return (v * s[..., None]).reshape(x.shape)


def oracle_fp4_ue8m0(x, group=32):
    xg = x.reshape(*x.shape[:-1], -1, group)
    amax = np.maximum(np.abs(xg).max(-1), np.float32(6 * 2.0**-126))
    s = np.exp2(np.ceil(np.log2((amax * np.float32(1 / 6)).astype(np.float64)))).astype(np.float32)
    v = np.clip(xg / s[..., None], -6, 6).astype(ml_dtypes.float4_e2m1fn).astype(np.float32)
    return (v * s[..., None]).reshape(x.shape)


@pytest.fixture(scope="module")
def bf16_inputs():
    """bf16-representable values over 24 binades, with whole groups at one magnitude."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((512, 64)) * np.exp2(rng.uniform(-12, 12, (512, 4))).repeat(16, 1)
    return x.astype(ml_dtypes.bfloat16).astype(np.float32)


# ---- latent_quant_bytes.json --------------------------------------------------------------------

@pytest.fixture(scope="module")
def latent():
    d = json.loads((FIX / "latent_quant_bytes.json").read_text())
    x = np.array(d["input"], np.float32).reshape(d["rows"], d["dim"])
    return d, x


def _fixture_dequant(vals):
    return np.array([np.nan if v == "NaN" else v for v in vals], np.float32)


@pytest.mark.parametrize("kind", ["fp8", "fp4e8m0"])
def test_latent_quant_bytes_exact(latent, kind):
    d, x = latent
    enc, qdq, dec = {
        "fp8": (quant.quant_fp8_ue8m0, quant.fp8_act_qdq, quant.dequant_fp8_rows),
        "fp4e8m0": (quant.quant_fp4_ue8m0, quant.fp4_qdq_ue8m0, quant.dequant_fp4_ue8m0_rows),
    }[kind]
    codes, scales = enc(x)
    assert np.array_equal(np.asarray(codes).ravel(), np.array(d[kind]["codes"], np.uint8))
    assert np.array_equal(np.asarray(scales).ravel(), np.array(d[kind]["scales"], np.uint8))
    want = _fixture_dequant(d[kind]["dequant"]).reshape(x.shape)
    assert same_bits(qdq(x), want)
    assert same_bits(dec(codes, scales, dtype=jnp.float32), want)


def test_latent_quant_bytes_fp4_e4m3(latent):
    """Byte-exact except where the fixture's generator deviates from the reference: when amax/6 > 448
    it stores a NaN scale (0x7f) and NaN values; the reference saturates the e4m3 scale at 448 (0x7e)
    (SOURCE.md). Those groups are checked against the saturating rule instead, and must be exactly
    the groups the fixture marks NaN."""
    d, x = latent
    enc, qdq = quant.quant_fp4_e4m3, quant.fp4_qdq_e4m3
    codes, scales = (np.asarray(a) for a in enc(x))
    codes, scales = codes.reshape(-1, 8), scales.ravel()           # 8 bytes = 16 values per group
    f_codes = np.array(d["fp4e4m3"]["codes"], np.uint8).reshape(-1, 8)
    f_scales = np.array(d["fp4e4m3"]["scales"], np.uint8)
    f_deq = _fixture_dequant(d["fp4e4m3"]["dequant"]).reshape(-1, 16)
    xg = x.reshape(-1, 16)
    overflow = np.abs(xg).max(-1) / np.float32(6) > 448
    assert overflow.sum() == 4                                      # row 3 (all 10000): 4 groups
    assert np.array_equal(f_scales == 0x7F, overflow)
    assert np.all(np.isnan(f_deq[overflow])) and not np.any(np.isnan(f_deq[~overflow]))
    ok = ~overflow
    assert np.array_equal(codes[ok], f_codes[ok]) and np.array_equal(scales[ok], f_scales[ok])
    deq = np.asarray(qdq(x)).reshape(-1, 16)
    assert same_bits(deq[ok], f_deq[ok])
    # saturating reference: scale 448 (0x7e), |x|/448 = 22.3 clamps to 6 (code 7 / 0xf)
    assert np.all(scales[overflow] == 0x7E)
    sat = np.where(xg[overflow] < 0, 0xF, 0x7).astype(np.uint8)
    assert np.array_equal(codes[overflow], sat[:, 0::2] | (sat[:, 1::2] << 4))
    assert np.array_equal(deq[overflow], np.sign(xg[overflow]) * 6 * 448)
    assert same_bits(quant.dequant_fp4_e4m3_rows(*enc(x), dtype=jnp.float32), deq.reshape(x.shape))


# ---- QDQ vs independent oracles, inside jit, bf16 in -> bf16 out ---------------------------------

@pytest.mark.parametrize("name", ["fp8_act_qdq", "fp4_qdq_e4m3", "fp4_qdq_ue8m0"])
def test_qdq_matches_oracle_bf16(bf16_inputs, name):
    fn = getattr(quant, name)
    oracle = {"fp8_act_qdq": oracle_fp8, "fp4_qdq_e4m3": oracle_fp4_e4m3, "fp4_qdq_ue8m0": oracle_fp4_ue8m0}[name]
    want = oracle(bf16_inputs)
    x = jnp.asarray(bf16_inputs, jnp.bfloat16)
    got = jax.jit(lambda v: fn(v) * 1)(x)                          # traced inside an outer jit
    assert got.dtype == jnp.bfloat16
    # the products are on a <= 6-bit grid times a power of two: exact in bf16
    assert same_bits(np.asarray(got, np.float32), want)
    assert same_bits(fn(bf16_inputs), want)                       # numpy fp32 in -> fp32 out


@pytest.mark.parametrize("name", ["fp8_act_qdq", "fp4_qdq_e4m3", "fp4_qdq_ue8m0"])
def test_qdq_is_straight_through_under_differentiation(bf16_inputs, name):
    """Training under the fake-quantizing numerics (train_demo's draft phase) needs a gradient
    through each QDQ: the identity, while the values stay the QDQ's own."""
    fn = getattr(quant, name)
    x = jnp.asarray(bf16_inputs, jnp.float32)
    cot = jnp.asarray(np.random.default_rng(1).standard_normal(x.shape), jnp.float32)
    value, vjp = jax.vjp(fn, x)
    assert same_bits(value, fn(x))
    assert same_bits(vjp(cot)[0], cot)


def test_rounded_quotient_exact_from_approximate_division(bf16_inputs):
    """XLA's fp32 division is approximate on GPU and a reciprocal multiply for constant/broadcast
    divisors; _round_quotient must give grid(fl32(num/den)) from any quotient a few ulps off,
    including the exact ties (x/s = 2.5, amax/6 on an e4m3 midpoint) bf16 data hits often."""
    xg = bf16_inputs.reshape(-1, 16)
    amax = np.maximum(np.abs(xg).max(-1), np.float32(6 * 2.0**-9))
    six = np.float32(6)
    s = np.clip(amax / six, 0, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    want_s = s
    want_v = np.clip(xg / s[:, None], -6, 6).astype(ml_dtypes.float4_e2m1fn).astype(np.float32)
    ties = np.abs(xg / s[:, None]) * 4 % 2 == 1                  # exactly on an e2m1 midpoint
    assert ties.sum() > 100
    fn = jax.jit(quant._round_quotient, static_argnums=(3, 4))
    for ulps in (-3, -1, 0, 1, 3):
        def off(q):
            for _ in range(abs(ulps)):
                q = np.nextafter(q, np.float32(np.sign(ulps) * np.inf), dtype=np.float32)
            return q
        assert same_bits(fn(amax, six, off(amax / six), quant._e4m3_step_exp, 448.0), want_s)
        sg = s[:, None]
        assert same_bits(fn(xg, sg, off(xg / sg), quant._e2m1_step_exp, 6.0), want_v)


# ---- decoders: hand-computed cases --------------------------------------------------------------

def test_e8m0_decode_edges():
    got = np.asarray(quant.e8m0_to_f32(np.array([0, 1, 126, 127, 128, 254, 255], np.uint8)))
    assert bits(got[0]) == 0x00400000 and got[0] == np.float32(2.0**-127)   # code 0 is 2^-127, not 0
    assert list(got[1:6]) == [2.0**-126, 0.5, 1.0, 2.0, 2.0**127]
    assert np.isnan(got[6])
    # the ml_dtypes type agrees on every code
    codes = np.arange(256, dtype=np.uint8)
    assert same_bits(quant.e8m0_to_f32(codes), codes.view(ml_dtypes.float8_e8m0fnu).astype(np.float32))
    assert same_bits(quant.e8m0_to_f32(codes.view(ml_dtypes.float8_e8m0fnu)), quant.e8m0_to_f32(codes))


def test_e4m3_decode_all_codes():
    codes = np.arange(256, dtype=np.uint8)
    got = np.asarray(quant.e4m3_to_f32(codes))
    assert same_bits(got, codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32))
    assert got[0x7E] == 448 and got[0x01] == 2.0**-9 and got[0x38] == 1.0 and bits(got[0x80]) == 0x80000000
    assert np.isnan(got[0x7F]) and np.isnan(got[0xFF])


def test_e2m1_decode_and_nibble_order():
    vals = np.asarray(quant.e2m1_to_f32(np.arange(16, dtype=np.uint8)))
    assert list(vals[:8]) == [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    assert list(vals[9:]) == [-0.5, -1, -1.5, -2, -3, -4, -6] and bits(vals[8]) == 0x80000000
    # byte 0x21: low nibble (even element) = code 1 = 0.5, high nibble (odd) = code 2 = 1.0
    packed = np.array([[0x21, 0xF7]], np.uint8)
    assert np.array_equal(np.asarray(quant.unpack_fp4(packed)), [[1, 2, 7, 15]])
    assert np.array_equal(np.asarray(quant.pack_fp4(quant.unpack_fp4(packed))), packed)
    w = quant.dequant_fp4_rows(np.tile(packed.view(np.int8), (1, 8)), np.array([[128]], np.uint8),
                               dtype=jnp.float32)
    assert list(np.asarray(w)[0, :4]) == [1.0, 2.0, 12.0, -12.0]


def test_e2m1_ties_to_even():
    mids = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)
    want = np.array([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0], np.float32)
    assert np.array_equal(np.asarray(quant.round_e2m1(mids)), want)
    assert np.array_equal(np.asarray(quant.round_e2m1(-mids)), -want)
    # through the encoder: amax 6 gives scale 2^0 (6 * fl(1/6) rounds to exactly 1.0)
    x = np.concatenate([mids, -mids, [6.0], np.zeros(17)]).astype(np.float32)[None]
    codes, scale = quant.quant_fp4_ue8m0(x)
    assert int(scale[0, 0]) == 127
    dec = np.asarray(quant.e2m1_to_f32(quant.unpack_fp4(codes)))[0]
    assert np.array_equal(dec[:14], np.concatenate([want, -want]))
    # -0.0 survives as code 8 (the reference takes the sign bit of x / s)
    x = np.zeros((1, 32), np.float32)
    x[0, :2] = 6.0, -1e-3
    assert list(np.asarray(quant.unpack_fp4(quant.quant_fp4_ue8m0(x)[0]))[0, :3]) == [7, 8, 0]


def test_round_e4m3_rne_and_saturation():
    rng = np.random.default_rng(3)
    x = (rng.standard_normal(200_000) * np.exp2(rng.uniform(-14, 10, 200_000))).astype(np.float32)
    want = np.clip(x, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    assert same_bits(jax.jit(quant.round_e4m3)(x), want)
    # ties between 1 and 1.125 / 1.125 and 1.25, subnormal tie 2^-10, and saturation instead of NaN
    x = np.array([1.0625, 1.1875, 2.0**-10, 3 * 2.0**-10, 464.0, 1e6, -1e6], np.float32)
    assert list(np.asarray(quant.round_e4m3(x))) == [1.0, 1.25, 0.0, 2.0**-8, 448.0, 448.0, -448.0]


# ---- block / row dequant with partial edge blocks ------------------------------------------------

def test_fp8_block_dequant_partial_edges():
    out_f, in_f = 40, 70                                   # edge blocks: 8 rows, 6 columns
    codes = np.full((out_f, in_f), 0x38, np.uint8)         # every value 1.0
    scale = np.array([[120, 121, 122], [123, 124, 125]], np.uint8)
    w = np.asarray(quant.dequant_fp8_blocks(codes.view(ml_dtypes.float8_e4m3fn), scale, dtype=jnp.float32))
    assert w.shape == (out_f, in_f)
    for bi in range(2):
        for bj in range(3):
            blk = w[32 * bi:32 * bi + 32, 32 * bj:32 * bj + 32]
            assert np.all(blk == 2.0 ** (int(scale[bi, bj]) - 127))
    with pytest.raises(ValueError, match="needs scale"):
        quant.dequant_fp8_blocks(codes, scale[:, :2])


def test_fp8_weight_quant_partial_edges():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((40, 70)).astype(np.float32)
    w[32:, 64:] *= 1000                                     # the 8x6 corner block has its own scale
    codes, scale = quant.quant_weight_fp8(w)
    assert codes.shape == (40, 70) and scale.shape == (2, 3)
    amax = np.abs(w[32:, 64:]).max()
    assert int(scale[1, 2]) == 127 + int(np.ceil(np.log2(amax / 448)))
    deq = np.asarray(quant.dequant_fp8_blocks(codes, scale, dtype=jnp.float32))
    s = np.asarray(quant.e8m0_to_f32(scale)).repeat(32, 0).repeat(32, 1)[:40, :70]
    assert np.all(np.abs(deq - w) <= np.maximum(np.abs(w) * 2.0**-4, s * 2.0**-10))


def test_engram_rows_dequant():
    codes = np.array([[0x38] * 32 + [0xB8] * 32], np.uint8)       # +1 x 32, -1 x 32
    scale = np.array([[125, 130]], np.uint8)
    rows = np.asarray(quant.dequant_fp8_rows(codes, scale), np.float32)
    assert rows.dtype == np.float32 and np.all(rows[0, :32] == 0.25) and np.all(rows[0, 32:] == -8.0)
    assert quant.dequant_fp8_rows(codes, scale).dtype == jnp.bfloat16


def test_encoders_roundtrip_through_decoders(bf16_inputs):
    for enc, dec, oracle in ((quant.quant_fp8_ue8m0, quant.dequant_fp8_rows, oracle_fp8),
                             (quant.quant_fp4_e4m3, quant.dequant_fp4_e4m3_rows, oracle_fp4_e4m3),
                             (quant.quant_fp4_ue8m0, quant.dequant_fp4_ue8m0_rows, oracle_fp4_ue8m0)):
        assert same_bits(dec(*enc(bf16_inputs), dtype=jnp.float32), oracle(bf16_inputs))


def test_bad_group_width_is_refused():
    with pytest.raises(ValueError, match="multiple of 32"):
        quant.fp8_act_qdq(jnp.zeros((2, 48)))


# ---- derivative_quant_codecs.json ----------------------------------------------------------------

@pytest.fixture(scope="module")
def derivative():
    return json.loads((FIX / "derivative_quant_codecs.json").read_text())


def _expected(case):
    return np.array(case["expectedBits"], np.uint32).view(np.float32).reshape(case["rows"], case["cols"])


def test_nvfp4(derivative):
    for c in derivative["nvfp4"]:
        r, n = c["rows"], c["cols"]
        packed = np.frombuffer(bytes.fromhex(c["packedHex"]), np.uint8).reshape(r, n // 2)
        scales = np.frombuffer(bytes.fromhex(c["scaleHex"]), np.uint8).reshape(r, n // 16)
        g = np.array(c["globalScaleBits"], np.uint32).view(np.float32)
        want = _expected(c)
        assert np.isnan(want).any()                         # the 0x7f e4m3 scale decodes to NaN
        assert same_bits(dc.decode_nvfp4(packed, scales, g), want)


def test_quark_mxfp4(derivative):
    for c in derivative["quark"]:
        r, n = c["rows"], c["cols"]
        packed = np.frombuffer(bytes.fromhex(c["packedHex"]), np.uint8).reshape(r, n // 2)
        scales = np.frombuffer(bytes.fromhex(c["scaleHex"]), np.uint8).reshape(r, n // 32)
        assert same_bits(dc.decode_mxfp4(packed, scales), _expected(c))


def test_mlx_affine(derivative):
    assert {c["bits"] for c in derivative["mlxAffine"]} == {4, 8}
    for c in derivative["mlxAffine"]:
        words = np.frombuffer(bytes.fromhex(c["packedHex"]), "<u4").reshape(c["rows"], -1)
        s = np.array(c["scaleBits"], np.uint32).view(np.float32).reshape(c["rows"], -1)
        b = np.array(c["biasBits"], np.uint32).view(np.float32).reshape(c["rows"], -1)
        assert same_bits(dc.decode_mlx_affine(words, s, b, c["bits"]), _expected(c))


def test_packed_fp4_ue8m0_rows_give_back_every_on_grid_row():
    """The cache's packed index rows: rows on the fp4 grid (an `fp4_qdq_ue8m0` output) packed and
    unpacked come back bit for bit, -0.0 included, whatever a group's largest code (every E2M1
    magnitude as a group's largest, so each scale drop of `pack_fp4_ue8m0_rows`' argument shows),
    over group scales 2^-100 .. 2^100. An off-grid row does not come back (the packing is a
    quantization), so the property is the grid's, not the identity's."""
    mags = quant.E2M1_TABLE[:8]
    rng = np.random.default_rng(0)
    rows = []
    for top in mags:                                   # the group's largest magnitude code
        for e in (-100, -37, 0, 5, 100):
            g = rng.choice(mags[mags <= top], size=(4, 32)) * rng.choice([-1.0, 1.0], size=(4, 32))
            g[:, 0] = top
            rows.append(g * np.float32(2.0 ** e))
    x = np.concatenate(rows).astype(np.float32).reshape(-1, 128)
    x[0, 1] = -0.0
    on_grid = quant.fp4_qdq_ue8m0(jnp.asarray(x))
    assert same_bits(on_grid, x)                        # the rows are on the grid already
    packed = quant.pack_fp4_ue8m0_rows(on_grid)
    assert packed.shape == (x.shape[0], 64 + 4) and packed.dtype == jnp.uint8
    assert same_bits(quant.unpack_fp4_ue8m0_rows(packed, dtype=jnp.float32), x)
    off = x.copy()
    off[1, 2] = np.float32(x[1, 2] * 1.1 if x[1, 2] else 0.3)
    assert not same_bits(quant.unpack_fp4_ue8m0_rows(quant.pack_fp4_ue8m0_rows(jnp.asarray(off)),
                                                     dtype=jnp.float32), off)
