"""The XLA options the step's executables are compiled with on CUDA (`compile_cache.CUDA_OPTIONS`):
every one a name and value this jaxlib accepts (XLA checks them at compile time on any backend,
so a misspelt field or enum value fails here on the CPU, not first on a GPU), and a user's
XLA_FLAGS naming an option, under its current or its older spelling, leaves it out."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from v41_jax.runtime import compile_cache


def test_every_cuda_option_is_accepted_by_this_jaxlib():
    lowered = jax.jit(lambda x: x * 2).lower(jnp.ones(3))
    for name, value in compile_cache.CUDA_OPTIONS.items():
        lowered.compile(compiler_options={name: value})
    with pytest.raises(Exception, match="not a valid enum value"):     # the check is real
        lowered.compile(compiler_options={"xla_gpu_command_buffer_scheduling_mode": "SIDE_BY_SIDE"})


def test_a_users_xla_flags_win_under_either_spelling():
    mode = "xla_gpu_command_buffer_scheduling_mode"
    assert compile_cache.cuda_options("") == compile_cache.CUDA_OPTIONS
    for flags in (f"--{mode}=SERIALIZE", "--xla_gpu_graph_enable_concurrent_region=false"):
        opts = compile_cache.cuda_options(flags)
        assert mode not in opts and len(opts) == len(compile_cache.CUDA_OPTIONS) - 1
    assert "xla_gpu_enable_cub_radix_sort" not in compile_cache.cuda_options("--xla_gpu_enable_cub_radix_sort=true")
