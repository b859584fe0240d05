"""The engine loop: one background thread owns the Engine (the device, the donated cache, the page
and slot allocators). Request handlers, on any thread, only talk to it through `EngineLoop`:

    stream = loop.submit(request)        # thread-safe; the request waits in the loop's inbox
    for event in stream.events(alive):    # TokenEvent ... FinishEvent, as the engine produces them
    stream.cancel()                       # or loop.abort(rid): ends it at the next step boundary

Between two engine steps the loop takes its inbox (new requests, aborts), aborts requests whose
deadline passed, runs one `Engine.step()` and hands each event to its request's queue. So a cancel,
a disconnect or a deadline frees the request's slot and pages at the next step boundary, and no
handler ever touches engine state.

A step that raises (a device error, a bug) ends every admitted request with finish_reason "error"
and the exception's text; requests still waiting (no state yet) are kept. The loop then recovers:
`Engine.reset()` gives a fresh cache and empty allocators (the compiled steps stay) and serving
goes on. After `MAX_FAILED_STEPS` failures with no good step between them the loop stops serving
(state FAILED, health NOT_SERVING): every open request ends with "error" and new ones are refused.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import traceback
from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable, Iterator, NamedTuple

from v41_jax.runtime.engine import Engine
from v41_jax.runtime.request import Request, Result
from v41_jax.runtime.scheduler import Event, FinishEvent, TokenEvent

log = logging.getLogger("v41.serve")

MAX_FAILED_STEPS = 3                 # failed steps in a row before the loop gives up (FAILED)


class State(Enum):
    WARMING = "warming"              # compiling; requests are queued, not refused
    SERVING = "serving"
    DRAINING = "draining"            # shutting down: open requests finish, new ones are refused
    STOPPED = "stopped"
    FAILED = "failed"                # the engine kept failing: nothing is served


class Refused(Exception):
    """A request the server will not run. kind: "invalid" (a bad field: `field` names it),
    "exhausted" (it can never fit), "busy" (the server holds all it may; retry later),
    "unavailable" (not serving now)."""

    def __init__(self, kind: str, message: str, field: str | None = None):
        self.kind, self.message, self.field = kind, message, field
        super().__init__(f"{field}: {message}" if field else message)


@dataclass
class _Open:
    """One request the loop holds, from submit to its FinishEvent."""
    rid: Any
    req: Request
    events: queue.SimpleQueue
    submitted: float                  # time.perf_counter() at submit
    deadline: float | None            # time.perf_counter() after which it is aborted
    note: str | None = None           # why it was aborted, when the server did it
    reason: str | None = None         # the finish reason the client gets where the engine's differs
                                      # (a stop string ends the request by abort: "stop")
    first: float | None = None        # first and latest token arrival
    last: float | None = None
    tokens: int = 0
    drafted: int = 0                  # DSpark drafts its verify spans checked
    accepted: int = 0                 # of those, accepted by the target
    in_engine: bool = False


class Snapshot(NamedTuple):
    """The loop's state after its latest iteration (read from any thread)."""
    state: State
    open: int                 # requests submitted and not finished
    waiting: int              # in the inbox or the scheduler's queue
    running: int              # holding a slot
    free_pages: int
    quarantined_pages: int
    free_slots: int
    steps: int
    finished: int             # requests ended since start


@dataclass
class Timing:
    """What the loop measured of a finished request (handler side: the Final message)."""
    ttft_s: float
    tokens_per_s: float
    drafted: int
    accepted: int


class Stream:
    """A handler's end of one request."""

    def __init__(self, loop: "EngineLoop", op: _Open):
        self._loop, self._op = loop, op
        self.rid = op.rid
        self.prompt_len = len(op.req.prompt)

    def events(self, alive: Callable[[], bool] | None = None, poll_s: float = 0.1) -> Iterator[Event]:
        """The request's events up to and including its FinishEvent. `alive` (e.g. "the client is
        still connected") is asked every poll_s, whether events come or not (a whole-response
        handler writes nothing until the end, so only this notices a client gone mid-decode);
        once it says False the request is cancelled and the iteration ends without a FinishEvent."""
        asked = time.perf_counter()
        while True:
            try:
                ev = self._op.events.get(timeout=poll_s)
            except queue.Empty:
                ev = None
            if isinstance(ev, FinishEvent):
                yield ev
                return
            if alive is not None and (ev is None or time.perf_counter() - asked >= poll_s):
                asked = time.perf_counter()
                if not alive():
                    self.cancel("client disconnected")
                    return
            if ev is not None:
                yield ev

    def cancel(self, note: str = "cancelled") -> None:
        """Abort this request (not a later one that reuses its id: a gRPC call's end callback
        can run after its client has already sent the next request under the same id)."""
        self._loop.abort(self.rid, note, self._op)

    def stop(self) -> None:
        """End this request because a stop string matched: aborted in the engine, but finished
        with reason "stop" for the client, and so in the metrics (set before the abort is queued,
        so the loop thread reads it after)."""
        self._op.reason = "stop"
        self.cancel("stop string")

    def timing(self) -> Timing:
        """Valid once the FinishEvent came (the loop wrote these before queueing it)."""
        op = self._op
        ttft = op.first - op.submitted if op.first is not None else 0.0
        rate = (op.tokens - 1) / (op.last - op.first) if op.tokens > 1 and op.last > op.first else 0.0
        return Timing(ttft, rate, op.drafted, op.accepted)


class EngineLoop:
    """metrics: a `serving.metrics.Metrics` (or None). max_open: requests held at once (inbox,
    waiting and running); one more is refused "busy" rather than queued without bound."""

    def __init__(self, engine: Engine, *, metrics=None, max_open: int = 1024, warmup: bool = True,
                 status_every_s: float = 0.0, on_state: Callable[[State], None] | None = None):
        self.engine, self.metrics, self.max_open = engine, metrics, max_open
        self._warmup, self.status_every_s, self._on_state = warmup, status_every_s, on_state
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()           # guards _open and _state against submit/abort
        self._open: dict[Any, _Open] = {}       # by request id; the loop removes on finish
        self._state = State.WARMING
        self._stop = threading.Event()
        self._drained = threading.Event()
        self._failed_in_row = 0
        self._finished = 0
        self._snapshot = Snapshot(State.WARMING, 0, 0, 0, 0, 0, 0, 0, 0)
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    # ---- any thread ------------------------------------------------------------------------
    @property
    def state(self) -> State:
        return self._state

    def snapshot(self) -> Snapshot:
        return self._snapshot

    def start(self) -> None:
        self._thread.start()

    def submit(self, req: Request, timeout_s: float | None = None) -> Stream:
        """Queue a request (its request_id must be set, unique among open requests) -> its Stream.
        Raises Refused when the server is not taking requests or is full."""
        now = time.perf_counter()
        op = _Open(req.request_id, req, queue.SimpleQueue(), now, now + timeout_s if timeout_s else None)
        with self._lock:
            if self._state not in (State.WARMING, State.SERVING):
                raise Refused("unavailable", f"the server is {self._state.value}")
            if req.request_id in self._open:
                raise Refused("invalid", f"{req.request_id!r} is the id of a request still running",
                              "request_id")
            if len(self._open) >= self.max_open:
                raise Refused("busy", f"the server holds {self.max_open} requests, its limit; retry later")
            self._open[op.rid] = op
        self._inbox.put(("add", op))
        return Stream(self, op)

    def abort(self, rid, note: str = "aborted", op: _Open | None = None) -> bool:
        """End an open request at the next step boundary -> whether it was open (op: only if the
        open request under that id is this one)."""
        with self._lock:
            held = self._open.get(rid)
            if held is None or (op is not None and held is not op):
                return False
        self._inbox.put(("abort", rid, note, held))
        return True

    def call(self, fn: Callable[[Engine], Any], timeout: float | None = 30.0) -> Any:
        """fn(engine) run on the loop thread between two steps -> its result (tests, tools)."""
        done = queue.SimpleQueue()
        self._inbox.put(("call", fn, done))
        ok, value = done.get(timeout=timeout)
        if not ok:
            raise value
        return value

    def drain(self, timeout: float | None = None) -> bool:
        """Stop admitting, let open requests finish, then stop the loop -> True if all finished in
        time (the rest are aborted)."""
        with self._lock:
            if self._state in (State.WARMING, State.SERVING):
                self._set_state(State.DRAINING)
        self._inbox.put(("wake",))
        clean = self._drained.wait(timeout)
        if not clean:
            with self._lock:
                rids = list(self._open)
            for rid in rids:
                self.abort(rid, "the server is shutting down")
        self._stop.set()
        self._inbox.put(("wake",))
        self._thread.join(timeout=60)
        return clean

    # ---- the loop thread ------------------------------------------------------------------
    def _set_state(self, state: State) -> None:
        self._state = state
        if self._on_state is not None:
            self._on_state(state)

    def _run(self) -> None:
        if self._warmup:
            t0 = time.perf_counter()
            try:
                self.engine.warmup()
            except Exception as err:                    # noqa: BLE001 - the server reports it, not dies
                log.error("warm-up failed: %s", "".join(traceback.format_exception(err)))
                self._fail(f"warm-up failed: {type(err).__name__}: {err}")
            else:
                log.info("warm-up done in %.1f s", time.perf_counter() - t0)
        with self._lock:
            if self._state == State.WARMING:
                self._set_state(State.SERVING)
        last_status = time.perf_counter()
        while True:
            failed = self._state == State.FAILED
            try:
                self._take_inbox(block=failed or not self.engine.has_work)
                self._expire()
                if not failed and self.engine.has_work:
                    self._step()
                self._publish()
            except Exception as err:                    # noqa: BLE001 - a bug here must not strand clients
                log.error("engine loop: %s", "".join(traceback.format_exception(err)))
                self._fail(f"the engine loop failed: {type(err).__name__}: {err}")
            idle = self._state == State.FAILED or not self.engine.has_work
            if self._state in (State.DRAINING, State.FAILED) and not self._snapshot.open and idle:
                self._drained.set()
            if self._stop.is_set() and idle:
                break
            if self.status_every_s and time.perf_counter() - last_status >= self.status_every_s:
                last_status = time.perf_counter()
                self._log_status()
        if self._state != State.FAILED:
            self._set_state(State.STOPPED)
        self._publish()

    def _take_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            kind = item[0]
            if kind == "add":
                self._add(item[1])
            elif kind == "abort":
                if self._open.get(item[1]) is item[3]:      # still that request, not a successor
                    self._abort(item[1], item[2])
            elif kind == "call":
                try:
                    item[2].put((True, item[1](self.engine)))
                except Exception as err:                # noqa: BLE001 - handed to the caller
                    item[2].put((False, err))
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _add(self, op: _Open) -> None:
        if self._open.get(op.rid) is not op:            # ended while it sat in the inbox (and its id may be
            return                                      # open again, for a resubmission: not this request)
        if self._state == State.FAILED:
            self._finish_unadmitted(op, "error", "the engine is not serving (it failed repeatedly)")
            return
        try:
            self.engine.add(op.req)
        except Exception as err:                        # noqa: BLE001 - this request alone
            self._finish_unadmitted(op, "error", f"the engine refused it: {type(err).__name__}: {err}")
            return
        op.in_engine = True

    def _abort(self, rid, note: str) -> None:
        op = self._open.get(rid)
        if op is None:
            return
        op.note = op.note or note
        if op.in_engine:
            self.engine.abort(rid)                      # its FinishEvent comes with the next step's events
        else:
            self._finish_unadmitted(op, "abort", note)

    def _held(self) -> list[_Open]:
        """The open requests (a copy: handlers add to the dict meanwhile)."""
        with self._lock:
            return list(self._open.values())

    def _expire(self) -> None:
        now = time.perf_counter()
        for op in [o for o in self._held() if o.deadline is not None and now > o.deadline]:
            op.deadline = None
            self._abort(op.rid, "deadline exceeded")

    def _step(self) -> None:
        try:
            events = self.engine.step()
        except Exception as err:                        # noqa: BLE001 - one bad step must not kill the server
            self._step_failed(err)
            return
        self._failed_in_row = 0
        now = time.perf_counter()
        for ev in events:
            op = self._open.get(ev.rid)
            if op is None:
                continue
            if isinstance(ev, TokenEvent):
                self._on_tokens(op, ev, now)
            else:
                self._deliver_finish(op, ev)

    def _on_tokens(self, op: _Open, ev: TokenEvent, now: float) -> None:
        if self.metrics is not None:
            if op.first is None:
                self.metrics.ttft.observe(now - op.submitted)
                self.metrics.prompt_tokens.inc(len(op.req.prompt))
            else:
                self.metrics.itl.observe(now - op.last)
            self.metrics.add_tokens(len(ev.tokens))
            if ev.drafted:
                self.metrics.add_drafts(ev.drafted, ev.accepted)
        op.drafted += ev.drafted
        op.accepted += ev.accepted
        op.first = op.first if op.first is not None else now
        op.last = now
        op.tokens += len(ev.tokens)
        op.events.put(ev)

    def _deliver_finish(self, op: _Open, ev: FinishEvent) -> None:
        res = ev.result
        if res.finish_reason == "abort" and res.error is None:
            res.error = op.note
        if op.in_engine:
            self.engine.forget(op.rid)
        with self._lock:
            self._open.pop(op.rid, None)
        self._finished += 1
        if self.metrics is not None:
            self.metrics.finished.labels(op.reason or res.finish_reason).inc()
            self.metrics.latency.observe(time.perf_counter() - op.submitted)
        op.events.put(ev)

    def _finish_unadmitted(self, op: _Open, reason: str, error: str) -> None:
        res = Result(op.rid, len(op.req.prompt), finish_reason=reason, error=error)
        self._deliver_finish(op, FinishEvent(op.rid, res))

    def _step_failed(self, err: Exception) -> None:
        self._failed_in_row += 1
        msg = f"the engine step failed: {type(err).__name__}: {err}"
        log.error("%s\n%s", msg, "".join(traceback.format_exception(err)))
        if self.metrics is not None:
            self.metrics.step_failures.inc()
        sched = self.engine.scheduler
        waiting = [s.req for s in sched.waiting]        # never admitted: no state lost, run them later
        kept = {req.request_id for req in waiting}
        for op in self._held():
            if not op.in_engine or op.rid in kept:
                continue
            seq = sched.by_id.get(op.rid)
            if seq is not None and seq.done:            # aborted or finished, its event not delivered yet
                self._deliver_finish(op, FinishEvent(op.rid, seq.result))
            elif seq is not None:
                self.engine.abort(op.rid)               # ended in the scheduler; the reset below drops it
                seq.result.finish_reason, seq.result.error = "error", msg
                self._deliver_finish(op, FinishEvent(op.rid, seq.result))
            else:
                self._finish_unadmitted(op, "error", msg)
        if self._failed_in_row >= MAX_FAILED_STEPS:
            self._fail(f"{self._failed_in_row} engine steps failed in a row; the last: {msg}")
            return
        try:
            self.engine.reset()
        except Exception as reset_err:                  # noqa: BLE001
            self._fail(f"{msg}; then the reset failed: {type(reset_err).__name__}: {reset_err}")
            return
        log.warning("engine reset after a failed step: %d waiting requests resubmitted", len(waiting))
        for req in waiting:
            self.engine.add(req)

    def _fail(self, why: str) -> None:
        log.error("not serving: %s", why)
        with self._lock:
            self._set_state(State.FAILED)
        self._fail_open(why)

    def _fail_open(self, why: str) -> None:
        for op in self._held():
            try:
                if op.in_engine:
                    self.engine.abort(op.rid)           # still waiting or running: ended, so forgettable
                self._finish_unadmitted(op, "error", why)
            except Exception:                           # noqa: BLE001 - one request must not strand the rest
                log.exception("failing request %r", op.rid)
                op.in_engine = False                    # deliver its end without the engine
                self._finish_unadmitted(op, "error", why)

    def _publish(self) -> None:
        e = self.engine
        sched = e.scheduler
        held = self._held()
        s = Snapshot(self._state, len(held), sum(not o.in_engine for o in held) + len(sched.waiting),
                     len(sched.running), e.pages.available, e.pages.quarantined,
                     e.slots.available, e.steps, self._finished)
        self._snapshot = s
        if self.metrics is not None:
            self.metrics.publish(s)

    def _log_status(self) -> None:
        s = self._snapshot
        rate = self.metrics.tokens_per_s() if self.metrics is not None else 0.0
        log.info("status: %s, %d finished, %d running, %d waiting, %.1f tokens/s, free pages %d/%d, "
                 "free slots %d/%d", s.state.value, s.finished, s.running, s.waiting, rate, s.free_pages,
                 self.engine.geom.settings.num_pages - 1, s.free_slots, self.engine.geom.settings.slots)
