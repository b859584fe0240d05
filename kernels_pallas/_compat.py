"""Version shim for the Pallas Triton API (jax 0.10.2 on CPU CI, jax 0.11.2 on the H200 image).

Everything a kernel file needs from `jax.experimental.pallas[.triton]` comes through here, so a
rename in a later jax touches one file:
  * `compiler_params(num_warps, num_stages)`: Triton compiler params. They are always passed
    explicitly: with them `pallas_call` lowers through Triton on CUDA *and* ROCm; without them
    ROCm is refused ("Mosaic GPU does not yet support AMD ROCm devices").
    Older jax named the class `TritonCompilerParams` (under `pallas.gpu`).
  * `load(ref, mask=, other=)` / `store(ref, val, mask=)`: masked (gather / scatter) access.
  * `atomic_add(ref, idx, val)` (acquire-release, GPU scope; the old value) and `cta_barrier()`
    (all of a program's threads; not in interpret mode): a split-K semaphore.
  * `SQUEEZED`: the block-shape marker for a dimension the kernel does not see.
"""

from __future__ import annotations

import jax
from jax.experimental import pallas as pl

try:  # jax >= 0.4.36: the Triton backend lives in pallas.triton
    from jax.experimental.pallas import triton as _pltriton
except ImportError:  # pragma: no cover - very old jax
    from jax.experimental.pallas import gpu as _pltriton

_PARAMS_CLS = getattr(_pltriton, "CompilerParams", None) or getattr(_pltriton, "TritonCompilerParams")

load = _pltriton.load
store = _pltriton.store
atomic_add = _pltriton.atomic_add
cta_barrier = _pltriton.debug_barrier
SQUEEZED = pl.Squeezed() if hasattr(pl, "Squeezed") else None

# The custom-call target every Triton-lowered pallas_call becomes (also the name jax.export must
# be told to allow, because it is not on export's list of stable custom calls).
TRITON_CUSTOM_CALL = getattr(_pltriton, "CUSTOM_CALL_TARGET_NAME", "__gpu$xla.gpu.triton")


def compiler_params(num_warps: int, num_stages: int):
    return _PARAMS_CLS(num_warps=num_warps, num_stages=num_stages)


def on_gpu() -> bool:
    return jax.default_backend() in ("gpu", "cuda", "rocm")
