"""resolve_topology against docs/MODEL.md §1.2 (released), the official fixtures' modes and the
repo's small configs."""

import pathlib

import pytest

from v41_jax.config import ModelConfig
from v41_jax.topology import Candidates, LayerTopology, Mode, resolve_topology

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "v41_jax" / "configs"
OFFICIAL = ROOT / "tests" / "fixtures" / "dsv41_official"

W, F, RI, RU = Mode.WINDOW, Mode.FULL, Mode.REINDEX, Mode.REUSE
NO, PRODUCE, CONSUME = Candidates.NONE, Candidates.PRODUCE, Candidates.CONSUME

# docs/MODEL.md §1.2, row by row: (first, last, ratio, mode, kv owner, top-k owner, candidates).
RELEASED_TABLE = [
    (0, 0, 0, W, None, None, NO),
    (1, 1, 0, W, None, None, NO),
    (2, 2, 2, F, 2, 2, NO),
    (3, 7, 2, RU, 2, 2, NO),
    (8, 8, 2, F, 8, 8, NO),
    (9, 13, 2, RU, 8, 8, NO),
    (14, 14, 2, F, 14, 14, NO),
    (15, 19, 2, RU, 14, 14, NO),
    (20, 20, 1, F, 20, 20, PRODUCE),
    (21, 23, 1, RU, 20, 20, CONSUME),
    (24, 24, 1, RI, 20, 24, CONSUME),
    (25, 27, 1, RU, 20, 24, CONSUME),
    (28, 28, 1, RI, 20, 28, CONSUME),
    (29, 31, 1, RU, 20, 28, CONSUME),
    (32, 32, 1, RI, 20, 32, CONSUME),
    (33, 35, 1, RU, 20, 32, CONSUME),
    (36, 36, 1, RI, 20, 36, CONSUME),
    (37, 39, 1, RU, 20, 36, CONSUME),
    (40, 42, 0, W, None, None, NO),
]
RELEASED_ENGRAM = {1, 14}

# Mode codes of the official fixtures' SOURCE.md: code -> (mode, ratio, candidate role).
CODES = {"W": (W, 0, NO), "F2": (F, 2, NO), "R2": (RU, 2, NO), "C1": (F, 1, PRODUCE),
         "R1": (RU, 1, CONSUME), "RI": (RI, 1, CONSUME)}
FIXTURE_MODES = {  # backbone layers as listed there; every draft stage is W
    "small_a": "W+E F2+E R2 C1 R1 RI",
    "small_b": "W W+E F2+E R2 R2 C1 R1 RI R1",
}


def load(path: pathlib.Path) -> ModelConfig:
    return ModelConfig.from_file(path)


def rows(topology: tuple[LayerTopology, ...]) -> list[tuple]:
    return [(t.layer, t.ratio, t.mode, t.kv_owner, t.topk_owner, t.candidates) for t in topology]


def test_released_topology_is_the_spec_table():
    cfg = load(CONFIGS / "deepseek_v41_flash.config.json")
    expected = [(layer, ratio, mode, kv, topk, cand)
                for first, last, ratio, mode, kv, topk, cand in RELEASED_TABLE
                for layer in range(first, last + 1)]
    topology = resolve_topology(cfg)
    assert len(expected) == 43
    assert rows(topology) == expected
    assert {t.layer for t in topology if t.engram} == RELEASED_ENGRAM
    assert [t.layer for t in topology if t.is_draft] == [40, 41, 42]


def test_reference_layout_resolves_the_same():
    hf = resolve_topology(load(CONFIGS / "deepseek_v41_flash.config.json"))
    ref = resolve_topology(load(CONFIGS / "deepseek_v41_flash.inference_config.json"))
    assert hf == ref


def test_derived_flags_of_the_released_topology():
    topology = resolve_topology(load(CONFIGS / "deepseek_v41_flash.config.json"))
    assert [t.layer for t in topology if t.scores] == [2, 8, 14, 20, 24, 28, 32, 36]
    assert [t.layer for t in topology if t.rope_global] == list(range(2, 40))


@pytest.mark.parametrize("name", sorted(FIXTURE_MODES))
def test_official_fixture_modes(name):
    cfg = load(OFFICIAL / name / "checkpoint" / "config.json")
    topology = resolve_topology(cfg)
    codes = FIXTURE_MODES[name].split() + ["W"] * cfg.n_mtp_layers
    assert len(topology) == len(codes)
    for t, code in zip(topology, codes):
        mode, ratio, cand = CODES[code.removesuffix("+E")]
        assert (t.mode, t.ratio, t.candidates, t.engram) == (mode, ratio, cand, code.endswith("+E")), t


def test_small_b_owners():
    topology = resolve_topology(load(OFFICIAL / "small_b" / "checkpoint" / "config.json"))
    assert [(t.kv_owner, t.topk_owner) for t in topology[:9]] == [
        (None, None), (None, None), (2, 2), (2, 2), (2, 2), (5, 5), (5, 5), (5, 7), (5, 7)]


def test_tiny_has_every_mode():
    topology = resolve_topology(load(CONFIGS / "tiny.config.json"))
    kinds = {(t.mode, t.ratio, t.candidates) for t in topology}
    assert kinds >= {(W, 0, NO), (F, 2, NO), (RU, 2, NO), (F, 1, PRODUCE), (RU, 1, CONSUME),
                     (RI, 1, CONSUME)}
    source = next(t for t in topology if t.candidates is PRODUCE)
    reindex = [t for t in topology if t.mode is RI]
    # a REINDEX layer scores inside the candidate source's blocks over the same kv owner
    assert reindex and all(t.kv_owner == source.kv_owner and t.layer > source.layer
                           for t in reindex)
    # and a REUSE layer takes its selection from that REINDEX layer
    assert any(t.mode is RU and t.topk_owner == r.layer for t in topology for r in reindex)
    assert sum(t.engram for t in topology) == 2
    assert [t.mode for t in topology if t.is_draft] == [W, W, W]


def test_modes_config_is_the_released_pattern_in_miniature():
    cfg = load(CONFIGS / "modes.config.json")
    assert cfg.compress_ratios == (0, 0, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0)
    topology = resolve_topology(cfg)
    assert [t.mode for t in topology] == [W, W, F, RU, RU, F, RU, RI, RU, W, W, W]
    assert [t.candidates for t in topology[5:9]] == [PRODUCE, CONSUME, CONSUME, CONSUME]
    assert [t.layer for t in topology if t.engram] == [1, 4]
    assert cfg.dspark_target_layer_ids == (6, 7, 8)
