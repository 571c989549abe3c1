"""Writing GPT-OSS checkpoints in the exact Hugging Face layout (config.json + safetensors).

Real weights cannot be downloaded here, so we make our own from a *decisive* random init: weights
scaled so activations stay O(1), non-zero biases, sinks and norm weights, and an lm_head wide enough
that the top-1 logit clears the top-2 by far more than float error (else greedy comparisons with
transformers are meaningless). Experts are written as MXFP4 (`*_blocks` uint8 e2m1 pairs, `*_scales`
E8M0) or as dense bf16 (`gate_up_proj [E, H, 2I]`, `down_proj [E, I, H]`). The rest is bf16.
Large presets are written shard by shard, so the whole model is never held in RAM.
Same preset + seed -> the same bytes.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from .config import FULL, SLIDING, GptOssConfig, QuantConfig, RopeConfig
from .mxfp4 import BYTES_PER_GROUP, GROUP
from .tokenizer import write_tokenizer_files

PRESETS: dict[str, dict] = {
    # Seconds to load and run: tests.
    "tiny": dict(vocab_size=1024, hidden_size=64, intermediate_size=64, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=8,
                 num_experts_per_tok=4, sliding_window=16, max_position_embeddings=4096,
                 eos_token_ids=(2,), pad_token_id=0, bos_token_id=1),
    # ~1 GB: benchmarks.
    "small": dict(vocab_size=32000, hidden_size=1024, intermediate_size=1024, num_hidden_layers=12,
                  num_attention_heads=16, num_key_value_heads=4, head_dim=64, num_local_experts=32,
                  num_experts_per_tok=4, sliding_window=128, max_position_embeddings=32768,
                  eos_token_ids=(2,), pad_token_id=0, bos_token_id=1),
    # The real layouts (gpt-oss-20b / gpt-oss-120b).
    "20b-shape": dict(num_hidden_layers=24, num_local_experts=32),
    "120b-shape": dict(),
}
SHARD_BYTES = 2 * 1024**3

# Trained presets: checkpoints shipped with the package (written by a training script, copied as they are).
#   demo: a tiny GPT-OSS that answers `What is A + B?` (0..99) in harmony, with the working on the analysis
#         channel, or calls a function tool `add` when the request offers one (tools/train_demo_model.py).
ASSETS = Path(__file__).resolve().parent / "assets"
TRAINED = {"demo": ASSETS / "demo"}
DEMO_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
              "generation_config.json", "training_report.json")


def preset_config(name: str, experts: str = "mxfp4") -> GptOssConfig:
    if name in TRAINED:
        cfg = GptOssConfig.from_hf(_trained_dir(name))
        return cfg if experts == "mxfp4" else cfg.with_(quantization=None)
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r} (choose from {', '.join([*PRESETS, *TRAINED])})")
    kw = dict(PRESETS[name])
    n = kw.get("num_hidden_layers", 36)
    kw["layer_types"] = tuple(SLIDING if i % 2 == 0 else FULL for i in range(n))
    kw["rope"] = RopeConfig()
    kw["quantization"] = QuantConfig() if experts == "mxfp4" else None
    return GptOssConfig(**kw)


class _Init:
    """Deterministic generator of decisive random tensors."""

    def __init__(self, seed: int) -> None:
        self.g = torch.Generator().manual_seed(seed)

    def normal(self, shape: tuple[int, ...], std: float, mean: float = 0.0) -> torch.Tensor:
        return (torch.randn(shape, generator=self.g) * std + mean).to(torch.bfloat16)

    def mxfp4(self, rows_shape: tuple[int, ...], k: int, out_std: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Random e2m1 codes + E8M0 scales so that a row dotted with an RMS-1 vector has std ~out_std."""
        groups = k // GROUP
        blocks = torch.randint(0, 256, (*rows_shape, groups, BYTES_PER_GROUP), generator=self.g, dtype=torch.uint8)
        # E[e2m1^2] over uniform codes = 8.5625; choose 2^e with k * 8.5625 * 4^e = out_std^2.
        e = round(math.log2(out_std / math.sqrt(k * 8.5625)))
        jitter = torch.randint(-1, 1, (*rows_shape, groups), generator=self.g, dtype=torch.int32)
        scales = (127 + e + jitter).clamp(0, 254).to(torch.uint8)
        return blocks, scales


def layer_tensors(cfg: GptOssConfig, layer: int, init: _Init, experts: str) -> dict[str, torch.Tensor]:
    H, I, E, d = cfg.hidden_size, cfg.intermediate_size, cfg.num_local_experts, cfg.head_dim
    nh, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    p = f"model.layers.{layer}."
    t: dict[str, torch.Tensor] = {
        p + "input_layernorm.weight": init.normal((H,), 0.1, 1.0),
        p + "post_attention_layernorm.weight": init.normal((H,), 0.1, 1.0),
        p + "self_attn.q_proj.weight": init.normal((nh * d, H), 1.5 / math.sqrt(H)),
        p + "self_attn.q_proj.bias": init.normal((nh * d,), 0.1),
        p + "self_attn.k_proj.weight": init.normal((kv * d, H), 1.5 / math.sqrt(H)),
        p + "self_attn.k_proj.bias": init.normal((kv * d,), 0.1),
        p + "self_attn.v_proj.weight": init.normal((kv * d, H), 1.0 / math.sqrt(H)),
        p + "self_attn.v_proj.bias": init.normal((kv * d,), 0.1),
        p + "self_attn.o_proj.weight": init.normal((H, nh * d), 1.0 / math.sqrt(nh * d)),
        p + "self_attn.o_proj.bias": init.normal((H,), 0.1),
        p + "self_attn.sinks": init.normal((nh,), 1.0),
        p + "mlp.router.weight": init.normal((E, H), 2.0 / math.sqrt(H)),
        p + "mlp.router.bias": init.normal((E,), 0.5),
    }
    if not cfg.attention_bias:                       # drawn all the same: the other tensors keep their values
        for proj in ("q", "k", "v", "o"):
            del t[p + f"self_attn.{proj}_proj.bias"]
    x = p + "mlp.experts."
    if experts == "mxfp4":
        t[x + "gate_up_proj_blocks"], t[x + "gate_up_proj_scales"] = init.mxfp4((E, 2 * I), H, 2.0)
        t[x + "down_proj_blocks"], t[x + "down_proj_scales"] = init.mxfp4((E, H), I, 1.0)
    else:
        t[x + "gate_up_proj"] = init.normal((E, H, 2 * I), 2.0 / math.sqrt(H))
        t[x + "down_proj"] = init.normal((E, I, H), 1.0 / math.sqrt(I))
    t[x + "gate_up_proj_bias"] = init.normal((E, 2 * I), 0.2)
    t[x + "down_proj_bias"] = init.normal((E, H), 0.1)
    return t


def _trained_dir(name: str) -> Path:
    d = TRAINED[name]
    missing = [f for f in DEMO_FILES if not (d / f).is_file()]
    if missing:
        raise FileNotFoundError(f"the {name!r} preset's files are missing from {d}: {', '.join(missing)} "
                                f"(an install without the package data? tools/train_demo_model.py writes them)")
    return d


def copy_trained(out: str | Path, name: str = "demo", experts: str = "mxfp4") -> Path:
    """Copy a trained preset's files to `out`. experts="bf16" writes its MXFP4 experts as dense bf16
    instead (exact: every e2m1 value times a power of two is a bf16 number) and drops quantization_config."""
    import shutil

    from safetensors.torch import load_file

    from .mxfp4 import decode_mxfp4

    src = _trained_dir(name)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for old in list(out.glob("model*.safetensors")) + list(out.glob("model.safetensors.index.json")):
        old.unlink()
    for f in DEMO_FILES:
        shutil.copyfile(src / f, out / f)
    if experts == "bf16":
        tensors = load_file(str(src / "model.safetensors"))
        for name_ in [k for k in tensors if k.endswith("_blocks")]:
            base = name_.removesuffix("_blocks")
            w = decode_mxfp4(tensors.pop(name_), tensors.pop(base + "_scales"), torch.float32)
            tensors[base] = w.transpose(-1, -2).contiguous().to(torch.bfloat16)   # [E, in, out]
        save_file(dict(sorted(tensors.items())), str(out / "model.safetensors"), metadata={"format": "pt"})
        hf = json.loads((src / "config.json").read_text())
        hf.pop("quantization_config", None)
        (out / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    return out


def make_checkpoint(out: str | Path, preset: str = "tiny", seed: int = 0, experts: str = "mxfp4",
                    cfg: GptOssConfig | None = None, shard_bytes: int = SHARD_BYTES) -> Path:
    """Write config.json + safetensors for a preset (or an explicit config). Returns the directory.

    A trained preset ("demo") is copied from the package's files (`copy_trained`; `seed` does not apply)."""
    if experts not in ("mxfp4", "bf16"):
        raise ValueError(f"--experts must be mxfp4 or bf16 (got {experts!r})")
    if cfg is None and preset in TRAINED:
        return copy_trained(out, preset, experts)
    cfg = cfg or preset_config(preset, experts)
    if experts == "mxfp4" and (cfg.hidden_size % GROUP or cfg.intermediate_size % GROUP):
        raise ValueError(f"MXFP4 experts need hidden and intermediate sizes that are multiples of {GROUP}")
    if experts == "mxfp4" and cfg.quantization is None:
        cfg = cfg.with_(quantization=QuantConfig())
    if experts == "bf16" and cfg.quantization is not None:
        cfg = cfg.with_(quantization=None)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    init = _Init(seed)
    H, V = cfg.hidden_size, cfg.vocab_size

    shards: list[dict[str, torch.Tensor]] = []
    current: dict[str, torch.Tensor] = {}
    size = 0
    pending: list[Path] = []
    weight_map: dict[str, str] = {}

    def flush() -> None:
        nonlocal current, size
        if current:
            path = out / f"model-{len(pending) + 1:05d}.safetensors.tmp"
            save_file(current, str(path), metadata={"format": "pt"})
            pending.append(path)
            shards.append({k: None for k in current})  # names only
            current, size = {}, 0

    def add(tensors: dict[str, torch.Tensor]) -> None:
        nonlocal size
        for k, v in tensors.items():
            nbytes = v.numel() * v.element_size()
            if size and size + nbytes > shard_bytes:
                flush()
            current[k] = v.contiguous()
            size += nbytes

    add({"model.embed_tokens.weight": init.normal((V, H), 1.0)})
    for i in range(cfg.num_hidden_layers):
        add(layer_tensors(cfg, i, init, experts))
    add({"model.norm.weight": init.normal((H,), 0.1, 1.0)})
    if not cfg.tie_word_embeddings:
        add({"lm_head.weight": init.normal((V, H), 4.0 / math.sqrt(H))})
    flush()

    for old in list(out.glob("model*.safetensors")) + list(out.glob("model.safetensors.index.json")):
        old.unlink()
    n = len(pending)
    for idx, (tmp, names) in enumerate(zip(pending, shards)):
        final = out / ("model.safetensors" if n == 1 else f"model-{idx + 1:05d}-of-{n:05d}.safetensors")
        tmp.rename(final)
        for name in names:
            weight_map[name] = final.name
    if n > 1:
        (out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(cfg.to_hf(), indent=2) + "\n")
    if cfg.vocab_size >= 300:  # a byte-level vocabulary needs 256 ids plus the specials
        write_tokenizer_files(out, cfg)
    (out / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": list(cfg.eos_token_ids), "pad_token_id": cfg.pad_token_id, "do_sample": False},
        indent=2) + "\n")
    return out
