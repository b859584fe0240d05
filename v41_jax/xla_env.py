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

XLA:GPU also removes an fp32 -> bf16 -> fp32 conversion pair by default, as "excess precision"
(`xla_allow_excess_precision`): every rounding to bf16 the reference makes and the model writes as
such a pair (a bf16 result used in fp32 next) was skipped on the GPU. On the H200 that was most of
the device's distance from the reference: `check_reference --engine` on small_a, mean row ulps of
the conditioning 6.43 with the default, 1.37 with the flag false (inside the 4 one-ulp runs;
BENCHMARKS.md, 2026-12-04 d). So the flag is false here too, unless the user's XLA_FLAGS set it,
on ROCm as well (the same XLA:GPU pass; not measured there: no AMD GPU here).
The NVPTX option only where a CUDA plugin is installed: other LLVM builds may lack it.
"""

from __future__ import annotations

import importlib.metadata
import os
import warnings

CUDA_LLVM_OPTIONS = "-nvptx-prec-divf32=2"
EXCESS_PRECISION = "--xla_allow_excess_precision=false"
_KEY = "xla_backend_extra_options"


def with_gpu_options(flags: str, plugins: set[str]) -> str:
    """XLA_FLAGS with the options for the installed GPU plugins ("cuda", "rocm") added: the CUDA
    LLVM options with a CUDA plugin, EXCESS_PRECISION with either; each unless the flags set that
    option themselves."""
    if "cuda" in plugins and _KEY not in flags:
        flags = f"{flags} --{_KEY}={CUDA_LLVM_OPTIONS}"
    if plugins and "xla_allow_excess_precision" not in flags:
        flags = f"{flags} {EXCESS_PRECISION}"
    return flags.strip()


def gpu_plugins() -> set[str]:
    """The jax GPU plugins installed: a subset of {"cuda", "rocm"}."""
    names = [(d.metadata["Name"] or "").lower().replace("_", "-") for d in importlib.metadata.distributions()]
    return {p for p in ("cuda", "rocm") if any(n.startswith((f"jax-{p}", f"jaxlib-{p}")) for n in names)}


def apply() -> None:
    plugins = gpu_plugins()
    if not plugins:
        return
    flags = os.environ.get("XLA_FLAGS", "")
    wanted = with_gpu_options(flags, plugins)
    if wanted == flags:
        return
    from jax._src import xla_bridge   # internal: whether a backend already read XLA_FLAGS

    if xla_bridge.backends_are_initialized():
        missing = " ".join(f for f in wanted.split() if f not in flags.split())
        warnings.warn(f"v41_jax imported after jax started its backends: XLA_FLAGS lack {missing}, "
                      f"so fp32 divisions on CUDA may be approximate and roundings to bf16 skipped "
                      f"(import v41_jax first, or set the flags)", stacklevel=3)
        return
    os.environ["XLA_FLAGS"] = wanted
