"""The KV page of a vLLM CPU engine, and its repack into this engine's per-buffer KV.

vLLM's CPU attention (`CPU_ATTN`, layout `LBHNC`) keeps the KV of one layer of one block as one page: for
each kv head h, first its K part, then its V part, each `B·D` elements of the KV dtype (B = vLLM's block
size, D = head dim). Inside a part the element order depends on the CPU kernel vLLM chose at start-up,
which the handshake does not say (its `_get_attn_isa`: "amx" when the CPU has AMX tiles, the model is
bf16 and B % 32 == 0, else "vec" on x86):

    vec   K [D][B]                 element (t, d) at d·B + t
          V [B][D]                 element (t, d) at t·D + d
    amx   K [B/16][D/2][16][2]     element (t, d) at ((t//16)·(D/2) + d//2)·32 + (t%16)·2 + d%2
          V [D/16][B/2][16][2]     element (t, d) at (d//16)·(16·B) + (t//2)·32 + (d%16)·2 + t%2

(t = token in the block, d = head dim index). FP8 KV (e4m3) uses the same orders with one-byte elements.
`unpack_pages` turns raw pages into token-major K and V; the reader then writes the tokens it needs into
its own cache with `kv.cache.write_kv` (our FP8 rounding, our packed-K order), so what a vLLM producer
computed lands exactly as if this engine had computed those K/V values itself.
"""

from __future__ import annotations

import torch

LAYOUTS = ("vec", "amx")
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "fp8": torch.float8_e4m3fn}


def page_bytes(heads: int, block: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one vLLM page (one layer, one block): K and V of every kv head."""
    return 2 * heads * block * head_dim * torch.empty((), dtype=dtype).element_size()


def unpack_pages(raw: torch.Tensor, heads: int, block: int, head_dim: int, dtype: torch.dtype, layout: str
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """raw uint8 [n, page] (n pages) -> k, v [n, heads, block, head_dim] in `dtype` (token-major)."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown vLLM KV layout {layout!r} (one of {LAYOUTS})")
    H, B, D = heads, block, head_dim
    n = raw.shape[0]
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] != page_bytes(H, B, D, dtype):
        raise ValueError(f"vLLM pages: expected uint8 [n, {page_bytes(H, B, D, dtype)}], got {raw.dtype} "
                         f"{tuple(raw.shape)} ({H} heads × block {B} × dim {D} of {dtype})")
    if layout == "amx" and (B % 16 or D % 16):
        raise ValueError(f"vLLM's AMX layout needs block and head dim multiples of 16 (got {B}, {D})")
    parts = raw.contiguous().view(n, H, 2, -1).view(dtype)                # [n, H, 2, B·D]
    k, v = parts[:, :, 0], parts[:, :, 1]
    if layout == "vec":
        k = k.reshape(n, H, D, B).transpose(-1, -2)
        v = v.reshape(n, H, B, D)
    else:
        k = k.reshape(n, H, B // 16, D // 2, 16, 2).permute(0, 1, 2, 4, 3, 5).reshape(n, H, B, D)
        v = v.reshape(n, H, D // 16, B // 2, 16, 2).permute(0, 1, 3, 5, 2, 4).reshape(n, H, B, D)
    return k.contiguous(), v.contiguous()
