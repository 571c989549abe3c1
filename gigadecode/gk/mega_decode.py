"""The giga-kernel: `gpt_oss_decode_mega_kernel` runs every layer of one decode step in one call.

Inputs per step: token ids, the weights stacked once on a leading `[L, …]` axis (indexed `W[i]`),
the KV cache as per-buffer K/V tensors (`K_i`, `V_i`; K packed-FP8 `[nb, kv, B/2, d, 2]` or plain
`[nb, kv, B, d]`) or the legacy stacked `K_cache`/`V_cache` (exactly one form), and the step's
`AttentionControl`. Layer i picks its table, write index and position frame by its kind (the seed's
`i % 2`: sliding or full) and its KV buffer by `layer_buffer[i]` (the seed's `i // 2`).
MoE decodes only the experts the batch selected, each once per step for all of its tokens (one expert's
dense transient at a time); the compiled form fuses the MXFP4 decode into the dot product instead.

Everything static (layer pattern, sizes, scales) is in `KernelSpec`, so the same function is the eager
reference and, through `torch.compile(fullgraph=True)`, the compiled program (weights and KV stay inputs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..mxfp4 import _luts, decode_mxfp4
from ..ops import moe_routed, rms_norm, route, swiglu
from ..rope import apply_rope

FP8 = torch.float8_e4m3fn


@dataclass(frozen=True)
class KernelSpec:
    num_layers: int
    num_heads: int                      # q heads on this rank
    num_kv_heads: int                   # kv heads on this rank
    head_dim: int
    window: int
    eps: float
    top_k: int
    alpha: float
    limit: float
    block_size: int
    layer_sliding: tuple[bool, ...]     # kind of layer i (the seed's i % 2)
    layer_kind_group: tuple[int, ...]   # index of layer i's group among groups of its kind
    layer_buffer: tuple[int, ...]       # KV buffer of layer i (the seed's i // 2)
    k_scale: float = 1.0
    v_scale: float = 1.0
    mxfp4: bool = True
    fused_moe: bool = False             # compiled form: decode-and-dot as one reduction (Inductor fuses it)

    @property
    def scale(self) -> float:
        return self.head_dim ** -0.5


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == FP8 else t


def _store(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    if dtype == FP8:
        return _u8((x.float() / scale).clamp(-448.0, 448.0).to(FP8))
    return x.to(dtype)


def _load(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    if x.dtype == FP8:
        y = x.float()
        return (y * scale).to(dtype) if scale != 1.0 else y.to(dtype)
    return x.to(dtype)


def write_token_kv(k_buf: torch.Tensor, v_buf: torch.Tensor, slot: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   spec: KernelSpec) -> None:
    """Write one token per batch slot. slot [Bt]; k, v [Bt, kv, d]."""
    B = spec.block_size
    blk, off = slot // B, slot % B
    kq, vq = _store(k, k_buf.dtype, spec.k_scale), _store(v, v_buf.dtype, spec.v_scale)
    if k_buf.dim() == v_buf.dim() + 1:                 # packed K: token 2p+s at [.., p, j, s]
        _u8(k_buf)[blk, :, off // 2, :, off % 2] = kq
    else:
        _u8(k_buf)[blk, :, off, :] = kq
    _u8(v_buf)[blk, :, off, :] = vq


def read_table_kv(k_buf: torch.Tensor, v_buf: torch.Tensor, table: torch.Tensor, dtype: torch.dtype,
                  spec: KernelSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """table [Bt, n] -> k, v [Bt, kv, n*B, d] (token-major, frame position = column)."""
    bt, n = table.shape
    kb = k_buf[table]                                  # [Bt, n, kv, B/2, d, 2] or [Bt, n, kv, B, d]
    vb = v_buf[table]                                  # [Bt, n, kv, B, d]
    if kb.dim() == vb.dim() + 1:
        kb = kb.transpose(-1, -2)                      # [Bt, n, kv, B/2, 2, d]
    k = _load(kb, dtype, spec.k_scale).reshape(bt, n, spec.num_kv_heads, spec.block_size, spec.head_dim)
    v = _load(vb, dtype, spec.v_scale)
    k = k.permute(0, 2, 1, 3, 4).reshape(bt, spec.num_kv_heads, n * spec.block_size, spec.head_dim)
    v = v.permute(0, 2, 1, 3, 4).reshape(bt, spec.num_kv_heads, n * spec.block_size, spec.head_dim)
    return k, v


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, active: torch.Tensor,
                     sinks: torch.Tensor, window: int | None, spec: KernelSpec) -> torch.Tensor:
    """q [Bt, nh, d]; k, v [Bt, kv, S, d]; pos [Bt] frame position of the query -> [Bt, nh*d]."""
    bt, nh, d = q.shape
    kvh, S = k.shape[1], k.shape[2]
    rep = nh // kvh
    qg = q.view(bt, kvh, rep, d)
    scores = torch.einsum("bgrd,bgsd->bgrs", qg, k) * spec.scale            # [Bt, kv, rep, S]
    kf = torch.arange(S, device=q.device)
    mask = (kf[None, :] <= pos[:, None]) & active[:, None]                  # [Bt, S]
    if window is not None:
        mask = mask & (kf[None, :] > pos[:, None] - window)
    scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
    sink = sinks.view(1, kvh, rep, 1).to(scores.dtype).expand(bt, kvh, rep, 1)
    logits = torch.cat((scores, sink), dim=-1)
    logits = logits - logits.amax(dim=-1, keepdim=True)
    probs = torch.softmax(logits, dim=-1)[..., :-1]
    out = torch.einsum("bgrs,bgsd->bgrd", probs.to(v.dtype), v)             # [Bt, kv, rep, d]
    return out.reshape(bt, nh * d)


def dense_expert(W: dict[str, torch.Tensor], i: int, le: int, spec: KernelSpec, dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert `le` (local id) of layer i as dense w1 [2I, H], w2 [H, I] (out-features first): MXFP4 decoded
    into a transient, bf16 / fp32 experts as views."""
    if spec.mxfp4:
        return (decode_mxfp4(W["gate_up_blocks"][i][le], W["gate_up_scales"][i][le], dtype),
                decode_mxfp4(W["down_blocks"][i][le], W["down_scales"][i][le], dtype))
    return W["gate_up"][i][le].transpose(-1, -2), W["down"][i][le].transpose(-1, -2)


def moe_decode(h: torch.Tensor, W: dict[str, torch.Tensor], i: int, spec: KernelSpec,
               expert_offset: int = 0) -> torch.Tensor:
    """The eager form's MoE: h [Bt, H] -> [Bt, H]. Only the experts the batch selected are decoded, each once
    for all of its tokens (`ops.moe_routed`). With expert parallelism the stacks hold the experts from global
    id `expert_offset` on and the result is this rank's partial sum (pairs routed elsewhere cost nothing)."""
    idx, gate_w = route(h, W["router_w"][i], W["router_b"][i], spec.top_k)  # [Bt, k]
    return moe_routed(h, idx, gate_w, lambda le: dense_expert(W, i, le, spec, h.dtype), W["gate_up_bias"][i],
                      W["down_bias"][i], spec.alpha, spec.limit, expert_offset)


def mxfp4_matvec(blocks: torch.Tensor, scales: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Per-row MXFP4 matrix times vector without a dense weight: blocks [n, R, G, 16], scales [n, R, G],
    x [n, G*32] -> [n, R]. Dot each 32-value group, then apply the group's power of two. Written as one
    gather + multiply + reduction so Inductor emits a single fused loop (eager would materialize it)."""
    pair, scale = _luts(x.dtype)
    n, R, G, _ = blocks.shape
    vals = pair[blocks.long()]                                           # [n, R, G, 16, 2]
    part = (vals * x.view(n, 1, G, 16, 2)).sum((-1, -2))                 # [n, R, G]
    return (part * scale[scales.long()].squeeze(-1)).sum(-1)


def moe_decode_fused(h: torch.Tensor, W: dict[str, torch.Tensor], i: int, spec: KernelSpec) -> torch.Tensor:
    """The compiled form's MoE: every (token, slot) pair at once, experts never dequantized to memory."""
    idx, gate_w = route(h, W["router_w"][i], W["router_b"][i], spec.top_k)  # [Bt, k]
    bt, k = idx.shape
    e = idx.reshape(-1)                                                   # [Bt k]
    hk = h.repeat_interleave(k, dim=0)                                    # [Bt k, H]
    if spec.mxfp4:
        g = mxfp4_matvec(W["gate_up_blocks"][i][e], W["gate_up_scales"][i][e], hk)
    else:
        g = torch.bmm(hk.unsqueeze(1), W["gate_up"][i][e]).squeeze(1)
    a = swiglu(g + W["gate_up_bias"][i][e], spec.alpha, spec.limit)      # [Bt k, I]
    if spec.mxfp4:
        y = mxfp4_matvec(W["down_blocks"][i][e], W["down_scales"][i][e], a)
    else:
        y = torch.bmm(a.unsqueeze(1), W["down"][i][e]).squeeze(1)
    y = (y + W["down_bias"][i][e]) * gate_w.reshape(-1, 1)
    return y.view(bt, k, -1).sum(1)


def gpt_oss_decode_mega_kernel(input_ids: torch.Tensor, W: dict[str, torch.Tensor],
                               k_bufs: tuple[torch.Tensor, ...] | None, v_bufs: tuple[torch.Tensor, ...] | None,
                               cos: torch.Tensor, sin: torch.Tensor, full_table: torch.Tensor,
                               swa_table: torch.Tensor, active: torch.Tensor, pos: torch.Tensor,
                               pos_swa: torch.Tensor, kv_cache_update_idx: torch.Tensor,
                               kv_cache_update_idx_swa: torch.Tensor, *, spec: KernelSpec,
                               K_cache: torch.Tensor | None = None, V_cache: torch.Tensor | None = None,
                               return_hidden: bool = False, parallel=None) -> torch.Tensor:
    """One decode step over all layers. input_ids [Bt] -> logits [Bt, V] (or the final hidden [Bt, H]).

    `parallel` (a `gigadecode.parallel.ParallelContext`; None = one rank, no collectives): W is this rank's
    shard. Per layer: local heads, o-proj all-reduced over the TP group (bias added once), MoE on the local
    experts summed over the EP group (gathering the EP group's DP tokens first when it spans several: every
    DP group must pass the same batch bucket Bt). Returns this rank's vocabulary columns
    [Bt, vocab_stop - vocab_start] (reduce with `parallel.greedy`). Eager only (no compiled form yet)."""
    assert (k_bufs is None) != (K_cache is None), "pass exactly one KV form: per-buffer K/V or stacked K_cache/V_cache"
    nh, kvh, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
    x = W["embed"][input_ids]                                              # [Bt, H]
    for i in range(spec.num_layers):
        buf = spec.layer_buffer[i]
        kb = k_bufs[buf] if k_bufs is not None else K_cache[buf]
        vb = v_bufs[buf] if v_bufs is not None else V_cache[buf]
        g = spec.layer_kind_group[i]
        if spec.layer_sliding[i]:
            table, slot, fpos, window = swa_table[g], kv_cache_update_idx_swa[g], pos_swa, spec.window
        else:
            table, slot, fpos, window = full_table[g], kv_cache_update_idx[g], pos, None

        h = rms_norm(x, W["input_norm"][i], spec.eps)
        qkv = F.linear(h, W["qkv_w"][i], W["qkv_b"][i])                    # [Bt, (nh + 2 kv) d]
        q = apply_rope(qkv[:, : nh * d].reshape(-1, nh, d), cos, sin)
        k = apply_rope(qkv[:, nh * d: (nh + kvh) * d].reshape(-1, kvh, d), cos, sin)
        v = qkv[:, (nh + kvh) * d:].reshape(-1, kvh, d)
        write_token_kv(kb, vb, slot, k, v, spec)
        keys, vals = read_table_kv(kb, vb, table, x.dtype, spec)
        a = decode_attention(q, keys, vals, fpos, active, W["sinks"][i], window, spec)
        if parallel is None:
            x = x + F.linear(a, W["o_w"][i], W["o_b"][i])
        else:
            x = x + parallel.row_parallel_linear(a, W["o_w"][i], W["o_b"][i])

        h = rms_norm(x, W["post_norm"][i], spec.eps)
        if parallel is None:
            x = x + (moe_decode_fused(h, W, i, spec) if spec.fused_moe else moe_decode(h, W, i, spec))
        else:
            x = x + parallel.ep_moe(h, lambda t, i=i: moe_decode(t, W, i, spec, parallel.expert_offset))
    x = rms_norm(x, W["norm"], spec.eps)
    if return_hidden:
        return x
    if parallel is not None:
        return parallel.local_logits(x, W["lm_head"])
    return F.linear(x, W["lm_head"])
