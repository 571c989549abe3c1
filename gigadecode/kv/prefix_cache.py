"""Automatic prefix caching: full KV blocks found again by the tokens that made them.

A full block of B tokens is named by a hash chain over the tokens from the sequence's start
(`block_hashes`: block i's hash covers its own B token ids and block i-1's hash), so two requests whose
first k·B tokens agree name the same k blocks. The KV of those tokens depends on nothing else (the same
model and KV cache), so a new request can take them instead of computing them again.

`PrefixCache` maps (KV group, hash) -> block id for blocks whose KV is complete. A block stays named while
it is held and after it is freed: a free named block sits in the pool's free list and is handed out again
by a hit (its ref count goes back up) or, once it reaches the front of the free list, reused for other
tokens, which unnames it (`evict`). Nothing is ever written into a named block: a request writes only at
positions past what it computed or took from the cache, and only whole blocks are named.

Which blocks a hit of L tokens needs differs by group: full attention all of [0, L/B); a sliding window
only those its next query can see (`SingleTypeManager.num_skipped_blocks`), the rest stay null blocks.
"""

from __future__ import annotations

import hashlib
from array import array


def block_hashes(token_ids: list[int], block_size: int, num_blocks: int, known: list[bytes]) -> list[bytes]:
    """`known` (the hashes of the first len(known) blocks) extended to the first `num_blocks` full blocks of
    `token_ids` (in place; also returned)."""
    for i in range(len(known), num_blocks):
        h = hashlib.blake2b(known[-1] if known else b"", digest_size=16)
        h.update(array("q", token_ids[i * block_size:(i + 1) * block_size]).tobytes())
        known.append(h.digest())
    return known


class PrefixCache:
    """(group id, block hash) <-> block id, for blocks whose KV is complete."""

    def __init__(self) -> None:
        self._block: dict[tuple[int, bytes], int] = {}
        self._key: dict[int, tuple[int, bytes]] = {}

    def __len__(self) -> int:
        return len(self._block)

    def lookup(self, group: int, block_hash: bytes) -> int | None:
        return self._block.get((group, block_hash))

    def insert(self, group: int, block_hash: bytes, block_id: int) -> None:
        """Name `block_id`; a name already taken (the same tokens computed twice) keeps its first block, and
        a block keeps its first name."""
        key = (group, block_hash)
        if key not in self._block and block_id not in self._key:
            self._block[key] = block_id
            self._key[block_id] = key

    def evict(self, block_id: int) -> None:
        """The block is handed out for other tokens: forget its name (no-op when it has none)."""
        key = self._key.pop(block_id, None)
        if key is not None:
            del self._block[key]
