"""The mHC expand + collapse kernel (`kernels_pallas.hc_expand`, interpreted here) and its use by
the block (docs/MODEL.md §3.2).

Exact: the new streams and the collapse, bit for bit the XLA rule's, on rows and widths that are
not multiples of the blocks (masked lanes). Not exact: the two sums of squares, which the fast RMS
takes in the backend's order: against the float64 sum of the same rounded values, within the
bound of any fp32 order, gamma_(n+1) = (n + 1) u / (1 - (n + 1) u) relative, u = 2^-24, n terms
(each square rounded once, then at most n - 1 rounded adds; all terms >= 0, so relative to the
sum itself). One missing column block of 64 moves the sum by ~1 / blocks, far outside.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import hc_expand, reference as ref
from tests.kernels_common import fresh_rng
from v41_jax.model import mhc
from v41_jax.model.numerics import Numerics


def _gamma(n: int) -> float:
    nu = (n + 1) * 2.0 ** -24
    return nu / (1 - nu)


def _inputs(rng, rows: int, n: int, d: int, dtype):
    big = np.exp(rng.standard_normal((rows, n, d)))                      # magnitudes over ~e^+-3
    comb = rng.random((rows, n, n))
    return (jnp.asarray(rng.standard_normal((rows, d)) * 3, dtype), jnp.asarray(rng.standard_normal((rows, n, d)) * big, dtype),
            jnp.asarray(rng.random((rows, n)) * 2, jnp.float32), jnp.asarray(comb / comb.sum(-1, keepdims=True), jnp.float32),
            jnp.asarray(rng.random((rows, n)), jnp.float32))


def _exact_sumsq(v) -> np.ndarray:
    v = np.asarray(v, np.float64).reshape(v.shape[0], -1)
    return (v * v).sum(-1)


@pytest.mark.parametrize("rows,n,d,dtype,block_cols", [
    (1, 4, 512, jnp.bfloat16, 256),      # a decode row, two column blocks
    (9, 4, 300, jnp.bfloat16, 128),      # rows past the row block, columns past the last block masked
    (5, 2, 48, jnp.float32, 256),        # fp32 activations, one column block of 64 wider than D
])
def test_kernel_equals_the_rule_and_its_sums_are_within_any_orders_bound(rows, n, d, dtype, block_cols):
    rng, seed = fresh_rng()
    args = _inputs(rng, rows, n, d, dtype)
    y, c, ss, css = hc_expand.expand_collapse(*args, backend="pallas", block_cols=block_cols)
    want_y, want_c = ref.expand_collapse(*args)
    assert y.dtype == want_y.dtype and c.dtype == want_c.dtype
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(want_y, np.float32), err_msg=f"seed {seed}")
    np.testing.assert_array_equal(np.asarray(c, np.float32), np.asarray(want_c, np.float32), err_msg=f"seed {seed}")
    for got, values, terms in ((ss, y, n * d), (css, c, d)):
        exact = _exact_sumsq(values)
        rel = np.abs(np.asarray(got, np.float64) - exact) / exact
        assert rel.max() <= _gamma(terms), (seed, rel.max(), _gamma(terms))


def test_the_rule_is_the_models_expand_and_collapse():
    """`reference.expand_collapse` (the kernel's XLA path) is the model's expand, then its collapse,
    bit for bit, on any lead shape."""
    rng, seed = fresh_rng()
    f, x, post, comb, pre = _inputs(rng, 6, 4, 96, jnp.bfloat16)
    y, c = ref.expand_collapse(f, x, post, comb, pre)
    lead = lambda a: a.reshape(2, 3, *a.shape[1:])
    want_y = mhc.expand(lead(f), lead(x), lead(post), lead(comb))
    np.testing.assert_array_equal(np.asarray(lead(y), np.float32), np.asarray(want_y, np.float32), err_msg=f"seed {seed}")
    np.testing.assert_array_equal(np.asarray(lead(c), np.float32),
                                  np.asarray(mhc.collapse(want_y, lead(pre)), np.float32), err_msg=f"seed {seed}")


def test_the_sums_come_only_with_the_fast_rms_on_the_kernel():
    """`mhc.expand_collapse` / `input_collapse`: with the exact RMS or on the XLA path no sums (their
    consumers compute them from the streams); with the fast RMS on the kernel, the kernel's, and
    the statistic taken from them is the one computed from the streams within the sums' bound;
    `input_collapse` gives the same structure as the expand in every case (a scanned run's carry)."""
    from kernels_pallas import backend
    from v41_jax.model.norm import rms_inv
    rng, seed = fresh_rng()
    f, x, post, comb, pre = (a.reshape(2, 4, *a.shape[1:]) for a in _inputs(rng, 8, 4, 128, jnp.bfloat16))
    fast = Numerics.fast()
    want_y, want = mhc.expand_collapse(f, x, post, comb, pre, Numerics.reference())
    for numerics, name in ((Numerics.reference(), "pallas"), (fast, "xla"), (fast, "pallas")):
        with backend.use_backend(name, kernel="hc_expand"):
            y, got = mhc.expand_collapse(f, x, post, comb, pre, numerics)
            fresh = mhc.input_collapse(y, pre, numerics)
        np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(want_y, np.float32))
        np.testing.assert_array_equal(np.asarray(got.c, np.float32), np.asarray(want.c, np.float32))
        np.testing.assert_array_equal(np.asarray(fresh.c, np.float32), np.asarray(want.c, np.float32))
        sums = not numerics.exact_rms and name == "pallas"
        for g in (got, fresh):
            assert (g.x_sumsq is not None, g.c_sumsq is not None) == (sums, sums), (numerics, name)
    assert got.x_sumsq.shape == (2, 4, 1) and got.c_sumsq.shape == (2, 4, 1)
    # each sum within gamma of the exact one, so the two within 2 gamma; the root halves that;
    # then each side's division by the count, its eps add and its rsqrt: 8 ulps for those
    for stat, values in ((got.x_sumsq, y.reshape(2, 4, -1)), (got.c_sumsq, got.c)):
        a, b = rms_inv(values, 1e-20, fast, stat), rms_inv(values, 1e-20, fast)
        rel = np.abs(np.asarray(a, np.float64) / np.asarray(b, np.float64) - 1)
        assert rel.max() <= _gamma(values.shape[-1]) + 8 * 2.0 ** -24, (seed, rel.max())


def test_scanned_runs_carry_the_sums_through_the_stack(tmp_path, monkeypatch):
    """The forward traces with the sums handed from block to block on the runs-wired tiny model
    (runs from layer 0, after an Engram layer, DSpark taps inside; tests/test_layer_runs.py): a
    scanned run's carry keeps one structure, and every expand is the kernel's (two a block,
    unrolled; a scanned run's body traced once). Traced only: XLA:CPU compiles the fast policy for
    minutes; the values are the unit tests' above."""
    import json

    import jax

    from kernels_pallas import backend
    from scripts.make_checkpoint import make_checkpoint
    from scripts.scan_rounding import RUNS_WIRING
    from tests.engine_common import ROOT
    from v41_jax.checkpoint.load import load_params
    from v41_jax.model.forward import forward
    from v41_jax.model.layer_runs import layer_runs, stack_runs

    raw = json.loads((ROOT / "v41_jax/configs/tiny.config.json").read_text())
    raw["text_config"].update(RUNS_WIRING)
    (tmp_path / "runs.config.json").write_text(json.dumps(raw))
    make_checkpoint(str(tmp_path / "runs.config.json"), str(tmp_path / "ckpt"), 0)
    cfg, params = load_params(tmp_path / "ckpt", progress=False)
    rows = {l: jnp.zeros((1, 12, cfg.engram_hash_cols, cfg.engram_head_dim), jnp.bfloat16)
            for l in cfg.engram_layer_ids}
    run = lambda p: forward(p, cfg, jnp.zeros((1, 12), jnp.int32), numerics=Numerics.fast(), engram_rows=rows)
    calls = []
    real = hc_expand._expand_collapse_pallas
    monkeypatch.setattr(hc_expand, "_expand_collapse_pallas", lambda *a, **k: calls.append(1) or real(*a, **k))
    scanned = sum(len(r) - 1 for r in layer_runs(cfg, params))          # layers whose block is not traced
    for name, unrolled in (("pallas", 2 * cfg.n_layers), ("xla", 0)):
        with backend.use_backend(name, kernel="hc_expand"):
            for p, want in ((params, unrolled), (stack_runs(params, cfg), unrolled and unrolled - 2 * scanned)):
                calls.clear()
                assert jax.eval_shape(run, p).shape == (1, 12, cfg.vocab_size)
                assert len(calls) == want, (name, len(calls), want)
