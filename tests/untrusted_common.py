"""Helpers of the untrusted-file tests (tests/test_untrusted_files.py, tests/test_untrusted_fuzz.py):
a tiny 3-shard checkpoint to copy and mutate, raw header / index / config edits, the refusal format
check, params equality, and an audit of every file a load opens (docs/MODEL.md §2.3)."""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import sys
from contextlib import contextmanager
from pathlib import Path

import jax
import numpy as np

from scripts.make_checkpoint import make_checkpoint
from tests.engine_common import SUITE_CACHE
from v41_jax.checkpoint.load import ENGRAM_KEY
from v41_jax.checkpoint.safetensors_io import DTYPES, INDEX_NAME
from v41_jax.config import CheckpointError

ROOT = Path(__file__).resolve().parents[1]
TINY_CONFIG = ROOT / "v41_jax" / "configs" / "tiny.config.json"
SHARDS = [f"model-0000{k}-of-00003.safetensors" for k in (1, 2, 3)]
# the parts of a file a refusal may name instead of a tensor or a field
PARTS = {"file", "folder", "index", "header", "header length", "data", "__metadata__", "weight_map",
         "metadata", "metadata.total_size", "config", "text_config"}
TENSOR_NAME = re.compile(r"^[A-Za-z_][\w]*(\.[\w]+)+$")


def build_tiny(folder: Path) -> Path:
    """The tiny config's random checkpoint in 3 shards (seed 0)."""
    make_checkpoint(str(TINY_CONFIG), str(folder), seed=0, shards=3)
    return folder


def copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    for p in dst.iterdir():
        p.chmod(0o644)
    return dst


# ---- raw edits -----------------------------------------------------------------------------------

def split_shard(path: Path) -> tuple[bytes, bytes]:
    """(header JSON bytes, data bytes) of a shard."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return raw[8:8 + n], raw[8 + n:]


def write_shard(path: Path, header: bytes, data: bytes, pad: bool = True) -> None:
    if pad:
        header += b" " * (-(8 + len(header)) % 8)
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)


def edit_json(path: Path, fn) -> None:
    obj = json.loads(path.read_text())
    fn(obj)
    path.write_text(json.dumps(obj, indent=1))


def tensor_names(path: Path) -> list[str]:
    header, _ = split_shard(path)
    return sorted(k for k in json.loads(header) if k != "__metadata__")


def poke(path: Path, name: str, values: bytes, at: int = 0) -> None:
    """Overwrite bytes of tensor `name`'s data in place, `at` bytes into it."""
    header, _ = split_shard(path)
    begin = 8 + len(header) + json.loads(header)[name]["data_offsets"][0] + at
    with open(path, "r+b") as f:
        f.seek(begin)
        f.write(values)


def tensor_info(path: Path, name: str) -> dict:
    header, _ = split_shard(path)
    return json.loads(header)[name]


def element_bytes(dtype: str, value: float) -> bytes:
    return np.asarray([value], dtype=DTYPES[dtype]).tobytes()


# ---- checks --------------------------------------------------------------------------------------

def check_refusal(err: BaseException, files, whats=None) -> None:
    """The project's error, one line `<file>: <what>: <rule>`, file among `files`, and `what` among
    `whats` (when given) or a tensor name or a part of a file."""
    assert isinstance(err, CheckpointError), f"{type(err).__name__}: {err}"
    line = str(err)
    assert "\n" not in line and line == f"{err.file}: {err.what}: {err.rule}" and err.rule, line
    assert err.file in {str(f) for f in files}, line
    if whats is not None:
        assert err.what in whats, line
    else:
        assert err.what in PARTS or TENSOR_NAME.match(err.what), line


def params_equal(a: dict, b: dict) -> bool:
    """Equal params: every device leaf bit-equal, and the Engram tables' bytes (their file paths
    differ between two copies of one checkpoint)."""
    a, b = dict(a), dict(b)
    ta, tb = a.pop(ENGRAM_KEY), b.pop(ENGRAM_KEY)
    la, da = jax.tree.flatten(a)
    lb, db = jax.tree.flatten(b)
    if da != db or len(la) != len(lb):
        return False
    if not all(np.array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))
               and np.asarray(x).dtype == np.asarray(y).dtype for x, y in zip(la, lb)):
        return False
    return all(np.array_equal(np.asarray(getattr(ta, k)[l]).view(np.uint8),
                              np.asarray(getattr(tb, k)[l]).view(np.uint8))
               for k in ("weight", "scale") for l in ta.weight) and set(ta.weight) == set(tb.weight)


# ---- opened files --------------------------------------------------------------------------------

_OPENED: list[str] | None = None   # recording while a `files_opened` block runs


def _audit(event: str, args) -> None:
    if _OPENED is not None and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        _OPENED.append(os.fsdecode(args[0]))


sys.addaudithook(_audit)   # audit hooks cannot be removed: it records only inside `files_opened`


@contextmanager
def files_opened():
    """Every path opened (builtins.open, os.open, np.memmap's open) inside the block."""
    global _OPENED
    _OPENED = opened = []
    try:
        yield opened
    finally:
        _OPENED = None


def outside(opened: list[str], folder: Path) -> list[str]:
    """The opened paths that are not inside `folder` once symlinks are resolved, leaving out jax's
    persistent compilation cache: the engine's own files, where the loader's small jitted checks
    look up their executables (a clean clone's first run reads and writes them there). Both the
    configured folder and the suite's: jax keeps the folder its cache started with, so after a test
    in this process points the config elsewhere (`compile_cache.enable`), reads still go there."""
    cache = jax.config.jax_compilation_cache_dir
    allowed = [os.path.realpath(folder), os.path.realpath(SUITE_CACHE)] + ([os.path.realpath(cache)] if cache else [])
    return [p for p in opened
            if not any(os.path.commonpath([a, os.path.realpath(p)]) == a for a in allowed)]


def index_path(folder: Path) -> Path:
    return folder / INDEX_NAME
