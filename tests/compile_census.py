"""Where the suite's time goes in JAX: a pytest plugin, off unless named.

    python -m pytest -p tests.compile_census --compile-census DIR -n 2 --dist loadfile tests
    python -m tests.compile_census DIR          # the table

Each process (an xdist worker, or pytest alone) writes DIR/census-<pid>.json: per test, jax's own
compile events (`jax.monitoring`: tracing, lowering to MLIR, backend compile, persistent-cache hits)
and every executable it compiled and wrote to the persistent cache (module name, cache key,
seconds). A key compiled by two tests is a compile the suite paid twice (the workers share one
cache folder, so that happens only when both miss at once). Child processes a test starts are not
seen. The backend seconds of compiles run in parallel threads (e.g. `bench_step.random_params`'s
pool) add up past their wall time. BENCHMARKS.md ("o") has the census of 2026-12-07.
"""

from __future__ import annotations

import collections
import json
import os
import sys
from pathlib import Path

_current = ["<collection>"]
_events: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
_writes: list[tuple[str, str, str, float]] = []
_out: list[Path] = []


def pytest_addoption(parser):
    parser.addoption("--compile-census", metavar="DIR", help="write each test's JAX compile events to DIR")


def pytest_configure(config):
    folder = config.getoption("--compile-census")
    if not folder:
        return
    import jax.monitoring
    from jax._src import compiler   # its persistent-cache write is the one place every miss passes

    _out.append(Path(folder))
    _out[0].mkdir(parents=True, exist_ok=True)

    def duration(event, secs, **_):
        c = _events[_current[0]]
        c[event] += secs
        c[event + "#n"] += 1

    def event(name, **_):
        _events[_current[0]][name + "#n"] += 1

    jax.monitoring.register_event_duration_secs_listener(duration)
    jax.monitoring.register_event_listener(event)
    write = compiler._cache_write

    def recorded(cache_key, compile_time_secs, module_name, *args, **kw):
        _writes.append((_current[0], module_name, cache_key, float(compile_time_secs)))
        return write(cache_key, compile_time_secs, module_name, *args, **kw)

    compiler._cache_write = recorded


def pytest_runtest_setup(item):
    _current[0] = item.nodeid


def pytest_unconfigure(config):
    if _out:
        (_out[0] / f"census-{os.getpid()}.json").write_text(
            json.dumps({"events": {k: dict(v) for k, v in _events.items()}, "writes": _writes}))


COMPILE = "/jax/core/compile/backend_compile_duration"
TRACE = "/jax/core/compile/jaxpr_trace_duration"
LOWER = "/jax/core/compile/jaxpr_to_mlir_module_duration"


def summary(folder: Path, top: int = 30) -> str:
    """The census files of one run -> a text table: totals, compiles by size, keys compiled twice,
    the test files by compile seconds, the largest executables."""
    events, writes = collections.defaultdict(collections.Counter), []
    for f in sorted(folder.glob("census-*.json")):
        data = json.loads(f.read_text())
        for test, c in data["events"].items():
            events[test].update(c)
        writes += data["writes"]
    total = collections.Counter()
    for c in events.values():
        total.update(c)
    lines = [f"{len(writes)} executables compiled, {sum(w[3] for w in writes):.0f} s; tracing "
             f"{total[TRACE]:.0f} s, lowering {total[LOWER]:.0f} s; cache hits "
             f"{total['/jax/compilation_cache/cache_hits#n']}"]
    for lo, hi in ((0, 0.05), (0.05, 1), (1, 5), (5, float("inf"))):
        sizes = [w[3] for w in writes if lo <= w[3] < hi]
        lines.append(f"  compiles of [{lo}, {hi}) s: {len(sizes)}, {sum(sizes):.0f} s")
    by_key = collections.defaultdict(list)
    for w in writes:
        by_key[w[2]].append(w)
    twice = {k: v for k, v in by_key.items() if len(v) > 1}
    lines.append(f"keys compiled more than once: {len(twice)} "
                 f"({sum(sum(w[3] for w in v[1:]) for v in twice.values()):.0f} s paid again)")
    per_file = collections.defaultdict(collections.Counter)
    for test, c in events.items():
        per_file[test.split("::")[0]].update(c)
    lines.append("\ncompile  trace  lower  compiles  file")
    for f, c in sorted(per_file.items(), key=lambda kv: -(kv[1][COMPILE] + kv[1][TRACE] + kv[1][LOWER]))[:top]:
        lines.append(f"{c[COMPILE]:7.1f} {c[TRACE]:6.1f} {c[LOWER]:6.1f} {c[COMPILE + '#n']:9d}  {f}")
    lines.append("\nseconds  executable  test")
    for test, module, _, secs in sorted(writes, key=lambda w: -w[3])[:top]:
        lines.append(f"{secs:7.1f}  {module}  {test}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(summary(Path(sys.argv[1])))
