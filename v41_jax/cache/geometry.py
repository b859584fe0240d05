"""CSA2 cache geometry: the one authority for every region's shape, dtype, byte count and address.

The cache has two currencies (docs/CACHE.md §1):

* PAGE: a page id names, for every KV owner (FULL layer) of ratio r, `B/r` compressed main rows
  and `B/r` index-key rows (B = page tokens). Region-major byte layout: first the main-page
  region (`P x page_bytes`, page-major, one field per owner inside a page, each field aligned),
  then one dense index plane per owner (`[P, B/r, index_row]`, each plane aligned to 256).
  Page 0 is the null page: never handed to a request, padding points at it.
* STATE: one fixed-size entry per request slot, entry-major after the PAGE boundary. Fields, in
  order, each aligned: the window rings of every layer (`[L_win, W + S, row]`; draft stages
  included when speculating, S = draft slack), the fp32 compressor rings of the owners that pool
  more than one token (`[n_ring_owners, max_ratio + S, head_dim]`, raw projections then gate
  scores), the Engram cursor (`[H + 1]` = committed position, last H compressed ids), and the
  token last sampled for the slot, then (speculating) the draft block drafted after it (int32
  `[1 + block]`: a step launched before they reached the host reads its input tokens there).

Field set: ATOM's "v2" (rings, not tails; docs/CACHE.md §1.5) with one deliberate difference:
only the ratio > 1 owners get compressor rings; a ratio-1 owner's group is always complete inside
a step, so ATOM's ring for it is never read. Per slot that is `2 * comp_ring * head_dim * 4` bytes less
than ATOM's figure (8,192 B for V4.1-Flash at S = 0: 5,268,480 vs 5,276,672).

Everything that allocates, addresses, zeroes, images or budgets the cache reads `CacheGeometry`;
the device arrays (`array_specs`) and the flat byte image (`*_address`, `to_image`) are two views
of the same numbers.

Run `python -m v41_jax.cache.geometry --config C [--page-tokens B ...]` for the byte budget.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Mapping

import jax
import numpy as np

from v41_jax.config import ModelConfig, exit_2_on_refusal
from v41_jax.numerics import Numerics
from v41_jax.quant import FP4_GROUP, packed_fp4_row_bytes, packed_fp8_row_bytes
from v41_jax.topology import Mode, resolve_topology

# Row formats (docs/CACHE.md §1.3). "bf16"/"f32" rows are typed arrays; packed rows are uint8 bytes
# whose encodings the packed kernels own.
KV_FORMATS = ("bf16", "f32", "packed")
INDEX_FORMATS = ("bf16", "f32", "fp8", "fp4")
# the packed index format the step reads and writes (`quant.pack_fp4_ue8m0_rows`: the fp4 grid the
# model puts index keys on, held exactly in a quarter of bf16's bytes); "fp8" is laid out only
INDEX_PACKED = "fp4"
# main and window rows packed (main FP4 with E4M3 scales, window FP8 with E8M0 scales: the grids
# the model's round trips put them on, so held exactly)
KV_PACKED = "packed"
_TYPED = {"bf16": np.dtype(jax.numpy.bfloat16), "f32": np.dtype(np.float32)}
_U8 = np.dtype(np.uint8)
_F32 = np.dtype(np.float32)
_CURSOR_DTYPE = np.dtype(np.int32)  # positions < 2^31 and compressed ids fit; jax x64 stays off
_PLANE_ALIGN = 256  # index planes, state fields and regions start on 256 bytes


def typed_format(dtype) -> str:
    """The typed row format ("bf16" / "f32") that holds `dtype` values exactly."""
    for name, dt in _TYPED.items():
        if np.dtype(dtype) == dt:
            return name
    raise ValueError(f"no typed row format holds {np.dtype(dtype).name}; typed formats: {sorted(_TYPED)}")


def row_formats(numerics: Numerics, index_format: str | None = None, kv_format: str | None = None) -> dict:
    """EngineSettings' kv_format / index_format for these numerics: rows the step reads back
    exactly, in the activation dtype. index_format / kv_format: None or "typed" for that, or a
    format name (INDEX_PACKED: packed FP4 index rows, 15 % less cache for a scoring kernel up to
    21 % slower on the H200, BENCHMARKS.md 2026-12-04 e; KV_PACKED: main rows FP4 and window rows
    FP8, 0.28 / 0.52 of bf16's bytes; the step refuses what it cannot read back exactly)."""
    typed = typed_format(numerics.act_dtype)
    pick = lambda fmt: typed if fmt in (None, "typed") else fmt
    return dict(kv_format=pick(kv_format), index_format=pick(index_format))


def _align(n: int, a: int) -> int:
    return -(-n // a) * a


def main_row_bytes(fmt: str, d: int) -> int:
    """Compressed main row of d lanes: typed, or packed FP4 (d/2 E2M1 bytes + d/16 E4M3 scales)."""
    return d * _TYPED[fmt].itemsize if fmt in _TYPED else packed_fp4_row_bytes(d)


def window_row_bytes(fmt: str, d: int) -> int:
    """Window row of d lanes: typed, or packed FP8 (d E4M3 bytes + d/32 E8M0 scales)."""
    return d * _TYPED[fmt].itemsize if fmt in _TYPED else packed_fp8_row_bytes(d)


def index_row_bytes(fmt: str, di: int) -> int:
    """Index-key row of di lanes: typed, FP8 (di bytes + one fp32 scale) or FP4 (di/2 + di/32)."""
    if fmt in _TYPED:
        return di * _TYPED[fmt].itemsize
    return di + 4 if fmt == "fp8" else di // 2 + di // FP4_GROUP


@dataclass(frozen=True)
class EngineSettings:
    """What the engine chooses; everything else in the geometry follows from it and the config."""
    page_tokens: int = 16      # B: tokens one PAGE holds, for every owner at once
    num_pages: int = 64        # P: pages in the pool, page 0 (null) included
    slots: int = 8             # N: STATE entries, one per in-flight request
    draft_slack: int = 0       # S: speculative rows; > 0 also gives the draft stages window rings
    max_context: int = 0       # tokens one request may hold; 0 = cfg.max_seq_len
    kv_format: str = "bf16"    # main and window rows
    index_format: str = "bf16"


@dataclass(frozen=True)
class Owner:
    """A FULL layer: owns compressed rows and index keys of its ratio."""
    layer: int
    ratio: int
    rows_per_page: int         # B / ratio


@dataclass(frozen=True)
class CacheGeometry:
    settings: EngineSettings
    head_dim: int              # D: main / window row lanes
    index_dim: int             # Di
    window: int                # W: logical window
    history: int               # H: Engram ids carried in the cursor
    window_layers: int         # rings per slot (backbone + draft stages when speculating)
    owners: tuple[Owner, ...]
    ring_owners: tuple[int, ...]     # indices into owners that pool > 1 token (get compressor rings)
    comp_ring: int             # compressor ring rows, one width for all ring owners: max ratio + S
    sampled_width: int         # the slot's next input tokens: the sampled one, then the draft block
    max_pages: int             # block-table width: pages for max_context tokens
    max_context: int
    # derived byte layout
    alignment: int
    page_fields: tuple[int, ...]      # byte offset of owner k's main field inside a page
    page_bytes: int
    index_planes: tuple[int, ...]     # byte offset of owner k's index plane
    boundary: int                     # end of PAGE currency = start of STATE
    state_fields: Mapping[str, int]   # byte offset of each STATE field inside a slot
    state_bytes: int

    # ---- construction ------------------------------------------------------------------
    @classmethod
    def build(cls, cfg: ModelConfig, settings: EngineSettings) -> "CacheGeometry":
        s = settings
        if s.kv_format not in KV_FORMATS or s.index_format not in INDEX_FORMATS:
            raise ValueError(f"kv_format/index_format: one of {KV_FORMATS} / {INDEX_FORMATS}")
        topo = resolve_topology(cfg)
        owners = tuple(Owner(t.layer, t.ratio, s.page_tokens // max(t.ratio, 1))
                       for t in topo if t.mode is Mode.FULL and not t.is_draft)
        for o in owners:
            if s.page_tokens % o.ratio:
                raise ValueError(f"page_tokens: {s.page_tokens} must be divisible by owner "
                                 f"{o.layer}'s ratio {o.ratio}")
        if s.page_tokens % 2:
            raise ValueError("page_tokens: must be even (docs/CACHE.md §1.2)")
        if s.num_pages < 2 or s.slots < 1 or s.draft_slack < 0:
            raise ValueError("num_pages >= 2 (page 0 is the null page), slots >= 1, draft_slack >= 0")
        max_context = s.max_context or cfg.max_seq_len
        ring_owners = tuple(k for k, o in enumerate(owners) if o.ratio > 1)
        window_layers = cfg.n_layers + (cfg.n_mtp_layers if s.draft_slack > 0 else 0)
        d, di = cfg.head_dim, cfg.index_head_dim
        packed = s.kv_format == "packed"
        alignment = _PLANE_ALIGN if packed else math.lcm(_PLANE_ALIGN, main_row_bytes(s.kv_format, d))

        # PAGE: main fields inside a page, then one index plane per owner.
        page_fields, off = [], 0
        for o in owners:
            off = _align(off, alignment)
            page_fields.append(off)
            off += o.rows_per_page * main_row_bytes(s.kv_format, d)
        page_bytes = _align(off, alignment)
        index_planes, off = [], s.num_pages * page_bytes
        for o in owners:
            off = _align(off, _PLANE_ALIGN)
            index_planes.append(off)
            off += s.num_pages * o.rows_per_page * index_row_bytes(s.index_format, di)
        boundary = _align(_align(off, _PLANE_ALIGN), alignment)

        # STATE: one slot's fields.
        field_align = max(_PLANE_ALIGN, alignment)
        comp_ring = max(owners[k].ratio for k in ring_owners) + s.draft_slack if ring_owners else 0
        sizes = {
            "window": window_layers * (cfg.window_size + s.draft_slack) * window_row_bytes(s.kv_format, d),
            "comp_kv": len(ring_owners) * comp_ring * d * _F32.itemsize,
            "comp_score": len(ring_owners) * comp_ring * d * _F32.itemsize,
            "cursor": (cfg.engram_max_ngram_size - 1 + 1) * _CURSOR_DTYPE.itemsize,
            "sampled": sampled_width(cfg, s) * _CURSOR_DTYPE.itemsize,
        }
        state_fields, off = {}, 0
        for name, size in sizes.items():
            # the sampled token shares the cursor's aligned block (it is read and written with it)
            off = _align(off, _CURSOR_DTYPE.itemsize if name == "sampled" else field_align)
            state_fields[name] = off
            off += size
        return cls(
            settings=s, head_dim=d, index_dim=di, window=cfg.window_size,
            history=cfg.engram_max_ngram_size - 1, window_layers=window_layers, owners=owners,
            ring_owners=ring_owners, comp_ring=comp_ring, sampled_width=sampled_width(cfg, s), max_pages=-(-max_context // s.page_tokens),
            max_context=max_context, alignment=alignment, page_fields=tuple(page_fields),
            page_bytes=page_bytes, index_planes=tuple(index_planes), boundary=boundary,
            state_fields=state_fields, state_bytes=_align(off, alignment))

    # ---- derived sizes -----------------------------------------------------------------
    @property
    def ring_slots(self) -> int:
        """Physical window ring rows: W + S, so a verify block never overwrites a visible row."""
        return self.window + self.settings.draft_slack

    @property
    def ratios(self) -> tuple[int, ...]:
        """Distinct owner ratios, ascending."""
        return tuple(sorted({o.ratio for o in self.owners}))

    @property
    def main_row_bytes(self) -> int:
        return main_row_bytes(self.settings.kv_format, self.head_dim)

    @property
    def window_row_bytes(self) -> int:
        return window_row_bytes(self.settings.kv_format, self.head_dim)

    @property
    def index_row_bytes(self) -> int:
        return index_row_bytes(self.settings.index_format, self.index_dim)

    @property
    def paged_bytes(self) -> int:
        """Bytes one page id names: its main fields plus its rows in every index plane."""
        return self.page_bytes + sum(o.rows_per_page * self.index_row_bytes for o in self.owners)

    @property
    def page_bytes_per_token(self) -> float:
        return self.paged_bytes / self.settings.page_tokens

    @property
    def total_bytes(self) -> int:
        return self.boundary + self.settings.slots * self.state_bytes

    def owner_index(self, layer: int) -> int:
        """Position of a KV owner layer in `owners` (the cache's owner axis)."""
        for k, o in enumerate(self.owners):
            if o.layer == layer:
                return k
        raise KeyError(f"layer {layer} owns no compressed rows")

    def ring_index(self, layer: int) -> int:
        """Position of a ratio > 1 owner on the compressor-ring axis."""
        return self.ring_owners.index(self.owner_index(layer))

    def pages_for(self, tokens: int) -> int:
        """Pages a request holding `tokens` positions needs."""
        return -(-tokens // self.settings.page_tokens)

    # ---- the device arrays ---------------------------------------------------------------
    def array_specs(self) -> dict:
        """Shape and dtype of every cache array, keyed like the `Cache` fields."""
        s, d, di = self.settings, self.head_dim, self.index_dim
        kv = _TYPED.get(s.kv_format)
        ix = _TYPED.get(s.index_format)
        main_row = (d,) if kv is not None else (self.main_row_bytes,)
        index_row = (di,) if ix is not None else (self.index_row_bytes,)
        window_row = (d,) if kv is not None else (self.window_row_bytes,)
        sds = jax.ShapeDtypeStruct
        return {
            "main": tuple(sds((s.num_pages, o.rows_per_page, *main_row), kv or _U8) for o in self.owners),
            "index": tuple(sds((s.num_pages, o.rows_per_page, *index_row), ix or _U8) for o in self.owners),
            "window": sds((s.slots, self.window_layers, self.ring_slots, *window_row), kv or _U8),
            "comp_kv": sds((s.slots, len(self.ring_owners), self.comp_ring, d), _F32),
            "comp_score": sds((s.slots, len(self.ring_owners), self.comp_ring, d), _F32),
            "cursor": sds((s.slots, self.history + 1), _CURSOR_DTYPE),
            "sampled": sds((s.slots, self.sampled_width), _CURSOR_DTYPE),
        }

    # ---- flat byte addresses (docs/CACHE.md §1.7) --------------------------------------------
    def main_row_address(self, owner: int, page: int, row: int) -> int:
        return page * self.page_bytes + self.page_fields[owner] + row * self.main_row_bytes

    def index_row_address(self, owner: int, page: int, row: int) -> int:
        o = self.owners[owner]
        return self.index_planes[owner] + (page * o.rows_per_page + row) * self.index_row_bytes

    def slot_address(self, slot: int) -> int:
        return self.boundary + slot * self.state_bytes

    def window_row_address(self, slot: int, layer: int, position: int) -> int:
        return (self.slot_address(slot) + self.state_fields["window"]
                + (layer * self.ring_slots + position % self.ring_slots) * self.window_row_bytes)

    def ring_row_address(self, field: str, ring_owner: int, slot: int, position: int) -> int:
        """field: "comp_kv" or "comp_score"; ring_owner: index on the ring axis."""
        row = ring_owner * self.comp_ring + position % self.comp_ring
        return self.slot_address(slot) + self.state_fields[field] + row * self.head_dim * _F32.itemsize

    def cursor_address(self, slot: int) -> int:
        return self.slot_address(slot) + self.state_fields["cursor"]

    # ---- the byte image (checkpoint images, interop, and the test that both views agree) ----
    def to_image(self, cache) -> np.ndarray:
        """The whole cache as one uint8[total_bytes] laid out as docs/CACHE.md §1.4, §1.5."""
        img = np.zeros(self.total_bytes, np.uint8)
        for view, arr in self._views(img, cache):
            view[...] = np.asarray(arr).view(np.uint8).reshape(view.shape)
        return img

    def from_image(self, img: np.ndarray) -> dict:
        """Host arrays (numpy) of every cache field read back from an image."""
        out = {k: (tuple(np.zeros(s.shape, s.dtype) for s in v) if isinstance(v, tuple)
                   else np.zeros(v.shape, v.dtype)) for k, v in self.array_specs().items()}
        for view, arr in self._views(img, out):
            arr.view(np.uint8).reshape(view.shape)[...] = view
        return out

    def _views(self, img: np.ndarray, cache):
        """(byte view into img, the cache array it holds) for every field."""
        s = self.settings
        pages = img[: s.num_pages * self.page_bytes].reshape(s.num_pages, self.page_bytes)
        for k, o in enumerate(self.owners):
            n = o.rows_per_page * self.main_row_bytes
            yield pages[:, self.page_fields[k]: self.page_fields[k] + n], _get(cache, "main")[k]
            n = s.num_pages * o.rows_per_page * self.index_row_bytes
            yield img[self.index_planes[k]: self.index_planes[k] + n], _get(cache, "index")[k]
        slots = img[self.boundary:].reshape(s.slots, self.state_bytes)
        for name in ("window", "comp_kv", "comp_score", "cursor", "sampled"):
            arr = _get(cache, name)
            n = int(np.prod(arr.shape[1:])) * np.dtype(arr.dtype).itemsize
            yield slots[:, self.state_fields[name]: self.state_fields[name] + n], arr

    def summary(self) -> str:
        s = self.settings
        lines = [
            f"kv {s.kv_format} / index {s.index_format}, page {s.page_tokens} tokens, "
            f"{s.num_pages} pages, {s.slots} slots, draft slack {s.draft_slack}",
            f"owners (layer:ratio): {', '.join(f'{o.layer}:{o.ratio}' for o in self.owners)}",
            f"PAGE: page_bytes (main) {self.page_bytes:,} B, paged_bytes (main+index) "
            f"{self.paged_bytes:,} B, per token {self.page_bytes_per_token:,.1f} B",
            f"STATE: {self.window_layers} rings x {self.ring_slots} rows, compressor rings "
            f"{len(self.ring_owners)} owners x {self.comp_ring} rows; per slot {self.state_bytes:,} B "
            f"(fields at {dict(self.state_fields)})",
            f"total: boundary {self.boundary:,} B + {s.slots} x {self.state_bytes:,} B = "
            f"{self.total_bytes:,} B",
        ]
        return "\n".join(lines)


def sampled_width(cfg: ModelConfig, settings: EngineSettings) -> int:
    """Tokens a slot keeps for its next span: the one last sampled, and when the geometry
    reserves the draft slack (speculating, with draft stages) the block drafted after it."""
    return 1 + (cfg.dspark_block_size if settings.draft_slack > 0 and cfg.n_mtp_layers else 0)


def _get(cache, name):
    return cache[name] if isinstance(cache, Mapping) else getattr(cache, name)


@exit_2_on_refusal
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True, help="config.json (any accepted layout) or checkpoint dir")
    p.add_argument("--page-tokens", type=int, default=256)
    p.add_argument("--num-pages", type=int, default=64)
    p.add_argument("--slots", type=int, default=64)
    p.add_argument("--draft-slack", type=int, default=0)
    p.add_argument("--kv-format", default="bf16", choices=KV_FORMATS)
    p.add_argument("--index-format", default="bf16", choices=INDEX_FORMATS)
    a = p.parse_args(argv)
    cfg = ModelConfig.from_file(a.config)
    geom = CacheGeometry.build(cfg, EngineSettings(
        page_tokens=a.page_tokens, num_pages=a.num_pages, slots=a.slots, draft_slack=a.draft_slack,
        kv_format=a.kv_format, index_format=a.index_format))
    print(geom.summary())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
