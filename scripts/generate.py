"""Offline generation: a JSONL file of requests through the engine (continuous batching).

    python -m scripts.generate --checkpoint DIR --prompts P.jsonl [--out OUT.jsonl] [--stream] ...

Input, one JSON object per line:

    {"id": "a", "prompt": "text"}              text prompt (needs a tokenizer: tokenizer.json in the
                                               checkpoint folder, or --tokenizer)
    {"id": "b", "prompt_ids": [5, 6, 7]}       token ids in [0, vocab)
    optional per line: id (string or int; default: the line's index among the non-blank lines),
    max_new_tokens (int >= 1), temperature (>= 0, 0 = greedy), top_k (int >= 0,
    0 = off), top_p (0 < p <= 1), seed (int in [0, 2**32)), stop_ids (list of ids), ignore_eos
    (bool), logprobs (bool); absent fields take the flags below. Unknown fields and an id used by
    an earlier line are refused. Example line:
    {"id": "q1", "prompt_ids": [5, 6, 7], "max_new_tokens": 16, "temperature": 0.7, "seed": 1}

Output, one JSON object per request in input order (to --out, else stdout): id, prompt_len,
tokens, text (with a tokenizer), finish_reason (eos | stop | length | error), error, logprobs.
A bad line gets its own error line (file, line number and field) and the others run. Arguments
and the prompts file are checked before the checkpoint loads; a file without one valid request
compiles nothing. The summary (stderr) gives tokens/s, TTFT and inter-token latency p50/p95 and
compile vs run time. --stream prints `[id] <tokens or text>` per token event and `[id] <reason>` at
the end of each request (stderr). Exit code 2 for a usage error (one line, no traceback).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from v41_jax.cache.geometry import INDEX_PACKED, KV_PACKED
from v41_jax.config import exit_2_on_refusal
from v41_jax.runtime import compile_cache
from v41_jax.runtime.metadata import DEFAULT_MAX_BATCH, DEFAULT_NUMERICS

NUMERICS_CHOICES = ("fast", "fp32", "reference")
EXPERT_CHOICES = ("auto", "fp8", "fp4", "bf16")
DENSE_CHOICES = ("auto", "fp8", "bf16")
INDEX_CHOICES = ("typed", INDEX_PACKED)
KV_CHOICES = ("typed", KV_PACKED)
KV_HELP = ("the cache's main and window rows: typed = the activation dtype (default); packed = FP4 main and "
           "FP8 window rows, exact under fast / reference numerics (their own grids): 0.28 / 0.52 of bf16's "
           "bytes (2.35x the tokens a cache holds), the same values read back; decode steps of the bench slice at 32K "
           "context 2.5-5.5 %% slower on an H100 (the sparse attention decodes the rows after its gather)")
INDEX_HELP = ("the cache's index rows: typed = the activation dtype (default); fp4 = packed FP4, exact under "
              "fast / reference numerics (the keys' own grid): a quarter of the index bytes, 15 %% less cache, "
              "the indexer's scoring up to 21 %% slower")


class UsageError(Exception):
    """A bad argument or input file: printed as one line, exit code 2."""


def _positive(name: str, allow_zero: bool = False):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name}: {text!r} is not an integer") from None
        if v < 0 or (v == 0 and not allow_zero):
            raise argparse.ArgumentTypeError(f"{name}: must be {'>= 0' if allow_zero else '>= 1'}, got {v}")
        return v
    return parse


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m scripts.generate", description=__doc__.split("\n\n")[0],
                                 epilog=__doc__[__doc__.index("Input,"):], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True, help="published-format checkpoint folder (config.json, shards)")
    ap.add_argument("--prompts", required=True, help="JSONL file of requests (schema below)")
    ap.add_argument("--out", help="write results here as JSONL (default: stdout)")
    ap.add_argument("--tokenizer", help="tokenizer.json (default: the checkpoint folder's, if any)")
    ap.add_argument("--stream", action="store_true", help="print each request's tokens (text with a tokenizer) "
                    "to stderr as they come")
    ap.add_argument("--max-new-tokens", type=_positive("--max-new-tokens"), default=32,
                    help="new tokens per request unless the line says (capped by the context limit)")
    ap.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0 = greedy)")
    ap.add_argument("--top-k", type=_positive("--top-k", True), default=0, help="keep the k most likely tokens (0 = off)")
    ap.add_argument("--top-p", type=float, default=1.0, help="nucleus mass in (0, 1]")
    ap.add_argument("--seed", type=_positive("--seed", True), default=0, help="sampling seed in [0, 2**32)")
    ap.add_argument("--stop-ids", type=_positive("--stop-ids", True), nargs="*", default=(),
                    help="token ids that end a request")
    ap.add_argument("--ignore-eos", action="store_true", help="do not stop at the end-of-sequence token")
    ap.add_argument("--max-batch", type=_positive("--max-batch"), default=DEFAULT_MAX_BATCH, help="requests per step")
    ap.add_argument("--chunk", type=_positive("--chunk"), default=64, help="prefill rows per step")
    ap.add_argument("--buckets", help="explicit step shapes TxRxO,... (tokens x requests x logits rows; "
                    "one must hold the most of each)")
    ap.add_argument("--decode-sizes", help="request counts that get a decode step shape of their own, e.g. "
                    "1,2,4 (default: the powers of two up to --max-batch on a GPU, --max-batch alone on a CPU)")
    ap.add_argument("--one-bucket", action="store_true",
                    help="one step shape, the prefill bucket, for decode steps too: half the compiling of a "
                         "first run, decode steps padded to it (make generate on a CPU)")
    ap.add_argument("--scan-layers", action="store_true",
                    help="compile each run of identical layers once (a scanned loop): about half the compile time")
    ap.add_argument("--index-format", choices=INDEX_CHOICES, default=None,
                    help=INDEX_HELP)
    ap.add_argument("--kv-format", choices=KV_CHOICES, default=None, help=KV_HELP)
    ap.add_argument("--page-tokens", type=_positive("--page-tokens"), default=16, help="tokens per cache page")
    ap.add_argument("--pages", type=_positive("--pages", True), default=0,
                    help="page pool size (default: max-batch full contexts)")
    ap.add_argument("--slots", type=_positive("--slots", True), default=0, help="STATE slots (default: max-batch)")
    ap.add_argument("--max-context", type=_positive("--max-context", True), default=0,
                    help="tokens per request, prompt included (default: the config's)")
    ap.add_argument("--numerics", choices=NUMERICS_CHOICES, default=DEFAULT_NUMERICS,
                    help="fast: bf16 activations; fp32; reference: the official rounding points")
    ap.add_argument("--experts", choices=EXPERT_CHOICES, default="auto",
                    help="how the routed experts are held (auto: fp8 on a GPU, bf16 on CPU)")
    ap.add_argument("--dense", choices=DENSE_CHOICES, default="auto",
                    help="how the dense FP8 weights are held (fp8: as published, read by the dense_fp8 "
                         "kernel at decode; auto: bf16)")
    ap.add_argument("--compile-cache", default=None,
                    help=f"persistent compilation cache folder ('' disables; default ${compile_cache.ENV} "
                         f"or {compile_cache.DEFAULT})")
    ap.add_argument("--speculative", choices=("on", "off"), default="on",
                    help="DSpark speculative decoding when the checkpoint has draft stages (a request's "
                         "\"speculative\": false turns it off for that request)")
    ap.add_argument("--draft-width", type=_positive("--draft-width"), default=None,
                    help="drafts per verify step: must be the checkpoint's dspark_block_size (the default)")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    return ap


def parse_args(argv=None):
    return build_parser().parse_args(argv)


def check_shape_flags(buckets: str | None, decode_sizes: str | None, max_batch: int) -> None:
    """--buckets / --decode-sizes (shared with v41-serve): each well formed, not both."""
    from v41_jax.runtime.engine import check_decode_sizes, parse_buckets, parse_decode_sizes

    if buckets and decode_sizes is not None:
        raise UsageError("--decode-sizes: not with --buckets (it picks the buckets)")
    for flag, check in (("--buckets", lambda: buckets and parse_buckets(buckets)),
                        ("--decode-sizes", lambda: decode_sizes is not None and
                         check_decode_sizes(parse_decode_sizes(decode_sizes), max_batch))):
        try:
            check()
        except ValueError as err:
            raise UsageError(f"{flag}: {err}") from None


def check_row_format_flags(index_format: str | None, kv_format: str | None, numerics: str | None) -> None:
    """--index-format / --kv-format (shared with v41-serve): rows the step reads back exactly under
    --numerics (None: the engine's default)."""
    from v41_jax.cache.geometry import row_formats
    from v41_jax.runtime.engine import NUMERICS
    from v41_jax.runtime.step import check_row_formats

    num = NUMERICS[numerics or DEFAULT_NUMERICS]()
    try:
        check_row_formats(num, **row_formats(num, index_format, kv_format))
    except ValueError as err:
        flags = " ".join(f"{f} {v}" for f, v in (("--index-format", index_format), ("--kv-format", kv_format)) if v)
        raise UsageError(f"{flags}: {err}") from None


def _validate(args):
    """Everything checkable without the weights -> (cfg, tokenizer, requests-or-errors)."""
    from v41_jax.checkpoint.load import config_path
    from v41_jax.config import CheckpointError, ModelConfig
    from v41_jax.runtime.engine import check_draft_width, load_tokenizer
    from v41_jax.runtime.request_parse import RequestDefaults, RequestError, parse_file

    ckpt = Path(args.checkpoint)
    if not (ckpt / "config.json").is_file():
        raise UsageError(f"{ckpt}: not a checkpoint folder (no config.json)")
    if not Path(args.prompts).is_file() and args.prompts != "-":
        raise UsageError(f"{args.prompts}: prompts file not found")
    if args.out and not Path(args.out).resolve().parent.is_dir():
        raise UsageError(f"--out {args.out}: its folder does not exist")
    if args.one_bucket and (args.buckets or args.decode_sizes is not None):
        raise UsageError(f"--one-bucket: not with {'--buckets' if args.buckets else '--decode-sizes'} "
                         "(it picks the buckets)")
    check_shape_flags(args.buckets, args.decode_sizes, args.max_batch)
    check_row_format_flags(args.index_format, args.kv_format, args.numerics)
    try:
        defaults = RequestDefaults.from_args(args)
    except RequestError as err:
        raise UsageError(f"--{err.field.replace('_', '-')}: {err.message}") from None
    try:
        cfg = ModelConfig.from_file(config_path(str(ckpt)))
    except CheckpointError as err:   # already `<file>: <field>: <rule>`
        raise UsageError(str(err)) from None
    try:
        check_draft_width(cfg, args.draft_width)
    except ValueError as err:
        raise UsageError(f"--draft-width: {err}") from None
    try:
        tokenizer = load_tokenizer(args.tokenizer, ckpt)
    except Exception as err:  # noqa: BLE001 - any tokenizer failure is a usage error
        raise UsageError(f"--tokenizer: {err}") from None
    source = sys.stdin.buffer if args.prompts == "-" else args.prompts
    parsed = parse_file(source, vocab_size=cfg.vocab_size, defaults=defaults, tokenizer=tokenizer)
    return cfg, tokenizer, parsed


def _percentiles(values) -> str:
    if not values:
        return "n/a"
    p50, p95 = np.percentile(np.asarray(values) * 1e3, [50, 95])
    return f"p50 {p50:.1f} ms, p95 {p95:.1f} ms"


@exit_2_on_refusal   # a checkpoint refused while the engine loads it
def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        cfg, tokenizer, parsed = _validate(args)
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    from v41_jax.runtime.request_parse import RequestError

    requests = [p for p in parsed if not isinstance(p, RequestError)]
    for err in (p for p in parsed if isinstance(p, RequestError)):
        print(f"error: {err}", file=sys.stderr)
    results = {}
    stats = None
    if requests:
        results, stats = _run(args, tokenizer, requests)
    out = open(args.out, "w") if args.out else sys.stdout
    try:
        for p in parsed:
            if isinstance(p, RequestError):
                out.write(json.dumps({"id": p.request_id, "prompt_len": 0, "tokens": [], "finish_reason": "error",
                                      "error": str(p)}) + "\n")
                continue
            res = results[p.request_id]
            row = {"id": res.request_id, "prompt_len": res.prompt_len, "tokens": res.tokens,
                   "finish_reason": res.finish_reason}
            if tokenizer is not None:
                row["text"] = tokenizer.decode(res.tokens)
            if p.logprobs:
                row["logprobs"] = res.logprobs
            if res.error:
                row["error"] = res.error
            out.write(json.dumps(row) + "\n")
    finally:
        if args.out:
            out.close()
    for r in results.values():
        if r.error is not None:                      # refused by the engine (e.g. the context limit)
            print(f"error: request {r.request_id!r}: {r.error}", file=sys.stderr)
    refused = sum(isinstance(p, RequestError) for p in parsed) + sum(r.error is not None for r in results.values())
    if stats is None:
        print(f"summary: {len(parsed)} requests ({refused} refused), nothing to run: loaded and compiled nothing",
              file=sys.stderr)
        return 0
    ttft = [r.ttft_s for r in results.values() if r.ttft_s is not None]
    itl = [b - a for r in results.values() for a, b in zip(r.token_times, r.token_times[1:])]
    print(f"summary: {len(parsed)} requests ({refused} refused), {stats.prompt_tokens} prompt tokens, "
          f"{stats.generated_tokens} generated tokens in {stats.steps} steps, {stats.tokens_per_s:.1f} tokens/s; "
          f"TTFT {_percentiles(ttft)}; inter-token {_percentiles(itl)}; "
          f"compile {stats.compile_s:.1f} s, run {stats.run_s:.1f} s ({stats.backend}, {args.numerics} numerics)",
          file=sys.stderr)
    if stats.verifies:
        print(f"speculative: {stats.verifies} verifies, {stats.tokens_per_verify:.2f} tokens per verify, drafts "
              f"{stats.drafts_accepted}/{stats.drafts_proposed} accepted; acceptance by draft position "
              + " ".join(f"{a:.2f}" for a in stats.acceptance_at), file=sys.stderr)
    return 0


def _run(args, tokenizer, requests):
    """Load, warm up and generate -> ({id: Result}, Stats)."""
    import jax
    from tqdm.auto import tqdm

    from v41_jax.runtime.engine import Engine, Stats
    from v41_jax.runtime.scheduler import FinishEvent, TokenEvent

    engine = Engine.from_checkpoint(args.checkpoint, numerics=args.numerics, experts=args.experts, dense=args.dense,
                                    max_batch=args.max_batch, chunk=args.chunk, buckets=args.buckets,
                                    page_tokens=args.page_tokens, pages=args.pages, slots=args.slots,
                                    max_context=args.max_context, compile_cache_dir=args.compile_cache,
                                    tokenizer=args.tokenizer, progress=not args.quiet,
                                    speculative=None if args.speculative == "on" else False,
                                    draft_width=args.draft_width,
                                    decode_sizes=() if args.one_bucket else args.decode_sizes,
                                    scan_layers=args.scan_layers, index_format=args.index_format,
                                    kv_format=args.kv_format)
    stats = Stats()
    runnable = [r for r in requests if engine.check_request(r) is None]    # the others end at once
    for req in runnable:
        budget = engine.scheduler.budget(req)
        if budget < req.max_new_tokens:
            print(f"note: request {req.request_id!r}: max_new_tokens {req.max_new_tokens} capped to {budget}: "
                  f"prompt {len(req.prompt)} + {budget} = the context limit {engine.geom.max_context}",
                  file=sys.stderr)
    stats.compile_s = engine.warmup()                    # every bucket compiled before the clock runs
    total = sum(engine.scheduler.budget(r) for r in runnable)
    with tqdm(total=total, unit="tok", disable=args.quiet or args.stream, file=sys.stderr) as bar:
        def on_event(e):
            if isinstance(e, TokenEvent):
                bar.update(len(e.tokens))
                if args.stream:
                    piece = tokenizer.decode(list(e.tokens)) if tokenizer is not None else " ".join(map(str, e.tokens))
                    print(f"[{e.rid}] {piece}", file=sys.stderr, flush=True)
            elif isinstance(e, FinishEvent):       # what it will not generate after all
                bar.update(e.result.max_new_tokens - len(e.result.tokens))
                if args.stream:
                    print(f"[{e.rid}] <{e.result.finish_reason}>" + (f" {e.result.error}" if e.result.error else ""),
                          file=sys.stderr, flush=True)

        results = engine.generate(requests, on_event=on_event, stats=stats)
    stats.backend = jax.default_backend()
    return {r.request_id: r for r in results}, stats


if __name__ == "__main__":
    sys.exit(main())
