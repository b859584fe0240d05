"""Shared by the serving tests: the tiny checkpoint with a WordLevel tokenizer, engines in the test
geometry (tests/engine_common.py, so the compiled steps come from the shared cache), and small
clients over loopback sockets."""

from __future__ import annotations

import http.client
import json
import time

import grpc

from tests.engine_common import SETTINGS, build_model, make_engine
from scripts.bench_serving import http_body, to_request
from serving.client import sse_events
from serving.proto import v41_pb2, v41_pb2_grpc

ENGINE_FLAGS = ["--numerics", "fp32", "--buckets", "80x4x80", "--chunk", "16", "--page-tokens",
                str(SETTINGS.page_tokens), "--pages", str(SETTINGS.num_pages), "--slots", str(SETTINGS.slots),
                "--max-context", str(SETTINGS.max_context), "--speculative", "off"]


def word_tokenizer(vocab_size: int):
    """"w<i>" is token i (whitespace-split words; anything else is w0)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tok


def tok_model(tmp_path_factory):
    """(checkpoint folder with tokenizer.json, (cfg, params, token_map), tokenizer)."""
    path = tmp_path_factory.mktemp("tiny_serving")
    cfg, params, token_map = build_model(path, "tiny", seed=0)
    tok = word_tokenizer(cfg.vocab_size)
    tok.save(str(path / "tokenizer.json"))
    return path, (cfg, params, token_map), tok


def engine_for(model, **kw):
    _, (cfg, params, token_map), tok = model
    return make_engine(cfg, params, token_map, prefill_chunk=16, tokenizer=tok, **kw)


def offline(engine, requests: dict) -> dict:
    """name -> offline generate's Result for each request's fields (the engine left reset)."""
    names = list(requests)
    results = engine.generate([to_request(requests[n], f"ref-{i}") for i, n in enumerate(names)])
    engine.reset()
    return dict(zip(names, results))


# ---- gRPC ----------------------------------------------------------------------------------------
def stub(port: int):
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    return v41_pb2_grpc.GenerationStub(channel), channel


def grpc_generate(stub_, fields: dict, **call_kw) -> tuple[list[int], v41_pb2.Final, str]:
    """-> (tokens, the Final, the streamed text)."""
    tokens, text = [], []
    for msg in stub_.Generate(v41_pb2.GenerateRequest(**fields), **call_kw):
        if msg.HasField("final"):
            return tokens, msg.final, "".join(text) + msg.final.text
        tokens += msg.chunk.token_ids
        text.append(msg.chunk.text)
    raise AssertionError("the stream ended without a Final")


# ---- HTTP ----------------------------------------------------------------------------------------
def http_call(port: int, method: str, path: str, body=None, headers=None, raw: bytes | None = None,
              timeout: float = 120):
    """-> (status, decoded JSON or text, headers)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        hdrs = {"Content-Type": "application/json"} if data is not None else {}
        hdrs.update(headers or {})
        conn.request(method, path, body=data, headers=hdrs)
        resp = conn.getresponse()
        payload = resp.read()
        ctype = resp.getheader("Content-Type", "")
        return resp.status, json.loads(payload) if "json" in ctype else payload.decode(), dict(resp.getheaders())
    finally:
        conn.close()


def http_generate(port: int, fields: dict, stream: bool, path: str = "/v1/completions", headers=None):
    """-> (tokens, finish_reason, text) through the HTTP endpoint."""
    body = dict(http_body(fields), stream=stream)
    if not stream:
        status, out, _ = http_call(port, "POST", path, body, headers)
        assert status == 200, out
        c = out["choices"][0]
        return c["token_ids"], c["finish_reason"], c.get("text", c.get("message", {}).get("content"))
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json",
                                                                   **(headers or {})})
        resp = conn.getresponse()
        assert resp.status == 200, resp.read()
        tokens, text, reason = [], [], None
        for ev in sse_events(resp):
            assert "error" not in ev, ev
            c = ev["choices"][0]
            tokens += c["token_ids"]
            text.append(c.get("text", c.get("delta", {}).get("content", "")) or "")
            reason = c["finish_reason"] or reason
        return tokens, reason, "".join(text)
    finally:
        conn.close()


def wait_for(cond, timeout: float = 60.0, every: float = 0.01):
    """Poll cond() until it is truthy -> its value; AssertionError after timeout."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = cond()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout} s waiting for {cond}")


def assert_idle_and_empty(server, timeout: float = 60.0) -> None:
    """Every request finished, the engine idle, every page and slot back in its allocator (none
    quarantined), the scheduler's invariants hold. Read on the loop thread."""
    s = SETTINGS
    wait_for(lambda: server.loop.snapshot().open == 0 and server.loop.call(lambda e: not e.has_work), timeout)
    counts = server.loop.call(lambda e: (e.pages.available, e.pages.quarantined, e.slots.available,
                                         len(e.scheduler.running), len(e.scheduler.waiting)))
    assert counts == (s.num_pages - 1, 0, s.slots, 0, 0), counts
    server.loop.call(lambda e: e.scheduler.check_invariants(s.num_pages, s.slots))
