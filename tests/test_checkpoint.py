"""Published checkpoint format: schema vs the official fixtures, reader, writer, loader, orbax cache,
and refusal of every malformed case with an error naming the tensor and the file."""

import gc
import json
import os
import re
import shutil
import struct
import tracemalloc
from collections import Counter
from dataclasses import replace
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors import safe_open

from scripts.make_checkpoint import encode, engram_token_map, main, make_checkpoint
from v41_jax import quant
from v41_jax.model import moe
from v41_jax.model.numerics import Numerics
from v41_jax.quant import Fp4Weight, Fp8BlockWeight, Fp8RowWeight
from v41_jax.checkpoint import converted
from v41_jax.checkpoint import load as load_mod
from v41_jax.checkpoint.load import ENGRAM_KEY, EngramTables, load_params, param_units
from v41_jax.checkpoint.safetensors_io import (INDEX_NAME, Checkpoint, CheckpointError, write_checkpoint,
                                               write_safetensors)
from v41_jax.checkpoint.schema import (SchemaOptions, checkpoint_schema, parameter_aliases,
                                       validate_checkpoint)
from v41_jax.config import ModelConfig

ROOT = Path(__file__).parent
OFFICIAL = ROOT / "fixtures" / "dsv41_official"
TINY_CONFIG = ROOT.parent / "v41_jax" / "configs" / "tiny.config.json"
# tensor counts per dtype, from tests/fixtures/dsv41_official/SOURCE.md ("Checkpoint format")
OFFICIAL_COUNTS = {
    "small_a": {"F8_E8M0": 141, "I8": 84, "BF16": 66, "F8_E4M3": 57, "F32": 56},
    "small_b": {"F8_E8M0": 344, "I8": 252, "BF16": 96, "F32": 96, "F8_E4M3": 92},
}


def raw_header(path) -> tuple[int, dict]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return n, json.loads(f.read(n))


def u8(a) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint8).ravel()


def f32(a) -> np.ndarray:
    """Host fp32 copy (ml_dtypes widening; no device op, so no per-shape compile)."""
    return np.asarray(a).astype(np.float32)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A 3-shard random checkpoint of the tiny config, the fp32 weights it encodes, its params."""
    out = tmp_path_factory.mktemp("tiny") / "ckpt"
    cfg, weights = make_checkpoint(str(TINY_CONFIG), str(out), seed=0, shards=3)
    _, params = load_params(out, progress=False)
    return out, cfg, weights, params


# ---- official fixtures ---------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["small_a", "small_b"])
def test_official_schema_and_load(name):
    d = OFFICIAL / name / "checkpoint"
    cfg = ModelConfig.from_file(d)
    schema = checkpoint_schema(cfg)
    _, header = raw_header(d / "model.safetensors")
    assert header.pop("__metadata__") == {"format": "pt"}
    assert set(schema) == set(header)
    assert all(schema[k].dtype == v["dtype"] and list(schema[k].shape) == v["shape"] for k, v in header.items())
    assert Counter(s.dtype for s in schema.values()) == OFFICIAL_COUNTS[name]
    assert parameter_aliases(cfg) == json.loads((d / "parameter_aliases.json").read_text())
    opts, _ = validate_checkpoint(Checkpoint(d), cfg)
    assert opts == SchemaOptions()                              # wo_a BF16, no bias_vl

    cfg2, params = load_params(d, progress=False)
    assert cfg2 == cfg
    ckpt = Checkpoint(d)
    # independent dequant with ml_dtypes: FP8 32x32 blocks and FP4 rows
    w, s = ckpt.get("layers.2.attn.wq_b.weight"), ckpt.get("layers.2.attn.wq_b.scale")
    want = w.astype(np.float32) * s.astype(np.float32).repeat(32, 0).repeat(32, 1)[:w.shape[0], :w.shape[1]]
    got = params["layers"][2]["attn"]["wq_b"]["weight"]
    assert got.dtype == jnp.bfloat16 and np.array_equal(f32(got), want)
    e = cfg.n_routed_experts - 1
    packed = ckpt.get(f"layers.1.ffn.experts.{e}.w2.weight").view(np.uint8)
    nib = np.stack([packed & 15, packed >> 4], -1).reshape(packed.shape[0], -1)
    table = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float32)
    scale = ckpt.get(f"layers.1.ffn.experts.{e}.w2.scale").astype(np.float32).repeat(32, 1)
    w2 = params["layers"][1]["ffn"]["experts"]["w2"]            # "auto" on CPU: bf16
    assert w2.dtype == jnp.bfloat16 and w2.shape == (cfg.n_routed_experts, cfg.dim, cfg.moe_inter_dim)
    assert np.array_equal(f32(w2[e]), table[nib] * scale)
    # dense FP8 weights held as published: the file's codes and block scales, the same decode
    _, as_blocks = load_params(d, progress=False, dense="fp8")
    held_wq_b = as_blocks["layers"][2]["attn"]["wq_b"]["weight"]
    assert isinstance(held_wq_b, Fp8BlockWeight) and held_wq_b.shape == w.shape
    assert np.array_equal(np.asarray(held_wq_b.codes), u8(w).reshape(w.shape))
    assert np.array_equal(np.asarray(held_wq_b.block_scale), u8(s).reshape(s.shape))
    assert np.array_equal(f32(held_wq_b.dequant()), want)
    # every FP8 weight of the file, and only those, held so
    blocks = [x for x in jax.tree.leaves(as_blocks, is_leaf=lambda x: isinstance(x, Fp8BlockWeight))
              if isinstance(x, Fp8BlockWeight)]
    assert len(blocks) == sum(t.dtype == "F8_E4M3" and t.held != "host" for t in schema.values()) > 0
    with pytest.raises(ValueError, match="dense: 'fp4'"):
        load_params(d, progress=False, dense="fp4")
    _, as_fp8 = load_params(d, progress=False, experts="fp8")             # re-coded rows
    w2 = as_fp8["layers"][1]["ffn"]["experts"]["w2"]
    assert isinstance(w2, Fp8RowWeight) and w2.codes.dtype == jnp.uint8 and w2.shape == w2.codes.shape
    assert np.array_equal(f32(w2[e].dequant()), table[nib] * scale)
    _, as_fp4 = load_params(d, progress=False, experts="fp4")             # as published
    w2 = as_fp4["layers"][1]["ffn"]["experts"]["w2"]
    assert isinstance(w2, Fp4Weight) and np.array_equal(np.asarray(w2.codes[e]), packed)
    assert np.array_equal(np.asarray(w2.scale[e]), u8(ckpt.get(f"layers.1.ffn.experts.{e}.w2.scale")).reshape(w2.scale.shape[1:]))
    assert np.array_equal(f32(w2[e].dequant()), table[nib] * scale)
    # the MoE sublayer's routed experts give the same output bit for bit in every format
    k = cfg.n_activated_experts
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((5, cfg.dim)), jnp.bfloat16)
    idx = jnp.asarray(np.stack([rng.choice(cfg.n_routed_experts, k, replace=False) for _ in range(5)]), jnp.int32)
    wts = jnp.asarray(rng.random((5, k)), jnp.float32)
    outs = [np.asarray(moe.routed_experts(x, idx, wts, *(p["layers"][1]["ffn"]["experts"][n] for n in ("w1", "w3", "w2")),
                                          Numerics.reference(), cfg.swiglu_limit))
            for p in (params, as_fp8, as_fp4)]
    np.testing.assert_array_equal(outs[1], outs[0])
    np.testing.assert_array_equal(outs[2], outs[0])
    with pytest.raises(ValueError, match="experts: 'int4'"):
        load_params(d, progress=False, experts="int4")
    # the BF16 tensors the reference holds in fp32 stay the file's bf16 values (lin_f32 takes
    # them as they are); the F32 tensors stay fp32
    assert params["head"]["weight"].dtype == jnp.bfloat16
    assert np.array_equal(f32(params["head"]["weight"]), ckpt.get("head.weight").astype(np.float32))
    last = params["mtp"][cfg.n_mtp_layers - 1]
    assert last["markov_head"]["head"]["weight"].dtype == jnp.bfloat16
    assert last["confidence_head"]["proj"]["weight"].dtype == jnp.bfloat16
    assert params["layers"][cfg.kv_source_layers[0]]["attn"]["compressor"]["wgate"]["weight"].dtype == jnp.bfloat16
    assert params["layers"][0]["hc_attn_fn"].dtype == jnp.float32
    # Engram tables: host memmaps, no device leaves
    tables = params[ENGRAM_KEY]
    assert isinstance(tables, EngramTables) and not jax.tree.leaves(tables)
    for l, rows in zip(cfg.engram_layer_ids, cfg.engram_num_embeddings):
        assert isinstance(tables.weight[l], np.memmap) and tables.weight[l].shape == (rows, cfg.engram_head_dim)
        codes, scales = tables.gather(l, np.array([[0, rows - 1]]))
        assert codes.shape == (1, 2, cfg.engram_head_dim) and scales.shape == (1, 2, cfg.engram_head_dim // 32)


def test_lazy_subsets(tiny):
    ckpt = Checkpoint(tiny[0])
    expert = ckpt.get_prefix("layers.1.ffn.experts.3.")
    assert sorted(expert) == [f"layers.1.ffn.experts.3.{w}.{k}" for w in ("w1", "w2", "w3") for k in ("scale", "weight")]
    layer = ckpt.get_prefix("layers.1.")
    assert set(expert) < set(layer) and not any(n.startswith("layers.1") and not n.startswith("layers.1.") for n in layer)
    assert all(isinstance(a, np.memmap) for a in layer.values())


def test_reader_bytes_equal_safetensors_library(tiny):
    """Our memmap reader returns exactly the bytes the safetensors library reads (official + written)."""
    for d in (OFFICIAL / "small_a" / "checkpoint", tiny[0]):
        ckpt = Checkpoint(d)
        assert len(ckpt.files) == (1 if "small_a" in str(d) else 3)
        for shard in ckpt.files.values():
            with safe_open(shard.path, "pt") as f:
                for name in f.keys():
                    ref = f.get_tensor(name).contiguous().view(torch.uint8).numpy().ravel()
                    ours = ckpt.get(name)
                    assert isinstance(ours, np.memmap) and np.array_equal(u8(ours), ref), name


# ---- writer ------------------------------------------------------------------------------------

def test_written_layout(tiny):
    out, cfg, _, _ = tiny
    index = json.loads((out / INDEX_NAME).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert shards == [f"model-0000{k}-of-00003.safetensors" for k in (1, 2, 3)]
    assert set(index["weight_map"]) == set(checkpoint_schema(cfg))
    total = 0
    for shard in shards:
        n, header = raw_header(out / shard)
        assert (8 + n) % 8 == 0
        assert next(iter(header)) == "__metadata__" and header.pop("__metadata__") == {"format": "pt"}
        names = list(header)
        assert names == sorted(names) and {k for k, v in index["weight_map"].items() if v == shard} == set(names)
        pos = 0
        for name in names:                                     # contiguous, in name order
            assert header[name]["data_offsets"][0] == pos
            pos = header[name]["data_offsets"][1]
        assert os.path.getsize(out / shard) == 8 + n + pos
        total += pos
    assert index["metadata"]["total_size"] == total
    assert ModelConfig.from_file(out) == ModelConfig.from_file(TINY_CONFIG) == cfg
    assert json.loads((out / "engram_token_map.json").read_text())[:6] == [0, 0, 1, 1, 2, 2]
    assert json.loads((out / "parameter_aliases.json").read_text()) == parameter_aliases(cfg)


def test_written_bytes_read_back_exactly(tiny):
    out, cfg, weights, _ = tiny
    stored = encode(checkpoint_schema(cfg), weights)
    ckpt = Checkpoint(out)
    assert set(stored) == set(ckpt.tensors)
    for name, arr in stored.items():
        assert ckpt.get(name).dtype == arr.dtype and np.array_equal(u8(ckpt.get(name)), u8(arr)), name


def test_dequant_within_format_rounding(tiny):
    """Loaded params vs the fp32 weights they were quantized from.

    FP8 E4M3, 32x32 block, scale s = 2^ceil(log2(amax/448)) so |w|/s <= 448 never saturates:
    3 mantissa bits, round to nearest -> |deq - w| <= max(2^-4 |w|, 2^-10 s) (the second term is half
    the subnormal step 2^-9 s). FP4 E2M1, 1x32 row group, s = 2^ceil(log2(amax/6)) so |w|/s <= 6:
    |deq - w| <= s * step(|w|/s) / 2 with step 0.5 below 2, 1 below 4, 2 up to 6. Both decoded
    values are exact in bf16. BF16 tensors are the RNE bf16 of w; F32 ones equal w."""
    out, cfg, weights, params = tiny
    schema = checkpoint_schema(cfg)
    ckpt = Checkpoint(out)
    seen_fp8 = seen_fp4 = 0.0
    for path, unit in param_units(schema).items():
        spec = schema[unit.names[0]]
        leaf = params
        for key in path.split("."):
            leaf = leaf[int(key)] if isinstance(leaf, list) else leaf[key]
        got = f32(quant.held(leaf))           # FP4 experts: their exact bf16 decode
        w = np.stack([weights[n] for n in unit.names]) if unit.stacked else weights[unit.names[0]]
        assert got.shape == w.shape, path
        err = np.abs(got - w)
        if spec.dtype == "F8_E4M3":
            s = f32(ckpt.get(unit.names[0][:-6] + "scale"))
            s = s.repeat(32, 0).repeat(32, 1)[:w.shape[0], :w.shape[1]]
            assert np.all(err <= np.maximum(np.abs(w) * 2.0**-4, s * 2.0**-10)), path
            normal = np.abs(w) >= s * 2.0**-6
            seen_fp8 = max(seen_fp8, float((err[normal] / np.abs(w[normal])).max()))
        elif spec.dtype == "I8":
            s = np.stack([f32(ckpt.get(n[:-6] + "scale")) for n in unit.names])
            s = s.repeat(32, -1).reshape(w.shape)
            v = np.abs(w) / s
            step = np.where(v < 2, 0.5, np.where(v < 4, 1.0, 2.0))
            assert np.all(v <= 6) and np.all(err <= s * step / 2), path
            seen_fp4 = max(seen_fp4, float((err / s).max()))
        elif spec.dtype == "BF16":
            assert np.array_equal(got, w.astype(ml_dtypes.bfloat16).astype(np.float32)), path
        else:
            assert np.array_equal(got, w), path
    # the weights really went through the codecs (errors near the bounds, not zero)
    assert 2.0**-5 < seen_fp8 <= 2.0**-4 and 0.5 < seen_fp4 <= 1.0


def test_wo_a_fp8_variant_and_lone_file(tiny, tmp_path):
    """The HF-release variant (wo_a FP8 + scale) is detected and dequantized, or held as published
    with the other FP8 weights; a lone
    model.safetensors without an index is read."""
    out, cfg, weights, _ = tiny
    ckpt = Checkpoint(out)
    tensors = {n: np.array(ckpt.get(n)) for n in ckpt.tensors}
    name = "layers.0.attn.wo_a.weight"
    codes, scale = quant.quant_weight_fp8(weights[name])
    for l in range(cfg.n_layers):
        w, s = quant.quant_weight_fp8(weights[f"layers.{l}.attn.wo_a.weight"])
        tensors[f"layers.{l}.attn.wo_a.weight"] = np.asarray(w).view(ml_dtypes.float8_e4m3fn)
        tensors[f"layers.{l}.attn.wo_a.scale"] = np.asarray(s).view(ml_dtypes.float8_e8m0fnu)
    for m in range(cfg.n_mtp_layers):
        w, s = quant.quant_weight_fp8(weights[f"mtp.{m}.attn.wo_a.weight"])
        tensors[f"mtp.{m}.attn.wo_a.weight"] = np.asarray(w).view(ml_dtypes.float8_e4m3fn)
        tensors[f"mtp.{m}.attn.wo_a.scale"] = np.asarray(s).view(ml_dtypes.float8_e8m0fnu)
    write_safetensors(tmp_path / "model.safetensors", tensors)
    shutil.copy(out / "config.json", tmp_path / "config.json")
    opts, _ = validate_checkpoint(Checkpoint(tmp_path), cfg)
    assert opts == SchemaOptions(wo_a_fp8=True)
    want = f32(quant.dequant_fp8_blocks(codes, scale, dtype=jnp.float32))
    _, params = load_params(tmp_path, progress=False, dense="bf16")
    got = params["layers"][0]["attn"]["wo_a"]["weight"]
    assert got.dtype == jnp.bfloat16 and np.array_equal(f32(got), want)
    _, held = load_params(tmp_path, progress=False, dense="fp8")          # or held as published
    got = held["layers"][0]["attn"]["wo_a"]["weight"]
    assert isinstance(got, Fp8BlockWeight) and np.array_equal(f32(got.dequant()), want)


def test_cli_main_writes_a_loadable_checkpoint(tmp_path):
    cfg_path = OFFICIAL / "small_b" / "checkpoint" / "reference_config.json"   # reference names
    assert main(["--config", str(cfg_path), "--out", str(tmp_path), "--seed", "3"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["config.json", "engram_token_map.json", "model.safetensors", INDEX_NAME, "parameter_aliases.json"])
    cfg = ModelConfig.from_file(tmp_path)
    assert cfg == ModelConfig.from_file(cfg_path)
    assert "text_config" in json.loads((tmp_path / "config.json").read_text())
    validate_checkpoint(Checkpoint(tmp_path), cfg)
    assert json.loads((tmp_path / "engram_token_map.json").read_text()) == engram_token_map(cfg)


# ---- orbax cache -------------------------------------------------------------------------------

def test_orbax_cache_roundtrip_bit_exact(tiny, tmp_path, monkeypatch):
    out, cfg, _, params = tiny
    cache = tmp_path / "cache"
    _, first = converted.load_params_cached(out, cache, progress=False, experts="fp8", dense="fp8")
    assert (cache / "source.json").exists()

    def no_conversion(*a, **k):
        raise AssertionError("second start must not convert")
    monkeypatch.setattr(converted, "load_params", no_conversion)
    cfg2, again = converted.load_params_cached(out, cache, progress=False, experts="fp8", dense="fp8")
    assert cfg2 == cfg
    w1 = again["layers"][0]["ffn"]["experts"]["w1"]
    assert isinstance(w1, Fp8RowWeight)                              # the held types come back
    assert isinstance(again["layers"][0]["attn"]["wq_a"]["weight"], Fp8BlockWeight)
    assert jax.tree.structure(again) == jax.tree.structure(first)
    for (path, a), b in zip(jax.tree.leaves_with_path(again), jax.tree.leaves(first)):
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(u8(np.asarray(a)), u8(np.asarray(b))), path
    assert again[ENGRAM_KEY] == params[ENGRAM_KEY]
    # another config (same files) does not hit the cache
    with pytest.raises(AssertionError, match="must not convert"):
        converted.load_params_cached(out, cache, cfg.replace(max_seq_len=cfg.max_seq_len * 2), progress=False,
                                     experts="fp8")
    with pytest.raises(AssertionError, match="must not convert"):                 # nor another expert format
        converted.load_params_cached(out, cache, progress=False, experts="fp4", dense="fp8")
    with pytest.raises(AssertionError, match="must not convert"):                 # nor another dense one
        converted.load_params_cached(out, cache, progress=False, experts="fp8", dense="bf16")
    # nor a loader that holds a tensor in another dtype than the one that converted the cache
    checked = converted.validate_checkpoint

    def held_otherwise(ckpt, c):
        opts, schema = checked(ckpt, c)
        return opts, {n: (replace(t, held="f32") if n == "head.weight" else t) for n, t in schema.items()}
    monkeypatch.setattr(converted, "validate_checkpoint", held_otherwise)
    with pytest.raises(AssertionError, match="must not convert"):
        converted.load_params_cached(out, cache, progress=False, experts="fp8", dense="fp8")


@pytest.mark.parametrize("cut", ["params saved", "params half saved", "stamp not json", "stamp a list"])
def test_orbax_cache_save_cut_short_converts_again(tiny, tmp_path, monkeypatch, cut):
    """A save killed midway (or a damaged stamp) leaves no fingerprint that matches: the next start
    converts again, where it used to restore params that were gone (a bare FileNotFoundError on
    every start until the cache was deleted by hand) or, cut after the params, another checkpoint's."""
    out, cfg, _, _ = tiny
    cache = tmp_path / "cache"
    converted.load_params_cached(out, cache, progress=False, experts="fp8")
    if cut.startswith("params"):
        real = converted.ocp.StandardCheckpointer.save

        def killed(self, path, item, *a, **k):
            if cut == "params saved":
                real(self, path, item, *a, **k)
                self.wait_until_finished()
            raise KeyboardInterrupt("killed")
        monkeypatch.setattr(converted.ocp.StandardCheckpointer, "save", killed)
        with pytest.raises(KeyboardInterrupt):
            converted.save_converted(cache, {"x": jnp.zeros(3)}, "another checkpoint")
        monkeypatch.undo()
    else:
        (cache / "source.json").write_text("[]" if cut == "stamp a list" else "{")
    assert converted.cached_fingerprint(cache) is None
    calls = []
    monkeypatch.setattr(converted, "load_params", lambda *a, **k: calls.append(1) or load_params(*a, **k))
    _, again = converted.load_params_cached(out, cache, progress=False, experts="fp8")
    assert calls == [1] and "layers" in again


# ---- malformed checkpoints ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_tensors(tiny):
    ckpt = Checkpoint(tiny[0])
    return {n: np.array(ckpt.get(n)) for n in ckpt.tensors}


def _rewrite_header(path, mutate):
    """Re-encode one shard's header (after mutate(header)) in front of its unchanged data bytes."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header, data = json.loads(f.read(n)), f.read()
    mutate(header)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + data)


def _first_name(path) -> str:
    _, header = raw_header(path)
    return sorted(k for k in header if k != "__metadata__")[0]


def _drop(t, n):
    del t[n]


@pytest.mark.parametrize("case, name, mutate", [
    ("missing", "layers.2.attn.wkv.scale", _drop),
    ("extra", "layers.0.attn.bogus.weight",
     lambda t, n: t.__setitem__(n, np.zeros((2, 2), ml_dtypes.bfloat16))),
    ("wrong shape", "layers.1.attn.indexer.wk.weight",
     lambda t, n: t.__setitem__(n, np.zeros((3, 64), ml_dtypes.bfloat16))),
    ("wrong dtype", "layers.0.attn.attn_sink", lambda t, n: t.__setitem__(n, t[n].astype(ml_dtypes.bfloat16))),
    ("wrong dtype fp8", "layers.0.attn.wq_a.weight", lambda t, n: t.__setitem__(n, t[n].view(np.int8))),
])
def test_refused_tensor_set(tiny, tiny_tensors, tmp_path, case, name, mutate):
    tensors = dict(tiny_tensors)
    mutate(tensors, name)
    write_checkpoint(tmp_path, tensors, 1)
    shutil.copy(tiny[0] / "config.json", tmp_path / "config.json")
    with pytest.raises(CheckpointError) as e:
        load_params(tmp_path, progress=False)
    where = str(tmp_path / INDEX_NAME) if case == "missing" else str(tmp_path / "model.safetensors")
    assert str(e.value).startswith(f"{where}: {name}: "), str(e.value)


@pytest.mark.parametrize("name, experts", [("layers.0.attn.wq_a.scale", "bf16"),
                                           ("layers.1.ffn.experts.3.w2.scale", "fp4"),
                                           ("layers.1.ffn.experts.3.w2.scale", "fp8")])
def test_refused_nan_scale(tiny, tiny_tensors, tmp_path, name, experts):
    """E8M0 code 255 is NaN: a scale holding it is refused by name, in every expert format,
    instead of loading NaN weights."""
    tensors = dict(tiny_tensors)
    bad = tensors[name].view(np.uint8).copy()
    bad.reshape(-1)[1] = 255
    tensors[name] = bad.view(tensors[name].dtype)
    write_checkpoint(tmp_path, tensors, 1)
    shutil.copy(tiny[0] / "config.json", tmp_path / "config.json")
    with pytest.raises(CheckpointError, match=rf"model\.safetensors: {re.escape(name)}: 1 E8M0 scale bytes are 255"):
        load_params(tmp_path, progress=False, experts=experts)


def _copy(tiny, tmp_path) -> Path:
    d = tmp_path / "ckpt"
    shutil.copytree(tiny[0], d)
    for p in d.iterdir():
        p.chmod(0o644)
    return d


SHARD = "model-00002-of-00003.safetensors"


def _truncate(d):
    path = d / SHARD
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size - 1)
    _, header = raw_header(path)
    return max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][1])


def _overlap(d):
    def lie(h):
        names = sorted(k for k in h if k != "__metadata__")
        h[names[1]]["data_offsets"] = [o - 2 for o in h[names[1]]["data_offsets"]]
        lie.name = names[1]
    _rewrite_header(d / SHARD, lie)
    return lie.name


def _gap(d):
    def lie(h):
        names = sorted(k for k in h if k != "__metadata__")
        for n in names[1:]:                       # shift every later tensor: a gap, then past the end
            h[n]["data_offsets"] = [o + 8 for o in h[n]["data_offsets"]]
        lie.name = names[1]
    _rewrite_header(d / SHARD, lie)
    return lie.name


def _size_mismatch(d):
    name = _first_name(d / SHARD)
    _rewrite_header(d / SHARD, lambda h: h[name].__setitem__("shape", [h[name]["shape"][0] + 1, *h[name]["shape"][1:]]))
    return name


def _unknown_dtype(d):
    name = _first_name(d / SHARD)
    _rewrite_header(d / SHARD, lambda h: h[name].__setitem__("dtype", "F8_E5M2"))
    return name


def _edit_index(d, fn):
    index = json.loads((d / INDEX_NAME).read_text())
    name = fn(index)
    (d / INDEX_NAME).write_text(json.dumps(index))
    return name


def _missing_shard(d):
    def fn(index):
        name = _first_name(d / SHARD)
        index["weight_map"][name] = "model-00009-of-00009.safetensors"
        return name
    return _edit_index(d, fn)


def _absent_from_shard(d):
    def fn(index):
        index["weight_map"]["layers.0.attn.ghost.weight"] = SHARD
        return "layers.0.attn.ghost.weight"
    return _edit_index(d, fn)


def _unlisted_in_index(d):
    def fn(index):
        name = _first_name(d / SHARD)
        del index["weight_map"][name]
        return name
    return _edit_index(d, fn)


@pytest.mark.parametrize("corrupt, file, words", [
    (_truncate, SHARD, "truncated shard"),
    (_overlap, SHARD, "overlap"),
    (_gap, SHARD, "gap"),
    (_size_mismatch, SHARD, "needs"),
    (_unknown_dtype, SHARD, "unknown dtype"),
    (_missing_shard, INDEX_NAME, "does not exist"),
    (_absent_from_shard, SHARD, "absent from the shard"),
    (_unlisted_in_index, SHARD, "maps it nowhere"),
])
def test_refused_files(tiny, tmp_path, corrupt, file, words):
    d = _copy(tiny, tmp_path)
    name = corrupt(d)
    with pytest.raises(CheckpointError) as e:
        load_params(d, progress=False)
    msg = str(e.value)
    assert msg.startswith(f"{d / file}: {name}: ") and words in msg, msg


def test_refused_total_size(tiny, tmp_path):
    d = _copy(tiny, tmp_path)
    index = json.loads((d / INDEX_NAME).read_text())
    index["metadata"]["total_size"] += 1
    (d / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="total_size") as e:
        Checkpoint(d)
    assert str(d / INDEX_NAME) in str(e.value)


def test_a_read_is_freed_when_its_conversion_returns(tiny):
    """The loader's host transient is one read at a time (`memory_plan.host_read_bytes`):
    `_convert` returns with its stacked host read (8 experts' codes, 32 KiB) freed, the garbage
    collector off (a numpy argument of a jitted call would stay until it ran)."""
    ckpt = Checkpoint(tiny[0])
    schema = validate_checkpoint(ckpt, tiny[1])[1]
    unit = param_units(schema)["layers.0.ffn.experts.w1"]
    copied = sum(ckpt.info(n).nbytes for n in unit.names)
    load_mod._convert(ckpt, unit, schema[unit.names[0]], "bf16")          # compiled before tracing
    gc.disable()
    tracemalloc.start()
    try:
        out = load_mod._convert(ckpt, unit, schema[unit.names[0]], "bf16")
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
        gc.enable()
    assert out.shape == (8, 64, 128) and held < copied // 4, (held, copied)


def test_auto_holds_experts_by_backend(monkeypatch):
    """"auto": FP8 rows where the MoE kernels run (a GPU), bf16 on CPU (the XLA loop would decode
    every pick); an unknown name is refused."""
    from v41_jax.checkpoint.load import resolve_dense, resolve_experts
    assert resolve_experts("auto") == "bf16" and resolve_experts("fp4") == "fp4"
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert resolve_experts("auto") == "fp8"
    # dense FP8 weights: decoded at load on every backend until the kernel is measured
    assert resolve_dense("auto") == "bf16" and resolve_dense("fp8") == "fp8"
    with pytest.raises(ValueError, match="dense: 'fp4'"):
        resolve_dense("fp4")
    with pytest.raises(ValueError, match="experts: 'int4'"):
        resolve_experts("int4")
