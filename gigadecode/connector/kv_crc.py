"""The CRC32s that prove a request's KV arrived intact: a producer computes them over the blocks it leases
(`kv_crc32`, and `kv_crc32_heads` per kv head, for a consumer that holds other heads), a consumer checks the
blocks its reads landed in against them (`crc_matches`). The byte order is the contract: group by group,
block by block, every buffer's K then V (within a block, heads outermost)."""

from __future__ import annotations

import zlib

import torch

from .params import RemoteRank


def kv_crc32(kv, block_ids: list[list[int]]) -> int:
    """CRC32 of a request's KV bytes: group by group, block by block, every buffer's K then V."""
    crc = 0
    for ids in block_ids:
        if not ids:
            continue
        idx = torch.tensor(ids, dtype=torch.long)
        for buf in kv.group_bufs:
            for half in (buf[0], buf[1]):
                crc = zlib.crc32(half.view(torch.uint8).index_select(0, idx).numpy().tobytes(), crc)
    return crc


def kv_crc32_heads(kv, block_ids: list[list[int]], heads: tuple[int, int] | None = None) -> list[int]:
    """One CRC32 per kv head of the cache (local head index h in `heads`, default all): that head's bytes
    of a request's KV, group by group, block by block, every buffer's K then V. Lets a consumer that
    holds other kv heads (prefill TP != decode TP) check exactly the slice it read."""
    h0, h1 = heads if heads is not None else (0, kv.group_bufs[0].shape[2])
    crcs = [0] * (h1 - h0)
    for ids in block_ids:
        if not ids:
            continue
        idx = torch.tensor(ids, dtype=torch.long)
        for buf in kv.group_bufs:
            for half in (buf[0], buf[1]):                   # [nb, kv, ...]: heads outermost within a block
                sel = half.view(torch.uint8).index_select(0, idx)
                for i, h in enumerate(range(h0, h1)):
                    crcs[i] = zlib.crc32(sel[:, h].contiguous().numpy().tobytes(), crcs[i])
    return crcs


def crc_matches(kv, local_ids: list[list[int]], src: RemoteRank, local_heads: tuple[int, int],
                heads: tuple[int, int] | None = None) -> bool:
    """Did the KV of `local_ids` arrive intact? Global kv heads `heads` (default: all of `local_heads`, the
    heads this cache holds) are checked against the producer rank's per-head CRCs (`kv_crc32_heads`, from
    global head `kv_head_start` on) when both sides hold different heads, else against its `kv_crc32`."""
    h0, h1 = heads or local_heads
    r0 = src.kv_head_start
    per_head = src.kv_crc32_heads
    if per_head is None or (heads is None and (r0, r0 + len(per_head)) == tuple(local_heads)):
        if (h0, h1) != tuple(local_heads) or src.kv_crc32 is None:
            return False                                  # no CRC to check this slice against
        return kv_crc32(kv, local_ids) == src.kv_crc32
    if h0 < r0 or h1 > r0 + len(per_head):
        return False
    got = kv_crc32_heads(kv, local_ids, (h0 - local_heads[0], h1 - local_heads[0]))
    return got == list(per_head[h0 - r0: h1 - r0])
