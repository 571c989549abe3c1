"""A layer's routed MoE on the grouped MXFP4 kernel: route the tokens, then `native.moe_mxfp4` over the
layer's expert stacks. Shared by the per-layer model (prefill chunks, in bounded slices) and the GK
program's decode step (router on the native small-batch linear)."""

from __future__ import annotations

import torch

from . import native
from .gemm import linear
from .ops import route
from .weights import LayerWeights


def native_routed_moe(x: torch.Tensor, lw: LayerWeights, top_k: int, alpha: float, limit: float,
                      expert_offset: int = 0, *, router_linear=linear, max_tokens: int | None = None
                      ) -> torch.Tensor:
    """x [T, H] -> [T, H]: each token through its top-k experts, gate-weighted (under EP, this rank's
    experts' share: global ids from `expert_offset` on). `max_tokens`: call the kernel on slices of at most
    this many tokens (its per-pair scratch, [pairs, 2I] fp32, stays bounded for big chunks)."""
    idx, gate_w = route(x, lw.router_w, lw.router_b, top_k, linear=router_linear)   # [T, k]
    step = max_tokens or max(x.shape[0], 1)
    outs = [native.moe_mxfp4(x[s: s + step], idx[s: s + step], gate_w[s: s + step], lw.gate_up_blocks,
                             lw.gate_up_scales, lw.gate_up_bias, lw.down_blocks, lw.down_scales, lw.down_bias,
                             alpha, limit, expert_offset)
            for s in range(0, max(x.shape[0], 1), step)]                  # T = 0: one call, zeros
    return outs[0] if len(outs) == 1 else torch.cat(outs)
