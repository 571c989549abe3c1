"""Decode context parallel (DCP): which of a sequence's tokens one rank of a DCP group holds.

The N ranks of a DCP group share the same kv heads and split every sequence's tokens between them,
round-robin in chunks of `interleave` tokens: the token at position p belongs to rank `(p // I) % N`.
Each rank stores its own tokens contiguously in *local* order (local index = how many of its tokens come
before), so its block tables are ordinary tables over local indices:

    local index of p (owned)   li = (p // (I·N))·I + p % I
    position of local index    p  = (li // I)·I·N + j·I + li % I          (rank j)
    tokens of rank j in [0, n) count_j(n) = (n // (I·N))·I + clamp(n % (I·N) - j·I, 0, I)

`interleave` is a multiple of the block size, so every block holds the tokens of one rank only: a rank's
local block is exactly one block of the unsharded sequence (what a DCP decode rank reads from a prefill
engine that has no DCP: whole blocks, so packed-FP8 token pairs never split).

Attention for a query at position P sees the keys at positions in (P - W, P] (W = ∞ on full layers); on
rank j those are a contiguous run of local indices [count_j(P - W + 1), count_j(P + 1) - 1], possibly
empty (that rank then contributes nothing to the merge).

The ranks of a DCP group run identical schedules (they are ranks of one TP group), so their block pools
must stay in lockstep: every rank allocates for a request the blocks the *fullest* rank needs (rank 0,
`count_0(n)`) and frees sliding blocks only once the *emptiest* rank (rank N-1) no longer needs them. All
ranks then hold the same block ids, each storing its own tokens in them, ~1/N of the request's KV.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TokenShard:
    """Rank `rank` of a DCP group of `size` ranks, chunks of `interleave` tokens. size 1: every token."""

    size: int = 1
    rank: int = 0
    interleave: int = 1

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size or self.interleave < 1:
            raise ValueError(f"bad DCP shard: rank {self.rank} of {self.size}, interleave {self.interleave}")

    @property
    def trivial(self) -> bool:
        return self.size == 1

    @property
    def period(self) -> int:
        return self.interleave * self.size

    def count(self, n: int, rank: int | None = None) -> int:
        """Tokens of `rank` (default: this one) among positions [0, n)."""
        if self.size == 1:
            return max(0, n)
        if n <= 0:
            return 0
        j = self.rank if rank is None else rank
        I = self.interleave
        full, rest = divmod(n, self.period)
        return full * I + min(max(rest - j * I, 0), I)

    def most(self, n: int) -> int:
        """Tokens the fullest rank (0) holds among [0, n): what every rank allocates for."""
        return self.count(n, 0)

    def least(self, n: int) -> int:
        """Tokens the emptiest rank (N-1) holds among [0, n): what every rank may free before."""
        return self.count(n, self.size - 1)

    def owns(self, p: int) -> bool:
        return self.size == 1 or (p // self.interleave) % self.size == self.rank

    def local_index(self, p: int) -> int:
        """Local index of an owned position p."""
        if self.size == 1:
            return p
        return (p // self.period) * self.interleave + p % self.interleave

    def position(self, li: int) -> int:
        """Position of this rank's local index li."""
        if self.size == 1:
            return li
        I = self.interleave
        return (li // I) * self.period + self.rank * I + li % I

    def positions(self, li):
        """`position` of a tensor of local indices (elementwise)."""
        if self.size == 1:
            return li
        I = self.interleave
        return (li // I) * self.period + self.rank * I + li % I

    def visible(self, p: int, window: int | None) -> tuple[int, int]:
        """Local indices [first, last] of the keys a query at position p sees (first > last: none)."""
        lo = max(0, p - window + 1) if window else 0
        return self.count(lo), self.count(p + 1) - 1
