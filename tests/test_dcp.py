"""Decode context parallel (`--dcp`): the token split, the lockstep block pools, the exact partial-attention
merge, the DCP CRC combination, and whole worlds (tp 2 / tp 4 with dcp 2) token-identical to one rank.

The tiny model has 2 kv heads, so at tp 4 without DCP every kv head is held twice; with dcp 2 each rank
holds one kv head and half of every sequence's tokens. Block 4 and window 16: the prompt lengths cross
block edges, the window edge, N % block == block-1 and more than 3 windows.
"""

from __future__ import annotations

import random

import pytest
import torch

from gigadecode.config import ConfigError, GptOssConfig
from gigadecode.engine_config import EngineConfig
from gigadecode.connector.dcp_reads import combine, partial_head_crcs, stream_length
from gigadecode.connector.kv_crc import kv_crc32_heads
from gigadecode.kv.cache import KVCache
from gigadecode.kv.dcp import TokenShard
from gigadecode.kv.manager import KVCacheManager
from gigadecode.kv.spec import get_kv_spec, make_kv_cache_config
from gigadecode.ops import flash_sink_attention
from gigadecode.parallel.launch import run_parallel_generate
from gigadecode.distributed.mesh import LayoutError, build_layout
from gigadecode.parallel.spawn import generate_job, run_world

from .helpers import random_prompt

LENGTHS = [3, 4, 7, 16, 17, 19, 23, 55]
GEN = dict(max_tokens=10, block_size=4)


# --------------------------------------------------------------------------------------------------
# the token split
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("size,interleave", [(1, 1), (2, 4), (2, 8), (3, 4), (4, 12)])
def test_token_shard_is_a_partition(size, interleave):
    shards = [TokenShard(size, j, interleave) for j in range(size)]
    for n in range(0, 5 * size * interleave + 3):
        owners = [[j for j, s in enumerate(shards) if s.owns(p)] for p in range(n)]
        assert all(len(o) == 1 for o in owners)                       # every position has one owner
        for j, s in enumerate(shards):
            mine = [p for p in range(n) if owners[p] == [j]]
            assert s.count(n) == len(mine)
            assert [s.local_index(p) for p in mine] == list(range(len(mine)))   # contiguous local order
            assert [s.position(i) for i in range(len(mine))] == mine
            assert s.positions(torch.arange(len(mine))).tolist() == mine
        assert shards[0].most(n) == max(s.count(n) for s in shards)
        assert shards[0].least(n) == min(s.count(n) for s in shards)


@pytest.mark.parametrize("window", [None, 1, 5, 16])
def test_visible_local_range_is_the_window(window):
    s = TokenShard(3, 1, 4)
    for p in range(60):
        f, l = s.visible(p, window)
        want = [s.local_index(k) for k in range(p + 1) if s.owns(k) and (window is None or k > p - window)]
        assert list(range(f, l + 1)) == want


def test_layout_and_config_refuse_bad_dcp(tiny_ckpt):
    cfg = GptOssConfig.from_hf(tiny_ckpt)                              # 2 kv heads, 4 q heads
    assert build_layout(4, 1, 1, 4, cfg, dcp=2).dcp_groups == ((0, 1), (2, 3))
    with pytest.raises(LayoutError, match="does not divide --tp"):
        build_layout(4, 1, 1, 4, cfg, dcp=3)
    with pytest.raises(LayoutError, match="held twice"):               # tp/dcp = 4 > 2 kv heads
        build_layout(8, 1, 1, 8, cfg.with_(num_attention_heads=8), dcp=2)
    with pytest.raises(ConfigError, match="multiple of --block-size"):
        EngineConfig(block_size=4, tp=2, dcp=2, dcp_interleave=6)
    with pytest.raises(ConfigError, match="decode engines"):
        EngineConfig(tp=2, dcp=2, kv_role="kv_producer")


# --------------------------------------------------------------------------------------------------
# lockstep pools: every rank of a DCP group keeps the same tables, each ~1/N of the tokens
# --------------------------------------------------------------------------------------------------
def test_dcp_pools_stay_in_lockstep_and_hold_their_share(tiny_ckpt):
    cfg = GptOssConfig.from_hf(tiny_ckpt)
    B, N, I = 4, 2, 8
    kvc = make_kv_cache_config(get_kv_spec(cfg, B, 1, 1), 400)
    shards = [TokenShard(N, j, I) for j in range(N)]
    mgrs = [KVCacheManager(kvc, B, s) for s in shards]
    single = KVCacheManager(kvc, B)
    rng = random.Random(0)
    lens = {f"r{i}": 0 for i in range(5)}
    for _ in range(200):
        rid = rng.choice(list(lens))
        c = lens[rid]
        n = c + rng.choice([1, 1, 1, 5, 13])
        oks = {m.allocate(rid, n, c) for m in mgrs}
        assert len(oks) == 1                                           # the same decision on every rank
        single.allocate(rid, n, c)
        lens[rid] = n
        tables = [m.block_tables(rid) for m in mgrs]
        assert all(t == tables[0] for t in tables)                     # the same block ids
        for m, s in zip(mgrs, shards):                                 # a rank's live range covers its keys
            full = m.block_tables(rid)[1]
            assert len(full) * B >= s.count(n)
            sw = m.block_tables(rid)[0]
            f = s.visible(c, cfg.sliding_window)[0]                   # the chunk's first query ...
            l = s.visible(n - 1, cfg.sliding_window)[1]               # ... to its last one
            assert all(sw[k] != 0 for k in range(f // B, (l // B) + 1))
    for rid, n in lens.items():                                        # ~1/N of the full group's blocks
        held, solo = mgrs[0].num_held(rid)[1], single.num_held(rid)[1]
        assert held * B <= -(-n // N) + I + B
        assert abs(held - solo / N) <= I // B + 1


def test_dcp_context_limit_grows_with_dcp(tiny_ckpt):
    cfg = GptOssConfig.from_hf(tiny_ckpt)
    kvc = make_kv_cache_config(get_kv_spec(cfg, 4, 1, 1), 101)
    specs = [g.spec for g in kvc.groups]

    def longest(tokens):
        return max(n for n in range(1, 3000) if sum(s.peak_blocks(n, min(16, n), tokens) for s in specs) <= 100)
    assert longest(TokenShard(2, 0, 4)) >= 1.8 * longest(None)


# --------------------------------------------------------------------------------------------------
# the math: partial attentions merged with the sink equal one attention over every key
# --------------------------------------------------------------------------------------------------
class _Merge:
    """`ParallelContext.dcp_merge` on one process: the group's partials given as a list."""

    @staticmethod
    def merge(parts, sinks, h):
        lses = torch.stack([lse for _, lse in parts])                 # [N, T, hg]
        m = lses.amax(0)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        outs = []
        for r in range(len(parts)):
            mine = slice(r * h, (r + 1) * h)
            num = sum(torch.exp(lse[:, mine] - m[:, mine]).unsqueeze(-1) * o[:, mine] for o, lse in parts)
            den = torch.exp(lses[:, :, mine] - m[:, mine]).sum(0) + torch.exp(sinks[mine] - m[:, mine])
            outs.append(num / den.unsqueeze(-1))
        return torch.cat(outs, 1)


@pytest.mark.parametrize("window", [None, 7])
def test_partial_attention_merge_is_exact(window):
    """Keys split over 3 ranks round-robin (chunks of 4), each rank's flash attention without the sink,
    merged with the sink counted once == `flash_sink_attention` over all keys with the sink."""
    g = torch.Generator().manual_seed(0)
    T, S, nh, nkv, d, N, I = 5, 40, 6, 2, 16, 3, 4
    q = torch.randn(T, nh, d, generator=g)
    k, v = torch.randn(S, nkv, d, generator=g), torch.randn(S, nkv, d, generator=g)
    sinks = torch.randn(nh, generator=g)
    qpos = torch.arange(S - T, S)
    want = flash_sink_attention(q, k, v, qpos, torch.arange(S), sinks, 0.25, window, tile=8)
    parts = []
    for j in range(N):
        s = TokenShard(N, j, I)
        own = torch.tensor([p for p in range(S) if s.owns(p)])
        parts.append(flash_sink_attention(q, k[own], v[own], qpos, own, None, 0.25, window, tile=8))
    got = _Merge.merge(parts, sinks, nh // N)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


# --------------------------------------------------------------------------------------------------
# the DCP CRC: the group's zero-filled partial CRCs combine to the prefill's per-head CRC
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("N", [2, 3])
def test_partial_crcs_combine_to_the_head_crc_and_catch_a_flipped_slice(tiny_ckpt, N):
    cfg = GptOssConfig.from_hf(tiny_ckpt)
    kv = KVCache(cfg, EngineConfig(kv_dtype="fp8", block_size=4), 40)
    for buf in kv.group_bufs:
        buf.view(torch.uint8).copy_(torch.randint(0, 120, buf.shape, dtype=torch.uint8))
    live = [[5, 9, 2], [7, 1, 3, 11, 4, 8]]                            # per group: the live block ids, in order
    want = kv_crc32_heads(kv, live)
    length = stream_length(kv, [len(x) for x in live])

    def partials():
        out = []
        for j in range(N):                                             # rank j "read" block i when i % N == j
            slots = [[(i, b) for i, b in enumerate(ids) if i % N == j] for ids in live]
            out.append(partial_head_crcs(kv, slots, [len(x) for x in live], (0, kv.num_kv_heads)))
        return out
    p = partials()
    got = [combine([p[j][h] for j in range(N)], length) for h in range(kv.num_kv_heads)]
    assert got == want
    kv.group_bufs[1].view(torch.uint8)[1, 11, 0, 2, 3] ^= 0x10         # one byte of one rank's slice (V, head 0)
    p = partials()
    got = [combine([p[j][h] for j in range(N)], length) for h in range(kv.num_kv_heads)]
    assert got[0] != want[0] and got[1:] == want[1:]


# --------------------------------------------------------------------------------------------------
# whole worlds
# --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def prompts(tiny_ckpt):
    vocab = GptOssConfig.from_hf(tiny_ckpt).vocab_size
    return [random_prompt(n, vocab, seed=700 + n) for n in LENGTHS]


@pytest.fixture(scope="module")
def single(tiny_ckpt, prompts):
    return {kv: [r["token_ids"] for r in run_parallel_generate(tiny_ckpt, prompts, kv_dtype=kv, **GEN)]
            for kv in ("auto", "fp8")}


WORLDS = [
    pytest.param(2, "gk-native", "fp8", {}, id="tp2-dcp2-native-fp8"),
    pytest.param(2, "gk-native", "auto", {}, id="tp2-dcp2-native-fp32kv"),
    pytest.param(4, "gk-native", "auto", {}, id="tp4-dcp2-native-fp32kv"),
    pytest.param(4, "gk", "fp8", {"dcp_interleave": 8}, id="tp4-dcp2-eager-fp8-interleave8"),
    # chunks of 20 > the window of 16: a sliding window often lies on one rank, the other contributes nothing
    pytest.param(4, "gk-native", "fp8", {"dcp_interleave": 20}, id="tp4-dcp2-native-fp8-interleave20"),
    pytest.param(2, "reference", "auto", {}, id="tp2-dcp2-reference-fp32kv"),
    pytest.param(4, "gk-compiled", "fp8", {}, id="tp4-dcp2-compiled-fp8", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("tp,decoder,kv_dtype,extra", WORLDS)
def test_dcp_world_equals_one_rank(tiny_ckpt, prompts, single, tp, decoder, kv_dtype, extra):
    """Greedy fp32 tokens of tp × dcp 2 == one rank's, for every decoder; each step's DCP collectives are
    three per layer (q all-gather, LSE all-gather, reduce-scatter)."""
    outs = run_world(tp, generate_job, str(tiny_ckpt), prompts, tp, 1, 1,
                     {**GEN, "decoder": decoder, "kv_dtype": kv_dtype, "dcp": 2, **extra})
    assert [r["token_ids"] for r in outs[0][0]] == single[kv_dtype]
    L = GptOssConfig.from_hf(tiny_ckpt).num_hidden_layers
    for _, rep in outs:
        for st in rep["step_stats"]:
            assert st["calls"].get("dcp") == 3 * L, st


def test_dcp_rank_pools_hold_half_the_tokens(tiny_ckpt):
    """A long request (200 prompt tokens, blocks of 4): each DCP rank's pool holds ~1/2 of the full-attention
    blocks one rank holds (± one chunk), and the same on both ranks of the group."""
    vocab = GptOssConfig.from_hf(tiny_ckpt).vocab_size
    prompt = [random_prompt(200, vocab, seed=3)]
    kw = {**GEN, "max_tokens": 2, "kv_dtype": "fp8", "num_blocks": 200}
    outs = run_world(2, generate_job, str(tiny_ckpt), prompt, 2, 1, 1, {**kw, "dcp": 2})
    solo = run_world(2, generate_job, str(tiny_ckpt), prompt, 2, 1, 1, kw)
    peak = [max(t.kv_used for t in rep["steps"]) for _, rep in outs]
    peak_solo = max(t.kv_used for t in solo[0][1]["steps"])
    assert peak[0] == peak[1]
    full_solo = -(-201 // 4)                                          # the full group's blocks at 201 tokens
    assert abs((peak_solo - peak[0]) - full_solo / 2) <= 2, (peak, peak_solo)


def test_dcp_with_ep_across_dp_groups_and_an_idle_group(tiny_ckpt):
    """tp2 × dp2 × ep4 with DCP 2: the EP group spans both DP groups, so while one group prefills (in chunks of
    2 tokens here) the other, with nothing to prefill, runs the step's collectives on zero tokens — its DCP
    attention included (a reshape of its empty output used to raise there, and the world then hung).
    Tokens equal one rank's."""
    vocab = GptOssConfig.from_hf(tiny_ckpt).vocab_size
    prompts = [random_prompt(1, vocab, seed=5), random_prompt(41, vocab, seed=6)]
    kw = {**GEN, "kv_dtype": "auto", "max_prefill_tokens": 2, "decoder": "gk"}
    want = [r["token_ids"] for r in run_parallel_generate(tiny_ckpt, prompts, **kw)]
    outs = run_world(4, generate_job, str(tiny_ckpt), prompts, 2, 2, 4, {**kw, "dcp": 2})
    assert [r["token_ids"] for r in outs[0][0]] == want


@pytest.mark.parametrize("decoder", ["gk-native", "gk"])
def test_dcp_world_with_speculative_decoding_equals_one_rank(tiny_ckpt, decoder):
    """Speculative decoding over DCP: a request's drafts are rows at consecutive positions whose KV lands on
    whichever rank owns each position; greedy tokens equal one rank's plain ones, in fewer steps. The
    prompts hold (nearly) every token of the vocabulary, so each sampled token matched before and the
    n-gram proposer drafts on every step."""
    from gigadecode.speculative import SpeculativeConfig
    vocab = GptOssConfig.from_hf(tiny_ckpt).vocab_size
    perm = list(range(vocab))
    random.Random(3).shuffle(perm)
    prompts = [perm[: vocab - 1], perm[200:] + perm[:150]]
    kw = {**GEN, "decoder": decoder, "kv_dtype": "auto"}
    one: dict = {}
    want = [r["token_ids"] for r in run_parallel_generate(tiny_ckpt, prompts, report=one, **kw)]
    spec = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=2)
    outs = run_world(2, generate_job, str(tiny_ckpt), prompts, 2, 1, 1, {**kw, "dcp": 2, "speculative": spec})
    assert [r["token_ids"] for r in outs[0][0]] == want
    assert len(outs[0][1]["steps"]) < len(one["steps"])
