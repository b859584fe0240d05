"""The gRPC front end: `v41.Generation` (serving/proto/v41.proto), `grpc.health.v1.Health` and
server reflection, on one `grpc.Server`.

Handlers run on the server's thread pool and only build requests, submit them to the engine loop
and stream its events; a call that ends early (client cancel, disconnect, deadline) aborts its
request through the call's termination callback.
"""

from __future__ import annotations

import hmac
import threading
import uuid
from concurrent import futures

import grpc
from google.protobuf import unknown_fields
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from serving.api import Api
from serving.loop import EngineLoop, Refused, State
from serving.proto import v41_pb2, v41_pb2_grpc
from v41_jax.runtime.scheduler import FinishEvent

SERVICE = v41_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
# a request that can never fit is the caller's to change (INVALID_ARGUMENT, whatever the load), where
# RESOURCE_EXHAUSTED says "retry later" to a client's retry policy
CODES = {"invalid": grpc.StatusCode.INVALID_ARGUMENT, "exhausted": grpc.StatusCode.INVALID_ARGUMENT,
         "busy": grpc.StatusCode.RESOURCE_EXHAUSTED, "unavailable": grpc.StatusCode.UNAVAILABLE}
FINISH = {"stop": v41_pb2.STOP, "length": v41_pb2.LENGTH, "eos": v41_pb2.EOS, "abort": v41_pb2.ABORT,
          "error": v41_pb2.ERROR}
# proto3 `optional` scalars: passed to request_parse only when the client set them
_OPTIONAL = ("prompt", "max_new_tokens", "temperature", "top_p", "top_k", "seed", "ignore_eos", "logprobs",
             "speculative")
# calls beyond max_streams Generate streams (health probes, Abort, GetModelInfo, reflection)
CONTROL_RPCS = 8
# without the health service: a probe carries no key
_OPEN_METHODS = ("/grpc.health.v1.Health/",)


def request_fields(msg: v41_pb2.GenerateRequest) -> dict:
    """The fields a client set, in request_parse's names (+ stop). Integers arrive as
    int64, so out-of-range ids and negative counts reach request_parse's checks and messages."""
    unknown = list(unknown_fields.UnknownFieldSet(msg))
    if unknown:
        raise Refused("invalid", "unknown field (not in v41.GenerateRequest)", f"field {unknown[0].field_number}")
    out = {k: getattr(msg, k) for k in _OPTIONAL if msg.HasField(k)}
    for k in ("prompt_ids", "stop_ids"):
        if len(getattr(msg, k)):
            out[k] = list(getattr(msg, k))
    if len(msg.stop):
        out["stop"] = list(msg.stop)
    return out


class GenerationServicer(v41_pb2_grpc.GenerationServicer):
    def __init__(self, loop: EngineLoop, api: Api, metrics):
        self.loop, self.api, self.metrics = loop, api, metrics
        # the streams limit counts Generate calls alone: gRPC's own limit (`build`) counts every
        # call, and at max_streams streams a health probe or an Abort must still get through
        self._streams = threading.BoundedSemaphore(api.limits.max_streams)

    def _refuse(self, context, err: Refused):
        self.metrics.refused.labels(err.kind).inc()
        context.abort(CODES[err.kind], str(err))

    def Generate(self, request, context):
        if not self._streams.acquire(blocking=False):
            self._refuse(context, Refused("busy", f"too many streams (max_streams {self.api.limits.max_streams})"))
        try:
            yield from self._generate(request, context)
        finally:
            self._streams.release()

    def _generate(self, request, context):
        rid = request.request_id or f"grpc-{uuid.uuid4().hex}"
        try:
            job = self.api.build(request_fields(request), rid)
            remaining = context.time_remaining()
            limit = self.api.limits.request_timeout_s or None
            if remaining is not None and remaining < 1e6:
                limit = min(limit or remaining, remaining)
            stream = self.loop.submit(job.request, timeout_s=limit)
        except Refused as err:
            self._refuse(context, err)
        # any end of the call (cancel, disconnect, deadline, normal) aborts the request if still open
        context.add_callback(lambda: stream.cancel("the call ended"))
        text = self.api.text(job.stop)
        total = 0
        for ev in stream.events(context.is_active):
            if isinstance(ev, FinishEvent):
                res = ev.result
                reason = "stop" if text.stopped else res.finish_reason
                t = stream.timing()
                yield v41_pb2.GenerateResponse(request_id=rid, final=v41_pb2.Final(
                    finish_reason=FINISH[reason], error="" if reason == "stop" else res.error or "",
                    text=text.flush(), prompt_tokens=stream.prompt_len, completion_tokens=total,
                    ttft_s=t.ttft_s, tokens_per_s=t.tokens_per_s, draft_tokens=t.drafted,
                    accepted_tokens=t.accepted, acceptance_rate=t.accepted / t.drafted if t.drafted else 0.0))
                return
            if text.stopped:
                continue                                # aborted: its FinishEvent is on the way
            chunk = text.push(ev.tokens)
            total += text.taken
            yield v41_pb2.GenerateResponse(request_id=rid, chunk=v41_pb2.Chunk(
                token_ids=ev.tokens[:text.taken], text=chunk, logprobs=(ev.logprobs or ())[:text.taken],
                prompt_tokens=stream.prompt_len, completion_tokens=total))
            if text.stopped:
                stream.stop()

    def Abort(self, request, context):
        return v41_pb2.AbortResponse(aborted=self.loop.abort(request.request_id, "aborted by Abort"))

    def GetModelInfo(self, request, context):
        api, e = self.api, self.loop.engine
        s = e.geom.settings
        return v41_pb2.ModelInfo(model=api.model_name, vocab_size=api.vocab_size, max_context=api.max_context,
                                 max_prompt_tokens=api.limits.max_prompt_tokens,
                                 max_new_tokens=api.limits.max_new_tokens, tokenizer=api.tokenizer is not None,
                                 speculative=api.speculative, slots=s.slots, pages=s.num_pages - 1,
                                 page_tokens=s.page_tokens, eos_id=-1 if api.eos_id is None else api.eos_id)


class _KeyCheck(grpc.ServerInterceptor):
    """`authorization: Bearer <key>` metadata on every call but health probes; a wrong or missing key
    ends the call UNAUTHENTICATED before any handler runs."""

    def __init__(self, key: str, metrics):
        self._want = f"Bearer {key}".encode()
        self._metrics = metrics

        def deny(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "a valid 'authorization: Bearer <key>' is required")
        self._deny = grpc.unary_unary_rpc_method_handler(deny)

    def intercept_service(self, continuation, details):
        if details.method.startswith(_OPEN_METHODS):
            return continuation(details)
        got = dict(details.invocation_metadata).get("authorization", "")
        if hmac.compare_digest(got.encode(), self._want):
            return continuation(details)
        self._metrics.refused.labels("unauthenticated").inc()
        return self._deny


def build(loop: EngineLoop, api: Api, metrics, host: str, port: int, api_key: str | None = None):
    """-> (grpc.Server not started, its bound port, the health servicer)."""
    lim = api.limits
    calls = lim.max_streams + CONTROL_RPCS
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=calls, thread_name_prefix="grpc"),
        maximum_concurrent_rpcs=calls,
        interceptors=[_KeyCheck(api_key, metrics)] if api_key else [],
        options=[("grpc.max_receive_message_length", lim.max_message_bytes),
                 ("grpc.max_send_message_length", lim.max_message_bytes)])
    v41_pb2_grpc.add_GenerationServicer_to_server(GenerationServicer(loop, api, metrics), server)
    health_servicer = health.HealthServicer(experimental_non_blocking=True)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = (SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"gRPC: cannot bind {host}:{port}")
    set_health(health_servicer, loop.state)
    return server, bound, health_servicer


def set_health(servicer, state: State) -> None:
    status = (health_pb2.HealthCheckResponse.SERVING if state == State.SERVING
              else health_pb2.HealthCheckResponse.NOT_SERVING)
    for name in ("", SERVICE):
        servicer.set(name, status)
