"""Disaggregated inference across a real process boundary: a per-layer prefill engine (its own process)
ships KV over NIXL to a GK decode engine; output equals a single node; every fault ends in a clear
error (or a correct recomputation) with both block pools back where they started."""

from __future__ import annotations

import os
import signal
import time

import pytest

from gigadecode.config import EngineConfig
from gigadecode.connector.nixl_connector import build_engine
from gigadecode.kv.manager import KVCacheManager
from gigadecode.kv.spec import get_kv_spec, make_kv_cache_config
from gigadecode.checkpoint import preset_config
from gigadecode.sampling import SamplingParams

from .di_peer import Producer
from .helpers import random_prompt

BLOCK, NUM_BLOCKS = 4, 400
BASE = dict(kv_dtype="fp8", block_size=BLOCK, num_blocks=NUM_BLOCKS)
# tiny: window W = 16. 1, 2, block-1, block, block+1, W-1, W, W+1, N % block == block-1 with N > W, > 3 windows.
LENGTHS = [1, 2, 3, 4, 5, 15, 16, 17, 19, 23, 55, 70]


def greedy(n=12):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def producer(tiny_ckpt):
    p = Producer(tiny_ckpt, **BASE)
    yield p
    p.close()


@pytest.fixture(scope="module")
def single(tiny_ckpt):
    return build_engine(tiny_ckpt, EngineConfig(**BASE))


@pytest.fixture()
def consumer(tiny_ckpt):
    eng = build_engine(tiny_ckpt, EngineConfig(kv_role="kv_consumer", kv_transfer_timeout_s=3.0, **BASE))
    yield eng
    eng.connector.close()


def run(eng, prompt, params=None, kv=None):
    rid = eng.add_request(prompt, params or greedy(), kv_transfer_params=kv)
    t0 = time.monotonic()
    while not eng.requests[rid].finished:
        eng.step()
        assert time.monotonic() - t0 < 60
    return eng.requests[rid]


def test_di_equals_single_node(producer, single, consumer):
    for n in LENGTHS:
        prompt = random_prompt(n, 1024, seed=900 + n)
        want = run(single, prompt).output_ids
        params = producer.prefill(prompt)
        assert params["num_computed_tokens"] == n - 1
        got = run(consumer, prompt, kv=params)
        assert got.error is None, got.error
        assert got.output_ids == want, n
    assert consumer.stats["kv_bytes_transferred"] > 0
    assert consumer.kv_manager.num_free_blocks == NUM_BLOCKS - 1
    assert producer.wait_free(NUM_BLOCKS - 1) == NUM_BLOCKS - 1      # freed on the READ notifications


def test_sliding_list_is_clipped_to_the_window(producer, consumer):
    prompt = random_prompt(70, 1024, seed=1)
    params = producer.prefill(prompt)
    sliding, full = params["remote_block_ids"]
    assert len(sliding) <= -(-(16 - 1) // BLOCK) + 1 and params["remote_first_block"][0] > 0
    assert len(full) == -(-69 // BLOCK) and params["remote_first_block"][1] == 0
    assert producer.call("leases") == 1                # held for the decode side
    assert run(consumer, prompt, kv=params).error is None
    _pools_back(consumer, producer)


def test_n_minus_1_rule_keeps_the_boundary_block():
    """With the skip computed at N, a prompt with N % block == block-1 (N > W) loses exactly one block the
    decode side needs; computing at N-1 (both nodes) keeps it."""
    cfg = preset_config("tiny")                                       # W = 16
    kvc = make_kv_cache_config(get_kv_spec(cfg, BLOCK, 1), 64)
    for n in (19, 23, 27, 20, 21, 22):
        buggy, fixed, decode = (KVCacheManager(kvc, BLOCK) for _ in range(3))
        buggy.allocate("r", n, 0)
        buggy.remove_skipped_blocks("r", n)                           # prefill computed all N
        fixed.allocate("r", n - 1, 0)
        fixed.remove_skipped_blocks("r", n - 1)                       # the N-1 rule
        decode.allocate("r", n, n - 1)                                # decode: N-1 computed, room for token N-1
        need = {j for j, b in enumerate(decode.block_tables("r")[0][: (n - 2) // BLOCK + 1]) if b}
        have_buggy = {j for j, b in enumerate(buggy.block_tables("r")[0]) if b}
        have_fixed = {j for j, b in enumerate(fixed.block_tables("r")[0]) if b}
        lost = need - have_buggy
        assert len(lost) == (1 if n % BLOCK == BLOCK - 1 else 0), (n, lost)
        assert need <= have_fixed


def _pools_back(consumer, producer):
    assert consumer.kv_manager.num_free_blocks == NUM_BLOCKS - 1
    assert producer.wait_free(NUM_BLOCKS - 1) == NUM_BLOCKS - 1


def test_transfer_error_bad_block_id(producer, consumer):
    prompt = random_prompt(30, 1024, seed=2)
    params = producer.prefill(prompt)
    bad = dict(params, remote_block_ids=[ids[:-1] + [NUM_BLOCKS + 5] for ids in params["remote_block_ids"]])
    r = run(consumer, prompt, kv=bad)
    assert r.finish_reason == "error" and "out of range" in r.error and not r.output_ids
    # the untouched lease still expires or is read: read it properly so the producer frees
    ok = run(consumer, prompt, kv=params)
    assert ok.error is None
    _pools_back(consumer, producer)
    assert consumer.stats["transfer_failures"] >= 1


def test_corrupted_kv_is_refused(producer, consumer):
    prompt = random_prompt(30, 1024, seed=3)
    params = producer.prefill(prompt)
    r = run(consumer, prompt, kv=dict(params, kv_crc32=params["kv_crc32"] ^ 1))
    assert r.finish_reason == "error" and "CRC32" in r.error and not r.output_ids
    _pools_back(consumer, producer)                   # the READ did complete: the producer was notified


def test_handshake_refused_names_the_field(tiny_ckpt, consumer):
    other = Producer(tiny_ckpt, kv_dtype="fp8", block_size=8, num_blocks=NUM_BLOCKS)
    try:
        prompt = random_prompt(20, 1024, seed=4)
        params = other.prefill(prompt)
        r = run(consumer, prompt, kv=params)
        assert r.finish_reason == "error" and "block_size: local 4, remote 8" in r.error
        assert consumer.kv_manager.num_free_blocks == NUM_BLOCKS - 1
    finally:
        other.close()


def test_lease_expired_before_read(tiny_ckpt, consumer):
    short = Producer(tiny_ckpt, kv_lease_s=0.3, **BASE)
    try:
        prompt = random_prompt(25, 1024, seed=5)
        params = short.prefill(prompt)
        assert short.wait_free(NUM_BLOCKS - 1) == NUM_BLOCKS - 1      # lease expired: producer freed
        r = run(consumer, prompt, kv=params)
        assert r.finish_reason == "error" and "lease" in r.error
        assert consumer.kv_manager.num_free_blocks == NUM_BLOCKS - 1
    finally:
        short.close()


def test_stalled_prefill_times_out(tiny_ckpt, consumer, single):
    stalled = Producer(tiny_ckpt, kv_lease_s=4.0, **BASE)
    try:
        prompt = random_prompt(40, 1024, seed=6)
        params = stalled.prefill(prompt)
        os.kill(stalled.proc.pid, signal.SIGSTOP)
        try:
            r = run(consumer, prompt, kv=params)
        finally:
            os.kill(stalled.proc.pid, signal.SIGCONT)
        assert r.finish_reason == "error" and ("timed out" in r.error or "failed" in r.error)
        assert consumer.kv_manager.num_free_blocks == NUM_BLOCKS - 1
        assert stalled.wait_free(NUM_BLOCKS - 1, timeout=10) == NUM_BLOCKS - 1   # via lease expiry
        # the consumer keeps serving
        assert run(consumer, prompt).output_ids == run(single, prompt).output_ids
    finally:
        stalled.close()


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_prefill_killed(tiny_ckpt, single, policy):
    eng = build_engine(tiny_ckpt, EngineConfig(kv_role="kv_consumer", kv_transfer_timeout_s=3.0,
                                               kv_failure_policy=policy, **BASE))
    dead = Producer(tiny_ckpt, **BASE)
    try:
        prompt = random_prompt(33, 1024, seed=7)
        params = dead.prefill(prompt)
        dead.proc.kill()
        dead.proc.join(5)
        r = run(eng, prompt, kv=params)
        if policy == "fail":
            assert r.finish_reason == "error" and r.error and not r.output_ids
        else:
            assert r.error is None and r.output_ids == run(single, prompt).output_ids
            assert eng.stats["recomputed_after_failure"] == 1
        assert eng.kv_manager.num_free_blocks == NUM_BLOCKS - 1
    finally:
        dead.close()
        eng.connector.close()


def test_bad_params_are_refused(consumer):
    from gigadecode.engine import RequestError
    with pytest.raises(RequestError, match="missing"):
        consumer.add_request([5, 6, 7], greedy(), kv_transfer_params={"do_remote_prefill": True})
    with pytest.raises(RequestError, match="num_computed_tokens"):
        consumer.add_request([5, 6, 7], greedy(), kv_transfer_params={
            "do_remote_prefill": True, "remote_engine_id": "x", "remote_host": "127.0.0.1", "remote_port": 1,
            "remote_request_id": "r", "remote_block_ids": [[], []], "remote_first_block": [0, 0],
            "num_computed_tokens": 5, "kv_crc32": 0})
    with pytest.raises(RequestError, match="prefill engine"):
        consumer.add_request([5, 6, 7], greedy(), kv_transfer_params={"do_remote_decode": True})
