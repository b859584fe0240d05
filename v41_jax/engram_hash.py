"""Engram hash constants and hash ids (docs/MODEL.md §3.11.1-3.11.3), on the host in NumPy.

The tables are host resident, so the row ids are computed here and the gathered rows are handed
to the jitted code. Everything is int64: a compressed token id times its multiplier stays below
2^63 by construction of the multiplier bound.

Column layout of one Engram layer's ids: `(n - 2) * engram_n_heads + head` for n-gram sizes
n = 2..max_ngram_size, each already shifted by the offset of its bucket range in the layer's table.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import jax.numpy as jnp
import numpy as np

if TYPE_CHECKING:  # config.py imports this module for validation
    from tokenizers import Tokenizer

    from .config import ModelConfig

DEAD = -1  # compressed id of a token that takes part in no n-gram (image span), or of no token

_MR_BASES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)  # deterministic below 3.3e24


def is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin (exact for every n a config can name)."""
    if n < 2:
        return False
    for p in _MR_BASES:
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d, s = d // 2, s + 1
    for a in _MR_BASES:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def _next_unseen_prime(current: int, seen: set[int]) -> int:
    """The smallest prime strictly above `current` not handed out yet."""
    candidate = current + 1
    while candidate in seen or not is_prime(candidate):
        candidate += 1
    return candidate


@functools.lru_cache(maxsize=16)
def engram_primes(n_engram_layers: int, max_ngram_size: int, n_heads: int,
                  vocab_size: int) -> np.ndarray:
    """Bucket moduli P[layer][n - 2][head] -> int64 [n_engram_layers, max_ngram_size - 1, n_heads].

    One seen-set across all layers keeps every bucket range's modulus distinct; the search restarts
    from vocab_size - 1 for each (layer, n) and walks upward through the heads.
    """
    seen: set[int] = set()
    primes = np.zeros((n_engram_layers, max_ngram_size - 1, n_heads), np.int64)
    for layer in range(n_engram_layers):
        for n in range(max_ngram_size - 1):
            current = vocab_size - 1
            for head in range(n_heads):
                current = _next_unseen_prime(current, seen)
                seen.add(current)
                primes[layer, n, head] = current
    primes.setflags(write=False)
    return primes


def engram_offsets(primes: np.ndarray) -> np.ndarray:
    """Start row of each bucket range: exclusive prefix sum over a layer's (n, head) primes.

    primes [L, N-1, H] -> offsets [L, (N-1) * H]; the ranges tile the layer's table exactly.
    """
    flat = primes.reshape(primes.shape[0], -1)
    return np.cumsum(flat, axis=1) - flat


def engram_multipliers(layer_ids: tuple[int, ...], max_ngram_size: int,
                       compressed_vocab_size: int) -> np.ndarray:
    """Odd multiplier per (Engram layer, lookback slot) -> int64 [L, max_ngram_size].

    Drawn from NumPy's PCG64 stream seeded 10007 * layer id, as the reference does; the bound keeps
    `compressed id * multiplier` inside int64.
    """
    bound = max(1, (np.iinfo(np.int64).max // compressed_vocab_size) // 2)
    rows = [np.random.default_rng(10007 * layer).integers(0, bound, size=max_ngram_size,
                                                         dtype=np.int64)
            for layer in layer_ids]
    return np.stack(rows) * 2 + 1


def _token_normalizer():
    """NFKC, NFD, strip accents, lowercase, collapse whitespace runs, strip; a token that is exactly
    one space is kept as one space (via a private-use sentinel) instead of becoming empty."""
    from tokenizers import Regex, normalizers

    sentinel = "\ue000"
    return normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "), normalizers.Replace(Regex(r"^ $"), sentinel),
        normalizers.Strip(), normalizers.Replace(sentinel, " "),
    ])


def token_map_from_tokenizer(tokenizer: "Tokenizer", compressed_vocab_size: int) -> np.ndarray:
    """Compressed id per token id (docs/MODEL.md §3.11.1) from a `tokenizers.Tokenizer` -> int64 [vocab].

    Each id is decoded alone, specials kept; equal normalized keys share an id, numbered in
    first-seen order. A decode with U+FFFD (a partial UTF-8 byte token) is keyed by its raw token
    string. The number of keys must equal `compressed_vocab_size`: every multiplier derives from it.
    """
    normalizer = _token_normalizer()
    keys: dict[str, int] = {}
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    token_map = np.zeros(vocab, np.int64)
    for token_id in range(vocab):
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        if "\ufffd" in text:
            key = tokenizer.id_to_token(token_id)
        else:
            key = normalizer.normalize_str(text) or text
        token_map[token_id] = keys.setdefault(key, len(keys))
    if len(keys) != compressed_vocab_size:
        raise ValueError(f"engram_compressed_vocab_size: the tokenizer gives {len(keys)} compressed "
                         f"ids, the config says {compressed_vocab_size}")
    return token_map


@dataclass(frozen=True)
class EngramCursor:
    """Per-request hash history: tokens committed so far and the compressed ids of the last
    max_ngram_size - 1 of them, oldest first (DEAD for a dead token or before the start)."""
    position: int
    history: tuple[int, ...]

    def as_row(self) -> np.ndarray:
        """The STATE cursor row (docs/CACHE.md §1.5): int64 [1 + H] = [position, history...]."""
        return np.asarray((self.position, *self.history), np.int64)

    @classmethod
    def from_row(cls, row: np.ndarray) -> "EngramCursor":
        return cls(int(row[0]), tuple(int(c) for c in row[1:]))


class EngramHasher:
    """The hash constants of one config plus its token map, built once; `hash_ids` is pure."""

    def __init__(self, cfg: "ModelConfig", token_map: np.ndarray):
        if not cfg.engram_layer_ids:
            raise ValueError("engram_layer_ids: the config has no Engram layers to hash for")
        token_map = np.asarray(token_map, np.int64)
        if token_map.shape != (cfg.vocab_size,):
            raise ValueError(f"engram token map: must have vocab_size = {cfg.vocab_size} entries, "
                             f"got shape {token_map.shape}")
        if token_map.min() < 0 or token_map.max() >= cfg.engram_compressed_vocab_size:
            raise ValueError(f"engram token map: ids must lie in [0, engram_compressed_vocab_size = "
                             f"{cfg.engram_compressed_vocab_size})")
        self.max_ngram_size = cfg.engram_max_ngram_size
        self.vocab_size = cfg.vocab_size
        self.primes = engram_primes(len(cfg.engram_layer_ids), cfg.engram_max_ngram_size,
                                    cfg.engram_n_heads, cfg.engram_vocab_size)  # [L, N-1, H]
        self.offsets = engram_offsets(self.primes)                               # [L, cols]
        self.multipliers = engram_multipliers(cfg.engram_layer_ids, cfg.engram_max_ngram_size,
                                              cfg.engram_compressed_vocab_size)  # [L, N]
        self.token_map = token_map                                               # [vocab]
        self.compressed_vocab_size = cfg.engram_compressed_vocab_size
        self.pad_id = int(token_map[cfg.engram_pad_id])

    def start(self) -> EngramCursor:
        """The cursor of an empty request."""
        return EngramCursor(0, (DEAD,) * (self.max_ngram_size - 1))

    def compress(self, token_ids: np.ndarray, token_mask: np.ndarray | None = None) -> np.ndarray:
        """Compressed ids [T]; DEAD where token_mask is False (image-span tokens)."""
        token_ids = np.asarray(token_ids, np.int64)
        if token_ids.ndim != 1 or ((token_ids < 0) | (token_ids >= self.vocab_size)).any():
            raise ValueError(f"token_ids: must be a 1-D array of ids in [0, {self.vocab_size})")
        compressed = self.token_map[token_ids]
        if token_mask is None:
            return compressed
        return np.where(np.asarray(token_mask, bool), compressed, DEAD)

    def _context(self, cursor: EngramCursor, compressed: np.ndarray) -> np.ndarray:
        """The cursor's history followed by the span's compressed ids -> int64 [N-1+T]."""
        if len(cursor.history) != self.max_ngram_size - 1:
            raise ValueError(f"cursor.history: must hold max_ngram_size - 1 = "
                             f"{self.max_ngram_size - 1} ids, got {len(cursor.history)}")
        return np.concatenate([np.asarray(cursor.history, np.int64), compressed])

    def lookback_tokens(self, cursor: EngramCursor, compressed: np.ndarray) -> np.ndarray:
        """Token of each lookback slot s = 0..N-1 (s = 0 is the token itself) -> int64 [T, N].

        The lookback latches: once a slot reaches the sequence start or a DEAD token, it and every
        farther slot take the pad id, so an n-gram never spans an image or the start.
        """
        n = self.max_ngram_size
        context = self._context(cursor, compressed)                                  # [N-1+T]
        t = np.arange(len(compressed))
        source = context[(n - 1) + t[:, None] - np.arange(n)[None, :]]              # [T, N]
        return self._latch(source, cursor.position + t)

    def _latch(self, source: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Lookback tokens [T, N] of tokens at `positions` [T] with the latch applied."""
        before_start = positions[:, None] < np.arange(self.max_ngram_size)[None, :]
        blocked = np.logical_or.accumulate(before_start | (source == DEAD), axis=1)
        return np.where(blocked, self.pad_id, source)

    def next_token_ids(self, cursor_rows: np.ndarray, token_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """One token for each of K requests at once (a decode step): cursor rows [K, 1 + H] (as
        `EngramCursor.as_row`) and their next tokens [K] -> (row ids [K, L, cols], cursor rows
        after them [K, 1 + H]). Equals `hash_ids` row by row, without a per-request loop."""
        rows = np.asarray(cursor_rows, np.int64).reshape(-1, self.max_ngram_size)
        compressed = self.compress(np.asarray(token_ids).reshape(-1))
        history = rows[:, 1:]                                                        # oldest first
        source = np.concatenate([compressed[:, None], history[:, ::-1]], axis=1)     # slot 0 = the token
        ids = self.bucket_ids(self._latch(source, rows[:, 0]))
        nxt = np.concatenate([rows[:, :1] + 1, history[:, 1:], compressed[:, None]], axis=1)
        return ids, nxt

    def bucket_ids(self, tokens: np.ndarray) -> np.ndarray:
        """Lookback tokens [T, N] -> table row ids [T, L, (N-1) * H], offsets included.

        A running XOR of the multiplied tokens: after slot n-1 it hashes the n-gram ending here,
        which each head reduces modulo its own prime.
        """
        products = tokens[:, None, :] * self.multipliers[None]                     # [T, L, N]
        ngram_hashes = np.bitwise_xor.accumulate(products, axis=-1)[..., 1:]     # [T, L, N-1]
        ids = ngram_hashes[..., None] % self.primes[None]                         # [T, L, N-1, H]
        return ids.reshape(*ids.shape[:2], self.offsets.shape[1]) + self.offsets[None]

    def hash_ids(self, cursor: EngramCursor, token_ids: np.ndarray,
                 token_mask: np.ndarray | None = None) -> tuple[np.ndarray, EngramCursor]:
        """Row ids of `token_ids` (the next T tokens after `cursor`) -> (int64 [T, L, cols], cursor).

        token_mask: [T] bool, False for tokens that take part in no n-gram (image spans). Works for
        any split of a sequence into chunks: prefill, chunked prefill and decode agree.
        """
        compressed = self.compress(token_ids, token_mask)
        ids = self.bucket_ids(self.lookback_tokens(cursor, compressed))
        end = self.prefix_cursor_rows(cursor, compressed)[-1:]
        return ids, (EngramCursor.from_row(end[0]) if len(end) else cursor)

    # ---- tokens hashed on the device ----------------------------------------------------------
    # The pipelined loop launches step N+1 before step N's sampled tokens (and drafts) reach the
    # host, so the rows whose tokens are only known on the device are hashed there, from the
    # slot's cursor and the span's own tokens (`device_lookback`, `device_bucket_ids`). The device
    # has no int64: each product compressed id x multiplier comes from a table as two uint32
    # halves, and the n-gram hash is their running XOR, half by half.
    def device_constants(self) -> dict[str, np.ndarray] | None:
        """What the device hashing needs: products [L, N, C, 2] (compressed id c times the
        multiplier of layer L's lookback slot n, as uint32 halves hi, lo), token_map int32 [V],
        pad_id, primes, 2^32 mod prime and offsets [L, cols]. Needs every prime below 2^24 (the
        uint32 modular product); None otherwise."""
        primes = self.primes.reshape(self.primes.shape[0], -1)                        # [L, cols]
        if primes.max() >= 1 << 24:
            return None
        p = np.arange(self.compressed_vocab_size, dtype=np.int64)[None, None, :] * self.multipliers[:, :, None]
        return {"products": np.stack([p >> 32, p & 0xFFFFFFFF], axis=-1).astype(np.uint32),
                "token_map": self.token_map.astype(np.int32), "pad_id": np.int32(self.pad_id),
                "primes": primes.astype(np.uint32), "two32": ((1 << 32) % primes).astype(np.uint32),
                "offsets": self.offsets.astype(np.int32)}

    def prefix_cursor_rows(self, cursor: EngramCursor, compressed: np.ndarray) -> np.ndarray:
        """Cursor rows after each prefix of the span -> int64 [T, 1 + H]; row j = the cursor once
        compressed[:j + 1] is committed. A verify step commits the row of its accepted length,
        since Engram history cannot be rebuilt from the KV (docs/CACHE.md §4)."""
        h = self.max_ngram_size - 1
        context = self._context(cursor, compressed)                                  # [H+T]
        ends = np.arange(1, len(compressed) + 1)
        history = context[ends[:, None] + np.arange(h)[None, :]]                     # [T, H]
        return np.concatenate([(cursor.position + ends)[:, None], history], axis=1)


def _mulmod(a, b, p):
    """a * b mod p for uint32 a, b < p < 2^24, in uint32: Horner over b's three bytes."""
    r = jnp.zeros_like(a)
    for shift in (16, 8, 0):
        byte = (b >> shift) & 0xFF
        r = ((r << 8) % p + (a * byte) % p) % p
    return r


def device_lookback(consts: dict, context, positions):
    """`EngramHasher._latch` on the device: context [T, N] int32 (slot s = the compressed id s
    tokens back, slot 0 the token itself; DEAD where none), positions [T] -> latched [T, N]."""
    n = context.shape[1]
    blocked = jnp.cumsum((positions[:, None] < jnp.arange(n)) | (context == DEAD), axis=1) > 0
    return jnp.where(blocked, consts["pad_id"], context)


def device_bucket_ids(consts: dict, lookback, heads: int):
    """`EngramHasher.bucket_ids` on the device: latched lookback ids [T, N] -> row ids
    [T, L, cols] int32, offsets included (the same values)."""
    n = lookback.shape[1]
    prod = jnp.moveaxis(consts["products"][:, jnp.arange(n)[None, :], lookback], 0, 1)   # [T, L, N, 2]
    acc, hashes = prod[:, :, 0], []
    for s in range(1, n):                                                      # n-gram sizes 2..N
        acc = acc ^ prod[:, :, s]
        hashes.append(acc)
    h = jnp.repeat(jnp.stack(hashes, axis=2), heads, axis=2)                  # [T, L, cols, 2]
    p, two32 = consts["primes"], consts["two32"]
    x = (_mulmod(h[..., 0] % p, two32, p) + h[..., 1] % p) % p
    return x.astype(jnp.int32) + consts["offsets"]
