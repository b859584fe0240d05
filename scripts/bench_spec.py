"""DSpark speculative decoding: what it buys end to end, and what a verify step and the draft cost.

    # end to end on a trained checkpoint (the demo model): tokens/s with and without DSpark
    python -m scripts.bench_spec generate --checkpoint artifacts/demo --prompts scripts/demo_prompts.jsonl \
        --batches 1,8,32 --new 128 --out S.json
    # step costs on random weights (the bench slice)
    python -m scripts.bench_spec steps --config v41_jax/configs/bench_slice.config.json \
        --batches 1,8,32 --out C.json

`generate`: per batch b, b requests (the prompts file cycled; greedy, EOS ignored) through
`Engine.generate`, speculative off and on, one engine each (each run once untimed first, then
`--rounds` timed runs alternating the two); median tokens/s and ms per step of each with their
range over the rounds, the speed-up as the median of the rounds' paired ratios (one run is a
fraction of a second at batch 1, so single runs of the same code were seen to differ by 1.5x), the
measured tokens per verify (drafts accepted + 1), acceptance per draft position, and the share of
requests whose tokens equal the plain run's.

`steps`: per batch b, compiled executables called back to back with their inputs on the device:
a plain decode step (plain engine, b x 1 rows), the same decode step of a speculating engine (it
also drafts: the difference is the draft's cost) and a verify step (b x (block + 1) rows, every
row's logits, acceptance and the draft). verify / plain bounds the speed-up at a measured tokens
per verify t: speed-up <= t * plain / verify.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import jax
import numpy as np

from scripts.bench_common import back_to_back_s
from v41_jax.runtime import compile_cache
from v41_jax.runtime.engine import NUMERICS, Engine, Stats


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="mode", required=True)
    g = sub.add_parser("generate", help="tokens/s with and without DSpark on a checkpoint")
    g.add_argument("--checkpoint", required=True)
    g.add_argument("--prompts", required=True, help="JSONL requests (request_parse schema)")
    g.add_argument("--new", type=int, default=128, help="new tokens per request")
    g.add_argument("--chunk", type=int, default=256)
    g.add_argument("--rounds", type=int, default=7,
                   help="timed runs of each engine per batch, alternating plain and DSpark; the median is reported")
    g.add_argument("--warm-only", action="store_true",
                   help="compile both engines into --compile-cache and exit (a later run loads them)")
    s = sub.add_parser("steps", help="verify / draft / plain decode step costs on random weights")
    s.add_argument("--config", required=True)
    s.add_argument("--position", type=int, default=512, help="decode position of the timed steps")
    s.add_argument("--iters", type=int, default=30)
    s.add_argument("--experts", default="auto")
    for p in (g, s):
        p.add_argument("--batches", default="1,8,32")
        p.add_argument("--numerics", choices=sorted(NUMERICS), default="fast")
        p.add_argument("--compile-cache", default=None)
        p.add_argument("--out", required=True)
    return ap.parse_args(argv)


def _generate(args) -> list[dict]:
    from v41_jax.runtime.request_parse import RequestDefaults, parse_file

    rows = []
    engines = {spec: Engine.from_checkpoint(args.checkpoint, numerics=args.numerics, max_batch=max(args.batches),
                                            chunk=args.chunk, speculative=None if spec else False,
                                            decode_sizes=args.batches,
                                            compile_cache_dir=args.compile_cache, progress=False)
               for spec in (False, True)}
    warm_concurrently(list(engines.values()))
    if args.warm_only:
        return []
    if not engines[True].speculative:
        raise SystemExit(f"{args.checkpoint}: no DSpark draft stages, nothing to compare")
    parsed = parse_file(args.prompts, vocab_size=engines[True].cfg.vocab_size,
                        defaults=RequestDefaults(max_new_tokens=args.new, ignore_eos=True),
                        tokenizer=engines[True].tokenizer)
    prompts = [p for p in parsed if not isinstance(p, Exception)]
    for b in args.batches:
        reqs = [prompts[i % len(prompts)] for i in range(b)]
        reqs = [type(r)(r.prompt, args.new, r.sampling, ignore_eos=True, request_id=i) for i, r in enumerate(reqs)]
        for engine in engines.values():       # untimed: first-call costs outside the figures
            engine.reset()
            engine.generate(reqs)
        runs, tokens = {False: [], True: []}, {}
        for _ in range(args.rounds):          # interleaved, so drifts of the machine hit both alike
            for spec, engine in engines.items():
                engine.reset()
                stats = Stats()
                out = [r.tokens for r in engine.generate(reqs, stats=stats)]
                if tokens.setdefault(spec, out) != out:
                    raise SystemExit(f"batch {b}: speculative={spec} emitted other tokens in a later round")
                runs[spec].append(stats)
        row = {"batch": b, "rounds": args.rounds}
        for spec, key in ((False, "plain"), (True, "spec")):
            tps = [s.tokens_per_s for s in runs[spec]]
            ms = [s.run_s / s.steps * 1e3 for s in runs[spec]]
            row.update({f"{key}_tokens_per_s": float(np.median(tps)), f"{key}_tokens_per_s_range": [min(tps), max(tps)],
                        f"{key}_steps": runs[spec][0].steps, f"{key}_ms_per_step": float(np.median(ms)),
                        f"{key}_ms_per_step_range": [min(ms), max(ms)]})
        last = runs[True][-1]
        row.update(tokens_per_verify=last.tokens_per_verify, acceptance_at=last.acceptance_at,
                   drafts_proposed=last.drafts_proposed, drafts_accepted=last.drafts_accepted)
        # each round's plain and DSpark runs ran next to each other: their ratio is the paired figure
        ups = [s.tokens_per_s / p.tokens_per_s for p, s in zip(runs[False], runs[True])]
        row.update(speedup=float(np.median(ups)), speedup_range=[min(ups), max(ups)], speedup_rounds=ups)
        # greedy: equal unless the batch shapes move a near-tie (`fast` numerics on a GPU)
        row["requests_equal_to_plain"] = sum(x == y for x, y in zip(tokens[False], tokens[True])) / b
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def warm_concurrently(engines: list[Engine]) -> None:
    """Every engine's buckets compiled at once (each engine's warm-up already compiles its own
    buckets concurrently: XLA compiles outside the GIL)."""
    with ThreadPoolExecutor(max_workers=len(engines)) as pool:
        list(pool.map(lambda e: e.warmup(), engines))


def _steps(args) -> list[dict]:
    from scripts.bench_step import engram_token_map, param_leaf_specs, random_params
    from v41_jax.cache.geometry import EngineSettings, row_formats
    from v41_jax.config import ModelConfig
    from v41_jax.runtime.metadata import Bucket, BucketSet, build_step
    from v41_jax.runtime.sampling import SamplingParams

    cfg = ModelConfig.from_file(args.config)
    if not cfg.n_mtp_layers:
        raise SystemExit(f"{args.config}: no DSpark draft stages")
    blk, page, r_max = cfg.dspark_block_size, 16, max(args.batches)
    numerics = NUMERICS[args.numerics]()
    context = -(-(args.position + blk + 2) // page) * page
    params = random_params(cfg, 0, param_leaf_specs(cfg, args.experts))
    token_map = np.asarray(engram_token_map(cfg)) if cfg.engram_layer_ids else None
    settings = EngineSettings(page_tokens=page, num_pages=r_max * context // page + 1, slots=r_max,
                              max_context=context, draft_slack=blk, **row_formats(numerics))
    plain, spec = (Engine(params, cfg, settings=settings, numerics=numerics, token_map=token_map, speculative=on,
                          buckets=BucketSet(tuple(Bucket(b * w, b, b * w) for b in args.batches for w in widths)))
                   for on, widths in ((False, (1,)), (True, (1, blk + 1))))
    warm_concurrently([plain, spec])         # the nine executables compile at once, not one by one
    rng = np.random.default_rng(0)
    rows = []
    for b in args.batches:
        toks = [rng.integers(3, cfg.vocab_size - 1, args.position + blk + 1).tolist() for _ in range(b)]
        pos = args.position
        row = {"batch": b, "block": blk, "position": pos}
        for name, engine, width in (("plain_decode", plain, 1), ("spec_decode", spec, 1), ("verify", spec, blk + 1)):
            runner = engine.runner
            pages = [np.arange(1 + i * (context // page), 1 + (i + 1) * (context // page)) for i in range(b)]
            if width == 1:
                spans = [runner.span(i, i, pos, toks[i][pos:pos + 1], pages[i], runner.cursor_row(toks[i], pos),
                                     draft=engine.speculative) for i in range(b)]
            else:
                spans = [runner.verify_span(i, i, pos, toks[i][:pos], toks[i][pos:pos + width], pages[i],
                                            runner.cursor_row(toks[i], pos), SamplingParams()) for i in range(b)]
            bucket = Bucket(b * width, b, b * width)
            built = build_step(engine.geom, cfg, bucket, spans)
            batch = runner.send(bucket, built.batch)
            compiled = runner.compiled[bucket]

            def call():
                out = compiled(engine.params, runner.cache, batch)
                runner.cache = out.cache
            row[f"{name}_ms"] = back_to_back_s(call, lambda: runner.cache, args.iters) * 1e3
        row["draft_ms"] = row["spec_decode_ms"] - row["plain_decode_ms"]
        row["verify_over_plain"] = row["verify_ms"] / row["plain_decode_ms"]
        row["breakeven_tokens_per_verify"] = row["verify_over_plain"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    args.batches = sorted(int(b) for b in args.batches.split(","))
    start = time.perf_counter()
    compile_cache.enable(args.compile_cache)
    rows = _generate(args) if args.mode == "generate" else _steps(args)
    out = {"mode": args.mode, "device": jax.devices()[0].device_kind, "jax": jax.__version__,
           "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S"),
           "args": vars(args), "process_s": time.perf_counter() - start, "rows": rows}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
