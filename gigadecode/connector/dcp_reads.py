"""DCP reads: a decode rank with decode context parallel reads its share of a prefill engine's KV.

The prefill engine keeps every token (no DCP, any TP); the decode ranks of a DCP group each hold the tokens
of their chunks (`kv.dcp.TokenShard`). The interleave is a multiple of the block size, so each block of the
prefill's sequence belongs to one DCP rank, and is exactly one of that rank's local blocks: a rank READs
whole remote blocks — the ones it owns, each into the local block at its local index — and only its kv
heads' byte range of each (as without DCP). Packed-FP8 K keeps its token pairs whole for free.

Checking the bytes: the prefill's answer carries one CRC32 per kv head over the head's bytes of every live
block (`kv_crc.kv_crc32_heads`: group by group, buffer by buffer, K then V, block by block). No
single DCP rank holds all of them, but CRC32 is affine over GF(2): if the ranks' shares are disjoint and
M_j is the head's byte stream with every block rank j does not hold replaced by zeros, then

    crc32(M) = crc32(M_0) ^ crc32(M_1) ^ … ^ crc32(M_{N-1}) ^ (crc32(0^L) if N is even)

(L = the stream's length). Each rank computes its crc32(M_j) per head over the slices it read, the TP
group exchanges them (a few ints per head) and every rank compares the combination with the prefill's
CRC: a slice corrupted on any rank fails the request on all of them.
"""

from __future__ import annotations

import zlib

import torch

from ..kv.dcp import TokenShard
from .base import TransferError
from .params import KVTransferParams

_ZERO_CHUNK = bytes(1 << 20)


def zeros_crc(n: int) -> int:
    """crc32 of n zero bytes."""
    crc = 0
    while n > 0:
        k = min(n, len(_ZERO_CHUNK))
        crc = zlib.crc32(memoryview(_ZERO_CHUNK)[:k], crc)
        n -= k
    return crc


def dcp_pairs(params: KVTransferParams, local_tables: list[list[int]], block_size: int, tokens: TokenShard,
              windows: list[int | None]) -> tuple[list[tuple[int, int]], list[list[tuple[int, int]]]]:
    """The remote blocks this DCP rank owns, paired with its local blocks -> (pairs (remote id, local id),
    per group [(index into that group's remote_block_ids, local id)]).

    Global block G holds positions [G·B, (G+1)·B); this rank owns it when `tokens.owns(G·B)`, and it is local
    block `tokens.local_index(G·B) // B`. A block the next query needs (past the sliding window's start,
    `windows[g]`; every block of a full group) must have been sent; blocks wholly before the window are
    dead (never sent, no data needed) even where the lockstep table still holds them."""
    n, B = params.num_computed_tokens or 0, block_size
    pairs: list[tuple[int, int]] = []
    slots: list[list[tuple[int, int]]] = []
    for g, (rids, j0, table, window) in enumerate(zip(params.remote_block_ids or [], params.remote_first_block or [],
                                                      local_tables, windows)):
        needed_from = max(0, n - window + 1) // B if window else 0     # first block a query still sees
        last = (n - 1) // B if n > 0 else -1                            # last block holding a computed token
        mine: list[tuple[int, int]] = []
        for G in range(needed_from, last + 1):
            if not tokens.owns(G * B):
                continue
            if not j0 <= G < j0 + len(rids):
                raise TransferError(f"KV group {g}: block {G} was not sent by the prefill "
                                    f"(it sent blocks {j0}..{j0 + len(rids) - 1})")
            k = tokens.local_index(G * B) // B
            lb = table[k] if k < len(table) else 0
            if lb == 0:
                raise TransferError(f"KV group {g}: no local block for the prefill's block {G} (local block {k})")
            pairs.append((int(rids[G - j0]), int(lb)))
            mine.append((G - j0, int(lb)))
        slots.append(mine)
    return pairs, slots


def partial_head_crcs(kv, slots: list[list[tuple[int, int]]], group_lens: list[int], heads: tuple[int, int]
                      ) -> list[int]:
    """Per local kv head in `heads` [h0, h1): crc32 of that head's byte stream (as `kv_crc32_heads` orders
    it over `group_lens[g]` live blocks per group) with the blocks this rank did not read left as zeros."""
    h0, h1 = heads
    crcs = [0] * (h1 - h0)
    for (mine, n_live) in zip(slots, group_lens):
        if n_live == 0:
            continue
        idx = torch.tensor([i for i, _ in mine], dtype=torch.long)
        ids = torch.tensor([lb for _, lb in mine], dtype=torch.long)
        for buf in kv.group_bufs:
            for half in (buf[0], buf[1]):                               # [nb, kv, ...]
                raw = half.view(torch.uint8)
                head_len = raw[0, 0].numel()
                for i, h in enumerate(range(h0, h1)):
                    stream = torch.zeros(n_live, head_len, dtype=torch.uint8)
                    if len(mine):
                        stream[idx] = raw.index_select(0, ids)[:, h].reshape(len(mine), head_len)
                    crcs[i] = zlib.crc32(stream.numpy().tobytes(), crcs[i])
    return crcs


def stream_length(kv, group_lens: list[int]) -> int:
    """Bytes of one kv head's stream over a request's live blocks (every buffer, K and V)."""
    head_len = kv.group_bufs[0][0, 0, 0].numel() * kv.group_bufs[0].element_size()
    return sum(group_lens) * len(kv.group_bufs) * 2 * head_len


def combine(partials: list[int], length: int) -> int:
    """The crc32 of the whole stream from the ranks' zero-filled partial CRCs (module docstring)."""
    crc = 0
    for c in partials:
        crc ^= c
    return crc ^ zeros_crc(length) if len(partials) % 2 == 0 else crc
