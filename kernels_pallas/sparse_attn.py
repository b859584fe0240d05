"""Sparse latent attention with a per-head sink, reading K = V rows straight from cache row views.

docs/MODEL.md §3.5; jnp reference: `kernels_pallas.reference.sparse_attn`.

Cache-side input layout (what the step feeds; docs/CACHE.md §1.7, §2.4)
--------------------------------------------------------------------
A *source* is a pair `(rows [R, D], idx [B, S, K])`:
  rows  a flat row view of one cache plane, e.g. the kv owner's compressed rows
        `main[o].reshape(P * rpp, 512)`, the window rings `window.reshape(N * L * ring, 512)`, or
        this step's own new latent rows `[T, 512]` (prefill "extend" rows). A reshape of a
        contiguous cache array is free; nothing is gathered or copied in HBM.
        Rows may also be packed (uint8: the window row's FP8 [R, D + D/32] or the compressed
        row's FP4 [R, D/2 + D/16], `_row_format`), decoded exactly after the gather.
  idx   per query token, K global row ids into `rows` (int32, any negative = skip).
Sources are walked in the order given, each in chunks of 64 ids, exactly as the reference walks
its concatenated list (window part first, then the compressed part, when the caller passes them
in that order). Each K is padded to a multiple of 64 with -1 here. Rows the lists do not name
are never read, so unwritten pages may hold anything (NaN included).

Kernel (Pallas, Triton lowering): grid (head blocks x value parts, tokens, splits). One program
holds one token's 64 heads (or a head block of them) as the M dimension of both products (MQA:
every head shares the rows), so each gathered [64, 512] row tile feeds a [64 x 512] @ [512 x 64]
logit product and a [64 x 64] @ [64 x 512] value product. With two value parts a program
gathers the tile as two column halves, sums the logits from both, and keeps the value product
(and its softmax statistics) for its own half. The online softmax keeps (m, l, acc) in fp32; probabilities are rounded to bf16
before P.V (reference mode) relative to the running max; the sink is folded in at the end.
With splits > 1 the chunk sequence is cut into contiguous parts (the natural cut is window |
compressed), each part writes fp32 partials (m, l, acc), and either the last program of a token's
head block to finish merges them and folds the sink (`merge_in_kernel`: an arrival counter, the
split-K semaphore) or a small XLA epilogue does (`split_merge`: one formula for both). One
split reproduces the reference's rounding points exactly; more splits only move where the bf16
probability rounding is taken (relative to a part's max).
"""

from __future__ import annotations

import functools
import math
from typing import Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernels_pallas import backend as _backend
from kernels_pallas import sparse_attn_mgpu
from kernels_pallas._codecs import fp4_halves, fp4_values, fp8_halves, fp8_values
from kernels_pallas._compat import SQUEEZED, atomic_add, compiler_params, cta_barrier, load
from kernels_pallas.reference import CHUNK, NO_MAX, sparse_attn
from kernels_pallas.split_merge import combine, merge_splits
from v41_jax.quant import (KV_FP4_GROUP, KV_FP8_GROUP, dequant_fp4_e4m3_rows, dequant_fp8_rows,
                           packed_fp4_row_bytes, packed_fp8_row_bytes)
from v41_jax.numerics import HIGHEST, Numerics

Source = tuple[jax.Array, jax.Array]  # (rows [R, D] or packed uint8 rows, idx [..., K])

def _row_format(rows: jax.Array, d: int) -> str:
    """A source's rows for queries of D lanes: "typed" [R, D], or packed uint8 (docs/CACHE.md
    §1.3), "fp8" (the window row: D E4M3 codes, then one E8M0 scale code per 32 lanes) or "fp4"
    (the compressed row: D/2 bytes of two E2M1 codes, the even lane low, then one E4M3 scale code
    per 16 lanes)."""
    widths = {packed_fp8_row_bytes(d): "fp8", packed_fp4_row_bytes(d): "fp4"}
    if rows.dtype == jnp.uint8:
        if rows.shape[-1] not in widths:
            raise ValueError(f"packed rows of {d} lanes are {packed_fp8_row_bytes(d)} (FP8) or "
                             f"{packed_fp4_row_bytes(d)} (FP4) bytes, got {rows.shape[-1]}")
        return widths[rows.shape[-1]]
    if rows.shape[-1] != d:
        raise ValueError(f"rows of {rows.shape[-1]} lanes for queries of {d}")
    return "typed"

# The kernel against its XLA path in reference numerics: outputs are bf16 (2^-8 relative step)
# and the two differ only in fp32 summation order and exp/div implementation, which can move one
# bf16 rounding by one step: rtol = atol = 2^-7 (two steps at |o| ~ 1). The kernel tests and the
# benchmark's check of every timed variant hold it.
BF16_TOL = 2.0 ** -7


def _pad_ids(idx: jax.Array) -> jax.Array:
    """[T, K] -> [T, ceil(K/64)*64] with -1 (a skipped id changes nothing)."""
    return jnp.pad(idx.astype(jnp.int32), ((0, 0), (0, -idx.shape[-1] % CHUNK)), constant_values=-1)


def _split_bounds(split, n_chunks: int, base: int, per_split: int, n_splits: int):
    """Chunk range [lo, hi) of one source (its chunks start at global chunk `base`) in a split."""
    if n_splits == 1:
        return 0, n_chunks
    lo = jnp.clip(split * per_split - base, 0, n_chunks)
    hi = jnp.clip((split + 1) * per_split - base, 0, n_chunks)
    return lo, hi


def _attn_kernel(q_ref, sink_ref, *refs, n_src: int, n_chunks: tuple[int, ...], per_split: int,
                 n_splits: int, scale: float, bf16_probs: bool, prefetch_ids: bool, value_parts: int,
                 lane_pairs: bool, merge_in_kernel: bool, formats: tuple[str, ...], barrier: bool):
    idx_refs, kv_refs, out_refs = refs[:n_src], refs[n_src:2 * n_src], refs[2 * n_src:]
    h, d = q_ref.shape
    split = pl.program_id(2)
    # value halves: this program's output columns (`own`) and the other half, each gathered as a
    # tile of its own; the logits are own . own + other . other. Each part keeps (and writes) its
    # own softmax statistics: compiled, Triton chains the two products into one accumulation in
    # the part's order, so the two parts' logits may differ in the last fp32 bit
    # lane pairs: q arrives with its even lanes in columns [0, D/2) and its odd lanes in [D/2, D);
    # every row is taken as its (even, odd) lanes, two [C, D/2] tiles, and the output leaves in
    # q's order (the caller puts the lanes back): an FP4 byte already holds an (even, odd) pair,
    # so nothing is interleaved per chunk
    dv = d // value_parts
    own = pl.program_id(0) % value_parts * dv
    starts = [own, dv - own] if value_parts == 2 else [0]
    if value_parts == 2:
        qs = [q_ref[:, pl.ds(pl.multiple_of(st, dv), dv)] for st in starts]   # [H, D / 2] each
    elif lane_pairs:
        qs = [q_ref[:, :d // 2], q_ref[:, d // 2:]]
    else:
        qs = [q_ref[...]]                                              # [H, D]
    dtype = q_ref.dtype

    def gather(kv_ref, ids, fmt):
        """A chunk's rows as the tiles the products take, in q's dtype: [C, D] whole, the value
        halves (own, other) [C, D/2] each, or the lane pairs (even, odd) [C, D/2] each. Masked, so
        skipped ids read nothing and give 0 rows (no NaN from unused pages); two broadcast index
        arrays, not (ids, :): interpret mode cannot mix them. Packed rows are decoded exactly (an
        E4M3 code times 2^(s - 127), an E2M1 code times an E4M3 scale: 4 and 6 significant bits,
        bf16s). (Loading each lane's code and scale bytes at its own column instead, with no
        broadcast or interleave, was 2.5-10x slower: byte loads; H100, 2026-12-06 p2.)"""
        at, valid = jnp.maximum(ids, 0)[:, None], (ids >= 0)[:, None]

        def cols(lanes):                                               # columns, 0 if skipped
            return load(kv_ref.at[at, lanes[None, :]], mask=valid, other=0)

        def span(first, n):
            return cols(first + jax.lax.broadcasted_iota(jnp.int32, (n,), 0))

        if lane_pairs:
            if fmt == "typed":                         # two strided loads (typed rows beside packed)
                even = 2 * jax.lax.broadcasted_iota(jnp.int32, (d // 2,), 0)
                return [cols(even).astype(dtype), cols(even + 1).astype(dtype)]
            if fmt == "fp4":
                halves = fp4_halves(span(0, d // 2), span(d // 2, d // KV_FP4_GROUP), group=KV_FP4_GROUP,
                                    e4m3_scales=True)
            else:
                halves = fp8_halves(span(0, d), span(d, d // KV_FP8_GROUP))
            return [x.astype(dtype) for x in halves]

        def part(start):                                               # lanes [start, start + D/V)
            if fmt == "typed":
                return span(start, dv).astype(dtype)                   # fp32 policy: -> fp32
            if fmt == "fp4":
                return fp4_values(span(start // 2, dv // 2),
                                  span(d // 2 + start // KV_FP4_GROUP, dv // KV_FP4_GROUP), dtype,
                                  group=KV_FP4_GROUP, e4m3_scales=True)
            return fp8_values(span(start, dv), span(d + start // KV_FP8_GROUP, dv // KV_FP8_GROUP), dtype)
        return [part(st) for st in starts]

    def attend(kv_ref, fmt, carry, ids):
        """One chunk: its ids [C] folded into (run_max, denom, accumulators)."""
        run_max, denom, accs = carry                                   # [H], [H], ([H, Dv] fp32, ...)
        valid = ids >= 0
        tiles = gather(kv_ref, ids, fmt)
        logits = functools.reduce(jnp.add, [
            jax.lax.dot_general(qh, t, (((1,), (1,)), ((), ())), precision=HIGHEST,
                                preferred_element_type=jnp.float32) for qh, t in zip(qs, tiles)])   # [H, C]
        values = tiles[:1] if value_parts == 2 else tiles              # this program's value columns
        logits = jnp.where(valid[None, :], logits, -jnp.inf) * scale
        new_max = jnp.maximum(run_max, logits.max(axis=1))
        rescale = jnp.exp(run_max - new_max)
        p = jnp.exp(logits - new_max[:, None])
        denom = denom * rescale + p.sum(axis=1)
        if bf16_probs and dtype == jnp.bfloat16:
            pv = p.astype(jnp.bfloat16)                                # exact products, fp32 sum
        else:
            pv = p.astype(jnp.bfloat16).astype(jnp.float32) if bf16_probs else p
            values = [v.astype(jnp.float32) for v in values]
        accs = tuple(acc * rescale[:, None] + jax.lax.dot_general(
            pv, v, (((1,), (0,)), ((), ())), precision=HIGHEST, preferred_element_type=jnp.float32)
            for acc, v in zip(accs, values))
        return new_max, denom, accs

    def chunk_ids(idx_ref, c, n):
        """Chunk c's ids [C] (c clamped to the source's last chunk: a prefetch past it reads the
        last again and is never used)."""
        return idx_ref[pl.ds(pl.multiple_of(jnp.minimum(c, n - 1) * CHUNK, CHUNK), CHUNK)]

    def walk(idx_ref, kv_ref, fmt, n, lo, hi, carry):
        if n == 0:
            return carry
        if not prefetch_ids:
            return jax.lax.fori_loop(lo, hi, lambda c, cr: attend(kv_ref, fmt, cr, chunk_ids(idx_ref, c, n)),
                                     carry)

        # the next chunk's ids loaded while this chunk's rows are gathered: the gather then does
        # not wait for an ids load issued in the same step
        def body(c, cr):
            return (*attend(kv_ref, fmt, cr[:3], cr[3]), chunk_ids(idx_ref, c + 1, n))
        return jax.lax.fori_loop(lo, hi, body, (*carry, chunk_ids(idx_ref, lo, n)))[:3]

    n_acc = 2 if lane_pairs else 1
    carry = (jnp.full((h,), NO_MAX, jnp.float32), jnp.zeros((h,), jnp.float32),
             tuple(jnp.zeros((h, dv // n_acc), jnp.float32) for _ in range(n_acc)))
    base = 0
    for idx_ref, kv_ref, fmt, n in zip(idx_refs, kv_refs, formats, n_chunks):
        lo, hi = _split_bounds(split, n, base, per_split, n_splits)
        carry = walk(idx_ref, kv_ref, fmt, n, lo, hi, carry)
        base += n
    run_max, denom, accs = carry
    width = dv // n_acc

    def put(ref, parts, *lead):                                        # one indexer (Triton lowering)
        for n, part in enumerate(parts):                               # each accumulator its columns
            ref[(*lead, slice(None), pl.ds(n * width, width))] = part.astype(ref.dtype)

    if n_splits == 1:                  # sink: unscaled, denominator only (a one-split `combine`)
        (o_ref,) = out_refs
        put(o_ref, [combine([acc], [run_max], [denom], sink_ref[...], acc.dtype) for acc in accs])
    else:
        # each split writes its partial into its (token, head block)'s blocks of every split
        if merge_in_kernel:
            _, o_ref, acc_ref, max_ref, den_ref, count_ref = out_refs  # the counters' input aliased
        else:
            acc_ref, max_ref, den_ref = out_refs
        put(acc_ref, accs, split)
        max_ref[split] = run_max
        den_ref[split] = denom
        if merge_in_kernel:
            # the last to finish merges them all (the split-K semaphore: the CTA's stores, a
            # barrier, then one acquire-release atomic by one thread; Triton hands a scalar
            # atomic's result to the other threads through shared memory and a barrier, so the
            # merger's loads follow the acquire). `barrier` is off in interpret mode, whose
            # programs run one after another (and which has no rule for it)
            if barrier:
                cta_barrier()
            arrived = atomic_add(count_ref, (pl.program_id(0), pl.program_id(1)), jnp.int32(1))

            @pl.when(arrived == n_splits - 1)
            def _():
                o_ref[...] = combine([acc_ref[n] for n in range(n_splits)], [max_ref[n] for n in range(n_splits)],
                                     [den_ref[n] for n in range(n_splits)], sink_ref[...], o_ref.dtype)


def launch_config(tokens: int, packed: bool = False) -> dict:
    """Heads per program, warps, pipeline depth and value halves, measured (BENCHMARKS.md): up to
    48 query tokens 16-head programs on 4 warps (more programs to hide the gather latency; a
    [16, 512] fp32 accumulator needs no spills; H200, 2026-11-30), loading each chunk's ids a
    loop step ahead (64 tokens 0.0449 -> 0.0418 ms, 32 equal; 2026-12-05). From 49 to 64 tokens
    64-head programs in value halves on 4 warps, 3 stages (H100 at 64 tokens: 0.0390-0.0399 ms
    against 0.0420-0.0443, four runs; equal at 48, slower at 32, 33-47 not measured; 2026-12-06
    y2, p). From 65 tokens every
    head in one 8-warp program with 3 stages (each row read once per token; the grid fills the
    GPU anyway). Slower wherever tried (H100, 2026-12-06 t, w-z): 16 warps for 64 heads, the next
    chunk's rows carried in registers, a gather per product, the output's columns in 2-4
    programs each gathering whole rows, and the one-product 64-head program at 32 / 64 tokens.
    Packed rows (any source) at every token count: every head in one 8-warp program with 3
    stages, so a row is gathered and decoded once per token, not once per head block (H100 at 1 /
    8 / 32 / 64 / 128 tokens: 0.036 / 0.041 / 0.061 / 0.118 / 0.134 ms against 0.046 / 0.068 /
    0.143 / 0.244 / 0.440 for 16-head programs and 0.057 / 0.080 / 0.121 / 0.183 / 0.362 for
    value halves; 2026-12-06 p and g2; 9-31 tokens not measured); from 64 tokens each row as its
    (even, odd) lanes (`lane_pairs`: 64 / 96 / 128 / 4,096 tokens 0.108 / 0.113 / 0.118 / 3.20 ms
    against 0.122 / 0.125 / 0.136 / 3.73 whole; at 32 slower, 0.073 against 0.062; H100,
    2026-12-07 j and k; 33-63 not measured)."""
    if tokens > 64 or packed:
        return dict(head_block=64, num_warps=8, num_stages=3, prefetch_ids=False, value_parts=1,
                    lane_pairs=packed and tokens >= 64)
    if tokens <= 48:
        return dict(head_block=16, num_warps=4, num_stages=2, prefetch_ids=True, value_parts=1,
                    lane_pairs=False)
    return dict(head_block=64, num_warps=4, num_stages=3, prefetch_ids=False, value_parts=2,
                lane_pairs=False)


def merge_in_kernel_default(splits: int, head_block: int) -> bool:
    """Whether the last program of a token's head block to finish merges the splits (else the XLA
    epilogue), measured (BENCHMARKS.md m): for 16-head programs at 2 splits (32 tokens 0.0270 /
    0.0269 / 0.0270 ms against 0.0351 / 0.0314 / 0.0307 with the epilogue, three pairs of runs,
    H100 2026-12-07); slower at 4 splits (8 tokens +12 %) and for 64-head programs (+6 % at 2
    splits, +23-28 % at 4: one program then reads 256-512 KiB of partials alone)."""
    return splits == 2 and head_block == 16


def default_splits(tokens: int, n_chunks: int) -> int:
    """Splits only while the token grid alone leaves most of the GPU idle: each split costs an
    fp32 [H, D] partial write + read (128 KiB per token at real size, twice one chunk's rows).
    Measured on the H200 (BENCHMARKS.md): 4 splits best at 1-8 tokens, 2 at 32, none from 64."""
    splits = 4 if tokens <= 16 else 2 if tokens < 64 else 1
    return max(1, min(splits, n_chunks))


@functools.partial(jax.jit, static_argnames=("scale", "bf16_probs", "num_splits", "num_warps",
                                             "num_stages", "interpret", "head_block", "prefetch_ids",
                                             "value_parts", "lane_pairs", "merge_in_kernel"))
def _sparse_attn_pallas(q, sink, rows, idx, *, scale, bf16_probs, num_splits, num_warps,
                        num_stages, interpret, head_block, prefetch_ids, value_parts, lane_pairs,
                        merge_in_kernel):
    t, h, d = q.shape
    if d & (d - 1) or d < 16:
        raise ValueError(f"head dim {d}: the kernel needs a power of two >= 16")
    hp = max(16, 1 << (h - 1).bit_length())                            # dot M: power of two >= 16
    q = jnp.pad(q, ((0, 0), (0, hp - h), (0, 0)))
    if lane_pairs:                                     # even lanes, then odd (the kernel's order)
        q = q.reshape(t, hp, d // 2, 2).swapaxes(-1, -2).reshape(t, hp, d)
    sink_p = jnp.pad(sink.astype(jnp.float32), (0, hp - h))
    formats = tuple(_row_format(r, d) for r in rows)
    idx = [_pad_ids(i) for i in idx]
    n_chunks = tuple(i.shape[1] // CHUNK for i in idx)
    total = sum(n_chunks)
    n_splits = max(1, min(num_splits, total))
    per_split = -(-total // n_splits)

    hb = max(16, min(head_block or hp, hp))                            # heads per program (pow2)
    # grid (head block, token, split): a token's head blocks run side by side, so its rows come
    # from HBM once and from L2 after (measured as fast or faster at every shape, 2-8%)
    # value halves: the output's columns cut in `vp` parts, one program each; every part computes
    # the chunk's logits over all of D (the softmax is the whole row's), its fp32 accumulator is
    # [hb, D / vp]. Axis 0 is (head block, part).
    if value_parts not in (1, 2) or d // value_parts < 16:
        raise ValueError(f"value_parts {value_parts}: 1, or 2 with D/2 >= 16 (got D {d})")
    vp, dv = value_parts, d // value_parts
    if lane_pairs and vp != 1:
        raise ValueError("lane_pairs takes value_parts=1 (each program computes every column)")
    for fmt, group in (("fp8", KV_FP8_GROUP), ("fp4", KV_FP4_GROUP)):
        if fmt in formats and dv % group:
            raise ValueError(f"packed {fmt} rows: D/value_parts = {dv} lanes is no whole number of "
                             f"{group}-lane groups")
    if merge_in_kernel is None:
        merge_in_kernel = merge_in_kernel_default(n_splits, hb)
    grid = (hp // hb * vp, t, n_splits)
    sq = SQUEEZED
    in_specs = ([pl.BlockSpec((sq, hb, d), lambda g, i, s: (i, g // vp, 0)),
                 pl.BlockSpec((hb,), lambda g, i, s: (g // vp,))]
                + [pl.BlockSpec((sq, x.shape[1]), lambda g, i, s: (i, 0)) for x in idx]
                + [pl.BlockSpec(r.shape, lambda *_: (0, 0)) for r in rows])
    out_shape = jax.ShapeDtypeStruct((t, hp, d), q.dtype)
    out_specs = pl.BlockSpec((sq, hb, dv), lambda g, i, s: (i, g // vp, g % vp))
    extra, aliases = (), {}
    if n_splits > 1:
        # the partials: a program's blocks hold every split of its (token, head block)
        stats = jax.ShapeDtypeStruct((t, n_splits, vp, hp), jnp.float32)
        stat_spec = pl.BlockSpec((sq, n_splits, sq, hb), lambda g, i, s: (i, 0, g % vp, g // vp))
        parts = ((jax.ShapeDtypeStruct((t, n_splits, hp, d), jnp.float32), stats, stats),
                 (pl.BlockSpec((sq, n_splits, hb, dv), lambda g, i, s: (i, 0, g // vp, g % vp)),
                  stat_spec, stat_spec))
        if merge_in_kernel:      # and the output, and the arrival counters (one a head block and token)
            counts = jnp.zeros(grid[:2], jnp.int32)
            count_spec = pl.BlockSpec(counts.shape, lambda *_: (0, 0))
            extra, aliases = (counts,), {len(in_specs): 4}           # the last input: the counters
            in_specs.append(count_spec)
            out_shape = (out_shape, *parts[0], jax.ShapeDtypeStruct(counts.shape, jnp.int32))
            out_specs = (out_specs, *parts[1], count_spec)
        else:
            out_shape, out_specs = parts
    kernel = functools.partial(_attn_kernel, n_src=len(rows), n_chunks=n_chunks,
                               per_split=per_split, n_splits=n_splits, scale=scale,
                               bf16_probs=bf16_probs, prefetch_ids=prefetch_ids, value_parts=vp,
                               lane_pairs=lane_pairs, merge_in_kernel=merge_in_kernel, formats=formats,
                               barrier=not interpret)
    out = pl.pallas_call(
        kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        input_output_aliases=aliases, compiler_params=compiler_params(num_warps, num_stages),
        interpret=interpret, name="sparse_latent_attn",
    )(q, sink_p, *idx, *rows, *extra)
    if n_splits > 1:
        out = out[0] if merge_in_kernel else merge_splits(*out, sink_p, q.dtype)
    if lane_pairs:                                     # lanes back in place
        out = out.reshape(t, hp, 2, d // 2).swapaxes(-1, -2).reshape(t, hp, d)
    return out[:, :h]


def _flatten(q: jax.Array, sources: Sequence[Source]):
    lead = q.shape[:-2]
    t = math.prod(lead)
    q2 = q.reshape(t, *q.shape[-2:])
    rows = tuple(r for r, _ in sources)
    idx = tuple(i.reshape(t, i.shape[-1]) for _, i in sources)
    return lead, q2, rows, idx


def decode_rows(rows: jax.Array, d: int, dtype) -> jax.Array:
    """Gathered rows [..., W] of one source (typed, or packed as `_row_format` reads them) -> their
    values [..., D] in `dtype`, exactly: the XLA paths' decode after their gathers."""
    fmt = _row_format(rows, d)
    if fmt == "fp8":
        return dequant_fp8_rows(rows[..., :d], rows[..., d:], KV_FP8_GROUP, dtype)
    if fmt == "fp4":
        return dequant_fp4_e4m3_rows(rows[..., :d // 2], rows[..., d // 2:], KV_FP4_GROUP, dtype)
    return rows


def sparse_attn_paged_xla(q: jax.Array, sink: jax.Array, sources: Sequence[Source], scale: float,
                          *, numerics: Numerics) -> jax.Array:
    """The XLA path and the kernel's reference: gather each token's rows, concatenate the sources
    in order, and run the reference's sparse attention core on the gathered list."""
    lead, q2, rows, idx = _flatten(q, sources)
    gathered, local, offset = [], [], 0
    for r, i in zip(rows, idx):
        i = _pad_ids(i)
        gathered.append(decode_rows(r[jnp.maximum(i, 0)], q2.shape[-1], numerics.act_dtype))   # [T, K_i, D]
        local.append(jnp.where(i >= 0, offset + jnp.arange(i.shape[1], dtype=jnp.int32), -1))
        offset += i.shape[1]
    kv = jnp.concatenate(gathered, axis=1)                             # [T, K, D] (materialised)
    ids = jnp.concatenate(local, axis=1)[:, None, :]                   # [T, 1, K]
    out = sparse_attn(q2[:, None], kv, sink, ids, scale, numerics=numerics)
    return out[:, 0].reshape(*lead, *q.shape[-2:])


def sparse_attn_paged(q: jax.Array, sink: jax.Array, sources: Sequence[Source], scale: float, *,
                      numerics: Numerics, backend: str | None = None,
                      num_splits: int | None = None, num_warps: int | None = None,
                      num_stages: int | None = None, head_block: int | None = None,
                      prefetch_ids: bool | None = None, value_parts: int | None = None,
                      lane_pairs: bool | None = None, merge_in_kernel: bool | None = None,
                      impl: str | None = None) -> jax.Array:
    """Sparse attention of every query token over the rows its index lists name.

    q [..., H, D] (bf16 in reference numerics, fp32 in the fp32 policy); sink [H] fp32;
    sources: ((rows [R_i, D] or packed uint8 rows (FP8 [R_i, D + D/32], FP4 [R_i, D/2 + D/16]),
    idx [..., K_i] int32, negative = skip), ...), walked in order;
    scale: softmax scale of q.k (Dh^-0.5). Returns [..., H, D] in the activation dtype; 0 for a
    token with no valid id. numerics.attn_probs_bf16 rounds the unnormalised probabilities to bf16
    before P.V (the reference kernel).
    num_splits None = `default_splits`; head_block (heads per program, a power of two),
    num_warps, num_stages (Triton launch parameters), prefetch_ids (each chunk's ids loaded one
    loop step ahead of its gather) and value_parts (1, or 2: the output's columns in two programs,
    each computing the logits over all of D from the rows' two halves), lane_pairs (every row
    taken as its even and its odd lanes, two half tiles, as an FP4 byte holds them: no interleave
    after the decode; packed rows 9-14 % faster from 64 tokens, 18 % slower at 32, H100
    2026-12-07 j / k, so the packed default from 64 tokens), merge_in_kernel (with splits, the
    last program of a token's head block to finish merges the partials, a split-K semaphore,
    instead of an XLA epilogue): None = `launch_config`.
    impl: None / "triton" (the portable kernel) or "mgpu" (`sparse_attn_mgpu`, NVIDIA Hopper:
    warp specialised, rows copied by TMA; num_splits None = its `default_splits`). Not the
    default: measured equal to the Triton kernel at 128 tokens and slower at 32 / 64 (H100,
    2026-12-06 g3, BENCHMARKS.md).
    """
    if _backend.resolve(backend) == "xla":
        return sparse_attn_paged_xla(q, sink, sources, scale, numerics=numerics)
    lead, q2, rows, idx = _flatten(q, sources)
    n_chunks = sum(-(-i.shape[1] // CHUNK) for i in idx)
    if impl == "mgpu":
        q2 = q2.astype(numerics.act_dtype)
        if not (numerics.attn_probs_bf16 and sparse_attn_mgpu.supported(q2, rows)):
            raise ValueError("impl='mgpu' takes bf16 queries and typed bf16 rows of 512 lanes, at most "
                             "64 heads, bf16 probabilities (reference or fast numerics)")
        triton_only = [k for k, v in (("num_warps", num_warps), ("num_stages", num_stages),
                                      ("head_block", head_block), ("prefetch_ids", prefetch_ids),
                                      ("value_parts", value_parts), ("lane_pairs", lane_pairs),
                                      ("merge_in_kernel", merge_in_kernel))
                      if v is not None]
        if triton_only:
            raise ValueError(f"impl='mgpu' has no Triton launch parameters: {', '.join(triton_only)}")
        splits = num_splits or sparse_attn_mgpu.default_splits(q2.shape[0], n_chunks)
        out = sparse_attn_mgpu.sparse_attn_mgpu(q2, sink, rows, tuple(_pad_ids(i) for i in idx),
                                                scale=float(scale), num_splits=splits)
        return out.reshape(*lead, *q.shape[-2:])
    if impl not in (None, "triton"):
        raise ValueError(f"sparse attention impl {impl!r}: 'triton' (the default) or 'mgpu'")
    splits = default_splits(q2.shape[0], n_chunks) if num_splits is None else num_splits
    launch = launch_config(q2.shape[0], packed=any(r.dtype == jnp.uint8 for r in rows))
    if q.shape[-1] // 2 < 16:                      # value halves need 16 lanes each: whole rows
        launch["value_parts"] = 1
    launch.update({k: v for k, v in (("head_block", head_block), ("num_warps", num_warps),
                                     ("num_stages", num_stages), ("prefetch_ids", prefetch_ids),
                                     ("value_parts", value_parts), ("lane_pairs", lane_pairs),
                                     ("merge_in_kernel", merge_in_kernel))
                   if v is not None})
    if value_parts == 2 and lane_pairs is None:    # value halves given: whole rows, not the default pairs
        launch["lane_pairs"] = False
    if lane_pairs and value_parts is None:         # lane pairs given: whole-row programs
        launch["value_parts"] = 1
    launch.setdefault("merge_in_kernel", None)    # None: decided where the splits and head block are
    out = _sparse_attn_pallas(q2.astype(numerics.act_dtype), sink, rows, idx, scale=float(scale),
                              bf16_probs=numerics.attn_probs_bf16,
                              num_splits=splits, interpret=_backend.interpret(), **launch)
    return out.reshape(*lead, *q.shape[-2:])
