"""Compile once: jax's persistent compilation cache, the step's serialized executables, and a
meter of what compiled.

The one place that turns the caches on. Default folder: `$V41_COMPILE_CACHE` if set, else
`~/.cache/v41-jax/xla`; `''` or `off` (flag or variable) disables it. Every executable is cached,
however fast it compiled (jax's default skips those under a second, so a second start would still
compile the small ones), which is what makes a second start of the same config and buckets run no
XLA compilation at all.

jax's cache is keyed by the lowered program, so a hit still traces and lowers the step (seconds on
a deep model). The step's own executables are therefore also kept, serialized
(`jax.experimental.serialize_executable`), under `<folder>/executables/<key>`: the key covers
everything the program depends on (this package's source, jax and jaxlib, the devices, the config,
geometry, numerics, bucket, the params' and cache's shapes and dtypes, and the V41_* / XLA_* /
JAX_* environment), so a start whose key matches loads the executable without tracing anything,
and any change compiles afresh. Only bytes are stored (no pickle); a file that fails to load is
ignored and rewritten. Only an executable XLA compiled in this process is stored: one that jax's
persistent cache served (our key changed, the program did not) was itself deserialized, and on
XLA:CPU (jaxlib 0.10) serializing such a copy again drops its code — a process that loads it fails
at its first run with "Function <fusion> not found".
"""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

import jax
import jax.extend

ENV = "V41_COMPILE_CACHE"
DEFAULT = os.path.join(os.path.expanduser("~"), ".cache", "v41-jax", "xla")
TRACE, LOWER, COMPILE = ("/jax/core/compile/jaxpr_trace_duration",
                         "/jax/core/compile/jaxpr_to_mlir_module_duration",
                         "/jax/core/compile/backend_compile_duration")
HIT = "/jax/compilation_cache/cache_hits"


def resolve(path: str | None = None) -> str | None:
    """The cache folder a flag value (None: not given) and the environment name, or None (off)."""
    value = os.environ.get(ENV, DEFAULT) if path is None else path
    return None if value in ("", "off") else os.path.abspath(os.path.expanduser(value))


_enabled: str | None = None


def enable(path: str | None = None) -> str | None:
    """Turn the persistent cache on at `resolve(path)` (or leave it off) -> the folder used."""
    global _enabled
    folder = _enabled = resolve(path)
    if folder is not None:
        os.makedirs(folder, exist_ok=True)
        jax.config.update("jax_compilation_cache_dir", folder)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return folder


# XLA options for the step's executables on CUDA. Measured on CUDA only: ROCm keeps XLA's
# defaults until measured there. XLA_FLAGS that name an option win (the user's choice).
CUDA_OPTIONS = {
    # command buffers (CUDA graphs) for every kind of kernel, however small the graph: a decode
    # step is ~450-750 kernels, and launched one by one their launch costs as long as the step
    # itself. On the H200 (bench slice, batch 1, BENCHMARKS.md "Engine loop") the step took 6.1 ms
    # with XLA's defaults and 4.1 ms with these, its launch returning in 0.5-0.9 ms, not 6.0 ms.
    "xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL",
    "xla_gpu_graph_min_graph_size": 1,
    # graphs whose kernels with no dependence between them (a sublayer's independent
    # projections, norms and bookkeeping) run side by side instead of one after another. H100,
    # bench slice, decode back to back, this option against XLA's default (LHS), one lowering,
    # interleaved in one process: 0.26 / 0.44 / 0.44 / 0.48 ms faster at b = 1 / 8 / 32 / 64 (8K),
    # 0.41 / 0.61 / 0.61 at b = 1 / 8 / 32 (32K); prefill within +-1.4 ms of 63 / 121 (BENCHMARKS.md
    # 2026-12-06 r). The order left is XLA's buffer read/write conflicts plus its control
    # dependencies (kept in this mode since openxla/xla#27412). With autotuning off the two modes'
    # outputs are equal byte for byte (b = 8, 32); with it on they differed at b >= 8, so those
    # differences are the autotuner's choices for each compile, not the order. PDL
    # (xla_gpu_enable_pdl) and unrolled loops (xla_gpu_command_buffer_unroll_loops): no change (q).
    "xla_gpu_command_buffer_scheduling_mode": "CONCURRENT",
    # XLA's own sort kernels, not CUB's radix sort: a CUB sort cannot be captured in a command
    # buffer, so the sampler's `lax.cond` around its vocabulary sort (runtime/sampling.py) ran on
    # the host, which waited for the predicate mid-step, split the step into three graphs, and
    # could not queue the next step behind it (H200, bench slice: a batch-1 step's host-side
    # conditional took 2.3 ms; BENCHMARKS.md, 2026-12-04). XLA's sort of the 129,280-entry rows
    # measured 0.34 vs 0.25 ms at 1 row, 0.53 vs 0.59 at 8 and 1.29 vs 1.39 at 32, and only
    # sampled steps run it.
    "xla_gpu_enable_cub_radix_sort": False,
}

# older XLA_FLAGS names of an option above: a user's flag under either name wins
SPELLINGS = {"xla_gpu_command_buffer_scheduling_mode": ("xla_gpu_graph_enable_concurrent_region",)}


def cuda_options(xla_flags: str) -> dict:
    """CUDA_OPTIONS less those that `xla_flags` names under any spelling."""
    return {k: v for k, v in CUDA_OPTIONS.items() if not any(n in xla_flags for n in (k, *SPELLINGS.get(k, ())))}


def compiler_options() -> dict:
    """XLA options the step's executables are compiled with on this backend."""
    backend = jax.extend.backend.get_backend()
    if backend.platform != "gpu" or "cuda" not in backend.platform_version.lower():
        return {}
    return cuda_options(os.environ.get("XLA_FLAGS", ""))


def _source_digest() -> str:
    """sha256 of every .py file of the packages a step's program comes from."""
    root = Path(__file__).resolve().parents[2]
    h = hashlib.sha256()
    for pkg in ("v41_jax", "kernels_pallas"):
        for f in sorted((root / pkg).rglob("*.py")):
            h.update(str(f.relative_to(root)).encode())
            h.update(f.read_bytes())
    return h.hexdigest()


def executable_key(*parts) -> str:
    """A key for a serialized executable: `parts` (reprs of what the program depends on) plus the
    source, versions, devices and environment."""
    import jaxlib

    env = sorted((k, v) for k, v in os.environ.items() if k.startswith(("V41_", "XLA_", "JAX_")))
    devices = [(d.platform, d.device_kind) for d in jax.devices()]
    h = hashlib.sha256(repr((_source_digest(), jax.__version__, jaxlib.__version__, devices, env,
                             parts)).encode())
    return h.hexdigest()[:32]


def _executable_path(key: str) -> Path | None:
    return None if _enabled is None else Path(_enabled) / "executables" / key


_loaded: dict[str, object] = {}


def load_executable(key: str, in_tree, out_tree):
    """The executable saved under `key` (a `jax.stages.Compiled`), or None. One this process has
    already compiled or loaded is reused as it is: XLA:CPU cannot load a second copy of an
    executable it holds (its functions clash by name and the copy fails at run time)."""
    from jax.experimental import serialize_executable

    if key in _loaded:
        return _loaded[key]
    path = _executable_path(key)
    if path is None or not path.is_file():
        return None
    try:
        _loaded[key] = serialize_executable.deserialize_and_load(path.read_bytes(), in_tree, out_tree)
        return _loaded[key]
    except Exception:  # noqa: BLE001 - a stale or truncated file: compile afresh and overwrite it
        return None


def compile_and_save(key: str | None, lowered):
    """`lowered` compiled with this backend's options (`compiler_options`), kept under `key`
    (None: not kept) when XLA compiled it here rather than jax's persistent cache serving it (see
    the module's note); a served one is still reused for the rest of this process."""
    hits = CompileMeter.hits_in_this_thread()
    compiled = lowered.compile(compiler_options=compiler_options())
    if key is not None:
        if CompileMeter.hits_in_this_thread() == hits:
            _save_executable(key, compiled)
        else:
            _loaded[key] = compiled
    return compiled


def _save_executable(key: str, compiled) -> None:
    """Keep `compiled` under `key`, in this process and on disk. Only for an executable XLA
    compiled in this process (see the module's note)."""
    from jax.experimental import serialize_executable

    _loaded[key] = compiled
    path = _executable_path(key)
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    payload, _, _ = serialize_executable.serialize(compiled)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_bytes(payload)
    tmp.replace(path)                                  # atomic: a reader never sees half a file


class CompileMeter:
    """Process-wide compilation counters (jax.monitoring events). `lowerings` counts every jit
    cache miss; `cache_hits` those the persistent cache then served; `xla_compiles()` the XLA
    compilations actually run (jax reports a backend-compile event for hits too, so hits are
    subtracted); `seconds` tracing + lowering + compiling (or loading) time."""
    lowerings = 0
    compile_events = 0
    cache_hits = 0
    seconds = 0.0
    # jax reports a hit in the thread that compiles, so a compile can tell whether it was served
    # even while others run in a pool
    _here = threading.local()

    @classmethod
    def hits_in_this_thread(cls) -> int:
        return getattr(cls._here, "hits", 0)

    @classmethod
    def xla_compiles(cls) -> int:
        return cls.compile_events - cls.cache_hits

    @classmethod
    def _duration(cls, event: str, duration: float, **_):
        if event in (TRACE, LOWER, COMPILE):
            cls.seconds += duration
            cls.lowerings += event == LOWER
            cls.compile_events += event == COMPILE

    @classmethod
    def _event(cls, event: str, **_):
        if event == HIT:
            cls.cache_hits += 1
            cls._here.hits = cls.hits_in_this_thread() + 1


jax.monitoring.register_event_duration_secs_listener(CompileMeter._duration)
jax.monitoring.register_event_listener(CompileMeter._event)
