"""A vLLM prefill engine restarted under the same engine id (`--kv-transfer-config '{"engine_id": ...}'`),
without vLLM: a fake producer process that does what vLLM's NixlConnector producer does for a consumer — a
real NIXL agent (UCX loopback) over host memory in vLLM's CPU page layout (LBHNC, the "vec" order, fp32),
its handshake answered on a ZMQ ROUTER — is read once, killed, and replaced by a new one (same engine id,
same side-channel port; new agent, new memory, other KV). The decode side (`VllmReader`) must notice the
lost peer on the first failed READ (that request fails, naming the engine and a possible restart), drop
the stale pairing, and read the next request's own KV from the new process; and params the old process
answered whose load starts only after that re-pairing must fail, reading nothing (the same block ids in the
new process hold another request's KV)."""

from __future__ import annotations

import multiprocessing as mp
import socket
import time
import uuid
from pathlib import Path

import pytest
import torch

from gigadecode.config import GptOssConfig
from gigadecode.connector.nixl_agent import NixlKVAgent
from gigadecode.connector.vllm_handshake import from_vllm_answer
from gigadecode.connector.vllm_producer import RESTART_SKEW_S, VllmReader
from gigadecode.engine_config import EngineConfig
from gigadecode.kv.cache import KVCache

DEMO = Path(__file__).parents[1] / "gigadecode" / "assets" / "demo"
ENGINE_ID = "vllm-prefill-fixed-id"
REGIONS, HEADS, BLOCK, DIM, NUM_BLOCKS = 2, 2, 32, 32, 8     # the demo model: 4 layers -> 2 regions, fp32
LOCAL_BLOCK = 16


def producer_kv(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V [regions, blocks, heads, block, dim] (fp32) a fake producer of this seed holds."""
    g = torch.Generator().manual_seed(seed)
    shape = (REGIONS, NUM_BLOCKS, HEADS, BLOCK, DIM)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def vllm_pages(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """[..., heads, block, dim] K and V -> vLLM CPU pages (vec order: per head K as [dim, block], then V as
    [block, dim]), uint8 [..., page bytes]."""
    kp = k.transpose(-1, -2).reshape(*k.shape[:-2], BLOCK * DIM)
    vp = v.reshape(*v.shape[:-2], BLOCK * DIM)
    pages = torch.stack((kp, vp), -2).contiguous()                    # [..., heads, 2, block·dim]
    return pages.view(torch.uint8).reshape(*k.shape[:-3], -1)


def fake_vllm_producer(conn, engine_id: str, port: int, seed: int) -> None:
    """One vLLM prefill process: NIXL agent over its pages, side channel on `port`, until told to stop."""
    import msgspec
    import zmq
    from nixl._api import nixl_agent_config
    from gigadecode.connector.nixl_agent import _new_agent
    torch.set_num_threads(1)
    k, v = producer_kv(seed)
    regions = [vllm_pages(k[r], v[r]) for r in range(REGIONS)]       # each [blocks, page]: one region
    agent = _new_agent(f"vllm-{uuid.uuid4()}", nixl_agent_config(backends=["UCX"], enable_prog_thread=True))
    agent.register_memory(regions)
    page = regions[0].shape[1]
    inner = {"engine_id": engine_id, "agent_metadata": agent.get_agent_metadata(),
             "kv_caches_base_addr": [t.data_ptr() for t in regions], "num_blocks": NUM_BLOCKS,
             "block_lens": [page] * REGIONS, "block_strides": [page] * REGIONS, "kv_cache_layout": "LBHNC",
             "block_size": BLOCK, "attn_backend_name": "CPU_ATTN"}
    answer = msgspec.msgpack.encode({"compatibility_hash": "fake", "agent_metadata_bytes":
                                     msgspec.msgpack.encode(inner)})
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.bind(f"tcp://127.0.0.1:{port}")
    conn.send("ready")
    notifs: list[bytes] = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if router.poll(20):
            frames = router.recv_multipart()
            router.send_multipart((frames[0], b"", answer, msgspec.msgpack.encode(time.time())))
        for msgs in agent.get_new_notifs().values():
            notifs.extend(msgs)
        if conn.poll(0):
            if conn.recv() == "stop":
                break
            conn.send(notifs)
    router.close(0)


class FakeVllm:
    def __init__(self, port: int, seed: int) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=fake_vllm_producer, args=(child, ENGINE_ID, port, seed), daemon=True)
        self.proc.start()
        assert self.conn.poll(60) and self.conn.recv() == "ready"

    def notifs(self) -> list[bytes]:
        self.conn.send("notifs")
        assert self.conn.poll(10)
        return self.conn.recv()

    def kill(self) -> None:
        """A crash or a restart: the process is gone, its agent and memory with it."""
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(10)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def params_for(port: int, request: str, blocks: list[list[int]], n: int):
    return from_vllm_answer({"remote_engine_id": ENGINE_ID, "remote_host": "127.0.0.1", "remote_port": port,
                             "remote_request_id": request, "remote_block_ids": blocks, "remote_num_tokens": n,
                             "tp_size": 1, "transfer_mode": "pull"}, lease_s=60.0)


def run_load(reader: VllmReader, rid: str, params, tables: list[list[int]], timeout_s: float = 30) -> str | None:
    """Start a load and poll it to its end: None when it landed, else its error."""
    reader.start_load(rid, params, tables)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done, failed = reader.get_finished()
        if rid in failed:
            return failed[rid]
        if rid in done:
            reader.notify(rid)
            return None
        time.sleep(0.01)
    raise AssertionError(f"load {rid} neither landed nor failed in {timeout_s} s")


def assert_own_kv(kv: KVCache, seed: int, blocks: list[list[int]], tables: list[list[int]], n: int,
                  windows: list[int | None]) -> None:
    """Every token the decode needs holds the KV of the producer of `seed`, from the blocks its params name."""
    k, v = producer_kv(seed)
    for g, (ids, table, window) in enumerate(zip(blocks, tables, windows)):
        first = max(0, n - window + 1) if window else 0
        for p in range(first, n):
            rb, lb = ids[p // BLOCK], table[p // LOCAL_BLOCK]
            for r in range(REGIONS):
                assert torch.equal(kv.k_buf(r)[lb, :, p % LOCAL_BLOCK], k[r, rb, :, p % BLOCK]), (g, p, r)
                assert torch.equal(kv.v_buf(r)[lb, :, p % LOCAL_BLOCK], v[r, rb, :, p % BLOCK]), (g, p, r)


@pytest.mark.timeout(180)
def test_a_restarted_vllm_prefill_with_a_fixed_engine_id_is_paired_again():
    cfg = GptOssConfig.from_hf(DEMO)
    kv = KVCache(cfg, EngineConfig(dtype="float32", kv_dtype="auto", block_size=LOCAL_BLOCK), 8)
    agent = NixlKVAgent("decode-vllm-restart")
    reader = VllmReader(agent, kv, cfg, heads=(0, HEADS), timeout_s=15.0, layout="vec", consumers=1)
    n, tables = 40, [[1, 2, 3], [4, 5, 6]]                  # 40 tokens: 2 vLLM blocks, 3 local ones per group
    port = free_port()
    old = FakeVllm(port, seed=1)
    new = None
    try:
        assert run_load(reader, "r1", params_for(port, "req-1", [[1, 2], [3, 4]], n), tables) is None
        assert_own_kv(kv, 1, [[1, 2], [3, 4]], tables, n, reader.windows)
        stale = params_for(port, "req-0", [[5, 6], [7, 1]], n)   # answered by the old process, loaded last
        old.kill()
        new = FakeVllm(port, seed=2)                        # same engine id, same port: a new process
        # the first request after the restart still reads with the old pairing: it fails, saying why
        err = run_load(reader, "r2", params_for(port, "req-2", [[5, 6], [7, 1]], n), tables)
        assert err is not None and ENGINE_ID in err and "restarted" in err, err
        assert ENGINE_ID not in reader.paired and not reader.dropped   # the stale pairing is gone, its agent too
        while time.time() <= reader.lost_at[ENGINE_ID] + RESTART_SKEW_S:   # params issued this soon are refused
            time.sleep(0.05)
        # the next one pairs with the new process and decodes from its own KV (another request's blocks)
        kv.group_bufs[0].zero_(), kv.group_bufs[1].zero_()
        blocks = [[2, 7], [6, 3]]
        assert run_load(reader, "r3", params_for(port, "req-3", blocks, n), tables) is None
        assert_own_kv(kv, 2, blocks, tables, n, reader.windows)
        deadline = time.monotonic() + 10
        while b"req-3:1" not in (got := new.notifs()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert b"req-3:1" in got                             # the new process was told it may free them
        assert len(reader.paired) == 1
        # the old process's params, loaded after the new pairing: its blocks 5, 6, 7, 1 are the new process's
        # now (another request's KV); they must fail, read nothing, and leave the new pairing alone
        kv.group_bufs[0].zero_(), kv.group_bufs[1].zero_()
        err = run_load(reader, "r0", stale, tables)
        assert err is not None and ENGINE_ID in err and "restarted (or lost) after these params were issued" in err
        assert not any(buf.any() for buf in kv.group_bufs), "the old process's params read the new process's KV"
        assert len(reader.paired) == 1 and not any(b"req-0" in m for m in new.notifs())
    finally:
        reader.close()
        old.kill()
        if new is not None:
            new.kill()
        agent.close()


@pytest.mark.timeout(180)
def test_a_reader_reads_only_from_the_vllm_process_that_answered():
    """With the process the router signs into the params (`producer_process`, from a probe of the side channel
    after vLLM answered): a reader that never paired with the old process refuses the old process's params once
    a new one listens under the same engine id, reading nothing (before, it paired with the new process and
    decoded another request's KV); a reader still paired with the old process reads the new process's params
    at once, pairing anew (before, that request failed on the dead pairing)."""
    from gigadecode.connector.vllm_handshake import fetch_handshake
    cfg = GptOssConfig.from_hf(DEMO)
    n, tables = 40, [[1, 2, 3], [4, 5, 6]]
    port = free_port()

    def answered(request: str, blocks: list[list[int]]):
        """What the router sends a decode server for vLLM's answer: the params and the process that gave them."""
        p = params_for(port, request, blocks, n)
        return p.model_copy(update={"producer_process": fetch_handshake("127.0.0.1", port, 5.0).process})

    def reader_of(name: str) -> tuple[VllmReader, KVCache, NixlKVAgent]:
        kv = KVCache(cfg, EngineConfig(dtype="float32", kv_dtype="auto", block_size=LOCAL_BLOCK), 8)
        agent = NixlKVAgent(name)
        return VllmReader(agent, kv, cfg, heads=(0, HEADS), timeout_s=15.0, layout="vec", consumers=1), kv, agent

    (paired, kv, agent), (unpaired, kv2, agent2) = reader_of("decode-paired"), reader_of("decode-unpaired")
    old = FakeVllm(port, seed=1)
    new = None
    try:
        assert run_load(paired, "r1", answered("req-1", [[1, 2], [3, 4]]), tables) is None
        assert_own_kv(kv, 1, [[1, 2], [3, 4]], tables, n, paired.windows)
        stale = answered("req-0", [[5, 6], [7, 1]])
        old.kill()
        new = FakeVllm(port, seed=2)                        # same engine id, same port: a new process
        err = run_load(unpaired, "s0", stale, tables)
        assert err is not None and f"vLLM prefill {ENGINE_ID} that answered these params is gone" in err, err
        assert not any(buf.any() for buf in kv2.group_bufs), "the old process's params read the new process's KV"
        kv.group_bufs[0].zero_(), kv.group_bufs[1].zero_()
        blocks = [[2, 7], [6, 3]]
        assert run_load(paired, "r2", answered("req-2", blocks), tables) is None
        assert_own_kv(kv, 2, blocks, tables, n, paired.windows)
        assert len(paired.paired) == 1 and not paired.dropped       # the stale pairing's agent left NIXL
        kv.group_bufs[0].zero_(), kv.group_bufs[1].zero_()
        err = run_load(paired, "s1", stale, tables)
        assert err is not None and "that answered these params is gone" in err, err
        assert not any(buf.any() for buf in kv.group_bufs)
        deadline = time.monotonic() + 10
        while b"req-2:1" not in (got := new.notifs()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert b"req-2:1" in got and not any(b"req-0" in m for m in got)
    finally:
        for reader in (paired, unpaired):
            reader.close()
        old.kill()
        if new is not None:
            new.kill()
        agent.close(), agent2.close()
