"""DI when servers come and go behind the same addresses (a Kubernetes pod restarted in place).

A prefill engine restarted at the same KV side-channel port is a new engine (a new name, NIXL agent and memory
addresses): a running decode engine pairs with it at once (the handshake back-off is per engine, not per
address), and the params the old one answered fail cleanly, saying that engine is gone, never a read that lands;
one restarted with other weights is refused at the door until a matching one returns. With real servers: a
prefill server told to stop (SIGTERM) keeps the KV it answered until the decode server has read it, and the
proxy in front of both answers every request while either restarts (a 502 naming the server, no hang), its
/health says which role is missing, and the single node's tokens come back once the server is up again.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from gigadecode.checkpoint import make_checkpoint
from gigadecode.connector.base import HandshakeError, KVLayout
from gigadecode.connector.params import RemoteRank
from gigadecode.connector.side_channel import HandshakeCache, SideChannel
from gigadecode.engine import build_engine
from gigadecode.engine_config import EngineConfig
from gigadecode.request import RequestError

from .di_peer import Producer
from .helpers import KV_SECRET, random_prompt, stop_process_tree
from .test_di import BASE, NUM_BLOCKS, greedy, run
from .test_server import free_port

KEY = KV_SECRET.encode()


def _layout(name: str) -> dict:
    return KVLayout(engine_id=name, agent_name=name, host="127.0.0.1", port=0, model_id="m", dtype="float8_e4m3fn",
                    packed=True, block_size=4, kv_heads=1, head_dim=8, num_blocks=8, block_len=32, num_groups=2,
                    num_buffers=1, num_regions=2, region_addrs=(4096, 8192)).to_dict()


class _Agent:
    """What `HandshakeCache` asks of the NIXL agent: its paired remotes, and pairing one more."""

    def __init__(self) -> None:
        self.remotes: list[str] = []

    def add_remote(self, name: str, metadata: bytes, layout: KVLayout) -> str:
        self.remotes.append(name)
        return name


def _ready(cache: HandshakeCache, agent: _Agent, name: str, port: int) -> str:
    rank = RemoteRank(remote_engine_id=name, remote_host="127.0.0.1", remote_port=port, remote_request_id="r1")
    t0 = time.monotonic()
    while (got := cache.ready(agent, rank)) is None:             # the handshake runs on a worker thread
        assert time.monotonic() - t0 < 10
        time.sleep(0.01)
    return got


def test_a_handshake_answered_by_a_restarted_engine_says_the_old_one_is_gone():
    """Params of engine `old` reach its address, where a restarted server (engine `new`) answers now: the load
    fails saying the old engine is gone with its KV (it said the side channel answered for another engine),
    and the back-off that failure starts is the old engine's only: the new one pairs at once."""
    side = SideChannel("127.0.0.1", 0, lambda: {"layout": _layout("prefill-new"), "agent_metadata": "AA=="}, KEY)
    cache, agent = HandshakeCache(KEY, 2.0), _Agent()
    try:
        with pytest.raises(HandshakeError) as e:
            _ready(cache, agent, "prefill-old", side.port)
        msg = str(e.value)
        assert f"127.0.0.1:{side.port}" in msg and "'prefill-new' now" in msg and "'prefill-old'" in msg, msg
        assert "restarted" in msg and "KV is gone" in msg, msg
        with pytest.raises(HandshakeError, match="not retried"):                     # the old name: backed off
            _ready(cache, agent, "prefill-old", side.port)
        assert _ready(cache, agent, "prefill-new", side.port) == "prefill-new"       # the new one: paired now
        assert agent.remotes == ["prefill-new"]
    finally:
        cache.close()
        side.close()


def test_a_read_from_a_lost_peer_says_it_is_gone():
    import nixl._bindings as bindings

    from gigadecode.connector.nixl_agent import _nixl_failure
    why = _nixl_failure(bindings.nixlRemoteDisconnectError("NIXL_ERR_REMOTE_DISCONNECT"))
    assert why.startswith("nixlRemoteDisconnectError: NIXL_ERR_REMOTE_DISCONNECT") and "gone" in why
    assert "gone" not in _nixl_failure(bindings.nixlInvalidParamError("NIXL_ERR_INVALID_PARAM"))


@pytest.mark.slow
def test_a_prefill_restarted_at_the_same_address(tiny_ckpt, tmp_path):
    """A running decode engine, its prefill engine killed and started again at the same side-channel port: first
    with other weights (refused at the door, naming the layout), then as it was. The new engine pairs at once
    and its KV decodes to the single node's tokens; the params the dead one answered (signed, within their
    lease) fail at once saying that engine is gone; nothing is left on either pool."""
    port = free_port()
    single = build_engine(tiny_ckpt, EngineConfig(**BASE))
    consumer = build_engine(tiny_ckpt, EngineConfig(kv_role="kv_consumer", kv_transfer_timeout_s=3.0, **BASE))
    other = make_checkpoint(tmp_path / "tiny-seed1", "tiny", seed=1, experts="mxfp4")
    prompts = [random_prompt(n, 1024, seed=1300 + n) for n in (30, 33, 27)]
    want = [run(single, p).output_ids for p in prompts]
    procs: list[Producer] = []

    def restart(ckpt) -> Producer:
        if procs:
            os.kill(procs[-1].proc.pid, signal.SIGKILL)
            procs[-1].proc.join(5)
        procs.append(Producer(ckpt, side_port=port, **BASE))
        assert procs[-1].side_port == port
        return procs[-1]

    try:
        old = restart(tiny_ckpt)
        assert run(consumer, prompts[0], kv=old.prefill(prompts[0])).output_ids == want[0]      # paired
        stale = old.prefill(prompts[1])                            # answered, leased, never read: then killed

        tuned = restart(other)                                     # other weights behind the same address
        with pytest.raises(RequestError) as e:
            consumer.add_request(prompts[2], greedy(), kv_transfer_params=tuned.prefill(prompts[2]))
        assert e.value.param == "kv_transfer_params.kv_layout_id" and "weights" in str(e.value)

        new = restart(tiny_ckpt)                                   # the matching one returns
        t0 = time.monotonic()
        assert run(consumer, prompts[2], kv=new.prefill(prompts[2])).output_ids == want[2]
        assert time.monotonic() - t0 < consumer.connector.handshakes.BACKOFF_S                 # no back-off
        t0 = time.monotonic()
        r = run(consumer, prompts[1], kv=stale)                    # the dead engine's params
        assert r.finish_reason == "error" and not r.output_ids
        assert stale["remote_engine_id"] in r.error and "gone" in r.error, r.error
        assert time.monotonic() - t0 < 2.0                         # at once, not after the 3 s time-out
        assert run(consumer, prompts[0], kv=new.prefill(prompts[0])).output_ids == want[0]
        assert consumer.kv_manager.num_free_blocks == NUM_BLOCKS - 1
        assert new.wait_free(NUM_BLOCKS - 1) == NUM_BLOCKS - 1
    finally:
        for p in procs:
            p.close()
        consumer.connector.close()


# --------------------------------------------------------------------------------------------------
# real servers
# --------------------------------------------------------------------------------------------------
def _serve(model_dir, role: str, port: int, *extra: str):
    from .test_serve_di import FLAGS, start_gigadecode
    return start_gigadecode(["serve", "--model", str(model_dir), "--role", role, "--port", str(port), *FLAGS,
                             *extra])


@pytest.mark.slow
def test_a_prefill_server_told_to_stop_keeps_the_kv_it_answered_until_read(tiny_ckpt):
    """SIGTERM right after a prefill server answered: it stops taking requests but keeps its engine, side
    channel and KV until the decode server has read that KV (then exits at once, long before the grace and the
    lease), so the request decodes to the single node's tokens. It used to exit at once: the decode failed."""
    import httpx

    from .test_serve_di import MODEL
    from .test_server import wait_health
    pp, dp = free_port(), free_port()
    prefill = _serve(tiny_ckpt, "prefill", pp, "--kv-lease-s", "60", "--shutdown-timeout-s", "20")
    decode = _serve(tiny_ckpt, "decode", dp)
    try:
        for port, proc in ((pp, prefill), (dp, decode)):
            wait_health(f"http://127.0.0.1:{port}", proc, timeout=180)
        body = {"model": MODEL, "prompt": random_prompt(30, 1024, seed=1400), "max_tokens": 6, "temperature": 0.0,
                "ignore_eos": True}
        want = httpx.post(f"http://127.0.0.1:{dp}/v1/completions", json=body, timeout=60).json()
        kv = httpx.post(f"http://127.0.0.1:{pp}/v1/completions", timeout=60, json={
            **body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}).json()["kv_transfer_params"]
        prefill.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        time.sleep(0.5)                                            # its HTTP side is down by now
        with pytest.raises(httpx.ConnectError):
            httpx.post(f"http://127.0.0.1:{pp}/v1/completions", json=body, timeout=5)
        r = httpx.post(f"http://127.0.0.1:{dp}/v1/completions", json={**body, "kv_transfer_params": kv}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want["choices"][0]["text"]
        prefill.wait(15)
        assert time.monotonic() - t0 < 10                          # gone once read: not after 20 s (or 60)
    finally:
        stop_process_tree(prefill)
        stop_process_tree(decode)


@pytest.mark.slow
def test_the_proxy_while_its_servers_restart_in_place(tiny_ckpt):
    """The proxy in front of a prefill and a decode server, each killed and started again at the same ports
    (the prefill at the same --kv-port too): every request gets an answer within seconds (a 502 naming the
    missing server, never a hang), /health is 503 naming the role until the server is back and 200 after, the
    answers are the single node's again, and the dead prefill's params fail at the decode server saying that
    engine is gone. No lease is left on the prefill once it is over."""
    import httpx

    from .test_serve_di import MODEL, start_gigadecode
    from .test_server import wait_health, wait_idle
    pp, dp, xp, kp = (free_port() for _ in range(4))
    url = {"prefill": f"http://127.0.0.1:{pp}", "decode": f"http://127.0.0.1:{dp}", "proxy": f"http://127.0.0.1:{xp}"}
    start = {"prefill": lambda: _serve(tiny_ckpt, "prefill", pp, "--kv-port", str(kp), "--kv-lease-s", "120"),
             "decode": lambda: _serve(tiny_ckpt, "decode", dp)}
    procs = {role: make() for role, make in start.items()}
    procs["proxy"] = start_gigadecode(["proxy", "--prefill", url["prefill"], "--decode", url["decode"], "--port",
                                       str(xp)])
    bodies = [{"model": MODEL, "prompt": random_prompt(20 + 7 * i, 1024, seed=1500 + i), "max_tokens": 8,
               "temperature": 0.0, "ignore_eos": True} for i in range(3)]

    def ask(body: dict) -> httpx.Response:
        t0 = time.monotonic()
        r = httpx.post(url["proxy"] + "/v1/completions", json=body, timeout=60)
        assert time.monotonic() - t0 < 20, "a request hung"
        return r

    try:
        for role in ("prefill", "decode"):
            wait_health(url[role], procs[role], timeout=180)
        wait_health(url["proxy"], procs["proxy"], timeout=60)
        want = [ask(b).json()["choices"][0]["text"] for b in bodies]
        stale = httpx.post(url["prefill"] + "/v1/completions", timeout=60, json={
            **bodies[0], "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}).json()["kv_transfer_params"]
        for role in ("prefill", "decode"):
            procs[role].kill()
            procs[role].wait(10)
            r = ask(bodies[1])
            assert r.status_code == 502 and url[role] in r.json()["error"]["message"], r.text
            assert r.json()["error"]["code"] == f"{role}_failed"
            h = httpx.get(url["proxy"] + "/health", timeout=5)
            assert h.status_code == 503 and role in h.json()["reason"], h.text
            procs[role] = start[role]()
            t0 = time.monotonic()
            while (r := ask(bodies[1])).status_code != 200:        # waits out the server's start
                assert r.status_code == 502, r.text
                assert time.monotonic() - t0 < 180
                time.sleep(0.2)
            while httpx.get(url["proxy"] + "/health", timeout=5).status_code != 200:
                assert time.monotonic() - t0 < 180
                time.sleep(0.2)
            assert [ask(b).json()["choices"][0]["text"] for b in bodies] == want
            if role == "prefill":                                  # the dead engine's params, within their lease
                r = httpx.post(url["decode"] + "/v1/completions", json={**bodies[0], "kv_transfer_params": stale},
                               timeout=60)
                assert r.status_code == 500 and "gone" in r.json()["error"]["message"], r.text
                assert stale["remote_engine_id"] in r.json()["error"]["message"]
        assert wait_idle(url["prefill"], timeout=5)["gigadecode_kv_leases"] == 0
    finally:
        for proc in procs.values():
            stop_process_tree(proc)
