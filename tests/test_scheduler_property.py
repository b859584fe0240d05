"""The Scheduler under random traffic, driven by a fake device (no jax work, host only).

The harness follows `Engine.step` exactly: schedule N+1 -> prepare -> collect N -> dispatch N+1
(pending tokens from N's output) -> update(N). The fake device runs a step when it is dispatched
(in order, like a stream) and keeps what a real one would: each slot's cursor (a position-0 span
resets it, every span leaves it at its end) and each request's true token stream. So `found` is
the cursor the step read, never a copy of the plan, and every input token the host hands over is
checked against what the device itself sampled.

Depth: one step in flight only. A deeper loop is not something the Scheduler supports: a decode
row's pending token is the output of the step just before it (`PlannedSpan.pending`, filled from
the previous step's `feedback`), so with two steps in flight the second decode would need a token
that is still on the device.

Properties, after every operation (and in the middle of a step, right after admission):
`check_invariants`; pages referenced by a step still in flight are neither free nor owned by
another request (the quarantine, docs/CACHE.md INV-7); plans respect the widths; FCFS admission
with no head-of-line idling; events: no TokenEvent after a request's FinishEvent, exactly one
FinishEvent each, tokens <= budget, "length" means exactly budget tokens, the host's tokens are
the device's; after draining both allocators are empty again.
"""

from __future__ import annotations

import random
from collections import Counter, deque
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from v41_jax.cache.bookkeeping import PageAllocator
from v41_jax.runtime.request import Request
from v41_jax.runtime.scheduler import FinishEvent, Scheduler, StepResult, TokenEvent

EOS, STOP, VOCAB = 1, 2, 100
STAGES = ("waiting", "admitted", "prefill", "prefilled", "decoding", "finished", "unknown")
LIVE = STAGES[:5]


@dataclass(frozen=True)
class Config:
    num_pages: int = 30           # 29 usable: 116 tokens < max_context, so some requests never fit
    slots: int = 4
    max_requests: int = 4
    max_tokens: int = 16
    prefill_chunk: int = 7
    page_tokens: int = 4
    max_context: int = 128


CONFIGS = (Config(), Config(num_pages=40, slots=4, max_requests=3), Config(num_pages=24, slots=3, max_requests=3))


class DevSpan(NamedTuple):
    seq: Any
    rid: Any
    slot: int
    position: int
    length: int
    emits: bool
    pending: bool
    pages: tuple[int, ...]
    tokens: tuple           # input tokens, None where pending


class Flight(NamedTuple):
    step_id: int
    spans: tuple[DevSpan, ...]
    result: StepResult


class FakeDevice:
    def __init__(self, cfg: Config, rng: random.Random, p_eos: float, p_stop: float):
        self.cfg, self.rng, self.p_eos, self.p_stop = cfg, rng, p_eos, p_stop
        self.cursor: dict[int, int] = {}          # slot -> committed position (absent: garbage)
        self.truth: dict[Any, list[int]] = {}     # rid -> prompt + every token the device sampled
        self.next_pos: dict[Any, int] = {}        # rid -> first position not yet planned

    def sample(self) -> int:
        u = self.rng.random()
        if u < self.p_eos:
            return EOS
        if u < self.p_eos + self.p_stop:
            return STOP
        return self.rng.randrange(3, VOCAB)

    def prepare(self, plan) -> tuple[int, tuple[DevSpan, ...]]:
        """What the Runner captures on the host: slot, pages and known tokens, at planning time."""
        cfg, spans = self.cfg, plan.spans
        assert len(spans) <= cfg.max_requests, "more spans than requests per step"
        assert sum(sp.length for sp in spans) <= cfg.max_tokens, "more rows than the step holds"
        prefill = [sp for sp in spans if sp.position < sp.seq.prompt_len]
        assert sum(sp.length for sp in prefill) <= cfg.prefill_chunk, "prefill rows over prefill_chunk"
        kinds = [sp.position >= sp.seq.prompt_len for sp in spans]
        assert kinds == sorted(kinds, reverse=True), "decodes are planned before prefill chunks"
        assert len({sp.rid for sp in spans}) == len(spans) and len({sp.slot for sp in spans}) == len(spans)
        out = []
        for sp in spans:
            seq = sp.seq
            assert not seq.done and seq.slot is not None, "a finished request was planned"
            assert sp.position == self.next_pos.get(seq.rid, 0), "positions planned out of order"
            self.next_pos[seq.rid] = sp.position + sp.length
            assert sp.length >= 1 and sp.position + sp.length <= len(seq.pages) * cfg.page_tokens, \
                "a span runs past its request's pages"
            assert sp.position + sp.length <= cfg.max_context
            assert 0 not in seq.pages
            if sp.pending:
                assert sp.length == 1 and len(seq.tokens) == sp.position, \
                    "a pending decode must know every token before its own"
                toks = (None,)
            else:
                assert len(seq.tokens) >= sp.position + sp.length
                toks = tuple(seq.tokens[sp.position: sp.position + sp.length])
                assert tuple(int(t) for t in sp.known_tokens()) == toks
            if sp.emits:
                assert sp.position + sp.length >= seq.prompt_len
            out.append(DevSpan(seq, seq.rid, seq.slot, sp.position, sp.length, sp.emits, sp.pending,
                               tuple(seq.pages), toks))
        return plan.step_id, tuple(out)

    def dispatch(self, prepared, feedback: dict) -> Flight:
        """Fill in the pending tokens and run the step (in dispatch order, like a stream)."""
        step_id, spans = prepared
        tokens, found = [], []
        for sp in spans:
            toks = [feedback[sp.rid] if t is None else t for t in sp.tokens]
            truth = self.truth[sp.rid]
            assert toks == truth[sp.position: sp.position + sp.length], \
                f"{sp.rid}: the device got the wrong input tokens at {sp.position}"
            found.append(0 if sp.position == 0 else self.cursor.get(sp.slot, -7))
            self.cursor[sp.slot] = sp.position + sp.length
            if sp.emits:
                assert len(truth) == sp.position + sp.length
                t = self.sample()
                truth.append(t)
                tokens.append(t)
            else:
                tokens.append(self.rng.randrange(VOCAB))       # a row nobody reads
        return Flight(step_id, spans, StepResult(step_id, np.asarray(tokens, np.int32),
                                                 np.asarray(found, np.int64), None))


class Harness:
    def __init__(self, cfg: Config = Config(), seed: int = 0, p_eos: float = 0.05, p_stop: float = 0.05):
        self.cfg = cfg
        self.rng = random.Random(seed)
        self.sch = Scheduler(num_pages=cfg.num_pages, slots=cfg.slots, max_requests=cfg.max_requests,
                             max_tokens=cfg.max_tokens, prefill_chunk=cfg.prefill_chunk,
                             page_tokens=cfg.page_tokens, max_context=cfg.max_context,
                             check=self.check_request, eos_id=EOS)
        self.dev = FakeDevice(cfg, self.rng, p_eos, p_stop)
        self.flights: deque[Flight] = deque()
        self.order: dict[Any, int] = {}          # rid -> add index
        self.reqs: dict[Any, Request] = {}
        self.rejected: set = set()
        self.aborted: set = set()
        self.tokens: dict[Any, list[int]] = {}   # from TokenEvents
        self.finish: dict[Any, str] = {}         # from FinishEvents
        self.admitted: list[Any] = []
        self.stages = Counter()
        self.steps = 0
        self._unknown = 0

    # ---- what the engine's check_request does, without jax ---------------------------------
    def budget(self, req: Request) -> int:
        return max(0, min(req.max_new_tokens, self.cfg.max_context - len(req.prompt)))

    def check_request(self, req: Request) -> str | None:
        if len(req.prompt) == 0:
            return "empty prompt"
        if len(req.prompt) >= self.cfg.max_context:
            return "prompt leaves no room below max_context"
        if req.max_new_tokens < 1:
            return "max_new_tokens must be >= 1"
        need = -(-(len(req.prompt) + self.budget(req)) // self.cfg.page_tokens)
        if need > self.cfg.num_pages - 1:
            return f"needs {need} pages"
        return None

    # ---- operations -------------------------------------------------------------------------
    def add(self, kind: str = "ok", prompt_len: int = 8, max_new: int = 8, stop: bool = False,
            ignore_eos: bool = False, auto_id: bool = False) -> Any:
        n = {"ok": prompt_len, "long": 80 + prompt_len % 48, "too_long": 128 + prompt_len % 13,
             "empty": 0, "zero": prompt_len}[kind]
        if kind == "zero":
            max_new = 0
        prompt = [self.rng.randrange(3, VOCAB) for _ in range(n)]
        rid = None if auto_id else f"r{len(self.order)}"
        req = Request(prompt, max_new_tokens=max_new, stop_ids=(STOP,) if stop else (),
                      ignore_eos=ignore_eos, request_id=rid)
        expect_reject = self.check_request(req) is not None
        free_before = self.sch.pages.available
        got = self.sch.add(req)
        assert rid is None or got == rid
        rid = got
        assert rid not in self.order, "an id was handed out twice"
        self.order[rid], self.reqs[rid] = len(self.order), req
        seq = self.sch.by_id[rid]
        self.dev.truth[rid] = list(prompt)
        if expect_reject:
            self.rejected.add(rid)
            assert seq.done and seq.result.finish_reason == "error" and seq.result.error, "not rejected at once"
            assert seq not in self.sch.waiting and seq not in self.sch.running
            assert self.sch.pages.available == free_before
        else:
            assert not seq.done and seq.result.finish_reason == "" and self.sch.waiting[-1] is seq
            assert seq.budget == self.budget(req)
        self.check()
        return rid

    def stage(self, rid) -> str:
        seq = self.sch.by_id.get(rid)
        if seq is None:
            return "unknown"
        if seq.done:
            return "finished"
        if seq in self.sch.waiting:
            return "waiting"
        assert seq in self.sch.running
        if seq.planned == 0:
            return "admitted"
        assert self.dev.next_pos[rid] == seq.planned, "planned rows not dispatched between steps"
        if seq.planned < seq.prompt_len:
            return "prefill"            # >= 1 chunk dispatched, the prompt not done
        return "prefilled" if not seq.result.tokens else "decoding"

    def abort(self, stage: str, index: int = 0) -> bool:
        if stage == "unknown":
            rid, self._unknown = f"nope{self._unknown}", self._unknown + 1
        else:
            cands = [r for r in self.order if self.stage(r) == stage]
            if not cands:
                return False
            rid = cands[index % len(cands)]
        actual = self.stage(rid)
        assert actual == stage
        got = self.sch.abort(rid)
        self.stages[actual] += 1
        assert got == (actual in LIVE), f"abort({rid!r}) at stage {actual} returned {got}"
        if got:
            self.aborted.add(rid)
            seq = self.sch.by_id[rid]
            assert seq.done and seq.result.finish_reason == "abort" and seq.slot is None and not seq.pages
            assert self.sch.abort(rid) is False
        self.check()
        return got

    def step(self) -> list:
        """Engine.step, with the fake device in place of the Runner."""
        sch = self.sch
        plan = sch.schedule()
        self.check_admission()
        prepared = self.dev.prepare(plan) if plan is not None else None
        self.check_in_flight(self.flights)        # step N still in flight, N+1 just admitted/planned
        res, feedback = None, {}
        if self.flights:
            flight = self.flights.popleft()
            res = flight.result
            feedback = {sp.rid: int(res.tokens[b]) for b, sp in enumerate(flight.spans) if sp.emits}
        if prepared is not None:
            self.flights.append(self.dev.dispatch(prepared, feedback))
        events = sch.update(res) if res is not None else sch.drain()
        assert not (not self.flights and res is None and sch.running), "running requests but nothing to schedule"
        self.steps += 1
        self.observe(events)
        self.check()
        return events

    def drain(self, limit: int = 5000) -> None:
        n = 0
        while self.sch.has_work:
            self.step()
            n += 1
            assert n < limit, "the scheduler never runs dry"
        assert not self.flights and not self.sch.in_flight and not self.sch.outbox
        self.final_checks()

    # ---- checks -----------------------------------------------------------------------------
    def check_admission(self) -> None:
        """FCFS: admitted in add order, and the head of the queue only waits for a real reason."""
        sch = self.sch
        for seq in sch.running:
            if seq.rid not in self.admitted:
                if self.admitted:
                    assert self.order[seq.rid] > self.order[self.admitted[-1]], \
                        f"FCFS: {seq.rid} overtook {self.admitted[-1]}"
                self.admitted.append(seq.rid)
        if sch.waiting:
            head = sch.waiting[0]
            assert (len(sch.running) >= sch.max_requests or not sch.slots.available
                    or sch.pages.available < sch.pages_needed(head.req)), \
                f"the head {head.rid} fits ({sch.pages.available} pages free) but waits"
            assert all(self.order[r] < self.order[head.rid] for r in self.admitted), \
                f"FCFS: a request added after the head {head.rid} was admitted"

    def check_in_flight(self, flights) -> None:
        owner = {p: s for s in self.sch.running for p in s.pages}
        free = set(self.sch.pages._free)
        for fl in flights:
            for sp in fl.spans:
                for p in sp.pages:
                    assert p not in free, \
                        f"page {p} is free while step {fl.step_id} in flight uses it for {sp.rid}"
                    o = owner.get(p)
                    assert o is None or o is sp.seq, \
                        f"page {p} is owned by {o.rid} while step {fl.step_id} in flight uses it for {sp.rid}"

    def check(self) -> None:
        sch, cfg = self.sch, self.cfg
        sch.check_invariants(cfg.num_pages, cfg.slots)
        self.check_in_flight(self.flights)
        assert set(sch.in_flight) == {f.step_id for f in self.flights}
        assert len(self.flights) <= 1
        for s in sch.running:
            assert sch.slots._owner[s.slot] == s.rid, "a slot is owned by someone else"
            assert len(s.pages) == sch.pages_needed(s.req)
        assert len(sch.running) <= sch.max_requests
        assert sch.pages.available + sch.pages.quarantined + sum(len(s.pages) for s in sch.running) \
            == cfg.num_pages - 1

    def observe(self, events) -> None:
        for e in events:
            assert e.rid in self.order, f"an event for {e.rid!r}, never added"
            assert e.rid not in self.finish, f"an event for {e.rid!r} after its FinishEvent"
            if isinstance(e, TokenEvent):
                assert e.rid not in self.rejected and e.rid not in self.aborted
                got = self.tokens.setdefault(e.rid, [])
                got.extend(e.tokens)
                assert len(got) <= self.sch.by_id[e.rid].budget, f"{e.rid}: more tokens than its budget"
            else:
                assert isinstance(e, FinishEvent)
                self.finish[e.rid] = e.result.finish_reason
                assert self.sch.by_id[e.rid].done

    def final_checks(self) -> None:
        sch, cfg = self.sch, self.cfg
        assert sch.pages.available == cfg.num_pages - 1 and sch.pages.quarantined == 0
        assert sch.slots.available == cfg.slots and not sch.slots._owner
        assert not sch.running and not sch.waiting
        assert set(self.finish) == set(self.order), "a request without a FinishEvent"
        for rid, reason in self.finish.items():
            req, seq = self.reqs[rid], self.sch.by_id[rid]
            toks = self.tokens.get(rid, [])
            assert toks == seq.result.tokens
            assert reason == seq.result.finish_reason
            if rid in self.rejected:
                assert reason == "error" and not toks
                continue
            if rid in self.aborted:
                assert reason == "abort"
            else:
                assert reason in ("eos", "stop", "length"), f"{rid}: {reason} {seq.result.error}"
            budget = self.budget(req)
            assert len(toks) <= budget
            if reason == "length":
                assert len(toks) == budget
            if reason == "eos":
                assert toks[-1] == EOS and not req.ignore_eos
            if reason == "stop":
                assert toks[-1] in req.stop_ids
            stopping = set(req.stop_ids) | (set() if req.ignore_eos else {EOS})
            assert not stopping & set(toks[:-1]), f"{rid} went on past a stop token"
            n = len(req.prompt)
            assert toks == self.dev.truth[rid][n: n + len(toks)], f"{rid}: the host's tokens are not the device's"

    # ---- a program of operations --------------------------------------------------------------
    def run(self, ops) -> "Harness":
        for op in ops:
            if op[0] == "add":
                self.add(*op[1:])
            elif op[0] == "abort":
                self.abort(*op[1:])
            else:
                for _ in range(op[1]):
                    self.step()
        self.drain()
        return self


ADD_KINDS = ("ok",) * 16 + ("long", "long", "too_long", "empty", "zero")


def random_ops(rng: random.Random, n: int = 70) -> list:
    ops = []
    for _ in range(n):
        u = rng.random()
        if u < 0.35:
            ops.append(("add", rng.choice(ADD_KINDS), rng.randint(1, 60), rng.randint(1, 30),
                        rng.random() < 0.3, rng.random() < 0.2, rng.random() < 0.1))
        elif u < 0.55:
            ops.append(("abort", rng.choice(STAGES), rng.randrange(8)))
        else:
            ops.append(("step", rng.randint(1, 4)))
    return ops


def run_seed(cfg: Config, seed: int) -> Harness:
    rng = random.Random(seed)
    return Harness(cfg, seed=seed).run(random_ops(rng))


# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"p{c.num_pages}s{c.slots}r{c.max_requests}")
def test_random_traffic_seeded(cfg):
    stages, finishes, steps = Counter(), Counter(), 0
    for seed in range(120):
        h = run_seed(cfg, seed)
        stages += h.stages
        finishes += Counter(h.finish.values())
        steps += h.steps
    # every stage of abort was hit, and every way of finishing
    for stage in STAGES:
        assert stages[stage] > 0, (stage, stages)
    for reason in ("eos", "stop", "length", "abort", "error"):
        assert finishes[reason] > 0, (reason, finishes)


def test_admission_waits_happen():
    """The pools are small enough that the head of the queue waits for pages (not only slots)."""
    waited = 0
    orig = Harness.check_admission

    def counting(self):
        nonlocal waited
        orig(self)
        s = self.sch
        if s.waiting and s.slots.available and len(s.running) < s.max_requests:
            waited += 1                      # waiting on pages alone
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Harness, "check_admission", counting)
        for seed in range(20):
            run_seed(Config(), seed)
    assert waited > 0


OP = st.one_of(
    st.tuples(st.just("add"), st.sampled_from(ADD_KINDS), st.integers(1, 60), st.integers(1, 30),
              st.booleans(), st.booleans(), st.booleans()),
    st.tuples(st.just("abort"), st.sampled_from(STAGES), st.integers(0, 7)),
    st.tuples(st.just("step"), st.integers(1, 4)),
)


@settings(max_examples=400, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(cfg=st.sampled_from(CONFIGS), ops=st.lists(OP, max_size=60), seed=st.integers(0, 2 ** 32 - 1))
def test_random_traffic_hypothesis(cfg, ops, seed):
    Harness(cfg, seed=seed).run(ops)


def test_fcfs_big_head_not_overtaken():
    """A big request at the head waits (pages) while small ones behind it would fit; none of them
    overtakes it, and it is admitted at the first step its pages are free."""
    h = Harness(Config(), seed=1, p_eos=0.0, p_stop=0.0)
    a = h.add("ok", 20, 20)                         # 10 pages
    b = h.add("ok", 20, 20)                         # 10 pages: 9 left
    big = h.add("ok", 60, 30)                       # 23 pages: must wait for a or b
    small = [h.add("ok", 4, 4) for _ in range(4)]   # 2 pages each: would fit at once
    waited_with_room = 0
    while h.sch.by_id[big].slot is None and not h.sch.by_id[big].done:
        h.step()
        s = h.sch
        if h.sch.by_id[big] in s.waiting:
            assert all(s.by_id[r] in s.waiting for r in small), "a small request overtook the big head"
            waited_with_room += s.pages.available >= 2 and s.slots.available > 0
        assert h.steps < 200
    assert waited_with_room > 0                     # the small ones could have gone, and did not
    h.drain()
    assert h.admitted == [a, b, big, *small]
    assert all(h.finish[r] == "length" for r in h.order)


def test_finish_event_of_an_idle_scheduler_is_work():
    """Regression: an abort (or a rejection) with nothing else in the engine leaves a FinishEvent
    in the outbox; `has_work` must say so, or `while has_work: step()` never delivers it."""
    h = Harness(Config(), seed=0)
    rid = h.add("ok", 5, 5)
    assert h.abort("waiting")
    assert h.sch.has_work
    bad = h.add("empty")
    h.drain()
    assert h.finish == {rid: "abort", bad: "error"}


# ---- mutations: the checks above can fail ---------------------------------------------------
def _free_at_once(self, pages, last_step):
    self._free.extend(pages)


def _retire_one_early(self, completed_step):
    while self._quarantine and self._quarantine[0][0] <= completed_step + 1:
        self._free.extend(self._quarantine.popleft()[1])


@pytest.mark.parametrize("name,mutant", [("free", _free_at_once), ("retire", _retire_one_early)])
def test_mutation_no_quarantine_is_caught(monkeypatch, name, mutant):
    run_seed(Config(), 3)                           # passes as written
    monkeypatch.setattr(PageAllocator, name, mutant)
    with pytest.raises(AssertionError, match="while step .* in flight uses it"):
        run_seed(Config(), 3)


def test_mutation_overtaking_is_caught(monkeypatch):
    def admit_skipping(self):
        for seq in list(self.waiting):
            if len(self.running) >= self.max_requests or not self.slots.available:
                break
            need = self.pages_needed(seq.req)
            if self.pages.available < need:
                continue                            # the bug: later requests overtake the head
            self.waiting.remove(seq)
            seq.slot = self.slots.acquire(seq.rid)
            seq.pages = self.pages.allocate(need)
            self.running.append(seq)

    monkeypatch.setattr(Scheduler, "_admit", admit_skipping)
    with pytest.raises(AssertionError, match="FCFS|overtook"):
        test_fcfs_big_head_not_overtaken()


def test_next_tokens_follow_rows_after_an_aborted_verify():
    """Regression: with host feedback, each emitting span's next token is read at its own first
    logits row; a verify span before it takes 1 + verify rows, so span index != row. An aborted
    speculative request leaves the step in flight with its verify span ahead of a prefill that
    emits; the engine feeds that prefill's request what the scheduler emits for it."""
    blk = 3
    s = Scheduler(num_pages=64, slots=4, max_requests=4, max_tokens=32, prefill_chunk=8,
                  page_tokens=8, max_context=64, check=lambda r: None, eos_id=None,
                  spec_block=blk, pipelined=False)

    def result(plan, base):
        rows = plan.rows
        assert plan.first_rows() == list(np.cumsum([0] + [1 + sp.verify for sp in plan.spans])[:-1])
        return StepResult(plan.step_id, np.arange(base, base + rows, dtype=np.int32),
                          np.asarray([sp.seq.committed for sp in plan.spans]), None,
                          np.asarray([sp.verify for sp in plan.spans]),        # every draft accepted
                          np.full((len(plan.spans), blk), 7))

    s.add(Request([1, 2, 3], 20, request_id="X"))
    first = s.schedule()
    s.update(result(first, 100))                            # X prefilled, its drafts read
    s.add(Request([4, 5, 6, 7, 8], 20, request_id="C", speculative=False))
    plan = s.schedule()
    assert [(sp.rid, sp.verify > 0, sp.emits) for sp in plan.spans] == [("X", True, True), ("C", False, True)]
    s.abort("X")                                            # a stop string, a disconnect
    res = result(plan, 200)
    fed = plan.next_tokens(res)
    emitted = {e.rid: e.tokens for e in s.update(res) if isinstance(e, TokenEvent)}
    assert fed["C"] == emitted["C"][-1] == 200 + 1 + blk    # C's row comes after X's 1 + 3


def test_abort_between_steps_frees_pages_for_the_waiting_head():
    """Regression: a pipelined speculative request counts its drafts in flight as emitted, so near
    its budget it runs with nothing to plan; read the step in flight and nothing is planned or
    unread. An abort then (a cancel, a deadline, a stop string) used to quarantine its pages until
    a step that had already been read, and the request waiting for them was never admitted."""
    blk = 3
    s = Scheduler(num_pages=3, slots=2, max_requests=2, max_tokens=8, prefill_chunk=8, page_tokens=4,
                  max_context=64, check=lambda r: None, eos_id=None, spec_block=blk, pipelined=True)

    def result(plan):
        return StepResult(plan.step_id, np.full(plan.rows, 7, np.int32),
                          np.asarray([sp.seq.committed for sp in plan.spans]), None,
                          np.zeros(len(plan.spans), np.int32), np.zeros((len(plan.spans), blk), np.int32))

    s.add(Request([1, 2, 3, 4], max_new_tokens=4, request_id="A"))
    s.add(Request([5, 6, 7, 8], max_new_tokens=4, request_id="B"))   # waits: A holds the pages
    first = s.schedule()                                             # A's prefill
    verify = s.schedule()                                            # planned before the prefill is read
    s.update(result(first))
    assert s.schedule() is None                                      # the budget is counted as planned
    s.update(result(verify))                                         # every draft rejected
    assert [q.rid for q in s.running] == ["A"] and not s.in_flight and [q.rid for q in s.waiting] == ["B"]
    assert s.abort("A")
    plan = s.schedule()
    assert plan is not None and [sp.rid for sp in plan.spans] == ["B"], (s.pages.available, s.pages.quarantined)
    s.check_invariants(num_pages=3, slots=2)
