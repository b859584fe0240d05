"""Every case of issue #19, one named test each: a checkpoint or config from someone else is refused
in one line `<file>: <tensor or field>: <rule>` (CheckpointError), nothing outside the checkpoint
folder is opened, no size hangs the load, and the CLIs print the refusal and exit 2
(docs/MODEL.md §2.3). tests/test_untrusted_fuzz.py mutates the same checkpoint at random."""

import json
import math
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from scripts import generate as generate_script
from scripts import make_checkpoint as make_checkpoint_script
from tests.engine_common import SUITE_CACHE
from tests.untrusted_common import (ROOT, SHARDS, TINY_CONFIG, build_tiny, check_refusal, copy_checkpoint,
                                    edit_json, element_bytes, files_opened, index_path,
                                    outside, params_equal, poke, split_shard, tensor_info, write_shard)
from v41_jax.cache import geometry
from v41_jax.checkpoint import converted, verify
from v41_jax.checkpoint.safetensors_io import Checkpoint
from v41_jax.checkpoint.load import load_params
from v41_jax.config import (ENGRAM_BUCKETS_BOUND, RELEASED_SIZES, CheckpointError, ConfigError, ModelConfig,
                            size_bound)
from v41_jax.tools import check_reference


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny checkpoint (3 shards) and its params, loaded once."""
    folder = build_tiny(tmp_path_factory.mktemp("untrusted") / "ckpt")
    _, params = load_params(folder, progress=False)
    return folder, params


@pytest.fixture
def ckpt(tiny, tmp_path):
    return copy_checkpoint(tiny[0], tmp_path / "ckpt")


def refused(folder: Path, **kw) -> CheckpointError:
    with pytest.raises(CheckpointError) as e:
        load_params(folder, progress=False, **kw)
    return e.value


def shard_of(folder: Path, name: str) -> Path:
    return folder / json.loads(index_path(folder).read_text())["weight_map"][name]


# ---- reads outside the folder --------------------------------------------------------------------

@pytest.fixture
def outside_copy(ckpt, tmp_path):
    """A valid copy of shard 1 outside the checkpoint folder: a loader that followed a path there
    would load it without complaint."""
    (tmp_path / "elsewhere").mkdir()
    target = tmp_path / "elsewhere" / SHARDS[0]
    target.write_bytes((ckpt / SHARDS[0]).read_bytes())
    return target


def _remap_shard1(folder: Path, new_name: str) -> None:
    def fn(index):
        for name, shard in index["weight_map"].items():
            if shard == SHARDS[0]:
                index["weight_map"][name] = new_name
    edit_json(index_path(folder), fn)
    (folder / SHARDS[0]).unlink()


@pytest.mark.parametrize("how", ["absolute", "dotdot", "symlink"])
def test_shard_path_outside_the_folder_refused_and_not_opened(ckpt, outside_copy, how):
    if how == "absolute":
        _remap_shard1(ckpt, str(outside_copy))
    elif how == "dotdot":
        _remap_shard1(ckpt, f"../elsewhere/{SHARDS[0]}")
    else:
        (ckpt / SHARDS[0]).unlink()
        os.symlink(outside_copy, ckpt / SHARDS[0])
    with files_opened() as opened:
        err = refused(ckpt)
    check_refusal(err, [index_path(ckpt)])
    assert "outside the checkpoint folder" in err.rule or "absolute path" in err.rule, err
    assert outside(opened, ckpt) == [], opened


@pytest.mark.parametrize("name", ["config.json", "model.safetensors.index.json"])
def test_symlinked_config_or_index_outside_refused(ckpt, tmp_path, name):
    target = tmp_path / f"elsewhere_{name}"
    target.write_bytes((ckpt / name).read_bytes())
    (ckpt / name).unlink()
    os.symlink(target, ckpt / name)
    with files_opened() as opened:
        err = refused(ckpt)
    assert "outside the checkpoint folder" in err.rule and outside(opened, ckpt) == [], (err, opened)


# ---- hang: sizes -------------------------------------------------------------------------------

def _config_with(folder: Path, edit) -> Path:
    raw = json.loads(TINY_CONFIG.read_text())
    edit(raw)
    (folder / "config.json").write_text(json.dumps(raw))
    return folder / "config.json"


def test_expert_count_1e12_refused_at_once(ckpt):
    """10**12 routed experts built a schema entry by entry for minutes; the bound refuses it first."""
    path = _config_with(ckpt, lambda r: r["text_config"].update(n_routed_experts=10**12))
    start = time.perf_counter()
    err = refused(ckpt)
    assert time.perf_counter() - start < 2
    check_refusal(err, [path], {"n_routed_experts"})
    assert str(size_bound(384)) in err.rule


def test_schema_larger_than_the_checkpoint_stops_at_its_tensor_count(ckpt):
    """A size within its bound (4096 experts) but more than the files hold: the schema stops growing
    at the checkpoint's tensor count and the first missing tensor is named."""
    _config_with(ckpt, lambda r: r["text_config"].update(n_routed_experts=size_bound(384)))
    start = time.perf_counter()
    err = refused(ckpt)
    assert time.perf_counter() - start < 2
    check_refusal(err, [index_path(ckpt)])
    assert ".ffn.experts.8." in err.what and "missing from the checkpoint" in err.rule, err


def test_cached_load_stops_at_the_tensor_count_too(ckpt, tmp_path):
    """`load_params_cached` fingerprints the schema before it converts: built the same bounded way
    (it was built whole first, 1-2 s at this size on the tiny checkpoint, minutes at the config's
    bounds), and refused the same way."""
    _config_with(ckpt, lambda r: r["text_config"].update(n_routed_experts=size_bound(384)))
    start = time.perf_counter()
    with pytest.raises(CheckpointError) as e:
        converted.load_params_cached(ckpt, tmp_path / "cache", progress=False)
    assert time.perf_counter() - start < 0.5, time.perf_counter() - start
    check_refusal(e.value, [index_path(ckpt)])
    assert ".ffn.experts.8." in e.value.what and "missing from the checkpoint" in e.value.rule, e.value


def test_engram_bucket_count_bounded_before_the_prime_search(tiny):
    """Engram layers x (ngram - 1) x heads prime searches ran 40 s at the per-field bounds."""
    cfg = ModelConfig.from_file(tiny[0] / "config.json")
    start = time.perf_counter()
    with pytest.raises(ConfigError) as e:
        cfg.replace(engram_n_heads=64, engram_max_ngram_size=32)
    assert time.perf_counter() - start < 1 and e.value.what == "engram_n_heads"
    assert str(ENGRAM_BUCKETS_BOUND) in e.value.rule


def test_released_sizes_are_the_released_config():
    """The bounds' anchor: RELEASED_SIZES equals the released config (largest entry of a list)."""
    cfg = ModelConfig.from_file(ROOT / "v41_jax" / "configs" / "deepseek_v41_flash.config.json")
    for name, value in RELEASED_SIZES.items():
        got = getattr(cfg, name)
        assert (max(got) if isinstance(got, tuple) else got) == value, name


# ---- config types and values (the list) ------------------------------------------------

def _set(key, value, where="text_config"):
    def edit(raw):
        (raw[where] if where else raw)[key] = value
    return edit


def _rope(key, value):
    def edit(raw):
        raw["text_config"]["rope_scaling"][key] = value
    return edit


def _drop_rope(key):
    def edit(raw):
        del raw["text_config"]["rope_scaling"][key]
    return edit


CONFIG_CASES = [
    # (id, edit, the field the refusal names)
    ("layers_as_string", _set("num_hidden_layers", "7"), "num_hidden_layers"),
    ("window_as_string", _set("sliding_window", "8"), "sliding_window"),
    ("ratios_not_a_list", _set("compress_ratios", 5), "compress_ratios"),
    ("ratios_of_strings", _set("compress_ratios", ["0"] * 10), "compress_ratios"),
    ("rope_scaling_not_an_object", _set("rope_scaling", 5), "rope_scaling"),
    ("rope_scaling_null", _set("rope_scaling", None), "rope_scaling"),
    ("rope_scaling_missing_factor", _drop_rope("factor"), "rope_scaling.factor"),
    ("rope_scaling_unknown_key", _rope("mscale", 1.0), "rope_scaling.mscale"),
    ("rope_factor_0", _rope("factor", 0), "rope_scaling.factor"),
    ("rope_factor_infinity", _rope("factor", math.inf), "rope_scaling.factor"),
    ("window_infinity", _set("sliding_window", math.inf), "sliding_window"),
    ("rope_theta_string", _set("rope_theta", "10000.0"), "rope_theta"),
    ("rope_theta_true", _set("rope_theta", True), "rope_theta"),
    ("swiglu_limit_string", _set("swiglu_limit", "10.0"), "swiglu_limit"),
    ("norm_eps_nan", _set("rms_norm_eps", math.nan), "rms_norm_eps"),
    ("norm_eps_object", _set("rms_norm_eps", {}), "rms_norm_eps"),
    ("norm_eps_negative", _set("rms_norm_eps", -1e-6), "rms_norm_eps"),
    ("norm_eps_zero_in_fp32", _set("rms_norm_eps", 1e-300), "rms_norm_eps"),        # eps + 0 = 0: NaN rows
    # fields a layout with text_config would have ignored or let contradict each other silently
    ("layers_at_the_root", _set("num_hidden_layers", 99, where=None), "num_hidden_layers"),
    ("bos_given_twice_unlike", _set("bos_token_id", 5), "bos_token_id"),
    ("quantized_and_bf16", _set("dtype", "bf16"), "dtype"),
    ("hidden_act_relu", _set("hidden_act", "relu"), "hidden_act"),
    ("attention_bias_true", _set("attention_bias", True), "attention_bias"),
    ("tied_embeddings_at_the_root", _set("tie_word_embeddings", True, where=None), "tie_word_embeddings"),
    ("gate_temp_subnormal", _set("gate_temp", 1e-320), "gate_temp"),               # logits / 0 in fp32
    ("route_scale_inf_in_fp32", _set("routed_scaling_factor", 1e300), "routed_scaling_factor"),
    ("sinkhorn_iters_1e12", _set("hc_sinkhorn_iters", 10**12), "hc_sinkhorn_iters"),
    ("rope_theta_past_float", _set("rope_theta", 10**400), "rope_theta"),
    ("layers_bool", _set("num_hidden_layers", True), "num_hidden_layers"),
    ("norm_topk_prob_int", _set("norm_topk_prob", 1), "norm_topk_prob"),
    ("score_func_list", _set("scoring_func", ["sqrtsoftplus"]), "scoring_func"),
    ("quantization_config_null", _set("quantization_config", None, where=None), "quantization_config"),
    ("model_type_llama", _set("model_type", "llama", where=None), "model_type"),
    ("text_model_type_llama", _set("model_type", "llama"), "text_config.model_type"),
    ("text_config_a_list", _set("text_config", [], where=None), "text_config"),
    ("eos_outside_vocab", _set("eos_token_id", 512, where=None), "eos_token_id"),
    ("kv_heads_string", _set("num_key_value_heads", "1"), "num_key_value_heads"),
    ("field_given_twice", _set("dim", 128), "dim"),
]


@pytest.mark.parametrize("edit,field_name", [(e, f) for _, e, f in CONFIG_CASES],
                         ids=[c[0] for c in CONFIG_CASES])
def test_config_value_refused_naming_the_field(tmp_path, edit, field_name):
    path = _config_with(tmp_path, edit)
    check_refusal(refused(tmp_path), [path], {field_name})


@pytest.mark.parametrize("content,what,words", [
    (b"", "file", "empty"),
    (b'{"text_config": {"vocab_size": 5', "file", "not valid JSON"),
    (b"\xff\xfe{\x00}\x00", "file", "not UTF-8"),
    (b"[" * 100_000 + b"]" * 100_000, "file", "nested too deeply"),
    (b'{"text_config": {"vocab_size": 5, "vocab_size": 6}}', "vocab_size", "given twice"),
    (b"9" * 5000, "file", "not valid JSON"),
    (b" " * (1 << 20) + b"{}", "file", "larger than"),
], ids=["empty", "truncated", "utf16", "deep", "duplicate_key", "huge_int", "oversized"])
def test_config_file_unreadable_one_line_naming_it(tmp_path, content, what, words):
    (tmp_path / "config.json").write_bytes(content)
    err = refused(tmp_path)
    check_refusal(err, [tmp_path / "config.json"], {what})
    assert words in err.rule, err


def test_config_json_that_is_a_folder(tmp_path):
    """Was reported as .../config.json/config.json."""
    (tmp_path / "config.json").mkdir()
    check_refusal(refused(tmp_path), [tmp_path / "config.json"], {"file"})
    with pytest.raises(CheckpointError) as e:
        ModelConfig.from_file(tmp_path / "config.json")
    check_refusal(e.value, [tmp_path / "config.json"], {"file"})


@pytest.mark.parametrize("name", ["config.json", "model.safetensors.index.json", SHARDS[0]])
def test_fifo_refused_without_reading(ckpt, name):
    """A named pipe would block the first read forever: only regular files are opened."""
    (ckpt / name).unlink()
    os.mkfifo(ckpt / name)
    start = time.perf_counter()
    err = refused(ckpt)
    assert time.perf_counter() - start < 2 and "not a regular file" in err.rule, err


# ---- the small files beside the weights: the Engram token map, the tokenizer -----------------------

def _engine_refused(folder: Path, monkeypatch) -> CheckpointError:
    """Engine.from_checkpoint's refusal, raised before any weight is read."""
    from v41_jax.checkpoint import load as load_mod
    from v41_jax.runtime.engine import Engine

    monkeypatch.setattr(load_mod, "load_params", lambda *a, **k: pytest.fail("weights read before the refusal"))
    with pytest.raises(CheckpointError) as e:
        Engine.from_checkpoint(folder, progress=False, compile_cache_dir=str(SUITE_CACHE))   # not the user's
    return e.value


def _token_map_edit(how: str, folder: Path, tmp_path: Path) -> tuple[str, str]:
    """Break the token map one way -> (the refusal's `what`, a word of its rule)."""
    path = folder / "engram_token_map.json"
    ids = json.loads(path.read_text())
    cfg = ModelConfig.from_file(folder / "config.json")
    if how == "outside":
        (tmp_path / "elsewhere.json").write_text(json.dumps(ids))
        path.unlink()
        path.symlink_to(tmp_path / "elsewhere.json")
        return "file", "outside"
    if how == "fifo":
        path.unlink()
        os.mkfifo(path)
        return "file", "regular"
    if how == "too big":
        path.write_text(json.dumps(ids) + " " * (17 * cfg.vocab_size))
        return "file", "bytes"
    edits = {"an object": ({"ids": ids}, "token map", "list"), "one short": (ids[:-1], "token map", "vocab_size"),
             "a float": ([1.5] + ids[1:], "token map[0]", "integer"),
             "a bool": (ids[:3] + [True] + ids[4:], "token map[3]", "integer"),
             "out of range": (ids[:-1] + [cfg.engram_compressed_vocab_size], f"token map[{cfg.vocab_size - 1}]",
                              "engram_compressed_vocab_size")}
    value, what, word = edits[how]
    path.write_text(json.dumps(value))
    return what, word


@pytest.mark.parametrize("how", ["outside", "fifo", "too big", "an object", "one short", "a float", "a bool",
                                 "out of range"])
def test_token_map_refused_naming_it_before_the_weights(ckpt, tmp_path, monkeypatch, how):
    """`engram_token_map.json` is read like config.json: a regular file inside the folder, bounded
    (16 bytes a token), a list of vocab_size ids in [0, engram_compressed_vocab_size); refused in one
    line naming it, before a weight is read (it was opened through symlinks, blocked on a FIFO, and
    failed with a bare ValueError after the whole load)."""
    what, word = _token_map_edit(how, ckpt, tmp_path)
    start = time.perf_counter()
    err = _engine_refused(ckpt, monkeypatch)
    check_refusal(err, [ckpt / "engram_token_map.json"], {what})
    assert word in err.rule and time.perf_counter() - start < 5, err


def test_tokenizer_that_does_not_parse_refused_naming_it(ckpt, monkeypatch):
    (ckpt / "tokenizer.json").write_text("{}")
    err = _engine_refused(ckpt, monkeypatch)
    check_refusal(err, [ckpt / "tokenizer.json"], {"file"})
    assert "not a tokenizer" in err.rule, err


def test_hub_keys_at_the_root_are_left_alone(ckpt):
    """Keys a hub adds at the root (auto_map, _name_or_path, use_cache) describe no model field."""
    _config_with(ckpt, lambda r: r.update(auto_map={"AutoConfig": "x.y"}, _name_or_path="here", use_cache=True))
    assert ModelConfig.from_file(ckpt / "config.json") == ModelConfig.from_file(TINY_CONFIG)


def test_tokenizer_symlinked_outside_refused(ckpt, tmp_path, monkeypatch):
    (tmp_path / "tokenizer.json").write_text("{}")
    (ckpt / "tokenizer.json").symlink_to(tmp_path / "tokenizer.json")
    err = _engine_refused(ckpt, monkeypatch)
    check_refusal(err, [ckpt / "tokenizer.json"], {"file"})
    assert "outside" in err.rule, err


# ---- a shard changed after it was checked -----------------------------------------------------------

def test_shard_swapped_for_a_symlink_after_the_check_is_not_followed(ckpt, tmp_path):
    """The shard is read through the file opened and checked: a symlink put in its place later (to
    a file outside the folder, of the same size) is never read; the data were read from it before."""
    ck = Checkpoint(ckpt)
    name = next(n for n, t in ck.tensors.items() if t.path.endswith(SHARDS[1]) and t.end > t.begin)
    path = ckpt / SHARDS[1]
    original = path.read_bytes()
    (tmp_path / "elsewhere.bin").write_bytes(bytes(len(original)))
    path.rename(tmp_path / "moved.safetensors")
    path.symlink_to(tmp_path / "elsewhere.bin")
    got = np.array(ck.get(name)).view(np.uint8).reshape(-1)
    info = ck.info(name)
    assert got.tobytes() == original[info.begin:info.end] and got.any(), name


def test_shard_truncated_after_the_check_refused_naming_it(ckpt):
    """A shard cut short after its layout was checked would fault the process when its map is read
    (SIGBUS): its size is checked again when it is first mapped."""
    ck = Checkpoint(ckpt)
    name = next(n for n, t in ck.tensors.items() if t.path.endswith(SHARDS[1]))
    os.truncate(ckpt / SHARDS[1], 100)
    with pytest.raises(CheckpointError) as e:
        ck.get(name)
    check_refusal(e.value, [ckpt / SHARDS[1]], {name})
    assert "no longer the" in e.value.rule, e.value


@pytest.mark.parametrize("key", ["bad\nkey", "x" * 5000, "tab\tand\x1b[31mcolour"])
def test_refusal_stays_one_line_whatever_the_key(tmp_path, key):
    """A key or name from the file is printed escaped and cut short: a newline or a terminal escape
    in it cannot break the one-line refusal."""
    path = _config_with(tmp_path, _set(key, 1))
    err = refused(tmp_path)
    line = str(err)
    assert "\n" not in line and "\x1b" not in line and len(line) < 1000 and line.startswith(f"{path}: "), line
    assert err.rule == "unknown config field"


def test_errors_pickle():
    for err in (CheckpointError("a.json", "x", "bad"), ConfigError("x", "bad", "a.json"), ConfigError("x", "bad")):
        back = pickle.loads(pickle.dumps(err))
        assert type(back) is type(err) and str(back) == str(err)


def test_config_with_utf8_bom_loads_equal(ckpt, tiny):
    """Accepted on purpose: a UTF-8 byte order mark cannot change the meaning (docs/MODEL.md §2.3)."""
    path = ckpt / "config.json"
    path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
    _, params = load_params(ckpt, progress=False)
    assert params_equal(params, tiny[1])


# ---- index file types --------------------------------------------------------------------------

@pytest.mark.parametrize("edit,what", [
    (lambda i: i.update(weight_map=list(i["weight_map"])), "weight_map"),
    (lambda i: i.update(weight_map="model.safetensors"), "weight_map"),
    (lambda i: i["weight_map"].update({"norm.weight": 3}), "norm.weight"),
    (lambda i: i["weight_map"].update({"norm.weight": None}), "norm.weight"),
    (lambda i: i.update(metadata=[1]), "metadata"),
    (lambda i: i["metadata"].update(total_size="3"), "metadata.total_size"),
    (lambda i: i["metadata"].update(total_size=True), "metadata.total_size"),
    (lambda i: i.update(shards=3), "shards"),
    (lambda i: i["weight_map"].update({"norm.weight": "\ud800.safetensors"}), "norm.weight"),
], ids=["weight_map_list", "weight_map_string", "shard_int", "shard_null", "metadata_list",
        "total_size_string", "total_size_bool", "unknown_key", "shard_name_lone_surrogate"])
def test_index_types_refused(ckpt, edit, what):
    edit_json(index_path(ckpt), edit)
    check_refusal(refused(ckpt), [index_path(ckpt)], {what})


def test_index_utf16_refused(ckpt):
    text = index_path(ckpt).read_text()
    index_path(ckpt).write_bytes(text.encode("utf-16"))
    err = refused(ckpt)
    check_refusal(err, [index_path(ckpt)], {"file"})
    assert "not UTF-8" in err.rule


# ---- duplicates --------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [[10**400] * 11, [1] * 65, [0, 10**30]], ids=["product_of_4400_digits", "65_axes",
                                                                               "empty_but_huge"])
def test_shape_past_numpys_bounds_refused(ckpt, shape):
    """A shape numpy cannot hold: its byte count printed past Python's 4,300 digits (a bare
    ValueError while the message was built), or an array numpy refuses later (`get`)."""
    header, data = split_shard(ckpt / SHARDS[1])
    raw = json.loads(header)
    first = next(k for k in raw if k != "__metadata__")
    raw[first]["shape"] = shape
    write_shard(ckpt / SHARDS[1], json.dumps(raw).encode(), data)
    err = refused(ckpt)
    check_refusal(err, [ckpt / SHARDS[1]], {first})
    assert "at most 64 axes, each below 2**63" in err.rule, err


def test_duplicate_key_in_a_shard_header_refused(ckpt):
    """The last of two equal keys won silently: the first entry's bytes went unaccounted for."""
    header, data = split_shard(ckpt / SHARDS[1])
    first = next(k for k in json.loads(header) if k != "__metadata__")
    entry = json.dumps(json.loads(header)[first], separators=(",", ":"))
    doubled = header.rstrip().replace(b"{", b"{" + f'"{first}":{entry},'.encode(), 1)
    write_shard(ckpt / SHARDS[1], doubled, data)
    check_refusal(refused(ckpt), [ckpt / SHARDS[1]], {first})


@pytest.mark.parametrize("same_shard", [True, False], ids=["same_shard", "other_shard"])
def test_tensor_mapped_twice_in_the_index_refused(ckpt, same_shard):
    text = index_path(ckpt).read_text()
    name = "norm.weight"
    other = SHARDS[0] if json.loads(text)["weight_map"][name] != SHARDS[0] else SHARDS[1]
    again = json.loads(text)["weight_map"][name] if same_shard else other
    text = text.replace('"weight_map": {', f'"weight_map": {{"{name}": "{again}",', 1)
    index_path(ckpt).write_text(text)
    check_refusal(refused(ckpt), [index_path(ckpt)], {name})


def test_tensor_stored_in_two_shards_refused(ckpt):
    name = "norm.weight"
    home = shard_of(ckpt, name)
    other = ckpt / next(s for s in SHARDS if ckpt / s != home)
    value = np.zeros(tensor_info(home, name)["shape"], np.uint16)     # bf16 zeros
    header, data = split_shard(other)
    obj = json.loads(header)
    obj[name] = {"dtype": "BF16", "shape": list(value.shape), "data_offsets": [len(data), len(data) + value.nbytes]}
    write_shard(other, json.dumps(obj, separators=(",", ":")).encode(), data + value.tobytes())
    edit_json(index_path(ckpt), lambda i: i["metadata"].update(total_size=i["metadata"]["total_size"] + value.nbytes))
    err = refused(ckpt)
    check_refusal(err, [home, other], {name})
    assert "two shards" in err.rule, err


# ---- values ------------------------------------------------------------------------------------

@pytest.mark.parametrize("name,value", [
    ("layers.0.attn_norm.weight", math.nan),
    ("embed.weight", math.inf),
    ("layers.0.hc_attn_base", math.nan),
    ("layers.2.attn.attn_sink", -math.inf),
    ("mtp.2.markov_head.head.weight", math.nan),
], ids=["bf16_nan", "bf16_inf", "f32_nan", "f32_minus_inf", "bf16_held_f32_nan"])
def test_non_finite_tensor_refused_by_name(ckpt, name, value):
    shard = shard_of(ckpt, name)
    poke(shard, name, element_bytes(tensor_info(shard, name)["dtype"], value), at=2 * 4)
    err = refused(ckpt)
    check_refusal(err, [shard], {name})
    assert "NaN or infinite" in err.rule


@pytest.mark.parametrize("code", [0x7F, 0xFF])
@pytest.mark.parametrize("dense", ["bf16", "fp8"])
def test_e4m3_nan_code_refused_by_name(ckpt, code, dense):
    """Decoded at load (bf16) or held as published (fp8, the codes themselves checked)."""
    name = "layers.0.attn.wq_a.weight"
    shard = shard_of(ckpt, name)
    poke(shard, name, bytes([code]), at=5)
    err = refused(ckpt, dense=dense)
    check_refusal(err, [shard], {name})
    assert "dequantizes to NaN" in err.rule


@pytest.mark.parametrize("scale,code,experts,refused_code", [
    ("layers.0.attn.wq_a.scale", 246, "bf16", False),
    ("layers.0.attn.wq_a.scale", 247, "bf16", True),            # 448 x 2^120 overflows bf16
    ("layers.1.ffn.experts.3.w2.scale", 252, "fp4", False),
    ("layers.1.ffn.experts.3.w2.scale", 253, "fp4", True),      # 6 x 2^126 overflows bf16
    ("layers.1.ffn.experts.3.w2.scale", 253, "fp8", True),
], ids=["fp8_246", "fp8_247", "fp4_252", "fp4_253_held_fp4", "fp4_253_held_fp8"])
def test_scale_that_overflows_refused_by_name(ckpt, scale, code, experts, refused_code):
    """A scale whose product with the format's largest value overflows bf16 is refused by name in
    every held format, without decoding the weights; the code below it loads."""
    shard = shard_of(ckpt, scale)
    poke(shard, scale, bytes([code]))
    if not refused_code:
        load_params(ckpt, progress=False, experts=experts)
        return
    err = refused(ckpt, experts=experts)
    check_refusal(err, [shard], {scale})
    assert "1 E8M0 scale bytes are above" in err.rule, err


def test_engram_nan_code_found_by_verify_only(ckpt, capsys):
    """The host Engram tables are mapped, not read, at load (docs/MODEL.md §2.3): a NaN code there
    loads, and `verify=True` / `python -m v41_jax.checkpoint.verify` refuse it by name."""
    name = "layers.3.engram.embed.weight"
    shard = shard_of(ckpt, name)
    poke(shard, name, bytes([0xFF]), at=40)
    load_params(ckpt, progress=False)
    check_refusal(refused(ckpt, verify=True), [shard], {name})
    assert verify.main([str(ckpt), "--quiet"]) == 2
    _one_line(capsys, f"{shard}: {name}: holds the E4M3 NaN code 0x7F/0xFF")


def test_verify_accepts_the_original(tiny, capsys):
    assert verify.main([str(tiny[0]), "--quiet"]) == 0
    assert capsys.readouterr().out.startswith(f"ok: {tiny[0]}")


# ---- CLIs: one line, exit 2 --------------------------------------------------------------------

def _one_line(capsys, prefix: str) -> str:
    err = capsys.readouterr().err
    assert err.startswith(f"error: {prefix}") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.fixture
def bad_config(tmp_path):
    return _config_with(tmp_path, _set("rms_norm_eps", math.nan))


def test_geometry_cli_exit_2(bad_config, capsys):
    assert geometry.main(["--config", str(bad_config)]) == 2
    _one_line(capsys, f"{bad_config}: rms_norm_eps: must be finite")


def test_make_checkpoint_cli_exit_2(bad_config, tmp_path, capsys):
    assert make_checkpoint_script.main(["--config", str(bad_config), "--out", str(tmp_path / "o"),
                                        "--seed", "0"]) == 2
    _one_line(capsys, f"{bad_config}: rms_norm_eps: ")


def test_check_reference_cli_exit_2(ckpt, tmp_path, capsys):
    folder = tmp_path / "fixture"
    folder.mkdir()
    ckpt.rename(folder / "checkpoint")
    _config_with(folder / "checkpoint", _set("swiglu_limit", "10.0"))
    assert check_reference.main([str(folder)]) == 2
    _one_line(capsys, f"{folder / 'checkpoint' / 'config.json'}: swiglu_limit: ")


def _prompts(tmp_path) -> str:
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt_ids": [5, 6]}\n')
    return str(path)


def test_generate_cli_bad_config_exit_2(ckpt, tmp_path, capsys):
    _config_with(ckpt, _set("model_type", "llama", where=None))
    assert generate_script.main(["--checkpoint", str(ckpt), "--prompts", _prompts(tmp_path)]) == 2
    _one_line(capsys, f"{ckpt / 'config.json'}: model_type: ")


def test_generate_cli_bad_tensor_exit_2(ckpt, tmp_path, capsys):
    """Refused while the engine loads the weights, after every argument was checked."""
    name = "norm.weight"
    poke(shard_of(ckpt, name), name, element_bytes("BF16", math.nan))
    assert generate_script.main(["--checkpoint", str(ckpt), "--prompts", _prompts(tmp_path), "--quiet",
                                 "--compile-cache", ""]) == 2
    _one_line(capsys, f"{shard_of(ckpt, name)}: {name}: holds NaN")


def test_cli_as_a_process_exit_2_without_traceback(bad_config):
    run = subprocess.run([sys.executable, "-m", "v41_jax.cache.geometry", "--config", str(bad_config)],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
    assert run.stderr.strip().splitlines() == [f"error: {bad_config}: rms_norm_eps: must be finite, got NaN"]
