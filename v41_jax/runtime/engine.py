"""Generation: continuous batching of requests over the jitted step.

Each iteration admits waiting requests while a STATE slot and their pages are free (a request
reserves pages for prompt + max_new_tokens at admission, so a running request never stalls for
memory), schedules one span per running request (decodes first, one token each, then prefill
chunks while the step's token budget lasts), runs one step in the smallest bucket that holds the
batch, samples the rows that end a prompt or decode a token, and retires finished requests.

Host-side per span (RUNTIME.md §3.6): a continuing span reads its slot's Engram cursor from the
cache and must find it at its own first position (else StaleStateError); the cursor's history
seeds the n-gram hashes of the span's tokens, whose rows are gathered from the host-resident
tables and passed in the batch together with the cursor after the span; position-0 spans get
their slot reset first. Nothing is staged twice and nothing is skipped: the step writes each
span's cursor once.

Bad requests (empty prompt, token id outside the vocabulary, prompt that leaves no room for one
new token, more pages than the pool holds, max_new_tokens < 1) finish at once with
finish_reason "error" and a message; the others run as if they were absent. More requests than
slots wait in the queue.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from v41_jax.cache.bookkeeping import PageAllocator, SlotAllocator, check_cursor
from v41_jax.cache.buffer import allocate, reset_slots
from v41_jax.cache.geometry import CacheGeometry, EngineSettings
from v41_jax.checkpoint.load import ENGRAM_KEY
from v41_jax.config import ModelConfig
from v41_jax.engram_hash import EngramCursor, EngramHasher
from v41_jax.model.numerics import Numerics
from v41_jax.runtime.metadata import Bucket, BucketSet, BuiltStep, Span, build_step
from v41_jax.runtime.sampling import SamplingParams, sample
from v41_jax.runtime.step import make_step

TRACE, LOWER, COMPILE = ("/jax/core/compile/jaxpr_trace_duration",
                         "/jax/core/compile/jaxpr_to_mlir_module_duration",
                         "/jax/core/compile/backend_compile_duration")


class CompileMeter:
    """Process-wide compilation counters (jax.monitoring events). `lowerings` counts every jit
    cache miss, including those the persistent compilation cache then serves; `backend_compiles`
    the XLA compilations actually run; `seconds` tracing + lowering + compiling."""
    lowerings = 0
    backend_compiles = 0
    seconds = 0.0

    @classmethod
    def _listen(cls, event: str, duration: float, **_):
        if event in (TRACE, LOWER, COMPILE):
            cls.seconds += duration
            cls.lowerings += event == LOWER
            cls.backend_compiles += event == COMPILE


jax.monitoring.register_event_duration_secs_listener(CompileMeter._listen)


@dataclass(frozen=True)
class Request:
    prompt: Sequence[int]
    max_new_tokens: int = 32
    sampling: SamplingParams = SamplingParams()
    stop_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    request_id: Any = None


@dataclass
class Result:
    request_id: Any
    prompt_len: int
    tokens: list[int] = field(default_factory=list)
    finish_reason: str = ""          # "eos" | "stop" | "length" | "error"
    error: str | None = None


@dataclass
class Stats:
    requests: int = 0
    steps: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    compile_s: float = 0.0
    run_s: float = 0.0               # wall time of generate() minus compile time

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.run_s if self.run_s > 0 else 0.0


class Ran(NamedTuple):
    logits: jax.Array                # fp32 [O, V] on device
    built: BuiltStep
    inter: dict | None               # per-token-row intermediates when the engine records


@dataclass
class _Live:
    req: Request
    rid: Any
    slot: int
    pages: list[int]
    tokens: list[int]                # prompt + generated
    prompt_len: int
    committed: int = 0               # positions already in the cache
    result: Result | None = None

    @property
    def prefilling(self) -> bool:
        return self.committed < self.prompt_len


def default_buckets(max_requests: int, chunk: int) -> BucketSet:
    """One decode bucket and one prefill bucket, both at the full request width: two compiles,
    and a step never waits for a bucket (padding rows cost little next to a recompile)."""
    return BucketSet((Bucket(max_requests, max_requests, max_requests),
                      Bucket(chunk + max_requests, max_requests, max_requests)))


def parse_buckets(spec: str) -> BucketSet:
    """"TxRxO,..." (tokens x requests x logits rows) -> BucketSet."""
    return BucketSet(tuple(Bucket(*map(int, b.split("x"))) for b in spec.split(",")))


class Engine:
    def __init__(self, params: dict, cfg: ModelConfig, *, settings: EngineSettings, buckets: BucketSet,
                 numerics: Numerics, token_map: np.ndarray | None = None, prefill_chunk: int | None = None,
                 eos_id: int | None = None, record: bool = False):
        self.params, self.cfg, self.numerics, self.buckets = params, cfg, numerics, buckets
        self.record = record
        self.eos_id = cfg.eos_token_id if eos_id is None else eos_id
        self.geom = CacheGeometry.build(cfg, settings)
        if buckets.max_requests > settings.slots:
            raise ValueError(f"buckets: {buckets.max_requests} requests per step exceed {settings.slots} slots")
        self.prefill_chunk = prefill_chunk or buckets.max_tokens
        self.hasher = EngramHasher(cfg, token_map) if cfg.engram_layer_ids else None
        self.tables = params.get(ENGRAM_KEY)
        self.step_fn = make_step(cfg, self.geom, numerics, record)
        self.reset()

    def reset(self) -> None:
        """Drop every request's state: a zeroed cache and empty allocators (the compiled step stays)."""
        self.cache = allocate(self.geom)
        self.pages = PageAllocator(self.geom.settings.num_pages)
        self.slots = SlotAllocator(self.geom.settings.slots)
        self.step_id = 0                 # steps dispatched so far
        self.bucket_steps: Counter[Bucket] = Counter()

    # ---- one step --------------------------------------------------------------------------
    def _engram(self, cursor: EngramCursor, tokens: np.ndarray):
        """(codes, scales, next cursor row) of a span's tokens after `cursor`."""
        if self.hasher is None:
            return (), (), np.asarray([cursor.position + len(tokens), *cursor.history], np.int32)
        ids, nxt = self.hasher.hash_ids(cursor, tokens)                        # [L, nE, cols]
        rows = [self.tables.gather(layer, ids[:, i]) for i, layer in enumerate(self.cfg.engram_layer_ids)]
        return (tuple(c.view(np.uint8) for c, _ in rows), tuple(s.view(np.uint8) for _, s in rows),
                nxt.as_row())

    def make_span(self, rid, slot: int, position: int, tokens: Sequence[int], pages: Sequence[int],
                  cursor_row: np.ndarray | None, all_logits: bool = False) -> Span:
        """A span with its Engram rows; cursor_row is the slot's cursor as read from the cache
        (ignored for a position-0 span, whose slot is reset)."""
        tokens = np.asarray(tokens, np.int32)
        if position == 0:
            cursor = EngramCursor(0, (-1,) * self.geom.history)
        else:
            check_cursor(rid, position, int(cursor_row[0]))
            cursor = EngramCursor.from_row(cursor_row)
        codes, scales, nxt = self._engram(cursor, tokens)
        return Span(rid, slot, position, tokens, np.asarray(pages, np.int32), nxt, codes, scales, all_logits)

    def cursors(self) -> np.ndarray:
        """Every slot's Engram cursor, read from the cache (a blocking probe, RUNTIME.md I-4)."""
        return np.asarray(self.cache.cursor)

    def run(self, spans: Sequence[Span], bucket: Bucket | None = None, forced: dict | None = None) -> Ran:
        """Reset the fresh slots, build and run one step. forced: teacher forcing per token row
        (see `step`); the intermediates come back when the engine records."""
        n_logits = sum(len(s.tokens) if s.all_logits else 1 for s in spans)
        bucket = bucket or self.buckets.pick(len(spans), sum(len(s.tokens) for s in spans), n_logits)
        built = build_step(self.geom, self.cfg, bucket, spans)
        fresh = np.zeros(self.geom.settings.slots, bool)
        fresh[[s.slot for s in spans if s.position == 0]] = True
        if fresh.any():
            self.cache = reset_slots(self.cache, fresh)
        out = self.step_fn(self.params, self.cache, built.batch, forced)
        self.cache = out[1]
        self.step_id += 1
        self.bucket_steps[bucket] += 1
        return Ran(out[0], built, out[2] if self.record else None)

    def warmup(self) -> None:
        """Compile every bucket (an all-padding step is inert) and the helpers."""
        for b in self.buckets.buckets:
            self._sample(self.run([], b).logits, [])
        self.cache = reset_slots(self.cache, np.zeros(self.geom.settings.slots, bool))
        jax.block_until_ready(self.cache)

    def _sample(self, logits: jax.Array, rows: Sequence[tuple[SamplingParams, int]]) -> np.ndarray:
        """rows: (sampling params, position sampled for) of the first len(rows) logits rows."""
        o = logits.shape[0]
        sp = list(rows) + [(SamplingParams(), 0)] * (o - len(rows))
        arr = lambda f, dt: jnp.asarray(np.array([f(s, p) for s, p in sp], dt))
        return np.asarray(sample(logits, arr(lambda s, p: s.temperature, np.float32),
                                 arr(lambda s, p: s.top_k, np.int32), arr(lambda s, p: s.top_p, np.float32),
                                 arr(lambda s, p: s.seed, np.int32), arr(lambda s, p: p, np.int32)))

    # ---- generation ----------------------------------------------------------------------
    def check_request(self, req: Request) -> str | None:
        prompt = np.asarray(req.prompt)
        if prompt.size == 0:
            return "empty prompt"
        if prompt.ndim != 1 or prompt.min() < 0 or prompt.max() >= self.cfg.vocab_size:
            return f"token ids must lie in [0, {self.cfg.vocab_size})"
        if len(prompt) >= self.geom.max_context:
            return f"prompt of {len(prompt)} tokens leaves no room below max_context {self.geom.max_context}"
        if req.max_new_tokens < 1:
            return "max_new_tokens must be >= 1"
        if self._pages_needed(req) > self.geom.settings.num_pages - 1:
            return f"needs {self._pages_needed(req)} pages, the pool has {self.geom.settings.num_pages - 1}"
        return None

    def _pages_needed(self, req: Request) -> int:
        return self.geom.pages_for(min(len(req.prompt) + req.max_new_tokens, self.geom.max_context))

    def generate(self, requests: Sequence[Request], on_step: Callable[[int], None] | None = None,
                 stats: Stats | None = None) -> list[Result]:
        """Run every request to completion; results in request order. on_step(new_tokens)."""
        stats = stats if stats is not None else Stats()
        t0, c0 = time.perf_counter(), CompileMeter.seconds
        results, queue, live = [], deque(), []
        for i, req in enumerate(requests):
            rid = i if req.request_id is None else req.request_id
            res = Result(rid, len(req.prompt))
            results.append(res)
            err = self.check_request(req)
            if err:
                res.finish_reason, res.error = "error", err
            else:
                queue.append((req, rid, res))
        stats.requests += len(requests)
        while queue or live:
            while queue and len(live) < self.buckets.max_requests and self.slots.available \
                    and self.pages.available >= self._pages_needed(queue[0][0]):
                req, rid, res = queue.popleft()
                live.append(_Live(req, rid, self.slots.acquire(rid), self.pages.allocate(self._pages_needed(req)),
                                  [int(t) for t in req.prompt], len(req.prompt), result=res))
                stats.prompt_tokens += len(req.prompt)
            if not live:
                raise RuntimeError("a valid request cannot be admitted into an empty engine")
            scheduled = self._schedule(live)
            cursors = self.cursors()
            spans = [self.make_span(lv.rid, lv.slot, lv.committed, lv.tokens[lv.committed: lv.committed + n],
                                    lv.pages, cursors[lv.slot]) for lv, n in scheduled]
            sampled = self._sample(self.run(spans).logits,
                                   [(lv.req.sampling, lv.committed + n) for lv, n in scheduled])
            new = 0
            for (lv, n), tok in zip(scheduled, sampled):
                lv.committed += n
                if lv.prefilling:
                    continue
                lv.tokens.append(int(tok))
                lv.result.tokens.append(int(tok))
                new += 1
                reason = self._finished(lv, int(tok))
                if reason:
                    lv.result.finish_reason = reason
                    self.pages.free(lv.pages, last_step=self.step_id)
                    self.slots.release(lv.slot)
                    live.remove(lv)
            self.pages.retire(completed_step=self.step_id)   # the sampled tokens are on the host
            stats.steps += 1
            stats.generated_tokens += new
            if on_step:
                on_step(new)
        compile_s = CompileMeter.seconds - c0
        stats.compile_s += compile_s
        stats.run_s += time.perf_counter() - t0 - compile_s
        return results

    def _schedule(self, live: list[_Live]) -> list[tuple[_Live, int]]:
        """(request, rows) for this step: one row per decoding request, then prefill chunks
        sharing at most `prefill_chunk` rows (and what the largest bucket leaves)."""
        decodes = [(lv, 1) for lv in live if not lv.prefilling]
        budget = min(self.prefill_chunk, self.buckets.max_tokens - len(decodes))
        prefills = []
        for lv in (lv for lv in live if lv.prefilling):
            n = min(budget, lv.prompt_len - lv.committed)
            if n > 0:
                prefills.append((lv, n))
                budget -= n
        return decodes + prefills

    def _finished(self, lv: _Live, tok: int) -> str:
        if tok == self.eos_id and not lv.req.ignore_eos:
            return "eos"
        if tok in lv.req.stop_ids:
            return "stop"
        if len(lv.result.tokens) >= lv.req.max_new_tokens or len(lv.tokens) >= self.geom.max_context:
            return "length"
        return ""
