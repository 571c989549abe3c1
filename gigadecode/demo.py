"""The one-command demo: disaggregated inference on the built-in demo model, end to end on loopback.

Starts a prefill server (per-layer model, kv_producer), a decode server (GK program, packed-FP8 KV,
kv_consumer) and the proxy as separate processes; asks the demo model (a small GPT-OSS trained to add,
`make-checkpoint --preset demo`) through the official `openai` client: streamed, its reasoning and its
answer apart; then with the `add` tool offered, a tool call, its result sent back, and the answer. Prints
the timings and the KV moved, and shuts everything down.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import sys
import time
import urllib.request
from contextlib import ExitStack
from pathlib import Path

from .ports import free_port


def wait_healthy(url: str, procs: subprocess.Popen | list[subprocess.Popen], timeout_s: float = 180.0) -> None:
    """Poll `url`/health until it answers 200; fail at once if one of `procs` (the servers behind it) exits."""
    procs = procs if isinstance(procs, list) else [procs]
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"{url}: a server exited with code {p.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"{url} not healthy after {timeout_s:.0f}s")


def metric(url: str, name: str) -> float:
    text = urllib.request.urlopen(url + "/metrics", timeout=5).read().decode()
    m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.eE+-]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def run_demo(model_dir: Path, prompt: str, max_tokens: int) -> int:
    from openai import OpenAI

    py = [sys.executable, "-m", "gigadecode"]
    p_port, d_port, x_port = free_port(), free_port(), free_port()
    common = ["--model", str(model_dir), "--kv-dtype", "fp8", "--log-level", "warning"]
    # the prefill and decode servers share a KV secret (they sign / check kv_transfer_params with it); the
    # demo makes a fresh one unless one is set
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "GIGADECODE_KV_SECRET": os.environ.get("GIGADECODE_KV_SECRET") or secrets.token_hex(32)}
    with ExitStack() as stack:
        procs = []

        def start(args: list[str]) -> subprocess.Popen:
            p = subprocess.Popen(py + args, env=env)
            procs.append(p)
            stack.callback(_stop, p)
            return p

        t0 = time.perf_counter()
        pre = start(["serve", "--role", "prefill", "--port", str(p_port), *common])
        dec = start(["serve", "--role", "decode", "--port", str(d_port), *common])
        pre_url, dec_url, px_url = (f"http://127.0.0.1:{p}" for p in (p_port, d_port, x_port))
        prx = start(["proxy", "--prefill", pre_url, "--decode", dec_url, "--port", str(x_port), "--log-level", "warning"])
        for url, proc in ((pre_url, pre), (dec_url, dec), (px_url, prx)):
            wait_healthy(url, proc)
        print(f"prefill {pre_url} (per-layer model) -> decode {dec_url} (GK program, FP8 KV) via proxy {px_url}; "
              f"up in {time.perf_counter() - t0:.1f}s", flush=True)

        client = OpenAI(base_url=px_url + "/v1", api_key="unused")
        model = client.models.list().data[0].id
        _chat_round_trips(client, model, prompt, max_tokens)
        print(f"\nKV moved prefill -> decode over NIXL: {metric(dec_url, 'gigadecode_kv_bytes_transferred_total'):.0f} "
              f"bytes; transfer failures: {metric(dec_url, 'gigadecode_kv_transfer_failures_total'):.0f}")
    print("servers stopped")
    return 0


def _stop(p: subprocess.Popen) -> None:
    if p.poll() is None:
        p.terminate()
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)


ADD_TOOL = {"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}


def _chat_round_trips(client, model: str, prompt: str, max_tokens: int) -> None:
    """Streamed chat (reasoning and answer as they come), then a tool-call round trip: the model calls `add`,
    the demo runs it, sends the result back, and the model answers."""
    messages = [{"role": "user", "content": prompt}]
    print(f"\nuser: {prompt}")
    t_start = time.perf_counter()
    t_first, n, kind = None, 0, None
    for chunk in client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                                temperature=0.0, stream=True):
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        for k, text in (("reasoning", (d.model_extra or {}).get("reasoning_content")), ("answer", d.content)):
            if text:
                if t_first is None:
                    t_first = time.perf_counter()
                if k != kind:
                    print(f"\n  {k} (streamed): ", end="")
                    kind = k
                n += 1
                print(text, end="", flush=True)
    t_end = time.perf_counter()
    print(f"\n  time to first token {((t_first or t_end) - t_start) * 1e3:.0f} ms (prefill + KV transfer + first "
          f"GK step), {max(n - 1, 0) / max(t_end - (t_first or t_end), 1e-9):.0f} chunks/s after it")

    print(f"\nuser (offering the add tool): {prompt}")
    r = client.chat.completions.create(model=model, messages=messages, tools=[ADD_TOOL], max_tokens=max_tokens,
                                       temperature=0.0)
    choice = r.choices[0]
    calls = choice.message.tool_calls or []
    print(f"  finish_reason: {choice.finish_reason}")
    if not calls:
        print(f"  answer: {choice.message.content}")
        return
    call = calls[0]
    args = json.loads(call.function.arguments)
    result = int(args.get("a", 0)) + int(args.get("b", 0))
    print(f"  tool call: {call.function.name}({call.function.arguments})  -> the demo runs it: {result}")
    follow = messages + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                         {"role": "tool", "tool_call_id": call.id, "content": str(result)}]
    r = client.chat.completions.create(model=model, messages=follow, tools=[ADD_TOOL], max_tokens=max_tokens,
                                       temperature=0.0)
    print(f"  answer after the tool result: {r.choices[0].message.content}")
