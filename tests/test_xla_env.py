"""The process-wide XLA options (`v41_jax.xla_env`): set only where a GPU plugin is installed,
never over the user's own backend options, and refused with a warning once a backend has read
XLA_FLAGS (then they could no longer take effect)."""

from __future__ import annotations

import os

import pytest

from v41_jax import xla_env


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
