"""ModelConfig loading (all shipped layouts) and validate(): one failing config per rule."""

import dataclasses
import json
import pathlib

import pytest

from v41_jax.config import CheckpointError, ModelConfig, validate

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "v41_jax" / "configs"
OFFICIAL = ROOT / "tests" / "fixtures" / "dsv41_official"

SHIPPED = ["deepseek_v41_flash.config.json", "deepseek_v41_flash.inference_config.json",
           "bench_slice.config.json", "tiny.config.json", "modes.config.json"]


def load(name: str) -> ModelConfig:
    return ModelConfig.from_file(CONFIGS / name)


@pytest.fixture(scope="module")
def tiny() -> ModelConfig:
    return load("tiny.config.json")


def _differences(a: ModelConfig, b: ModelConfig) -> dict[str, tuple]:
    return {f.name: (getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a)
            if getattr(a, f.name) != getattr(b, f.name)}


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_configs_load_and_validate(name):
    cfg = load(name)
    validate(cfg)
    assert len(cfg.compress_ratios) == cfg.n_layers + cfg.n_mtp_layers


def test_released_config_values():
    cfg = load("deepseek_v41_flash.config.json")
    assert (cfg.vocab_size, cfg.dim, cfg.n_layers, cfg.n_mtp_layers) == (129280, 5120, 40, 3)
    assert cfg.compress_ratios == (0, 0) + (2,) * 18 + (1,) * 20 + (0, 0, 0)
    assert cfg.kv_source_layers == (2, 8, 14, 20)
    assert cfg.index_source_layers == (2, 8, 14, 20, 24, 28, 32, 36)
    assert (cfg.candidate_source_layer, cfg.candidate_topk_blocks, cfg.candidate_block_size) == \
        (20, 2048, 8)
    assert (cfg.rope_factor, cfg.beta_fast, cfg.beta_slow, cfg.original_seq_len) == \
        (16, 32, 1, 65536)
    assert cfg.moe_experts(39) == (384, 6) and cfg.moe_experts(40) == (128, 3)
    assert cfg.engram_hash_cols == 24 and cfg.quantized
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (0, 1, 2)


def test_released_hf_and_reference_layouts_agree():
    hf, ref = load("deepseek_v41_flash.config.json"), load("deepseek_v41_flash.inference_config.json")
    # max_seq_len is a runtime limit the reference's config.json leaves at the ModelArgs default
    assert _differences(hf, ref) == {"max_seq_len": (1048576, 4096)}


@pytest.mark.parametrize("name", ["small_a", "small_b"])
def test_official_fixture_layouts_agree(name):
    hf = ModelConfig.from_file(OFFICIAL / name / "checkpoint" / "config.json")
    ref = ModelConfig.from_file(OFFICIAL / name / "checkpoint" / "reference_config.json")
    # the reference writes 0 for "draft experts as the backbone"; the HF layout spells the counts out
    assert hf.moe_experts(hf.n_layers) == ref.moe_experts(ref.n_layers)
    diff = _differences(hf, ref)
    assert set(diff) <= {"dspark_n_routed_experts", "dspark_n_activated_experts"}
    assert all(r == 0 for _, r in diff.values())


def test_directory_path_loads_its_config_json():
    assert ModelConfig.from_file(OFFICIAL / "small_a" / "checkpoint").n_layers == 6


# ---- one failing config per rule ---------------------------------------------------------------
# Each case changes the valid tiny config (7 backbone layers + 3 draft stages, ratios
# 0,2,2,1,1,1,1,0,0,0; kv sources 1,3; index sources 1,3,5; candidate source 3 with 4 blocks of 2;
# index_topk 8; Engram layers 1,3; DSpark targets 4,5,6) so that exactly one rule breaks.
BAD = [
    ("ratio_value", dict(compress_ratios=(0, 2, 2, 1, 1, 1, 4, 0, 0, 0)), "compress_ratios"),
    ("ratio_count", dict(compress_ratios=(0, 2, 2, 1, 1, 1, 1, 0, 0)), "compress_ratios"),
    ("draft_ratio", dict(compress_ratios=(0, 2, 2, 1, 1, 1, 1, 0, 1, 0)), "compress_ratios"),
    ("no_layers", dict(n_layers=0), "n_layers"),
    ("kv_not_index", dict(index_source_layers=(1, 5), candidate_source_layer=-1),
     "kv_source_layers"),
    ("kv_ratio0", dict(kv_source_layers=(0, 1, 3), index_source_layers=(0, 1, 3, 5)),
     "kv_source_layers"),
    ("kv_out_of_range", dict(kv_source_layers=(1, 3, 8), index_source_layers=(1, 3, 5, 8)),
     "kv_source_layers"),
    ("index_ratio0", dict(index_source_layers=(0, 1, 3, 5)), "index_source_layers"),
    ("index_unsorted", dict(index_source_layers=(3, 1, 5)), "index_source_layers"),
    ("owner_after_consumer", dict(kv_source_layers=(2, 3), index_source_layers=(2, 3, 5)),
     "kv_source_layers"),
    ("index_without_owner", dict(compress_ratios=(0, 1, 1, 1, 1, 2, 1, 0, 0, 0)),
     "kv_source_layers"),
    ("candidate_not_index", dict(candidate_source_layer=4), "candidate_source_layer"),
    ("candidate_ratio0", dict(candidate_source_layer=0), "candidate_source_layer"),
    ("candidate_out_of_range", dict(candidate_source_layer=7), "candidate_source_layer"),
    ("candidate_pool", dict(candidate_topk_blocks=3), "candidate_topk_blocks"),
    ("candidate_no_blocks", dict(candidate_block_size=0), "candidate_topk_blocks"),
    ("candidate_foreign_owner", dict(compress_ratios=(0, 2, 2, 1, 1, 2, 1, 0, 0, 0)),
     "candidate_source_layer"),
    ("o_groups", dict(o_groups=3), "o_groups"),
    ("rope_odd", dict(rope_head_dim=15), "rope_head_dim"),
    ("rope_above_head", dict(rope_head_dim=96), "rope_head_dim"),
    ("rope_above_index", dict(rope_head_dim=48), "rope_head_dim"),
    ("window", dict(window_size=0), "window_size"),
    ("shared_experts", dict(n_shared_experts=2), "n_shared_experts"),
    ("activated", dict(n_activated_experts=9), "n_activated_experts"),
    ("dspark_activated", dict(dspark_n_activated_experts=5), "dspark_n_activated_experts"),
    ("score_func", dict(score_func="sparsemax"), "score_func"),
    ("engram_out_of_range", dict(engram_layer_ids=(1, 7)), "engram_layer_ids"),
    ("engram_count", dict(engram_num_embeddings=(1916,)), "engram_num_embeddings"),
    ("engram_rows", dict(engram_num_embeddings=(1916, 2149)), "engram_num_embeddings"),
    ("engram_heads_vs_rows", dict(engram_n_heads=3), "engram_num_embeddings"),
    ("engram_ngram", dict(engram_max_ngram_size=1), "engram_max_ngram_size"),
    ("engram_pad", dict(engram_pad_id=512), "engram_pad_id"),
    ("engram_compressed", dict(engram_compressed_vocab_size=513), "engram_compressed_vocab_size"),
    ("dspark_targets_range", dict(dspark_target_layer_ids=(4, 5, 7)), "dspark_target_layer_ids"),
    ("dspark_targets_repeat", dict(dspark_target_layer_ids=(4, 5, 5)), "dspark_target_layer_ids"),
    ("dspark_no_targets", dict(dspark_target_layer_ids=()), "dspark_target_layer_ids"),
    ("dspark_block", dict(dspark_block_size=0), "dspark_block_size"),
    ("dspark_noise", dict(dspark_noise_token_id=512), "dspark_noise_token_id"),
    ("width_moe", dict(moe_inter_dim=48), "moe_inter_dim"),
    ("width_engram", dict(engram_head_dim=48), "engram_head_dim"),
]


@pytest.mark.parametrize("changes,field_name", [(c, f) for _, c, f in BAD],
                         ids=[name for name, _, _ in BAD])
def test_rule_violation_names_the_field(tiny, changes, field_name):
    with pytest.raises(ValueError) as err:
        tiny.replace(**changes)
    assert str(err.value).startswith(f"{field_name}: "), str(err.value)


def test_width_rule_applies_only_to_the_quantized_format(tiny):
    assert tiny.replace(quantized=False, moe_inter_dim=48).moe_inter_dim == 48


def test_engram_width_rule_applies_to_every_format(tiny):
    """The Engram table is FP8 with an E8M0 scale a 32 lanes in an unquantized checkpoint too: a
    width of 48 asked for a scale of 1.5 columns there (make_checkpoint failed with a bare error)."""
    with pytest.raises(ValueError, match="^engram_head_dim: width 48 must be a multiple of 32"):
        tiny.replace(quantized=False, engram_head_dim=48)


def test_no_draft_stages_need_no_dspark_fields(tiny):
    cfg = tiny.replace(n_mtp_layers=0, compress_ratios=tiny.compress_ratios[:7],
                       dspark_block_size=0, dspark_target_layer_ids=())
    assert cfg.n_total_layers == 7


def test_no_candidate_source_ignores_the_pool(tiny):
    cfg = tiny.replace(candidate_source_layer=-1, candidate_topk_blocks=0, candidate_block_size=0)
    assert cfg.candidate_source_layer == -1


def _raw(name: str) -> dict:
    return json.loads((CONFIGS / name).read_text())


@pytest.mark.parametrize("edit,field_name", [
    (lambda r: r["quantization_config"].update(expert_dtype="fp8"), "quantization_config"),
    (lambda r: r["text_config"].update(num_key_value_heads=2), "num_key_value_heads"),
    (lambda r: r["text_config"].update(hidden_sizes=5), "hidden_sizes"),
    (lambda r: r["text_config"].pop("index_topk"), "index_topk"),
    (lambda r: r["text_config"]["rope_scaling"].update(rope_type="linear"), "rope_scaling.rope_type"),
    (lambda r: r["text_config"].update(engram_num_embeddings=[1916, 2000]), "engram_num_embeddings"),
], ids=["quantization", "kv_heads", "unknown", "missing", "rope_type", "validated_on_load"])
def test_loader_refuses_bad_files(edit, field_name):
    raw = _raw("tiny.config.json")
    edit(raw)
    with pytest.raises(ValueError) as err:
        ModelConfig.from_dict(raw)
    assert str(err.value).startswith(f"{field_name}: "), str(err.value)


def test_file_errors_name_the_file(tmp_path):
    raw = _raw("tiny.config.json")
    raw["text_config"]["scoring_func"] = "sparsemax"
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=r"config\.json: scoring_func: "):
        ModelConfig.from_file(path)


def test_refusals_name_the_part_that_is_wrong():
    """A list field with one bad item names that item; a quantization_config names its first key
    that differs from the published one (not the whole value, which may be large)."""
    raw = _raw("tiny.config.json")
    raw["text_config"]["compress_ratios"][2] = "4"
    with pytest.raises(ValueError, match=r'^compress_ratios: must be a list of integers, item 2 is "4"$'):
        ModelConfig.from_dict(raw)
    raw = _raw("tiny.config.json")
    raw["quantization_config"].update(expert_dtype="fp8")
    with pytest.raises(ValueError, match=r"^quantization_config: .*: its 'expert_dtype' is \"fp8\"$"):
        ModelConfig.from_dict(raw)
    raw = _raw("tiny.config.json")
    raw["quantization_config"].pop("expert_dtype")
    with pytest.raises(ValueError, match=r"^quantization_config: .*: it lacks 'expert_dtype'$"):
        ModelConfig.from_dict(raw)
