"""DI across TP layouts (head_ratio != 1): prefill and decode with different TP sizes hold different kv heads;
each decode rank reads the right head slice of every remote block, checks it against the producer's per-head
CRC32 and decodes with the sharded GK program. Greedy output equals the single-node output (tiny checkpoint,
fp32, packed FP8 KV, block 4, window 16).

- prefill tp=1 (our producer engine, its own process) -> decode tp=2 (a gloo world): each decode rank reads
  its kv head of every remote block; the producer's leases are released by the decode ranks' notifications;
- prefill tp=2 (a world of sharded per-layer models, one NIXL agent each) -> decode tp=1: the decode rank
  reads from both prefill ranks into its blocks' head slices;
- a corrupted head slice is refused on every decode rank (nothing decodes).
"""

from __future__ import annotations

import pytest

from gigadecode.parallel.di import decode_rank_job, run_di, source_from_producer
from gigadecode.parallel.launch import run_parallel_generate
from gigadecode.parallel.spawn import run_world

from .di_peer import Producer
from .helpers import random_prompt

BLOCK, NUM_BLOCKS, MAX_TOKENS = 4, 400, 8
KV = dict(kv_dtype="fp8", block_size=BLOCK)
# 1 token (nothing to send), block+1, N % block == block-1 past the window (19, 23), > 2 windows.
LENGTHS = [1, 5, 19, 23, 38]


@pytest.fixture(scope="module")
def prompts():
    return [random_prompt(n, 1024, seed=700 + n) for n in LENGTHS]


@pytest.fixture(scope="module")
def single(tiny_ckpt, prompts):
    res = run_parallel_generate(tiny_ckpt, prompts, max_tokens=MAX_TOKENS, ignore_eos=True, **KV)
    return [r["token_ids"] for r in res]


@pytest.fixture(scope="module")
def producer(tiny_ckpt):
    p = Producer(tiny_ckpt, num_blocks=NUM_BLOCKS, **KV)
    yield p
    p.close()


def _decode_tp2(tiny_ckpt, prompts, source):
    kw = dict(KV, max_tokens=MAX_TOKENS, ignore_eos=True, timeout_s=20.0)
    return run_world(2, decode_rank_job, str(tiny_ckpt), prompts, 2, [source], kw)[0]


@pytest.mark.timeout(300)
def test_engine_prefill_tp1_to_decode_tp2(tiny_ckpt, prompts, single, producer):
    params = [producer.prefill(p) for p in prompts]
    assert [p["num_computed_tokens"] for p in params] == [n - 1 for n in LENGTHS]
    assert all(len(p["kv_crc32_heads"]) == 2 and p["kv_head_start"] == 0 for p in params)
    source = source_from_producer("127.0.0.1", producer.side_port, params)
    res = _decode_tp2(tiny_ckpt, prompts, source)
    assert [r["token_ids"] for r in res] == single
    # decode rank 0 read only its kv head: BLOCK·d·1 bytes (fp8) of each block, in K and V of both buffers
    full = [sum(len(ids) for ids in p["remote_block_ids"]) for p in params]
    assert [r["kv_bytes"] for r in res] == [n * 4 * BLOCK * 16 for n in full]
    assert producer.wait_free(NUM_BLOCKS - 1) == NUM_BLOCKS - 1      # leases released by the notifications


@pytest.mark.timeout(300)
def test_corrupted_head_slice_is_refused_on_every_rank(tiny_ckpt, prompts, producer):
    ps = prompts[2:4]
    params = [producer.prefill(p) for p in ps]
    bad = [dict(p, kv_crc32_heads=[p["kv_crc32_heads"][0], p["kv_crc32_heads"][1] ^ 1]) for p in params]
    source = source_from_producer("127.0.0.1", producer.side_port, bad)
    with pytest.raises(RuntimeError) as ei:
        _decode_tp2(tiny_ckpt, ps, source)
    msg = str(ei.value)
    assert "CRC32 mismatch" in msg and "[1, 2)" in msg                 # rank 1 (head 1) saw it ...
    assert "another decode rank's KV transfer failed" in msg           # ... and rank 0 refused too
    assert producer.call("leases") == 2             # no decode rank notified: the blocks stay leased (to expiry)


@pytest.mark.timeout(300)
def test_prefill_tp2_to_decode_tp1(tiny_ckpt, prompts, single):
    out = run_di(tiny_ckpt, prompts, prefill_tp=2, decode_tp=1, max_tokens=MAX_TOKENS, ignore_eos=True, **KV)
    assert [r["token_ids"] for r in out["results"]] == single
    assert [rep["notifs"] for rep in out["prefill"]] == [len(LENGTHS), len(LENGTHS)]   # both ranks read from


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sharded_prefill_tp1_to_decode_tp2(tiny_ckpt, prompts, single):
    out = run_di(tiny_ckpt, prompts, prefill_tp=1, decode_tp=2, max_tokens=MAX_TOKENS, ignore_eos=True, **KV)
    assert [r["token_ids"] for r in out["results"]] == single
