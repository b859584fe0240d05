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
  pending [T] bool: a row of a pending span (`Span.pending`); pending_req [R] bool: its request row
  spec_k [R] int32: drafts a verify span checks (its rows after the first; 0 = not a verify span)
  spec_draft [R] bool: draft a block after this step from the request's committed end
  spec_cursors [R, max(1, blk), H + 1]: a verify span's cursor after its first j + 1 rows (the row
      committed when j drafts are accepted and j < spec_k; all of them accepted commits cursor_rows)
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
    verify: int = 0                     # its last `verify` rows are drafts to check (then all_logits)
    draft: bool = False                 # draft a block after this step (speculative request)
    prefix_cursors: np.ndarray | None = None      # int [verify, H + 1] the cursor after rows 0..j
    # pending: the span continues its slot from where the cache says it is: its position is the
    # slot's cursor, its tokens the slot's `sampled` row (the sampled token, then the drafts after
    # it), and its Engram rows, cursors and every position-dependent plan entry are resolved in the
    # step (`step._resolve_pending`). Its tokens, next_cursor, Engram rows and prefix_cursors here
    # are placeholders, so the host batch of a step of pending spans does not change from one
    # step to the next (`Runner.steady` then sends nothing). `position` is where the host expects
    # it to start, or a bound above that (drafts in flight counted as accepted), used only to
    # validate the span (its pages); the stale-state check is the Scheduler's (`Sequence.committed`).
    pending: bool = False

    @property
    def end(self) -> int:
        return self.position + len(self.tokens)


@partial(jax.tree_util.register_dataclass, data_fields=[
    "tokens", "positions", "token_req", "req_pos", "req_len", "req_offset", "slots",
    "block_tables", "visible", "compress_plans", "window_writes", "ring_writes", "cursor_rows",
    "engram_codes", "engram_scales", "logit_rows", "temperature", "top_k", "top_p", "seed", "pending", "pending_req",
    "spec_k", "spec_draft", "spec_cursors"],
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
    spec_k: Any
    spec_draft: Any
    spec_cursors: Any


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


def _padded(values, size: int, fill, dtype) -> np.ndarray:
    """[size] array of `dtype`: `values` first, then `fill`."""
    out = np.full(size, fill, dtype)
    out[: len(values)] = values
    return out


def _pad_rows(rows: np.ndarray, cap: int) -> np.ndarray:
    """A plan's rows [n, width] (all requests, in row order) with a tail of -1 sentinels up to cap."""
    out = np.full((cap, rows.shape[1]), -1, np.int32)
    out[: len(rows)] = rows
    return out


@dataclass(frozen=True)
class _Columns:
    """The spans' per-span scalars and their flattened token and page rows, gathered once."""
    lens: np.ndarray           # [n] int64 tokens per span
    positions: np.ndarray      # [n] int64 first position of each span
    all_logits: np.ndarray     # [n] bool
    pending: np.ndarray        # [n] bool
    n_pages: np.ndarray        # [n] int64 pages per span
    tokens: np.ndarray         # [sum lens] every span's tokens, span after span
    token_span: np.ndarray     # [sum lens] int64 the span of each token
    pages: np.ndarray          # [sum n_pages] every span's pages, span after span
    page_span: np.ndarray      # [sum n_pages] int64 the span of each page

    @classmethod
    def of(cls, spans: Sequence[Span]) -> "_Columns":
        n = len(spans)
        lens = np.array([len(s.tokens) for s in spans], np.int64)
        n_pages = np.array([len(s.pages) for s in spans], np.int64)
        flat = (lambda parts: np.concatenate(parts) if n else np.zeros(0, np.int64))
        return cls(lens=lens, positions=np.array([s.position for s in spans], np.int64),
                   all_logits=np.array([bool(s.all_logits) for s in spans], bool),
                   pending=np.array([bool(s.pending) for s in spans], bool), n_pages=n_pages,
                   tokens=flat([s.tokens for s in spans]), token_span=np.repeat(np.arange(n), lens),
                   pages=flat([s.pages for s in spans]), page_span=np.repeat(np.arange(n), n_pages))


def _any_per_span(flags: np.ndarray, span_of: np.ndarray, n: int) -> np.ndarray:
    """[n] bool: whether any flagged row belongs to each span."""
    return np.bincount(span_of[flags], minlength=n) > 0


def validate_spans(geom: CacheGeometry, cfg: ModelConfig, bucket: Bucket, spans: Sequence[Span]) -> None:
    """The begin_step rules (docs/CACHE.md §2.5): every violation is an error before any work."""
    _validate(geom, cfg, bucket, spans, _Columns.of(spans))


def _validate(geom: CacheGeometry, cfg: ModelConfig, bucket: Bucket, spans: Sequence[Span], col: _Columns) -> None:
    n_slots, n_pages, b = geom.settings.slots, geom.settings.num_pages, geom.settings.page_tokens
    if len(spans) > bucket.requests:
        raise ValueError(f"{len(spans)} spans exceed the bucket's {bucket.requests} requests")
    if col.lens.sum() > bucket.tokens:
        raise ValueError(f"{int(col.lens.sum())} tokens exceed the bucket's {bucket.tokens}")
    if np.where(col.all_logits, col.lens, 1).sum() > bucket.logits:
        raise ValueError(f"logits rows exceed the bucket's {bucket.logits}")
    slots = [s.slot for s in spans]
    if len(set(slots)) != len(slots) or any(not 0 <= x < n_slots for x in slots):
        raise ValueError(f"slots must be distinct and in [0, {n_slots}): {slots}")
    rings = [x for x in (geom.ring_slots, geom.comp_ring) if x]
    for s in spans:
        if s.pending and len(s.tokens) > min(rings, default=len(s.tokens)):
            raise ValueError(f"request {s.request_id!r}: a pending span of {len(s.tokens)} rows is longer "
                             f"than a ring ({min(rings)} rows): its ring writes would depend on its position")
        if s.verify and (len(s.tokens) != s.verify + 1 or not s.all_logits or s.verify > _spec_width(cfg)
                         or s.prefix_cursors is None or len(s.prefix_cursors) != s.verify):
            raise ValueError(f"request {s.request_id!r}: a verify span is its first row then its "
                             f"{s.verify} drafts (at most {_spec_width(cfg)}), every row's logits, "
                             f"a cursor per accepted prefix")
    # The per-span rules at once: which spans break any of them.
    n, ends = len(spans), col.positions + col.lens
    bad = ((col.lens == 0) | (col.positions < 0) | (ends > geom.max_context)
           | _any_per_span((col.tokens < 0) | (col.tokens >= cfg.vocab_size), col.token_span, n)
           | (col.n_pages < -(-ends // b)) | (col.n_pages > geom.max_pages)
           | _any_per_span((col.pages == NULL_PAGE) | (col.pages < 0) | (col.pages >= n_pages), col.page_span, n))
    if not bad.any():
        return
    # The first bad span's first broken rule gives the message, as the rules read one span at a time.
    for s in spans[int(bad.argmax()):]:
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
    """The step's metadata (module docstring), built for all spans at once: per-span scalars and
    flat token / page rows, then per-token index arrays and boolean masks, no loop over spans (the
    engine loop pays this host time every step, at up to R one-token decode spans)."""
    col = _Columns.of(spans)
    _validate(geom, cfg, bucket, spans, col)
    t_cap, r_cap = bucket.tokens, bucket.requests
    n, n_tok = len(spans), len(col.tokens)

    # Per span: first token row, slot. Per token row (the first n_tok): its request row, position,
    # and its span's first position and end.
    offset = np.cumsum(col.lens) - col.lens
    span_slot = np.array([s.slot for s in spans], np.int64)
    rows, req = np.arange(n_tok), col.token_span
    start = col.positions[req]
    pos = start + rows - offset[req]
    end = (col.positions + col.lens)[req]

    # Token and request rows, padded (docs: padding tokens row -1 / position 0, padding requests slot N).
    tokens = _padded(col.tokens, t_cap, 0, np.int32)
    positions = _padded(pos, t_cap, 0, np.int32)
    token_req = _padded(req, t_cap, -1, np.int32)
    req_pos = _padded(col.positions, r_cap, 0, np.int32)
    req_len = _padded(col.lens, r_cap, 0, np.int32)
    req_offset = _padded(offset, r_cap, t_cap, np.int32)
    slots = _padded(span_slot, r_cap, geom.settings.slots, np.int32)

    # Block tables: span b's j-th page at [b, j]; the rest null.
    block_tables = np.full((r_cap, geom.max_pages), NULL_PAGE, np.int32)
    page_col = np.arange(len(col.pages)) - (np.cumsum(col.n_pages) - col.n_pages)[col.page_span]
    block_tables[col.page_span, page_col] = col.pages

    # Cursors and Engram rows, copied span after span (zeros for padding).
    cursor_rows = np.zeros((r_cap, geom.history + 1), np.int32)
    n_engram = len(cfg.engram_layer_ids)
    cols, hd = cfg.engram_hash_cols, cfg.engram_head_dim
    engram_codes = tuple(np.zeros((t_cap, cols, hd), np.uint8) for _ in range(n_engram))
    engram_scales = tuple(np.zeros((t_cap, cols, hd // 32), np.uint8) for _ in range(n_engram))
    spec = no_spec(geom, cfg, r_cap)
    spec_k, spec_draft, spec_cursors = spec["spec_k"], spec["spec_draft"], spec["spec_cursors"]
    if spans:
        cursor_rows[:n] = [s.next_cursor for s in spans]
        spec_k[:n] = [s.verify for s in spans]
        spec_draft[:n] = [s.draft for s in spans]
        for b, s in enumerate(spans):
            if s.verify:
                spec_cursors[b, :s.verify] = s.prefix_cursors
        for i in range(n_engram):
            np.concatenate([s.engram_codes[i] for s in spans], out=engram_codes[i][:n_tok], casting="unsafe")
            np.concatenate([s.engram_scales[i] for s in spans], out=engram_scales[i][:n_tok], casting="unsafe")

    # Compress plans: a row per token ending a group of r, in token-row order; a group that began
    # before its span reads its leading inputs from the compressor ring. A pending span's position
    # is only known in the step: it gets a row for each group it can complete, ceil(L / r), on its
    # first rows, which the step fills in or drops (`step._resolve_pending`).
    pend = col.pending[req]
    in_span = rows - offset[req]

    def compress_plan(r: int) -> np.ndarray:
        last = np.where(pend, in_span < -(-col.lens[req] // r), (pos + 1) % r == 0)
        x = pos[last]
        plan = np.stack([rows[last], req[last], x, np.maximum(0, start[last] - (x - r + 1))], axis=1)
        return _pad_rows(plan, plan_capacity(bucket, t_cap, r))

    # Window (ring = W + S) and compressor-ring writes: each request's last `ring` rows,
    # (token row, slot, ring row); no compressor ring, no rows.
    def ring_plan(ring: int) -> np.ndarray:
        if not ring:
            return _pad_rows(np.zeros((0, 3), np.int32), plan_capacity(bucket, ring))
        keep = pos >= end - ring
        return _pad_rows(np.stack([rows[keep], span_slot[req[keep]], pos[keep] % ring], axis=1),
                         plan_capacity(bucket, ring))

    # Logits rows: every row of an all_logits span, else its last; each row's owner and sampler.
    wanted = col.all_logits[req] | (rows == (offset + col.lens - 1)[req])
    owner = req[wanted]
    ids = [s.request_id for s in spans]
    logit_owner = tuple(zip([ids[b] for b in owner.tolist()], pos[wanted].tolist()))

    batch = StepBatch(
        tokens=tokens, positions=positions, token_req=token_req, req_pos=req_pos, req_len=req_len,
        req_offset=req_offset, slots=slots, block_tables=block_tables,
        visible=tuple(np.where(token_req >= 0, (positions + 1) // r, 0).astype(np.int32)
                      for r in geom.ratios),
        compress_plans=tuple(compress_plan(r) for r in geom.ratios),
        window_writes=ring_plan(geom.ring_slots), ring_writes=ring_plan(geom.comp_ring),
        cursor_rows=cursor_rows, engram_codes=engram_codes, engram_scales=engram_scales,
        logit_rows=_padded(rows[wanted], bucket.logits, 0, np.int32),
        **spec,
        **_sampler_rows([s.sampling for s in spans], owner, bucket.logits),
        pending=_padded(pend, t_cap, False, bool), pending_req=_padded(col.pending, r_cap, False, bool))
    return BuiltStep(batch, bucket, logit_owner)


def _spec_width(cfg: ModelConfig) -> int:
    """Drafts a verify span may check: the checkpoint's block (1 keeps the arrays non-empty without
    draft stages)."""
    return cfg.dspark_block_size if cfg.n_mtp_layers else 1


def no_spec(geom: CacheGeometry, cfg: ModelConfig, r_cap: int) -> dict:
    """The speculative fields of a step with no verify span and no draft."""
    return {"spec_k": np.zeros(r_cap, np.int32), "spec_draft": np.zeros(r_cap, bool),
            "spec_cursors": np.zeros((r_cap, _spec_width(cfg), geom.history + 1), np.int32)}


def _sampler_rows(samplers: list[SamplingParams], owner: np.ndarray, n: int) -> dict:
    """Per logits row sampling arrays (row j samples as samplers[owner[j]]), padded with greedy rows."""
    greedy, out = SamplingParams(), {}
    for name, dtype in (("temperature", np.float32), ("top_k", np.int32), ("top_p", np.float32), ("seed", np.uint32)):
        per_span = np.array([getattr(s, name) for s in samplers], dtype)
        out[name] = _padded(per_span[owner], n, getattr(greedy, name), dtype)
    return out


DEFAULT_MAX_BATCH = 4      # requests per step unless told (v41-generate, v41-serve, Engine.from_checkpoint)
DEFAULT_NUMERICS = "fast"  # likewise the numerics (`engine.NUMERICS`)


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

    @property
    def max_logits(self) -> int:
        return max(b.logits for b in self.buckets)

    def pick(self, n_requests: int, n_tokens: int, n_logits: int) -> Bucket:
        for b in self.buckets:
            if b.requests >= n_requests and b.tokens >= n_tokens and b.logits >= n_logits:
                return b
        raise ValueError(f"no bucket holds {n_requests} requests / {n_tokens} tokens / {n_logits} logits")
