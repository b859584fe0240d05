"""Request validation (v41_jax.runtime.request_parse) and SamplingParams' checks: strict types, bounded reads."""

import io
import json
import math
import time

import numpy as np
import pytest

from v41_jax.runtime.request import Request
from v41_jax.runtime.request_parse import (FIELDS, RequestDefaults, RequestError, decode_json, parse_file,
                                           parse_request, read_jsonl)
from v41_jax.runtime.sampling import SamplingParams

V = 512
D = RequestDefaults()


def ok(obj, **kw) -> Request:
    return parse_request(obj, vocab_size=V, defaults=kw.pop("defaults", D), **kw)


def refused(obj, field, match=None, **kw) -> RequestError:
    with pytest.raises(RequestError) as info:
        ok(obj, **kw)
    assert info.value.field == field, str(info.value)
    if match is not None:
        assert match in str(info.value), str(info.value)
    return info.value


def line_error(text: str, field: str) -> RequestError:
    """A raw line through the decoder and the parser: refused on `field`."""
    [(n, value)] = list(read_jsonl(io.BytesIO(text.encode())))
    if not isinstance(value, RequestError):
        with pytest.raises(RequestError) as info:
            ok(value)
        value = info.value
    assert value.field == field, str(value)
    return value


class Tok:
    """A stand-in tokenizer: one id per character (tokenizers' Encoding has .ids; so does this)."""
    class _Enc:
        def __init__(self, ids):
            self.ids = ids

    def __init__(self, offset=0):
        self.offset = offset

    def encode(self, text):
        return self._Enc([ord(c) % 300 + self.offset for c in text])


# ---- the valid shapes -----------------------------------------------------------------------------

def test_minimal_takes_defaults():
    r = ok({"prompt_ids": [1, 2, 3]}, index=7)
    assert r.prompt == [1, 2, 3] and r.request_id == 7 and r.max_new_tokens == 32
    assert r.sampling == SamplingParams() and r.stop_ids == () and r.ignore_eos is False


def test_every_field():
    r = ok({"id": "a", "prompt_ids": [0, V - 1], "max_new_tokens": 5, "temperature": 1, "top_k": 40,
            "top_p": 0.9, "seed": 2 ** 32 - 1, "stop_ids": [3, 4], "ignore_eos": True})
    assert r.request_id == "a" and r.prompt == [0, V - 1] and r.max_new_tokens == 5
    assert r.sampling == SamplingParams(temperature=1.0, top_k=40, top_p=0.9, seed=2 ** 32 - 1)
    assert type(r.sampling.temperature) is float
    assert r.stop_ids == (3, 4) and r.ignore_eos is True


def test_defaults_fill_absent_fields():
    d = RequestDefaults(max_new_tokens=7, temperature=0.5, top_k=3, top_p=0.5, seed=9, stop_ids=[1],
                        ignore_eos=True)
    r = ok({"prompt_ids": [1]}, defaults=d)
    assert (r.max_new_tokens, r.sampling, r.stop_ids, r.ignore_eos) == (
        7, SamplingParams(0.5, 3, 0.5, 9), (1,), True)
    assert ok({"prompt_ids": [1], "top_k": 0}, defaults=d).sampling.top_k == 0


def test_no_seed_anywhere_draws_a_fresh_one():
    """The server's defaults name no seed: each request that names none gets its own (two sampled
    requests for one prompt differ); a request's own seed, or a default one, is kept."""
    d = RequestDefaults(temperature=1.0, seed=None)
    seeds = {ok({"prompt_ids": [1]}, defaults=d).sampling.seed for _ in range(8)}
    assert len(seeds) == 8 and all(0 <= s < 2 ** 32 for s in seeds)      # equal pairs: p ~ 28 / 2**32
    assert ok({"prompt_ids": [1], "seed": 5}, defaults=d).sampling.seed == 5
    assert ok({"prompt_ids": [1]}).sampling.seed == 0                     # the CLI's default
    assert ok({"prompt_ids": [1], "seed": None}, defaults=d).sampling.seed not in seeds   # null = absent
    assert ok({"prompt_ids": [1], "seed": None}).sampling.seed == 0


def test_defaults_checked():
    for kw, field in [({"max_new_tokens": 0}, "max_new_tokens"), ({"temperature": math.nan}, "temperature"),
                      ({"top_p": 0.0}, "top_p"), ({"seed": -1}, "seed"), ({"top_k": True}, "top_k"),
                      ({"stop_ids": [-1]}, "stop_ids"), ({"ignore_eos": 1}, "ignore_eos")]:
        with pytest.raises(RequestError) as info:
            RequestDefaults(**kw)
        assert info.value.field == field
    refused({"prompt_ids": [1]}, "stop_ids", "default", defaults=RequestDefaults(stop_ids=(V,)))


def test_defaults_from_args():
    import argparse
    args = argparse.Namespace(max_new_tokens=4, temperature=0.0, top_k=0, top_p=1.0, seed=1, stop_ids=[5],
                              ignore_eos=False, checkpoint="x")
    assert RequestDefaults.from_args(args) == RequestDefaults(max_new_tokens=4, seed=1, stop_ids=(5,))


def test_text_prompt_with_tokenizer():
    r = ok({"prompt": "hi"}, tokenizer=Tok())
    assert r.prompt == [ord("h"), ord("i")]


def test_text_prompt_needs_tokenizer():
    e = refused({"prompt": "hi"}, "prompt")
    assert str(e) == ("prompt: a text prompt needs a tokenizer (--tokenizer or tokenizer.json in the "
                      "checkpoint folder)")


def test_tokenizer_ids_range_checked():
    refused({"prompt": "hi"}, "prompt", "the tokenizer's ids", tokenizer=Tok(offset=V))


def test_lone_surrogate_prompt_refused():
    refused(decode_json('{"prompt": "a\\ud800"}'), "prompt", "surrogate", tokenizer=Tok())


# ---- prompt and ids --------------------------------------------------------------------------------

def test_prompt_and_prompt_ids_exactly_one():
    refused({"prompt": "a", "prompt_ids": [1]}, "prompt", "not both", tokenizer=Tok())
    refused({}, "prompt")
    refused({"id": 3}, "prompt")


def test_empty_prompt_refused():
    refused({"prompt_ids": []}, "prompt_ids", "empty")
    refused({"prompt": ""}, "prompt", "empty", tokenizer=Tok())


def test_prompt_ids_string_refused():
    refused({"prompt_ids": "123"}, "prompt_ids", 'got "123"')
    refused({"prompt": 123}, "prompt")
    refused({"prompt_ids": {"0": 1}}, "prompt_ids")
    refused({"prompt_ids": None}, "prompt_ids", "got null")


def test_float_ids_refused():
    e = refused({"prompt_ids": [4, 5, 6, 1.5]}, "prompt_ids")
    assert str(e) == f"prompt_ids: must be a list of integers in [0, {V}), item 3 is 1.5"
    refused({"prompt_ids": [1.0]}, "prompt_ids", "item 0 is 1.0")


def test_bool_ids_refused():
    refused({"prompt_ids": [1, True]}, "prompt_ids", "item 1 is true")
    refused({"prompt_ids": [False]}, "prompt_ids", "item 0 is false")
    refused({"prompt_ids": [1], "stop_ids": [True]}, "stop_ids", "item 0 is true")


def test_ids_out_of_range_name_the_item():
    refused({"prompt_ids": [0, 1, V]}, "prompt_ids", f"item 2 is {V}")
    refused({"prompt_ids": [0, -1]}, "prompt_ids", "item 1 is -1")
    refused({"prompt_ids": [[1]]}, "prompt_ids", "item 0 is a list")
    refused({"prompt_ids": [1], "stop_ids": [V + 3]}, "stop_ids", f"item 0 is {V + 3}")


def test_stop_ids_string_refused():
    refused({"prompt_ids": [1], "stop_ids": "ab"}, "stop_ids", 'got "ab"')
    refused({"prompt_ids": [1], "stop_ids": 5}, "stop_ids")
    assert ok({"prompt_ids": [1], "stop_ids": []}).stop_ids == ()


def test_nan_infinity_ids_refused():
    for text in ['{"prompt_ids": [NaN]}', '{"prompt_ids": [1, Infinity]}', '{"prompt_ids": [-Infinity]}',
                 '{"prompt_ids": [1e999]}', '{"prompt_ids": [1], "temperature": NaN}',
                 '{"prompt_ids": [1], "top_p": Infinity}']:
        line_error(text, "json")
    # and from a lenient decoder's dict (a server's): refused on the field
    refused({"prompt_ids": [math.nan]}, "prompt_ids")
    refused({"prompt_ids": [1], "temperature": math.nan}, "temperature", "NaN")
    refused({"prompt_ids": [1], "temperature": math.inf}, "temperature", "Infinity")
    refused({"prompt_ids": [1], "top_p": math.nan}, "top_p")


# ---- scalar fields ---------------------------------------------------------------------------------

def test_max_new_tokens_string_refused():
    refused({"prompt_ids": [1], "max_new_tokens": "5"}, "max_new_tokens", 'got "5"')
    refused({"prompt_ids": [1], "max_new_tokens": 0}, "max_new_tokens")
    refused({"prompt_ids": [1], "max_new_tokens": 5.0}, "max_new_tokens")
    refused({"prompt_ids": [1], "max_new_tokens": True}, "max_new_tokens")
    refused({"prompt_ids": [1], "max_new_tokens": 2 ** 31}, "max_new_tokens")
    refused({"prompt_ids": [1], "max_new_tokens": None}, "max_new_tokens", "got null")


def test_seed_2_pow_70_refused():
    e = refused({"prompt_ids": [1], "seed": 2 ** 70}, "seed")
    assert str(2 ** 70) in str(e)
    refused({"prompt_ids": [1], "seed": 2 ** 32}, "seed")
    refused({"prompt_ids": [1], "seed": -1}, "seed")
    refused({"prompt_ids": [1], "seed": 1.0}, "seed")
    refused({"prompt_ids": [1], "seed": 10 ** 500}, "seed", "bits")
    line_error('{"prompt_ids": [1], "seed": %s}' % ("9" * 2000), "json")     # over-long literal
    assert ok({"prompt_ids": [1], "seed": 2 ** 32 - 1}).sampling.seed == 2 ** 32 - 1


def test_temperature_hot_refused():
    refused({"prompt_ids": [1], "temperature": "hot"}, "temperature", 'got "hot"')
    refused({"prompt_ids": [1], "temperature": True}, "temperature")
    refused({"prompt_ids": [1], "temperature": -0.1}, "temperature")
    refused({"prompt_ids": [1], "temperature": 10 ** 400}, "temperature")     # beyond float range
    assert ok({"prompt_ids": [1], "temperature": 2}).sampling.temperature == 2.0


def test_top_k_top_p_ranges():
    refused({"prompt_ids": [1], "top_k": -1}, "top_k")
    refused({"prompt_ids": [1], "top_k": 2.0}, "top_k")
    refused({"prompt_ids": [1], "top_k": "1"}, "top_k")
    for p in (0, 0.0, -0.5, 1.0001, "1", False, True):
        refused({"prompt_ids": [1], "top_p": p}, "top_p")
    assert ok({"prompt_ids": [1], "top_p": 1}).sampling.top_p == 1.0


def test_ignore_eos_string_refused():
    refused({"prompt_ids": [1], "ignore_eos": "no"}, "ignore_eos", 'got "no"')
    refused({"prompt_ids": [1], "ignore_eos": 0}, "ignore_eos")
    refused({"prompt_ids": [1], "ignore_eos": None}, "ignore_eos")


def test_logprobs_field():
    if "logprobs" not in Request.__dataclass_fields__:
        refused({"prompt_ids": [1], "logprobs": True}, "logprobs", "unknown field")
        return
    assert ok({"prompt_ids": [1], "logprobs": True}).logprobs is True
    assert ok({"prompt_ids": [1]}, defaults=RequestDefaults(logprobs=True)).logprobs is True
    refused({"prompt_ids": [1], "logprobs": 1}, "logprobs")


def test_id_types():
    assert ok({"id": 0, "prompt_ids": [1]}).request_id == 0
    assert ok({"id": "", "prompt_ids": [1]}).request_id == ""
    for bad in (1.5, True, None, [1], {}):
        refused({"id": bad, "prompt_ids": [1]}, "id")


def test_unknown_field_refused():
    e = refused({"prompt_ids": [1], "temprature": 1.0}, "temprature", "unknown field")
    assert "temperature" in str(e)                 # the known ones are listed


def test_error_carries_request_id():
    assert refused({"id": "x", "prompt_ids": [V]}, "prompt_ids").request_id == "x"
    assert refused({"prompt_ids": [V]}, "prompt_ids", index=4).request_id == 4


def test_line_5_and_null_refused():
    for text in ("5", "null", "[1]", '"s"', "true", "1.5"):
        e = line_error(text, "request")
        assert "must be a JSON object" in str(e)


# ---- JSON and lines --------------------------------------------------------------------------------

def test_malformed_json_names_position():
    [(n, e)] = list(read_jsonl(io.BytesIO(b'{"prompt_ids": [1,, 2]}\n')))
    assert n == 1 and isinstance(e, RequestError) and e.field == "json" and "column 19" in str(e)
    line_error('{"prompt_ids": [1]} x', "json")
    line_error('{"prompt_ids": [1], "prompt_ids": [2]}', "json")              # duplicate key
    line_error("[" * 100_000, "json")                                        # nesting, no RecursionError


def test_bom():
    data = b'\xef\xbb\xbf{"prompt_ids": [1]}\n{"prompt_ids": [2]}\n'
    reqs = parse_file(io.BytesIO(data), vocab_size=V)
    assert [r.prompt for r in reqs] == [[1], [2]]
    # a line's leading BOM (files joined with cat) is accepted too; one inside a line is not
    cat = parse_file(io.BytesIO(b'{"prompt_ids": [1]}\n\xef\xbb\xbf{"prompt_ids": [2]}\n'), vocab_size=V)
    assert [r.prompt for r in cat] == [[1], [2]]
    [bad] = parse_file(io.BytesIO(b'{"prompt_ids":\xef\xbb\xbf [1]}\n'), vocab_size=V)
    assert isinstance(bad, RequestError) and bad.field == "json"
    assert decode_json(b'\xef\xbb\xbf{"a": 1}') == {"a": 1}


def test_invalid_utf8_refused_for_that_line():
    data = b'{"prompt_ids": [1]}\n{"id": "\xff\xfe", "prompt_ids": [2]}\n{"prompt_ids": [3]}\n'
    out = parse_file(io.BytesIO(data), vocab_size=V)
    assert isinstance(out[0], Request) and isinstance(out[2], Request) and out[2].prompt == [3]
    assert isinstance(out[1], RequestError) and out[1].field == "encoding" and out[1].line == 2


def test_blank_lines_and_crlf():
    data = b'\n  \r\n{"prompt_ids": [1]}\r\n\t\n{"prompt_ids": [2]}'         # no final newline
    assert [(n, v) for n, v in read_jsonl(io.BytesIO(data))] == [(3, {"prompt_ids": [1]}),
                                                                  (5, {"prompt_ids": [2]})]
    reqs = parse_file(io.BytesIO(data), vocab_size=V)
    assert [r.request_id for r in reqs] == [0, 1]                             # index among non-blank lines


def test_one_bad_line_others_parse(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text('{"id": "a", "prompt_ids": [1]}\n'
                 '\n'
                 '{"id": "b", "prompt_ids": [1, 2, 3, 1.5]}\n'
                 '{"prompt_ids": [7], "max_new_tokens": 2}\n')
    out = parse_file(p, vocab_size=V)
    assert len(out) == 3
    assert isinstance(out[0], Request) and out[0].request_id == "a"
    assert isinstance(out[2], Request) and out[2].request_id == 2 and out[2].max_new_tokens == 2
    e = out[1]
    assert isinstance(e, RequestError) and isinstance(e, ValueError)
    assert str(e) == f"{p}:3: prompt_ids: must be a list of integers in [0, {V}), item 3 is 1.5"
    assert (e.field, e.line, e.request_id) == ("prompt_ids", 3, "b")


def test_long_line_is_one_error_then_reading_resumes():
    data = b'{"prompt_ids": [1]}\n' + b'{"prompt_ids": [' + b"1, " * 5000 + b'1]}\n{"prompt_ids": [2]}\n'
    out = list(read_jsonl(io.BytesIO(data), max_line_bytes=1000))
    assert [n for n, _ in out] == [1, 2, 3]
    assert isinstance(out[1][1], RequestError) and out[1][1].field == "line"
    assert "line longer than 1000 bytes" in str(out[1][1])
    assert out[2][1] == {"prompt_ids": [2]}
    # exactly at the limit is fine
    line = b'{"prompt_ids": [1]}'
    assert list(read_jsonl(io.BytesIO(line + b"\n"), max_line_bytes=len(line))) == [(1, {"prompt_ids": [1]})]
    [(_, e)] = list(read_jsonl(io.BytesIO(line + b"\n"), max_line_bytes=len(line) - 1))
    assert isinstance(e, RequestError)


def test_dev_zero_bounded():
    t = time.perf_counter()
    out = list(read_jsonl("/dev/zero", max_line_bytes=4096, max_skip_bytes=1 << 20))
    assert time.perf_counter() - t < 2.0
    [(n, e)] = out
    assert n == 1 and isinstance(e, RequestError) and e.field == "line"
    assert "line longer than 4096 bytes" in str(e) and "not read" in str(e)
    # the default skip bound too
    t = time.perf_counter()
    [(_, e)] = list(read_jsonl("/dev/zero", max_line_bytes=4096))
    assert time.perf_counter() - t < 2.0 and isinstance(e, RequestError)


def test_parse_file_dev_zero():
    [e] = parse_file("/dev/zero", vocab_size=V, max_line_bytes=1 << 10)
    assert isinstance(e, RequestError) and str(e).startswith("/dev/zero:1: line: line longer than 1024 bytes")


def test_text_mode_file_refused():
    with pytest.raises(TypeError):
        list(read_jsonl(io.StringIO('{"prompt_ids": [1]}\n')))


def test_error_pickles():
    import pickle
    e = RequestError("seed", "bad", where="f:2", request_id="r", line=2)
    e2 = pickle.loads(pickle.dumps(e))
    assert (str(e2), e2.request_id, e2.line) == (str(e), "r", 2)


# ---- SamplingParams --------------------------------------------------------------------------------

@pytest.mark.parametrize("kw,field", [
    ({"temperature": True}, "temperature"), ({"temperature": math.nan}, "temperature"),
    ({"temperature": math.inf}, "temperature"), ({"temperature": -1.0}, "temperature"),
    ({"temperature": "0.5"}, "temperature"), ({"temperature": 10 ** 400}, "temperature"),
    ({"top_k": 1.0}, "top_k"), ({"top_k": True}, "top_k"), ({"top_k": -1}, "top_k"), ({"top_k": 2 ** 31}, "top_k"),
    ({"top_p": 0.0}, "top_p"), ({"top_p": math.nan}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"top_p": None}, "top_p"),
    ({"seed": 2 ** 32}, "seed"), ({"seed": 2 ** 70}, "seed"), ({"seed": -1}, "seed"), ({"seed": 1.0}, "seed"),
    ({"seed": np.bool_(True)}, "seed"), ({"seed": 10 ** 5000}, "seed"),
])
def test_sampling_params_strict(kw, field):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        SamplingParams(**kw)


def test_sampling_params_normalizes():
    s = SamplingParams(temperature=np.float32(0.5), top_k=np.int64(3), top_p=1, seed=np.uint32(2 ** 32 - 1))
    assert (type(s.temperature), type(s.top_k), type(s.top_p), type(s.seed)) == (float, int, float, int)
    assert s == SamplingParams(0.5, 3, 1.0, 2 ** 32 - 1)
    hash(s)


# ---- fuzz ------------------------------------------------------------------------------------------

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings, strategies as st  # noqa: E402

VALID = {"id": "r", "prompt_ids": [1, 2, 3], "max_new_tokens": 4, "temperature": 0.7, "top_k": 5,
         "top_p": 0.9, "seed": 3, "stop_ids": [2], "ignore_eos": False}

scalars = (st.none() | st.booleans() | st.integers() | st.integers(-3, V + 3) | st.text(max_size=8)
           | st.floats(allow_nan=True, allow_infinity=True))
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=6), inner, max_size=4), max_leaves=12)
keys = st.sampled_from(FIELDS + ("extra", ""))


def _outcome(obj):
    try:
        r = parse_request(obj, vocab_size=V, defaults=D, tokenizer=Tok(), index=0)
    except RequestError as e:
        assert isinstance(e.field, str) and str(e)
        return e
    assert isinstance(r, Request) and r.prompt and all(0 <= t < V for t in r.prompt)
    assert all(0 <= t < V for t in r.stop_ids) and isinstance(r.ignore_eos, bool)
    assert r.max_new_tokens >= 1 and 0 <= r.sampling.seed < 2 ** 32
    return r


@settings(max_examples=300, deadline=None)
@given(json_values)
def test_fuzz_any_value(obj):
    _outcome(obj)


@settings(max_examples=400, deadline=None)
@given(st.lists(st.tuples(keys, json_values | st.none()), max_size=4), st.sets(st.sampled_from(FIELDS)))
def test_fuzz_mutated_valid_line(changes, drop):
    obj = {k: v for k, v in VALID.items() if k not in drop}
    for k, v in changes:
        obj[k] = v
    _outcome(obj)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=80), st.integers(0, 60), st.integers(1, 64))
def test_fuzz_bytes_of_a_valid_line(junk, at, limit):
    line = json.dumps(VALID).encode()
    data = line[:at] + junk + line[at:] + b"\n" + line + b"\n"
    out = parse_file(io.BytesIO(data), vocab_size=V, tokenizer=Tok(), max_line_bytes=limit * 8)
    assert all(isinstance(x, (Request, RequestError)) for x in out)


def test_values_in_refusals_are_brief_and_json_spelled():
    """One renderer (`v41_jax.brief.show`) for configs, request files, HTTP bodies and
    SamplingParams: JSON's spelling, and short whatever the input holds."""
    from v41_jax.brief import show
    assert [show(v) for v in (None, True, np.bool_(False), 3, np.int64(-2), 0.5, float("nan"), -math.inf)] == \
        ["null", "true", "false", "3", "-2", "0.5", "NaN", "-Infinity"]
    assert show(10 ** 4000) == f"an integer of {(10 ** 4000).bit_length()} bits"
    assert show("x" * 10 ** 6) == '"' + "x" * 40 + '..."' and show('a"b') == '"a\\"b"'
    assert (show([1] * 10 ** 6), show({"a": 1}), show(object())) == ("a list of 1000000 items", "an object", "a object")
    from fractions import Fraction
    assert show(Fraction(10 ** 400)) == "a number beyond float range"      # float() would overflow
