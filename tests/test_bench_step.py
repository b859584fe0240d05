"""scripts/bench_step.py: its random params have the loader's exact layout, its writer-scale
probe, the expected-experts count and the MoE what-if switch (the end-to-end run is the CPU smoke
command in the script's docstring, too slow for CI)."""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from scripts import bench_step as bs
from scripts.make_checkpoint import make_checkpoint
from v41_jax.checkpoint.load import ENGRAM_KEY, load_params
from v41_jax.config import ModelConfig
from tests.engine_common import WHOLE

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "v41_jax/configs/tiny.config.json")


def _layout(tree):
    return jax.tree_util.tree_map(lambda x: (tuple(x.shape), str(x.dtype)), tree)


@pytest.mark.parametrize("experts, dense", [("fp4", "bf16"), ("fp8", "bf16"), ("bf16", "bf16"), ("fp8", "fp8")])
def test_random_params_have_the_loaders_layout(tmp_path, experts, dense):
    make_checkpoint(TINY, str(tmp_path), seed=0)
    cfg, loaded = load_params(tmp_path, progress=False, experts=experts, dense=dense)
    made = bs.random_params(cfg, seed=0, specs=bs.param_leaf_specs(cfg, experts, dense))
    made_tables, tables = made.pop(ENGRAM_KEY), loaded.pop(ENGRAM_KEY)   # static nodes: by source
    assert jax.tree_util.tree_structure(_layout(made)) == jax.tree_util.tree_structure(_layout(loaded))
    assert _layout(made) == _layout(loaded)
    assert sorted(made_tables.weight) == sorted(tables.weight)
    for layer in tables.weight:
        for got, want in ((made_tables.weight[layer], tables.weight[layer]),
                          (made_tables.scale[layer], tables.scale[layer])):
            assert got.shape == want.shape and got.dtype == want.dtype
        assert np.isfinite(made_tables.weight[layer].astype(np.float32)).all()
    leaves = [x for path, x in jax.tree_util.tree_leaves_with_path(made)     # FP8 row scales: one value
              if jax.numpy.issubdtype(x.dtype, jax.numpy.floating) and "row_scale" not in jax.tree_util.keystr(path)]
    assert all(np.isfinite(x).all() and x.std() > 0 for x in (np.asarray(v, np.float32) for v in leaves) if x.size > 1)
    if dense == "fp8":      # dense FP8 blocks: varied codes, the writer's rms
        wq_b = made["layers"][0]["attn"]["wq_b"]["weight"]
        assert np.asarray(wq_b.codes).std() > 0
        assert np.std(np.asarray(wq_b.dequant(jax.numpy.float32))) == pytest.approx(cfg.q_lora_rank ** -0.5, rel=0.5)
    if experts != "bf16":   # the codes vary; the scales give the writer's rms
        w2 = made["layers"][0]["ffn"]["experts"]["w2"]
        assert np.asarray(w2.codes).std() > 0
        assert np.std(np.asarray(w2.dequant(jax.numpy.float32))) == pytest.approx(cfg.moe_inter_dim ** -0.5, rel=0.5)


def test_specs_take_the_writers_scales():
    cfg = ModelConfig.from_file(TINY)
    specs = bs.param_leaf_specs(cfg, "fp8")
    norm = specs["layers.0.attn_norm.weight"]
    assert (norm.offset, norm.held) == (1.0, "bf16") and norm.scale == pytest.approx(0.1)
    wq = specs["layers.0.attn.wq_a.weight"]
    assert wq.offset == 0 and wq.scale == pytest.approx(cfg.dim ** -0.5)
    experts = specs["layers.0.ffn.experts.w2"]
    assert experts.shape == (cfg.n_routed_experts, cfg.dim, cfg.moe_inter_dim)
    assert experts.scale == pytest.approx(cfg.moe_inter_dim ** -0.5)
    n = int(np.prod(experts.shape))
    assert experts.held == "fp8" and experts.nbytes == n + 4 * n // cfg.moe_inter_dim   # + fp32 per row
    held = lambda h: bs.param_leaf_specs(cfg, h)["layers.0.ffn.experts.w2"]
    assert held("auto").held == "bf16"                                               # on CPU
    assert held("fp4").held == "fp4" and held("fp4").nbytes == n // 2 + n // 32      # + E8M0 per 32
    assert held("bf16").held == "bf16" and held("bf16").nbytes == 2 * n
    assert specs["head.weight"].held == "bf16" and specs["embed.weight"].scale == 1


def test_expected_experts_and_decode_bytes():
    assert bs.expected_experts(64, 6, 1) == pytest.approx(6)
    assert bs.expected_experts(64, 6, 8) == pytest.approx(34.88, abs=0.01)  # BENCHMARKS.md saw 35
    assert bs.expected_experts(64, 6, 1000) == pytest.approx(64)
    cfg = ModelConfig.from_file(TINY)
    from v41_jax.cache.geometry import CacheGeometry, EngineSettings
    geom = CacheGeometry.build(cfg, EngineSettings(page_tokens=16, num_pages=9, slots=2, max_context=64))
    one, two = (bs.decode_bytes(cfg, geom, bs.param_leaf_specs(cfg), b, 64) for b in (1, 2))
    assert two["kv_total"] == 2 * one["kv_total"] and one["experts_expected"] < two["experts_expected"]
    assert one["total"] == one["dense_weights"] + one["experts_expected"] + one["kv_total"]


def test_prefill_attention_flops_count_the_rows_each_position_reads():
    """A prefill's attention FLOPs are, position by position, the rows a decode at that position
    reads (`decode_bytes`, one context at a time): 4 H Dh a window or compressed row (q.k and
    p.v), 2 x index heads x index dim a scanned index key."""
    cfg = ModelConfig.from_file(TINY)
    from v41_jax.cache.geometry import CacheGeometry, EngineSettings
    geom = CacheGeometry.build(cfg, EngineSettings(page_tokens=16, num_pages=9, slots=2, max_context=64))
    specs = bs.param_leaf_specs(cfg)
    want = 0.0
    for context in range(1, 65):
        b = bs.decode_bytes(cfg, geom, specs, 1, context)
        rows = b["kv_window"] / geom.window_row_bytes + b["kv_compressed"] / geom.main_row_bytes
        want += 4 * cfg.n_heads * cfg.head_dim * rows
        want += 2 * cfg.index_n_heads * cfg.index_head_dim * b["kv_index_keys"] / geom.index_row_bytes
    assert bs.prefill_attention_flops(cfg, 64) == pytest.approx(want, rel=1e-12)
    assert 0 < bs.prefill_attention_flops(cfg, 32) < bs.prefill_attention_flops(cfg, 64)


def test_kernel_profile_attributes_device_time_to_kernels():
    """`--profile`'s breakdown: a traced matmul + tanh + sum shows up as kernels with time, per call;
    Pallas kernels are reported by their pallas_call names, XLA fusions without numeric suffixes."""
    from scripts.bench_common import PALLAS_KERNELS, kernel_group, kernel_profile
    f = jax.jit(lambda a, b: jax.numpy.tanh(a @ b).sum())
    a = jax.numpy.ones((256, 256))
    f(a, a).block_until_ready()
    prof = kernel_profile(lambda: f(a, a).block_until_ready(), 3)
    assert prof["calls"] == 3 and prof["device_ms_per_call"] > 0 and prof["kernels"]
    assert sum(k["share"] for k in prof["kernels"]) == pytest.approx(1.0, abs=1e-3)
    assert all(k["ms_per_call"] >= 0 and k["launches_per_call"] > 0 for k in prof["kernels"])
    assert prof["launches_per_call"] == pytest.approx(sum(k["launches_per_call"] for k in prof["kernels"]))
    inst = [i["ms_per_call"] for i in prof["instances"]]
    rest = prof["instances_left_out"]
    assert inst == sorted(inst, reverse=True)
    assert sum(inst) + rest["ms_per_call"] == pytest.approx(prof["device_ms_per_call"], abs=1e-3)
    assert sum(i["launches_per_call"] for i in prof["instances"]) + rest["launches_per_call"] == \
        pytest.approx(prof["launches_per_call"])
    assert kernel_group("loop_fusion_12") == "loop_fusion"
    assert kernel_group("gemm_fusion_dot.3") == "gemm_fusion_dot"
    assert all(kernel_group(f"{k}_kernel_0") == k for k in PALLAS_KERNELS)
    assert kernel_group("moe_gemv_down") == "moe_gemv_down" and kernel_group("moe_down") == "moe_down"


def test_device_timeline_splits_calls_and_measures_idle_gaps():
    """Two calls 20 ms apart; in each, two overlapping kernels (on two streams) then a 3 us and a
    30 us gap: the span, the busy union and the idle rest per call, the gaps in their bins."""
    from scripts.bench_common import device_timeline
    us = 1000
    def call(t0):
        return [(t0, t0 + 10 * us, "a"), (t0 + 5 * us, t0 + 12 * us, "b"),
                (t0 + 15 * us, t0 + 16 * us, "c"), (t0 + 46 * us, t0 + 50 * us, "d")]
    tl = device_timeline(call(0) + call(20_000 * us), 2)
    assert tl["calls_found"] == 2
    assert tl["span_ms"] == pytest.approx(0.050) and tl["busy_ms"] == pytest.approx(0.017)
    assert tl["idle_ms"] == pytest.approx(0.033)
    counts = {tuple(b["us"]): b["per_call"] for b in tl["gaps"]}
    assert counts[(2.0, 5.0)] == 1 and counts[(20.0, 100.0)] == 1 and sum(counts.values()) == 2
    assert tl["longest_gaps"][0] == {"us": 30.0, "after": "c", "before": "d"}
    assert tl["longest_gaps"][2] == {"us": 3.0, "after": "b", "before": "c"}


def test_bench_compile_cuts_configs_and_matches_the_loaders_layout():
    """scripts/bench_compile.py: every cut of the released config is a valid config whose layers
    are the released ones; its abstract params have the loader's layout (bench_step's specs)."""
    from scripts import bench_compile as bc
    from v41_jax.topology import resolve_topology
    full = ModelConfig.from_file(str(ROOT / "v41_jax/configs/deepseek_v41_flash.config.json"))
    whole = resolve_topology(full)
    for n in (1, 2, 3, 6, 20, 21, 40):
        cut = bc.cut(full, n)                        # validate() inside
        topo = resolve_topology(cut)
        assert cut.n_layers == n and cut.n_mtp_layers == full.n_mtp_layers
        assert [(t.ratio, t.mode) for t in topo[:n]] == [(t.ratio, t.mode) for t in whole[:n]]
    assert bc.cut(full, 40) == full
    cfg = ModelConfig.from_file(TINY)
    made = bs.random_params(cfg, seed=0, specs=bs.param_leaf_specs(cfg, "fp8"))
    made.pop(ENGRAM_KEY)
    assert _layout(bc.abstract_params(cfg, "fp8")) == _layout(made)
    text = jax.jit(_loop_then_sort).lower(np.ones(64, np.float32)).compile().as_text()
    counts = bc.hlo_counts(text)
    assert counts["while_loops"] == 1 and counts["instructions"] > counts["fusions"] >= 0
    found = bc.kernels_by_source(text)
    by = {k["source"].split(":")[-1]: k for k in found["kernels"]}
    # the sort is one launch; the loop body's kernels run 7 times each
    assert by["_loop_then_sort"]["launches"] >= 1 and by["_doubled"]["launches"] == 7 * by["_doubled"]["instructions"] > 0
    # the one loop, traced in _loop_then_sort, its trip count known, reached once a call
    [loop] = found["loops"]
    assert loop["op"] == "while" and loop["source"].endswith(":_loop_then_sort")
    assert loop["trip_count"] == 7 and loop["times_per_call"] == 1


def test_kernels_by_source_lists_the_copies():
    """An input kept and updated out of place: XLA copies it (twice on XLA:CPU); each top-level
    copy is listed with its shape and bytes."""
    from scripts import bench_compile as bc
    text = jax.jit(_kept_and_updated).lower(np.ones((64, 32), np.float32)).compile().as_text()
    copies = bc.kernels_by_source(text)["copies"]
    assert copies and all(c["shape"] == "f32[64,32]" and c["bytes"] == 64 * 32 * 4 and c["times_per_call"] == 1
                          for c in copies)


def test_time_by_source_sums_a_profiles_kernels_by_the_function_that_traced_them():
    """Every kernel instruction of a compiled module is named as its launches are in a GPU trace
    ('.' as '_') with its source function; a profile's instances sum by it, and a kernel that is
    no instruction of the module (a Pallas or library kernel) keeps its report name."""
    from scripts import bench_common as bcm
    text = jax.jit(_loop_then_sort).lower(np.ones(64, np.float32)).compile().as_text()
    sources = bcm.kernel_sources(text)
    assert sources and all("." not in name and "-" not in name for name in sources)
    owners = {src.rsplit(":", 1)[1] for src in sources.values()}
    assert {"_doubled", "_loop_then_sort"} <= owners, owners
    instances = {name: [1e6 * (i + 1), 2] for i, name in enumerate(sources)}
    instances["rms_inv_kernel_3"] = [5e6, 4]
    rows = bcm.time_by_source(instances, sources, calls=2)
    want = {}
    for (name, (ns, n)) in instances.items():
        key = sources.get(name, "[rms_inv]")
        want[key] = (want.get(key, (0, 0))[0] + ns / 2e6, want.get(key, (0, 0))[1] + n / 2)
    assert {r["source"]: (pytest.approx(r["ms_per_call"]), r["launches_per_call"]) for r in rows} == want
    assert [r["ms_per_call"] for r in rows] == sorted((r["ms_per_call"] for r in rows), reverse=True)
    # each source's kinds add up to it
    for r in rows:
        assert sorted(r["by_kind"]) == r["kinds"]
        assert sum(ms for ms, _ in r["by_kind"].values()) == pytest.approx(r["ms_per_call"], abs=1e-3)
        assert sum(n for _, n in r["by_kind"].values()) == r["launches_per_call"]


def _kept_and_updated(a):
    return a, a.at[0].set(1.0)


def _doubled(i, x):
    return jnp.sin(x * 2.0 + i)


def _loop_then_sort(a):
    return jnp.sort(jax.lax.fori_loop(0, 7, _doubled, a))


def test_bench_sampler_times_both_sorts_and_both_kinds_of_rows(tmp_path):
    """scripts/bench_sampler.py on a small vocabulary: the engine's options and CUB's sort, greedy
    and sampled rows, each timed both ways, with the conditional found in the host's trace."""
    import json
    from scripts import bench_sampler
    out = tmp_path / "s.json"
    assert bench_sampler.main(["--out", str(out), "--rows", "2", "--vocab", "512", "--iters", "2"]) == 0
    cases = json.loads(out.read_text())["cases"]
    assert {(c["variant"], c["temperature"]) for c in cases} == {(v, t) for v in ("engine", "cub") for t in (0.0, 1.0)}
    assert all(c["rows"] == 2 and c["sync_ms"] > 0 and c["back_to_back_ms"] > 0 for c in cases)
    # XLA:CPU runs every conditional on the host: each case's trace shows it by name
    assert all(any(n.startswith("cond") for n in c["host_events"]) for c in cases)


@pytest.mark.skipif(not WHOLE, reason="whole run only (V41_FARM=all): a benchmark script end to end, ~45-70 CPU-s (suite time)")
def test_bench_decode_choices_compares_each_choice_with_its_alternatives(tmp_path):
    """scripts/bench_decode_choices.py --smoke: every alternative of each choice ran and timed, and
    they are exact alternatives (the E4M3 routes give the same MoE output bits, the rms_inv
    loop shapes the same statistic bits, the grouped GEMM's tile shapes and transposed tiles the
    same pairs), at widths where the rules pick differently."""
    from scripts import bench_decode_choices
    out = tmp_path / "c.json"
    assert bench_decode_choices.main(["--out", str(out), "--smoke", "--reps", "1"]) == 0
    cases = json.loads(out.read_text())["cases"]
    e4m3 = [c for c in cases if c["name"].startswith("e4m3/")]
    assert {c["name"].rsplit("/", 1)[1] for c in e4m3} == {"rule", "direct", "via-fp16"}
    assert all(c["ms"] > 0 for c in e4m3) and [c["bit_equal"] for c in e4m3 if "bit_equal" in c] == [True, True]
    impl = {c["name"] for c in cases if c["name"].startswith("moe-impl/")}
    assert {n.rsplit("/", 1)[1] for n in impl} == {"gemv", "grouped", "grouped-bn32"}
    rms = [c for c in cases if c["name"].startswith("rms-runs/")]
    assert len(rms) == 9 and all(c["bit_equal_to_rule"] for c in rms)
    prefill = [c for c in cases if c["name"].startswith("moe-prefill/")]
    assert {c["name"].split("/", 2)[2] for c in prefill} == {
        "fp8/default", "fp8/bn64", "fp8/bm256-bn64", "fp8/bn64-k128", "fp8/bn64-s4", "fp8/bn64-w4",
        "bf16/default"}
    assert all(c["ms"] > 0 for c in prefill)
    assert all(c["bit_equal_to_default"] for c in prefill if not c["name"].endswith("/default"))
    assert sum("bit_equal_to_default" in c for c in prefill) == 5      # every fp8 variant


def test_random_cache_fills_packed_index_planes_with_on_grid_keys():
    """The synthetic cache of a `--index-format fp4` run: every (packed FP4) index plane holds
    random keys that decode finite and re-quantize to themselves (the fp4 grid)."""
    from v41_jax.cache.buffer import allocate
    from v41_jax.cache.geometry import CacheGeometry, EngineSettings, row_formats
    from v41_jax.model.numerics import Numerics
    from v41_jax.quant import fp4_qdq_ue8m0, unpack_fp4_ue8m0_rows

    cfg = ModelConfig.from_file(TINY)
    geom = CacheGeometry.build(cfg, EngineSettings(page_tokens=8, num_pages=4, slots=2,
                                                   **row_formats(Numerics.fast(), "fp4")))
    cursor = jnp.zeros((2, geom.history + 1), jnp.int32)
    cache = bs.randomize_cache(allocate(geom), jax.random.key(0), cursor)
    for plane in cache.index:
        assert plane.dtype == jnp.uint8
        keys = unpack_fp4_ue8m0_rows(plane, dtype=jnp.float32)
        assert keys.shape[-1] == geom.index_dim and np.isfinite(keys).all() and np.asarray(keys).std() > 0.1
        np.testing.assert_array_equal(np.asarray(fp4_qdq_ue8m0(keys)), np.asarray(keys))


def test_random_cache_fills_packed_kv_planes_with_on_grid_rows():
    """The synthetic cache of a `--kv-format packed` run: the main planes (FP4) and the window
    rings (FP8) hold random rows that decode finite, on their grids."""
    from kernels_pallas.sparse_attn import decode_rows
    from v41_jax.cache.buffer import allocate
    from v41_jax.cache.geometry import KV_PACKED, CacheGeometry, EngineSettings, row_formats
    from v41_jax.model.numerics import Numerics
    from v41_jax.quant import fp4_qdq_e4m3, fp8_act_qdq

    cfg = ModelConfig.from_file(TINY)
    geom = CacheGeometry.build(cfg, EngineSettings(page_tokens=8, num_pages=4, slots=2,
                                                   **row_formats(Numerics.fast(), kv_format=KV_PACKED)))
    cursor = jnp.zeros((2, geom.history + 1), jnp.int32)
    cache = bs.randomize_cache(allocate(geom), jax.random.key(0), cursor)
    for plane, qdq in [*((m, fp4_qdq_e4m3) for m in cache.main), (cache.window, fp8_act_qdq)]:
        assert plane.dtype == jnp.uint8
        rows = decode_rows(plane, geom.head_dim, jnp.float32)
        assert rows.shape[-1] == geom.head_dim and np.isfinite(rows).all() and np.asarray(rows).std() > 0.1
        np.testing.assert_array_equal(np.asarray(qdq(rows)), np.asarray(rows))


def test_compare_numerics_offers_the_policys_switches_one_comparison_a_run(tmp_path):
    """`--compare-numerics FIELD` takes the boolean fields of `Numerics` (exact_rms among them, not
    act_dtype, nor `quantized`, which the checkpoint sets), and one comparison per run: with
    --compare-kernel it stops before any work."""
    from dataclasses import fields
    from v41_jax.numerics import Numerics
    bools = {f.name for f in fields(Numerics) if isinstance(getattr(Numerics.fast(), f.name), bool)}
    assert set(bs.POLICY_SWITCHES) == bools - {"quantized"} and "exact_rms" in bools and "act_dtype" not in bools
    out = str(tmp_path / "r.json")
    assert bs.parse_args(["--config", TINY, "--out", out, "--compare-numerics", "exact_rms"]).compare_numerics == "exact_rms"
    with pytest.raises(SystemExit):
        bs.parse_args(["--config", TINY, "--out", out, "--compare-numerics", "act_dtype"])
    with pytest.raises(SystemExit, match="one comparison per run"):
        bs.main(["--config", TINY, "--out", out, "--compare-numerics", "exact_rms", "--compare-kernel", "rope"])
    with pytest.raises(SystemExit, match="add --dense fp8"):      # nothing to compare on the bf16 hold
        bs.main(["--config", TINY, "--out", out, "--compare-kernel", "dense_fp8"])
    assert not Path(out).exists()


@pytest.mark.skipif(not WHOLE, reason="whole run only (V41_FARM=all): a benchmark script end to end, ~35-55 CPU-s (suite time)")
def test_compare_option_times_two_executables_of_one_lowering_on_the_same_inputs(tmp_path):
    """`--compare-option KEY=VALUE`: each case compiled with the engine's options and with KEY set
    to VALUE, timed interleaved; both variants fed the same tokens, so their outputs are compared
    byte for byte (on the CPU a GPU-only option changes nothing: no output may differ, the
    control's nor the variants'). An empty value (e.g. command buffers off) is a variant of its own,
    compared like any other. A malformed option stops at the command line."""
    out = tmp_path / "r.json"
    assert bs.main(["--config", TINY, "--out", str(out), "--batches", "1", "--prefill=", "--context", "32",
                    "--iters", "2", "--case-s", "0.2", "--compare-option", "xla_gpu_enable_command_buffer="]) == 0
    data = json.loads(out.read_text())
    comp = data["comparisons"]["decode b=1 ctx=32"]
    # every case is also timed waited with the previous call's logits freed first
    assert all(c["step_ms_outputs_dropped_median"] > 0 for c in data["cases"])
    assert comp["compared"] == "xla_gpu_enable_command_buffer"
    assert comp["engine"]["calls"] > 0 and comp["''"]["calls"] > 0
    assert len(comp["''"]["back_to_back_ms"]) == 5 and min(comp["engine"]["back_to_back_ms"]) > 0
    assert "''_minus_engine_back_to_back_ms" in comp and "''_minus_engine_ms" in comp
    assert comp["differing_outputs"] == {"control": {}, "control_second": {}, "variants": {}}
    assert bs._option("xla_a=true") == ("xla_a", True) and bs._option("xla_b=-3") == ("xla_b", -3)
    assert bs._option("xla_c=LHS") == ("xla_c", "LHS") and bs._option("xla_d=") == ("xla_d", "")
    for bad in ("xla_gpu_command_buffer_scheduling_mode", "scheduling=LHS"):
        with pytest.raises(SystemExit):
            bs.parse_args(["--config", TINY, "--out", str(out), "--compare-option", bad])


@pytest.mark.skipif(not WHOLE, reason="whole run only (V41_FARM=all): a benchmark script end to end, ~35-55 CPU-s (suite time)")
def test_compare_dense_times_both_holds_of_the_same_values(tmp_path):
    """`--compare-dense`: each case with the dense FP8 weights held bf16 and held as published,
    the same values (the bf16 variant the fp8 one's decode), timed interleaved; on the CPU both
    run XLA's GEMM on the decoded values, so no output may differ; each variant's ideal counts its
    own bytes (the dense weights' one byte a weight against two)."""
    out = tmp_path / "r.json"
    assert bs.main(["--config", TINY, "--out", str(out), "--batches", "1", "--prefill=", "--context", "32",
                    "--iters", "2", "--case-s", "0.2", "--compare-dense"]) == 0
    data = json.loads(out.read_text())
    comp = data["comparisons"]["decode b=1 ctx=32"]
    assert comp["compared"] == "dense" and comp["bf16"]["calls"] > 0 and comp["fp8"]["calls"] > 0
    assert comp["differing_outputs"]["variants"] == {}
    rows = {c["variant"]["dense"]: c for c in data["cases"]}
    assert rows["fp8"]["bytes"]["dense_weights"] < rows["bf16"]["bytes"]["dense_weights"]
    assert rows["fp8"]["bytes"]["experts_expected"] == rows["bf16"]["bytes"]["experts_expected"]


def test_differing_counts_and_sizes_what_differs_and_option_sets_every_case(tmp_path):
    """`differing`: per leaf the elements that differ (NaN == NaN, any payload, in every float
    dtype), for floats the largest difference among those finite in both (in float64: no
    overflow), the largest magnitude there and how many differ where either side is NaN or
    infinite; integer leaves (int4 too) by count. `--option` reaches every case's compile: an
    invalid enum value fails each case's compile."""
    e4 = jnp.asarray([1.0, 2.0, jnp.nan, 4.0], jnp.float8_e4m3fn)
    e5 = jnp.asarray([1.0, jnp.nan], jnp.float8_e5m2)
    i4 = jnp.asarray([1, 2], jnp.int4)
    a = {"x": jnp.asarray([1.0, jnp.nan, 3.0, 5.0, 3e38, jnp.nan, jnp.inf]), "e4": e4, "e5": e5, "i4": i4,
         "i": jnp.asarray([1, 2, 3])}
    b = {"x": jnp.asarray([1.0, jnp.nan, 3.5, jnp.inf, -3e38, jnp.inf, -jnp.inf]),
         "e4": jnp.asarray([1.0, 2.5, jnp.nan, 4.0], jnp.float8_e4m3fn), "e5": e5,
         "i4": jnp.asarray([1, 3], jnp.int4), "i": jnp.asarray([1, 0, 3])}
    got = bs.differing(a, b)
    assert got.keys() == {"['x']", "['e4']", "['i4']", "['i']"}
    x = got["['x']"]
    assert x["elements"] == 5 and x["nonfinite"] == 3 and x["max_abs"] == pytest.approx(3e38, rel=1e-6)
    assert x["max_abs_diff"] == pytest.approx(6e38, rel=1e-6)
    assert got["['e4']"] == {"elements": 1, "max_abs_diff": 0.5, "max_abs": 2.0, "nonfinite": 0}
    assert got["['i4']"] == got["['i']"] == {"elements": 1}
    assert bs.differing(a, a) == {}
    out = tmp_path / "o.json"
    bs.main(["--config", TINY, "--out", str(out), "--batches", "1,2", "--prefill=", "--context", "32",
             "--iters", "2", "--case-s", "0.2", "--option", "xla_gpu_command_buffer_scheduling_mode=BOGUS"])
    res = json.loads(out.read_text())
    assert res["compile_options"]["xla_gpu_command_buffer_scheduling_mode"] == "BOGUS"
    assert len(res["cases"]) == 2 and all(c.get("error", "").startswith("compile:") and "BOGUS" in c["error"]
                                          for c in res["cases"])
    with pytest.raises(SystemExit):
        bs.main(["--config", TINY, "--out", str(out), "--compare-option", "xla_gpu_command_buffer_scheduling_mode=engine"])


def test_bench_graph_launch_times_straight_and_looped_programs(tmp_path):
    """scripts/bench_graph_launch.py on tiny arrays: each size straight-line and as a loop, both
    timed waited and back to back; the loop's program computes what the straight one does."""
    from scripts import bench_graph_launch as bg
    out = tmp_path / "g.json"
    assert bg.main(["--out", str(out), "--kernels", "4,8", "--iters", "2", "--shape", "8,16"]) == 0
    cases = json.loads(out.read_text())["cases"]
    assert [(c["kind"], c["pairs"]) for c in cases] == [("straight", 2), ("straight", 4), ("loop", 2), ("loop", 4)]
    assert all(c["waited_ms"] > 0 and c["back_to_back_ms"] > 0 for c in cases)
    x = jnp.arange(128, dtype=jnp.float32).reshape(8, 16)
    np.testing.assert_allclose(np.asarray(bg.looped(x, 3)), np.asarray(bg.straight(x, 3)), rtol=1e-6)
    with pytest.raises(SystemExit):
        bg.main(["--out", str(out), "--kernels", "a,b"])
