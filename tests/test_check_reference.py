"""check_reference against the official-reference fixtures: passes on both, fails on a corrupted checkpoint.

The checker's own tolerances are documented (and derived) in v41_jax/tools/check_reference.py.
"""

import json
import shutil
import struct
from pathlib import Path

import pytest

from v41_jax.tools.check_reference import OUTPUTS, main

OFFICIAL = Path(__file__).parent / "fixtures" / "dsv41_official"


@pytest.mark.parametrize("name", ["small_a", "small_b"])
def test_reference_fixture_passes(name, capsys):
    assert main([str(OFFICIAL / name), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    keys = {c["key"] for c in report["checks"]}
    # every family of outputs is compared, not just some
    for key in ("prefill.engram_hash_ids", "decode.block_out", "prefill.logits_all", "decode.logits",
                "dspark.logits", "dspark.confidence", "dspark.output_ids", "decode.final_normed"):
        assert key in keys
    assert any(k.startswith("decode.index_topk.L") for k in keys)
    assert any(k.startswith("prefill.candidate_blocks.L") for k in keys)
    # hash ids are exact, and most rows' own selections equal the reference's exactly
    hashes = [c for c in report["checks"] if c["key"].endswith("engram_hash_ids")]
    assert all(c["stats"]["mismatched_rows"] == 0 for c in hashes)
    sel = [c["stats"] for c in report["checks"] if "topk" in c["key"] or "candidate" in c["key"]]
    assert sum(s["matched"] for s in sel) >= 0.9 * sum(s["rows"] for s in sel)


def _flip_high_byte(ckpt: Path, tensor: str, mask: int) -> None:
    """XOR `mask` into the high byte of element 0 of a bf16 tensor of a single-file safetensors."""
    path = ckpt / "model.safetensors"
    raw = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    start, _ = json.loads(raw[8:8 + n])[tensor]["data_offsets"]
    raw[8 + n + start + 1] ^= mask  # little-endian bf16: byte 1 = sign + top exponent bits
    path.write_bytes(bytes(raw))


def test_flipped_weight_byte_fails(tmp_path, capsys):
    src = OFFICIAL / "small_b"
    dst = tmp_path / "small_b"
    shutil.copytree(src / "checkpoint", dst / "checkpoint")
    shutil.copy(src / OUTPUTS, dst / OUTPUTS)
    for f in dst.rglob("*"):
        f.chmod(0o644)
    # the first block's attention norm: every token of every path goes through it
    _flip_high_byte(dst / "checkpoint", "layers.0.attn_norm.weight", 0x40)
    # one nudge a size: the conditioning doubles its nudges to the largest on a model this far off
    assert main([str(dst), "--json", "--conditioning", "1"]) != 0
    report = json.loads(capsys.readouterr().out)
    failed = {c["key"] for c in report["checks"] if not c["passed"]}
    assert {"prefill.block_out_last", "decode.block_out", "prefill.final_normed_all"} <= failed
    # beyond even the largest nudges: no noise floor is measured for it, the profile judges alone
    assert report["conditioning"]["levels"][-1]["mean_row_ulps"] < report["conditioning"]["deviation_mean_row_ulps"]
    assert report["conditioning"]["tensor_noise"] == {}


def test_one_ulp_nudge_moves_each_value_by_one_ulp():
    import jax.numpy as jnp
    import ml_dtypes
    import numpy as np

    from v41_jax.tools.check_reference import nudged_params

    w = jnp.asarray(np.random.default_rng(0).normal(size=(4, 64)).astype(ml_dtypes.bfloat16))
    params = {"embed": {"weight": w},
              "layers": [{"attn_norm": {"weight": w[0]}, "ffn_norm": {"weight": w[1]}, "other": w[2]}]}
    out, wide = nudged_params(params, seed=1), nudged_params(params, seed=1, ulps=4)
    for a, b, c in ((params["embed"]["weight"], out["embed"]["weight"], wide["embed"]["weight"]),
                    (params["layers"][0]["attn_norm"]["weight"], out["layers"][0]["attn_norm"]["weight"],
                     wide["layers"][0]["attn_norm"]["weight"])):
        bits = [np.asarray(x).view(np.uint16).astype(np.int32) for x in (a, b, c)]
        step = bits[1] - bits[0]
        assert set(np.unique(step)) == {-1, 1}          # every value moved, by one ulp, both directions
        assert np.array_equal(bits[2] - bits[0], 4 * step)  # a seed's signs at every size
    assert out["layers"][0]["other"] is params["layers"][0]["other"]


def test_near_tie_rules_come_from_the_fixture_and_catch_higher_index_ties():
    """The selection rules' scales are measured on the fixture (one-ulp conditioning run), and an
    exact tie of the model's own scores resolved to the higher index is never a near-tie."""
    import numpy as np

    from v41_jax.tools.check_reference import NearTie, tie_to_higher_index

    scores = np.array([3.0, 1.0, 1.0, 0.0, -0.0])
    ref, own = np.array([0, 1]), np.array([0, 2])           # ref took the lower of the tied 1 and 2
    assert tie_to_higher_index(own, ref, scores)
    assert not tie_to_higher_index(ref, own, scores)         # the lower index is the rule, not a defect
    assert tie_to_higher_index(np.array([0, 4]), np.array([0, 3]), scores)  # -0.0 == +0.0
    for rule in (NearTie(True, reach=10.0), NearTie(False, noise=10.0)):
        assert not rule.holds(own, ref, scores)              # however wide the noise scale
        assert rule.holds(np.array([0, 3]), np.array([0, 1]), np.array([3.0, 1.0, 0.5, 0.9]))
    # a rank rule of reach 0 (the nudges moved nothing) accepts no mismatch at all
    assert not NearTie(True, reach=0.0).holds(np.array([0, 3]), np.array([0, 1]), np.array([3.0, 1.0, 0.5, 0.9]))


def test_conditioning_measures_the_selection_noise(capsys):
    """The near-tie scales are measured per fixture: one-ulp nudges move a good share of small_b's
    index rows, and the measured reach and gate noise are what the rules report."""
    main([str(OFFICIAL / "small_b"), "--json", "--conditioning", "2"])
    report = json.loads(capsys.readouterr().out)
    cond = report["conditioning"]
    assert {"index_topk.L2", "index_topk.L5", "index_topk.L7", "candidate_blocks.L5"} <= set(cond["rank_reach"])
    moved = cond["rows_moved"].values()
    assert sum(m for m, _ in moved) >= 0.25 * sum(n for _, n in moved)
    assert all(v > 0 for v in cond["gate_noise"].values())
    checks = {c["key"]: c for c in report["checks"]}
    assert f'{cond["rank_reach"]["index_topk.L5"]:.3g}k' in checks["prefill.index_topk.L5"]["tolerance"]
    assert f'{cond["gate_noise"]["0"]:.3g}' in checks["prefill.gate_topk.L0"]["tolerance"]


def _rank_check(key, missed, reach, tie=False):
    """A rank key's Check from compare_selection on two rows of 8 scored positions, k = 2: row 0 the
    model's own picks {0, 1} against the reference's {0, 2 * missed} (a pick of own rank 2 * missed:
    `missed` k); row 1 equal picks, or with `tie` positions 1 and 2 scoring alike, the model taking 2
    and the reference the lower, 1."""
    import numpy as np

    from v41_jax.tools.check_reference import NearTie, compare_selection

    scores = np.tile(np.arange(8.0, 0.0, -1.0), (2, 1))
    own, ref = np.array([[0, 1], [0, 1]]), np.array([[0, int(2 * missed) or 1], [0, 1]])
    if tie:
        scores[1, 2], own[1] = scores[1, 1], [0, 2]
    return compare_selection(key, own, ref, scores, np.zeros(2, bool), NearTie(True, reach=reach))


def test_stage2_statistic_bounds_false_fails_and_sees_how_far_beyond():
    """The second stage's combined statistic (docs/MODEL.md §6.3): a device inside the draws'
    spread passes, one far beyond them on one rule fails though other rules have a draw alone at
    their top (where a count of runs below would cap both at N and pass it), a tie at the top is
    not beyond, and a device that is one more exchangeable draw fails with probability 1 / (N + 1)."""
    import numpy as np

    from v41_jax.tools.check_reference import beyond_others, stage2_passes

    rng = np.random.default_rng(0)
    draws = rng.gamma(4.0, 0.5, (99, 3))
    top = draws.max(0)
    assert stage2_passes(np.median(draws, 0), draws)[0]
    far = np.array([0.0, 2 * top[1], 0.0])
    passed, dev, most = stage2_passes(far, draws)
    assert not passed and dev == 2.0 and 1.0 < most < 2.0   # each rule's top draw passes the rest a little
    assert stage2_passes(np.array([0.0, top[1], 0.0]), draws)[0]           # a tie with the top draw
    # the only run that moves a rule is measured against the least miss, 1 k; inf / inf is a tie
    runs = np.array([[0.0, 0.0], [0.0, 3.0], [np.inf, 0.0], [np.inf, 0.0]])
    assert list(beyond_others(runs)) == [0.0, 3.0, 1.0, 1.0]
    # exchangeable runs: the first is strictly the most beyond in 1 / (N + 1) of the trials (N = 19: 0.05)
    fails = np.mean([not stage2_passes(x[0], x[1:])[0] for x in rng.gamma(4.0, 0.5, (4000, 20, 3))])
    assert 0.04 < fails < 0.06


def test_tensor_stage2_decides_a_failing_tensor_of_an_inside_device_over_one_ulp_draws():
    """A bf16 tensor check that fails its first stage, on a device inside the nudges, is decided over
    the one-ulp draws (asked for once): within the draws' spread it passes, with its numbers in its
    stats; strictly beyond every draw it fails. Passing checks, and every check of a device not
    inside (a defect is never inside), keep the first stage's verdict."""
    import numpy as np

    from v41_jax.tools.check_reference import CPU, compare_bf16, tensor_stage2

    rng = np.random.default_rng(3)
    ref = rng.standard_normal((4, 64)).astype(np.float32)
    ulp = 2.0 ** (np.floor(np.log2(np.sqrt(np.mean(ref.astype(np.float64) ** 2, -1, keepdims=True)))) - 7)

    def check(key, ulps):                                   # every element `ulps` row ulps off
        return compare_bf16(key, ref + ulps * ulp, ref, CPU)
    # 19 draws: the tensor's row ulps at 5..14 (p50 = p99 = max); the other tensor's always 1
    draws = {"t.a": [[u, u, u] for u in np.linspace(5, 14, 19)], "t.b": [[1.0, 1.0, 1.0]] * 19}
    asked = []

    def decide(ulps_a, inside=True):
        asked.clear()
        cond = {"inside": inside, "stage2_draws": 19, "draw_tensors": draws}
        out = tensor_stage2([check("t.a", ulps_a), check("t.b", 1.0)], cond, lambda: asked.append(1))
        return {c.key: c for c in out}

    first = decide(3.0)                                     # within CPU's p50 4: stage 1, nothing asked
    assert first["t.a"].passed and "stage" not in first["t.a"].stats and not asked
    within = decide(8.0)                                    # fails p50 <= 4; draws reach 14
    assert not check("t.a", 8.0).passed and within["t.a"].passed and asked == [1]
    assert within["t.a"].stats["stage2"]["tensors"] == ["t.a"] and "stage 2 over 19" in within["t.a"].tolerance
    assert not decide(20.0)["t.a"].passed                    # beyond every draw
    assert not decide(8.0, inside=False)["t.a"].passed and not asked   # not inside: stage 1 stands
    assert within["t.b"].passed and "stage" not in within["t.b"].stats


def test_two_stage_decides_rank_keys_and_keeps_the_tie_rule():
    """Stage 1 decides unless a rank key has a row beyond its reach; then stage 2 (the conditioning's
    draws, asked for once) decides those keys, and its numbers are in their stats. Where the
    conditioning took no draws (a device inside the nudges' noise: XLA:CPU) stage 1 stands alone, and
    a row breaking an exact tie toward the higher index fails whatever stage 2 says. Stage 2 counts
    missed picks too: a device whose furthest miss is within the draws' but that misses many more
    picks than any draw fails."""
    from dataclasses import replace

    from v41_jax.tools.check_reference import two_stage

    # the first 19 draws (stage 1) reach 1.5 k on the index layer, all 99 reach 2.5 k (one draw, 2.0 the
    # next); on the candidate layer both reach 1.0 k
    draw_ranks = {"index_topk.L1": [0.5, 1.0, 1.5] * 6 + [1.0] + [0.5, 2.0] * 39 + [0.5, 2.5],
                  "candidate_blocks.L1": [0.0, 0.5, 1.0] * 33}
    # each draw misses 1-4 index picks and 0-2 candidate blocks over its rows
    draw_missed = {"index_topk.L1": [1, 2, 3, 4] * 24 + [1, 2, 3], "candidate_blocks.L1": [0, 1, 2] * 33}
    reach = {k: max(v[:19]) for k, v in draw_ranks.items()}
    cond = {"rank_reach": reach, "stage2_draws": 99, "draw_ranks": draw_ranks, "draw_missed": draw_missed}
    asked = []

    def decide(index_missed, blocks_missed=0.0, tie=False, stage2_draws=99, index_count=None):
        asked.clear()
        index = _rank_check("prefill.index_topk.L1", index_missed, reach["index_topk.L1"], tie)
        if index_count is not None:
            index = replace(index, stats={**index.stats, "missed_picks": index_count})
        checks = [index,
                  _rank_check("decode.index_topk.L1", 0.0, reach["index_topk.L1"]),
                  _rank_check("decode.candidate_blocks.L1", blocks_missed, reach["candidate_blocks.L1"])]
        out = two_stage(checks, dict(cond, stage2_draws=stage2_draws),
                        lambda: asked.append(1) or (draw_ranks, draw_missed))
        return {c.key: c for c in out}

    inside = decide(0.5)                                     # within the reach: stage 1, no draws asked for
    assert not asked and all(c.passed and c.stats["stage"] == 1 for c in inside.values())
    flagged = decide(2.0)                                     # past the first 19 draws, not the 99
    assert not _rank_check("prefill.index_topk.L1", 2.0, reach["index_topk.L1"]).passed   # stage 1 alone fails it
    c = flagged["prefill.index_topk.L1"]
    assert asked == [1] and c.passed and c.stats["stage"] == 2
    verdict = c.stats["stage2"]
    assert verdict["draws"] == 99 and verdict["device_beyond"] <= verdict["draws_beyond_max"]
    assert "stage 2 over 99 draws" in c.tolerance and flagged["decode.index_topk.L1"].stats["stage"] == 1
    far = decide(0.5, blocks_missed=3.0)                      # 3x the candidate draws' largest
    blocks = far["decode.candidate_blocks.L1"]
    assert not blocks.passed and not blocks.stats["stage2"]["passed"]
    assert blocks.stats["stage2"]["device_beyond"] == 3.0
    assert not decide(2.0, stage2_draws=0)["prefill.index_topk.L1"].passed and not asked
    tie = decide(2.0, tie=True)["prefill.index_topk.L1"]     # a tie row besides: not rescued by stage 2
    assert asked == [1] and tie.stats["stage2"]["passed"] and not tie.passed
    assert decide(2.0, index_count=4)["prefill.index_topk.L1"].passed     # as many as the most a draw misses
    many = decide(2.0, index_count=40)["prefill.index_topk.L1"]           # 2 k deep, but 10x the picks
    assert not many.passed and many.stats["stage2"]["device_beyond"] == 10.0
