"""Per-layer CSA2 attention topology, resolved once from the config (docs/MODEL.md §1.2).

Every non-zero-ratio layer reads the compressed KV of the most recent KV source with the same
ratio (its kv owner, which also owns the index keys) and the top-k of the most recent index source
at or after that owner. Nothing else in the code base re-derives these facts.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from .config import ModelConfig


class Mode(enum.Enum):
    WINDOW = "WINDOW"    # sliding window only
    FULL = "FULL"        # kv owner: compressor + index keys + own indexer
    REINDEX = "REINDEX"  # own indexer over the kv owner's index keys, inside the candidate blocks
    REUSE = "REUSE"      # top-k of its top-k owner, own query


class Candidates(enum.Enum):
    NONE = "-"
    PRODUCE = "produce"  # the candidate source: publishes candidate blocks, itself unrestricted
    CONSUME = "consume"  # bound by the candidate source's blocks (matters where it scores: REINDEX)


@dataclass(frozen=True)
class LayerTopology:
    layer: int
    ratio: int                 # 0, 1 or 2
    mode: Mode
    kv_owner: int | None       # owner of the compressed rows and of the index keys
    topk_owner: int | None     # layer whose selection this layer attends with
    candidates: Candidates
    is_draft: bool             # a DSpark stage (mtp.{layer - n_layers})
    engram: bool               # Engram applied to the residual before this block

    @property
    def rope_global(self) -> bool:
        """Compressed layers use the compress-theta + YaRN table for everything (docs/MODEL.md §3.1)."""
        return self.ratio > 0

    @property
    def scores(self) -> bool:
        """Runs its own indexer (FULL and REINDEX)."""
        return self.mode in (Mode.FULL, Mode.REINDEX)


def resolve_topology(cfg: ModelConfig) -> tuple[LayerTopology, ...]:
    """One LayerTopology per layer, backbone then draft stages. Assumes `validate(cfg)` passed."""
    kv_sources = set(cfg.kv_source_layers)
    index_sources = set(cfg.index_source_layers)
    engram = set(cfg.engram_layer_ids)
    cand = cfg.candidate_source_layer
    out = []
    kv_owner_by_ratio: dict[int, int] = {}
    topk_owner_by_ratio: dict[int, int] = {}
    for layer, ratio in enumerate(cfg.compress_ratios):
        is_draft = layer >= cfg.n_layers
        if ratio == 0:
            out.append(LayerTopology(layer, 0, Mode.WINDOW, None, None, Candidates.NONE,
                                     is_draft, layer in engram))
            continue
        if layer in kv_sources:
            kv_owner_by_ratio[ratio] = layer
            topk_owner_by_ratio.pop(ratio, None)
        if layer in index_sources:
            topk_owner_by_ratio[ratio] = layer
        kv_owner = kv_owner_by_ratio[ratio]
        topk_owner = topk_owner_by_ratio[ratio]
        if layer == kv_owner:
            mode = Mode.FULL
        elif layer == topk_owner:
            mode = Mode.REINDEX
        else:
            mode = Mode.REUSE
        if cand >= 0 and layer == cand:
            candidates = Candidates.PRODUCE
        elif cand >= 0 and layer > cand:
            candidates = Candidates.CONSUME
        else:
            candidates = Candidates.NONE
        out.append(LayerTopology(layer, ratio, mode, kv_owner, topk_owner, candidates,
                                 is_draft, layer in engram))
    return tuple(out)
