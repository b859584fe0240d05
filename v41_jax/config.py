"""Model configuration: one frozen dataclass, loaded from any of the three published layouts.

Accepted inputs (see docs/MODEL.md §1.1):
  * the released HF `config.json` (root with `text_config` and `quantization_config`),
  * a flat HF text config (`hidden_size`, `num_hidden_layers`, ...),
  * the official reference's own `ModelArgs` field names (`dim`, `n_layers`, ...).

Field names follow the official `inference/model.py` (`ModelArgs`), because the model code reads
like the reference that way. `validate()` is fail-closed: every rule raises a ConfigError that names
the field and the rule, first the type and range of every field (sizes bounded, floats finite), then
the rules between fields. The per-layer attention topology is resolved once, in `topology.py`.

A config.json is untrusted input (docs/MODEL.md §2.3): `from_file` reads it with `read_json`
(bounded size, UTF-8, strict JSON, no duplicate key) and every refusal is one line
`<file>: <field>: <rule>`, a `CheckpointError`, the one error type of the checkpoint loader.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable, Mapping, NoReturn

from .brief import show
from .engram_hash import engram_primes

# HF text_config name -> reference (ModelArgs) name. Names absent here are the same in both.
_HF_TO_REF = {
    "hidden_size": "dim",
    "num_hidden_layers": "n_layers",
    "num_attention_heads": "n_heads",
    "qk_rope_head_dim": "rope_head_dim",
    "rms_norm_eps": "norm_eps",
    "num_experts_per_tok": "n_activated_experts",
    "moe_intermediate_size": "moe_inter_dim",
    "scoring_func": "score_func",
    "routed_scaling_factor": "route_scale",
    "sliding_window": "window_size",
    "kv_source_layer_ids": "kv_source_layers",
    "index_source_layer_ids": "index_source_layers",
    "candidate_source_layer_id": "candidate_source_layer",
    "num_nextn_predict_layers": "n_mtp_layers",
    "engram_pad_token_id": "engram_pad_id",
    "dspark_num_experts_per_tok": "dspark_n_activated_experts",
    "max_position_embeddings": "max_seq_len",
}

# The only quantization_config the published checkpoint format has (docs/MODEL.md §1.1).
PUBLISHED_QUANTIZATION = {
    "quant_method": "fp8",
    "activation_scheme": "dynamic",
    "weight_block_size": [32, 32],
    "scale_fmt": "ue8m0",
    "expert_dtype": "fp4",
}

# Keys a config may carry that this text-only engine ignores on purpose.
# the root keys a layout with text_config may hold besides _IGNORED_KEYS
_ROOT_KEYS = {"text_config", "quantization_config", "model_type", "bos_token_id", "eos_token_id", "pad_token_id"}
# keys the model does not read but whose value must be its own where a file gives them: another value
# describes another model (an activation, biases, tied embeddings, a routing method)
_PINNED = {"hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False, "topk_method": "noaux_tc"}


def _same_value(a: Any, b: Any) -> bool:
    return type(a) is type(b) and a == b


_IGNORED_KEYS = {
    "model_type", "architectures", "dtype", "torch_dtype", "transformers_version", "hidden_act",
    "attention_bias", "tie_word_embeddings", "num_key_value_heads", "topk_method", "rope_scaling",
    "vision_config", "text_config", "quantization_config", "max_batch_size", "temperature",
    "expert_dtype", "vision_n_layers", "vision_dim", "vision_n_heads", "vision_inter_dim",
    "vision_patch_size", "vision_rope_theta", "vision_downsample_ratio", "vision_max_n_token",
    "vision_min_pixels", "vision_max_wh_ratio", "image_token_id",
}


# ---- refusals of untrusted files -------------------------------------------------------------

class CheckpointError(ValueError):
    """An untrusted checkpoint file (config.json, the index, a shard) or a config breaks a rule.

    One line `<file>: <what>: <rule>`, where `what` is the tensor or field (or the part of the file:
    `file`, `header`, ...); `<what>: <rule>` alone for a config built in code. Defined here, below
    the checkpoint reader, so that config.json's refusals share the type; `v41_jax.checkpoint`
    re-exports it."""

    def __init__(self, file: str | None, what: str, rule: str):
        file, what, rule = _one_line(file, 500), _one_line(what, 300), _one_line(rule, 2000)
        super().__init__(file, what, rule)
        self.file, self.what, self.rule = file, what, rule

    def __str__(self) -> str:
        return f"{self.file}: {self.what}: {self.rule}" if self.file else f"{self.what}: {self.rule}"


def _one_line(text: str | None, limit: int) -> str | None:
    """Text from a hostile file (a key, a tensor or file name) as a refusal may print it: control
    characters escaped, so the refusal stays one line, and cut to `limit` characters."""
    if text is None:
        return None
    text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    return text if len(text) <= limit else f"{text[:limit - 3]}..."


class ConfigError(CheckpointError):
    """A config field breaks a rule (`validate`, `from_dict`, `from_file`)."""

    def __init__(self, what: str, rule: str, file: str | None = None):
        super().__init__(file, what, rule)
        self.args = (what, rule, file)    # this constructor's order, so that it pickles


def exit_2_on_refusal(main: Callable[..., int | None]) -> Callable[..., int | None]:
    """A CLI's main: a CheckpointError prints as the one line `error: <file>: <what>: <rule>` on
    stderr and main returns 2, without a traceback (a bad file is the user's input, not a bug)."""
    @functools.wraps(main)
    def run(*args: Any, **kwargs: Any) -> int | None:
        try:
            return main(*args, **kwargs)
        except CheckpointError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
    return run


CONFIG_NAME = "config.json"
# config.json of the released model is 4 KB; 1 MiB leaves room for any layout and stops a stray
# large file (or a device) from being read whole.
CONFIG_MAX_BYTES = 1 << 20
_UTF8_BOM = b"\xef\xbb\xbf"


class _DuplicateKey(Exception):
    def __init__(self, key: str):
        self.key = key


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """json's object hook: Python's json keeps the last of two equal keys silently; refuse instead."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def parse_json(data: bytes, file: str, what: str) -> Any:
    """Strict JSON of untrusted bytes: UTF-8 (no BOM), no key twice in one object. NaN, Infinity
    and 1e999 parse as floats, so that the field holding one is refused by name where it is checked."""
    try:
        return json.loads(data.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except UnicodeDecodeError as e:
        raise CheckpointError(file, what, f"not UTF-8 text ({e.reason} at byte {e.start})") from None
    except _DuplicateKey as e:
        raise CheckpointError(file, e.key, "given twice in one JSON object (the last would win "
                                           "silently)") from None
    except json.JSONDecodeError as e:
        rule = "empty" if not data.strip() else f"not valid JSON ({e.msg} at line {e.lineno} column {e.colno})"
        raise CheckpointError(file, what, rule) from None
    except RecursionError:
        raise CheckpointError(file, what, "not valid JSON (nested too deeply)") from None
    except ValueError as e:   # an integer literal past Python's digit limit
        raise CheckpointError(file, what, f"not valid JSON ({e})") from None


def read_json(path: str, max_bytes: int) -> Any:
    """A small JSON file (config.json, the index): `read_small`, parsed by `parse_json`. A UTF-8
    byte order mark is accepted and skipped: editors on Windows write one and it cannot change the
    meaning; any other encoding is refused."""
    return parse_json(read_small(path, max_bytes).removeprefix(_UTF8_BOM), path, "file")


def read_small(path: str, max_bytes: int) -> bytes:
    """The bytes of a regular file of at most max_bytes, else a CheckpointError naming it."""
    if not os.path.isfile(path):
        rule = "is a directory, not a file" if os.path.isdir(path) else (
            "not a regular file" if os.path.exists(path) else "does not exist")
        raise CheckpointError(path, "file", rule)
    try:
        with open(path, "rb") as f:
            # no more than the file holds: read(n) allocates n bytes up front (a 95 MB buffer for
            # a 0.2 MB checkpoint index, the largest host allocation of a sharded load)
            data = f.read(min(max_bytes, os.fstat(f.fileno()).st_size) + 1)
    except OSError as e:
        raise CheckpointError(path, "file", f"unreadable ({e.strerror})") from None
    if len(data) > max_bytes:
        raise CheckpointError(path, "file", f"larger than {max_bytes} bytes, too large for this file")
    return data


@dataclass(frozen=True)
class ModelConfig:
    # vocabulary and widths
    vocab_size: int
    dim: int                                  # D, width of one mHC stream
    n_layers: int                             # backbone blocks
    n_heads: int                              # H query heads (one shared K=V latent)
    head_dim: int                             # Dh, query and latent width
    rope_head_dim: int                        # R, RoPE on the last R lanes
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    norm_eps: float
    # attention topology (CSA2)
    window_size: int
    compress_ratios: tuple[int, ...]          # n_layers + n_mtp_layers entries, values 0/1/2
    kv_source_layers: tuple[int, ...]
    index_source_layers: tuple[int, ...]
    candidate_source_layer: int               # -1 disables candidate blocks
    candidate_topk_blocks: int
    candidate_block_size: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    # rope
    rope_theta: float
    compress_rope_theta: float
    rope_factor: float
    original_seq_len: int                     # 0 disables YaRN
    beta_fast: int
    beta_slow: int
    max_seq_len: int
    # MoE
    moe_inter_dim: int
    n_routed_experts: int
    n_shared_experts: int
    n_activated_experts: int
    score_func: str
    gate_temp: float
    norm_topk_prob: bool
    route_scale: float
    swiglu_limit: float
    # mHC
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    # Engram
    engram_layer_ids: tuple[int, ...]
    engram_num_embeddings: tuple[int, ...]
    engram_max_ngram_size: int
    engram_vocab_size: int
    engram_n_heads: int
    engram_head_dim: int
    engram_pad_id: int
    engram_compressed_vocab_size: int
    # DSpark draft stages (mtp.*)
    n_mtp_layers: int
    dspark_block_size: int
    dspark_noise_token_id: int
    dspark_target_layer_ids: tuple[int, ...]
    dspark_markov_rank: int
    dspark_n_routed_experts: int              # 0 = same as the backbone (reference rule)
    dspark_n_activated_experts: int           # 0 = same as the backbone
    # special tokens
    bos_token_id: int = 0
    eos_token_id: int = 1
    pad_token_id: int = 2
    # the published quantization: fp8 dense weights + fp4 routed experts
    quantized: bool = True

    # ---- derived -------------------------------------------------------------------------
    @property
    def n_total_layers(self) -> int:
        """Backbone blocks plus DSpark draft stages (the length of `compress_ratios`)."""
        return self.n_layers + self.n_mtp_layers

    def moe_experts(self, layer_id: int) -> tuple[int, int]:
        """(routed experts, activated experts) of a backbone layer or a draft stage."""
        if layer_id < self.n_layers:
            return self.n_routed_experts, self.n_activated_experts
        return (self.dspark_n_routed_experts or self.n_routed_experts,
                self.dspark_n_activated_experts or self.n_activated_experts)

    @property
    def engram_hash_cols(self) -> int:
        return (self.engram_max_ngram_size - 1) * self.engram_n_heads

    def replace(self, **changes: Any) -> "ModelConfig":
        """A changed copy, validated like a loaded one."""
        cfg = dataclasses.replace(self, **changes)
        validate(cfg)
        return cfg

    # ---- loading -------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: Any, source: str | None = None) -> "ModelConfig":
        """Load the HF root layout, a flat HF text config, or reference ModelArgs names; a refusal
        names the field as the file spells it, and `source` (the file) when given."""
        try:
            cfg = cls(**_normalise(raw))      # its refusals name the keys as the file has them
        except ConfigError as e:
            raise ConfigError(e.what, e.rule, source) from None
        try:
            validate(cfg)
        except ConfigError as e:
            raise ConfigError(_spelled(e.what, raw), e.rule, source) from None
        return cfg

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "ModelConfig":
        """A config file, or a checkpoint folder's config.json (a folder named config.json is not a
        checkpoint folder: it is refused as the file it should have been)."""
        path = os.fspath(path)
        if os.path.isdir(path) and os.path.basename(os.path.normpath(path)) != CONFIG_NAME:
            path = os.path.join(path, CONFIG_NAME)
        return cls.from_dict(read_json(path, CONFIG_MAX_BYTES), path)


# rope_scaling's keys (HF) -> ModelConfig fields; YaRN is the only scaling the model has
_ROPE_SCALING = {"factor": "rope_factor", "beta_fast": "beta_fast", "beta_slow": "beta_slow",
                 "original_max_position_embeddings": "original_seq_len"}
# model_type where a layout names one: the HF root, its text_config
_MODEL_TYPES = ("deepseek_v41", "deepseek_v41_text")
SCORE_FUNCS = ("sqrtsoftplus", "softmax", "sigmoid")     # the reference's router score functions


def _spelled(field_name: str, raw: Any) -> str:
    """A ModelConfig field as the file spells it (`rms_norm_eps`, `rope_scaling.factor`)."""
    text = raw.get("text_config", raw) if isinstance(raw, Mapping) else {}
    if not isinstance(text, Mapping):
        return field_name
    hf = {v: k for k, v in _HF_TO_REF.items()}.get(field_name)
    if hf is not None and hf in text:
        return hf
    rope = {v: k for k, v in _ROPE_SCALING.items()}.get(field_name)
    if rope is not None and isinstance(text.get("rope_scaling"), Mapping) and rope in text["rope_scaling"]:
        return f"rope_scaling.{rope}"
    return field_name


def _object(field_name: str, value: Any) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigError(field_name, f"must be a JSON object, got {show(value)}")
    return value


def _normalise(raw: Any) -> dict[str, Any]:
    """Map any accepted layout onto ModelConfig field names; refuse unknown, doubled or missing
    fields and values of the wrong JSON type (ranges are `validate`'s)."""
    root = _object("config", raw)
    text = _object("text_config", root["text_config"]) if "text_config" in root else root
    out: dict[str, Any] = {}
    for where, obj in (("model_type", root), ("text_config.model_type", text)):
        if "model_type" in obj and obj["model_type"] not in _MODEL_TYPES:
            raise ConfigError(where, f"must be one of {list(_MODEL_TYPES)}, got {show(obj['model_type'])}")
    if "quantization_config" in root:
        quant = root["quantization_config"]
        if quant != PUBLISHED_QUANTIZATION:
            differs = sorted(set(quant) ^ set(PUBLISHED_QUANTIZATION) if isinstance(quant, dict) else ())
            differs += sorted(k for k in PUBLISHED_QUANTIZATION if isinstance(quant, dict) and k in quant
                              and quant[k] != PUBLISHED_QUANTIZATION[k])
            what = (f"its {differs[0]!r} is {show(quant.get(differs[0]))}" if differs and differs[0] in quant
                    else f"it lacks {differs[0]!r}" if differs else f"got {show(quant)}")
            raise ConfigError("quantization_config", f"must be exactly the published "
                              f"{PUBLISHED_QUANTIZATION} (or absent): {what}")
        out["quantized"] = True
    model_fields = {f.name for f in dataclasses.fields(ModelConfig)}
    if text is not root:
        # the model's fields live in text_config: one at the root would be ignored silently (other
        # root keys, a hub's auto_map, _name_or_path, ..., describe no model and are left alone)
        for k in root:
            if k not in _ROOT_KEYS and (_HF_TO_REF.get(k, k) in model_fields or k == "rope_scaling"):
                raise ConfigError(k, "a model field at the root (a layout with text_config takes them "
                                     "there; this one would be ignored)")
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if k in root:
            if text is not root and k in text and not _same_value(text[k], root[k]):
                raise ConfigError(k, f"is {show(text[k])} in text_config where the root says {show(root[k])}")
            out[k] = root[k]
    for obj in (root, text) if text is not root else (root,):
        for k, want in _PINNED.items():
            if k in obj and not _same_value(obj[k], want):
                raise ConfigError(k, f"must be {show(want)} (this model's; the key is otherwise not read), "
                                     f"got {show(obj[k])}")
    if text.get("dtype") == "bf16":
        if "quantization_config" in root:
            raise ConfigError("dtype", "bf16 (an unquantized checkpoint) beside a quantization_config "
                                       "(a quantized one)")
        out["quantized"] = False
    spelled: dict[str, str] = {}   # field -> the key that gave it
    if "rope_scaling" in text:
        out.update(_rope_scaling(_object("rope_scaling", text["rope_scaling"])))
        spelled.update({name: f"rope_scaling.{k}" for k, name in _ROPE_SCALING.items()})
    for k, v in text.items():
        name = _HF_TO_REF.get(k, k)
        if name in spelled:
            raise ConfigError(k, f"gives {name} a second time (also given as {spelled[name]})")
        if name in model_fields:
            out[name], spelled[name] = v, k
        elif k not in _IGNORED_KEYS:
            raise ConfigError(k, "unknown config field")
    if text.get("num_key_value_heads", 1) != 1 or isinstance(text.get("num_key_value_heads"), bool):
        raise ConfigError("num_key_value_heads", "must be 1 (one shared K=V latent)")
    # ModelArgs defaults for fields the reference's own config.json leaves out.
    for k, default in (("gate_temp", 1.0), ("norm_topk_prob", True), ("max_seq_len", 4096),
                       ("candidate_source_layer", -1), ("candidate_topk_blocks", 0),
                       ("candidate_block_size", 0), ("original_seq_len", 0),
                       ("dspark_n_routed_experts", 0), ("dspark_n_activated_experts", 0)):
        out.setdefault(k, default)
    missing = sorted(f for f in model_fields if f not in out and
                     ModelConfig.__dataclass_fields__[f].default is dataclasses.MISSING)
    if missing:
        raise ConfigError(missing[0], f"missing config field (also missing: {missing[1:]})")
    for k in _TUPLE_FIELDS:
        if not isinstance(out[k], list):
            raise ConfigError(k, f"must be a list of integers, got {show(out[k])}")
        out[k] = tuple(out[k])   # element types are validate's
    return out


def _rope_scaling(rs: Mapping[str, Any]) -> dict[str, Any]:
    """The YaRN fields of HF's rope_scaling, every key present and none unknown (a key this model
    does not implement, e.g. mscale, would be ignored silently otherwise)."""
    if rs.get("rope_type", "yarn") != "yarn":
        raise ConfigError("rope_scaling.rope_type", f"only 'yarn' is supported, got {show(rs.get('rope_type'))}")
    for k in rs:
        if k not in _ROPE_SCALING and k != "rope_type":
            raise ConfigError(f"rope_scaling.{k}", f"unknown key (known: {sorted(_ROPE_SCALING)} and rope_type)")
    missing = [k for k in _ROPE_SCALING if k not in rs]
    if missing:
        raise ConfigError(f"rope_scaling.{missing[0]}", "missing")
    return {name: rs[k] for k, name in _ROPE_SCALING.items()}


# ---- validation ----------------------------------------------------------------------------
# Fail-closed: every rule raises ConfigError("<field>: <rule>"). First each field's type and range
# (`_check_fields`), so that no later rule compares a string or loops to a size from a hostile file;
# then the attention rules the topology resolver relies on (docs/MODEL.md §1.2) and the width rules
# the published quantization needs (A8 activation scales per 32 lanes, FP4 weight scales per 32 inputs).

_TUPLE_FIELDS = ("compress_ratios", "kv_source_layers", "index_source_layers", "engram_layer_ids",
                 "engram_num_embeddings", "dspark_target_layer_ids")

# The size fields' values in the released model (configs/deepseek_v41_flash.config.json; a test
# checks they agree). A size may be up to 8x its released value, rounded up to a power of two, and
# never 2**31 or more: int32 is JAX's index type, which token ids, positions, table rows and expert
# ids are on the device. Past that a value is a corrupt or hostile file whose loops and buffers
# would hang the load or exhaust memory (n_routed_experts = 10**12 did, issue #19).
RELEASED_SIZES = {
    "vocab_size": 129280, "dim": 5120, "n_layers": 40, "n_heads": 64, "head_dim": 512,
    "rope_head_dim": 64, "q_lora_rank": 1280, "o_groups": 8, "o_lora_rank": 1024, "window_size": 128,
    "candidate_topk_blocks": 2048, "candidate_block_size": 8, "index_n_heads": 32,
    "index_head_dim": 128, "index_topk": 512, "original_seq_len": 65536, "beta_fast": 32,
    "beta_slow": 1, "max_seq_len": 1048576, "moe_inter_dim": 2304, "n_routed_experts": 384,
    "n_shared_experts": 1, "n_activated_experts": 6, "hc_mult": 4, "hc_sinkhorn_iters": 20,
    "engram_num_embeddings": 384016682, "engram_max_ngram_size": 4, "engram_vocab_size": 16000000,
    "engram_n_heads": 8, "engram_head_dim": 256, "engram_compressed_vocab_size": 99092,
    "n_mtp_layers": 3, "dspark_block_size": 5, "dspark_markov_rank": 256,
    "dspark_n_routed_experts": 128, "dspark_n_activated_experts": 3,
}
INT32_MAX = 2**31 - 1


def size_bound(released: int) -> int:
    return min(1 << (8 * released - 1).bit_length(), INT32_MAX)


# Engram's bucket moduli (Engram layers x (max_ngram_size - 1) x heads: 48 released) are each found
# by a prime search when the config is validated: the same 8x rule bounds their count.
ENGRAM_BUCKETS_BOUND = size_bound(2 * 3 * 8)

# Float fields: finite, and inside the range their formula needs: (low, high, low included).
FP32_TINY, FP32_MAX = 2.0 ** -126, (2 - 2.0 ** -23) * 2.0 ** 127   # fp32's smallest normal, largest finite
_FLOAT_RANGES = {
    "norm_eps": (0.0, 1.0, False),            # added to a mean square before rsqrt
    "hc_eps": (0.0, 1.0, False),              # Sinkhorn's floor
    "rope_theta": (1.0, math.inf, False),     # log(theta) divides in YaRN; theta <= 1 has no wavelengths
    "compress_rope_theta": (1.0, math.inf, False),
    "rope_factor": (1.0, math.inf, True),     # YaRN stretches the context: 1 = no stretch
    "gate_temp": (0.0, math.inf, False),      # divides the router logits
    "route_scale": (0.0, math.inf, False),
    "swiglu_limit": (0.0, math.inf, True),    # 0 = no clamp
}


def validate(cfg: ModelConfig) -> None:
    """Raise ConfigError naming the first field that breaks a rule; return None if all hold."""
    for check in (_check_fields, _check_layer_counts, _check_ratios, _check_kv_sources,
                  _check_index_sources, _check_kv_owners, _check_candidates, _check_attention_shape,
                  _check_rope, _check_moe, _check_engram, _check_dspark, _check_token_ids,
                  _check_quantized_widths):
        check(cfg)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_fields(cfg: ModelConfig) -> None:
    """Every field's type (bool is not int, a string is not a number) and range: sizes in
    [0, size_bound], other integers in int32, floats finite and in `_FLOAT_RANGES`."""
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if f.type == "float":
            _check_float(f.name, v)
            continue
        _check_type(f.name, f.type, v)
        if f.type in ("int", "tuple[int, ...]"):
            _check_int_range(f.name, v if isinstance(v, tuple) else (v,))


def _check_type(field_name: str, type_name: str, v: Any) -> None:
    ok = {"int": _is_int(v), "bool": isinstance(v, bool), "str": isinstance(v, str),
          "tuple[int, ...]": isinstance(v, tuple) and all(_is_int(x) for x in v)}[type_name]
    if not ok:
        want = {"int": "an integer", "bool": "true or false", "str": "a string",
                "tuple[int, ...]": "a list of integers"}[type_name]
        bad = [i for i, x in enumerate(v) if not _is_int(x)] if isinstance(v, tuple) else []
        _fail(field_name, f"must be {want}, " + (f"item {bad[0]} is {show(v[bad[0]])}" if bad else f"got {show(v)}"))


def _check_int_range(field_name: str, values: tuple[int, ...]) -> None:
    if field_name in RELEASED_SIZES:
        low, high = 0, size_bound(RELEASED_SIZES[field_name])
        why = f"8x the released model's {RELEASED_SIZES[field_name]}, within int32"
    else:   # ids and ratios: their own rules bound them; int32 keeps those rules' arithmetic small
        low, high, why = -INT32_MAX, INT32_MAX, "int32"
    for x in values:
        if not low <= x <= high:
            _fail(field_name, f"{x} is outside [{low}, {high}] ({why})")


def _check_float(field_name: str, v: Any) -> None:
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        _fail(field_name, f"must be a number, got {show(v)}")
    # an integer literal past float's range (2**1024) would overflow where the model uses it
    if not (math.isfinite(v) if isinstance(v, float) else abs(v) < 2**1024):
        _fail(field_name, f"must be finite, got {show(v)}")
    low, high, closed = _FLOAT_RANGES[field_name]
    if not (low <= v if closed else low < v) or not v < high:
        _fail(field_name, f"must be in {'[' if closed else '('}{low}, {high}), got {v}")
    # the model computes with these in fp32: a value fp32 rounds to 0 or inf (an eps of 1e-300,
    # a router temperature of 1e-320) would pass the range above and give NaN logits
    if v and not FP32_TINY <= abs(v) <= FP32_MAX:
        _fail(field_name, f"must be 0 or a normal fp32 magnitude ({FP32_TINY:.4g} to {FP32_MAX:.4g}), got {v}")


def _fail(field_name: str, rule: str) -> NoReturn:
    raise ConfigError(field_name, rule)


def _check_layer_ids(field_name: str, ids: tuple[int, ...], n_layers: int) -> None:
    """Strictly increasing backbone layer ids: the reference visits them in layer order."""
    if any(not 0 <= i < n_layers for i in ids):
        _fail(field_name, f"every id must be a backbone layer in [0, {n_layers}), got {list(ids)}")
    if any(a >= b for a, b in zip(ids, ids[1:])):
        _fail(field_name, f"ids must be strictly increasing, got {list(ids)}")


def _check_layer_counts(cfg: ModelConfig) -> None:
    if cfg.n_layers < 1:
        _fail("n_layers", f"must be >= 1, got {cfg.n_layers}")
    if cfg.n_mtp_layers < 0:
        _fail("n_mtp_layers", f"must be >= 0, got {cfg.n_mtp_layers}")


def _check_ratios(cfg: ModelConfig) -> None:
    ratios = cfg.compress_ratios
    if len(ratios) != cfg.n_total_layers:
        _fail("compress_ratios", f"must have n_layers + n_mtp_layers = {cfg.n_total_layers} "
              f"entries, got {len(ratios)}")
    if any(r not in (0, 1, 2) for r in ratios):
        _fail("compress_ratios", f"values must be 0, 1 or 2 (CSA2), got {sorted(set(ratios))}")
    draft = [l for l in range(cfg.n_layers, cfg.n_total_layers) if ratios[l] != 0]
    if draft:
        _fail("compress_ratios", f"DSpark draft layers must be ratio 0 (window only), got "
              f"non-zero ratio at layers {draft}")


def _check_sources_compressed(cfg: ModelConfig, field_name: str, ids: tuple[int, ...]) -> None:
    window_only = [l for l in ids if cfg.compress_ratios[l] == 0]
    if window_only:
        _fail(field_name, f"a ratio-0 (window-only) layer cannot be a source, got {window_only}")


def _check_kv_sources(cfg: ModelConfig) -> None:
    _check_layer_ids("kv_source_layers", cfg.kv_source_layers, cfg.n_layers)
    _check_sources_compressed(cfg, "kv_source_layers", cfg.kv_source_layers)
    missing = [l for l in cfg.kv_source_layers if l not in cfg.index_source_layers]
    if missing:
        _fail("kv_source_layers", f"every KV source must also be an index source; {missing} "
              f"are not in index_source_layers")


def _check_index_sources(cfg: ModelConfig) -> None:
    _check_layer_ids("index_source_layers", cfg.index_source_layers, cfg.n_layers)
    _check_sources_compressed(cfg, "index_source_layers", cfg.index_source_layers)


def _kv_owner(cfg: ModelConfig, layer: int) -> int | None:
    """The most recent KV source at or before `layer` with the same ratio (None if there is none)."""
    ratio = cfg.compress_ratios[layer]
    owners = [s for s in cfg.kv_source_layers if s <= layer and cfg.compress_ratios[s] == ratio]
    return owners[-1] if owners else None


def _check_kv_owners(cfg: ModelConfig) -> None:
    """Owners precede consumers with the same ratio; this also puts every top-k owner at or after
    its kv owner, because each KV source is itself an index source."""
    for layer, ratio in enumerate(cfg.compress_ratios):
        if ratio and _kv_owner(cfg, layer) is None:
            _fail("kv_source_layers", f"layer {layer} (ratio {ratio}) has no KV source with ratio "
                  f"{ratio} at or before it")


def _check_candidates(cfg: ModelConfig) -> None:
    cand = cfg.candidate_source_layer
    if cand == -1:
        return
    if not 0 <= cand < cfg.n_layers:
        _fail("candidate_source_layer", f"must be -1 or a backbone layer in [0, {cfg.n_layers}), "
              f"got {cand}")
    if cand not in cfg.index_source_layers:
        _fail("candidate_source_layer", f"layer {cand} must be an index source")
    if cfg.candidate_topk_blocks < 1 or cfg.candidate_block_size < 1:
        _fail("candidate_topk_blocks", f"candidate_topk_blocks and candidate_block_size must be >= 1 "
              f"with a candidate source, got {cfg.candidate_topk_blocks} x "
              f"{cfg.candidate_block_size}")
    # per-row selection counts are computed in closed form from a full pool (docs/CACHE.md INV-10)
    if cfg.candidate_topk_blocks * cfg.candidate_block_size < cfg.index_topk:
        _fail("candidate_topk_blocks", f"candidate_topk_blocks * candidate_block_size = "
              f"{cfg.candidate_topk_blocks * cfg.candidate_block_size} must be >= index_topk "
              f"= {cfg.index_topk}")
    # the published blocks index the source's kv owner's rows, so every consumer must read those
    owner = _kv_owner(cfg, cand)
    foreign = [l for l in range(cand + 1, cfg.n_layers)
               if cfg.compress_ratios[l] and _kv_owner(cfg, l) != owner]
    if foreign:
        _fail("candidate_source_layer", f"candidate consumers must share the source's kv owner "
              f"{owner}; layers {foreign} read another")


def _check_attention_shape(cfg: ModelConfig) -> None:
    for name in ("n_heads", "head_dim", "q_lora_rank", "o_groups", "o_lora_rank", "window_size",
                 "index_n_heads", "index_head_dim", "index_topk", "max_seq_len", "hc_mult",
                 "hc_sinkhorn_iters", "vocab_size", "dim"):
        if getattr(cfg, name) < 1:
            _fail(name, f"must be >= 1, got {getattr(cfg, name)}")
    if cfg.n_heads % cfg.o_groups:
        _fail("o_groups", f"n_heads = {cfg.n_heads} must be divisible by o_groups = {cfg.o_groups}")
    r = cfg.rope_head_dim
    if r < 2 or r % 2:
        _fail("rope_head_dim", f"must be even and >= 2 (rotated in pairs), got {r}")
    if r > cfg.head_dim or r > cfg.index_head_dim:
        _fail("rope_head_dim", f"{r} must be <= head_dim = {cfg.head_dim} and <= index_head_dim "
              f"= {cfg.index_head_dim}")


def _check_rope(cfg: ModelConfig) -> None:
    """YaRN (original_seq_len > 0) takes log(original_seq_len / (beta * 2 pi)): betas >= 1."""
    if cfg.original_seq_len:
        for name in ("beta_fast", "beta_slow"):
            if getattr(cfg, name) < 1:
                _fail(name, f"must be >= 1 with YaRN (original_seq_len > 0), got {getattr(cfg, name)}")


def _check_token_ids(cfg: ModelConfig) -> None:
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if not 0 <= getattr(cfg, name) < cfg.vocab_size:
            _fail(name, f"must be a token id in [0, {cfg.vocab_size}), got {getattr(cfg, name)}")


def _check_moe(cfg: ModelConfig) -> None:
    if cfg.n_shared_experts != 1:
        _fail("n_shared_experts", f"must be exactly 1, got {cfg.n_shared_experts}")
    if cfg.score_func not in SCORE_FUNCS:
        _fail("score_func", f"must be one of {', '.join(map(repr, SCORE_FUNCS))}, got {cfg.score_func!r}")
    if cfg.moe_inter_dim < 1:
        _fail("moe_inter_dim", f"must be >= 1, got {cfg.moe_inter_dim}")
    if not 1 <= cfg.n_activated_experts <= cfg.n_routed_experts:
        _fail("n_activated_experts", f"must be in [1, n_routed_experts = {cfg.n_routed_experts}], "
              f"got {cfg.n_activated_experts}")
    if cfg.dspark_n_routed_experts < 0 or cfg.dspark_n_activated_experts < 0:
        _fail("dspark_n_routed_experts", "dspark expert counts must be >= 0 (0 = as the backbone)")
    if cfg.n_mtp_layers:
        routed, active = cfg.moe_experts(cfg.n_layers)
        if not 1 <= active <= routed:
            _fail("dspark_n_activated_experts", f"the draft stages' activated experts {active} must "
                  f"be in [1, routed = {routed}]")


def _check_engram(cfg: ModelConfig) -> None:
    ids = cfg.engram_layer_ids
    _check_layer_ids("engram_layer_ids", ids, cfg.n_layers)
    if len(cfg.engram_num_embeddings) != len(ids):
        _fail("engram_num_embeddings", f"needs one entry per Engram layer ({len(ids)}), got "
              f"{len(cfg.engram_num_embeddings)}")
    if not ids:
        return
    for name, low in (("engram_max_ngram_size", 2), ("engram_n_heads", 1), ("engram_head_dim", 1),
                      ("engram_vocab_size", 1), ("engram_compressed_vocab_size", 1)):
        if getattr(cfg, name) < low:
            _fail(name, f"must be >= {low} with Engram layers, got {getattr(cfg, name)}")
    if not 0 <= cfg.engram_pad_id < cfg.vocab_size:
        _fail("engram_pad_id", f"must be a token id in [0, {cfg.vocab_size}), got {cfg.engram_pad_id}")
    if cfg.engram_compressed_vocab_size > cfg.vocab_size:
        _fail("engram_compressed_vocab_size", f"{cfg.engram_compressed_vocab_size} cannot exceed "
              f"vocab_size = {cfg.vocab_size}")
    buckets = len(ids) * cfg.engram_hash_cols
    if buckets > ENGRAM_BUCKETS_BOUND:
        _fail("engram_n_heads", f"{len(ids)} Engram layers x (engram_max_ngram_size - 1) x "
              f"engram_n_heads = {buckets} bucket moduli, more than {ENGRAM_BUCKETS_BOUND} "
              "(8x the released model's 48)")
    rows = tuple(int(x) for x in engram_primes(len(ids), cfg.engram_max_ngram_size,
                                                cfg.engram_n_heads, cfg.engram_vocab_size)
                 .sum(axis=(1, 2)))
    if rows != cfg.engram_num_embeddings:
        _fail("engram_num_embeddings", f"must equal each layer's sum of bucket primes "
              f"{list(rows)} (from engram_vocab_size, engram_n_heads, engram_max_ngram_size), got "
              f"{list(cfg.engram_num_embeddings)}")


def _check_dspark(cfg: ModelConfig) -> None:
    targets = cfg.dspark_target_layer_ids
    # taps are collected in layer order, one per target, into main_proj's len(targets) * dim input
    _check_layer_ids("dspark_target_layer_ids", targets, cfg.n_layers)
    if not cfg.n_mtp_layers:
        return
    if not targets:
        _fail("dspark_target_layer_ids", "DSpark draft stages need at least one target layer")
    if cfg.dspark_block_size < 1:
        _fail("dspark_block_size", f"must be >= 1 with draft stages, got {cfg.dspark_block_size}")
    if not 0 <= cfg.dspark_noise_token_id < cfg.vocab_size:
        _fail("dspark_noise_token_id", f"must be a token id in [0, {cfg.vocab_size}), got "
              f"{cfg.dspark_noise_token_id}")
    if cfg.dspark_markov_rank < 1:
        _fail("dspark_markov_rank", f"must be >= 1, got {cfg.dspark_markov_rank}")


def _check_quantized_widths(cfg: ModelConfig) -> None:
    """Every quantized GEMM's input width takes whole A8 groups of 32, and the FP4/Engram rows whole
    E8M0 groups of 32; head_dim also covers the FP4 x 16 compressed-KV groups. The Engram table is
    FP8 with an E8M0 scale a 32 lanes in every checkpoint, quantized or not (`schema`)."""
    widths = {"engram_head_dim": cfg.engram_head_dim} if cfg.engram_layer_ids else {}
    if cfg.quantized:
        widths.update({"dim": cfg.dim, "q_lora_rank": cfg.q_lora_rank, "head_dim": cfg.head_dim,
                       "index_head_dim": cfg.index_head_dim, "moe_inter_dim": cfg.moe_inter_dim,
                       "o_lora_rank": cfg.o_groups * cfg.o_lora_rank})  # wo_b's input: o_groups * o_lora_rank
    for name, width in widths.items():
        if width % 32:
            _fail(name, f"width {width} must be a multiple of 32 for the published quantization")


def to_hf_root(cfg: ModelConfig) -> dict[str, Any]:
    """The HF root `config.json` layout for `cfg` (the inverse of `from_dict`, checked)."""
    ref_to_hf = {v: k for k, v in _HF_TO_REF.items()}
    text = {"model_type": "deepseek_v41_text", "num_key_value_heads": 1}
    for k, v in vars(cfg).items():
        if k in ("quantized", "bos_token_id", "eos_token_id", "pad_token_id",
                 "rope_factor", "beta_fast", "beta_slow", "original_seq_len"):
            continue
        text[ref_to_hf.get(k, k)] = list(v) if isinstance(v, tuple) else v
    text["rope_scaling"] = {"rope_type": "yarn", "factor": cfg.rope_factor, "beta_fast": cfg.beta_fast,
                            "beta_slow": cfg.beta_slow, "original_max_position_embeddings": cfg.original_seq_len}
    root = {"model_type": "deepseek_v41", "architectures": ["DeepseekV41ForCausalLM"], "dtype": "bfloat16",
            "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id, "pad_token_id": cfg.pad_token_id}
    if cfg.quantized:
        root["quantization_config"] = dict(PUBLISHED_QUANTIZATION)
    else:
        text["dtype"] = "bf16"
    root["text_config"] = text
    if ModelConfig.from_dict(root) != cfg:
        raise ValueError("config: the HF root layout built for this config does not load back equal")
    return root
