"""Safetensors reader and writer for the published checkpoint layout (own parser, numpy memmap).

File layout: an 8-byte little-endian header length n, a JSON header
`{"__metadata__": {...}, name: {"dtype", "shape", "data_offsets": [start, end]}}` padded with spaces,
then the raw little-endian bytes; offsets are relative to the end of the header. The safetensors
package cannot hand fp8 to numpy, so this module parses the header itself and returns zero-copy
numpy views of a read-only memmap typed with ml_dtypes (float8_e4m3fn, float8_e8m0fnu, bfloat16).

A checkpoint directory holds `model.safetensors.index.json` (`weight_map` name -> shard file,
`metadata.total_size`) plus its shards, or a lone `model.safetensors`. Opening one parses every
header and checks it; tensor bytes are only touched when a caller asks for that tensor, so one
tensor, one layer or one expert can be read without reading the rest.

Every inconsistency raises CheckpointError (a ValueError) naming the tensor and the file.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from typing import Iterable, Mapping

import ml_dtypes
import numpy as np

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"

# safetensors dtype string -> numpy dtype of the stored elements
DTYPES: dict[str, np.dtype] = {
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F32": np.dtype(np.float32),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
    "I8": np.dtype(np.int8),
}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
_ALIGN = 8  # the header is space-padded so that the data starts 8-byte aligned


class CheckpointError(ValueError):
    """A checkpoint file or tensor is malformed or does not match the expected schema."""


def _err(path: str, name: str | None, msg: str) -> CheckpointError:
    where = f"tensor {name!r} in {path}" if name is not None else path
    return CheckpointError(f"{where}: {msg}")


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str                  # safetensors dtype string
    shape: tuple[int, ...]
    path: str                   # the shard holding it
    begin: int                  # absolute byte offsets in that file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


class SafetensorsFile:
    """One .safetensors file: header parsed and checked at open, tensors mapped on demand."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self._mm: np.memmap | None = None
        size = os.path.getsize(self.path)
        with open(self.path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise _err(self.path, None, f"file of {size} bytes has no 8-byte header length")
            (n,) = struct.unpack("<Q", head)
            if 8 + n > size:
                raise _err(self.path, None, f"header length {n} runs past the end of the file ({size} bytes)")
            raw = f.read(n)
        try:
            header = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise _err(self.path, None, f"header is not valid JSON: {e}") from e
        if not isinstance(header, dict):
            raise _err(self.path, None, "header is not a JSON object")
        self.metadata: dict = header.pop("__metadata__", None) or {}
        self.data_start = 8 + n
        self.tensors: dict[str, TensorInfo] = {
            name: self._entry(name, entry) for name, entry in header.items()}
        self._check_layout(size - self.data_start)

    def _entry(self, name: str, entry) -> TensorInfo:
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            raise _err(self.path, name, f"header entry must have exactly dtype/shape/data_offsets, got {entry!r}")
        dtype, shape, offs = entry["dtype"], entry["shape"], entry["data_offsets"]
        if dtype not in DTYPES:
            raise _err(self.path, name, f"unknown dtype {dtype!r} (known: {sorted(DTYPES)})")
        if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
            raise _err(self.path, name, f"bad shape {shape!r}")
        if not (isinstance(offs, list) and len(offs) == 2 and all(isinstance(o, int) for o in offs)
                and 0 <= offs[0] <= offs[1]):
            raise _err(self.path, name, f"bad data_offsets {offs!r}")
        want = math.prod(shape) * DTYPES[dtype].itemsize
        if offs[1] - offs[0] != want:
            raise _err(self.path, name, f"data_offsets {offs} span {offs[1] - offs[0]} bytes but "
                                        f"shape {shape} x {dtype} needs {want}")
        return TensorInfo(name, dtype, tuple(shape), self.path,
                          self.data_start + offs[0], self.data_start + offs[1])

    def _check_layout(self, data_bytes: int) -> None:
        """Tensors must tile the data section exactly: no overlap, no gap, nothing past the end."""
        pos = self.data_start
        for t in sorted(self.tensors.values(), key=lambda t: (t.begin, t.end)):
            if t.begin < pos:
                raise _err(self.path, t.name, f"data_offsets [{t.begin - self.data_start}, "
                                              f"{t.end - self.data_start}] overlap the previous tensor")
            if t.begin > pos:
                raise _err(self.path, t.name, f"gap of {t.begin - pos} bytes before this tensor's data")
            if t.end - self.data_start > data_bytes:
                raise _err(self.path, t.name, f"data ends at byte {t.end - self.data_start} but the file "
                                              f"holds {data_bytes} data bytes: truncated shard")
            pos = t.end
        if pos - self.data_start != data_bytes:
            raise _err(self.path, None, f"{data_bytes - (pos - self.data_start)} trailing bytes after the last tensor")

    def get(self, name: str) -> np.ndarray:
        """Zero-copy read-only view of one tensor (dtype from DTYPES)."""
        t = self.tensors.get(name)
        if t is None:
            raise _err(self.path, name, "not in this file")
        if self._mm is None:
            self._mm = np.memmap(self.path, dtype=np.uint8, mode="r")
        return self._mm[t.begin:t.end].view(DTYPES[t.dtype]).reshape(t.shape)


class Checkpoint:
    """A checkpoint directory: the index (or a lone model.safetensors) and its shards."""

    def __init__(self, ckpt_dir: str | os.PathLike):
        self.dir = os.fspath(ckpt_dir)
        index_path = os.path.join(self.dir, INDEX_NAME)
        self.files: dict[str, SafetensorsFile] = {}
        self.tensors: dict[str, TensorInfo] = {}
        if os.path.exists(index_path):
            self.source = index_path
            self._open_index(index_path)
        else:
            single = os.path.join(self.dir, SINGLE_NAME)
            if not os.path.exists(single):
                raise CheckpointError(f"{self.dir}: neither {INDEX_NAME} nor {SINGLE_NAME} found")
            self.source = single
            self.files[SINGLE_NAME] = SafetensorsFile(single)
            self.tensors = dict(self.files[SINGLE_NAME].tensors)
        self._by_path = {f.path: f for f in self.files.values()}

    def _open_index(self, index_path: str) -> None:
        try:
            with open(index_path) as f:
                index = json.load(f)
            weight_map: dict[str, str] = index["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise _err(index_path, None, f"unreadable index: {e!r}") from e
        for name, shard in sorted(weight_map.items()):
            if shard not in self.files:
                path = os.path.join(self.dir, shard)
                if not os.path.isfile(path):
                    raise _err(index_path, name, f"index points at shard {shard!r}, which does not exist")
                self.files[shard] = SafetensorsFile(path)
            info = self.files[shard].tensors.get(name)
            if info is None:
                raise _err(os.path.join(self.dir, shard), name, f"listed in {INDEX_NAME} but absent from the shard")
            self.tensors[name] = info
        for shard, f in self.files.items():
            for name in f.tensors:
                if weight_map.get(name) != shard:
                    raise _err(f.path, name, f"present in the shard but {INDEX_NAME} maps it "
                                             f"{'to ' + repr(weight_map[name]) if name in weight_map else 'nowhere'}")
        total = index.get("metadata", {}).get("total_size")
        actual = sum(t.nbytes for t in self.tensors.values())
        if total is not None and total != actual:
            raise _err(index_path, None, f"metadata.total_size {total} != {actual} bytes of tensor data")

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def names(self) -> list[str]:
        return sorted(self.tensors)

    def info(self, name: str) -> TensorInfo:
        t = self.tensors.get(name)
        if t is None:
            raise CheckpointError(f"tensor {name!r} in {self.dir}: not in the checkpoint")
        return t

    def get(self, name: str) -> np.ndarray:
        """Zero-copy read-only view of one tensor; only its own shard pages are touched."""
        return self._by_path[self.info(name).path].get(name)

    def get_prefix(self, prefix: str) -> dict[str, np.ndarray]:
        """Every tensor whose name starts with `prefix`, e.g. one layer ("layers.3.") or one expert
        ("layers.3.ffn.experts.7."), as zero-copy views; no other tensor is read."""
        return {n: self.get(n) for n in self.names() if n.startswith(prefix)}


# ---- writer ------------------------------------------------------------------------------------

def dtype_name(arr: np.ndarray) -> str:
    try:
        return _DTYPE_NAMES[arr.dtype]
    except KeyError:
        raise CheckpointError(f"dtype {arr.dtype} has no safetensors name here (known: {sorted(DTYPES)})") from None


def write_safetensors(path: str | os.PathLike, tensors: Mapping[str, np.ndarray],
                      metadata: Mapping[str, str] | None = None) -> int:
    """Write one file in the published layout: compact JSON header with `__metadata__` first and
    names sorted, space-padded to 8 bytes; data contiguous in name order. Returns the data bytes."""
    names = sorted(tensors)
    header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
    pos = 0
    for name in names:
        arr = tensors[name]
        header[name] = {"dtype": dtype_name(arr), "shape": list(arr.shape),
                        "data_offsets": [pos, pos + arr.nbytes]}
        pos += arr.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % _ALIGN)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name in names:
            f.write(np.ascontiguousarray(tensors[name]).tobytes())
    return pos


def shard_names(names: Iterable[str], sizes: Mapping[str, int], n_shards: int) -> list[list[str]]:
    """Split sorted names into n_shards contiguous, non-empty runs of roughly equal bytes."""
    names = sorted(names)
    if not 1 <= n_shards <= len(names):
        raise ValueError(f"shards: need 1 <= n <= {len(names)} (the tensor count), got {n_shards}")
    total = sum(sizes[n] for n in names)
    out: list[list[str]] = [[]]
    acc = 0
    for i, name in enumerate(names):
        shards_left = n_shards - len(out)
        full = acc * n_shards >= total * len(out)
        if out[-1] and shards_left and (full or len(names) - i == shards_left):
            out.append([])
        out[-1].append(name)
        acc += sizes[name]
    return out


def write_checkpoint(ckpt_dir: str | os.PathLike, tensors: Mapping[str, np.ndarray], n_shards: int = 1) -> None:
    """Write shards plus `model.safetensors.index.json` (weight_map, metadata.total_size).

    One shard is named `model.safetensors` (as the official fixtures); several follow the HF
    `model-0000k-of-0000N.safetensors` convention."""
    ckpt_dir = os.fspath(ckpt_dir)
    os.makedirs(ckpt_dir, exist_ok=True)
    groups = shard_names(tensors, {k: v.nbytes for k, v in tensors.items()}, n_shards)
    weight_map: dict[str, str] = {}
    total = 0
    for k, group in enumerate(groups):
        fname = SINGLE_NAME if n_shards == 1 else f"model-{k + 1:05d}-of-{n_shards:05d}.safetensors"
        total += write_safetensors(os.path.join(ckpt_dir, fname), {n: tensors[n] for n in group})
        weight_map.update({n: fname for n in group})
    with open(os.path.join(ckpt_dir, INDEX_NAME), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=1)
