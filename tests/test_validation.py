"""Configuration and checkpoint validation (issue 12): engine flags are range-checked with a one-line error
naming the flag; config.json values are type- and range-checked with the key named; the loader reports the
tensors the config does not explain (extra layers, unknown names) as well as the missing and misshapen ones.
Only headers are read; every test here runs in well under a second on the tiny checkpoint."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from gigadecode.checkpoint import PRESETS, preset_config
from gigadecode.config import FULL, SLIDING, ConfigError, GptOssConfig
from gigadecode.engine_config import EngineConfig
from gigadecode.weights import CheckpointError, load_weights
from helpers import GPT_OSS_20B

ST = "model.safetensors"

# gpt-oss-120b's config.json differs from the 20b one only in depth and expert count.
GPT_OSS_120B = dict(GPT_OSS_20B, num_hidden_layers=36, num_local_experts=128,
                    layer_types=["sliding_attention", "full_attention"] * 18)


def copy_ckpt(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_config(d: Path, **changes) -> None:
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))


def add_tensors(d: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Extra tensors in a second safetensors file next to the checkpoint's own."""
    save_file(tensors, str(d / "model-extra.safetensors"), metadata={"format": "pt"})


def tiny_dict(tiny_ckpt: Path) -> dict:
    return json.loads((tiny_ckpt / "config.json").read_text())


# ---------------------------------------------------------------------------------------------------------
# EngineConfig: every value range-checked, the flag named.
BUCKETS_MSG = "batch_buckets must be a non-empty, strictly increasing sequence of positive integers"


@pytest.mark.parametrize("changes,message", [
    (dict(max_num_seqs=0), "--max-num-seqs must be >= 1 (got 0)"),
    (dict(max_num_seqs=-3), "--max-num-seqs must be >= 1 (got -3)"),
    (dict(max_prefill_tokens=0), "--max-prefill-tokens must be >= 1 (got 0)"),
    (dict(dtype="float16"), "--dtype must be one of ['bfloat16', 'float32'] (got 'float16')"),
    (dict(max_model_len=1), "--max-model-len must be >= 2 (got 1: a prompt token and a generated one)"),
    (dict(max_model_len=64.0), "--max-model-len must be an integer >= 2 (got 64.0: a prompt token and a generated one)"),
    (dict(num_blocks=1), "--num-blocks must be >= 2 (got 1; block 0 is the reserved null block)"),
    (dict(num_blocks=0), "--num-blocks must be >= 2 (got 0; block 0 is the reserved null block)"),
    (dict(kv_budget_gib=0.0), "--kv-budget-gib must be > 0 and finite (got 0.0)"),
    (dict(kv_budget_gib=-1.0), "--kv-budget-gib must be > 0 and finite (got -1.0)"),
    (dict(kv_budget_gib=math.inf), "--kv-budget-gib must be > 0 and finite (got inf)"),
    (dict(kv_budget_gib=math.nan), "--kv-budget-gib must be > 0 and finite (got nan)"),
    (dict(tp=0), "--tp must be >= 1 (got 0)"),
    (dict(dp=0), "--dp must be >= 1 (got 0)"),
    (dict(ep=-1), "--ep must be >= 1 (got -1)"),
    (dict(tp=1.5), "--tp must be an integer >= 1 (got 1.5)"),
    (dict(dcp=0), "--dcp must be >= 1 (got 0)"),
    (dict(tp=4, dcp=3), "--dcp 3 must divide --tp 4 (a DCP group is dcp ranks of one TP group)"),
    (dict(tp=2, dcp=2, dcp_interleave=0), "--dcp-interleave must be >= 1 (got 0)"),
    (dict(kv_lease_s=0.0), "--kv-lease-s must be > 0 and finite (got 0.0)"),
    (dict(kv_lease_s=math.nan), "--kv-lease-s must be > 0 and finite (got nan)"),
    (dict(kv_transfer_timeout_s=-1.0), "--kv-transfer-timeout-s must be > 0 and finite (got -1.0)"),
    (dict(kv_transfer_timeout_s=math.inf), "--kv-transfer-timeout-s must be > 0 and finite (got inf)"),
    (dict(batch_buckets=()), "BB (got ())"),
    (dict(batch_buckets=(0, 1, 2)), "BB (got (0, 1, 2))"),
    (dict(batch_buckets=(1, 4, 2)), "BB (got (1, 4, 2))"),
    (dict(batch_buckets=(1, 2, 2, 4)), "BB (got (1, 2, 2, 4))"),
])
def test_engine_values_out_of_range_are_refused(changes, message):
    """Today these were accepted (and e.g. max_num_seqs=0 made generate spin forever)."""
    with pytest.raises(ConfigError) as e:
        EngineConfig(**changes)
    assert str(e.value) == message.replace("BB", BUCKETS_MSG)
    assert "\n" not in str(e.value)


def test_engine_edge_values_are_accepted():
    EngineConfig()
    EngineConfig(num_blocks=2, kv_budget_gib=1e-6, max_num_seqs=1, max_prefill_tokens=1, tp=1, dp=1, ep=1,
                 kv_lease_s=0.01, kv_transfer_timeout_s=0.01, batch_buckets=(3,))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("extra", [[], ["--num-blocks", "64"]])
def test_cli_generate_refuses_zero_max_num_seqs(tiny_ckpt, capsys, extra):
    """`generate --max-num-seqs 0` exits 2 at once with the flag named. It used to load the model and then
    fail on a KV pool sized from 0 sequences ("prompt ... can never fit the KV pool"), or, with --num-blocks,
    loop forever scheduling nothing."""
    from gigadecode.cli import main
    rc = main(["generate", "--model", str(tiny_ckpt), "--prompt-ids", "1,2", "--max-num-seqs", "0", *extra])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.strip() == "gigadecode generate: error: --max-num-seqs must be >= 1 (got 0)"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("flag,value", [("--max-prefill-tokens", "0"), ("--num-blocks", "1"), ("--max-model-len", "1"),
                                        ("--kv-budget-gib", "0"), ("--tp", "0"), ("--dcp", "0"),
                                        ("--dcp-interleave", "0")])
def test_cli_generate_refuses_bad_engine_flags(tiny_ckpt, capsys, flag, value):
    from gigadecode.cli import main
    rc = main(["generate", "--model", str(tiny_ckpt), "--prompt-ids", "1,2", flag, value])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith(f"gigadecode generate: error: {flag} must be"), err


# ---------------------------------------------------------------------------------------------------------
# GptOssConfig invariants.
MXFP4_MSG = r"MXFP4 experts need hidden_size and intermediate_size to be multiples of 32, the MXFP4 block size: "


@pytest.mark.parametrize("name", list(PRESETS))
@pytest.mark.parametrize("experts", ["mxfp4", "bf16"])
def test_every_preset_validates(name, experts):
    c = preset_config(name, experts)
    c.validate()
    assert GptOssConfig.from_hf(c.to_hf()) == c


def test_real_gpt_oss_configs_validate():
    c20 = GptOssConfig.from_hf(GPT_OSS_20B)
    assert (c20.num_hidden_layers, c20.num_local_experts, c20.eos_token_ids, c20.pad_token_id) == (
        24, 32, (200002,), 199999)
    c120 = GptOssConfig.from_hf(GPT_OSS_120B)
    assert (c120.num_hidden_layers, c120.num_local_experts) == (36, 128)
    GptOssConfig().validate()                                   # the defaults are the 120b


@pytest.mark.parametrize("changes,match", [
    (dict(hidden_size=48), MXFP4_MSG + r"hidden_size \(the input dim of gate_up_proj\) is 48"),
    (dict(intermediate_size=80), MXFP4_MSG + r"intermediate_size \(the input dim of down_proj\) is 80"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 0.0}),
     r"rope factor must be > 0 and finite for YaRN \(got 0.0\)"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": -2.0}),
     r"rope factor must be > 0"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 0.0, "factor": 32.0}),
     r"rope_theta must be > 0 and finite \(got 0.0\)"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1.0, "factor": 32.0}),
     r"rope_theta must be > 1 for YaRN \(got 1.0\)"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": -10000.0}), r"rope_theta must be > 0"),
    (dict(rms_norm_eps=0.0), r"rms_norm_eps must be > 0 and finite \(got 0.0\)"),
    (dict(rms_norm_eps=-1e-5), r"rms_norm_eps must be > 0"),
    (dict(swiglu_limit=0.0), r"swiglu_limit must be > 0 \(got 0.0\)"),
    (dict(swiglu_limit=-7.0), r"swiglu_limit must be > 0"),
])
def test_bad_model_config_values(tiny_ckpt, changes, match):
    """Each of these was accepted before (a YaRN factor of 0 was even silently replaced by 32)."""
    d = tiny_dict(tiny_ckpt)
    d.update(changes)
    with pytest.raises(ConfigError, match="invalid GPT-OSS config: " + match):
        GptOssConfig.from_hf(d)


@pytest.mark.parametrize("changes,kept,warned", [
    (dict(eos_token_id=1024), ((), 0, 1), "eos_token_id=1024"),
    (dict(eos_token_id=[2, 5000]), ((2,), 0, 1), "eos_token_id=5000"),
    (dict(eos_token_id=-1), ((), 0, 1), "eos_token_id=-1"),
    (dict(pad_token_id=1024), ((2,), None, 1), "pad_token_id=1024"),
    (dict(bos_token_id=99999), ((2,), 0, None), "bos_token_id=99999"),
])
def test_special_ids_outside_the_vocabulary_are_dropped(tiny_ckpt, caplog, changes, kept, warned):
    """A special id past the vocabulary (a config cut down from a real one: gpt-oss-20b's eos 200002 and pad
    199999 in a smaller vocabulary) can never be generated; transformers loads such a config, so do we, without
    it and with a warning naming it. (It was refused.)"""
    d = {**tiny_dict(tiny_ckpt), **changes}
    with caplog.at_level("WARNING", logger="gigadecode.config"):
        c = GptOssConfig.from_hf(d)
    assert (c.eos_token_ids, c.pad_token_id, c.bos_token_id) == kept
    assert f"{warned} outside the vocabulary [0, 1024) ignored" in caplog.text


def test_a_real_config_with_a_smaller_vocabulary_loads():
    import transformers
    d = {**json.loads(json.dumps(GPT_OSS_20B)), "vocab_size": 1000}
    transformers.GptOssConfig(**json.loads(json.dumps(d)))          # (it edits the dicts it is given)
    c = GptOssConfig.from_hf(d)
    assert (c.vocab_size, c.eos_token_ids, c.pad_token_id) == (1000, (), None)


def test_mxfp4_multiple_of_32_applies_only_to_mxfp4_experts(tiny_ckpt):
    """hidden/intermediate sizes that are not multiples of 32 are fine with dense bf16 experts."""
    d = tiny_dict(tiny_ckpt)
    d.update(hidden_size=48, intermediate_size=40)
    del d["quantization_config"]
    c = GptOssConfig.from_hf(d)
    assert (c.hidden_size, c.intermediate_size, c.experts_mxfp4) == (48, 40, False)
    with pytest.raises(ConfigError, match="intermediate_size"):
        preset_config("tiny").with_(intermediate_size=40)      # the MXFP4 preset


def test_pad_and_bos_may_be_absent(tiny_ckpt):
    d = tiny_dict(tiny_ckpt)
    d.update(pad_token_id=None)
    d.pop("bos_token_id", None)
    c = GptOssConfig.from_hf(d)
    assert c.pad_token_id is None and c.bos_token_id is None


@pytest.mark.parametrize("changes,key", [
    (dict(num_hidden_layers="x"), "num_hidden_layers"),
    (dict(num_hidden_layers=[4]), "num_hidden_layers"),
    (dict(num_hidden_layers=4.5), "num_hidden_layers"),
    (dict(hidden_size="64"), "hidden_size"),
    (dict(num_attention_heads={"n": 4}), "num_attention_heads"),
    (dict(num_local_experts=True), "num_local_experts"),
    (dict(rms_norm_eps="1e-5"), "rms_norm_eps"),
    (dict(swiglu_limit=[7.0]), "swiglu_limit"),
    (dict(attention_bias="yes"), "attention_bias"),
    (dict(tie_word_embeddings=1), "tie_word_embeddings"),
    (dict(eos_token_id="2"), "eos_token_id"),
    (dict(eos_token_id=[2, "x"]), "eos_token_id"),
    (dict(pad_token_id=[0]), "pad_token_id"),
    (dict(bos_token_id="1"), "bos_token_id"),
    (dict(layer_types="sliding_attention"), "layer_types"),
    (dict(layer_types=[1, 2, 3, 4]), "layer_types"),
    (dict(rope_parameters="yarn"), "rope_parameters"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": "big", "factor": 32.0}),
     "rope_parameters.rope_theta"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": [32]}), "rope_parameters.factor"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 32.0, "truncate": "no"}),
     "rope_parameters.truncate"),
    (dict(rope_parameters={"rope_type": 3, "rope_theta": 1e4}), "rope_parameters.rope_type"),
    (dict(quantization_config="mxfp4"), "quantization_config"),
    (dict(quantization_config={"quant_method": "mxfp4", "modules_to_not_convert": "lm_head"}),
     "quantization_config.modules_to_not_convert"),
    (dict(torch_dtype=16), "torch_dtype"),
])
def test_config_json_type_errors_name_the_key(tiny_ckpt, changes, key):
    """A wrong JSON type is a ConfigError naming the key (it was a TypeError/ValueError, or accepted)."""
    d = tiny_dict(tiny_ckpt)
    for k, v in changes.items():
        if v is None:
            d.pop(k, None)
        else:
            d[k] = v
    with pytest.raises(ConfigError, match=rf"config.json '{key}' must be"):
        GptOssConfig.from_hf(d)


def test_config_json_old_rope_and_derived_keys_type_errors():
    d = json.loads(json.dumps(GPT_OSS_20B))
    d["rope_theta"] = "150000"
    with pytest.raises(ConfigError, match="config.json 'rope_theta' must be a number"):
        GptOssConfig.from_hf(d)
    d = json.loads(json.dumps(GPT_OSS_20B))
    del d["num_local_experts"]
    d["num_experts"] = "32"
    with pytest.raises(ConfigError, match="config.json 'num_experts' must be an integer"):
        GptOssConfig.from_hf(d)
    d = json.loads(json.dumps(GPT_OSS_20B))
    d["max_position_embeddings"] = "128k"          # YaRN's original length when the rope dict has none
    del d["rope_scaling"]["original_max_position_embeddings"]
    with pytest.raises(ConfigError, match="config.json 'max_position_embeddings' must be an integer"):
        GptOssConfig.from_hf(d)


def test_config_json_integral_floats_are_accepted():
    c = GptOssConfig.from_hf(dict(GPT_OSS_20B, hidden_size=2880.0, num_hidden_layers=24.0))
    assert c == GptOssConfig.from_hf(GPT_OSS_20B) and isinstance(c.hidden_size, int)


def test_config_json_not_an_object(tiny_ckpt, tmp_path):
    d = copy_ckpt(tiny_ckpt, tmp_path / "ck")
    (d / "config.json").write_text("[1, 2, 3]")
    with pytest.raises(ConfigError, match="must hold a JSON object"):
        GptOssConfig.from_hf(d)
    with pytest.raises(ConfigError, match="must hold a JSON object"):
        load_weights(d)


# ---------------------------------------------------------------------------------------------------------
# The loader: tensors the config does not explain, and the ones it needs.
def test_config_with_fewer_layers_than_the_files(tiny_ckpt, tmp_path):
    """config.json says 2 layers, the files hold 4: it used to load the first 2 and drop the rest silently."""
    d = copy_ckpt(tiny_ckpt, tmp_path / "ck")
    edit_config(d, num_hidden_layers=2, layer_types=[SLIDING, FULL])
    with pytest.raises(CheckpointError, match=r"^the checkpoint holds 4 layers \(model.layers.0 to model.layers.3\) "
                                              r"but config.json has num_hidden_layers=2"):
        load_weights(d)


def test_config_with_more_layers_than_the_files(tiny_ckpt, tmp_path):
    d = copy_ckpt(tiny_ckpt, tmp_path / "ck")
    edit_config(d, num_hidden_layers=6, layer_types=[SLIDING, FULL] * 3)
    with pytest.raises(CheckpointError, match=r"missing tensor 'model.layers.4.input_layernorm.weight' .*: the "
                                              r"checkpoint holds 4 layers \(model.layers.0 to model.layers.3\) but "
                                              r"config.json has num_hidden_layers=6"):
        load_weights(d)


def test_extra_layer_tensor(tiny_ckpt, tmp_path):
    d = copy_ckpt(tiny_ckpt, tmp_path / "ck")
    add_tensors(d, {"model.layers.4.input_layernorm.weight": torch.ones(64, dtype=torch.bfloat16)})
    with pytest.raises(CheckpointError, match=r"holds 5 layers .* num_hidden_layers=4"):
        load_weights(d)


def test_unknown_tensor_names_are_listed(tiny_ckpt, tmp_path):
    d = copy_ckpt(tiny_ckpt, tmp_path / "ck")
    add_tensors(d, {"model.layers.1.self_attn.rotary_emb.inv_freq": torch.ones(8),
                    "model.extra_norm.weight": torch.ones(64)})
    with pytest.raises(CheckpointError, match=r"^the checkpoint has 2 tensors the config does not explain: "
                                              r"'model.extra_norm.weight', "
                                              r"'model.layers.1.self_attn.rotary_emb.inv_freq'$"):
        load_weights(d)


def test_many_unknown_tensors_are_listed_up_to_five(tiny_ckpt, tmp_path):
    d = copy_ckpt(tiny_ckpt, tmp_path / "ck")
    add_tensors(d, {f"model.layers.{i}.mlp.shared_expert.weight": torch.ones(4) for i in (0, 1, 2, 3)}
                | {"vision.a": torch.ones(1), "vision.b": torch.ones(1), "vision.c": torch.ones(1)})
    with pytest.raises(CheckpointError) as e:
        load_weights(d)
    msg = str(e.value)
    assert msg.startswith("the checkpoint has 7 tensors the config does not explain: "
                          "'model.layers.0.mlp.shared_expert.weight', 'model.layers.1.mlp.shared_expert.weight', ")
    assert msg.endswith(" and 2 more") and msg.count("'") == 10


def test_both_expert_layouts_in_one_checkpoint(tiny_ckpt, tmp_path):
    """MXFP4 experts plus stray dense experts: the dense ones are reported, not ignored."""
    d = copy_ckpt(tiny_ckpt, tmp_path / "ck")
    add_tensors(d, {"model.layers.0.mlp.experts.gate_up_proj": torch.zeros(8, 64, 128, dtype=torch.bfloat16)})
    with pytest.raises(CheckpointError, match=r"1 tensor the config does not explain: "
                                              r"'model.layers.0.mlp.experts.gate_up_proj'"):
        load_weights(d)


def test_tied_config_with_an_lm_head_in_the_files(tiny_ckpt, tmp_path, caplog):
    """tie_word_embeddings=true, but the files hold an lm_head.weight: transformers loads that lm_head (untied,
    with a warning), so we do too and give its tokens. (It was refused.)"""
    from gigadecode.engine import build_engine
    from gigadecode.sampling import SamplingParams
    from helpers import load_hf
    d = copy_ckpt(tiny_ckpt, tmp_path / "ck")
    edit_config(d, tie_word_embeddings=True)
    with caplog.at_level("WARNING", logger="gigadecode.weights"):
        w = load_weights(d)
    assert "using it (untied), as transformers does" in caplog.text
    assert not w.cfg.tie_word_embeddings and w.lm_head.data_ptr() != w.embed.data_ptr()
    assert torch.equal(w.lm_head, load_file(d / ST)["lm_head.weight"].float())
    eng = build_engine(str(d), EngineConfig(dtype="float32", num_blocks=64))
    prompt = [5, 9, 200, 17, 3]
    ours = eng.generate([prompt], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0].output_ids
    hf = load_hf(str(d))
    assert not torch.equal(hf.lm_head.weight, hf.model.embed_tokens.weight)
    theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, min_new_tokens=10)[0, 5:]
    assert ours == theirs.tolist()


def test_biases_present_but_attention_bias_false(tiny_ckpt, tmp_path):
    """attention_bias=false used to load and drop the q/k/v/o biases without a word."""
    d = copy_ckpt(tiny_ckpt, tmp_path / "ck")
    edit_config(d, attention_bias=False)
    with pytest.raises(CheckpointError, match=r"16 tensors the config does not explain: .*"
                                              r"\(config.json has attention_bias=false\)"):
        load_weights(d)


def test_renamed_tensor_names_both_sides(tiny_ckpt, tmp_path):
    """A renamed tensor: the missing name, and the unexplained one it probably is."""
    d = copy_ckpt(tiny_ckpt, tmp_path / "ck")
    t = load_file(d / ST)
    t["model.layers.2.mlp.gate.weight"] = t.pop("model.layers.2.mlp.router.weight")
    save_file(t, str(d / ST), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"^missing tensor 'model.layers.2.mlp.router.weight' \(expected shape "
                                              r"\[8, 64\]\); the checkpoint has 1 tensor the config does not explain: "
                                              r"'model.layers.2.mlp.gate.weight'$"):
        load_weights(d)


def test_missing_and_misshapen_tensors_still_named(tiny_ckpt, tmp_path):
    d = copy_ckpt(tiny_ckpt, tmp_path / "ck")
    t = load_file(d / ST)
    del t["model.layers.3.self_attn.sinks"]
    save_file(t, str(d / ST), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"^missing tensor 'model.layers.3.self_attn.sinks' \(expected shape "
                                              r"\[4\]\)$"):
        load_weights(d)
    t["model.layers.3.self_attn.sinks"] = torch.zeros(5, dtype=torch.bfloat16)
    save_file(t, str(d / ST), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"^tensor 'model.layers.3.self_attn.sinks' has shape \[5\], "
                                              r"config expects \[4\]$"):
        load_weights(d)


def test_both_layouts_still_load(tiny_ckpt, tiny_ckpt_bf16):
    assert load_weights(tiny_ckpt).mxfp4
    w = load_weights(tiny_ckpt_bf16)
    assert not w.mxfp4 and w.tensors["gate_up"].shape == (4, 8, 64, 128)


@pytest.mark.parametrize("name, content", [("tokenizer.json", "garbage"), ("tokenizer.json", "{}"),
                                           ("tokenizer_config.json", "{not json"), ("tokenizer_config.json", "[1]")])
def test_a_broken_tokenizer_file_is_named_not_a_traceback(tiny_ckpt, tmp_path, capsys, name, content):
    from gigadecode.cli import main
    d = copy_ckpt(tiny_ckpt, tmp_path / "ck")
    (d / name).write_text(content)
    assert main(["generate", "--model", str(d), "--prompt", "hi", "--threads", "1"]) == 2
    err = capsys.readouterr().err
    assert str(d / name) in err and "Traceback" not in err, err


@pytest.mark.parametrize("defaults, key", [({"temperature": "hot"}, "temperature"), ({"temperature": -1}, "temperature"),
                                          ({"top_k": 2.5}, "top_k"), ({"max_new_tokens": 0}, "max_tokens")])
def test_bad_sampling_defaults_in_generation_config_stop_the_start(tiny_ckpt, tmp_path, defaults, key):
    """A generation_config.json default the engine cannot use is a startup error naming the file, not a 400
    blaming every request that leaves the field unset."""
    from gigadecode.generation_config import GenerationDefaults
    d = copy_ckpt(tiny_ckpt, tmp_path / "ck")
    (d / "generation_config.json").write_text(json.dumps(defaults))
    with pytest.raises(ConfigError, match=rf"generation_config.json: invalid sampling parameter {key}"):
        GenerationDefaults.from_dir(d)


@pytest.mark.timeout(60)
def test_cli_generate_max_model_len(tiny_ckpt, capsys):
    """`--max-model-len` caps what a request may ask for; past the model's positions it fails before loading."""
    from gigadecode.cli import main
    rc = main(["generate", "--model", str(tiny_ckpt), "--prompt-ids", "1,2,3", "--max-model-len", "64",
               "--max-tokens", "62", "--threads", "1"])
    err = capsys.readouterr().err
    assert rc == 2 and "maximum context length is 64 tokens. However, you requested 65 tokens" in err, err
    most = tiny_dict(tiny_ckpt)["max_position_embeddings"]
    rc = main(["generate", "--model", str(tiny_ckpt), "--prompt-ids", "1,2,3", "--max-model-len", str(most + 1)])
    err = capsys.readouterr().err
    assert rc == 2 and err.strip() == (f"gigadecode generate: error: --max-model-len {most + 1} is longer than the "
                                       f"model's context: config.json has max_position_embeddings={most}"), err
    assert main(["generate", "--model", str(tiny_ckpt), "--prompt-ids", "1,2,3", "--max-model-len", "64",
                 "--max-tokens", "61", "--threads", "1"]) == 0


@pytest.mark.timeout(120)
def test_float16_checkpoint_runs_in_float32_under_dtype_auto(tiny_ckpt, tmp_path, capsys):
    """A float16 checkpoint (transformers' `save_pretrained` after `.half()`) under `--dtype auto` computes in
    float32, which holds its weights exactly, and gives the tokens of the same weights in float32. It used to
    compute in float16, which the kernels do not take, and fail every request."""
    from gigadecode.cli import main
    d = tmp_path / "fp16"
    shutil.copytree(tiny_ckpt, d)
    t = {k: v.half() if v.is_floating_point() else v for k, v in load_file(d / ST).items()}
    save_file(t, str(d / ST), metadata={"format": "pt"})
    cfg = json.loads((d / "config.json").read_text())
    cfg.pop("torch_dtype", None)
    (d / "config.json").write_text(json.dumps(dict(cfg, dtype="float16")))
    ref = tmp_path / "fp32"                                  # the same (fp16-rounded) weights stored as fp32
    shutil.copytree(d, ref)
    save_file({k: v.float() if v.is_floating_point() else v for k, v in t.items()}, str(ref / ST),
              metadata={"format": "pt"})
    (ref / "config.json").write_text(json.dumps(dict(cfg, dtype="float32")))
    outs = []
    for m in (d, ref):
        assert main(["generate", "--model", str(m), "--prompt-ids", "5,6,7,8", "--max-tokens", "12", "--json",
                     "--threads", "1", "--ignore-eos"]) == 0
        outs.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1])["token_ids"])
    assert outs[0] == outs[1] and len(outs[0]) == 12
