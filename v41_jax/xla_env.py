"""XLA options that must be in place before jax starts a GPU backend (process-wide, read once
from XLA_FLAGS): the one place that sets them. `apply()` runs when `v41_jax` is imported.

CUDA: XLA compiles every fp32 division, its own and the Pallas/Triton kernels', with LLVM's NVPTX
option -nvptx-prec-divf32=1 (`div.full.f32`, up to 2 ulp; XLA's choice for speed), and LLVM turns
a division done in fp64 and rounded to fp32 back into an fp32 division (exact in IEEE arithmetic,
so `kernels_pallas._ieee.div_rn` becomes `div.full` too). On the H200 that left 20 % of fp32
quotients and 21 % of the RMS-norm kernel's rows 1 ulp from torch's (BENCHMARKS.md, 2026-12-03);
with =2 (IEEE `div.rn.f32`) every one was equal. A decode step is bound by memory, not by its few
divisions. XLA's own fp32 sqrt stays approximate whatever the NVPTX options (the kernels take
theirs in fp64, which stays exact). A user's XLA_FLAGS that set xla_backend_extra_options win.
Only where a CUDA plugin is installed: other LLVM builds may lack the NVPTX option.
"""

from __future__ import annotations

import importlib.metadata
import os
import warnings

CUDA_LLVM_OPTIONS = "-nvptx-prec-divf32=2"
_KEY = "xla_backend_extra_options"


def with_cuda_options(flags: str) -> str:
    """XLA_FLAGS with the CUDA LLVM options added, unless they set backend options themselves."""
    if _KEY in flags:
        return flags
    return f"{flags} --{_KEY}={CUDA_LLVM_OPTIONS}".strip()


def cuda_plugin_installed() -> bool:
    return any((d.metadata["Name"] or "").lower().replace("_", "-").startswith(("jax-cuda", "jaxlib-cuda"))
               for d in importlib.metadata.distributions())


def apply() -> None:
    if not cuda_plugin_installed():
        return
    flags = os.environ.get("XLA_FLAGS", "")
    wanted = with_cuda_options(flags)
    if wanted == flags:
        return
    from jax._src import xla_bridge   # internal: whether a backend already read XLA_FLAGS

    if xla_bridge.backends_are_initialized():
        warnings.warn(f"v41_jax imported after jax started its backends: XLA_FLAGS lack "
                      f"--{_KEY}={CUDA_LLVM_OPTIONS}, so fp32 divisions on CUDA are approximate "
                      f"(import v41_jax first, or set the flag)", stacklevel=3)
        return
    os.environ["XLA_FLAGS"] = wanted
