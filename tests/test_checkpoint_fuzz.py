"""Broken checkpoint directories, generated: each is refused at load with a CheckpointError / ConfigError that
names the file or tensor (never a traceback from inside, a silent load, or weights other than the files'),
and each odd-but-valid one loads the same weights as the intact checkpoint.

The oracle for what is valid is what transformers reads: the safetensors library refuses every corrupt header
below (so transformers cannot load those files either), and transformers loads the accepted variants (a
float64 tensor, an index whose weight_map misplaces a tensor). Corrupt values (NaN / inf weights, the MXFP4
NaN scale byte) are loaded by transformers, whose logits then come out NaN for every prompt: refused here.
Runs over the tiny preset and an odd config (3 layers, 3 heads of 24 over 1 kv head, 5 experts, vocab 1031).
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from gigadecode.checkpoint import make_checkpoint, preset_config
from gigadecode.config import ConfigError, GptOssConfig
from gigadecode.generation_config import GenerationDefaults
from gigadecode.weights import CheckpointError, Shard, load_weights

ST = "model.safetensors"
INDEX = "model.safetensors.index.json"
NORM0 = "model.layers.0.input_layernorm.weight"
POST0 = "model.layers.0.post_attention_layernorm.weight"


def odd_config() -> GptOssConfig:
    return preset_config("tiny").with_(vocab_size=1031, hidden_size=96, intermediate_size=64, num_hidden_layers=3,
                                       num_attention_heads=3, num_key_value_heads=1, head_dim=24,
                                       num_local_experts=5, num_experts_per_tok=3, sliding_window=7, layer_types=())


@pytest.fixture(scope="module", params=["tiny", "odd"])
def base(request, tmp_path_factory) -> Path:
    """An intact single-file checkpoint (MXFP4 experts)."""
    d = tmp_path_factory.mktemp(f"fuzz_{request.param}") / "base"
    return make_checkpoint(d, cfg=None if request.param == "tiny" else odd_config(), seed=3)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    """The tiny preset in 4 shards with a model.safetensors.index.json."""
    return make_checkpoint(tmp_path_factory.mktemp("fuzz_sharded") / "base", "tiny", seed=3, shard_bytes=200_000)


def copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def read_raw(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8: 8 + n]), raw[8 + n:]


def write_raw(path: Path, header: dict | str, data: bytes) -> None:
    text = (header if isinstance(header, str) else json.dumps(header)).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def edit_tensors(d: Path, edit) -> None:
    t = load_file(d / ST)
    edit(t)
    save_file(t, str(d / ST), metadata={"format": "pt"})


def stacks(d: Path, shard: Shard = Shard()) -> dict[str, torch.Tensor]:
    return load_weights(d, dtype=torch.float32, shard=shard).tensors


# -- corrupt safetensors headers: what the safetensors library refuses -------------------------------------
def _overlap(h, data):                       # a tensor pointing into another's bytes
    h[POST0]["data_offsets"] = h[NORM0]["data_offsets"]
    return h, data


def _negative_offset(h, data):              # bytes before the data section (the header's own)
    s, e = h[NORM0]["data_offsets"]
    h[NORM0]["data_offsets"] = [s - e, 0]
    return h, data


def _shape(value):
    def edit(h, data):
        h[NORM0]["shape"] = value
        return h, data
    return edit


def _trailing_bytes(h, data):               # bytes no tensor claims
    return h, data + bytes(64)


def _metadata_list(h, data):
    h["__metadata__"] = ["format", "pt"]
    return h, data


def _infinity_shape(h, data):               # Python's json reads Infinity; JSON (and safetensors) does not
    text = json.dumps(h).replace(json.dumps(h[NORM0]["shape"]), "[Infinity]", 1)
    return text, data


def _entry_without_dtype(h, data):
    del h[NORM0]["dtype"]
    return h, data


CORRUPT_HEADERS = {
    "overlapping offsets": (_overlap, "overlaps the bytes of"),
    "negative offset": (_negative_offset, "data_offsets must be two byte offsets >= 0"),
    "string shape": (_shape(["64"]), "shape must be a list of sizes >= 0"),
    "float shape": (_shape([64.5]), "shape must be a list of sizes >= 0"),
    "negative shape": (_shape([-1, -64]), "shape must be a list of sizes >= 0"),
    "bool shape": (_shape([True]), "shape must be a list of sizes >= 0"),
    "Infinity in shape": (_infinity_shape, "Infinity is not a JSON value"),
    "unclaimed trailing bytes": (_trailing_bytes, "data bytes in the file"),
    "__metadata__ not an object": (_metadata_list, "__metadata__ must be an object of strings"),
    "entry without dtype": (_entry_without_dtype, "needs dtype, shape and data_offsets"),
}


@pytest.mark.parametrize("case", list(CORRUPT_HEADERS))
def test_corrupt_header_is_refused_naming_the_file(base, tmp_path, case):
    edit, match = CORRUPT_HEADERS[case]
    d = copy(base, tmp_path / "m")
    h, data = read_raw(d / ST)
    write_raw(d / ST, *edit(h, data))
    with pytest.raises(Exception):            # the oracle: the safetensors library refuses the file too
        with safe_open(str(d / ST), "pt") as f:
            f.get_tensor(NORM0)
    with pytest.raises(CheckpointError, match=match) as e:
        load_weights(d)
    assert ST in str(e.value)


def test_header_length_past_the_format_limit(base, tmp_path):
    """A header length field of 200 MiB in a (sparse) 300 MiB file: refused before reading it."""
    d = copy(base, tmp_path / "m")
    with open(d / ST, "r+b") as f:
        f.write(struct.pack("<Q", 200 * 2**20))
        f.truncate(300 * 2**20)
    with pytest.raises(CheckpointError, match=f"{ST}: corrupt safetensors header .*over the format's limit"):
        load_weights(d)


@pytest.mark.parametrize("kind", ["broken symlink", "directory"])
def test_unreadable_safetensors_entry_is_named(base, tmp_path, kind):
    """A *.safetensors that cannot be read (a broken symlink: a blob missing from the HF cache)."""
    d = copy(base, tmp_path / "m")
    extra = d / "model-extra.safetensors"
    if kind == "directory":
        extra.mkdir()
    else:
        extra.symlink_to(d / "missing-blob")
    with pytest.raises(CheckpointError, match="model-extra.safetensors: cannot read it"):
        load_weights(d)


# -- corrupt values -----------------------------------------------------------------------------------------
VALUE_CASES = {
    "NaN in q_proj": ("model.layers.0.self_attn.q_proj.weight", (0, 1), float("nan")),
    "inf in embed": ("model.embed_tokens.weight", (5, 0), float("inf")),
    "-inf in the last norm": ("model.norm.weight", (2,), float("-inf")),
    "NaN in a router bias": ("model.layers.1.mlp.router.bias", (1,), float("nan")),
    "NaN in an expert bias": ("model.layers.2.mlp.experts.down_proj_bias", (0, 3), float("nan")),
    "scale byte 255": ("model.layers.1.mlp.experts.down_proj_scales", (0, 0, 0), 255),
}


@pytest.mark.parametrize("case", list(VALUE_CASES))
def test_non_finite_weights_are_refused_naming_the_tensor(base, tmp_path, case):
    name, at, value = VALUE_CASES[case]
    d = copy(base, tmp_path / "m")

    def edit(t):
        t[name][at] = value
    edit_tensors(d, edit)
    with pytest.raises(CheckpointError, match=f"tensor '{name}' in {ST} holds 1 "):
        load_weights(d)


def test_a_sink_of_minus_inf_is_no_sink_as_in_transformers(tmp_path):
    """A sink of -inf (that head has no sink: e^-inf = 0) runs in transformers, so it loads here and gives
    transformers' tokens and logprobs, on the GK program and the per-layer model; NaN or +inf in a sink is
    still refused."""
    from gigadecode.engine import build_engine
    from gigadecode.engine_config import EngineConfig
    from gigadecode.sampling import SamplingParams
    from .helpers import hf_logits, load_hf
    d = make_checkpoint(tmp_path / "m", "tiny", seed=3)
    name = "model.layers.0.self_attn.sinks"

    def edit(t):
        t[name][0] = float("-inf")
        t["model.layers.1.self_attn.sinks"][:] = float("-inf")
    edit_tensors(d, edit)
    hf = load_hf(str(d), torch.float32)
    prompt = [5, 9, 13, 200, 7, 31]
    for decoder in ("gk-native", "reference"):
        eng = build_engine(str(d), EngineConfig(dtype="float32", kv_dtype="auto", decoder=decoder,
                                                gk_decode=decoder != "reference", num_blocks=32, threads=1))
        r = eng.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0))[0]
        ref = hf_logits(hf, prompt + r.output_ids).log_softmax(-1)[len(prompt) - 1:]
        assert r.output_ids == [int(ref[j].argmax()) for j in range(6)], decoder
        assert max(abs(lp.logprob - float(ref[j, t])) for j, (lp, t) in enumerate(zip(r.output_logprobs,
                                                                                     r.output_ids))) < 1e-4
    for bad in (float("nan"), float("inf")):
        edit_tensors(d, lambda t: t[name].__setitem__(1, bad))
        with pytest.raises(CheckpointError, match=f"tensor '{name}' in {ST} holds 1 NaN or infinite"):
            load_weights(d)


def test_non_finite_bf16_experts_are_refused(tmp_path):
    d = make_checkpoint(tmp_path / "m", "tiny", seed=3, experts="bf16")
    name = "model.layers.3.mlp.experts.gate_up_proj"

    def edit(t):
        t[name][4, 1, 2] = float("nan")
        t[name][0, 0, 0] = float("inf")
    edit_tensors(d, edit)
    with pytest.raises(CheckpointError, match=f"tensor '{name}' in {ST} holds 2 NaN or infinite"):
        load_weights(d)


def test_non_finite_weights_are_refused_on_the_rank_that_holds_them(sharded, tmp_path):
    """With tp=2 each rank checks the slice it reads: rank 0 holds q head 0's NaN, rank 1 does not; the
    other ranks' rows of the fused qkv slot (not yet read, uninitialised) are never taken for corrupt."""
    d = copy(sharded, tmp_path / "m")
    name = "model.layers.0.self_attn.q_proj.weight"
    f = d / json.loads((d / INDEX).read_text())["weight_map"][name]
    t = load_file(f)
    t[name][0, 0] = float("nan")               # row 0: q head 0, held by rank 0 of 2
    save_file(t, str(f), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=f"tensor '{name}' in {f.name} holds 1 NaN"):
        load_weights(d, shard=Shard(tp_rank=0, tp_size=2))
    load_weights(d, shard=Shard(tp_rank=1, tp_size=2))
    for rank in range(2):
        load_weights(sharded, shard=Shard(tp_rank=rank, tp_size=2))


# -- the index, and odd-but-valid directories transformers loads ------------------------------------------
def test_index_naming_no_shards(sharded, tmp_path):
    d = copy(sharded, tmp_path / "m")
    (d / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": {}}))
    with pytest.raises(CheckpointError, match=f"{INDEX}: its weight_map names no shard files"):
        load_weights(d)


def test_misplaced_and_unknown_index_entries_load_the_files_weights(sharded, tmp_path):
    """transformers loads a checkpoint whose weight_map puts a tensor in the wrong shard or names a tensor no
    shard holds (it reads the shards' headers); so does the loader, with the same weights."""
    d = copy(sharded, tmp_path / "m")
    index = json.loads((d / INDEX).read_text())
    first = sorted(set(index["weight_map"].values()))[0]
    index["weight_map"]["model.norm.weight"] = first
    index["weight_map"]["model.layers.0.not_a_tensor"] = first
    (d / INDEX).write_text(json.dumps(index))
    got, want = stacks(d), stacks(sharded)
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_float64_tensors_load_as_transformers_loads_them(base, tmp_path):
    """transformers casts an F64 tensor to the model's dtype; the loader does too (bf16 values: exact)."""
    d = copy(base, tmp_path / "m")

    def edit(t):
        for name in ("model.norm.weight", "model.layers.0.self_attn.q_proj.weight", "model.embed_tokens.weight"):
            t[name] = t[name].double()
    edit_tensors(d, edit)
    got, want = stacks(d), stacks(base)
    for k in want:
        assert torch.equal(got[k], want[k]), k


# -- config.json / generation_config.json / the model path -----------------------------------------------
@pytest.mark.parametrize("kind", ["directory", "binary"])
@pytest.mark.parametrize("name", ["config.json", "generation_config.json"])
def test_unreadable_config_files_are_named(base, tmp_path, kind, name):
    """config.json / generation_config.json as a directory, or not UTF-8: a ConfigError naming the file (it was
    an IsADirectoryError traceback, or a bare "'utf-8' codec can't decode")."""
    d = copy(base, tmp_path / "m")
    (d / name).unlink()
    if kind == "directory":
        (d / name).mkdir()
    else:
        (d / name).write_bytes(b"\xff\xfe{\x00")
    with pytest.raises(ConfigError, match=name):
        GptOssConfig.from_hf(d) if name == "config.json" else GenerationDefaults.from_dir(d)


def test_a_file_given_as_the_model_directory(base):
    with pytest.raises(CheckpointError, match="is a file: pass the checkpoint's directory"):
        load_weights(base / ST, GptOssConfig.from_hf(base))


CONFIG_DIMENSIONS = ["hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                     "num_local_experts", "vocab_size", "num_hidden_layers"]


@pytest.mark.parametrize("key", CONFIG_DIMENSIONS)
def test_config_dimension_disagreeing_with_the_tensors(base, tmp_path, key):
    """Each model dimension in config.json changed (kept valid: multiples of 32 for MXFP4, heads divisible):
    the tensors' headers contradict it, and the error names a tensor or the layer count."""
    d = copy(base, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    step = {"hidden_size": 32, "intermediate_size": 32, "num_attention_heads": cfg["num_key_value_heads"],
            "num_key_value_heads": 0, "head_dim": 2, "num_local_experts": 1, "vocab_size": 7,
            "num_hidden_layers": 1}[key]
    if key == "num_key_value_heads":          # another divisor of the head count, or the head count
        nh, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        cfg[key] = next(k for k in range(nh, 0, -1) if nh % k == 0 and k != kv)
    else:
        cfg[key] += step
    if key == "num_hidden_layers":
        cfg["layer_types"].append("full_attention")
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"config expects|num_hidden_layers"):
        load_weights(d)
