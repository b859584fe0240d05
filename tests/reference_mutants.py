"""Realistic defects injected into the model, for showing that `check_reference` catches them
(tests/test_check_reference_farm.py; docs/MODEL.md §6.5).

Each mutant is a context manager that swaps one function the model looks up at trace time, so a
jitted forward (or step) traced inside it carries the defect (call `jax.clear_caches()` around it:
jit caches by function identity, not by what the function calls). `CACHE_PATH` names the mutants
that only the cache path can show (run them through `engine_replay.run_engine`): the full forward
never decodes incrementally.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace

import jax
import jax.numpy as jnp

import kernels_pallas.reference as kref
from v41_jax.model import attention, moe
from v41_jax.runtime import step


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


def _published_last(geom, layer: int) -> int:
    """The owner (index into `geom.owners`) whose keys the released reference's shared hand-off
    holds when a ratio-2 scorer at `layer` runs on a decode step that completes no ratio-2 group:
    ratio-1 owners publish on every step, so the last one above it; with none above, the stack's
    last owner, since every owner published on the step before (it completed the group, or was the
    prefill)."""
    assert set(geom.ratios) <= {1, 2}, geom.ratios
    above = [k for k, o in enumerate(geom.owners) if o.ratio == 1 and o.layer < layer]
    return above[-1] if above else len(geom.owners) - 1


def _stale_index_keys(orig):
    """The reference's decode fix reverted (tests/fixtures/dsv41_official/SOURCE.md, "One fix"): an
    owner publishes its index keys only when it completes a group, so at a decode row whose ratio-2
    group is incomplete the scorer reads the keys another owner published last. Both scorings are
    traced; each token row takes the stale one where the released code would have read stale keys."""
    def select(p, cfg, geom, topo, h, c_q, batch, state, numerics):
        fixed_state, fixed = orig(p, cfg, geom, topo, h, c_q, batch, state, numerics)
        own, last = geom.owner_index(topo.kv_owner), _published_last(geom, topo.layer)
        if topo.ratio != 2 or last == own:
            return fixed_state, fixed
        index = state.cache.index
        stale_cache = replace(state.cache, index=index[:own] + (index[last],) + index[own + 1:])
        stale_state, stale = orig(p, cfg, geom, topo, h, c_q, batch, state._replace(cache=stale_cache), numerics)
        span_start = batch.req_pos[jnp.maximum(batch.token_req, 0)]
        hit = (span_start > 0) & ((batch.positions + 1) % topo.ratio != 0)                    # [T]

        def pick(a, b, axis):  # per token row; a ratio-1 owner's score rows are wider (masked past `visible`)
            return jnp.where(hit.reshape([-1 if i == axis else 1 for i in range(a.ndim)]), b[..., : a.shape[-1]], a)
        selected = {**fixed_state.selected, topo.layer: pick(fixed_state.selected[topo.layer],
                                                             stale_state.selected[topo.layer], 0)}
        candidates = {l: pick(c, stale_state.candidates[l], 0) for l, c in fixed_state.candidates.items()}
        return (fixed_state._replace(selected=selected, candidates=candidates),
                {k: pick(v, stale[k], 1) for k, v in fixed.items()})
    return select


MUTANTS = {
    # a fake-quant site left out: the window KV rows skip their fp8 (ue8m0 / 32) QDQ
    "window_kv_fp8_skipped": lambda: _patched((attention, "fp8_act_qdq", _no_window_fp8)),
    # every top-k (index and candidate blocks: the reference's select_topk, the XLA path the CPU
    # takes; MoE gate) breaks exact ties toward the higher index
    "ties_to_higher_index": lambda: _patched((kref, "top_k", _top_k_higher_index),
                                             (moe, "top_k", _top_k_higher_index)),
    # the attention sublayer takes the other RoPE table (window <-> compressed/YaRN)
    "wrong_rope_table": lambda: _patched((attention, "rope_cos_sin", _swapped_rope_table)),
    # the attention sink left out of the softmax denominator
    "sink_left_out": lambda: _patched((attention, "sparse_attn", _no_sink)),
    # a REINDEX layer scores every row instead of only those inside the candidate blocks
    "candidate_mask_skipped": lambda: _patched((attention, "candidate_mask", _no_candidate_mask)),
    # the released decode path: stale index keys on decode steps that complete no ratio-2 group
    "decode_fix_reverted": lambda: _patched((step, "_select", _stale_index_keys)),
}
CACHE_PATH = frozenset({"decode_fix_reverted"})
