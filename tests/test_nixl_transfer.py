"""NIXL KV transfer across a real process boundary (loopback): a producer (prefill) process owns a filled
KVCache; the consumer (this process) READs non-contiguous remote blocks into other local block ids.

nixl is a real dependency: if it cannot be imported this module errors (it does not skip).
"""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest
import torch

from gigadecode.checkpoint import preset_config
from gigadecode.engine_config import EngineConfig
from gigadecode.connector.params import KVParamsError, KVTransferParams, parse_kv_params
from gigadecode.connector.base import (COMPAT_FIELDS, HandshakeError, KVLayout, TransferError,
                                       TransferTimeout, check_compatible, model_identity, pair_remote_blocks)
from gigadecode.connector.nixl_agent import NixlKVAgent, block_descs
from gigadecode.kv.cache import KVCache

NUM_BLOCKS = 32
PRODUCER_SEED = 1234
CONSUMER_SEED = 99


def make_cache(kv_dtype: str = "fp8", block_size: int = 4, num_blocks: int = NUM_BLOCKS) -> KVCache:
    return KVCache(preset_config("tiny"), EngineConfig(kv_dtype=kv_dtype, block_size=block_size), num_blocks)


def fill(cache: KVCache, seed: int) -> None:
    """Every block but the null block 0 of every buffer's K and V: deterministic random bytes."""
    g = torch.Generator().manual_seed(seed)
    for buf in cache.group_bufs:
        raw = buf.view(torch.uint8)
        raw[:, 1:] = torch.randint(0, 256, raw[:, 1:].shape, generator=g, dtype=torch.uint8)


def raw_bufs(cache: KVCache) -> list[torch.Tensor]:
    return [b.view(torch.uint8).clone() for b in cache.group_bufs]


# -- the producer process ----------------------------------------------------------------------------
def producer_main(conn, name: str, kv_dtype: str, block_size: int) -> None:
    """Serve one filled KVCache; progress the agent unless stalled; answer commands over `conn`."""
    torch.set_num_threads(1)
    cache = make_cache(kv_dtype, block_size)
    fill(cache, PRODUCER_SEED)
    agent = NixlKVAgent(name, model_id=model_identity(cache.cfg))
    layout = agent.register_kv(cache)
    conn.send(("ready", agent.metadata(), layout.to_dict()))
    notifs: dict[str, list[bytes]] = {}
    progressing, deadline = True, time.monotonic() + 120
    while time.monotonic() < deadline:
        if progressing:
            for k, v in agent.get_notifs().items():
                notifs.setdefault(k, []).extend(v)
        if conn.poll(0 if progressing else 0.01):
            cmd = conn.recv()
            if cmd == "stop":
                break
            if cmd == "stall":
                progressing = False
            elif cmd == "resume":
                progressing = True
            elif cmd == "notifs":
                conn.send(notifs)
                notifs = {}
            conn.send("ok") if cmd in ("stall", "resume") else None
        elif progressing:
            time.sleep(1e-4)
    agent.close()


class Producer:
    def __init__(self, name: str = "prefill-0", kv_dtype: str = "fp8", block_size: int = 4) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=producer_main, args=(child, name, kv_dtype, block_size), daemon=True)
        self.proc.start()
        tag, self.metadata, layout = self.recv(60)
        assert tag == "ready"
        self.layout = KVLayout.from_dict(layout)
        self.name = name

    def recv(self, timeout: float = 10):
        if not self.conn.poll(timeout):
            raise TimeoutError("producer did not answer")
        return self.conn.recv()

    def command(self, cmd: str):
        self.conn.send(cmd)
        return self.recv()

    def notifs(self) -> dict[str, list[bytes]]:
        return self.command("notifs")

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send("stop")
            except (BrokenPipeError, OSError):
                pass
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


@pytest.fixture(scope="module")
def producer():
    p = Producer()
    yield p
    p.stop()


@pytest.fixture(scope="module")
def consumer(producer):
    cache = make_cache()
    fill(cache, CONSUMER_SEED)
    agent = NixlKVAgent("decode-0", model_id=model_identity(cache.cfg))
    agent.register_kv(cache)
    agent.add_remote(producer.name, producer.metadata, producer.layout)
    yield agent, cache
    agent.close()


def expected_remote() -> list[torch.Tensor]:
    cache = make_cache()
    fill(cache, PRODUCER_SEED)
    return raw_bufs(cache)


def wait_notif(producer: Producer, sender: str, msg: bytes, timeout: float = 10) -> list[bytes]:
    got: list[bytes] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got += producer.notifs().get(sender, [])
        if msg in got:
            return got
        time.sleep(0.02)
    raise AssertionError(f"producer never saw {msg!r} from {sender!r} (got {got})")


# -- tests ---------------------------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_layout_registers_k_and_v_per_buffer(consumer, producer):
    agent, cache = consumer
    lay = agent.layout()
    assert lay.num_buffers == len(cache.group_bufs) == 2 and lay.num_groups == 2
    assert lay.num_regions == 2 * lay.num_buffers
    assert lay.region_addrs == tuple(cache.group_bufs[i][h].data_ptr() for i in range(2) for h in (0, 1))
    assert lay.block_len == cache.num_kv_heads * 4 * cache.head_dim * 1       # kv·block·d·itemsize (fp8)
    assert (lay.dtype, lay.packed, lay.block_size, lay.num_blocks) == ("float8_e4m3fn", True, 4, NUM_BLOCKS)
    assert producer.layout.compat_hash() == lay.compat_hash()
    assert producer.layout.region_addrs != lay.region_addrs                   # other process, own memory
    d = block_descs(lay.region_addrs, lay.num_blocks, lay.block_len)
    assert d.shape == (lay.num_regions * NUM_BLOCKS, 3)
    assert int(d[NUM_BLOCKS + 5, 0]) == lay.region_addrs[1] + 5 * lay.block_len


@pytest.mark.timeout(60)
def test_read_noncontiguous_blocks(consumer, producer):
    agent, cache = consumer
    before = raw_bufs(cache)
    remote = expected_remote()
    # Per group: sliding group reads remote [3, 17] -> local [20, 2]; full group [5, 30, 9] -> [11, 7, 31].
    pairs = [(3, 20), (17, 2), (5, 11), (30, 7), (9, 31)]
    h = agent.read_blocks(producer.name, pairs, notif=b"req-1", timeout_s=20)
    assert h.state == "DONE" and h.released and h.num_descs == len(pairs) * 4
    after = raw_bufs(cache)
    moved = {lb: rb for rb, lb in pairs}
    for i in range(len(after)):
        for half in (0, 1):                                                   # K and V of every buffer
            for lb in range(NUM_BLOCKS):
                want = remote[i][half, moved[lb]] if lb in moved else before[i][half, lb]
                assert torch.equal(after[i][half, lb], want), (i, half, lb)
    # The bytes are the KV: the packed-FP8 K view gathers the same tokens on both sides.
    ref = make_cache()
    fill(ref, PRODUCER_SEED)
    k_loc, v_loc = cache.gather(1, torch.tensor([7]))
    k_ref, v_ref = ref.gather(1, torch.tensor([30]))
    assert torch.equal(k_loc.nan_to_num(), k_ref.nan_to_num())
    assert torch.equal(v_loc.nan_to_num(), v_ref.nan_to_num())
    assert b"req-1" in wait_notif(producer, "decode-0", b"req-1")


@pytest.mark.timeout(60)
def test_partial_block_reads(consumer, producer):
    """sub_range: a byte range (a kv-head slice) of each remote block into another range of the local block."""
    agent, cache = consumer
    hb = agent.layout().block_len // cache.num_kv_heads                       # bytes of one kv head in a block
    remote = expected_remote()
    before = raw_bufs(cache)
    agent.read_blocks(producer.name, [(4, 13), (10, 14)], timeout_s=20)      # (whole blocks: the default)
    agent.wait(agent.read(producer.name, [(21, 13), (22, 14)], sub_range=(hb, hb), local_offset=0), 20)
    after = raw_bufs(cache)
    for i in range(len(after)):
        for half in (0, 1):
            for rb, rb2, lb in ((4, 21, 13), (10, 22, 14)):
                got, want = after[i][half, lb].reshape(-1), remote[i][half, rb].reshape(-1).clone()
                want[:hb] = remote[i][half, rb2].reshape(-1)[hb: 2 * hb]       # head 1 of rb2 -> head 0
                assert torch.equal(got, want), (i, half, lb)
            assert torch.equal(after[i][half, 15], before[i][half, 15])


@pytest.mark.timeout(60)
def test_empty_read_only_notifies(consumer, producer):
    agent, cache = consumer
    before = raw_bufs(cache)
    h = agent.read_blocks(producer.name, [], notif=b"req-empty")
    assert h.state == "DONE"
    assert all(torch.equal(a, b) for a, b in zip(before, raw_bufs(cache)))
    wait_notif(producer, "decode-0", b"req-empty")


@pytest.mark.timeout(60)
def test_bad_block_ids_are_clear_errors(consumer, producer):
    agent, cache = consumer
    before = raw_bufs(cache)
    with pytest.raises(TransferError, match=r"remote block id 32 out of range \[0, 32\)"):
        agent.read(producer.name, [(1, 1), (32, 2)])
    with pytest.raises(TransferError, match=r"local block id 40 out of range"):
        agent.read(producer.name, [(1, 40)])
    with pytest.raises(TransferError, match=r"remote block id -1"):
        agent.read(producer.name, [(-1, 3)])
    with pytest.raises(TransferError, match="appears twice"):
        agent.read(producer.name, [(1, 3), (2, 3)])
    with pytest.raises(TransferError, match="unknown remote agent"):
        agent.read("nobody", [(1, 3)])
    with pytest.raises(TransferError, match="sub_range"):
        agent.read(producer.name, [(1, 3)], sub_range=(64, agent.layout().block_len))
    assert all(torch.equal(a, b) for a, b in zip(before, raw_bufs(cache)))
    agent.read_blocks(producer.name, [(12, 12)], timeout_s=20)                # the agent still works
    assert torch.equal(raw_bufs(cache)[0][1, 12], expected_remote()[0][1, 12])


@pytest.mark.timeout(60)
def test_stalled_producer_times_out(consumer, producer):
    """A producer that stops progressing its agent (a hung prefill engine): READs time out and are cancelled.

    UCX lets about one READ complete right after the target stops progressing, so up to 3 are tried.
    """
    agent, _ = consumer
    assert producer.command("stall") == "ok"
    try:
        outcomes = []
        for attempt in range(3):
            h = agent.read(producer.name, [(6, 6), (8, 9)], notif=b"req-stalled-%d" % attempt)
            t0 = time.monotonic()
            try:
                agent.wait(h, timeout_s=1.0)
                outcomes.append("done")
            except TransferTimeout as e:
                assert "not done after 1 s" in str(e) and "cancelled" in str(e)
                assert 0.9 < time.monotonic() - t0 < 5 and h.state == "TIMEOUT" and h.released
                outcomes.append("timeout")
                break
        assert outcomes[-1] == "timeout", outcomes
    finally:
        assert producer.command("resume") == "ok"
    h = agent.read_blocks(producer.name, [(6, 6)], notif=b"req-after", timeout_s=20)
    assert h.state == "DONE"
    wait_notif(producer, "decode-0", b"req-after")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("change, field, local_val", [
    (dict(block_size=8), "block_size", 8),
    (dict(kv_dtype="bf16"), "dtype", "bfloat16"),
])
def test_mismatched_layout_is_refused(producer, change, field, local_val):
    kw = dict(kv_dtype="fp8", block_size=4) | change
    cache = make_cache(**kw)
    agent = NixlKVAgent(f"decode-mismatch-{field}", model_id=model_identity(cache.cfg))
    try:
        agent.register_kv(cache)
        remote_val = getattr(producer.layout, field)
        with pytest.raises(HandshakeError, match=rf"KV layout mismatch: {field}: local {local_val}, remote {remote_val}"):
            agent.add_remote(producer.name, producer.metadata, producer.layout)
        assert agent.remotes == []
        with pytest.raises(TransferError, match="unknown remote agent"):
            agent.read(producer.name, [(1, 1)])
    finally:
        agent.close()


@pytest.mark.timeout(60)
def test_read_fails_cleanly_when_the_producer_is_gone():
    """A second producer that exits: the READ raises TransferError (or times out), never hangs or crashes."""
    p = Producer("prefill-gone")
    cache = make_cache()
    agent = NixlKVAgent("decode-gone", model_id=model_identity(cache.cfg))
    try:
        agent.register_kv(cache)
        agent.add_remote(p.name, p.metadata, p.layout)
        agent.read_blocks(p.name, [(2, 2)], timeout_s=20)                     # connected and working
        p.stop()
        assert not p.proc.is_alive()
        with pytest.raises(TransferError):
            agent.read_blocks(p.name, [(3, 3)], timeout_s=5)
    finally:
        p.stop()
        agent.close()


# -- in-process checks of the handshake data ------------------------------------------------------------
def _layout(**kw) -> KVLayout:
    base = dict(engine_id="e", agent_name="a", host="127.0.0.1", port=1, model_id="m", dtype="float8_e4m3fn",
                packed=True, block_size=16, kv_heads=8, head_dim=64, num_blocks=100, block_len=8192,
                num_groups=2, num_buffers=18, num_regions=2, region_addrs=(4096, 1 << 20))
    return KVLayout(**(base | kw))


def test_layout_dict_roundtrip_and_hash():
    a = _layout()
    d = a.to_dict()
    assert KVLayout.from_dict(d) == a
    # Peers may differ in pool size, addresses and endpoint: same hash, compatible.
    b = _layout(num_blocks=7, region_addrs=(1, 2), engine_id="x", agent_name="y", host="h", port=9)
    assert a.compat_hash() == b.compat_hash()
    check_compatible(a, b)
    with pytest.raises(HandshakeError, match="compat_hash"):
        KVLayout.from_dict(d | {"block_size": 8})
    with pytest.raises(HandshakeError, match="missing fields: block_len"):
        KVLayout.from_dict({k: v for k, v in d.items() if k != "block_len"})


@pytest.mark.parametrize("field", COMPAT_FIELDS)
def test_check_compatible_names_each_field(field):
    a = _layout()
    v = getattr(a, field)
    other = (not v) if isinstance(v, bool) else (v + "x" if isinstance(v, str) else v * 2)
    kw = {field: other}
    if field == "num_regions":
        kw["region_addrs"] = tuple(range(other))
    b = _layout(**kw)
    assert a.compat_hash() != b.compat_hash()
    with pytest.raises(HandshakeError, match=rf"KV layout mismatch: {field}: local {v}, remote {other}"):
        check_compatible(a, b)


def test_check_compatible_rejects_malformed_and_names_head_ratio():
    with pytest.raises(HandshakeError, match="malformed"):
        check_compatible(_layout(), _layout(region_addrs=(1,)))
    with pytest.raises(HandshakeError, match="head_ratio"):
        check_compatible(_layout(), _layout(kv_heads=1))


def test_head_mapping_between_tp_sizes():
    from gigadecode.connector.base import head_byte_range
    full = _layout(total_kv_heads=8)                                           # tp 1: heads [0, 8)
    r1 = _layout(kv_heads=4, block_len=4096, kv_head_start=4, total_kv_heads=8)  # tp 2, rank 1: heads [4, 8)
    check_compatible(full, r1)
    check_compatible(r1, full)
    assert head_byte_range(r1, full) == (4096, 0, 4096)                        # decode tp 2 <- prefill tp 1
    assert head_byte_range(full, r1) == (0, 4096, 4096)                        # decode tp 1 <- prefill tp 2
    assert head_byte_range(full, full) == (0, 0, 8192)
    r0 = _layout(kv_heads=4, block_len=4096, kv_head_start=0, total_kv_heads=8)
    with pytest.raises(HandshakeError, match="kv_heads"):                      # same count, disjoint heads
        check_compatible(r0, r1)
    with pytest.raises(HandshakeError, match="kv_heads"):                      # no TP head info
        check_compatible(_layout(), _layout(kv_heads=4, block_len=4096))
    with pytest.raises(HandshakeError, match="kv_heads"):                      # other bytes per head
        check_compatible(full, _layout(kv_heads=4, block_len=8192, kv_head_start=4, total_kv_heads=8))
    with pytest.raises(HandshakeError, match="dtype"):                         # everything else still checked
        check_compatible(full, _layout(kv_heads=4, block_len=4096, kv_head_start=4, total_kv_heads=8,
                                       dtype="bfloat16"))
    assert KVLayout.from_dict(r1.to_dict()) == r1


def test_pair_remote_blocks_and_params():
    """The producer's live blocks (per group from `remote_first_block`) onto the consumer's at the same logical
    indices: freed sliding entries (0) on this side are skipped, blocks past the computed tokens need nothing,
    a block holding computed tokens the prefill did not send (what the N-1 rule prevents) and a count that
    does not match are errors."""
    def params(ids, first, n):
        return KVTransferParams(remote_block_ids=ids, remote_first_block=first, num_computed_tokens=n)
    # B = 4, 10 computed tokens: logical blocks 0..2 hold them; sliding group: blocks 0 freed here, 1..2 sent
    pairs, local = pair_remote_blocks(params([[41, 42], [50, 51, 52]], [1, 0], 10), [[0, 7, 8, 9], [3, 4, 5, 6]], 4)
    assert pairs == [(41, 7), (42, 8), (50, 3), (51, 4), (52, 5)] and local == [[7, 8], [3, 4, 5]]
    with pytest.raises(TransferError, match="logical block 0 was not sent"):
        pair_remote_blocks(params([[42]], [1], 10), [[6, 7, 8]], 4)
    with pytest.raises(TransferError, match="the prefill sent 3 blocks, 2 are live here"):
        pair_remote_blocks(params([[40, 41, 42]], [0], 8), [[6, 7, 8]], 4)
    p = KVTransferParams(do_remote_prefill=True, remote_engine_id="p0", remote_block_ids=[[1], [2, 3]],
                         num_computed_tokens=7)
    assert parse_kv_params(p.to_dict()) == p
    with pytest.raises(KVParamsError, match="kv_transfer_params.unknown: Extra inputs"):
        parse_kv_params(p.to_dict() | {"unknown": 1})
    assert model_identity(preset_config("tiny")) == model_identity(preset_config("tiny"))
    assert model_identity(preset_config("tiny")) != model_identity(preset_config("small"))


@pytest.mark.timeout(60)
def test_progress_thread_serves_reads_and_sleeps_between():
    # A producer's agent has a progress thread (a consumer's READ completes only while the producer's agent
    # is progressed, and a prefill step can take seconds). It must wake on traffic, not poll without pause:
    # such a thread took a whole core from the kernels (DI on 2 cores decoded ~10x slower).
    cache_p = make_cache()
    fill(cache_p, PRODUCER_SEED)
    prod = NixlKVAgent("prefill-pthread", model_id=model_identity(cache_p.cfg), progress_thread=True)
    lay = prod.register_kv(cache_p)
    cpu = time.process_time()
    time.sleep(1.0)
    idle_cpu = time.process_time() - cpu           # every thread of this process over 1 s of idle
    cache_c = make_cache()
    fill(cache_c, CONSUMER_SEED)
    cons = NixlKVAgent("decode-pthread", model_id=model_identity(cache_c.cfg))
    cons.register_kv(cache_c)
    cons.add_remote(prod.name, prod.metadata(), lay)
    try:
        # nothing here progresses the producer's agent: only its own thread completes the READ
        h = cons.read_blocks(prod.name, [(3, 20), (9, 2)], timeout_s=20)
        assert h.state == "DONE"
        remote, after = expected_remote(), raw_bufs(cache_c)
        for i in range(len(after)):
            assert torch.equal(after[i][:, 20], remote[i][:, 3]) and torch.equal(after[i][:, 2], remote[i][:, 9])
    finally:
        cons.close()
        prod.close()
    assert idle_cpu < 0.3, f"an idle agent used {idle_cpu:.2f} s of CPU in 1 s"
