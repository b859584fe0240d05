"""`python -m scripts.generate` as a user meets it: bad lines, usage errors before anything loads,
a file with nothing to run, context-capped budgets, the checkpoint's tokenizer, --stream, the
progress bar, the summary, --help. In-process (`main([...])`), one tiny checkpoint, few model runs."""

import json
import re
import shutil

import pytest

from scripts import generate as generate_script
from tests.engine_common import SETTINGS, SUITE_CACHE, build_model
from v41_jax.checkpoint import load as load_module
from v41_jax.runtime.compile_cache import CompileMeter
from v41_jax.runtime.engine import Engine, auto_decode_sizes, default_buckets, parse_decode_sizes
from v41_jax.runtime.metadata import Bucket
from v41_jax.runtime.request import Request
from v41_jax.runtime.request_parse import FIELDS

S = SETTINGS
ENGINE_FLAGS = ["--numerics", "fp32", "--buckets", "80x4x80", "--chunk", "16", "--page-tokens", str(S.page_tokens),
                "--pages", str(S.num_pages), "--slots", str(S.slots), "--max-context", str(S.max_context),
                "--compile-cache", str(SUITE_CACHE)]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    cfg, _, _ = build_model(path, "tiny", seed=0)
    return path, cfg


@pytest.fixture(scope="module")
def tok_model(model, tmp_path_factory):
    """A copy of the checkpoint with a WordLevel tokenizer.json ("w<i>" is token i, vocab = the config's)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    path, cfg = model
    copy = tmp_path_factory.mktemp("tiny_tok") / "ckpt"
    shutil.copytree(path, copy)
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(cfg.vocab_size)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    assert tok.get_vocab_size() == cfg.vocab_size
    tok.save(str(copy / "tokenizer.json"))
    return copy, tok


@pytest.fixture
def load_spy(monkeypatch):
    """load_params replaced by a recorder that fails: a test asserting `calls == []` shows nothing loaded."""
    calls = []

    def spy(*a, **kw):
        calls.append(a)
        raise AssertionError("load_params called")

    monkeypatch.setattr(load_module, "load_params", spy)
    return calls


def _main(capsys, argv):
    """-> (exit code, stdout, stderr); argparse's SystemExit is an exit code too."""
    try:
        rc = generate_script.main([str(a) for a in argv])
    except SystemExit as e:
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def _write(path, lines):
    path.write_text("".join((l if isinstance(l, str) else json.dumps(l)) + "\n" for l in lines))
    return path


# line -> the field its error must name (line numbers are 1-based; the file has no blank lines)
BAD = [
    ('{"id": "x", "prompt_ids": [1, 2', "json"),                      # malformed JSON
    ({"prompt_ids": [5, "a"]}, "prompt_ids"),                         # non-integer id
    ('{"prompt_ids": [5, 1.0]}', "prompt_ids"),                       # float id
    ({"prompt_ids": "123"}, "prompt_ids"),                            # a string, not a list
    ({"prompt_ids": [5, True]}, "prompt_ids"),                        # bool id
    ({"id": "np", "max_new_tokens": 3}, "prompt"),                    # no prompt
    ({"prompt_ids": [5], "top_p": 0}, "top_p"),                       # sampling value out of range
    ("5", "request"),
    ("null", "request"),
    ('{"prompt_ids": [5, NaN]}', "json"),                             # NaN (strict JSON refuses it)
    ({"prompt_ids": [5], "seed": 2 ** 70}, "seed"),
    ({"prompt_ids": [5], "max_new_tokens": "5"}, "max_new_tokens"),
    ({"prompt_ids": [5], "temperature": "hot"}, "temperature"),
    ({"prompt_ids": [5], "colour": "red"}, "colour"),                 # unknown field
    ({"id": "a", "prompt_ids": [9]}, "id"),                           # duplicate of line 1's id
    ({"id": "t", "prompt": "hello"}, "prompt"),                       # text without a tokenizer
]


def test_bad_lines_cap_progress_and_summary(model, tmp_path, capsys):
    """One run: every bad line is its own error row (file:line: field) and stderr line, the good lines
    run; a context-capped budget is noted and stops at the cap; the progress bar reaches its total
    though one request stops early; the summary has every number."""
    path, cfg = model
    good_first = {"id": "a", "prompt_ids": [5, 6, 7, 8], "max_new_tokens": 6, "ignore_eos": True}
    cap = {"id": "cap", "prompt_ids": [7] * 100, "max_new_tokens": 50, "ignore_eos": True}
    stop = {"id": "stop", "prompt_ids": [9] * 10, "max_new_tokens": 20, "ignore_eos": True,
            "stop_ids": list(range(cfg.vocab_size))}                  # any token stops it: 1 of 20
    long = {"id": "long", "prompt_ids": [7] * S.max_context}      # parses; the engine refuses it
    lines = [good_first] + [l for l, _ in BAD] + [long, cap, stop]
    prompts = _write(tmp_path / "p.jsonl", lines)
    out = tmp_path / "out.jsonl"
    rc, stdout, err = _main(capsys, ["--checkpoint", path, "--prompts", prompts, "--out", out, *ENGINE_FLAGS])
    assert rc == 0 and stdout == ""
    rows = [json.loads(l) for l in out.read_text().splitlines()]
    assert len(rows) == len(lines)

    for n, (row, (_, field)) in enumerate(zip(rows[1:], BAD), start=2):
        assert row["finish_reason"] == "error" and row["tokens"] == [], row
        assert row["error"].startswith(f"{prompts}:{n}: {field}: "), (n, row["error"])
        assert f"error: {row['error']}" in err.splitlines()
    assert "tokenizer" in rows[len(BAD)]["error"]                   # the text prompt's
    assert "earlier line" in rows[len(BAD) - 1]["error"]            # the duplicate's
    assert rows[-3]["finish_reason"] == "error" and "max_context" in rows[-3]["error"]
    assert f"error: request 'long': {rows[-3]['error']}" in err.splitlines()

    first, capped, stopped = rows[0], rows[-2], rows[-1]
    assert first["id"] == "a" and first["finish_reason"] == "length" and len(first["tokens"]) == 6
    assert all(0 <= t < cfg.vocab_size for t in first["tokens"])
    budget = S.max_context - 100
    assert capped["finish_reason"] == "length" and len(capped["tokens"]) == budget
    [note] = [l for l in err.splitlines() if l.startswith("note:")]
    assert "'cap'" in note and "50" in note and str(budget) in note and str(S.max_context) in note
    assert stopped["finish_reason"] == "stop" and len(stopped["tokens"]) == 1

    bars = re.findall(r"(\d+)/(\d+) \[[^\]\r\n]*(?:tok/s|s/tok)\]", err)
    total = 6 + budget + 20
    assert bars and bars[-1] == (str(total), str(total))

    [summary] = [l for l in err.splitlines() if l.startswith("summary:")]
    assert f"summary: {len(lines)} requests ({len(BAD) + 1} refused)" in summary
    num = r"\d+(\.\d+)?"
    assert re.search(rf"TTFT p50 {num} ms, p95 {num} ms; inter-token p50 {num} ms, p95 {num} ms", summary)
    assert re.search(rf"{num} tokens/s", summary) and re.search(rf"compile {num} s, run {num} s", summary)
    assert f"{6 + budget + 1} generated tokens" in summary


def test_tokenizer_from_checkpoint_and_stream(tok_model, tmp_path, capsys):
    """tokenizer.json in the checkpoint folder: a text prompt runs without --tokenizer, rows have
    text; --stream prints each token event and a final <reason> line per request."""
    path, tok = tok_model
    prompts = _write(tmp_path / "p.jsonl", [
        {"id": "t1", "prompt": "w5 w6 w7 w8", "max_new_tokens": 5, "ignore_eos": True},
        {"id": "t2", "prompt_ids": [9, 10, 11], "max_new_tokens": 3, "ignore_eos": True}])
    rc, stdout, err = _main(capsys, ["--checkpoint", path, "--prompts", prompts, "--stream", *ENGINE_FLAGS])
    assert rc == 0
    rows = [json.loads(l) for l in stdout.splitlines()]
    assert [r["id"] for r in rows] == ["t1", "t2"] and rows[0]["prompt_len"] == 4
    for row in rows:
        assert row["finish_reason"] == "length" and row["text"] == tok.decode(row["tokens"])
    lines = err.splitlines()
    for row in rows:
        mine = [l[len(f"[{row['id']}] "):] for l in lines if l.startswith(f"[{row['id']}] ")]
        assert mine[-1] == "<length>" and all(not m.startswith("<") for m in mine[:-1])
        assert len(mine) - 1 == len(row["tokens"])                  # one line per token event here
        assert " ".join(mine[:-1]).split() == [f"w{t}" for t in row["tokens"]]   # text, as it came


def test_usage_errors_before_the_checkpoint_loads(model, tmp_path, capsys, load_spy):
    path, _ = model
    prompts = _write(tmp_path / "p.jsonl", [{"prompt_ids": [5, 6]}])
    base = ["--checkpoint", path, "--prompts", prompts, *ENGINE_FLAGS]
    cases = [
        (["--checkpoint", path, "--prompts", tmp_path / "missing.jsonl"], "missing.jsonl"),
        (["--checkpoint", tmp_path / "no_ckpt", "--prompts", prompts], "no_ckpt"),
        (base + ["--buckets", "80x4"], "--buckets"),
        (base + ["--buckets", "0x4x4"], "--buckets"),
        (base + ["--buckets", "64x1x1,8x4x8"], "no bucket holds the largest step the scheduler plans (64 tokens, "
                                               "4 requests, 8 logits rows); add 64x4x8"),
        (base + ["--top-p", "2"], "--top-p"),
        (base + ["--one-bucket"], "--one-bucket"),               # ENGINE_FLAGS give --buckets
        (base + ["--decode-sizes", "1,2"], "--decode-sizes"),     # likewise
        (base[:-len(ENGINE_FLAGS)] + ["--decode-sizes", "1,8"], "--decode-sizes"),      # > --max-batch 4
        (base[:-len(ENGINE_FLAGS)] + ["--decode-sizes", "1,x"], "--decode-sizes"),
        (base[:-len(ENGINE_FLAGS)] + ["--decode-sizes", "0"], "--decode-sizes"),
        (base[:-len(ENGINE_FLAGS)] + ["--decode-sizes", "1", "--one-bucket"], "--one-bucket"),
        (base + ["--out", tmp_path / "nowhere" / "o.jsonl"], "--out"),
        (base + ["--index-format", "fp4"], "--index-format fp4: "),   # ENGINE_FLAGS: fp32, no fake-quant
        (base + ["--kv-format", "packed"], "--kv-format packed: "),   # likewise
    ]
    for argv, named in cases:
        rc, stdout, err = _main(capsys, argv)
        assert rc == 2 and stdout == "", argv
        assert len(err.splitlines()) == 1 and err.startswith("error: ") and named in err, err
    rc, _, err = _main(capsys, base + ["--max-new-tokens", "0"])         # argparse: usage + one error line
    assert rc == 2 and "Traceback" not in err and "--max-new-tokens: must be >= 1" in err.splitlines()[-1]
    assert load_spy == []


def test_no_valid_request_loads_and_compiles_nothing(model, tmp_path, capsys, load_spy):
    path, _ = model
    prompts = _write(tmp_path / "p.jsonl", ["5", {"prompt_ids": []}, {"id": "t", "prompt": "hi"}])
    lowered, compiled = CompileMeter.lowerings, CompileMeter.xla_compiles()
    rc, stdout, err = _main(capsys, ["--checkpoint", path, "--prompts", prompts, *ENGINE_FLAGS])
    assert rc == 0 and load_spy == []
    assert CompileMeter.lowerings == lowered and CompileMeter.xla_compiles() == compiled
    rows = [json.loads(l) for l in stdout.splitlines()]
    assert [r["finish_reason"] for r in rows] == ["error"] * 3
    assert "summary: 3 requests (3 refused), nothing to run: loaded and compiled nothing" in err


def test_help_documents_every_flag_and_the_schema(capsys):
    from v41_jax.checkpoint.load import DENSE_HOLDS, EXPERT_HOLDS
    # the CLI's choices (spelled here: parsing imports no jax) are the loader's
    assert generate_script.EXPERT_CHOICES == EXPERT_HOLDS and generate_script.DENSE_CHOICES == DENSE_HOLDS
    parser = generate_script.build_parser()
    assert [a.dest for a in parser._actions if not a.help] == []
    rc, stdout, _ = _main(capsys, ["--help"])
    assert rc == 0
    for field in FIELDS:
        assert re.search(rf"\b{field}\b", stdout), field
    assert "--stream" in stdout and "Example line" in stdout


def test_one_bucket_is_the_prefill_bucket():
    """--one-bucket (make generate): decode steps run in the prefill bucket, nothing else compiles."""
    both, one = default_buckets(4, 64, 6), default_buckets(4, 64, 6, decode_sizes=())
    assert len(both.buckets) == 2 and one.buckets == both.buckets[1:]
    assert (one.max_tokens, one.max_requests, one.buckets[0].logits) == (64 + 4 * 6, 4, 4 * 6)


def test_decode_sizes_give_each_batch_its_own_bucket():
    """A decode step of b requests runs in the smallest decode bucket holding b (width rows each),
    not padded to the full batch; the GPU default is the powers of two up to the batch."""
    buckets = default_buckets(32, 64, 6, (1, 8, 32))
    assert buckets.buckets == (Bucket(6, 1, 6), Bucket(48, 8, 48), Bucket(192, 32, 192), Bucket(64 + 192, 32, 192))
    assert [buckets.pick(b, 6 * b, 6 * b) for b in (1, 2, 8, 9)] == [Bucket(6, 1, 6)] + [Bucket(48, 8, 48)] * 2 + [Bucket(192, 32, 192)]
    assert auto_decode_sizes(32, gpu=True) == (1, 2, 4, 8, 16, 32)
    assert auto_decode_sizes(6, gpu=True) == (1, 2, 4, 6) and auto_decode_sizes(1, gpu=True) == (1,)
    assert auto_decode_sizes(32, gpu=False) == (32,)
    assert parse_decode_sizes("1,4") == (1, 4) and parse_decode_sizes("") == ()
    for bad in ("1,x", "0", "-2"):
        with pytest.raises(ValueError, match="decode sizes"):
            parse_decode_sizes(bad)
    with pytest.raises(ValueError, match=r"\[8\] not in 1..4"):
        default_buckets(4, 64, 1, (1, 8))


def test_smaller_decode_buckets_emit_the_same_tokens(model):
    """Three requests ending at different lengths (3, 2, then 1 running) in an engine with decode
    buckets for 2 and 4 requests: the steps move to the smaller bucket once 2 run, and every token
    equals the engine whose decode steps all pad to 4 requests (fp32: padding rows change no real
    row). Two sizes, not 1/2/4: each bucket is a compile (~25 s of the suite's CPU), and one size
    smaller already shows the move; bucket choice for every size is tested on `default_buckets`."""
    path, _ = model
    kw = dict(numerics="fp32", max_batch=4, chunk=16, page_tokens=S.page_tokens, max_context=S.max_context,
              compile_cache_dir=str(SUITE_CACHE))
    reqs = [Request([5 + i, 9, 11], max_new_tokens=n, ignore_eos=True) for i, n in enumerate((3, 7, 12))]
    runs = {}
    for sizes in ((4,), (2, 4)):
        eng = Engine.from_checkpoint(path, decode_sizes=sizes, **kw)
        runs[sizes] = ([r.tokens for r in eng.generate(reqs)], eng.bucket_steps)
    (one, steps_one), (many, steps_many) = runs[(4,)], runs[(2, 4)]
    assert many == one and [len(t) for t in one] == [3, 7, 12]
    decode = lambda steps: {b.requests for b in steps if b.tokens == b.logits}      # not the prefill bucket
    assert decode(steps_many) == {2, 4} and decode(steps_one) == {4}
