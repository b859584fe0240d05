"""`v41-client`: one request to a running v41-serve over gRPC, its text (or token ids) streamed to
the terminal as it comes.

    v41-client "def fib(n):"                       text prompt (the server needs a tokenizer)
    v41-client --ids 5 6 7 --max-new-tokens 16     token ids
    v41-client --info                              the model the server runs
"""

from __future__ import annotations

import argparse
import os
import sys

import grpc

from serving.proto import v41_pb2, v41_pb2_grpc


def sse_events(resp):
    """The JSON objects of a server-sent-events response (an http.client response or any file with
    readline), up to `data: [DONE]`; AssertionError when the stream ends before it."""
    import json

    while True:
        line = resp.readline()
        if not line:
            raise AssertionError("the event stream ended without [DONE]")
        line = line.strip()
        if not line:
            continue
        if not line.startswith(b"data: "):
            raise AssertionError(f"not an SSE data line: {line[:80]!r}")
        data = line[len(b"data: "):]
        if data == b"[DONE]":
            return
        yield json.loads(data)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="v41-client", description=__doc__.split("\n\n")[0])
    ap.add_argument("prompt", nargs="?", help="text prompt")
    ap.add_argument("--ids", type=int, nargs="+", help="prompt token ids instead of text")
    ap.add_argument("--server", default="127.0.0.1:50051", help="gRPC address (default 127.0.0.1:50051)")
    ap.add_argument("--api-key", default=os.environ.get("V41_API_KEY"), help="default $V41_API_KEY")
    ap.add_argument("--max-new-tokens", type=int)
    ap.add_argument("--temperature", type=float)
    ap.add_argument("--top-p", type=float)
    ap.add_argument("--top-k", type=int)
    ap.add_argument("--seed", type=int)
    ap.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    ap.add_argument("--timeout", type=float, help="deadline in seconds")
    ap.add_argument("--info", action="store_true", help="print the server's model info and exit")
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if not args.info and (args.prompt is None) == (args.ids is None):
        print("error: give a text prompt or --ids (one of them)", file=sys.stderr)
        return 2
    meta = [("authorization", f"Bearer {args.api_key}")] if args.api_key else []
    with grpc.insecure_channel(args.server) as channel:
        stub = v41_pb2_grpc.GenerationStub(channel)
        try:
            if args.info:
                print(stub.GetModelInfo(v41_pb2.ModelInfoRequest(), metadata=meta, timeout=args.timeout or 10))
                return 0
            opt = {k: getattr(args, k) for k in ("max_new_tokens", "temperature", "top_p", "top_k", "seed")
                   if getattr(args, k) is not None}
            req = v41_pb2.GenerateRequest(prompt=args.prompt, prompt_ids=args.ids or (), stop=args.stop, **opt)
            for msg in stub.Generate(req, metadata=meta, timeout=args.timeout):
                if msg.HasField("chunk"):
                    c = msg.chunk
                    print(c.text if c.text or args.ids is None else " ".join(map(str, c.token_ids)) + " ",
                          end="", flush=True)
                else:
                    f = msg.final
                    print(f.text)
                    reason = v41_pb2.FinishReason.Name(f.finish_reason)
                    print(f"[{reason}{': ' + f.error if f.error else ''}] {f.completion_tokens} tokens, "
                          f"TTFT {f.ttft_s * 1e3:.0f} ms, {f.tokens_per_s:.1f} tokens/s", file=sys.stderr)
                    return 1 if f.finish_reason == v41_pb2.ERROR else 0
        except grpc.RpcError as err:
            print(f"\nerror: {err.code().name}: {err.details()}", file=sys.stderr)
            return 1
    return 1


if __name__ == "__main__":
    sys.exit(main())
