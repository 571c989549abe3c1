"""`torchrun --nproc-per-node 4 -m gigadecode serve --tp 2 --dp 2 --ep 4`: the OpenAI server in front of the
parallel engine, driven with the official `openai` client. Greedy and seeded outputs (completions and
chat, streamed and not, concurrent) equal the single-rank engine's; a cancelled stream and a bad request
leave the server serving and no KV block in use; SIGTERM stops every rank."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest

from gigadecode.cli import build_parser
from gigadecode.sampling import SamplingParams
from gigadecode.server.api import build_engine

from .helpers import random_prompt
from .test_server import free_port, metrics, wait_health

MODEL = "tiny"
FLAGS = ["--served-model-name", MODEL, "--num-blocks", "256", "--block-size", "4", "--kv-dtype", "fp8"]


@pytest.fixture(scope="module")
def server(tiny_ckpt):
    port, master = free_port(), free_port()
    torchrun = Path(sys.executable).with_name("torchrun")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GIGADECODE_API_KEY": ""}
    proc = subprocess.Popen([str(torchrun), "--nproc-per-node", "4", "--master-port", str(master), "-m", "gigadecode",
                             "serve", "--model", str(tiny_ckpt), "--role", "both", "--port", str(port), "--tp", "2",
                             "--dp", "2", "--ep", "4", "--log-level", "warning", *FLAGS],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_health(url, proc, timeout=180)
        yield url, proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


@pytest.fixture(scope="module")
def single(tiny_ckpt):
    return build_engine(build_parser().parse_args(["serve", "--model", str(tiny_ckpt), *FLAGS]), "both")


def _want(engine, prompt, **kw):
    return engine.generate([prompt], SamplingParams(**kw))[0].output_ids


def test_parallel_server_equals_single_rank(server, single, tiny_ckpt):
    url, _ = server
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
    extra = {"ignore_eos": True, "return_token_ids": True}
    for n in (1, 6, 19):
        prompt = random_prompt(n, 1024, seed=900 + n)
        want = _want(single, prompt, temperature=0.0, max_tokens=10, ignore_eos=True)
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0.0, extra_body=extra)
        assert r.choices[0].model_extra["token_ids"] == want, n
        got = []
        for ch in client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0.0, stream=True,
                                            extra_body=extra):
            got += (ch.choices[0].model_extra or {}).get("token_ids") or []
        assert got == want, n
    prompt = random_prompt(9, 1024, seed=1)
    want = _want(single, prompt, temperature=0.9, top_p=0.95, seed=42, max_tokens=8, ignore_eos=True)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0.9, top_p=0.95, seed=42,
                                  extra_body=extra)
    assert r.choices[0].model_extra["token_ids"] == want

    from gigadecode.tokenizer import TextCodec
    msgs = [{"role": "user", "content": "Which ranks hold the experts?"}]
    want = _want(single, TextCodec.from_dir(tiny_ckpt).apply_chat_template(msgs), temperature=0.0, max_tokens=8,
                 ignore_eos=True)
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0.0, extra_body=extra)
    assert r.choices[0].model_extra["token_ids"] == want

    with pytest.raises(openai.BadRequestError):                  # too long: refused, the server keeps serving
        client.completions.create(model=MODEL, prompt=[1] * 5000, max_tokens=2)


def test_parallel_server_concurrent_streams_and_cancellation(server, single):
    url, _ = server
    prompts = [random_prompt(3 + (i * 5) % 25, 1024, seed=50 + i) for i in range(12)]
    want = {i: _want(single, p, temperature=0.0, max_tokens=6, ignore_eos=True)
            for i, p in enumerate(prompts) if i % 3}

    async def one(client, i, p):
        stream = await client.completions.create(model=MODEL, prompt=p, max_tokens=6 if i % 3 else 300,
                                                 temperature=0.0, stream=True,
                                                 extra_body={"ignore_eos": True, "return_token_ids": True})
        got = []
        async for ch in stream:
            got += (ch.choices[0].model_extra or {}).get("token_ids") or []
            if i % 3 == 0 and len(got) >= 2:
                await stream.close()                 # the client goes away mid-stream
                return i, None
        return i, got

    async def main():
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120) as c:
            return await asyncio.gather(*(one(c, i, p) for i, p in enumerate(prompts)))

    for i, got in asyncio.run(main()):
        if i % 3:
            assert got == want[i], i
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        m = metrics(url)
        if m["gigadecode_kv_blocks_used"] == 0 and m["gigadecode_requests_running"] == 0:
            break
        time.sleep(0.2)
    assert m["gigadecode_kv_blocks_used"] == 0 and m["gigadecode_requests_running"] == 0
    assert m["gigadecode_kv_blocks_total"] == 2 * 255              # two DP groups, a pool each


def test_parallel_server_stops_every_rank_on_sigterm(server):
    _, proc = server
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) is not None
    out = proc.stdout.read()
    # every rank left cleanly (torchrun's own agent still reports the signal it got, with a traceback)
    assert "[rank" not in out and "engine.step() failed" not in out, out[-3000:]
