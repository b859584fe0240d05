"""Step metadata, built on the host in numpy (docs/CACHE.md §2).

A step runs a flat batch of token rows from up to R requests, padded to a bucket (R requests,
T tokens, O logits rows) from a small fixed set, so the jitted step sees one shape per bucket and
never recompiles for a new batch composition. Every per-step value is an array argument (docs/CACHE.md INV-5).

Padding is inert (docs/CACHE.md INV-6): a padding token has request row -1 and position 0 and appears in no plan;
a padding request has length 0, slot N (out of range: its scatters are dropped, never wrapped)
and an all-null block-table row; plan tails are -1 sentinel rows.

`StepBatch` fields (T tokens, R requests, M = max pages per request, H = Engram history):
  tokens, positions [T] int32; token_req [T] int32 (request row, -1 pad)
  req_pos [R] first position of the span; req_len [R]; req_offset [R] first token row
  slots [R] (N pad); block_tables [R, M] (0 = null page pad)
  visible[i] [T] compressed rows visible to each token at geometry ratio i: (x + 1) // r
  compress_plans[i] [cap, 4] one row per compressed row the step completes at ratio i:
      (token row of the group's last token, request row, its position x, leading group inputs
      read from the compressor ring because they precede the span); row id x // r
  window_writes [cap, 3] (token row, slot, ring row): each request's last W+S rows, which are all
      distinct ring rows, so the scatter has no duplicate targets
  ring_writes [cap, 3] (token row, slot, compressor-ring row): each request's last max_r + S rows
  cursor_rows [R, H + 1] the Engram cursor each request holds after this step (written once)
  engram_codes[i], engram_scales[i] [T, cols, hd] / [T, cols, hd/32] uint8: FP8 rows and E8M0
      scales of Engram layer i's hash ids, gathered on the host (zeros for padding)
  logit_rows [O] token rows whose logits the step returns (0 pad)
  temperature, top_p [O] f32; top_k [O] int32; seed [O] uint32: each logits row's sampler
      (greedy for padding rows); the position sampled for is the row's position + 1
  pending [T] bool: a decode row whose token is the one the previous step sampled for its slot
      (read on the device from the cache's `sampled`); pending_req [R] bool: its request rows
  engram_history [T, L_engram, N-1, 2] uint32: a pending row's Engram history hash halves
      (`EngramHasher.decode_history`); its ids are finished on the device
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any, Sequence

import jax
import numpy as np

from v41_jax.cache.bookkeeping import NULL_PAGE
from v41_jax.cache.geometry import CacheGeometry
from v41_jax.config import ModelConfig
from v41_jax.runtime.sampling import SamplingParams


@dataclass(frozen=True, order=True)
class Bucket:
    tokens: int       # T: token rows per step
    requests: int     # R: request rows per step
    logits: int       # O: logits rows returned


@dataclass(frozen=True)
class Span:
    """One request's rows in one step."""
    request_id: Any
    slot: int
    position: int                       # first absolute position of these rows
    tokens: np.ndarray                  # int [L]
    pages: np.ndarray                   # int [ceil((position + L) / B)] the request's pages
    next_cursor: np.ndarray             # int [H + 1] the Engram cursor after these rows
    engram_codes: tuple = ()            # per Engram layer: uint8 [L, cols, hd]
    engram_scales: tuple = ()           # per Engram layer: uint8 [L, cols, hd / 32]
    all_logits: bool = False            # logits of every row (teacher forcing), else the last
    sampling: SamplingParams = SamplingParams()   # how its logits rows are sampled

    @property
    def end(self) -> int:
        return self.position + len(self.tokens)


@partial(jax.tree_util.register_dataclass, data_fields=[
    "tokens", "positions", "token_req", "req_pos", "req_len", "req_offset", "slots",
    "block_tables", "visible", "compress_plans", "window_writes", "ring_writes", "cursor_rows",
    "engram_codes", "engram_scales", "logit_rows", "temperature", "top_k", "top_p", "seed", "pending", "pending_req",
    "engram_history"],
    meta_fields=[])
@dataclass(frozen=True)
class StepBatch:
    tokens: Any
    positions: Any
    token_req: Any
    req_pos: Any
    req_len: Any
    req_offset: Any
    slots: Any
    block_tables: Any
    visible: tuple
    compress_plans: tuple
    window_writes: Any
    ring_writes: Any
    cursor_rows: Any
    engram_codes: tuple
    engram_scales: tuple
    logit_rows: Any
    temperature: Any
    top_k: Any
    top_p: Any
    seed: Any
    pending: Any
    pending_req: Any
    engram_history: Any


@dataclass(frozen=True)
class BuiltStep:
    batch: StepBatch                    # numpy arrays, bucket-shaped
    bucket: Bucket
    logit_owner: tuple                  # (request_id, position) of each real logits row, in order


def plan_capacity(bucket: Bucket, per_request: int, ratio: int = 1) -> int:
    """Static rows of a plan. A request of L rows completes at most ceil(L / r) <= L // r + 1
    groups and writes at most `per_request` ring rows, so the bucket needs at most this many."""
    groups = bucket.tokens if ratio == 1 else bucket.tokens // ratio + bucket.requests
    return min(bucket.tokens, groups, bucket.requests * per_request)


def _pad_rows(parts: list, cap: int, width: int) -> np.ndarray:
    """Concatenate per-request plan rows [n, width] and fill the tail with -1 sentinels."""
    out = np.full((cap, width), -1, np.int32)
    rows = np.concatenate(parts) if parts else np.zeros((0, width), np.int32)
    out[: len(rows)] = rows
    return out


def validate_spans(geom: CacheGeometry, cfg: ModelConfig, bucket: Bucket, spans: Sequence[Span]) -> None:
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


def build_step(geom: CacheGeometry, cfg: ModelConfig, bucket: Bucket, spans: Sequence[Span]) -> BuiltStep:
    validate_spans(geom, cfg, bucket, spans)
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
        compress_plans=tuple(_pad_rows(compress[r], plan_capacity(bucket, t_cap, r), 4)
                             for r in geom.ratios),
        window_writes=_pad_rows(window_writes, plan_capacity(bucket, geom.ring_slots), 3),
        ring_writes=_pad_rows(ring_writes, plan_capacity(bucket, geom.comp_ring), 3),
        cursor_rows=cursor_rows, engram_codes=engram_codes, engram_scales=engram_scales,
        logit_rows=np.pad(np.asarray(logit_rows, np.int32), (0, bucket.logits - len(logit_rows))),
        **_sampler_rows(samplers, bucket.logits), **no_pending(cfg, t_cap, r_cap))
    return BuiltStep(batch, bucket, tuple(logit_owner))


def no_pending(cfg: ModelConfig, t_cap: int, r_cap: int) -> dict:
    """The pending-decode fields of a step whose every token is on the host (the Runner sets
    them for decode rows whose token the previous step samples on the device)."""
    return {"pending": np.zeros(t_cap, bool), "pending_req": np.zeros(r_cap, bool),
            "engram_history": np.zeros((t_cap, len(cfg.engram_layer_ids), cfg.engram_max_ngram_size - 1, 2),
                                       np.uint32)}


def _sampler_rows(samplers: list[SamplingParams], n: int) -> dict:
    """Per logits row sampling arrays, padded with greedy rows."""
    rows = samplers + [SamplingParams()] * (n - len(samplers))
    return {"temperature": np.array([s.temperature for s in rows], np.float32),
            "top_k": np.array([s.top_k for s in rows], np.int32),
            "top_p": np.array([s.top_p for s in rows], np.float32),
            "seed": np.array([s.seed for s in rows], np.uint32)}


@dataclass(frozen=True)
class BucketSet:
    """The fixed shapes the step is compiled for; a batch runs in the smallest that holds it."""
    buckets: tuple[Bucket, ...] = field(default=())

    def __post_init__(self):
        if not self.buckets:
            raise ValueError("buckets: at least one")
        object.__setattr__(self, "buckets", tuple(sorted(set(self.buckets))))

    @property
    def max_tokens(self) -> int:
        return max(b.tokens for b in self.buckets)

    @property
    def max_requests(self) -> int:
        return max(b.requests for b in self.buckets)

    def pick(self, n_requests: int, n_tokens: int, n_logits: int) -> Bucket:
        for b in self.buckets:
            if b.requests >= n_requests and b.tokens >= n_tokens and b.logits >= n_logits:
                return b
        raise ValueError(f"no bucket holds {n_requests} requests / {n_tokens} tokens / {n_logits} logits")
