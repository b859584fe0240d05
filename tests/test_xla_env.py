"""The process-wide XLA options (`v41_jax.xla_env`): set only where a GPU plugin is installed,
never over the user's own backend options, and refused with a warning once a backend has read
XLA_FLAGS (then they could no longer take effect); XLA:CPU's thread pool sized for a mesh of host
devices."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from v41_jax import xla_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_gpu_options_are_added_once_and_never_over_the_users():
    cuda = f"--xla_backend_extra_options={xla_env.CUDA_LLVM_OPTIONS}"
    both = f"{cuda} {xla_env.EXCESS_PRECISION}"
    add = xla_env.with_gpu_options
    assert add("", {"cuda"}) == both
    assert add("--xla_gpu_autotune_level=0", {"cuda"}) == f"--xla_gpu_autotune_level=0 {both}"
    assert add(both, {"cuda"}) == both
    mine = "--xla_backend_extra_options=-nvptx-prec-divf32=1"
    assert add(mine, {"cuda"}) == f"{mine} {xla_env.EXCESS_PRECISION}"
    mine = "--xla_allow_excess_precision=true"
    assert add(mine, {"cuda"}) == f"{mine} {cuda}"
    assert add("", {"rocm"}) == xla_env.EXCESS_PRECISION      # no NVPTX option for AMD's LLVM
    assert add("--xla_gpu_autotune_level=0", set()) == "--xla_gpu_autotune_level=0"


def test_apply_sets_the_flags_only_with_a_gpu_plugin_and_before_any_backend(monkeypatch):
    from jax._src import xla_bridge

    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_autotune_level=0")
    monkeypatch.setattr(xla_env, "gpu_plugins", lambda: set())
    xla_env.apply()
    assert os.environ["XLA_FLAGS"] == "--xla_gpu_autotune_level=0"

    monkeypatch.setattr(xla_env, "gpu_plugins", lambda: {"cuda"})
    monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: True)
    with pytest.warns(UserWarning, match="nvptx-prec-divf32=2 --xla_allow_excess_precision=false"):
        xla_env.apply()
    assert os.environ["XLA_FLAGS"] == "--xla_gpu_autotune_level=0"

    monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: False)
    xla_env.apply()
    assert os.environ["XLA_FLAGS"] == xla_env.with_gpu_options("--xla_gpu_autotune_level=0", {"cuda"})


def test_gpu_plugin_detection_matches_the_backend():
    # a CPU machine gets no GPU options; a GPU one must be recognised (else divisions stay
    # approximate and bf16 roundings may be skipped)
    jax = pytest.importorskip("jax")
    assert bool(xla_env.gpu_plugins()) == (jax.default_backend() == "gpu")


def test_cpu_pool_is_sized_for_host_device_meshes():
    pool = xla_env.cpu_pool_env
    flag = "--xla_force_host_platform_device_count="
    assert pool(f"{flag}8", {}, 2) == {"PJRT_NPROC": "16"}
    assert pool(f"--xla_cpu_collective_timeout_seconds=600 {flag}8", {}, 64) == {"PJRT_NPROC": "64"}
    assert pool(f"{flag}8 {flag}2", {}, 2) == {"PJRT_NPROC": "4"}          # the last one counts
    assert pool(f"{flag}1", {}, 2) == {} and pool("", {}, 2) == {}
    assert pool(f"{flag}8", {"NPROC": "8"}, 2) == {} and pool(f"{flag}8", {"PJRT_NPROC": "8"}, 2) == {}


def _pool_child(mode: str, extra: dict) -> subprocess.CompletedProcess:
    # a hung collective aborts after 10 s instead of XLA's 40 / 30 s
    env = {k: v for k, v in os.environ.items() if k not in ("PJRT_NPROC", "NPROC")}
    env.update(extra, PYTHONPATH=str(ROOT), XLA_FLAGS="--xla_force_host_platform_device_count=8 "
               "--xla_cpu_collective_timeout_seconds=10 --xla_cpu_collective_call_terminate_timeout_seconds=10")
    return subprocess.run([sys.executable, "-m", "tests.cpu_pool_child", mode], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=240)


def test_a_cpu_mesh_with_v41_jax_runs_far_ahead_without_hanging():
    """300 collective programs queued on 8 host devices: done with v41_jax's pool size. The
    control, XLA's own pool size on this 2-core machine (max(cores, 8) = 8 threads), hangs in the
    collective and aborts; if it ever stops hanging, the setting may no longer be needed."""
    ok = _pool_child("v41_jax", {})
    assert ok.returncode == 0 and ok.stdout.strip() == "done", ok.stderr[-3000:]
    hung = _pool_child("plain", {"PJRT_NPROC": "8"})
    assert hung.returncode != 0 and "threads to join the rendezvous" in hung.stderr, (hung.returncode, hung.stdout)
