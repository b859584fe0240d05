"""Orbax cache of converted params, so a second start skips reading and dequantizing the shards.

    cfg, params = load_params_cached(ckpt_dir, cache_dir, experts="auto")

The first call runs `load_params` and saves the device params (everything but the host Engram
tables) with orbax into `cache_dir/params`, next to `cache_dir/source.json`, which records a
fingerprint of the source checkpoint (config.json, the index and every shard's size and header)
and the config and expert format used. A later call whose fingerprint matches restores the params bit-exactly and
re-attaches the Engram tables as memmaps of the source shards; a mismatch reconverts.
With `expert_sharding` (as `load_params`; docs/PARALLEL.md §3) the routed-expert stacks are saved
as the sharded arrays they are and restored straight into their shardings, each device's block
read alone.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile

import jax
import orbax.checkpoint as ocp

from ..config import CONFIG_MAX_BYTES, ModelConfig, read_small, validate
from ..quant import Fp4Weight, Fp8BlockWeight, Fp8RowWeight
from .load import ENGRAM_KEY, EngramTables, config_path, load_params, resolve_dense, resolve_experts
from .safetensors_io import INDEX_NAME, MAX_HEADER_BYTES, Checkpoint, inside
from .schema import validate_checkpoint

_SOURCE = "source.json"
_PARAMS = "params"


def fingerprint(ckpt_dir: str | os.PathLike, cfg: ModelConfig, experts: str, dense: str) -> str:
    """sha256 over the config and the expert and dense formats used, the dtype the loader holds each tensor in,
    config.json, the index and each shard's name, size and header bytes: it changes whenever a
    tensor's name, dtype, shape or placement does, the config does, or the loader's holding does
    (a cache converted before would restore the old dtypes). Tensor bytes are not read (a shard
    rewritten in place with equal headers is not detected)."""
    ckpt_dir = os.fspath(ckpt_dir)
    validate(cfg)
    ckpt = Checkpoint(ckpt_dir)   # checks that every file it names is inside the folder
    # the schema as `load_params` builds it, bounded by the files' tensor count: a hostile size in
    # the config costs no more than the headers here either
    _, schema = validate_checkpoint(ckpt, cfg)
    h = hashlib.sha256(repr(cfg).encode() + b"\0experts=" + experts.encode() + b"\0dense=" + dense.encode())
    h.update(repr(sorted((name, spec.held) for name, spec in schema.items())).encode())
    for fname, bound in (("config.json", CONFIG_MAX_BYTES), (INDEX_NAME, MAX_HEADER_BYTES)):
        if os.path.lexists(os.path.join(ckpt_dir, fname)):
            h.update(fname.encode() + b"\0" + read_small(inside(ckpt_dir, fname, ckpt_dir, fname), bound))
    for shard in sorted(ckpt.files.values(), key=lambda f: f.path):
        h.update(os.path.basename(shard.path).encode() + b"\0" + str(shard.size).encode())
        h.update(shard.header_bytes())      # from the file opened and checked, not the path again
    return h.hexdigest()


def save_converted(cache_dir: str | os.PathLike, params: dict, source: str) -> None:
    """Save the device params (Engram tables excluded) and the source fingerprint."""
    cache_dir = os.path.abspath(os.fspath(cache_dir))
    target, stamp = os.path.join(cache_dir, _PARAMS), os.path.join(cache_dir, _SOURCE)
    os.makedirs(cache_dir, exist_ok=True)
    # the fingerprint goes first and comes back last, whole (a rename): a save cut short (killed,
    # out of disk) leaves none, so the next start converts again rather than restoring missing
    # params, or another checkpoint's under this one's fingerprint
    if os.path.lexists(stamp):
        os.remove(stamp)
    if os.path.exists(target):
        shutil.rmtree(target)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(target, {k: v for k, v in params.items() if k != ENGRAM_KEY})
        ckptr.wait_until_finished()
    with tempfile.NamedTemporaryFile("w", dir=cache_dir, prefix=_SOURCE, delete=False) as f:   # one a process
        json.dump({"fingerprint": source}, f)
    os.replace(f.name, stamp)


def restore_converted(cache_dir: str | os.PathLike, expert_sharding=None) -> dict:
    """The saved device params, as saved (structure, dtypes and values), without Engram tables;
    the routed experts in `expert_sharding(n_experts)` where it gives one (`load_params`)."""
    path = os.path.join(os.path.abspath(os.fspath(cache_dir)), _PARAMS)
    with ocp.StandardCheckpointer() as ckptr:
        target = None if expert_sharding is None else _targets(ckptr.metadata(path).item_metadata.tree,
                                                                expert_sharding)
        return _rewrap(ckptr.restore(path, target))


def _targets(meta, expert_sharding):
    """Restore targets from the saved metadata: a leaf under an `experts` node in its expert
    sharding when the stack splits, every other leaf on this process's first device (as a load)."""
    one = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])

    def walk(node, experts: bool):
        if isinstance(node, dict):
            return {k: walk(v, experts or k == "experts") for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v, experts) for v in node]
        sharding = expert_sharding(node.shape[0]) if experts else None
        return jax.ShapeDtypeStruct(node.shape, node.dtype, sharding=sharding or one)
    return walk(meta, False)


def _rewrap(node):
    """Orbax restores a pytree dataclass as the dict of its fields: give held experts their type back."""
    if isinstance(node, dict):
        for cls in (Fp4Weight, Fp8RowWeight, Fp8BlockWeight):
            if set(node) == set(cls.__dataclass_fields__):
                return cls(**node)
        return {k: _rewrap(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_rewrap(v) for v in node]
    return node


def cached_fingerprint(cache_dir: str | os.PathLike) -> str | None:
    """The fingerprint the cache's params were saved under, or None (no cache, a save cut short,
    a file that is not one: each converts again)."""
    if not os.path.isdir(os.path.join(os.fspath(cache_dir), _PARAMS)):
        return None
    try:
        with open(os.path.join(os.fspath(cache_dir), _SOURCE)) as f:
            got = json.load(f)
    except (OSError, ValueError):
        return None
    return got.get("fingerprint") if isinstance(got, dict) and isinstance(got.get("fingerprint"), str) else None


def load_params_cached(ckpt_dir: str | os.PathLike, cache_dir: str | os.PathLike,
                       cfg: ModelConfig | None = None, *, progress: bool = True,
                       experts: str = "auto", dense: str = "auto", expert_sharding=None) -> tuple[ModelConfig, dict]:
    """`load_params`, served from the orbax cache when it was made from this same checkpoint."""
    ckpt_dir = os.fspath(ckpt_dir)
    if cfg is None:
        cfg = ModelConfig.from_file(config_path(ckpt_dir))
    experts, dense = resolve_experts(experts), resolve_dense(dense)
    source = fingerprint(ckpt_dir, cfg, experts, dense)
    if cached_fingerprint(cache_dir) != source:
        cfg, params = load_params(ckpt_dir, cfg, progress=progress, experts=experts, dense=dense,
                                  expert_sharding=expert_sharding)
        save_converted(cache_dir, params, source)
        return cfg, params
    params = restore_converted(cache_dir, expert_sharding)
    params[ENGRAM_KEY] = EngramTables.from_checkpoint(Checkpoint(ckpt_dir), cfg)
    return cfg, params
