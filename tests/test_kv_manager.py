"""Block pool, per-group managers (full / sliding window) and the all-groups KV manager; HMA grouping."""

from __future__ import annotations

import random

import pytest

from gigadecode.checkpoint import preset_config
from gigadecode.config import FULL, SLIDING, GptOssConfig
from gigadecode.kv.manager import (
    NULL_BLOCK, BlockPool, FullAttentionManager, KVBlockError, KVCacheManager, NoFreeBlocks,
    SlidingWindowManager, make_manager,
)
from gigadecode.kv.spec import (
    FullAttentionSpec, KVCacheConfig, SlidingWindowSpec, cdiv, get_kv_spec, group_kv_specs, make_kv_cache_config,
)

SIZES = [(b, w) for b in (2, 3, 4) for w in (4, 5, 8)]


def sliding(block: int, window: int, num_blocks: int = 64) -> SlidingWindowManager:
    return SlidingWindowManager(SlidingWindowSpec(block, 1, 8, 1, window), BlockPool(num_blocks))


def tiny_cfg(types: str, window: int = 8) -> GptOssConfig:
    """A tiny config with layer types from a string of S (sliding) / F (full)."""
    lt = tuple(SLIDING if c == "S" else FULL for c in types)
    return preset_config("tiny").with_(num_hidden_layers=len(lt), layer_types=lt, sliding_window=window)


def kv_manager(types: str, block: int, window: int, num_blocks: int) -> KVCacheManager:
    specs = get_kv_spec(tiny_cfg(types, window), block, 1)
    return KVCacheManager(make_kv_cache_config(specs, num_blocks), block)


# -- BlockPool ------------------------------------------------------------------------------------
def test_pool_never_hands_out_null_block_and_is_fifo():
    pool = BlockPool(6)
    assert (pool.num_free, pool.num_used, pool.capacity) == (5, 0, 5)
    ids = pool.allocate(3)
    assert ids == [1, 2, 3]
    pool.free([2])
    assert pool.allocate(3) == [4, 5, 2]          # FIFO: 2 went to the back
    assert pool.num_free == 0 and pool.num_used == 5
    assert NULL_BLOCK not in ids


def test_pool_exhaustion_allocates_nothing():
    pool = BlockPool(4)
    pool.allocate(2)
    with pytest.raises(NoFreeBlocks) as ei:
        pool.allocate(2)
    assert isinstance(ei.value, RuntimeError)
    assert "2 blocks requested, 1 free" in str(ei.value)
    assert pool.num_free == 1
    assert pool.allocate(1) == [3]


def test_pool_double_free_and_null_free():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    pool.free([NULL_BLOCK, NULL_BLOCK])           # no-op
    assert pool.num_free == 1
    pool.free([a])
    with pytest.raises(KVBlockError, match="double free of block 1"):
        pool.free([a])
    with pytest.raises(KVBlockError, match="double free"):
        pool.free([b, b])                         # checked before anything changes
    assert pool.num_free == 2                     # b still held once
    with pytest.raises(KVBlockError, match="out of range"):
        pool.free([7])


def test_pool_ref_counts():
    pool = BlockPool(3)
    (a,) = pool.allocate(1)
    pool.share([a])
    pool.free([a])
    assert pool.num_free == 1                     # the shared reference still holds it
    pool.free([a])
    assert pool.num_free == 2
    with pytest.raises(KVBlockError, match="double free"):
        pool.free([a])


# -- single-type managers -------------------------------------------------------------------------
def test_manager_picked_by_spec_type():
    pool = BlockPool(4)
    assert type(make_manager(FullAttentionSpec(4, 1, 8, 1), pool)) is FullAttentionManager
    assert type(make_manager(SlidingWindowSpec(4, 1, 8, 1, 8), pool)) is SlidingWindowManager


# (block, window, tokens allocated, computed tokens, table after remove_skipped_blocks)
SKIP_CASES = [
    (4, 8, 20, 20, [0, 0, 0, 4, 5]),   # skip max(0, 20-8+1) = 13 tokens -> blocks 0..2 (tokens 0..11)
    (4, 8, 20, 7, [1, 2, 3, 4, 5]),    # skip 0
    (4, 8, 20, 11, [0, 2, 3, 4, 5]),   # skip 4 -> block 0 (tokens 0..3)
    (4, 8, 20, 10, [1, 2, 3, 4, 5]),   # skip 3 -> token 3 still visible, nothing wholly dead
    (2, 4, 10, 10, [0, 0, 0, 4, 5]),   # skip 7 -> blocks 0..2 (tokens 0..5)
    (3, 5, 10, 10, [0, 0, 3, 4]),      # skip 6 -> blocks 0..1 (tokens 0..5)
    (4, 4, 12, 9, [0, 2, 3]),          # skip 6 -> block 0
    (2, 8, 9, 9, [0, 2, 3, 4, 5]),     # skip 2 -> block 0 (tokens 0, 1)
]


@pytest.mark.parametrize("block,window,tokens,computed,table", SKIP_CASES)
def test_sliding_frees_exactly_out_of_window_blocks(block, window, tokens, computed, table):
    m = sliding(block, window, num_blocks=16)
    assert m.allocate_for("r", tokens, 0) == list(range(1, cdiv(tokens, block) + 1))
    free0 = m.pool.num_free
    expect_freed = sum(1 for b in table if b == 0)
    assert m.remove_skipped_blocks("r", computed) == expect_freed
    assert m.block_table("r") == table
    assert m.pool.num_free == free0 + expect_freed
    assert m.remove_skipped_blocks("r", computed) == 0            # idempotent


def test_full_manager_never_skips():
    m = FullAttentionManager(FullAttentionSpec(4, 1, 8, 1), BlockPool(16))
    m.allocate_for("r", 30, num_computed_tokens=29)
    assert m.block_table("r") == list(range(1, 9))
    assert m.remove_skipped_blocks("r", 30) == 0
    assert m.blocks_needed(30, 29) == 8


@pytest.mark.parametrize("block,window", SIZES)
def test_sliding_bound_growing_token_by_token(block, window):
    m = sliding(block, window)
    bound = cdiv(window - 1, block) + 1
    assert m.spec.max_blocks(50) == bound
    peak = 0
    for t in range(1, 51):                    # decode token t-1 with t-1 computed
        m.allocate_for("r", t, num_computed_tokens=t - 1)
        table = m.block_table("r")
        assert len(table) == cdiv(t, block)
        lo = max(0, t - window)               # first visible token of the query at position t-1
        live = set(range(lo // block, (t - 1) // block + 1))
        for i, b in enumerate(table):
            assert (b != NULL_BLOCK) == (i in live), (t, table)
        held = m.num_held("r")
        assert held <= bound
        peak = max(peak, held)
    assert peak == bound == m.spec.max_blocks(50)
    m.free("r")
    assert m.pool.num_free == m.pool.capacity


@pytest.mark.parametrize("block,window", SIZES)
def test_sliding_never_allocates_dead_blocks(block, window):
    """DI decode admission: N-1 tokens computed remotely, only the window gets real blocks."""
    m = sliding(block, window)
    n = 37
    need = m.blocks_needed(n, n - 1)
    new = m.allocate_for("r", n, num_computed_tokens=n - 1)
    assert len(new) == need
    table = m.block_table("r")
    first = max(0, n - window) // block       # first visible token of the query at n-1
    assert table[:first] == [0] * first
    assert all(b != 0 for b in table[first:])
    assert len(new) <= m.spec.max_blocks(n)


# -- KVCacheManager ------------------------------------------------------------------------------
@pytest.mark.parametrize("block,window", SIZES)
def test_pool_returns_to_start_after_requests(block, window):
    mgr = kv_manager("SFSF", block, window, num_blocks=200)
    start = mgr.num_free_blocks
    rng = random.Random(block * 10 + window)
    lengths = {f"r{i}": rng.randint(1, 30) for i in range(6)}
    # prefill each request, then decode a few tokens round-robin, freeing dead sliding blocks
    for r, n in lengths.items():
        assert mgr.allocate(r, n, num_computed_tokens=0)
    for step in range(12):
        for r in lengths:
            c = lengths[r] + step
            assert mgr.allocate(r, c + 1, num_computed_tokens=c)
            full = mgr.block_tables(r)[1]
            assert len(full) == cdiv(c + 1, block) and 0 not in full
            assert mgr.num_held(r)[0] <= cdiv(window - 1, block) + 1
    assert 0 < mgr.usage < 1
    for r in lengths:
        mgr.free(r)
        mgr.free(r)                            # idempotent per request
    assert mgr.num_free_blocks == start and mgr.usage == 0
    assert sorted(mgr.pool._free) == list(range(1, 200))


def test_all_or_nothing_when_pool_runs_out():
    mgr = kv_manager("SFSF", 4, 8, num_blocks=6)   # 5 usable blocks, 2 groups
    assert mgr.blocks_needed(12) == [3, 3]
    assert mgr.allocate("a", 12, 0) is False
    assert mgr.num_free_blocks == 5 and not mgr.has_request("a")
    assert mgr.allocate("a", 8, 0) is True            # 2 + 2
    assert mgr.block_tables("a") == [[1, 2], [3, 4]]
    assert mgr.num_free_blocks == 1
    assert mgr.allocate("b", 4, 0) is False           # needs 1 + 1
    assert mgr.num_free_blocks == 1 and not mgr.has_request("b")
    with pytest.raises(KeyError):
        mgr.block_tables("b")
    # decoding "a" with 9 computed: skip 9-8+1 = 2 tokens, no block wholly dead; it needs
    # 1 sliding + 1 full block with 1 free -> refused, nothing changes.
    assert mgr.allocate("a", 10, num_computed_tokens=9) is False
    assert mgr.block_tables("a") == [[1, 2], [3, 4]]
    # with 11 computed, skip 4 -> sliding block 0 is released first, so 2 new blocks fit (1 free + 1 released)
    assert mgr.allocate("a", 12, num_computed_tokens=11) is True
    assert mgr.block_tables("a") == [[0, 2, 5], [3, 4, 1]]
    assert mgr.num_free_blocks == 0
    mgr.free("a")
    assert mgr.num_free_blocks == 5


def test_allocate_is_all_or_nothing_over_random_sequences():
    """Random prefills, decodes and frees on a small pool: a granted allocation covers every group's tokens;
    a refused one changes nothing but the dead sliding blocks it released first (entries turned null), and
    the pool's free count equals its capacity minus the real blocks the tables hold."""
    rng = random.Random(0)
    block, mgr = 2, kv_manager("SFSF", 2, 4, num_blocks=24)
    state: dict[str, int] = {}
    refused = 0
    for _ in range(400):
        r = f"r{rng.randrange(5)}"
        if r in state and rng.random() < 0.1:
            mgr.free(r)
            del state[r]
            continue
        c = state.get(r, 0)
        n = c + rng.randint(1, 6)
        before = mgr.block_tables(r) if mgr.has_request(r) else None
        free0 = mgr.num_free_blocks
        if mgr.allocate(r, n, num_computed_tokens=c):
            assert all(len(t) == cdiv(n, block) for t in mgr.block_tables(r))
            state[r] = n
        else:
            refused += 1
            assert mgr.num_free_blocks >= free0
            if before is None:
                assert not mgr.has_request(r)
            else:
                for old_t, new_t in zip(before, mgr.block_tables(r)):
                    assert len(old_t) == len(new_t)
                    assert all(b == a or b == NULL_BLOCK for a, b in zip(old_t, new_t))
        held = sum(b != NULL_BLOCK for q in state if mgr.has_request(q) for t in mgr.block_tables(q) for b in t)
        assert mgr.num_free_blocks == mgr.pool.capacity - held
    assert refused > 0                                   # the pool did run out



def test_manager_over_uneven_groups():
    mgr = kv_manager("SFFSFF", 4, 8, num_blocks=40)   # groups: S(0,3), F(1,2), F(4,5)
    assert [type(m) for m in mgr.managers] == [SlidingWindowManager, FullAttentionManager, FullAttentionManager]
    assert mgr.allocate("r", 9, 0)
    assert [len(t) for t in mgr.block_tables("r")] == [3, 3, 3]
    assert len({b for t in mgr.block_tables("r") for b in t}) == 9   # no block in two groups


def test_block_size_mismatch_rejected():
    cfg = make_kv_cache_config(get_kv_spec(tiny_cfg("SF"), 4, 1), 8)
    with pytest.raises(ValueError, match="block_size"):
        KVCacheManager(cfg, 8)


# -- HMA grouping (kv/spec.py) --------------------------------------------------------------------
def check_grouping(cfg: KVCacheConfig, specs: dict) -> None:
    n = len(specs)
    seen = [layer for g in cfg.groups for layer in g.layers]
    assert sorted(seen) == list(range(n))                       # every layer exactly once
    for g in cfg.groups:
        assert all(specs[layer] == g.spec for layer in g.layers)  # one spec per group
    for j, t in enumerate(cfg.tensors):
        groups_in_buffer = [cfg.layer_group[layer] for layer in t.shared_by]
        assert len(set(groups_in_buffer)) == len(groups_in_buffer)  # at most one layer per group
        assert all(cfg.layer_buffer[layer] == j for layer in t.shared_by)
    assert sorted(x for t in cfg.tensors for x in t.shared_by) == list(range(n))
    for layer in range(n):
        g = cfg.groups[cfg.layer_group[layer]]
        assert g.layers[cfg.layer_buffer[layer]] == layer


@pytest.mark.parametrize("preset", ["tiny", "small", "120b-shape"])
def test_grouping_gpt_oss_alternating(preset):
    mcfg = preset_config(preset)
    L = mcfg.num_hidden_layers
    specs = get_kv_spec(mcfg, 16, 1)
    cfg = make_kv_cache_config(specs, 10)
    check_grouping(cfg, specs)
    assert len(cfg.groups) == 2 and cfg.group_size == L // 2
    assert isinstance(cfg.groups[0].spec, SlidingWindowSpec)
    assert type(cfg.groups[1].spec) is FullAttentionSpec
    assert all(len(g.layers) == L // 2 for g in cfg.groups)
    assert [t.shared_by for t in cfg.tensors] == [(2 * i, 2 * i + 1) for i in range(L // 2)]
    assert cfg.layer_group == tuple(i % 2 for i in range(L))
    assert cfg.layer_buffer == tuple(i // 2 for i in range(L))
    page = 2 * 16 * mcfg.num_key_value_heads * mcfg.head_dim
    assert all(t.size == page * 10 for t in cfg.tensors)


def test_grouping_all_full():
    specs = get_kv_spec(tiny_cfg("FFFF"), 4, 1)
    cfg = make_kv_cache_config(specs, 5)
    check_grouping(cfg, specs)
    assert len(cfg.groups) == 1 and cfg.group_size == 4
    assert [t.shared_by for t in cfg.tensors] == [(0,), (1,), (2,), (3,)]
    assert cfg.layer_group == (0, 0, 0, 0) and cfg.layer_buffer == (0, 1, 2, 3)


@pytest.mark.parametrize("types", ["SFFSFF", "SSSF", "FSFFS", "SFSFSFF"])
def test_grouping_uneven(types):
    specs = get_kv_spec(tiny_cfg(types), 4, 1)
    cfg = make_kv_cache_config(specs, 5)
    check_grouping(cfg, specs)
    groups, buffers = group_kv_specs(specs)
    assert [list(t.shared_by) for t in cfg.tensors] == buffers


def test_grouping_sffsff_layout():
    specs = get_kv_spec(tiny_cfg("SFFSFF"), 4, 1)
    cfg = make_kv_cache_config(specs, 5)
    assert [g.layers for g in cfg.groups] == [(0, 3), (1, 2), (4, 5)]
    assert [t.shared_by for t in cfg.tensors] == [(0, 1, 4), (3, 2, 5)]
    assert cfg.layer_group == (0, 1, 1, 0, 2, 2)
    assert cfg.layer_buffer == (0, 0, 1, 1, 0, 1)


# -- prefix caching -------------------------------------------------------------------------------
def cached_manager(types: str = "SF", block: int = 4, window: int = 8, num_blocks: int = 40) -> KVCacheManager:
    specs = get_kv_spec(tiny_cfg(types, window), block, 1)
    return KVCacheManager(make_kv_cache_config(specs, num_blocks), block, prefix_caching=True)


def computed(m: KVCacheManager, rid: str, ids: list[int], upto: int | None = None) -> None:
    """A request that computed `ids` (all, or the first `upto`) in one go and named its full blocks."""
    upto = len(ids) if upto is None else upto
    assert m.allocate(rid, len(ids), 0)
    m.name_computed(rid, ids, upto)


def test_prefix_hit_takes_whole_named_blocks_and_leaves_a_token_to_compute():
    """Full attention needs every block of the hit; a sliding group (window 8, block 4) only the blocks its
    next query sees, the rest null. A hit is whole blocks, at most `max_tokens`, and only of named blocks
    (computed ones); another prompt's blocks never match."""
    m = cached_manager()
    a = list(range(100, 130))                                    # 30 tokens: 7 full blocks
    computed(m, "a", a, upto=22)                                 # 5 full blocks computed and named
    b = a[:26] + [7, 7, 7]
    assert m.take_cached_prefix("b", b, len(b) - 1) == 20        # 5 named blocks: 20 tokens
    full, slide = m.managers[1].block_table("b"), m.managers[0].block_table("b")
    assert full == m.managers[1].block_table("a")[:5]
    # window 8 at position 20 sees tokens 13..19: blocks 3 and 4; blocks 0..2 are dead
    assert slide[:3] == [NULL_BLOCK] * 3 and slide[3:] == m.managers[0].block_table("a")[3:5]
    assert all(m.pool._ref[x] == 2 for x in full + slide[3:])
    assert m.allocate("b", len(b), 20)                           # goes on from token 20
    assert m.take_cached_prefix("c", a[:20], 19) == 16           # at most max_tokens, whole blocks
    assert m.take_cached_prefix("d", [1] + a[1:20], 19) == 0     # the first block differs: the chain does
    assert not m.has_request("d")
    m2 = cached_manager()
    computed(m2, "a", a)
    assert m2.take_cached_prefix("x", a, 0) == 0 and m2.take_cached_prefix("y", a[:3], 2) == 0


def test_freed_named_blocks_stay_hittable_until_handed_out_again():
    m = cached_manager(types="F", num_blocks=9)                  # 8 usable blocks
    a = list(range(200, 216))                                    # 4 blocks
    computed(m, "a", a)
    m.free("a")
    assert m.num_free_blocks == 8                                # named but free: counted as free
    assert m.take_cached_prefix("b", a + [1], 16) == 16          # taken back out of the free list
    assert m.num_free_blocks == 4 and m.pool.num_used == 4
    m.free("b")
    # freed tail first, so the LRU end holds a's last blocks: 5 fresh blocks take 4 never-used ones and
    # then a's last block, which loses its name; a's first three blocks still hit
    assert m.allocate("c", 20, 0)
    assert m.take_cached_prefix("d", a + [1], 16) == 12
    m.free("c")
    m.free("d")
    assert m.allocate("e", 32, 0)                                # every block handed out: no name left
    m.free("e")
    assert m.take_cached_prefix("f", a + [1], 16) == 0 and m.num_free_blocks == 8


def test_a_sliding_hit_needs_only_the_window_and_full_every_block():
    """Sliding-only model: a hit needs the blocks the window sees; with the early blocks already freed (out
    of the window) the hit still stands. A full group missing one early block gets no hit past it."""
    m = cached_manager(types="S", window=8)
    a = list(range(300, 340))                                    # 10 blocks
    assert m.allocate("a", 40, 0)
    m.name_computed("a", a, 40)
    m.remove_skipped_blocks("a", 40)                              # blocks 0..7 are dead at 40 computed
    m.free("a")
    assert m.take_cached_prefix("b", a + [5], 40) == 40
    f = cached_manager(types="F")
    assert f.allocate("a", 40, 0)
    f.name_computed("a", a, 40)
    f.prefix.evict(f.managers[0].block_table("a")[2])             # as if block 2 were handed out again
    assert f.take_cached_prefix("b", a + [5], 40) == 8


def test_a_long_prompt_looks_each_block_up_once_per_group():
    """Finding the longest cached prefix costs one lookup per block and group, not one per block and candidate
    length (quadratic: seconds of engine-thread time for a 128k-token prompt, again every step it waits)."""
    m = cached_manager()
    a = list(range(1000, 1040))
    computed(m, "a", a)                                          # 10 named blocks
    looked = []
    lookup = m.prefix.lookup
    m.prefix.lookup = lambda g, h: looked.append(g) or lookup(g, h)
    prompt = a[:13] + list(range(5000))                          # 3 cached blocks, then 1250 new ones
    assert m.take_cached_prefix("b", prompt, len(prompt) - 1) == 12
    assert m.managers[1].block_table("b") == m.managers[1].block_table("a")[:3]
    assert len(looked) <= 2 * (len(prompt) // 4)


def test_prefix_caching_is_off_by_default_and_refused_with_dcp():
    m = kv_manager("SF", 4, 8, 40)
    assert m.prefix is None and m.take_cached_prefix("a", list(range(40)), 39) == 0
    from gigadecode.kv.dcp import TokenShard
    specs = get_kv_spec(tiny_cfg("SF", 8), 4, 1)
    with pytest.raises(ValueError, match="prefix caching"):
        KVCacheManager(make_kv_cache_config(specs, 40), 4, TokenShard(rank=0, size=2, interleave=4), prefix_caching=True)
