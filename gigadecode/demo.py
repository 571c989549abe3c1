"""The one-command demo: disaggregated inference on the built-in tiny model, end to end on loopback.

Starts a prefill server (per-layer model, kv_producer), a decode server (GK program, packed-FP8 KV,
kv_consumer) and the proxy as separate processes, sends a chat request through the official `openai`
client (streamed, then whole), prints the answer and the timings, and shuts everything down.
"""

from __future__ import annotations

import os
import re
import secrets
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import ExitStack
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
        messages = [{"role": "user", "content": prompt}]
        print(f"\nuser: {prompt}\nassistant (streamed): ", end="", flush=True)
        t_start = time.perf_counter()
        t_first, n = None, 0
        stream = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                                temperature=0.0, stream=True, extra_body={"ignore_eos": True})
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                if t_first is None:
                    t_first = time.perf_counter()
                n += 1
                print(chunk.choices[0].delta.content, end="", flush=True)
        t_end = time.perf_counter()
        print()
        whole = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                               temperature=0.0, extra_body={"ignore_eos": True,
                                                                            "return_token_ids": True})
        choice = whole.choices[0]
        ids = getattr(choice, "token_ids", None) or (choice.model_extra or {}).get("token_ids")
        print(f"assistant (whole):    {choice.message.content}")
        print(f"token ids: {ids}")
        ttft = (t_first or t_end) - t_start
        print(f"\ntime to first token {ttft * 1e3:.0f} ms (prefill + KV transfer + first GK step), "
              f"{max(n - 1, 0) / max(t_end - (t_first or t_end), 1e-9):.1f} chunks/s after it, total {t_end - t_start:.2f}s")
        print(f"KV moved prefill -> decode over NIXL: {metric(dec_url, 'gigadecode_kv_bytes_transferred_total'):.0f} "
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
