"""Realistic defects injected into the model, for showing that `check_reference` catches them
(tests/test_check_reference_farm.py; docs/MODEL.md §6.5).

Each mutant is a context manager that swaps one function the model looks up at trace time, so a
jitted forward traced inside it carries the defect (call `jax.clear_caches()` around it: jit caches
by function identity, not by what the function calls).
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp

import kernels_pallas.reference as kref
from v41_jax.model import attention, indexer, moe


@contextlib.contextmanager
def _patched(*swaps):
    old = [(mod, name, getattr(mod, name)) for mod, name, _ in swaps]
    try:
        for mod, name, new in swaps:
            setattr(mod, name, new(getattr(mod, name)))
        yield
    finally:
        for mod, name, value in old:
            setattr(mod, name, value)


def _top_k_higher_index(_orig):
    """Exact ties to the higher index: top-k of the reversed lanes, ids mapped back."""
    def top_k(x, k):
        x = jnp.where(x == 0, jnp.zeros_like(x), x)
        values, ids = jax.lax.top_k(x[..., ::-1], k)
        return values, x.shape[-1] - 1 - ids
    return top_k


def _no_window_fp8(_orig):
    return lambda x, block: x


def _swapped_rope_table(orig):
    """Window layers rotate with the compressed layers' (YaRN, compress theta) table and back."""
    return lambda cfg, positions, global_table: orig(cfg, positions, not global_table)


def _no_sink(orig):
    return lambda q, kv, sink, idx, scale, **kw: orig(q, kv, jnp.full_like(sink, -jnp.inf), idx, scale, **kw)


def _no_candidate_mask(_orig):
    return lambda blocks, n_rows, block_size: jnp.ones((*blocks.shape[:-1], n_rows), bool)


MUTANTS = {
    # a fake-quant site left out: the window KV rows skip their fp8 (ue8m0 / 32) QDQ
    "window_kv_fp8_skipped": lambda: _patched((attention, "fp8_act_qdq", _no_window_fp8)),
    # every top-k (index, candidate blocks, MoE gate) breaks exact ties toward the higher index
    "ties_to_higher_index": lambda: _patched((indexer, "top_k", _top_k_higher_index),
                                             (kref, "top_k", _top_k_higher_index),
                                             (moe, "top_k", _top_k_higher_index)),
    # the attention sublayer takes the other RoPE table (window <-> compressed/YaRN)
    "wrong_rope_table": lambda: _patched((attention, "rope_cos_sin", _swapped_rope_table)),
    # the attention sink left out of the softmax denominator
    "sink_left_out": lambda: _patched((attention, "sparse_attn", _no_sink)),
    # a REINDEX layer scores every row instead of only those inside the candidate blocks
    "candidate_mask_skipped": lambda: _patched((attention, "candidate_mask", _no_candidate_mask)),
}
