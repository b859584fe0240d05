"""The one switch between the Pallas kernels and their XLA (pure-jnp) paths.

Resolution order for a kernel call (all static: read at trace time, so flipping the switch after a
function was jitted needs a re-trace, e.g. a new jit or `jax.clear_caches()`):
  1. the call's own `backend=` argument ("xla" | "pallas"),
  2. `with use_backend(..., kernel=name)` for the kernels that name themselves in `resolve`
     (KERNELS; e.g. to compare one kernel inside a whole step, the others unchanged),
  3. `set_backend(...)` / `with use_backend(...)` in this process,
  4. the environment variable V41_KERNELS = xla | pallas | auto,
  5. auto: "pallas" on a GPU (CUDA or ROCm), "xla" elsewhere.

On a machine without a GPU a "pallas" request runs the kernels in Pallas interpret mode (the
CPU CI does this on small shapes); V41_PALLAS_INTERPRET=1 forces interpret mode on a GPU too.
On NVIDIA Hopper (`mosaic_gpu()`) the MoE grouped GEMM from 2K tokens and the sparse attention
take optional Mosaic GPU paths (`kernels_pallas.moe_mgpu`, `kernels_pallas.sparse_attn_mgpu`);
V41_MOSAIC_GPU=0 keeps them on the portable Triton kernels.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from typing import Iterator

import jax

from kernels_pallas._compat import on_gpu

ENV_BACKEND = "V41_KERNELS"
ENV_INTERPRET = "V41_PALLAS_INTERPRET"
ENV_MOSAIC = "V41_MOSAIC_GPU"     # "0": never take the Mosaic GPU paths (the Triton kernels run instead)
CHOICES = ("xla", "pallas")
KERNELS = ("sinkhorn", "rmsnorm", "select", "rope", "hc_expand", "dense_fp8")  # the names `resolve(kernel=...)` is called with

_overrides: dict[str | None, str] = {}   # None: every kernel; a name of KERNELS: that kernel only


def _check(name: str) -> str:
    if name not in CHOICES + ("auto",):
        raise ValueError(f"kernel backend: {name!r} is not one of xla, pallas, auto")
    return name


def set_backend(name: str | None) -> None:
    """Process-wide choice; None returns to the environment / auto rule."""
    if name is None:
        _overrides.pop(None, None)
    else:
        _overrides[None] = _check(name)


@contextlib.contextmanager
def use_backend(name: str, kernel: str | None = None) -> Iterator[None]:
    """Process-wide, or (kernel=) for that one kernel only, inside the block."""
    if kernel is not None and kernel not in KERNELS:
        raise ValueError(f"kernel backend: {kernel!r} is not one of {', '.join(KERNELS)}")
    prev = _overrides.get(kernel)
    _overrides[kernel] = _check(name)
    try:
        yield
    finally:
        if prev is None:
            del _overrides[kernel]
        else:
            _overrides[kernel] = prev


def resolve(backend: str | None = None, kernel: str | None = None) -> str:
    name = _check(backend or _overrides.get(kernel) or _overrides.get(None)
                  or os.environ.get(ENV_BACKEND, "auto"))
    if name == "auto":
        return "pallas" if on_gpu() else "xla"
    return name


def interpret() -> bool:
    return (not on_gpu()) or os.environ.get(ENV_INTERPRET, "0") == "1"


def mosaic_gpu() -> bool:
    """True where the optional Mosaic GPU kernels can run: an NVIDIA GPU of compute capability 9.x
    (wgmma, TMA) and a jax with Mosaic GPU, unless V41_MOSAIC_GPU=0."""
    if os.environ.get(ENV_MOSAIC, "1") == "0" or not on_gpu():
        return False
    if importlib.util.find_spec("jax.experimental.pallas.mosaic_gpu") is None:
        return False   # pragma: no cover - a jax without Mosaic GPU
    dev = jax.devices()[0]
    return getattr(dev, "platform", "") == "gpu" and str(getattr(dev, "compute_capability", "0")).startswith("9")
