"""The checkpoint writer: deterministic bytes, presets, sharding (+ index json), HF layout, decisive logits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from gigadecode.checkpoint import PRESETS, make_checkpoint, preset_config
from gigadecode.config import FULL, SLIDING, GptOssConfig, RopeConfig
from gigadecode.mxfp4 import decode_mxfp4
from gigadecode.weights import LAYER_STACKS, load_weights
from helpers import (GPT_OSS_20B, build_reference, contiguous_tables, hf_logits, load_hf, prefill_logits,
                     random_prompt, rel_err)


def all_bytes(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def all_tensors(d: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.mark.parametrize("experts", ["mxfp4", "bf16"])
def test_same_seed_same_bytes(tmp_path, tiny_ckpt, tiny_ckpt_bf16, experts):
    ref = tiny_ckpt if experts == "mxfp4" else tiny_ckpt_bf16
    again = make_checkpoint(tmp_path / "again", "tiny", seed=0, experts=experts)
    a, b = all_bytes(ref), all_bytes(again)
    assert set(a) == {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}
    assert a == b


def test_different_seed_different_weights(tmp_path, tiny_ckpt):
    other = make_checkpoint(tmp_path / "seed1", "tiny", seed=1, experts="mxfp4")
    a, b = all_bytes(tiny_ckpt), all_bytes(other)
    assert a["config.json"] == b["config.json"]
    assert a["model.safetensors"] != b["model.safetensors"]
    ta, tb = all_tensors(tiny_ckpt), all_tensors(other)
    assert set(ta) == set(tb)
    differ = [k for k in ta if not torch.equal(ta[k], tb[k])]
    assert len(differ) == len(ta)             # every tensor is drawn from the seed


def test_hf_layout_names_shapes_dtypes(tiny_ckpt, tiny_ckpt_bf16):
    cfg = preset_config("tiny")
    E, H, I = cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size
    with safe_open(str(tiny_ckpt / "model.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}
        x = "model.layers.3.mlp.experts."
        assert f.get_slice(x + "gate_up_proj_blocks").get_shape() == [E, 2 * I, H // 32, 16]
        assert f.get_slice(x + "gate_up_proj_blocks").get_dtype() == "U8"
        assert f.get_slice(x + "gate_up_proj_scales").get_shape() == [E, 2 * I, H // 32]
        assert f.get_slice(x + "down_proj_blocks").get_shape() == [E, H, I // 32, 16]
        assert f.get_slice(x + "down_proj_bias").get_dtype() == "BF16"
        assert f.get_slice("model.layers.0.self_attn.sinks").get_shape() == [cfg.num_attention_heads]
        assert f.get_slice("model.embed_tokens.weight").get_dtype() == "BF16"
        # MXFP4 expert weights decode to finite values of a sane scale (no E8M0 extremes).
        w = decode_mxfp4(f.get_tensor(x + "gate_up_proj_blocks"), f.get_tensor(x + "gate_up_proj_scales"))
        assert torch.isfinite(w).all() and 0.01 < w.std() < 10
    with safe_open(str(tiny_ckpt_bf16 / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert "model.layers.0.mlp.experts.gate_up_proj" in names
        assert not any(n.endswith(("_blocks", "_scales")) for n in names)
        assert f.get_slice("model.layers.0.mlp.experts.gate_up_proj").get_shape() == [E, H, 2 * I]
        assert f.get_slice("model.layers.0.mlp.experts.down_proj").get_shape() == [E, I, H]
    hf_cfg = json.loads((tiny_ckpt / "config.json").read_text())
    assert hf_cfg["model_type"] == "gpt_oss" and hf_cfg["quantization_config"]["quant_method"] == "mxfp4"
    assert "quantization_config" not in json.loads((tiny_ckpt_bf16 / "config.json").read_text())
    gen = json.loads((tiny_ckpt / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [2] and gen["do_sample"] is False


@pytest.mark.parametrize("experts", ["mxfp4", "bf16"])
def test_tiny_preset_loads_with_matching_fields(tiny_ckpt, tiny_ckpt_bf16, experts):
    d = tiny_ckpt if experts == "mxfp4" else tiny_ckpt_bf16
    want = preset_config("tiny", experts)
    cfg = GptOssConfig.from_hf(d)
    assert cfg == want
    for k, v in PRESETS["tiny"].items():
        assert getattr(cfg, k) == v, k
    assert cfg.layer_types == (SLIDING, FULL, SLIDING, FULL)
    assert cfg.experts_mxfp4 == (experts == "mxfp4")
    w = load_weights(d)
    L, H, E, V = cfg.num_hidden_layers, cfg.hidden_size, cfg.num_local_experts, cfg.vocab_size
    assert w.layout == experts
    assert w.embed.shape == w.lm_head.shape == (V, H)
    assert w.tensors["router_w"].shape == (L, E, H) and w.tensors["sinks"].shape == (L, cfg.num_attention_heads)
    if experts == "mxfp4":
        assert w.tensors["gate_up_blocks"].shape == (L, E, 2 * cfg.intermediate_size, H // 32, 16)
    else:
        assert w.tensors["gate_up"].shape == (L, E, H, 2 * cfg.intermediate_size)
    # each layer's typed view: views of the stacks' layer i (same memory, no copy), one expert form only
    assert len(w.layers) == L
    for i, lw in enumerate(w.layers):
        for name in LAYER_STACKS:
            view = getattr(lw, name)
            if name in w.tensors:
                assert view.data_ptr() == w.tensors[name][i].data_ptr() and view.shape == w.tensors[name].shape[1:]
            else:
                assert view is None, name
        assert lw.mxfp4 == (experts == "mxfp4") and (lw.gate_up is None) == lw.mxfp4


def test_big_presets_configs():
    c20 = preset_config("20b-shape")
    ref = GptOssConfig.from_hf(GPT_OSS_20B)
    for f in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "num_local_experts", "num_experts_per_tok", "sliding_window",
              "layer_types", "max_position_embeddings", "rms_norm_eps", "swiglu_limit", "quantization"):
        assert getattr(c20, f) == getattr(ref, f), f
    assert c20.rope == ref.rope
    c120 = preset_config("120b-shape")
    assert (c120.num_hidden_layers, c120.num_local_experts, c120.hidden_size) == (36, 128, 2880)
    small = preset_config("small", "bf16")
    assert small.quantization is None and small.vocab_size == 32000 and small.num_hidden_layers == 12
    for name in PRESETS:
        c = preset_config(name)
        assert GptOssConfig.from_hf(c.to_hf()) == c, name
    with pytest.raises(ValueError, match="unknown preset"):
        preset_config("huge")


def test_written_config_keeps_every_model_field(tmp_path):
    """A checkpoint written for a config with non-default activation / norm / RoPE values is that model for us
    and for transformers (a field left out of config.json would load as its default: another model)."""
    from transformers import GptOssConfig as HFConfig

    c = preset_config("tiny", "bf16").with_(swiglu_alpha=1.25, swiglu_limit=3.5, rms_norm_eps=1e-3,
                                            tie_word_embeddings=True, attention_bias=False)
    assert GptOssConfig.from_hf(c.to_hf()) == c
    d = make_checkpoint(tmp_path / "ck", cfg=c, experts="bf16")
    assert GptOssConfig.from_hf(d) == c
    hf = HFConfig.from_pretrained(str(d))
    assert (hf.swiglu_alpha, hf.swiglu_limit, hf.rms_norm_eps) == (1.25, 3.5, 1e-3)


def test_writer_argument_errors(tmp_path):
    with pytest.raises(ValueError, match="mxfp4 or bf16"):
        make_checkpoint(tmp_path / "x", "tiny", experts="fp8")
    with pytest.raises(ValueError, match="multiples of 32"):         # the config itself refuses it now
        make_checkpoint(tmp_path / "y", cfg=preset_config("tiny").with_(hidden_size=48, num_attention_heads=4,
                                                                         head_dim=12), experts="mxfp4")


# ---------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sharded_ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("sharded") / "ck", "tiny", seed=0, experts="mxfp4",
                           shard_bytes=100_000)


def test_sharded_writer_index_and_files(sharded_ckpt, tiny_ckpt):
    shards = sorted(sharded_ckpt.glob("*.safetensors"))
    n = len(shards)
    assert n >= 3
    assert [p.name for p in shards] == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert not (sharded_ckpt / "model.safetensors").exists()
    assert not list(sharded_ckpt.glob("*.tmp"))
    index = json.loads((sharded_ckpt / "model.safetensors.index.json").read_text())
    wmap = index["weight_map"]
    single = all_tensors(tiny_ckpt)
    assert set(wmap) == set(single)
    for shard in shards:
        with safe_open(str(shard), "pt") as f:
            keys = set(f.keys())
        assert keys and keys == {k for k, v in wmap.items() if v == shard.name}
        assert shard.stat().st_size < 100_000 + 8_000 or len(keys) == 1    # only a lone big tensor overflows
    sharded = all_tensors(sharded_ckpt)
    for k, v in single.items():
        assert sharded[k].dtype == v.dtype and torch.equal(sharded[k], v), k
    assert (sharded_ckpt / "config.json").read_bytes() == (tiny_ckpt / "config.json").read_bytes()


def test_sharded_loads_identical_weights(sharded_ckpt, tiny_ckpt):
    a, b = load_weights(tiny_ckpt), load_weights(sharded_ckpt)
    assert set(a.tensors) == set(b.tensors)
    for k in a.tensors:
        assert torch.equal(a.tensors[k], b.tensors[k]), k


def test_a_missing_shard_is_named(sharded_ckpt, tmp_path):
    """An incomplete download: the shard the index lists but the directory lacks is named (it was reported as
    the first tensor it held); an index that is no index is named too."""
    import shutil

    from gigadecode.weights import CheckpointError
    d = Path(shutil.copytree(sharded_ckpt, tmp_path / "ck"))
    n = len(list(d.glob("*.safetensors")))
    (d / f"model-00002-of-{n:05d}.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"model.safetensors.index.json lists 1 shard file\(s\) missing from "
                                              r".*: model-00002-of-\d{5}.safetensors"):
        load_weights(d)
    (d / "model.safetensors.index.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="model.safetensors.index.json: not a safetensors index"):
        load_weights(d)


def test_transformers_loads_sharded(sharded_ckpt, hf_model):
    ids = random_prompt(40, 1024, seed=5)
    assert torch.equal(hf_logits(load_hf(str(sharded_ckpt)), ids), hf_logits(hf_model, ids))


@pytest.mark.parametrize("first,second", [(100_000, None), (None, 100_000)])
def test_rewrite_removes_stale_shards(tmp_path, first, second):
    d = tmp_path / "ck"
    kw = lambda sb: {} if sb is None else {"shard_bytes": sb}  # noqa: E731
    make_checkpoint(d, "tiny", seed=3, **kw(first))
    make_checkpoint(d, "tiny", seed=0, **kw(second))
    files = sorted(p.name for p in d.glob("model*"))
    if second is None:
        assert files == ["model.safetensors"]
    else:
        assert "model.safetensors" not in files and "model.safetensors.index.json" in files
    w = load_weights(d)                    # no duplicate tensors from the old layout
    assert w.embed.shape == (1024, 64)


def test_explicit_config_tied_embeddings(tmp_path):
    """make_checkpoint(cfg=...) with tied embeddings and plain RoPE: no lm_head written; loader ties it;
    transformers agrees on the logits."""
    cfg = preset_config("tiny").with_(num_hidden_layers=2, layer_types=(FULL, SLIDING), tie_word_embeddings=True,
                                      rope=RopeConfig(rope_type="default", theta=10000.0))
    d = make_checkpoint(tmp_path / "tied", cfg=cfg, seed=4)
    assert "lm_head.weight" not in all_tensors(d)
    back = GptOssConfig.from_hf(d)
    assert (back.rope.rope_type, back.rope.theta) == ("default", 10000.0)   # (yarn-only fields don't matter)
    assert back.with_(rope=cfg.rope) == cfg
    _, w, model, kv = build_reference(d)
    assert w.lm_head.data_ptr() == w.embed.data_ptr()
    ids = random_prompt(50, cfg.vocab_size, seed=6)
    ours = prefill_logits(model, kv, contiguous_tables(kv, 50), ids)
    assert rel_err(ours, hf_logits(load_hf(str(d)), ids)) <= 1e-3


# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("experts", ["mxfp4", "bf16"])
def test_decisive_logits(tiny_ckpt, tiny_ckpt_bf16, experts):
    """Top-1 clears top-2 by far more than float error, so greedy comparisons are meaningful."""
    d = tiny_ckpt if experts == "mxfp4" else tiny_ckpt_bf16
    cfg, _, model, kv = build_reference(d)
    ids = random_prompt(200, cfg.vocab_size, seed=42)
    logits = prefill_logits(model, kv, contiguous_tables(kv, 200), ids)
    top2 = logits.topk(2, -1).values
    gap = top2[:, 0] - top2[:, 1]
    assert gap.median() > 0.1
    # Not degenerate either: the argmax varies with the context.
    assert len(set(logits.argmax(-1).tolist())) > 50
