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

XLA:CPU with N > 1 host devices (`--xla_force_host_platform_device_count=N`, the CPU mesh of
docs/PARALLEL.md): its client runs every device's share of a multi-device program on one pool
of max(cores, N) threads, where a share can wait in a collective for the others, and where the
task that enqueues a share blocks while its device already has 32 computations in flight (the
client's fixed `max_inflight_computations_per_device`). When the host runs that far ahead (async
dispatch; the engine queues steps without waiting), up to N such blocked tasks can hold pool threads
while the shares of the program in flight wait for a thread, and the process hangs in the
collective ("Expected 8 threads to join the rendezvous, but only 7 of them arrived"): 2 of 5 clean
CI runs of the mesh test, 2026-12-04; deterministic with tests/cpu_pool_child.py. N blocked tasks
and one program's N shares fit in 2N threads, so `PJRT_NPROC` (the pool size XLA reads when the
client starts) is set to max(cores, 2N) unless the user set it or NPROC.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import warnings
from typing import Mapping

CUDA_LLVM_OPTIONS = "-nvptx-prec-divf32=2"
EXCESS_PRECISION = "--xla_allow_excess_precision=false"
_KEY = "xla_backend_extra_options"
_HOST_DEVICES = re.compile(r"--xla_force_host_platform_device_count=(\d+)")


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


def cpu_pool_env(flags: str, env: Mapping[str, str], cores: int) -> dict[str, str]:
    """The environment XLA:CPU's client needs for the host devices `flags` ask for: PJRT_NPROC =
    max(cores, 2N) for N > 1 devices, unless `env` sizes the pool itself (PJRT_NPROC or NPROC)."""
    found = _HOST_DEVICES.findall(flags)
    n = int(found[-1]) if found else 1          # XLA takes the last of a repeated flag
    if n < 2 or "PJRT_NPROC" in env or "NPROC" in env:
        return {}
    return {"PJRT_NPROC": str(max(cores, 2 * n))}


def apply() -> None:
    flags = os.environ.get("XLA_FLAGS", "")
    plugins = gpu_plugins()
    wanted = with_gpu_options(flags, plugins) if plugins else flags
    pool = cpu_pool_env(flags, os.environ, os.cpu_count() or 1)
    if wanted == flags and not pool:
        return
    from jax._src import xla_bridge   # internal: whether a backend already read XLA_FLAGS

    if xla_bridge.backends_are_initialized():
        if pool:
            warnings.warn(f"v41_jax imported after jax started its backends: {pool} could not be set, so "
                          f"a mesh of host devices may hang in a collective (import v41_jax first, or set "
                          f"it)", stacklevel=3)
        if wanted == flags:
            return
        missing = " ".join(f for f in wanted.split() if f not in flags.split())
        warnings.warn(f"v41_jax imported after jax started its backends: XLA_FLAGS lack {missing}, "
                      f"so fp32 divisions on CUDA may be approximate and roundings to bf16 skipped "
                      f"(import v41_jax first, or set the flags)", stacklevel=3)
        return
    os.environ.update(pool)
    os.environ["XLA_FLAGS"] = wanted
