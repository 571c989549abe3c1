"""Soak test of disaggregated serving: sustained concurrent streaming load with cancellations and malformed
requests through `gigadecode proxy`, then checks for leaked KV blocks and memory growth.

Starts `serve --role prefill`, `serve --role decode` (one shared GIGADECODE_KV_SECRET, fresh per run) and
`proxy` in front of them, as separate processes on free loopback ports, on the tiny checkpoint (written
once under ~/.cache/gigadecode/tiny) or --model. After a warm-up (a few requests, including the first KV
handshake) it reads each process's RSS (VmRSS in /proc/<pid>/status), then for --seconds keeps --streams
closed-loop clients busy through the proxy with the official `openai` async client. Each client sends
streaming requests back to back (/v1/completions with random token ids, or /v1/chat/completions), each one
drawn as
  normal     (the rest)            streamed to the end; must finish with its `max_tokens` tokens
  cancelled  (--cancel-frac, 0.2)  the client goes away mid-stream after a few chunks, or before the
                                   first byte (the request task is cancelled during prefill)
  malformed  (--malformed-frac, 0.1) a wrong type (max_tokens "8", temperature "hot", prompt of dicts),
                                   an out-of-range value (top_p 5, a token id past the vocabulary, a
                                   negative max_tokens), max_tokens far past the context, or garbage
                                   kv_transfer_params; must be answered 4xx.
When the load stops, every in-flight request is finished or cancelled and each engine must go idle: 0
requests running or waiting and `gigadecode_kv_blocks_used` 0 on both prefill and decode within
--idle-timeout (the prefill server's KV leases are --kv-lease-s, so leases a cancelled request never
let the decode side read expire in time).

Printed: requests sent / completed / cancelled / malformed, req/s and streamed tokens/s, errors by class
(HTTP status or exception type, per request kind; an error on a normal request, a 5xx anywhere, or a
malformed request that was served 2xx is UNEXPECTED), and per server the KV blocks in use after idle and
RSS at start and end against the bound end <= 1.25 x start + 50 MiB.

Exit code 1 when a KV block leaked, an RSS bound was exceeded, a server process died, or no request
completed (with --fail-on-errors also on any UNEXPECTED error); 0 otherwise. Traffic only goes to
127.0.0.1, and the run stops by itself after --seconds (+ the drain and idle waits).

    .venv/bin/python bench/soak.py [--seconds 60] [--streams 64] [--model DIR] [--cancel-frac 0.2]
        [--malformed-frac 0.1] [--max-tokens 24] [--seed 0] [--fail-on-errors]
        [--shared-prefix N --serve-flag --enable-prefix-caching]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gigadecode.checkpoint import make_checkpoint  # noqa: E402

CACHE = Path.home() / ".cache" / "gigadecode"
RSS_FACTOR, RSS_SLACK_MIB = 1.25, 50.0


# -- processes -------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Proc:
    name: str
    url: str
    popen: subprocess.Popen
    log: Path
    has_engine: bool

    def tail(self, n: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:]) if self.log.exists() else ""


def start(name: str, argv: list[str], port: int, log_dir: Path, env: dict[str, str], has_engine: bool) -> Proc:
    log = log_dir / f"{name}.log"
    with open(log, "wb") as f:
        p = subprocess.Popen(argv, env=env, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    return Proc(name, f"http://127.0.0.1:{port}", p, log, has_engine)


def stop_all(procs: list[Proc]) -> None:
    for p in procs:
        if p.popen.poll() is None:
            p.popen.terminate()
    deadline = time.monotonic() + 15
    for p in procs:
        try:
            p.popen.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.popen.kill()
            p.popen.wait(5)


def wait_healthy(p: Proc, timeout_s: float) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if p.popen.poll() is not None:
            raise RuntimeError(f"{p.name} exited with code {p.popen.returncode}:\n{p.tail()}")
        try:
            with urllib.request.urlopen(p.url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{p.name} ({p.url}) not healthy after {timeout_s:.0f}s:\n{p.tail()}")


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def metrics(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(url + "/metrics", timeout=5).read().decode()
    out = {}
    for line in text.splitlines():
        m = re.match(r"^([a-z_]+) ([-+0-9.eE]+)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def wait_idle(url: str, timeout_s: float) -> tuple[bool, dict[str, float]]:
    """(idle reached, last /metrics): idle = nothing running or waiting and no KV block in use."""
    t0, m = time.monotonic(), {}
    while True:
        try:
            m = metrics(url)
            if m.get("gigadecode_kv_blocks_used") == 0 and m.get("gigadecode_requests_running") == 0 \
                    and m.get("gigadecode_requests_waiting") == 0:
                return True, m
        except OSError:
            pass
        if time.monotonic() - t0 > timeout_s:
            return False, m
        time.sleep(0.25)


# -- load ------------------------------------------------------------------------------------------------
@dataclass
class Stats:
    sent: Counter = field(default_factory=Counter)          # kind -> requests sent
    done: Counter = field(default_factory=Counter)          # kind -> ended as intended
    errors: Counter = field(default_factory=Counter)        # (kind, class) -> count
    unexpected: Counter = field(default_factory=Counter)    # (kind, class) -> count
    examples: dict = field(default_factory=dict)            # (kind, class) -> first message
    tokens: int = 0


MALFORMED = [  # (fields over a valid body, only kv_transfer_params is wrong: the proxy replaces those, so 2xx is fine)
    ({"max_tokens": "8"}, False), ({"max_tokens": -3}, False), ({"max_tokens": 0}, False), ({"max_tokens": 2**64}, False),
    ({"max_tokens": "context x 4"}, False), ({"temperature": "hot"}, False), ({"top_p": 5}, False),
    ({"top_k": -7}, False), ({"seed": "x"}, False), ({"logprobs": 500}, False), ({"stop_token_ids": "eos"}, False),
    ({"ignore_eos": "yes"}, False), ({"min_tokens": 10**6}, False), ({"n": 17}, False), ({"stream_options": "yes"}, False),
    ({"prompt": "vocab + 5"}, False), ({"prompt": [{"a": 1}]}, False), ({"prompt": [-1, 2]}, False),
    ({"kv_transfer_params": "garbage"}, True), ({"kv_transfer_params": {"do_remote_prefill": "x", "a": [[[]]]}}, True),
    ({"kv_transfer_params": [1, 2, 3]}, True),
]


def malformed_request(rng: random.Random, vocab: int, context: int) -> tuple[bool, dict, dict, bool]:
    """(chat?, the body's main part, the fields that override it, 2xx acceptable?) of a request the server
    must refuse with a 4xx (or, for garbage kv_transfer_params, may serve: the proxy replaces them)."""
    bad, kv_only = rng.choice(MALFORMED)
    bad = dict(bad)
    if bad.get("max_tokens") == "context x 4":
        bad["max_tokens"] = context * 4
    if bad.get("prompt") == "vocab + 5":
        bad["prompt"] = [vocab + 5]
    chat = rng.random() < 0.3
    if chat:
        main = {"messages": [{"role": "user", "content": "hello"}]}
        if "prompt" in bad:
            main = {"messages": [{"role": 5, "content": bad.pop("prompt")}]}
    else:
        main = {"prompt": bad.pop("prompt", [rng.randrange(3, vocab) for _ in range(rng.randint(2, 12))])}
    return chat, main, bad, kv_only


PREFIX = [3 + (i * 7919) % 997 for i in range(4096)]          # --shared-prefix: the ids every prompt starts with


async def one_request(client, rng: random.Random, args, stats: Stats, vocab: int, context: int) -> None:
    import openai
    r = rng.random()
    kind = "malformed" if r < args.malformed_frac else "cancelled" if r < args.malformed_frac + args.cancel_frac \
        else "normal"
    stats.sent[kind] += 1
    common = {"model": args.model_name, "stream": True, "temperature": rng.choice([0.0, 0.0, 0.8]),
              "seed": rng.randrange(2**31)}
    kv_only = False
    if kind == "malformed":
        chat, main, extra, kv_only = malformed_request(rng, vocab, context)
        kwargs = {**common, **main, "max_tokens": 8, "extra_body": extra}
    else:
        chat = rng.random() < 0.3
        n_tokens = rng.randint(2, args.max_tokens) if kind == "normal" else args.max_tokens * 4
        main = {"messages": [{"role": "user", "content": f"tell me about {rng.randrange(10**6)}"}]} if chat else \
            {"prompt": PREFIX[:args.shared_prefix] + [rng.randrange(3, vocab) for _ in range(rng.randint(1, args.prompt_len))]}
        kwargs = {**common, **main, "max_tokens": n_tokens, "extra_body": {"ignore_eos": True}}
    create = client.chat.completions.create if chat else client.completions.create
    what = json.dumps({k: v for k, v in kwargs.items() if k not in ("seed", "model")}, default=str)[:240]

    async def run() -> tuple[int, str | None]:
        """-> (chunks with text, the last finish_reason); stops early for a cancelled request."""
        stream = await create(**kwargs)
        chunks, reason = 0, None
        stop_after = rng.randint(0, 8) if kind == "cancelled" else None
        try:
            async for ch in stream:
                for c in ch.choices:
                    text = getattr(c, "text", None) if not chat else (c.delta.content if c.delta else None)
                    chunks += 1 if text else 0
                    reason = c.finish_reason or reason
                if stop_after is not None and chunks > stop_after:
                    break                             # the client goes away mid-stream
        finally:
            await stream.close()
        return chunks, reason

    def err(cls: str, msg: str, unexpected: bool) -> None:
        stats.errors[(kind, cls)] += 1
        if unexpected:
            stats.unexpected[(kind, cls)] += 1
        stats.examples.setdefault((kind, cls), msg[:400])

    try:
        if kind == "cancelled" and rng.random() < 0.3:      # cancel before the first byte (during prefill)
            task = asyncio.ensure_future(run())
            await asyncio.sleep(rng.uniform(0.0, 0.05))
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
            stats.done[kind] += 1
            return
        chunks, reason = await asyncio.wait_for(run(), timeout=args.request_timeout)
        stats.tokens += chunks
        if kind == "malformed" and not kv_only:
            err("HTTP 2xx", f"served (finish {reason}): {what}", True)
        elif kind == "normal" and reason not in ("length", "stop"):
            err("incomplete stream", f"finish_reason {reason!r} after {chunks} chunks: {what}", True)
        else:
            stats.done[kind] += 1
    except openai.APIStatusError as e:
        expected = kind == "malformed" and 400 <= e.status_code < 500
        err(f"HTTP {e.status_code}", f"{e.message} <- {what}", not expected)
        if expected:
            stats.done[kind] += 1
    except asyncio.TimeoutError:
        err("timeout", f"no end in {args.request_timeout}s <- {what}", True)
    except Exception as e:  # noqa: BLE001 - every failure is counted by class
        err(type(e).__name__, f"{e} <- {what}", True)


async def load(url: str, args, vocab: int, context: int, stats: Stats) -> float:
    import httpx
    import openai
    deadline = time.monotonic() + args.seconds
    limits = httpx.Limits(max_connections=args.streams * 2, max_keepalive_connections=args.streams)
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="soak", max_retries=0,
                                  timeout=args.request_timeout,
                                  http_client=httpx.AsyncClient(limits=limits)) as client:
        async def worker(i: int) -> None:
            rng = random.Random(args.seed * 1000 + i)
            while time.monotonic() < deadline:
                await one_request(client, rng, args, stats, vocab, context)
        t0 = time.monotonic()
        await asyncio.gather(*(worker(i) for i in range(args.streams)))
        return time.monotonic() - t0


async def warm_up(url: str, args, vocab: int) -> None:
    import openai
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="soak", max_retries=0, timeout=120) as c:
        for n in (1, 5, 40):
            r = await c.completions.create(model=args.model_name, prompt=list(range(3, 3 + n)), max_tokens=4,
                                           temperature=0, extra_body={"ignore_eos": True})
            assert r.choices[0].finish_reason == "length", r
        await asyncio.gather(*(c.completions.create(model=args.model_name, prompt=[5 + i, 6, 7], max_tokens=2,
                                                    temperature=0) for i in range(min(8, args.streams))))


# -- main ------------------------------------------------------------------------------------------------
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint directory (default ~/.cache/gigadecode/tiny)")
    ap.add_argument("--seconds", type=float, default=60.0, help="how long the load runs")
    ap.add_argument("--streams", type=int, default=64, help="concurrent streaming clients")
    ap.add_argument("--cancel-frac", type=float, default=0.2)
    ap.add_argument("--malformed-frac", type=float, default=0.1)
    ap.add_argument("--max-tokens", type=int, default=24, help="a normal request asks for 2..N tokens")
    ap.add_argument("--prompt-len", type=int, default=48, help="completions prompts have 1..N token ids")
    ap.add_argument("--num-blocks", type=int, default=1024)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--kv-dtype", default="fp8", choices=["auto", "bf16", "fp8"])
    ap.add_argument("--kv-lease-s", type=float, default=5.0, help="prefill: lease of KV not yet read")
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each server process")
    ap.add_argument("--request-timeout", type=float, default=120.0)
    ap.add_argument("--startup-timeout", type=float, default=180.0)
    ap.add_argument("--idle-timeout", type=float, default=None, help="default kv-lease-s + 30")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fail-on-errors", action="store_true", help="exit 1 on any UNEXPECTED error too")
    ap.add_argument("--shared-prefix", type=int, default=0,
                    help="completions prompts start with the same N token ids (with --serve-flag "
                         "--enable-prefix-caching: a prefix-cache soak)")
    ap.add_argument("--serve-flag", action="append", default=[], help="one more flag for both servers (repeat)")
    args = ap.parse_args()
    idle_timeout = args.idle_timeout if args.idle_timeout is not None else args.kv_lease_s + 30

    model_dir = Path(args.model) if args.model else CACHE / "tiny"
    if not (model_dir / "config.json").exists():
        print(f"writing the tiny checkpoint to {model_dir} ...", flush=True)
        make_checkpoint(model_dir, "tiny", seed=0)
    args.model_name = "soak"
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]

    def on_term(signum, frame):  # SIGTERM unwinds like Ctrl-C, so the servers are stopped
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "GIGADECODE_API_KEY": "",
           "GIGADECODE_KV_SECRET": secrets.token_hex(16)}
    flags = ["--served-model-name", args.model_name, "--kv-dtype", args.kv_dtype, "--block-size",
             str(args.block_size), "--num-blocks", str(args.num_blocks), "--max-num-seqs", str(max(64, args.streams)),
             "--log-level", "warning", *args.serve_flag]
    gd = [sys.executable, "-m", "gigadecode"]
    pp, dp, xp = free_port(), free_port(), free_port()
    with ExitStack() as stack:
        log_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="gigadecode-soak-")))
        procs: list[Proc] = []
        stack.callback(stop_all, procs)
        procs.append(start("prefill", gd + ["serve", "--model", str(model_dir), "--role", "prefill", "--port", str(pp),
                                            "--kv-lease-s", str(args.kv_lease_s), *flags], pp, log_dir, env, True))
        procs.append(start("decode", gd + ["serve", "--model", str(model_dir), "--role", "decode", "--port", str(dp),
                                           *flags], dp, log_dir, env, True))
        procs.append(start("proxy", gd + ["proxy", "--prefill", procs[0].url, "--decode", procs[1].url, "--port",
                                          str(xp), "--log-level", "warning"], xp, log_dir, env, False))
        t0 = time.perf_counter()
        for p in procs:
            wait_healthy(p, args.startup_timeout)
        proxy = procs[2]
        models = json.loads(urllib.request.urlopen(proxy.url + "/v1/models", timeout=10).read())
        context = int(models["data"][0].get("max_model_len") or 4096)
        asyncio.run(warm_up(proxy.url, args, vocab))
        rss0 = {p.name: rss_mib(p.popen.pid) for p in procs}
        print(f"model {model_dir}  servers up + warm-up in {time.perf_counter() - t0:.1f}s  context {context}  "
              f"{args.streams} streams for {args.seconds:.0f}s  cancel {args.cancel_frac:.0%}  malformed "
              f"{args.malformed_frac:.0%}", flush=True)

        stats = Stats()
        wall = asyncio.run(load(proxy.url, args, vocab, context, stats))

        idle = {}
        for p in procs:
            if p.has_engine and p.popen.poll() is None:
                idle[p.name] = wait_idle(p.url, idle_timeout)
        rss1 = {p.name: rss_mib(p.popen.pid) if p.popen.poll() is None else float("nan") for p in procs}
        dead = [p for p in procs if p.popen.poll() is not None]

        # -- report ----------------------------------------------------------------------------------------
        sent, done = sum(stats.sent.values()), sum(stats.done.values())
        print(f"\n{'requests':<10} {'sent':>6} {'as meant':>8}   (normal: streamed to the end; cancelled: client went "
              f"away; malformed: answered 4xx)")
        for k in ("normal", "cancelled", "malformed"):
            print(f"{k:<10} {stats.sent[k]:>6} {stats.done[k]:>8}")
        print(f"{'all':<10} {sent:>6} {done:>8}   in {wall:.1f}s: {stats.done['normal'] / wall:.1f} completed req/s, "
              f"{stats.tokens / wall:.0f} streamed chunks/s")
        print(f"\n{'errors by class':<34} {'count':>6}")
        if not stats.errors:
            print("  (none)")
        for (kind, cls), n in sorted(stats.errors.items(), key=lambda t: (-t[1], t[0])):
            mark = "  UNEXPECTED" if stats.unexpected[(kind, cls)] else ""
            print(f"  {kind + ' / ' + cls:<32} {n:>6}{mark}")
            if mark:
                print(f"      e.g. {stats.examples[(kind, cls)]}")
        print(f"\n{'server':<8} {'kv blocks used':>14} {'running':>8} {'waiting':>8} {'RSS start MiB':>14} "
              f"{'RSS end MiB':>12} {'bound MiB':>10}  ok")
        failed = []
        for p in procs:
            bound = RSS_FACTOR * rss0[p.name] + RSS_SLACK_MIB
            ok_rss = rss1[p.name] <= bound
            if p.has_engine and p.name in idle:
                reached, m = idle[p.name]
                used = m.get("gigadecode_kv_blocks_used", float("nan"))
                run_, wait_ = m.get("gigadecode_requests_running", float("nan")), m.get("gigadecode_requests_waiting",
                                                                                          float("nan"))
                ok_kv = reached and used == 0
                kv_s, r_s, w_s = f"{used:.0f}", f"{run_:.0f}", f"{wait_:.0f}"
            else:
                ok_kv, kv_s, r_s, w_s = not p.has_engine, "-", "-", "-"
            ok = ok_rss and ok_kv and p.popen.poll() is None
            print(f"{p.name:<8} {kv_s:>14} {r_s:>8} {w_s:>8} {rss0[p.name]:>14.1f} {rss1[p.name]:>12.1f} {bound:>10.1f}  "
                  f"{'yes' if ok else 'NO'}")
            if not ok_kv:
                failed.append(f"{p.name}: KV not released after {idle_timeout:.0f}s idle wait (blocks {kv_s}, running "
                              f"{r_s}, waiting {w_s})")
            if not ok_rss:
                failed.append(f"{p.name}: RSS {rss1[p.name]:.1f} MiB > bound {bound:.1f} MiB "
                              f"({RSS_FACTOR} x {rss0[p.name]:.1f} + {RSS_SLACK_MIB:.0f})")
        for p in dead:
            failed.append(f"{p.name} exited with code {p.popen.returncode}:\n{p.tail()}")
        if stats.done["normal"] == 0:
            failed.append("no normal request completed")
        n_unexpected = sum(stats.unexpected.values())
        if args.fail_on_errors and n_unexpected:
            failed.append(f"{n_unexpected} unexpected errors (--fail-on-errors)")
        if failed:
            print("\nFAILED:\n  " + "\n  ".join(failed))
            for p in procs:
                if p.popen.poll() is not None or p.has_engine:
                    print(f"--- {p.name} log (tail) ---\n{p.tail(15)}")
            return 1
        print(f"\nOK: no KV leaked, RSS within bounds{f', {n_unexpected} unexpected errors' if n_unexpected else ''}")
        return 0


if __name__ == "__main__":
    sys.exit(main())
