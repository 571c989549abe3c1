"""Loader and config errors: each broken checkpoint fails with a message naming what is wrong; config.json
parsing of the real gpt-oss layout."""

from __future__ import annotations

import json
import math
import shutil
import struct
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

from gigadecode.config import FULL, SLIDING, ConfigError, GptOssConfig
from gigadecode.rope import Rope, rope_inv_freq
from gigadecode.weights import CheckpointError, load_weights, read_safetensors_index
from helpers import GPT_OSS_20B

ST = "model.safetensors"


def broken_copy(src: Path, dst: Path, edit=None) -> Path:
    """Copy the checkpoint dir; `edit(tensors)` mutates the tensor dict, which is saved back."""
    shutil.copytree(src, dst)
    if edit is not None:
        t = load_file(dst / ST)
        edit(t)
        save_file(t, str(dst / ST), metadata={"format": "pt"})
    return dst


def edit_config(d: Path, **changes) -> None:
    cfg = json.loads((d / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (d / "config.json").write_text(json.dumps(cfg))


def header(path: Path) -> tuple[int, dict]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return n, json.loads(f.read(n))


def test_tiny_checkpoint_loads(tiny_ckpt, tmp_path):
    """The unbroken copy loads (so the failures below come from the edits)."""
    w = load_weights(broken_copy(tiny_ckpt, tmp_path / "ck"))
    assert w.mxfp4 and w.tensors["qkv_w"].shape == (4, (4 + 2 * 2) * 16, 64)


def test_missing_tensor(tiny_ckpt, tmp_path):
    name = "model.layers.1.self_attn.k_proj.bias"
    d = broken_copy(tiny_ckpt, tmp_path / "ck", lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=f"missing tensor '{name}'"):
        load_weights(d)


def test_missing_expert_scales(tiny_ckpt, tmp_path):
    name = "model.layers.3.mlp.experts.down_proj_scales"
    d = broken_copy(tiny_ckpt, tmp_path / "ck", lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=f"missing tensor '{name}'"):
        load_weights(d)


@pytest.mark.parametrize("name,new_shape", [
    ("model.layers.2.self_attn.q_proj.weight", (64, 64 + 1)),
    ("model.layers.0.mlp.router.bias", (7,)),
    ("model.layers.1.mlp.experts.gate_up_proj_blocks", (8, 128, 2, 8)),
    ("lm_head.weight", (1000, 64)),
])
def test_wrong_shape(tiny_ckpt, tmp_path, name, new_shape):
    def edit(t):
        t[name] = torch.zeros(new_shape, dtype=t[name].dtype)
    d = broken_copy(tiny_ckpt, tmp_path / "ck", edit)
    with pytest.raises(CheckpointError, match=rf"tensor '{name}' has shape \[{', '.join(map(str, new_shape))}\]"):
        load_weights(d)


def test_float_where_uint8_blocks_expected(tiny_ckpt, tmp_path):
    name = "model.layers.0.mlp.experts.gate_up_proj_blocks"

    def edit(t):
        t[name] = t[name].float()
    d = broken_copy(tiny_ckpt, tmp_path / "ck", edit)
    with pytest.raises(CheckpointError, match=rf"tensor '{name}' has dtype torch.float32.*uint8"):
        load_weights(d)


@pytest.mark.parametrize("dtype", [torch.int32, torch.uint8, torch.float8_e4m3fn])
def test_non_float_where_float_expected(tiny_ckpt, tmp_path, dtype):
    name = "model.layers.2.mlp.router.weight"

    def edit(t):
        t[name] = t[name].float().to(dtype)
    d = broken_copy(tiny_ckpt, tmp_path / "ck", edit)
    with pytest.raises(CheckpointError, match=rf"tensor '{name}' has dtype {dtype}.*float"):
        load_weights(d)


def test_truncated_file_names_the_tensor(tiny_ckpt, tmp_path):
    d = broken_copy(tiny_ckpt, tmp_path / "ck")
    f = d / ST
    n, h = header(f)
    # The tensor whose data ends last is the one a cut-short download loses.
    last = max((k for k in h if k != "__metadata__"), key=lambda k: h[k]["data_offsets"][1])
    data = f.read_bytes()
    f.write_bytes(data[:-100])
    with pytest.raises(CheckpointError, match=rf"tensor '{last}' in {ST}: file truncated"):
        load_weights(d)
    with pytest.raises(CheckpointError, match="truncated"):
        read_safetensors_index(d)


def test_header_whose_bytes_do_not_hold_its_shape(tiny_ckpt, tmp_path):
    """A header entry claiming more elements than its data bytes hold is refused by name before any read
    (tensors are read straight into the stacks by byte offset, so a lying header must never get that far)."""
    d = broken_copy(tiny_ckpt, tmp_path / "ck")
    f = d / ST
    n, h = header(f)
    name = "model.layers.1.mlp.router.bias"
    h[name]["shape"] = [h[name]["shape"][0] * 2]
    raw = json.dumps(h).encode()
    f.write_bytes(struct.pack("<Q", len(raw)) + raw + f.read_bytes()[8 + n:])
    with pytest.raises(CheckpointError, match=rf"tensor '{name}' in {ST}: \d+ data bytes for shape"):
        load_weights(d)


def test_loaded_stacks_equal_the_files_tensors(tiny_ckpt):
    """The plain-read loader gives the safetensors library's values bit for bit (fp32 stacks: casts)."""
    t = load_file(tiny_ckpt / ST)
    w = load_weights(tiny_ckpt)
    lw = w.layers[2]
    assert torch.equal(lw.router_w, t["model.layers.2.mlp.router.weight"].float())
    assert torch.equal(lw.gate_up_blocks, t["model.layers.2.mlp.experts.gate_up_proj_blocks"])
    assert torch.equal(lw.qkv_w[: t["model.layers.2.self_attn.q_proj.weight"].shape[0]],
                       t["model.layers.2.self_attn.q_proj.weight"].float())
    assert torch.equal(w.embed, t["model.embed_tokens.weight"].float())


@pytest.mark.parametrize("keep", [4, 1000])
def test_truncated_inside_header(tiny_ckpt, tmp_path, keep):
    d = broken_copy(tiny_ckpt, tmp_path / "ck")
    f = d / ST
    f.write_bytes(f.read_bytes()[:keep])
    with pytest.raises(CheckpointError, match=rf"{ST}: truncated file"):
        load_weights(d)


def test_corrupt_header(tiny_ckpt, tmp_path):
    d = broken_copy(tiny_ckpt, tmp_path / "ck")
    f = d / ST
    data = bytearray(f.read_bytes())
    data[8:40] = b"\xff\xfe garbage, not json at all!! \x00"[:32].ljust(32, b"#")
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"{ST}: corrupt safetensors header"):
        load_weights(d)


@pytest.mark.parametrize("bad_header", [b'["a", "list"]', b'{"x": 1}', b'{"x": {"dtype": "F32", "shape": [1]}}'])
def test_header_with_wrong_structure(tiny_ckpt, tmp_path, bad_header):
    """Valid JSON that is not a safetensors header is a CheckpointError too (not a TypeError/KeyError)."""
    d = broken_copy(tiny_ckpt, tmp_path / "ck")
    f = d / ST
    n, _ = header(f)
    body = f.read_bytes()[8 + n:]
    f.write_bytes(struct.pack("<Q", len(bad_header)) + bad_header + body)
    with pytest.raises(CheckpointError, match=rf"{ST}: corrupt safetensors header"):
        load_weights(d)


def test_unsupported_tensor_dtype(tiny_ckpt, tmp_path):
    name = "model.layers.0.self_attn.sinks"

    def edit(t):
        t[name] = t[name].float().to(torch.float8_e5m2)
    d = broken_copy(tiny_ckpt, tmp_path / "ck", edit)
    with pytest.raises(CheckpointError, match=rf"tensor '{name}'.*unsupported dtype F8_E5M2"):
        load_weights(d)


def test_tensor_in_two_files(tiny_ckpt, tmp_path):
    name = "model.norm.weight"
    d = broken_copy(tiny_ckpt, tmp_path / "ck")
    save_file({name: load_file(d / ST)[name]}, str(d / "model-extra.safetensors"))
    with pytest.raises(CheckpointError, match=rf"tensor '{name}' appears in both"):
        load_weights(d)


def test_unsupported_quantization(tiny_ckpt, tmp_path):
    d = broken_copy(tiny_ckpt, tmp_path / "ck")
    edit_config(d, quantization_config={"quant_method": "fp8", "modules_to_not_convert": []})
    with pytest.raises(ConfigError, match="fp8"):
        load_weights(d)
    with pytest.raises(ConfigError, match="unsupported quantization 'fp8'"):
        GptOssConfig.from_hf(d)


def test_mxfp4_tensors_without_quantization_config(tiny_ckpt, tmp_path):
    d = broken_copy(tiny_ckpt, tmp_path / "ck")
    edit_config(d, quantization_config=None)
    with pytest.raises(CheckpointError, match="quantization_config"):
        load_weights(d)


def test_no_safetensors_files(tiny_ckpt, tmp_path):
    d = broken_copy(tiny_ckpt, tmp_path / "ck")
    (d / ST).unlink()
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors files"):
        load_weights(d)


def test_missing_config_json(tiny_ckpt, tmp_path):
    d = broken_copy(tiny_ckpt, tmp_path / "ck")
    (d / "config.json").unlink()
    with pytest.raises(ConfigError, match="no config.json"):
        load_weights(d)


def test_invalid_config_json(tiny_ckpt, tmp_path):
    d = broken_copy(tiny_ckpt, tmp_path / "ck")
    (d / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_weights(d)


def test_missing_model_dir(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_weights(tmp_path / "nope")


def test_config_mismatching_the_tensors(tiny_ckpt, tmp_path):
    """A config that disagrees with the files (8 experts written, 16 declared) names the first bad tensor."""
    d = broken_copy(tiny_ckpt, tmp_path / "ck")
    edit_config(d, num_local_experts=16)
    with pytest.raises(CheckpointError, match=r"tensor 'model.layers.0.mlp.router.weight' has shape \[8, 64\]"):
        load_weights(d)


# ---------------------------------------------------------------------------------------------------------
def tiny_dict(tiny_ckpt) -> dict:
    return json.loads((tiny_ckpt / "config.json").read_text())


@pytest.mark.parametrize("changes,match", [
    (dict(num_attention_heads=5), r"num_attention_heads \(5\) must be a multiple of num_key_value_heads \(2\)"),
    (dict(layer_types=["sliding_attention", "full_attention", "chunked_attention", "full_attention"]),
     r"unknown layer_types \['chunked_attention'\]"),
    (dict(layer_types=["full_attention"] * 3), "layer_types has 3 entries for 4 layers"),
    (dict(hidden_size=0), "hidden_size must be > 0"),
    (dict(num_experts_per_tok=9), r"num_experts_per_tok \(9\) > num_local_experts \(8\)"),
    (dict(head_dim=15), "head_dim must be even"),
    (dict(sliding_window=0), "sliding_window must be > 0"),
    (dict(rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0}), "rope_type 'longrope'"),
    (dict(model_type="llama"), "model_type is 'llama'"),
])
def test_bad_config_values(tiny_ckpt, changes, match):
    d = tiny_dict(tiny_ckpt)
    d.update(changes)
    with pytest.raises(ConfigError, match=match):
        GptOssConfig.from_hf(d)


def test_tiny_config_round_trips(tiny_ckpt):
    cfg = GptOssConfig.from_hf(tiny_ckpt)
    assert GptOssConfig.from_hf(cfg.to_hf()) == cfg
    assert (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.sliding_window) == (4, 2, 16)
    assert cfg.experts_mxfp4 and cfg.eos_token_ids == (2,) and cfg.pad_token_id == 0 and cfg.bos_token_id == 1


def test_from_hf_gpt_oss_20b():
    c = GptOssConfig.from_hf(dict(GPT_OSS_20B, some_future_key={"x": 1}, another=[1, 2]))  # unknown keys ignored
    assert (c.vocab_size, c.hidden_size, c.intermediate_size) == (201088, 2880, 2880)
    assert (c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (24, 64, 8, 64)
    assert (c.num_local_experts, c.num_experts_per_tok, c.num_kv_groups) == (32, 4, 8)
    assert c.sliding_window == 128 and c.max_position_embeddings == 131072
    assert c.layer_types == (SLIDING, FULL) * 12 and c.is_sliding(0) and not c.is_sliding(23)
    assert c.rms_norm_eps == 1e-5 and c.swiglu_limit == 7.0 and c.attention_bias and not c.tie_word_embeddings
    assert c.eos_token_ids == (200002,) and c.pad_token_id == 199999 and c.bos_token_id is None
    r = c.rope
    assert (r.rope_type, r.theta, r.factor, r.original_max_position_embeddings) == ("yarn", 150000.0, 32.0, 4096)
    assert (r.beta_fast, r.beta_slow, r.truncate, r.attention_factor) == (32.0, 1.0, False, None)
    assert isinstance(r.theta, float)
    assert c.experts_mxfp4 and c.quantization.modules_to_not_convert == tuple(
        GPT_OSS_20B["quantization_config"]["modules_to_not_convert"])


def test_from_hf_only_experts_per_token_and_num_experts():
    """transformers reads `num_experts` for num_local_experts, but not `experts_per_token` (it routes to its
    default 4): one that agrees is fine, one that does not is refused rather than run differently."""
    d = json.loads(json.dumps(GPT_OSS_20B))                  # (transformers edits the dicts it is given)
    del d["num_experts_per_tok"], d["num_local_experts"]
    d.update(experts_per_token=4, num_experts=16)
    hf = transformers.GptOssConfig(**json.loads(json.dumps(d)))
    c = GptOssConfig.from_hf(d)
    assert (c.num_experts_per_tok, c.num_local_experts) == (hf.num_experts_per_tok, hf.num_local_experts) == (4, 16)
    d["experts_per_token"] = 2
    assert transformers.GptOssConfig(**json.loads(json.dumps(d))).num_experts_per_tok == 4
    with pytest.raises(ConfigError, match="experts_per_token=2 but no num_experts_per_tok.*add \"num_experts_per_tok\": 2"):
        GptOssConfig.from_hf(d)


@pytest.mark.parametrize("key", ["head_dim", "num_key_value_heads", "sliding_window", "num_experts_per_tok",
                                 "rms_norm_eps", "swiglu_limit", "max_position_embeddings", "attention_bias"])
def test_from_hf_missing_key_takes_transformers_default(key):
    """A key left out of config.json means what transformers' GptOssConfig makes of it (head_dim once was
    hidden / heads, num_key_value_heads the q heads and sliding_window none: other shapes, other numbers)."""
    d = {k: v for k, v in json.loads(json.dumps(GPT_OSS_20B)).items() if k not in (key, "experts_per_token")}
    d.update(hidden_size=256, num_attention_heads=16)        # hidden / heads = 16, not the default head_dim 64
    hf, c = transformers.GptOssConfig(**json.loads(json.dumps(d))), GptOssConfig.from_hf(d)
    assert getattr(c, key) == getattr(hf, key), key
    assert (c.head_dim, c.num_key_value_heads, c.sliding_window) == (hf.head_dim, hf.num_key_value_heads,
                                                                     hf.sliding_window)


def test_from_hf_reads_the_non_finite_floats_transformers_writes(tmp_path):
    """transformers 5 writes inf / NaN floats to config.json as {"__float__": "Infinity"} (JSON has no such
    numbers) and reads them back: a config it saved with an unclamped SwiGLU (swiglu_limit inf) loads here
    as well, as inf (it was refused: 'swiglu_limit' must be a number)."""
    hf = transformers.GptOssConfig(swiglu_limit=math.inf, num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=16, num_local_experts=4, vocab_size=100)
    hf.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["swiglu_limit"] == {"__float__": "Infinity"}
    c = GptOssConfig.from_hf(tmp_path)
    assert c.swiglu_limit == math.inf == transformers.AutoConfig.from_pretrained(tmp_path).swiglu_limit
    assert GptOssConfig.from_hf(json.loads((tmp_path / "config.json").read_text())) == c
    edit_config(tmp_path, swiglu_limit={"__float__": "NaN"})
    with pytest.raises(ConfigError, match="swiglu_limit must be > 0"):
        GptOssConfig.from_hf(tmp_path)


def test_attention_bias_false_loads_zero_biases(tmp_path, monkeypatch):
    """attention_bias: false — no file fills the q/k/v/o bias stacks, so they must be zeros, not whatever
    memory they were allocated on (which gave NaN logits or wrong tokens); new stacks here start as NaN."""
    from gigadecode import weights as weights_mod
    from gigadecode.checkpoint import make_checkpoint, preset_config
    cfg = preset_config("tiny", "mxfp4").with_(attention_bias=False)
    d = make_checkpoint(tmp_path / "nobias", cfg=cfg, seed=3)
    assert not any(".self_attn." in n and n.endswith("_proj.bias") for n in read_safetensors_index(d))
    real_empty = torch.empty
    monkeypatch.setattr(weights_mod.torch, "empty", lambda *a, **k: real_empty(*a, **k).fill_(math.nan)
                        if k.get("dtype", torch.float32).is_floating_point else real_empty(*a, **k))
    w = load_weights(d)
    assert not w.tensors["qkv_b"].any() and not w.tensors["o_b"].any()
    assert not w.tensors["qkv_w"].isnan().any()


def test_from_hf_truncate_missing_means_true():
    d = json.loads(json.dumps(GPT_OSS_20B))
    del d["rope_scaling"]["truncate"]
    assert GptOssConfig.from_hf(d).rope.truncate is True
    d["rope_scaling"]["truncate"] = False
    assert GptOssConfig.from_hf(d).rope.truncate is False


def test_from_hf_new_rope_parameters_form():
    d = json.loads(json.dumps(GPT_OSS_20B))
    rp = d.pop("rope_scaling")
    del d["rope_theta"]
    d["rope_parameters"] = dict(rp, rope_theta=150000.0)
    assert GptOssConfig.from_hf(d) == GptOssConfig.from_hf(GPT_OSS_20B)


def test_from_hf_eos_list_and_missing_layer_types():
    d = dict(GPT_OSS_20B, eos_token_id=[200002, 199999, 200012])
    del d["layer_types"]
    c = GptOssConfig.from_hf(d)
    assert c.eos_token_ids == (200002, 199999, 200012)
    assert c.layer_types == (SLIDING, FULL) * 12                 # GPT-OSS default alternation


def test_from_hf_legacy_attention_layer_type_is_full_attention():
    """transformers reads the legacy layer type "attention" as "full_attention" (its `remap_legacy_layer_types`)
    and runs such a GPT-OSS: it loads here too, the same layers full (it was refused as an unknown layer type);
    a name transformers does not know is still refused."""
    d = dict(GPT_OSS_20B, layer_types=["sliding_attention", "attention"] * 12)
    hf = transformers.GptOssConfig(**json.loads(json.dumps(d)))
    c = GptOssConfig.from_hf(d)
    assert list(c.layer_types) == list(hf.layer_types) == [SLIDING, FULL] * 12
    with pytest.raises(ConfigError, match="unknown layer_types \\['global'\\]"):
        GptOssConfig.from_hf(dict(GPT_OSS_20B, layer_types=["sliding_attention", "global"] * 12))


def test_from_hf_agrees_with_transformers_config():
    """transformers parses the same dict to the same numbers (rope included)."""
    hf = transformers.GptOssConfig(**json.loads(json.dumps(GPT_OSS_20B)))
    c = GptOssConfig.from_hf(GPT_OSS_20B)
    assert (hf.num_local_experts, hf.num_experts_per_tok, hf.sliding_window) == (
        c.num_local_experts, c.num_experts_per_tok, c.sliding_window)
    assert list(hf.layer_types) == list(c.layer_types)
    rp = getattr(hf, "rope_parameters", None) or hf.rope_scaling
    assert float(rp["rope_theta"] if "rope_theta" in rp else hf.rope_theta) == c.rope.theta
    assert rp["factor"] == c.rope.factor and rp.get("truncate", True) == c.rope.truncate


# config.json RoPE forms beyond the published ones: what each key's absence means is transformers' call
_NO_ROPE = {k: v for k, v in GPT_OSS_20B.items() if k not in ("rope_scaling", "rope_theta", "initial_context_length")}
ROPE_FORMS = {
    "no rope keys": {},                                                  # GPT-OSS's YaRN, not plain RoPE
    "null rope_parameters": {"rope_parameters": None},
    "rope_theta only": {"rope_theta": 10000.0},
    "rope_parameters without a type": {"rope_parameters": {"rope_theta": 10000.0}},   # plain RoPE
    "empty rope_parameters": {"rope_parameters": {}, "rope_theta": 99.0},
    "rope_scaling without a type": {"rope_scaling": {"factor": 4.0}},
    "yarn without its original length": {"rope_scaling": {"rope_type": "yarn", "factor": 8.0},
                                         "initial_context_length": 1024, "max_position_embeddings": 8192},
    "rope_scaling wins": {"rope_scaling": {"type": "yarn", "factor": 8.0},
                          "rope_parameters": {"rope_type": "default", "rope_theta": 77.0}},
    "empty rope_scaling": {"rope_scaling": {}, "rope_parameters": {"rope_type": "default", "rope_theta": 77.0}},
    "null truncate, null factor": {"rope_parameters": {"rope_type": "yarn", "factor": None, "truncate": None,
                                                       "original_max_position_embeddings": 2048}},
}


@pytest.mark.parametrize("form", list(ROPE_FORMS))
def test_rope_defaults_are_read_as_transformers_reads_them(form, tmp_path):
    """Each RoPE form of a config.json gives the parameters transformers' GptOssConfig loads from the same
    file (a wrong default changes every token after the first few: they once were read the other way round)."""
    d = {**_NO_ROPE, **ROPE_FORMS[form]}
    (tmp_path / "config.json").write_text(json.dumps(d))
    want = transformers.AutoConfig.from_pretrained(tmp_path).rope_parameters
    got = GptOssConfig.from_hf(tmp_path).rope
    assert (got.rope_type, got.theta) == (want["rope_type"], want["rope_theta"])
    if got.rope_type == "yarn":         # a null factor: transformers' YaRN takes the ratio of the two lengths
        factor = want["factor"] or d["max_position_embeddings"] / want["original_max_position_embeddings"]
        assert (got.factor, got.original_max_position_embeddings) == (factor, want["original_max_position_embeddings"])
        assert (got.truncate, got.beta_fast, got.beta_slow) == (bool(want.get("truncate", True)),
                                                                want.get("beta_fast") or 32, want.get("beta_slow") or 1)


def test_rope_forms_we_cannot_run_are_refused():
    for rp in ({"rope_type": "yarn", "rope_theta": 1000.0},                     # YaRN needs its factor
               {"rope_type": "linear", "rope_theta": 1000.0},                   # so does linear scaling
               {"rope_type": "default", "partial_rotary_factor": 0.5},          # GPT-OSS rotates whole heads
               {"rope_type": "dynamic", "factor": 4.0}):                         # scaled by the sequence length
        with pytest.raises(ConfigError, match="rope_parameters|rope_type 'dynamic' is not supported"):
            GptOssConfig.from_hf({**_NO_ROPE, "rope_parameters": rp})
    # a top-level partial_rotary_factor joins the RoPE dict in transformers (whose GPT-OSS then fails in its
    # forward): refused as well, not run with whole heads rotated
    for rp in (None, {"rope_type": "default"}, {"rope_type": "yarn", "factor": 4.0}):
        with pytest.raises(ConfigError, match="partial_rotary_factor.* = 0.5 is not supported"):
            GptOssConfig.from_hf({**_NO_ROPE, "rope_parameters": rp, "partial_rotary_factor": 0.5})
    assert GptOssConfig.from_hf({**_NO_ROPE, "partial_rotary_factor": 1.0}) == GptOssConfig.from_hf(_NO_ROPE)
    # RoPE parameters nested by layer type (transformers' form for models with one RoPE per layer type; its
    # GPT-OSS fails on them with a KeyError): refused, not read as a dict without a type (plain RoPE)
    yarn = dict(GPT_OSS_20B["rope_scaling"], rope_theta=150000.0)
    for key in ("rope_parameters", "rope_scaling"):
        with pytest.raises(ConfigError, match=f"{key} is nested by layer type.*not supported"):
            GptOssConfig.from_hf({**_NO_ROPE, key: {FULL: yarn, SLIDING: yarn}})


def _yarn_case(max_pos: int, theta: float = 150000, **rope) -> dict:
    d = json.loads(json.dumps(GPT_OSS_20B))
    d["max_position_embeddings"], d["rope_theta"] = max_pos, theta
    d["rope_scaling"].update(rope)
    return d


# max_position_embeddings != original_max_position_embeddings in each; factor != their ratio in the last
# three (so using the ratio for the factor, or the wrong one of the two lengths, shows)
ROPE_CASES = {
    "gpt-oss-20b": GPT_OSS_20B,                                          # 131072 / 4096, factor 32, no truncate
    "truncate": _yarn_case(65536, factor=8.0, truncate=True),
    "betas-theta": _yarn_case(16384, theta=50000, factor=4.0, beta_fast=16.0, beta_slow=2.0,
                              original_max_position_embeddings=2048),
    "attention-factor": _yarn_case(32768, factor=16.0, attention_factor=1.25),
    # transformers uses mscale only with mscale_all_dim (their ratio is the attention factor)
    "mscale-alone": _yarn_case(32768, factor=16.0, mscale=0.7),
    "mscale-ratio": _yarn_case(32768, factor=16.0, mscale=0.7, mscale_all_dim=1.3),
    "linear": dict(_yarn_case(8192), rope_scaling={"rope_type": "linear", "factor": 3.0}),
    # a top-level original_max_position_embeddings wins over the YaRN dict's (and over GPT-OSS's default YaRN)
    "top-level-original-length": dict(_yarn_case(32768, factor=8.0), original_max_position_embeddings=1024),
    "top-level-original-length-no-rope-dict": dict(_NO_ROPE, original_max_position_embeddings=2048),
}


@pytest.mark.parametrize("case", list(ROPE_CASES))
def test_rope_matches_transformers(case):
    """Our YaRN inverse frequencies and attention factor equal transformers' own (`ROPE_INIT_FUNCTIONS["yarn"]`),
    and the cos/sin tables equal what GptOssRotaryEmbedding computes, at positions up to past the original
    context length."""
    d = ROPE_CASES[case]
    hf_cfg = transformers.GptOssConfig(**json.loads(json.dumps(d)))
    ours_cfg = GptOssConfig.from_hf(d)
    kind = ours_cfg.rope.rope_type
    assert kind == ("linear" if case == "linear" else "yarn")
    assert kind == "linear" or ours_cfg.max_position_embeddings != ours_cfg.rope.original_max_position_embeddings
    ref_inv, ref_attn = ROPE_INIT_FUNCTIONS[kind](hf_cfg, "cpu")
    inv, attn = rope_inv_freq(ours_cfg)
    assert inv.dtype == ref_inv.dtype == torch.float32 and inv.shape == ref_inv.shape == (ours_cfg.head_dim // 2,)
    torch.testing.assert_close(inv, ref_inv, rtol=1e-6, atol=0)
    assert attn == pytest.approx(ref_attn, rel=1e-12)
    if case == "attention-factor":
        assert attn == 1.25
    elif case == "mscale-ratio":
        assert attn == pytest.approx((0.07 * math.log(16) + 1) / (0.13 * math.log(16) + 1))
    elif case == "linear":
        assert attn == 1.0
        torch.testing.assert_close(inv, 1.0 / (150000.0 ** (torch.arange(0, 64, 2) / 64)) / 3.0, rtol=1e-6, atol=0)
    else:
        assert attn == pytest.approx(0.1 * math.log(ours_cfg.rope.factor) + 1.0)

    positions = torch.tensor([0, 1, 7, 100, 4095, 4096, 20000, ours_cfg.max_position_embeddings - 1])
    rot = GptOssRotaryEmbedding(hf_cfg)
    ref_cos, ref_sin = rot(torch.zeros(1, dtype=torch.float32), positions[None])
    cos, sin = Rope(ours_cfg, torch.float32).cos_sin(positions)
    torch.testing.assert_close(cos, ref_cos[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sin, ref_sin[0], rtol=1e-5, atol=1e-5)
