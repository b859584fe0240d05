"""Prometheus metrics of one server (its own registry, so several servers live in one process).

The engine loop updates them (serving/loop.py); `/metrics` renders `render()`.
"""

from __future__ import annotations

import threading
import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Latency buckets in seconds: a CPU-hosted tiny model steps in tens of ms, a GPU model in ms.
_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# A whole request's: long generations run minutes (4K tokens at 30 tokens/s is over 2)
_REQUEST_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
RATE_WINDOW_S = 10.0                 # tokens/s is measured over this trailing window
RATE_SAMPLE_S = 0.25                 # at most one (time, count) sample per this: the window holds <= 41


class Metrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        p = "v41_"
        self.queue = Gauge(p + "queue_length", "requests waiting for a slot and pages", registry=r)
        self.running = Gauge(p + "running_requests", "requests holding a slot", registry=r)
        self.free_pages = Gauge(p + "free_pages", "cache pages free to allocate", registry=r)
        self.free_slots = Gauge(p + "free_slots", "STATE slots free", registry=r)
        self.serving = Gauge(p + "serving", "1 while the engine serves, 0 while warming, draining or failed",
                             registry=r)
        self.tokens = Counter(p + "generated_tokens", "tokens generated", registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "prompt tokens prefilled (counted at a request's first token)",
                                     registry=r)
        self.rate = Gauge(p + "tokens_per_second", f"tokens generated per second over the last {RATE_WINDOW_S:g} s",
                          registry=r)
        self.finished = Counter(p + "requests_finished", "requests ended, by finish reason", ["reason"], registry=r)
        self.refused = Counter(p + "requests_refused", "requests refused before the engine, by kind (invalid, "
                               "exhausted, busy, unavailable, unauthenticated, connections: over the connection limit)", ["kind"], registry=r)
        self.step_failures = Counter(p + "engine_step_failures", "engine steps that raised", registry=r)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "submission to first token", buckets=_BUCKETS,
                              registry=r)
        self.latency = Histogram(p + "request_latency_seconds", "submission to finish, whatever the reason",
                                 buckets=_REQUEST_BUCKETS, registry=r)
        self.itl = Histogram(p + "inter_token_latency_seconds", "between a request's consecutive token arrivals",
                             buckets=_BUCKETS, registry=r)
        # DSpark speculative decoding (0 while nothing speculates)
        self.draft_tokens = Counter(p + "dspark_draft_tokens", "tokens proposed by DSpark draft stages", registry=r)
        self.accepted_tokens = Counter(p + "dspark_accepted_tokens", "draft tokens the target accepted",
                                       registry=r)
        self.acceptance = Gauge(p + "dspark_acceptance_rate",
                                "accepted / drafted tokens since start (0 with no drafts)",
                                registry=r)
        self._lock = threading.Lock()
        self._generated = 0
        self._drafted = self._accepted = 0
        self._window: deque[tuple[float, float]] = deque()   # (time, tokens counter value)

    def publish(self, snap) -> None:
        """The loop's latest `Snapshot`."""
        self.queue.set(snap.waiting)
        self.running.set(snap.running)
        self.free_pages.set(snap.free_pages)
        self.free_slots.set(snap.free_slots)
        self.serving.set(1 if snap.state.value == "serving" else 0)
        self.rate.set(self.tokens_per_s())

    def add_drafts(self, proposed: int, accepted: int) -> None:
        self.draft_tokens.inc(proposed)
        self.accepted_tokens.inc(accepted)
        with self._lock:
            self._drafted += proposed
            self._accepted += accepted
            rate = self._accepted / self._drafted if self._drafted else 0.0
        self.acceptance.set(rate)

    def add_tokens(self, n: int) -> None:
        self.tokens.inc(n)
        with self._lock:
            self._generated += n

    def tokens_per_s(self) -> float:
        now = time.monotonic()
        with self._lock:
            total = self._generated
            w = self._window
            # the loop publishes after every step (tens a second): sampling each would hold a
            # window of hundreds of tuples whose number follows the step rate; one per RATE_SAMPLE_S
            # bounds it by RATE_WINDOW_S / RATE_SAMPLE_S + 1 whatever the load
            if not w or now - w[-1][0] >= RATE_SAMPLE_S:
                w.append((now, total))
            while len(w) > 1 and now - w[0][0] > RATE_WINDOW_S:
                w.popleft()
            t0, n0 = w[0]
        return (total - n0) / (now - t0) if now > t0 else 0.0

    def render(self) -> bytes:
        return generate_latest(self.registry)
