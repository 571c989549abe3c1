"""The GK program's layer pieces on the native kernels (`gigadecode.native`): `NATIVE_BLOCKS` plugs them
into `gpt_oss_decode_mega_kernel`, which stays the one layer loop of the program.

Per layer and step: rms_norm -> qkv linear -> RoPE + KV write (packed-FP8 in place) -> paged attention
over the block table in place -> o linear -> rms_norm -> router linear + top-k -> the MXFP4 MoE grouped by
expert. Weights are the stacks' per-layer views; nothing the size of a weight is allocated per step.
Checkpoints with dense (bf16) experts run the eager expert loop for the MoE. With MXFP4 experts the whole
loop runs as one native call (`native_all_layers`), which saves the host work between the ops.
"""

from __future__ import annotations

import dataclasses

import torch

from .. import native
from ..routed_moe import native_routed_moe
from ..weights import LayerWeights
from .attn_control import AttentionControl
from .mega_decode import KernelSpec, LayerBlocks, moe_decode, split_kv_buffer


def native_attention_block(x: torch.Tensor, Wl: LayerWeights,
                           kv: torch.Tensor | tuple[torch.Tensor, torch.Tensor], cos: torch.Tensor,
                           sin: torch.Tensor, table: torch.Tensor, slot: torch.Tensor, fpos: torch.Tensor,
                           active: torch.Tensor, *, window: int | None, spec: KernelSpec) -> torch.Tensor:
    """`mega_decode.attention_block` on the kernels: x [Bt, H] -> [Bt, nh*d] (before the o-proj)."""
    k_buf, v_buf = split_kv_buffer(kv, spec.packed_k) if isinstance(kv, torch.Tensor) else kv
    h = native.rms_norm(x, Wl.input_norm, spec.eps)
    qkv = native.linear(h, Wl.qkv_w, Wl.qkv_b)                         # [Bt, (nh + 2 kv) d]
    q = native.rope_kv_write(qkv, cos, sin, k_buf, v_buf, slot, spec.num_heads, spec.k_scale, spec.v_scale)
    return native.paged_decode_attention(q, k_buf, v_buf, table, fpos, active, Wl.sinks, window or 0,
                                         spec.scale, spec.k_scale, spec.v_scale, x.dtype)


def native_moe(h: torch.Tensor, Wl: LayerWeights, spec: KernelSpec, expert_offset: int = 0
               ) -> torch.Tensor:
    """`mega_decode.moe_decode` on the kernels: h [Bt, H] -> [Bt, H] (this rank's experts' share under EP)."""
    if not spec.mxfp4:
        return moe_decode(h, Wl, spec, expert_offset)
    return native_routed_moe(h, Wl, spec.top_k, spec.alpha, spec.limit, expert_offset, router_linear=native.linear)

def native_rope_write(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_buf: torch.Tensor,
                      v_buf: torch.Tensor, slot: torch.Tensor, spec: KernelSpec) -> torch.Tensor:
    """`mega_decode.rope_write_kv` on the kernel: -> q [Bt, nh, d] fp32."""
    return native.rope_kv_write(qkv, cos, sin, k_buf, v_buf, slot, spec.num_heads, spec.k_scale, spec.v_scale)


def native_all_layers(x: torch.Tensor, W: dict[str, torch.Tensor], k_bufs: tuple[torch.Tensor, ...],
                      v_bufs: tuple[torch.Tensor, ...], ctl: AttentionControl, spec: KernelSpec
                      ) -> torch.Tensor | None:
    """Every layer in one native call (`native.gk_decode_layers`: the loop below in C++, bit-equal), where
    it applies: the kernels built, MXFP4 experts, and every projection on the small-batch kernel at this
    batch. Else None: the per-op loop runs."""
    if not (spec.mxfp4 and native.available()):
        return None
    bt = x.shape[0]
    if bt > native.LINEAR_MAX_ROWS and any(bt > native.linear_max_rows(W[n], x.dtype)
                                           for n in ("qkv_w", "o_w", "router_w")):
        return None
    return native.gk_decode_layers(
        x, [W[n] for n in native.GK_STACKS], k_bufs, v_bufs, spec.layer_buffer, spec.layer_sliding,
        spec.layer_kind_group, ctl.cos, ctl.sin, ctl.full_table, ctl.swa_table, ctl.kv_cache_update_idx,
        ctl.kv_cache_update_idx_swa, ctl.pos, ctl.pos_swa, ctl.active, spec.num_heads, spec.window, spec.eps,
        spec.scale, spec.k_scale, spec.v_scale, spec.top_k, spec.alpha, spec.limit)


NATIVE_BLOCKS = LayerBlocks(attention=native_attention_block, moe=native_moe, linear=native.linear,
                            norm=native.rms_norm, rope_write=native_rope_write,
                            partial_attention=native.paged_decode_attention_partial,
                            all_layers=native_all_layers)
# the same pieces, one op at a time (the per-op loop: the oracle of `all_layers` in the tests)
NATIVE_BLOCKS_PER_OP = dataclasses.replace(NATIVE_BLOCKS, all_layers=None)
