"""Expert-parallel MoE for the per-layer model: only the experts this rank holds."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..ops import dense_expert_weights, route, swiglu


def moe_tokens_local(x: torch.Tensor, weights, layer: int, top_k: int, alpha: float, limit: float,
                     expert_offset: int) -> torch.Tensor:
    """`ops.moe_tokens` restricted to the experts held here: global ids [expert_offset, expert_offset + n_local)
    (the stacks hold local ids 0..n_local-1). Routing uses the replicated router over all experts; tokens
    routed elsewhere get 0 from this rank. x [T, H] -> [T, H] (this rank's partial sum)."""
    idx, gate_w = route(x, weights.router_w[layer], weights.router_b[layer], top_k)
    n_local = weights.gate_up_bias.shape[1]
    out = torch.zeros_like(x)
    for e in torch.unique(idx).tolist():
        le = e - expert_offset
        if not 0 <= le < n_local:
            continue
        tok, slot = torch.where(idx == e)
        w1, w2 = dense_expert_weights(weights, layer, le, x.dtype)
        h = F.linear(x[tok], w1, weights.gate_up_bias[layer, le])
        h = F.linear(swiglu(h, alpha, limit), w2, weights.down_bias[layer, le])
        out.index_add_(0, tok, h * gate_w[tok, slot, None])
    return out
