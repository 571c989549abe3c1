"""Reading KV from a stock vLLM prefill engine, without vLLM: the page repack against hand-built vLLM CPU
pages (vec and AMX orders, fp32 / bf16 / fp8, element by element from vLLM's index formulas), the handshake
and params of a real vLLM 0.32 producer (recorded from one: `tests/fixtures/vllm/`), the wire protocol of its
side channel (a ZMQ ROUTER replaying the recorded answer, checking our request byte for byte), the token
plan across block sizes, and the router's signed params. The end-to-end run against a live vLLM server is
`tests/test_vllm_interop.py` (`make test-interop`)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import msgspec
import pytest
import torch
import zmq

from gigadecode.connector.base import HandshakeError, TransferError
from gigadecode.connector.params import KVParamsError, parse_kv_params, prompt_digest, sign, verify
from gigadecode.connector.vllm_layout import page_bytes, token_plan, unpack_pages
from gigadecode.connector.vllm_handshake import GET_META_MSG, VllmAgentMetadata, fetch_handshake, from_vllm_answer

from .helpers import KV_SECRET

FIX = Path(__file__).parent / "fixtures" / "vllm"


def _hand_page(k: torch.Tensor, v: torch.Tensor, layout: str) -> torch.Tensor:
    """One vLLM page from k, v [H, B, D] (any dtype), element by element with vLLM's index formulas."""
    H, B, D = k.shape
    kp = torch.empty(H, B * D, dtype=k.dtype)
    vp = torch.empty(H, B * D, dtype=v.dtype)
    for h in range(H):
        for t in range(B):
            for d in range(D):
                if layout == "vec":
                    ko, vo = d * B + t, t * D + d
                else:
                    ko = ((t // 16) * (D // 2) + d // 2) * 32 + (t % 16) * 2 + d % 2
                    vo = (d // 16) * (16 * B) + (t // 2) * 32 + (d % 16) * 2 + t % 2
                kp[h, ko], vp[h, vo] = k[h, t, d], v[h, t, d]
    page = torch.stack((kp, vp), 1)                                    # [H, 2, B·D]: head by head, K then V
    return page.contiguous().view(torch.uint8).reshape(-1)


@pytest.mark.parametrize("layout", ["vec", "amx"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_unpack_hand_built_pages(layout, dtype):
    H, B, D, n = 2, 32, 32, 3
    g = torch.Generator().manual_seed(1)
    ks = (torch.randn(n, H, B, D, generator=g) * 4).to(dtype)
    vs = (torch.randn(n, H, B, D, generator=g) * 4).to(dtype)
    raw = torch.stack([_hand_page(ks[i], vs[i], layout) for i in range(n)])
    assert raw.shape == (n, page_bytes(H, B, D, dtype))
    k, v = unpack_pages(raw, H, B, D, dtype, layout)
    assert torch.equal(k.view(torch.uint8), ks.view(torch.uint8)) and torch.equal(v.view(torch.uint8), vs.view(torch.uint8))
    other = "amx" if layout == "vec" else "vec"                        # the wrong order is not silently right
    k2, _ = unpack_pages(raw, H, B, D, dtype, other)
    assert not torch.equal(k2.float(), ks.float())


def test_unpack_refuses_wrong_pages():
    with pytest.raises(ValueError, match="expected uint8"):
        unpack_pages(torch.zeros(1, 100, dtype=torch.uint8), 2, 32, 32, torch.float32, "vec")
    with pytest.raises(ValueError, match="unknown vLLM KV layout"):
        unpack_pages(torch.zeros(1, page_bytes(2, 32, 32, torch.float32), dtype=torch.uint8), 2, 32, 32,
                     torch.float32, "tiles")


# --------------------------------------------------------------------------------------------------
# the recorded handshake and params of a vLLM 0.32 CPU producer (the demo model, fp32, block 32)
# --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def recorded():
    return (FIX / "handshake_fp32.msgpack").read_bytes(), json.loads((FIX / "params_fp32.json").read_text())


def test_recorded_handshake_decodes(recorded):
    payload, params = recorded
    meta = VllmAgentMetadata.from_payload(payload)
    assert meta.engine_id == params["answer"]["remote_engine_id"]
    assert meta.kv_cache_layout == "LBHNC" and meta.attn_backend_name == "CPU_ATTN" and meta.block_size == 32
    assert len(meta.kv_caches_base_addr) == 2                           # one region per pair of layers (4 layers)
    assert meta.block_lens == (2 * 2 * 32 * 32 * 4,) * 2                # 2 kv heads × (K, V) × 32 tokens × dim 32, fp32
    assert len(meta.agent_metadata) > 0 and meta.num_blocks > 1
    with pytest.raises(HandshakeError, match="not NIXL agent metadata"):
        VllmAgentMetadata.from_payload(msgspec.msgpack.encode({"compatibility_hash": "x"}))


def test_side_channel_wire_protocol(recorded):
    """A ZMQ ROUTER that answers like vLLM's listener (and records what it got): our request is the one
    well-formed message vLLM's listener takes; two frames come back."""
    payload, _ = recorded
    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    got = []

    def serve():
        frames = router.recv_multipart()
        got.append(frames)
        router.send_multipart((frames[0], b"", payload, msgspec.msgpack.encode(time.perf_counter())))
    t = threading.Thread(target=serve)
    t.start()
    meta = fetch_handshake("127.0.0.1", port, 5.0)
    t.join(5)
    router.close(0)
    assert len(got[0]) == 3 and got[0][1] == b""                       # identity, delimiter, message
    assert msgspec.msgpack.decode(got[0][2]) == [GET_META_MSG, 0, 0]
    assert meta.block_size == 32
    with pytest.raises(HandshakeError, match="did not answer"):         # nobody there
        fetch_handshake("127.0.0.1", port, 0.3)


def test_params_from_the_vllm_answer_and_signed_by_the_router(recorded):
    _, rec = recorded
    p = from_vllm_answer(rec["answer"], lease_s=30.0)
    assert p.producer == "vllm" and p.remote_block_ids == [[2, 3], [4, 5, 6]] and p.num_computed_tokens == 71
    assert time.time() + 25 < p.lease_expires < time.time() + 30
    prompt = rec["prompt_ids"] + [7]                                   # the decode request has one more token
    signed = sign(p.model_copy(update={"prompt_digest": prompt_digest(prompt)}), KV_SECRET.encode())
    verify(parse_kv_params(signed.to_dict()), KV_SECRET.encode(), prompt, "0" * 16)   # no layout id: vLLM's
    with pytest.raises(KVParamsError, match="another prompt"):
        verify(signed, KV_SECRET.encode(), prompt[:-1], "0" * 16)
    for bad, match in (({"tp_size": 2}, "TP 1"), ({"transfer_mode": "push"}, "pull"),
                       ({"remote_block_ids": None}, "lack remote_block_ids")):
        with pytest.raises(KVParamsError, match=match):
            from_vllm_answer({**rec["answer"], **bad}, 30.0)


def test_token_plan_across_block_sizes(recorded):
    """vLLM blocks of 32, ours of 16 (two local blocks per remote one), window 32: the full group needs every
    computed token, the sliding group the last W-1 + 1; the sliding list is the sequence's tail."""
    _, rec = recorded
    p = from_vllm_answer(rec["answer"], 30.0)                            # 71 tokens: 3 remote blocks
    full = list(range(10, 15))                                           # local blocks for tokens 0..79
    sliding = [0, 0, 20, 21, 22]                                         # tokens before 32 are dead here
    plans = token_plan(p, 32, [sliding, full], 16, [32, None])
    assert [s for _, _, s in plans[1]] == [full[t // 16] * 16 + t % 16 for t in range(71)]
    assert [(k, off) for k, off, _ in plans[1][:2]] == [(0, 0), (0, 1)] and plans[1][40][:2] == (1, 8)
    assert [t for t in range(71) if t >= 71 - 32 + 1] == [40 + i for i in range(len(plans[0]))]
    assert plans[0][0][:2] == (0, 8)                                     # token 40: remote list entry 0 = block 1
    lead_null = p.model_copy(update={"remote_block_ids": [[0, 3], [4, 5, 6]]})   # vLLM nulled block 1
    with pytest.raises(TransferError, match="token 40 is in no block"):
        token_plan(lead_null, 32, [sliding, full], 16, [32, None])
    with pytest.raises(TransferError, match="no local block for token 48"):
        token_plan(p, 32, [[0, 0, 21, 0, 22], full], 16, [32, None])


def test_tokenize_route(tiny_ckpt):
    """vLLM's /tokenize on our server (the router asks it for the ids a vLLM prefill gets)."""
    import httpx
    from gigadecode.cli import build_parser
    from gigadecode.server.api import build_app, engine_from_args
    from gigadecode.server.async_engine import AsyncEngine
    from .test_server import ServerThread
    args = build_parser().parse_args(["serve", "--model", str(tiny_ckpt), "--num-blocks", "16", "--dtype", "float32"])
    app = build_app(AsyncEngine(engine_from_args(args, "both"), codec=None), "ids-only")
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=30) as hc:
        r = hc.post("/tokenize", json={"prompt": [5, 6, 7]}).json()
        assert r["tokens"] == [5, 6, 7] and r["count"] == 3 and r["max_model_len"] > 0
        assert hc.post("/tokenize", json={"prompt": {"x": 1}}).status_code == 400
        assert hc.post("/tokenize", json={"prompt": "text"}).status_code == 400     # no tokenizer here


def test_a_producer_we_cannot_repack_is_refused_at_the_handshake(recorded, tiny_ckpt):
    """The recorded producer serves the demo model (2 kv heads × dim 32, 2 regions); a decode engine of the
    tiny model (dim 16) must refuse it before any read, naming why."""
    from gigadecode.config import GptOssConfig
    from gigadecode.engine_config import EngineConfig
    from gigadecode.connector.vllm_producer import VllmReader
    from gigadecode.kv.cache import KVCache
    cfg = GptOssConfig.from_hf(tiny_ckpt)
    kv = KVCache(cfg, EngineConfig(block_size=16), 8)
    reader = VllmReader(None, kv, cfg, heads=(0, cfg.num_key_value_heads), timeout_s=1.0)
    meta = VllmAgentMetadata.from_payload(recorded[0])
    with pytest.raises(HandshakeError, match="another model"):
        reader._check_geometry(meta)
    demo = GptOssConfig.from_hf(Path(__file__).parents[1] / "gigadecode" / "assets" / "demo")
    ok = VllmReader(None, KVCache(demo, EngineConfig(block_size=16), 8), demo, heads=(0, 2), timeout_s=1.0)
    ok._check_geometry(meta)                                           # the demo model's own geometry passes
    assert ok._geometry(meta)[1:] == (torch.float32, "vec")             # fp32 pages: always the vec order
    import dataclasses
    with pytest.raises(HandshakeError, match="only LBHNC"):
        ok._check_geometry(dataclasses.replace(meta, kv_cache_layout="NHD"))
    reader.fetches.close()
    ok.fetches.close()


def test_the_router_signs_when_vllm_answered(recorded):
    """`issued_at` (the router's clock when vLLM answered) is signed like every other field: moving it later, to
    slip past a restart the decode side saw, breaks the signature; it must be a finite number."""
    _, rec = recorded
    before = time.time()
    p = from_vllm_answer(rec["answer"], lease_s=30.0)
    assert before <= p.issued_at <= time.time()
    prompt = rec["prompt_ids"] + [7]
    signed = sign(p.model_copy(update={"prompt_digest": prompt_digest(prompt)}), KV_SECRET.encode()).to_dict()
    verify(parse_kv_params(signed), KV_SECRET.encode(), prompt, "0" * 16)
    for issued_at in (p.issued_at + 60, None):
        with pytest.raises(KVParamsError, match="signature does not match"):
            verify(parse_kv_params({**signed, "issued_at": issued_at}), KV_SECRET.encode(), prompt, "0" * 16)
    with pytest.raises(KVParamsError, match="issued_at: Value error, must be a finite number"):
        parse_kv_params({**signed, "issued_at": float("inf")})


def test_params_older_than_a_lost_pairing_are_refused_before_any_read(recorded):
    """Once the reader dropped engine E's pairing (its READ failed: E stopped or restarted), a load of E's params
    issued before that (plus the clock skew), or of unknown issue time, fails without a handshake or a READ
    (the NIXL agent records every call); params issued later, or of another engine, pass."""
    from gigadecode.config import GptOssConfig
    from gigadecode.connector.vllm_producer import RESTART_SKEW_S, VllmReader
    from gigadecode.engine_config import EngineConfig
    from gigadecode.kv.cache import KVCache
    _, rec = recorded
    demo = GptOssConfig.from_hf(Path(__file__).parents[1] / "gigadecode" / "assets" / "demo")
    calls: list[str] = []

    class RecordingAgent:                                                # stands for NixlKVAgent and its .agent
        agent = property(lambda self: self)

        def __getattr__(self, name):
            return lambda *args, **kwargs: calls.append(name)

    reader = VllmReader(RecordingAgent(), KVCache(demo, EngineConfig(block_size=16), 8), demo, heads=(0, 2),
                        timeout_s=1.0)
    p = from_vllm_answer(rec["answer"], lease_s=30.0)
    eid = p.remote_engine_id
    reader._refuse_if_restarted(p.model_copy(update={"issued_at": None}))   # nothing lost: old routers' params pass
    reader.paired[eid] = ("old-agent", VllmAgentMetadata.from_payload(recorded[0]))
    reader._unpair(eid, "old-agent")                                     # what a failed READ does
    lost = reader.lost_at[eid]
    assert eid not in reader.paired and time.time() - 1 < lost <= time.time()
    for issued_at in (None, p.issued_at - 5, lost, lost + RESTART_SKEW_S - 0.1):
        with pytest.raises(TransferError, match=f"vLLM prefill {eid} was restarted .or lost. after these params"):
            reader._refuse_if_restarted(p.model_copy(update={"issued_at": issued_at}))
    reader._refuse_if_restarted(p.model_copy(update={"issued_at": lost + RESTART_SKEW_S + 0.1}))
    reader._refuse_if_restarted(p.model_copy(update={"remote_engine_id": "another-engine"}))
    reader.start_load("r-old", p.model_copy(update={"issued_at": None}), [[1, 2, 3], [4, 5, 6]])
    done, failed = reader.get_finished()
    assert not done and "their KV went with the old process" in failed["r-old"] and not reader.loads
    assert calls == ["remove_remote_agent"]                              # the old agent left; no handshake, no READ
    assert not reader.fetches.pending                                   # no handshake was started either
    reader.fetches.close()


def test_a_vllm_process_is_named_by_what_only_it_has(recorded):
    """`process`: the same for every handshake answer of one process, different for a restarted one under the
    same engine id (new NIXL agent, or KV at new addresses)."""
    import dataclasses
    meta = VllmAgentMetadata.from_payload(recorded[0])
    assert meta.process == VllmAgentMetadata.from_payload(recorded[0]).process
    assert len(meta.process) == 32 and int(meta.process, 16) >= 0
    restarted = [dataclasses.replace(meta, agent_metadata=meta.agent_metadata + b"x"),
                 dataclasses.replace(meta, kv_caches_base_addr=(meta.kv_caches_base_addr[0] + 4096,
                                                                *meta.kv_caches_base_addr[1:])),
                 dataclasses.replace(meta, engine_id=meta.engine_id + "-2")]
    assert len({meta.process, *(m.process for m in restarted)}) == 4


def test_the_router_names_the_vllm_process_that_answered():
    """`AnsweringProcess.of`: a probe of the side channel started after the answer (one probe for the answers
    that came before it) names the process; a probe that had seen another process before the prefill was sent,
    another engine behind the side channel, or no answer in time, is a HandshakeError."""
    import asyncio
    from gigadecode.connector.vllm_handshake import AnsweringProcess, ProducerRestarted
    from .helpers import VllmSideChannel
    side = VllmSideChannel("eng")
    p = from_vllm_answer({"remote_engine_id": "eng", "remote_host": "127.0.0.1", "remote_port": side.port,
                          "remote_request_id": "r", "remote_block_ids": [[1]], "remote_num_tokens": 3}, lease_s=30.0)
    first = VllmAgentMetadata.from_payload(side.payload()).process

    async def run():
        watch = AnsweringProcess(timeout_s=2.0)         # ample for a live side channel on a loaded host
        answered = time.monotonic()
        got = await asyncio.gather(*(watch.of(p, watch.seen(), answered) for _ in range(5)))
        assert got == [first] * 5 and side.requests == 1           # one probe for the five answers
        assert await watch.of(p, watch.seen(), answered) == first and side.requests == 1   # started after them
        seen = watch.seen()
        assert seen == {("127.0.0.1", side.port): first}
        side.process = "second"                                      # restarted under the same engine id
        second = VllmAgentMetadata.from_payload(side.payload()).process
        with pytest.raises(ProducerRestarted, match="another process than before this prefill was sent"):
            await watch.of(p, seen, time.monotonic())                 # which of the two answered is unknown
        assert watch.seen() == {("127.0.0.1", side.port): second}
        assert await watch.of(p, watch.seen(), time.monotonic()) == second   # the next prefill is placed
        side.engine_id = "other"
        with pytest.raises(HandshakeError, match="is engine 'other' now, not the 'eng' that answered"):
            await watch.of(p, watch.seen(), time.monotonic())
        side.close()
        t = time.monotonic()
        with pytest.raises(HandshakeError, match="did not answer in 2 s"):
            await watch.of(p, watch.seen(), time.monotonic())
        assert time.monotonic() - t < 6
    try:
        asyncio.run(run())
    finally:
        side.close()
