"""Serving under load: many concurrent clients over gRPC and HTTP against one in-process server,
some cancelling mid-stream, some sending malformed requests; every completed request checked
token for token against offline generate.

    python -m scripts.bench_serving --checkpoint DIR [--requests 10000] [--concurrency 64] \\
        [--cancel 0.1] [--malformed 0.05] [engine flags as v41-serve] [--json OUT]

Random prompt lengths (1..--max-prompt) and output lengths (1..--max-new), a third greedy and the
rest sampled with their own seeds, half of them over each protocol. The offline references are
generated first on the same engine (before the server owns it). Reported: throughput, client-side
TTFT and inter-token latency p50/p99, the process's resident memory after warm-up (the first 10 %
of requests) and at the end (server and clients: the clients' `Outcome`s, ~0.9 KB a request, are
in it; the server's heap bound is tests/test_serving_memory.py's), and the checks: mismatches,
unexpected errors, engine errors (stale-state refusals among them), pages / slots / request
records left after the load drains.
Exit code 1 if a check fails. tests/test_serving_load.py runs a small version of this in CI.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

import numpy as np

from v41_jax.runtime.request import Request
from v41_jax.runtime.sampling import SamplingParams

SAMPLING = ("temperature", "top_k", "top_p", "seed")
# request_parse field -> OpenAI completions field
HTTP_NAMES = {"max_new_tokens": "max_tokens", "stop_ids": "stop_token_ids", "prompt_ids": "prompt"}


def random_requests(rng, n: int, vocab: int, max_prompt: int = 40, max_new: int = 16) -> list[dict]:
    """Random prompts and output lengths (request_parse fields); a third greedy, the rest sampled
    with their own seeds; 70 % ignore EOS."""
    out = []
    for i in range(n):
        f = {"prompt_ids": rng.integers(3, vocab, int(rng.integers(1, max_prompt + 1))).tolist(),
             "max_new_tokens": int(rng.integers(1, max_new + 1)), "ignore_eos": bool(rng.random() < 0.7)}
        if i % 3:
            f.update(temperature=float(rng.choice([0.7, 1.0])), seed=int(rng.integers(0, 2 ** 32)),
                     top_k=int(rng.choice([0, 50])), top_p=float(rng.choice([1.0, 0.9])))
        out.append(f)
    return out


def to_request(fields: dict, rid) -> Request:
    """Request fields -> the Request offline generate runs for them."""
    return Request(list(fields["prompt_ids"]), fields["max_new_tokens"],
                   SamplingParams(**{k: fields[k] for k in SAMPLING if k in fields}),
                   tuple(fields.get("stop_ids", ())), fields.get("ignore_eos", False), rid,
                   logprobs=fields.get("logprobs", False), speculative=fields.get("speculative"))


def http_body(fields: dict) -> dict:
    return {HTTP_NAMES.get(k, k): v for k, v in fields.items()}


# Malformed requests: (gRPC fields, HTTP body) and the field each refusal must name.
MALFORMED = [
    ({"prompt_ids": [1, 10 ** 6]}, {"prompt": [1, 10 ** 6]}, ("prompt_ids", "prompt")),
    ({"prompt_ids": [1], "max_new_tokens": -3}, {"prompt": [1], "max_tokens": -3}, ("max_new_tokens", "max_tokens")),
    ({"prompt_ids": [1], "temperature": -1.0}, {"prompt": [1], "temperature": -1}, ("temperature", "temperature")),
    ({"prompt_ids": [1], "top_p": 2.0}, {"prompt": [1], "top_p": 2}, ("top_p", "top_p")),
    ({"prompt_ids": [1], "speculative": True}, {"prompt": [1], "bogus": 1}, ("speculative", "bogus")),
]


@dataclass
class Outcome:
    kind: str                       # full / cancel / malformed
    proto: str
    ok: bool = False                # did what it should (matched, cancelled, refused naming the field)
    tokens: list[int] = field(default_factory=list)
    finish: str = ""
    error: str = ""
    sent: float = 0.0
    arrivals: list[float] = field(default_factory=list)


def _grpc(stub, fields: dict, rid: str, cancel_after: int | None, out: Outcome):
    from serving.proto import v41_pb2

    call = stub.Generate(v41_pb2.GenerateRequest(request_id=rid, **fields))
    for msg in call:
        if msg.HasField("final"):
            out.finish = v41_pb2.FinishReason.Name(msg.final.finish_reason).lower()
            out.error = msg.final.error
            return
        out.tokens += msg.chunk.token_ids
        out.arrivals.append(time.perf_counter())
        if cancel_after is not None and len(out.tokens) >= cancel_after:
            call.cancel()
            out.finish = "cancelled"
            return


def _http(port: int, fields: dict, cancel_after: int | None, out: Outcome):
    from serving.client import sse_events

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(dict(http_body(fields), stream=True)),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            out.error = f"HTTP {resp.status}: {resp.read()[:200]!r}"
            return
        for ev in sse_events(resp):
            if "error" in ev:
                out.finish, out.error = "error", ev["error"]["message"]
                continue
            c = ev["choices"][0]
            if c["token_ids"]:
                out.tokens += c["token_ids"]
                out.arrivals.append(time.perf_counter())
            if c["finish_reason"]:
                out.finish = c["finish_reason"]
            if cancel_after is not None and len(out.tokens) >= cancel_after and not c["finish_reason"]:
                conn.sock.shutdown(2)               # the client goes away mid-stream
                out.finish = "cancelled"
                return
    finally:
        conn.close()


def _malformed(stub, port: int, case, proto: str, out: Outcome):
    import grpc

    grpc_fields, body, (grpc_field, http_field) = case
    if proto == "grpc":
        try:
            _grpc(stub, grpc_fields, f"bad-{id(out)}", None, out)
            out.error = "accepted"
        except grpc.RpcError as err:
            out.ok = err.code() == grpc.StatusCode.INVALID_ARGUMENT and err.details().startswith(grpc_field + ":")
            out.error = f"{err.code().name}: {err.details()}"
        return
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        reply = json.loads(resp.read())
        out.ok = resp.status == 400 and reply["error"]["param"] == http_field
        out.error = json.dumps(reply)[:200]
    finally:
        conn.close()


@dataclass
class Report:
    requests: int
    concurrency: int
    full: int = 0
    cancelled: int = 0
    malformed: int = 0
    failed: list[str] = field(default_factory=list)        # what went wrong, one line per request
    engine_errors: int = 0          # requests the engine ended "error" (a stale-state refusal is one)
    wall_s: float = 0.0
    tokens: int = 0
    tokens_per_s: float = 0.0
    requests_per_s: float = 0.0
    ttft_ms: dict = field(default_factory=dict)
    itl_ms: dict = field(default_factory=dict)
    rss_mib_warm: float = 0.0       # server process RSS after the first 10 % of requests
    rss_mib_end: float = 0.0
    left: dict = field(default_factory=dict)               # allocator and record counts after draining

    @property
    def clean(self) -> bool:
        return not self.failed and not self.engine_errors and self.left.get("leaks") == 0


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20


def _pct(values) -> dict:
    if not len(values):
        return {}
    p50, p99 = np.percentile(np.asarray(values) * 1e3, [50, 99])
    return {"p50": round(float(p50), 2), "p99": round(float(p99), 2)}


def run_load(server, requests: list[dict], refs: list[list[int]], *, concurrency: int = 64,
             cancel: float = 0.1, malformed: float = 0.05, seed: int = 0, log=None) -> Report:
    """Drive `server` (a started, ready serving.server.Server) with `requests` (request_parse
    fields; refs[i]: offline generate's tokens for requests[i]) from `concurrency` client threads."""
    from serving.proto import v41_pb2_grpc
    import grpc

    rng = np.random.default_rng(seed)
    n = len(requests)
    kinds = rng.choice(["full", "cancel", "malformed"], n, p=[1 - cancel - malformed, cancel, malformed])
    protos = np.where(np.arange(n) % 2 == 0, "grpc", "http")
    rep = Report(n, concurrency)
    channel = grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}")
    stub = v41_pb2_grpc.GenerationStub(channel)
    outcomes: list[Outcome | None] = [None] * n
    done = [0]
    lock = threading.Lock()
    warm_at = max(1, n // 10)

    def one(i: int):
        kind, proto, fields = str(kinds[i]), str(protos[i]), requests[i]
        out = Outcome(kind, proto, sent=time.perf_counter())
        try:
            if kind == "malformed":
                _malformed(stub, server.http_port, MALFORMED[i % len(MALFORMED)], proto, out)
            else:
                budget = len(refs[i])
                cancel_after = int(rng_i(i).integers(1, budget)) if kind == "cancel" and budget > 1 else None
                if proto == "grpc":
                    _grpc(stub, fields, f"load-{i}", cancel_after, out)
                else:
                    _http(server.http_port, fields, cancel_after, out)
                if out.finish == "cancelled":
                    out.ok = out.tokens == refs[i][:len(out.tokens)]
                else:
                    out.ok = out.tokens == refs[i] and out.finish in ("length", "eos", "stop")
        except Exception as err:                     # noqa: BLE001 - a client failure is a result
            out.error = f"{type(err).__name__}: {err}"
        outcomes[i] = out
        with lock:
            done[0] += 1
            if done[0] == warm_at:
                rep.rss_mib_warm = _rss_mib()
            if log and done[0] % max(1, n // 20) == 0:
                log(f"{done[0]}/{n} requests, {server.loop.snapshot().free_pages} free pages")

    def rng_i(i):
        return np.random.default_rng([seed, i])

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, range(n)))
    rep.wall_s = time.perf_counter() - t0
    channel.close()
    ttft, itl = [], []
    for i, out in enumerate(outcomes):
        rep.full += out.kind == "full"
        rep.cancelled += out.kind == "cancel"
        rep.malformed += out.kind == "malformed"
        rep.tokens += len(out.tokens)
        rep.engine_errors += out.finish == "error"
        if not out.ok:
            rep.failed.append(f"request {i} ({out.kind}, {out.proto}): finish {out.finish!r}, error {out.error!r}, "
                              f"{len(out.tokens)} tokens")
        if out.arrivals:
            ttft.append(out.arrivals[0] - out.sent)
            itl += list(np.diff(out.arrivals))
    rep.tokens_per_s = rep.tokens / rep.wall_s
    rep.requests_per_s = n / rep.wall_s
    rep.ttft_ms, rep.itl_ms = _pct(ttft), _pct(itl)
    rep.left = leftovers(server)
    rep.rss_mib_end = _rss_mib()
    return rep


def leftovers(server, timeout: float = 120.0) -> dict:
    """Once the load drained: pages and slots not back in their allocators, requests still held by
    the loop, request records left in the scheduler (0 each when nothing leaked)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if server.loop.snapshot().open == 0 and server.loop.call(lambda e: not e.has_work):
            break
        time.sleep(0.05)
    s = server.loop.engine.geom.settings

    def count(e):
        sched = e.scheduler
        return {"pages": s.num_pages - 1 - e.pages.available, "slots": s.slots - e.slots.available,
                "open": server.loop.snapshot().open, "records": len(sched.by_id),
                "queued": len(sched.waiting) + len(sched.running)}
    left = server.loop.call(count)
    left["leaks"] = sum(left.values())
    return left


def build_parser() -> argparse.ArgumentParser:
    from serving.server import build_parser as serve_parser

    ap = argparse.ArgumentParser(prog="python -m scripts.bench_serving", description=__doc__.split("\n\n")[0],
                                 parents=[serve_parser()], add_help=False, conflict_handler="resolve")
    ap.add_argument("--requests", type=int, default=10000)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--cancel", type=float, default=0.1, help="fraction cancelled mid-stream")
    ap.add_argument("--malformed", type=float, default=0.05, help="fraction malformed")
    ap.add_argument("--max-prompt", type=int, default=40)
    ap.add_argument("--max-new", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the report here")
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    import logging

    from serving.api import Limits
    from serving.server import Server, load_engine

    logging.basicConfig(level=logging.WARNING, force=True)
    say = lambda msg: print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)
    engine = load_engine(args)
    say(f"warm-up: {engine.warmup():.1f} s compiling")
    rng = np.random.default_rng(args.seed)
    requests = random_requests(rng, args.requests, engine.cfg.vocab_size, args.max_prompt, args.max_new)
    t0 = time.perf_counter()
    refs = [r.tokens for r in engine.generate([to_request(f, f"ref-{i}") for i, f in enumerate(requests)])]
    engine.reset()
    say(f"offline references: {time.perf_counter() - t0:.1f} s")
    limits = Limits(max_open=max(1024, args.concurrency * 2), max_streams=max(256, args.concurrency * 2))
    server = Server(engine, limits=limits, warmup=False).start()
    server.wait_ready()
    rep = run_load(server, requests, refs, concurrency=args.concurrency, cancel=args.cancel,
                   malformed=args.malformed, seed=args.seed, log=say)
    server.shutdown(60)
    summary = {k: v for k, v in asdict(rep).items() if k != "failed"}
    summary.update(failed=len(rep.failed), first_failures=rep.failed[:10], clean=rep.clean)
    print(json.dumps(summary, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    return 0 if rep.clean else 1


if __name__ == "__main__":
    sys.exit(main())
