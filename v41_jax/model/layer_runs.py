"""Runs of identical layers, stacked and scanned: the layer stack compiled once per distinct layer
rather than once per layer (docs/DESIGN.md, "Scanned layer runs").

Unrolled, every layer is traced and compiled as its own copy, so compile time grows linearly
with depth (~1 s per layer for a GPU decode bucket of the released config). Most layers of the
released stack are REUSE layers that differ only in their weights and their window ring: 30 of
its 40 layers sit in 8 runs (3-7, 9-13, 15-19, 21-23, 25-27, 29-31, 33-35, 37-39). A run's
weights stacked on a leading axis let `run_layers` (model/forward.py) `lax.scan` one traced block
over them; the layer index inside the scan is a traced int32, used only where a REUSE or WINDOW
layer uses it (the cached step's window ring).

A run: at least two consecutive backbone layers with the same topology fields other than the
index (ratio, mode, kv owner, top-k owner, candidates), none of them a kv owner, an index
source or an Engram layer (their publishing is keyed by the layer id), the same MoE width and the
same parameter shapes. DSpark taps may fall inside a run (the scan returns every layer's input
mean; the taps are picked from it).

The routed experts of a run stay one [L, E, ...] stack read in place by the MoE kernels
(`kernels_pallas.moe.routed_pairs(stack_index=)`): slicing a layer's experts out inside the
loop would copy them every step. The other weights are the scan's per-layer slices.

API
  layer_runs(cfg, params=None) -> tuple[range, ...]   the runs, in layer order (shapes checked
      when params are given)
  stack_runs(params, cfg) -> params with params["runs"] = {first layer: block params stacked on
      axis 0} and params["layers"][l] = None for every l inside a run
  run_at(params, layer) -> (first, stacked) of the run holding `layer`, or None
  layer_params(params, layer) -> that layer's block params (a static slice of its run's stack)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from v41_jax.topology import LayerTopology, Mode, resolve_topology

if TYPE_CHECKING:
    from v41_jax.config import ModelConfig

RUNS_KEY = "runs"


def _signature(topo: LayerTopology, cfg: ModelConfig):
    """What must be equal along a run, or None for a layer that cannot be in one."""
    if topo.is_draft or topo.engram or topo.mode not in (Mode.WINDOW, Mode.REUSE):
        return None
    return (topo.ratio, topo.mode, topo.kv_owner, topo.topk_owner, topo.candidates,
            cfg.moe_experts(topo.layer))


def _shapes(block: dict):
    return jax.tree.structure(block), tuple((a.shape, a.dtype) for a in jax.tree.leaves(block))


def layer_runs(cfg: ModelConfig, params: dict | None = None) -> tuple[range, ...]:
    """Maximal runs of >= 2 consecutive layers with one signature (and, given params, one
    parameter tree of the same shapes and dtypes)."""
    topology = resolve_topology(cfg)[: cfg.n_layers]
    key = lambda l: (_signature(topology[l], cfg),
                     None if params is None else _shapes(params["layers"][l]))
    runs, start = [], 0
    for layer in range(1, cfg.n_layers + 1):
        if layer < cfg.n_layers and _signature(topology[layer], cfg) is not None \
                and key(layer) == key(start):
            continue
        if _signature(topology[start], cfg) is not None and layer - start >= 2:
            runs.append(range(start, layer))
        start = layer
    return tuple(runs)


def stack_runs(params: dict, cfg: ModelConfig) -> dict:
    """params (per-layer list, as loaded) -> the scanned layout. Stacking copies each run's
    weights once (a run's worth of extra memory at a time, freed as the caller drops the list)."""
    if RUNS_KEY in params:
        return params
    layers = list(params["layers"])
    stacked = {}
    for run in layer_runs(cfg, params):
        stacked[run.start] = jax.tree.map(lambda *a: jnp.stack(a), *(layers[l] for l in run))
        for l in run:
            layers[l] = None
    return {**params, "layers": layers, RUNS_KEY: stacked}


def run_at(params: dict, layer: int) -> tuple[int, dict] | None:
    for first, stacked in params.get(RUNS_KEY, {}).items():
        if first <= layer < first + jax.tree.leaves(stacked)[0].shape[0]:
            return first, stacked
    return None


def layer_params(params: dict, layer: int) -> dict:
    if params["layers"][layer] is not None:
        return params["layers"][layer]
    first, stacked = run_at(params, layer)
    return jax.tree.map(lambda a: a[layer - first], stacked)
