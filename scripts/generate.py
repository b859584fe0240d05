"""Offline batch generation over the cache and the jitted step (continuous batching).

    python -m scripts.generate --checkpoint DIR --prompts P.jsonl [--out OUT.jsonl]
        [--tokenizer tokenizer.json] [--max-new-tokens 32] [--temperature 0] [--top-k 0]
        [--top-p 1] [--seed 0] [--max-batch 4] [--chunk 64] [--numerics fast]

Input JSONL, one request per line: {"id": ..., "prompt": "text"} (needs --tokenizer) or
{"id": ..., "prompt_ids": [ints]}; optional per-line "max_new_tokens", "temperature", "top_k",
"top_p", "seed", "stop_ids", "ignore_eos". Output JSONL (to --out, else stdout): id, prompt_len,
tokens, text (with a tokenizer), finish_reason, error. A bad request gets an error line; the
others run unaffected. The closing summary goes to stderr: requests, generated tokens, tokens/s,
steps, compile time vs run time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import jax
from tqdm.auto import tqdm

from v41_jax.cache.geometry import EngineSettings, typed_format
from v41_jax.checkpoint.load import EXPERT_HOLDS, load_params
from v41_jax.engram_hash import load_token_map, token_map_from_tokenizer
from v41_jax.model.numerics import Numerics
from v41_jax.runtime.engine import (CompileMeter, Engine, Request, Stats, default_buckets,
                                    parse_buckets)
from v41_jax.runtime.sampling import SamplingParams

NUMERICS = {"reference": Numerics.reference, "fast": Numerics.fast, "fp32": Numerics.fp32}


def read_requests(path: str, args, tokenizer) -> list[Request]:
    out = []
    with open(path) as f:
        for i, line in enumerate(l for l in f if l.strip()):
            row = json.loads(line)
            if "prompt_ids" in row:
                ids = [int(t) for t in row["prompt_ids"]]
            elif tokenizer is None:
                raise SystemExit(f"{path}:{i + 1}: a text prompt needs --tokenizer")
            else:
                ids = tokenizer.encode(row["prompt"]).ids
            sampling = SamplingParams(temperature=row.get("temperature", args.temperature),
                                      top_k=row.get("top_k", args.top_k), top_p=row.get("top_p", args.top_p),
                                      seed=row.get("seed", args.seed))
            out.append(Request(ids, row.get("max_new_tokens", args.max_new_tokens), sampling,
                               tuple(row.get("stop_ids", args.stop_ids)),
                               row.get("ignore_eos", args.ignore_eos), row.get("id", i)))
    return out


def build_engine(args, tokenizer) -> Engine:
    cfg, params = load_params(args.checkpoint, progress=not args.quiet, experts=args.experts)
    ckpt = Path(args.checkpoint)
    if (ckpt / "engram_token_map.json").exists():
        token_map = load_token_map(ckpt / "engram_token_map.json")
    elif tokenizer is not None and cfg.engram_layer_ids:
        token_map = token_map_from_tokenizer(tokenizer, cfg.engram_compressed_vocab_size)
    else:
        token_map = None
    numerics = NUMERICS[args.numerics]()
    fmt = typed_format(numerics.act_dtype)
    max_context = args.max_context or cfg.max_seq_len
    buckets = parse_buckets(args.buckets) if args.buckets else default_buckets(args.max_batch, args.chunk)
    pages_per_request = -(-max_context // args.page_tokens)
    settings = EngineSettings(page_tokens=args.page_tokens,
                              num_pages=args.pages or buckets.max_requests * pages_per_request + 1,
                              slots=max(args.slots, buckets.max_requests), max_context=max_context,
                              kv_format=fmt, index_format=fmt)
    return Engine(params, cfg, settings=settings, buckets=buckets, numerics=numerics, token_map=token_map,
                  prefill_chunk=args.chunk)


def _tokenizer(args):
    if not args.tokenizer:
        return None
    from tokenizers import Tokenizer
    return Tokenizer.from_file(args.tokenizer)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--prompts", required=True, help="JSONL, one request per line")
    ap.add_argument("--out", help="JSONL results (default: stdout)")
    ap.add_argument("--tokenizer", help="tokenizer.json for text prompts and decoded output")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--stop-ids", type=int, nargs="*", default=())
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument("--max-batch", type=int, default=4, help="requests per step")
    ap.add_argument("--chunk", type=int, default=64, help="prefill rows per step")
    ap.add_argument("--buckets", help="explicit step shapes TxRxO,... (tokens x requests x logits)")
    ap.add_argument("--page-tokens", type=int, default=16)
    ap.add_argument("--pages", type=int, default=0, help="PAGE pool size (default: max-batch full contexts)")
    ap.add_argument("--slots", type=int, default=0, help="STATE slots (default: max-batch)")
    ap.add_argument("--max-context", type=int, default=0, help="tokens per request (default: config)")
    ap.add_argument("--numerics", choices=sorted(NUMERICS), default="fast")
    ap.add_argument("--experts", choices=EXPERT_HOLDS, default="auto",
                    help="how the routed experts are held (auto: fp8 on a GPU, bf16 on CPU; fp8: "
                         "fastest decode kernels; bf16: fastest prefill)")
    ap.add_argument("--xla-cache", default=os.path.join(os.path.expanduser("~"), ".cache", "v41-jax", "xla"),
                    help="persistent compilation cache directory ('' disables): a re-run skips compiling")
    ap.add_argument("--quiet", action="store_true", help="no progress bars")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.xla_cache:
        jax.config.update("jax_compilation_cache_dir", args.xla_cache)
    tokenizer = _tokenizer(args)
    engine = build_engine(args, tokenizer)
    requests = read_requests(args.prompts, args, tokenizer)
    stats = Stats()
    before = CompileMeter.seconds
    engine.warmup()                                  # every bucket compiled before the clock runs
    stats.compile_s = CompileMeter.seconds - before
    with tqdm(total=sum(r.max_new_tokens for r in requests), unit="tok", disable=args.quiet,
              file=sys.stderr) as bar:
        results = engine.generate(requests, on_step=bar.update, stats=stats)
    out = open(args.out, "w") if args.out else sys.stdout
    try:
        for res in results:
            row = {"id": res.request_id, "prompt_len": res.prompt_len, "tokens": res.tokens,
                   "finish_reason": res.finish_reason}
            if tokenizer is not None:
                row["text"] = tokenizer.decode(res.tokens)
            if res.error:
                row["error"] = res.error
            out.write(json.dumps(row) + "\n")
    finally:
        if args.out:
            out.close()
    errors = sum(r.error is not None for r in results)
    print(f"summary: {stats.requests} requests ({errors} refused), {stats.prompt_tokens} prompt tokens, "
          f"{stats.generated_tokens} generated tokens in {stats.steps} steps, "
          f"{stats.tokens_per_s:.1f} tokens/s; compile {stats.compile_s:.1f} s, run {stats.run_s:.1f} s "
          f"({jax.default_backend()}, {args.numerics} numerics)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
