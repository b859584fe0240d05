"""CacheGeometry: byte budgets against docs/CACHE.md §1, and the array view agreeing with the flat
address formulas (docs/CACHE.md INV-8: one authority for allocated and addressed bytes)."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from v41_jax.cache.geometry import CacheGeometry, EngineSettings
from v41_jax.config import ModelConfig

ROOT = Path(__file__).resolve().parents[1]
RELEASED = ROOT / "v41_jax/configs/deepseek_v41_flash.config.json"
SMALL_B = ROOT / "tests/fixtures/dsv41_official/small_b/checkpoint/config.json"

# The ratio-1 owner's compressor rings, which ATOM's v2 field set allocates and ours does not
# (its one-token groups are always complete inside a step): 2 fields x comp_ring x 512 x fp32.
def _ratio1_rings(comp_ring: int) -> int:
    return 2 * comp_ring * 512 * 4


@pytest.fixture(scope="module")
def released():
    return ModelConfig.from_file(RELEASED)


def _geom(cfg, **kw):
    kw.setdefault("page_tokens", 256)
    return CacheGeometry.build(cfg, EngineSettings(**kw))


@pytest.mark.parametrize("kv,index,per_token,page", [
    ("bf16", "bf16", 3200, None),         # docs/CACHE.md §1.4 bf16/bf16
    ("bf16", "fp8", 2890, 739_840),       # docs/CACHE.md §1.4, B=256
    ("bf16", "fp4", 2730, 698_880),       # docs/CACHE.md §1.4: (1024 + 68) * 2.5 = 2730 (--index-format fp4)
    ("packed", "fp4", 890, 227_840),      # docs/CACHE.md §1.4: (288 + 68) * 2.5 = 890
])
def test_page_bytes_per_token(released, kv, index, per_token, page):
    g = _geom(released, kv_format=kv, index_format=index)
    assert g.page_bytes_per_token == per_token
    if page is not None:
        assert g.paged_bytes == page
    # main rows per page = 2.5 B: 3 ratio-2 owners x B/2 + 1 ratio-1 owner x B
    assert sum(o.rows_per_page for o in g.owners) == 640


@pytest.mark.parametrize("b,paged", [(16, 46_240), (32, 92_480)])
def test_small_pages_bf16_fp8(released, b, paged):
    assert _geom(released, page_tokens=b, index_format="fp8").paged_bytes == paged


@pytest.mark.parametrize("kv,slack,atom_v2", [
    ("bf16", 0, 5_276_672),     # docs/CACHE.md §1.5 (ATOM's v2): 40 rings x 128, comp ring 2
    ("bf16", 5, 5_971_968),     # 43 rings x 133, comp ring 7
    ("packed", 0, 2_736_384),
])
def test_state_bytes_per_slot(released, kv, slack, atom_v2):
    g = _geom(released, kv_format=kv, draft_slack=slack)
    assert g.window_layers == (43 if slack else 40) and g.ring_slots == 128 + slack
    assert g.comp_ring == 2 + slack and len(g.ring_owners) == 3
    # Ours is ATOM's v2 figure less the ratio-1 owner's rings (5,268,480 B for BF16 S=0).
    assert g.state_bytes == atom_v2 - _ratio1_rings(g.comp_ring)


def test_total_and_alignment(released):
    for pages in (63, 64):
        g = _geom(released, index_format="fp8", num_pages=pages, slots=3)
        # docs/CACHE.md §1.6: boundary = align_up(739,840 P, 1024) (adds 512 B when P is odd)
        assert g.boundary == -(-739_840 * pages // 1024) * 1024
        assert g.total_bytes == g.boundary + 3 * g.state_bytes
        assert g.boundary % g.alignment == 0 and g.state_bytes % g.alignment == 0
        assert g.index_planes[0] == 655_360 * pages


def test_array_specs_sum_to_accounted_bytes(released):
    g = _geom(released, page_tokens=16, num_pages=8, slots=2)
    specs = g.array_specs()
    leaves = [*specs["main"], *specs["index"], specs["window"], specs["comp_kv"],
              specs["comp_score"], specs["cursor"], specs["sampled"]]
    arrays = sum(int(np.prod(s.shape)) * s.dtype.itemsize for s in leaves)
    # For these widths every region is already aligned except the 16-byte cursor and the 4-byte
    # sampled token after it at the end of each slot, padded together to the 1024-byte alignment:
    # nothing else is unaccounted for.
    assert g.total_bytes - arrays == 2 * (g.alignment - 16 - 4)


def test_image_addresses_match_arrays():
    """Write distinct bytes into every array; each address formula must find its own row."""
    cfg = ModelConfig.from_file(SMALL_B)
    g = CacheGeometry.build(cfg, EngineSettings(page_tokens=8, num_pages=5, slots=3, draft_slack=2))
    rng = np.random.default_rng(0)
    specs = g.array_specs()

    def rand(s):
        return rng.integers(0, 255, int(np.prod(s.shape)) * s.dtype.itemsize, np.uint8).view(s.dtype).reshape(s.shape)

    cache = {k: tuple(map(rand, v)) if isinstance(v, tuple) else rand(v) for k, v in specs.items()}
    img = g.to_image(cache)
    assert img.size == g.total_bytes

    def at(addr, arr_row):
        b = np.ascontiguousarray(arr_row).view(np.uint8).ravel()
        return np.array_equal(img[addr: addr + b.size], b)

    for k, o in enumerate(g.owners):
        for page, row in ((0, 0), (4, o.rows_per_page - 1), (2, 1)):
            assert at(g.main_row_address(k, page, row), cache["main"][k][page, row])
            assert at(g.index_row_address(k, page, row), cache["index"][k][page, row])
    for slot, layer, pos in ((0, 0, 0), (2, g.window_layers - 1, 57), (1, 3, g.ring_slots)):
        assert at(g.window_row_address(slot, layer, pos), cache["window"][slot, layer, pos % g.ring_slots])
    for field in ("comp_kv", "comp_score"):
        for j in range(len(g.ring_owners)):
            for slot, pos in ((0, 0), (2, 9)):
                assert at(g.ring_row_address(field, j, slot, pos), cache[field][slot, j, pos % g.comp_ring])
    assert at(g.cursor_address(2), cache["cursor"][2])

    back = g.from_image(img)
    for k in ("window", "comp_kv", "comp_score", "cursor", "sampled"):
        assert np.array_equal(back[k].view(np.uint8), cache[k].view(np.uint8))
    for k in ("main", "index"):
        for a, b in zip(back[k], cache[k]):
            assert np.array_equal(a.view(np.uint8), b.view(np.uint8))


def test_refuses_bad_settings(released):
    with pytest.raises(ValueError, match="page_tokens"):
        _geom(released, page_tokens=7)
    with pytest.raises(ValueError, match="num_pages"):
        _geom(released, num_pages=1)


def test_cli_prints_budget():
    out = subprocess.run([sys.executable, "-m", "v41_jax.cache.geometry", "--config", str(RELEASED)],
                         capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert "per token 3,200.0 B" in out and "per slot 5,268,480 B" in out
