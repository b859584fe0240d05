"""The full-sequence forward: whole sequences from position 0, no cache. The oracle for the cache path.

API
  forward(params, cfg, tokens [B, S], *, numerics, engram_rows=None, image_mask=None,
          forced=None, return_intermediates=False) -> logits fp32 [B, S, V]  (, intermediates)
      engram_rows: {engram layer id: bf16 [B, S, cols, hd]} gathered on the host
      (`engram.sequence_rows`); required when the config has Engram layers.
      image_mask: [B, S] bool, True inside image spans (MoE bias_vl, Engram gate closed).
      forced: teacher forcing for checking against a reference whose selections may differ at
      near-ties: {"index_topk": {l: [B, S, K]}, "candidate_blocks": {l: [B, S, Kb]},
      "gate_topk": {l: [B, S, k]}} (any subset; ids as the official fixtures record them). The
      forced picks are attended / routed; the intermediates still report the model's own picks.
      jit with cfg, numerics and return_intermediates static.
  force_picks(candidates, selected, layer, forced) -> (candidates, selected)
      the forcing rule on a layer's published picks, shared with the cached step.
  intermediates (dicts keyed by layer id):
      block_out [L, B, S, N, D]   each block's output streams
      next_pre [L, B, S, N]       the pre-mix each block hands on
      engram_out {l: [B, S, N, D]} streams after the Engram module (before block l)
      final_collapsed, final_normed [B, S, D]
      main_hidden [B, S, nT * D]  DSpark input: mean over streams of each target layer's input
      index_topk {l: [B, S, K']}  compressed rows picked by each index source (ascending, -1 = none)
      index_scores {l: [B, S, N]} the scores those picks were taken from (candidate mask applied)
      candidate_blocks {l: [B, S, Kb']}   blocks kept by the candidate source (ascending, -1 = dropped)
      gate_topk {l: [B, S, k]}    routed experts, selection order
      gate_scores {l: [B, S, E]}  the scores they were selected by (bias included)
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from v41_jax.model.attention import AttnContext, empty_context, full_attention
from v41_jax.model.block import BlockOut, block
from v41_jax.model.engram import engram
from v41_jax.model.head import final_hidden, lm_head
from v41_jax.model.layer_runs import RUNS_KEY, layer_params
from v41_jax.model.mhc import Collapsed, input_collapse, one_hot_pre, stream_mean
from v41_jax.model.numerics import Numerics
from v41_jax.topology import LayerTopology, Mode, resolve_topology

if TYPE_CHECKING:
    from v41_jax.config import ModelConfig


def embed(params: dict, tokens: jax.Array, hc: int, numerics: Numerics) -> jax.Array:
    """Token embeddings copied onto every stream -> [B, S, N, D]."""
    e = numerics.act(params["embed"]["weight"][tokens])
    return jnp.broadcast_to(e[..., None, :], (*e.shape[:-1], hc, e.shape[-1]))


def fit_ids(ids: jax.Array, width: int) -> jax.Array:
    """Selected ids in any order with -1 anywhere -> ascending, -1 after, `width` columns."""
    big = jnp.iinfo(jnp.int32).max
    ids = jnp.sort(jnp.where(ids < 0, big, ids.astype(jnp.int32)), axis=-1)
    ids = jnp.pad(ids, [(0, 0)] * (ids.ndim - 1) + [(0, max(0, width - ids.shape[-1]))], constant_values=big)
    return jnp.where(ids == big, -1, ids[..., :width])


def force_picks(candidates: dict, selected: dict, layer: int, forced: dict) -> tuple[dict, dict]:
    """Teacher forcing, for the forward and the cached step alike: the picks `layer` published
    (candidate blocks by source layer, top-k by owner) -> the forced ones where `forced` has them,
    fitted to the published width and shape (the step keeps a unit query axis the forced lack)."""
    def fit(table: dict, kind: str) -> dict:
        if layer not in table or layer not in forced.get(kind, {}):
            return table
        own = table[layer]
        return {**table, layer: fit_ids(forced[kind][layer], own.shape[-1]).reshape(own.shape)}
    return fit(candidates, "candidate_blocks"), fit(selected, "index_topk")


def _attend(p: dict, cfg: ModelConfig, topo: LayerTopology, h: jax.Array, ctx: AttnContext,
            numerics: Numerics, forced: dict | None) -> tuple[jax.Array, tuple[AttnContext, dict]]:
    """One attention sublayer -> (out, (context for the next layers, this layer's own picks))."""
    out, ctx, own = full_attention(p, cfg, topo, h, ctx, numerics)
    if forced is None or not topo.scores or topo.layer not in ctx.selected:  # (a scanned layer's id is traced)
        return out, (ctx, own)
    # attend again with the forced picks: as a REUSE layer of itself, reading what it published
    candidates, selected = force_picks(ctx.candidates, ctx.selected, topo.layer, forced)
    out, ctx, _ = full_attention(p, cfg, dataclasses.replace(topo, mode=Mode.REUSE), h,
                                 ctx._replace(candidates=candidates, selected=selected), numerics)
    return out, (ctx, own)


PICK_KINDS = ("index_topk", "index_scores", "candidate_blocks", "gate_topk", "gate_scores")


def run_layers(params: dict, cfg: ModelConfig, x: jax.Array, pre: jax.Array, carry, attend, numerics: Numerics,
               *, engram_rows: dict | None = None, image_mask: jax.Array | None = None,
               forced_gates: dict | None = None):
    """The layer stack shared by `forward` and the cached step (`runtime.step`): Engram before its
    block, the drafter's taps, the blocks; the two differ only in how a layer attends. Params in
    the scanned layout (`layer_runs.stack_runs`) run each stacked run as one `lax.scan`.

    x [B, S, N, D], pre [B, S, N]; attend(p_attn, topo, h, carry) -> (out, (carry, picks)), picks =
    this layer's own selections {kind: [B, S, ...]}; engram_rows {layer: [B, S, cols, hd]};
    forced_gates {layer: [B, S, k]}. -> (x, collapsed (`mhc.Collapsed`: x collapsed by the last
    block's pre, the head's input), carry, intermediates: every one `forward` documents but the
    final hidden states). Each block hands the next its input's collapse (`BlockOut.collapsed`)
    unless an Engram module rewrites the streams between them."""
    topology = resolve_topology(cfg)
    token_mask = None if image_mask is None else ~image_mask
    forced_gates = forced_gates or {}
    inter: dict = {"block_out": [], "next_pre": [], "engram_out": {}, **{k: {} for k in PICK_KINDS}}
    taps = []

    def record(layer: int, out: BlockOut, tap: jax.Array) -> None:
        if layer in cfg.dspark_target_layer_ids:
            taps.append(tap)  # the drafter reads the block's input, not its output
        inter["block_out"].append(out.x)
        inter["next_pre"].append(out.pre)
        inter["gate_topk"][layer] = out.gate_idx
        inter["gate_scores"][layer] = out.gate_scores
        for kind, ids in out.attn_aux[1].items():
            inter[kind][layer] = ids

    runs = params.get(RUNS_KEY, {})
    layer, collapsed = 0, None
    while layer < cfg.n_layers:
        if layer in runs:
            x, pre, collapsed, carry, outs = _scan_run(runs[layer], cfg, topology[layer], x, pre, collapsed, carry,
                                                       attend, numerics, image_mask, forced_gates)
            for j, (out, tap) in enumerate(outs):
                record(layer + j, out, tap)
            layer += len(outs)
            continue
        topo, p = topology[layer], layer_params(params, layer)
        if topo.engram:
            x = engram(p["engram"], cfg, x, engram_rows[layer], numerics, token_mask)
            inter["engram_out"][layer] = x
            collapsed = None
        tap = stream_mean(x) if layer in cfg.dspark_target_layer_ids else None
        out = block(p, cfg, layer, x, pre, lambda h, p=p, topo=topo, carry=carry: attend(p["attn"], topo, h, carry),
                    numerics, image_mask, forced_gates.get(layer), collapsed=collapsed)
        x, pre, carry, collapsed = out.x, out.pre, out.attn_aux[0], out.collapsed
        record(layer, out, tap)
        layer += 1
    inter.update(block_out=jnp.stack(inter["block_out"]), next_pre=jnp.stack(inter["next_pre"]),
                 main_hidden=jnp.concatenate(taps, -1) if taps else None)
    return x, collapsed, carry, inter


def _scan_run(stacked: dict, cfg: ModelConfig, first: LayerTopology, x: jax.Array, pre: jax.Array,
              collapsed: Collapsed | None, carry, attend, numerics: Numerics, image_mask: jax.Array | None,
              forced_gates: dict):
    """One stacked run (model/layer_runs.py) as a `lax.scan` over its layers: the block traced once,
    the layer index traced (the window ring's), the routed experts read in place from the stack.
    -> (x, pre, collapsed, carry, per layer (BlockOut with attn_aux = (None, picks) and no
    collapsed, its input's stream mean))."""
    n = jax.tree.leaves(stacked)[0].shape[0]
    layers = range(first.layer, first.layer + n)
    forced = [forced_gates[l] for l in layers if l in forced_gates]
    if forced and len(forced) != n:
        raise ValueError(f"forced gates on part of the scanned run of layers {layers.start}-{layers.stop - 1}; "
                         "pass the per-layer params (without `layer_runs.stack_runs`)")
    experts = stacked["ffn"]["experts"]
    per_layer = {**stacked, "ffn": {k: v for k, v in stacked["ffn"].items() if k != "experts"}}

    def body(c, xs):
        x, pre, collapsed, carry = c
        p, j, gate = xs
        p = {**p, "ffn": {**p["ffn"], "experts": experts}}
        topo = dataclasses.replace(first, layer=first.layer + j)
        out = block(p, cfg, first.layer, x, pre, lambda h: attend(p["attn"], topo, h, carry), numerics,
                    image_mask, gate, expert_layer=j, collapsed=collapsed)
        carry, picks = out.attn_aux
        return (out.x, out.pre, out.collapsed, carry), (out._replace(attn_aux=(None, picks), collapsed=None),
                                                         stream_mean(x))

    # the carry's structure is fixed before the loop: a fresh input's collapse with the sums where
    # the blocks hand them on
    start = input_collapse(x, pre, numerics) if collapsed is None else collapsed
    (x, pre, collapsed, carry), (outs, taps) = jax.lax.scan(
        body, (x, pre, start, carry), (per_layer, jnp.arange(n, dtype=jnp.int32), jnp.stack(forced) if forced else None))
    return x, pre, collapsed, carry, [(jax.tree.map(lambda a: a[j], outs), taps[j]) for j in range(n)]


def forward(params: dict, cfg: ModelConfig, tokens: jax.Array, *, numerics: Numerics,
            engram_rows: dict | None = None, image_mask: jax.Array | None = None,
            forced: dict | None = None, return_intermediates: bool = False):
    numerics = numerics.for_model(cfg.quantized)
    x = embed(params, tokens, cfg.hc_mult, numerics)
    pre = one_hot_pre(tokens.shape, cfg.hc_mult)
    attend = lambda p, topo, h, ctx: _attend(p, cfg, topo, h, ctx, numerics, forced)
    x, collapsed, _, inter = run_layers(params, cfg, x, pre, empty_context(), attend, numerics,
                                  engram_rows=engram_rows, image_mask=image_mask,
                                  forced_gates=None if forced is None else forced.get("gate_topk"))
    collapsed, normed = final_hidden(params, cfg, collapsed, numerics)
    logits = lm_head(params["head"]["weight"], normed)
    if not return_intermediates:
        return logits
    inter.update(final_collapsed=collapsed, final_normed=normed)
    return logits, inter
