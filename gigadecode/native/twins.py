"""Torch twins of the native kernels: the same signatures and semantics in plain PyTorch.

Each twin is the oracle the kernel is tested against and the fallback where no kernel could be built.
All compute in fp32 and return the dtype the kernel returns (shapes in the native docstrings of
`gigadecode.native`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kv.cache import dequantize, gather_kv, packed_to_token_major, write_kv
from ..mxfp4 import decode_mxfp4
from ..ops import moe_routed, rms_norm as _rms_norm, sink_attention, swiglu as _swiglu
from ..rope import apply_rope


def moe_mxfp4(x, idx, gate_w, gate_up_blocks, gate_up_scales, gate_up_bias, down_blocks, down_scales, down_bias,
              alpha: float, limit: float, expert_offset: int) -> torch.Tensor:
    """In fp32; with bf16 x the activations between the two expert matmuls are rounded to bf16 (what a bf16
    model holds there)."""
    def dense(le: int):
        return (decode_mxfp4(gate_up_blocks[le], gate_up_scales[le], torch.float32),
                decode_mxfp4(down_blocks[le], down_scales[le], torch.float32))
    act = torch.bfloat16 if x.dtype == torch.bfloat16 else None
    out = moe_routed(x.float(), idx, gate_w.float(), dense, gate_up_bias.float(), down_bias.float(), alpha, limit,
                     expert_offset, act_dtype=act)
    return out.to(x.dtype)


def mxfp4_dequant(blocks, scales, dtype: torch.dtype) -> torch.Tensor:
    return decode_mxfp4(blocks, scales, torch.float32).to(dtype)


def mxfp4_dequant_into(blocks, scales, out: torch.Tensor) -> None:
    if not out.is_contiguous() or out.shape != (*scales.shape[:-1], scales.shape[-1] * 32):
        raise RuntimeError(f"dequant out must be contiguous [..., R, G*32] for scales {tuple(scales.shape)}")
    out.copy_(mxfp4_dequant(blocks, scales, out.dtype))


def swiglu(gate_up, alpha: float, limit: float) -> torch.Tensor:
    return _swiglu(gate_up.float(), alpha, limit).to(gate_up.dtype)


def linear(x, weight, bias=None) -> torch.Tensor:
    return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)


def rms_norm(x, weight, eps: float) -> torch.Tensor:
    return _rms_norm(x.float(), weight.float(), eps).to(x.dtype)


def rope_kv_write(qkv, cos, sin, k_cache, v_cache, slot, num_heads: int, k_scale: float, v_scale: float
                  ) -> torch.Tensor:
    nb, kvh, B, d = v_cache.shape
    x = qkv.float()
    c, s = cos.float(), sin.float()
    q = apply_rope(x[:, : num_heads * d].reshape(-1, num_heads, d), c, s)
    k = apply_rope(x[:, num_heads * d: (num_heads + kvh) * d].reshape(-1, kvh, d), c, s)
    v = x[:, (num_heads + kvh) * d:].reshape(-1, kvh, d)
    write_kv(k_cache, v_cache, slot, k, v, B, k_scale, v_scale)
    return q.contiguous()


def kv_gather(k_cache, v_cache, block_ids, k_scale: float, v_scale: float, dtype: torch.dtype
              ) -> tuple[torch.Tensor, torch.Tensor]:
    return gather_kv(k_cache, v_cache, block_ids, dtype, k_scale, v_scale)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, active: torch.Tensor,
                     sinks: torch.Tensor, window: int | None, scale: float) -> torch.Tensor:
    """Dense decode attention with sinks: q [Bt, nh, d]; k, v [Bt, kv, S, d] (frame position = column);
    pos [Bt] frame position of the query -> [Bt, nh*d]. Sliding (`window`): keys pos-W < k <= pos."""
    bt, nh, d = q.shape
    kvh, S = k.shape[1], k.shape[2]
    rep = nh // kvh
    kf = torch.arange(S, device=q.device)
    mask = (kf[None, :] <= pos[:, None]) & active[:, None]                  # [Bt, S]
    if window is not None:
        mask = mask & (kf[None, :] > pos[:, None] - window)
    # GQA without repeating K/V: query heads [Bt, kv, rep, T=1, d] against keys [Bt, kv, 1, S, d]
    out = sink_attention(q.view(bt, kvh, rep, 1, d), k.unsqueeze(2), v.unsqueeze(2), mask[:, None, None, :],
                         sinks.view(kvh, rep), scale)                       # [Bt, kv, rep, 1, d]
    return out.reshape(bt, nh * d)


def paged_decode_attention(q, k_cache, v_cache, table, pos, active, sinks, window: int, scale: float,
                           k_scale: float, v_scale: float, out_dtype: torch.dtype) -> torch.Tensor:
    bt, n = table.shape
    nb, kvh, B, d = v_cache.shape
    kb, vb = k_cache[table], v_cache[table]               # [Bt, n, kv, B(/2), d(, 2)]
    if kb.dim() == vb.dim() + 1:
        kb = packed_to_token_major(kb)                    # [Bt, n, kv, B, d]
    k = dequantize(kb, torch.float32, k_scale).permute(0, 2, 1, 3, 4).reshape(bt, kvh, n * B, d)
    v = dequantize(vb, torch.float32, v_scale).permute(0, 2, 1, 3, 4).reshape(bt, kvh, n * B, d)
    out = decode_attention(q.float(), k, v, pos, active, sinks.float(), window or None, scale)
    return out.to(out_dtype)


def paged_decode_attention_partial(q, k_cache, v_cache, table, pos, first, active, scale: float, k_scale: float,
                                   v_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Slot b attends to frame columns first[b] <= c <= pos[b] only, without a sink -> (out [Bt, nh, d] fp32
    normalized over those keys, lse [Bt, nh] fp32: log-sum-exp of their scaled scores); 0 / -inf where nothing
    is visible. Only the blocks of the visible columns are gathered (the others read the null block 0)."""
    bt, n = table.shape
    nb, kvh, B, d = v_cache.shape
    nh = q.shape[1]
    rep = nh // kvh
    col = torch.arange(n * B, device=q.device)
    vis = (col[None, :] >= first[:, None]) & (col[None, :] <= pos[:, None]) & active[:, None]      # [Bt, S]
    blk = torch.arange(n, device=q.device)
    read = (blk[None, :] >= first.clamp(min=0)[:, None] // B) & (blk[None, :] <= pos[:, None] // B) \
        & vis.any(dim=1, keepdim=True)                                                              # [Bt, n]
    tb = torch.where(read, table, torch.zeros_like(table))
    kb, vb = k_cache[tb], v_cache[tb]                     # [Bt, n, kv, B(/2), d(, 2)]
    if kb.dim() == vb.dim() + 1:
        kb = packed_to_token_major(kb)                    # [Bt, n, kv, B, d]
    k = dequantize(kb, torch.float32, k_scale).permute(0, 2, 1, 3, 4).reshape(bt, kvh, n * B, d)
    v = dequantize(vb, torch.float32, v_scale).permute(0, 2, 1, 3, 4).reshape(bt, kvh, n * B, d)
    k = k.masked_fill(~vis[:, None, :, None], 0.0)
    v = v.masked_fill(~vis[:, None, :, None], 0.0)
    scores = torch.einsum("bgrd,bgsd->bgrs", q.float().reshape(bt, kvh, rep, d), k) * scale    # [Bt, kv, rep, S]
    scores = scores.masked_fill(~vis[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)                                                       # [Bt, kv, rep]
    probs = torch.exp(scores - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))[..., None])
    out = torch.einsum("bgrs,bgsd->bgrd", probs, v)
    return out.reshape(bt, nh, d).contiguous(), lse.reshape(bt, nh).contiguous()


def prefill_attention(q, k, v, q_pos, k_start: int, sinks, scale: float, window: int = 0) -> torch.Tensor:
    """q [T, nh, d] against k, v [S, nkv, d] at positions k_start.. (GQA, causal, the sliding window when
    window > 0, the sink), dense in fp32: `sink_attention` over the visibility mask."""
    T, nh, d = q.shape
    S, nkv = k.shape[0], k.shape[1]
    rep = nh // nkv
    kpos = torch.arange(k_start, k_start + S)
    vis = kpos[None, :] <= q_pos[:, None]
    if window:
        vis &= kpos[None, :] > q_pos[:, None] - window
    qh = q.float().view(T, nkv, rep, d).permute(1, 2, 0, 3)                  # [nkv, rep, T, d]
    kh, vh = k.float().permute(1, 0, 2)[:, None], v.float().permute(1, 0, 2)[:, None]   # [nkv, 1, S, d]
    o = sink_attention(qh, kh, vh, vis, sinks.float().view(nkv, rep), scale)  # [nkv, rep, T, d]
    return o.permute(2, 0, 1, 3).reshape(T, nh, d).to(q.dtype)


def gk_decode_layers(x, stacks, k_bufs, v_bufs, layer_buffer, layer_sliding, layer_group, cos, sin, full_table,
                     swa_table, full_slot, swa_slot, pos, pos_swa, active, num_heads: int, window: int, eps: float,
                     scale: float, k_scale: float, v_scale: float, top_k: int, alpha: float, limit: float
                     ) -> torch.Tensor:
    """Every layer of a decode step on the twins (stacks in `gigadecode.native.GK_STACKS` order) -> [Bt, H]."""
    (input_norm, qkv_w, qkv_b, o_w, o_b, sinks, post_norm, router_w, router_b, gub, gus, gubias, dnb, dns,
     dnbias) = stacks
    for i, (buf, sliding, g) in enumerate(zip(layer_buffer, layer_sliding, layer_group)):
        k, v = k_bufs[buf], v_bufs[buf]
        table, slot, p = (swa_table[g], swa_slot[g], pos_swa) if sliding else (full_table[g], full_slot[g], pos)
        qkv = linear(rms_norm(x, input_norm[i], eps), qkv_w[i], qkv_b[i])
        q = rope_kv_write(qkv, cos, sin, k, v, slot, num_heads, k_scale, v_scale)
        a = paged_decode_attention(q, k, v, table, p, active, sinks[i], window if sliding else 0, scale, k_scale,
                                   v_scale, x.dtype)
        x = x + linear(a, o_w[i], o_b[i])
        h = rms_norm(x, post_norm[i], eps)
        top, idx = torch.topk(linear(h, router_w[i], router_b[i]), top_k, dim=-1)
        x = x + moe_mxfp4(h, idx, torch.softmax(top, dim=-1), gub[i], gus[i], gubias[i], dnb[i], dns[i], dnbias[i],
                          alpha, limit, 0)
    return x
