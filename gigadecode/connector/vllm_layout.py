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
`unpack_pages` turns raw pages into token-major K and V; `token_plan` says which token of which remote page
goes to which local slot, and `repack_tokens` writes them into this engine's cache with `kv.cache.write_kv`
(our FP8 rounding, our packed-K order), so what a vLLM producer computed lands exactly as if this engine had
computed those K/V values itself.
"""

from __future__ import annotations

import torch

from ..kv.cache import write_kv
from ..kv.spec import cdiv
from .base import TransferError
from .params import KVTransferParams

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


def default_layout(element: int, block: int) -> str:
    """vLLM's own choice on this kind of CPU: AMX tiles for bf16 pages whose block is a multiple of 32."""
    return "amx" if element == 2 and block % 32 == 0 and torch.cpu._is_amx_tile_supported() else "vec"


def token_plan(params: KVTransferParams, remote_block: int, local_tables: list[list[int]], local_block: int,
               windows: list[int | None]) -> list[list[tuple[int, int, int]]]:
    """Per KV group: (index into that group's remote list, token offset in that remote block, local slot) for
    every computed token this engine needs (a sliding group: the window the next query sees). TransferError
    when one of them is not in a block the producer sent, or has no local block."""
    n = params.num_computed_tokens or 0
    plans = []
    for g, (ids, table, window) in enumerate(zip(params.remote_block_ids or [], local_tables, windows)):
        first_logical = cdiv(n, remote_block) - len(ids)            # the list is the sequence's tail
        lo = max(0, n - window + 1) if window else 0
        plan = []
        for p in range(lo, n):
            k = p // remote_block - first_logical
            if not 0 <= k < len(ids) or ids[k] == 0:
                raise TransferError(f"KV group {g}: token {p} is in no block the vLLM prefill sent")
            lb = table[p // local_block] if p // local_block < len(table) else 0
            if lb == 0:
                raise TransferError(f"KV group {g}: no local block for token {p}")
            plan.append((k, p % remote_block, lb * local_block + p % local_block))
        plans.append(plan)
    return plans


def repack_tokens(kv, staging: torch.Tensor, cols: torch.Tensor, offs: torch.Tensor, slots: torch.Tensor,
                  heads: tuple[int, int], model_heads: int, head_dim: int, block: int, dtype: torch.dtype,
                  layout: str) -> None:
    """Write tokens from vLLM pages into this engine's KV: staging uint8 [regions, m, page] (region r = this
    engine's buffer r), per token its page column `cols`, its offset in that page `offs` and its local slot
    `slots` [T]; the kv heads [h0, h1) of the model's `model_heads` are this cache's."""
    h0, h1 = heads
    uniq = torch.unique(cols)
    where = torch.searchsorted(uniq, cols)
    for r in range(staging.shape[0]):
        k, v = unpack_pages(staging[r, uniq], model_heads, block, head_dim, dtype, layout)   # [m, H, B, D]
        kt = k[where, h0:h1, offs].to(kv.compute_dtype)                  # [T, heads here, D]
        vt = v[where, h0:h1, offs].to(kv.compute_dtype)
        write_kv(kv.k_buf(r), kv.v_buf(r), slots, kt, vt, kv.block_size, kv.k_scale, kv.v_scale)
