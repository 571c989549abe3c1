"""Requests never affect each other's tokens: `gigadecode serve` (and, slow, the DI proxy in front of a prefill and
a decode server) under a concurrent mixed load (tests/isolation_load.py: greedy and seeded completions and chats
over shared prefixes, logprobs, stop strings, token masks, guided JSON, n > 1, echo and prompt logprobs,
priorities, streamed or not, with malformed bodies and clients that leave) in a KV pool small enough to preempt,
with prefix caching, n-gram drafts and chunked prefill, gives every request what it gets alone; afterwards the
server is healthy and idle, holds no KV block, logged no traceback and still answers right. Also: a client that
leaves before its body is read is no server error, on the server and on the proxy."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from gigadecode.cli import build_parser
from gigadecode.ports import free_port
from gigadecode.server.api import build_app, engine_from_args
from gigadecode.server.async_engine import AsyncEngine
from gigadecode.server.proxy import build_proxy_app
from gigadecode.tokenizer import TextCodec

from .helpers import stop_process_tree
from .isolation_load import compare, load, make_requests, record, run
from .test_server import ServerThread, fake_upstream, metrics, wait_health, wait_idle

MODEL = "tiny"
# fp32 compute and KV; at most 128 tokens a request; 19 blocks of 16 tokens hold ~2 of them with their sliding blocks
TIGHT = ["--served-model-name", MODEL, "--dtype", "float32", "--kv-dtype", "auto", "--max-model-len", "128",
         "--enable-prefix-caching", "--scheduling-policy", "priority",
         "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}']
POOLS = {16: ["--block-size", "16", "--num-blocks", "20", "--max-num-seqs", "6", "--max-prefill-tokens", "24"],
         3: ["--block-size", "3", "--num-blocks", "60", "--max-num-seqs", "4", "--max-prefill-tokens", "16"],
         1: ["--block-size", "1", "--num-blocks", "170", "--max-num-seqs", "8", "--max-prefill-tokens", "7"]}


def start(args: list[str], log: Path) -> subprocess.Popen:
    """`gigadecode ARGS` (one thread) logging to a file, not a pipe: a server that logs a lot never blocks."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GIGADECODE_API_KEY": ""}
    with open(log, "wb") as f:
        return subprocess.Popen([sys.executable, "-m", "gigadecode", *args, "--log-level", "warning"], env=env,
                                stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def token_text(tiny_ckpt):
    codec = TextCodec.from_dir(tiny_ckpt)
    return lambda t: codec.decode([t], skip_special_tokens=False)


def check_isolation(urls: dict[str, str], ref_url: str, logs: list[Path], token_text, seed: int, count: int,
                    di: bool) -> None:
    """References on `ref_url` (each request alone), then the load on urls["api"]; every answer against its
    reference, and the engines (urls' others) idle, healthy, with preemptions, drafts and prefix hits counted."""
    reqs = make_requests(seed, count, MODEL, priority=True, di=di)
    refs = asyncio.run(record(ref_url, reqs))
    assert sum("error" not in r for r in refs) >= 0.9 * count, [r for r in refs if "error" in r]
    answers, problems = asyncio.run(load(urls["api"], reqs, clients=16, noise=count // 3, seed=seed, model=MODEL))
    for i, (req, got, want) in enumerate(zip(reqs, answers, refs)):
        problems += [f"request {i} ({req['kind']}, stream {req['stream']}, {req['body']}): {p}"
                     for p in compare(req, got, want, token_text, lp_tol=1e-4)]
    engines = [u for k, u in urls.items() if k != "api"]
    for url in engines:
        m = wait_idle(url, timeout=30)
        assert m["gigadecode_kv_leases"] == 0 and httpx.get(url + "/health").status_code == 200
    decode = metrics(engines[-1])          # the one that decodes: the server, or DI's decode server
    assert decode["gigadecode_num_preemptions_total"] > 0 and decode["gigadecode_spec_decode_num_drafts_total"] > 0
    assert metrics(engines[0])["gigadecode_prefix_cache_hits_total"] > 0
    final = next(i for i, (r, w) in enumerate(zip(reqs, refs)) if not r["seeded"] and "error" not in w)
    problems += [f"after the load: {p}" for p in compare(reqs[final], asyncio.run(_one(urls["api"], reqs[final])),
                                                         refs[final], token_text, lp_tol=1e-4)]
    problems += [f"{log.name}: traceback" for log in logs if "Traceback" in log.read_text(errors="replace")]
    assert not problems, f"{len(problems)} problem(s):\n" + "\n".join(problems[:20])


async def _one(url: str, req: dict) -> dict:
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60) as client:
        return await run(client, req)


def _serve(ckpt, flags: list[str], role: str, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    return start(["serve", "--model", str(ckpt), "--role", role, "--port", str(port), *flags], log), \
        f"http://127.0.0.1:{port}"


def test_mixed_load_gives_every_request_its_tokens_alone(tiny_ckpt, tmp_path, token_text):
    """Single node, blocks of 16 in a 19-block pool: the references are recorded on the same server first, one
    request at a time, then all of them again from 16 clients at once among malformed and abandoned ones."""
    proc, url = _serve(tiny_ckpt, TIGHT + POOLS[16], "both", tmp_path / "server.log")
    try:
        wait_health(url, proc, timeout=120)
        check_isolation({"api": url, "server": url}, url, [tmp_path / "server.log"], token_text, seed=0, count=70,
                        di=False)
    finally:
        stop_process_tree(proc)


@pytest.mark.slow
@pytest.mark.parametrize("block_size", [1, 3])
def test_mixed_load_with_small_blocks(tiny_ckpt, tmp_path, token_text, block_size):
    proc, url = _serve(tiny_ckpt, TIGHT + POOLS[block_size], "both", tmp_path / "server.log")
    try:
        wait_health(url, proc, timeout=120)
        check_isolation({"api": url, "server": url}, url, [tmp_path / "server.log"], token_text, seed=block_size,
                        count=150, di=False)
    finally:
        stop_process_tree(proc)


@pytest.mark.slow
@pytest.mark.parametrize("block_size", [16, 3])
def test_mixed_load_through_the_di_proxy(tiny_ckpt, tmp_path, token_text, block_size):
    """The same through `proxy` in front of a prefill and a decode server (both with the tight pool); the
    references from a single node with the same flags (DI gives its tokens in fp32)."""
    flags = TIGHT + POOLS[block_size]
    procs, urls = [], {}
    try:
        for role in ("both", "prefill", "decode"):
            p, urls[role] = _serve(tiny_ckpt, flags + (["--kv-lease-s", "10"] if role == "prefill" else []), role,
                                   tmp_path / f"{role}.log")
            procs.append(p)
        port = free_port()
        procs.append(start(["proxy", "--prefill", urls["prefill"], "--decode", urls["decode"], "--port", str(port)],
                           tmp_path / "proxy.log"))
        urls["api"] = f"http://127.0.0.1:{port}"
        for p, role in zip(procs, ("both", "prefill", "decode", "api")):
            wait_health(urls[role], p, timeout=180)
        ref = urls.pop("both")
        check_isolation(urls, ref, [tmp_path / f"{n}.log" for n in ("both", "prefill", "decode", "proxy")],
                        token_text, seed=10 + block_size, count=150, di=True)
    finally:
        for p in procs:
            stop_process_tree(p)


# --------------------------------------------------------------------------------------------------
# A client gone before its body was read
# --------------------------------------------------------------------------------------------------
class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.seen: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.seen.append(f"{record.name}: {record.getMessage()}")


def _leave_mid_body(url: str, path: str) -> None:
    """Headers promising 100 bytes of body, 12 of them, then the client goes."""
    host, port = url.rsplit("/", 1)[1].split(":")
    with socket.create_connection((host, int(port))) as s:
        s.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                  f"Content-Length: 100\r\n\r\n{{\"prompt\": [".encode())
        time.sleep(0.1)


@pytest.mark.parametrize("which", ["server", "proxy"])
def test_a_client_gone_before_its_body_was_read_is_no_server_error(tiny_ckpt, which):
    """Its route finds the body cut off (starlette's ClientDisconnect): that was logged as an unhandled error with
    two tracebacks (a 500 for nobody), on the API server and on the proxy alike. Now it is answered 499 quietly
    and the next request is served."""
    upstream = ServerThread(fake_upstream("up", "decode")[0])    # healthy, never sent a request: the proxy's
    if which == "server":                                          # health probe has nothing to warn of
        args = build_parser().parse_args(["serve", "--model", str(tiny_ckpt), "--num-blocks", "64"])
        app = build_app(AsyncEngine(engine_from_args(args, "both")), MODEL)
        paths = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/tokenize")
    else:
        app = build_proxy_app([upstream.url], [upstream.url])
        paths = ("/v1/completions", "/v1/chat/completions", "/v1/responses")
    records = _Records()
    loggers = [logging.getLogger(n) for n in ("uvicorn.error", "gigadecode.server", "gigadecode.proxy")]
    try:
        with upstream, ServerThread(app) as srv:
            for lg in loggers:                 # after uvicorn's start: its logging config drops earlier handlers
                lg.addHandler(records)
            for path in paths:
                _leave_mid_body(srv.url, path)
            time.sleep(0.5)
            r = httpx.post(srv.url + "/v1/completions", content=b'{"prompt": [', timeout=10,
                           headers={"content-type": "application/json"})
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"   # served as ever
    finally:
        for lg in loggers:
            lg.removeHandler(records)
    assert not records.seen, records.seen
