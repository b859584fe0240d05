"""The process-wide XLA options (`v41_jax.xla_env`): set only where a CUDA plugin is installed,
never over the user's own backend options, and refused with a warning once a backend has read
XLA_FLAGS (then they could no longer take effect)."""

from __future__ import annotations

import os

import pytest

from v41_jax import xla_env


def test_cuda_options_are_added_once_and_never_over_the_users():
    opt = f"--xla_backend_extra_options={xla_env.CUDA_LLVM_OPTIONS} {xla_env.EXCESS_PRECISION}"
    assert xla_env.with_cuda_options("") == opt
    assert xla_env.with_cuda_options("--xla_gpu_autotune_level=0") == f"--xla_gpu_autotune_level=0 {opt}"
    assert xla_env.with_cuda_options(opt) == opt
    mine = "--xla_backend_extra_options=-nvptx-prec-divf32=1"
    assert xla_env.with_cuda_options(mine) == f"{mine} {xla_env.EXCESS_PRECISION}"
    mine = "--xla_allow_excess_precision=true"
    assert xla_env.with_cuda_options(mine) == f"--xla_allow_excess_precision=true --xla_backend_extra_options={xla_env.CUDA_LLVM_OPTIONS}"


def test_apply_sets_the_flags_only_with_a_cuda_plugin_and_before_any_backend(monkeypatch):
    from jax._src import xla_bridge

    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_autotune_level=0")
    monkeypatch.setattr(xla_env, "cuda_plugin_installed", lambda: False)
    xla_env.apply()
    assert os.environ["XLA_FLAGS"] == "--xla_gpu_autotune_level=0"

    monkeypatch.setattr(xla_env, "cuda_plugin_installed", lambda: True)
    monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: True)
    with pytest.warns(UserWarning, match="nvptx-prec-divf32=2"):
        xla_env.apply()
    assert os.environ["XLA_FLAGS"] == "--xla_gpu_autotune_level=0"

    monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: False)
    xla_env.apply()
    assert os.environ["XLA_FLAGS"] == xla_env.with_cuda_options("--xla_gpu_autotune_level=0")


def test_cuda_plugin_detection_matches_the_backend():
    # a CPU machine gets no CUDA options; a CUDA one must be recognised (else divisions stay approximate)
    jax = pytest.importorskip("jax")
    assert xla_env.cuda_plugin_installed() == (jax.default_backend() == "gpu")
