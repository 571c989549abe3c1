"""bf16 matrix products on CPUs that have no bf16 arithmetic.

oneDNN multiplies bf16 in hardware where the CPU has AVX512-BF16 or AMX (or emulates it cheaply with
AVX-512); elsewhere (an AVX2-only x86-64) torch's bf16 matmul falls back to a path ~8x (GEMMs) to ~25x
(attention's batched products) slower than its fp32 one. There the bf16 products below run in fp32 instead:
bf16 × bf16 products are exact in fp32 and the sums are fp32 either way, so the result is what a bf16
GEMM with fp32 accumulation gives, rounded once to bf16 at the end.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F

# weight rows converted to fp32 per block: a bounded transient (4 MiB of fp32), never a copy of the weight
_BLOCK_ELEMS = 1 << 20
log = logging.getLogger("gigadecode.gemm")


def _bf16_gemm_in_hardware() -> bool:
    forced = os.environ.get("GIGADECODE_BF16_GEMM")      # "1" / "0" overrides torch's answer
    if forced in ("0", "1"):
        return forced == "1"
    if forced:
        log.warning("gigadecode: GIGADECODE_BF16_GEMM=%r ignored (1 or 0); asking torch", forced)
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return True


# whether oneDNN runs bf16 GEMMs natively on this CPU (True where torch cannot tell); a constant, so compiled
# programs see a plain bool
BF16_GEMM_IN_HARDWARE = _bf16_gemm_in_hardware()


def product_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype to multiply `dtype` operands in: fp32 for bf16 on a CPU without bf16 GEMMs, else itself."""
    return torch.float32 if dtype == torch.bfloat16 and not BF16_GEMM_IN_HARDWARE else dtype


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear: x [M, K] · weight [N, K]^T + bias -> [M, N] in x's dtype; bf16 on a CPU without bf16 GEMMs
    through `linear_fp32_blocks`, or straight in fp32 when the weight is already fp32 (a decoded expert)."""
    if weight.dtype != x.dtype and weight.dtype == product_dtype(x.dtype):
        return F.linear(x.to(weight.dtype), weight, None if bias is None else bias.to(weight.dtype)).to(x.dtype)
    if product_dtype(x.dtype) == x.dtype or weight.dtype != x.dtype:
        return F.linear(x, weight, bias)
    return linear_fp32_blocks(x, weight, bias)


def linear_fp32_blocks(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                       block_elems: int = _BLOCK_ELEMS) -> torch.Tensor:
    """F.linear computed in fp32, result in x's dtype: blocks of weight rows (about `block_elems` values each)
    converted to fp32 once per call, all M rows multiplied with each."""
    xf = x.float()
    N, K = weight.shape
    out = torch.empty(*x.shape[:-1], N, dtype=x.dtype)
    rows = max(1, block_elems // max(K, 1))
    for n0 in range(0, N, rows):
        n1 = min(N, n0 + rows)
        b = None if bias is None else bias[n0:n1].float()
        out[..., n0:n1] = F.linear(xf, weight[n0:n1].float(), b)
    return out
