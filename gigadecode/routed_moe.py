"""A layer's routed MoE on the grouped MXFP4 kernel: route the tokens, then `native.moe_mxfp4` over the
layer's expert stacks. Shared by the per-layer model (prefill chunks, in bounded slices) and the GK
program's decode step (router on the native small-batch linear).

With `gemm.DENSE_BF16_EXPERTS` (opt-in, for CPUs with AMX tiles), a bf16 expert with at least
`DENSE_MIN_TOKENS` tokens in a prefill chunk is instead decoded once to a bf16 transient (exact) and
multiplied in oneDNN's bf16 GEMM, ~10x the fp32 FMA rate the grouped kernel's products run at there; the
kernel takes the other experts (their pairs routed past its experts, which it skips)."""

from __future__ import annotations

import torch

from . import native
from . import gemm
from .gemm import linear
from .ops import dense_expert, moe_routed, route
from .weights import LayerWeights


def native_routed_moe(x: torch.Tensor, lw: LayerWeights, top_k: int, alpha: float, limit: float,
                      expert_offset: int = 0, *, router_linear=linear, max_tokens: int | None = None,
                      dense_experts: bool = False) -> torch.Tensor:
    """x [T, H] -> [T, H]: each token through its top-k experts, gate-weighted (under EP, this rank's
    experts' share: global ids from `expert_offset` on). `max_tokens`: call the kernel on slices of at most
    this many tokens (its per-pair scratch, [pairs, 2I] fp32, stays bounded for big chunks). `dense_experts`
    (prefill chunks; a decode step allocates nothing the size of an expert): let experts with many tokens take
    the bf16 GEMM where `gemm.DENSE_BF16_EXPERTS`."""
    idx, gate_w = route(x, lw.router_w, lw.router_b, top_k, linear=router_linear)   # [T, k]
    dense = None
    if (dense_experts and gemm.DENSE_BF16_EXPERTS and x.dtype == torch.bfloat16 and lw.mxfp4
            and x.shape[0] >= DENSE_MIN_TOKENS):
        dense, idx = _dense_experts(x, lw, idx, gate_w, alpha, limit, expert_offset)
    step = max_tokens or max(x.shape[0], 1)
    outs = [native.moe_mxfp4(x[s: s + step], idx[s: s + step], gate_w[s: s + step], lw.gate_up_blocks,
                             lw.gate_up_scales, lw.gate_up_bias, lw.down_blocks, lw.down_scales, lw.down_bias,
                             alpha, limit, expert_offset)
            for s in range(0, max(x.shape[0], 1), step)]                  # T = 0: one call, zeros
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return out if dense is None else (out.float() + dense.float()).to(x.dtype)


DENSE_MIN_TOKENS = 32        # an expert's tokens from which its bf16 GEMM beats the grouped kernel (AMX)


def _dense_experts(x: torch.Tensor, lw: LayerWeights, idx: torch.Tensor, gate_w: torch.Tensor, alpha: float,
                   limit: float, expert_offset: int) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The experts with DENSE_MIN_TOKENS or more tokens through bf16 GEMMs (`ops.moe_routed`, each decoded
    once): -> (their gate-weighted sum [T, H], or None when no expert has that many; idx with their pairs
    routed past every local expert, for the grouped kernel to skip)."""
    E = lw.gate_up_blocks.shape[0]
    local = (idx - expert_offset).clamp(-1, E)                          # [T, k]; -1 / E: another rank's
    big = torch.bincount(local.reshape(-1) + 1, minlength=E + 2)[1:E + 1] >= DENSE_MIN_TOKENS
    if not bool(big.any()):
        return None, idx
    mine = torch.cat([torch.zeros(1, dtype=torch.bool), big, torch.zeros(1, dtype=torch.bool)])[local + 1]
    away = expert_offset - 1                                             # local id -1: no expert here
    out = moe_routed(x, idx.masked_fill(~mine, away), gate_w,
                     lambda le: dense_expert(lw, le, torch.bfloat16, native.mxfp4_dequant), lw.gate_up_bias,
                     lw.down_bias, alpha, limit, expert_offset)
    return out, idx.masked_fill(mine, away)
