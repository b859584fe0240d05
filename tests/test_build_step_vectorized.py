"""`build_step` / `validate_spans`, vectorized over spans, against the per-span loop they replaced.

The loop lives on here as `_reference_build_step` / `_reference_validate_spans` (verbatim copies of
v41_jax/runtime/metadata.py before vectorization, helpers included). Properties, over random
geometries of the test configs, random span sets and buckets that fit:

* every field of the StepBatch is bit-identical to the reference (ndarray, dtype, shape, values:
  plan row order and -1 tails included), and so are the BuiltStep's bucket and logit_owner;
* an invalid batch (one or more rule violations anywhere) is refused with the same exception and
  message as the reference, or accepted by both with identical output.

`test_host_time` prints old vs new host time (not an assertion).
"""

from __future__ import annotations

import time
from dataclasses import fields, replace
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.engine_common import SETTINGS
from v41_jax.cache.bookkeeping import NULL_PAGE
from v41_jax.cache.geometry import CacheGeometry
from v41_jax.config import ModelConfig
from v41_jax.runtime.metadata import Bucket, BuiltStep, Span, StepBatch, build_step, no_spec, plan_capacity
from v41_jax.runtime.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
CFGS = {name: ModelConfig.from_file(ROOT / f"v41_jax/configs/{name}.config.json") for name in ("tiny", "modes")}


# ---- the reference: metadata.py's per-span loop, as it was ----------------------------------------
def _reference_pad_rows(parts: list, cap: int, width: int) -> np.ndarray:
    """Concatenate per-request plan rows [n, width] and fill the tail with -1 sentinels."""
    out = np.full((cap, width), -1, np.int32)
    rows = np.concatenate(parts) if parts else np.zeros((0, width), np.int32)
    out[: len(rows)] = rows
    return out


def _reference_validate_spans(geom, cfg, bucket, spans) -> None:
    """The begin_step rules (docs/CACHE.md §2.5): every violation is an error before any work."""
    n_slots, n_pages, b = geom.settings.slots, geom.settings.num_pages, geom.settings.page_tokens
    if len(spans) > bucket.requests:
        raise ValueError(f"{len(spans)} spans exceed the bucket's {bucket.requests} requests")
    if sum(len(s.tokens) for s in spans) > bucket.tokens:
        raise ValueError(f"{sum(len(s.tokens) for s in spans)} tokens exceed the bucket's {bucket.tokens}")
    if sum(len(s.tokens) if s.all_logits else 1 for s in spans) > bucket.logits:
        raise ValueError(f"logits rows exceed the bucket's {bucket.logits}")
    slots = [s.slot for s in spans]
    if len(set(slots)) != len(slots) or any(not 0 <= x < n_slots for x in slots):
        raise ValueError(f"slots must be distinct and in [0, {n_slots}): {slots}")
    for s in spans:
        if len(s.tokens) == 0 or s.position < 0:
            raise ValueError(f"request {s.request_id!r}: empty span or negative position")
        if s.end > geom.max_context:
            raise ValueError(f"request {s.request_id!r}: end {s.end} exceeds max_context {geom.max_context}")
        tok = np.asarray(s.tokens)
        if tok.min() < 0 or tok.max() >= cfg.vocab_size:
            raise ValueError(f"request {s.request_id!r}: token ids must lie in [0, {cfg.vocab_size})")
        pages = np.asarray(s.pages)
        if len(pages) < -(-s.end // b) or len(pages) > geom.max_pages:
            raise ValueError(f"request {s.request_id!r}: {len(pages)} pages do not cover {s.end} tokens")
        if (pages == NULL_PAGE).any() or (pages < 0).any() or (pages >= n_pages).any():
            raise ValueError(f"request {s.request_id!r}: pages must lie in [1, {n_pages})")


def _reference_sampler_rows(samplers, n: int) -> dict:
    """Per logits row sampling arrays, padded with greedy rows."""
    rows = samplers + [SamplingParams()] * (n - len(samplers))
    return {"temperature": np.array([s.temperature for s in rows], np.float32),
            "top_k": np.array([s.top_k for s in rows], np.int32),
            "top_p": np.array([s.top_p for s in rows], np.float32),
            "seed": np.array([s.seed for s in rows], np.uint32)}


def _reference_build_step(geom, cfg, bucket, spans) -> BuiltStep:
    _reference_validate_spans(geom, cfg, bucket, spans)
    t_cap, r_cap = bucket.tokens, bucket.requests
    n_slots = geom.settings.slots
    h1 = geom.history + 1

    tokens = np.zeros(t_cap, np.int32)
    positions = np.zeros(t_cap, np.int32)
    token_req = np.full(t_cap, -1, np.int32)
    req_pos = np.zeros(r_cap, np.int32)
    req_len = np.zeros(r_cap, np.int32)
    req_offset = np.full(r_cap, t_cap, np.int32)
    slots = np.full(r_cap, n_slots, np.int32)
    block_tables = np.full((r_cap, geom.max_pages), NULL_PAGE, np.int32)
    cursor_rows = np.zeros((r_cap, h1), np.int32)
    compress = {r: [] for r in geom.ratios}
    window_writes, ring_writes = [], []
    logit_rows, logit_owner = [], []
    samplers = []
    n_engram = len(cfg.engram_layer_ids)
    cols, hd = cfg.engram_hash_cols, cfg.engram_head_dim
    engram_codes = tuple(np.zeros((t_cap, cols, hd), np.uint8) for _ in range(n_engram))
    engram_scales = tuple(np.zeros((t_cap, cols, hd // 32), np.uint8) for _ in range(n_engram))

    off = 0
    for b, s in enumerate(spans):
        n = len(s.tokens)
        pos = s.position + np.arange(n)
        rows = off + np.arange(n)
        tokens[rows], positions[rows], token_req[rows] = s.tokens, pos, b
        req_pos[b], req_len[b], req_offset[b], slots[b] = s.position, n, off, s.slot
        block_tables[b, : len(s.pages)] = s.pages
        cursor_rows[b] = s.next_cursor
        for i in range(n_engram):
            engram_codes[i][rows] = s.engram_codes[i]
            engram_scales[i][rows] = s.engram_scales[i]
        for r in geom.ratios:
            last = (pos + 1) % r == 0                        # the group's last token is here
            x = pos[last]
            compress[r].append(np.stack([rows[last], np.full_like(x, b), x,
                                         np.maximum(0, s.position - (x - r + 1))], axis=1))
        keep = pos >= s.end - geom.ring_slots
        window_writes.append(np.stack([rows[keep], np.full(keep.sum(), s.slot),
                                       pos[keep] % geom.ring_slots], axis=1))
        if geom.comp_ring:
            keep = pos >= s.end - geom.comp_ring
            ring_writes.append(np.stack([rows[keep], np.full(keep.sum(), s.slot),
                                         pos[keep] % geom.comp_ring], axis=1))
        kept = rows if s.all_logits else rows[-1:]
        logit_rows += list(kept)
        logit_owner += [(s.request_id, int(positions[t])) for t in kept]
        samplers += [s.sampling] * len(kept)
        off += n

    batch = StepBatch(
        tokens=tokens, positions=positions, token_req=token_req, req_pos=req_pos, req_len=req_len,
        req_offset=req_offset, slots=slots, block_tables=block_tables,
        visible=tuple(np.where(token_req >= 0, (positions + 1) // r, 0).astype(np.int32)
                      for r in geom.ratios),
        compress_plans=tuple(_reference_pad_rows(compress[r], plan_capacity(bucket, t_cap, r), 4)
                             for r in geom.ratios),
        window_writes=_reference_pad_rows(window_writes, plan_capacity(bucket, geom.ring_slots), 3),
        ring_writes=_reference_pad_rows(ring_writes, plan_capacity(bucket, geom.comp_ring), 3),
        cursor_rows=cursor_rows, engram_codes=engram_codes, engram_scales=engram_scales,
        logit_rows=np.pad(np.asarray(logit_rows, np.int32), (0, bucket.logits - len(logit_rows))),
        **_reference_sampler_rows(samplers, bucket.logits), pending=np.zeros(t_cap, bool),
        pending_req=np.zeros(r_cap, bool), **no_spec(geom, cfg, r_cap))
    return BuiltStep(batch, bucket, tuple(logit_owner))



# ---- comparison ------------------------------------------------------------------------------------
def _assert_same_array(a, b, where: str) -> None:
    assert type(a) is np.ndarray and type(b) is np.ndarray, f"{where}: {type(a)} vs {type(b)}"
    assert a.dtype == b.dtype, f"{where}: dtype {a.dtype} vs {b.dtype}"
    assert a.shape == b.shape, f"{where}: shape {a.shape} vs {b.shape}"
    assert np.array_equal(a, b), f"{where}: values differ\n{a}\n{b}"


def assert_same_built(new: BuiltStep, ref: BuiltStep) -> None:
    assert new.bucket == ref.bucket
    for f in fields(StepBatch):
        a, b = getattr(new.batch, f.name), getattr(ref.batch, f.name)
        if isinstance(b, tuple):
            assert isinstance(a, tuple) and len(a) == len(b), f"{f.name}: {len(a)} vs {len(b)} entries"
            for i, (x, y) in enumerate(zip(a, b)):
                _assert_same_array(x, y, f"{f.name}[{i}]")
        else:
            _assert_same_array(a, b, f.name)
    assert new.logit_owner == ref.logit_owner
    assert type(new.logit_owner) is tuple
    for (rid, pos), (rid_ref, pos_ref) in zip(new.logit_owner, ref.logit_owner):
        assert rid is rid_ref and type(pos) is int and type(pos_ref) is int


def _outcome(fn, *args):
    try:
        return "ok", fn(*args)
    except Exception as e:                      # noqa: BLE001 - the refusal itself is compared
        return "error", (type(e), str(e))


def assert_same_outcome(geom, cfg, bucket, spans) -> str:
    new, ref = _outcome(build_step, geom, cfg, bucket, spans), _outcome(_reference_build_step, geom, cfg, bucket, spans)
    assert new[0] == ref[0], f"new: {new}, reference: {ref}"
    if new[0] == "ok":
        assert_same_built(new[1], ref[1])
    else:
        assert new[1] == ref[1]
    return new[0]


# ---- random cases ------------------------------------------------------------------------------------
def _make_span(cfg, geom, rng, rid, slot, position, n, pages, all_logits, sampling, kind) -> Span:
    cols, hd, ne = cfg.engram_hash_cols, cfg.engram_head_dim, len(cfg.engram_layer_ids)
    tokens = rng.integers(0, cfg.vocab_size, n)
    tokens = {"int32": tokens.astype(np.int32), "int64": tokens, "list": tokens.tolist()}[kind]
    return Span(rid, slot, position, tokens, np.asarray(pages, np.int32 if kind == "int32" else np.int64),
                rng.integers(0, 1000, geom.history + 1).astype(np.int32),
                tuple(rng.integers(0, 256, (n, cols, hd), dtype=np.uint8) for _ in range(ne)),
                tuple(rng.integers(0, 256, (n, cols, hd // 32), dtype=np.uint8) for _ in range(ne)),
                all_logits, sampling)


SAMPLING = st.builds(SamplingParams,
                     temperature=st.one_of(st.just(0.0), st.floats(0, 4, allow_nan=False)),
                     top_k=st.one_of(st.just(0), st.integers(0, 2 ** 31 - 1)),
                     top_p=st.one_of(st.just(1.0), st.floats(0, 1, exclude_min=True)),
                     seed=st.integers(0, 2 ** 32 - 1))


@st.composite
def cases(draw):
    """(geom, cfg, bucket, spans): a geometry of a test config, a valid span set, a bucket that fits."""
    cfg = CFGS[draw(st.sampled_from(sorted(CFGS)))]
    s = replace(SETTINGS, page_tokens=draw(st.sampled_from([2, 4, 8, 16])), slots=draw(st.integers(1, 12)),
                draft_slack=draw(st.integers(0, 3)), max_context=draw(st.sampled_from([24, 64, 128])))
    geom = CacheGeometry.build(cfg, s)
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 32 - 1)))
    n = draw(st.integers(0, s.slots))
    slots = draw(st.permutations(range(s.slots)))[:n]
    kind = draw(st.sampled_from(["int32", "int64", "list"]))
    spans = []
    for b in range(n):
        length = min(draw(st.one_of(st.just(1), st.integers(1, 3), st.integers(1, 40))), s.max_context)
        position = draw(st.integers(0, s.max_context - length))
        need = -(-(position + length) // s.page_tokens)
        pages = rng.integers(1, s.num_pages, draw(st.integers(need, geom.max_pages)))
        rid = draw(st.sampled_from([f"r{b}", b, ("t", b)]))
        spans.append(_make_span(cfg, geom, rng, rid, int(slots[b]), position, length, pages,
                                draw(st.booleans()), draw(SAMPLING), kind))
    n_tok = sum(len(sp.tokens) for sp in spans)
    n_log = sum(len(sp.tokens) if sp.all_logits else 1 for sp in spans)
    bucket = Bucket(tokens=n_tok + draw(st.integers(0, 9)), requests=n + draw(st.integers(0, 3)),
                    logits=n_log + draw(st.integers(0, 5)))
    return geom, cfg, bucket, spans


HYP = settings(max_examples=400, deadline=None, derandomize=True, database=None,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@HYP
@given(case=cases())
def test_matches_reference(case):
    geom, cfg, bucket, spans = case
    assert assert_same_outcome(geom, cfg, bucket, spans) == "ok"


MUTATIONS = ("empty", "negative_position", "past_max_context", "token_low", "token_high", "few_pages",
             "many_pages", "null_page", "page_high", "page_negative", "dup_slot", "slot_high", "slot_negative",
             "bucket_tokens", "bucket_requests", "bucket_logits")


def _mutate(geom, cfg, bucket, spans, what: str, b: int, rng):
    """One rule violation at span b (or the bucket)."""
    s = geom.settings
    if what.startswith("bucket_"):
        n_tok = sum(len(sp.tokens) for sp in spans)
        n_log = sum(len(sp.tokens) if sp.all_logits else 1 for sp in spans)
        field = what.removeprefix("bucket_")
        value = {"tokens": n_tok, "requests": len(spans), "logits": n_log}[field] - 1
        return replace(bucket, **{field: max(value, 0)}), spans
    if not spans:
        return bucket, spans
    b %= len(spans)
    sp, spans = spans[b], list(spans)
    tok, pages = np.array(sp.tokens), np.array(sp.pages)
    if what == "empty":
        sp = replace(sp, tokens=tok[:0], engram_codes=tuple(c[:0] for c in sp.engram_codes),
                     engram_scales=tuple(c[:0] for c in sp.engram_scales))
    elif what == "negative_position":
        sp = replace(sp, position=-int(rng.integers(1, 4)))
    elif what == "past_max_context":
        sp = replace(sp, position=geom.max_context - len(tok) + int(rng.integers(1, 3)))
    elif what in ("token_low", "token_high"):
        if len(tok):                                  # an earlier mutation may have emptied it
            tok[rng.integers(len(tok))] = -1 if what == "token_low" else cfg.vocab_size
            sp = replace(sp, tokens=tok)
    elif what == "few_pages":
        sp = replace(sp, pages=pages[: -(-sp.end // s.page_tokens) - 1])
    elif what == "many_pages":
        sp = replace(sp, pages=np.resize(pages, geom.max_pages + 1))
    elif what in ("null_page", "page_high", "page_negative"):
        if len(pages):
            pages[rng.integers(len(pages))] = {"null_page": NULL_PAGE, "page_high": s.num_pages,
                                              "page_negative": -1}[what]
        sp = replace(sp, pages=pages)
    elif what == "dup_slot":
        sp = replace(sp, slot=spans[(b + 1) % len(spans)].slot)
    elif what == "slot_high":
        sp = replace(sp, slot=s.slots)
    elif what == "slot_negative":
        sp = replace(sp, slot=-1)
    spans[b] = sp
    return bucket, spans


@HYP
@given(case=cases(), muts=st.lists(st.tuples(st.sampled_from(MUTATIONS), st.integers(0, 11)), min_size=1, max_size=3),
       seed=st.integers(0, 2 ** 32 - 1))
def test_refusals_match_reference(case, muts, seed):
    geom, cfg, bucket, spans = case
    rng = np.random.default_rng(seed)
    for what, b in muts:
        bucket, spans = _mutate(geom, cfg, bucket, spans, what, b, rng)
    assert_same_outcome(geom, cfg, bucket, spans)


def test_reference_refuses_what_the_mutations_break():
    """The mutation harness is not vacuous: on a fixed valid batch every mutation is refused."""
    cfg = CFGS["tiny"]
    geom = CacheGeometry.build(cfg, SETTINGS)
    rng = np.random.default_rng(0)
    spans = [_make_span(cfg, geom, rng, i, i, 9 * i, 3, [1 + i, 5 + i, 9 + i], i % 2 == 0, SamplingParams(), "int32")
             for i in range(3)]
    bucket = Bucket(16, 4, 8)
    assert assert_same_outcome(geom, cfg, bucket, spans) == "ok"
    for what in MUTATIONS:
        b2, s2 = _mutate(geom, cfg, bucket, spans, what, 1, rng)
        assert assert_same_outcome(geom, cfg, b2, s2) == "error", what


# ---- host time (printed, not asserted) ---------------------------------------------------------------
def _best_ms(fn, *args, reps: int = 30) -> float:
    fn(*args)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn(*args)
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def _timing_cases():
    """(label, geom, cfg, bucket, spans): 64 one-token decode spans and one 1024-token prefill span,
    in the tiny test config and in the V4.1-Flash config (its Engram row sizes)."""
    out = []
    for name in ("tiny", "deepseek_v41_flash"):
        cfg = CFGS.get(name) or ModelConfig.from_file(ROOT / f"v41_jax/configs/{name}.config.json")
        s = replace(SETTINGS, page_tokens=16, slots=64, max_context=4096, num_pages=64 * 256 + 1)
        geom = CacheGeometry.build(cfg, s)
        rng = np.random.default_rng(0)
        decode = [_make_span(cfg, geom, rng, i, i, 100 + 37 * i, 1, 1 + 256 * i + np.arange(-(-(101 + 37 * i) // 16)),
                             False, SamplingParams(0.7, 50, 0.9, i), "int32") for i in range(64)]
        prefill = [_make_span(cfg, geom, rng, "p", 0, 512, 1024, 1 + np.arange(96), False, SamplingParams(), "int32")]
        out += [(f"{name}: 64 decode spans", geom, cfg, Bucket(64, 64, 64), decode),
                (f"{name}: one 1024-token span", geom, cfg, Bucket(1024, 1, 1), prefill)]
    return out


def test_host_time(capsys):
    lines = []
    for label, geom, cfg, bucket, spans in _timing_cases():
        assert_same_built(build_step(geom, cfg, bucket, spans), _reference_build_step(geom, cfg, bucket, spans))
        old, new = _best_ms(_reference_build_step, geom, cfg, bucket, spans), _best_ms(build_step, geom, cfg, bucket, spans)
        lines.append(f"build_step {label}: reference loop {old:.3f} ms, vectorized {new:.3f} ms ({old / new:.1f}x)")
    with capsys.disabled():
        print("\n" + "\n".join(lines))
