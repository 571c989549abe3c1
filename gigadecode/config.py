"""Model configuration: `GptOssConfig`, a frozen dataclass passed between modules (the engine's own
settings are `engine_config.EngineConfig`).

`GptOssConfig.from_hf` reads a Hugging Face GPT-OSS `config.json` (old `rope_scaling`/`rope_theta` form
and the newer `rope_parameters` form alike); unknown keys are ignored. Defaults are the 120B values.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

SLIDING = "sliding_attention"
_INT32_MAX = 2**31 - 1
FULL = "full_attention"


class ConfigError(ValueError):
    """A config.json (or engine flag) that cannot describe a valid GPT-OSS model."""


@dataclass(frozen=True)
class RopeConfig:
    """YaRN RoPE parameters (`rope_type == "yarn"`), plain RoPE (`"default"`), or positions divided by
    `factor` (`"linear"`)."""

    rope_type: str = "yarn"
    theta: float = 150000.0
    factor: float = 32.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = False
    attention_factor: float | None = None


@dataclass(frozen=True)
class QuantConfig:
    """`quantization_config` of the checkpoint. Only `mxfp4` (experts) is supported."""

    quant_method: str = "mxfp4"
    modules_to_not_convert: tuple[str, ...] = (
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    )


@dataclass(frozen=True)
class GptOssConfig:
    """Every field GPT-OSS uses. Defaults: gpt-oss-120b."""

    vocab_size: int = 201088
    hidden_size: int = 2880
    intermediate_size: int = 2880
    num_hidden_layers: int = 36
    num_attention_heads: int = 64
    num_key_value_heads: int = 8
    head_dim: int = 64
    num_local_experts: int = 128
    num_experts_per_tok: int = 4
    sliding_window: int = 128
    layer_types: tuple[str, ...] = ()
    max_position_embeddings: int = 131072
    rms_norm_eps: float = 1e-5
    rope: RopeConfig = field(default_factory=RopeConfig)
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702
    attention_bias: bool = True
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = (200002, 199999, 200012)
    pad_token_id: int | None = 199999
    bos_token_id: int | None = None
    quantization: QuantConfig | None = field(default_factory=QuantConfig)
    torch_dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        if not self.layer_types:
            # GPT-OSS default: even layers sliding, odd layers full.
            types = tuple(SLIDING if i % 2 == 0 else FULL for i in range(self.num_hidden_layers))
            object.__setattr__(self, "layer_types", types)
        self.validate()

    # ----------------------------------------------------------------------------------------------
    def validate(self) -> None:
        """Every invariant the model code relies on; a ConfigError names the field and its value."""
        from numbers import Integral, Real

        from .mxfp4 import GROUP

        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ConfigError(f"invalid GPT-OSS config: {msg}")

        def is_int(v: Any) -> bool:
            return isinstance(v, Integral) and not isinstance(v, bool)

        def is_num(v: Any) -> bool:
            return isinstance(v, Real) and not isinstance(v, bool)

        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "num_local_experts",
                     "num_experts_per_tok", "max_position_embeddings", "sliding_window"):
            v = getattr(self, name)
            need(is_int(v), f"{name} must be an integer (got {v!r})")
            if name != "sliding_window":
                need(v > 0, f"{name} must be > 0 (got {v})")
        for name in ("rms_norm_eps", "swiglu_limit", "swiglu_alpha"):
            v = getattr(self, name)
            need(is_num(v), f"{name} must be a number (got {v!r})")
        need(self.num_attention_heads % self.num_key_value_heads == 0,
             f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
             f"num_key_value_heads ({self.num_key_value_heads})")
        need(self.head_dim % 2 == 0, f"head_dim must be even for RoPE (got {self.head_dim})")
        need(self.num_experts_per_tok <= self.num_local_experts,
             f"num_experts_per_tok ({self.num_experts_per_tok}) > num_local_experts ({self.num_local_experts})")
        need(len(self.layer_types) == self.num_hidden_layers,
             f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers")
        bad = sorted({t for t in self.layer_types if t not in (SLIDING, FULL)}, key=repr)
        need(not bad, f"unknown layer_types {bad} (expected {SLIDING!r} or {FULL!r})")
        if SLIDING in self.layer_types:
            need(self.sliding_window > 0, f"sliding_window must be > 0 (got {self.sliding_window})")
            # a window longer than the context never binds: those layers attend to everything (as in
            # transformers, which loads such a config)
        # Token ids index the embedding / lm_head rows.
        for e in self.eos_token_ids:
            need(is_int(e) and 0 <= e < self.vocab_size,
                 f"eos_token_id {e!r} is outside the vocabulary [0, {self.vocab_size})")
        for name in ("pad_token_id", "bos_token_id"):
            v = getattr(self, name)
            need(v is None or (is_int(v) and 0 <= v < self.vocab_size),
                 f"{name} {v!r} is outside the vocabulary [0, {self.vocab_size})")
        need(math.isfinite(self.rms_norm_eps) and self.rms_norm_eps > 0,
             f"rms_norm_eps must be > 0 and finite (got {self.rms_norm_eps})")
        need(self.swiglu_limit > 0, f"swiglu_limit must be > 0 (got {self.swiglu_limit})")
        need(math.isfinite(self.swiglu_alpha), f"swiglu_alpha must be finite (got {self.swiglu_alpha})")
        # RoPE.
        r = self.rope
        need(r.rope_type in ("yarn", "default", "linear"),
             f"rope_type {r.rope_type!r} is not supported (yarn, default or linear)")
        need(is_num(r.theta) and math.isfinite(r.theta) and r.theta > 0,
             f"rope_theta must be > 0 and finite (got {r.theta!r})")
        if r.rope_type == "linear":
            need(is_num(r.factor) and math.isfinite(r.factor) and r.factor > 0,
                 f"rope factor must be > 0 and finite for linear RoPE (got {r.factor!r})")
        if r.rope_type == "yarn":
            # YaRN's correction range divides by ln(theta) and takes ln(original_max / (beta * 2 pi)).
            need(r.theta > 1, f"rope_theta must be > 1 for YaRN (got {r.theta})")
            need(is_num(r.factor) and math.isfinite(r.factor) and r.factor > 0,
                 f"rope factor must be > 0 and finite for YaRN (got {r.factor!r})")
            need(is_int(r.original_max_position_embeddings) and r.original_max_position_embeddings > 0,
                 f"rope original_max_position_embeddings must be > 0 (got {r.original_max_position_embeddings!r})")
            for name in ("beta_fast", "beta_slow"):
                v = getattr(r, name)
                need(is_num(v) and math.isfinite(v) and v > 0, f"rope {name} must be > 0 and finite (got {v!r})")
            need(r.attention_factor is None or (is_num(r.attention_factor) and math.isfinite(r.attention_factor)
                                                and r.attention_factor > 0),
                 f"rope attention_factor must be > 0 and finite (got {r.attention_factor!r})")
        if self.quantization is not None:
            need(self.quantization.quant_method == "mxfp4",
                 f"unsupported quantization {self.quantization.quant_method!r} (only mxfp4)")
        if self.experts_mxfp4:
            # MXFP4 blocks the input (last) dim of each expert matrix in groups of 32: gate_up_proj
            # [E, 2I, H] is blocked along hidden_size, down_proj [E, H, I] along intermediate_size.
            for name, role in (("hidden_size", "the input dim of gate_up_proj"),
                               ("intermediate_size", "the input dim of down_proj")):
                v = getattr(self, name)
                need(v % GROUP == 0, f"MXFP4 experts need hidden_size and intermediate_size to be multiples "
                                     f"of {GROUP}, the MXFP4 block size: {name} ({role}) is {v}")

    # ----------------------------------------------------------------------------------------------
    @property
    def num_kv_groups(self) -> int:
        """Query heads per kv head (GQA)."""
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def experts_mxfp4(self) -> bool:
        return self.quantization is not None and self.quantization.quant_method == "mxfp4"

    @property
    def attention_window(self) -> int:
        """The sliding window the kernels and the KV pool run: `sliding_window`, or when that is longer than any
        sequence can be (past max_position_embeddings, which bounds the engine's context) the context itself,
        where it binds no more than before. A window of 2**31 or more, which transformers loads, would
        otherwise overflow the kernels' 32-bit window and size the decode's window tables by it."""
        return min(self.sliding_window, self.max_position_embeddings, _INT32_MAX)

    def is_sliding(self, layer: int) -> bool:
        return self.layer_types[layer] == SLIDING

    def to_hf(self) -> dict[str, Any]:
        """The config.json dict (current transformers format), as our checkpoints write it."""
        rope = {
            "rope_type": self.rope.rope_type,
            "rope_theta": self.rope.theta,
        }
        if self.rope.rope_type == "linear":
            rope["factor"] = self.rope.factor
        if self.rope.rope_type == "yarn":
            rope.update(factor=self.rope.factor, beta_fast=self.rope.beta_fast, beta_slow=self.rope.beta_slow,
                        truncate=self.rope.truncate,
                        original_max_position_embeddings=self.rope.original_max_position_embeddings)
            if self.rope.attention_factor is not None:
                rope["attention_factor"] = self.rope.attention_factor
        out: dict[str, Any] = {
            "architectures": ["GptOssForCausalLM"],
            "model_type": "gpt_oss",
            "attention_bias": self.attention_bias,
            "attention_dropout": 0.0,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0],
            "pad_token_id": self.pad_token_id,
            "experts_per_token": self.num_experts_per_tok,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "hidden_size": self.hidden_size,
            "initial_context_length": self.rope.original_max_position_embeddings,
            "initializer_range": 0.02,
            "intermediate_size": self.intermediate_size,
            "layer_types": list(self.layer_types),
            "max_position_embeddings": self.max_position_embeddings,
            "num_attention_heads": self.num_attention_heads,
            "num_experts_per_tok": self.num_experts_per_tok,
            "num_hidden_layers": self.num_hidden_layers,
            "num_key_value_heads": self.num_key_value_heads,
            "num_local_experts": self.num_local_experts,
            "output_router_logits": False,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": rope,
            "router_aux_loss_coef": 0.9,
            "sliding_window": self.sliding_window,
            "swiglu_alpha": self.swiglu_alpha,
            "swiglu_limit": self.swiglu_limit,
            "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": self.torch_dtype,
            "use_cache": True,
            "vocab_size": self.vocab_size,
        }
        if self.bos_token_id is not None:
            out["bos_token_id"] = self.bos_token_id
        if self.quantization is not None:
            out["quantization_config"] = {
                "quant_method": self.quantization.quant_method,
                "modules_to_not_convert": list(self.quantization.modules_to_not_convert),
            }
        return out

    @classmethod
    def from_hf(cls, source: dict[str, Any] | str | Path) -> GptOssConfig:
        """Build from a config.json path, a model directory, or its parsed dict.

        A value of the wrong JSON type (a string or a list where a number belongs, ...) is a ConfigError
        naming the key; ranges and cross-field invariants are checked by `validate`."""
        if not isinstance(source, dict):
            path = Path(source)
            if path.is_dir():
                path = path / "config.json"
            try:
                source = json.loads(path.read_text())
            except FileNotFoundError:
                raise ConfigError(f"no config.json at {path}") from None
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path} is not valid JSON: {e}") from None
            except UnicodeDecodeError as e:
                raise ConfigError(f"{path} is not valid JSON: not UTF-8 text ({e})") from None
            except OSError as e:                        # a directory named config.json, no read permission
                raise ConfigError(f"cannot read {path}: {e.strerror or e}") from None
            if not isinstance(source, dict):
                raise ConfigError(f"{path} must hold a JSON object (got a {type(source).__name__})")
        d = _untag_floats(dict(source))

        mt = d.get("model_type")
        if mt is not None and mt != "gpt_oss":
            raise ConfigError(f"model_type is {mt!r}, expected 'gpt_oss'")

        # RoPE, read as transformers reads it: a legacy `rope_scaling` (when not empty) wins over
        # `rope_parameters`; with neither, GPT-OSS's YaRN (factor 32 over 4,096 positions, no truncation);
        # a dict without a type is plain RoPE; `rope_theta` inside the dict, else top-level, else 150,000; a
        # YaRN dict without `original_max_position_embeddings` scales from max_position_embeddings.
        rp_key = "rope_scaling" if d.get("rope_scaling") else "rope_parameters"
        rp = d.get(rp_key)
        if rp is not None and not isinstance(rp, dict):
            raise _bad(rp_key, rp, "an object")
        if rp is not None and any(k in (SLIDING, FULL) for k in rp):
            raise ConfigError(f"config.json {rp_key} is nested by layer type ({', '.join(sorted(rp))}): per-layer-type "
                              f"RoPE is not supported (GPT-OSS has one RoPE for every layer, and transformers' "
                              f"GPT-OSS cannot run it either)")

        def rk(k: str) -> str:
            return f"{rp_key}.{k}"

        # transformers moves a top-level partial_rotary_factor into the RoPE dict (the dict's own wins)
        prf = d.get("partial_rotary_factor")
        if prf is not None and prf != 1.0 and "partial_rotary_factor" not in (rp or {}):
            raise ConfigError(f"config.json 'partial_rotary_factor' = {prf!r} is not supported (GPT-OSS rotates "
                              f"whole heads)")

        if rp is not None and rp.get("rope_theta") is not None:
            theta = _as_float(rk("rope_theta"), rp["rope_theta"])
        elif d.get("rope_theta") is not None:
            theta = _as_float("rope_theta", d["rope_theta"])
        else:
            theta = RopeConfig.theta
        # a top-level `original_max_position_embeddings` (Phi-3's form) wins over the YaRN dict's, as in
        # transformers (`standardize_rope_params` gives the attribute priority)
        top_orig = d.get("original_max_position_embeddings")
        top_orig = None if top_orig is None else _as_int("original_max_position_embeddings", top_orig)
        if rp is None:
            rope = RopeConfig(theta=theta)
            if top_orig is not None:
                rope = replace(rope, original_max_position_embeddings=top_orig)
        else:
            rope = _rope_from_dict(rp, theta, d.get("max_position_embeddings", cls.max_position_embeddings), rk,
                                   top_orig)

        qc = d.get("quantization_config")
        quant = None
        if qc:
            if not isinstance(qc, dict):
                raise _bad("quantization_config", qc, "an object")
            quant = QuantConfig(
                quant_method=str(qc.get("quant_method")),
                modules_to_not_convert=_as_strs("quantization_config.modules_to_not_convert",
                                               qc.get("modules_to_not_convert") or ()),
            )

        eos = d.get("eos_token_id")
        eos_ids: tuple[int, ...] = () if eos is None else tuple(
            _as_int("eos_token_id", e) for e in (eos if isinstance(eos, list) else [eos]))

        convert = {"int": _as_int, "float": _as_float, "bool": _as_bool, "str": _as_str, "int | None": _as_int}
        kw: dict[str, Any] = {}
        types = {f.name: f.type for f in fields(cls)}
        for k, t in types.items():                          # field order: the first bad key is reported
            if k not in ("rope", "quantization", "layer_types", "eos_token_ids") and d.get(k) is not None:
                conv = convert.get(str(t))
                kw[k] = conv(k, d[k]) if conv else d[k]
        if "num_local_experts" not in d and "num_experts" in d:
            kw["num_local_experts"] = _as_int("num_experts", d["num_experts"])
        # A key left out takes transformers' GptOssConfig default (the field defaults above: head_dim 64,
        # num_key_value_heads 8, sliding_window 128, num_experts_per_tok 4). transformers does not read
        # `experts_per_token` (the original release's name), so one that disagrees with what it runs is refused.
        if "num_experts_per_tok" not in d and "experts_per_token" in d:
            k = _as_int("experts_per_token", d["experts_per_token"])
            if k != cls.num_experts_per_tok:
                raise ConfigError(f"config.json has experts_per_token={k} but no num_experts_per_tok, the key "
                                  f"transformers reads (it would route to {cls.num_experts_per_tok} experts): "
                                  f"add \"num_experts_per_tok\": {k}")
        if "sliding_window" in d and d["sliding_window"] is None:
            kw["sliding_window"] = 0                        # explicitly none: only full-attention layers valid
        if d.get("dtype") and "torch_dtype" not in d:
            kw["torch_dtype"] = _as_str("dtype", d["dtype"])
        kw.pop("pad_token_id", None)
        pad = d.get("pad_token_id")
        pad = None if pad is None else _as_int("pad_token_id", pad)
        # special ids past the vocabulary (a config cut down from a real one) can never be generated: transformers
        # loads them and never meets them, so they are dropped here, with a word
        vocab = kw.get("vocab_size", cls.vocab_size)
        outside = [f"{k}={v}" for k, vs in (("eos_token_id", eos_ids), ("pad_token_id", (pad,)),
                                            ("bos_token_id", (kw.get("bos_token_id"),)))
                   for v in vs if isinstance(v, int) and not 0 <= v < vocab]
        if outside:
            log.warning("config.json: %s outside the vocabulary [0, %d) ignored", ", ".join(outside), vocab)
            eos_ids = tuple(e for e in eos_ids if 0 <= e < vocab)
            pad = pad if pad is None or 0 <= pad < vocab else None
            if not 0 <= kw.get("bos_token_id", 0) < vocab:
                kw["bos_token_id"] = None
        # transformers reads the legacy layer type "attention" as full attention (`remap_legacy_layer_types`)
        layer_types = tuple(FULL if t == "attention" else t
                            for t in _as_strs("layer_types", d.get("layer_types") or ()))
        return cls(
            rope=rope,
            quantization=quant,
            layer_types=layer_types,
            eos_token_ids=eos_ids,
            pad_token_id=pad,
            **kw,
        )

    def with_(self, **changes: Any) -> GptOssConfig:
        return replace(self, **changes)


# transformers writes the floats JSON has no literal for as {"__float__": "Infinity" | "-Infinity" | "NaN"}
_FLOAT_TAGS = {"Infinity": math.inf, "-Infinity": -math.inf, "NaN": math.nan}


def _untag_floats(v: Any) -> Any:
    """A parsed config.json with transformers' tagged non-finite floats read back as floats (as it reads them)."""
    if isinstance(v, dict):
        tag = v.get("__float__")
        if len(v) == 1 and isinstance(tag, str) and tag in _FLOAT_TAGS:
            return _FLOAT_TAGS[tag]
        return {k: _untag_floats(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_untag_floats(x) for x in v]
    return v


# config.json readers: a value of the wrong JSON type is a ConfigError naming its key
def _bad(key: str, v: Any, want: str) -> ConfigError:
    return ConfigError(f"config.json {key!r} must be {want} (got {v!r})")


def _as_int(key: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (isinstance(v, float) and not v.is_integer()):
        raise _bad(key, v, "an integer")
    return int(v)


def _as_float(key: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _bad(key, v, "a number")
    return float(v)


def _as_bool(key: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise _bad(key, v, "true or false")
    return v


def _as_str(key: str, v: Any) -> str:
    if not isinstance(v, str):
        raise _bad(key, v, "a string")
    return v


def _as_strs(key: str, v: Any) -> tuple[str, ...]:
    if not isinstance(v, (list, tuple)) or not all(isinstance(x, str) for x in v):
        raise _bad(key, v, "a list of strings")
    return tuple(v)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention factor for `factor`, scaled by `mscale` (transformers' `get_mscale`)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _rope_from_dict(rp: dict[str, Any], theta: float, max_positions: Any, rk: Callable[[str], str],
                    top_orig: int | None = None) -> RopeConfig:
    """A config.json's RoPE dict -> RopeConfig, with transformers' defaults for the keys it leaves out."""
    rope_type = rp.get("rope_type", rp.get("type", "default"))
    rope_type = _as_str(rk("rope_type"), rope_type)
    prf = rp.get("partial_rotary_factor")
    if prf is not None and prf != 1.0:
        raise ConfigError(f"config.json {rk('partial_rotary_factor')} = {prf!r} is not supported (GPT-OSS rotates "
                          f"whole heads)")
    if rope_type in ("yarn", "linear") and "factor" not in rp:
        raise ConfigError(f"config.json {rk('factor')} is required for {rope_type} RoPE")
    if rope_type == "linear":
        return RopeConfig(rope_type="linear", theta=theta, factor=_as_float(rk("factor"), rp["factor"]))
    if rope_type != "yarn":
        return RopeConfig(rope_type=rope_type, theta=theta)
    orig = rp.get("original_max_position_embeddings")
    orig = (top_orig if top_orig is not None
            else _as_int("max_position_embeddings", max_positions) if orig is None
            else _as_int(rk("original_max_position_embeddings"), orig))
    factor = rp["factor"]                   # null: the ratio of the context to the pretraining length
    factor = (_as_int("max_position_embeddings", max_positions) / orig if factor is None
              else _as_float(rk("factor"), factor))
    af = rp.get("attention_factor")
    ms, ms_all = rp.get("mscale"), rp.get("mscale_all_dim")
    if af is None and ms and ms_all:        # transformers: both set (and non-zero) -> their ratio; else unused
        af = yarn_mscale(factor, _as_float(rk("mscale"), ms)) / yarn_mscale(factor, _as_float(rk("mscale_all_dim"),
                                                                                              ms_all))
    truncate = rp.get("truncate", True)     # transformers: a missing `truncate` is True, a null one False
    return RopeConfig(
        rope_type="yarn",
        theta=theta,
        factor=factor,
        original_max_position_embeddings=orig,
        # transformers reads the betas as `get(...) or default`.
        beta_fast=_as_float(rk("beta_fast"), rp.get("beta_fast") or 32.0),
        beta_slow=_as_float(rk("beta_slow"), rp.get("beta_slow") or 1.0),
        truncate=False if truncate is None else _as_bool(rk("truncate"), truncate),
        attention_factor=None if af is None else _as_float(rk("attention_factor"), af),
    )
