"""The Scheduler: which rows of which requests the next step runs (host only, no jax).

It owns the waiting queue, the running requests, the page and slot allocators, admission and the
policy; the Runner only executes what it plans. The loop is pipelined one step deep: step N+1 is
planned while step N is on the device, before N's tokens are known. So

* a request whose last planned row samples a token decodes next with that token *pending* (the
  Runner fills it in from step N's output before it dispatches N+1);
* a request that step N finishes (EOS, stop id) may still have a row in step N+1: that row is
  dead, its output is discarded, and its pages stay quarantined until N+1 has completed
  (docs/CACHE.md INV-7, page quarantine), so no new owner's rows can be written by it;
* a request never gets more rows than its token budget allows (`budget`, known in advance).

Policy: strict FCFS admission (the head of the queue waits for its pages and a slot, nothing
overtakes it, so nothing starves), reserving pages for prompt + budget at admission so a running
request never stalls for memory; each step plans one row per decoding request first, then prefill
chunks in admission order while `prefill_chunk` rows (and what the largest bucket leaves) last.

Speculative requests (DSpark, docs/CACHE.md §4.1) decode by verify spans: the last committed
token then up to `spec_block` drafts, and the step reports how many were accepted; the request
takes that many tokens plus the target's one after. Where a verify span starts depends on how many
drafts the step before it accepted. With `pipelined` (the Runner resolves pending spans on the
device from the slot: position, token, drafts) the next verify span is planned while the step
before it runs, like a plain decode: the host counts every draft in flight as accepted (`planned`
and `planned_emits` are upper bounds until the step is read, then lowered by the drafts it
rejected), so a span never goes past the request's pages or budget. Without it (Engram tables on
the host: the host hashes a span's tokens), a step that drafts for a request leaves it *awaiting*
until that step's results are read, and its verify span is built from the drafts read.

The stale-state check: each step reports the cursor position it found in every request row's slot
(`StepOutput.found`); `update` compares it with where that request's committed state ends after
the steps read before this one (`Sequence.committed`), which is where this same step's span
started. A mismatch ends that request alone with `StaleStateError` text naming slot, expected and
found; it is never judged against another step, so a pipelined loop cannot fire it falsely.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

import numpy as np

from v41_jax.cache.bookkeeping import PageAllocator, RankedPages, RankedSlots, SlotAllocator, StaleStateError
from v41_jax.runtime.request import Request, Result
from v41_jax.runtime.sampling import SamplingParams


@dataclass
class Sequence:
    """A request the scheduler holds: its tokens so far and what is planned for it."""
    rid: Any
    req: Request
    result: Result
    budget: int                          # new tokens it may produce (max_new_tokens, context-capped)
    tokens: list[int]                    # prompt + tokens received so far
    submitted: float
    slot: int | None = None
    pages: list[int] = field(default_factory=list)
    planned: int = 0                     # positions planned (rows in dispatched or planned steps; drafts
                                         # in flight counted as accepted)
    planned_emits: int = 0               # sampled tokens planned (same upper bound)
    committed: int = 0                   # positions committed by the steps read so far
    done: bool = False
    spec: bool = False                   # decodes by verifying DSpark drafts
    drafts: list[int] = field(default_factory=list)   # the block drafted after its last step
    awaiting: bool = False               # a step that drafts for it has not been read yet

    @property
    def prompt_len(self) -> int:
        return self.result.prompt_len

    @property
    def prefilling(self) -> bool:
        return self.planned < self.prompt_len


class PlannedSpan(NamedTuple):
    seq: Sequence
    position: int
    length: int
    emits: bool            # its last row samples the request's next token
    pending: bool          # its input tokens come from the step before it: a decode's token not read yet,
                           # or (pipelined) a verify span's token and drafts, whose position is an upper bound
    verify: int = 0        # drafts it checks (its rows after the first)
    draft: bool = False    # the step drafts a block for the request after it

    @property
    def rid(self):
        return self.seq.rid

    @property
    def slot(self) -> int:
        return self.seq.slot

    @property
    def sampling(self) -> SamplingParams:
        return self.seq.req.sampling

    def known_tokens(self) -> np.ndarray:
        """Its input tokens: a verify span's last committed token then its drafts; a pending span's
        (the previous step produces them, on the device) as 0."""
        if self.pending:
            return np.zeros(self.length, np.int32)
        if self.verify:
            return np.asarray([self.seq.tokens[self.position], *self.seq.drafts[:self.verify]], np.int32)
        return np.asarray(self.seq.tokens[self.position: self.position + self.length], np.int32)


@dataclass(frozen=True)
class StepPlan:
    step_id: int
    spans: tuple[PlannedSpan, ...]

    def first_rows(self) -> list[int]:
        """Each span's first logits row (a span has one row, a verify span 1 + verify)."""
        return np.cumsum([0] + [1 + sp.verify for sp in self.spans])[:-1].tolist()

    @property
    def rows(self) -> int:
        return sum(1 + sp.verify for sp in self.spans)

    def next_tokens(self, res: "StepResult") -> dict:
        """rid -> the token each emitting span ends on (after a verify, its last accepted row's):
        what the request's next decode reads. Row b is not span b once a verify span precedes it."""
        return {sp.rid: int(res.tokens[first + (int(res.accepted[b]) if sp.verify else 0)])
                for b, (sp, first) in enumerate(zip(self.spans, self.first_rows())) if sp.emits}


@dataclass(frozen=True)
class TokenEvent:
    rid: Any
    tokens: tuple[int, ...]
    logprobs: tuple[float, ...] | None = None
    drafted: int = 0                                 # DSpark drafts the verify behind these tokens checked
    accepted: int = 0                                # of those, accepted by the target


@dataclass(frozen=True)
class FinishEvent:
    rid: Any
    result: Result


Event = TokenEvent | FinishEvent


class StepResult(NamedTuple):
    step_id: int
    tokens: np.ndarray           # int [O]: each span's logits rows in order (one, or 1 + verify)
    found: np.ndarray            # int [R]: span b's slot cursor as the step read it
    logprobs: np.ndarray | None  # fp32 [O] when a span asked for them
    accepted: np.ndarray | None = None   # int [R]: drafts span b accepted (speculating engines)
    drafts: np.ndarray | None = None     # int [R, blk]: the block drafted after span b


@dataclass
class SpecStats:
    """Speculation counters: verifies (one request's verify span each), drafts proposed and
    accepted per draft position."""
    verifies: int = 0
    proposed_at: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)

    def record(self, proposed: int, accepted: int) -> None:
        width = max(proposed, len(self.proposed_at))
        for counts in (self.proposed_at, self.accepted_at):
            counts.extend([0] * (width - len(counts)))
        self.verifies += 1
        for j in range(proposed):
            self.proposed_at[j] += 1
            self.accepted_at[j] += j < accepted


class Scheduler:
    def __init__(self, *, num_pages: int, slots: int, max_requests: int, max_tokens: int,
                 prefill_chunk: int, page_tokens: int, max_context: int,
                 check: Callable[[Request], str | None], eos_id: int | None, spec_block: int = 0,
                 max_logits: int | None = None, ranks: int = 1, pipelined: bool = False):
        # ranks > 1: a mesh's data-parallel ranks, each with its own slots and pages (docs/PARALLEL.md §3)
        self.ranks = ranks
        self.pages = PageAllocator(num_pages) if ranks == 1 else RankedPages(num_pages, ranks)
        self.slots = SlotAllocator(slots) if ranks == 1 else RankedSlots(slots, ranks)
        self.max_requests, self.max_tokens = max_requests, max_tokens
        self.prefill_chunk, self.page_tokens, self.max_context = prefill_chunk, page_tokens, max_context
        self.check, self.eos_id = check, eos_id
        # drafts per verify (0: no request speculates); logits rows a step may return
        self.spec_block, self.max_logits = spec_block, max_tokens if max_logits is None else max_logits
        self.pipelined = pipelined                   # verify spans resolved on the device (module docstring)
        self.spec_stats = SpecStats()
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.by_id: dict[Any, Sequence] = {}
        self.outbox: list[Event] = []
        self.in_flight: dict[int, StepPlan] = {}     # planned or dispatched, results not read yet
        self.last_planned = 0                        # step ids start at 1
        self._auto_id = 0

    # ---- requests in and out ------------------------------------------------------------------
    def budget(self, req: Request) -> int:
        return max(0, min(req.max_new_tokens, self.max_context - len(req.prompt)))

    def pages_needed(self, req: Request) -> int:
        return -(-(len(req.prompt) + self.budget(req)) // self.page_tokens)

    def add(self, req: Request) -> Any:
        """Queue a request -> its id. A request that can never run is finished at once with
        finish_reason "error" (a FinishEvent in the next `update`/`drain`)."""
        rid = req.request_id
        if rid is None:
            rid, self._auto_id = self._auto_id, self._auto_id + 1
            while rid in self.by_id:
                rid, self._auto_id = self._auto_id, self._auto_id + 1
        if rid in self.by_id and not self.by_id[rid].done:
            raise ValueError(f"request id {rid!r} is already in the engine")
        result = Result(rid, len(req.prompt))
        err = self.check(req)
        seq = Sequence(rid, req, result, self.budget(req) if not err else 0,
                       [int(t) for t in req.prompt] if not err else [], time.perf_counter())
        result.max_new_tokens = seq.budget
        seq.spec = bool(self.spec_block) and req.speculative is not False
        self.by_id[rid] = seq
        if err:
            self._finish(seq, "error", err)
        else:
            self.waiting.append(seq)
        return rid

    def abort(self, rid) -> bool:
        """End a request at any stage (waiting, prefilling, decoding); False if it had ended.
        Rows already planned for it still run; their output is discarded."""
        seq = self.by_id.get(rid)
        if seq is None or seq.done:
            return False
        if seq in self.waiting:
            self.waiting.remove(seq)
        self._finish(seq, "abort")
        return True

    def forget(self, rid) -> None:
        """Drop a finished request's record (`by_id` keeps every request until then, so that a
        caller can read its result; a server that runs for days forgets each once delivered)."""
        seq = self.by_id.get(rid)
        if seq is not None and not seq.done:
            raise ValueError(f"request {rid!r} is still running: abort it first")
        self.by_id.pop(rid, None)

    def _finish(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        seq.done = True
        seq.result.finish_reason, seq.result.error = reason, error
        if seq.slot is not None:
            # steps up to the newest planned one may still read or write these pages; with none
            # planned and unread (an abort between steps: a pipelined speculative request can be
            # running with nothing to plan), every such step is done, and no later update would
            # release them: a waiting request that needs them would wait forever
            self.pages.free(seq.pages, last_step=self.last_planned)
            if not self.in_flight:
                self.pages.retire(completed_step=self.last_planned)
            self.slots.release(seq.slot)
            seq.slot, seq.pages = None, []
            self.running.remove(seq)
        self.outbox.append(FinishEvent(seq.rid, seq.result))

    @property
    def has_work(self) -> bool:
        # an undelivered event is work too: an abort or a rejection in an idle engine leaves only
        # its FinishEvent, which `while has_work: step()` must still deliver
        return bool(self.waiting or self.running or self.in_flight or self.outbox)

    def drain(self) -> list[Event]:
        out, self.outbox = self.outbox, []
        return out

    # ---- planning ------------------------------------------------------------------------------
    def rank_of(self, seq: Sequence) -> int:
        """The data-parallel rank a running request's slot (and pages) belong to."""
        return seq.slot // self.slots.per if self.ranks > 1 else 0

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_requests * self.ranks and self.slots.available:
            seq = self.waiting[0]
            rank = self._rank_for(self.pages_needed(seq.req))
            if rank is None:
                break                                # FCFS: nobody overtakes the head
            self.waiting.popleft()
            seq.slot = self.slots.acquire(seq.rid, rank)
            seq.pages = self.pages.allocate(self.pages_needed(seq.req), rank)
            self.running.append(seq)

    def _rank_for(self, need: int) -> int | None:
        """The rank a request needing `need` pages joins: of those with room for one more running
        request, a free slot and the pages, the one with the most free pages (then the lowest), or None."""
        running = [0] * self.ranks
        for seq in self.running:
            running[self.rank_of(seq)] += 1
        fits = [r for r in range(self.ranks) if running[r] < self.max_requests and self.slots.available_on(r)
                and self.pages.available_on(r) >= need]
        return max(fits, key=lambda r: (self.pages.available_on(r), -r)) if fits else None

    def schedule(self) -> StepPlan | None:
        """The next step's spans (decodes first, then prefill chunks), or None if nothing runs."""
        self._admit()
        # every budget is per data-parallel rank (one rank without a mesh): each rank's rows form
        # their own batch of the bucket
        spans, rank = [], self.rank_of
        tokens_left, logits_left = [self.max_tokens] * self.ranks, [self.max_logits] * self.ranks
        requests = [0] * self.ranks
        decoding = [s for s in self.running if not s.prefilling and s.planned_emits < s.budget and not s.awaiting]
        for seq in (s for s in decoding if not s.spec):
            spans.append(PlannedSpan(seq, seq.planned, 1, True, seq.planned >= len(seq.tokens)))
            tokens_left[rank(seq)] -= 1
            logits_left[rank(seq)] -= 1
            requests[rank(seq)] += 1
        verifying = [s for s in decoding if s.spec]
        for i, seq in enumerate(verifying):
            # as many drafts as the budget can still emit and the bucket holds, one row kept for
            # each verify after this one on its rank
            r = rank(seq)
            left, after = seq.budget - seq.planned_emits, sum(rank(s) == r for s in verifying[i + 1:])
            k = max(0, min(self.spec_block, left - 1, tokens_left[r] - 1 - after, logits_left[r] - 1 - after))
            # pipelined: `left` is a lower bound (drafts in flight counted as accepted), so it drafts
            # whenever a later span may follow
            spans.append(PlannedSpan(seq, seq.planned, 1 + k, True, self.pipelined, k,
                                     self.pipelined or left > 1))
            tokens_left[r], logits_left[r] = tokens_left[r] - 1 - k, logits_left[r] - 1 - k
            requests[r] += 1
        room = [min(self.prefill_chunk, t) for t in tokens_left]
        stopped: set[int] = set()                    # FCFS per rank: nobody overtakes a chunk that did not fit
        for seq in (s for s in self.running if s.prefilling):
            r = rank(seq)
            n = min(room[r], seq.prompt_len - seq.planned)
            if r in stopped or n <= 0 or requests[r] >= self.max_requests or logits_left[r] < 1:
                stopped.add(r)
                if len(stopped) == self.ranks:
                    break
                continue
            last = seq.planned + n == seq.prompt_len
            spans.append(PlannedSpan(seq, seq.planned, n, last, False, 0, last and seq.spec and seq.budget > 1))
            room[r] -= n
            logits_left[r] -= 1
            requests[r] += 1
        if not spans:
            return None
        for sp in spans:
            sp.seq.planned += sp.length
            sp.seq.planned_emits += sp.emits + sp.verify
            sp.seq.awaiting = sp.draft and not self.pipelined
        self.last_planned += 1
        plan = StepPlan(self.last_planned, tuple(spans))
        self.in_flight[plan.step_id] = plan
        return plan

    # ---- results -------------------------------------------------------------------------------
    def update(self, res: StepResult) -> list[Event]:
        """Apply one step's results (steps in order) -> the events since the last call."""
        plan = self.in_flight.pop(res.step_id)
        now = time.perf_counter()
        for b, (sp, first) in enumerate(zip(plan.spans, plan.first_rows())):
            seq = sp.seq
            if seq.done:
                continue                             # aborted or finished: a dead row
            found = int(res.found[b])
            if found != seq.committed:
                err = StaleStateError(f"request {seq.rid!r}: slot {sp.slot} needs state at {seq.committed}, "
                                      f"found {found}")
                self._finish(seq, "error", str(err))
                continue
            n = int(res.accepted[b]) if sp.verify else 0
            rejected = sp.verify - n                 # rows written but never read, tokens never emitted
            seq.committed += sp.length - rejected
            seq.planned -= rejected
            seq.planned_emits -= rejected
            if sp.verify:
                self.spec_stats.record(sp.verify, n)
            if sp.draft:
                seq.awaiting = False
                if not self.pipelined:               # the host builds the next verify span from them
                    seq.drafts = res.drafts[b].tolist()
            if not sp.emits:
                continue
            self._emit(seq, res.tokens[first: first + n + 1],
                       None if res.logprobs is None else res.logprobs[first: first + n + 1], now,
                       drafted=sp.verify, accepted=n)
        self.pages.retire(completed_step=res.step_id)
        return self.drain()

    def _emit(self, seq: Sequence, tokens: np.ndarray, logprobs: np.ndarray | None, now: float,
              drafted: int = 0, accepted: int = 0) -> None:
        """The request's new tokens in order, up to the first that finishes it (the rest dropped)."""
        r, toks, lps, reason = seq.result, [], [], ""
        for i, tok in enumerate(int(t) for t in tokens):
            seq.tokens.append(tok)
            r.tokens.append(tok)
            r.token_times.append(now)
            toks.append(tok)
            if seq.req.logprobs:
                lps.append(float(logprobs[i]))
                r.logprobs.append(lps[-1])
            reason = self._stop_reason(seq, tok)
            if reason:
                break
        if r.ttft_s is None:
            r.ttft_s = now - seq.submitted
        self.outbox.append(TokenEvent(seq.rid, tuple(toks), tuple(lps) if seq.req.logprobs else None,
                                      drafted, accepted))
        if reason:
            self._finish(seq, reason)

    @property
    def awaiting(self) -> bool:
        """A running request waits for the results of a step in flight before it can be planned."""
        return any(s.awaiting for s in self.running)

    def _stop_reason(self, seq: Sequence, tok: int) -> str:
        if tok == self.eos_id and not seq.req.ignore_eos:
            return "eos"
        if tok in seq.req.stop_ids:
            return "stop"
        if len(seq.result.tokens) >= seq.budget:
            return "length"
        return ""

    # ---- invariants (tests) ----------------------------------------------------------------
    def check_invariants(self, num_pages: int, slots: int) -> None:
        """No page in two requests, every page exactly one of free / quarantined / owned, every
        slot free or owned by one running request; raises AssertionError."""
        owned = [p for s in self.running for p in s.pages]
        assert len(owned) == len(set(owned)), "a page is held by two requests"
        free = list(self.pages._free)
        quarantined = [p for _, ps in self.pages._quarantine for p in ps]
        every = owned + free + quarantined
        assert sorted(every) == list(range(1, num_pages)), "pages lost or duplicated"
        held = [s.slot for s in self.running]
        assert len(held) == len(set(held)) and None not in held, "a slot is held twice or not at all"
        assert sorted(held + list(self.slots._free)) == list(range(slots)), "slots lost or duplicated"
        assert all(not s.done for s in self.running) and all(s.slot is None for s in self.waiting)

