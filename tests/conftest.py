"""The suite's order: the longest test files first.

`make test` runs two xdist workers that take whole files (`--dist loadfile`) in collection order,
each worker the next file as it frees up. Alphabetically the longest files can start last and run
alone at the end (test_mesh.py alone is ~3 minutes of one worker), so the files measured longest
(clean-clone runs, `--durations`) go first; the rest keep their order. A stale list costs only
balance, never a test. What each test spends compiling: `-p tests.compile_census` (its docstring).
"""

LONGEST_FIRST = ("test_check_reference_farm.py", "test_mesh.py", "test_speculative.py", "test_kernels_moe.py",
                 "test_runtime.py", "test_step_replay.py", "test_engine_golden.py", "test_serving.py",
                 "test_layer_runs.py", "test_demo_model.py", "test_bench_step.py", "test_check_reference.py",
                 "test_generate_cli.py", "test_generate.py")


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))     # stable: in-file order kept
