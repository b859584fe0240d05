"""RoPE on the last lanes of wide rows, written in place: one Pallas kernel (Triton lowering) per call.

docs/MODEL.md §3.1; jnp reference and XLA path: `kernels_pallas.reference.apply_rope`.

  apply_rope(x [..., H, W] or [..., W], cos, sin, inverse=False, *, backend=None) -> x.dtype
      Bit-equal to the reference. cos / sin: fp32 [..., 1, R/2] against x [..., H, W] (one angle
      for every head of a row), or [..., R/2] against x [..., W].

Why a kernel: the XLA path rotates the R lanes and concatenates them after the W - R it leaves
alone, so every call rewrites all W lanes (an in-place `dynamic_update_slice` is miscompiled by
XLA:CPU here, BENCHMARKS.md 2026-12-05 c). On the attention's queries and outputs (W = 512, R = 64,
64 heads) that is the whole [T, H, W] tensor read and written per layer: 3.8 ms of an 8K-token
prefill. Here x is the kernel's output as well (`input_output_aliases`): a program reads and
writes only the rotated lanes of a block of rows of one head, R / W of the bytes. Where x's
buffer is still needed elsewhere XLA copies it first, which costs what the concatenate did, so
the model calls this only where the rotation is x's last use (its queries and outputs; the index
and KV rows keep the XLA rule, which fuses into their quantization).

Exactness: the reference's operations: four products each rounded to fp32 (`numerics.rounded`:
Triton contracts a product into the add after it as an FMA), one add each, one cast back.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernels_pallas import backend as _backend
from kernels_pallas import reference as ref
from kernels_pallas._compat import compiler_params, load, store
from v41_jax.numerics import rounded

ROW_BLOCK, WARPS = 64, 4   # rows of one head a program: [64, R/2] pairs, 16 lanes' pairs a thread at R = 64


def _rope_kernel(cos_ref, sin_ref, x_ref, o_ref, *, width: int, inverse: bool, br: int):
    rows, half = cos_ref.shape
    r = pl.program_id(0) * br + jax.lax.broadcasted_iota(jnp.int32, (br, 1), 0)
    j = jax.lax.broadcasted_iota(jnp.int32, (1, half), 1)
    live = jnp.broadcast_to(r < rows, (br, half))
    even = pl.program_id(1) * width + width - 2 * half + 2 * j          # column of lane 2i in [R, H * W]
    a = load(x_ref.at[r, even], mask=live, other=0).astype(jnp.float32)
    b = load(x_ref.at[r, even + 1], mask=live, other=0).astype(jnp.float32)
    c = load(cos_ref.at[r, j], mask=live, other=0)
    s = load(sin_ref.at[r, j], mask=live, other=0)
    if inverse:
        s = -s
    store(o_ref.at[r, even], (rounded(a * c) - rounded(b * s)).astype(o_ref.dtype), mask=live)
    store(o_ref.at[r, even + 1], (rounded(a * s) + rounded(b * c)).astype(o_ref.dtype), mask=live)


@functools.partial(jax.jit, static_argnames=("heads", "inverse", "interpret"))
def _rope_pallas(x2, cos2, sin2, *, heads, inverse, interpret):
    rows, hw = x2.shape
    kernel = functools.partial(_rope_kernel, width=hw // heads, inverse=inverse, br=ROW_BLOCK)
    whole = lambda a: pl.BlockSpec(a.shape, lambda i, h: (0, 0))    # rows and lanes addressed in the kernel
    return pl.pallas_call(
        kernel, grid=(pl.cdiv(rows, ROW_BLOCK), heads),
        in_specs=[whole(cos2), whole(sin2), whole(x2)], out_specs=whole(x2),
        out_shape=jax.ShapeDtypeStruct(x2.shape, x2.dtype), input_output_aliases={2: 0},
        compiler_params=compiler_params(WARPS, 1), interpret=interpret, name="rope_in_place",
    )(cos2, sin2, x2)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array, inverse: bool = False, *,
               backend: str | None = None) -> jax.Array:
    """`kernels_pallas.reference.apply_rope`, in place on the Pallas backend (module docstring)."""
    if _backend.resolve(backend, kernel="rope") == "xla":
        return ref.apply_rope(x, cos, sin, inverse)
    half = cos.shape[-1]
    # the tables' missing leading axes (a [T, 1, R/2] table against [B, T, H, W] rows) are 1s:
    # without them the one-angle-per-row case would read as per-head tables, [B T H, R/2] in HBM
    pad = (1,) * (x.ndim - cos.ndim)
    cos, sin = cos.reshape(pad + cos.shape), sin.reshape(pad + sin.shape)
    per_head = cos.shape[-2] == 1 and x.ndim >= 2
    lead = x.shape[:-2] if per_head else x.shape[:-1]
    heads = x.shape[-2] if per_head else 1
    rows = math.prod(lead)
    table = lambda t: jnp.broadcast_to(t.astype(jnp.float32), (*lead, *((1,) if per_head else ()), half)).reshape(rows, half)
    out = _rope_pallas(x.reshape(rows, heads * x.shape[-1]), table(cos), table(sin), heads=heads,
                       inverse=inverse, interpret=_backend.interpret())
    return out.reshape(x.shape)
