"""Check the model against an official-reference fixture folder.

    python -m v41_jax.tools.check_reference DIR [--json] [--numerics reference|fast] [--engine]
                                                [--tolerance auto|cpu|gpu] [--conditioning N]
                                                [--free-running]

DIR holds `checkpoint/` (published format, `config.json`, `engram_token_map.json`) and
`outputs_lowest_index_ties.npz` (the official reference run with lower-index tie-breaking; layout in
tests/fixtures/dsv41_official/SOURCE.md), and the DSpark taps of every prompt row in it or in a
`prefill_taps.npz` beside it. Exit status 0 only if every check passes. Every rule is written out,
with its measurements, in docs/MODEL.md §6.

What runs
  * the full forward over prompt + decode.input_ids (16 teacher-forced steps). Decode step i is
    the row S + i of that forward: the forward is causal, so it equals a forward over
    prompt + input_ids[:i+1] taking the last position (the oracle decode). The top-k widths can
    differ between the two only where every visible row is selected anyway (validate() requires
    candidate_topk_blocks * candidate_block_size >= index_topk, so a candidate restriction never
    bites while fewer than index_topk rows are visible), so the selected sets are the same;
  * the DSpark draft head at every decode step (anchor S + i, first token the step's output), on
    the model's own taps and on the reference's;
  * teacher forcing: the reference's own selections (index top-k, candidate blocks, gate top-k,
    DSpark gate and Markov chain) are what the model attends / routes with, while the model's own
    selections are compared with the reference's separately. Without it one legitimate near-tie
    flip changes everything downstream, and the numeric comparisons would measure the flip;
  * the conditioning run (`selection_conditioning`: N = 4 one-ulp nudges of the model by default;
    where the device's own deviation from the reference is a draw of that noise, as on a GPU,
    nudges of the device's measured size, ceil(K / 0.05) - 1 of them, and where a rank rule is
    beyond their reach, more up to ceil(F / 0.05) - 1 for a run of F fixture checks, `two_stage`)
    that the near-tie scales of the selection rules, and there the head-alone allowance, are
    measured from;
  * with --free-running, one unforced forward for the free-running greedy comparison.

Tolerances (the arithmetic behind them)
  * exact: Engram hash ids (integer arithmetic).
  * bf16 tensors (block outputs, Engram outputs, final hidden states, DSpark main hidden): each
    element's error in units of the bf16 ulp of its row's RMS ("row ulps"). Two correct
    implementations round the same bf16 value differently wherever an fp32 intermediate differs in
    its last bit (fp32 GEMM and reduction order, exp / sigmoid implementations, FMA contraction:
    torch-CPU and XLA differ in all of these), and the fake-quant amplifies such a flip into a
    whole quantization step of its group (an fp8 step is 2^-3 relative; an fp4 step or a flipped
    ue8m0 scale rescales 32 index lanes), which residual mixing then spreads over the row. So the
    median must stay at a few ulps (row_ulps_p50), while the tail is bounded by row_ulps_p99 /
    row_ulps_max (`Tolerance`; CPU and GPU profiles, chosen by the backend), or per tensor by how
    far the conditioning's gentlest nudge moves it on this fixture where that is further
    (`tensor_noise`, `tensor_tolerance`). A real defect (a wrong weight, position, mask or rounding
    point) moves the bulk of a row by tens to thousands of row ulps.
  * target logits: logits = normed . W in fp32, so |dlogit[p, v]| <= sum_d |dn[p, d]| |W[v, d]| +
    2 D u32 sum_d |n[p, d] W[v, d]|, with dn the observed final-normed difference (itself checked
    above) and u32 = 2^-24 (fp32 dot rounding on both sides). Every logit must satisfy it.
  * DSpark (docs/MODEL.md §6.2): the taps on every row a draft reads (bf16 rule above); the head on
    the reference's taps within, per lane of its normed (confidence: pre-norm) hidden, the larger
    of one bf16 ulp and the most the conditioning's nudges moved the lane, + fp32 rounding; the
    head on the model's own taps within sum_d |dn_d||W_vd| of the measured draft-hidden difference
    dn (own taps run - reference taps run) + that allowance.
  * pre-mix (sigmoid outputs in (0, 1]): row_ulps_p50 bf16 ulps at 1.
  * selections, per row (docs/MODEL.md §6.3): the model's own picks equal the reference's, or the
    row is a near-tie by a scale measured on this fixture by the conditioning run: index / candidate
    rows within the layer's rank reach of the conditioning's noise (or, beyond it, the device no
    further past the draws than a draw is past the rest: the second stage), router rows within
    2 x its gate-score noise. An exact tie of the model's own scores resolved to the higher index
    always fails. Rows the fixture flags `tie_consequential` are counted and reported on their
    own; also reported per key: recall (share of reference picks the model made) and the worst
    missed rank.
  * greedy ids (decode outputs, DSpark drafts): equal, or the model's logit gap between its argmax
    and the reference's token is within that row's logit bound (a near-tie).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from dataclasses import asdict, dataclass, field, replace
from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from v41_jax.checkpoint.load import DENSE_HOLDS, ENGRAM_KEY, EXPERT_HOLDS, load_params, load_token_map
from v41_jax.config import ModelConfig, exit_2_on_refusal
from v41_jax.engram_hash import EngramHasher
from v41_jax.model import dspark
from v41_jax.model.engram import sequence_rows
from v41_jax.model.forward import forward
from v41_jax.model.norm import rms_norm
from v41_jax.model.numerics import Numerics

OUTPUTS = "outputs_lowest_index_ties.npz"
# the DSpark taps of every prompt row (the draft reads back into the prompt): in the outputs, or a sidecar
TAPS_ALL = "prefill.dspark_main_hidden_all"
TAPS_SIDECAR = "prefill_taps.npz"
N_DECODE = 16
U32 = 2.0 ** -24
SELECTIONS = ("index_topk", "candidate_blocks", "gate_topk")
# one-ulp nudges per fixture the near-tie scales are measured from (`selection_conditioning`)
CONDITIONING_RUNS = 4


@dataclass(frozen=True)
class Tolerance:
    row_ulps_p50: float   # bf16 tensors: median |err| / ulp(row rms) ...
    row_ulps_p99: float   # ... its 99th percentile ...
    row_ulps_max: float   # ... and its maximum


# XLA:CPU against torch-CPU: the differences are last-bit (FMA contraction, exp, GEMM order).
CPU = Tolerance(4.0, 24.0, 64.0)
# On a GPU the GEMMs accumulate in another order again (cuBLAS / Triton tiles, split-K) and exp and
# XLA's own sqrt are approximate (divisions are IEEE: `xla_env`), so more fp32 intermediates flip
# their bf16 rounding before the fake-quant amplifies them. Measured on the H200 (BENCHMARKS.md):
# final hidden-state medians of 6-10 row ulps for both the forward and the cache path (2026-12-02;
# the farm's largest p50 10.5 on 2026-12-04 e). A real defect still moves the bulk of a row by
# hundreds of row ulps.
GPU = Tolerance(16.0, 96.0, 256.0)


def default_tolerance() -> Tolerance:
    return CPU if jax.default_backend() == "cpu" else GPU


@dataclass
class Check:
    key: str
    passed: bool
    tolerance: str
    stats: dict = field(default_factory=dict)


# ---- numbers ------------------------------------------------------------------------------------

def bf16_ulp(x: np.ndarray) -> np.ndarray:
    """Spacing of bf16 values at |x| (normal range)."""
    x = np.maximum(np.abs(np.asarray(x, np.float64)), 2.0 ** -126)
    return 2.0 ** (np.floor(np.log2(x)) - 7)


def _ordered_bits(x: np.ndarray) -> np.ndarray:
    b = np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).view(np.int16).astype(np.int64)
    return np.where(b < 0, -32768 - b, b)


def _pct(x: np.ndarray) -> dict:
    x = np.asarray(x, np.float64).ravel()
    p50, p90, p99 = np.percentile(x, [50, 90, 99]) if x.size else (0.0, 0.0, 0.0)
    return {"p50": float(p50), "p90": float(p90), "p99": float(p99), "max": float(x.max(initial=0.0))}


def compare_bf16(key: str, ours: np.ndarray, ref: np.ndarray, tol: Tolerance) -> Check:
    """Elementwise error of bf16-valued tensors, scaled by the bf16 ulp of each row's RMS."""
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    err = np.abs(ours - ref)
    row_rms = np.sqrt(np.mean(ref ** 2, axis=-1, keepdims=True))
    row_ulps = err / bf16_ulp(row_rms)
    stats = {"max_abs": float(err.max()), "max_rel_to_row_rms": float((err / np.maximum(row_rms, 1e-30)).max()),
             "exact_frac": float((err == 0).mean()), "row_ulps": _pct(row_ulps),
             "element_ulps": _pct(np.abs(_ordered_bits(ours) - _ordered_bits(ref)))}
    r = stats["row_ulps"]
    passed = r["p50"] <= tol.row_ulps_p50 and r["p99"] <= tol.row_ulps_p99 and r["max"] <= tol.row_ulps_max
    return Check(key, passed, f"row ulps p50 <= {tol.row_ulps_p50:g}, p99 <= {tol.row_ulps_p99:g}, "
                 f"max <= {tol.row_ulps_max:g}", stats)


def compare_fp32(key: str, ours: np.ndarray, ref: np.ndarray, atol: float, why: str) -> Check:
    err = np.abs(np.asarray(ours, np.float64) - np.asarray(ref, np.float64))
    stats = {"max_abs": float(err.max()), "abs": _pct(err)}
    return Check(key, stats["max_abs"] <= atol, f"|err| <= {atol:g} ({why})", stats)


def compare_bounded(key: str, ours: np.ndarray, ref: np.ndarray, bound: np.ndarray, why: str) -> Check:
    err = np.abs(np.asarray(ours, np.float64) - np.asarray(ref, np.float64))
    ratio = err / np.maximum(bound, 1e-30)
    stats = {"max_abs": float(err.max()), "abs": _pct(err), "err_over_bound": _pct(ratio),
             "bound": _pct(bound)}
    return Check(key, bool((err <= bound).all()), why, stats)


def compare_exact(key: str, ours: np.ndarray, ref: np.ndarray) -> Check:
    ours, ref = np.asarray(ours), np.asarray(ref)
    bad = (ours != ref).reshape(ours.shape[0], -1).any(-1) if ours.shape == ref.shape else np.ones(1, bool)
    return Check(key, not bad.any(), "bit-exact", {"rows": int(bad.size), "mismatched_rows": int(bad.sum())})


def head_bound(normed_diff: np.ndarray, normed: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Bound on |dlogit| from a hidden-state difference: sum_d |dn_d| |W_vd| + 2 D u32 sum_d |n_d W_vd|."""
    aw = np.abs(w.astype(np.float64))
    return np.abs(normed_diff) @ aw.T + 2 * w.shape[1] * U32 * (np.abs(normed) @ aw.T)


# ---- selections ---------------------------------------------------------------------------------

def _canon(ids: np.ndarray, width: int) -> np.ndarray:
    """Rows of picks as sorted sets, -1 (no pick) first, padded / cut to `width` columns."""
    ids = np.sort(np.asarray(ids), axis=-1)
    pad = width - ids.shape[-1]
    if pad > 0:
        ids = np.concatenate([np.full(ids.shape[:-1] + (pad,), -1), ids], -1)
    return np.sort(ids, axis=-1)[..., ids.shape[-1] - width:]


def _block_scores(scores: np.ndarray, block: int) -> np.ndarray:
    """Index scores [..., N] -> candidate-block scores (best visible row; the pinned newest block
    gets +inf, as the candidate source ranks it)."""
    n = scores.shape[-1]
    padded = np.concatenate([scores, np.full(scores.shape[:-1] + (-n % block,), -np.inf)], -1)
    blocks = padded.reshape(*scores.shape[:-1], -1, block).max(-1)
    visible = np.isfinite(scores).sum(-1)  # the source's scores are unrestricted: finite = visible
    newest = (visible - 1) // block
    hit = (np.arange(blocks.shape[-1]) == newest[..., None]) & (visible[..., None] > 0)
    return np.where(hit, np.inf, blocks)


def _only(a: np.ndarray, b: np.ndarray) -> list[int]:
    return [int(i) for i in a if i >= 0 and i not in b]


def missed_picks(own: np.ndarray, ref: np.ndarray) -> int:
    """Reference picks the model did not make, summed over rows of [R, k] picks (-1: none)."""
    return sum(len(_only(r, o)) for o, r in zip(own, ref))


def missed_rank(own: np.ndarray, ref: np.ndarray, scores: np.ndarray) -> float:
    """Worst rank, in the model's own scores and in units of k, of a reference pick the model
    missed (0 when it missed none; inf for a pick outside the scored range)."""
    k = max(int((ref >= 0).sum()), 1)
    rank = np.empty(scores.shape[-1], np.int64)
    rank[np.argsort(-scores, kind="stable")] = np.arange(scores.shape[-1])  # ties: lower index first
    return max([float(rank[i]) / k if i < scores.shape[-1] else np.inf for i in _only(ref, own)], default=0.0)


def tie_to_higher_index(own: np.ndarray, ref: np.ndarray, scores: np.ndarray) -> bool:
    """The model's picks break an exact tie of its *own* scores toward the higher index: a pick
    only it made scores exactly as much as (-0.0 == +0.0) a lower-indexed one only the reference
    made. No noise explains that: the rule on equal scores is the lower index, so it is a defect."""
    n = scores.shape[-1]
    return any(scores[j] == scores[i] for j in _only(own, ref) for i in _only(ref, own) if i < j < n)


@dataclass(frozen=True)
class NearTie:
    """When a row whose picks differ from the reference's is a near-tie, from the one-ulp
    conditioning run of the fixture being checked (`selection_conditioning`):
      rank (index top-k, candidate blocks): every missed reference pick ranks within `reach` * k of
        the model's own scores, `reach` = the furthest one-ulp nudges of the model pushed a pick
        of its own on that layer;
      score (MoE gate): best own-only pick - worst reference-only pick <= 2 * `noise`, `noise` =
        the largest |score change| the nudges caused on that layer (each side's score within
        noise of the other's, so a gap up to 2 * noise can flip)."""
    by_rank: bool
    reach: float = 0.0
    noise: float = 0.0

    def describe(self) -> str:
        return (f"missed reference picks within the own top {self.reach:.3g}k (conditioning reach)" if self.by_rank
                else f"boundary gap <= 2 x {self.noise:.3g} (conditioning score noise)")

    def holds(self, own: np.ndarray, ref: np.ndarray, scores: np.ndarray) -> bool:
        if tie_to_higher_index(own, ref, scores):
            return False
        if self.by_rank:
            return missed_rank(own, ref, scores) <= self.reach
        only_own, only_ref = _only(own, ref), _only(ref, own)
        if not only_own or len(only_own) != len(only_ref):
            return False
        return bool(max(scores[i] for i in only_own) - min(scores[i] for i in only_ref) <= 2 * self.noise)


def compare_selection(key: str, own: np.ndarray, ref: np.ndarray, scores: np.ndarray,
                      consequential: np.ndarray, rule: NearTie) -> Check:
    """own / ref [R, k] picks, scores [R, N] the model's selection scores, consequential [R]."""
    width = ref.shape[-1]
    own_c, ref_c = _canon(own, width), _canon(ref, width)
    differ = (own_c != ref_c).any(-1)
    near = np.array([rule.holds(own_c[r], ref_c[r], scores[r]) if differ[r] else True
                     for r in range(len(differ))])
    hard = differ & ~near
    picks = ref_c >= 0
    missed = missed_picks(own_c, ref_c)
    stats = {"rows": int(len(differ)), "matched": int((~differ).sum()),
             "recall": (int(picks.sum()) - missed) / max(int(picks.sum()), 1), "missed_picks": missed,
             "worst_missed_rank_over_k": max([missed_rank(own_c[r], ref_c[r], scores[r])
                                              for r in np.flatnonzero(differ)], default=0.0),
             "near_tie_mismatches": int((differ & near).sum()), "mismatches_beyond_near_tie": int(hard.sum()),
             "ties_to_higher_index": int(sum(tie_to_higher_index(own_c[r], ref_c[r], scores[r])
                                             for r in np.flatnonzero(differ))),
             "mismatched_rows": np.flatnonzero(differ).tolist(),
             "tie_consequential_rows": int(consequential.sum()),
             "tie_consequential_mismatched": int((consequential & differ).sum())}
    return Check(key, not hard.any(), f"own picks == reference picks, except near-ties ({rule.describe()})", stats)


def compare_ids(key: str, ours_logits: np.ndarray, ref_ids: np.ndarray, bound: np.ndarray) -> Check:
    """Greedy ids: our argmax equals the reference's token, or the gap is within the logit bound."""
    own = ours_logits.argmax(-1)
    rows = np.arange(own.size)
    flat_l, flat_b = ours_logits.reshape(own.size, -1), bound.reshape(own.size, -1)
    own_f, ref_f = own.ravel(), np.asarray(ref_ids).ravel()
    gap = flat_l[rows, own_f] - flat_l[rows, ref_f]
    allowed = flat_b[rows, own_f] + flat_b[rows, ref_f]
    differ = own_f != ref_f
    hard = differ & (gap > allowed)
    return Check(key, not hard.any(), "argmax == reference id, or logit gap within the logit bound",
                 {"ids": int(own.size), "differ": int(differ.sum()), "differ_beyond_bound": int(hard.sum())})


# ---- running the model --------------------------------------------------------------------------

class Fixture(NamedTuple):
    cfg: object
    params: dict
    z: dict          # the reference outputs (npz keys -> arrays)
    hasher: EngramHasher | None


REFERENCE_CONFIG = "reference_config.json"


def load_fixture(folder: str, experts: str = "auto", dense: str = "auto") -> Fixture:
    """The folder's checkpoint through the project's own reader (routed experts held as `experts`,
    dense FP8 weights as `dense`, `load_params`' choices: all hold the same values), its reference outputs (plus the prefill
    taps sidecar where the outputs lack them), its hasher. The model's arguments are the
    reference's own (`checkpoint/reference_config.json`, the ModelArgs the outputs came from)
    where the folder has them: the HF-layout config.json beside them leaves some out (the router's
    `gate_temp`, the `dtype` of an unquantized model), which a config.json of a published
    checkpoint leaves at their defaults (docs/MODEL.md §6)."""
    ckpt = os.path.join(folder, "checkpoint")
    own_args = os.path.join(ckpt, REFERENCE_CONFIG)
    cfg = ModelConfig.from_file(own_args) if os.path.exists(own_args) else None
    cfg, params = load_params(ckpt, cfg, progress=False, experts=experts, dense=dense)
    hasher = EngramHasher(cfg, load_token_map(ckpt, cfg)) \
        if cfg.engram_layer_ids else None
    with np.load(os.path.join(folder, OUTPUTS)) as f:
        z = {k: f[k] for k in f.files}
    sidecar = os.path.join(folder, TAPS_SIDECAR)
    if TAPS_ALL not in z and os.path.exists(sidecar):
        with np.load(sidecar) as f:
            z[TAPS_ALL] = f[TAPS_ALL]
    return Fixture(cfg, params, z, hasher)


def _layer_keys(z, stage: str, kind: str) -> list[int]:
    prefix = f"{stage}.{kind}.L"
    return sorted(int(k[len(prefix):]) for k in z if k.startswith(prefix) and "." not in k[len(prefix):])


def _forced(z, cfg) -> dict:
    """The reference's picks for every row of prompt + decode (batch of one)."""
    out = {}
    for kind in SELECTIONS:
        out[kind] = {l: jnp.asarray(np.concatenate([z[f"prefill.{kind}.L{l}"], z[f"decode.{kind}.L{l}"]])[None])
                     for l in _layer_keys(z, "prefill", kind)}
    return out


def reference_taps(z, s: int) -> tuple[np.ndarray, np.ndarray]:
    """The reference's DSpark taps (main hidden) of prompt + decode rows [S+16, nT*D] and which rows
    the fixture records [S+16]: every row with `prefill.dspark_main_hidden_all`, else the last
    prompt row and the decode rows only."""
    dec = z["decode.dspark_main_hidden"]
    taps = np.zeros((s + N_DECODE, dec.shape[-1]), np.float32)
    known = np.zeros(s + N_DECODE, bool)
    if TAPS_ALL in z:
        taps[:s], known[:s] = z[TAPS_ALL], True
    else:
        taps[s - 1], known[s - 1] = z["prefill.dspark_main_hidden_last"], True
    taps[s:], known[s:] = dec, True
    return taps, known


def draft_rows(s: int, window: int) -> list[np.ndarray]:
    """The context rows the draft head reads at each decode step: anchor S + i sees (anchor - window, anchor]."""
    return [np.arange(max(0, s + i - window + 1), s + i + 1) for i in range(N_DECODE)]


def _host(tree):
    return jax.tree.map(lambda a: np.asarray(jnp.asarray(a).astype(jnp.float32)) if
                        jnp.issubdtype(a.dtype, jnp.floating) else np.asarray(a), tree)


def run_draft(cfg, params, z, taps: np.ndarray, numerics: Numerics) -> dict:
    """The draft head at the 16 decode steps over context taps [S+16, nT*D], teacher-forced on the
    reference's gate picks and Markov tokens -> its logits, confidence, pre-norm and normed hidden,
    gate picks / scores and the Markov embeddings the confidence head read."""
    s = len(z["prompt_ids"])
    ctx = dspark.context_x(params, cfg, jnp.asarray(taps, jnp.bfloat16)[None], numerics)
    ref_ids = z["dspark.output_ids"]
    d = jax.jit(dspark.draft, static_argnames=("cfg", "numerics"))(
        params, cfg, jnp.broadcast_to(ctx, (N_DECODE,) + ctx.shape[1:]), jnp.arange(s, s + N_DECODE),
        jnp.asarray(ref_ids[:, 0]), numerics,
        {l: jnp.asarray(z[f"decode.gate_topk.L{l}"]) for l in range(cfg.n_layers, cfg.n_total_layers)},
        jnp.asarray(ref_ids[:, :-1]))
    last = params["mtp"][-1]
    out = _host({k: v for k, v in d._asdict().items() if not isinstance(v, dict)})
    out["normed"] = _host(rms_norm(d.hidden, last["norm"]["weight"], cfg.norm_eps, numerics))
    out["markov"] = _host(last["markov_head"]["embed"]["weight"][jnp.asarray(ref_ids[:, :-1])])
    out["gate_idx"] = {l: np.asarray(v) for l, v in d.gate_idx.items()}
    out["gate_scores"] = {l: np.asarray(v) for l, v in d.gate_scores.items()}
    return out


def run_model(cfg, params, z, hasher: EngramHasher, numerics: Numerics, forced: bool = True,
              draft: bool = True) -> dict:
    """The full forward over prompt + decode inputs (teacher-forced on the reference's selections
    unless `forced` is False) and, forced and with `draft`, the draft head twice: over the model's
    own taps and over the reference's (`dspark_ref_taps`)."""
    tokens = np.concatenate([z["prompt_ids"], z["decode.input_ids"]])[None]
    hash_ids, rows = sequence_rows(params[ENGRAM_KEY], hasher, cfg, tokens) if cfg.engram_layer_ids else (None, {})
    fwd = jax.jit(forward, static_argnames=("cfg", "numerics", "return_intermediates"))
    logits, inter = fwd(params, cfg, jnp.asarray(tokens), numerics=numerics,
                        engram_rows={l: jnp.asarray(r) for l, r in rows.items()},
                        forced=_forced(z, cfg) if forced else None, return_intermediates=True)
    out = {"logits": np.asarray(logits)[0], "hash_ids": None if hash_ids is None else hash_ids[0],
           "inter": _host(inter)}
    if forced and draft and cfg.n_mtp_layers and cfg.dspark_block_size:
        s = len(z["prompt_ids"])
        own = out["inter"]["main_hidden"][0]
        ref, known = reference_taps(z, s)
        out["dspark"] = run_draft(cfg, params, z, own, numerics)
        # rows the fixture lacks take the model's own taps: the steps reading them are not compared
        out["dspark_ref_taps"] = run_draft(cfg, params, z, np.where(known[:, None], ref, own), numerics)
    return out


# ---- the comparisons ----------------------------------------------------------------------------

def _selection_checks(cfg, z, inter: dict, s: int, draft: dict | None, cond: dict) -> list[Check]:
    checks = []
    block = cfg.candidate_block_size
    for kind, score_key in (("index_topk", "index_scores"), ("candidate_blocks", "index_scores"),
                            ("gate_topk", "gate_scores")):
        for l in _layer_keys(z, "prefill", kind):
            own = inter[kind][l][0]
            scores = inter[score_key][l][0]
            if kind == "candidate_blocks":
                scores = _block_scores(scores, block)
            rule = (NearTie(False, noise=cond["gate_noise"][l]) if kind == "gate_topk"
                    else NearTie(True, reach=cond["rank_reach"][f"{kind}.L{l}"]))
            for stage, rows in (("prefill", slice(0, s)), ("decode", slice(s, s + N_DECODE))):
                key = f"{stage}.{kind}.L{l}"
                checks.append(compare_selection(key, own[rows], z[key], scores[rows],
                                                z[f"{key}.tie_consequential"], rule))
    if draft is not None:
        for l, own in draft["gate_idx"].items():
            key = f"decode.gate_topk.L{l}"
            k = own.shape[-1]
            scores = draft["gate_scores"][l]
            checks.append(compare_selection(key, own.reshape(-1, k), z[key].reshape(-1, k),
                                            scores.reshape(-1, scores.shape[-1]), z[f"{key}.tie_consequential"].ravel(),
                                            NearTie(False, noise=cond["gate_noise"][l])))
    return checks


# ---- how well-conditioned the selections are ------------------------------------------------------

def _ulp_nudge(w: jax.Array, rng: np.random.Generator, ulps: int) -> jax.Array:
    """Every bf16 value moved by `ulps` ulps (steps of its bit pattern), up or down at random."""
    bits = np.asarray(w).view(np.uint16).astype(np.int32)
    step = ulps * rng.choice(np.array([-1, 1], np.int32), bits.shape)
    return jnp.asarray((bits + step).astype(np.uint16).view(ml_dtypes.bfloat16))


def nudged_params(params: dict, seed: int, ulps: int = 1) -> dict:
    """The embedding and every block's (backbone and DSpark) attn/ffn RMSNorm weight moved by
    `ulps` bf16 ulps (one: the size of the last-bit difference two correct implementations leave
    in each layer's normed input). A seed gives the same signs at every size."""
    rng = np.random.default_rng(seed)

    def nudge(blocks):
        return [dict(p, attn_norm={"weight": _ulp_nudge(p["attn_norm"]["weight"], rng, ulps)},
                     ffn_norm={"weight": _ulp_nudge(p["ffn_norm"]["weight"], rng, ulps)}) for p in blocks]
    out = dict(params, embed={"weight": _ulp_nudge(params["embed"]["weight"], rng, ulps)},
               layers=nudge(params["layers"]))
    if params.get("mtp"):
        out["mtp"] = nudge(params["mtp"])
    return out


def _picks(cfg, out: dict) -> dict:
    """Index / candidate picks with the scores they were taken from, per layer (all rows)."""
    inter, res = out["inter"], {}
    for kind in ("index_topk", "candidate_blocks"):
        for l, ids in inter[kind].items():
            sc = inter["index_scores"][l][0]
            sc = _block_scores(sc, cfg.candidate_block_size) if kind == "candidate_blocks" else sc
            res[f"{kind}.L{l}"] = (_canon(ids[0], ids.shape[-1]), sc)
    return res


def _gate_scores(out: dict) -> dict:
    scores = {l: v[0] for l, v in out["inter"]["gate_scores"].items()}
    if "dspark" in out:
        scores.update(out["dspark"]["gate_scores"])
    return scores


def split_taps(cfg, a: np.ndarray) -> np.ndarray:
    """DSpark main hidden [..., nT * D] -> one row per target layer [..., nT, D]."""
    return a.reshape(*a.shape[:-1], len(cfg.dspark_target_layer_ids), cfg.dim)


def read_tap_rows(cfg, known: np.ndarray, s: int) -> np.ndarray:
    """The token rows some step's draft reads whose reference taps the fixture records (`known`,
    from `reference_taps`): the rows `dspark.taps` compares."""
    rows = np.unique(np.concatenate(draft_rows(s, cfg.window_size)))
    return rows[known[rows]]


def bf16_tensors(cfg, out: dict, s: int, taps: bool, tap_rows: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """A run's bf16 tensors the fixture records, by check key, in the reference's layout; with
    `taps` the DSpark main hidden too (one row per target layer), and with `tap_rows` the taps the
    draft checks compare (`dspark.taps`, on `read_tap_rows`). The checked run is compared on these
    with the reference's (`check_folder`, `_dspark_checks`), and each nudged run of the conditioning
    with the unnudged run (`tensor_noise`)."""
    inter = out["inter"]
    dec = slice(s, s + N_DECODE)
    block_out = inter["block_out"][:, 0]                                        # [L, S+16, N, D]
    res = {"prefill.block_out_last": block_out[:, s - 1],
           "decode.block_out": block_out[:, dec].transpose(1, 0, 2, 3)}
    if cfg.engram_layer_ids:
        engram_out = np.stack([inter["engram_out"][l][0] for l in cfg.engram_layer_ids])  # [nE, S+16, N, D]
        res["prefill.engram_out_last"] = engram_out[:, s - 1]
        res["decode.engram_out"] = engram_out[:, dec].transpose(1, 0, 2, 3)
    normed = inter["final_normed"][0]
    res["prefill.final_collapsed_last"] = inter["final_collapsed"][0, s - 1]
    res["prefill.final_normed_all"] = normed[:s]
    res["decode.final_normed"] = normed[dec]
    if taps and inter["main_hidden"] is not None:
        mh = inter["main_hidden"][0]
        res["prefill.dspark_main_hidden_last"] = split_taps(cfg, mh[s - 1])
        res["decode.dspark_main_hidden"] = split_taps(cfg, mh[dec])
        if tap_rows is not None:
            res["dspark.taps"] = split_taps(cfg, mh[tap_rows])
    return res


def tensor_tolerance(tol: Tolerance, noise: dict | None) -> Tolerance:
    """The profile, or where larger the conditioning's measure of how far one-ulp-sized noise moves
    this tensor on this fixture (`selection_conditioning`'s `tensor_noise`, per statistic)."""
    if not noise:
        return tol
    return Tolerance(max(tol.row_ulps_p50, noise["p50"]), max(tol.row_ulps_p99, noise["p99"]),
                     max(tol.row_ulps_max, noise["max"]))


def _recorded(t) -> list[np.ndarray]:
    """The tensors the conditioning's deviation is measured on, from a run's `bf16_tensors` or the
    reference's outputs alike: every layer's block output at the last prompt row and the decode
    rows [L, 17, N, D], the final normed rows [S+16, D]."""
    blocks = np.concatenate([t["prefill.block_out_last"][None], t["decode.block_out"]]).transpose(1, 0, 2, 3)
    return [blocks, np.concatenate([t["prefill.final_normed_all"], t["decode.final_normed"]])]


def mean_row_ulps(ours: list[np.ndarray], ref: list[np.ndarray]) -> float:
    """Mean |ours - ref| over every element of the tensors, in row ulps of ref (as `compare_bf16`)."""
    ulps = [np.abs(np.asarray(a, np.float64) - b) /
            bf16_ulp(np.sqrt(np.mean(np.asarray(b, np.float64) ** 2, -1, keepdims=True))) for a, b in zip(ours, ref)]
    return float(np.concatenate([u.ravel() for u in ulps]).mean())


def _head_inputs(out: dict) -> dict:
    """The draft head's inputs to its two outputs on the reference's taps: the normed draft hidden
    (logits) and the pre-norm hidden + Markov embedding (confidence), [16, ...] each."""
    d = out["dspark_ref_taps"]
    return {"normed": d["normed"], "conf_in": np.concatenate([d["hidden"], d["markov"]], -1)}


# a nudge of 2^6 ulps moves a bf16 weight by a quarter to a half of its value: past that it is no
# longer a perturbation, and a device that far from the reference fails the bf16 profile anyway
MAX_NUDGE_ULPS = 64
# a device whose bf16 tensors sit nearer the reference's than this share of the gentlest one-ulp
# nudge's deviation differs from it in last bits only (`selection_conditioning`): a classification
# margin between the two kinds of device measured (docs/MODEL.md §6.3), not a tolerance
INSIDE = 0.5
# where the device's own run is one more draw of the nudges' noise, the chance that a correct
# device fails by the luck of the draw: a significance level, not a scale. Per fixture check in
# the first stage (`selection_conditioning`), for the whole family of checks run together (a
# farm: fixtures x modes) in the second (`stage2_passes`; docs/MODEL.md §6.3)
FALSE_FAIL = 0.05
# the row-ulp statistics a bf16 tensor check bounds (`Tolerance`)
TENSOR_STATS = ("p50", "p99", "max")


def selection_conditioning(fx: Fixture, numerics: Numerics, runs: int, base: dict | None = None,
                           family: int = 1) -> dict:
    """How far noise of the size of this device's own deviation from the reference moves the
    model's selections and draft head on this fixture (docs/MODEL.md §6.3).

    The deviation is measured first: the mean row ulps between the unnudged run's bf16 tensors and
    the reference's on the rows the fixture records (`_recorded`). Then `runs` nudges of the model
    (teacher-forced like the checked run) by one bf16 ulp. If the device's deviation is at most
    INSIDE times the smallest of theirs (`inside`: it differs from the reference in the last bits
    only, as XLA:CPU does), those runs are the first stage, and a device beyond them on some rule
    gets the second stage over max(runs, ceil(family / FALSE_FAIL) - 1) one-ulp draws. Otherwise
    the device's run is
    itself a draw of nudge-sized noise: the nudges double in size (`runs` each) until they move the
    tensors at least that far on average (`ulps`), and that size gets runs until there are
    ceil(K / FALSE_FAIL) - 1 (`draws`; K rank rules; none where even MAX_NUDGE_ULPS falls short:
    such a device fails the bf16 tensors anyway): a correct device's worst missed rank on a rule
    then exceeds the largest of the draws' with probability 1 / (draws + 1) (order statistics of
    exchangeable draws), on any of the K with probability <= FALSE_FAIL (stage 1). A device beyond
    that on some rule gets the second stage (`two_stage`), over `stage2_draws` draws of the same
    size: ceil(family / FALSE_FAIL) - 1 for a `family` of fixture checks run together, at least
    the first stage's (`extend_draws` adds the rest when a check asks for them).
    Over every nudged run: per index / candidate layer the rows whose picks move and the worst rank
    (in units of k, in the nudged model's scores) of an unnudged pick the nudged model dropped
    (`rank_reach`; each draw's, per layer, in `draw_ranks`), per routed layer the largest |gate
    score change| (`gate_noise`), and per step and lane the largest change of the draft head's
    inputs on the reference's taps (`head`). These are the near-tie scales of `NearTie` and the
    head-alone allowance (`head_allowance`). And per bf16 tensor the check compares
    (`bf16_tensors`), its row-ulp statistics against the unnudged run, each the smallest over the
    final size's runs (`tensor_noise`): where a fixture is so conditioned that one-ulp noise moves
    a tensor further than the fixed profile allows, that measured move is its tolerance
    (`tensor_tolerance`; docs/MODEL.md §6.1). `base`: the unnudged `run_model`
    result, if already computed (its picks are kept, `picks`, for `extend_draws`). Measured on
    the full forward for the engine path too: the two compute the same arithmetic
    (tests/test_step_equivalence_*), and one forward compile is far cheaper than an engine per
    nudge."""
    cfg, params, z, hasher = fx
    s = len(z["prompt_ids"])
    base = base or run_model(cfg, params, z, hasher, numerics)
    picks, gates = _picks(cfg, base), _gate_scores(base)
    # every bf16 tensor a mode may check (the engine's run, without a draft, checks the taps too)
    # (a fixture without a draft records no taps)
    tap_rows = read_tap_rows(cfg, reference_taps(z, s)[1], s) if "decode.dspark_main_hidden" in z else None
    tensors = lambda out: bf16_tensors(cfg, out, s, taps=True, tap_rows=tap_rows)
    base_tensors = tensors(base)
    recorded = _recorded(base_tensors)
    deviation = mean_row_ulps(recorded, _recorded(z))
    base_head = _head_inputs(base) if "dspark_ref_taps" in base else None
    head = None if base_head is None else {k: np.zeros_like(v) for k, v in base_head.items()}
    moved = {k: np.zeros(len(v[0]), bool) for k, v in picks.items()}
    own = {k: v[0] for k, v in picks.items()}
    reach = dict.fromkeys(picks, 0.0)
    noise = dict.fromkeys(gates, 0.0)

    def nudge(ulps: int, seeds: range) -> list[tuple[float, dict]]:
        """Nudged runs of one size: fold their gate scores and head inputs in -> per run its
        deviation and its worst missed rank per rank rule."""
        runs_at = []
        for seed in seeds:
            out = run_model(cfg, nudged_params(params, seed, ulps), z, hasher, numerics)
            worst, missed = {}, {}
            for key, (rows, w, n) in _rank_draw(cfg, out, own).items():
                moved[key] |= rows
                worst[key], reach[key], missed[key] = w, max(reach[key], w), n
            nudged = tensors(out)
            moved_tensors = _tensor_moves(nudged, base_tensors)
            runs_at.append((mean_row_ulps(_recorded(nudged), recorded), worst, moved_tensors, missed))
            for l, sc in _gate_scores(out).items():
                noise[l] = max(noise[l], float(np.abs(sc.astype(np.float64) - gates[l]).max()))
            if head is not None:
                for k, v in _head_inputs(out).items():
                    head[k] = np.maximum(head[k], np.abs(v - base_head[k]))
        return runs_at

    ulps, runs_at = 1, nudge(1, range(runs))
    moved_mean = lambda: float(np.mean([r[0] for r in runs_at]))
    levels = [{"ulps": 1, "runs": runs, "mean_row_ulps": moved_mean()}]
    inside = deviation <= INSIDE * min(r[0] for r in runs_at)
    # inside, 4 runs are stage 1 and a flagged key gets stage 2 over one-ulp draws: a device nearer
    # the reference than the gentlest nudge is at most as noisy as a one-ulp draw, but the largest
    # of 4 draws' misses is itself only a draw (docs/MODEL.md §6.3: j54 through the engine)
    stage2 = max(runs, int(np.ceil(family / FALSE_FAIL)) - 1) if inside else 0
    if not inside:
        while moved_mean() < deviation and ulps < MAX_NUDGE_ULPS:
            ulps *= 2
            runs_at = nudge(ulps, range(runs))
            levels.append({"ulps": ulps, "runs": runs, "mean_row_ulps": moved_mean()})
        # a device further from the reference than the largest nudge moves the model fails the bf16
        # tensors whatever the selections do: no draws for it
        if moved_mean() >= deviation:
            draws = max(runs, int(np.ceil(len(picks) / FALSE_FAIL)) - 1)
            runs_at += nudge(ulps, range(runs, draws))
            levels[-1].update(runs=len(runs_at), mean_row_ulps=moved_mean())
            stage2 = max(draws, int(np.ceil(family / FALSE_FAIL)) - 1)
    # per bf16 tensor and statistic, the gentlest of the final size's runs; none where even the
    # largest nudges fall short of the device (no size of noise it is a draw of: the profile judges)
    measured = inside or moved_mean() >= deviation
    draw_tensors = {k: [r[2][k] for r in runs_at] for k in base_tensors}
    tensor_noise = {k: dict(zip(TENSOR_STATS, np.min(v, 0).tolist())) for k, v in draw_tensors.items()} \
        if measured else {}
    return {"runs": runs, "deviation_mean_row_ulps": deviation, "inside": bool(inside), "ulps": ulps,
            "draws": levels[-1]["runs"], "levels": levels, "rank_reach": reach, "gate_noise": noise, "head": head,
            "tensor_noise": tensor_noise, "rows_moved": {k: [int(v.sum()), int(v.size)] for k, v in moved.items()},
            "stage2_draws": stage2, "draw_ranks": {k: [r[1][k] for r in runs_at] for k in picks},
            "draw_missed": {k: [r[3][k] for r in runs_at] for k in picks}, "picks": own,
            # each run's tensor statistics, and what a further draw is compared with (`extend_draws`)
            "draw_tensors": draw_tensors,
            "base_tensors": base_tensors, "tap_rows": tap_rows}


def _rank_draw(cfg, out: dict, own: dict) -> dict:
    """One nudged run against the unnudged run's picks `own`, per rank rule: the rows whose picks
    moved, the worst rank (in units of k, in the nudged scores) of an unnudged pick it dropped, and
    how many unnudged picks it dropped over all rows (`compare_selection`'s `missed_picks`)."""
    res = {}
    for key, (ids, sc) in _picks(cfg, out).items():
        b = own[key]
        worst = max([missed_rank(ids[r], b[r], sc[r]) for r in range(len(b))], default=0.0)
        res[key] = ((ids != b).any(-1), worst, missed_picks(ids, b))
    return res


def _tensor_moves(tensors: dict, base: dict) -> dict[str, list[float]]:
    """A nudged run's bf16 tensors against the unnudged run's -> per tensor its row-ulp statistics
    (`TENSOR_STATS`, in that order)."""
    return {k: [compare_bf16(k, v, base[k], CPU).stats["row_ulps"][q] for q in TENSOR_STATS] for k, v in tensors.items()}


def extend_draws(fx: Fixture, numerics: Numerics, cond: dict) -> tuple[dict, dict]:
    """The second stage's draws: the conditioning's draws at its final size, extended by nudges of
    that size (the next seeds) to `stage2_draws` in all -> per rank rule the worst missed rank of
    each and how many picks each missed (and, in `cond["draw_tensors"]`, each draw's bf16 tensor
    statistics against the unnudged run). Kept in `cond`: a second mode checked against the same
    conditioning reuses them. No draft head is run (its eager context projection costs several
    forwards)."""
    cfg, params, z, hasher = fx
    ranks, missed, tensors = cond["draw_ranks"], cond["draw_missed"], cond["draw_tensors"]
    s = len(z["prompt_ids"])
    for seed in range(len(next(iter(tensors.values()))), cond["stage2_draws"]):
        out = run_model(cfg, nudged_params(params, seed, cond["ulps"]), z, hasher, numerics, draft=False)
        for key, (_, worst, n) in _rank_draw(cfg, out, cond["picks"]).items():
            ranks[key].append(worst)
            missed[key].append(n)
        moved = _tensor_moves(bf16_tensors(cfg, out, s, taps=True, tap_rows=cond["tap_rows"]), cond["base_tensors"])
        for key, v in moved.items():
            tensors[key].append(v)
    return ranks, missed


def beyond_others(x: np.ndarray) -> np.ndarray:
    """Runs' statistics [runs >= 2, columns] (per rank rule its worst missed rank and its count of
    missed picks) -> per run, how many times the largest of every other run's (at least 1) it
    reaches on its furthest column (inf / inf: a tie, 1). A function of one run and the others as
    a set: for exchangeable runs the results are exchangeable, whatever the columns' scales, so one
    comparison covers them all. The floor is the least a miss can be (a pick outside the own top k
    ranks k-th or lower, 1 k; one pick): on a column that no other run moves, a run's miss counts
    against that, not against 0."""
    top = x.max(0)
    alone = (x == top) & ((x == top).sum(0) == 1)
    others = np.maximum(np.where(alone, np.sort(x, 0)[-2], top), 1.0)
    with np.errstate(invalid="ignore"):
        ratio = x / others
    return np.where(np.isnan(ratio), 1.0, ratio).max(1)


def stage2_passes(device: np.ndarray, draws: np.ndarray) -> tuple[bool, float, float]:
    """The second stage over device [K] and draws [N, K] worst missed ranks -> (passes, the device's
    `beyond_others`, the largest of the draws'). It fails only where the device's is strictly the
    largest of the N + 1 (a tie passes): for a device whose run is one more exchangeable draw, with
    probability <= 1 / (N + 1)."""
    t = beyond_others(np.concatenate([device[None], draws]).astype(np.float64))
    dev, most = float(t[0]), float(t[1:].max())
    return dev <= most, dev, most


def two_stage(checks: list[Check], cond: dict, more_draws) -> list[Check]:
    """The rank rules' two stages (docs/MODEL.md §6.3). Stage 1 (each row within its layer's reach)
    decides unless a rank key has a row beyond it that breaks no exact tie; then, where the
    conditioning took draws (`stage2_draws`), stage 2 decides those keys: `more_draws()` gives the
    draws' worst missed ranks and missed-pick counts per rule, the device's per rule are the worst
    rank and the summed count over its prefill and decode keys, and `stage2_passes` compares them
    over all rules and both statistics at once. The count is there for a defect that moves many
    picks not far (each a near-tie's distance, all together far more than noise moves). Passing,
    a key keeps only the tie rule. Fixture false-fail <= P(stage 2 fails) <= 1 / (stage2_draws + 1)."""
    rule = lambda c: c.key.split(".", 1)[1]
    rank = {c.key: c for c in checks if rule(c) in cond["rank_reach"]}
    # tie rows always fail (NearTie.holds): the rest of the rows beyond the near-tie rule are beyond the reach
    flagged = {k for k, c in rank.items()
               if c.stats["mismatches_beyond_near_tie"] > c.stats["ties_to_higher_index"]}
    decided = {k: replace(c, stats={**c.stats, "stage": 1}) for k, c in rank.items()}
    if flagged and cond["stage2_draws"]:
        ranks, missed = more_draws()
        rules = sorted(ranks)
        of = lambda r: [c.stats for c in rank.values() if rule(c) == r]
        device = np.array([max([st["worst_missed_rank_over_k"] for st in of(r)], default=0.0) for r in rules]
                          + [sum(st["missed_picks"] for st in of(r)) for r in rules])
        draws = np.array([ranks[r] for r in rules] + [missed[r] for r in rules], np.float64).T
        passed, dev_t, draws_t = stage2_passes(device, draws)
        verdict = {"passed": passed, "draws": len(draws), "device_beyond": dev_t, "draws_beyond_max": draws_t}
        why = (f"; beyond that reach, stage 2 over {verdict['draws']} draws of the conditioning: the device's "
               f"worst missed rank or missed-pick count x{dev_t:.3g} the draws' largest on its furthest rule, "
               f"against at most x{draws_t:.3g} for a draw over the rest: {'within' if passed else 'beyond'}")
        for k in flagged:
            c = rank[k]
            decided[k] = replace(c, passed=passed and c.stats["ties_to_higher_index"] == 0,
                                 tolerance=c.tolerance + why, stats={**c.stats, "stage": 2, "stage2": verdict})
    return [decided.get(c.key, c) for c in checks]


def tensor_stage2(checks: list[Check], cond: dict, more_draws) -> list[Check]:
    """The bf16 tensors' second stage, for a device inside the one-ulp nudges (docs/MODEL.md §6.1):
    a tensor check that fails its first stage (the profile, or the gentlest of the 4 runs' move
    where larger: `tensor_tolerance`) is decided over `stage2_draws` one-ulp draws, as the rank rules'
    (`two_stage`): its statistics and every other failing tensor's, all at once (`stage2_passes`),
    fail only where the device's are strictly beyond every draw's. An inside device is at most as
    noisy as a one-ulp draw, so a correct one fails with probability <= 1 / (stage2_draws + 1); a
    defect (not inside, by far) never reaches this stage."""
    flagged = {c.key: c for c in checks if not c.passed and c.key in cond["draw_tensors"]}
    if not flagged or not cond["inside"] or not cond["stage2_draws"]:
        return checks
    more_draws()
    keys = sorted(flagged)
    device = np.array([flagged[k].stats["row_ulps"][q] for k in keys for q in TENSOR_STATS])
    draws = np.concatenate([np.asarray(cond["draw_tensors"][k], np.float64) for k in keys], axis=1)
    passed, dev_t, draws_t = stage2_passes(device, draws)
    verdict = {"passed": passed, "draws": len(draws), "tensors": keys, "device_beyond": dev_t,
               "draws_beyond_max": draws_t}
    why = (f"; beyond that, stage 2 over {len(draws)} one-ulp draws with {len(keys)} failing tensor(s): the "
           f"device's row ulps x{dev_t:.3g} the draws' largest on its furthest statistic, against at most "
           f"x{draws_t:.3g} for a draw over the rest: {'within' if passed else 'beyond'}")
    return [replace(c, passed=passed, tolerance=c.tolerance + why, stats={**c.stats, "stage": 2, "stage2": verdict})
            if c.key in flagged else c for c in checks]


# ---- free-running greedy ------------------------------------------------------------------------

def first_selection_flip(z, inter: dict, s: int) -> int:
    """The first token row where the teacher-forced run's own picks (index, candidate blocks, gate)
    differ from the reference's: a near-tie the selection checks accept, after which an unforced run
    no longer equals the forced one (S + 16 when there is none)."""
    first = s + N_DECODE
    for kind in SELECTIONS:
        for l in _layer_keys(z, "prefill", kind):
            ref = np.concatenate([z[f"prefill.{kind}.L{l}"], z[f"decode.{kind}.L{l}"]])
            own = inter[kind][l][0][: s + N_DECODE]
            differ = np.flatnonzero((_canon(own, ref.shape[-1]) != _canon(ref, ref.shape[-1])).any(-1))
            first = min([first, *differ[:1].tolist()])
    return first


def free_running(fx: Fixture, numerics: Numerics, forced_err: np.ndarray, flip_row: int) -> Check:
    """Greedy tokens with nothing teacher-forced but the tokens themselves. The forward is causal,
    so while the model's greedy tokens equal the reference's its free-running continuation has the
    reference's prefix, and one unforced forward over prompt + reference continuation gives every
    step's free-running logits up to the first divergence. Until the first row whose own picks
    differ from the reference's (`flip_row`) the unforced run makes the forced run's picks, so its
    logits are the forced run's and differ from the reference's by the measured forced_err
    [17, V]: the tokens must be equal up to the first step whose reference top-2 margin is within
    that noise (margin <= err[top1] + err[top2]) or whose row is past flip_row; that step, if any,
    is reported and nothing after it is compared."""
    cfg, params, z, hasher = fx
    s = len(z["prompt_ids"])
    own = run_model(cfg, params, z, hasher, numerics, forced=False)["logits"][s - 1: s + N_DECODE].argmax(-1)
    ref_logits = np.concatenate([z["prefill.logits_all"][-1:], z["decode.logits"]])
    ref_ids = np.concatenate([z["prefill.output_id"][None], z["decode.output_ids"]])
    order = np.argsort(-ref_logits, -1, kind="stable")[:, :2]
    r = np.arange(len(ref_ids))
    margin = ref_logits[r, order[:, 0]] - ref_logits[r, order[:, 1]]
    noise = forced_err[r, order[:, 0]] + forced_err[r, order[:, 1]]
    noisy = np.flatnonzero(margin <= noise)
    flip_step = max(flip_row - (s - 1), 0)                                 # step t reads row S - 1 + t
    upto = min(int(noisy[0]) if noisy.size else len(ref_ids), flip_step)
    differ = np.flatnonzero(own[:upto] != ref_ids[:upto])
    return Check("free_running.greedy_ids", differ.size == 0,
                 "greedy ids == reference's up to the first step whose top-2 margin <= their measured |dlogit| "
                 "or whose row follows a near-tie selection flip",
                 {"steps": len(ref_ids), "compared_steps": upto,
                  "first_noisy_margin_step": int(noisy[0]) if noisy.size else None,
                  "first_selection_flip_step": flip_step if flip_step < len(ref_ids) else None,
                  "first_mismatch": None if not differ.size else int(differ[0]),
                  "top2_margin": [round(float(x), 6) for x in margin], "noise": [float(x) for x in noise]})


def check_folder(fx: Fixture, numerics: Numerics, tol: Tolerance | None = None, runner=None,
                 conditioning: dict | None = None, free: bool = False) -> list[Check]:
    """Every comparison for one loaded fixture folder. `runner` computes what `run_model` returns
    (the full forward by default; `engine_replay.run_engine` goes through the cache and the step).
    `conditioning`: `selection_conditioning`'s result for this fixture (measured here when None);
    `free`: also compare free-running greedy tokens."""
    tol = tol or default_tolerance()
    cfg, params, z, hasher = fx
    out = (runner or run_model)(cfg, params, z, hasher, numerics)
    conditioning = conditioning or selection_conditioning(fx, numerics, CONDITIONING_RUNS, None if runner else out)
    inter, s = out["inter"], len(z["prompt_ids"])
    dec = slice(s, s + N_DECODE)
    checks: list[Check] = []

    if out["hash_ids"] is not None:
        checks.append(compare_exact("prefill.engram_hash_ids", out["hash_ids"][:s], z["prefill.engram_hash_ids"]))
        checks.append(compare_exact("decode.engram_hash_ids", out["hash_ids"][dec], z["decode.engram_hash_ids"]))

    noise = conditioning["tensor_noise"]
    # the taps where no draft ran: the draft checks cover every row a draft reads
    for key, ours in bf16_tensors(cfg, out, s, taps=out.get("dspark") is None).items():
        checks.append(compare_bf16(key, ours, z[key].reshape(ours.shape), tensor_tolerance(tol, noise.get(key))))
    # sigmoid outputs in (0, 1] from bf16-noisy streams: the row-ulp budget at magnitude 1
    checks.append(compare_fp32("prefill.block_next_pre_mix_last", inter["next_pre"][:, 0, s - 1],
                               z["prefill.block_next_pre_mix_last"], tol.row_ulps_p50 * 2.0 ** -7,
                               "row_ulps_p50 bf16 ulps at 1"))
    normed = inter["final_normed"][0]

    w = np.asarray(jnp.asarray(params["head"]["weight"], jnp.float32))
    ref_normed = np.concatenate([z["prefill.final_normed_all"], z["decode.final_normed"]])
    bound = head_bound(normed[: s + N_DECODE] - ref_normed, normed[: s + N_DECODE], w)
    why = "sum_d |dn_d||W_vd| + 2 D u32 sum_d |n_d W_vd| from the observed final-normed difference"
    checks.append(compare_bounded("prefill.logits_all", out["logits"][:s], z["prefill.logits_all"], bound[:s], why))
    checks.append(compare_bounded("decode.logits", out["logits"][dec], z["decode.logits"], bound[s:], why))
    checks.append(compare_ids("prefill.output_id", out["logits"][s - 1], z["prefill.output_id"][None], bound[s - 1]))
    checks.append(compare_ids("decode.output_ids", out["logits"][dec], z["decode.output_ids"], bound[s:]))

    draft = out.get("dspark")
    if draft is not None:
        checks.extend(_dspark_checks(cfg, params, z, s, inter["main_hidden"][0], draft, out["dspark_ref_taps"], w, tol,
                                     conditioning))
    checks.extend(_selection_checks(cfg, z, inter, s, draft, conditioning))
    more_draws = lambda: extend_draws(fx, numerics, conditioning)
    checks = tensor_stage2(two_stage(checks, conditioning, more_draws), conditioning, more_draws)
    if free:
        # the teacher-forced run's own |dlogit| per row is the noise a free-running margin must beat
        rows = slice(s - 1, s + N_DECODE)
        ref_rows = np.concatenate([z["prefill.logits_all"][-1:], z["decode.logits"]])
        checks.append(free_running(fx, numerics, np.abs(out["logits"][rows] - ref_rows),
                                   first_selection_flip(z, inter, s)))
    return checks


def fp32_rounding(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """|x . w| rounding allowance of an fp32 dot of length D on both sides: 2 D u32 sum_d |x_d w_d|."""
    return 2 * w.shape[-1] * U32 * (np.abs(x.astype(np.float64)) @ np.abs(w.astype(np.float64)).T)


def _row_ulps(diff: np.ndarray, ref: np.ndarray) -> dict:
    rms = np.sqrt(np.mean(np.asarray(ref, np.float64) ** 2, -1, keepdims=True))
    return _pct(np.abs(diff) / bf16_ulp(rms))


def head_allowance(cond: dict, steps: np.ndarray, normed: np.ndarray, conf_in: np.ndarray):
    """How far, per lane, the device may move the draft head's inputs when it runs on the
    reference's taps (docs/MODEL.md §6.2 item 2) -> (normed lanes, confidence-input lanes, why).
    The head is a whole block (attention, MoE, the fp8 fake-quant of its activations and window
    rows) before its norm: a last-bit difference anywhere in it (an fp32 sum in another order) can
    flip a bf16 rounding that a fake-quant then turns into a whole fp8 step of its group, which the
    block spreads over the row, as in the backbone's blocks (the bf16 profile). So a lane may move
    by as much as the conditioning's nudges moved it (`head`, largest over the nudged runs, per step
    and lane: one-ulp nudges where the device is `inside` their noise, nudges of the device's
    measured size where not), and never by less than one ulp of that lane."""
    ulp_n, ulp_conf = bf16_ulp(normed), bf16_ulp(conf_in)
    head = cond["head"]
    return (np.maximum(ulp_n, head["normed"][steps]), np.maximum(ulp_conf, head["conf_in"][steps]),
            f"the larger of one bf16 ulp and the most {cond['draws']} {cond['ulps']}-ulp nudges moved it")


def _dspark_checks(cfg, params, z, s: int, own_taps: np.ndarray, draft: dict, ref_draft: dict, w: np.ndarray,
                   tol: Tolerance, cond: dict) -> list[Check]:
    """The draft head in three parts (docs/MODEL.md §6.2):
      dspark.taps           the model's taps on every row some step's draft reads, bf16 tolerance;
      dspark.ref_taps.*     the draft head run on the reference's own taps (and its gate picks and
                            Markov tokens): the head alone, so exact up to fp32 rounding of the last
                            dot products (2 D u32 sum |x w|);
      dspark.logits / .confidence / .output_ids   the head on the model's own taps, bounded by the
                            measured difference that the tap noise leaves in the head's input: the
                            normed draft hidden dn (logits) and the pre-norm hidden dh (confidence),
                            both measured as own-taps run minus reference-taps run, so
                            |dlogit| <= sum_d |dn_d||W_vd| + the fp32 rounding of both runs.
    Steps whose context rows the fixture does not record are left out of the last two (counted)."""
    checks = []
    ref_taps, known = reference_taps(z, s)
    covered = np.array([known[r].all() for r in draft_rows(s, cfg.window_size)])
    rows = read_tap_rows(cfg, known, s)
    taps = compare_bf16("dspark.taps", split_taps(cfg, own_taps[rows]), split_taps(cfg, ref_taps[rows]),
                        tensor_tolerance(tol, cond["tensor_noise"].get("dspark.taps")))
    taps.stats.update(rows_read=int(len(rows)), steps_with_reference_context=int(covered.sum()))
    checks.append(taps)

    c = covered
    proj = np.asarray(jnp.asarray(params["mtp"][-1]["confidence_head"]["proj"]["weight"], jnp.float32))
    ref_n, ref_conf_in = ref_draft["normed"][c], np.concatenate([ref_draft["hidden"], ref_draft["markov"]], -1)[c]
    # the head alone: per lane of its inputs, what the device may move it by (head_allowance)
    lane_n, lane_conf, why_lane = head_allowance(cond, c, ref_n, ref_conf_in)
    tf_bound = head_bound(lane_n, ref_n, w)
    checks.append(compare_bounded("dspark.ref_taps.logits", ref_draft["logits"][c], z["dspark.logits"][c], tf_bound,
                                  f"{why_lane} on every lane of the normed draft hidden, through the head, "
                                  "+ fp32 rounding (2 D u32 sum |n W|)"))
    tf_cbound = head_bound(lane_conf, ref_conf_in, proj)[..., 0]
    checks.append(compare_bounded("dspark.ref_taps.confidence", ref_draft["confidence"][c], z["dspark.confidence"][c],
                                  tf_cbound, f"{why_lane} on every lane of the draft hidden, through proj, "
                                  "+ fp32 rounding"))
    checks[-2].stats.update(lane_allowance_row_ulps=_row_ulps(lane_n, ref_n), conditioning_inside=cond["inside"])

    dn = draft["normed"][c] - ref_n
    bound = head_bound(dn, draft["normed"][c], w) + tf_bound
    logits = compare_bounded("dspark.logits", draft["logits"][c], z["dspark.logits"][c], bound,
                             "sum_d |dn_d||W_vd| from the measured normed-draft-hidden difference (own taps - "
                             "reference taps) + fp32 rounding + the head's own allowance (dspark.ref_taps.logits)")
    # where the bound comes from: how much the head amplifies the tap noise (row ulps in, row ulps out)
    logits.stats.update(steps=int(c.sum()), taps_row_ulps=_row_ulps(own_taps[rows] - ref_taps[rows], ref_taps[rows]),
                        normed_draft_row_ulps=_row_ulps(dn, ref_n))
    checks.append(logits)
    checks.append(compare_ids("dspark.output_ids", draft["logits"][c], z["dspark.output_ids"][c][:, 1:], bound))
    dh = np.concatenate([draft["hidden"], draft["markov"]], -1)[c] - ref_conf_in
    cbound = (np.abs(dh) @ np.abs(proj.astype(np.float64)).T)[..., 0] + fp32_rounding(ref_conf_in + dh, proj)[..., 0] \
        + tf_cbound
    checks.append(compare_bounded("dspark.confidence", draft["confidence"][c], z["dspark.confidence"][c], cbound,
                                  "sum_d |dh_d||p_d| from the measured draft-hidden difference + fp32 rounding "
                                  "+ the head's own allowance (dspark.ref_taps.confidence)"))
    return checks


@exit_2_on_refusal
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder")
    ap.add_argument("--json", action="store_true", help="print the full report as JSON")
    ap.add_argument("--numerics", choices=("reference", "fast"), default="reference")
    ap.add_argument("--engine", action="store_true",
                    help="run prefill + decode through the cache and the jitted step (no DSpark checks)")
    ap.add_argument("--kv-format", choices=("typed", "packed"), default="typed",
                    help="with --engine: the cache's main and window rows (packed: FP4 / FP8, the same values)")
    ap.add_argument("--tolerance", choices=("auto", "cpu", "gpu"), default="auto",
                    help="tolerance profile; auto = by the default JAX backend")
    ap.add_argument("--experts", choices=EXPERT_HOLDS, default="auto", help="how the routed experts are held")
    ap.add_argument("--dense", choices=DENSE_HOLDS, default="auto", help="how the dense FP8 weights are held")
    ap.add_argument("--conditioning", type=int, default=CONDITIONING_RUNS, metavar="N",
                    help="one-ulp nudges of the model the near-tie rules are measured from")
    ap.add_argument("--free-running", action="store_true", help="also compare free-running greedy tokens")
    args = ap.parse_args(argv)
    runner = None
    if args.kv_format != "typed" and not args.engine:
        ap.error(f"--kv-format {args.kv_format}: a cache format, so only with --engine")
    if args.engine:
        from v41_jax.tools.engine_replay import run_engine  # imports this module: bind late
        runner = functools.partial(run_engine, kv_format=args.kv_format)
    tol = {"auto": None, "cpu": CPU, "gpu": GPU}[args.tolerance]
    fx, numerics = load_fixture(args.folder, args.experts, args.dense), getattr(Numerics, args.numerics)()
    cond = selection_conditioning(fx, numerics, args.conditioning)
    checks = check_folder(fx, numerics, tol, runner, cond, args.free_running)
    ok = all(c.passed for c in checks)
    if args.json:
        print(json.dumps({"folder": args.folder, "passed": ok, "checks": [asdict(c) for c in checks],
                          "conditioning": _jsonable(cond)}, indent=1))
    else:
        for c in checks:
            brief = {k: v for k, v in c.stats.items() if not isinstance(v, list)}
            print(f"{'PASS' if c.passed else 'FAIL'}  {c.key:40s} {c.tolerance}\n      {json.dumps(brief)}")
        print(f"conditioning x{args.conditioning}: {json.dumps(_jsonable(cond))}")
        print(f"{'PASS' if ok else 'FAIL'}: {sum(c.passed for c in checks)}/{len(checks)} checks")
    return 0 if ok else 1


def _jsonable(cond: dict) -> dict:
    """The conditioning for a report: the head's per-lane arrays, the unnudged picks and tensors and
    the draws' tensor statistics left out (the checks report what they decide)."""
    return {k: {str(l): x for l, x in v.items()} if isinstance(v, dict) else v for k, v in cond.items()
            if k not in ("head", "picks", "draw_tensors", "base_tensors", "tap_rows")}


if __name__ == "__main__":
    sys.exit(main())
