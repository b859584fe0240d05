"""The servers over real loopback sockets, on the tiny checkpoint with a WordLevel tokenizer:
health while warming and after, reflection, concurrent gRPC and HTTP streams equal to offline
generate token for token, the `openai` client, malformed requests (refused naming the field, the
server serving on), stop strings, cancel / disconnect / Abort / deadline mid-prefill and mid-decode
with every page and slot back, requests that can never fit, the API key, a fault injected into an
engine step (recovery) and repeated faults (NOT_SERVING), metrics, and SIGTERM under load (a
`python -m serving.server` process drains and exits 0)."""

from __future__ import annotations

import http.client
import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from scripts.bench_serving import random_requests
from serving import grpc_server, http_server
from serving.api import BYTE_LEVEL, Job, Limits, TextStream, chat_prompt, token_bytes
from serving.client import sse_events
from serving.loop import State
from serving.metrics import Metrics
from serving.proto import v41_pb2
from serving.server import Server
from tests.engine_common import ROOT, SETTINGS, SUITE_CACHE
from tests.serving_common import (ENGINE_FLAGS, assert_idle_and_empty, engine_for, grpc_generate, http_call,
                                  http_body, http_generate, offline, stub, tok_model, wait_for)
from v41_jax.runtime.request import Request

LIMITS = Limits(max_prompt_tokens=100, max_new_tokens=64, max_message_bytes=64 << 10)
LONG = list(range(10, 110))                        # a 100-token prompt: 7 prefill steps of 16 rows
MIX = {f"mix{i}": f for i, f in enumerate(random_requests(np.random.default_rng(1), 8, 512))}
COMPARED = {
    **MIX,
    "warm": {"prompt_ids": [7, 8, 9, 10], "max_new_tokens": 6, "ignore_eos": True},
    "greedy": {"prompt_ids": [5, 6, 7, 8, 9], "max_new_tokens": 12, "ignore_eos": True},
    "sampled": {"prompt_ids": [11, 12, 13], "max_new_tokens": 10, "temperature": 0.9, "seed": 3, "top_k": 40,
                "ignore_eos": True},
    "after_fault": {"prompt_ids": [21, 22, 23, 24, 25, 26], "max_new_tokens": 8, "ignore_eos": True},
    **{f"term{i}": {"prompt_ids": [30 + i, 40 + i, 50 + i], "max_new_tokens": 40, "ignore_eos": True,
                    "temperature": 0.8, "seed": i} for i in range(4)},
}
MESSAGES = [{"role": "system", "content": "w9 w8"}, {"role": "user", "content": "w5 w6 w7"}]


@dataclass
class Served:
    server: Server
    engine: object
    refs: dict                   # name -> offline Result
    stub: object
    channel: object
    tokenizer: object
    warming: dict                # what the fixture saw while the engine warmed up

    @property
    def port(self) -> int:
        return self.server.http_port

    def tokens(self, name):
        return self.refs[name].tokens


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tok_model(tmp_path_factory)


@pytest.fixture(scope="module")
def served(model):
    """The module's server. Its warm-up waits for a gate, so that health while warming and a
    request queued meanwhile are observed here (asserted by the first test)."""
    engine = engine_for(model)
    engine.warmup()
    tok = model[2]
    chat = {"prompt_ids": tok.encode(chat_prompt(MESSAGES)).ids, "max_new_tokens": 7, "ignore_eos": True}
    compared = dict(COMPARED, chat=chat, chat_lp={**chat, "logprobs": True},
                    sampled_lp={**COMPARED["sampled"], "logprobs": True})
    refs = offline(engine, compared)          # before the server owns the engine
    gate, real = threading.Event(), engine.warmup
    engine.warmup = lambda: gate.wait(300) and real()
    server = Server(engine, model_name="tiny", limits=LIMITS).start()
    st, channel = stub(server.grpc_port)
    health = health_pb2_grpc.HealthStub(channel)
    seen = {"grpc": health.Check(health_pb2.HealthCheckRequest(service="v41.Generation")).status,
            "http": http_call(server.http_port, "GET", "/health")[:2]}
    with ThreadPoolExecutor(1) as pool:
        queued = pool.submit(grpc_generate, st, COMPARED["warm"])
        time.sleep(0.5)
        seen["queued_done_while_warming"] = queued.done()
        gate.set()
        assert server.wait_ready(300)
        seen["queued_tokens"] = queued.result(timeout=300)[0]
    seen["grpc_after"] = health.Check(health_pb2.HealthCheckRequest(service="")).status
    seen["http_after"] = http_call(server.http_port, "GET", "/health")[:2]
    yield Served(server, engine, refs, st, channel, tok, seen)
    channel.close()
    assert server.shutdown(30)


def _count(served, reason: str) -> float:
    return served.server.metrics.registry.get_sample_value("v41_requests_finished_total", {"reason": reason}) or 0.0


def test_health_warming_then_serving(served):
    w = served.warming
    assert w["grpc"] == health_pb2.HealthCheckResponse.NOT_SERVING
    assert w["http"] == (503, {"status": "warming"})
    assert not w["queued_done_while_warming"]              # queued, not refused, not run
    assert w["queued_tokens"] == served.tokens("warm")
    assert w["grpc_after"] == health_pb2.HealthCheckResponse.SERVING
    assert w["http_after"] == (200, {"status": "serving"})


def test_reflection_lists_services(served):
    stub_ = reflection_pb2_grpc.ServerReflectionStub(served.channel)
    reply = next(stub_.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    names = {s.name for s in reply.list_services_response.service}
    assert {"v41.Generation", "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= names
    # and the service's schema through reflection (what grpcurl uses)
    req = reflection_pb2.ServerReflectionRequest(file_containing_symbol="v41.Generation")
    reply = next(stub_.ServerReflectionInfo(iter([req])))
    assert reply.file_descriptor_response.file_descriptor_proto


def test_concurrent_grpc_and_http_equal_offline(served):
    """Eight requests at once, over gRPC, HTTP streaming and HTTP whole, in flight together."""
    ways = [lambda f: grpc_generate(served.stub, f)[0],
            lambda f: http_generate(served.port, f, stream=True)[0],
            lambda f: http_generate(served.port, f, stream=False)[0]]
    with ThreadPoolExecutor(len(MIX)) as pool:
        futs = {n: pool.submit(ways[i % 3], f) for i, (n, f) in enumerate(MIX.items())}
        got = {n: f.result(timeout=300) for n, f in futs.items()}
    for n in MIX:
        assert got[n] == served.tokens(n), n
    assert_idle_and_empty(served.server)


def test_grpc_final_and_text(served):
    tokens, final, text = grpc_generate(served.stub, COMPARED["sampled"])
    want = served.tokens("sampled")
    assert tokens == want and final.finish_reason == v41_pb2.LENGTH
    assert text == served.tokenizer.decode(want)
    assert (final.prompt_tokens, final.completion_tokens) == (3, len(want))
    assert final.ttft_s > 0 and final.tokens_per_s > 0
    assert (final.draft_tokens, final.accepted_tokens, final.acceptance_rate) == (0, 0, 0.0)
    info = served.stub.GetModelInfo(v41_pb2.ModelInfoRequest())
    assert (info.model, info.vocab_size, info.max_prompt_tokens, info.max_new_tokens) == ("tiny", 512, 100, 64)
    assert info.tokenizer and not info.speculative and info.pages == SETTINGS.num_pages - 1


def test_openai_client(served):
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{served.port}/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["tiny"] and client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("gpt-4")
    assert err.value.body["code"] == "model_not_found"
    assert http_call(served.port, "GET", "/v1/models/t%69ny")[0] == 200        # %-quoted: the same name
    decode = served.tokenizer.decode
    for name in ("greedy", "sampled"):
        f, want = COMPARED[name], served.tokens(name)
        kw = dict(model="tiny", prompt=f["prompt_ids"], max_tokens=f["max_new_tokens"],
                  extra_body={"ignore_eos": True, **({"top_k": f["top_k"]} if "top_k" in f else {})},
                  **({"temperature": f["temperature"], "seed": f["seed"]} if "seed" in f else {}))
        whole = client.completions.create(**kw)
        assert whole.choices[0].token_ids == want and whole.choices[0].text == decode(want)
        assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == len(want)
        chunks = list(client.completions.create(stream=True, **kw))
        assert [t for c in chunks for t in c.choices[0].token_ids] == want
        assert "".join(c.choices[0].text for c in chunks) == decode(want)
        assert chunks[-1].choices[0].finish_reason == "length"
    want = served.tokens("chat")
    kw = dict(model="tiny", messages=MESSAGES, max_tokens=7, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kw)
    assert whole.choices[0].message.content == decode(want) and whole.choices[0].token_ids == want
    assert whole.choices[0].message.role == "assistant"
    # the unimplemented fields at their neutral values, as some clients send every default: served alike
    neutral = dict(frequency_penalty=0, presence_penalty=0.0, logit_bias={}, extra_body={"ignore_eos": True,
                                                                                        "repetition_penalty": 1, "min_p": 0})
    assert client.chat.completions.create(**{**kw, **neutral}, response_format={"type": "text"}).choices[0].token_ids == want
    f = COMPARED["greedy"]
    assert client.completions.create(model="tiny", prompt=f["prompt_ids"], max_tokens=f["max_new_tokens"], echo=False,
                                     best_of=1, **neutral).choices[0].token_ids == served.tokens("greedy")
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == decode(want)
    assert chunks[-1].usage.completion_tokens == len(want) and not chunks[-1].choices
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tiny", prompt=[1, 2], max_tokens=-1)
    assert err.value.body["param"] == "max_tokens"


def test_openai_client_logprobs(served):
    """The sampled tokens' log-probabilities, equal to offline generate's (JSON carries a float's
    repr, so equal to the bit), whole and streamed, completions and chat."""
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{served.port}/v1", api_key="unused", max_retries=0)
    f, ref = COMPARED["sampled"], served.refs["sampled_lp"]
    assert ref.tokens == served.tokens("sampled") and len(ref.logprobs) == len(ref.tokens)
    kw = dict(model="tiny", prompt=f["prompt_ids"], max_tokens=f["max_new_tokens"], temperature=f["temperature"],
              seed=f["seed"], logprobs=0, extra_body={"ignore_eos": True, "top_k": f["top_k"]})
    whole = client.completions.create(**kw).choices[0]
    assert whole.token_ids == ref.tokens and whole.logprobs.token_logprobs == ref.logprobs
    assert whole.logprobs.tokens == [served.tokenizer.decode([t]) for t in ref.tokens]
    chunks = list(client.completions.create(stream=True, **kw))
    assert [lp for c in chunks for lp in (c.choices[0].logprobs.token_logprobs if c.choices[0].logprobs else [])] \
        == ref.logprobs
    assert client.completions.create(**{**kw, "logprobs": None}).choices[0].logprobs is None
    ref = served.refs["chat_lp"]
    kw = dict(model="tiny", messages=MESSAGES, max_tokens=7, logprobs=True, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kw).choices[0]
    assert [c.logprob for c in whole.logprobs.content] == ref.logprobs and whole.token_ids == ref.tokens
    streamed = [c.logprob for ch in client.chat.completions.create(stream=True, **kw)
                if ch.choices and ch.choices[0].logprobs for c in ch.choices[0].logprobs.content]
    assert streamed == ref.logprobs
    # alternatives are not computed: asking for them is refused, naming the field
    for call, extra, field in ((client.completions.create, dict(prompt=[1, 2], logprobs=2), "logprobs"),
                               (client.chat.completions.create, dict(messages=MESSAGES, logprobs=True,
                                                                     top_logprobs=3), "top_logprobs")):
        with pytest.raises(openai.BadRequestError) as err:
            call(model="tiny", max_tokens=2, **extra)
        assert err.value.body["param"] == field and "top alternatives" in err.value.body["message"]


# body (dict, or raw bytes), path, content type -> the status and the field the refusal names
HTTP_BAD = [
    (b'{"prompt": [1, 2', "/v1/completions", "application/json", 400, "json"),
    (b'{"prompt": [1, 2], "temperature": NaN}', "/v1/completions", "application/json", 400, "json"),
    (b'[1, 2]', "/v1/completions", "application/json", 400, "body"),
    (b'\xff\xfe', "/v1/completions", "application/json", 400, "encoding"),
    ({"prompt": [1, 2]}, "/v1/completions", "text/plain", 400, "Content-Type"),
    ({"prompt": [1, 2], "bogus": 1}, "/v1/completions", "application/json", 400, "bogus"),
    ({"prompt": [1, 600]}, "/v1/completions", "application/json", 400, "prompt"),
    ({"prompt": [1, -3]}, "/v1/completions", "application/json", 400, "prompt"),
    ({"prompt": []}, "/v1/completions", "application/json", 400, "prompt"),
    ({"prompt": ["w1", "w2"]}, "/v1/completions", "application/json", 400, "prompt"),
    ({"prompt": [5] * 101}, "/v1/completions", "application/json", 400, "prompt"),
    ({"max_tokens": 3}, "/v1/completions", "application/json", 400, "prompt"),
    ({"prompt": [1, 2], "max_tokens": -1}, "/v1/completions", "application/json", 400, "max_tokens"),
    ({"prompt": [1, 2], "max_tokens": 10 ** 12}, "/v1/completions", "application/json", 400, "max_tokens"),
    ({"prompt": [1, 2], "max_tokens": 65}, "/v1/completions", "application/json", 400, "max_tokens"),
    ({"prompt": [1, 2], "max_tokens": 2.5}, "/v1/completions", "application/json", 400, "max_tokens"),
    ({"prompt": [1, 2], "temperature": -1}, "/v1/completions", "application/json", 400, "temperature"),
    ({"prompt": [1, 2], "top_p": 1.5}, "/v1/completions", "application/json", 400, "top_p"),
    ({"prompt": [1, 2], "top_k": True}, "/v1/completions", "application/json", 400, "top_k"),
    ({"prompt": [1, 2], "seed": 2 ** 32}, "/v1/completions", "application/json", 400, "seed"),
    ({"prompt": [1, 2], "stop_token_ids": ["a"]}, "/v1/completions", "application/json", 400, "stop_token_ids"),
    ({"prompt": [1, 2], "stop": [""]}, "/v1/completions", "application/json", 400, "stop"),
    ({"prompt": [1, 2], "speculative": True}, "/v1/completions", "application/json", 400, "speculative"),
    ({"prompt": [1, 2], "n": 2}, "/v1/completions", "application/json", 400, "n"),
    ({"prompt": [1, 2], "frequency_penalty": 0.5}, "/v1/completions", "application/json", 400, "frequency_penalty"),
    ({"prompt": [1, 2], "presence_penalty": False}, "/v1/completions", "application/json", 400, "presence_penalty"),
    ({"prompt": [1, 2], "logit_bias": {"5": 100}}, "/v1/completions", "application/json", 400, "logit_bias"),
    ({"prompt": [1, 2], "echo": True}, "/v1/completions", "application/json", 400, "echo"),
    ({"prompt": [1, 2], "response_format": {"type": "text"}}, "/v1/completions", "application/json", 400,
     "response_format"),
    ({"messages": [{"role": "user", "content": "w1"}], "response_format": {"type": "json_object"}},
     "/v1/chat/completions", "application/json", 400, "response_format"),
    ({"prompt": [1, 2], "logprobs": True}, "/v1/completions", "application/json", 400, "logprobs"),
    ({"messages": [{"role": "user", "content": "w1"}], "logprobs": 1}, "/v1/chat/completions",
     "application/json", 400, "logprobs"),
    ({"prompt": [1, 2], "stream": "yes"}, "/v1/completions", "application/json", 400, "stream"),
    ({"prompt": [1, 2], "model": "gpt-4"}, "/v1/completions", "application/json", 404, "model"),
    ({"messages": []}, "/v1/chat/completions", "application/json", 400, "messages"),
    ({"messages": [{"role": "robot", "content": "w1"}]}, "/v1/chat/completions", "application/json", 400,
     "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, "/v1/chat/completions", "application/json", 400,
     "messages[0].content"),
    ({"messages": [{"role": "user", "content": "w1", "name": 7}]}, "/v1/chat/completions", "application/json",
     400, "messages[0].name"),
    ({"messages": [{"role": "user", "content": "w1"}], "max_completion_tokens": 0}, "/v1/chat/completions",
     "application/json", 400, "max_completion_tokens"),
    ({"prompt": "w1 " * 30000}, "/v1/completions", "application/json", 413, "Content-Length"),
]

GRPC_BAD = [
    ({"prompt_ids": [1, 600]}, "prompt_ids"),
    ({"prompt_ids": [-1]}, "prompt_ids"),
    ({"prompt_ids": [5] * 101}, "prompt_ids"),
    ({}, "prompt"),
    ({"prompt": "w1", "prompt_ids": [1]}, "prompt"),
    ({"prompt_ids": [1], "max_new_tokens": -5}, "max_new_tokens"),
    ({"prompt_ids": [1], "max_new_tokens": 2 ** 40}, "max_new_tokens"),
    ({"prompt_ids": [1], "max_new_tokens": 65}, "max_new_tokens"),
    ({"prompt_ids": [1], "temperature": float("nan")}, "temperature"),
    ({"prompt_ids": [1], "top_p": 0.0}, "top_p"),
    ({"prompt_ids": [1], "top_k": -1}, "top_k"),
    ({"prompt_ids": [1], "seed": -1}, "seed"),
    ({"prompt_ids": [1], "stop_ids": [999]}, "stop_ids"),
    ({"prompt_ids": [1], "stop": [""]}, "stop"),
    ({"prompt_ids": [1], "speculative": True}, "speculative"),
]


def test_malformed_requests_refused_naming_the_field(served):
    refused0 = served.server.metrics.registry.get_sample_value("v41_requests_refused_total", {"kind": "invalid"})
    for body, path, ctype, status, field in HTTP_BAD:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        got, out, _ = http_call(served.port, "POST", path, raw=raw, headers={"Content-Type": ctype})
        assert (got, out["error"]["param"]) == (status, field), (body, out)
    for fields, field in GRPC_BAD:
        with pytest.raises(grpc.RpcError) as err:
            grpc_generate(served.stub, fields)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, fields
        assert err.value.details().startswith(f"{field}: "), (fields, err.value.details())
    # a field this server's proto does not know (a newer client): field number 99, varint 1
    # (tag 99 << 3 | varint = 792 as a varint: 0x98 0x06; then the value 1)
    raw = v41_pb2.GenerateRequest(prompt_ids=[1]).SerializeToString() + bytes([0x98, 0x06, 0x01])
    call = served.channel.unary_stream("/v41.Generation/Generate", request_serializer=None,
                                       response_deserializer=v41_pb2.GenerateResponse.FromString)
    with pytest.raises(grpc.RpcError) as err:
        list(call(raw))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and err.value.details().startswith("field 99: ")
    # over the message size limit: gRPC's own check
    with pytest.raises(grpc.RpcError) as err:
        grpc_generate(served.stub, {"prompt": "w1 " * 30000})
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    # unknown paths and methods
    assert http_call(served.port, "GET", "/v1/completions")[0] == 404
    assert http_call(served.port, "POST", "/nope", {"prompt": [1]})[0] == 404
    refused = served.server.metrics.registry.get_sample_value("v41_requests_refused_total", {"kind": "invalid"})
    assert refused - (refused0 or 0) == len(HTTP_BAD) + len(GRPC_BAD) + 1
    # and the server keeps serving
    assert grpc_generate(served.stub, COMPARED["greedy"])[0] == served.tokens("greedy")
    assert http_generate(served.port, COMPARED["greedy"], stream=True)[0] == served.tokens("greedy")
    assert_idle_and_empty(served.server)


def test_stop_string_inside_a_multi_token_event():
    """A speculative step delivers several tokens at once: the reply's tokens end with the one that
    completed the stop string, its text before the stop string, and later pushes take nothing."""
    from serving.api import TextStream

    class Words:                                        # token t reads "w<t>", space separated
        @staticmethod
        def decode(ids):
            return " ".join(f"w{t}" for t in ids)

    text = TextStream(Words(), stop=["w7"])
    assert text.push([5]) == "w5" and text.taken == 1
    assert text.push([6, 7, 8, 9]) == " w6 " and text.stopped and text.taken == 2
    assert text.push([10]) == "" and text.taken == 0 and text.flush() == ""
    two = TextStream(Words(), stop=["w1 w2 w3", "w2"])   # "w2" completes first: its text, its tokens
    assert two.push([1, 2, 3]) == "w1 " and two.taken == 2
    whole = TextStream(Words(), stop=["w5 w6"])         # the stop string spans two pushes
    assert whole.push([4, 5]) == "w4 " and whole.taken == 2
    assert whole.push([6, 7]) == "" and whole.stopped and whole.taken == 1


def test_text_stream_decodes_each_id_a_bounded_number_of_times():
    """A push decodes the ids since the settled text (and one push of context), not the whole reply
    again (quadratic: 7.8 s of a handler's CPU for 8,000 tokens). The demo's byte-level tokenizer,
    2,000 random ids (characters split across ids included) pushed 1-3 at a time, a stop string
    that never appears held back at each push: the pushes and the flush give exactly the whole
    decode, and each id is decoded a handful of times (a pending split character keeps its ids in
    the window a little longer)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(ROOT / "models/demo/tokenizer.json"))

    class Counting:
        decoded = 0

        def decode(self, ids):
            Counting.decoded += len(ids)
            return tok.decode(ids)

    rng = np.random.default_rng(0)
    ids = rng.integers(0, tok.get_vocab_size(), 2000).tolist()
    stream, out, i = TextStream(Counting(), stop=["\x00never"]), [], 0
    while i < len(ids):
        n = int(rng.integers(1, 4))
        out.append(stream.push(ids[i:i + n]))
        i += n
    out.append(stream.flush())
    assert "".join(out) == tok.decode(ids)
    assert Counting.decoded - len(ids) <= 8 * len(ids), Counting.decoded     # the flush decodes all once


def test_text_stream_empty_push_keeps_a_leading_space():
    """A push with no ids moves nothing: the next decode still has the previous push as context, so
    a decoder that drops a leading space (SentencePiece's) keeps the space between two words."""
    class Pieces:                                       # token t reads "▁w<t>"; a leading space is dropped
        @staticmethod
        def decode(ids):
            return "".join(f" w{t}" for t in ids).lstrip(" ")

    stream = TextStream(Pieces())
    out = [stream.push([1]), stream.push([]), stream.push([2, 3]), stream.flush()]
    assert "".join(out) == "w1 w2 w3", out


def test_stop_strings(served):
    stop0, abort0 = _count(served, "stop"), _count(served, "abort")
    want = served.tokens("greedy")
    full = served.tokenizer.decode(want)
    stop = f"w{want[4]}"
    cut = full.find(stop)
    # the reply's tokens end with the one that completed the stop string (later ones of its event too)
    kept = want[:next(n for n in range(1, len(want) + 1) if stop in served.tokenizer.decode(want[:n]))]
    tokens, final, text = grpc_generate(served.stub, dict(COMPARED["greedy"], stop=[stop]))
    assert final.finish_reason == v41_pb2.STOP and text == full[:cut] and tokens == kept
    assert final.completion_tokens == len(kept)
    toks, reason, text = http_generate(served.port, dict(COMPARED["greedy"], stop=stop), stream=True)
    assert (reason, text, toks) == ("stop", full[:cut], kept)
    assert http_generate(served.port, dict(COMPARED["greedy"], stop=[stop]), stream=False) == (kept, "stop", full[:cut])
    assert_idle_and_empty(served.server)
    # the engine aborts them, the metrics count what the clients got: three stops, no abort
    wait_for(lambda: _count(served, "stop") - stop0 == 3, 30)
    assert _count(served, "abort") == abort0


def test_json_null_is_a_field_not_given(served):
    """OpenAI's API takes null for its optional fields as "not given": so does this server (the
    reply equals the one without them); a null prompt is a missing prompt; a wrong model is named
    briefly, not as a Python repr."""
    nulls = dict(http_body(COMPARED["greedy"]), stop=None, seed=None, n=None, user=None, stream=None,
                 logprobs=None, stream_options=None, top_p=None)
    status, out, _ = http_call(served.port, "POST", "/v1/completions", nulls)
    assert status == 200 and out["choices"][0]["token_ids"] == served.tokens("greedy"), out
    status, out, _ = http_call(served.port, "POST", "/v1/completions", {"prompt": None, "max_tokens": 2})
    assert (status, out["error"]["param"]) == (400, "prompt")
    status, out, _ = http_call(served.port, "POST", "/v1/completions", {"prompt": [1, 2], "model": {"a": [1] * 900}})
    assert status == 404 and out["error"]["message"].endswith("not an object"), out
    assert_idle_and_empty(served.server)


def test_http_framing_a_get_body_and_two_content_lengths(served):
    """A GET's body is never read, so the connection closes after the answer (else the body would
    start the next request on it); two Content-Length headers are refused and the connection closed."""
    conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=60)
    conn.request("GET", "/health", body=b'{"a": 1}', headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert (resp.status, resp.getheader("Connection"), json.loads(resp.read())) == (200, "close", {"status": "serving"})
    conn.request("POST", "/v1/completions", body=json.dumps(http_body(COMPARED["greedy"])),   # reconnects
                 headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and json.loads(resp.read())["choices"][0]["token_ids"] == served.tokens("greedy")
    conn.close()
    with socket.create_connection(("127.0.0.1", served.port), timeout=60) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 2\r\nContent-Length: 30\r\n\r\n{}")
        reply = b"".join(iter(lambda: sock.recv(65536), b""))    # to the server's close
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and b"Connection: close" in head
    assert json.loads(body)["error"]["param"] == "Content-Length"
    # another method: a JSON 405 that names the two allowed, its body unread and the connection closed
    for method in ("PUT", "DELETE", "PATCH", "OPTIONS"):
        conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=60)
        conn.request(method, "/v1/completions", body=b'{"prompt": [1]}', headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        err = json.loads(resp.read())["error"]
        assert (resp.status, resp.getheader("Allow"), resp.getheader("Connection")) == (405, "GET, POST", "close")
        assert method in err["message"] and err["type"] == "invalid_request_error"
        conn.close()
    # what the stdlib refuses itself (a method no one names, over 100 headers) is JSON too
    many = b"".join(b"X-%d: 1\r\n" % i for i in range(101))
    for start, status in ((b"FROB /health HTTP/1.1\r\n", 501), (b"GET /health HTTP/1.1\r\n" + many, 431)):
        with socket.create_connection(("127.0.0.1", served.port), timeout=60) as sock:
            sock.sendall(start + b"Host: x\r\n\r\n")
            reply = b"".join(iter(lambda: sock.recv(65536), b""))
        head, _, body = reply.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 %d" % status) and b"Connection: close" in head, reply
        assert json.loads(body)["error"]["message"], reply
    # a body far over the limit (32 MiB against 64 KiB; more than the loopback's socket buffers
    # hold): refused unread, yet the client, which sends the whole body before it reads, gets the
    # 413 and not a reset (`http_server._Lingerer`; a 401 or 405 before the body takes the same close)
    conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=60)
    conn.request("POST", "/v1/completions", body=b" " * (32 << 20), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert (resp.status, json.loads(resp.read())["error"]["param"]) == (413, "Content-Length")
    conn.close()
    # HEAD: the 405's headers alone (a HEAD answer has no body)
    with socket.create_connection(("127.0.0.1", served.port), timeout=60) as sock:
        sock.sendall(b"HEAD /health HTTP/1.1\r\nHost: x\r\n\r\n")
        reply = b"".join(iter(lambda: sock.recv(65536), b""))
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 405") and b"Allow: GET, POST" in head and body == b"", reply
    assert_idle_and_empty(served.server)


def test_chat_logprob_bytes_are_the_tokens_own():
    """A token holding part of a UTF-8 character: its text alone is U+FFFD, its `bytes` are the
    part it holds, so a client joining every token's bytes gets the reply's UTF-8 back. The
    byte-level alphabet is the tokenizers library's own."""
    from tokenizers import Tokenizer, pre_tokenizers

    assert set(BYTE_LEVEL) == set(pre_tokenizers.ByteLevel.alphabet()) and sorted(BYTE_LEVEL.values()) == list(range(256))
    tok = Tokenizer.from_file(str(ROOT / "models/demo/tokenizer.json"))
    text = "naïve café — 日本語 🙂"
    ids = tok.encode(text).ids
    got = [token_bytes(tok, t) for t in ids]
    assert b"".join(map(bytes, got)) == text.encode()
    partial = [b for t, b in zip(ids, got) if tok.decode([t]) == "\ufffd"]
    assert partial and all(bytes(b) != "\ufffd".encode() for b in partial)   # the demo splits these characters
    # a special token is spelled as text, not bytes: EOS decodes to "" and gives no bytes (not b"<eos>")
    eos = tok.token_to_id("<eos>")
    assert tok.decode([eos]) == "" and token_bytes(tok, eos) == []


def _phase(served, match) -> str | None:
    """'waiting' / 'prefill' / 'decode' of the request whose prompt is `match` (None: not in the
    engine), read on the loop thread."""
    def look(engine):
        for seq in engine.scheduler.by_id.values():
            if not seq.done and list(seq.req.prompt) == match:
                return "waiting" if seq.slot is None else "prefill" if seq.prefilling else "decode"
        return None
    return served.server.loop.call(look)


def _http_stream_open(port, fields):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", "/v1/completions", body=json.dumps(dict(http_body(fields), stream=True)),
                 headers={"Content-Type": "application/json"})
    return conn


def test_cancel_mid_prefill_and_mid_decode_frees_everything(served):
    """gRPC cancel and HTTP disconnect, each mid-prefill and mid-decode, and Abort by id: every
    request ends as "abort" and every page and slot comes back."""
    aborts0 = _count(served, "abort")
    prompts = [[p] + LONG[1:] for p in (1, 2, 3, 4, 5)]         # distinct prompts to find each request
    fields = [{"prompt_ids": p, "max_new_tokens": 27, "ignore_eos": True} for p in prompts]
    # gRPC, mid-prefill
    call = served.stub.Generate(v41_pb2.GenerateRequest(**fields[0]))
    wait_for(lambda: _phase(served, prompts[0]) == "prefill")
    call.cancel()
    # HTTP, mid-prefill: the client closes its socket before any token
    conn = _http_stream_open(served.port, fields[1])
    wait_for(lambda: _phase(served, prompts[1]) == "prefill")
    conn.sock.shutdown(2)
    conn.close()
    # gRPC, mid-decode
    call = served.stub.Generate(v41_pb2.GenerateRequest(**fields[2]))
    assert next(call).HasField("chunk") and _phase(served, prompts[2]) == "decode"
    call.cancel()
    # HTTP, mid-decode
    conn = _http_stream_open(served.port, fields[3])
    resp = conn.getresponse()
    assert next(sse_events(resp))["choices"][0]["token_ids"] and _phase(served, prompts[3]) == "decode"
    conn.sock.shutdown(2)
    conn.close()
    # Abort by id, mid-decode
    call = served.stub.Generate(v41_pb2.GenerateRequest(request_id="abort-me", **fields[4]))
    assert next(call).HasField("chunk")
    assert served.stub.Abort(v41_pb2.AbortRequest(request_id="abort-me")).aborted
    rest = list(call)
    assert rest[-1].final.finish_reason == v41_pb2.ABORT and rest[-1].final.error == "aborted by Abort"
    assert sum(len(m.chunk.token_ids) for m in rest) < 26
    assert not served.stub.Abort(v41_pb2.AbortRequest(request_id="abort-me")).aborted
    wait_for(lambda: _count(served, "abort") - aborts0 == 5)
    assert_idle_and_empty(served.server)
    for p in prompts:
        assert _phase(served, p) is None


def test_whole_response_client_gone_mid_decode_is_aborted(served):
    """A non-streaming HTTP request writes nothing until it ends, and its tokens come faster than
    the handler's poll: the client closing its socket mid-decode still aborts it (it had run on
    to its token budget)."""
    aborts0 = _count(served, "abort")
    prompt = [6] + LONG[1:20]
    conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=60)
    conn.request("POST", "/v1/completions",
                 body=json.dumps(http_body({"prompt_ids": prompt, "max_new_tokens": 60, "ignore_eos": True})),
                 headers={"Content-Type": "application/json"})
    wait_for(lambda: _phase(served, prompt) == "decode")
    conn.sock.shutdown(2)
    conn.close()
    wait_for(lambda: _count(served, "abort") - aborts0 == 1)
    assert _phase(served, prompt) is None
    assert_idle_and_empty(served.server)


def test_stream_asks_alive_while_events_keep_coming():
    """`Stream.events` asks `alive` every poll_s even when an event arrives within each poll (a
    decode faster than the poll): a gone client is noticed and its request cancelled."""
    import queue

    from serving.loop import Stream, _Open
    from v41_jax.runtime.request import Request, Result
    from v41_jax.runtime.scheduler import FinishEvent, TokenEvent

    class Loop:
        aborted = []

        def abort(self, rid, note, op):
            self.aborted.append((rid, note))

    op = _Open("r", Request([1, 2], 500, request_id="r"), queue.SimpleQueue(), 0.0, None)
    stop = threading.Event()

    def feed():                                          # an event every 5 ms for 2 s, then the end
        end = time.perf_counter() + 2.0
        while not stop.is_set() and time.perf_counter() < end:
            op.events.put(TokenEvent("r", (3,)))
            time.sleep(0.005)
        op.events.put(FinishEvent("r", Result("r", 2, finish_reason="length")))

    threading.Thread(target=feed, daemon=True).start()
    gone_at = time.perf_counter() + 0.2
    t0 = time.perf_counter()
    try:
        got = sum(1 for _ in Stream(Loop(), op).events(alive=lambda: time.perf_counter() < gone_at, poll_s=0.05))
    finally:
        stop.set()
    assert Loop.aborted == [("r", "client disconnected")]
    assert got > 0 and time.perf_counter() - t0 < 0.2 + 0.05 + 0.5     # noticed within a poll (+ scheduling slack)


def test_connected_check_works_past_descriptor_1024():
    """The HTTP handler's "client still there?" check on a socket numbered past 1024 (select()
    refuses those, and every such request had been cancelled as disconnected): open while the
    peer is, closed once the peer closes."""
    import fcntl
    import resource
    import socket
    import types

    from serving.http_server import _Handler

    if resource.getrlimit(resource.RLIMIT_NOFILE)[0] <= 1500:
        pytest.skip("the descriptor limit is below 1500 here")
    a, b = socket.socketpair()
    high = socket.socket(fileno=fcntl.fcntl(a.fileno(), fcntl.F_DUPFD, 1024))   # the lowest free fd >= 1024
    a.close()
    try:
        handler = types.SimpleNamespace(connection=high)
        assert high.fileno() >= 1024 and _Handler._connected(handler)
        b.sendall(b"x")                                      # readable, data pending: still there
        assert _Handler._connected(handler)
        assert high.recv(1) == b"x"
        b.close()
        assert not _Handler._connected(handler)
    finally:
        high.close()


def test_a_late_cancel_never_hits_a_reused_id(served):
    """A stream's cancel after its request ended (a gRPC call's end callback) leaves a newer request
    under the same id alone."""
    from scripts.bench_serving import to_request
    from v41_jax.runtime.scheduler import FinishEvent

    loop = served.server.loop
    first = loop.submit(to_request(COMPARED["greedy"], "reused"))
    assert isinstance(list(first.events())[-1], FinishEvent)
    second = loop.submit(to_request(COMPARED["greedy"], "reused"))
    first.cancel("the first call ended")
    events = list(second.events())
    assert events[-1].result.finish_reason == "length" and events[-1].result.tokens == served.tokens("greedy")
    assert_idle_and_empty(served.server)


def test_an_add_outlived_by_its_request_never_runs_under_a_reused_id():
    """Regression: a request that ends while its add still sits in the loop's inbox (a deadline
    spent at submit) and whose client resubmits the same id: the stale add must not run, or the
    old request would be decoded and its tokens delivered to the new one's stream. No thread: the
    loop's own steps, in the order its iteration takes them."""
    from serving.loop import EngineLoop

    class Engine:
        added: list = []

        def add(self, req):
            self.added.append(req)

    loop = EngineLoop(Engine(), warmup=False)
    old = loop.submit(Request([1, 2, 3], 4, request_id="x"), timeout_s=1e-9)
    time.sleep(0.01)
    loop._expire()                                   # ends it unadmitted; its add is still queued
    assert list(old.events())[-1].result.finish_reason == "abort"
    new = Request([4, 5], 4, request_id="x")
    loop.submit(new)
    loop._take_inbox(block=False)
    assert Engine.added == [new]


def test_deadline_frees_the_request(served):
    aborts0 = _count(served, "abort")
    with pytest.raises(grpc.RpcError) as err:
        grpc_generate(served.stub, {"prompt_ids": LONG, "max_new_tokens": 27, "ignore_eos": True}, timeout=0.3)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_for(lambda: _count(served, "abort") - aborts0 == 1)
    assert_idle_and_empty(served.server)


def test_fault_in_a_step_ends_inflight_with_error_then_recovers(served):
    """Recovery is the documented choice: the step's exception ends every admitted request with
    ERROR and its message, the engine is reset (fresh cache), and new requests are served."""
    runner = served.engine.runner

    def boom(*args, **kw):
        del runner.dispatch                      # one fault: the next step dispatches normally
        raise RuntimeError("injected fault")

    calls = [served.stub.Generate(v41_pb2.GenerateRequest(prompt_ids=[60 + i, 61, 62], max_new_tokens=40,
                                                          ignore_eos=True)) for i in range(3)]
    for c in calls:
        assert next(c).HasField("chunk")         # all three are decoding
    runner.dispatch = boom
    for c in calls:
        final = list(c)[-1].final
        assert final.finish_reason == v41_pb2.ERROR and "RuntimeError: injected fault" in final.error
    assert served.server.loop.state == State.SERVING
    assert_idle_and_empty(served.server)
    assert grpc_generate(served.stub, COMPARED["after_fault"])[0] == served.tokens("after_fault")
    assert http_generate(served.port, COMPARED["greedy"], stream=False)[0] == served.tokens("greedy")
    assert served.server.metrics.registry.get_sample_value("v41_engine_step_failures_total") == 1


def test_metrics(served):
    def read():
        status, text, headers = http_call(served.port, "GET", "/metrics")
        assert status == 200 and headers["Content-Type"].startswith("text/plain")
        return {k: float(v) for k, v in re.findall(r"^(v41_[a-z_]+(?:\{[^}]*\})?) (\S+)$", text, re.M)}
    before = read()
    f = COMPARED["greedy"]
    assert http_generate(served.port, f, stream=False)[0] == served.tokens("greedy")
    values = read()
    # one request more: its prompt prefilled, its tokens generated, its latency observed once
    grew = lambda k: values.get(k, 0) - before.get(k, 0)
    assert grew("v41_prompt_tokens_total") == len(f["prompt_ids"])
    assert grew("v41_generated_tokens_total") == len(served.tokens("greedy"))
    assert grew("v41_request_latency_seconds_count") == 1 and grew("v41_request_latency_seconds_sum") > 0
    assert float(values["v41_time_to_first_token_seconds_count"]) > 0
    assert float(values["v41_inter_token_latency_seconds_count"]) > 0
    assert float(values["v41_generated_tokens_total"]) > 0
    assert float(values["v41_free_pages"]) == SETTINGS.num_pages - 1
    assert float(values["v41_free_slots"]) == SETTINGS.slots
    assert float(values["v41_serving"]) == 1
    assert float(values["v41_dspark_acceptance_rate"]) == 0
    assert 'v41_requests_finished_total{reason="length"}' in values


# ---- a second, small engine: a pool of 11 pages (88 tokens), never warmed (compiles nothing) ----------
@pytest.fixture(scope="module")
def small(model):
    return engine_for(model, settings=replace(SETTINGS, num_pages=12))


def test_never_fits_and_api_key(small, monkeypatch):
    calls = []
    for name in ("add", "check_request"):
        real = getattr(small, name)
        monkeypatch.setattr(small, name, lambda *a, _real=real, _n=name: (calls.append(_n), _real(*a))[1])
    server = Server(small, model_name="tiny", limits=LIMITS, api_key="sekrit", warmup=False).start()
    try:
        assert server.wait_ready(60)
        st, channel = stub(server.grpc_port)
        bad_keys = ([], [("authorization", "Bearer wrong")], [("authorization", "sekrit")])
        for meta in bad_keys:
            with pytest.raises(grpc.RpcError) as err:
                grpc_generate(st, {"prompt_ids": [1, 2]}, metadata=meta)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.RpcError) as err:
                st.GetModelInfo(v41_pb2.ModelInfoRequest(), metadata=meta)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekrit"}):
            status, out, hdrs = http_call(server.http_port, "POST", "/v1/completions", {"prompt": [1, 2]}, headers)
            assert status == 401 and hdrs["WWW-Authenticate"] == "Bearer", out
            assert http_call(server.http_port, "GET", "/v1/models", headers=headers)[0] == 401
            assert http_call(server.http_port, "GET", "/metrics", headers=headers)[0] == 401
        assert calls == []                                        # no engine code was reached
        # probes need no key
        health = health_pb2_grpc.HealthStub(channel)
        assert health.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.SERVING
        assert http_call(server.http_port, "GET", "/health")[0] == 200
        key = [("authorization", "Bearer sekrit")]
        assert st.GetModelInfo(v41_pb2.ModelInfoRequest(), metadata=key).pages == 11
        auth = {"Authorization": "Bearer sekrit"}
        assert http_call(server.http_port, "GET", "/v1/models", headers=auth)[0] == 200
        # 60 + 40 tokens need 13 pages of 8: never, whatever else runs
        never = {"prompt_ids": list(range(3, 63)), "max_new_tokens": 40}
        with pytest.raises(grpc.RpcError) as err:
            grpc_generate(st, never, metadata=key)
        # the caller's to change, not to retry: INVALID_ARGUMENT, naming the field to lower and by how much
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details().startswith("max_new_tokens: this request can never run here: the prompt's 60 "
                                              "tokens and up to 40 new ones need 13 pages of 8 tokens, the pool has "
                                              "11 (88 tokens): at most 28 new tokens fit"), err.value.details()
        status, out, _ = http_call(server.http_port, "POST", "/v1/completions", http_body(never), auth)
        assert (status, out["error"]["code"], out["error"]["param"]) == (400, "exhausted", "max_tokens"), out
        assert "at most 28 new tokens fit" in out["error"]["message"]
        too_long = {"prompt_ids": list(range(3, 95)), "max_new_tokens": 1}       # 92 tokens: the prompt alone
        status, out, _ = http_call(server.http_port, "POST", "/v1/completions", http_body(too_long), auth)
        assert (status, out["error"]["param"]) == (400, "prompt"), out
        assert "the prompt alone does not fit" in out["error"]["message"]
        assert "add" not in calls                                 # refused before the engine loop
        channel.close()
    finally:
        assert server.shutdown(10)


def test_connections_over_the_limit_refused_and_counted(small):
    """With room for one connection, a second is still answered for /health and /metrics (a probe
    and a scrape when the server is full), any other request on it gets 429, counted, the
    connection closed after its answer. One that sends a body far past the socket buffers (32 MiB)
    still reads its 429, not a reset: the refusal is handed to the lingering close
    (`http_server._Lingerer`), which holds it only until the client is done. Past the control
    connections too, the accept loop answers 429 itself."""
    server = Server(small, model_name="tiny", limits=replace(LIMITS, max_streams=1), warmup=False).start()
    try:
        assert server.wait_ready(60)
        with socket.create_connection(("127.0.0.1", server.http_port), timeout=60):   # held, idle
            time.sleep(0.2)
            status, out, hdrs = http_call(server.http_port, "GET", "/health")
            assert (status, out, hdrs.get("Connection")) == (200, {"status": "serving"}, "close")
            status, text, _ = http_call(server.http_port, "GET", "/metrics")
            assert status == 200 and "v41_requests_refused_total" in text
            conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=60)
            conn.request("POST", "/v1/completions", body=b" " * (32 << 20),
                         headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            assert (resp.status, json.loads(resp.read())["error"]["code"]) == (429, "busy")
            conn.close()
            idle = [socket.create_connection(("127.0.0.1", server.http_port), timeout=60)
                    for _ in range(http_server.CONTROL_CONNS)]                 # the control connections, held
            time.sleep(0.2)
            status, out, _ = http_call(server.http_port, "GET", "/health")
            assert (status, out["error"]["code"]) == (429, "busy")
            for c in idle:
                c.close()
        got = server.metrics.registry.get_sample_value("v41_requests_refused_total", {"kind": "connections"})
        assert got == 2
        lingerer = server.http.server.lingerer
        deadline = time.monotonic() + 10
        while lingerer.held and time.monotonic() < deadline:      # each closed once its client is
            time.sleep(0.05)
        assert lingerer.held == 0
        # every slot back (a handler thread releases its slot just after its client saw the close)
        wait_for(lambda: http_call(server.http_port, "GET", "/health", timeout=10)[0] == 200)
    finally:
        assert server.shutdown(10)


def test_grpc_streams_limit_leaves_room_for_probes_and_abort():
    """max_streams counts Generate streams alone: with that many open, a health probe and an Abort
    are answered (gRPC's own limit, which counts every call, sits CONTROL_RPCS above), a further
    Generate is refused RESOURCE_EXHAUSTED and counted, and an ended stream gives its place back.
    A fake engine loop holds each stream open until its call ends."""
    class Held:
        prompt_len = 1

        def events(self, alive):
            while alive():
                time.sleep(0.02)
            return
            yield

        def cancel(self, note=""):
            pass

    class Loop:
        state = State.SERVING

        def submit(self, req, timeout_s=None):
            return Held()

        def abort(self, rid, note="", op=None):
            return False

    class FakeApi:
        limits = Limits(max_streams=2)

        def build(self, fields, rid, names=None):
            return Job(Request([1], request_id=rid))

        def text(self, stop=()):
            return TextStream(None, stop)

    metrics = Metrics()
    server, port, _ = grpc_server.build(Loop(), FakeApi(), metrics, "127.0.0.1", 0)
    server.start()
    st, channel = stub(port)
    try:
        calls = [st.Generate(v41_pb2.GenerateRequest(prompt_ids=[1])) for _ in range(2)]
        time.sleep(0.5)                             # both streams open on the server (the refusal below shows it)
        check = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert check.status == health_pb2.HealthCheckResponse.SERVING
        st.Abort(v41_pb2.AbortRequest(request_id="none"), timeout=10)
        with pytest.raises(grpc.RpcError) as err:
            list(st.Generate(v41_pb2.GenerateRequest(prompt_ids=[1]), timeout=10))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_streams 2" in err.value.details()
        assert metrics.registry.get_sample_value("v41_requests_refused_total", {"kind": "busy"}) == 1
        calls[0].cancel()
        deadline, code = time.monotonic() + 10, None
        while time.monotonic() < deadline:          # the ended stream's place comes back
            with pytest.raises(grpc.RpcError) as err:
                list(st.Generate(v41_pb2.GenerateRequest(prompt_ids=[1]), timeout=0.5))
            code = err.value.code()
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:   # admitted, held until its deadline
                break
        assert code == grpc.StatusCode.DEADLINE_EXCEEDED
        calls[1].cancel()
    finally:
        channel.close()
        server.stop(0)


def test_engine_refusing_a_request_ends_it_alone(small, monkeypatch):
    """Engine.add raising (a bug, or a rule the server's checks missed) ends that request with ERROR
    and its message; the loop keeps serving."""
    def refuse(req):
        raise ValueError("no room for this one")

    monkeypatch.setattr(small, "add", refuse)
    server = Server(small, model_name="tiny", limits=LIMITS, warmup=False).start()
    try:
        assert server.wait_ready(60)
        st, channel = stub(server.grpc_port)
        for _ in range(2):
            tokens, final, _ = grpc_generate(st, {"prompt_ids": [5, 6, 7], "max_new_tokens": 3})
            assert tokens == [] and final.finish_reason == v41_pb2.ERROR
            assert final.error == "the engine refused it: ValueError: no room for this one"
        assert server.loop.state == State.SERVING and server.loop.snapshot().open == 0
        channel.close()
    finally:
        assert server.shutdown(10)


def test_repeated_faults_stop_serving(small, monkeypatch):
    """A fault in every step: each request ends ERROR; after MAX_FAILED_STEPS failures in a row the
    server reports NOT_SERVING and refuses new requests (UNAVAILABLE / 503)."""
    from serving.loop import MAX_FAILED_STEPS

    def broken(*args, **kw):
        raise RuntimeError("device lost")

    monkeypatch.setattr(small.runner, "dispatch", broken)
    server = Server(small, model_name="tiny", limits=LIMITS, warmup=False).start()
    try:
        assert server.wait_ready(60)
        st, channel = stub(server.grpc_port)
        for i in range(MAX_FAILED_STEPS):
            tokens, final, _ = grpc_generate(st, {"prompt_ids": [5, 6, 7], "max_new_tokens": 3})
            assert tokens == [] and final.finish_reason == v41_pb2.ERROR and "device lost" in final.error
        wait_for(lambda: server.loop.state == State.FAILED)
        health = health_pb2_grpc.HealthStub(channel)
        assert health.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.RpcError) as err:
            grpc_generate(st, {"prompt_ids": [5, 6, 7], "max_new_tokens": 3})
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert http_call(server.http_port, "POST", "/v1/completions", {"prompt": [5, 6]})[0] == 503
        assert http_call(server.http_port, "GET", "/health") [:2] == (503, {"status": "failed"})
        channel.close()
    finally:
        server.shutdown(10)


def test_failing_with_requests_still_waiting_ends_every_one(small, monkeypatch):
    """Regression: the failure that stops serving comes while requests still wait in the
    scheduler (more than the slots); each open request gets its error FinishEvent and the loop
    thread lives on (it had died in `forget` of a waiting request, stranding the rest)."""
    from serving.loop import MAX_FAILED_STEPS, EngineLoop
    from v41_jax.runtime.request import Request
    from v41_jax.runtime.scheduler import FinishEvent

    def broken(*args, **kw):
        raise RuntimeError("device lost")

    monkeypatch.setattr(small.runner, "dispatch", broken)
    loop = EngineLoop(small, warmup=False)
    n = (MAX_FAILED_STEPS + 1) * SETTINGS.slots
    streams = [loop.submit(Request([5, 6, 7], 3, request_id=f"w{i}")) for i in range(n)]
    loop.start()
    try:
        deadline = time.perf_counter() + 30
        ends = [list(s.events(alive=lambda: time.perf_counter() < deadline))[-1:] for s in streams]
        assert all(isinstance(e[0], FinishEvent) for e in ends), "a request never got its FinishEvent"
        assert all(e[0].result.finish_reason == "error" and "device lost" in e[0].result.error for e in ends)
        assert loop.state == State.FAILED and loop._thread.is_alive()
        assert loop.call(lambda e: e.scheduler.running) == []          # the thread still answers
    finally:
        loop.drain(10)


# ---- DSpark: an engine that speculates (the test geometry plus the draft slack) ------------------------
SPEC = {"spec": {"prompt_ids": [40, 41, 42, 43, 44], "max_new_tokens": 20, "ignore_eos": True},
        "plain": {"prompt_ids": [40, 41, 42, 43, 44], "max_new_tokens": 20, "ignore_eos": True, "speculative": False}}


@pytest.fixture(scope="module")
def spec_served(model):
    cfg = model[1][0]
    engine = engine_for(model, settings=replace(SETTINGS, draft_slack=cfg.dspark_block_size))
    assert engine.speculative
    engine.warmup()
    refs = offline(engine, SPEC)
    server = Server(engine, model_name="tiny", limits=LIMITS).start()
    assert server.wait_ready(300)
    st, channel = stub(server.grpc_port)
    yield Served(server, engine, refs, st, channel, model[2], {})
    channel.close()
    assert server.shutdown(30)


def _verifying(served, match) -> bool:
    """The request whose prompt is `match` has a verify span in a step in flight (past its prefill,
    decoding by verifying the previous step's drafts)."""
    def look(engine):
        return any(sp.verify and not sp.seq.done and list(sp.seq.req.prompt) == match
                   for plan in engine.scheduler.in_flight.values() for sp in plan.spans)
    return served.server.loop.call(look)


def test_speculative_requests_and_cancel_mid_verify(spec_served):
    sv = spec_served
    assert sv.stub.GetModelInfo(v41_pb2.ModelInfoRequest()).speculative
    tokens, spec, _ = grpc_generate(sv.stub, SPEC["spec"])
    assert tokens == sv.tokens("spec") == sv.tokens("plain")          # greedy: drafts change no token
    assert spec.draft_tokens > 0 and 0 <= spec.accepted_tokens <= spec.draft_tokens
    assert spec.acceptance_rate == pytest.approx(spec.accepted_tokens / spec.draft_tokens)
    tokens, plain, _ = grpc_generate(sv.stub, SPEC["plain"])
    assert tokens == sv.tokens("plain") and plain.draft_tokens == 0
    assert http_generate(sv.port, dict(SPEC["spec"], speculative=True), stream=True)[0] == sv.tokens("spec")
    # the engine's counters, as /metrics gives them: the two identical speculative requests' drafts
    value = lambda name: sv.server.metrics.registry.get_sample_value(name)
    assert value("v41_dspark_draft_tokens_total") == 2 * spec.draft_tokens
    assert value("v41_dspark_accepted_tokens_total") == 2 * spec.accepted_tokens
    # cancel mid-verify, then everything back
    aborts0 = _count(sv, "abort")
    prompt = [50 + i for i in range(30)]
    call = sv.stub.Generate(v41_pb2.GenerateRequest(prompt_ids=prompt, max_new_tokens=60, ignore_eos=True))
    assert next(call).HasField("chunk")
    wait_for(lambda: _verifying(sv, prompt))
    call.cancel()
    wait_for(lambda: _count(sv, "abort") - aborts0 == 1)
    assert_idle_and_empty(sv.server)


def test_stop_string_mid_event_on_a_speculating_server(spec_served):
    """Speculative steps may deliver several tokens an event: for a stop string at a few tokens,
    the reply's token ids (gRPC and HTTP) end with the token that completed it and its text before
    it. (The tiny model accepts few drafts, so an event rarely goes on past the stop: the slicing
    itself is `TextStream.taken`'s, tested above.)"""
    sv = spec_served
    want = sv.tokens("spec")
    full = sv.tokenizer.decode(want)
    for k in (2, 5, 8):
        stop = f"w{want[k]}"
        kept = want[:next(n for n in range(1, len(want) + 1) if stop in sv.tokenizer.decode(want[:n]))]
        tokens, final, text = grpc_generate(sv.stub, dict(SPEC["spec"], stop=[stop]))
        assert (tokens, final.completion_tokens, text) == (kept, len(kept), full[:full.find(stop)]), k
        assert http_generate(sv.port, dict(SPEC["spec"], stop=[stop]), stream=False) == \
            (kept, "stop", full[:full.find(stop)]), k
    assert_idle_and_empty(sv.server)


# ---- the process: SIGTERM under load ----------------------------------------------------------------
def test_sigterm_under_load_drains_and_exits_0(served, model):
    """`python -m serving.server` on the checkpoint: requests in flight over both protocols when
    SIGTERM comes all finish in full (equal to offline); new ones are refused; exit code 0."""
    cmd = [sys.executable, "-m", "serving.server", "--checkpoint", str(model[0]), "--grpc-port", "0",
           "--http-port", "0", "--status-every", "0.2", *ENGINE_FLAGS]
    proc = subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stderr.readline, "")), daemon=True)
    reader.start()
    try:
        ports = wait_for(lambda: next((m for m in map(re.compile(r"listening: gRPC (\d+), HTTP (\d+)").search,
                                                      lines) if m), None), timeout=300)
        wait_for(lambda: any("ready: serving" in l for l in lines), timeout=300)
        grpc_port, http_port = int(ports[1]), int(ports[2])
        st, channel = stub(grpc_port)
        names = [f"term{i}" for i in range(4)]
        calls = [st.Generate(v41_pb2.GenerateRequest(**COMPARED[n])) for n in names[:2]]
        conns = [_http_stream_open(http_port, COMPARED[n]) for n in names[2:]]
        firsts = [next(c).chunk.token_ids for c in calls]
        resps = [c.getresponse() for c in conns]
        events = [sse_events(r) for r in resps]
        heads = [next(e) for e in events]
        assert all("choices" in h for h in heads), heads        # an error event says why
        firsts += [h["choices"][0]["token_ids"] for h in heads]
        proc.send_signal(signal.SIGTERM)
        wait_for(lambda: any("shutting down" in l for l in lines))
        with pytest.raises(grpc.RpcError) as err:
            grpc_generate(st, COMPARED["greedy"])
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        got = [list(firsts[0]) + [t for m in calls[0] if m.HasField("chunk") for t in m.chunk.token_ids],
               list(firsts[1]) + [t for m in calls[1] if m.HasField("chunk") for t in m.chunk.token_ids]]
        got += [list(f) + [t for ev in e for t in ev["choices"][0]["token_ids"]] for f, e in zip(firsts[2:], events)]
        for n, tokens in zip(names, got):
            assert tokens == served.tokens(n), n
        assert proc.wait(timeout=120) == 0, "".join(lines[-20:])
        channel.close()
        for c in conns:
            c.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert any("stopped (drained)" in l for l in lines), "".join(lines[-20:])
    # the periodic status line, seen while the four requests ran
    status = re.compile(r"status: (serving|draining), \d+ finished, [1-4] running, \d+ waiting, [\d.]+ tokens/s, "
                        rf"free pages \d+/{SETTINGS.num_pages - 1}, free slots [0-3]/{SETTINGS.slots}")
    assert any(status.search(l) for l in lines), "".join(lines[-20:])


def test_v41_client_streams_text(served, capsys):
    from serving import client

    want = served.tokens("greedy")
    f = COMPARED["greedy"]
    argv = ["--server", f"127.0.0.1:{served.server.grpc_port}", "--ids", *map(str, f["prompt_ids"]),
            "--max-new-tokens", str(f["max_new_tokens"])]
    assert client.main(argv) == 0
    out, err = capsys.readouterr()
    # ignore_eos is not a client flag: the text runs to EOS or the budget, whichever comes first
    assert served.tokenizer.decode(want).startswith(out.strip()) and out.strip()
    assert re.search(r"\[(LENGTH|EOS)\] \d+ tokens", err)
    assert client.main(["--server", f"127.0.0.1:{served.server.grpc_port}", "--info"]) == 0
    assert 'model: "tiny"' in capsys.readouterr().out
    assert client.main(["--server", f"127.0.0.1:{served.server.grpc_port}", "--ids", "1", "--temperature", "-1"]) == 1
    assert "INVALID_ARGUMENT: temperature:" in capsys.readouterr().err


@pytest.mark.parametrize("argv,named", [
    (["--http-port", "70000"], "--http-port: must be a TCP port"), (["--grpc-port", "-2"], "--grpc-port: must be"),
    (["--request-timeout", "nan"], "--request-timeout: must be a finite"),
    (["--request-timeout", "-1"], "--request-timeout: must be a finite"),
    (["--drain-timeout", "inf"], "--drain-timeout: must be a finite"), (["--status-every", "x"], "--status-every: 'x'"),
])
def test_serve_cli_refuses_bad_ports_and_times_before_loading(argv, named, capsys, monkeypatch, tmp_path):
    """A port out of range (refused after the whole load before), a NaN timeout (deadlines silently
    off), a negative one (every request aborted) or an infinite drain (an OverflowError on
    SIGTERM): argparse's one-line usage error, exit 2, nothing loaded."""
    from serving import server as server_module

    monkeypatch.setattr(server_module, "load_engine", lambda args: pytest.fail("loaded the engine"))
    with pytest.raises(SystemExit) as e:
        server_module.main(["--checkpoint", str(tmp_path), *argv])
    assert e.value.code == 2 and named in capsys.readouterr().err


def test_serve_cli_bad_checkpoint_is_one_line_exit_2(tmp_path, capsys):
    """A checkpoint the loader refuses prints its one line and exits 2, no traceback."""
    from serving import server as server_module

    (tmp_path / "config.json").write_text("{")
    assert server_module.main(["--checkpoint", str(tmp_path), "--no-warmup", "--compile-cache", str(SUITE_CACHE)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"error: {tmp_path / 'config.json'}: ") and "Traceback" not in "".join(err), err


def test_serve_cli_refuses_bad_step_shapes_before_loading(model, capsys, monkeypatch):
    """v41-serve names a bad --decode-sizes / --buckets in one line and exits 2 before loading."""
    from serving import server as server_module

    monkeypatch.setattr(server_module, "load_engine", lambda args: pytest.fail("loaded the engine"))
    for argv, named in ((["--decode-sizes", "1,9", "--max-batch", "8"], "--decode-sizes: decode sizes: [9] not in 1..8"),
                        (["--decode-sizes", "2,a"], "--decode-sizes"),
                        (["--buckets", "4x4"], "--buckets"),
                        (["--buckets", "4x1x4", "--decode-sizes", "1"], "--decode-sizes: not with --buckets"),
                        (["--numerics", "fp32", "--index-format", "fp4"], "--index-format fp4: "),
                        (["--numerics", "fp32", "--kv-format", "packed"], "--kv-format packed: ")):
        assert server_module.main(["--checkpoint", str(model[0]), *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith("error: ") and named in err[-1], err
