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

Checkpoints are untrusted input (docs/MODEL.md §2.3). Every inconsistency raises CheckpointError
(a ValueError) as one line `<file>: <tensor or part>: <rule>`. Every file read is a regular file
inside the checkpoint folder once symlinks are resolved (`inside`); JSON is strict (`parse_json`:
UTF-8, no key twice, so neither a header nor the index can list a tensor twice); sizes read
before parsing are bounded.
"""

from __future__ import annotations

import json
import math
import os
import stat
import struct
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import ml_dtypes
import numpy as np

from ..config import CheckpointError, parse_json, read_json

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
# The safetensors library refuses a header over 100 MB (its MAX_HEADER_SIZE); so does this reader,
# before reading it. The index lists no more than the headers hold: the same bound serves it.
MAX_HEADER_BYTES = 100_000_000
MAX_DIMS = 64            # numpy's most axes


def inside(folder: str, name: Any, source: str, what: str) -> str:
    """The path of file `name` in the checkpoint `folder`, refused (naming `source`, the file that
    named it, and `what`) unless it is a relative path that stays inside the folder once `..` and
    symlinks are resolved, and a regular file. Nothing outside the folder is opened: a shard name
    in a downloaded index could otherwise read any file of the machine."""
    if not isinstance(name, str) or not name or "\0" in name:
        raise CheckpointError(source, what, f"file name must be a non-empty string, got {name!r:.80}")
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:   # a lone surrogate, written as a JSON escape: no file has that name
        raise CheckpointError(source, what, f"file name {name!r:.80} is not valid Unicode (a lone surrogate)") from None
    if os.path.isabs(name):
        raise CheckpointError(source, what, f"file {name!r} is an absolute path; it must be inside "
                                            f"the checkpoint folder")
    path = os.path.join(folder, name)
    real_folder = os.path.realpath(folder)
    if os.path.commonpath([real_folder, os.path.realpath(path)]) != real_folder:
        raise CheckpointError(source, what, f"file {name!r} resolves outside the checkpoint folder "
                                            f"{folder} (.. or a symlink)")
    if not os.path.isfile(path):
        rule = "does not exist" if not os.path.lexists(path) else "is not a regular file"
        raise CheckpointError(source, what, f"file {name!r} {rule}")
    return path


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


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class SafetensorsFile:
    """One .safetensors file: header parsed and checked at open, tensors mapped on demand."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self._mm: np.memmap | None = None
        # opened once, and every later read (the header, the data's map, a fingerprint) goes
        # through this open file: the path checked by `inside` may be replaced or truncated later
        # (a sync still writing, a folder someone else controls), and reopening it then read
        # whatever was there (a symlink's target outside the folder). Non-blocking, so a FIFO put
        # there after the check does not hang the open; it is refused as not a regular file.
        fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise CheckpointError(self.path, "file", "is not a regular file")
        self._file = f = os.fdopen(fd, "rb")
        self.size = size = st.st_size
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(self.path, "header length", f"file of {size} bytes has no "
                                                              "8-byte header length")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES:
            raise CheckpointError(self.path, "header length", f"{n} bytes, over the "
                                                              f"{MAX_HEADER_BYTES} safetensors allows")
        if 8 + n > size:
            raise CheckpointError(self.path, "header length", f"{n} runs past the end of the "
                                                              f"file ({size} bytes)")
        raw = f.read(n)
        header = parse_json(raw, self.path, "header")
        if not isinstance(header, dict):
            raise CheckpointError(self.path, "header", "not a JSON object")
        self.metadata: dict = header.pop("__metadata__", {})
        if not (isinstance(self.metadata, dict) and all(isinstance(v, str) for v in self.metadata.values())):
            raise CheckpointError(self.path, "__metadata__", "must map strings to strings")
        self.data_start = 8 + n
        self.tensors: dict[str, TensorInfo] = {
            name: self._entry(name, entry) for name, entry in header.items()}
        self._check_layout(size - self.data_start)

    def _entry(self, name: str, entry) -> TensorInfo:
        def refuse(rule: str):
            return CheckpointError(self.path, name, rule)
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            raise refuse(f"header entry must have exactly dtype/shape/data_offsets, got {entry!r:.200}")
        dtype, shape, offs = entry["dtype"], entry["shape"], entry["data_offsets"]
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise refuse(f"unknown dtype {dtype!r:.80} (known: {sorted(DTYPES)})")
        if not (isinstance(shape, list) and all(_is_int(d) and d >= 0 for d in shape)):
            raise refuse(f"bad shape {shape!r:.200}")
        # numpy's bounds (an array of up to 64 axes, each an int64): within them the byte count
        # below has at most ~1,200 digits, so the message can print it
        if len(shape) > MAX_DIMS or any(d >= 2**63 for d in shape):
            raise refuse(f"shape of {len(shape)} axes {str(shape)[:200]}: at most {MAX_DIMS} axes, each below 2**63")
        if not (isinstance(offs, list) and len(offs) == 2 and all(_is_int(o) for o in offs)
                and 0 <= offs[0] <= offs[1]):
            raise refuse(f"bad data_offsets {offs!r:.200}")
        want = math.prod(shape) * DTYPES[dtype].itemsize
        if offs[1] - offs[0] != want:
            raise refuse(f"data_offsets {offs} span {offs[1] - offs[0]} bytes but shape {shape} x "
                         f"{dtype} needs {want}")
        return TensorInfo(name, dtype, tuple(shape), self.path,
                          self.data_start + offs[0], self.data_start + offs[1])

    def _check_layout(self, data_bytes: int) -> None:
        """Tensors must tile the data section exactly: no overlap, no gap, nothing past the end."""
        pos = self.data_start
        for t in sorted(self.tensors.values(), key=lambda t: (t.begin, t.end)):
            offsets = f"data_offsets [{t.begin - self.data_start}, {t.end - self.data_start}]"
            if t.begin < pos:
                raise CheckpointError(self.path, t.name, f"{offsets} overlap the previous tensor")
            if t.begin > pos:
                raise CheckpointError(self.path, t.name, f"gap of {t.begin - pos} bytes before this "
                                                         "tensor's data")
            if t.end - self.data_start > data_bytes:
                raise CheckpointError(self.path, t.name, f"data ends at byte {t.end - self.data_start} "
                                                         f"but the file holds {data_bytes} data bytes: "
                                                         "truncated shard")
            pos = t.end
        if pos - self.data_start != data_bytes:
            raise CheckpointError(self.path, "data", f"{data_bytes - (pos - self.data_start)} "
                                                     "trailing bytes after the last tensor")

    def header_bytes(self) -> bytes:
        """The header as checked at open (its length prefix included), read from the open file."""
        if self._mm is not None:
            return bytes(self._mm[:self.data_start])
        return os.pread(self._file.fileno(), self.data_start, 0)

    def get(self, name: str) -> np.ndarray:
        """Zero-copy read-only view of one tensor (dtype from DTYPES)."""
        t = self.tensors.get(name)
        if t is None:
            raise CheckpointError(self.path, name, "not in this file")
        if self._mm is None:
            # a map past a truncated file's end faults the process (SIGBUS) when read
            if os.fstat(self._file.fileno()).st_size != self.size:
                raise CheckpointError(self.path, name, f"the file is no longer the {self.size} bytes it was when "
                                                       "opened (rewritten or truncated since)")
            self._mm = np.memmap(self._file, dtype=np.uint8, mode="r")
            self._file.close()                # the map holds its own descriptor of the same file
        return self._mm[t.begin:t.end].view(DTYPES[t.dtype]).reshape(t.shape)


class Checkpoint:
    """A checkpoint directory: the index (or a lone model.safetensors) and its shards."""

    def __init__(self, ckpt_dir: str | os.PathLike):
        self.dir = os.fspath(ckpt_dir)
        self.files: dict[str, SafetensorsFile] = {}
        self.tensors: dict[str, TensorInfo] = {}
        if os.path.lexists(os.path.join(self.dir, INDEX_NAME)):
            self.source = inside(self.dir, INDEX_NAME, self.dir, "index")
            self._open_index(self.source)
        elif os.path.lexists(os.path.join(self.dir, SINGLE_NAME)):
            self.source = inside(self.dir, SINGLE_NAME, self.dir, "shard")
            self.files[SINGLE_NAME] = SafetensorsFile(self.source)
            self.tensors = dict(self.files[SINGLE_NAME].tensors)
        else:
            raise CheckpointError(self.dir, "folder", f"neither {INDEX_NAME} nor {SINGLE_NAME} found")
        self._by_path = {f.path: f for f in self.files.values()}

    def _open_index(self, index_path: str) -> None:
        weight_map, total = _read_index(index_path)
        for name, shard in sorted(weight_map.items()):
            if shard not in self.files:
                self.files[shard] = SafetensorsFile(inside(self.dir, shard, index_path, name))
            info = self.files[shard].tensors.get(name)
            if info is None:
                raise CheckpointError(self.files[shard].path, name, f"listed in {INDEX_NAME} but "
                                                                    "absent from the shard")
            self.tensors[name] = info
        for shard, f in self.files.items():
            for name in f.tensors:
                if weight_map.get(name) != shard:
                    where = (f"is mapped to {weight_map[name]!r}: a tensor stored in two shards"
                             if name in weight_map else "maps it nowhere")
                    raise CheckpointError(f.path, name, f"present in the shard but {INDEX_NAME} {where}")
        actual = sum(t.nbytes for t in self.tensors.values())
        if total is not None and total != actual:
            raise CheckpointError(index_path, "metadata.total_size", f"{total} != {actual} bytes of "
                                                                     "tensor data")

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def names(self) -> list[str]:
        return sorted(self.tensors)

    def info(self, name: str) -> TensorInfo:
        t = self.tensors.get(name)
        if t is None:
            raise CheckpointError(self.source, name, "not in the checkpoint")
        return t

    def get(self, name: str) -> np.ndarray:
        """Zero-copy read-only view of one tensor; only its own shard pages are touched."""
        return self._by_path[self.info(name).path].get(name)

    def get_prefix(self, prefix: str) -> dict[str, np.ndarray]:
        """Every tensor whose name starts with `prefix`, e.g. one layer ("layers.3.") or one expert
        ("layers.3.ffn.experts.7."), as zero-copy views; no other tensor is read."""
        return {n: self.get(n) for n in self.names() if n.startswith(prefix)}


def _read_index(path: str) -> tuple[dict[str, str], int | None]:
    """The index's weight_map (tensor -> shard file name) and metadata.total_size (None if absent);
    every other key is refused."""
    index = read_json(path, MAX_HEADER_BYTES)
    if not isinstance(index, dict):
        raise CheckpointError(path, "file", "the index must be a JSON object")
    for key in index:
        if key not in ("weight_map", "metadata"):
            raise CheckpointError(path, key, "unknown index key (known: metadata, weight_map)")
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict):
        raise CheckpointError(path, "weight_map", f"must be an object of tensor -> shard file, got "
                                                  f"{type(weight_map).__name__}")
    for name, shard in weight_map.items():
        if not isinstance(shard, str):
            raise CheckpointError(path, name, f"shard file must be a string, got {shard!r:.80}")
        # one file, one name: "./a.safetensors" and "a.safetensors" are the same shard
        weight_map[name] = os.path.normpath(shard) if shard else shard
    metadata = index.get("metadata", {})
    if not isinstance(metadata, dict):
        raise CheckpointError(path, "metadata", f"must be an object, got {type(metadata).__name__}")
    total = metadata.get("total_size")
    if total is not None and not (_is_int(total) and total >= 0):
        raise CheckpointError(path, "metadata.total_size", f"must be a byte count, got {total!r:.80}")
    return weight_map, total


# ---- writer ------------------------------------------------------------------------------------

def dtype_name(arr: np.ndarray) -> str:
    try:
        return _DTYPE_NAMES[arr.dtype]
    except KeyError:
        raise CheckpointError(None, f"dtype {arr.dtype}", f"has no safetensors name here (known: "
                                                          f"{sorted(DTYPES)})") from None


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
