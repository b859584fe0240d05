"""The in-place RoPE kernel (`kernels_pallas.rope`) against its XLA path, bit for bit, in Pallas
interpret mode: per-head angles on [..., H, W] rows and per-row angles on [..., W] rows, both
directions, bf16 and fp32, row counts that do not fill the last block. Exact equality is the
tolerance: both round the same four products and two adds, and the lanes the kernel does not
write must come back as they went in. Also: where the input is still read after the call, XLA
keeps it intact (the aliased buffer is a copy there), and the model's queries and outputs take the
kernel only on the Pallas backend."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_common import fresh_rng
from kernels_pallas import backend
from kernels_pallas import reference as ref
from kernels_pallas.rope import ROW_BLOCK, apply_rope


def _angles(rng, shape):
    theta = jnp.asarray(rng.uniform(-40, 40, shape).astype(np.float32))
    return jnp.cos(theta), jnp.sin(theta)


@pytest.mark.parametrize("lead,heads,width,half,dtype", [
    ((3, 5), 4, 48, 8, jnp.bfloat16), ((ROW_BLOCK + 3,), 2, 64, 16, jnp.bfloat16),
    ((2, 7), None, 40, 4, jnp.float32), ((1,), 3, 16, 8, jnp.float32),
])
@pytest.mark.parametrize("inverse", [False, True], ids=["forward", "inverse"])
def test_kernel_equals_xla_path_bit_for_bit(lead, heads, width, half, dtype, inverse):
    rng, seed = fresh_rng()
    shape = (*lead, heads, width) if heads else (*lead, width)
    x = jnp.asarray((rng.standard_normal(shape) * np.exp(2 * rng.standard_normal(shape))).astype(np.float32), dtype)
    cos, sin = _angles(rng, (*lead, 1, half) if heads else (*lead, half))
    want = jax.jit(lambda x, c, s: ref.apply_rope(x, c, s, inverse))(x, cos, sin)
    got = jax.jit(lambda x, c, s: apply_rope(x, c, s, inverse, backend="pallas"))(x, cos, sin)
    assert got.dtype == x.dtype and got.shape == x.shape
    np.testing.assert_array_equal(np.asarray(got, np.float32).view(np.uint32),
                                  np.asarray(want, np.float32).view(np.uint32), err_msg=f"seed {seed}")
    # and the rotation moved something (the angles are not all zero)
    assert not np.array_equal(np.asarray(got[..., -2 * half:]), np.asarray(x[..., -2 * half:]))


def test_input_read_after_the_call_stays_intact():
    rng, seed = fresh_rng()
    x = jnp.asarray(rng.standard_normal((6, 2, 32)), jnp.bfloat16)
    cos, sin = _angles(rng, (6, 1, 8))

    @jax.jit
    def both(x):
        y = x * 2                        # an intermediate: XLA may alias it, yet reads it again below
        return apply_rope(y, cos, sin, backend="pallas"), y
    rotated, y = both(x)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x * 2), err_msg=f"seed {seed}")
    np.testing.assert_array_equal(np.asarray(rotated), np.asarray(ref.apply_rope(x * 2, cos, sin)))


def test_one_table_row_serves_every_head():
    """The attention's shapes (a [T, 1, R/2] table against [B, T, H, W] rows, no batch axis in the
    table): the kernel gets [B T, R/2] tables and H heads a row, not a table row per head."""
    rng, seed = fresh_rng()
    x = jnp.asarray(rng.standard_normal((2, 5, 4, 32)), jnp.bfloat16)
    cos, sin = _angles(rng, (5, 1, 8))
    fn = lambda x: apply_rope(x, cos, sin, backend="pallas")
    call = next(e for e in jax.make_jaxpr(fn)(x).eqns if e.primitive.name in ("jit", "pjit"))
    assert [tuple(v.aval.shape) for v in call.invars] == [(10, 4 * 32), (10, 8), (10, 8)]
    np.testing.assert_array_equal(np.asarray(jax.jit(fn)(x), np.float32),
                                  np.asarray(ref.apply_rope(x, cos, sin), np.float32), err_msg=f"seed {seed}")


def test_model_rotates_in_place_only_on_the_pallas_backend():
    from v41_jax.model.rope import apply_rope as model_rope
    x = jnp.ones((4, 2, 16), jnp.bfloat16)
    cos, sin = _angles(np.random.default_rng(0), (4, 1, 4))
    traced = lambda in_place: str(jax.make_jaxpr(lambda x: model_rope(x, cos, sin, in_place=in_place))(x))
    with backend.use_backend("pallas", kernel="rope"):
        assert "pallas_call" in traced(True) and "pallas_call" not in traced(False)
    with backend.use_backend("xla", kernel="rope"):
        assert "pallas_call" not in traced(True)


def test_whole_forward_takes_the_kernel_bit_for_bit(tmp_path):
    """The tiny model's full forward with the queries and outputs rotated in place equals the XLA
    rule's, every logit bit: the in-place write is what an in-place `dynamic_update_slice` got
    wrong on XLA:CPU inside the whole graph while every piece alone was right (BENCHMARKS.md,
    2026-12-05 c), so the check is on the whole graph."""
    from engine_common import build_model, forward_logits
    from v41_jax.model.numerics import Numerics
    cfg, params, token_map = build_model(tmp_path, "tiny")
    tokens = np.random.default_rng(0).integers(3, cfg.vocab_size - 1, 40).astype(np.int32)
    logits = {}
    for name in ("xla", "pallas"):
        with backend.use_backend(name, kernel="rope"):
            logits[name] = forward_logits(params, cfg, token_map, tokens, Numerics.reference())
    np.testing.assert_array_equal(logits["pallas"].view(np.uint32), logits["xla"].view(np.uint32))
