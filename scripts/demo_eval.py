"""Measure the exported demo checkpoint (models/demo) as any downloaded checkpoint is used: loaded
through the schema-checked reader, run by the engine.

    python -m scripts.demo_eval --checkpoint models/demo --data build/demo_data --out eval.json

  * held-out perplexity by the engine (reference numerics; the windows fed through the paged cache
    in chunks, every row's logits kept) on the first --windows held-out windows of 257 tokens, the
    windows `scripts.train_demo` reports its own perplexity on;
  * the same by the full forward (`model.forward`, reference numerics), the engine's oracle;
  * greedy continuations of the held-out documents' prompts in scripts/demo_prompts.jsonl
    (engine, text in, text out);
  * DSpark agreement: held-out prefixes continued greedily by the target, then at every anchor
    inside a continuation the draft stages' greedy tokens against the target's, per draft
    position 1..dspark_block_size (`model.dspark.draft`, each position on its own);
  * DSpark in the engine ("spec"): greedy generation with speculative decoding from held-out
    prefixes and from the demo prompts: tokens per verify step and acceptance per draft position.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

from scripts.train_demo import CONT, PREFIX, SEQ, windows


GOLDEN_PROMPT = "The Python standard library"
GOLDEN_TOKENS = 24


def small_engine(ckpt, **kw):
    """One slot, reference numerics (their GEMM order is fixed, so tokens agree across backends);
    one bucket that keeps every row's logits (teacher forcing) for every step: one compile. (A
    second, 4-token decode bucket gave the same tokens, perplexity and draft statistics for 16 s
    more of CPU in tests/test_demo_model.py, its compile costing more than its faster decodes
    saved; 2026-12-07.) kw: more `Engine.from_checkpoint` arguments (the test's compile cache)."""
    from v41_jax.runtime.engine import Engine

    return Engine.from_checkpoint(ckpt, numerics="reference", chunk=64, buckets="68x1x68", **kw)


def greedy_tokens(engine, prompt: str, n: int) -> list[int]:
    from v41_jax.runtime.sampling import SamplingParams

    return engine.generate([prompt], SamplingParams(temperature=0.0), max_new_tokens=n, ignore_eos=True)[0].tokens


def engine_nll(engine, tokens: np.ndarray, chunk: int) -> float:
    """Summed next-token NLL of one window fed through the engine's cache in chunks."""
    import jax

    pages = engine.pages.allocate(engine.geom.pages_for(len(tokens)))
    logits, pos = [], 0
    while pos < len(tokens) - 1:
        n = min(chunk, len(tokens) - 1 - pos)
        span = engine.make_span("ppl", 0, pos, tokens[pos: pos + n], pages, engine.cursors()[0], all_logits=True)
        logits.append(np.asarray(engine.run([span]).logits[:n]))
        pos += n
    engine.pages.free(pages, engine.step_id)
    engine.pages.retire(engine.step_id)
    logp = np.asarray(jax.nn.log_softmax(np.concatenate(logits), -1))
    return float(-logp[np.arange(len(tokens) - 1), tokens[1:]].sum())


def forward_fn(cfg, params, token_map, numerics):
    """tokens [B, S] -> (logits [B, S, V], main_hidden) by the full forward, Engram rows from the
    checkpoint's host tables."""
    import jax
    import jax.numpy as jnp

    from v41_jax.checkpoint.load import ENGRAM_KEY
    from v41_jax.engram_hash import EngramHasher
    from v41_jax.model.engram import sequence_rows
    from v41_jax.model.forward import forward

    hasher = EngramHasher(cfg, token_map)
    run = jax.jit(lambda p, t, rows: forward(p, cfg, t, numerics=numerics, engram_rows=rows, return_intermediates=True))

    def call(tokens):
        _, rows = sequence_rows(params[ENGRAM_KEY], hasher, cfg, tokens)
        logits, inter = run(params, jnp.asarray(tokens), {k: jnp.asarray(v) for k, v in rows.items()})
        return logits, inter["main_hidden"]
    return call


def draft_agreement(cfg, params, fwd, numerics, prefixes: np.ndarray) -> list[float]:
    """Per draft position, the fraction of anchors whose draft equals the target's greedy token."""
    import jax
    import jax.numpy as jnp

    from v41_jax.model.dspark import context_x, draft

    seqs = prefixes[:, :PREFIX + CONT].copy()
    for pos in range(PREFIX - 1, PREFIX + CONT - 1):
        seqs[:, pos + 1] = np.asarray(jnp.argmax(fwd(seqs)[0][:, pos], -1))
    hidden = fwd(seqs)[1]
    blk = cfg.dspark_block_size
    anchors = np.arange(PREFIX - 1, PREFIX + CONT - blk - 1)

    @jax.jit
    def drafts(params, hidden, anchor, first):
        ctx = context_x(params, cfg, hidden, numerics)
        return draft(params, cfg, ctx, anchor, first, numerics).ids[:, 1:]

    right = np.zeros(blk)
    for a in anchors:
        ids = np.asarray(drafts(params, hidden, jnp.full(len(seqs), a, jnp.int32), jnp.asarray(seqs[:, a + 1])))
        right += (ids == seqs[:, a + 2: a + 2 + blk]).mean(0)
    return (right / len(anchors)).tolist()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--data", required=True, help="scripts.demo_data output (held-out stream and documents)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--prompts", default="scripts/demo_prompts.jsonl", help="held-out text prompts (JSONL)")
    ap.add_argument("--windows", type=int, default=32)
    ap.add_argument("--draft-prefixes", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--golden", help="write the golden tokens of GOLDEN_PROMPT and the perplexity of "
                    "tests/fixtures/demo_heldout.txt (the test's engine) to this JSON, then stop")
    ap.add_argument("--spec-prompts", type=int, default=32, help="held-out prefixes for the DSpark measurement")
    ap.add_argument("--spec-numerics", default="fast", help="the engine's numerics for the DSpark measurement")
    ap.add_argument("--parts", default="forward,drafts,spec,engine",
                    help="which measurements (comma-separated; the forward and the drafts are slow on CPU)")
    args = ap.parse_args(argv)

    from v41_jax.checkpoint.load import load_params, load_token_map
    from v41_jax.numerics import Numerics
    from v41_jax.runtime.engine import Engine
    from v41_jax.runtime.sampling import SamplingParams

    if args.golden:
        engine = small_engine(args.checkpoint)
        tokens = np.asarray(engine.tokenizer.encode(open("tests/fixtures/demo_heldout.txt").read()).ids)
        golden = {"prompt": GOLDEN_PROMPT, "tokens": greedy_tokens(engine, GOLDEN_PROMPT, GOLDEN_TOKENS),
                  "heldout_file_ppl": float(np.exp(engine_nll(engine, tokens, 64) / (len(tokens) - 1)))}
        golden["text"] = engine.tokenizer.decode(golden["tokens"])
        with open(args.golden, "w") as f:
            json.dump(golden, f, indent=1)
        print(json.dumps(golden))
        return 0
    out: dict = {}

    def save(out):   # after every measurement: a later one failing keeps the earlier
        print(json.dumps(out), flush=True)
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    held = windows(np.load(os.path.join(args.data, "heldout.npy")), SEQ + 1)[:args.windows]
    cfg, params = load_params(args.checkpoint, progress=False)
    token_map = load_token_map(args.checkpoint, cfg)
    ref = Numerics.reference()
    fwd = forward_fn(cfg, params, token_map, ref)
    parts = args.parts.split(",")
    if "forward" in parts:
        t0 = time.time()
        nll = sum(float(-np.take_along_axis(np.asarray(jax_log_softmax(fwd(held[i:i + 8, :-1])[0])),
                                            held[i:i + 8, 1:, None], -1).sum()) for i in range(0, len(held), 8))
        out["heldout_ppl_forward_reference"] = float(np.exp(nll / held[:, 1:].size))
        out["forward_seconds"] = round(time.time() - t0, 1)
        save(out)
    if "drafts" in parts:
        prefixes = windows(np.load(os.path.join(args.data, "heldout.npy")), SEQ + 1, SEQ // 2)[:args.draft_prefixes]
        out["draft_agreement_per_position"] = draft_agreement(cfg, params, fwd, ref, prefixes)
        save(out)
    if "spec" in parts:   # DSpark in the engine: held-out prefixes, then the demo prompts (text)
        engine = Engine.from_checkpoint(args.checkpoint, numerics=args.spec_numerics, max_batch=8, chunk=64)
        with open(args.prompts) as f:
            texts = [json.loads(line)["prompt"] for line in f if line.strip()]
        out["speculative"] = {
            "numerics": args.spec_numerics,
            f"heldout_prefixes_of_{PREFIX}": speculative_acceptance(engine, held[:args.spec_prompts, :PREFIX].tolist(),
                                                                    args.new_tokens),
            "demo_prompts": speculative_acceptance(engine, texts, args.new_tokens)}
        save(out)
    if "engine" not in parts:
        return 0

    # the prefill bucket keeps every row's logits (teacher forcing), the decode bucket serves generate
    engine = Engine.from_checkpoint(args.checkpoint, numerics="reference", chunk=64, buckets="4x4x4,68x4x68")
    t0 = time.time()
    nll = sum(engine_nll(engine, w, 64) for w in held)
    out["heldout_ppl_engine_reference"] = float(np.exp(nll / held[:, 1:].size))
    out["engine_seconds"] = round(time.time() - t0, 1)
    save(out)

    with open(args.prompts) as f:
        prompts = [json.loads(line)["prompt"] for line in f if line.strip()]
    results = engine.generate(prompts, SamplingParams(temperature=0.0), max_new_tokens=args.new_tokens)
    out["continuations"] = [{"prompt": p, "continuation": engine.tokenizer.decode(r.tokens)}
                            for p, r in zip(prompts, results)]
    save(out)
    return 0


def speculative_acceptance(engine, prompts: list, new_tokens: int) -> dict:
    """Greedy generation with DSpark -> tokens per verify step (drafts accepted + 1) and the
    acceptance per draft position over `prompts` (token lists or text), `new_tokens` each."""
    from v41_jax.runtime.engine import Stats
    from v41_jax.runtime.sampling import SamplingParams

    stats = Stats()
    engine.generate(prompts, SamplingParams(temperature=0.0), max_new_tokens=new_tokens, ignore_eos=True, stats=stats)
    return {"prompts": len(prompts), "new_tokens": new_tokens, "verifies": stats.verifies,
            "tokens_per_verify": round(stats.tokens_per_verify, 3),
            "acceptance_at": [round(a, 3) for a in stats.acceptance_at]}


def jax_log_softmax(x):
    import jax

    return jax.nn.log_softmax(x, -1)


if __name__ == "__main__":
    raise SystemExit(main())
