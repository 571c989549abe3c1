"""The GK decode model (the seed's `model_mxfp4_perf`): decode-only holder of the stacked weights and the
per-buffer KV, and the program that runs them.

- `get_kv_spec()` is honest per layer (sliding layers report their window).
- `bind_kv_cache({layer: [k, v]})` keeps the generic per-layer signature; packing is inferred from
  `k.dim() == v.dim() + 1`; layers sharing a buffer must pass the same tensors.
- `set_kv_cache_buffers(ks, vs)` stores each buffer as its own registered buffer `K_cache_buf_i` /
  `V_cache_buf_i` (never a list: a program built on meta/fake tensors walks tensor attributes only).
- `use_stacked_kv_cache(K_cache, V_cache)` selects the legacy stacked form instead.
- `decode(input_ids, ctl)` runs `gpt_oss_decode_mega_kernel` on the native kernels (`native=True`), eagerly
  in torch, or its compiled form
  (`torch.compile(fullgraph=True)`, one program per batch bucket and table width, Inductor's on-disk
  cache under `~/.cache/gigadecode/inductor` so a restart does not recompile).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from pathlib import Path

import torch

from ..config import GptOssConfig
from ..distributed.context import ParallelContext
from ..kv.spec import KVCacheConfig, KVSpec, get_kv_spec
from ..mxfp4 import _luts
from ..weights import ModelWeights
from .attn_control import AttentionControl
from .mega_decode import KernelSpec, LayerBlocks, LocalPairsMoE, attention_block, gpt_oss_decode_mega_kernel
from ..native.twins import paged_decode_attention_partial
from .native_blocks import NATIVE_BLOCKS


_programs_made = 0          # compiled programs made by every GK model of this process (see _recompile_room)

CACHE_DIR = Path(os.environ.get("GIGADECODE_CACHE", Path.home() / ".cache" / "gigadecode"))


def kernel_spec(cfg: GptOssConfig, weights: ModelWeights, kv_config: KVCacheConfig, block_size: int,
                k_scale: float = 1.0, v_scale: float = 1.0) -> KernelSpec:
    nh = weights.layers[0].sinks.shape[0]
    kvh = (weights.layers[0].qkv_w.shape[0] // cfg.head_dim - nh) // 2
    sliding_groups = [g for g, grp in enumerate(kv_config.groups) if hasattr(grp.spec, "sliding_window")]
    full_groups = [g for g, grp in enumerate(kv_config.groups) if not hasattr(grp.spec, "sliding_window")]
    kind_group = []
    for i in range(cfg.num_hidden_layers):
        g = kv_config.layer_group[i]
        kind_group.append(sliding_groups.index(g) if cfg.is_sliding(i) else full_groups.index(g))
    return KernelSpec(
        num_layers=cfg.num_hidden_layers, num_heads=nh, num_kv_heads=kvh, head_dim=cfg.head_dim,
        window=cfg.attention_window, eps=cfg.rms_norm_eps, top_k=cfg.num_experts_per_tok,
        alpha=cfg.swiglu_alpha, limit=cfg.swiglu_limit, block_size=block_size,
        layer_sliding=tuple(cfg.is_sliding(i) for i in range(cfg.num_hidden_layers)),
        layer_kind_group=tuple(kind_group), layer_buffer=tuple(kv_config.layer_buffer),
        k_scale=k_scale, v_scale=v_scale, mxfp4=weights.mxfp4,
    )


class GptOssGKDecodeModel(torch.nn.Module):
    """Decode-only GK model over stacked weights (shared with the per-layer model, never copied)."""

    def __init__(self, cfg: GptOssConfig, weights: ModelWeights, kv_config: KVCacheConfig, block_size: int,
                 k_scale: float = 1.0, v_scale: float = 1.0, compiled: bool = False,
                 parallel: ParallelContext | None = None, native: bool = False) -> None:
        super().__init__()
        self.parallel = parallel      # None: one rank
        self.cfg, self.weights, self.kv_config = cfg, weights, kv_config
        self.block_size = block_size
        self.spec = kernel_spec(cfg, weights, kv_config, block_size, k_scale, v_scale)
        self.group_size = kv_config.group_size
        self.compiled = compiled
        self.native = native          # the layer pieces on the native kernels (gigadecode.native)
        self._stacked = False
        self._kv_allocs: tuple[torch.Tensor, ...] | None = None
        self._local_moe: LocalPairsMoE | None = None   # parallel + compiled: made with its first program
        self._programs: dict[tuple, object] = {}
        _luts(weights.embed.dtype)   # fill the MXFP4 tables now: filling them while tracing forces a recompile

    # -- KV binding (seed names) -------------------------------------------------------------------
    def get_kv_spec(self) -> dict[int, KVSpec]:
        itemsize = self.K_cache_buf_0.element_size() if hasattr(self, "K_cache_buf_0") else 1
        return get_kv_spec(self.cfg, self.block_size, itemsize, self.spec.num_kv_heads)

    def bind_kv_cache(self, kv: dict[int, list[torch.Tensor]]) -> None:
        """Generic per-layer binding {layer: [k, v]} -> per-buffer attributes."""
        ks: list[torch.Tensor | None] = [None] * self.group_size
        vs: list[torch.Tensor | None] = [None] * self.group_size
        for layer, (k, v) in sorted(kv.items()):
            if k.dim() not in (v.dim(), v.dim() + 1):
                raise ValueError(f"layer {layer}: K rank {k.dim()} vs V rank {v.dim()}")
            j = self.kv_config.layer_buffer[layer]
            if ks[j] is None:
                ks[j], vs[j] = k, v
            elif ks[j].data_ptr() != k.data_ptr() or vs[j].data_ptr() != v.data_ptr():
                raise ValueError(f"layers sharing buffer {j} were bound to different tensors (layer {layer})")
        missing = [j for j in range(self.group_size) if ks[j] is None]
        if missing:
            raise ValueError(f"no KV bound for buffers {missing}")
        self.set_kv_cache_buffers(ks, vs)

    def set_kv_cache_buffers(self, k_bufs: list[torch.Tensor], v_bufs: list[torch.Tensor]) -> None:
        for i, (k, v) in enumerate(zip(k_bufs, v_bufs)):
            self.register_buffer(f"K_cache_buf_{i}", k, persistent=False)
            self.register_buffer(f"V_cache_buf_{i}", v, persistent=False)
        self._stacked = False
        self.spec = dataclasses.replace(self.spec, packed_k=k_bufs[0].dim() == v_bufs[0].dim() + 1)
        # K and V of a buffer are usually views of its one allocation [2, nb, kv, B, d]: the program then
        # takes the allocation (two aliasing inputs would make a compiled program copy the whole cache)
        allocs = [_allocation(k, v) for k, v in zip(k_bufs, v_bufs)]
        self._kv_allocs = tuple(allocs) if all(a is not None for a in allocs) else None
        self._programs.clear()

    def use_stacked_kv_cache(self, K_cache: torch.Tensor, V_cache: torch.Tensor) -> None:
        """Legacy form: one stacked K `[group_size, nb, …]` and one stacked V."""
        self.register_buffer("K_cache", K_cache, persistent=False)
        self.register_buffer("V_cache", V_cache, persistent=False)
        self._stacked = True

    def kv_buffers(self) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        return (tuple(getattr(self, f"K_cache_buf_{i}") for i in range(self.group_size)),
                tuple(getattr(self, f"V_cache_buf_{i}") for i in range(self.group_size)))

    # -- the program -------------------------------------------------------------------------------
    def program(self, ctl: AttentionControl):
        """The step's program. One rank, compiled: the whole kernel as one graph per (batch bucket, table
        width). Parallel, compiled: the kernel loop runs eagerly around its collectives; each layer's
        attention runs as a compiled graph (one per bucket and table width, shared by every layer: the
        weights come in as per-layer views) and its MoE as `LocalPairsMoE` (only this rank's pairs)."""
        if self.native:
            return functools.partial(gpt_oss_decode_mega_kernel, spec=self.spec, parallel=self.parallel,
                                     blocks=NATIVE_BLOCKS, layers=self.weights.layers)
        if not self.compiled:
            return functools.partial(gpt_oss_decode_mega_kernel, spec=self.spec, parallel=self.parallel)
        key = (ctl.active.shape[0], ctl.full_table.shape[-1], self._stacked)
        prog = self._programs.get(key)
        if prog is None:
            enable_inductor_disk_cache()
            spec = dataclasses.replace(self.spec, fused_moe=True)
            if self.parallel is None:
                prog = torch.compile(functools.partial(gpt_oss_decode_mega_kernel, spec=spec),
                                     fullgraph=True, dynamic=False)
            else:
                if self._local_moe is None:          # shared by every program (torch.compile costs seconds:
                    self._local_moe = LocalPairsMoE()   # never at the start of an engine that does not use it)
                blocks = LayerBlocks(attention=torch.compile(attention_block, fullgraph=True, dynamic=False),
                                     moe=self._local_moe,
                                     partial_attention=torch.compile(paged_decode_attention_partial,
                                                                     fullgraph=True, dynamic=False))
                prog = functools.partial(gpt_oss_decode_mega_kernel, spec=spec, parallel=self.parallel,
                                         blocks=blocks)
            self._programs[key] = prog
            global _programs_made
            _programs_made += 1
        return prog

    @torch.inference_mode()
    def decode(self, input_ids: torch.Tensor, ctl: AttentionControl) -> torch.Tensor:
        """input_ids [Bt] (padded to the bucket) -> logits [Bt, V] (with `parallel`: this rank's vocabulary
        columns [Bt, vocab_stop - vocab_start])."""
        prog = self.program(ctl)
        with self._recompile_room():
            if self._stacked:
                return prog(input_ids, self.weights.tensors, None, None, ctl, K_cache=self.K_cache,
                            V_cache=self.V_cache)
            if self._kv_allocs is not None:
                return prog(input_ids, self.weights.tensors, None, None, ctl, kv_bufs=self._kv_allocs)
            ks, vs = self.kv_buffers()
            return prog(input_ids, self.weights.tensors, ks, vs, ctl)

    def _recompile_room(self):
        """The compiled programs (one per batch bucket and table width, and per model) are all compiled versions
        of the same functions, which dynamo counts against one per-function limit (8 by default; with
        fullgraph=True, reaching it fails the step): room for every program made in this process, plus dynamo's
        own margin."""
        if not self.compiled:
            return contextlib.nullcontext()
        cfg = torch._dynamo.config
        need = _programs_made + 8
        return cfg.patch(recompile_limit=max(cfg.recompile_limit, need),
                         accumulated_recompile_limit=max(cfg.accumulated_recompile_limit, 4 * need))


def _allocation(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor | None:
    """The [2, nb, kv, B, d] tensor whose [0] holds K (maybe through the packed view) and [1] is V, or None."""
    base = v._base
    if base is None or k._base is not base or base.dim() != 5 or base.shape[0] != 2 or base.dtype != v.dtype \
            or base[1].shape != v.shape or base[1].data_ptr() != v.data_ptr() or base[0].data_ptr() != k.data_ptr() \
            or k.numel() != base[0].numel() or not base.is_contiguous():
        return None
    return base


def enable_inductor_disk_cache() -> None:
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(CACHE_DIR / "inductor"))
    os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "1")
