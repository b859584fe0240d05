"""Step metadata builder: layout, plans with sentinel tails, inert padding, refusals."""

from pathlib import Path

import numpy as np
import pytest

from v41_jax.cache.geometry import CacheGeometry, EngineSettings
from v41_jax.config import ModelConfig
from v41_jax.runtime.metadata import Bucket, BucketSet, Span, build_step, plan_capacity

SMALL_B = Path(__file__).resolve().parents[1] / "tests/fixtures/dsv41_official/small_b/checkpoint"


@pytest.fixture(scope="module")
def setup():
    cfg = ModelConfig.from_file(SMALL_B)       # window 8, ratios 1 and 2, 2 Engram layers
    geom = CacheGeometry.build(cfg, EngineSettings(page_tokens=8, num_pages=16, slots=4, max_context=64))
    return cfg, geom


def _span(cfg, geom, rid, slot, position, n, pages, all_logits=False):
    cols, hd = cfg.engram_hash_cols, cfg.engram_head_dim
    ne = len(cfg.engram_layer_ids)
    return Span(rid, slot, position, np.arange(n) % cfg.vocab_size, np.asarray(pages),
                np.array([position + n, 5, 6, 7]),
                tuple(np.full((n, cols, hd), 1, np.uint8) for _ in range(ne)),
                tuple(np.full((n, cols, hd // 32), 2, np.uint8) for _ in range(ne)), all_logits)


def test_layout_plans_and_padding(setup):
    cfg, geom = setup
    bucket = Bucket(tokens=16, requests=4, logits=14)
    spans = [_span(cfg, geom, "a", 2, 3, 4, [3]),             # positions 3..6, continues
             _span(cfg, geom, "b", 0, 0, 11, [5, 6], True)]    # fresh, 11 rows, every logit
    built = build_step(geom, cfg, bucket, spans)
    b = built.batch
    assert list(b.positions[:4]) == [3, 4, 5, 6] and list(b.positions[4:15]) == list(range(11))
    assert list(b.token_req) == [0] * 4 + [1] * 11 + [-1]
    assert b.positions[15] == 0 and b.tokens[15] == 0
    assert list(b.req_pos) == [3, 0, 0, 0] and list(b.req_len) == [4, 11, 0, 0]
    assert list(b.req_offset) == [0, 4, 16, 16]
    assert list(b.slots) == [2, 0, 4, 4]                        # padding: slot N (dropped)
    assert list(b.block_tables[0, :2]) == [3, 0] and not b.block_tables[2:].any()
    r2 = geom.ratios.index(2)
    assert list(b.visible[r2][:4]) == [2, 2, 3, 3] and b.visible[r2][15] == 0
    plan = b.compress_plans[r2]
    assert plan.shape == (plan_capacity(bucket, 16, 2), 4)
    # a: x=3 needs position 2 from the ring (1 leading input), x=5 is whole; b: x=1,3,5,7,9
    assert plan[:2].tolist() == [[0, 0, 3, 1], [2, 0, 5, 0]]
    assert plan[2:7, 2].tolist() == [1, 3, 5, 7, 9] and (plan[7:] == -1).all()
    ww = b.window_writes
    # a writes all 4 rows; b only its last W = 8 (positions 3..10), each a distinct ring row
    assert ww[:4].tolist() == [[t, 2, x % 8] for t, x in zip(range(4), range(3, 7))]
    assert ww[4:12, 0].tolist() == list(range(7, 15)) and (ww[12:] == -1).all()
    assert len(set(map(tuple, ww[4:12, 1:]))) == 8
    rw = b.ring_writes                                           # comp ring = 2 rows
    assert rw[:4].tolist() == [[2, 2, 1], [3, 2, 0], [13, 0, 1], [14, 0, 0]] and (rw[4:] == -1).all()
    assert list(b.logit_rows) == [3] + list(range(4, 15)) + [0, 0]     # a's last row, all of b's
    assert built.logit_owner == (("a", 6),) + tuple(("b", p) for p in range(11))
    assert b.cursor_rows[0].tolist() == [7, 5, 6, 7] and not b.cursor_rows[2:].any()
    assert (b.engram_codes[0][:15] == 1).all() and not b.engram_codes[0][15].any()


@pytest.mark.parametrize("bad, msg", [
    (dict(slot=9), "slots"),
    (dict(pages=[0, 4]), "pages must lie"),
    (dict(pages=[4]), "do not cover"),
    (dict(n=0), "empty"),
    (dict(position=60, pages=list(range(1, 10))), "max_context"),
])
def test_refusals(setup, bad, msg):
    cfg, geom = setup
    kw = dict(rid="x", slot=1, position=0, n=10, pages=[4, 5])
    kw.update(bad)
    with pytest.raises(ValueError, match=msg):
        build_step(geom, cfg, Bucket(16, 2, 2), [_span(cfg, geom, **kw)])


def test_refuses_duplicate_slots_and_bad_tokens(setup):
    cfg, geom = setup
    s = _span(cfg, geom, "x", 1, 0, 2, [4])
    with pytest.raises(ValueError, match="slots"):
        build_step(geom, cfg, Bucket(16, 2, 2), [s, _span(cfg, geom, "y", 1, 0, 2, [5])])
    bad = Span("z", 0, 0, np.array([cfg.vocab_size]), np.array([4]), s.next_cursor,
               s.engram_codes, s.engram_scales)
    with pytest.raises(ValueError, match="token ids"):
        build_step(geom, cfg, Bucket(16, 2, 2), [bad])
    with pytest.raises(ValueError, match="exceed"):
        build_step(geom, cfg, Bucket(4, 2, 2), [_span(cfg, geom, "w", 0, 0, 5, [4])])


def test_plan_capacity_holds_any_batch(setup):
    """Random spans that fit a bucket never overflow a plan (the builder would raise)."""
    cfg, geom = setup
    rng = np.random.default_rng(0)
    bucket = Bucket(tokens=24, requests=4, logits=4)
    for _ in range(200):
        n_req = rng.integers(1, 5)
        lens = rng.multinomial(24 - n_req, np.ones(n_req) / n_req) + 1
        spans = []
        for i, n in enumerate(lens):
            pos = int(rng.integers(0, 64 - n))
            pages = np.arange(1, -(-(pos + n) // 8) + 1) + i
            spans.append(_span(cfg, geom, i, i, pos, int(n), pages % 15 + 1))
        build_step(geom, cfg, bucket, spans)


def test_bucket_pick():
    bs = BucketSet((Bucket(4, 4, 4), Bucket(64, 1, 1), Bucket(64, 4, 4), Bucket(1, 1, 1)))
    assert bs.pick(1, 1, 1) == Bucket(1, 1, 1)
    assert bs.pick(3, 3, 3) == Bucket(4, 4, 4)
    assert bs.pick(1, 40, 1) == Bucket(64, 1, 1)
    assert bs.pick(2, 40, 2) == Bucket(64, 4, 4)
    with pytest.raises(ValueError):
        bs.pick(5, 1, 1)
