"""The distributed greedy argmax (docs/design.md, "Parallel").

The lm_head is vocab-sharded: each rank reduces its shard to a per-row `(value, global index)` with
`shard_argmax`, the pairs are gathered and `reduce_argmax` picks the winner. The larger value wins and ties go
to the lowest global index, so the result is exactly `torch.argmax` over the whole vocabulary (ties, all `-inf`
rows, and NaN, which `torch.argmax` treats as the maximum: the first NaN wins). `greedy` is the single-process
reference that splits the vocabulary into contiguous shards and runs them all.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

#: The index an empty shard reports: larger than every real token id, so it never wins a tie.
NO_INDEX = torch.iinfo(torch.int64).max


def vocab_shard(vocab_size: int, num_shards: int, rank: int) -> tuple[int, int]:
    """[start, stop) of shard `rank`: contiguous shards of ceil(V / S) ids, the last ones shorter
    (possibly empty when S does not divide V evenly enough)."""
    if vocab_size < 1 or num_shards < 1 or not 0 <= rank < num_shards:
        raise ValueError(f"bad vocab shard: vocab_size={vocab_size}, num_shards={num_shards}, rank={rank}")
    size = -(-vocab_size // num_shards)
    start = min(rank * size, vocab_size)
    return start, min(start + size, vocab_size)


def shard_argmax(logits_shard: torch.Tensor, vocab_offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One rank's half of the distributed argmax.

    logits_shard [B, Vs]: this rank's slice of the logits (global ids vocab_offset … vocab_offset+Vs-1;
    slice off any padding columns first). Returns (values [B] in the logits' dtype, indices [B] int64
    global ids): the row max and its first position (torch.argmax; NaN counts as the max). An empty
    shard reports (-inf, NO_INDEX), which never wins.
    """
    if logits_shard.dim() != 2:
        raise ValueError(f"logits_shard must be [B, Vs] (got shape {tuple(logits_shard.shape)})")
    b, vs = logits_shard.shape
    if vs == 0:
        return (torch.full((b,), -math.inf, dtype=logits_shard.dtype, device=logits_shard.device),
                torch.full((b,), NO_INDEX, dtype=torch.int64, device=logits_shard.device))
    local = torch.argmax(logits_shard, dim=-1)                              # [B]
    values = logits_shard.gather(1, local[:, None]).squeeze(1)             # [B]
    return values, local + vocab_offset


def reduce_argmax(values: torch.Tensor | Sequence[torch.Tensor],
                  indices: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
    """Combine the gathered per-shard results: values [S, B], indices [S, B] (or S tensors of [B], as
    all_gather returns them) -> global argmax [B] int64. The larger value wins; equal values go to the
    lowest global index; any NaN beats every number (the lowest-index NaN wins), as in torch.argmax."""
    if not isinstance(values, torch.Tensor):
        values = torch.stack(list(values))
    if not isinstance(indices, torch.Tensor):
        indices = torch.stack(list(indices))
    if values.dim() != 2 or values.shape != indices.shape:
        raise ValueError(f"values and indices must both be [S, B] (got {tuple(values.shape)} and "
                         f"{tuple(indices.shape)})")
    nan = values.isnan()                                                    # [S, B]
    best = values.masked_fill(nan, -math.inf).amax(dim=0)                   # [B]
    winner = torch.where(nan.any(dim=0), nan, values == best)               # [S, B] candidates
    return indices.masked_fill(~winner, NO_INDEX).amin(dim=0)               # [B]


def greedy(logits: torch.Tensor, num_shards: int = 1) -> torch.Tensor:
    """Argmax over the vocabulary of logits [B, V] -> [B] int64, computed as `num_shards` vocab-sharded
    ranks would (contiguous shards, `vocab_shard`) and reduced: the single-process reference of the
    distributed argmax. Equals `torch.argmax(logits, -1)` for every input."""
    if logits.dim() != 2 or logits.shape[1] == 0:
        raise ValueError(f"logits must be [B, V] with V >= 1 (got shape {tuple(logits.shape)})")
    v = logits.shape[1]
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1 (got {num_shards})")
    parts = []
    for rank in range(num_shards):
        start, stop = vocab_shard(v, num_shards, rank)
        parts.append(shard_argmax(logits[:, start:stop], start))
    return reduce_argmax([p[0] for p in parts], [p[1] for p in parts])
