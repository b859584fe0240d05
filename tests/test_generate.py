"""Generation: continuous batching == each request alone, slot reuse == fresh cache, stops, bad
requests, no recompilation after warm-up, and the generate script."""

import json
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from scripts import generate as generate_script
from tests.engine_common import BUCKETS, SETTINGS, build_model, make_engine
from v41_jax.runtime.compile_cache import CompileMeter
from v41_jax.runtime.request import Request
from v41_jax.runtime.metadata import Bucket, BucketSet
from v41_jax.runtime.sampling import SamplingParams


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    return path, build_model(path, "tiny", seed=0)


@pytest.fixture(scope="module")
def engine(model):
    return make_engine(*model[1], prefill_chunk=16)


def _requests(vocab: int, n: int, seed: int = 0) -> list[Request]:
    """Different prompt lengths, budgets and samplers; staggered by the queue (n > 4 slots)."""
    rng = np.random.default_rng(seed)
    lengths = [5, 23, 40, 13, 31, 9, 17, 2][:n]
    out = []
    for i, n_prompt in enumerate(lengths):
        sampling = SamplingParams(temperature=0.9, top_k=30, top_p=0.9, seed=i) if i % 3 == 1 else SamplingParams()
        out.append(Request(rng.integers(3, vocab - 1, n_prompt).tolist(), int(rng.integers(6, 20)),
                           sampling, ignore_eos=True, request_id=f"r{i}"))
    return out


def _alone(engine, req):
    engine.reset()
    return engine.generate([req])[0]


def test_mixed_batch_equals_each_alone(engine):
    reqs = _requests(engine.cfg.vocab_size, 6)
    engine.reset()
    mixed = engine.generate(reqs)
    assert [r.request_id for r in mixed] == [q.request_id for q in reqs]
    for req, got in zip(reqs, mixed):
        alone = _alone(engine, req)
        assert got.tokens == alone.tokens and got.finish_reason == alone.finish_reason == "length"
        assert len(got.tokens) == req.max_new_tokens
    # every page came back (freed pages leave quarantine once their last step completed)
    assert engine.pages.available == SETTINGS.num_pages - 1 and engine.pages.quarantined == 0


def test_slot_reuse_equals_fresh_cache_even_over_poisoned_state(engine):
    """A finished request's slot and pages handed to a new one leak nothing: poison every PAGE row
    and every STATE entry with NaN first; the new request must still match a fresh cache."""
    first, second, new = _requests(engine.cfg.vocab_size, 3, seed=1)
    fresh = _alone(engine, new)
    engine.reset()
    engine.generate([first, second])
    poison = lambda x: jnp.full_like(x, jnp.nan) if jnp.issubdtype(x.dtype, jnp.floating) else jnp.full_like(x, 77)
    engine.cache = jax.tree_util.tree_map(poison, engine.cache)
    again = engine.generate([new])[0]
    assert again.tokens == fresh.tokens


def test_stop_ids_and_eos(engine):
    req = _requests(engine.cfg.vocab_size, 1)[0]
    full = _alone(engine, req).tokens
    stop = full[4]
    cut = full[: full.index(stop) + 1]
    engine.reset()
    got = engine.generate([Request(req.prompt, req.max_new_tokens, stop_ids=(stop,), ignore_eos=True)])[0]
    assert got.tokens == cut and got.finish_reason == "stop"
    engine.reset()
    engine.eos_id = stop
    try:
        got = engine.generate([Request(req.prompt, req.max_new_tokens)])[0]
    finally:
        engine.eos_id = engine.cfg.eos_token_id
    assert got.tokens == cut and got.finish_reason == "eos"


def test_bad_requests_are_refused_and_disturb_nothing(engine):
    good = _requests(engine.cfg.vocab_size, 2, seed=2)
    v = engine.cfg.vocab_size
    bad = [Request([]), Request([3, v]), Request([3] * SETTINGS.max_context), Request([3, 4], max_new_tokens=0)]
    engine.reset()
    clean = engine.generate(good)
    engine.reset()
    mixed = engine.generate([good[0], *bad, good[1]])
    assert [r.finish_reason for r in mixed[1:5]] == ["error"] * 4
    msgs = [r.error for r in mixed[1:5]]
    assert "empty" in msgs[0] and "token ids" in msgs[1] and "max_context" in msgs[2] and "max_new" in msgs[3]
    assert mixed[0].tokens == clean[0].tokens and mixed[5].tokens == clean[1].tokens


def test_no_recompilation_after_warmup(model):
    """>= 50 steps whose composition keeps changing (1-4 requests, decodes, prefill chunks of
    every length, queueing) inside a two-bucket set compile nothing after warm-up."""
    buckets = BucketSet((BUCKETS.buckets[-1], Bucket(4, 4, 4)))
    engine = make_engine(*model[1], buckets=buckets, prefill_chunk=16)
    engine.warmup()
    lowered, compiled = CompileMeter.lowerings, CompileMeter.xla_compiles()
    warm_steps = engine.step_id
    reqs = [replace(r, max_new_tokens=r.max_new_tokens + 20) for r in _requests(engine.cfg.vocab_size, 8, seed=3)]
    results = engine.generate(reqs)
    assert all(r.finish_reason == "length" for r in results)
    assert engine.step_id - warm_steps >= 50
    assert all(engine.bucket_steps[b] > 1 for b in buckets.buckets)     # both shapes in use
    assert CompileMeter.lowerings == lowered and CompileMeter.xla_compiles() == compiled


def test_generate_script(model, tmp_path, capsys):
    path, (cfg, _, _) = model
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "a", "prompt_ids": [5, 6, 7, 8]}) + "\n"
                       + json.dumps({"id": "b", "prompt_ids": [9] * 20, "temperature": 0.7, "seed": 3}) + "\n"
                       + json.dumps({"id": "bad", "prompt_ids": []}) + "\n")
    out = tmp_path / "out.jsonl"
    s = SETTINGS
    rc = generate_script.main([
        "--checkpoint", str(path), "--prompts", str(prompts), "--out", str(out), "--max-new-tokens", "6",
        "--numerics", "fp32", "--buckets", "80x4x80", "--chunk", "16", "--page-tokens", str(s.page_tokens),
        "--pages", str(s.num_pages), "--slots", str(s.slots), "--max-context", str(s.max_context),
        "--compile-cache", "", "--quiet"])
    assert rc == 0
    rows = [json.loads(l) for l in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == ["a", "b", "bad"]
    assert len(rows[0]["tokens"]) == 6 and all(0 <= t < cfg.vocab_size for t in rows[0]["tokens"])
    assert rows[2]["finish_reason"] == "error" and "empty" in rows[2]["error"]
    err = capsys.readouterr().err
    assert "summary: 3 requests (1 refused)" in err and "tokens/s" in err and "compile" in err


def test_pallas_kernels_generate_what_the_xla_path_does(model, tmp_path):
    """The whole engine on the Pallas kernels (interpreted here: paged sparse attention, paged
    indexer, the decode MoE GEMV and the grouped GEMM for prefill chunks) against the XLA path, in
    fp32 numerics where only fp32 summation order differs: the same tokens. (In bf16 `fast`
    numerics the two paths diverge on this random-weight model after a few tokens: the fp4
    fake-quant of the index q/k turns last-bit differences into different index picks.)"""
    from kernels_pallas import backend

    path, _ = model
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps(r) for r in (
        {"id": "a", "prompt_ids": [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]},
        {"id": "b", "prompt_ids": [40, 41, 42, 43] * 5},
        {"id": "c", "prompt_ids": [100, 200, 300, 17, 3], "temperature": 0.8, "top_k": 40, "seed": 7})) + "\n")
    s = SETTINGS
    tokens = {}
    for name in ("xla", "pallas"):
        out = tmp_path / f"{name}.jsonl"
        with backend.use_backend(name):
            assert generate_script.main([
                "--checkpoint", str(path), "--prompts", str(prompts), "--out", str(out), "--max-new-tokens", "10",
                "--numerics", "fp32", "--buckets", "32x4x32,4x4x4", "--chunk", "16",
                "--page-tokens", str(s.page_tokens), "--pages", str(s.num_pages), "--slots", str(s.slots),
                "--max-context", str(s.max_context), "--compile-cache", "", "--quiet"]) == 0
        tokens[name] = [json.loads(l)["tokens"] for l in out.read_text().splitlines()]
    assert all(len(t) == 10 for t in tokens["xla"])
    assert tokens["pallas"] == tokens["xla"]
