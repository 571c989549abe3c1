"""KV block bookkeeping: the block pool, one manager per KV group, and the all-groups manager.

Owns *which block ids a request holds*, never KV bytes (those live in `kv.cache`). Modelled on vLLM
v1's `BlockPool` / `FullAttentionManager` / `SlidingWindowManager` / `KVCacheManager`, written anew:

- `BlockPool(num_blocks)`: ids `0 … num_blocks-1`; id 0 is the null block (never handed out, the
  filler of dead table slots and padding writes). FIFO free list, a ref count per block.
- `FullAttentionManager` / `SlidingWindowManager`: one per KV group (`KVCacheConfig.groups`), chosen by
  spec type (`MANAGER_FOR_SPEC`). Per request a block table `list[int]`, index = logical block number
  (tokens `[i·B, (i+1)·B)`). A block id owned by group g holds, in every buffer j, the KV of layer
  `groups[g].layers[j]`.
- Sliding window W: with `c` computed tokens the next query (position c) sees keys `c-W+1 … c`, so
  tokens before `max(0, c-W+1)` (vLLM's `get_num_skipped_tokens`) are dead. Blocks wholly before
  that token go back to the pool and their slots become the null block; a logical block already dead
  when it is first allocated gets the null block, never a real one. Decoding token by token a request
  therefore holds at most `cdiv(W-1, B) + 1` real sliding blocks (a prefill chunk of n new tokens
  holds the blocks its queries need, up to `cdiv(W+n-2, B) + 1`).
- `KVCacheManager`: one pool shared by every group (one global `num_blocks`), all-or-nothing
  allocation across groups so a scheduler can admit by free blocks.
- Decode context parallel (`tokens`, a `dcp.TokenShard`): a rank holds only its share of each sequence
  and its tables index its *local* tokens; token counts are mapped to local counts (allocate for the
  fullest rank of the group, free before the emptiest one), so every rank of the group keeps the same
  tables while holding ~1/N of the tokens.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable
from itertools import accumulate
from typing import ClassVar

from .dcp import TokenShard
from .prefix_cache import PrefixCache, block_hashes
from .spec import AttentionSpec, FullAttentionSpec, KVCacheConfig, KVSpec, SlidingWindowSpec, cdiv

NULL_BLOCK = 0


class KVBlockError(RuntimeError):
    """Misuse of the block pool (double free, unknown block id)."""


class NoFreeBlocks(KVBlockError):
    """Not enough free blocks; nothing was allocated."""

    def __init__(self, requested: int, free: int) -> None:
        super().__init__(f"KV pool exhausted: {requested} blocks requested, {free} free")
        self.requested, self.free = requested, free


# --------------------------------------------------------------------------------------------------
class BlockPool:
    """Block ids 1 … num_blocks-1 handed out FIFO (least recently freed first); id 0 (the null block) never
    is. With a prefix cache, a free block keeps its name until it is handed out for other tokens, and a hit
    takes a named free block back out of the free list (`touch`)."""

    def __init__(self, num_blocks: int, cache: PrefixCache | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1 (block 0 is the null block); got {num_blocks}")
        self.num_blocks = num_blocks
        self.cache = cache
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
        self._ref: list[int] = [0] * num_blocks       # [num_blocks]; the null block stays 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - 1 - len(self._free)

    @property
    def capacity(self) -> int:
        """Blocks a request can ever get (all but the null block)."""
        return self.num_blocks - 1

    def allocate(self, n: int) -> list[int]:
        """n fresh block ids (ref count 1 each); raises NoFreeBlocks and allocates nothing if short."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > len(self._free):
            raise NoFreeBlocks(n, len(self._free))
        ids = [self._free.popitem(last=False)[0] for _ in range(n)]
        for b in ids:
            self._ref[b] = 1
            if self.cache is not None:
                self.cache.evict(b)
        return ids

    def touch(self, ids: Iterable[int]) -> None:
        """Take a reference to cached blocks, held or free (a prefix-cache hit)."""
        for b in ids:
            self._check_id(b)
            if self._ref[b] == 0:
                del self._free[b]
            self._ref[b] += 1

    def share(self, ids: Iterable[int]) -> None:
        """Add a reference to blocks already held (prefix sharing); the null block is ignored."""
        ids = [b for b in ids if b != NULL_BLOCK]
        for b in ids:
            self._check_id(b)
            if self._ref[b] == 0:
                raise KVBlockError(f"cannot share free block {b}")
        for b in ids:
            self._ref[b] += 1

    def free(self, ids: Iterable[int]) -> None:
        """Drop one reference per id; a block returns to the free list at 0. Null block: no-op.

        Checked before anything changes: freeing a block more times than it is referenced raises
        KVBlockError (double free) and leaves the pool untouched.
        """
        counts = Counter(b for b in ids if b != NULL_BLOCK)
        for b, k in counts.items():
            self._check_id(b)
            if self._ref[b] < k:
                raise KVBlockError(f"double free of block {b} (ref count {self._ref[b]}, freed {k}x)")
        for b, k in counts.items():
            self._ref[b] -= k
            if self._ref[b] == 0:
                self._free[b] = None

    def _check_id(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise KVBlockError(f"block id {block_id} out of range [0, {self.num_blocks})")


# --------------------------------------------------------------------------------------------------
class SingleTypeManager:
    """Block tables of one KV group. Subclasses say which tokens are dead (`num_skipped_tokens`)."""

    spec_type: ClassVar[type[AttentionSpec]] = AttentionSpec

    def __init__(self, spec: KVSpec, pool: BlockPool, group_id: int = 0, tokens: TokenShard = TokenShard()) -> None:
        self.spec, self.pool, self.group_id, self.tokens = spec, pool, group_id, tokens
        self.block_size = spec.block_size
        self.tables: dict[str, list[int]] = {}       # req -> [logical block] block id (0 = null)

    # -- what is dead ------------------------------------------------------------------------------
    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Tokens the next query can no longer see (full attention: none)."""
        return 0

    def num_skipped_blocks(self, num_computed_tokens: int) -> int:
        """Logical (local) blocks wholly before the first visible token, on every rank of a DCP group."""
        return self.tokens.least(self.num_skipped_tokens(num_computed_tokens)) // self.block_size

    def _target(self, num_tokens: int) -> int:
        """Table length covering num_tokens tokens (on the fullest rank of a DCP group)."""
        return cdiv(self.tokens.most(num_tokens), self.block_size)

    # -- queries (no mutation) ---------------------------------------------------------------------
    def block_table(self, req_id: str) -> list[int]:
        try:
            return self.tables[req_id]
        except KeyError:
            raise KeyError(f"request {req_id!r} holds no KV blocks in group {self.group_id}") from None

    def num_held(self, req_id: str) -> int:
        """Real (non-null) blocks the request holds in this group."""
        return sum(1 for b in self.tables.get(req_id, ()) if b != NULL_BLOCK)

    def blocks_needed(self, num_tokens: int, num_computed_tokens: int = 0) -> int:
        """Real blocks a *new* request needs to cover num_tokens tokens with num_computed already done."""
        target = self._target(num_tokens)
        return max(0, target - min(self.num_skipped_blocks(num_computed_tokens), target))

    def covers(self, req_id: str, num_tokens: int) -> bool:
        """Whether the request's table already covers num_tokens tokens (`allocate_for` would add nothing)."""
        table = self.tables.get(req_id)
        return table is not None and self._target(num_tokens) <= len(table)

    def num_new_blocks(self, req_id: str, num_tokens: int, num_computed_tokens: int) -> int:
        """Real blocks `allocate_for(req_id, num_tokens, num_computed_tokens)` would take from the pool."""
        table = self.tables.get(req_id, [])
        target = self._target(num_tokens)
        return max(0, target - max(len(table), self.num_skipped_blocks(num_computed_tokens)))

    def _newly_dead(self, req_id: str, num_computed_tokens: int) -> list[int]:
        """Table indices of the real blocks wholly before the first visible token: walking back from there
        to the first null slot (everything before it was nulled already; vLLM's remove_skipped_blocks)."""
        table = self.tables.get(req_id, [])
        i = min(self.num_skipped_blocks(num_computed_tokens), len(table)) - 1
        dead = []
        while i >= 0 and table[i] != NULL_BLOCK:
            dead.append(i)
            i -= 1
        return dead

    # -- mutation ----------------------------------------------------------------------------------
    def allocate_for(self, req_id: str, num_tokens: int, num_computed_tokens: int) -> list[int]:
        """Grow the table to cover num_tokens tokens (num_computed_tokens of them computed); returns the new
        real block ids. Dead blocks are released first (`remove_skipped_blocks`); new slots for logical
        blocks already dead get the null block. Raises NoFreeBlocks (and changes nothing beyond that
        release) when the pool is short."""
        self.remove_skipped_blocks(req_id, num_computed_tokens)
        if self.covers(req_id, num_tokens):            # covered already (most decode steps)
            return []
        table = self.tables.get(req_id, [])
        target = self._target(num_tokens)
        first_real = max(len(table), self.num_skipped_blocks(num_computed_tokens))
        new = self.pool.allocate(max(0, target - first_real))      # raises before any change
        if target > len(table):
            table.extend([NULL_BLOCK] * (min(first_real, target) - len(table)))
            table.extend(new)
        self.tables[req_id] = table
        return new

    def remove_skipped_blocks(self, req_id: str, num_computed_tokens: int) -> int:
        """Free blocks wholly before token `num_skipped_tokens(c)`; their slots become 0. -> count freed."""
        if num_computed_tokens < 0:
            raise ValueError(f"num_computed_tokens must be >= 0 (got {num_computed_tokens})")
        table = self.tables.get(req_id)
        if table is None:
            return 0
        dead = self._newly_dead(req_id, num_computed_tokens)
        if not dead:                                   # most steps of most requests
            return 0
        ids = [table[i] for i in dead]
        for i in dead:
            table[i] = NULL_BLOCK
        self.pool.free(ids)
        return len(ids)

    def trim(self, req_id: str, num_tokens: int) -> int:
        """Free the blocks past those that cover num_tokens tokens, tail first (as `free`) -> count freed."""
        table = self.tables.get(req_id)
        target = self._target(num_tokens)
        if table is None or len(table) <= target:
            return 0
        tail = table[target:]
        del table[target:]
        self.pool.free(reversed(tail))
        return sum(1 for b in tail if b != NULL_BLOCK)

    def free(self, req_id: str) -> None:
        """Release every block of the request (unknown request: no-op)."""
        table = self.tables.pop(req_id, None)
        if table:
            # Tail first (vLLM's order): the most recent blocks are the least likely to be shared.
            self.pool.free(reversed(table))


class FullAttentionManager(SingleTypeManager):
    """Full attention: every token stays visible, so nothing is ever skipped."""

    spec_type = FullAttentionSpec

    def num_skipped_blocks(self, num_computed_tokens: int) -> int:
        return 0                                       # so `_newly_dead` finds nothing at once


class SlidingWindowManager(SingleTypeManager):
    """Sliding window W: tokens before `max(0, c - W + 1)` are dead (vLLM's get_num_skipped_tokens)."""

    spec_type = SlidingWindowSpec

    def __init__(self, spec: SlidingWindowSpec, pool: BlockPool, group_id: int = 0,
                 tokens: TokenShard = TokenShard()) -> None:
        super().__init__(spec, pool, group_id, tokens)
        if spec.sliding_window <= 0:
            raise ValueError(f"sliding window must be > 0 (got {spec.sliding_window})")
        self.window = spec.sliding_window

    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return max(0, num_computed_tokens - self.window + 1)


MANAGER_FOR_SPEC: dict[type[AttentionSpec], type[SingleTypeManager]] = {
    FullAttentionSpec: FullAttentionManager,
    SlidingWindowSpec: SlidingWindowManager,
}


def make_manager(spec: KVSpec, pool: BlockPool, group_id: int = 0, tokens: TokenShard = TokenShard()
                 ) -> SingleTypeManager:
    """The manager for a group's spec (exact type: a sliding spec is not a full one)."""
    try:
        cls = MANAGER_FOR_SPEC[type(spec)]
    except KeyError:
        raise TypeError(f"no KV manager for spec type {type(spec).__name__}") from None
    return cls(spec, pool, group_id, tokens)  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------------
class KVCacheManager:
    """One block pool shared by all KV groups; allocation succeeds in every group or in none."""

    def __init__(self, kv_cache_config: KVCacheConfig, block_size: int | None = None,
                 tokens: TokenShard = TokenShard(), prefix_caching: bool = False) -> None:
        groups = kv_cache_config.groups
        if not groups:
            raise ValueError("KV cache config has no groups")
        for g in groups:
            if block_size is not None and g.spec.block_size != block_size:
                raise ValueError(f"group spec block_size {g.spec.block_size} != manager block_size {block_size}")
        self.config = kv_cache_config
        self.block_size = block_size if block_size is not None else groups[0].spec.block_size
        if prefix_caching and tokens.size > 1:
            raise ValueError("prefix caching needs every token's KV on one rank (no decode context parallel)")
        self.prefix = PrefixCache() if prefix_caching else None
        self.pool = BlockPool(kv_cache_config.num_blocks, self.prefix)
        self.tokens = tokens
        self.managers: list[SingleTypeManager] = [make_manager(g.spec, self.pool, gi, tokens)
                                                  for gi, g in enumerate(groups)]
        self._hashes: dict[str, list[bytes]] = {}      # prefix caching: per request its full blocks' hashes
        self._named: dict[str, int] = {}               # ... and how many of its blocks are named in the cache

    # -- admission ---------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def usage(self) -> float:
        """Fraction of the usable blocks (all but the null block) in use."""
        return self.pool.num_used / self.pool.capacity if self.pool.capacity else 0.0

    def blocks_needed(self, num_tokens: int, num_computed_tokens: int = 0) -> list[int]:
        """Per group: real blocks a new request of num_tokens tokens (num_computed done) needs."""
        return [m.blocks_needed(num_tokens, num_computed_tokens) for m in self.managers]

    # -- mutation ----------------------------------------------------------------------------------
    def allocate(self, req_id: str, num_tokens: int, num_computed_tokens: int) -> bool:
        """Cover num_tokens tokens in every group, or allocate nothing and return False (the pool's
        shortage is an answer here, not an error).

        num_computed_tokens (tokens whose KV is already in the cache) first releases dead sliding
        blocks; that release stands even when the allocation fails (the blocks are dead either way).
        """
        if num_computed_tokens > num_tokens:
            raise ValueError(f"num_computed_tokens {num_computed_tokens} > num_tokens {num_tokens}")
        self.remove_skipped_blocks(req_id, num_computed_tokens)
        if all(m.covers(req_id, num_tokens) for m in self.managers):    # most decode steps
            return True
        need = sum(m.num_new_blocks(req_id, num_tokens, num_computed_tokens) for m in self.managers)
        if need > self.pool.num_free:
            return False
        for m in self.managers:
            m.allocate_for(req_id, num_tokens, num_computed_tokens)
        return True

    def trim(self, req_id: str, num_tokens: int) -> int:
        """Give back, in every group, the blocks past those that cover num_tokens tokens (speculative decoding:
        the slots of rejected drafts, never computed, so never named) -> blocks freed."""
        return sum(m.trim(req_id, num_tokens) for m in self.managers)

    def remove_skipped_blocks(self, req_id: str, num_computed_tokens: int) -> int:
        """Release dead blocks in every group; -> blocks freed."""
        return sum(m.remove_skipped_blocks(req_id, num_computed_tokens) for m in self.managers)

    def free(self, req_id: str) -> None:
        for m in self.managers:
            m.free(req_id)
        self._hashes.pop(req_id, None)
        self._named.pop(req_id, None)

    # -- prefix caching ------------------------------------------------------------------------------
    def take_cached_prefix(self, req_id: str, token_ids: list[int], max_tokens: int) -> int:
        """For a request that holds nothing yet: the longest prefix of `token_ids`, whole blocks and at most
        `max_tokens` tokens, whose blocks every group finds in the cache (a sliding group only those its next
        query sees) -> its length L; the request's tables then hold those blocks (a reference each) and it
        goes on from token L. 0 (nothing taken) without prefix caching or a hit."""
        if self.prefix is None or self.has_request(req_id):
            return 0
        B = self.block_size
        k_max = max(0, max_tokens) // B
        hashes = block_hashes(token_ids, B, k_max, self._hashes.setdefault(req_id, []))[:k_max]
        # per group, the cached block of each hash (None: not cached) and, for each k, how many blocks in a row
        # before block k are cached: one lookup per block and group, not one per block and candidate length
        found = [[self.prefix.lookup(m.group_id, h) for h in hashes] for m in self.managers]
        runs = [list(accumulate(ids, lambda run, b: 0 if b is None else run + 1, initial=0)) for ids in found]
        for k in range(len(hashes), 0, -1):
            if all(k - m.num_skipped_blocks(k * B) <= run[k] for m, run in zip(self.managers, runs)):
                for m, ids in zip(self.managers, found):
                    lo = min(m.num_skipped_blocks(k * B), k)
                    self.pool.touch(ids[lo:k])
                    m.tables[req_id] = [NULL_BLOCK] * lo + ids[lo:k]
                self._named[req_id] = k
                return k * B
        return 0

    def has_unnamed_blocks(self, req_id: str, num_computed: int) -> bool:
        """Whether `name_computed` would name something (a block of the request filled since the last call)."""
        return self.prefix is not None and num_computed // self.block_size > self._named.get(req_id, 0)

    def name_computed(self, req_id: str, token_ids: list[int], num_computed: int) -> None:
        """Name in the cache the request's blocks whose tokens are all computed (no-op without caching)."""
        if self.prefix is None or not self.has_request(req_id):
            return
        B, start = self.block_size, self._named.get(req_id, 0)
        k = num_computed // B
        if k <= start:
            return
        hashes = block_hashes(token_ids, B, k, self._hashes.setdefault(req_id, []))
        for m in self.managers:
            table = m.tables[req_id]
            for i in range(start, min(k, len(table))):
                if table[i] != NULL_BLOCK:
                    self.prefix.insert(m.group_id, hashes[i], table[i])
        self._named[req_id] = k

    # -- tables ------------------------------------------------------------------------------------
    def block_tables(self, req_id: str) -> list[list[int]]:
        """Per group (index = group id): the request's block table (0 = null block)."""
        return [m.block_table(req_id) for m in self.managers]

    def num_held(self, req_id: str) -> list[int]:
        return [m.num_held(req_id) for m in self.managers]

    def has_request(self, req_id: str) -> bool:
        return req_id in self.managers[0].tables
