"""API fuzzing: a bounded property-based run of `/v1/completions` and `/v1/chat/completions` against real
servers (`gigadecode serve --role both`, and a DI pair `--role prefill` / `--role decode`, subprocesses on
loopback, the tiny checkpoint).

Inputs (hypothesis, derandomized, ~100 per endpoint per server):
- bodies drawn from the request schema: the body schema the route declares in FastAPI's `/openapi.json`
  when it declares one, otherwise the pydantic body models of `gigadecode.server.api` (`CompletionBody`,
  `ChatBody`: `model_json_schema()` through `hypothesis_jsonschema.from_schema`);
- well-formed bodies with known fields replaced by wrong types (strings for ints, huge / negative ints,
  NaN / inf, nested garbage), garbage or near-valid DI `kv_transfer_params` (including mutations of a real
  prefill answer), missing required fields;
- raw bodies: NaN / Infinity / 1e999 as JSON text, ints of thousands of digits, non-object JSON, invalid
  UTF-8, deeply nested arrays and objects, truncated JSON, empty bodies.
A valid `max_tokens` is capped to <= 4 (and chat bodies always carry one) so generation stays fast.
DI params never point anywhere but loopback: every `remote_host` is rewritten to 127.0.0.1 (or a harmless
non-address) and every in-range `remote_port` to the prefill server's side channel or a closed port.

Property, per example: the status is < 500; a status >= 400 carries a JSON body with an `error` object; a
200 is strict JSON (no NaN / Infinity), or for a stream, SSE events that are JSON, no in-band
`server_error` event, ending with `data: [DONE]`; no request hangs (30 s). Every violation is collected
(smallest body per distinct failure) and reported at the end, not shrunk, so one run stays bounded.
After the run each server is still healthy, answers a greedy completion as it did before, logged no
traceback, counted no engine step failure, and goes idle with `gigadecode_kv_blocks_used` 0 (the prefill
server's leases are 2 s here, so leased KV expires quickly).

`test_proxy_explicit_cases` checks the same property through `gigadecode proxy` for the fixed raw cases;
`test_max_tokens_up_to_the_context_finishes` asks for prompt + max_tokens == the context, which must be
answered (or refused), not left waiting; `test_soak` (-m slow) runs bench/soak.py for 20 s and expects
its exit code 0.
"""

from __future__ import annotations

import copy
import json
import os
import re
import secrets
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st
from hypothesis_jsonschema import from_schema

from .helpers import stop_process_tree
from .test_server import free_port, metrics

ROOT = Path(__file__).resolve().parents[1]
MODEL = "tiny"
# 63 usable blocks of 16 (a context of ~500 tokens once the sliding window and a prefill chunk are counted),
# so prompts and max_tokens can reach its limit
FLAGS = ["--served-model-name", MODEL, "--dtype", "float32", "--num-blocks", "64", "--block-size", "16", "--kv-dtype", "fp8",
         "--max-num-seqs", "16", "--log-level", "warning"]
ROLE_FLAGS = {"both": [], "prefill": ["--kv-lease-s", "2"], "decode": ["--kv-transfer-timeout-s", "3"]}
KV_SECRET = secrets.token_hex(16)        # the DI pair's shared key (GIGADECODE_KV_SECRET)
PATHS = ("/v1/completions", "/v1/chat/completions")
EXAMPLES = 100                           # per endpoint per server
MAX_VALID_TOKENS = 4
REQUEST_TIMEOUT_S = 30.0
BASE_PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]
VOCAB = 1024                             # the tiny preset's vocabulary (ids >= it are out of range)


# --------------------------------------------------------------------------------------------------
# Servers
# --------------------------------------------------------------------------------------------------
@dataclass
class Server:
    role: str
    url: str
    proc: subprocess.Popen
    log: Path
    baseline: list[int] | None = None            # greedy tokens of BASE_PROMPT before the fuzz run
    notes: list[str] = field(default_factory=list)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-n:])


def _start(role: str, model_dir: Path, log_dir: Path) -> Server:
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GIGADECODE_API_KEY": ""}
    if role != "both":
        env["GIGADECODE_KV_SECRET"] = KV_SECRET
    log = log_dir / f"{role}.log"
    cmd = [sys.executable, "-m", "gigadecode", "serve", "--model", str(model_dir), "--role", role,
           "--port", str(port), *FLAGS, *ROLE_FLAGS[role]]
    with open(log, "wb") as f:           # a file, not a pipe: a server logging tracebacks must never block
        proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    return Server(role, f"http://127.0.0.1:{port}", proc, log)


def _wait_up(s: Server, timeout: float = 180.0) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if s.proc.poll() is not None:
            raise RuntimeError(f"{s.role} server exited with {s.proc.returncode}:\n{s.tail()}")
        try:
            if httpx.get(s.url + "/health", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{s.role} server {s.url} not healthy in {timeout}s:\n{s.tail()}")


def greedy_ids(url: str, prompt: list[int], n: int, kv: dict | None = None, timeout: float = 60.0
               ) -> tuple[list[int], dict]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    if kv is not None:
        body["kv_transfer_params"] = kv
    r = httpx.post(url + "/v1/completions", json=body, timeout=timeout)
    assert r.status_code == 200, (url, r.status_code, r.text[:500])
    j = r.json()
    return j["choices"][0]["token_ids"], j


def wait_idle(url: str, timeout: float = 30.0) -> dict[str, float]:
    """/metrics once nothing runs or waits and no KV block is held (AssertionError after `timeout`)."""
    t0 = time.monotonic()
    while True:
        m = metrics(url)
        if m.get("gigadecode_kv_blocks_used") == 0 and m.get("gigadecode_requests_running") == 0 \
                and m.get("gigadecode_requests_waiting") == 0:
            return m
        if time.monotonic() - t0 > timeout:
            keys = ("gigadecode_kv_blocks_used", "gigadecode_requests_running", "gigadecode_requests_waiting")
            raise AssertionError(f"{url} not idle after {timeout}s: {({k: m.get(k) for k in keys})}")
        time.sleep(0.1)


@pytest.fixture(scope="module")
def servers(tiny_ckpt, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("fuzz_logs")
    started: dict[str, Server] = {}
    try:
        for role in ("both", "prefill", "decode"):
            started[role] = _start(role, tiny_ckpt, log_dir)
        for s in started.values():
            _wait_up(s)
        for s in started.values():
            s.baseline = greedy_ids(s.url, BASE_PROMPT, MAX_VALID_TOKENS)[0]
        yield started
    finally:
        for s in started.values():
            stop_process_tree(s.proc)


@pytest.fixture(scope="module")
def kv_seed(servers) -> dict[str, Any]:
    """A real prefill answer for BASE_PROMPT (the DI path checked once: decode from it equals `both`), whose
    fields the fuzzer mutates, and the prefill side channel's port."""
    pre, dec = servers["prefill"], servers["decode"]
    _, j = greedy_ids(pre.url, BASE_PROMPT, 1, kv={"do_remote_decode": True})
    kv = j.get("kv_transfer_params")
    assert isinstance(kv, dict) and kv, f"the prefill server answered no kv_transfer_params: {j}"
    got, _ = greedy_ids(dec.url, BASE_PROMPT, MAX_VALID_TOKENS, kv=kv)
    assert got == servers["both"].baseline, (got, servers["both"].baseline)
    port = kv.get("remote_port")
    return {"params": kv, "side_port": port if isinstance(port, int) else None, "closed_port": free_port()}


# --------------------------------------------------------------------------------------------------
# Strategies
# --------------------------------------------------------------------------------------------------
def body_schema(url: str, path: str) -> tuple[dict[str, Any], str]:
    """(JSON schema of the route's body, where it came from): the OpenAPI document's requestBody when the
    route declares one, else the pydantic model in gigadecode.server.protocol."""
    doc = httpx.get(url + "/openapi.json", timeout=10).json()
    rb = doc.get("paths", {}).get(path, {}).get("post", {}).get("requestBody")
    schema = (rb or {}).get("content", {}).get("application/json", {}).get("schema")
    if schema:
        return {**schema, "components": doc.get("components", {})}, "openapi"
    from gigadecode.server import protocol
    model = getattr(protocol, "CompletionBody" if path.endswith("/completions") and "chat" not in path else "ChatBody")
    return model.model_json_schema(), f"pydantic {model.__name__}"


COMMON_FIELDS = ["model", "stream", "stream_options", "n", "stop", "return_token_ids", "kv_transfer_params",
                 "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "min_tokens", "ignore_eos",
                 "stop_token_ids", "repetition_penalty", "presence_penalty", "frequency_penalty", "logprobs",
                 "user", "logit_bias"]
FIELDS = {"/v1/completions": COMMON_FIELDS + ["prompt", "echo", "suffix", "best_of"],
          "/v1/chat/completions": COMMON_FIELDS + ["messages", "top_logprobs", "add_generation_prompt",
                                                   "max_completion_tokens", "tools", "tool_choice",
                                                   "reasoning_effort", "include_reasoning"]}
NUMERIC_FIELDS = ["temperature", "top_p", "min_p", "top_k", "seed", "max_tokens", "min_tokens", "logprobs",
                  "repetition_penalty", "presence_penalty", "frequency_penalty", "n", "best_of", "top_logprobs",
                  "max_completion_tokens"]
KV_KEYS = ["do_remote_decode", "do_remote_prefill", "remote_engine_id", "remote_host", "remote_port",
           "remote_request_id", "remote_block_ids", "remote_first_block", "num_computed_tokens", "lease_expires",
           "kv_crc32", "kv_head_start", "kv_crc32_heads", "remote_ranks"]

HUGE = st.sampled_from([2**31 - 1, 2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64, 2**64 + 1, 10**30, -1, -2,
                        -2**31, -2**63 - 1, -10**30, 0])
LEAF = st.one_of(st.none(), st.booleans(), st.integers(), HUGE, st.floats(allow_nan=True, allow_infinity=True),
                 st.text(max_size=12))
JSON_ANY = st.recursive(LEAF, lambda c: st.one_of(st.lists(c, max_size=4),
                                                  st.dictionaries(st.text(max_size=8), c, max_size=4)),
                        max_leaves=10)
WRONG = st.one_of(HUGE, st.text(max_size=12), st.sampled_from(["1", "0.5", "", "null", "true", "NaN"]),
                  st.floats(allow_nan=True, allow_infinity=True), st.booleans(), st.none(),
                  st.integers(-10, 10), st.just([]), st.just({}), JSON_ANY)
TOKEN_IDS = st.lists(st.integers(3, VOCAB - 1), min_size=1, max_size=24)


def valid_body(path: str) -> st.SearchStrategy[dict]:
    common = {"max_tokens": st.integers(1, MAX_VALID_TOKENS)}
    optional = {"model": st.just(MODEL), "temperature": st.sampled_from([0, 0.0, 0.5, 1.0, 2]),
                "stream": st.booleans(), "ignore_eos": st.booleans(), "return_token_ids": st.booleans(),
                "seed": st.integers(0, 2**32), "top_k": st.sampled_from([-1, 0, 1, 5]),
                "top_p": st.sampled_from([0.1, 0.9, 1.0]), "stop_token_ids": st.lists(st.integers(0, VOCAB - 1),
                                                                                       max_size=3),
                "stream_options": st.just({"include_usage": True})}
    if "chat" in path:
        msg = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "developer"]),
                                     "content": st.one_of(st.text(max_size=40), st.just(
                                         [{"type": "text", "text": "hello"}]))})
        return st.fixed_dictionaries({"messages": st.lists(msg, min_size=1, max_size=3), **common},
                                     optional={**optional, "logprobs": st.booleans(),
                                               "top_logprobs": st.integers(0, 3)})
    prompt = st.one_of(st.text(min_size=1, max_size=60), TOKEN_IDS, st.lists(TOKEN_IDS, min_size=1, max_size=3))
    return st.fixed_dictionaries({"prompt": prompt, **common},
                                 optional={**optional, "logprobs": st.integers(0, 3)})


def kv_garbage(seed: dict[str, Any]) -> st.SearchStrategy[Any]:
    real = seed["params"]
    ports = [p for p in (seed["side_port"], seed["closed_port"]) if p]
    plausible = {
        "do_remote_decode": st.booleans(), "do_remote_prefill": st.booleans(),
        "remote_engine_id": st.one_of(st.text(max_size=12), st.just(real.get("remote_engine_id", "x"))),
        "remote_host": st.just("127.0.0.1"),
        "remote_port": st.one_of(st.sampled_from(ports), st.sampled_from([0, -1, 65536, 2**40])),
        "remote_request_id": st.one_of(st.text(max_size=12), st.just(real.get("remote_request_id", "x"))),
        "remote_block_ids": st.lists(st.lists(st.integers(-2, 200), max_size=6), max_size=3),
        "remote_first_block": st.lists(st.integers(-2, 8), max_size=3),
        "num_computed_tokens": st.integers(-1, 30),
        "lease_expires": st.one_of(st.floats(allow_nan=True, allow_infinity=True),
                                   st.just(time.time() + 3600)),
        "kv_crc32": st.one_of(st.integers(-1, 2**33), st.just(real.get("kv_crc32", 0))),
        "kv_head_start": st.integers(-1, 8),
        "kv_crc32_heads": st.lists(st.integers(-1, 2**32), max_size=4),
    }
    field_value = {k: st.one_of(v, WRONG) for k, v in plausible.items()}
    structured = st.fixed_dictionaries({"do_remote_prefill": st.one_of(st.just(True), WRONG)},
                                       optional={k: v for k, v in field_value.items() if k != "do_remote_prefill"})
    ranks = structured.map(lambda d: {**d, "remote_ranks": [dict(d)]})
    mutated_real = st.lists(st.tuples(st.sampled_from(sorted(set(real) | set(KV_KEYS))), WRONG),
                            min_size=1, max_size=2).map(lambda kvs: {**real, **dict(kvs)})
    dropped_real = st.sampled_from(sorted(real)).map(lambda k: {x: v for x, v in real.items() if x != k})
    return st.one_of(JSON_ANY, structured, ranks, mutated_real, dropped_real,
                     st.just({"do_remote_decode": True}), st.just({"do_remote_prefill": True}))


def mutated_body(path: str, seed: dict[str, Any]) -> st.SearchStrategy[dict]:
    fields = FIELDS[path]
    swap = st.tuples(st.sampled_from(fields), WRONG)
    kv = st.tuples(st.just("kv_transfer_params"), kv_garbage(seed))
    required = "messages" if "chat" in path else "prompt"

    def apply(args):
        body, swaps, drop = args
        body = dict(body)
        for k, v in swaps:
            body[k] = v
        if drop:
            body.pop(required, None)
        return body
    return st.tuples(valid_body(path), st.lists(st.one_of(swap, kv), min_size=1, max_size=3),
                     st.integers(0, 19).map(lambda k: k == 0)).map(apply)


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, allow_nan=True).encode()        # ensure_ascii: lone surrogates become \udXXX


def raw_body(path: str) -> st.SearchStrategy[bytes]:
    base = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2} if "chat" in path else \
        {"prompt": [5, 6, 7], "max_tokens": 2}
    head = _dumps(base)[:-1]                      # the object without its closing brace

    nonfinite = st.tuples(st.sampled_from(NUMERIC_FIELDS),
                          st.sampled_from(["NaN", "Infinity", "-Infinity", "1e999", "-1e999", "1e-999", "-0",
                                           "1E400", "0.0000000000000000001", "4.0", "1" * 5000, "-" + "9" * 5000])
                          ).map(lambda t: head + f', "{t[0]}": {t[1]}}}'.encode())
    nest_value = st.sampled_from(["prompt", "messages", "kv_transfer_params", "stop_token_ids", "stream_options"])
    depth = st.sampled_from([32, 256, 1000, 5000, 100_000])
    deep_arrays = depth.map(lambda d: b"[" * d + b"]" * d)
    deep_field = st.tuples(nest_value, depth, st.booleans()).map(
        lambda t: head + f', "{t[0]}": '.encode() + (b"[" * t[1] + b"1" + b"]" * t[1] if t[2] else
                                                      b'{"a":' * t[1] + b"1" + b"}" * t[1]) + b"}")
    bad_utf8 = st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80", b"\x80", b"\xfe\xff",
                                b"\xc0\xaf"])
    in_string = bad_utf8.map(lambda b: (b'{"prompt": "ab' + b + b'cd", "max_tokens": 2}') if "chat" not in path else
                             (b'{"messages": [{"role": "user", "content": "ab' + b + b'"}], "max_tokens": 2}'))
    escapes = st.sampled_from(["\\ud800", "\\udfff", "\\u0000", "\\ud83d\\ude00", "\\uffff", "\\ufffe"]).map(
        lambda e: (f'{{"prompt": "x{e}y", "max_tokens": 2}}' if "chat" not in path else
                   f'{{"messages": [{{"role": "user", "content": "x{e}y"}}], "max_tokens": 2}}').encode())
    role_escape = st.sampled_from(["\\ud800", "\\u0000"]).map(
        lambda e: f'{{"messages": [{{"role": "us{e}er", "content": "hi"}}], "max_tokens": 2}}'.encode())
    full = _dumps(base)
    misc = st.sampled_from([b"", b"null", b"{", b"}", b"[]", b"{}", b'"x"', b"1", b"true", full[:-1], full[: len(full) // 2],
                            b"\xef\xbb\xbf" + full, full.decode().encode("utf-16"), full + b"garbage",
                            full[:-1] + b', "max_tokens": 3, "max_tokens": "x"}', b" " * 1000 + full,
                            b'{"' + b"k" * 100_000 + b'": 1}'])
    non_object = JSON_ANY.filter(lambda x: not isinstance(x, dict)).map(_dumps)
    return st.one_of(nonfinite, deep_arrays, deep_field, in_string, escapes, role_escape, misc, non_object,
                     st.binary(max_size=64))


def _cap(v: Any) -> Any:
    """A valid-looking int max_tokens/min_tokens above the cap -> small; huge ints (>= 2**31) and wrong types stay."""
    if isinstance(v, int) and not isinstance(v, bool) and MAX_VALID_TOKENS < v < 2**31:
        return v % MAX_VALID_TOKENS + 1
    return v


SAFE_HOSTS = ("127.0.0.1", "localhost", "", None, True, False, [], {})


def _loopback_only(obj: Any, ports: list[int]) -> Any:
    """Rewrite every remote_host / remote_port so a KV handshake can only go to this machine's loopback: a
    host not in SAFE_HOSTS becomes 127.0.0.1 (ints and floats can spell IP addresses), an in-range port
    becomes the prefill side channel or a closed port."""
    if isinstance(obj, list):
        return [_loopback_only(x, ports) for x in obj]
    if not isinstance(obj, dict):
        return obj
    out = {}
    for k, v in obj.items():
        if k == "remote_host" and not any(v is s or (type(v) is type(s) and v == s) for s in SAFE_HOSTS):
            v = "127.0.0.1"
        elif k == "remote_port" and not isinstance(v, bool) and isinstance(v, (int, float, str)):
            try:
                n = int(float(v))
            except (ValueError, OverflowError):
                n = None
            if n is not None and 0 < n < 65536:
                v = ports[n % len(ports)] if isinstance(v, int) else str(ports[n % len(ports)])
        out[k] = _loopback_only(v, ports)
    return out


def bounded(path: str, body: Any, ports: list[int]) -> Any:
    """Keep a generated body cheap to serve and its DI params on loopback."""
    if not isinstance(body, dict):
        return body
    body = _loopback_only(copy.deepcopy(body), ports)
    for k in ("max_tokens", "max_completion_tokens", "min_tokens"):
        if k in body:
            body[k] = _cap(body[k])
    if "chat" in path and body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = MAX_VALID_TOKENS    # the chat default is the whole context
    return body


def explicit_cases(path: str) -> list[tuple[str, bytes]]:
    """Raw bodies every run sends (hypothesis' explicit phase), on top of the drawn ones: one of each
    deliberately wrong kind."""
    chat = "chat" in path
    ok = (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2' if chat else
          b'{"prompt": [5, 6, 7], "max_tokens": 2')
    field = b'"messages"' if chat else b'"prompt"'
    cases = [ok + b', "temperature": NaN}', ok + b', "top_p": Infinity}', ok + b', "temperature": -Infinity}',
             ok + b', "seed": 1e999}', ok + b', "top_k": ' + b"1" * 5000 + b"}",
             ok + b', "max_tokens": ' + b"9" * 5000 + b"}", ok + b', "max_tokens": 18446744073709551617}',
             ok + b', "max_tokens": -9223372036854775809}', ok + b', "seed": 18446744073709551616}',
             b"[" * 100_000 + b"]" * 100_000, b"{" + field + b": " + b"[" * 50_000 + b"]" * 50_000 + b"}",
             ok + b', "kv_transfer_params": ' + b'{"a":' * 20_000 + b"1" + b"}" * 20_000 + b"}",
             ok + b', "kv_transfer_params": {"do_remote_prefill": true, "remote_block_ids": "x"}}',
             ok + b', "kv_transfer_params": {"do_remote_decode": "yes"}}',
             ok + b', "kv_transfer_params": [1, 2]}', ok + b', "stop_token_ids": [[[[1]]]]}',
             b'{"messages": [{"role": "user", "content": "\xff\xfe"}], "max_tokens": 2}' if chat else
             b'{"prompt": "\xff\xfe", "max_tokens": 2}',
             b'{"prompt": "\\ud800", "max_tokens": 2}', b"[1, 2, 3]", b'"just a string"', b"null", b"", b"\x00\x01",
             ok + b', "stream": true, "max_tokens": "4"}', ok + b', "stream": true, "logprobs": 3, "top_logprobs": 3}',
             ok + b', "n": 2}', ok + b', "min_tokens": 3}']
    if chat:
        cases += [b'{"messages": [], "max_tokens": 2}', b'{"messages": [{"content": "no role"}], "max_tokens": 2}',
                  b'{"messages": [{"role": "user", "content": [{"type": "image_url"}]}], "max_tokens": 2}',
                  b'{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 2}',
                  b'{"messages": "hi", "max_tokens": 2}', b'{"messages": [{"role": "tool", "content": null}], '
                  b'"max_tokens": 2, "max_completion_tokens": null}']
    else:
        cases += [b'{"prompt": [], "max_tokens": 2}', b'{"prompt": [[]], "max_tokens": 2}',
                  b'{"prompt": [1024, -1], "max_tokens": 2}', b'{"prompt": [1.5], "max_tokens": 2}',
                  b'{"prompt": [[5, 6], [7]], "max_tokens": 2, "kv_transfer_params": {"do_remote_decode": true}}',
                  b'{"prompt": "' + b"a " * 20_000 + b'", "max_tokens": 2}']
    return [("explicit", c) for c in cases]


def request_strategy(path: str, schema: dict, seed: dict[str, Any]) -> st.SearchStrategy[tuple[str, bytes]]:
    """(kind, raw body bytes): ~40% schema bodies, ~35% mutated bodies, ~25% raw bytes."""
    ports = [p for p in (seed["side_port"], seed["closed_port"]) if p]
    dicts = {"schema": from_schema(schema), "mutated": mutated_body(path, seed)}

    def pick(k: int):
        if k < 75:
            kind = "schema" if k < 40 else "mutated"
            return dicts[kind].map(lambda b: (kind, _dumps(bounded(path, b, ports))))
        return raw_body(path).map(lambda r: ("raw", r))
    return st.integers(0, 99).flatmap(pick)


# --------------------------------------------------------------------------------------------------
# The property
# --------------------------------------------------------------------------------------------------
def _reject_constant(c: str) -> Any:
    raise ValueError(f"non-standard JSON constant {c}")


def strict_json(text: str | bytes) -> Any:
    return json.loads(text, parse_constant=_reject_constant)


def _show(raw: bytes, limit: int = 400) -> str:
    r = repr(raw)
    return r if len(r) <= limit else f"{r[:250]} …<{len(raw)} bytes>… {r[-100:]}"


def check_one(hc: httpx.Client, path: str, raw: bytes) -> tuple[int | None, str | None]:
    """Send one body -> (status, violation or None)."""
    try:
        wants_stream = json.loads(raw).get("stream") is True
    except Exception:  # noqa: BLE001 - any body that does not parse as an object is not a stream
        wants_stream = False
    t0 = time.monotonic()
    try:
        with hc.stream("POST", path, content=raw, headers={"Content-Type": "application/json"}) as r:
            ctype = r.headers.get("content-type", "")
            if "text/event-stream" not in ctype:
                data = r.read()
                return r.status_code, _check_plain(r.status_code, data)
            events = []
            for line in r.iter_lines():
                if time.monotonic() - t0 > REQUEST_TIMEOUT_S:
                    return r.status_code, f"stream still open after {REQUEST_TIMEOUT_S}s"
                if line.startswith("data: "):
                    events.append(line[6:])
            return r.status_code, _check_stream(r.status_code, events, wants_stream)
    except httpx.TimeoutException as e:
        return None, f"no answer in {REQUEST_TIMEOUT_S}s ({type(e).__name__})"
    except httpx.HTTPError as e:
        return None, f"transport error {type(e).__name__}: {e}"


def _check_plain(status: int, data: bytes) -> str | None:
    if status >= 500:
        return f"HTTP {status}: {data[:300]!r}"
    try:
        body = strict_json(data)
    except ValueError as e:
        return f"HTTP {status}: body is not (strict) JSON ({e}): {data[:200]!r}"
    if status >= 400:
        err = body.get("error") if isinstance(body, dict) else None
        if not isinstance(err, dict) or not isinstance(err.get("message"), str):
            return f"HTTP {status}: no OpenAI error object: {data[:200]!r}"
        return None
    if status != 200:
        return f"unexpected HTTP {status}: {data[:200]!r}"
    if not isinstance(body, dict) or not isinstance(body.get("choices"), list):
        return f"HTTP 200 without choices: {data[:200]!r}"
    return None


def _check_stream(status: int, events: list[str], wanted: bool) -> str | None:
    if status != 200:
        return f"HTTP {status} as an event stream: {events[:3]}"
    if not wanted:
        return "an event stream for a body without stream=true"
    if not events or events[-1] != "[DONE]":
        return f"stream did not end with [DONE] (last events {events[-2:]})"
    for ev in events[:-1]:
        try:
            obj = strict_json(ev)
        except ValueError as e:
            return f"stream event is not (strict) JSON ({e}): {ev[:200]}"
        if isinstance(obj, dict) and "error" in obj:
            err = obj["error"] if isinstance(obj["error"], dict) else {}
            if err.get("type") == "server_error" or not err:
                return f"in-band server error in the stream: {ev[:300]}"
    return None


def _signature(violation: str) -> str:
    """Failures that differ only in numbers or ids (or past their first 140 characters) count once."""
    return re.sub(r"[0-9a-f]{8,}|\d+", "N", violation)[:140]


def _trace_lines(log: str) -> list[str]:
    """The exception lines of the tracebacks in a server log."""
    out, in_tb = [], False
    for line in log.splitlines():
        if line.startswith("Traceback (most recent call last)"):
            in_tb = True
        elif in_tb and line and not line.startswith((" ", "\t")) and not line.startswith("During handling") \
                and not line.startswith("The above exception"):
            out.append(line.strip()[:200])
            in_tb = False
    return out


def post_run_checks(s: Server, log_before: int) -> list[str]:
    """The server after a fuzz run: alive, healthy, same greedy answer, idle with no KV held, no crash."""
    problems = []
    if s.proc.poll() is not None:
        return [f"server exited with {s.proc.returncode}:\n{s.tail()}"]
    r = httpx.get(s.url + "/health", timeout=10)
    if r.status_code != 200:
        problems.append(f"/health {r.status_code}: {r.text[:200]}")
    try:
        got, _ = greedy_ids(s.url, BASE_PROMPT, MAX_VALID_TOKENS)
        if got != s.baseline:
            problems.append(f"greedy completion changed: {got} != {s.baseline} (before the run)")
    except AssertionError as e:
        problems.append(f"greedy completion failed: {e}")
    try:
        m = wait_idle(s.url, timeout=30)
        if m.get("gigadecode_engine_step_failures_total", 0) > 0:
            problems.append(f"engine step failures: {m['gigadecode_engine_step_failures_total']:.0f}")
    except AssertionError as e:
        problems.append(str(e))
    tbs = _trace_lines(s.log_text()[log_before:])
    if tbs:
        counts: dict[str, int] = {}
        for t in tbs:
            counts[t] = counts.get(t, 0) + 1
        problems.append("tracebacks in the server log: " + "; ".join(f"{n}x {t}" for t, n in counts.items()))
    return problems


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("role", ["both", "prefill", "decode"])
def test_fuzz(servers, kv_seed, role, path):
    s = servers[role]
    schema, source = body_schema(s.url, path)
    failures: dict[str, tuple[str, bytes, int | None]] = {}          # signature -> (violation, smallest raw, status)
    statuses: dict[str, int] = {}
    dead: list[str] = []
    log_before = len(s.log_text())
    t0 = time.monotonic()

    def client() -> httpx.Client:
        return httpx.Client(base_url=s.url, timeout=httpx.Timeout(REQUEST_TIMEOUT_S, connect=5.0))

    conn = [client()]                    # one keep-alive connection, replaced after a 5xx or a transport error

    def record(violation: str, raw: bytes, status: int | None) -> None:
        sig = _signature(violation)
        if sig not in failures or len(raw) < len(failures[sig][1]):
            failures[sig] = (violation, raw, status)

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              phases=[Phase.explicit, Phase.generate],
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                     HealthCheck.filter_too_much, HealthCheck.large_base_example])
    @given(req=request_strategy(path, schema, kv_seed))
    def run(req):
        if dead:
            return
        kind, raw = req
        status, violation = check_one(conn[0], path, raw)
        statuses[str(status)] = statuses.get(str(status), 0) + 1
        if violation is None:
            return
        record(violation, raw, status)
        if status is None and s.proc.poll() is not None:
            dead.append(f"the server died (exit {s.proc.returncode}) on {_show(raw)}:\n{s.tail()}")
            return
        if status is not None and status >= 500:
            # does the connection that carried the 5xx still serve? (a fresh one is used from here on, so a
            # later request is never blamed for this one)
            _, after = check_one(conn[0], "/v1/completions", _dumps({"prompt": BASE_PROMPT, "max_tokens": 1}))
            if after is not None:
                record(f"after HTTP {status}, the next request on the same keep-alive connection fails: {after}",
                       raw, status)
        conn[0].close()
        conn[0] = client()

    for case in explicit_cases(path):
        run = example(req=case)(run)
    try:
        run()
    finally:
        conn[0].close()

    wall = time.monotonic() - t0
    print(f"\n{role} {path}: {sum(statuses.values())} requests ({EXAMPLES} drawn from {source}) in {wall:.1f}s; statuses {dict(sorted(statuses.items()))}")
    report = [f"{v}\n    request: POST {path} {_show(raw)}" for v, raw, _ in failures.values()]
    report += dead + [f"after the run: {p}" for p in ([] if dead else post_run_checks(s, log_before))]
    assert not report, f"{role} server, {path}: {len(report)} problem(s):\n" + "\n".join(report)


@pytest.fixture(scope="module")
def proxy(servers, tmp_path_factory):
    """`gigadecode proxy` in front of the fuzzed prefill and decode servers."""
    port = free_port()
    log = tmp_path_factory.mktemp("fuzz_proxy") / "proxy.log"
    cmd = [sys.executable, "-m", "gigadecode", "proxy", "--prefill", servers["prefill"].url, "--decode",
           servers["decode"].url, "--port", str(port), "--log-level", "warning"]
    with open(log, "wb") as f:
        p = subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=f, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL)
    s = Server("proxy", f"http://127.0.0.1:{port}", p, log)
    try:
        _wait_up(s, timeout=60)
        yield s
    finally:
        stop_process_tree(p)


@pytest.mark.parametrize("path", PATHS)
def test_proxy_explicit_cases(servers, proxy, path):
    """The same property through `gigadecode proxy` for the explicit raw cases (no drawn ones: each proxied
    request costs a prefill and a decode); afterwards the DI path still works and neither engine holds KV."""
    report = []                          # every failing case (the proxy's plain-text 500s all look alike)
    for _, raw in explicit_cases(path):
        with httpx.Client(base_url=proxy.url, timeout=httpx.Timeout(REQUEST_TIMEOUT_S, connect=5.0)) as hc:
            status, violation = check_one(hc, path, raw)
        if violation is not None:
            report.append(f"{violation}\n    request: POST {path} {_show(raw, 200)}")
    if proxy.proc.poll() is not None:
        report.append(f"the proxy exited with {proxy.proc.returncode}:\n{proxy.tail()}")
    else:
        got, _ = greedy_ids(proxy.url, BASE_PROMPT, MAX_VALID_TOKENS)
        if got != servers["both"].baseline:
            report.append(f"after the run: greedy completion through the proxy {got} != {servers['both'].baseline}")
        for role in ("prefill", "decode"):
            try:
                wait_idle(servers[role].url, timeout=30)
            except AssertionError as e:
                report.append(f"after the run: {e}")
        tbs = _trace_lines(proxy.log_text())
        if tbs:
            report.append("after the run: tracebacks in the proxy log: " + "; ".join(sorted(set(tbs))))
    assert not report, f"proxy, {path}: {len(report)} problem(s):\n" + "\n".join(report)


def test_max_tokens_up_to_the_context_finishes(servers):
    """A request whose prompt + max_tokens fits the context exactly is answered (or refused), never left
    waiting: the context here is what one request can hold of the KV pool's 63 blocks of 16 (full-attention
    blocks + the sliding window's blocks + a prefill chunk; before that was counted, 1008 tokens were
    advertised and a request that filled them was preempted forever)."""
    s = servers["both"]
    ctx = httpx.get(s.url + "/v1/models", timeout=10).json()["data"][0]["max_model_len"]
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": ctx - 3, "temperature": 0, "ignore_eos": True}
    try:
        r = httpx.post(s.url + "/v1/completions", json=body, timeout=20)
    except httpx.TimeoutException:
        m = metrics(s.url)
        pytest.fail(f"no answer in 20 s to {json.dumps(body)} (context {ctx}); /metrics then: waiting "
                    f"{m.get('gigadecode_requests_waiting')}, running {m.get('gigadecode_requests_running')}, "
                    f"kv blocks {m.get('gigadecode_kv_blocks_used')}")
    assert r.status_code == 200 or 400 <= r.status_code < 500, r.text[:300]
    if r.status_code == 200:
        assert r.json()["usage"]["completion_tokens"] == ctx - 3
    wait_idle(s.url, timeout=30)


def test_all_servers_serve_and_hold_no_kv_after_fuzzing(servers, kv_seed):
    """After every fuzz run: each server healthy and idle with 0 KV blocks used, and the DI path (a fresh
    prefill answer -> decode) still gives the single-node greedy tokens."""
    for s in servers.values():
        assert s.proc.poll() is None, f"{s.role} exited:\n{s.tail()}"
        assert httpx.get(s.url + "/health", timeout=10).status_code == 200, s.role
    prompt = [9, 8, 7, 6, 5, 4, 3, 20, 30, 40, 50, 60, 70, 80, 90, 100, 110]
    want, _ = greedy_ids(servers["both"].url, prompt, MAX_VALID_TOKENS)
    _, j = greedy_ids(servers["prefill"].url, prompt, 1, kv={"do_remote_decode": True})
    got, _ = greedy_ids(servers["decode"].url, prompt, MAX_VALID_TOKENS, kv=j["kv_transfer_params"])
    assert got == want
    for s in servers.values():
        m = wait_idle(s.url, timeout=30)
        assert m["gigadecode_kv_blocks_used"] == 0, s.role


# --------------------------------------------------------------------------------------------------
# Soak (bench/soak.py)
# --------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_soak(tiny_ckpt):
    """bench/soak.py for 20 s through the DI proxy: no leaked KV, bounded RSS (its exit code)."""
    cmd = [sys.executable, str(ROOT / "bench" / "soak.py"), "--model", str(tiny_ckpt), "--seconds", "20"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, f"soak exited {r.returncode}\n{r.stdout[-6000:]}\n{r.stderr[-3000:]}"
