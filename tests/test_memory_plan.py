"""The memory plan (v41_jax/tools/memory_plan.py) against hand computations on `tiny`.

tiny: D = 128, F = 64, 8 routed experts on each of 7 backbone layers, V = 512, 4 query heads of 64,
2 output groups of rank 64, q_lora 64, 4 index heads of 32 on the 3 scoring layers (1, 3, 5).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from v41_jax.config import ModelConfig
from v41_jax.tools import memory_plan as mp

ROOT = Path(__file__).resolve().parents[1]
TINY = ModelConfig.from_file(str(ROOT / "v41_jax/configs/tiny.config.json"))
LEAVES = mp.param_leaves(TINY)

# 7 layers x 8 experts x (w1 [64, 128] + w3 [64, 128] + w2 [128, 64]) weights
EXPERT_WEIGHTS = 7 * 8 * 3 * 64 * 128                 # 1,376,256
EXPERT_ROWS = 7 * 8 * (64 + 64 + 128)                  # 14,336 output rows


@pytest.mark.parametrize("fmt, full", [
    ("fp4", EXPERT_WEIGHTS // 2 + EXPERT_WEIGHTS // 32),   # E2M1 codes + one E8M0 per 32
    ("fp8", EXPERT_WEIGHTS + 4 * EXPERT_ROWS),             # E4M3 codes + one fp32 per row
    ("bf16", 2 * EXPERT_WEIGHTS),
])
@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_routed_experts_split_over_devices(fmt, full, n):
    assert mp.param_bytes(LEAVES, fmt, "dp", n)["routed_experts"] == full // n


def test_replicated_and_per_head_groups():
    dp = mp.param_bytes(LEAVES, "fp4", "dp", 2)
    tp = mp.param_bytes(LEAVES, "fp4", "tp", 2)
    assert dp["embed"] == tp["embed"] == 512 * 128 * 2           # bf16 [V, D]
    assert dp["head"] == tp["head"] == 512 * 128 * 2             # bf16 (fp32 products of bf16 values)
    # per-head attention bytes per backbone layer: sink fp32 [4], wq_b [256, 64], wo_a [128, 128],
    # wo_b [128, 128] bf16; per scoring layer indexer wq_b [128, 64] and weights_proj [4, 128] bf16
    per_head = 7 * (4 * 4 + 3 * 2 * 256 * 64) + 3 * (2 * 128 * 64 + 2 * 4 * 128)
    assert dp["attention"] - tp["attention"] == per_head // 2
    assert mp.param_bytes(LEAVES, "fp4", "dp", 1) == mp.param_bytes(LEAVES, "fp4", "tp", 1)


def test_cache_bytes_by_hand():
    """2 requests of 16 tokens, 8-token pages, bf16 rows: owners layer 1 (ratio 2, 4 rows a page)
    and layer 3 (ratio 1, 8 rows); 2 x 2 pages + the null page."""
    main = 5 * (4 * 128 + 8 * 128)                     # D = 64 bf16 rows: 128 B, fields 256-aligned
    index = 5 * 4 * 64 + 5 * 8 * 64                    # Di = 32 bf16 rows: 64 B
    state = 7 * 8 * 128 + 2 * (1 * 2 * 64 * 4) + 4 * 4 + 4   # window rings, 2 fp32 rings, cursor, sampled
    state = -(-state // 256) * 256
    assert mp.cache_bytes(TINY, 2, 16, 8, "bf16", "bf16") == main + index + 2 * state == 28416
    assert mp.largest_batch(TINY, 28416, 16, 8, "bf16", "bf16") == 2
    assert mp.largest_batch(TINY, 28415, 16, 8, "bf16", "bf16") == 1
    assert mp.largest_batch(TINY, 0, 16, 8, "bf16", "bf16") == 0


def test_plan_batches_follow_the_layout():
    rows = mp.plan(TINY, devices=(1, 2), contexts=(64,), hbm=1 << 24, reserve=0, page_tokens=8)
    by = {(r.layout, r.experts, r.devices): r for r in rows}
    for key, r in by.items():
        assert r.free == (1 << 24) - r.param_total
        assert r.batch_total[64] == r.batch_per_device[64] * (r.devices if r.layout == "dp" else 1)
    # tiny's Engram tables are small: copied to every device and counted there
    assert by["dp", "fp4", 1].engram_device == mp.engram_table_bytes(TINY) == (1916 + 2148) * (32 + 1)


def test_expert_stacks_the_devices_do_not_divide_stay_replicated():
    """tiny's draft stages hold 4 experts: split over 2 and 4 devices, whole on each of 8; the
    per-head attention weights of 4 heads over 8 devices are refused."""
    draft = 3 * 4 * 3 * 64 * 128 // 2 + 3 * 4 * 3 * 64 * 128 // 32
    for n, ways in ((2, 2), (4, 4), (8, 1)):
        assert mp.param_bytes(LEAVES, "fp4", "dp", n)["draft_routed_experts"] == draft // ways
    with pytest.raises(ValueError, match=r"attn_sink: leading dim 4 does not split over 8 devices"):
        mp.param_bytes(LEAVES, "fp4", "tp", 8)


def test_cli_markdown(capsys):
    assert mp.main(["--config", str(ROOT / "v41_jax/configs/tiny.config.json"), "--devices", "1,2",
                    "--contexts", "64", "--hbm-gib", "1", "--reserve-gib", "0", "--page-tokens", "8",
                    "--markdown"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n| dp |") == 6 and out.count("\n| tp |") == 6


def test_host_read_is_one_devices_block_of_a_stack():
    """tiny's experts as stored: w1 / w3 [64, 128] as E2M1 [64, 64] bytes + E8M0 [64, 4], w2
    [128, 64] as [128, 32] + [128, 2]: 4,352 bytes each. Backbone stacks of 8 split over N; the
    draft stacks of 4 split over 2 and 4, and are read whole on 8 (they stay replicated)."""
    expert = 64 * 64 + 64 * 4
    assert expert == 128 * 32 + 128 * 2 == 4352
    for n, experts in ((1, 8), (2, 4), (4, 2), (8, 4)):
        assert mp.host_read_bytes(TINY, n) == experts * expert
