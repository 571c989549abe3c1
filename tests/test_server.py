"""The OpenAI-compatible server and the DI proxy, over real sockets on loopback.

`gigadecode serve` runs as a subprocess on the tiny checkpoint; the official `openai` client talks to it.
Greedy outputs equal the in-process engine's (same engine flags, built by the same `build_engine`), and,
on a server in fp32 with fp32 KV, transformers' own greedy tokens;
16 concurrent streams complete; clients that go away leave no KV behind; bad requests get their 4xx in
OpenAI's shape and the server keeps serving. The proxy is checked against fake upstreams (what it sends
to prefill and decode, retry on a failing prefill, 4xx pass-through, disconnects) and, for pass-through,
against the real server standing in for both roles.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from contextlib import asynccontextmanager
from types import SimpleNamespace

import httpx
import openai
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from gigadecode.cli import build_parser
from gigadecode.ports import free_port
from gigadecode.sampling import SamplingParams
from gigadecode.engine import RequestOutput
from gigadecode.request import EngineStats
from gigadecode.connector.params import AUTH_HEADER, KVTransferParams, handshake_token
from gigadecode.server.api import build_app, engine_from_args
from gigadecode.server.async_engine import AsyncEngine
from gigadecode.server.proxy import build_proxy_app
from gigadecode.tokenizer import TextCodec

from .helpers import KV_SECRET, VllmSideChannel, assert_greedy_matches, hf_greedy, random_prompt

KEY = "sk-test-key"
ENGINE_FLAGS = ["--num-blocks", "256", "--block-size", "16", "--kv-dtype", "fp8", "--max-num-seqs", "32"]
CONTEXT = 255 * 16          # (num_blocks - 1) * block_size < the tiny model's 4096 positions
METRIC_NAMES = ("gigadecode_time_to_first_token_seconds", "gigadecode_inter_token_latency_seconds",
                "gigadecode_requests_running", "gigadecode_requests_waiting", "gigadecode_kv_blocks_used",
                "gigadecode_kv_blocks_total", "gigadecode_kv_bytes_transferred_total",
                "gigadecode_kv_transfer_failures_total", "gigadecode_requests_total")


def wait_health(url: str, proc: subprocess.Popen | None = None, timeout: float = 90.0) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{proc.stdout.read()}")
        try:
            if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url} did not become healthy in {timeout}s")


def _serve(model_dir, flags: list[str]):
    """`gigadecode serve --role both FLAGS` in a subprocess -> its URL (a generator for a fixture)."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GIGADECODE_API_KEY": ""}
    cmd = [sys.executable, "-m", "gigadecode", "serve", "--model", str(model_dir), "--role", "both",
           "--port", str(port), "--api-key", KEY, "--log-level", "warning", *flags]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_health(url, proc)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def server(tiny_ckpt):
    yield from _serve(tiny_ckpt, ENGINE_FLAGS)


# fp32 compute and fp32 KV: what transformers' GptOssForCausalLM computes in fp32, so the greedy tokens are
# transformers' own (the default --dtype auto is the checkpoint's bf16, and FP8 KV rounds what it stores)
ORACLE_FLAGS = ["--dtype", "float32", "--kv-dtype", "auto", "--num-blocks", "64", "--block-size", "16"]


@pytest.fixture(scope="module")
def oracle_server(tiny_ckpt):
    yield from _serve(tiny_ckpt, ORACLE_FLAGS)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def engine(tiny_ckpt):
    """The in-process engine `serve` builds for the same flags."""
    args = build_parser().parse_args(["serve", "--model", str(tiny_ckpt), *ENGINE_FLAGS])
    return engine_from_args(args, "both")


@pytest.fixture(scope="module")
def codec(tiny_ckpt):
    return TextCodec.from_dir(tiny_ckpt)


def greedy(engine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [r.output_ids for r in engine.generate(prompts, sp)]


def metrics(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics").text
    out = {}
    for line in text.splitlines():
        m = re.match(r"^([a-z_]+(?:\{[^}]*\})?) ([-+0-9.eE]+|NaN)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def wait_idle(url: str, timeout: float = 10.0) -> dict[str, float]:
    """/metrics once nothing runs and no KV block is held."""
    t0 = time.monotonic()
    while True:
        m = metrics(url)
        if m["gigadecode_kv_blocks_used"] == 0 and m["gigadecode_requests_running"] == 0 \
                and m["gigadecode_requests_waiting"] == 0:
            return m
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"server not idle after {timeout}s: {m}")
        time.sleep(0.05)


def assert_chat_equals_transformers(client, model: str, hf_model, ckpt, msgs: list[dict], n: int) -> None:
    """A greedy chat completion (ignore_eos) returns transformers' greedy tokens for the chat template."""
    r = client.chat.completions.create(model=model, messages=msgs, max_tokens=n, temperature=0.0,
                                       extra_body={"ignore_eos": True, "return_token_ids": True})
    want = hf_greedy(hf_model, TextCodec.from_dir(ckpt).apply_chat_template(msgs), n)
    assert r.choices[0].model_extra["token_ids"] == want


def assert_completion_ids(client, model: str, prompt: list[int], want: list[int], **kw) -> None:
    """A completions request (token-id prompt, greedy, ignore_eos) returns `want`, whole and streamed."""
    extra = {"ignore_eos": True, "return_token_ids": True}
    kw = {"max_tokens": len(want), "temperature": 0.0, **kw}
    r = client.completions.create(model=model, prompt=prompt, extra_body=extra, **kw)
    assert r.choices[0].model_extra["token_ids"] == want, len(prompt)
    got = []
    for ch in client.completions.create(model=model, prompt=prompt, stream=True, extra_body=extra, **kw):
        got += (ch.choices[0].model_extra or {}).get("token_ids") or []
    assert got == want, len(prompt)


def stream_and_cancel(base_url: str, model: str, prompts: list[list[int]], max_tokens: int,
                      cancelled: set[int], long_tokens: int) -> dict[int, list[int] | None]:
    """Stream every prompt at once through the openai client (greedy, ignore_eos, token ids). The streams in
    `cancelled` ask for `long_tokens` and the client goes away after their first 2 tokens (-> None); the
    others return their `max_tokens` ids."""
    async def one(client, i, p):
        stream = await client.completions.create(model=model, prompt=p, temperature=0.0, stream=True,
                                                 max_tokens=long_tokens if i in cancelled else max_tokens,
                                                 extra_body={"ignore_eos": True, "return_token_ids": True})
        got = []
        async for ch in stream:
            got += (ch.choices[0].model_extra or {}).get("token_ids") or []
            if i in cancelled and len(got) >= 2:
                await stream.close()                 # the client goes away mid-stream
                return i, None
        return i, got

    async def main():
        async with openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0, timeout=120) as c:
            return await asyncio.gather(*(one(c, i, p) for i, p in enumerate(prompts)))

    return dict(asyncio.run(main()))


EXTRA = {"return_token_ids": True, "ignore_eos": True}


# --------------------------------------------------------------------------------------------------
# Real server
# --------------------------------------------------------------------------------------------------
def test_completions_equal_engine(client, engine, codec):
    ids = random_prompt(23, 1024, seed=3)
    text_prompt = "The weather this morning was"
    want_ids, want_text = greedy(engine, [ids, codec.encode(text_prompt)], 12)

    r = client.completions.create(model="tiny_mxfp4", prompt=ids, max_tokens=12, temperature=0, extra_body=EXTRA)
    c = r.choices[0]
    assert c.token_ids == want_ids and c.finish_reason == "length"
    assert c.text == codec.decode(want_ids)
    assert r.usage.prompt_tokens == 23 and r.usage.completion_tokens == 12

    r = client.completions.create(model="tiny_mxfp4", prompt=text_prompt, max_tokens=12, temperature=0,
                                  extra_body=EXTRA)
    assert r.choices[0].token_ids == want_text and r.choices[0].text == codec.decode(want_text)

    toks, text, reasons = [], "", []
    for chunk in client.completions.create(model="tiny_mxfp4", prompt=ids, max_tokens=12, temperature=0,
                                           stream=True, extra_body=EXTRA):
        for ch in chunk.choices:
            toks += ch.token_ids
            text += ch.text
            reasons.append(ch.finish_reason)
    assert toks == want_ids and text == codec.decode(want_ids)
    assert reasons[-1] == "length" and all(x is None for x in reasons[:-1])

    # a batch of prompts: one choice each
    r = client.completions.create(model="tiny_mxfp4", prompt=[ids, ids[:5]], max_tokens=4, temperature=0,
                                  extra_body=EXTRA)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].token_ids == want_ids[:4]


def test_server_equals_transformers(oracle_server, hf_model, codec):
    """The served greedy tokens are transformers' own (its `generate`, fp32, same checkpoint): completions
    by token ids (whole and streamed) across block edges, a text prompt, and chat."""
    from .helpers import hf_greedy
    client = openai.OpenAI(base_url=oracle_server + "/v1", api_key=KEY, max_retries=0, timeout=60)
    for n in (1, 15, 16, 17, 40):
        prompt = random_prompt(n, 1024, seed=600 + n)
        assert_completion_ids(client, "tiny_mxfp4", prompt, hf_greedy(hf_model, prompt, 10))
    text = "The weather this morning was"
    r = client.completions.create(model="tiny_mxfp4", prompt=text, max_tokens=8, temperature=0, extra_body=EXTRA)
    assert r.choices[0].token_ids == hf_greedy(hf_model, codec.encode(text), 8)
    messages = [{"role": "user", "content": "What does a GPU do?"}]
    r = client.chat.completions.create(model="tiny_mxfp4", messages=messages, max_tokens=8, temperature=0,
                                       extra_body=EXTRA)
    assert r.choices[0].token_ids == hf_greedy(hf_model, codec.apply_chat_template(messages), 8)


def test_chat_equals_engine(client, engine, codec):
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What does a GPU do?"}]
    want = greedy(engine, [codec.apply_chat_template(messages)], 10)[0]

    r = client.chat.completions.create(model="tiny_mxfp4", messages=messages, max_completion_tokens=10,
                                       temperature=0, extra_body=EXTRA)
    assert r.choices[0].token_ids == want
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == codec.decode(want)

    toks, text, first = [], "", None
    stream = client.chat.completions.create(model="tiny_mxfp4", messages=messages, max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True}, extra_body=EXTRA)
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            first = first or ch.delta.role
            toks += getattr(ch, "token_ids", None) or []
            text += ch.delta.content or ""
    assert first == "assistant" and toks == want and text == codec.decode(want)
    assert usage.completion_tokens == 10
    # vLLM's continuous_usage_stats: every chunk carries the usage so far (the role's: no tokens yet)
    chunks = list(client.chat.completions.create(
        model="tiny_mxfp4", messages=messages, max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, extra_body=EXTRA))
    assert all(c.usage is not None and c.usage.prompt_tokens == usage.prompt_tokens for c in chunks)
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[:2] == [0, 1] and counts[-2:] == [10, 10] and len(counts) >= 11

    # logprobs come back in OpenAI's chat shape
    r = client.chat.completions.create(model="tiny_mxfp4", messages=messages, max_tokens=3, temperature=0,
                                       logprobs=True, top_logprobs=2)
    lps = r.choices[0].logprobs.content
    assert len(lps) == 3 and all(len(x.top_logprobs) == 2 and x.logprob <= 0 for x in lps)


def test_16_concurrent_streams(oracle_server, tiny_ckpt):
    """16 streams at once, each the tokens of the same request through the engine batched otherwise. In fp32:
    in bf16 the rounding tips the tiny model's near-tied routers by batch, at any logit gap (README)."""
    server = oracle_server
    args = build_parser().parse_args(["serve", "--model", str(tiny_ckpt), *ORACLE_FLAGS])
    engine = engine_from_args(args, "both")
    prompts = [random_prompt(3 + 5 * i, 1024, seed=100 + i) for i in range(16)]
    max_toks = [8 + (i % 5) for i in range(16)]
    want = engine.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, logprobs=2)
                                     for m in max_toks])

    async def one(ac, p, m):
        toks, reason = [], None
        async for chunk in await ac.completions.create(model="tiny_mxfp4", prompt=p, max_tokens=m,
                                                       temperature=0, stream=True, extra_body=EXTRA):
            for ch in chunk.choices:
                toks += ch.token_ids
                reason = ch.finish_reason or reason
        return toks, reason

    async def main():
        async with openai.AsyncOpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0) as ac:
            return await asyncio.gather(*(one(ac, p, m) for p, m in zip(prompts, max_toks)))

    got = asyncio.run(main())
    # the server batches the streams as they arrive, not as `generate` did: fp32 near-ties may go the other way
    for i, ((toks, _), r) in enumerate(zip(got, want)):
        assert_greedy_matches(toks, r.output_ids, r.output_logprobs, f"stream {i}")
    assert all(g[1] == "length" for g in got)
    wait_idle(server)


def test_client_disconnect_frees_kv(server):
    before = metrics(server).get('gigadecode_requests_total{finish_reason="abort"}', 0.0)
    headers = {"Authorization": f"Bearer {KEY}"}
    # long enough not to finish before the client leaves; short enough for one request in the pool (40 + 2,500
    # tokens: 159 full-attention blocks and a 1,024-token prefill chunk's 65 + 1 sliding ones of 255)
    body = {"prompt": random_prompt(40, 1024, seed=7), "max_tokens": 2500, "temperature": 0, "ignore_eos": True}

    async def cancel_streams():
        async with httpx.AsyncClient(base_url=server, headers=headers, timeout=30) as hc:
            async def one(i):
                async with hc.stream("POST", "/v1/completions", json={**body, "stream": True, "seed": i}) as r:
                    assert r.status_code == 200
                    n = 0
                    async for line in r.aiter_lines():
                        n += line.startswith("data: ")
                        if n >= 3:
                            return          # leaving the block closes the connection mid-stream
            await asyncio.gather(*(one(i) for i in range(6)))
    asyncio.run(cancel_streams())

    # a non-streaming client that gives up while its request runs (as soon as the server says it runs, not after
    # a fixed wait: a fast CPU decodes the 2,500 tokens in about a second, and a request that ends before the
    # server sees its client gone finishes as "length")
    async def leave_while_running():
        async with httpx.AsyncClient(base_url=server, headers=headers, timeout=30) as hc:
            task = asyncio.ensure_future(hc.post("/v1/completions", json=body))
            t0 = time.monotonic()
            while metrics(server).get("gigadecode_requests_running", 0) < 1:
                assert not task.done() and time.monotonic() - t0 < 30, "the request never ran"
                await asyncio.sleep(0.01)
            assert not task.done(), "the request finished before its client could leave"
            task.cancel()                       # closes the connection mid-request
            with pytest.raises(asyncio.CancelledError):
                await task
    asyncio.run(leave_while_running())
    m = wait_idle(server)
    assert m['gigadecode_requests_total{finish_reason="abort"}'] - before == 7


BAD = [  # (path, body (dict, or raw str), headers, status, param)
    ("/v1/completions", {"model": "gpt-4", "prompt": "hi"}, None, 404, "model"),
    ("/v1/completions", '{"prompt": "hi", ', None, 400, None),
    ("/v1/completions", "[1, 2]", None, 400, None),
    ("/v1/completions", {"prompt": [1] * (CONTEXT + 10)}, None, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, None, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 2}, None, 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, None, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "top_k": "x"}, None, 400, "top_k"),
    ("/v1/completions", {"prompt": [5, 100000]}, None, 400, "prompt"),
    ("/v1/completions", {"prompt": []}, None, 400, "prompt"),
    ("/v1/completions", {"prompt": {"a": 1}}, None, 400, None),
    ("/v1/completions", {}, None, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "stream": True, "temperature": -1}, None, 400, "temperature"),
    ("/v1/chat/completions", {"model": "tiny_mxfp4"}, None, 400, "messages"),
    ("/v1/chat/completions", {"messages": []}, None, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"content": "no role"}]}, None, 400, None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 50,
                              "logprobs": True}, None, 400, "top_logprobs"),
    ("/v1/completions", {"prompt": "hi"}, {"Authorization": "Bearer wrong"}, 401, None),
    ("/v1/completions", {"prompt": "hi"}, {"Authorization": ""}, 401, None),
    ("/v1/models", None, {"Authorization": "Bearer wrong"}, 401, None),
]


def test_bad_requests_get_openai_errors(server, client):
    good = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=server, timeout=30) as hc:
        for path, body, headers, status, param in BAD:
            h = {**good, **(headers or {})}
            if body is None:
                r = hc.get(path, headers=h)
            elif isinstance(body, str):
                r = hc.post(path, content=body, headers={**h, "Content-Type": "application/json"})
            else:
                r = hc.post(path, json=body, headers=h)
            assert r.status_code == status, (path, body, r.text)
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["message"], r.text
            if param is not None:
                assert err["param"] == param, (body, err)
        assert hc.get("/no/such/route", headers=good).status_code == 404
    # the official client maps them to its exceptions, and the server still serves
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny_mxfp4", prompt="hi", temperature=-1)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="hi")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server + "/v1", api_key="bad", max_retries=0).models.list()
    r = client.completions.create(model="tiny_mxfp4", prompt="hi", max_tokens=2, temperature=0)
    assert r.choices[0].finish_reason in ("length", "stop")
    wait_idle(server)


def test_models_health_metrics(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny_mxfp4"]
    assert httpx.get(server + "/health").json()["status"] == "ok"
    assert httpx.get(server + "/ping").json()["status"] == httpx.post(server + "/ping").json()["status"] == "ok"
    assert httpx.get(server + "/kv/handshake").status_code == 404        # no connector on --role both
    # a finished request of its own: labelled counters and histograms have no series before one (the test
    # passed only after the tests above it had made requests)
    client.completions.create(model="tiny_mxfp4", prompt="hi", max_tokens=2, temperature=0)
    wait_idle(server)
    text = httpx.get(server + "/metrics").text
    for name in METRIC_NAMES:
        assert re.search(rf"^{name}", text, re.M), name
    m = metrics(server)
    assert m["gigadecode_kv_blocks_total"] == 255
    assert m["gigadecode_time_to_first_token_seconds_count"] > 0
    assert m["gigadecode_inter_token_latency_seconds_count"] > 0


def test_metrics_under_vllms_names(server, client):
    """A vLLM dashboard's queries find their series: every family in vllm_metrics.VLLM_NAMES under its vLLM
    name with vLLM's labels (`model_name`, `engine`; `finished_reason`), equal to ours in the same scrape, and
    `vllm:kv_cache_usage_perc` = blocks used / total. The whole text parses as Prometheus exposition."""
    from prometheus_client.parser import text_string_to_metric_families
    from gigadecode.server.vllm_metrics import VLLM_NAMES
    client.completions.create(model="tiny_mxfp4", prompt="hi", max_tokens=3, temperature=0)
    wait_idle(server)
    fams = {f.name: f for f in text_string_to_metric_families(httpx.get(server + "/metrics").text)}
    labels = {"model_name": "tiny_mxfp4", "engine": "0"}
    for ours, theirs in VLLM_NAMES.items():
        assert theirs in fams, theirs
        mine = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in fams[ours].samples}
        got = {(s.name.replace(theirs, ours, 1),
                tuple(sorted({("finish_reason" if k == "finished_reason" else k): v for k, v in s.labels.items()
                              if k not in labels}.items()))): s.value
               for s in fams[theirs].samples}
        assert all(s.labels.items() >= labels.items() for s in fams[theirs].samples), theirs
        assert got == mine and fams[theirs].type == fams[ours].type, theirs
    assert fams["vllm:request_success"].samples                       # labelled by finished_reason
    assert all("finished_reason" in s.labels for s in fams["vllm:request_success"].samples)
    (usage,) = fams["vllm:kv_cache_usage_perc"].samples
    used, total = (fams[n].samples[0].value for n in ("gigadecode_kv_blocks_used", "gigadecode_kv_blocks_total"))
    assert usage.labels == labels and usage.value == used / total


# --------------------------------------------------------------------------------------------------
# In-process app (build_app over an AsyncEngine): engine failures, DI hooks, token-id-only models
# --------------------------------------------------------------------------------------------------
def sse_lines(hc: httpx.Client, path: str, body: dict) -> tuple[int, list]:
    with hc.stream("POST", path, json={**body, "stream": True}) as r:
        out = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    return r.status_code, [x if x == "[DONE]" else json.loads(x) for x in out]


def test_engine_failures_become_errors_and_serving_goes_on(tiny_ckpt, codec):
    args = build_parser().parse_args(["serve", "--model", str(tiny_ckpt), *ENGINE_FLAGS])
    eng = engine_from_args(args, "both")
    inject = {"decode": 0, "finish_error": False, "kv_out": None}
    real_decode, real_step = eng.runner.decode, eng.step

    def decode(seqs, pad_to=0):
        if inject["decode"]:
            inject["decode"] -= 1
            raise RuntimeError("injected decode failure")
        return real_decode(seqs, pad_to)

    def step():                  # stands in for the DI engine: transfer failures, producer params
        outs = real_step()
        if inject["finish_error"]:
            for r in list(eng.running):
                eng._finish(r, "error", error="KV transfer failed: injected")
        for o in outs:
            if o.finished and inject["kv_out"] is not None:
                eng.requests[o.request_id].kv_transfer_params_out = inject["kv_out"]
        return outs

    eng.runner.decode, eng.step = decode, step
    app = build_app(AsyncEngine(eng, codec=codec, model_dir=str(tiny_ckpt)), "tiny", role="both")
    body = {"prompt": [5, 6, 7, 8], "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=30) as hc:
        inject["decode"] = 1
        r = hc.post("/v1/completions", json=body)
        assert r.status_code == 500 and "injected decode failure" in r.json()["error"]["message"]
        inject["decode"] = 1
        status, events = sse_lines(hc, "/v1/completions", body)
        assert status == 200 and "injected decode failure" in events[-2]["error"]["message"]
        assert events[-1] == "[DONE]"

        inject["finish_error"] = True
        r = hc.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        assert r.status_code == 500 and "KV transfer failed: injected" in r.json()["error"]["message"]
        status, events = sse_lines(hc, "/v1/completions", body)
        assert "KV transfer failed" in events[-2]["error"]["message"]
        inject["finish_error"] = False

        inject["kv_out"] = {"remote_engine_id": "e1", "remote_block_ids": [[1], [2]]}
        r = hc.post("/v1/completions", json=body)
        assert r.status_code == 200 and r.json()["kv_transfer_params"] == inject["kv_out"]
        status, events = sse_lines(hc, "/v1/completions", body)
        assert events[-2]["kv_transfer_params"] == inject["kv_out"] and events[-2]["choices"][0]["finish_reason"]
        inject["kv_out"] = None

        r = hc.post("/v1/completions", json={**body, "return_token_ids": True})
        assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 6
        m = wait_idle(srv.url)
        assert m["gigadecode_engine_step_failures_total"] == 2
        assert m['gigadecode_requests_total{finish_reason="error"}'] == 4
        assert not eng.requests                  # finished requests are not kept


def test_warm_up_runs_on_the_engine_thread_before_health_says_ok(tiny_ckpt, engine):
    """`serve` warms its engine up on the engine thread (whose OpenMP workers, malloc arena and kernel scratch
    serve the requests); /health is 503 `engine_warming_up` until it is done, and a request sent meanwhile
    waits for it, then gets the tokens it gets from a cold engine."""
    args = build_parser().parse_args(["serve", "--model", str(tiny_ckpt), *ENGINE_FLAGS])
    eng = engine_from_args(args, "both")
    assert args.no_warmup is False                          # the command line's default: warm up
    gate, seen = threading.Event(), []
    real_warm_up = eng.warm_up

    def warm_up():
        seen.append(threading.current_thread().name)
        assert gate.wait(30)
        return real_warm_up()

    eng.warm_up = warm_up
    want = greedy(engine, [[9, 10, 11]], 5)[0]
    app = build_app(AsyncEngine(eng, codec=None, warm_up=True), "tiny")
    body = {"prompt": [9, 10, 11], "max_tokens": 5, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=30) as hc:
        r = hc.get("/health")
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_warming_up"
        with concurrent.futures.ThreadPoolExecutor(1) as ex:
            sent = ex.submit(hc.post, "/v1/completions", json=body)
            time.sleep(0.3)
            assert not sent.done()                          # queued behind the warm-up
            gate.set()
            r = sent.result(30)
        assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == want
        assert hc.get("/health").status_code == 200
    assert seen == ["gigadecode-engine"]


def test_token_id_only_model(tiny_ckpt, engine):
    args = build_parser().parse_args(["serve", "--model", str(tiny_ckpt), *ENGINE_FLAGS])
    app = build_app(AsyncEngine(engine_from_args(args, "both"), codec=None), "ids-only")
    want = greedy(engine, [[9, 10, 11]], 5)[0]
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=30) as hc:
        r = hc.post("/v1/completions", json={"prompt": [9, 10, 11], "max_tokens": 5, "temperature": 0,
                                             "ignore_eos": True, "return_token_ids": True})
        c = r.json()["choices"][0]
        assert c["text"] == "" and c["token_ids"] == want
        status, events = sse_lines(hc, "/v1/completions", {"prompt": [9, 10, 11], "max_tokens": 5,
                                                           "temperature": 0, "ignore_eos": True,
                                                           "return_token_ids": True})
        assert sum((e["choices"][0]["token_ids"] for e in events[:-1]), []) == want
        r = hc.post("/v1/completions", json={"prompt": "text"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        r = hc.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def test_several_served_model_names(tiny_ckpt, engine):
    """`--served-model-name a b c` (vLLM's aliases): a request may name any of them and is answered under the
    name it gave (the first when it gives none), as vLLM answers; /v1/models lists each; another name is a 404
    that lists them."""
    args = build_parser().parse_args(["serve", "--model", str(tiny_ckpt), *ENGINE_FLAGS,
                                      "--served-model-name", "gpt-oss", "openai/gpt-oss-20b", "g"])
    assert args.served_model_name == ["gpt-oss", "openai/gpt-oss-20b", "g"]
    app = build_app(AsyncEngine(engine_from_args(args, "both"), codec=None), args.served_model_name)
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=30) as hc:
        assert [m["id"] for m in hc.get("/v1/models").json()["data"]] == ["gpt-oss", "openai/gpt-oss-20b", "g"]
        for name in ("gpt-oss", "openai/gpt-oss-20b", "g"):
            r = hc.post("/v1/completions", json={"model": name, "prompt": [9, 10], "max_tokens": 2})
            assert r.status_code == 200 and r.json()["model"] == name
        r = hc.post("/v1/completions", json={"prompt": [9, 10], "max_tokens": 2})
        assert r.status_code == 200 and r.json()["model"] == "gpt-oss"
        with hc.stream("POST", "/v1/completions", json={"model": "g", "prompt": [9, 10], "max_tokens": 2,
                                                         "stream": True}) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        assert chunks and all(c["model"] == "g" for c in chunks)
        r = hc.post("/v1/completions", json={"model": "gpt-oss-120b", "prompt": [9, 10], "max_tokens": 2})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        assert "`gpt-oss`, `openai/gpt-oss-20b`, `g`" in r.json()["error"]["message"]
    with pytest.raises(ValueError, match="non-empty strings"):
        build_app(AsyncEngine(engine_from_args(args, "both"), codec=None), [])


class FakeEngine:
    """The engine contract AsyncEngine relies on, with a connector (a DI producer that answers params)."""

    max_model_len = 64

    def __init__(self) -> None:
        self.running, self.waiting, self.requests, self.stats = [], [], {}, EngineStats(kv_bytes_transferred=1234)
        self.runner = SimpleNamespace(kv=SimpleNamespace(num_blocks=9))
        self.connector = SimpleNamespace(handshake_info=lambda: {"layout": {"engine_id": "p0"}, "agent_metadata": "AA=="},
                                         key=KV_SECRET.encode())
        self.calls: list[dict] = []
        self.steps = 0

    def add_request(self, prompt_ids, params, request_id=None, **kw):
        self.calls.append(kw)
        self.requests[request_id] = SimpleNamespace(request_id=request_id, finished=False, finish_reason=None,
                                                    error=None, kv_transfer_params_out=None)
        self.waiting.append(self.requests[request_id])
        return request_id

    def has_unfinished(self):
        return bool(self.waiting)

    def kv_usage(self):
        return 0, 8

    def step(self):
        self.steps += 1
        outs = []
        for r in self.waiting:
            r.finished, r.finish_reason = True, "length"
            r.kv_transfer_params_out = {"remote_request_id": r.request_id}
            outs.append(RequestOutput(r.request_id, [], True, "length"))
        self.waiting.clear()
        return outs

    def abort(self, rid):
        return False


def test_an_engine_that_stops_for_good_ends_the_server():
    """A parallel engine whose rank failed serves no more (`failure`): the engine loop ends, `on_dead` (serve:
    shut the HTTP server down, exit with the reason) hears why once, /health answers 503 engine_dead with it
    and a new request 503, instead of a healthy-looking server failing every request."""

    class Dying(FakeEngine):
        failure = None

        def step(self):
            outs = super().step()
            if outs:                                     # the world stopped during this step
                self.failure = "rank 1: engine step failed: RuntimeError: injected"
            return outs

    heard = []
    aeng = AsyncEngine(Dying())
    aeng.on_dead = heard.append
    with ServerThread(build_app(aeng, "fake")) as srv, httpx.Client(base_url=srv.url, timeout=30) as hc:
        assert hc.get("/health").status_code == 200
        assert hc.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 1}).status_code == 200
        t0 = time.monotonic()
        while aeng.is_running and time.monotonic() - t0 < 10:
            time.sleep(0.02)
        assert heard == ["rank 1: engine step failed: RuntimeError: injected"] and not aeng.is_running
        r = hc.get("/health")
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
        assert "injected" in r.json()["error"]["message"]
        r = hc.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 1})
        assert r.status_code == 503 and "the engine stopped" in r.json()["error"]["message"]


def test_a_stalled_engine_loop_reads_unhealthy_until_it_moves_again():
    """A step that never returns (a kernel or a peer that hangs) left /health at 200 while nobody was served;
    past the stall timeout it answers 503 engine_stalled (a router, or the proxy's probe, stops sending work),
    the loop-age gauge says how long, and once the step returns the server reads healthy and serves again.
    An idle server, whose loop waits for work, never reads stalled."""

    class Hanging(FakeEngine):
        armed, gate, entered = False, threading.Event(), threading.Event()

        def step(self):
            if self.waiting and self.armed:
                self.entered.set()
                assert self.gate.wait(30)
                Hanging.armed = False
            return super().step()

    aeng = AsyncEngine(Hanging(), stall_timeout_s=0.5)
    with ServerThread(build_app(aeng, "fake")) as srv, httpx.Client(base_url=srv.url, timeout=30) as hc:
        time.sleep(1.0)                                   # idle for twice the timeout: its loop still moves
        assert hc.get("/health").status_code == 200
        with concurrent.futures.ThreadPoolExecutor(1) as ex:
            Hanging.armed = True
            sent = ex.submit(hc.post, "/v1/completions", json={"prompt": [1, 2], "max_tokens": 1})
            assert Hanging.entered.wait(10)
            assert hc.get("/health").status_code == 200   # a step may take a while
            time.sleep(0.7)
            r = hc.get("/health")
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_stalled"
            assert "no progress for" in r.json()["error"]["message"]
            m = re.search(r"^gigadecode_engine_loop_age_seconds (\S+)$", hc.get("/metrics").text, re.M)
            assert m and float(m.group(1)) > 0.5
            Hanging.gate.set()
            assert sent.result(30).status_code == 200
        assert hc.get("/health").status_code == 200
        assert hc.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 1}).status_code == 200
    off = AsyncEngine(FakeEngine(), stall_timeout_s=0)
    assert off.stalled_for() is None


@pytest.mark.parametrize("value", ["-1", "0.5", "nan", "inf"])
def test_serve_refuses_a_bad_stall_timeout(value, tiny_ckpt):
    args = build_parser().parse_args(["serve", "--model", str(tiny_ckpt), "--engine-stall-timeout-s", value])
    from gigadecode.server.api import serve
    with pytest.raises(ValueError, match="--engine-stall-timeout-s must be 0"):
        serve(args)


def test_di_hooks_handshake_and_idle_steps():
    fake = FakeEngine()
    app = build_app(AsyncEngine(fake), "fake", role="prefill")
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=30) as hc:
        assert hc.get("/kv/handshake").status_code == 403                 # no proof of the KV secret
        bad = handshake_token(b"not-the-deployment-key-0123")
        assert hc.get("/kv/handshake", headers={AUTH_HEADER: bad}).status_code == 403
        ok = {AUTH_HEADER: handshake_token(KV_SECRET.encode())}
        assert hc.get("/kv/handshake", headers=ok).json() == {"layout": {"engine_id": "p0"}, "agent_metadata": "AA=="}
        r = hc.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 1,
                                             "kv_transfer_params": {"do_remote_decode": True,
                                                                    "remote_host": "evil.example"}})
        assert r.status_code == 200
        # typed; the side-channel host is where the client reached this server, never one it names
        assert fake.calls[-1] == {"kv_transfer_params": KVTransferParams(do_remote_decode=True, remote_host="127.0.0.1")}
        assert r.json()["kv_transfer_params"] == {"remote_request_id": r.json()["id"]}
        assert r.json()["choices"][0]["text"] == "" and r.json()["usage"]["completion_tokens"] == 0
        r = hc.post("/v1/completions", json={"prompt": [1, 2, 3]})
        assert r.status_code == 200 and fake.calls[-1] == {}          # no kv_transfer_params: not passed
        n = fake.steps
        time.sleep(0.5)
        assert fake.steps - n >= 5             # idle: still steps at least every 50 ms
        assert metrics(srv.url)["gigadecode_kv_bytes_transferred_total"] == 1234
        assert hc.get("/health").json()["role"] == "prefill"


def test_a_prefill_server_shutting_down_keeps_its_leased_kv_until_read():
    """At shutdown (SIGTERM: uvicorn's, as `serve` runs it) a prefill server keeps its engine stepping, so its KV
    side channel and NIXL agent serve, until every lease has ended: the decode servers read the KV it answered
    just before. It used to stop at once: those requests then failed on the decode side. Bounded by the
    drain time (`--shutdown-timeout-s`)."""

    class Leasing(FakeEngine):
        leases = 1

        def num_leases(self):
            return self.leases

    for read_at, drain_s in ((0.6, 5.0), (None, 0.5)):          # read during the drain; never read
        fake = Leasing()
        srv = ServerThread(build_app(AsyncEngine(fake), "fake", role="prefill", lease_drain_s=drain_s))
        with srv:
            srv.server.should_exit = True                        # what SIGTERM does
            t0 = time.monotonic()
            if read_at is not None:
                time.sleep(read_at)
                assert srv.thread.is_alive(), "the server stopped with a lease held"
                steps = fake.steps
                time.sleep(0.2)
                assert fake.steps > steps                        # the engine still steps (notifications, expiry)
                fake.leases = 0                                  # the decode server's read ended it
            srv.thread.join(10)
            took = time.monotonic() - t0
            assert not srv.thread.is_alive()
            assert took < (read_at + 1.0 if read_at is not None else drain_s + 1.0), took
            assert read_at is not None or took >= drain_s        # a lease nobody reads: the whole drain time


def test_a_prefill_server_with_a_wedged_engine_still_shuts_down_within_its_drain():
    """The lease drain asks the engine thread for its leases: an engine wedged in a step (the stall
    `--engine-stall-timeout-s` reports) never answers, and the server shutting down waited for it forever instead
    of giving up when the drain time was over."""
    wedged = threading.Event()
    unwedge = threading.Event()

    class Wedging(FakeEngine):
        def num_leases(self):
            return 1

        def step(self):
            if wedged.is_set():
                unwedge.wait(60)
            return super().step()

    drain_s = 0.5
    srv = ServerThread(build_app(AsyncEngine(Wedging()), "fake", role="prefill", lease_drain_s=drain_s))
    try:
        with srv:
            wedged.set()
            time.sleep(0.3)                                  # the engine thread is inside a step for good
            srv.server.should_exit = True                    # what SIGTERM does
            t0 = time.monotonic()
            srv.thread.join(15)
            assert not srv.thread.is_alive(), "the server shutting down waits for a wedged engine"
            assert time.monotonic() - t0 < drain_s + 8       # the drain, then `stop`'s own bounded wait
    finally:
        unwedge.set()


def test_a_prefill_servers_lease_drain_runs_after_its_last_request_not_from_the_signal():
    """`serve`'s DrainingServer stops the engine `grace` s after SIGTERM to end requests still open; once they are
    done the lease drain has `--shutdown-timeout-s` of its own (`lease_drain_s`). That timer used to stop the engine
    under the drain too: a prefill answered just before the grace ran out had its KV gone before any read."""
    from gigadecode.server.api import DrainingServer

    class SlowLeasing(FakeEngine):
        leases, answer_at = 0, float("inf")

        def num_leases(self):
            return self.leases

        def step(self):
            if time.monotonic() < self.answer_at:           # the prefill runs until then
                self.steps += 1
                return []
            self.leases += bool(self.waiting)               # its answer leases the KV
            return super().step()

    grace = 2.0                                             # margins of 0.6-1 s: a loaded CI host keeps them
    fake = SlowLeasing()
    aeng = AsyncEngine(fake)
    srv = ServerThread(build_app(aeng, "fake", role="prefill", lease_drain_s=grace))
    srv.server = DrainingServer(uvicorn.Config(srv.server.config.app, log_level="warning",
                                               timeout_graceful_shutdown=grace + 2.0), aeng, grace)
    srv.thread = threading.Thread(target=srv.server.run, kwargs={"sockets": [srv.sock]}, daemon=True)
    with srv:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            fake.answer_at = time.monotonic() + 0.3 + grace - 0.6     # answered 0.6 s before the grace is over
            answer = pool.submit(httpx.post, srv.url + "/v1/completions", timeout=30, json={
                "prompt": [1, 2, 3], "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
            time.sleep(0.3)
            srv.server.should_exit = True                   # what SIGTERM does
            assert answer.result().status_code == 200
        time.sleep(1.0)                                     # past the grace, within the drain after the answer
        assert srv.thread.is_alive() and aeng.is_running, "the engine stopped with the lease unread"
        fake.leases = 0                                     # the decode server's read ended it
        srv.thread.join(10)
        assert not srv.thread.is_alive()


# --------------------------------------------------------------------------------------------------
# Proxy
# --------------------------------------------------------------------------------------------------
class ServerThread:
    """A uvicorn server for `app` on a loopback socket, in a thread."""

    def __init__(self, app) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=1))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> ServerThread:
        self.thread.start()
        t0 = time.monotonic()
        while not self.server.started:
            assert time.monotonic() - t0 < 10 and self.thread.is_alive(), "server thread did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()


def fake_vllm_prefill() -> tuple[FastAPI, list]:
    """A stock vLLM prefill server as the proxy's `--prefill-vllm` sees it: it records each body the proxy
    writes for it and answers NixlConnector params for the prompt it was sent, naming its side channel (which
    answers the proxy's probe while the app runs) -> (app, bodies seen)."""
    seen: list = []
    side: list[VllmSideChannel] = []

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        side.append(VllmSideChannel("v"))
        try:
            yield
        finally:
            side.pop().close()
    app = FastAPI(lifespan=lifespan)
    app.state.side_channel = side

    @app.post("/v1/completions")
    async def prefill(request: Request):
        seen.append(await request.json())
        return {"choices": [{"index": 0, "text": ""}], "kv_transfer_params": {
            "remote_engine_id": "v", "remote_host": "127.0.0.1", "remote_port": side[0].port,
            "remote_request_id": "r", "remote_block_ids": [[1]], "remote_num_tokens": len(seen[-1]["prompt"])}}
    return app, seen


def fake_upstream(name: str, mode: str) -> tuple[FastAPI, dict]:
    """mode: "fail" (500), "prefill" (answers kv_transfer_params; 400 for model "bad"), "decode"."""
    app = FastAPI()
    seen: dict = {"bodies": [], "cancelled": 0, "headers": []}

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model"}]}

    async def handle(request: Request, path: str):
        body = await request.json()
        seen["bodies"].append((path, body))
        seen["headers"].append(dict(request.headers))
        if mode == "fail":
            return JSONResponse({"error": {"message": "boom", "type": "server_error", "param": None,
                                           "code": None}}, status_code=500)
        if mode == "prefill":
            if body.get("model") == "bad":
                return JSONResponse({"error": {"message": "no such model", "type": "invalid_request_error",
                                               "param": "model", "code": "model_not_found"}}, status_code=404)
            return {"id": "p", "object": "text_completion", "choices": [{"index": 0, "text": "", "finish_reason":
                    "length"}], "kv_transfer_params": {"do_remote_prefill": True, "remote_engine_id": name,
                                                       "remote_block_ids": [[3], [4, 5]], "num_computed_tokens": 2}}
        if body.get("stream"):
            async def gen():
                try:
                    for i in range(body.get("max_tokens") or body.get("max_completion_tokens") or 10**6):
                        yield f"data: {json.dumps({'choices': [{'index': 0, 'text': f't{i}'}]})}\n\n"
                        await asyncio.sleep(0.01)
                    yield "data: [DONE]\n\n"
                except asyncio.CancelledError:
                    seen["cancelled"] += 1
                    raise
            return StreamingResponse(gen(), media_type="text/event-stream")
        return {"id": "d", "object": "text_completion", "model": name,
                "choices": [{"index": 0, "text": "decoded", "finish_reason": "length"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await handle(request, "/v1/chat/completions")

    return app, seen


def test_proxy_prefill_then_decode_with_retry():
    bad_app, bad = fake_upstream("bad", "fail")
    pre_app, pre = fake_upstream("pre", "prefill")
    dec_app, dec = fake_upstream("dec", "decode")
    dead = f"http://127.0.0.1:{free_port()}"          # nothing listens there
    with ServerThread(bad_app) as b, ServerThread(pre_app) as p, ServerThread(dec_app) as d:
        proxy = build_proxy_app([b.url, dead, p.url], [d.url])
        with ServerThread(proxy) as px, httpx.Client(base_url=px.url, timeout=20) as hc:
            body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 5, "temperature": 0}
            r = hc.post("/v1/completions", json=body, headers={"Authorization": "Bearer k"})
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == "decoded"
            # the failing prefill (500) was tried, then the good one (and the dead one between, unless the
            # proxy's probe of every server's /health had taken it out of rotation already)
            assert len(bad["bodies"]) == 1 and len(pre["bodies"]) == 1
            path, pb = pre["bodies"][0]
            assert path == "/v1/completions"
            assert pb["max_tokens"] == 1 and pb["stream"] is False
            assert pb["kv_transfer_params"] == {"do_remote_decode": True}
            assert pb["prompt"] == [1, 2, 3] and pb["temperature"] == 0
            _, db = dec["bodies"][0]
            assert db == {**body, "kv_transfer_params": {"do_remote_prefill": True, "remote_engine_id": "pre",
                                                         "remote_block_ids": [[3], [4, 5]],
                                                         "num_computed_tokens": 2}}
            assert dec["headers"][0]["authorization"] == "Bearer k"

            # streaming chat: prefill gets max_completion_tokens=1 and stream=false; decode streams
            chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 3,
                    "stream": True, "stream_options": {"include_usage": True}}
            with hc.stream("POST", "/v1/chat/completions", json=chat) as r:
                lines = [ln for ln in r.iter_lines() if ln]
            assert r.status_code == 200 and lines[-1] == "data: [DONE]" and len(lines) == 4
            path, pb = pre["bodies"][-1]
            assert path == "/v1/chat/completions" and pb["max_completion_tokens"] == 1 and pb["max_tokens"] == 1
            assert pb["stream"] is False and "stream_options" not in pb
            _, db = dec["bodies"][-1]
            assert db["stream"] is True and db["max_completion_tokens"] == 3
            assert db["kv_transfer_params"]["remote_engine_id"] == "pre"

            # a 4xx from prefill is the client's answer, decode is not asked
            n_dec = len(dec["bodies"])
            r = hc.post("/v1/completions", json={**body, "model": "bad"})
            assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
            assert len(dec["bodies"]) == n_dec
            r = hc.post("/v1/completions", content="{nope", headers={"Content-Type": "application/json"})
            assert r.status_code == 400 and "error" in r.json()

            # a client that leaves mid-stream cancels the decode server's stream
            with hc.stream("POST", "/v1/completions", json={**body, "stream": True, "max_tokens": None}) as r:
                for i, _ in enumerate(r.iter_lines()):
                    if i > 4:
                        break
            t0 = time.monotonic()
            while dec["cancelled"] == 0 and time.monotonic() - t0 < 5:
                time.sleep(0.05)
            assert dec["cancelled"] == 1

            assert hc.get("/v1/models").json()["data"][0]["id"] == "dec"
            h = hc.get("/health")
            assert h.status_code == 200 and h.json()["prefill"][dead]["healthy"] is False
            assert h.json()["prefill"][dead]["in_rotation"] is False and h.json()["prefill"][p.url]["in_rotation"]
            # a request's or the probe's ConnectError, whichever came first
            assert "ConnectError" in h.json()["prefill"][dead]["out_of_rotation_because"]
            m = metrics(px.url)                       # the same, for Prometheus
            assert m[f'gigadecode_proxy_upstream_in_rotation{{role="prefill",url="{dead}"}}'] == 0
            assert m[f'gigadecode_proxy_upstream_failures_total{{role="prefill",url="{dead}"}}'] >= 1
            assert m[f'gigadecode_proxy_upstream_in_rotation{{role="decode",url="{d.url}"}}'] == 1
            assert m[f'gigadecode_proxy_upstream_requests_total{{role="decode",url="{d.url}"}}'] == len(dec["bodies"])
            assert m[f'gigadecode_proxy_upstream_in_flight{{role="decode",url="{d.url}"}}'] == 0

        # every prefill failing: 502 in OpenAI's shape
        proxy = build_proxy_app([b.url, dead], [d.url])
        with ServerThread(proxy) as px:
            r = httpx.post(px.url + "/v1/completions", json=body, timeout=20)
            assert r.status_code == 502 and r.json()["error"]["code"] == "prefill_failed"


def test_proxy_says_which_decode_server_it_could_not_reach():
    """Every decode server down (stopped, restarting): the 502 names the last one tried and why, as the
    prefill's does, instead of a bare "no decode server could be reached"; streamed or not."""
    pre_app, _ = fake_upstream("pre", "prefill")
    dead = f"http://127.0.0.1:{free_port()}"          # nothing listens there
    with ServerThread(pre_app) as p, ServerThread(build_proxy_app([p.url], [dead])) as px:
        for stream in (False, True):
            r = httpx.post(px.url + "/v1/completions", timeout=20,
                           json={"model": "m", "prompt": [1, 2, 3], "max_tokens": 5, "stream": stream})
            err = r.json()["error"]
            assert r.status_code == 502 and err["code"] == "decode_failed", r.text
            assert f"decode server {dead} unreachable: ConnectError" in err["message"], err


class HangUpServer:
    """A decode server on its way out: healthy to GET /health, but it closes every POST's connection without a
    word, as a server shutting down closes the pooled connection a request was just sent on."""

    def __init__(self) -> None:
        import socket
        import threading
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.posts = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                head = b""
                while b"\r\n\r\n" not in head and (part := conn.recv(65536)):
                    head += part
                if head.startswith(b"GET"):
                    conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 15\r\n"
                                 b"connection: close\r\n\r\n{\"status\":\"ok\"}")
                else:
                    self.posts += 1

    def close(self) -> None:
        self.sock.close()


def test_proxy_sends_a_request_a_decode_server_dropped_unanswered_to_the_next():
    """A decode server that closes the connection before answering (shutting down: uvicorn closes its idle
    pooled connections, and a request just sent on one meets that) has done nothing for the request: the
    next decode server answers it, streamed or not, where the client got a 502; the first leaves the
    rotation, its reason shown in /health."""
    pre_app, _ = fake_upstream("pre", "prefill")
    dec_app, dec = fake_upstream("dec", "decode")
    hang_up = HangUpServer()
    try:
        with ServerThread(pre_app) as p, ServerThread(dec_app) as d:
            for stream in (False, True):
                with ServerThread(build_proxy_app([p.url], [hang_up.url, d.url])) as px:
                    posts = hang_up.posts
                    r = httpx.post(px.url + "/v1/completions", timeout=20,
                                   json={"model": "m", "prompt": [1, 2, 3], "max_tokens": 3, "stream": stream})
                    assert r.status_code == 200, r.text
                    assert ("t2" if stream else "decoded") in r.text
                    assert hang_up.posts == posts + 1          # the hang-up server was tried first
                    assert dec["bodies"][-1][1]["kv_transfer_params"]["remote_engine_id"] == "pre"
                    down = httpx.get(px.url + "/health").json()["decode"][hang_up.url]["out_of_rotation_because"]
                    assert re.search("dropped the request before answering: (RemoteProtocolError|ReadError)", down)
    finally:
        hang_up.close()


def test_the_proxy_signs_which_vllm_process_answered():
    """Behind a vLLM prefill the proxy probes its side channel after each answer and signs the process it found
    (`producer_process`) into the decode server's params; when the probe before the prefill saw another process
    (vLLM restarted around the request: which one answered is unknown) it prefills once more; a side channel
    that does not answer fails the request (502), as nothing could say whose KV the blocks hold."""
    from gigadecode.connector.params import parse_kv_params, verify_signature
    from gigadecode.connector.vllm_handshake import VllmAgentMetadata
    vllm, seen = fake_vllm_prefill()
    dec_app, dec = fake_upstream("dec", "decode")
    body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 3}
    with ServerThread(vllm) as v, ServerThread(dec_app) as d:
        side = vllm.state.side_channel[0]
        with ServerThread(build_proxy_app([], [d.url], prefill_vllm=[v.url], kv_secret=KV_SECRET)) as px:
            for process, prefills in (("first", 1), ("first", 1), ("second", 2), ("second", 1)):
                side.process = process                          # "second": restarted under the same engine id
                n = len(seen)
                r = httpx.post(px.url + "/v1/completions", json=body, timeout=20)
                assert r.status_code == 200, r.text
                assert len(seen) - n == prefills, process
                params = parse_kv_params(dec["bodies"][-1][1]["kv_transfer_params"])
                verify_signature(params, KV_SECRET.encode())
                assert params.producer_process == VllmAgentMetadata.from_payload(side.payload()).process
            side.close()                                       # vLLM gone right after answering
            n = len(dec["bodies"])
            r = httpx.post(px.url + "/v1/completions", json=body, timeout=20)
            assert r.status_code == 502 and r.json()["error"]["code"] == "prefill_failed", r.text
            assert "did not answer" in r.json()["error"]["message"] and len(dec["bodies"]) == n


def test_requests_around_a_vllm_restart_name_the_process_that_answered_them():
    """40 requests at once through the proxy while the vLLM prefill behind it restarts (a new process under the
    same engine id, once, as the 20th prefill arrives): every request is answered, and every decode server's
    params name the process that answered that prefill; a request whose prefill straddled the restart (the
    probe before it saw the old process, the one after it the new one) was prefilled once more."""
    from gigadecode.connector.params import parse_kv_params
    from gigadecode.connector.vllm_handshake import VllmAgentMetadata
    side = VllmSideChannel("v", process="old")
    app, arrivals = FastAPI(), []

    @app.post("/v1/completions")
    async def prefill(request: Request):
        body = await request.json()
        arrivals.append(body)
        if len(arrivals) == 21:                          # the warm-up's, then the 20th of the 40
            side.process = "new"
        await asyncio.sleep(0.01)
        return {"choices": [{"index": 0, "text": ""}], "kv_transfer_params": {
            "remote_engine_id": "v", "remote_host": "127.0.0.1", "remote_port": side.port,
            "remote_request_id": side.process, "remote_block_ids": [[1]], "remote_num_tokens": len(body["prompt"])}}
    dec_app, dec = fake_upstream("dec", "decode")

    async def send(url: str) -> list[int]:
        async with httpx.AsyncClient(timeout=60) as c:
            rs = await asyncio.gather(*(c.post(url, json={"model": "m", "prompt": [1, 2, 3, i], "max_tokens": 2})
                                        for i in range(40)))
        return [r.status_code for r in rs]
    try:
        with ServerThread(app) as v, ServerThread(dec_app) as d:
            with ServerThread(build_proxy_app([], [d.url], prefill_vllm=[v.url], kv_secret=KV_SECRET)) as px:
                assert httpx.post(px.url + "/v1/completions", json={"model": "m", "prompt": [1, 2], "max_tokens": 2},
                                  timeout=20).status_code == 200          # the proxy has seen the old process
                assert asyncio.run(send(px.url + "/v1/completions")) == [200] * 40
    finally:
        side.close()
    named = {name: VllmAgentMetadata.from_payload(VllmSideChannel.payload_of("v", name)).process
             for name in ("old", "new")}
    answered_by = [parse_kv_params(body["kv_transfer_params"]) for _, body in dec["bodies"]]
    assert len(answered_by) == 41 and len(arrivals) > 41                    # the 20th at least prefilled again
    assert all(p.producer_process == named[p.remote_request_id] for p in answered_by)
    assert {p.remote_request_id for p in answered_by} == {"old", "new"}


def test_proxy_behind_a_vllm_prefill_sends_a_dropped_request_to_no_other_decode_server():
    """A vLLM prefill frees its blocks once a decode server has read them, and nothing checks the bytes (its
    answer has no CRC): a decode server that dropped the request may have read them already (a non-streaming one
    answers only when done), so another one reading the same params could decode another request's KV. Behind
    vLLM only a decode server nothing reached goes to the next one; one that dropped the request is a 502."""
    vllm, _ = fake_vllm_prefill()
    dec_app, dec = fake_upstream("dec", "decode")
    hang_up = HangUpServer()
    dead = f"http://127.0.0.1:{free_port()}"          # nothing listens there
    body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 3}
    try:
        with ServerThread(vllm) as v, ServerThread(dec_app) as d:
            for stream in (False, True):
                app = build_proxy_app([], [hang_up.url, d.url], prefill_vllm=[v.url], kv_secret=KV_SECRET)
                with ServerThread(app) as px:
                    n = len(dec["bodies"])
                    r = httpx.post(px.url + "/v1/completions", json={**body, "stream": stream}, timeout=20)
                    assert r.status_code == 502 and r.json()["error"]["code"] == "decode_failed", r.text
                    assert hang_up.url in r.json()["error"]["message"]
                    assert len(dec["bodies"]) == n, "the params went to a second decode server"
            app = build_proxy_app([], [dead, d.url], prefill_vllm=[v.url], kv_secret=KV_SECRET)
            with ServerThread(app) as px:                 # nothing reached the first: the next one answers
                r = httpx.post(px.url + "/v1/completions", json=body, timeout=20)
                assert r.status_code == 200 and "decoded" in r.text, r.text
    finally:
        hang_up.close()


def test_proxy_sends_a_request_to_the_next_decode_server_when_connecting_times_out(monkeypatch):
    """A decode server whose host is gone (its SYNs go unanswered: here a listener whose backlog is full) is
    unreachable as much as one that refuses the connection: nothing was sent, so the next decode server
    answers, streamed or not, where the client got a 502 'failed: ConnectTimeout' after the connect timeout."""
    import gigadecode.server.proxy as proxy_module
    monkeypatch.setattr(proxy_module, "CONNECT_TIMEOUT_S", 0.5)
    pre_app, _ = fake_upstream("pre", "prefill")
    dec_app, dec = fake_upstream("dec", "decode")
    silent = socket.create_server(("127.0.0.1", 0), backlog=0)       # never accepts: once full, SYNs are dropped
    silent_url = f"http://127.0.0.1:{silent.getsockname()[1]}"
    queued = [socket.socket() for _ in range(4)]
    for q in queued:
        q.setblocking(False)
        q.connect_ex(silent.getsockname())
    try:
        with ServerThread(pre_app) as p, ServerThread(dec_app) as d:
            for stream in (False, True):
                with ServerThread(build_proxy_app([p.url], [silent_url, d.url])) as px:
                    r = httpx.post(px.url + "/v1/completions", timeout=20,
                                   json={"model": "m", "prompt": [1, 2, 3], "max_tokens": 3, "stream": stream})
                    assert r.status_code == 200, r.text
                    assert ("t2" if stream else "decoded") in r.text
                    down = httpx.get(px.url + "/health").json()["decode"][silent_url]["out_of_rotation_because"]
                    assert "ConnectTimeout" in down or "/health" in down, down
    finally:
        for q in queued:
            q.close()
        silent.close()


def test_proxy_least_loaded():
    from gigadecode.server.proxy_pool import Pool
    pool = Pool("decode", ["http://a", "http://b/", "http://c"])
    a, b, c = pool.servers
    assert [pool.pick().url for _ in range(4)] == ["http://a", "http://b", "http://c", "http://a"]     # idle: spread by requests sent
    a.in_flight, b.in_flight, c.in_flight = 2, 0, 1
    assert pool.pick() is b
    assert pool.pick(exclude=[b]) is c
    assert pool.pick(exclude=[a, b, c]) is None
    pool.mark_down(b, "unreachable")                  # out of rotation: the others first, however loaded
    assert pool.pick() is c and pool.pick(exclude=[c]) is a
    pool.mark_down(a, "unreachable")
    pool.mark_down(c, "timed out")
    assert pool.pick() is b                           # every one out: all are tried as before
    pool.mark_up(a)
    assert pool.pick() is a and a.down is None and b.down == "unreachable"


def test_proxy_prefix_affinity():
    """A prompt that starts like an earlier one goes to the prefill server that took the earlier one (its
    prefix cache holds the blocks) while that server is at most AFFINITY_SLACK requests busier than the least
    loaded; past that, or when it is excluded (failed), to the least loaded; prompts shorter than a chunk
    have no keys."""
    from gigadecode.server.proxy_pool import AFFINITY_SLACK, Pool, prefix_keys
    system = {"role": "system", "content": "You are a careful assistant. " * 40}
    turn1 = {"messages": [system, {"role": "user", "content": "first question"}]}
    turn2 = {"messages": turn1["messages"] + [{"role": "assistant", "content": "an answer"},
                                              {"role": "user", "content": "second question"}]}
    other = {"messages": [{"role": "system", "content": "Something else entirely. " * 40}]}
    k1, k2, ko = prefix_keys(turn1), prefix_keys(turn2), prefix_keys(other)
    assert k1 and len(k2) > len(k1) and k2[:len(k1) - 1] == k1[:len(k1) - 1] and not set(ko) & set(k1)
    assert prefix_keys({"prompt": "short"}) == [] and prefix_keys({"prompt": list(range(400))})
    pool = Pool("prefill", ["http://a", "http://b"])
    a, b = pool.servers
    assert pool.pick(keys=k1) is a
    assert pool.pick(keys=ko) is b                   # another prompt: the least loaded (b, fewer sent)
    a.in_flight = AFFINITY_SLACK
    assert pool.pick(keys=k2) is a                   # busier, but it holds turn 1
    a.in_flight = AFFINITY_SLACK + 1
    assert pool.pick(keys=k2) is b                   # too busy: the least loaded, which now owns the keys
    a.in_flight = 0
    assert pool.pick(keys=k2) is b and pool.pick(exclude=[b], keys=k2) is a


def test_proxy_passthrough_with_real_server(server):
    """One `--role both` server as prefill and decode: /v1/models and /health pass through. A both-role
    engine has no KV connector, so it refuses the prefill leg (`kv_transfer_params`) with a 400 naming the
    field, and the proxy answers the client that 400 as it is, without asking the decode leg."""
    headers = {"Authorization": f"Bearer {KEY}"}
    proxy = build_proxy_app([server], [server])
    body = {"model": "tiny_mxfp4", "prompt": [1, 2, 3, 4], "max_tokens": 4, "temperature": 0}
    direct = httpx.post(server + "/v1/completions", headers=headers, timeout=30,
                        json={**body, "max_tokens": 1, "stream": False, "kv_transfer_params": {"do_remote_decode": True}})
    with ServerThread(proxy) as px, httpx.Client(base_url=px.url, headers=headers, timeout=30) as hc:
        assert hc.get("/v1/models").json()["data"][0]["id"] == "tiny_mxfp4"
        t0 = time.monotonic()
        while (h := hc.get("/health")).status_code != 200:    # 503 until the proxy's probe has asked the server
            assert time.monotonic() - t0 < 5 and "has answered its /health" in h.text, h.text
            time.sleep(0.05)
        assert direct.status_code == 400, direct.text
        err = direct.json()["error"]
        assert err["param"] == "kv_transfer_params" and "no KV connector" in err["message"], err
        before = metrics(server).get('gigadecode_requests_total{finish_reason="length"}', 0.0)
        r = hc.post("/v1/completions", json=body)
        assert r.status_code == 400 and r.json() == direct.json()
        assert metrics(server).get('gigadecode_requests_total{finish_reason="length"}', 0.0) == before  # no decode
        assert hc.post("/v1/completions", json=body, headers={"Authorization": "Bearer nope"}).status_code == 401
    wait_idle(server)


def test_engine_start_ends_the_loading_threads_openmp_pool():
    # serve loads the model on its main thread, which keeps an OpenMP pool; with more pooled workers than
    # cores libgomp throttles every worker's spin (decode steps ~1.35x slower on 2 cores), so starting the
    # engine thread ends the calling thread's pool: its worker threads exit
    import torch
    got = {}

    def tasks() -> set[str]:
        return set(os.listdir("/proc/self/task"))

    def loader():
        torch.randn(1 << 22).exp_()                  # a parallel region on this thread: its pool of 2 - 1 workers
        before = tasks()
        aeng = AsyncEngine(FakeEngine())
        aeng.start()
        got["ended"] = before - tasks()
        aeng.stop()

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        t = threading.Thread(target=loader)
        t.start()
        t.join()
    finally:
        torch.set_num_threads(threads)
    assert len(got["ended"]) >= 1


def test_a_prefill_whose_client_left_releases_its_lease():
    # the router left (client gone) while the prefill ran: when the answer can no longer be delivered, the
    # prefill server ends the request's lease itself (nobody holds the params to read those blocks)
    class Producer(FakeEngine):
        def __init__(self) -> None:
            super().__init__()
            self.released: list[str] = []

        def release_lease(self, rid: str) -> bool:   # LLMEngine's: end the lease of one of its requests
            self.released.append(rid)
            return True

        def step(self):                              # the prefill never finishes while the client waits
            self.steps += 1
            return []

        def has_unfinished(self):
            return False

    fake = Producer()
    app = build_app(AsyncEngine(fake), "fake", role="prefill")
    with ServerThread(app) as srv:
        with pytest.raises(httpx.TimeoutException):
            httpx.post(srv.url + "/v1/completions", timeout=0.5, json={
                "prompt": [1, 2, 3], "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
        t0 = time.monotonic()
        while not fake.released and time.monotonic() - t0 < 5:
            time.sleep(0.05)
    assert fake.released == list(fake.requests)


def test_a_prefill_that_ends_after_its_client_left_releases_its_lease(monkeypatch):
    # the router left while the prefill ran, and the prefill ended before the server next looked for its
    # client (every DISCONNECT_POLL_S): the answer goes nowhere, so the server still ends the lease itself.
    # It used to hold the blocks until the lease ran out (a short prompt's prefill fits the 0.2 s between looks)
    import gigadecode.server.disconnect as disconnect
    monkeypatch.setattr(disconnect, "DISCONNECT_POLL_S", 5.0)     # the next look comes long after the end
    left = threading.Event()

    class Producer(FakeEngine):
        def __init__(self) -> None:
            super().__init__()
            self.released: list[str] = []

        def release_lease(self, rid: str) -> bool:
            self.released.append(rid)
            return True

        def step(self):                              # the prefill ends 0.3 s after its client left
            self.steps += 1
            return super().step() if left.is_set() and time.monotonic() - left.t > 0.3 else []

    fake = Producer()
    app = build_app(AsyncEngine(fake), "fake", role="prefill")
    with ServerThread(app) as srv:
        body = json.dumps({"prompt": [1, 2, 3], "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
        client = socket.create_connection(("127.0.0.1", int(srv.url.rsplit(":", 1)[1])))
        client.sendall(f"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                       f"content-length: {len(body)}\r\n\r\n{body}".encode())
        t0 = time.monotonic()
        while not fake.requests:
            assert time.monotonic() - t0 < 10
            time.sleep(0.01)
        (req,) = fake.requests.values()
        client.close()                               # the client leaves while its prefill runs
        left.t = time.monotonic()
        left.set()
        while not fake.released and time.monotonic() - left.t < 3:     # before the next look for the client
            time.sleep(0.05)
    assert req.finished and fake.released == [req.request_id]
