"""`check_reference`, run through the cache and the jitted step instead of the full forward.

    python -m v41_jax.tools.engine_replay DIR [--json] [--numerics reference|fast]

The real incremental path: the prompt is prefilled as one span at position 0 (every row's logits
kept), then the fixture's 16 decode inputs go in one token per step at positions S..S+15, each
through the host bookkeeping (the slot's Engram cursor read back from the cache and checked, hash
ids from that cursor, the page table) and the donated cache. The step records, per token row,
what the full forward's intermediates hold, and takes the same teacher forcing (the reference's
own selections are attended / routed, the engine's own picks are compared separately), so
`check_reference`'s comparisons and tolerances apply unchanged: `run_engine` returns what
`check_reference.run_model` returns (no DSpark part: the draft stages are not on the cache path
yet, so those checks are skipped) and `main` is `check_reference --engine`.
"""

from __future__ import annotations

import sys

import numpy as np

from v41_jax.cache.geometry import EngineSettings, row_formats
from v41_jax.engram_hash import EngramCursor, EngramHasher
from v41_jax.model.numerics import Numerics
from v41_jax.runtime.engine import Engine
from v41_jax.runtime.metadata import Bucket, BucketSet
from v41_jax.tools import check_reference

PAGE_TOKENS = 8


def _rows(forced: dict, rows: slice) -> dict:
    """The forcing of some token rows (the fixture's arrays are [1, S + 16, ...])."""
    return {kind: {l: v[0, rows] for l, v in per_layer.items()} for kind, per_layer in forced.items()}


def _stack_rows(parts: list[dict]) -> dict:
    """Per-step intermediates (token axis 0, or 1 under a leading layer axis) -> the whole
    sequence, with the forward's batch axis of one."""
    out = {}
    for key, first in parts[0].items():
        if first is None:
            out[key] = None
        elif isinstance(first, dict):
            out[key] = {l: np.concatenate([np.asarray(p[key][l]) for p in parts])[None] for l in first}
        elif key in ("block_out", "next_pre"):
            out[key] = np.concatenate([np.asarray(p[key]) for p in parts], axis=1)[:, None]
        else:
            out[key] = np.concatenate([np.asarray(p[key]) for p in parts])[None]
    return out


def run_engine(cfg, params, z, hasher: EngramHasher | None, numerics: Numerics, kv_format: str = "typed") -> dict:
    """`check_reference.run_model`'s result, computed through the cache (its main and window rows
    typed or packed, `geometry.row_formats`)."""
    prompt = z["prompt_ids"].astype(np.int32)
    inputs = z["decode.input_ids"].astype(np.int32)
    s, n = len(prompt), len(inputs)
    pages = -(-(s + n) // PAGE_TOKENS)
    settings = EngineSettings(page_tokens=PAGE_TOKENS, num_pages=pages + 1, slots=1, max_context=cfg.max_seq_len,
                              **row_formats(numerics, kv_format=kv_format))
    engine = Engine(params, cfg, settings=settings, buckets=BucketSet((Bucket(s, 1, s), Bucket(1, 1, 1))),
                    numerics=numerics, token_map=None if hasher is None else hasher.token_map, record=True)
    forced = check_reference._forced(z, cfg)
    table = engine.pages.allocate(pages)

    def hash_ids(cursor_row, tokens):
        return None if hasher is None else hasher.hash_ids(EngramCursor.from_row(cursor_row), tokens)[0]

    start = np.array([0] + [-1] * engine.geom.history)
    ids = [hash_ids(start, prompt)]
    ran = [engine.run([engine.make_span("replay", 0, 0, prompt, table, None, all_logits=True)],
                      forced=_rows(forced, slice(0, s)))]
    for i, tok in enumerate(inputs):
        cursor = engine.cursors()[0]
        ids.append(hash_ids(cursor, [tok]))
        ran.append(engine.run([engine.make_span("replay", 0, s + i, [tok], table, cursor)],
                              forced=_rows(forced, slice(s + i, s + i + 1))))
    logits = np.concatenate([np.asarray(r.logits[: len(r.built.logit_owner)]) for r in ran])
    return {"logits": logits, "hash_ids": None if hasher is None else np.concatenate(ids),
            "inter": _stack_rows([r.inter for r in ran])}


def main(argv=None) -> int:
    return check_reference.main(["--engine", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
