"""DSpark speculative decoding in the engine (#14): greedy with drafts emits exactly the tokens of
greedy without them, the cache a speculative run leaves equals the one a plain run leaves, the
drafts are the draft head's, and the per-request / engine switches.

Random weights accept almost no draft, so an *oracle* also runs: the step's drafts are replaced,
between the step and the scheduler, by the target's own greedy continuation (computed beforehand
by a plain run) with a wrong token at a chosen position m, cycling m over block..0, so that every
acceptance length is exercised and the step's acceptance must find exactly min(m, drafts checked).
The later drafts after the wrong one stay right: acceptance must stop at the first mismatch.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.engine_common import FP32, SETTINGS, build_model, make_engine
from v41_jax.checkpoint.load import ENGRAM_KEY, load_params, load_token_map
from v41_jax.engram_hash import EngramHasher
from v41_jax.model import dspark
from v41_jax.model.engram import sequence_rows
from v41_jax.model.forward import forward
from v41_jax.runtime.engine import Engine, Stats
from v41_jax.runtime.request import Request
from v41_jax.runtime.sampling import SamplingParams
from v41_jax.runtime.scheduler import FinishEvent, TokenEvent


FARM_F03 = Path(__file__).parent / "fixtures/dsv41_farm/f03_h6_ix8_dspark3_b5_engram0/checkpoint"


@pytest.fixture(scope="module", params=["modes", "farm_f03"])
def model(request, tmp_path_factory):
    """modes (block 4) and the fixture farm's official-reference checkpoint with the released
    block of 5 (acceptance lengths 0..5). Not tiny: it has modes' attention modes in the same
    order (modes adds a window and a ratio-2 reuse layer, where its Engram sits; tiny's window is
    8, modes' 16), and the speculative paths do not depend on either (~75 s of the suite's CPU)."""
    if request.param == "farm_f03":
        cfg, params = load_params(FARM_F03, progress=False)
        token_map = load_token_map(FARM_F03, cfg)
    else:
        cfg, params, token_map = build_model(tmp_path_factory.mktemp(request.param), request.param, seed=0)
    settings = replace(SETTINGS, draft_slack=cfg.dspark_block_size)
    # one engine per config (one compile); plain runs turn speculation off per request
    engine = make_engine(cfg, params, token_map, settings=settings, prefill_chunk=7)
    assert engine.speculative
    return cfg, params, token_map, engine


@pytest.fixture(autouse=True)
def _no_oracle(model):
    """Each test starts from an empty engine whose runner's `collect` is its own again."""
    engine = model[3]
    engine.runner.__dict__.pop("collect", None)
    engine.reset()
    yield
    engine.runner.__dict__.pop("collect", None)


def _requests(cfg, n: int, seed: int, **kw) -> list[Request]:
    rng = np.random.default_rng(seed)
    return [Request(rng.integers(3, cfg.vocab_size, int(rng.integers(3, 30))).tolist(),
                    int(rng.integers(8, 30)), ignore_eos=True, request_id=f"r{i}", **kw) for i in range(n)]


def _plain(engine: Engine, reqs: list[Request]) -> dict:
    engine.reset()
    return {r.request_id: r.tokens for r in engine.generate([replace(q, speculative=False) for q in reqs])}


class Oracle:
    """Wraps the runner's `collect`: checks each verify's acceptance against the forced one and
    replaces the step's drafts by the reference continuation, wrong at position m (cycling), in
    the host's copy and in the slot (a pipelined verify span reads its drafts there). So that the
    next verify span reads the replaced drafts, each step that drafts is read before the next
    step is planned (its requests await it, as without device feedback)."""

    def __init__(self, engine: Engine, reference: dict, prompts: dict):
        self.engine, self.blk = engine, engine.cfg.dspark_block_size
        self.full = {rid: list(prompts[rid]) + list(toks) for rid, toks in reference.items()}
        self.forced: dict = {}              # rid -> the accepted count its current drafts force
        self.turns: dict = {}               # rid -> drafts replaced so far (m cycles per request)
        self.offset = {rid: i for i, rid in enumerate(reference)}
        self.seen: list[tuple[int, int]] = []   # (drafts checked, accepted) per verify
        self.device_drafts: list = []       # (rid, committed tokens, first, drafts) before replacement
        self.collect = engine.runner.collect
        engine.runner.collect = self
        schedule = engine.scheduler.schedule

        def read_drafts_first():
            plan = schedule()
            for sp in plan.spans if plan is not None else ():
                sp.seq.awaiting = sp.seq.awaiting or sp.draft
            return plan
        engine.scheduler.schedule = read_drafts_first

    def __call__(self, flight):
        res = self.collect(flight)
        plan = self.engine.scheduler.in_flight[res.step_id]
        drafts = res.drafts.copy()
        for b, sp in enumerate(plan.spans):
            if sp.seq.done:
                continue
            if sp.verify:
                n = int(res.accepted[b])
                assert n == min(self.forced[sp.rid], sp.verify), (sp.rid, n, self.forced[sp.rid], sp.verify)
                self.seen.append((sp.verify, n))
            if not sp.draft:
                continue
            # the committed end: the index of the token the target emits after the accepted drafts
            c = sp.position + 1 + int(res.accepted[b]) if sp.verify else sp.position + sp.length
            full = self.full[sp.rid]
            self.device_drafts.append((sp.rid, full[:c], full[c], res.drafts[b].copy()))
            # all right first, then one fewer each time; each request starts the cycle elsewhere so
            # that short budgets still cover every length between them
            m = self.blk - (self.turns.get(sp.rid, 0) + self.offset[sp.rid]) % (self.blk + 1)
            self.turns[sp.rid] = self.turns.get(sp.rid, 0) + 1
            right = np.asarray((full + [0] * (self.blk + 1))[c + 1: c + 1 + self.blk])
            right[m:m + 1] = (right[m:m + 1] + 1) % self.engine.cfg.vocab_size
            drafts[b] = right
            cache = self.engine.cache
            self.engine.cache = replace(cache, sampled=cache.sampled.at[sp.slot, 1:].set(right))
            self.forced[sp.rid] = m
        return res._replace(drafts=drafts)


def test_greedy_with_drafts_equals_plain_greedy(model):
    """Mixed batches (speculative and plain requests, chunked prefill, more requests than slots so
    slots are reused): the head's own drafts, then the oracle's forced acceptances of every length."""
    cfg, params, token_map, engine = model
    reqs = _requests(cfg, 7, seed=1)
    want = _plain(engine, reqs)
    mixed = [replace(q, speculative=None if i % 3 else False) for i, q in enumerate(reqs)]
    engine.reset()
    stats = Stats()
    got = engine.generate(mixed, stats=stats)
    assert {r.request_id: r.tokens for r in got} == want
    assert stats.verifies > 0 and stats.drafts_proposed == sum(stats.proposed_at) > 0
    engine.reset()
    oracle = Oracle(engine, want, {q.request_id: q.prompt for q in reqs})
    stats, events = Stats(), []
    got = engine.generate(mixed, stats=stats, on_event=events.append)
    assert {r.request_id: r.tokens for r in got} == want
    # each token event carries its own verify's counts (what a server reports per request)
    counted = [(e.drafted, e.accepted) for e in events if isinstance(e, TokenEvent) and e.drafted]
    assert sorted(counted) == sorted(oracle.seen)
    accepted = {n for _, n in oracle.seen}
    assert accepted == set(range(cfg.dspark_block_size + 1)), accepted
    assert stats.drafts_accepted == sum(n for _, n in oracle.seen)
    assert stats.tokens_per_verify == pytest.approx((stats.drafts_accepted + stats.verifies) / stats.verifies)
    # position j's drafts were accepted exactly when the forced count exceeded j
    assert stats.accepted_at == [sum(n > j for _, n in oracle.seen) for j in range(cfg.dspark_block_size)]
    assert stats.proposed_at == [sum(k > j for k, _ in oracle.seen) for j in range(cfg.dspark_block_size)]


def test_abort_mid_verify(model):
    """A request aborted while its verify step is in flight: its output is dropped, the other one
    and a request added then decode exactly as without drafts."""
    cfg, params, token_map, engine = model
    reqs = _requests(cfg, 3, seed=2)
    want = _plain(engine, reqs)
    engine.reset()
    oracle = Oracle(engine, want, {q.request_id: q.prompt for q in reqs})
    for q in reqs[:2]:
        engine.add(q)
    tokens: dict = {q.request_id: [] for q in reqs}
    aborted = False
    while engine.has_work:
        for e in engine.step():
            if hasattr(e, "tokens"):
                tokens[e.rid] += e.tokens
        flight = engine._flight_plan
        if not aborted and flight is not None and any(sp.rid == "r0" and sp.verify for sp in flight.spans):
            assert engine.abort("r0")
            aborted = True
            engine.add(reqs[2])
    assert aborted and oracle.seen
    assert tokens["r0"] == want["r0"][:len(tokens["r0"])] and len(tokens["r0"]) < len(want["r0"])
    assert tokens["r1"] == want["r1"] and tokens["r2"] == want["r2"]


def _slot_state(engine: Engine, seq) -> tuple[int, dict]:
    """(committed position c, every region of the slot the next step reads): window rings (the
    backbone's and the draft stages') at positions (c - W, c), the compressor rings at the
    positions of the incomplete group of each ring owner, the compressed main and index rows
    before c // r of each owner in the request's pages, the cursor and the token fed next."""
    geom, cache, slot = engine.geom, engine.cache, seq.slot
    cursor = np.asarray(cache.cursor[slot])
    c, ring = int(cursor[0]), geom.ring_slots
    out = {"cursor": cursor, "sampled": int(np.asarray(cache.sampled[slot, 0]))}
    recent = np.arange(max(0, c - engine.cfg.window_size + 1), c)
    out["window"] = np.asarray(cache.window[slot])[:, recent % ring]
    for k, owner in enumerate(geom.ring_owners):
        r = geom.owners[owner].ratio
        group = np.arange(c - c % r, c)
        out[f"comp_kv{k}"] = np.asarray(cache.comp_kv[slot, k])[group % geom.comp_ring]
        out[f"comp_score{k}"] = np.asarray(cache.comp_score[slot, k])[group % geom.comp_ring]
    pages = np.asarray(seq.pages)
    for k, owner in enumerate(geom.owners):
        ids = np.arange(c // owner.ratio)
        at = (pages[ids // owner.rows_per_page], ids % owner.rows_per_page)
        out[f"main{k}"] = np.asarray(cache.main[k])[at]
        out[f"index{k}"] = np.asarray(cache.index[k])[at]
    return c, out


def _states(engine: Engine, req: Request) -> dict:
    """The slot state after every step of one request, by committed position."""
    engine.add(req)
    states = {}
    while engine.has_work:
        engine.step()
        seq = engine.scheduler.by_id[req.request_id]
        if not seq.done:
            c, state = _slot_state(engine, seq)
            states[c] = state
    return states


def test_cache_state_after_partial_acceptances_equals_plain(model):
    """After verifies accepting every length 0..block, every slot region the next step reads holds
    what a plain run holds at the same committed position, bit for bit. The prompt (21 tokens)
    wraps both configs' window ring (16) during the chunked prefill."""
    cfg, params, token_map, engine = model
    req = Request(np.random.default_rng(3).integers(3, cfg.vocab_size, 21).tolist(), 40, ignore_eos=True,
                  request_id="s")
    engine.reset()
    plain = _states(engine, replace(req, speculative=False))
    want = {"s": engine.scheduler.by_id["s"].result.tokens}
    engine.reset()
    oracle = Oracle(engine, want, {"s": req.prompt})
    spec = _states(engine, req)
    assert {n for _, n in oracle.seen} == set(range(cfg.dspark_block_size + 1))
    compared = 0
    for c, state in spec.items():
        if c <= len(req.prompt):
            continue                           # prefill: the plain run's chunks end elsewhere
        assert c in plain
        for key, value in state.items():
            np.testing.assert_array_equal(value, plain[c][key], err_msg=f"{key} at committed position {c}")
        compared += 1
    assert compared >= len(oracle.seen) - 1


def test_drafts_are_the_draft_heads(model):
    """The step's drafts after a prefill and after every verify (the draft context read from the
    slot's rings and the step's rows, across window wraps) equal `dspark.draft` over the full
    forward's taps. One forward over the whole sequence serves every anchor: the model is causal,
    and the draft at anchor a reads context rows <= a only."""
    cfg, params, token_map, engine = model
    req = Request(np.random.default_rng(4).integers(3, cfg.vocab_size, 11).tolist(), 24, ignore_eos=True,
                  request_id="d")
    want = _plain(engine, [req])
    engine.reset()
    oracle = Oracle(engine, want, {"d": req.prompt})
    engine.generate([req])
    full = np.asarray(list(req.prompt) + want["d"])
    _, rows = sequence_rows(params[ENGRAM_KEY], EngramHasher(cfg, token_map), cfg, full[None])

    @jax.jit
    def context(params, tokens, rows):
        _, inter = forward(params, cfg, tokens, numerics=FP32, engram_rows=rows, return_intermediates=True)
        return dspark.context_x(params, cfg, inter["main_hidden"], FP32)

    head = jax.jit(lambda params, ctx, anchor, first: dspark.draft(params, cfg, ctx, anchor, first, FP32).ids)
    ctx = context(params, jnp.asarray(full)[None], {k: jnp.asarray(v) for k, v in rows.items()})
    for _, committed, first, got in oracle.device_drafts:
        ids = head(params, ctx, jnp.asarray([len(committed) - 1]), jnp.asarray([first]))
        np.testing.assert_array_equal(got, np.asarray(ids[0, 1:]), err_msg=f"anchor {len(committed) - 1}")
    assert len(oracle.device_drafts) >= 4 and len(full) > 2 * cfg.window_size


def test_switches(model):
    """Per request off, the engine off, and a draft width other than the block refused."""
    cfg, params, token_map, engine = model
    blk = cfg.dspark_block_size
    with pytest.raises(ValueError, match=f"draft width {blk + 1}: this checkpoint drafts blocks of {blk}"):
        make_engine(cfg, params, token_map, settings=engine.geom.settings, draft_width=blk + 1)
    with pytest.raises(ValueError, match="draft_slack >= "):
        make_engine(cfg, params, token_map, settings=SETTINGS, speculative=True)
    off = make_engine(cfg, params, token_map, settings=SETTINGS)
    assert not off.speculative                   # no slack reserved: off by default
    rid = off.add(Request([5, 6, 7], 4, speculative=True))
    (finish,) = off.scheduler.drain()
    assert finish.rid == rid and finish.result.finish_reason == "error" and "speculative" in finish.result.error
    engine.reset()
    assert engine.scheduler.by_id[engine.add(Request([5, 6, 7], 4))].spec
    assert not engine.scheduler.by_id[engine.add(Request([5, 6, 7], 4, speculative=False))].spec
    engine.reset()


def test_sampled_requests_speculate(model):
    """A sampled request verifies drafts by rejection sampling (its distribution is
    tests/test_speculative_sampling.py's): it runs its budget, and one seed gives one output."""
    cfg, params, token_map, engine = model
    req = Request([5, 9, 14, 3], 12, SamplingParams(temperature=0.9, top_k=50, seed=11), ignore_eos=True)
    runs = []
    for _ in range(2):
        engine.reset()
        stats = Stats()
        runs.append(engine.generate([req], stats=stats)[0].tokens)
        assert stats.verifies > 0 and len(runs[-1]) == 12
    assert runs[0] == runs[1]


def test_pipelined_traffic_never_refuses_and_keeps_budgets(model):
    """Speculative and plain requests arriving, finishing (length, EOS, stop ids) and aborted at
    any time, two steps in flight per request (pipelined verify spans): the stale-state check never
    fires on variable advances, no request emits past its budget and one ended by length has
    exactly its budget, and the allocators drain back to empty."""
    cfg, params, token_map, engine = model
    rng = np.random.default_rng(7)
    v, live, n, errors, results = cfg.vocab_size, set(), 0, [], {}
    for _ in range(60):
        while len(live) < 4:
            stop = tuple(rng.integers(3, v, 2).tolist()) if rng.random() < 0.3 else ()
            req = Request(rng.integers(3, v - 1, int(rng.integers(1, 30))).tolist(), int(rng.integers(1, 13)),
                          SamplingParams(temperature=0.9, seed=n) if n % 2 else SamplingParams(), stop_ids=stop,
                          ignore_eos=bool(n % 3), request_id=n, speculative=None if n % 4 else False)
            live.add(engine.add(req))
            n += 1
        if rng.random() < 0.05:
            engine.abort(int(rng.choice(sorted(live))))
        for e in engine.step():
            if isinstance(e, FinishEvent):
                live.discard(e.rid)
                results[e.rid] = e.result
                if e.result.finish_reason == "error":
                    errors.append(e.result.error)
    while engine.has_work:
        engine.step()
    assert errors == [] and len(results) > 15
    assert all(len(r.tokens) <= r.max_new_tokens for r in results.values())
    assert all(len(r.tokens) == r.max_new_tokens for r in results.values() if r.finish_reason == "length")
    assert engine.pages.available == engine.geom.settings.num_pages - 1 and engine.pages.quarantined == 0
    assert engine.slots.available == engine.geom.settings.slots


def test_pending_spans_resolve_to_the_host_batch(model):
    """The rules `step._resolve_pending` applies on the device (positions, tokens, visible columns,
    ring rows, reserved compress-plan rows, Engram ids hashed from the cursor, cursors after the
    span and after each accepted prefix) give what `build_step` gives on the host for the same
    spans at their real positions: decodes and verify spans of every width at positions from 1
    (history shorter than the n-gram) up, beside a host-built prefill chunk left as it is."""
    from v41_jax.runtime.metadata import Span, build_step
    from v41_jax.runtime.step import _resolve_pending

    cfg, _, _, engine = model
    runner, geom, blk = engine.runner, engine.geom, cfg.dspark_block_size
    assert runner.device_feedback
    bucket = engine.buckets.buckets[-1]
    pages = np.arange(1 + 16 * 3, 1 + 16 * 4, dtype=np.int32)        # 128 positions for every span
    resolve = jax.jit(lambda cache, batch: _resolve_pending(runner.params, cfg, geom, cache, batch))
    rng = np.random.default_rng(7)
    zero_cursor = np.zeros(geom.history + 1, np.int64)
    cache = runner.fresh_cache()
    for trial in range(10):
        cursors, sampled = np.asarray(cache.cursor).copy(), np.asarray(cache.sampled).copy()
        host, pending = [], []
        for slot in range(3):
            p = int(rng.integers(1, 5)) if trial < 3 else int(rng.integers(1, 100))
            k = int(rng.integers(0, blk + 1))
            toks = rng.integers(0, cfg.vocab_size, p + 1 + k)
            cursor = runner.cursor_row(toks, p)
            if k:
                sp = runner.verify_span(slot, slot, p, toks[:p], toks[p:], pages, cursor, SamplingParams())
            else:
                sp = runner.span(slot, slot, p, toks[p:], pages, cursor, draft=True)
            host.append(sp)
            # the host's placeholders: another position (an upper bound), no tokens, no Engram rows
            pending.append(Span(slot, slot, p + 3, np.zeros(1 + k, np.int32), pages, zero_cursor,
                                *runner._zero_engram(1 + k), all_logits=bool(k), verify=k, draft=True,
                                prefix_cursors=np.zeros((k, len(zero_cursor)), np.int64) if k else None,
                                pending=True))
            cursors[slot], sampled[slot, :1 + k] = cursor, toks[p:]
        chunk = rng.integers(0, cfg.vocab_size, 9)
        prefill = runner.span("c", 3, 0, chunk, pages, None)
        want = build_step(geom, cfg, bucket, host + [prefill]).batch
        placeholders = build_step(geom, cfg, bucket, pending + [prefill]).batch
        got = resolve(replace(cache, cursor=cursors, sampled=sampled), jax.tree_util.tree_map(jnp.asarray, placeholders))
        for name in ("tokens", "positions", "req_pos", "visible", "window_writes", "ring_writes", "cursor_rows",
                     "engram_codes", "engram_scales"):
            jax.tree_util.tree_map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b, err_msg=name),
                                   getattr(got, name), getattr(want, name))
        for b, sp in enumerate(host):
            np.testing.assert_array_equal(np.asarray(got.spec_cursors)[b, :sp.verify],
                                          want.spec_cursors[b, :sp.verify])
        for r, g, w in zip(geom.ratios, got.compress_plans, want.compress_plans):
            rows = lambda plan: sorted(map(tuple, np.asarray(plan)[np.asarray(plan)[:, 1] >= 0].tolist()))
            assert rows(g) == rows(w), (trial, r)
