"""What both protocols share: the server's limits, a request's checks, its streamed text, the chat
template.

`Api.build(fields, rid)` turns a request's fields (request_parse's names, plus "stop") into a
`Job` or raises `Refused`. The field rules are request_parse's (one validation for files and
servers); this module adds only what a server adds: its limits, stop
strings, whether it speculates and the "can it ever fit" check (Engine.check_request, which reads
only the cache geometry, so any thread may call it). Protocols rename fields (OpenAI's max_tokens
is max_new_tokens): `names` maps request_parse's name to the one the client used, so a refusal
names the client's field.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from serving.loop import Refused
from v41_jax.brief import show
from v41_jax.runtime.request import Request
from v41_jax.runtime.request_parse import RequestDefaults, RequestError, parse_request

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256


@dataclass(frozen=True)
class Limits:
    """max_prompt_tokens / max_new_tokens: the most a request may ask for (0: the context limit);
    default_max_new_tokens: what a request that does not say gets; max_message_bytes: a request
    body or gRPC message; max_open: requests held at once (queued + running); max_streams:
    concurrent gRPC calls and HTTP connections; request_timeout_s: a request still running after
    this is aborted (0: never; a gRPC call's own deadline applies as well)."""
    max_prompt_tokens: int = 0
    max_new_tokens: int = 0
    default_max_new_tokens: int = 256
    max_message_bytes: int = 1 << 20
    max_open: int = 1024
    max_streams: int = 256
    request_timeout_s: float = 0.0

    def resolved(self, max_context: int) -> "Limits":
        """Zeros replaced by what the context allows; a request must leave room for one new token."""
        cap = max_context - 1
        prompt = min(self.max_prompt_tokens or cap, cap)
        new = min(self.max_new_tokens or cap, cap)
        return dataclasses.replace(self, max_prompt_tokens=prompt, max_new_tokens=new,
                                   default_max_new_tokens=min(self.default_max_new_tokens, new))


@dataclass(frozen=True)
class Job:
    request: Request
    stop: tuple[str, ...] = ()


class Api:
    def __init__(self, engine, limits: Limits, model_name: str):
        self.vocab_size, self.tokenizer, self.eos_id = engine.cfg.vocab_size, engine.tokenizer, engine.eos_id
        self.speculative = engine.speculative            # DSpark available (draft stages, and on)
        self.max_context = engine.geom.max_context
        self.limits = limits.resolved(self.max_context)
        self.model_name = model_name
        self._fits, self.new_tokens_room = engine.check_request, engine.new_tokens_room
        # a request without a seed samples with a fresh one (the offline CLI's default is 0: reproducible)
        self._defaults = RequestDefaults(max_new_tokens=self.limits.default_max_new_tokens, seed=None)

    def build(self, fields: Mapping[str, Any], rid, names: Mapping[str, str] | None = None) -> Job:
        names = names or {}
        name = lambda f: names.get(f, f)
        fields = dict(fields)
        stop = self._stop(fields.pop("stop", ()), name("stop"))
        try:
            req = parse_request(fields, vocab_size=self.vocab_size, defaults=self._defaults,
                                tokenizer=self.tokenizer)
        except RequestError as err:
            raise Refused("invalid", err.message, name(err.field)) from None
        # speculative (request_parse checked its type): absent takes the engine's default
        if req.speculative and not self.speculative:
            raise Refused("invalid", "this server does not speculate (the checkpoint has no DSpark draft stages, "
                                     "or it was started with --speculative off)", name("speculative"))
        lim = self.limits
        prompt_field = "prompt_ids" if "prompt_ids" in fields else "prompt"
        if len(req.prompt) > lim.max_prompt_tokens:
            raise Refused("invalid", f"{len(req.prompt)} tokens, over the limit of {lim.max_prompt_tokens}",
                          name(prompt_field))
        if req.max_new_tokens > lim.max_new_tokens:
            raise Refused("invalid", f"{req.max_new_tokens} is over the limit of {lim.max_new_tokens}",
                          name("max_new_tokens"))
        req = dataclasses.replace(req, request_id=rid)
        why = self._fits(req)
        if why is not None:
            # a request the cache can never hold names what to lower: max_new_tokens where the
            # prompt leaves room for one token or more, else the prompt
            room = self.new_tokens_room(len(req.prompt))
            field = None if req.max_new_tokens <= room else (
                "max_new_tokens" if room >= 1 else prompt_field)
            raise Refused("exhausted", f"this request can never run here: {why}", field and name(field))
        return Job(req, stop)

    def _stop(self, value, field: str) -> tuple[str, ...]:
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, (list, tuple)) or not all(isinstance(s, str) and s for s in value):
            raise Refused("invalid", "must be a non-empty string or a list of them", field)
        if len(value) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in value):
            raise Refused("invalid", f"at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} "
                                     "characters", field)
        if value and self.tokenizer is None:
            raise Refused("invalid", "stop strings need a tokenizer (this checkpoint has none); use stop ids",
                          field)
        return tuple(value)

    def text(self, stop: Sequence[str] = ()) -> "TextStream":
        return TextStream(self.tokenizer, stop)


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, char -> byte (what a `ByteLevel` pre-tokenizer spells each
    byte as): the printable bytes stand for themselves, the other 68 for chr(256 + n) in byte
    order. test_serving checks it against `tokenizers.pre_tokenizers.ByteLevel.alphabet()`."""
    printable = {*range(33, 127), *range(161, 173), *range(174, 256)}
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + n): b for n, b in enumerate(others)}}


BYTE_LEVEL = _byte_level_alphabet()


@functools.lru_cache(maxsize=8)
def _added_ids(tokenizer) -> frozenset[int]:
    return frozenset(tokenizer.get_added_tokens_decoder())


def token_bytes(tokenizer, token_id: int) -> list[int]:
    """A token's own bytes, as chat logprobs' `bytes` gives them: a token holding part of a UTF-8
    character gives that part (its decoded text alone is U+FFFD). Read from the token's spelling
    when the tokenizer decodes byte-level (the demo's, DeepSeek's); otherwise, and for an added or
    special token (EOS decodes to ""), its text's UTF-8."""
    from tokenizers import decoders
    piece = tokenizer.id_to_token(token_id)
    special = token_id in _added_ids(tokenizer)                     # spelled as text, not as bytes
    if (isinstance(tokenizer.decoder, decoders.ByteLevel) and not special and piece is not None
            and all(c in BYTE_LEVEL for c in piece)):
        return [BYTE_LEVEL[c] for c in piece]
    return list(tokenizer.decode([token_id]).encode())


class TextStream:
    """A request's text as its tokens come: each push returns the new text that is final. Text is
    held back while it ends in an incomplete character (U+FFFD from a split UTF-8 sequence) or in
    what may be the start of a stop string. On a stop string `stopped` turns true and the text ends
    before it (the request is then aborted by the caller); `taken` says how many of the last
    push's ids belong to the reply: all, or on a stop those up to the one that completed the stop
    string (the reply's token ids and counts end there, as its text does). Without a tokenizer
    all text is ""."""

    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        self.tokenizer, self.stop = tokenizer, tuple(stop)
        self.ids: list[int] = []
        self.sent = 0                 # characters of the decoded text already returned
        self.stopped = False
        self.taken = 0
        # the text of ids[:read], settled, and where the next decode starts (ids[context:read]
        # decoded again beside the new ones, so a character or a word split across the boundary
        # decodes as in the whole text): a push decodes a few ids, not the whole reply again (that
        # was quadratic: 7.8 s of a handler's CPU for an 8,000-token reply)
        self._text, self._context, self._read = "", 0, 0

    def _decoded(self) -> str:
        """The whole reply's text, decoding only the ids past the settled part (and its context)."""
        before = self.tokenizer.decode(self.ids[self._context:self._read])
        window = self.tokenizer.decode(self.ids[self._context:])
        if not window.startswith(before):   # a decoder whose text is not prefix-stable here: all of it,
            self._text, self._context, self._read = "", 0, 0        # and the window settles from the start
            return self.tokenizer.decode(self.ids)
        text = self._text + window[len(before):]
        # an incomplete character stays in the window until it completes; no new ids, no move (the
        # context would be empty, and a decoder that drops a leading space would drop a real one)
        if not window.endswith("\ufffd") and len(self.ids) > self._read:
            self._text, self._context, self._read = text, self._read, len(self.ids)
        return text

    def push(self, ids: Sequence[int]) -> str:
        self.taken = 0 if self.stopped else len(ids)
        if self.tokenizer is None or self.stopped:
            return ""
        self.ids += ids
        text = self._decoded()
        if self.stop:
            reach = max(map(len, self.stop))
            start = max(0, self.sent - reach + 1)
            if self._first_stop(text, start) is not None:
                # the reply ends with the first token at which a stop string appears, and its text
                # before the earliest stop string in that token's text (another stop string that
                # completes only with later tokens of this push does not count)
                self.stopped = True
                self.taken, text = self._completing(len(ids), start)
                cut = self._first_stop(text, start)
                out, self.sent = text[self.sent: cut], cut
                return out
        end = len(text)
        while end > self.sent and text[end - 1] == "\ufffd":
            end -= 1
        hold = max((k for s in self.stop for k in range(1, len(s)) if text.endswith(s[:k], 0, end)), default=0)
        end = max(self.sent, end - hold)
        out, self.sent = text[self.sent: end], end
        return out

    def _first_stop(self, text: str, start: int) -> int | None:
        """Where the earliest stop string in text (from `start`) begins, or None."""
        return min((i for i in (text.find(s, start) for s in self.stop) if i >= 0), default=None)

    def _completing(self, new: int, start: int) -> tuple[int, str]:
        """Of the `new` ids just pushed, how many it takes for a stop string to appear, and the
        text they decode to."""
        base = len(self.ids) - new
        for n in range(1, new + 1):
            text = self.tokenizer.decode(self.ids[:base + n])
            if self._first_stop(text, start) is not None:
                return n, text
        raise AssertionError("no stop string in the text that had one")

    def flush(self) -> str:
        """The held-back rest, once the request has finished."""
        if self.tokenizer is None or self.stopped:
            return ""
        text = self._decoded()                # the text `sent` counts into (a pending character too)
        out, self.sent = text[self.sent:], len(text)
        return out


# ---- chat -----------------------------------------------------------------------------------------
# Our own template: one block per message, "<|role|>\n" then the content and a newline, and the
# assistant's open block last; a model tuned on it ends its turn with EOS. (The demo model in
# models/demo was trained on plain text, so its chat replies are continuations of this text.)
CHAT_ROLES = ("system", "user", "assistant")


def chat_prompt(messages) -> str:
    """OpenAI-style messages -> the prompt text; Refused naming messages[i].<field>."""
    if not isinstance(messages, list) or not messages:
        raise Refused("invalid", "must be a non-empty list of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise Refused("invalid", "must be an object with role and content", where)
        extra = sorted(set(m) - {"role", "content", "name"})
        if extra:
            raise Refused("invalid", "unknown field (known: role, content, name)", f"{where}.{extra[0]}")
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise Refused("invalid", f"must be one of {', '.join(CHAT_ROLES)}, got {show(role)}", f"{where}.role")
        if "name" in m and not isinstance(m["name"], str):   # OpenAI's participant name (the template omits it)
            raise Refused("invalid", f"must be a string, got {show(m['name'])}", f"{where}.name")
        content = m.get("content")
        if isinstance(content, list):                 # [{"type": "text", "text": ...}, ...]
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise Refused("invalid", "only text parts ({type: text, text}) are supported", f"{where}.content")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise Refused("invalid", "must be a string or a list of text parts", f"{where}.content")
        out.append(f"<|{role}|>\n{content}\n")
    return "".join(out) + "<|assistant|>\n"
