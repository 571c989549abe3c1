"""Native CPU kernels for decode and bf16 prefill (the MXFP4 MoE, dense projections, paged attention), each with a torch twin.

Ops (registered as `torch.ops.gigadecode_native.*`; fake implementations below so a compiled program
treats each as one opaque node). Every function here calls the kernel when it is built (see `build.py`)
and its twin (`twins.py`, same signature) otherwise.

- `moe_mxfp4(x [T, H], idx [T, k] int64, gate_w [T, k], gate_up_blocks [E, 2I, H/32, 16], gate_up_scales
  [E, 2I, H/32], gate_up_bias [E, 2I], down_blocks [E, H, I/32, 16], down_scales [E, H, I/32], down_bias [E, H],
  alpha, limit, expert_offset) -> [T, H]`: the routed MXFP4 MoE, each selected expert read once for all of
  its tokens (a decode batch or a prefill chunk); global expert ids outside [expert_offset, expert_offset + E) contribute nothing (EP).
  On the AVX2 build, bf16 x (and the bf16 activations between the matmuls) of experts with fewer than 8 tokens
  are quantized to int16 per group of 32 (within 2^-16 of the group's largest |value|) before the products;
  on the AVX-512 build in its 'int16' product form (CPUs with AVX512-VNNI), of experts with fewer than 32
  tokens. Experts with more tokens (8; 24 in fp32 on the AVX-512 build) decode each strip of rows once and
  multiply it in dense tiles. On the
  AVX512-BF16 build, `product_form` says (or sets) whether bf16 inputs meet the experts as bf16 dot products or,
  for experts with 2 tokens or more, as fp32 FMAs (the same exact products, summed in another order).
- `mxfp4_dequant(blocks [..., R, G, 16], scales [..., R, G], dtype) -> [..., R, G*32]` (exact);
  `mxfp4_dequant_into(blocks, scales, out)` writes the same values into a contiguous `out` (prefill reuses
  one transient per expert shape, which stays in cache for the GEMM that reads it).
- `swiglu(gate_up [T, 2I], alpha, limit) -> [T, I]`: GPT-OSS's clamped SwiGLU on interleaved (gate, up)
  columns, bias already added; fp32 math (a vectorized exp for bf16), rounded once to gate_up's dtype.
- `linear(x [M, K], weight [N, K], bias [N] | None) -> [M, N]`: small-M dense projection (fp32 accumulate).
- `paged_decode_attention(q [Bt, nh, d] fp32, k_cache, v_cache, table [Bt, n], pos [Bt], active [Bt], sinks [nh],
  window (0 = full), scale, k_scale, v_scale, out_dtype) -> [Bt, nh*d]`: reads the table's blocks in place;
  K is plain [nb, kv, B, d] or packed-FP8 [nb, kv, B/2, d, 2], V [nb, kv, B, d].
- `paged_decode_attention_partial(q [Bt, nh, d] fp32, k_cache, v_cache, table [Bt, n], pos [Bt], first [Bt],
  active [Bt], scale, k_scale, v_scale) -> (out [Bt, nh, d] fp32, lse [Bt, nh] fp32)`: the same KV, but slot b
  sees only frame positions first <= c <= pos and no sink (decode context parallelism): out normalized over
  those keys, lse their log-sum-exp (natural log of the scaled scores); 0 / -inf where nothing is visible.
- `rope_kv_write(qkv [Bt, (nh + 2kv) d], cos, sin [Bt, d/2], k_cache, v_cache, slot [Bt], num_heads, k_scale,
  v_scale) -> q [Bt, nh, d] fp32`: RoPE on q and k, k and v stored at `slot` (FP8: x / scale, clamped).
- `kv_gather(k_cache, v_cache, block_ids [n], k_scale, v_scale, dtype) -> (k, v [n*B, kv, d])`: the blocks read
  back token-major in `dtype` (fp32 or bf16; FP8 values times their scale, rounded once), for prefill attention.
- `rms_norm(x [M, H], weight [H], eps) -> [M, H]`.
- `prefill_attention(q [T, nh, d] bf16, k, v [S, nkv, d] bf16, q_pos [T], k_start, sinks [nh], scale, window)
  -> [T, nh, d]`: a prefill chunk's causal GQA attention with the sink over the keys at positions k_start..
  (window > 0: sliding), flash style: bf16 pair products on AVX512-BF16 (AMX tiles where `amx_tiles`) for head
  dims that are multiples of 16 up to 128, fp32 products everywhere else (`prefill_attention_supported` says when it applies).
All compute in fp32 and return x's dtype unless stated.
"""

from __future__ import annotations

import torch

from .. import gemm
from . import twins
from .build import isa, load, status

__all__ = ["moe_mxfp4", "mxfp4_dequant", "mxfp4_dequant_into", "swiglu", "linear", "paged_decode_attention", "paged_decode_attention_partial",
           "rope_kv_write", "kv_gather", "rms_norm", "prefill_attention", "prefill_attention_supported", "gk_decode_layers",
           "GK_STACKS", "product_form", "amx_tiles", "fp8_reads",
           "available", "isa", "status", "twins"]


def available() -> bool:
    return load() is not None


def _op(name: str):
    ops = load()
    return getattr(ops, name) if ops is not None else getattr(twins, name)


def moe_mxfp4(x, idx, gate_w, gate_up_blocks, gate_up_scales, gate_up_bias, down_blocks, down_scales, down_bias,
              alpha: float, limit: float, expert_offset: int = 0) -> torch.Tensor:
    return _op("moe_mxfp4")(x.contiguous(), idx.contiguous(), gate_w.contiguous(), gate_up_blocks, gate_up_scales,
                            gate_up_bias.contiguous(), down_blocks, down_scales, down_bias.contiguous(), float(alpha),
                            float(limit), int(expert_offset))


def product_form(form: str = "") -> str:
    """How bf16 inputs meet bf16-exact weights: 'bf16' (`vdpbf16ps`) or 'fp32' (FMAs on the same exact
    values: `moe_mxfp4` for experts with 2 tokens or more, `linear` for 4 rows or more). The AVX512-BF16 build
    measures which multiplies faster on this CPU at first use (GIGADECODE_BF16_PRODUCTS=bf16|fp32 chooses
    instead). The AVX-512 build has 'int16' where the CPU has AVX512-VNNI, its default there (fp32 FMAs
    otherwise, or with GIGADECODE_BF16_PRODUCTS=fp32): `moe_mxfp4`'s experts with fewer than 32 tokens
    multiply int16-quantized inputs (`vpdpwssd`; 1.1-2x the fp32 tiles on an Ice Lake Xeon), `linear` stays
    fp32. The AVX2 build multiplies as it does (fp32, its MoE on int16 inputs), and the twins have no such
    choice ('none'). `form` ('auto', 'bf16', 'fp32' or 'int16') sets it first; '' only asks."""
    ops = load()
    if ops is None:
        return "none"
    return str(ops.product_form(form))


def amx_tiles(mode: str = "") -> str:
    """Whether bf16 products run on AMX tiles (our own tile code or oneDNN's batch-reduce GEMM, fp32 sums):
    `moe_mxfp4`'s experts with 5 or more bf16 inputs, `linear`'s bf16 weights at 5 rows or more,
    `prefill_attention`'s scores and P·V, `paged_decode_attention`'s over FP8 KV (fp32 values split into three
    exact bf16 parts): 'on' where the CPU has AMX-BF16 (GIGADECODE_AMX=0 turns it off), 'off',
    or 'unavailable' (no AMX, or a build without bf16 dot products; the twins). `mode` ('auto', 'on' or 'off')
    sets it first; '' only asks."""
    ops = load()
    if ops is None:
        if mode == "on":
            raise RuntimeError("amx_tiles: the native kernels are not built")
        return "unavailable"
    return str(ops.amx_tiles(mode))


def fp8_reads(mode: str = "") -> str:
    """How `paged_decode_attention`'s fp32 form reads FP8 KV into fp32 (the same exact values either way): 'table'
    (a byte table of each code's bf16, AVX512-VBMI permutes; the default where the CPU has them,
    GIGADECODE_FP8_READS=fp16 turns it off; packed K in blocks of whole 16-token groups is then scored 16 tokens a
    vector, the same scores to fp32 rounding) or 'fp16' (through fp16 conversions, every CPU); 'none' where the
    twins run. `mode` ('auto', 'table' or 'fp16') sets it first; '' only asks."""
    ops = load()
    if ops is None:
        if mode == "table":
            raise RuntimeError("fp8_reads: the native kernels are not built")
        return "none"
    return str(ops.fp8_reads(mode))


def mxfp4_dequant(blocks, scales, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return _op("mxfp4_dequant")(blocks, scales, dtype)


def mxfp4_dequant_into(blocks, scales, out: torch.Tensor) -> torch.Tensor:
    _op("mxfp4_dequant_into")(blocks, scales, out)
    return out


def swiglu(gate_up, alpha: float, limit: float) -> torch.Tensor:
    return _op("swiglu")(gate_up.contiguous(), float(alpha), float(limit))


# Up to this many rows the kernel streams each weight row once for all of them; past it a GEMM is
# compute-bound and oneDNN's blocking wins. First measured at 32 (2 threads, min of 40, bf16: the `small`
# lm_head [32000, 1024] at 8 / 16 / 32 rows 2.5 / 4.4 / 7.2 ms against oneDNN's 5.8 / 6.9 / 9.4, a [1536, 1024]
# qkv 0.09 / 0.19 / 0.32 against 0.21 / 0.26 / 0.39; at 64 rows even; fp32 2-4x faster than oneDNN
# throughout). On a Zen 5 (AVX512-BF16, no AMX; 2 threads, alternated, medians) the kernel stays ahead further:
# bf16 at 40 / 48 / 56 / 64 rows 1.42-2.49 / 1.19-2.14 / 1.09-1.86 / 0.98-1.52x oneDNN's GEMM over `small`'s
# projections and lm_head and 20b-shape's qkv, o and lm_head [201088, 2880] (that lm_head the 0.98x), fp32
# 1.59-2.68x at 32-64. Past this count a decode batch also leaves the one-call layer loop (`native_all_layers`)
# for the per-op one. Decode steps with this count at 56 against 32, the same host: `small` batch 40 / 48 / 56
# 1.13 / 1.14 / 1.07x, batch 48 in fp32 1.38x; `20b-shape` batch 48 / 56 1.08 / 1.04x (with it at 64, batch 64:
# `small` 1.07x, `20b-shape` 0.98x).
LINEAR_MAX_ROWS = 56
# Where bf16 GEMMs run in fp32 (`gemm.BF16_GEMM_IN_BF16` False: AVX2, say), a bf16 weight's GEMM first
# converts it to fp32 block by block, and the kernel stays ahead further (2-core Zen 3, bf16: 2.2x at 48 rows,
# 1.2-1.8x at 64, 0.93-1.17x at 128, 0.73-0.79x at 512 on the `small` lm_head, qkv and a 20b-shape qkv; the
# AVX512-BF16 build's pair tiles on an Intel Xeon: 1.4-1.5x at 64 rows, 0.9-1.1x at 128).
LINEAR_MAX_ROWS_BF16_IN_FP32 = 96
# The AVX2 build converts a bf16 weight to fp32 once per strip of rows for 40 rows or more (linear.cpp) and
# stays level with or ahead of that GEMM up to ~256 rows (2-core Zen 3, the `small` lm_head and qkv and a
# 20b-shape qkv: 1.19-1.59x at 96 rows, 1.05-1.21x at 128, 1.00-1.15x at 192, 0.99-1.02x at 256, 0.78-0.97x
# at 384-512); so does the AVX-512 build without BF16 from 64 rows (an Ice Lake Xeon, the same shapes and
# 20b-shape's o: 1.04-1.78x at 64-256 rows, 0.95-1.17x at 384, 0.69-0.97x at 512-1,024).
LINEAR_MAX_ROWS_BF16_STRIPS = 256


# On AMX tiles (bf16 weight and inputs) the kernel's own tile code keeps a weight streamed from memory at 16-20
# GB/s up to 64 rows, where oneDNN's GEMM reads it at 11-12.5 (24 layers of 20b-shape's qkv and o, 2 threads,
# 33 / 48 / 64 rows: 20.4 / 19.4 / 16.4 GB/s against 12.5 / 11.4 / 11.0; at 96 rows even, 10.7 / 10.8).
LINEAR_MAX_ROWS_AMX = 64


def linear_max_rows(weight: torch.Tensor, x_dtype: torch.dtype | None = None) -> int:
    """Up to how many rows `linear` runs the kernel for this weight and inputs of `x_dtype` (default: the
    weight's; past it, `gemm.linear`)."""
    if weight.dtype == torch.bfloat16 and not gemm.BF16_GEMM_IN_BF16:
        return LINEAR_MAX_ROWS_BF16_STRIPS if isa() in ("avx2", "avx512") else LINEAR_MAX_ROWS_BF16_IN_FP32
    if weight.dtype == torch.bfloat16 and (x_dtype or weight.dtype) == torch.bfloat16 and amx_tiles() == "on":
        return LINEAR_MAX_ROWS_AMX
    return LINEAR_MAX_ROWS


def linear(x, weight, bias=None) -> torch.Tensor:
    if x.shape[0] > LINEAR_MAX_ROWS and x.shape[0] > linear_max_rows(weight, x.dtype):
        return gemm.linear(x, weight, bias)
    return _op("linear")(x.contiguous(), weight, bias)


def projection(x, weight, bias=None) -> torch.Tensor:
    """The per-layer model's projection (qkv, o, router, lm_head): fp32 stays torch's own product (the
    exact mode); other dtypes take `linear` when the kernels are built (decode-size row counts read each
    weight row once), else `gemm.linear`."""
    if x.dtype == torch.float32 or not available():
        return gemm.linear(x, weight, bias)
    return linear(x, weight, bias)


def paged_decode_attention(q, k_cache, v_cache, table, pos, active, sinks, window: int, scale: float,
                           k_scale: float = 1.0, v_scale: float = 1.0, out_dtype: torch.dtype = torch.float32
                           ) -> torch.Tensor:
    return _op("paged_decode_attention")(q.contiguous(), k_cache, v_cache, table.contiguous(), pos.contiguous(),
                                         active.contiguous(), sinks, int(window or 0), float(scale), float(k_scale),
                                         float(v_scale), out_dtype)


def paged_decode_attention_partial(q, k_cache, v_cache, table, pos, first, active, scale: float,
                                   k_scale: float = 1.0, v_scale: float = 1.0
                                   ) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = _op("paged_decode_attention_partial")(q.contiguous(), k_cache, v_cache, table.contiguous(),
                                                     pos.contiguous(), first.contiguous(), active.contiguous(),
                                                     float(scale), float(k_scale), float(v_scale))
    return out, lse


def rope_kv_write(qkv, cos, sin, k_cache, v_cache, slot, num_heads: int, k_scale: float = 1.0,
                  v_scale: float = 1.0) -> torch.Tensor:
    return _op("rope_kv_write")(qkv.contiguous(), cos, sin, k_cache, v_cache, slot.contiguous(), int(num_heads),
                                float(k_scale), float(v_scale))


def kv_gather(k_cache, v_cache, block_ids, k_scale: float, v_scale: float, dtype: torch.dtype
              ) -> tuple[torch.Tensor, torch.Tensor]:
    return _op("kv_gather")(k_cache, v_cache, block_ids.contiguous(), float(k_scale), float(v_scale), dtype)


def rms_norm(x, weight, eps: float) -> torch.Tensor:
    return _op("rms_norm")(x.contiguous(), weight, float(eps))


def prefill_attention(q, k, v, q_pos, k_start: int, sinks, scale: float, window: int = 0) -> torch.Tensor:
    return _op("prefill_attention")(q.contiguous(), k.contiguous(), v.contiguous(), q_pos.contiguous(), int(k_start),
                                    sinks, float(scale), int(window))


def prefill_attention_supported(dtype: torch.dtype, head_dim: int) -> bool:
    """The kernel runs bf16 inputs on every build, any head dim (the native kernels loaded)."""
    ops = load()
    return ops is not None and dtype == torch.bfloat16 and bool(ops.prefill_attention_supported(head_dim))


# the per-layer stacks `gk_decode_layers` takes, in its order (`LayerWeights` field names)
GK_STACKS = ("input_norm", "qkv_w", "qkv_b", "o_w", "o_b", "sinks", "post_norm", "router_w", "router_b",
             "gate_up_blocks", "gate_up_scales", "gate_up_bias", "down_blocks", "down_scales", "down_bias")


def gk_decode_layers(x, stacks, k_bufs, v_bufs, layer_buffer, layer_sliding, layer_group, cos, sin, full_table,
                     swa_table, full_slot, swa_slot, pos, pos_swa, active, num_heads: int, window: int, eps: float,
                     scale: float, k_scale: float, v_scale: float, top_k: int, alpha: float, limit: float
                     ) -> torch.Tensor:
    """Every layer of a GK decode step in one call (MXFP4 experts, one rank): x [Bt, H] embedded tokens ->
    the hidden state after the last layer. `stacks`: the `GK_STACKS` tensors [L, ...]; layer i attends over KV
    buffer `layer_buffer[i]` with the sliding (window) or full tables [G, Bt, n] and write slots [G, Bt] of
    group `layer_group[i]`. The same kernels in the same order as the Python layer loop over the ops (bit-equal
    to it), without its host work between them. Every projection must take the kernel (rows within
    `linear_max_rows`)."""
    return _op("gk_decode_layers")(x.contiguous(), list(stacks), list(k_bufs), list(v_bufs),
                                   [int(b) for b in layer_buffer], [int(s) for s in layer_sliding],
                                   [int(g) for g in layer_group], cos, sin, full_table.contiguous(),
                                   swa_table.contiguous(), full_slot.contiguous(), swa_slot.contiguous(), pos, pos_swa,
                                   active.contiguous(), int(num_heads), int(window or 0), float(eps), float(scale),
                                   float(k_scale), float(v_scale), int(top_k), float(alpha), float(limit))
