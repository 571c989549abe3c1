"""bf16 matrix products where a bf16 GEMM is not the fastest way to multiply bf16 values.

oneDNN multiplies bf16 in hardware where the CPU has AVX512-BF16 or AMX (or emulates it cheaply with
AVX-512); elsewhere (an AVX2-only x86-64) torch's bf16 matmul falls back to a path ~8x (GEMMs) to ~25x
(attention's batched products) slower than its fp32 one. And some CPUs with bf16 instructions run them at
half the rate of their fp32 FMAs (an Intel Xeon without AMX: oneDNN's bf16 GEMM 70-80 GMAC/s, MKL's fp32 one
100-115 on a prefill-size projection). There the bf16 products below run in fp32 instead: bf16 × bf16
products are exact in fp32 and the sums are fp32 either way, so the result is what a bf16 GEMM with fp32
accumulation gives, rounded once to bf16 at the end.

And where oneDNN does multiply bf16, it builds a GEMM for every row count it meets: `linear` runs those of many
rows at a bounded set of row counts (`padded_rows`), which the start-up warm-up builds ahead
(`prime_row_counts`), so a prompt of a new length compiles nothing.
"""

from __future__ import annotations

import logging
import os
import time

import torch
import torch.nn.functional as F

# weight rows converted to fp32 per block: a bounded transient (4 MiB of fp32), never a copy of the weight
_BLOCK_ELEMS = 1 << 20
log = logging.getLogger("gigadecode.gemm")


def bf16_gemm_in_hardware() -> bool:
    """Whether oneDNN runs bf16 GEMMs natively on this CPU (torch's answer; True where torch cannot tell)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return True


def _fp32_gemm_faster(rows: int = 512, k: int = 1024, n: int = 1024, margin: float = 1.15) -> bool:
    """Whether a prefill-size bf16 projection (rows x k by an n x k weight) runs `margin` times faster as
    `linear_fp32_blocks` than as oneDNN's bf16 GEMM here: the best of four alternated rounds each, the first
    of which also warms both up (~0.05 s on 2 cores)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    best = {"bf16": float("inf"), "fp32": float("inf")}
    for _ in range(4):
        for name, fn in (("bf16", F.linear), ("fp32", linear_fp32_blocks)):
            t0 = time.perf_counter()
            fn(x, w)
            best[name] = min(best[name], time.perf_counter() - t0)
    return best["bf16"] > margin * best["fp32"]


def _bf16_gemm_in_bf16() -> bool:
    forced = os.environ.get("GIGADECODE_BF16_GEMM")      # "1" / "0" overrides the choice
    if forced in ("0", "1"):
        return forced == "1"
    if forced:
        log.warning("gigadecode: GIGADECODE_BF16_GEMM=%r ignored (1 or 0); measuring", forced)
    return bf16_gemm_in_hardware() and not _fp32_gemm_faster()


def product_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype to multiply `dtype` operands in: fp32 for bf16 where bf16 GEMMs are missing or slower, else
    itself."""
    return torch.float32 if dtype == torch.bfloat16 and not BF16_GEMM_IN_BF16 else dtype


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear: x [M, K] · weight [N, K]^T + bias -> [M, N] in x's dtype; bf16 where its products run in fp32
    through `linear_fp32_blocks`, or straight in fp32 when the weight is already fp32 (a decoded expert)."""
    if weight.dtype != x.dtype and weight.dtype == product_dtype(x.dtype):
        return F.linear(x.to(weight.dtype), weight, None if bias is None else bias.to(weight.dtype)).to(x.dtype)
    if (x.dtype == weight.dtype and _padded_dtype(x.dtype) and x.dim() == 2
            and not torch.compiler.is_compiling()):       # a compiled program's shapes are its own
        return _linear_padded_rows(x, weight, bias)
    if product_dtype(x.dtype) == x.dtype or weight.dtype != x.dtype:
        return F.linear(x, weight, bias)
    return linear_fp32_blocks(x, weight, bias)


# oneDNN builds and JIT-compiles a bf16 GEMM for each new row count, on its first call (~3 ms for a 1024 x 1536
# projection, ~7 ms for 2880 x 5120, 2 cores; then cached), so every prompt length a process had not seen paid
# it on each projection shape of its prefill (and again once oneDNN's cache of 1,024 GEMMs had dropped it). Past
# ROW_GRANULE rows a bf16 GEMM runs at its rows rounded up to a multiple of ROW_GRANULE (x ceil(rows / 1024) past
# 1,024 rows): fewer than 32 rows more up to 1,024 rows, under 6.25% more past them, and 31 row counts up to
# 1,024 rows, which the start-up warm-up builds ahead (`prime_row_counts`).
ROW_GRANULE = 32


def _padded_dtype(dtype: torch.dtype) -> bool:
    """Whether `linear` multiplies operands of `dtype` in oneDNN's bf16 GEMM, at padded row counts."""
    return dtype == torch.bfloat16 and product_dtype(dtype) == dtype


def padded_rows(m: int) -> int:
    """The row count a bf16 oneDNN GEMM of m rows runs at: m up to ROW_GRANULE, else rounded up as above."""
    if m <= ROW_GRANULE:
        return m
    g = ROW_GRANULE * -(-m // 1024)
    return -(-m // g) * g


def _linear_padded_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear of x [M, K] at `padded_rows(M)` rows (zeros below x's), its first M rows returned (a view)."""
    m, mp = x.shape[0], padded_rows(x.shape[0])
    if mp == m:
        return F.linear(x, weight, bias)
    xp = x.new_empty(mp, x.shape[1])
    xp[:m] = x
    xp[m:] = 0
    return F.linear(xp, weight, bias)[:m]


def prime_row_counts(projections: list[tuple[torch.Tensor, torch.Tensor | None]], max_rows: int) -> int:
    """Build oneDNN's GEMMs for every padded row count past ROW_GRANULE up to `padded_rows(max_rows)`, for each
    distinct (weight shape, bias or not) of `projections` [(weight [N, K], bias)]; only where `linear` takes
    the padded bf16 path. -> how many GEMMs were called."""
    shapes = {}
    for w, b in projections:
        if _padded_dtype(w.dtype):
            shapes.setdefault((tuple(w.shape), b is not None), (w, b))
    counts = sorted({padded_rows(m) for m in range(ROW_GRANULE + 1, max_rows + 1)})
    for w, b in shapes.values():
        for m in counts:
            F.linear(torch.zeros(m, w.shape[1], dtype=w.dtype), w, b)
    return len(shapes) * len(counts)


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


# whether bf16 GEMMs multiply in bf16 (oneDNN) here rather than in fp32: where the CPU has bf16 GEMMs and
# they are not measured slower than the fp32 form (GIGADECODE_BF16_GEMM=1 / 0 chooses); a constant, so
# compiled programs see a plain bool
BF16_GEMM_IN_BF16 = _bf16_gemm_in_bf16()
