"""The one switch between the Pallas kernels and their XLA (pure-jnp) paths.

Resolution order for a kernel call (all static: read at trace time, so flipping the switch after a
function was jitted needs a re-trace, e.g. a new jit or `jax.clear_caches()`):
  1. the call's own `backend=` argument ("xla" | "pallas"),
  2. `set_backend(...)` / `with use_backend(...)` in this process,
  3. the environment variable V41_KERNELS = xla | pallas | auto,
  4. auto: "pallas" on a GPU (CUDA or ROCm), "xla" elsewhere.

On a machine without a GPU a "pallas" request runs the kernels in Pallas interpret mode (the
CPU CI does this on small shapes); V41_PALLAS_INTERPRET=1 forces interpret mode on a GPU too.
On NVIDIA Hopper the MoE grouped GEMM from 2K tokens takes the optional Mosaic GPU path
(`kernels_pallas.moe_mgpu`); V41_MOSAIC_GPU=0 keeps it on the portable Triton kernels.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

from kernels_pallas._compat import on_gpu

ENV_BACKEND = "V41_KERNELS"
ENV_INTERPRET = "V41_PALLAS_INTERPRET"
CHOICES = ("xla", "pallas")

_override: str | None = None


def _check(name: str) -> str:
    if name not in CHOICES + ("auto",):
        raise ValueError(f"kernel backend: {name!r} is not one of xla, pallas, auto")
    return name


def set_backend(name: str | None) -> None:
    """Process-wide choice; None returns to the environment / auto rule."""
    global _override
    _override = None if name is None else _check(name)


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    global _override
    prev, _override = _override, _check(name)
    try:
        yield
    finally:
        _override = prev


def resolve(backend: str | None = None) -> str:
    name = _check(backend or _override or os.environ.get(ENV_BACKEND, "auto"))
    if name == "auto":
        return "pallas" if on_gpu() else "xla"
    return name


def interpret() -> bool:
    return (not on_gpu()) or os.environ.get(ENV_INTERPRET, "0") == "1"
