"""Seeded fuzz of the checkpoint loader (issue #19, docs/MODEL.md §2.3): a few hundred mutated copies
of the tiny 3-shard checkpoint (shard headers, the index, config.json, tensor data), each loaded with
`load_params(..., verify=True)`. Every case must be loaded (and equal the original when the mutation
is a no-op) or refused with CheckpointError `<file>: <tensor or field>: <rule>` naming a file the
mutation concerns and a tensor or field; no other exception, no case over 10 s, and no file outside
the checkpoint folder opened (an audit hook records every open). The named cases are in
tests/test_untrusted_files.py."""

import json
import math
import os
import random
import shutil
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.untrusted_common import (PARTS, SHARDS, TENSOR_NAME, build_tiny, copy_checkpoint, element_bytes,
                                    files_opened, outside, params_equal, poke, split_shard,
                                    tensor_info, tensor_names, write_shard)
from v41_jax.checkpoint.load import load_params
from v41_jax.checkpoint.safetensors_io import DTYPES, INDEX_NAME as INDEX
from v41_jax.config import CheckpointError, ModelConfig

SEED = 19
CASES = {"header": 90, "index": 80, "config": 110, "data": 50}   # 330 cases
CASE_LIMIT_S = 10.0


@dataclass
class Case:
    """What a mutation did: where a refusal may point, and whether the checkpoint still means the same."""
    what: str                                   # a description, for the failure report
    files: set[str]                             # file names (in the folder) a refusal may name
    tensors: set[str] | None = None             # the tensors a shard/index refusal may name (None: any)
    noop: bool = False
    extra_names: set[str] = field(default_factory=set)   # keys the mutation added (a refusal may name them)


# ---- the original --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def original(tmp_path_factory):
    base = tmp_path_factory.mktemp("fuzz")
    folder = build_tiny(base / "ckpt")
    _, params = load_params(folder, progress=False, verify=True)      # also compiles the conversions
    outside_dir = base / "elsewhere"                                  # valid files outside the folder
    outside_dir.mkdir()
    for name in (*SHARDS, "config.json"):
        shutil.copy(folder / name, outside_dir / name)
    config = json.loads((folder / "config.json").read_text())
    return folder, params, outside_dir, config


def _config_names(config: dict) -> set[str]:
    text = config["text_config"]
    names = set(config) | set(text) | {f"rope_scaling.{k}" for k in text["rope_scaling"]}
    names |= set(ModelConfig.__dataclass_fields__) | {"file", "config", "text_config", "text_config.model_type"}
    return names


# ---- header mutations ----------------------------------------------------------------------------

BAD_VALUES = ["7", "", True, False, None, {}, [], [1], math.nan, math.inf, -math.inf, 10**12, 10**30, 10**400, -1,
              0, 1, 2**31, 0.5, 1e-300, 1e300, "x" * 300]


def _header(d: Path, rng: random.Random) -> Case:
    shard = rng.choice(SHARDS)
    path = d / shard
    raw, data = split_shard(path)
    header = json.loads(raw)
    name = rng.choice(sorted(k for k in header if k != "__metadata__"))
    entry = header[name]
    op = rng.choice(["dtype", "shape", "offsets", "delete", "rename", "entry_key", "duplicate", "metadata",
                     "length", "truncate", "flip", "not_object", "reorder", "entry_value", "bom"])
    case = Case(f"header {op} {shard} {name}", {shard, INDEX})
    if op == "dtype":
        entry["dtype"] = rng.choice(["BF16", "F32", "F8_E4M3", "F8_E8M0", "I8", "F16", "F8_E5M2", "bf16", 7, None,
                                     ["BF16"]])
    elif op == "shape":
        s = list(entry["shape"])
        k = rng.randrange(len(s))
        entry["shape"] = rng.choice([s + [1], [1] + s, s[:-1], s[:k] + [s[k] + 1] + s[k + 1:],
                                     s[:k] + [s[k] - 1] + s[k + 1:], s[:k] + [rng.choice(BAD_VALUES)] + s[k + 1:],
                                     rng.choice(BAD_VALUES), s[::-1]])
    elif op == "offsets":
        a, b = entry["data_offsets"]
        entry["data_offsets"] = rng.choice([[a + 1, b + 1], [a, b + 1], [b, a], [a - 1, b - 1], [True, b], [a],
                                            [a, b, b], [a, 2**70], [float(a), b], rng.choice(BAD_VALUES)])
    elif op == "delete":
        del header[name]
    elif op == "rename":
        other = rng.choice(tensor_names(d / rng.choice(SHARDS)))
        new = rng.choice([name + "x", "layers.0.attn.ghost.weight", other])
        header[new] = header.pop(name)
        case.extra_names = {new}
    elif op == "entry_key":
        entry["extra"] = 1
    elif op == "entry_value":
        header[name] = rng.choice(BAD_VALUES)
    elif op == "metadata":
        header["__metadata__"] = rng.choice([{"format": 5}, [], None, "pt", {"format": "pt", "other": "x"},
                                             {"format": [[[]]]}])
        case.noop = header["__metadata__"] == {"format": "pt", "other": "x"}
    elif op == "reorder":
        items = list(header.items())
        rng.shuffle(items)
        text = json.dumps(dict(items), indent=rng.choice([None, 1, 4])).encode()
        write_shard(path, text, data)
        return Case(case.what, case.files, noop=True)
    if op in ("dtype", "shape", "offsets", "delete", "rename", "entry_key", "entry_value", "metadata"):
        write_shard(path, json.dumps(header, separators=(",", ":")).encode(), data)
        return case
    if op == "duplicate":
        dup = rng.choice([name, "__metadata__"])
        raw = raw.replace(b"{", b'{"%s":%s,' % (dup.encode(), json.dumps(header[dup]).encode()), 1)
        write_shard(path, raw.rstrip(), data)
    elif op == "length":
        n = len(raw)
        fake = rng.choice([n + 8, n - 1, 0, 2**63, n + len(data) + 1, 100_000_001])
        path.write_bytes(fake.to_bytes(8, "little") + raw + data)
    elif op == "truncate":
        write_shard(path, raw.rstrip()[: rng.randrange(1, len(raw.rstrip()))], data)
    elif op == "flip":
        at = rng.randrange(len(raw.rstrip()))
        write_shard(path, raw[:at] + bytes([rng.randrange(256)]) + raw[at + 1:], data, pad=False)
    elif op == "not_object":
        write_shard(path, rng.choice([b"[]", b"null", b"5", b'"x"', b"[" * 50_000 + b"]" * 50_000]), data)
    elif op == "bom":
        write_shard(path, b"\xef\xbb\xbf" + raw.rstrip(), data)
    return case


# ---- index mutations -----------------------------------------------------------------------------

def _index(d: Path, rng: random.Random, elsewhere: Path) -> Case:
    path = d / INDEX
    text = path.read_text()
    index = json.loads(text)
    wm = index["weight_map"]
    name = rng.choice(sorted(wm))
    shard = wm[name]
    op = rng.choice(["absolute", "dotdot", "symlink_out", "symlink_in", "dot_slash", "missing", "special",
                     "fifo", "subdir", "entry_type", "map_type", "metadata", "total", "drop", "ghost", "move",
                     "duplicate", "unknown", "encoding", "truncate", "reorder", "bom"])
    case = Case(f"index {op} {name}", {INDEX, *SHARDS})
    every = rng.random() < 0.5        # remap every tensor of the shard, or only `name`
    targets = [n for n, s in wm.items() if s == shard] if every else [name]
    if op == "absolute":
        for n in targets:
            wm[n] = str(rng.choice([elsewhere / shard, Path("/dev/zero"), Path("/etc/hostname")]))
    elif op == "dotdot":
        for n in targets:
            wm[n] = f"../{elsewhere.name}/{shard}"
    elif op == "symlink_out":
        (d / shard).unlink()
        os.symlink(rng.choice([elsewhere / shard, Path("/dev/zero"), elsewhere]), d / shard)
    elif op == "symlink_in":                           # an alias inside the folder: allowed
        os.symlink(shard, d / "alias.safetensors")
        for n in targets:
            wm[n] = "alias.safetensors"
        case.noop = every
    elif op == "dot_slash":
        for n in targets:
            wm[n] = f"./{shard}"
        case.noop = True
    elif op == "missing":
        for n in targets:
            wm[n] = rng.choice(["nothing.safetensors", "", ".", "..", "config.json", d.name])
        case.files.add("config.json")         # read as a shard, refused naming it
    elif op == "special":
        for n in targets:
            wm[n] = "engram_token_map.json"
        case.files.add("engram_token_map.json")
    elif op == "fifo":
        os.mkfifo(d / "pipe.safetensors")
        for n in targets:
            wm[n] = "pipe.safetensors"
    elif op == "subdir":
        (d / "sub").mkdir()
        for n in targets:
            wm[n] = "sub"
    elif op == "entry_type":
        wm[name] = rng.choice(BAD_VALUES)
    elif op == "map_type":
        index["weight_map"] = rng.choice([list(wm), "x", None, 5, [[name, shard]]])
    elif op == "metadata":
        index["metadata"] = rng.choice([[], "x", None, 5, {}, {"total_size": None}, {"other": 1,
                                        "total_size": index["metadata"]["total_size"]}])
        case.noop = isinstance(index["metadata"], dict)
    elif op == "total":
        t = index["metadata"]["total_size"]
        index["metadata"]["total_size"] = rng.choice([t + 1, t - 1, str(t), float(t), True, -t, 2**70])
    elif op == "drop":
        del wm[name]
    elif op == "ghost":
        wm["layers.0.attn.ghost.weight"] = shard
        case.extra_names = {"layers.0.attn.ghost.weight"}
    elif op == "move":
        wm[name] = rng.choice([s for s in SHARDS if s != shard])
    elif op == "unknown":
        index[rng.choice(["shards", "format", "weight_maps"])] = 1
        case.extra_names = set(index) - {"weight_map", "metadata"}
    if op in ("duplicate", "encoding", "truncate", "reorder", "bom"):
        if op == "duplicate":
            again = rng.choice([shard, rng.choice(SHARDS)])
            text = text.replace('"weight_map": {', f'"weight_map": {{"{name}": "{again}",', 1)
            path.write_text(text)
        elif op == "encoding":
            path.write_bytes(text.encode(rng.choice(["utf-16", "utf-32", "utf-16-be"])))
        elif op == "truncate":
            path.write_text(text[: rng.randrange(len(text))])
        elif op == "reorder":
            items = list(wm.items())
            rng.shuffle(items)
            path.write_text(json.dumps({"weight_map": dict(items), "metadata": index["metadata"]},
                                       indent=rng.choice([None, 2])))
            case.noop = True
        else:
            path.write_bytes(b"\xef\xbb\xbf" + text.encode())
            case.noop = True
        return case
    path.write_text(json.dumps(index))
    return case


# ---- config mutations ----------------------------------------------------------------------------

def _config(d: Path, rng: random.Random, config: dict) -> Case:
    path = d / "config.json"
    raw = json.loads(json.dumps(config))
    text = raw["text_config"]
    op = rng.choice(["value"] * 6 + ["element", "delete", "unknown", "duplicate", "root_value", "rope",
                                     "file", "reorder", "same_value"])
    key = rng.choice(sorted(text))
    case = Case(f"config {op} {key}", {"config.json", INDEX, *SHARDS})
    v = text[key]
    if op == "value":
        near = [v + 1, v - 1, v * 2, -v] if isinstance(v, (int, float)) and not isinstance(v, bool) else []
        text[key] = rng.choice(BAD_VALUES + near)
        case.what += f" = {text[key]!r:.40}"
    elif op == "element" and isinstance(v, list) and v:
        k = rng.randrange(len(v))
        v[k] = rng.choice(BAD_VALUES + [v[k] + 1, v[k] - 1])
        case.what += f"[{k}] = {v[k]!r:.40}"
    elif op == "delete":
        del text[key]
    elif op == "unknown":
        new = rng.choice(["hidden_sizes", "mscale", "n_experts"])
        text[new] = 1
        case.extra_names = {new}
    elif op == "root_value":
        rk = rng.choice(sorted(raw))
        raw[rk] = rng.choice(BAD_VALUES)
        case.what = f"config root {rk} = {raw[rk]!r:.40}"
    elif op == "rope":
        rs = text["rope_scaling"]
        rk = rng.choice(sorted(rs) + ["mscale"])
        rs[rk] = rng.choice(BAD_VALUES)
        case.extra_names = {f"rope_scaling.{rk}"}
        case.what = f"config rope_scaling.{rk} = {rs[rk]!r:.40}"
    elif op == "same_value":              # a float field as an equal integer, or an equal float
        fk = rng.choice(["rope_theta", "compress_rope_theta", "routed_scaling_factor", "swiglu_limit"])
        text[fk] = int(text[fk]) if float(text[fk]).is_integer() else text[fk]
        case.noop = True
    elif op == "reorder":
        items = list(text.items())
        rng.shuffle(items)
        raw["text_config"] = dict(items)
        case.noop = True
    if op == "duplicate":
        again = rng.choice([v, rng.choice(BAD_VALUES)])
        body = json.dumps(raw)
        path.write_text(body.replace('"text_config": {', f'"text_config": {{"{key}": {json.dumps(again)}, ', 1))
    elif op == "file":
        body = json.dumps(raw).encode()
        kind = rng.choice(["truncate", "empty", "bom", "utf16", "dir", "deep", "bigint", "inf_literal"])
        case.what = f"config file {kind}"
        case.noop = kind == "bom"
        if kind == "dir":
            path.unlink()
            path.mkdir()
        else:
            path.write_bytes({"truncate": body[: rng.randrange(len(body))], "empty": b"",
                              "bom": b"\xef\xbb\xbf" + body, "utf16": body.decode().encode("utf-16"),
                              "deep": b"[" * 100_000 + b"]" * 100_000,
                              "bigint": body.replace(b'"vocab_size": 512', b'"vocab_size": ' + b"9" * 5000),
                              "inf_literal": body.replace(b'"rms_norm_eps": 1e-20', b'"rms_norm_eps": 1e999')}[kind])
    else:
        path.write_text(json.dumps(raw, indent=rng.choice([None, 1])))
    return case


# ---- data mutations ------------------------------------------------------------------------------

def _data(d: Path, rng: random.Random) -> Case:
    shard = rng.choice(SHARDS)
    path = d / shard
    name = rng.choice(tensor_names(path))
    info = tensor_info(path, name)
    nbytes = info["data_offsets"][1] - info["data_offsets"][0]
    dtype = info["dtype"]
    stem = name.rsplit(".", 1)[0]
    siblings = {name, f"{stem}.weight", f"{stem}.scale"}
    case = Case(f"data {dtype} {name}", set(SHARDS), siblings)
    op = rng.choice(["special", "special", "flip", "same", "truncate", "append"])
    at = rng.randrange(nbytes)
    if op == "special":
        size = DTYPES[dtype].itemsize
        at -= at % size
        value = {"BF16": lambda: element_bytes(dtype, rng.choice([math.nan, math.inf, -math.inf])),
                 "F32": lambda: element_bytes(dtype, rng.choice([math.nan, math.inf, -math.inf])),
                 "F8_E4M3": lambda: bytes([rng.choice([0x7F, 0xFF])]),
                 "F8_E8M0": lambda: bytes([rng.choice([255, 254, 0])]),
                 "I8": lambda: bytes([rng.randrange(256)])}[dtype]()
        poke(path, name, value, at)
        case.what += f" {value.hex()} at {at}"
    elif op == "flip":
        poke(path, name, bytes([rng.randrange(256)]), at)
    elif op == "same":
        header, data = split_shard(path)
        begin = info["data_offsets"][0] + at
        poke(path, name, data[begin:begin + 1], at)
        case.noop = True
    else:
        header, data = split_shard(path)
        write_shard(path, header, data[:-rng.randrange(1, 64)] if op == "truncate" else data + b"\0" * 8,
                    pad=False)
        case.tensors = None
    return case


# ---- the run -------------------------------------------------------------------------------------

def _judge(case: Case, folder: Path, outcome, original_params, config_names) -> str | None:
    """None when the outcome is allowed, else why not."""
    if isinstance(outcome, CheckpointError):
        line = str(outcome)
        if "\n" in line or line != f"{outcome.file}: {outcome.what}: {outcome.rule}" or not outcome.rule:
            return f"not one line <file>: <what>: <rule>: {line!r}"
        if outcome.file not in {str(folder / f) for f in case.files}:
            return f"names a file the mutation does not concern: {line}"
        what = outcome.what
        if outcome.file == str(folder / "config.json"):
            ok = what in config_names | case.extra_names | PARTS   # PARTS: config.json named as a shard
            return None if ok else f"names no config field: {line}"
        if what in PARTS or what in case.extra_names:
            return None
        if TENSOR_NAME.match(what) and (case.tensors is None or what in case.tensors):
            return None
        return f"names neither the tensor nor a part of the file: {line}"
    if isinstance(outcome, BaseException):
        return f"{type(outcome).__name__}: {outcome}"
    if case.noop and not params_equal(outcome, original_params):
        return "a no-op mutation loaded different params"
    return None


def test_open_audit_sees_loads_and_outside_reads(original, tmp_path):
    """The fuzz's outside-read check can fail: the hook records the shards a load maps and a read
    of a file outside the folder."""
    folder0, _, elsewhere, _ = original
    with files_opened() as opened:
        load_params(folder0, progress=False)
        (elsewhere / "config.json").read_bytes()
    assert {str(folder0 / s) for s in SHARDS} <= set(opened)
    assert outside(opened, folder0) == [str(elsewhere / "config.json")]


def test_fuzz_loader_refuses_or_loads(original, tmp_path):
    folder0, params0, elsewhere, config = original
    rng = random.Random(SEED)
    plan = [family for family, n in CASES.items() for _ in range(n)]
    rng.shuffle(plan)
    failures, tally, slowest = [], Counter(), 0.0
    config_names = _config_names(config)
    start_all = time.perf_counter()
    for k, family in enumerate(plan):
        d = copy_checkpoint(folder0, tmp_path / f"case{k}")
        case = {"header": lambda: _header(d, rng), "index": lambda: _index(d, rng, elsewhere),
                "config": lambda: _config(d, rng, config), "data": lambda: _data(d, rng)}[family]()
        start = time.perf_counter()
        with files_opened() as opened:
            try:
                outcome = load_params(d, progress=False, verify=True)[1]
            except Exception as err:  # noqa: BLE001 - any other type is a finding, reported below
                outcome = err
        took = time.perf_counter() - start
        slowest = max(slowest, took)
        why = _judge(case, d, outcome, params0, config_names)
        stray = outside(opened, d)
        if why or stray or took > CASE_LIMIT_S:
            failures.append(f"case {k} ({case.what}): {why or ''} {'opened ' + str(stray) if stray else ''} "
                            f"{took:.1f} s")
        tally[(family, "refused" if isinstance(outcome, BaseException) else
               "loaded equal" if case.noop else "loaded")] += 1
        shutil.rmtree(d)
    print(f"\nfuzz: {len(plan)} cases in {time.perf_counter() - start_all:.1f} s, slowest {slowest:.2f} s; "
          f"{dict(sorted(tally.items()))}")
    assert not failures, "\n".join(failures)
    # the fuzz reaches both outcomes in every family
    for family in CASES:
        assert tally[(family, "refused")] > 0, family
    assert sum(v for (f, o), v in tally.items() if o != "refused") > 0
