"""Math shared by the per-layer model and the GK program: RMSNorm, attention with sinks, the router,
the clamped SwiGLU and MXFP4 expert MLPs. Plain PyTorch, each mirroring transformers' GptOss numerics.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .mxfp4 import decode_mxfp4


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """In fp32 (transformers keeps GPT-OSS norms in fp32), result in x's dtype."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * h).to(x.dtype)


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                   sinks: torch.Tensor, scale: float) -> torch.Tensor:
    """Softmax attention with a learned per-head sink logit (a softmax column with no value).

    q [..., H, T, d]; k, v [..., H, S, d] (kv heads already repeated); mask [..., T, S] bool (True = attend)
    or broadcastable; sinks [H]. -> [..., H, T, d].
    """
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale                    # [.., H, T, S]
    scores = scores.masked_fill(~mask.unsqueeze(-3), float("-inf"))
    sink = sinks.reshape(-1, 1, 1).to(scores.dtype).expand(*scores.shape[:-1], 1)
    logits = torch.cat((scores, sink), dim=-1)
    logits = logits - logits.amax(dim=-1, keepdim=True)
    probs = torch.softmax(logits, dim=-1)[..., :-1]                            # drop the sink column
    return torch.matmul(probs.to(v.dtype), v)


def route(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] -> (expert ids [T, k], weights [T, k]): softmax over the k chosen logits only."""
    logits = F.linear(x, w, b)                                                 # [T, E]
    top, idx = torch.topk(logits, top_k, dim=-1)
    return idx, torch.softmax(top, dim=-1)


def swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gate_up [..., 2I] interleaved (gate = even, up = odd) -> (up + 1) * gate * sigmoid(alpha * gate)."""
    gate = gate_up[..., ::2].clamp(max=limit)
    up = gate_up[..., 1::2].clamp(-limit, limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def dense_expert_weights(weights, layer: int, expert: torch.Tensor | int, dtype: torch.dtype
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """One expert's (or a batch of experts') weights as dense [.., 2I, H] and [.., H, I] (out-features first)."""
    if weights.mxfp4:
        w1 = decode_mxfp4(weights.gate_up_blocks[layer, expert], weights.gate_up_scales[layer, expert], dtype)
        w2 = decode_mxfp4(weights.down_blocks[layer, expert], weights.down_scales[layer, expert], dtype)
        return w1, w2
    return weights.gate_up[layer, expert].transpose(-1, -2), weights.down[layer, expert].transpose(-1, -2)


def moe_routed(x: torch.Tensor, idx: torch.Tensor, gate_w: torch.Tensor, dense_expert, gate_up_bias: torch.Tensor,
               down_bias: torch.Tensor, alpha: float, limit: float, expert_offset: int = 0) -> torch.Tensor:
    """The (token, slot) pairs routed to the experts held here, summed per token: x [T, H], idx / gate_w [T, k]
    -> [T, H]. The stacks hold local experts 0..n_local-1 = global ids [expert_offset, expert_offset + n_local)
    (all experts on one rank); pairs routed elsewhere contribute nothing. Each expert hit is made dense once
    (`dense_expert(local id)` -> w1 [2I, H], w2 [H, I]) and applied to all of its tokens together."""
    n_local = gate_up_bias.shape[0]
    e = idx - expert_offset
    out = torch.zeros_like(x)
    for le in torch.unique(e).tolist():
        if not 0 <= le < n_local:
            continue
        tok, slot = torch.where(e == le)
        w1, w2 = dense_expert(le)
        h = F.linear(x[tok], w1, gate_up_bias[le])
        h = F.linear(swiglu(h, alpha, limit), w2, down_bias[le])
        out.index_add_(0, tok, h * gate_w[tok, slot, None])
    return out


def moe_tokens(x: torch.Tensor, weights, layer: int, top_k: int, alpha: float, limit: float,
               expert_offset: int = 0) -> torch.Tensor:
    """The per-layer model's MoE over many tokens (the router sees every expert; this rank's stacks hold the
    experts from global id `expert_offset` on, see `moe_routed`). x [T, H] -> [T, H]."""
    idx, gate_w = route(x, weights.router_w[layer], weights.router_b[layer], top_k)
    return moe_routed(x, idx, gate_w, lambda le: dense_expert_weights(weights, layer, le, x.dtype),
                      weights.gate_up_bias[layer], weights.down_bias[layer], alpha, limit, expert_offset)
