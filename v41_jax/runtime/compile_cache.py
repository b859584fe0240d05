"""Compile once: jax's persistent compilation cache, and a meter of what compiled.

The one place that turns the cache on. Default folder: `$V41_COMPILE_CACHE` if set, else
`~/.cache/v41-jax/xla`; `''` or `off` (flag or variable) disables it. Every executable is cached,
however fast it compiled (jax's default skips those under a second, so a second start would still
compile the small ones), which is what makes a second start of the same config and buckets run no
XLA compilation at all.
"""

from __future__ import annotations

import os

import jax

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


def enable(path: str | None = None) -> str | None:
    """Turn the persistent cache on at `resolve(path)` (or leave it off) -> the folder used."""
    folder = resolve(path)
    if folder is not None:
        os.makedirs(folder, exist_ok=True)
        jax.config.update("jax_compilation_cache_dir", folder)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return folder


class CompileMeter:
    """Process-wide compilation counters (jax.monitoring events). `lowerings` counts every jit
    cache miss; `cache_hits` those the persistent cache then served; `xla_compiles()` the XLA
    compilations actually run (jax reports a backend-compile event for hits too, so hits are
    subtracted); `seconds` tracing + lowering + compiling (or loading) time."""
    lowerings = 0
    compile_events = 0
    cache_hits = 0
    seconds = 0.0

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
        cls.cache_hits += event == HIT


jax.monitoring.register_event_duration_secs_listener(CompileMeter._duration)
jax.monitoring.register_event_listener(CompileMeter._event)
