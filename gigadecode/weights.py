"""Checkpoint loading: the name map, validation, and the weights stacked once onto `[L, …]`.

One table (`checkpoint_tensors`) maps every Hugging Face GPT-OSS tensor name to the stack it fills.
`build_stacked_weight_specs` lists the stacks (name, shape, dtype); `load_weights` preallocates each
stack once and reads each checkpoint tensor straight into its slot (`safetensors_files.FileTensor`: plain
reads, no mapped file counted in the process's memory), so a per-layer copy of the model never exists. The per-layer model reads views `stack[i]`; the GK program reads the stacks.

Experts stay in the checkpoint's precision: MXFP4 experts are kept as `blocks` + `scales` (uint8) and
decoded per selected expert at run time; bf16 experts (community `gate_up_proj [E, H, 2I]` layout) are
kept dense in the compute dtype. q/k/v projections are fused into one `qkv` stack (rows q, then k, then v).

With a `Shard` (tp/ep > 1) each rank allocates and fills only its part, reading the matching slices of the
safetensors tensors (`_fill_shard`, `shard_ranges`): no rank ever holds the full model.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass, fields
from pathlib import Path

import torch
from safetensors import safe_open

from .config import ConfigError, GptOssConfig
from .safetensors_files import CheckpointError, FileTensor, TensorEntry, read_safetensors_index
from .mxfp4 import BYTES_PER_GROUP, GROUP

log = logging.getLogger(__name__)


# float weights as transformers loads them (cast to the compute dtype); F64 too, as it does
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


@dataclass(frozen=True)
class Shard:
    """Which slice of the model this rank holds (tensor/expert parallel). Default: everything."""

    tp_rank: int = 0
    tp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1
    dcp_size: int = 1            # decode context parallel: this many consecutive TP ranks share kv heads

    @property
    def kv_shards(self) -> int:
        """How many ways the kv heads are split (tp without DCP; tp / dcp with it)."""
        return self.tp_size // self.dcp_size

    @property
    def kv_rank(self) -> int:
        return self.tp_rank // self.dcp_size


@dataclass(frozen=True)
class StackSpec:
    """One preallocated weight tensor: `[L, …]` for per-layer stacks, plain for global ones."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class Source:
    """Where a checkpoint tensor goes: stack `name`, layer index (or None), rows [row0, row0+rows)."""

    stack: str
    layer: int | None
    shape: tuple[int, ...]       # expected checkpoint shape
    quantized: bool = False      # uint8 MXFP4 blocks/scales
    row0: int = 0                # offset into dim 0 of the destination slot (fused qkv)


def experts_layout(cfg: GptOssConfig, names: set[str]) -> str:
    """'mxfp4' or 'bf16', from the tensors actually present (config `quantization_config` must agree)."""
    has_blocks = "model.layers.0.mlp.experts.gate_up_proj_blocks" in names
    has_dense = "model.layers.0.mlp.experts.gate_up_proj" in names
    if has_blocks and not cfg.experts_mxfp4:
        raise CheckpointError("checkpoint has MXFP4 expert tensors (*_blocks) but config.json has no "
                              "quantization_config with quant_method 'mxfp4'")
    if has_dense and not has_blocks:
        return "bf16"
    return "mxfp4" if cfg.experts_mxfp4 else "bf16"


def build_stacked_weight_specs(cfg: GptOssConfig, dtype: torch.dtype, layout: str = "mxfp4",
                               shard: Shard = Shard()) -> list[StackSpec]:
    """Every weight tensor the model holds, with its (sharded) shape. Norms are kept in fp32."""
    L, H, I, E = cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size, cfg.num_local_experts
    d = cfg.head_dim
    nh, kv = local_heads(cfg, shard)
    e_local = E // shard.ep_size
    v_local = cdiv(cfg.vocab_size, shard.tp_size)
    specs = [
        StackSpec("embed", (cfg.vocab_size, H), dtype),
        StackSpec("norm", (H,), torch.float32),
        StackSpec("lm_head", (v_local, H), dtype),
        StackSpec("input_norm", (L, H), torch.float32),
        StackSpec("post_norm", (L, H), torch.float32),
        StackSpec("qkv_w", (L, (nh + 2 * kv) * d, H), dtype),
        StackSpec("qkv_b", (L, (nh + 2 * kv) * d), dtype),
        StackSpec("o_w", (L, H, nh * d), dtype),
        StackSpec("o_b", (L, H), dtype),
        StackSpec("sinks", (L, nh), dtype),
        StackSpec("router_w", (L, E, H), dtype),
        StackSpec("router_b", (L, E), dtype),
        StackSpec("gate_up_bias", (L, e_local, 2 * I), dtype),
        StackSpec("down_bias", (L, e_local, H), dtype),
    ]
    if layout == "mxfp4":
        specs += [
            StackSpec("gate_up_blocks", (L, e_local, 2 * I, H // GROUP, BYTES_PER_GROUP), torch.uint8),
            StackSpec("gate_up_scales", (L, e_local, 2 * I, H // GROUP), torch.uint8),
            StackSpec("down_blocks", (L, e_local, H, I // GROUP, BYTES_PER_GROUP), torch.uint8),
            StackSpec("down_scales", (L, e_local, H, I // GROUP), torch.uint8),
        ]
    else:
        specs += [
            StackSpec("gate_up", (L, e_local, H, 2 * I), dtype),
            StackSpec("down", (L, e_local, I, H), dtype),
        ]
    if cfg.tie_word_embeddings:
        specs = [s for s in specs if s.name != "lm_head"]
    return specs


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def local_heads(cfg: GptOssConfig, shard: Shard) -> tuple[int, int]:
    """(q heads, kv heads) held by one TP rank; kv heads are replicated when tp > kv heads. With DCP the kv
    heads are split over tp / dcp shards (the ranks of a DCP group hold the same kv heads, other tokens)."""
    nh, kv, tp = cfg.num_attention_heads, cfg.num_key_value_heads, shard.tp_size
    if nh % tp:
        raise ConfigError(f"tp={tp} does not divide num_attention_heads={nh}")
    if tp % shard.dcp_size:
        raise ConfigError(f"dcp={shard.dcp_size} does not divide tp={tp}")
    ks = shard.kv_shards
    if kv % ks and ks % kv:
        raise ConfigError(f"tp={tp} and num_key_value_heads={kv}: one must divide the other")
    return nh // tp, max(kv // ks, 1)


def checkpoint_tensors(cfg: GptOssConfig, layout: str) -> dict[str, Source]:
    """The name map: every checkpoint tensor -> where it lands. Shapes are the checkpoint's (unsharded)."""
    L, H, I, E = cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size, cfg.num_local_experts
    d, nh, kv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    out = {
        "model.embed_tokens.weight": Source("embed", None, (cfg.vocab_size, H)),
        "model.norm.weight": Source("norm", None, (H,)),
    }
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = Source("lm_head", None, (cfg.vocab_size, H))
    for i in range(L):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = Source("input_norm", i, (H,))
        out[p + "post_attention_layernorm.weight"] = Source("post_norm", i, (H,))
        for j, (proj, heads) in enumerate((("q_proj", nh), ("k_proj", kv), ("v_proj", kv))):
            row0 = (0, nh * d, (nh + kv) * d)[j]
            out[p + f"self_attn.{proj}.weight"] = Source("qkv_w", i, (heads * d, H), row0=row0)
            if cfg.attention_bias:
                out[p + f"self_attn.{proj}.bias"] = Source("qkv_b", i, (heads * d,), row0=row0)
        out[p + "self_attn.o_proj.weight"] = Source("o_w", i, (H, nh * d))
        if cfg.attention_bias:
            out[p + "self_attn.o_proj.bias"] = Source("o_b", i, (H,))
        out[p + "self_attn.sinks"] = Source("sinks", i, (nh,))
        out[p + "mlp.router.weight"] = Source("router_w", i, (E, H))
        out[p + "mlp.router.bias"] = Source("router_b", i, (E,))
        x = p + "mlp.experts."
        if layout == "mxfp4":
            out[x + "gate_up_proj_blocks"] = Source("gate_up_blocks", i, (E, 2 * I, H // GROUP, BYTES_PER_GROUP), True)
            out[x + "gate_up_proj_scales"] = Source("gate_up_scales", i, (E, 2 * I, H // GROUP), True)
            out[x + "down_proj_blocks"] = Source("down_blocks", i, (E, H, I // GROUP, BYTES_PER_GROUP), True)
            out[x + "down_proj_scales"] = Source("down_scales", i, (E, H, I // GROUP), True)
        else:
            out[x + "gate_up_proj"] = Source("gate_up", i, (E, H, 2 * I))
            out[x + "down_proj"] = Source("down", i, (E, I, H))
        out[x + "gate_up_proj_bias"] = Source("gate_up_bias", i, (E, 2 * I))
        out[x + "down_proj_bias"] = Source("down_bias", i, (E, H))
    return out


_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.")
_SHOW = 5          # unexplained tensor names listed in a message


def _name_key(name: str) -> tuple:
    """Sort key: layer numbers numerically (model.layers.2 before model.layers.10)."""
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in name.split("."))


def _held_layers(index: dict[str, TensorEntry]) -> set[int]:
    return {int(m.group(1)) for n in index if (m := _LAYER_RE.match(n))}


def _layers_text(layers: set[int]) -> str:
    n = len(layers)
    if not n:
        return "the checkpoint holds no model.layers.* tensors"
    return (f"the checkpoint holds {n} layer{'s' if n != 1 else ''} "
            f"(model.layers.{min(layers)} to model.layers.{max(layers)})")


def _unexplained_text(cfg: GptOssConfig, names: list[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:_SHOW])
    more = f" and {len(names) - _SHOW} more" if len(names) > _SHOW else ""
    hints = []
    if "lm_head.weight" in names and cfg.tie_word_embeddings:
        hints.append("config.json has tie_word_embeddings=true, so no lm_head.weight is expected")
    if not cfg.attention_bias and any(n.endswith("_proj.bias") and ".self_attn." in n for n in names):
        hints.append("config.json has attention_bias=false")
    hint = f" ({'; '.join(hints)})" if hints else ""
    return (f"{len(names)} tensor{'s' if len(names) != 1 else ''} the config does not explain: "
            f"{shown}{more}{hint}")


def validate_checkpoint(cfg: GptOssConfig, index: dict[str, TensorEntry], layout: str) -> dict[str, Source]:
    """Check the tensors against the config both ways (names, shapes and dtypes from the headers only):
    every tensor the config implies is present with the right shape and dtype, and every tensor present is
    one the config implies (no layers beyond num_hidden_layers, no unknown names). Returns the name map."""
    expected = checkpoint_tensors(cfg, layout)
    L = cfg.num_hidden_layers
    held = _held_layers(index)
    if held and max(held) >= L:
        raise CheckpointError(f"{_layers_text(held)} but config.json has num_hidden_layers={L}: the tensors of "
                              f"model.layers.{L} and above are not part of the model the config describes")
    unexplained = sorted((n for n in index if n not in expected), key=_name_key)
    for name, src in expected.items():
        entry = index.get(name)
        if entry is None:
            msg = f"missing tensor {name!r} (expected shape {list(src.shape)})"
            if src.layer is not None and src.layer not in held:
                msg += f": {_layers_text(held)} but config.json has num_hidden_layers={L}"
            elif unexplained:
                msg += f"; the checkpoint has {_unexplained_text(cfg, unexplained)}"
            raise CheckpointError(msg)
        if entry.shape != src.shape:
            raise CheckpointError(f"tensor {name!r} has shape {list(entry.shape)}, config expects {list(src.shape)}")
        if src.quantized and entry.dtype != torch.uint8:
            raise CheckpointError(f"tensor {name!r} has dtype {entry.dtype}, MXFP4 blocks/scales must be uint8")
        if not src.quantized and entry.dtype not in FLOAT_DTYPES:
            raise CheckpointError(f"tensor {name!r} has dtype {entry.dtype}, expected float32, float16, bfloat16 "
                                  f"or float64 (unsupported quantization?)")
    if unexplained:
        raise CheckpointError(f"the checkpoint has {_unexplained_text(cfg, unexplained)}")
    return expected


# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class LayerWeights:
    """One decoder layer's weights by role: views `stack[i]` of the stacked tensors (never a copy). Shapes
    are this rank's (TP: local heads; EP: local experts E). Experts are either MXFP4 (`gate_up_blocks`
    [E, 2I, H/32, 16] + `gate_up_scales` [E, 2I, H/32], `down_blocks` [E, H, I/32, 16] + `down_scales`) or
    dense in the compute dtype (`gate_up` [E, H, 2I], `down` [E, I, H]); the other pair is None."""

    input_norm: torch.Tensor        # [H] fp32
    qkv_w: torch.Tensor             # [(nh + 2 kv) d, H]: q rows, then k, then v
    qkv_b: torch.Tensor             # [(nh + 2 kv) d]
    o_w: torch.Tensor               # [H, nh d]
    o_b: torch.Tensor               # [H]
    sinks: torch.Tensor             # [nh]
    post_norm: torch.Tensor         # [H] fp32
    router_w: torch.Tensor          # [E_all, H] (the router sees every expert)
    router_b: torch.Tensor          # [E_all]
    gate_up_bias: torch.Tensor      # [E, 2I] (gate, up interleaved)
    down_bias: torch.Tensor         # [E, H]
    gate_up_blocks: torch.Tensor | None = None
    gate_up_scales: torch.Tensor | None = None
    down_blocks: torch.Tensor | None = None
    down_scales: torch.Tensor | None = None
    gate_up: torch.Tensor | None = None
    down: torch.Tensor | None = None

    @classmethod
    def of(cls, stacks: dict[str, torch.Tensor], i: int) -> LayerWeights:
        """Layer i's views of the stacks (the stacked form the GK program takes, by name)."""
        return cls(**{n: stacks[n][i] for n in LAYER_STACKS if n in stacks})

    @property
    def mxfp4(self) -> bool:
        return self.gate_up_blocks is not None


LAYER_STACKS = tuple(f.name for f in fields(LayerWeights))    # the stacks with a layer dimension


class ModelWeights:
    """All weights as named stacks `[L, …]` (`tensors`, see `build_stacked_weight_specs`), with each layer's
    typed views (`layers[i]`, made once) and the model-level tensors (`embed`, `norm`, `lm_head`)."""

    def __init__(self, cfg: GptOssConfig, layout: str, tensors: dict[str, torch.Tensor], shard: Shard) -> None:
        self.cfg, self.layout, self.shard = cfg, layout, shard
        self.tensors = tensors
        if cfg.tie_word_embeddings:
            tensors["lm_head"] = tensors["embed"]
            if shard.tp_size > 1:                     # this rank's vocabulary rows (a view, no copy)
                v0, v1 = shard_ranges(cfg, shard)["vocab"]
                tensors["lm_head"] = tensors["embed"][v0:v1]
        self.layers = [LayerWeights.of(tensors, i) for i in range(cfg.num_hidden_layers)]

    @property
    def embed(self) -> torch.Tensor:          # [V, H]
        return self.tensors["embed"]

    @property
    def norm(self) -> torch.Tensor:           # [H] fp32
        return self.tensors["norm"]

    @property
    def lm_head(self) -> torch.Tensor:        # [V_local, H] (this rank's vocabulary rows)
        return self.tensors["lm_head"]

    @property
    def mxfp4(self) -> bool:
        return self.layout == "mxfp4"

    def nbytes(self) -> int:
        seen, total = set(), 0
        for t in self.tensors.values():
            ptr = t.untyped_storage().data_ptr()         # a view (tied lm_head shard) is not counted again
            if ptr not in seen:
                seen.add(ptr)
                total += t.numel() * t.element_size()
        return total


def allocate_weights(cfg: GptOssConfig, dtype: torch.dtype, layout: str, shard: Shard = Shard(),
                     device: str | torch.device = "cpu") -> ModelWeights:
    no_source = set() if cfg.attention_bias else {"qkv_b", "o_b"}   # no checkpoint tensor fills these: zero
    tensors = {s.name: (torch.zeros if s.name in no_source else torch.empty)(s.shape, dtype=s.dtype, device=device)
               for s in build_stacked_weight_specs(cfg, dtype, layout, shard)}
    return ModelWeights(cfg, layout, tensors, shard)


def load_weights(model_dir: str | Path, cfg: GptOssConfig | None = None, dtype: torch.dtype = torch.float32,
                 shard: Shard = Shard(), progress: bool = False) -> ModelWeights:
    """Validate the checkpoint, then fill the preallocated stacks tensor by tensor from the files. The
    returned weights' `cfg` is the one they were loaded for (untied if the files hold an lm_head)."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise CheckpointError(f"model directory {model_dir} " + ("is a file: pass the checkpoint's directory"
                                                                 if model_dir.exists() else "does not exist"))
    cfg = cfg or GptOssConfig.from_hf(model_dir)
    index = read_safetensors_index(model_dir)
    if cfg.tie_word_embeddings and "lm_head.weight" in index:
        # as transformers does: an lm_head in the files is the model's own, whatever the config says
        log.warning("config.json has tie_word_embeddings=true but the checkpoint holds its own lm_head.weight: "
                    "using it (untied), as transformers does")
        cfg = cfg.with_(tie_word_embeddings=False)
    layout = experts_layout(cfg, set(index))
    name_map = validate_checkpoint(cfg, index, layout)
    weights = allocate_weights(cfg, dtype, layout, shard)
    by_file: dict[Path, list[str]] = {}
    for name in name_map:
        by_file.setdefault(index[name].file, []).append(name)
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=len(name_map), desc="loading weights", unit="tensor")
    sharded = shard.tp_size != 1 or shard.ep_size != 1
    for f, names in by_file.items():
        # one rank of several reads slices (safetensors slicing of the mapped file); else plain reads
        with (safe_open(str(f), framework="pt") if sharded else open(f, "rb", buffering=0)) as st:
            for name in names:
                src = name_map[name]
                dst = weights.tensors[src.stack]
                if src.layer is not None:
                    dst = dst[src.layer]
                filled = _fill(dst, st.get_slice(name) if sharded else FileTensor(st, index[name]), src,
                               weights.cfg, shard)
                _check_values(filled, name, f, src)
                if bar is not None:
                    bar.update()
    if bar is not None:
        bar.close()
    return weights


def _fill(dst: torch.Tensor, sl, src: Source, cfg: GptOssConfig, shard: Shard) -> torch.Tensor:
    """Copy one checkpoint tensor into its slot: the whole tensor (`FileTensor`) on one rank, this rank's
    shard of it (a lazy safetensors slice) on one of several. -> the slot it filled."""
    if shard.tp_size != 1 or shard.ep_size != 1:
        return _fill_shard(dst, sl, src, cfg, shard)
    if src.stack in ("qkv_w", "qkv_b"):
        dst = dst[src.row0: src.row0 + sl.entry.shape[0]]
    sl.read_into(dst)
    return dst


SCALE_STACKS = ("gate_up_scales", "down_scales")
NAN_E8M0 = 255                  # the MX formats' E8M0 scale byte for NaN (2^128 overflows every float)
_CHECK_CHUNK = 1 << 20          # elements tested at a time (a bool transient of 1 MiB, not one of the slot)


def _check_values(filled: torch.Tensor, name: str, file: Path, src: Source) -> None:
    """Refuse a tensor whose values no model holds: NaN or +-inf in a float weight, or an MXFP4 scale byte of
    255 (NaN). transformers loads them and its logits come out NaN for every prompt; here the load fails,
    naming the tensor, rather than every request. MXFP4 blocks are e2m1 codes: every byte is a number. One
    vectorized reduction over the slot (aminmax propagates NaN and +-inf; ~7 GB/s of bf16 here, where
    isfinite().all() ran at 0.08), counting the bad values only when there are some."""
    if (src.quantized and src.stack not in SCALE_STACKS) or filled.numel() == 0:
        return
    if src.quantized:
        if int(filled.amax()) != NAN_E8M0:
            return
    else:
        lo, hi = torch.aminmax(filled)
        # an attention sink of -inf is "no sink" (e^-inf = 0 in the softmax's denominator): transformers runs
        # it, and so does every path here; NaN and +inf are refused there as anywhere
        def ok(v: float) -> bool:
            return math.isfinite(v) or (src.stack == "sinks" and v == -math.inf)
        if ok(float(lo)) and ok(float(hi)):
            return
    flat = filled.reshape(-1)                                   # a view: the filled slots are contiguous
    parts = [flat[i: i + _CHECK_CHUNK] for i in range(0, flat.numel(), _CHECK_CHUNK)]
    if src.quantized:
        bad = sum(int((p == NAN_E8M0).sum()) for p in parts)
    elif src.stack == "sinks":
        bad = sum(int((p.isnan() | (p == math.inf)).sum()) for p in parts)
    else:
        bad = sum(p.numel() - int(torch.isfinite(p).sum()) for p in parts)
    what = (f"{bad} scale byte(s) of {NAN_E8M0}, which MXFP4 reads as NaN" if src.quantized
            else f"{bad} NaN or infinite value(s)")
    raise CheckpointError(f"tensor {name!r} in {file.name} holds {what}: a corrupt checkpoint")


EXPERT_STACKS = ("gate_up_blocks", "gate_up_scales", "down_blocks", "down_scales", "gate_up", "down",
                 "gate_up_bias", "down_bias")


def shard_ranges(cfg: GptOssConfig, shard: Shard) -> dict[str, tuple[int, int]]:
    """This rank's index ranges into the checkpoint's (unsharded) tensors:
    q heads, kv heads (rank r holds kv head r // (tp // kv) when tp > kv; with DCP, kv shard r // dcp of
    tp / dcp), vocabulary rows, experts."""
    nh_l, kv_l = local_heads(cfg, shard)
    r, tp = shard.tp_rank, shard.tp_size
    kv0 = shard.kv_rank * cfg.num_key_value_heads // shard.kv_shards
    v_size = cdiv(cfg.vocab_size, tp)
    v0 = min(r * v_size, cfg.vocab_size)
    e_l = cfg.num_local_experts // shard.ep_size
    return {"q_heads": (r * nh_l, (r + 1) * nh_l), "kv_heads": (kv0, kv0 + kv_l),
            "vocab": (v0, min(v0 + v_size, cfg.vocab_size)),
            "experts": (shard.ep_rank * e_l, (shard.ep_rank + 1) * e_l)}


def _fill_shard(dst: torch.Tensor, sl, src: Source, cfg: GptOssConfig, shard: Shard) -> torch.Tensor:
    """Sharded fill: read only this rank's slice of the checkpoint tensor (safetensors slices by range).

    q/k/v rows by head (fused as local q, then local k, then local v), sinks with the q heads, o-proj input
    columns by q head, lm_head rows by vocabulary (an uneven last shard is zero-padded), experts (weights
    and biases) by EP rank; embedding, norms, router and the o-proj bias are replicated (the bias is added
    once, after the TP all-reduce). -> the part of `dst` it filled."""
    rng = shard_ranges(cfg, shard)
    d = cfg.head_dim
    nh_l, kv_l = local_heads(cfg, shard)
    name = src.stack
    if name in ("qkv_w", "qkv_b"):
        if src.row0 == 0:                                        # q_proj
            (h0, h1), off = rng["q_heads"], 0
        else:                                                    # k_proj, v_proj
            (h0, h1) = rng["kv_heads"]
            off = nh_l * d if src.row0 == cfg.num_attention_heads * d else (nh_l + kv_l) * d
        t = sl[h0 * d: h1 * d]
        dst = dst[off: off + t.shape[0]]
        dst.copy_(t)
    elif name == "o_w":
        h0, h1 = rng["q_heads"]
        dst.copy_(sl[:, h0 * d: h1 * d])
    elif name == "sinks":
        dst.copy_(sl[slice(*rng["q_heads"])])
    elif name == "lm_head":
        v0, v1 = rng["vocab"]
        if v1 > v0:
            dst[: v1 - v0].copy_(sl[v0:v1])
        dst[v1 - v0:].zero_()
    elif name in EXPERT_STACKS:
        dst.copy_(sl[slice(*rng["experts"])])
    else:                                                        # replicated
        dst.copy_(sl[:])
    return dst
