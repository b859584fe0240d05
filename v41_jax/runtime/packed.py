"""A step's batch crosses to the device as two flat buffers, and is sliced apart inside the step.

Why: a `StepBatch` is 25-45 small arrays (more with more layers and Engram layers). Sent one by
one, each is its own host-to-device transfer with its own fixed cost, and the launch that takes
them waits on each. At batch 1 on the bench slice these fixed costs (~1.5 ms of `device_put`,
~1.5 ms more in the launch) were as long as the 4 ms step, so the pipelined loop fell behind
the device. Packed, a step sends two arrays whatever the model's depth:

* `words` int32 [W]: every 4-byte leaf (int32, uint32, float32), as raw bits;
* `bytes` uint8 [B]: every 1-byte leaf (uint8 Engram rows; bool flags as 0 / 1).

Unpacking is a static slice and a bitcast per leaf, which XLA fuses into the leaf's consumers:
the step computes exactly what it computes on the unpacked batch. The layout depends only on the
bucket (every leaf is bucket-shaped), so it is a static argument of the jitted step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import numpy as np

_WORD_DTYPES = (np.dtype(np.int32), np.dtype(np.uint32), np.dtype(np.float32))
_BYTE_DTYPES = (np.dtype(np.uint8), np.dtype(np.bool_))


class PackedBatch(NamedTuple):
    words: Any      # int32 [W]
    bytes: Any      # uint8 [B]


@dataclass(frozen=True)
class Leaf:
    in_words: bool   # which buffer holds it
    offset: int      # first element in that buffer
    size: int        # elements
    shape: tuple
    dtype: np.dtype


@dataclass(frozen=True)
class BatchLayout:
    """Where each leaf of a batch pytree lies in the two buffers (hashable: a static jit arg)."""
    treedef: Any
    leaves: tuple[Leaf, ...]
    n_words: int
    n_bytes: int

    @classmethod
    def of(cls, batch) -> BatchLayout:
        arrays, treedef = jax.tree_util.tree_flatten(batch)
        leaves, ends = [], {True: 0, False: 0}
        for path, x in zip(jax.tree_util.tree_flatten_with_path(batch)[0], arrays):
            dtype = np.dtype(x.dtype)
            if dtype not in _WORD_DTYPES + _BYTE_DTYPES:
                raise TypeError(f"batch leaf {jax.tree_util.keystr(path[0])}: dtype {dtype} has no packed form")
            in_words = dtype in _WORD_DTYPES
            shape = tuple(int(d) for d in x.shape)
            leaf = Leaf(in_words, ends[in_words], int(np.prod(shape, dtype=np.int64)), shape, dtype)
            ends[in_words] += leaf.size
            leaves.append(leaf)
        return cls(treedef, tuple(leaves), ends[True], ends[False])

    def pack(self, batch) -> PackedBatch:
        """The host batch (numpy) -> two numpy buffers, one copy of each leaf's bytes. On the
        engine's critical path at every step, hence plain comparisons of precomputed fields."""
        arrays, treedef = jax.tree_util.tree_flatten(batch)
        if treedef != self.treedef:
            raise ValueError("batch does not have this layout's structure")
        words = np.empty(self.n_words, np.int32)
        raw = np.empty(self.n_bytes, np.uint8)
        for leaf, x in zip(self.leaves, arrays):
            if x.shape != leaf.shape or x.dtype != leaf.dtype:
                raise ValueError(f"batch leaf {x.shape} {x.dtype} where the layout has {leaf.shape} {leaf.dtype}")
            dst = words if leaf.in_words else raw
            dst[leaf.offset: leaf.offset + leaf.size] = x.reshape(-1).view(dst.dtype)
        return PackedBatch(words, raw)

    def unpack(self, packed: PackedBatch):
        """The two buffers (traced) -> the batch pytree, each leaf in its own dtype and shape."""
        words, raw = packed
        out = []
        for leaf in self.leaves:
            src = words if leaf.in_words else raw
            x = jax.lax.slice_in_dim(src, leaf.offset, leaf.offset + leaf.size).reshape(leaf.shape)
            if leaf.dtype == np.bool_:
                x = x != 0
            elif leaf.dtype != src.dtype:
                x = jax.lax.bitcast_convert_type(x, leaf.dtype)
            out.append(x)
        return jax.tree_util.tree_unflatten(self.treedef, out)
