"""Attention control for one GK decode step: built once ("plan"), read by every layer ("run").

For batch slot b decoding the token at position p (0-based) with KV block size B and window W:
- full table: block ids of blocks 0 … p//B (padded with the null block 0);
  `kv_cache_update_idx = full[p//B]·B + p%B`.
- trimmed sliding table: the ≤ cdiv(W-1, B)+1 blocks from s = max(0, p-W+1)//B to p//B;
  window-frame position `pos_swa = p - s·B`; `kv_cache_update_idx_swa = swa[p//B - s]·B + p%B`.
- inactive (padding) slots write only into the null block 0 and attend to nothing real.
The sliding table of a request may hold null entries before s (freed blocks); trimming drops them.

Decode context parallel (`tokens`, a rank's `kv.dcp.TokenShard`): tables index this rank's *local* tokens,
so the frames are local too. A query at position p sees the local keys [f, l] = `tokens.visible(p, W)`:
the full frame position is l with `first = 0`; the sliding table starts at block s = f // B with frame
position l - s·B and `first_swa = f - s·B` (the kernel sees columns [first, pos]; f > l: nothing). RoPE
stays at the global position p. A token another rank holds is written to the null block.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..kv.dcp import TokenShard
from ..kv.spec import cdiv
from ..rope import Rope


@dataclass
class AttentionControl:
    """Per-kind group axes: GPT-OSS has one sliding and one full group (Gs = Gf = 1); other layer
    patterns may group into more (see kv/spec.py), each with its own table and write index."""

    cos: torch.Tensor                      # [Bt, d/2] RoPE at pos (compute dtype)
    sin: torch.Tensor                      # [Bt, d/2]
    full_table: torch.Tensor               # [Gf, Bt, nf] int64 block ids, null-padded
    swa_table: torch.Tensor                # [Gs, Bt, ns] int64 trimmed sliding tables, ns = cdiv(W-1, B)+1
    active: torch.Tensor                   # [Bt] bool
    pos: torch.Tensor                      # [Bt] int64 absolute positions (full-layer frame)
    pos_swa: torch.Tensor                  # [Bt] int64 window-frame positions (sliding-layer frame)
    kv_cache_update_idx: torch.Tensor      # [Gf, Bt] int64 slot written by full layers
    kv_cache_update_idx_swa: torch.Tensor  # [Gs, Bt] int64 slot written by sliding layers
    first: torch.Tensor | None = None      # DCP: [Bt] int64 first visible full-frame column (else None)
    first_swa: torch.Tensor | None = None  # DCP: [Bt] int64 first visible sliding-frame column

    @property
    def kv_first(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(first, first_swa) under DCP, else None (the kernel's `kv_first`)."""
        return None if self.first is None else (self.first, self.first_swa)


def swa_table_width(window: int, block_size: int) -> int:
    return cdiv(window - 1, block_size) + 1 if window > 0 else 1


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def build_attention_control(positions: list[int], tables: list[list[list[int]]], group_sliding: list[bool],
                            rope: Rope, block_size: int, window: int, batch_bucket: int | None = None,
                            full_width: int | None = None, tokens: TokenShard | None = None) -> AttentionControl:
    """positions[b]: position of the token slot b decodes; tables[b][g]: that request's block table for
    KV group g (logical block index -> id; 0 = null); group_sliding[g]: is group g a sliding group.
    Slots past len(positions) up to `batch_bucket` are padding. `full_width` pads the full tables
    (default: the next power of two that fits, so compiled programs see few shapes). `tokens`: this
    rank's DCP share (local frames, see the module docstring)."""
    if tokens is not None and not tokens.trivial:
        return _dcp_attention_control(positions, tables, group_sliding, rope, block_size, window, batch_bucket,
                                      full_width, tokens)
    B = block_size
    bt, f_groups, s_groups, nf, ns = _widths(len(positions), max((p // B + 1 for p in positions), default=1),
                                             group_sliding, B, window, batch_bucket, full_width)
    # filled in numpy, made tensors at the end (a torch op per slot and group cost ~70 us a slot at batch 32:
    # 2.3 ms of a step)
    full = np.zeros((len(f_groups), bt, nf), dtype=np.int64)
    swa = np.zeros((len(s_groups), bt, ns), dtype=np.int64)
    upd = np.zeros((len(f_groups), bt), dtype=np.int64)
    upd_swa = np.zeros((len(s_groups), bt), dtype=np.int64)
    pos, pos_swa = np.zeros(bt, dtype=np.int64), np.zeros(bt, dtype=np.int64)
    for b, p in enumerate(positions):
        cur = p // B
        for i, g in enumerate(f_groups):
            ft = _blocks(tables[b][g], 0, cur + 1)
            full[i, b, : cur + 1] = ft
            upd[i, b] = ft[-1] * B + p % B
        s = max(0, p - window + 1) // B if window > 0 else cur
        for i, g in enumerate(s_groups):
            st = _blocks(tables[b][g], s, cur + 1)
            swa[i, b, : len(st)] = st
            upd_swa[i, b] = st[-1] * B + p % B
        pos[b] = p
        pos_swa[b] = p - s * B
    active = torch.zeros(bt, dtype=torch.bool)
    active[: len(positions)] = True
    pos_t = torch.from_numpy(pos)
    cos, sin = rope.cos_sin(pos_t)
    return AttentionControl(cos, sin, torch.from_numpy(full), torch.from_numpy(swa), active, pos_t,
                            torch.from_numpy(pos_swa), torch.from_numpy(upd), torch.from_numpy(upd_swa))


def _blocks(table: list[int], j0: int, j1: int) -> list[int]:
    """Block ids of logical blocks [j0, j1) of `table`, each a real block (not null, not past the table)."""
    part = list(table[j0:j1])
    if len(part) < j1 - j0 or 0 in part:
        _block(table, next(j for j in range(j0, j1) if j >= len(table) or table[j] == 0))
    return part


def _widths(n: int, need: int, group_sliding: list[bool], B: int, window: int, batch_bucket: int | None,
            full_width: int | None) -> tuple[int, list[int], list[int], int, int]:
    """The step's shape -> (bucket, full groups, sliding groups, full table width nf, sliding width ns); `need`:
    the widest full table."""
    bt = batch_bucket or n
    if bt < n:
        raise ValueError(f"batch bucket {bt} < batch {n}")
    nf = full_width or next_pow2(need)
    if nf < need:
        raise ValueError(f"full table width {nf} < {need} blocks needed")
    f_groups = [g for g, s in enumerate(group_sliding) if not s]
    s_groups = [g for g, s in enumerate(group_sliding) if s]
    return bt, f_groups, s_groups, nf, swa_table_width(window, B)


def _tables(n: int, need: int, group_sliding: list[bool], B: int, window: int, batch_bucket: int | None,
            full_width: int | None):
    """The step's empty (null-block) tables and write indices -> (bucket, full groups, sliding groups,
    full [Gf, Bt, nf], swa [Gs, Bt, ns], upd [Gf, Bt], upd_swa [Gs, Bt]); `need`: widest full table."""
    bt, f_groups, s_groups, nf, ns = _widths(n, need, group_sliding, B, window, batch_bucket, full_width)
    return (bt, f_groups, s_groups, torch.zeros(len(f_groups), bt, nf, dtype=torch.long),
            torch.zeros(len(s_groups), bt, ns, dtype=torch.long), torch.zeros(len(f_groups), bt, dtype=torch.long),
            torch.zeros(len(s_groups), bt, dtype=torch.long))


def _block(table: list[int], j: int) -> int:
    if j >= len(table) or table[j] == 0:
        raise ValueError(f"block table has no block for logical block {j} (table {table})")
    return table[j]


def _dcp_attention_control(positions: list[int], tables: list[list[list[int]]], group_sliding: list[bool],
                           rope: Rope, block_size: int, window: int, batch_bucket: int | None,
                           full_width: int | None, tokens: TokenShard) -> AttentionControl:
    n, B = len(positions), block_size
    need = max((max(tokens.count(p + 1) - 1, 0) // B + 1 for p in positions), default=1)
    # write index 0 (the null block): a token another rank holds, or padding
    bt, f_groups, s_groups, full, swa, upd, upd_swa = _tables(n, need, group_sliding, B, window, batch_bucket,
                                                              full_width)
    pos = torch.full((bt,), -1, dtype=torch.long)
    pos_swa = torch.full((bt,), -1, dtype=torch.long)
    first = torch.zeros(bt, dtype=torch.long)
    first_swa = torch.zeros(bt, dtype=torch.long)
    active = torch.zeros(bt, dtype=torch.bool)
    for b, p in enumerate(positions):
        last = tokens.count(p + 1) - 1                                   # local index of the last visible key
        mine = tokens.owns(p)                                            # then `last` is p's own slot
        for i, g in enumerate(f_groups):
            ft = [_block(tables[b][g], j) for j in range(last // B + 1)] if last >= 0 else []
            full[i, b, : len(ft)] = torch.tensor(ft, dtype=torch.long)
            if mine:
                upd[i, b] = ft[last // B] * B + last % B
        f, l = tokens.visible(p, window if window > 0 else None)
        s = f // B
        for i, g in enumerate(s_groups):
            st = [_block(tables[b][g], j) for j in range(s, l // B + 1)] if l >= f else []
            swa[i, b, : len(st)] = torch.tensor(st, dtype=torch.long)
            if mine:
                upd_swa[i, b] = st[-1] * B + l % B
        pos[b], first[b] = last, 0
        pos_swa[b], first_swa[b] = l - s * B, f - s * B
        active[b] = True
    gpos = torch.zeros(bt, dtype=torch.long)
    gpos[:n] = torch.tensor(positions, dtype=torch.long)
    cos, sin = rope.cos_sin(gpos)                                        # RoPE at the global position
    return AttentionControl(cos, sin, full, swa, active, pos, pos_swa, upd, upd_swa, first, first_swa)
