"""Shape-only (fake / meta tensor) implementations of the native ops, so a compiled or traced program
treats each op as one opaque node."""

from __future__ import annotations

import torch


def register_fakes() -> None:
    """Called once, right after the library loaded (its ops must exist)."""
    lib = "gigadecode_native::"

    @torch.library.register_fake(lib + "moe_mxfp4")
    def _(x, idx, gate_w, gub, gus, gubias, dnb, dns, dnbias, alpha, limit, offset):
        return torch.empty_like(x)

    @torch.library.register_fake(lib + "mxfp4_dequant")
    def _(blocks, scales, dtype):
        return blocks.new_empty((*scales.shape[:-1], scales.shape[-1] * 32), dtype=dtype)

    @torch.library.register_fake(lib + "mxfp4_dequant_into")
    def _(blocks, scales, out):
        return None

    @torch.library.register_fake(lib + "swiglu")
    def _(gate_up, alpha, limit):
        return gate_up.new_empty((gate_up.shape[0], gate_up.shape[1] // 2))

    @torch.library.register_fake(lib + "linear")
    def _(x, weight, bias):
        return x.new_empty((x.shape[0], weight.shape[0]))

    @torch.library.register_fake(lib + "paged_decode_attention")
    def _(q, k, v, table, pos, active, sinks, window, scale, ks, vs, out_dtype):
        return q.new_empty((q.shape[0], q.shape[1] * q.shape[2]), dtype=out_dtype)

    @torch.library.register_fake(lib + "paged_decode_attention_partial")
    def _(q, k, v, table, pos, first, active, scale, ks, vs):
        return (q.new_empty(q.shape, dtype=torch.float32),
                q.new_empty((q.shape[0], q.shape[1]), dtype=torch.float32))

    @torch.library.register_fake(lib + "rope_kv_write")
    def _(qkv, cos, sin, k, v, slot, nh, ks, vs):
        return qkv.new_empty((qkv.shape[0], nh, v.shape[-1]), dtype=torch.float32)

    @torch.library.register_fake(lib + "kv_gather")
    def _(k, v, block_ids, ks, vs, dtype):
        kv, d = v.shape[1], v.shape[3]
        shape = (block_ids.shape[0] * v.shape[2], kv, d)
        return v.new_empty(shape, dtype=dtype), v.new_empty(shape, dtype=dtype)

    @torch.library.register_fake(lib + "rms_norm")
    def _(x, weight, eps):
        return torch.empty_like(x)

    @torch.library.register_fake(lib + "prefill_attention")
    def _(q, k, v, q_pos, k_start, sinks, scale, window):
        return torch.empty_like(q)

    @torch.library.register_fake(lib + "gk_decode_layers")
    def _(x, stacks, k_bufs, v_bufs, layer_buffer, layer_sliding, layer_group, cos, sin, full_table, swa_table,
          full_slot, swa_slot, pos, pos_swa, active, num_heads, window, eps, scale, ks, vs, top_k, alpha, limit):
        return torch.empty_like(x)
