"""The Runner: the device side of the engine. Params, the donated cache, one compiled step per
bucket, and the asynchronous hand-off of each step's few outputs to the host.

A step goes through three calls, so the host never waits on the device except for what it
cannot know in advance (the previous step's sampled tokens):

* `prepare(plan)` while the previous step runs: every span's metadata (positions, block tables,
  plans, samplers) and the Engram rows of every token already on the host, in numpy, packed into
  two buffers (`runtime/packed.py`) and sent to the device. A decode or verify span whose input
  tokens the previous step produces (its sampled token, then the drafts after it) is *pending*
  (`Span.pending`): the step itself takes its position, tokens, Engram rows and cursors from its
  slot (`step._resolve_pending`), so its host metadata does not depend on the position. A step whose spans are all pending and are the same requests as the step before
  (steady decoding) therefore takes the very same batch: `prepare` builds and sends nothing and
  the step is launched on the batch already on the device;
* `dispatch(prepared, feedback)`: fresh slots reset, the step launched, and its tokens / found
  cursors / logprobs copied to the host asynchronously. Without device feedback (Engram tables
  kept on the host) it first takes the previous step's tokens, writes the pending decode tokens
  into the batch, hashes and gathers their Engram rows (one vectorised call for all of them) and
  only then sends the batch;
* `collect(in_flight)` -> the host arrays (blocks only until that step's outputs have landed).

The Engram history of a span built on the host comes from the host's own copy of the request's
tokens, never from a probe of the cache; a pending span's comes from its slot's cursor inside the
step. The cache's cursor position is what the Scheduler checks (`StepOutput.found`).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any, Mapping, NamedTuple, Sequence

import jax
import numpy as np

from v41_jax.cache.bookkeeping import check_cursor
from v41_jax.cache.buffer import DEAD, allocate, reset_slots
from v41_jax.cache.geometry import CacheGeometry
from v41_jax.checkpoint.load import ENGRAM_DEVICE_KEY, ENGRAM_KEY
from v41_jax.config import ModelConfig
from v41_jax.engram_hash import EngramCursor, EngramHasher
from v41_jax.model.numerics import Numerics
from v41_jax.runtime import compile_cache
from v41_jax.runtime.metadata import Bucket, BucketSet, BuiltStep, Span, build_step
from v41_jax.runtime.packed import BatchLayout, PackedBatch
from v41_jax.runtime.sampling import SamplingParams
from v41_jax.runtime.scheduler import StepPlan, StepResult
from v41_jax.runtime.step import StepOutput, make_step


# Engram tables up to this size are copied to the device so that decode rows need no host hand-off
# (the released model's ~183 GiB stay on the host and take the hand-off instead).
DEVICE_ENGRAM_BYTES = 4 << 30


class Prepared(NamedTuple):
    plan: StepPlan
    built: BuiltStep
    device_batch: PackedBatch | None   # built.batch packed and on the device (sent while the previous
                                       # step runs); None while pending tokens come from the host
    pending_rows: np.ndarray       # int [K] token rows whose token the previous step samples
    pending_reqs: np.ndarray       # int [K] their request rows
    pending_ids: tuple             # [K] their request ids
    pending_cursors: np.ndarray    # int64 [K, 1 + H] each one's cursor before that token
    fresh: np.ndarray              # bool [N] slots that start at position 0 (reset first)
    logprobs: bool                 # a span asked for logprobs


class InFlight(NamedTuple):
    step_id: int
    out: StepOutput
    logprobs: bool
    built: Any = None              # the step's metadata where collect needs it (`mesh.MeshRunner`)


class Ran(NamedTuple):
    """A synchronous step (tools, teacher forcing): its outputs and the metadata it ran."""
    out: StepOutput
    built: BuiltStep

    @property
    def logits(self) -> jax.Array:
        return self.out.logits

    @property
    def inter(self) -> dict | None:
        return self.out.inter


class Runner:
    ranks = 1      # data-parallel ranks (`runtime.mesh.MeshRunner`: one per device of its mesh)

    def __init__(self, params: dict, cfg: ModelConfig, geom: CacheGeometry, numerics: Numerics,
                 buckets: BucketSet, token_map: np.ndarray | None = None, record: bool = False,
                 device_engram: bool | None = None, speculative: bool = False):
        self.params, self.cfg, self.geom, self.numerics, self.buckets = params, cfg, geom, numerics, buckets
        self.hasher = EngramHasher(cfg, token_map) if cfg.engram_layer_ids else None
        self.tables = params.get(ENGRAM_KEY)
        self.device_feedback = self.hasher is None or self._device_engram(device_engram)
        if self.hasher is not None and self.device_feedback:
            t = self.tables
            params = {**params, ENGRAM_DEVICE_KEY: {
                "consts": {k: jax.device_put(v) for k, v in self.hasher.device_constants().items()},
                "weight": tuple(jax.device_put(t.weight[l].view(np.uint8)) for l in cfg.engram_layer_ids),
                "scale": tuple(jax.device_put(t.scale[l].view(np.uint8)) for l in cfg.engram_layer_ids)}}
            self.params = params
        self.record, self.speculative = record, speculative
        self.step_fn = self.make_step_fn()
        self.compiled: dict[Bucket, Any] = {}
        self.layouts: dict[Bucket, BatchLayout] = {}
        self.cache = self.fresh_cache()
        self.steps = 0                               # steps dispatched
        self._steady: Prepared | None = None         # the last step of pending spans only (its batch reused)

    def make_step_fn(self):
        return make_step(self.cfg, self.geom, self.numerics, self.record, self.speculative)

    def fresh_cache(self):
        """A zeroed cache (every slot freshly reset)."""
        return allocate(self.geom)

    def reset(self) -> None:
        """A zeroed cache, and no batch kept for `steady` (it belongs to the requests dropped)."""
        self.cache = self.fresh_cache()
        self._steady = None

    def _device_engram(self, want: bool | None) -> bool:
        """Whether pending decode rows are hashed and gathered on the device (tables copied there):
        asked for, or (None) when the tables take at most DEVICE_ENGRAM_BYTES; never when a prime
        is too large for the device's uint32 modular product."""
        if want is False or self.hasher.device_constants() is None:
            return False
        size = sum(self.tables.weight[l].nbytes + self.tables.scale[l].nbytes for l in self.cfg.engram_layer_ids)
        return True if want else size <= DEVICE_ENGRAM_BYTES

    # ---- Engram rows from the host's tokens ----------------------------------------------------
    def cursor_row(self, tokens: Sequence[int], position: int) -> np.ndarray:
        """The cursor a slot holds once `tokens[:position]` are committed: int64 [1 + H]."""
        h = self.geom.history
        hist = np.full(h, DEAD, np.int64)
        if self.hasher is not None and position:
            prev = self.hasher.compress(np.asarray(tokens[max(0, position - h): position]))
            hist[h - len(prev):] = prev
        return np.concatenate([[position], hist]).astype(np.int64)

    def _engram(self, cursor: EngramCursor, tokens: np.ndarray):
        """(codes, scales, next cursor row) of a span's tokens after `cursor`."""
        if self.hasher is None:
            return (), (), np.asarray([cursor.position + len(tokens), *cursor.history], np.int32)
        ids, nxt = self.hasher.hash_ids(cursor, tokens)                        # [L, nE, cols]
        rows = [self.tables.gather(layer, ids[:, i]) for i, layer in enumerate(self.cfg.engram_layer_ids)]
        return (tuple(c.view(np.uint8) for c, _ in rows), tuple(s.view(np.uint8) for _, s in rows),
                nxt.as_row())

    def span(self, rid, slot: int, position: int, tokens: Sequence[int], pages: Sequence[int],
             cursor_row: np.ndarray | None, all_logits: bool = False,
             sampling: SamplingParams = SamplingParams(), draft: bool = False) -> Span:
        """A span with its Engram rows from an explicit cursor row (as the slot holds it before the
        span; ignored at position 0, whose slot is reset). Refuses a cursor at another position."""
        tokens = np.asarray(tokens, np.int32)
        if position == 0:
            cursor = EngramCursor(0, (DEAD,) * self.geom.history)
        else:
            check_cursor(rid, position, int(cursor_row[0]))
            cursor = EngramCursor.from_row(cursor_row)
        codes, scales, nxt = self._engram(cursor, tokens)
        return Span(rid, slot, position, tokens, np.asarray(pages, np.int32), nxt, codes, scales, all_logits,
                    sampling, draft=draft)

    def verify_span(self, rid, slot: int, position: int, committed: Sequence[int], tokens: Sequence[int],
                    pages: Sequence[int], cursor_row: np.ndarray, sampling: SamplingParams) -> Span:
        """A verify span: `tokens` = the request's next token then its drafts, at `position` after
        the `committed` tokens; every row's logits, a draft after it, and the cursor each accepted
        prefix commits (the step picks the one of the count it accepts)."""
        tokens = np.asarray(tokens, np.int32)
        seq = list(committed) + tokens.tolist()
        prefix = np.stack([self.cursor_row(seq, position + j + 1) for j in range(len(tokens) - 1)])
        sp = self.span(rid, slot, position, tokens, pages, cursor_row, all_logits=True, sampling=sampling,
                       draft=True)
        return replace(sp, verify=len(tokens) - 1, prefix_cursors=prefix)

    # ---- the pipelined step --------------------------------------------------------------------
    def plan_spans(self, plan: StepPlan) -> tuple[list[Span], list[tuple[int, np.ndarray]]]:
        """The plan's spans with their metadata and Engram rows, and (span index, cursor row) of
        every decode whose token is filled in on the host (no device feedback)."""
        spans, pending = [], []
        zero_cursor = np.zeros(self.geom.history + 1, np.int64)
        for b, sp in enumerate(plan.spans):
            seq = sp.seq
            if sp.pending and self.device_feedback:      # resolved in the step from the slot
                span = Span(seq.rid, seq.slot, sp.position, sp.known_tokens(), np.asarray(seq.pages, np.int32),
                            zero_cursor, *self._zero_engram(sp.length), all_logits=bool(sp.verify),
                            sampling=sp.sampling, verify=sp.verify, draft=sp.draft,
                            prefix_cursors=np.zeros((sp.verify, len(zero_cursor)), np.int64) if sp.verify else None,
                            pending=True)
                spans.append(span)
                continue
            cursor = self.cursor_row(seq.tokens, sp.position)
            if sp.pending:             # a one-row decode whose token the host fills in (`dispatch`)
                pending.append((b, cursor))
                span = Span(seq.rid, seq.slot, sp.position, sp.known_tokens(), np.asarray(seq.pages, np.int32),
                            cursor, *self._zero_engram(1), sampling=sp.sampling)
            elif sp.verify:
                span = self.verify_span(seq.rid, seq.slot, sp.position, seq.tokens[:sp.position], sp.known_tokens(),
                                        seq.pages, cursor, sp.sampling)
            else:
                span = self.span(seq.rid, seq.slot, sp.position, sp.known_tokens(), seq.pages, cursor,
                                 sampling=sp.sampling, draft=sp.draft)
            spans.append(span)
        return spans, pending

    def prepare(self, plan: StepPlan) -> Prepared:
        steady = self.steady(plan)
        if steady is not None:
            return steady
        spans, pending = self.plan_spans(plan)
        bucket = self.buckets.pick(len(spans), sum(s.length for s in plan.spans), plan.rows)
        built = build_step(self.geom, self.cfg, bucket, spans)
        reqs = np.asarray([b for b, _ in pending], np.int32)
        fresh = np.zeros(self.geom.settings.slots, bool)
        fresh[[sp.slot for sp in plan.spans if sp.position == 0]] = True
        handoff = bool(len(reqs)) and not self.device_feedback     # the batch is complete only in dispatch
        return self.remember(Prepared(plan, built, None if handoff else self.send(bucket, built.batch),
                                      built.batch.req_offset[reqs], reqs,
                                      tuple(plan.spans[b].rid for b in reqs),
                                      np.stack([c for _, c in pending]) if pending
                                      else np.zeros((0, self.geom.history + 1)),
                                      fresh, any(sp.seq.req.logprobs for sp in plan.spans)))

    # ---- steady decoding: the same batch again ---------------------------------------------
    def _all_pending(self, plan: StepPlan) -> bool:
        return self.device_feedback and all(sp.pending for sp in plan.spans)

    def steady(self, plan: StepPlan) -> Prepared | None:
        """The last step's prepared batch for `plan` if both are pending spans of the same requests
        in the same order: their batches are equal (`Span.pending`), so the one already on the device
        serves again (nothing built, nothing sent: the launch takes only resident inputs)."""
        last = self._steady
        if (last is None or len(last.plan.spans) != len(plan.spans) or not self._all_pending(plan)
                or any(a.seq is not b.seq or (a.length, a.verify, a.draft) != (b.length, b.verify, b.draft)
                       for a, b in zip(last.plan.spans, plan.spans))):
            return None
        return last._replace(plan=plan)

    def idle(self) -> None:
        """Nothing runs: forget the batch kept for `steady`. Its requests have all finished, and
        kept it would hold their sequences and its device buffers until the next steady step."""
        self._steady = None

    def remember(self, prep: Prepared) -> Prepared:
        """Keep `prep` for `steady` if its spans are all pending (and its batch on the device)."""
        self._steady = prep if self._all_pending(prep.plan) and prep.device_batch is not None else None
        return prep

    def _zero_engram(self, n: int) -> tuple[tuple, tuple]:
        cols, hd = self.cfg.engram_hash_cols, self.cfg.engram_head_dim
        k = len(self.cfg.engram_layer_ids)
        return (tuple(np.zeros((n, cols, hd), np.uint8) for _ in range(k)),
                tuple(np.zeros((n, cols, hd // 32), np.uint8) for _ in range(k)))

    def dispatch(self, prep: Prepared, feedback: Mapping[Any, int] | None = None) -> InFlight:
        """Launch the step and start copying its outputs to the host. Without device feedback the
        pending tokens are filled in first (feedback: request id -> the token the previous step
        sampled for it, so the previous step must have been collected)."""
        batch, device_batch = prep.built.batch, prep.device_batch
        if len(prep.pending_rows) and not self.device_feedback:
            toks = np.asarray([feedback[rid] for rid in prep.pending_ids], np.int32)
            self.feed(batch, prep.pending_rows, prep.pending_reqs, toks, *self.fed_rows(prep.pending_cursors, toks))
            device_batch = self.send(prep.built.bucket, batch)
        out = self._launch(prep.built.bucket, device_batch, prep.fresh)
        out.tokens.copy_to_host_async()
        out.found.copy_to_host_async()
        if self.speculative:
            out.accepted.copy_to_host_async()
            out.drafts.copy_to_host_async()
        if prep.logprobs:
            out.logprobs.copy_to_host_async()
        return InFlight(prep.plan.step_id, out, prep.logprobs)

    def fed_rows(self, cursors: np.ndarray, toks: np.ndarray) -> tuple[tuple, tuple, np.ndarray]:
        """Pending decodes whose tokens are now known (host hand-off): their Engram rows per
        Engram layer (codes, scales) and their next cursor rows, all at once."""
        if self.hasher is None:
            nxt = cursors.copy()
            nxt[:, 0] += 1
            return (), (), nxt
        ids, nxt = self.hasher.next_token_ids(cursors, toks)
        rows = [self.tables.gather(layer, ids[:, i]) for i, layer in enumerate(self.cfg.engram_layer_ids)]
        return tuple(c.view(np.uint8) for c, _ in rows), tuple(s.view(np.uint8) for _, s in rows), nxt

    @staticmethod
    def feed(batch, rows: np.ndarray, reqs: np.ndarray, toks: np.ndarray, codes: tuple, scales: tuple,
             nxt: np.ndarray) -> None:
        """Write pending decodes' tokens, Engram rows (token rows `rows`) and next cursors (request
        rows `reqs`) into a host batch."""
        batch.tokens[rows] = toks
        for i in range(len(codes)):
            batch.engram_codes[i][rows] = codes[i]
            batch.engram_scales[i][rows] = scales[i]
        batch.cursor_rows[reqs] = nxt

    def layout(self, bucket: Bucket) -> BatchLayout:
        """How a batch of this bucket is packed (every bucket-shaped batch has the same)."""
        if bucket not in self.layouts:
            self.layouts[bucket] = BatchLayout.of(build_step(self.geom, self.cfg, bucket, []).batch)
        return self.layouts[bucket]

    def send(self, bucket: Bucket, batch) -> PackedBatch:
        """A host batch packed and put on the device: two transfers (runtime/packed.py)."""
        return jax.device_put(self.layout(bucket).pack(batch))

    def _launch(self, bucket: Bucket, packed: PackedBatch, fresh: np.ndarray,
                forced: dict | None = None) -> StepOutput:
        if fresh.any():
            self.cache = reset_slots(self.cache, fresh)
        fn = self.compiled.get(bucket) if forced is None else None
        if fn is None:
            extra = () if forced is None else (forced,)
            out = self.step_fn(self.params, self.cache, packed, *extra, layout=self.layout(bucket))
        else:
            out = fn(self.params, self.cache, packed)
        self.cache = out.cache
        self.steps += 1
        return out

    def collect(self, flight: InFlight) -> StepResult:
        out = flight.out
        return StepResult(flight.step_id, np.asarray(out.tokens), np.asarray(out.found),
                          np.asarray(out.logprobs) if flight.logprobs else None,
                          np.asarray(out.accepted) if self.speculative else None,
                          np.asarray(out.drafts) if self.speculative else None)

    # ---- synchronous use (tools, tests) ------------------------------------------------------
    def run(self, spans: Sequence[Span], bucket: Bucket | None = None, forced: dict | None = None) -> Ran:
        """Reset the fresh slots, build and run one step now. forced: teacher forcing per token
        row (see `step`)."""
        n_logits = sum(len(s.tokens) if s.all_logits else 1 for s in spans)
        bucket = bucket or self.buckets.pick(len(spans), sum(len(s.tokens) for s in spans), n_logits)
        built = build_step(self.geom, self.cfg, bucket, spans)
        fresh = np.zeros(self.geom.settings.slots, bool)
        fresh[[s.slot for s in spans if s.position == 0]] = True
        return Ran(self._launch(bucket, self.send(bucket, built.batch), fresh, forced), built)

    def cursors(self) -> np.ndarray:
        """Every slot's Engram cursor, read from the cache (a blocking probe: tools only)."""
        return np.asarray(self.cache.cursor)

    def warmup(self, concurrent: bool = True) -> None:
        """Compile every bucket's step (concurrently: XLA compiles outside the GIL) and the slot
        reset. A second start loads the serialized executables (`compile_cache`), tracing nothing."""
        batches = [(b, self.layout(b).pack(build_step(self.geom, self.cfg, b, []).batch))
                   for b in self.buckets.buckets]
        missing = []
        for bucket, batch in batches:
            key, in_tree, out_tree = self._executable_id(bucket, batch)
            loaded = compile_cache.load_executable(key, in_tree, out_tree) if key else None
            if loaded is None:
                missing.append((bucket, batch, key))
            else:
                self.compiled[bucket] = loaded

        def compile_one(item):
            bucket, batch, key = item
            lowered = self.step_fn.lower(self.params, self.cache, batch, layout=self.layout(bucket))
            return bucket, compile_cache.compile_and_save(key, lowered)

        if missing:
            with ThreadPoolExecutor(max_workers=len(missing) if concurrent else 1) as pool:
                self.compiled.update(pool.map(compile_one, missing))
        self.cache = reset_slots(self.cache, np.zeros(self.geom.settings.slots, bool))
        jax.block_until_ready(self.cache)

    def _executable_id(self, bucket: Bucket, batch: PackedBatch) -> tuple[str | None, Any, Any]:
        """(key, input tree, output tree) of a bucket's step; no key for a recording step (its
        output tree is only known by tracing)."""
        if self.record:
            return None, None, None
        shapes = lambda tree: jax.tree_util.tree_map(lambda x: (tuple(x.shape), str(x.dtype)), tree)
        args = (self.params, self.cache, batch)
        key = compile_cache.executable_key("step", repr(self.cfg), repr(self.geom.settings), repr(self.numerics),
                                           bucket, self.speculative, repr(self.layout(bucket)), repr(shapes(args)),
                                           repr(jax.tree_util.tree_structure(args)),
                                           # the tables are static: a Compiled object only takes the same ones
                                           repr(getattr(self.tables, "source", None)))
        zero = np.zeros((), np.int32)
        out_tree = jax.tree_util.tree_structure(StepOutput(self.cache, zero, zero, zero, zero, None, zero, zero))
        return key, jax.tree_util.tree_structure((args, {})), out_tree
