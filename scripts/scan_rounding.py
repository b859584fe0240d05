"""Where the scanned layer stack and the unrolled one part at the last bit (docs/DESIGN.md,
"Scanned layer runs"): one decode token on a random cache, run unrolled and scanned through
buckets of several token counts, every layer's block output compared pairwise (fp32 numerics).

    python -m scripts.scan_rounding [--config v41_jax/configs/tiny.config.json] [--tokens 1,4] [--out R.json]

The config is re-wired (RUNS_WIRING, also the wiring of tests/test_layer_runs.py) so that it has
WINDOW, REUSE and candidate-consuming runs. Prints, per pair of (layout, bucket tokens), the
largest absolute difference at layer 0 and over all layers; 0.0 is bit-equal.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):  # python scripts/scan_rounding.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from scripts.bench_step import decode_cursors, param_leaf_specs, random_params, randomize_cache  # noqa: E402
from scripts.make_checkpoint import engram_token_map  # noqa: E402
from v41_jax.cache.geometry import EngineSettings  # noqa: E402
from v41_jax.config import ModelConfig  # noqa: E402
from v41_jax.model.layer_runs import layer_runs, stack_runs  # noqa: E402
from v41_jax.model.numerics import Numerics  # noqa: E402
from v41_jax.runtime.engine import Engine  # noqa: E402
from v41_jax.runtime.metadata import Bucket, BucketSet, build_step  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# runs of every kind on `tiny`: WINDOW 0-1, REUSE ratio 2 with DSpark taps 3-5, REUSE ratio 1
# consuming candidate blocks 9-10, next to a lone REUSE layer (7) and Engram on the kv owners
RUNS_WIRING = {"num_hidden_layers": 11, "compress_ratios": [0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 1, 0, 0, 0],
               "kv_source_layer_ids": [2, 6], "index_source_layer_ids": [2, 6, 8], "candidate_source_layer_id": 6,
               "engram_layer_ids": [2, 6], "dspark_target_layer_ids": [4, 5, 10]}
PAGE = 16


def rewired(config: str, folder: Path) -> ModelConfig:
    raw = json.loads(Path(config).read_text())
    raw["text_config"].update(RUNS_WIRING)
    path = folder / "runs.config.json"
    path.write_text(json.dumps(raw))
    return ModelConfig.from_file(path)


def block_outputs(cfg: ModelConfig, tokens: tuple[int, ...], context: int, seed: int) -> dict:
    """(layout, bucket tokens) -> every layer's block output [L, 1, ...] for one decode token."""
    params = random_params(cfg, seed, param_leaf_specs(cfg, "bf16"))
    settings = EngineSettings(page_tokens=PAGE, num_pages=context // PAGE + 2, slots=1, max_context=context,
                              kv_format="f32", index_format="f32")
    buckets = {t: Bucket(t, 1, t) for t in tokens}
    eng = Engine(params, cfg, settings=settings, buckets=BucketSet(tuple(buckets.values())),
                 numerics=Numerics.fp32(), token_map=np.asarray(engram_token_map(cfg)), record=True)
    cursor = decode_cursors(np.random.default_rng(seed), cfg, 1, eng.geom.history, context, 1)
    cache = randomize_cache(eng.cache, jax.random.key(seed + 1, impl="rbg"), jnp.asarray(cursor))
    eng.cache = cache
    span = eng.make_span("d", 0, context - 1, np.array([7], np.int32), eng.pages.allocate(context // PAGE),
                         eng.cursors()[0])
    out = {}
    for layout, p in (("unrolled", params), ("scanned", stack_runs(params, cfg))):
        for t, bucket in buckets.items():
            batch = eng.runner.send(bucket, build_step(eng.geom, cfg, bucket, [span]).batch)
            step = eng.step_fn(p, jax.tree.map(jnp.copy, cache), batch, layout=eng.runner.layout(bucket))
            out[layout, t] = np.asarray(step.inter["block_out"])[:, :1]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(ROOT / "v41_jax/configs/tiny.config.json"))
    ap.add_argument("--tokens", default="1,4", help="bucket token counts, comma separated")
    ap.add_argument("--context", type=int, default=64, help="the decode token's position + 1")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = rewired(args.config, Path(tmp))
    outs = block_outputs(cfg, tuple(int(t) for t in args.tokens.split(",")), args.context, args.seed)
    rows = []
    for a, b in itertools.combinations(outs, 2):
        d = np.abs(outs[a] - outs[b])
        rows.append({"a": f"{a[0]} T={a[1]}", "b": f"{b[0]} T={b[1]}", "layer0": float(np.nanmax(d[0])),
                     "all_layers": float(np.nanmax(d))})
        print(f"{rows[-1]['a']:>14} vs {rows[-1]['b']:<14} layer 0 {rows[-1]['layer0']:.3g}  all {rows[-1]['all_layers']:.3g}")
    report = {"runs": [[r.start, r.stop - 1] for r in layer_runs(cfg)], "backend": jax.default_backend(),
              "jax": jax.__version__, "pairs": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
