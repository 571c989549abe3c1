"""Disaggregated serving end to end: `gigadecode serve --role prefill` and `--role decode` as separate
processes behind `gigadecode proxy`, driven with the official `openai` client. Outputs equal the
single-node engine; 64 concurrent streams complete; streams cancelled mid-way leave no KV blocks in use
on either engine (read from /metrics). A second, small pair with fp32 KV serves transformers' own greedy
tokens."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest

from gigadecode.cli import build_parser
from gigadecode.sampling import SamplingParams
from gigadecode.server.api import engine_from_args

from .helpers import assert_greedy_matches, hf_greedy, random_prompt, stop_process_tree
from .test_server import assert_chat_equals_transformers, assert_completion_ids, free_port, metrics, stream_and_cancel, wait_health, wait_idle

MODEL = "tiny"
# fp32: DI must give exactly the single node's tokens (bf16 rounds the split point differently)
FLAGS = ["--served-model-name", MODEL, "--dtype", "float32", "--num-blocks", "512", "--block-size", "16", "--kv-dtype", "fp8", "--max-num-seqs", "64",
         "--kv-lease-s", "10"]


def start_gigadecode(args: list[str], ranks: int = 1) -> subprocess.Popen:
    """`gigadecode ARGS` in a subprocess (under torchrun with `ranks` > 1), one torch thread per process."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GIGADECODE_API_KEY": ""}
    head = [str(Path(sys.executable).with_name("torchrun")), "--nproc-per-node", str(ranks), "--master-port",
            str(free_port())] if ranks > 1 else [sys.executable]
    return subprocess.Popen([*head, "-m", "gigadecode", *args, "--log-level", "warning"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@contextlib.contextmanager
def di_servers(model_dir, prefill_args: list[str], decode_args: list[str], prefill_ranks: int = 1,
               decode_ranks: int = 1):
    """A prefill server, a decode server and the proxy in front -> {"prefill", "decode", "proxy"} URLs."""
    ports = [free_port() for _ in range(3)]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    procs = [start_gigadecode(["serve", "--model", str(model_dir), "--role", "prefill", "--port", str(ports[0]),
                               *prefill_args], prefill_ranks),
             start_gigadecode(["serve", "--model", str(model_dir), "--role", "decode", "--port", str(ports[1]),
                               *decode_args], decode_ranks),
             start_gigadecode(["proxy", "--prefill", urls[0], "--decode", urls[1], "--port", str(ports[2])])]
    try:
        for u, p in zip(urls, procs):
            wait_health(u, p, timeout=180)
        yield dict(prefill=urls[0], decode=urls[1], proxy=urls[2])
    finally:
        for p in procs:
            stop_process_tree(p)


@pytest.fixture(scope="module")
def di(tiny_ckpt):
    with di_servers(tiny_ckpt, FLAGS, FLAGS) as urls:
        yield urls


@pytest.fixture(scope="module")
def single(tiny_ckpt):
    args = build_parser().parse_args(["serve", "--model", str(tiny_ckpt), *FLAGS])
    assert args.served_model_name == [MODEL]
    return engine_from_args(args, "both")


# fp32 compute and fp32 KV: transformers' numbers (FP8 KV rounds what it stores: not token-identical to it)
ORACLE_FLAGS = ["--served-model-name", MODEL, "--dtype", "float32", "--num-blocks", "64", "--block-size", "16",
                "--kv-dtype", "auto", "--max-num-seqs", "8", "--kv-lease-s", "10", "--enable-prefix-caching"]


@pytest.fixture
def di_fp32_kv(tiny_ckpt):
    with di_servers(tiny_ckpt, ORACLE_FLAGS, ORACLE_FLAGS) as urls:
        yield urls


def _greedy(engine, prompt, n):
    return engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))[0].output_ids


def _greedy_logprobs(engine, prompt, n):
    """Greedy ids and each step's logprobs (top 2) of `prompt` run alone."""
    r = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=2))[0]
    return r.output_ids, r.output_logprobs


def test_di_completions_equal_single_node(di, single):
    client = openai.OpenAI(base_url=di["proxy"] + "/v1", api_key="x", max_retries=0, timeout=60)
    for n in (1, 15, 16, 17, 31, 47):
        prompt = random_prompt(n, 1024, seed=700 + n)
        assert_completion_ids(client, MODEL, prompt, _greedy(single, prompt, 12))
    m = metrics(di["decode"])
    assert m["gigadecode_kv_bytes_transferred_total"] > 0 and m["gigadecode_kv_transfer_failures_total"] == 0


def test_di_equals_transformers(di_fp32_kv, hf_model, tiny_ckpt):
    """Prefill on one server, the KV sent to the other, decode there: transformers' own greedy tokens (its
    `generate`, fp32, same checkpoint), for prompts across the block and window edges, and chat. Both servers
    cache prefixes: prompts that start like the 47-token one find its blocks on the prefill server."""
    client = openai.OpenAI(base_url=di_fp32_kv["proxy"] + "/v1", api_key="x", max_retries=0, timeout=60)
    for n in (1, 15, 16, 17, 47):
        prompt = random_prompt(n, 1024, seed=750 + n)
        assert_completion_ids(client, MODEL, prompt, hf_greedy(hf_model, prompt, 12))
    for extra in (1, 9, 20):
        prompt = random_prompt(47, 1024, seed=797) + random_prompt(extra, 1024, seed=800 + extra)
        assert_completion_ids(client, MODEL, prompt, hf_greedy(hf_model, prompt, 12))
    assert metrics(di_fp32_kv["prefill"])["gigadecode_prefix_cache_hits_total"] >= 3 * 32
    assert_chat_equals_transformers(client, MODEL, hf_model, tiny_ckpt,
                                    [{"role": "user", "content": "How fast is the decode engine?"}], 10)
    m = metrics(di_fp32_kv["decode"])
    assert m["gigadecode_kv_bytes_transferred_total"] > 0 and m["gigadecode_kv_transfer_failures_total"] == 0


def test_di_chat(di, single, tiny_ckpt):
    from gigadecode.tokenizer import TextCodec
    msgs = [{"role": "user", "content": "How fast is the decode engine?"}]
    ids = TextCodec.from_dir(tiny_ckpt).apply_chat_template(msgs)
    want = _greedy(single, ids, 10)
    client = openai.OpenAI(base_url=di["proxy"] + "/v1", api_key="x", max_retries=0, timeout=60)
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10, temperature=0.0,
                                       extra_body={"ignore_eos": True, "return_token_ids": True})
    assert r.choices[0].model_extra["token_ids"] == want


def test_64_concurrent_streams_and_cancellation(di, single):
    prompts = [random_prompt(5 + (i * 7) % 40, 1024, seed=i) for i in range(64)]
    want = {i: _greedy(single, p, 8) for i, p in enumerate(prompts) if i % 2 == 0}

    got = stream_and_cancel(di["proxy"], MODEL, prompts, 8, {i for i in range(64) if i % 2 == 1}, 200)
    for i in want:
        assert got[i] == want[i], i
    for k in ("prefill", "decode"):
        wait_idle(di[k], timeout=30)


def _prefill_params(di, prompt):
    import httpx
    r = httpx.post(di["prefill"] + "/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
    assert r.status_code == 200, r.text
    return r.json()["kv_transfer_params"]


def test_bad_kv_params_while_others_stream(di, single):
    """Malformed, forged, unsigned and prompt-swapped kv_transfer_params sent straight to the decode server
    while 200-token completions stream through the proxy: each gets a 400 naming the field, the streams end
    with the tokens they get alone (up to a near-tie: they are batched with each other on the decode server),
    and no KV block is left in use on either server."""
    import asyncio

    import httpx
    streams = [random_prompt(10 + 3 * i, 1024, seed=800 + i) for i in range(3)]
    want = [_greedy_logprobs(single, p, 200) for p in streams]
    a, b = random_prompt(21, 1024, seed=850), random_prompt(21, 1024, seed=851)
    params = _prefill_params(di, a)
    unsigned = {k: v for k, v in params.items() if k != "signature"}
    bad = [({"do_remote_prefill": True, "remote_first_block": ["a", "b"]}, a, "kv_transfer_params.remote_first_block.0"),
           ({"do_remote_prefill": True, "remote_ranks": "x"}, a, "kv_transfer_params.remote_ranks"),
           ({"do_remote_prefill": True, "kv_crc32": "x"}, a, "kv_transfer_params.kv_crc32"),
           ({**params, "remote_block_ids": [[1, 2], [3]]}, a, "kv_transfer_params.signature"),    # forged block ids
           (unsigned, a, "kv_transfer_params.signature"),
           (params, b, "kv_transfer_params.prompt_digest")]                                      # prompt swap

    async def main():
        async with httpx.AsyncClient(timeout=120) as hc, \
                openai.AsyncOpenAI(base_url=di["proxy"] + "/v1", api_key="x", max_retries=0, timeout=120) as oc:
            async def stream(p):
                got = []
                async for ch in await oc.completions.create(model=MODEL, prompt=p, max_tokens=200, temperature=0.0,
                                                            stream=True, extra_body=EXTRA):
                    got += (ch.choices[0].model_extra or {}).get("token_ids") or []
                return got

            async def refused(kv, prompt):
                await asyncio.sleep(0.3)                 # while the streams run
                return await hc.post(di["decode"] + "/v1/completions", json={
                    "model": MODEL, "prompt": prompt, "max_tokens": 8, "kv_transfer_params": kv})
            return await asyncio.gather(*(stream(p) for p in streams), *(refused(kv, p) for kv, p, _ in bad))

    EXTRA = {"ignore_eos": True, "return_token_ids": True}
    out = asyncio.run(main())
    for i, (got, (ids, lps)) in enumerate(zip(out[:len(streams)], want)):     # batched with each other: near-ties
        assert_greedy_matches(got, ids, lps, f"stream {i}")
    for r, (_, _, field) in zip(out[len(streams):], bad):
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    ok = httpx.post(di["decode"] + "/v1/completions", timeout=60, json={      # A's own params still work
        "model": MODEL, "prompt": a, "max_tokens": 6, "temperature": 0.0, "ignore_eos": True,
        "return_token_ids": True, "kv_transfer_params": params})
    assert ok.status_code == 200 and ok.json()["choices"][0]["token_ids"] == _greedy(single, a, 6)
    again = httpx.post(di["decode"] + "/v1/completions", timeout=60, json={"model": MODEL, "prompt": a,
                                                                           "kv_transfer_params": params})
    assert again.status_code == 400 and "used already" in again.json()["error"]["message"]   # no replay
    for k in ("prefill", "decode"):
        wait_idle(di[k], timeout=30)


def test_request_limits(di):
    import httpx
    r = httpx.post(di["decode"] + "/v1/completions", timeout=30,
                   json={"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 1_000_000_000})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("This model's maximum context length is")
    assert r.json()["error"]["param"] == "max_tokens"
    big = b'{"model": "tiny", "prompt": "' + b"x" * (5 << 20) + b'"}'
    r = httpx.post(di["decode"] + "/v1/completions", content=big, timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert httpx.get(di["prefill"] + "/kv/handshake", timeout=10).status_code == 403   # needs the KV secret
    assert httpx.get(di["decode"] + "/health", timeout=10).status_code == 200


def test_proxy_with_decode_down(di):
    """The decode server is unreachable: the proxy answers 502 and has the prefill release its lease (the
    blocks are free long before the 10 s lease would end)."""
    import httpx
    port = free_port()
    proxy = start_gigadecode(["proxy", "--prefill", di["prefill"], "--decode", f"http://127.0.0.1:{free_port()}",
                              "--port", str(port)])
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_up(url, proxy)
        r = httpx.post(url + "/v1/completions", timeout=60, json={"model": MODEL, "prompt": [5, 6, 7, 8, 9],
                                                                   "max_tokens": 4})
        assert r.status_code == 502 and "decode" in r.json()["error"]["message"]
        wait_idle(di["prefill"], timeout=3)                                   # released, not run out
    finally:
        stop_process_tree(proxy)


def test_proxy_moves_on_from_a_prefill_server_that_never_answers(di):
    """A prefill server that accepts and then says nothing (stopped, wedged): with --prefill-timeout-s the
    proxy tries the next one, and the answer is the one the healthy pair gives."""
    import socket

    import httpx
    wedged = socket.socket()
    wedged.bind(("127.0.0.1", 0))
    wedged.listen(16)                                  # accepts (the kernel does), never answers
    port = free_port()
    proxy = start_gigadecode(["proxy", "--prefill", f"http://127.0.0.1:{wedged.getsockname()[1]}", di["prefill"],
                              "--decode", di["decode"], "--port", str(port), "--prefill-timeout-s", "1"])
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_port(port, proxy)                        # its /health waits on the wedged one
        body = {"model": MODEL, "prompt": [5, 6, 7, 8, 9], "max_tokens": 4, "temperature": 0.0, "ignore_eos": True}
        t0 = time.monotonic()
        r = httpx.post(url + "/v1/completions", timeout=60, json=body)
        assert r.status_code == 200 and time.monotonic() - t0 < 20, r.text
        want = httpx.post(di["proxy"] + "/v1/completions", timeout=60, json=body).json()["choices"][0]["text"]
        assert r.json()["choices"][0]["text"] == want
    finally:
        stop_process_tree(proxy)
        wedged.close()


def test_proxy_gives_up_on_a_decode_server_that_never_answers(di):
    """A decode server that accepts and then says nothing: with --decode-timeout-s the client gets a 504 naming
    it (streaming or not) and the prefill's KV lease is released at once, not when it runs out."""
    import socket

    import httpx
    wedged = socket.socket()
    wedged.bind(("127.0.0.1", 0))
    wedged.listen(16)                                  # accepts (the kernel does), never answers
    port = free_port()
    proxy = start_gigadecode(["proxy", "--prefill", di["prefill"], "--decode",
                              f"http://127.0.0.1:{wedged.getsockname()[1]}", "--port", str(port),
                              "--decode-timeout-s", "1"])
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_port(port, proxy)
        for stream in (False, True):
            body = {"model": MODEL, "prompt": random_prompt(40, 1024, seed=5), "max_tokens": 4, "stream": stream}
            t0 = time.monotonic()
            r = httpx.post(url + "/v1/completions", timeout=60, json=body)
            assert r.status_code == 504 and time.monotonic() - t0 < 20, r.text
            assert r.json()["error"]["code"] == "decode_timeout" and str(wedged.getsockname()[1]) in r.text
            assert wait_idle(di["prefill"], timeout=3)["gigadecode_kv_leases"] == 0
    finally:
        stop_process_tree(proxy)
        wedged.close()


def test_requests_the_decode_refuses_hold_no_prefill_kv(di):
    # the proxy prefills with max_tokens=1, n=1, no stream: what only the decode server refuses is refused after
    # a prefill; the proxy then has the prefill release its lease (10 s here) at once
    import httpx
    prompt = random_prompt(60, 1024, seed=11)
    for extra in ({"stream_options": {"include_usage": True}}, {"max_tokens": 1_000_000}, {"n": 0}):
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, **extra}
        r = httpx.post(di["proxy"] + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] in ("stream_options", "max_tokens", "n"), r.text
        wait_idle(di["prefill"], timeout=3)
    r = httpx.post(di["proxy"] + "/v1/completions", timeout=60,
                   json={"model": MODEL, "prompt": prompt, "max_tokens": 4, "stream": True, "n": 0})
    assert r.status_code == 400
    wait_idle(di["prefill"], timeout=3)
    # the prefill's own answer: released once; forged or unsigned params are refused by name
    r = httpx.post(di["prefill"] + "/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
    kv = r.json()["kv_transfer_params"]
    assert metrics(di["prefill"])["gigadecode_kv_blocks_used"] > 0
    assert metrics(di["prefill"])["gigadecode_kv_leases"] == 1
    forged = {**kv, "remote_block_ids": [[1, 2, 3]] * len(kv["remote_block_ids"])}
    for bad in (forged, {**kv, "signature": None}, {"remote_request_id": 5}):
        r = httpx.post(di["prefill"] + "/kv/release", json={"kv_transfer_params": bad}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"].startswith("kv_transfer_params"), r.text
    assert metrics(di["prefill"])["gigadecode_kv_blocks_used"] > 0
    r = httpx.post(di["prefill"] + "/kv/release", json={"kv_transfer_params": kv}, timeout=30)
    assert r.status_code == 200 and r.json() == {"released": True}
    assert wait_idle(di["prefill"], timeout=3)["gigadecode_kv_leases"] == 0
    r = httpx.post(di["prefill"] + "/kv/release", json={"kv_transfer_params": kv}, timeout=30)
    assert r.json() == {"released": False}                                    # nothing left to release
    r = httpx.post(di["decode"] + "/kv/release", json={"kv_transfer_params": kv}, timeout=30)
    assert r.status_code == 400                                               # a decode server holds no leases


def _wait_port(port: int, proc) -> None:
    """Wait until the process listens on `port`."""
    import socket
    t0 = time.monotonic()
    while True:
        assert proc.poll() is None and time.monotonic() - t0 < 60
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.2)


def _wait_up(url, proc):
    """The proxy's /health is 503 while an upstream is down: wait for it to answer at all."""
    import time

    import httpx
    t0 = time.monotonic()
    while time.monotonic() - t0 < 60:
        assert proc.poll() is None, proc.stdout.read()
        try:
            httpx.get(url + "/health", timeout=1)
            return
        except httpx.HTTPError:
            time.sleep(0.2)
    raise TimeoutError(url)



@contextlib.contextmanager
def fake_decode_server(answer: bytes | None, then_close: bool = False):
    """A decode server that reads a request, then sends `answer` and hangs (headers of a stream that never
    comes; with `then_close`, it drops the connection there: a server that died mid-stream), or with None closes
    the connection without a word (a server that died mid-request)."""
    import socket
    import threading
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    conns = []

    def serve():
        while True:
            try:
                c, _ = srv.accept()
            except OSError:
                return
            c.recv(1 << 20)
            if answer is None or then_close:
                if answer is not None:
                    c.sendall(answer)
                c.close()
            else:
                c.sendall(answer)
                conns.append(c)
    threading.Thread(target=serve, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{srv.getsockname()[1]}"
    finally:
        srv.close()
        for c in conns:
            c.close()


HANG = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


@pytest.mark.parametrize("answer", [HANG, None], ids=["client-leaves-mid-stream", "decode-dies-before-headers"])
def test_a_stream_that_ends_early_releases_the_prefill_lease(di, answer):
    """A streaming request whose decode side never reads the KV frees the prefill's blocks at once (the lease is
    10 s here): the client that leaves once the stream has begun, and a decode server that drops the request
    before its headers (then a 502 in OpenAI's shape, not a bare 500). Both once held them to the lease's end."""
    import httpx
    port = free_port()
    with fake_decode_server(answer) as decode:
        proxy = start_gigadecode(["proxy", "--prefill", di["prefill"], "--decode", decode, "--port", str(port)])
        try:
            url = f"http://127.0.0.1:{port}"
            _wait_port(port, proxy)
            body = {"model": MODEL, "prompt": random_prompt(70, 1024, seed=12), "max_tokens": 4, "stream": True}
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
                if answer is None:
                    r.read()
                    assert r.status_code == 502 and r.json()["error"]["code"] == "decode_failed", r.text
                else:
                    assert r.status_code == 200            # the headers came; the client leaves now
            wait_idle(di["prefill"], timeout=3)
        finally:
            stop_process_tree(proxy)


def test_proxy_passes_min_tokens_and_names_one_prompt_a_request(di, single):
    """min_tokens above the prefill's 1 token is the decode server's to apply (the prefill refused it), and a
    list of prompts is refused by the proxy in its own words."""
    import httpx
    prompt = random_prompt(9, 1024, seed=13)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 6, "min_tokens": 6, "temperature": 0.0}
    r = httpx.post(di["proxy"] + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    want = single.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6, min_tokens=6))[0].output_ids
    assert r.json()["usage"]["completion_tokens"] == len(want) == 6
    r = httpx.post(di["proxy"] + "/v1/completions", json={**body, "prompt": ["a b", "c d"]}, timeout=60)
    assert r.status_code == 400 and "one prompt a request (got 2)" in r.json()["error"]["message"]
    wait_idle(di["prefill"], timeout=3)


def _chunked(*parts: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts)


@pytest.mark.parametrize("path", ["/v1/responses", "/v1/chat/completions"])
def test_a_decode_server_that_dies_mid_stream_ends_it_in_the_routes_own_error_shape(di, path):
    """The decode server sends one whole event and half of the next, then drops the connection. The client (the
    openai one) gets what a single server sends when a request fails mid-stream: on /v1/responses an `error`
    event (numbered after the last one relayed), on the chat route an error chunk (openai raises it as an
    APIError naming decode_failed); the half event is never relayed (it broke the client's parse), and the
    prefill's lease is released."""
    import httpx
    if path == "/v1/responses":
        whole = b'event: response.created\ndata: {"type":"response.created","sequence_number":0,"response":{}}\n\n'
        half = b'event: response.in_progress\ndata: {"type":"response.in'
    else:
        whole = (b'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"tiny","choices":[{"index":0,'
                 b'"delta":{"role":"assistant","content":"hi"},"finish_reason":null}]}\n\n')
        half = b'data: {"id":"c","object":"chat.comp'
    port = free_port()
    with fake_decode_server(HANG + _chunked(whole, half), then_close=True) as decode:
        proxy = start_gigadecode(["proxy", "--prefill", di["prefill"], "--decode", decode, "--port", str(port)])
        try:
            _wait_port(port, proxy)
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=60)
            if path == "/v1/responses":
                events = list(client.responses.create(model=MODEL, input="How fast is the decode engine?",
                                                      max_output_tokens=4, stream=True))
                assert [e.type for e in events] == ["response.created", "error"], events
                assert events[1].code == "decode_failed" and events[1].sequence_number == 1
                assert decode.rsplit(":", 1)[1] in events[1].message
            else:
                got = []
                with pytest.raises(openai.APIError) as e:
                    for ch in client.chat.completions.create(model=MODEL, stream=True, max_tokens=4,
                                                             messages=[{"role": "user", "content": "hi"}]):
                        got.append(ch.choices[0].delta.content)
                assert got == ["hi"] and e.value.code == "decode_failed", e.value
            assert wait_idle(di["prefill"], timeout=3)["gigadecode_kv_leases"] == 0
        finally:
            stop_process_tree(proxy)


def test_proxy_carries_vllms_sampling_extras(di, single, tiny_ckpt):
    """vLLM's allowed_token_ids, bad_words, truncate_prompt_tokens and include_stop_str_in_output through the
    proxy: both servers truncate alike (the decode server reads the KV of the same last N tokens), the decode
    server samples under the masks and keeps the stop string, streamed or not."""
    import httpx
    from gigadecode.tokenizer import TextCodec
    codec = TextCodec.from_dir(tiny_ckpt)
    prompt = random_prompt(24, 1024, seed=61)
    allowed = list(range(200, 260))
    base = {"model": MODEL, "prompt": prompt, "max_tokens": 10, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True}

    def post(path="/v1/completions", **extra):
        r = httpx.post(di["proxy"] + path, json={**base, **extra}, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()
    r = post(truncate_prompt_tokens=10, allowed_token_ids=allowed)
    want = single.generate([prompt[-10:]], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True,
                                                          allowed_token_ids=allowed))[0].output_ids
    assert r["choices"][0]["token_ids"] == want and set(want) <= set(allowed) and r["usage"]["prompt_tokens"] == 10
    plain = post()["choices"][0]
    t = next(t for t in plain["token_ids"][1:] if codec.encode(codec.decode([t]).lstrip()) == [t])
    banned = post(bad_words=[codec.decode([t]).lstrip()])["choices"][0]["token_ids"]
    assert t in plain["token_ids"] and t not in banned and len(banned) == 10
    text = plain["text"]
    stop = text[len(text) // 2: len(text) // 2 + 2]
    upto = text[:text.index(stop) + len(stop)]
    assert post(stop=stop, include_stop_str_in_output=True)["choices"][0]["text"] == upto
    streamed = ""
    with httpx.stream("POST", di["proxy"] + "/v1/completions", json={**base, "stream": True, "stop": stop,
                                                                    "include_stop_str_in_output": True}, timeout=60) as s:
        for line in s.iter_lines():
            if line.startswith("data: {"):
                streamed += json.loads(line[6:])["choices"][0]["text"]
    assert streamed == upto
    chat = post("/v1/chat/completions", messages=[{"role": "user", "content": "hello there"}], prompt=None,
                truncate_prompt_tokens=5, max_tokens=4)
    assert chat["usage"]["prompt_tokens"] == 5 and len(chat["prompt_token_ids"]) == 5
    r = httpx.post(di["proxy"] + "/v1/completions", json={**base, "allowed_token_ids": [5000]}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "allowed_token_ids"
    wait_idle(di["prefill"], timeout=3)


class Front:
    """A TCP front for a real server, in one of four modes: "wedged" takes connections and never answers (a
    stopped or hung process: the kernel accepts for it), "relay" relays bytes both ways, "hold" relays the
    requests but swallows the answers to the generation routes (an answer the server sent that never reached
    the proxy), "cut" drops the connection instead of relaying such an answer. `posts` counts the requests to
    the generation routes that reached it."""

    def __init__(self, target: str, mode: str = "wedged") -> None:
        import socket
        import threading
        self.target = target.removeprefix("http://").rsplit(":", 1)
        self.mode, self.posts, self.conns = mode, 0, []
        self.srv = socket.socket()
        self.srv.bind(("127.0.0.1", 0))
        self.srv.listen(64)
        self.url = f"http://127.0.0.1:{self.srv.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import socket
        import threading
        while True:
            try:
                c, _ = self.srv.accept()
            except OSError:
                return
            self.conns.append(c)
            if self.mode == "wedged":
                threading.Thread(target=self._pump, args=(c, None, []), daemon=True).start()
                continue
            up = socket.create_connection((self.target[0], int(self.target[1])))
            self.conns.append(up)
            generation = []                        # set once the connection carried a generation request
            threading.Thread(target=self._pump, args=(c, up, generation), daemon=True).start()
            threading.Thread(target=self._pump, args=(up, c, generation, True), daemon=True).start()

    def _pump(self, src, dst, generation: list, answers: bool = False) -> None:
        while True:
            try:
                data = src.recv(1 << 16)
            except OSError:
                return
            if not data:
                return
            if data.startswith(b"POST /v1/"):
                self.posts += 1
                generation.append(True)
            if dst is None or (answers and generation and self.mode == "hold"):
                continue
            if answers and generation and self.mode == "cut":
                self._drop(src, dst)
                return
            try:
                dst.sendall(data)
            except OSError:
                return

    @staticmethod
    def _drop(*socks) -> None:
        """Close at once (a shutdown first: a close alone waits for the other thread's recv on the socket)."""
        import socket
        for c in socks:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            c.close()

    def close(self) -> None:
        self.srv.close()
        self._drop(*self.conns)


def test_proxy_routes_around_a_wedged_server_and_back_when_it_answers_again(di):
    """A prefill and a decode server that take connections and never answer: the proxy's probe of every
    server's /health takes both out of rotation before any request pays for them (each once got every request,
    or every other, each paying the time-out), while the proxy's own /health answers at once (200: the healthy
    pair serves) and never waits on them; the requests go straight to the healthy pair. When the decode server
    answers /health again, the probe puts it back and it takes requests again. /v1/models is asked of a decode
    server in rotation (it waited on the wedged first one for ever). (A request's own time-out taking a server
    out of rotation: tests/test_proxy_health.py.)"""
    import httpx
    prefill, decode = Front(di["prefill"]), Front(di["decode"])
    port = free_port()
    proxy = start_gigadecode(["proxy", "--prefill", prefill.url, di["prefill"], "--decode", decode.url, di["decode"],
                              "--port", str(port), "--prefill-timeout-s", "1", "--decode-timeout-s", "1"])
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_port(port, proxy)
        t0 = time.monotonic()
        while True:                                               # a Kubernetes probe's default 1 s time-out
            health = httpx.get(url + "/health", timeout=1)
            rotation = (health.json()["prefill"][prefill.url]["in_rotation"],
                        health.json()["decode"][decode.url]["in_rotation"])
            if rotation == (False, False):
                break
            assert time.monotonic() - t0 < 20, health.text
            time.sleep(0.2)
        assert health.status_code == 200 and health.json()["status"] == "ok", health.text
        assert "/health" in health.json()["decode"][decode.url]["out_of_rotation_because"]
        body = {"model": MODEL, "prompt": random_prompt(20, 1024, seed=14), "max_tokens": 4, "temperature": 0.0}
        for stream in (False, True, False, True):
            r = httpx.post(url + "/v1/completions", json={**body, "stream": stream}, timeout=60)
            assert r.status_code == 200, r.text
        assert (prefill.posts, decode.posts) == (0, 0)            # none reached the wedged servers
        models = httpx.get(url + "/v1/models", timeout=30)       # asked of one in rotation (it hung on the first)
        assert models.status_code == 200 and models.json()["data"][0]["id"] == MODEL
        decode.mode = "relay"                                     # it answers again: the probe puts it back
        t0 = time.monotonic()
        while decode.posts == 0:
            assert time.monotonic() - t0 < 20, "the decode server never came back into rotation"
            r = httpx.post(url + "/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            time.sleep(0.2)
        assert wait_idle(di["prefill"], timeout=5)["gigadecode_kv_leases"] == 0
    finally:
        stop_process_tree(proxy)
        prefill.close()
        decode.close()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_client_that_leaves_while_the_prefill_answer_is_on_its_way_holds_no_lease(di, stream):
    """The prefill server has answered (its KV leased for the decode server) but the answer has not reached the
    proxy when the client leaves: the proxy cannot release params it never got, so it ends the prefill it named
    (`/kv/release` with that name), and the lease (10 s here) is over at once. It was held to its end: the
    server, which saw its client still there when it answered, could not know."""
    import socket

    import httpx
    front = Front(di["prefill"], mode="hold")
    port = free_port()
    proxy = start_gigadecode(["proxy", "--prefill", front.url, "--decode", di["decode"], "--port", str(port)])
    try:
        _wait_port(port, proxy)
        body = json.dumps({"model": MODEL, "prompt": random_prompt(40, 1024, seed=15), "max_tokens": 4,
                           "stream": stream}).encode()
        client = socket.create_connection(("127.0.0.1", port))
        client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        t0 = time.monotonic()
        while metrics(di["prefill"])["gigadecode_kv_leases"] == 0:     # answered; the answer is held back
            assert time.monotonic() - t0 < 30
            time.sleep(0.05)
        client.close()                                                 # the client leaves
        assert wait_idle(di["prefill"], timeout=3)["gigadecode_kv_leases"] == 0
    finally:
        stop_process_tree(proxy)
        front.close()


def test_a_prefill_named_by_the_proxy_is_ended_by_that_name(di):
    """`/kv/release {"handoff": name}` ends the prefill the proxy sent under that name (x-gigadecode-handoff):
    its lease once it answered, and only that one; a name that is not 32 hex digits, or whose request still holds
    its KV, is a 400."""
    import uuid

    import httpx
    body = {"model": MODEL, "prompt": random_prompt(30, 1024, seed=16), "max_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": True}}
    r = httpx.post(di["prefill"] + "/v1/completions", json=body, headers={"x-gigadecode-handoff": "x" * 32}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "x-gigadecode-handoff", r.text
    names = [uuid.uuid4().hex for _ in range(2)]
    for name, path in zip(names, ("/v1/completions", "/v1/chat/completions")):
        extra = {"messages": [{"role": "user", "content": "hi"}], "prompt": None} if "chat" in path else {}
        r = httpx.post(di["prefill"] + path, json={**body, **extra}, headers={"x-gigadecode-handoff": name}, timeout=60)
        assert r.status_code == 200 and r.json()["kv_transfer_params"]["remote_request_id"].endswith(name), r.text
    assert metrics(di["prefill"])["gigadecode_kv_leases"] == 2
    # a name whose request still holds its KV (leased) is not taken again: the two would share their blocks' names
    r = httpx.post(di["prefill"] + "/v1/completions", json=body, headers={"x-gigadecode-handoff": names[0]}, timeout=60)
    assert r.status_code == 400 and "already in use" in r.json()["error"]["message"], r.text
    release = di["prefill"] + "/kv/release"
    assert httpx.post(release, json={"handoff": names[1]}, timeout=30).json() == {"released": True}
    t0 = time.monotonic()
    while metrics(di["prefill"])["gigadecode_kv_leases"] != 1:                # freed at the next step
        assert time.monotonic() - t0 < 3
        time.sleep(0.05)
    time.sleep(0.2)
    assert metrics(di["prefill"])["gigadecode_kv_leases"] == 1                 # that one only
    assert httpx.post(release, json={"handoff": names[1]}, timeout=30).json() == {"released": False}
    assert httpx.post(release, json={"handoff": uuid.uuid4().hex}, timeout=30).json() == {"released": False}
    r = httpx.post(release, json={"handoff": "../" + names[0]}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "handoff"
    assert httpx.post(release, json={"handoff": names[0]}, timeout=30).json() == {"released": True}
    assert wait_idle(di["prefill"], timeout=3)["gigadecode_kv_leases"] == 0
    # a release that overtook its prefill (the router gave it up before the prefill arrived): the prefill that
    # comes after it is refused, holding no lease
    late = uuid.uuid4().hex
    assert httpx.post(release, json={"handoff": late}, timeout=30).json() == {"released": False}
    r = httpx.post(di["prefill"] + "/v1/completions", json=body, headers={"x-gigadecode-handoff": late}, timeout=60)
    assert r.status_code == 400 and "given up by its router" in r.json()["error"]["message"], r.text
    assert wait_idle(di["prefill"], timeout=3)["gigadecode_kv_leases"] == 0


def test_a_prefill_answer_cut_off_on_its_way_holds_no_lease(di):
    """The prefill server answered (leasing the KV) but the connection broke before the answer reached the
    proxy: the client gets a 502 naming the prefill, and the proxy ends the prefill it named, so the lease
    (10 s here) is over at once."""
    import httpx
    front = Front(di["prefill"], mode="cut")
    port = free_port()
    proxy = start_gigadecode(["proxy", "--prefill", front.url, "--decode", di["decode"], "--port", str(port)])
    try:
        _wait_port(port, proxy)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                       json={"model": MODEL, "prompt": random_prompt(40, 1024, seed=17), "max_tokens": 4})
        assert r.status_code == 502 and r.json()["error"]["code"] == "prefill_failed", r.text
        assert front.posts == 1
        assert wait_idle(di["prefill"], timeout=3)["gigadecode_kv_leases"] == 0
    finally:
        stop_process_tree(proxy)
        front.close()
