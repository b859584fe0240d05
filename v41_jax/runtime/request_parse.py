"""User requests from JSON: one strict validation for the offline generator (JSONL) and the servers.

    parse_request(obj, vocab_size=..., defaults=RequestDefaults(...), tokenizer=None) -> Request
    read_jsonl(path)  -> (line number, decoded object | RequestError) per non-blank line
    parse_file(path, vocab_size=..., defaults=...) -> [Request | RequestError], one per non-blank line
    decode_json(text_or_bytes) -> the decoded value (strict: no NaN/Infinity, no duplicate keys)

A request is a JSON object with the fields

    id              string or integer (default: the request's 0-based index among non-blank lines)
    prompt          text, encoded with the tokenizer     } exactly one of the two
    prompt_ids      non-empty list of token ids          }
    max_new_tokens  integer in [1, 2**31)
    temperature     finite number >= 0 (0 = greedy)
    top_k           integer in [0, 2**31) (0 = off)
    top_p           number in (0, 1]
    seed            integer in [0, 2**32) (default: RequestDefaults.seed; the server's None draws one)
    stop_ids        list of token ids (may be empty)
    ignore_eos      boolean
    logprobs        boolean: return each sampled token's log-probability
    speculative     boolean: false decodes without DSpark drafts (default: the engine's setting,
                    on when the checkpoint has draft stages); true where the engine cannot is an
                    error for that request

Absent fields take the `RequestDefaults` (the CLI flags). Types are strict: a JSON boolean is not a
number, 1.0 is not a token id, "5" is not an integer, a string is not a list, null is not "absent".
Unknown fields are refused; in a file, ids are unique. Every refusal is a `RequestError` (a
ValueError) naming the field: `prompt_ids: must be a list of integers in [0, 512), item 3 is 1.5`;
from a file it is prefixed `<path>:<line>: `. A bad line never stops the others.

The reader is bounded: it reads in fixed-size chunks, so a huge line (or /dev/zero) costs one error
for that line and at most `max_line_bytes` of memory, never a MemoryError.

Host-side code; jax comes in only through `SamplingParams` (sampling.py).
"""

from __future__ import annotations

import json
import math
import os
import secrets
from dataclasses import dataclass
from typing import Any, BinaryIO, Iterator

from v41_jax.brief import show
from v41_jax.runtime.request import Request
from v41_jax.runtime.sampling import SamplingParams, finite as _finite

FIELDS = ("id", "prompt", "prompt_ids", "max_new_tokens", "temperature", "top_k", "top_p", "seed",
          "stop_ids", "ignore_eos", "logprobs", "speculative")

MAX_NEW_TOKENS_LIMIT = 2 ** 31      # what the engine's int32 arrays hold
TOP_K_LIMIT = 2 ** 31
SEED_LIMIT = 2 ** 32                # the sampler keys on a uint32 seed
MAX_INT_DIGITS = 1000               # a longer JSON integer literal is refused while decoding
_BOM = b"\xef\xbb\xbf"
_CHUNK = 1 << 16


class RequestError(ValueError):
    """A refused request: `field` (a request field, or "json" / "line" / "encoding" / "request" for a
    line that is not a request at all) and `message`. `where` ("path:line") prefixes str() when set;
    `request_id` is the request's id when it could be read (else its index), for the error's output line."""

    def __init__(self, field: str, message: str, *, where: str | None = None, request_id: Any = None,
                 line: int | None = None):
        self.field, self.message, self.where = field, message, where
        self.request_id, self.line = request_id, line
        super().__init__(str(self))

    def __str__(self) -> str:
        text = f"{self.field}: {self.message}"
        return f"{self.where}: {text}" if self.where else text

    def __reduce__(self):
        return (_rebuild_error, (self.field, self.message, self.where, self.request_id, self.line))


def _rebuild_error(field, message, where, request_id, line):
    return RequestError(field, message, where=where, request_id=request_id, line=line)


# ---- values ---------------------------------------------------------------------------------------

def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _int_in(field: str, v, lo: int, hi: int, hi_text: str, note: str = "") -> int:
    if not _is_int(v) or not lo <= v < hi:
        raise RequestError(field, f"must be an integer in [{lo}, {hi_text}){note}, got {show(v)}")
    return int(v)


def _temperature(v) -> float:
    if not _is_number(v) or not _finite(v) or v < 0:
        raise RequestError("temperature", f"must be a finite number >= 0 (0 = greedy), got {show(v)}")
    return float(v)


def _top_p(v) -> float:
    if not _is_number(v) or not (0 < v <= 1):            # NaN fails the comparison
        raise RequestError("top_p", f"must be a number in (0, 1], got {show(v)}")
    return float(v)


def _max_new_tokens(v) -> int:
    return _int_in("max_new_tokens", v, 1, MAX_NEW_TOKENS_LIMIT, "2**31")


def _top_k(v) -> int:
    return _int_in("top_k", v, 0, TOP_K_LIMIT, "2**31", " (0 = off)")


def _seed(v) -> int:
    return _int_in("seed", v, 0, SEED_LIMIT, "2**32")


def _bool(field: str, v) -> bool:
    if not isinstance(v, bool):
        raise RequestError(field, f"must be true or false, got {show(v)}")
    return v


def _ignore_eos(v) -> bool:
    return _bool("ignore_eos", v)


def _ids(field: str, v, vocab_size: int | None, *, what: str = "") -> list[int]:
    """A list of token ids in [0, vocab_size) (any non-negative int when vocab_size is None)."""
    want = (f"must be a list of integers in [0, {vocab_size})" if vocab_size is not None
            else "must be a list of integers >= 0")
    if not isinstance(v, (list, tuple)):
        raise RequestError(field, f"{what}{want}, got {show(v)}")
    hi = vocab_size if vocab_size is not None else math.inf
    for i, t in enumerate(v):
        if not _is_int(t) or not 0 <= t < hi:
            raise RequestError(field, f"{what}{want}, item {i} is {show(t)}")
    return [int(t) for t in v]


# ---- defaults -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class RequestDefaults:
    """What a request gets for a field it leaves out (the CLI flags). Checked like a request's fields,
    except stop_ids against the vocabulary (parse_request does that)."""
    max_new_tokens: int = 32
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = 0            # None: each request that names none gets a fresh random one
    stop_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False

    def __post_init__(self):
        set_ = lambda k, v: object.__setattr__(self, k, v)
        set_("max_new_tokens", _max_new_tokens(self.max_new_tokens))
        set_("temperature", _temperature(self.temperature))
        set_("top_k", _top_k(self.top_k))
        set_("top_p", _top_p(self.top_p))
        set_("seed", None if self.seed is None else _seed(self.seed))
        set_("stop_ids", tuple(_ids("stop_ids", self.stop_ids, None)))
        set_("ignore_eos", _ignore_eos(self.ignore_eos))
        set_("logprobs", _bool("logprobs", self.logprobs))

    @classmethod
    def from_args(cls, args) -> "RequestDefaults":
        """From an argparse namespace with max_new_tokens, temperature, top_k, top_p, seed, stop_ids,
        ignore_eos, logprobs (any of them missing keeps the default)."""
        kw = {k: getattr(args, k) for k in cls.__dataclass_fields__ if getattr(args, k, None) is not None}
        if "stop_ids" in kw:
            kw["stop_ids"] = tuple(kw["stop_ids"])
        return cls(**kw)


# ---- one request ----------------------------------------------------------------------------------

def _encode(tokenizer, text: str, vocab_size: int) -> list[int]:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RequestError("prompt", f"contains a lone surrogate (\\u{ord(text[e.start]):04x}) at "
                                     f"character {e.start}") from None
    try:
        out = tokenizer.encode(text)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:        # a Rust tokenizer's panic is a BaseException (pyo3 PanicException)
        raise RequestError("prompt", f"the tokenizer failed: {type(e).__name__}: {e}") from None
    ids = list(getattr(out, "ids", out))
    if not ids:
        raise RequestError("prompt", "the tokenizer gave no tokens")
    return _ids("prompt", ids, vocab_size, what="the tokenizer's ids ")


def _prompt(obj: dict, vocab_size: int, tokenizer) -> list[int]:
    if "prompt" in obj and "prompt_ids" in obj:
        raise RequestError("prompt", "give one of prompt (text) and prompt_ids (token ids), not both")
    if "prompt_ids" in obj:
        ids = _ids("prompt_ids", obj["prompt_ids"], vocab_size)
        if not ids:
            raise RequestError("prompt_ids", "must not be empty")
        return ids
    if "prompt" not in obj:
        raise RequestError("prompt", "a request needs prompt (text) or prompt_ids (token ids)")
    text = obj["prompt"]
    if not isinstance(text, str):
        raise RequestError("prompt", f"must be a string, got {show(text)}")
    if not text:
        raise RequestError("prompt", "must not be empty")
    if tokenizer is None:
        raise RequestError("prompt", "a text prompt needs a tokenizer (--tokenizer or tokenizer.json in "
                                     "the checkpoint folder)")
    return _encode(tokenizer, text, vocab_size)


def parse_request(obj: Any, *, vocab_size: int, defaults: RequestDefaults = RequestDefaults(),
                  tokenizer=None, index: int = 0) -> Request:
    """One decoded JSON value -> a Request, or RequestError naming the first bad field.

    tokenizer: anything whose encode(text) gives a list of ids or an object with .ids (tokenizers'
    Tokenizer); needed only for "prompt". index: the request's id when it has none."""
    if not _is_int(vocab_size) or vocab_size < 1:
        raise ValueError(f"vocab_size must be a positive integer, got {vocab_size!r}")
    if not isinstance(obj, dict):
        raise RequestError("request", f"must be a JSON object, got {show(obj)}", request_id=index)
    for key in obj:
        if key not in FIELDS:
            raise RequestError(key if isinstance(key, str) else repr(key),
                               f"unknown field {show(key)} (known: {', '.join(FIELDS)})", request_id=index)
    rid = obj.get("id", index)
    if not (_is_int(rid) or isinstance(rid, str)):
        raise RequestError("id", f"must be a string or an integer, got {show(rid)}", request_id=index)
    try:
        prompt = _prompt(obj, vocab_size, tokenizer)
        get = lambda k: obj[k] if k in obj else getattr(defaults, k)
        if "stop_ids" in obj:
            stop = _ids("stop_ids", obj["stop_ids"], vocab_size)
        else:
            stop = _ids("stop_ids", defaults.stop_ids, vocab_size, what="the default ")
        # no seed from the request nor the defaults: a fresh one, so that two sampled requests
        # differ (OpenAI's behaviour; the sampler keys its noise on (seed, position) alone)
        seed = obj.get("seed")                               # null is absent (OpenAI's clients send it)
        seed = defaults.seed if seed is None else seed
        seed = secrets.randbits(32) if seed is None else _seed(seed)
        sampling = SamplingParams(temperature=_temperature(get("temperature")), top_k=_top_k(get("top_k")),
                                  top_p=_top_p(get("top_p")), seed=seed)
        return Request(prompt, _max_new_tokens(get("max_new_tokens")), sampling, tuple(stop),
                       _ignore_eos(get("ignore_eos")), rid, _bool("logprobs", get("logprobs")),
                       _bool("speculative", obj["speculative"]) if "speculative" in obj else None)
    except RequestError as e:
        e.request_id = rid
        raise


# ---- JSON -----------------------------------------------------------------------------------------

class _Refuse(Exception):
    pass


def _refuse_constant(name: str):
    raise _Refuse(f"{name} is not a JSON number")


def _finite_float(s: str) -> float:
    f = float(s)
    if not math.isfinite(f):
        raise _Refuse(f"number {s[:40]} is out of range")
    return f


def _bounded_int(s: str) -> int:
    if len(s) > MAX_INT_DIGITS + 1:
        raise _Refuse(f"integer literal of {len(s)} digits (at most {MAX_INT_DIGITS})")
    return int(s)


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict:
    out = {}
    for k, v in pairs:
        if k in out:
            raise _Refuse(f"duplicate key {show(k)}")
        out[k] = v
    return out


def decode_json(data: str | bytes) -> Any:
    """Strict JSON: NaN/Infinity, out-of-range numbers, over-long integers and duplicate keys refused;
    a leading UTF-8 BOM accepted. Raises RequestError (field "json" or "encoding")."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        data = bytes(data)
        if data.startswith(_BOM):
            data = data[len(_BOM):]
        try:
            data = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise RequestError("encoding", f"not valid UTF-8 (byte {e.start})") from None
    elif data.startswith("\ufeff"):
        data = data[1:]
    try:
        return json.loads(data, parse_constant=_refuse_constant, parse_float=_finite_float,
                          parse_int=_bounded_int, object_pairs_hook=_unique_keys)
    except json.JSONDecodeError as e:
        at = f"line {e.lineno} column {e.colno}" if e.lineno > 1 else f"column {e.colno}"
        raise RequestError("json", f"{e.msg} at {at}") from None
    except _Refuse as e:
        raise RequestError("json", str(e)) from None
    except RecursionError:
        raise RequestError("json", "nested too deeply") from None
    except ValueError as e:                                     # any other conversion limit
        raise RequestError("json", str(e)) from None


# ---- files ----------------------------------------------------------------------------------------

def _raw_lines(f: BinaryIO, max_line_bytes: int, max_skip_bytes: int) -> Iterator[tuple[int, bytes | RequestError]]:
    """(line number, its bytes without the newline) per line, in bounded reads; an over-long line gives
    a RequestError instead, once, after skipping to its end. When no line end comes within
    max_skip_bytes past the limit, that error says so and reading stops."""
    pending = bytearray()
    skipping, skipped, line = False, 0, 1
    too_long = lambda extra="": RequestError("line", f"line longer than {max_line_bytes} bytes{extra}", line=line)
    while True:
        chunk = f.read(_CHUNK)
        if not isinstance(chunk, (bytes, bytearray)):
            raise TypeError("read_jsonl needs a binary file (open it with 'rb')")
        if not chunk:
            if skipping:
                yield line, too_long()
            elif pending:
                yield line, bytes(pending)
            return
        start = 0
        while True:
            nl = chunk.find(b"\n", start)
            end = nl if nl >= 0 else len(chunk)
            if skipping:
                skipped += end - start
            elif len(pending) + end - start > max_line_bytes:
                skipping, skipped = True, len(pending) + end - start - max_line_bytes
                pending = bytearray()
            else:
                pending += chunk[start:end]
            if nl < 0:
                break
            if skipping:
                yield line, too_long()
                skipping = False
            else:
                yield line, bytes(pending)
                pending = bytearray()
            line += 1
            start = nl + 1
        if skipping and skipped > max_skip_bytes:
            yield line, too_long(f", and no line end in the next {max_skip_bytes} bytes: the rest of the "
                                 "input is not read")
            return


def read_jsonl(source: str | os.PathLike | BinaryIO, *, max_line_bytes: int = 1 << 20,
               max_skip_bytes: int = 64 << 20) -> Iterator[tuple[int, Any]]:
    """Yields (1-based line number, decoded JSON value or RequestError) per non-blank line of a path or
    a binary file. Memory stays within max_line_bytes plus one read; an over-long line is one error
    (its field "line"), then reading resumes after its end (or stops, when that end is not within
    max_skip_bytes). Errors here carry `line` but no path prefix (parse_file adds it)."""
    if not _is_int(max_line_bytes) or max_line_bytes < 1:
        raise ValueError(f"max_line_bytes must be a positive integer, got {max_line_bytes!r}")
    if hasattr(source, "read"):
        yield from _decoded(source, max_line_bytes, max_skip_bytes)
        return
    with open(source, "rb") as f:
        yield from _decoded(f, max_line_bytes, max_skip_bytes)


def _decoded(f, max_line_bytes, max_skip_bytes):
    for line, raw in _raw_lines(f, max_line_bytes, max_skip_bytes):
        if isinstance(raw, RequestError):
            yield line, raw
            continue
        if raw.startswith(_BOM):             # the file's BOM (or a joined file's: cat a.jsonl b.jsonl)
            raw = raw[len(_BOM):]
        if not raw.strip(b" \t\r"):
            continue                                             # blank line
        try:
            yield line, decode_json(raw)
        except RequestError as e:
            e.line = line
            yield line, e


def parse_file(source: str | os.PathLike | BinaryIO, *, vocab_size: int,
               defaults: RequestDefaults = RequestDefaults(), tokenizer=None,
               max_line_bytes: int = 1 << 20) -> list[Request | RequestError]:
    """One Request or RequestError per non-blank line, in order. An error's str() is
    `<path>:<line>: <field>: <message>`; its request_id is the line's id when readable, else its index
    (the 0-based count of non-blank lines before it, which is also the default id). Ids are unique
    in a file: a line reusing an earlier request's id (explicit or default) is refused (field "id").
    OSError from opening the file propagates."""
    name = os.fspath(source) if not hasattr(source, "read") else getattr(source, "name", "<input>")
    out: list[Request | RequestError] = []
    seen: set = set()
    for index, (line, value) in enumerate(read_jsonl(source, max_line_bytes=max_line_bytes)):
        if not isinstance(value, RequestError):
            try:
                req = parse_request(value, vocab_size=vocab_size, defaults=defaults, tokenizer=tokenizer,
                                    index=index)
                if req.request_id in seen:
                    raise RequestError("id", f"{show(req.request_id)} is the id of an earlier line"
                                       + ("" if "id" in value else " (this line's default id, its index)"),
                                       request_id=req.request_id)
                seen.add(req.request_id)
                out.append(req)
                continue
            except RequestError as e:
                value = e
        value.where, value.line = f"{name}:{line}", line
        if value.request_id is None:
            value.request_id = index
        value.args = (str(value),)
        out.append(value)
    return out
