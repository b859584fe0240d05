"""The OpenAI-compatible HTTP front end (stdlib `http.server`, a thread per connection):

    POST /v1/completions        prompt: a string or a list of token ids
    POST /v1/chat/completions   messages, rendered with our chat template (serving/api.py)
    GET  /v1/models, /v1/models/<name>, /health (200 serving / 503 otherwise), /metrics (Prometheus)

`"stream": true` answers with server-sent events (chunked transfer encoding), ending with
`data: [DONE]`. Each choice also carries `token_ids` (the tokens of that text; an extension, so a
client can compare tokens exactly). Extensions to the request: top_k, stop_token_ids, ignore_eos,
speculative. A refusal is `{"error": {"message", "type", "param", "code"}}` with param naming the
field: 400 for a bad field or a request that can never fit, 401 without the key, 413 for a body
over the limit, 429 when the server is full, 503 while not serving; any other method is 405
(after the key check, as every path but /health is). Past the connection limit, a few connections
more are still answered for /health and /metrics alone (CONTROL_PATHS).
"""

from __future__ import annotations

import hmac
import json
import logging
import select
import selectors
import socket
import sys
import threading
import time
import uuid
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote

from prometheus_client import CONTENT_TYPE_LATEST

from serving.api import Api, chat_prompt, token_bytes
from serving.loop import EngineLoop, Refused, State
from v41_jax.runtime.request_parse import RequestError, decode_json, show
from v41_jax.runtime.scheduler import FinishEvent

log = logging.getLogger("v41.serve.http")

STATUS = {"invalid": 400, "exhausted": 400, "busy": 429, "unavailable": 503}
ERROR_TYPE = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
              405: "invalid_request_error", 413: "invalid_request_error", 414: "invalid_request_error",
              429: "rate_limit_error", 431: "invalid_request_error", 500: "server_error",
              501: "invalid_request_error", 503: "server_error"}
FINISH = {"eos": "stop", "stop": "stop", "length": "length", "abort": "abort"}
COMMON = ("model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "stream_options", "n",
          "user", "top_k", "stop_token_ids", "ignore_eos", "speculative", "logprobs")
# OpenAI / vLLM fields this server does not implement, taken at the one value that changes nothing
# (some clients send every field's default, e.g. `frequency_penalty: 0`) and refused by name at any
# other: (that value, what this server does instead)
NEUTRAL = {"presence_penalty": (0, "samples without penalties"), "frequency_penalty": (0, "samples without penalties"),
           "repetition_penalty": (1, "samples without penalties"), "min_p": (0, "samples without a min-p cut"),
           "logit_bias": ({}, "applies no logit bias")}
NEUTRAL_BY = {"completions": {"echo": (False, "does not echo the prompt"), "best_of": (1, "samples one completion"),
                              "suffix": ("", "does not insert text")},
              "chat": {"response_format": ({"type": "text"}, "answers plain text")}}
KNOWN = {"completions": COMMON + ("prompt",) + (*NEUTRAL, *NEUTRAL_BY["completions"]),
         "chat": COMMON + ("messages", "max_completion_tokens", "top_logprobs") + (*NEUTRAL, *NEUTRAL_BY["chat"])}
# OpenAI's name -> request_parse's (and back, for refusals)
RENAME = {"max_tokens": "max_new_tokens", "max_completion_tokens": "max_new_tokens", "stop_token_ids": "stop_ids"}
PASS = ("temperature", "top_p", "seed", "top_k", "ignore_eos", "stop", "speculative")
MODEL_PREFIX = "/v1/models/"
SOCKET_TIMEOUT_S = 60.0              # a client that stalls a read or a write this long is dropped
# A refusal sent before its request's body was read (401, 404, 405, 413, a GET's body): the socket
# closed with unread bytes in its receive queue sends a TCP reset, and a client still writing the
# body sees "connection reset" instead of the answer. So the server first shuts its sending side
# (the client reads the answer, then EOF) and discards what still arrives, up to these bounds
# (Apache's "lingering close"), before closing. One thread does it for every such connection
# (`_Lingerer`), so neither a handler thread nor the accept loop (its 429 over the connection
# limit) waits; past LINGER_CONNS at once a refused connection is closed at once.
LINGER_S = 2.0
LINGER_BYTES = 64 << 20
LINGER_CONNS = 256
# Past the connection limit a few more connections are read, for the paths a monitor needs exactly
# when the server is full (a liveness probe, a metrics scrape); any other request on them is
# answered 429, each closed after one answer, and a client that stalls there is dropped sooner.
CONTROL_PATHS = ("/health", "/metrics")
CONTROL_CONNS = 8
CONTROL_TIMEOUT_S = 5.0


def _same_json(a, b) -> bool:
    """Equal as JSON values: a number equals a number (0 == 0.0), never a boolean (false != 0)."""
    number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
    if number(a) or number(b):
        return number(a) and number(b) and a == b
    return type(a) is type(b) and a == b


class HttpError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        self.status, self.message, self.param, self.code = status, message, param, code
        super().__init__(message)


def _refusal(err: Refused) -> HttpError:
    return HttpError(STATUS[err.kind], str(err), err.field, err.kind)


class HttpFrontend:
    def __init__(self, loop: EngineLoop, api: Api, metrics, host: str, port: int, api_key: str | None = None):
        self.loop, self.api, self.metrics = loop, api, metrics
        self.key = f"Bearer {api_key}".encode() if api_key else None
        self.created = int(time.time())
        handler = type("Handler", (_Handler,), {"front": self})
        self.server = _Server((host, port), handler, api.limits.max_streams)
        self.port = self.server.server_address[1]
        self._thread = threading.Thread(target=self.server.serve_forever, name="http", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop accepting, wait up to `timeout` for the requests being answered, then close every
        connection (idle keep-alive ones would otherwise hold their threads until the socket timeout)."""
        self.server.shutdown()
        self.server.wait_idle(timeout)
        self.server.close_connections()
        self.server.server_close()


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False
    request_queue_size = 128          # listen backlog: a burst of clients connecting at once is not refused

    def __init__(self, address, handler, max_connections: int):
        self._slots = threading.BoundedSemaphore(max_connections)
        self._control = threading.BoundedSemaphore(CONTROL_CONNS)
        self._idle = threading.Condition()       # guards the three below
        self._busy = 0                           # requests being answered
        self._conns: dict[socket.socket, threading.BoundedSemaphore] = {}   # open ones, by the slot held
        self._handed: set[socket.socket] = set()     # given to the lingerer: not closed here
        self.lingerer = _Lingerer()
        super().__init__(address, handler)

    def process_request(self, request, client_address):
        slot = next((sem for sem in (self._slots, self._control) if sem.acquire(blocking=False)), None)
        if slot is None:
            # over the connection limit and the control connections: counted (before the client
            # can see the answer), answered without a thread, closed
            self.RequestHandlerClass.front.metrics.refused.labels("connections").inc()
            try:
                body = json.dumps({"error": {"message": "too many connections", "type": "rate_limit_error",
                                             "param": None, "code": "busy"}}).encode()
                request.sendall(b"HTTP/1.1 429 Too Many Requests\r\nContent-Type: application/json\r\n"
                                b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            except OSError:
                pass
            self.lingerer.add(request)                  # the request's bytes are unread
            return
        with self._idle:
            self._conns[request] = slot
        super().process_request(request, client_address)

    def control_only(self, request) -> bool:
        """A connection past the limit: CONTROL_PATHS answered, anything else refused (429)."""
        with self._idle:
            return self._conns.get(request) is self._control

    def linger(self, request) -> None:
        """A handler's connection whose request body was left unread: closed by the lingerer."""
        with self._idle:
            self._handed.add(request)
        self.lingerer.add(request)

    def shutdown_request(self, request):
        with self._idle:
            handed = request in self._handed
            self._handed.discard(request)
        if not handed:
            super().shutdown_request(request)

    def server_close(self):
        super().server_close()
        self.lingerer.close()

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._idle:
                self._conns.pop(request).release()

    def handle_error(self, request, client_address):
        """A client that resets or stalls its connection is routine under load: one debug line, not
        socketserver's traceback on stderr."""
        err = sys.exc_info()[1]
        if isinstance(err, (ConnectionError, TimeoutError)):
            log.debug("connection from %s: %s", client_address, err)
        else:
            log.exception("connection from %s failed", client_address)

    def answering(self, delta: int) -> None:
        with self._idle:
            self._busy += delta
            self._idle.notify_all()

    def wait_idle(self, timeout: float) -> bool:
        with self._idle:
            return self._idle.wait_for(lambda: self._busy == 0, timeout)

    def close_connections(self) -> None:
        with self._idle:
            conns = list(self._conns)
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def _announces_body(headers) -> bool:
    """Whether a request's headers say a body follows (a Content-Length other than 0, or chunks)."""
    return headers.get("Content-Length", "0").strip() != "0" or "Transfer-Encoding" in headers


class _Lingerer:
    """Lingering closes on one thread: `add(conn)` shuts conn's sending side (the answer is
    already written) and hands it over; the thread discards what still arrives until EOF, LINGER_S
    or LINGER_BYTES, then closes it. `close()` closes every held connection and ends the thread."""

    def __init__(self, limit: int = LINGER_CONNS):
        self._limit = limit
        self._lock = threading.Lock()            # guards the three below
        self._new: list[socket.socket] = []
        self.held = 0                            # connections handed over and not yet closed
        self._closing = False
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._sel.register(self._wake_r, selectors.EVENT_READ)
        self._thread = threading.Thread(target=self._run, name="http-linger", daemon=True)
        self._thread.start()

    def add(self, conn: socket.socket) -> None:
        try:
            conn.shutdown(socket.SHUT_WR)
        except OSError:                              # already reset by the client
            pass
        with self._lock:
            take = not self._closing and self.held < self._limit
            if take:
                self.held += 1
                self._new.append(conn)
        if not take:
            conn.close()
            return
        try:
            self._wake_w.send(b"\0")
        except OSError:                              # closed meanwhile: its thread closed conn
            pass

    def close(self) -> None:
        with self._lock:
            if self._closing:
                return
            self._closing = True
        self._wake_w.send(b"\0")
        self._thread.join(10)
        self._wake_w.close()

    def _run(self) -> None:
        left: dict[socket.socket, list] = {}         # conn -> [deadline, bytes it may still send]

        def drop(conn: socket.socket) -> None:
            try:
                self._sel.unregister(conn)
            except (KeyError, ValueError):               # never registered: its fd was gone
                pass
            conn.close()
            del left[conn]
            with self._lock:
                self.held -= 1

        while True:
            soonest = min((d for d, _ in left.values()), default=None)
            ready = self._sel.select(None if soonest is None else max(0.0, soonest - time.monotonic()))
            for key, _ in ready:
                conn = key.fileobj
                if conn is self._wake_r:
                    while True:
                        try:
                            if not conn.recv(4096):
                                break
                        except BlockingIOError:
                            break
                    with self._lock:
                        new, self._new, closing = self._new, [], self._closing
                    for c in new:
                        left[c] = [time.monotonic() + LINGER_S, LINGER_BYTES]
                        try:
                            c.setblocking(False)
                            self._sel.register(c, selectors.EVENT_READ)
                        except (OSError, ValueError):        # closed or reset meanwhile
                            drop(c)
                    if closing:
                        for c in list(left):
                            drop(c)
                        self._sel.close()
                        self._wake_r.close()
                        return
                    continue
                try:
                    got = len(conn.recv(1 << 16))
                except BlockingIOError:
                    continue
                except OSError:                      # a reset: the client is gone
                    got = 0
                left[conn][1] -= got
                if not got or left[conn][1] <= 0:
                    drop(conn)
            now = time.monotonic()
            for c in [c for c, (d, _) in left.items() if d <= now]:
                drop(c)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "v41-serve"
    timeout = SOCKET_TIMEOUT_S
    front: HttpFrontend

    def log_message(self, fmt, *args):
        log.debug("%s %s", self.address_string(), fmt % args)

    def setup(self):
        super().setup()
        self.control_only = self.server.control_only(self.connection)
        if self.control_only:
            self.connection.settimeout(CONTROL_TIMEOUT_S)

    def finish(self):
        super().finish()
        headers = getattr(self, "headers", None)         # None: the request line itself was refused
        if (self.close_connection and headers is not None and _announces_body(headers)
                and getattr(self, "_read_for", None) is not headers):
            self.server.linger(self.connection)

    def send_error(self, code, message=None, explain=None):
        """The stdlib's own refusals (a malformed request line, headers too long or too many, a
        method no handler names: 501) in the JSON shape of ours, on a closed connection."""
        self.close_connection = True
        self._error(HttpError(code, message or HTTPStatus(code).phrase))

    # ---- routing -------------------------------------------------------------------------------
    def do_GET(self):
        if _announces_body(self.headers):
            self.close_connection = True       # a body a GET never reads would start the next request
        path = self.path.split("?", 1)[0]
        one = {path: lambda: self._retrieve(unquote(path[len(MODEL_PREFIX):]))} if path.startswith(MODEL_PREFIX) else {}
        self._route({"/health": self._health, "/v1/models": self._models, "/metrics": self._metrics, **one}, "GET")

    def do_POST(self):
        self._route({"/v1/completions": lambda: self._generate(chat=False),
                     "/v1/chat/completions": lambda: self._generate(chat=True)}, "POST")

    def _not_allowed(self):
        """Any other method: a JSON 405 naming the two this server answers (the stdlib would
        answer an HTML 501); the connection closed, as its body (if any) is never read."""
        self.close_connection = True
        self._route({}, self.command)

    do_PUT = do_DELETE = do_PATCH = do_OPTIONS = do_HEAD = do_TRACE = do_CONNECT = _not_allowed

    def _route(self, routes, method):
        self.server.answering(1)
        try:
            self._answer(routes, method)
        finally:
            self.server.answering(-1)

    def _answer(self, routes, method):
        path = self.path.split("?", 1)[0]
        try:
            if self.control_only:
                self.close_connection = True            # one answer a control connection
                if path not in CONTROL_PATHS:
                    self.front.metrics.refused.labels("connections").inc()
                    raise HttpError(429, "too many connections", code="busy")
            if path != "/health" and not self._authorized():
                self.front.metrics.refused.labels("unauthenticated").inc()
                self.close_connection = True            # its body (if any) is never read
                raise HttpError(401, "a valid 'Authorization: Bearer <key>' header is required")
            if method not in ("GET", "POST"):
                raise HttpError(405, f"method {method} not allowed: this server answers GET and POST")
            if path not in routes:
                self.close_connection = True
                other = "POST" if method == "GET" else "GET"
                raise HttpError(404, f"no {method} {path} (this server has: {', '.join(sorted(routes))} by "
                                     f"{method}, and others by {other})")
            routes[path]()
        except HttpError as err:
            self._error(err)
        except (BrokenPipeError, ConnectionResetError, socket.timeout):
            self.close_connection = True
        except Exception:                                  # noqa: BLE001 - a bug answers 500, never kills
            log.exception("HTTP %s %s failed", method, path)
            self.close_connection = True
            try:
                self._error(HttpError(500, "internal error (logged by the server)"))
            except OSError:
                pass

    def _authorized(self) -> bool:
        want = self.front.key
        return want is None or hmac.compare_digest(self.headers.get("Authorization", "").encode(), want)

    # ---- responses -----------------------------------------------------------------------------
    def _send(self, status: int, body: bytes, ctype: str = "application/json", headers=()):
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for k, v in headers:
            self.send_header(k, v)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":            # a HEAD answer has the headers alone (HTTP)
            self.wfile.write(body)

    def _json(self, status: int, obj) -> None:
        self._send(status, json.dumps(obj).encode())

    def _error(self, err: HttpError) -> None:
        headers = {401: [("WWW-Authenticate", "Bearer")], 405: [("Allow", "GET, POST")]}.get(err.status, [])
        body = {"error": {"message": err.message, "type": ERROR_TYPE.get(err.status, "invalid_request_error"),
                          "param": err.param, "code": err.code}}
        self._send(err.status, json.dumps(body).encode(), headers=headers)

    def _health(self):
        state = self.front.loop.state
        self._json(200 if state == State.SERVING else 503, {"status": state.value})

    def _model(self) -> dict:
        f = self.front
        return {"id": f.api.model_name, "object": "model", "created": f.created, "owned_by": "v41-jax"}

    def _models(self):
        self._json(200, {"object": "list", "data": [self._model()]})

    def _served(self, name) -> None:
        """404 `model_not_found` unless `name` is the served model (a request's `model`, a retrieve)."""
        if name != self.front.api.model_name:
            raise HttpError(404, f"this server serves {show(self.front.api.model_name)}, not {show(name)}", "model",
                            "model_not_found")

    def _retrieve(self, name: str):
        """OpenAI's retrieve (`GET /v1/models/<name>`, the name %-quoted or not)."""
        self._served(name)
        self._json(200, self._model())

    def _metrics(self):
        self._send(200, self.front.metrics.render(), CONTENT_TYPE_LATEST)

    # ---- requests ------------------------------------------------------------------------------
    def _body(self) -> dict:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            self.close_connection = True
            raise HttpError(400, "a request body needs a Content-Length (chunked bodies are not taken)",
                            "Content-Length")
        if len(self.headers.get_all("Content-Length") or ()) > 1:
            self.close_connection = True                # which one frames the body is ambiguous
            raise HttpError(400, "more than one Content-Length header", "Content-Length")
        try:
            length = int(self.headers.get("Content-Length", ""))
            if length < 0:
                raise ValueError
        except ValueError:
            self.close_connection = True
            raise HttpError(400, "a request body needs a valid Content-Length", "Content-Length") from None
        limit = self.front.api.limits.max_message_bytes
        if length > limit:
            self.close_connection = True                # the body is not read
            raise HttpError(413, f"the body is {length} bytes, over the limit of {limit}", "Content-Length")
        data = self.rfile.read(length)
        self._read_for = self.headers                      # this request's body is consumed (`finish`)
        if len(data) < length:
            self.close_connection = True
            raise HttpError(400, "the body ended before its Content-Length", "Content-Length")
        ctype = self.headers.get("Content-Type", "")
        if ctype.split(";")[0].strip().lower() != "application/json":
            raise HttpError(400, f"must be application/json, got {ctype!r}", "Content-Type")
        try:
            obj = decode_json(data)
        except RequestError as err:
            raise HttpError(400, err.message, err.field) from None
        if not isinstance(obj, dict):
            raise HttpError(400, "the body must be a JSON object", "body")
        return obj

    def _fields(self, body: dict, chat: bool) -> tuple[dict, dict, bool, bool]:
        """An OpenAI body -> (request_parse fields, names for refusals, stream, include_usage)."""
        known = KNOWN["chat" if chat else "completions"]
        for k in body:
            if k not in known:
                raise Refused("invalid", f"unknown or unsupported field (known: {', '.join(known)})", k)
        body = {k: v for k, v in body.items() if v is not None}   # JSON null: not given (OpenAI's reading)
        if "model" in body:
            self._served(body["model"])
        if body.get("n", 1) != 1 or isinstance(body.get("n"), bool):
            raise Refused("invalid", "only n = 1 is served", "n")
        for k, (want, instead) in {**NEUTRAL, **NEUTRAL_BY["chat" if chat else "completions"]}.items():
            if k in body and not _same_json(body[k], want):
                raise Refused("invalid", f"this server {instead}: must be {json.dumps(want)} or absent, got "
                                         f"{show(body[k])}", k)
        logprobs = self._wants_logprobs(body, chat)
        if "user" in body and not isinstance(body["user"], str):
            raise Refused("invalid", "must be a string", "user")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise Refused("invalid", "must be true or false", "stream")
        opts = body.get("stream_options", {})
        if not isinstance(opts, dict) or set(opts) - {"include_usage"} \
                or not isinstance(opts.get("include_usage", False), bool):
            raise Refused("invalid", "must be {\"include_usage\": true|false}", "stream_options")
        if "max_tokens" in body and "max_completion_tokens" in body:
            raise Refused("invalid", "give one of max_tokens and max_completion_tokens", "max_completion_tokens")
        fields = {RENAME.get(k, k): v for k, v in body.items() if k in PASS or k in RENAME}
        fields["logprobs"] = logprobs
        names = {RENAME[k]: k for k in body if k in RENAME}
        if chat:
            fields["prompt"] = chat_prompt(body.get("messages"))
            names["prompt"] = "messages"
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
                prompt = prompt[0]
            if isinstance(prompt, list) and all(isinstance(t, str) for t in prompt) and prompt:
                raise Refused("invalid", "one prompt per request (a string or a list of token ids)", "prompt")
            if "prompt" in body:
                fields["prompt_ids" if isinstance(prompt, list) else "prompt"] = prompt
            names["prompt_ids"] = "prompt"
        return fields, names, stream, bool(opts.get("include_usage", False))

    @staticmethod
    def _wants_logprobs(body: dict, chat: bool) -> bool:
        """OpenAI's log-probability fields -> whether to return the sampled tokens' log-probabilities.
        Only those are computed (the step returns no alternatives), so a request for the top
        alternatives is refused rather than answered with fewer than asked."""
        none = "only the sampled tokens' log-probabilities are served (no top alternatives)"
        if chat:
            want = body.get("logprobs", False)
            if want is None:
                want = False
            if not isinstance(want, bool):
                raise Refused("invalid", "must be true or false", "logprobs")
            top = body.get("top_logprobs")
            if top is not None and (isinstance(top, bool) or not isinstance(top, int) or top < 0):
                raise Refused("invalid", "must be a non-negative integer", "top_logprobs")
            if top:
                raise Refused("invalid", f"{none}: top_logprobs must be 0", "top_logprobs")
            return want
        want = body.get("logprobs")
        if want is None:
            return False
        if isinstance(want, bool) or not isinstance(want, int) or want < 0:
            raise Refused("invalid", "must be a non-negative integer or null", "logprobs")
        if want:
            raise Refused("invalid", f"{none}: logprobs must be 0", "logprobs")
        return True

    def _logprobs(self, ids, lps, chat: bool) -> dict | None:
        """The OpenAI form of the tokens' log-probabilities (None when not asked for)."""
        if lps is None:
            return None
        tok = self.front.api.tokenizer
        pieces = [tok.decode([t]) if tok is not None else "" for t in ids]
        if chat:
            return {"content": [{"token": p, "logprob": lp, "top_logprobs": [],
                                 "bytes": token_bytes(tok, t) if tok is not None else []}
                                for t, p, lp in zip(ids, pieces, lps)]}
        return {"tokens": pieces, "token_logprobs": list(lps), "top_logprobs": None}

    def _generate(self, chat: bool):
        front = self.front
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        try:
            fields, names, stream_mode, usage = self._fields(self._body(), chat)
            job = front.api.build(fields, rid, names)
            stream = front.loop.submit(job.request, timeout_s=front.api.limits.request_timeout_s or None)
        except Refused as err:
            front.metrics.refused.labels(err.kind).inc()
            raise _refusal(err) from None
        except HttpError:
            front.metrics.refused.labels("invalid").inc()
            raise
        try:
            if stream_mode:
                self._stream(stream, job, rid, chat, usage)
            else:
                self._whole(stream, job, rid, chat)
        except BaseException:
            stream.cancel("client disconnected")       # a failed write: free the request now
            raise

    def _connected(self) -> bool:
        """False once the client has closed its end (readable with nothing to read). `poll`, not
        `select`: select refuses descriptors >= 1024, which a busy server's sockets reach."""
        try:
            poller = select.poll()
            poller.register(self.connection, select.POLLIN)
            if not poller.poll(0):
                return True
            return self.connection.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
        except BlockingIOError:
            return True
        except (OSError, ValueError):
            return False

    def _envelope(self, rid, chat: bool, chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if chat else "text_completion"
        return {"id": rid, "object": kind, "created": int(time.time()), "model": self.front.api.model_name}

    @staticmethod
    def _usage(prompt: int, completion: int) -> dict:
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def _whole(self, stream, job, rid, chat):
        text = self.front.api.text(job.stop)
        parts, ids, lps, finish = [], [], [] if job.request.logprobs else None, None
        for ev in stream.events(self._connected):
            if isinstance(ev, FinishEvent):
                finish = ev.result
            elif not text.stopped:
                parts.append(text.push(ev.tokens))
                ids += ev.tokens[:text.taken]
                if lps is not None:
                    lps += ev.logprobs[:text.taken]
                if text.stopped:
                    stream.stop()
        if finish is None:                                 # the client left
            self.close_connection = True
            return
        if finish.finish_reason == "error" and not text.stopped:
            raise HttpError(500, f"the engine failed this request: {finish.error}", None, "engine_error")
        parts.append(text.flush())
        reason = "stop" if text.stopped else FINISH[finish.finish_reason]
        content = "".join(parts)
        choice = {"index": 0, "finish_reason": reason, "token_ids": ids, "logprobs": self._logprobs(ids, lps, chat)}
        if chat:
            choice["message"] = {"role": "assistant", "content": content}
        else:
            choice["text"] = content
        out = self._envelope(rid, chat, chunk=False)
        out.update(choices=[choice], usage=self._usage(stream.prompt_len, len(ids)))
        self._json(200, out)

    def _stream(self, stream, job, rid, chat, usage):
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        text = self.front.api.text(job.stop)
        n = 0

        def send(obj) -> None:
            data = b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.flush()

        def chunk(delta_text: str, ids, reason=None, lps=None) -> dict:
            choice = {"index": 0, "finish_reason": reason, "token_ids": list(ids),
                      "logprobs": self._logprobs(ids, lps, chat)}
            if chat:
                choice["delta"] = {"content": delta_text} if delta_text or reason is None else {}
            else:
                choice["text"] = delta_text
            out = self._envelope(rid, chat, chunk=True)
            out["choices"] = [choice]
            return out

        if chat:
            first = chunk("", ())
            first["choices"][0]["delta"] = {"role": "assistant", "content": ""}
            send(first)
        for ev in stream.events(self._connected):
            if isinstance(ev, FinishEvent):
                res = ev.result
                if res.finish_reason == "error" and not text.stopped:
                    send({"error": {"message": f"the engine failed this request: {res.error}",
                                    "type": "server_error", "param": None, "code": "engine_error"}})
                else:
                    send(chunk(text.flush(), (), "stop" if text.stopped else FINISH[res.finish_reason]))
                    if usage:
                        tail = self._envelope(rid, chat, chunk=True)
                        tail.update(choices=[], usage=self._usage(stream.prompt_len, n))
                        send(tail)
                send(b"[DONE]")
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()
                return
            if text.stopped:
                continue
            delta = text.push(ev.tokens)
            n += text.taken
            send(chunk(delta, ev.tokens[:text.taken], lps=ev.logprobs and ev.logprobs[:text.taken]))
            if text.stopped:
                stream.stop()
        self.close_connection = True                       # the client left mid-stream
