"""`v41-serve`: one engine loop behind a gRPC server and an OpenAI-compatible HTTP endpoint.

    v41-serve --checkpoint DIR [--grpc-port 50051] [--http-port 8000] [--host 127.0.0.1] [--api-key KEY]

Both listen on 127.0.0.1 unless --host says otherwise; a port of 0 picks a free one, -1 turns that
front end off. Requests that arrive while the engine compiles wait (health says NOT_SERVING until
it is done). SIGTERM or SIGINT: stop admitting (new requests get UNAVAILABLE / 503), let the open
ones finish (at most --drain-timeout seconds, then they are aborted), exit 0. A status line goes to
stderr every --status-every seconds. docs/SERVING.md has the rest.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from pathlib import Path

from serving.api import Api, Limits
from serving.loop import EngineLoop, State
from serving.metrics import Metrics
from v41_jax.config import exit_2_on_refusal

log = logging.getLogger("v41.serve")


class Server:
    """An engine loop and its front ends. grpc_port / http_port: None turns one off, 0 picks a free
    port (the bound ones are `grpc_port` / `http_port` after construction). warmup=False compiles
    on the first request instead of at start."""

    def __init__(self, engine, *, model_name: str = "v41", limits: Limits = Limits(), host: str = "127.0.0.1",
                 grpc_port: int | None = 0, http_port: int | None = 0, api_key: str | None = None,
                 warmup: bool = True, status_every_s: float = 0.0):
        from serving import grpc_server
        from serving.http_server import HttpFrontend

        self.metrics = Metrics()
        self._health = None
        self.loop = EngineLoop(engine, metrics=self.metrics, max_open=limits.max_open, warmup=warmup,
                               status_every_s=status_every_s, on_state=self._on_state)
        self.api = Api(engine, limits, model_name)
        self.grpc = self.http = None
        self.grpc_port = self.http_port = None
        if grpc_port is not None:
            self.grpc, self.grpc_port, self._health = grpc_server.build(self.loop, self.api, self.metrics, host,
                                                                        grpc_port, api_key)
        if http_port is not None:
            self.http = HttpFrontend(self.loop, self.api, self.metrics, host, http_port, api_key)
            self.http_port = self.http.port
        self._ready = threading.Event()

    def _on_state(self, state: State) -> None:
        if self._health is not None:
            from serving.grpc_server import set_health
            set_health(self._health, state)
        if state != State.WARMING:
            self._ready.set()

    def start(self) -> "Server":
        if self.grpc is not None:
            self.grpc.start()
        if self.http is not None:
            self.http.start()
        self.loop.start()
        return self

    def wait_ready(self, timeout: float | None = None) -> bool:
        """True once warm-up has ended (serving, or failed: see `loop.state`)."""
        return self._ready.wait(timeout)

    def shutdown(self, drain_timeout: float = 30.0) -> bool:
        """Stop admitting, drain, stop the front ends -> True if every open request finished."""
        clean = self.loop.drain(drain_timeout)
        if self.grpc is not None:
            self.grpc.stop(grace=5).wait()
        if self.http is not None:
            self.http.stop()
        return clean


def _in_range(name: str, convert, low, high, rule: str):
    """An argparse type: convert(text) within [low, high] (NaN is not), else one line naming the
    flag and the rule."""
    def parse(text: str):
        try:
            v = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name}: {text!r} is not {'an integer' if convert is int else 'a number'}") from None
        if not low <= v <= high:
            raise argparse.ArgumentTypeError(f"{name}: must be {rule}, got {text!r}")
        return v
    return parse


def _port(name: str):
    return _in_range(name, int, -1, 65535, "a TCP port 0-65535 (0: any free one) or -1 (off)")


def _seconds(name: str):   # past TIMEOUT_MAX a wait overflows
    return _in_range(name, float, 0, threading.TIMEOUT_MAX, f"a finite number of seconds in [0, {threading.TIMEOUT_MAX:.4g}]")


def build_parser() -> argparse.ArgumentParser:
    from scripts.generate import (EXPERT_CHOICES, INDEX_CHOICES, INDEX_HELP, KV_CHOICES, KV_HELP, NUMERICS_CHOICES,
                                  _positive)

    ap = argparse.ArgumentParser(prog="v41-serve", description=__doc__.split("\n\n")[0],
                                 epilog=__doc__[__doc__.index("Both"):],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True, help="published-format checkpoint folder")
    ap.add_argument("--model-name", help="the model's name in the API (default: the folder's name)")
    ap.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    ap.add_argument("--grpc-port", type=_port("--grpc-port"), default=50051, help="-1: no gRPC server")
    ap.add_argument("--http-port", type=_port("--http-port"), default=8000, help="-1: no HTTP server")
    ap.add_argument("--api-key", default=os.environ.get("V41_API_KEY"),
                    help="require 'Authorization: Bearer KEY' (gRPC metadata / HTTP header); default $V41_API_KEY")
    ap.add_argument("--tokenizer", help="tokenizer.json (default: the checkpoint folder's, if any)")
    g = ap.add_argument_group("limits")
    g.add_argument("--max-prompt-tokens", type=_positive("--max-prompt-tokens", True), default=0,
                   help="longest prompt taken (0: the context limit)")
    g.add_argument("--max-new-tokens", type=_positive("--max-new-tokens", True), default=0,
                   help="most new tokens a request may ask for (0: the context limit)")
    g.add_argument("--default-max-new-tokens", type=_positive("--default-max-new-tokens"), default=256,
                   help="new tokens for a request that does not say")
    g.add_argument("--max-message-bytes", type=_positive("--max-message-bytes"), default=1 << 20,
                   help="largest request body / gRPC message")
    g.add_argument("--max-open", type=_positive("--max-open"), default=1024,
                   help="requests held at once, queued or running (more: RESOURCE_EXHAUSTED / 429)")
    g.add_argument("--max-streams", type=_positive("--max-streams"), default=256,
                   help="concurrent gRPC Generate streams and, separately, HTTP connections (a few more "
                        "past it: health probes, Abort, /metrics)")
    g.add_argument("--request-timeout", type=_seconds("--request-timeout"), default=0.0,
                   help="abort a request after this many seconds (0: never)")
    g.add_argument("--drain-timeout", type=_seconds("--drain-timeout"), default=30.0, help="on SIGTERM, wait this long for open requests")
    g.add_argument("--status-every", type=_seconds("--status-every"), default=10.0, help="seconds between status lines (0: none)")
    e = ap.add_argument_group("engine (as v41-generate)")
    e.add_argument("--max-batch", type=_positive("--max-batch"), help="requests per step")
    e.add_argument("--chunk", type=_positive("--chunk"), help="prefill rows per step")
    e.add_argument("--buckets", help="explicit step shapes TxRxO,... (one must hold the most of each)")
    e.add_argument("--decode-sizes", help="request counts with a decode step shape of their own, e.g. 1,2,4 "
                   "(default: powers of two up to --max-batch on a GPU)")
    e.add_argument("--page-tokens", type=_positive("--page-tokens"))
    e.add_argument("--pages", type=_positive("--pages", True))
    e.add_argument("--slots", type=_positive("--slots", True))
    e.add_argument("--max-context", type=_positive("--max-context", True))
    e.add_argument("--numerics", choices=NUMERICS_CHOICES)
    e.add_argument("--experts", choices=EXPERT_CHOICES)
    e.add_argument("--speculative", choices=("auto", "on", "off"), default="auto",
                   help="DSpark speculative decoding: auto = on when the checkpoint has draft stages")
    e.add_argument("--index-format", choices=INDEX_CHOICES,
                   help=INDEX_HELP)
    e.add_argument("--kv-format", choices=KV_CHOICES, help=KV_HELP)
    e.add_argument("--scan-layers", action="store_true",
                   help="compile each run of identical layers once (a scanned loop): about half the compile time")
    e.add_argument("--compile-cache", default=None, help="persistent compilation cache folder ('' disables)")
    e.add_argument("--no-warmup", action="store_true", help="compile on the first request instead of at start")
    return ap


def load_engine(args):
    """The engine the parsed flags describe; only the flags given are passed, so the defaults stay
    Engine.from_checkpoint's."""
    from v41_jax.runtime.engine import Engine

    kw = {k: getattr(args, k) for k in ("max_batch", "chunk", "buckets", "decode_sizes", "page_tokens", "pages",
                                        "slots", "max_context", "numerics", "experts", "tokenizer",
                                        "index_format", "kv_format")
          if getattr(args, k) is not None}
    kw["speculative"] = {"auto": None, "on": True, "off": False}[args.speculative]
    kw["scan_layers"] = args.scan_layers
    return Engine.from_checkpoint(args.checkpoint, compile_cache_dir=args.compile_cache, **kw)


@exit_2_on_refusal
def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    # force: importing orbax (via the engine) already gave the root logger absl's default handler
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s",
                        stream=sys.stderr, force=True)
    from scripts.generate import UsageError, check_row_format_flags, check_shape_flags
    from v41_jax.runtime.metadata import DEFAULT_MAX_BATCH

    ckpt = Path(args.checkpoint)
    if not (ckpt / "config.json").is_file():
        print(f"error: {ckpt}: not a checkpoint folder (no config.json)", file=sys.stderr)
        return 2
    try:
        check_shape_flags(args.buckets, args.decode_sizes, args.max_batch or DEFAULT_MAX_BATCH)
        check_row_format_flags(args.index_format, args.kv_format, args.numerics)
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    log.info("loading %s", ckpt)
    engine = load_engine(args)
    limits = Limits(max_prompt_tokens=args.max_prompt_tokens, max_new_tokens=args.max_new_tokens,
                    default_max_new_tokens=args.default_max_new_tokens, max_message_bytes=args.max_message_bytes,
                    max_open=args.max_open, max_streams=args.max_streams, request_timeout_s=args.request_timeout)
    port = lambda p: None if p < 0 else p
    server = Server(engine, model_name=args.model_name or ckpt.resolve().name, limits=limits, host=args.host,
                    grpc_port=port(args.grpc_port), http_port=port(args.http_port), api_key=args.api_key,
                    warmup=not args.no_warmup, status_every_s=args.status_every)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    server.start()
    log.info("listening: gRPC %s, HTTP %s (host %s, api key %s); warming up",
             server.grpc_port if server.grpc else "off", server.http_port if server.http else "off", args.host,
             "required" if args.api_key else "off")
    ready = False
    while not stop.wait(0.5):
        if not ready and server.wait_ready(0):
            ready = True
            log.info("ready: %s", server.loop.state.value)
    log.info("shutting down: draining %d open requests", server.loop.snapshot().open)
    clean = server.shutdown(args.drain_timeout)
    log.info("stopped (%s)", "drained" if clean else "open requests aborted after --drain-timeout")
    return 0


if __name__ == "__main__":
    sys.exit(main())
