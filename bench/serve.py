"""Serving benchmark over HTTP: DI (prefill server + decode server behind `gigadecode proxy`) vs one
`--role both` server, and vLLM's CPU OpenAI server on the same checkpoint when vLLM is installed here.

Every system is started as separate processes on free loopback ports (as `gigadecode demo` does):

  DI    serve --role prefill + serve --role decode + proxy   (kv_producer -> NIXL -> kv_consumer)
  both  serve --role both                                     (kv_both, single node)
  vLLM  python -m vllm.entrypoints.openai.api_server --model DIR --dtype DTYPE     (only if importable)

with the same engine flags for every gigadecode server (the servers' defaults unless told: --dtype bfloat16,
--kv-dtype fp8, --decoder gk-native; --block-size, --num-blocks, --max-num-seqs) and OMP_NUM_THREADS=--threads
per server process (DI runs two engine processes, so it may use twice the cores of `both`: that is what
disaggregation buys).

Load: at each concurrency C, C closed-loop clients each send streaming `/v1/completions` requests back to
back (a prompt of --prompt-len random token ids, distinct per request, the same prompts for every
system; greedy, `ignore_eos`, exactly --output-len new tokens) until --requests requests have been sent
(default max(8, 4*C), at least C) or --duration seconds have passed. Measured at the client:
  req/s, out tok/s   completed requests / output tokens over the wall time of the level
  TTFT               send -> first SSE chunk carrying a token (DI: proxy + prefill + KV transfer + first step)
  ITL                gaps between a request's consecutive token-carrying chunks (a chunk of k tokens
                     counts its gap / k, k times)
Percentiles are p50/p90/p99 over all requests (TTFT) or all gaps (ITL). The systems are interleaved per
concurrency level (order alternating) so each DI/both ratio shares the machine's noise. A warm-up per
system (one request, then max(C) concurrent ones, 2 output tokens each: this includes DI's first KV
handshake) runs first and is excluded.

The default (tiny, C = 1 4 16) takes a few minutes on 2 cores, most of it the servers' start-up; `--preset
small` a few more (its decode steps take ~15-20 ms at batch 1 on one thread a server there).

    .venv/bin/python bench/serve.py [--preset small] [--concurrency 1 4 16] [--prompt-len 64]
        [--output-len 32] [--requests N] [--duration 60] [--dtype bfloat16] [--kv-dtype fp8]
        [--decoder gk-native] [--threads 1] [--no-vllm] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import random
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gigadecode.checkpoint import make_checkpoint  # noqa: E402
from gigadecode.demo import free_port, wait_healthy  # noqa: E402
from gigadecode.engine_config import DECODERS  # noqa: E402

CACHE = Path.home() / ".cache" / "gigadecode"


# -- processes -------------------------------------------------------------------------------------------
class Procs:
    """Server subprocesses, each logging to its own file; all stopped together (terminate, then kill)."""

    def __init__(self, log_dir: Path, threads: int) -> None:
        self.log_dir, self.threads = log_dir, threads
        self.procs: list[tuple[str, subprocess.Popen, Path]] = []
        # the DI servers sign and check kv_transfer_params with a shared secret: a fresh one per run
        self.kv_secret = os.environ.get("GIGADECODE_KV_SECRET") or secrets.token_hex(32)

    def start(self, name: str, argv: list[str], extra_env: dict[str, str] | None = None) -> subprocess.Popen:
        log = self.log_dir / f"{name}.log"
        env = {**os.environ, "OMP_NUM_THREADS": str(self.threads), "GIGADECODE_API_KEY": "",
               "GIGADECODE_KV_SECRET": self.kv_secret, **(extra_env or {})}
        with open(log, "wb") as f:
            p = subprocess.Popen(argv, env=env, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.procs.append((name, p, log))
        return p

    def tail(self, name: str, n: int = 25) -> str:
        for nm, _, log in self.procs:
            if nm == name:
                return "\n".join(log.read_text(errors="replace").splitlines()[-n:])
        return ""

    def stop(self, names: list[str] | None = None) -> None:
        victims = [(n, p) for n, p, _ in self.procs if names is None or n in names]
        for _, p in victims:
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + 10
        for _, p in victims:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)

    def alive(self) -> list[str]:
        return [n for n, p, _ in self.procs if p.poll() is None]


def metric(url: str, name: str) -> float:
    text = urllib.request.urlopen(url + "/metrics", timeout=5).read().decode()
    m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.eE+-]+)$", text, re.M)
    return float(m.group(1)) if m else float("nan")


@dataclass
class System:
    name: str
    url: str                      # where the load goes
    commands: list[str]
    startup_s: float = 0.0


def engine_flags(args: argparse.Namespace, num_blocks: int, max_seqs: int) -> list[str]:
    return ["--served-model-name", args.model_name, "--dtype", args.dtype, "--kv-dtype", args.kv_dtype,
            "--decoder", args.decoder, "--block-size", str(args.block_size), "--num-blocks", str(num_blocks),
            "--max-num-seqs", str(max_seqs), "--log-level", "warning"]


def start_gigadecode(procs: Procs, args: argparse.Namespace, model_dir: Path, flags: list[str]) -> list[System]:
    gd = [sys.executable, "-m", "gigadecode"]
    pp, dp, xp, bp = (free_port() for _ in range(4))
    pre_url, dec_url, px_url, both_url = (f"http://127.0.0.1:{p}" for p in (pp, dp, xp, bp))
    cmds = {
        "prefill": gd + ["serve", "--model", str(model_dir), "--role", "prefill", "--port", str(pp), *flags],
        "decode": gd + ["serve", "--model", str(model_dir), "--role", "decode", "--port", str(dp), *flags],
        "proxy": gd + ["proxy", "--prefill", pre_url, "--decode", dec_url, "--port", str(xp), "--log-level", "warning"],
        "both": gd + ["serve", "--model", str(model_dir), "--role", "both", "--port", str(bp), *flags],
    }
    t0 = time.perf_counter()
    ps = {n: procs.start(n, c) for n, c in cmds.items()}
    out = []
    try:
        wait_healthy(both_url, [ps["both"]], args.startup_timeout)
        out.append(System("both", both_url, [" ".join(cmds["both"])], time.perf_counter() - t0))
        for u, n in ((pre_url, "prefill"), (dec_url, "decode"), (px_url, "proxy")):
            wait_healthy(u, [ps[n]], args.startup_timeout)
    except (RuntimeError, TimeoutError):
        for n in cmds:
            print(f"--- {n} log (tail) ---\n{procs.tail(n)}", file=sys.stderr)
        raise
    di = System("DI", px_url, [" ".join(cmds[n]) for n in ("prefill", "decode", "proxy")], time.perf_counter() - t0)
    di.decode_url = dec_url  # type: ignore[attr-defined]
    return [di, *out]


def start_vllm(procs: Procs, args: argparse.Namespace, model_dir: Path, max_seqs: int) -> System | None:
    port = free_port()
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--dtype", args.dtype, "--host", "127.0.0.1", "--port", str(port),
            "--served-model-name", args.model_name, "--max-model-len", str(args.prompt_len + args.output_len + 64),
            "--max-num-seqs", str(max_seqs)]
    env = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    t0 = time.perf_counter()
    p = procs.start("vllm", argv, env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, [p], args.vllm_startup_timeout)
    except (RuntimeError, TimeoutError) as e:
        print(f"vLLM CPU server did not come up ({e}); the vLLM column is skipped. Log tail:\n"
              f"{procs.tail('vllm')}", flush=True)
        procs.stop(["vllm"])
        return None
    return System("vLLM-cpu", url, [" ".join(argv)], time.perf_counter() - t0)


# -- load ------------------------------------------------------------------------------------------------
@dataclass
class Req:
    start: float = 0.0
    ttft: float | None = None
    end: float = 0.0
    n_tokens: int = 0
    gaps: list[float] = field(default_factory=list)
    error: str | None = None


async def one_request(client: httpx.AsyncClient, url: str, body: dict) -> Req:
    r = Req(start=time.perf_counter())
    last, usage_tokens = None, None
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                r.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return r
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                obj = json.loads(data)
                if "error" in obj:
                    r.error = str(obj["error"])[:200]
                    break
                if obj.get("usage"):
                    usage_tokens = obj["usage"].get("completion_tokens")
                ch = obj.get("choices") or []
                if not ch:
                    continue
                ids = ch[0].get("token_ids")
                k = len(ids) if ids is not None else (1 if ch[0].get("text") or not ch[0].get("finish_reason") else 0)
                if k == 0:
                    continue
                if last is None:
                    r.ttft = now - r.start
                else:
                    r.gaps += [(now - last) / k] * k
                last = now
                r.n_tokens += k
    except (httpx.HTTPError, ValueError) as e:
        r.error = f"{type(e).__name__}: {e}"
    r.end = time.perf_counter()
    if usage_tokens is not None:
        r.n_tokens = usage_tokens
    return r


def body_for(args: argparse.Namespace, prompt: list[int], max_tokens: int) -> dict:
    return {"model": args.model_name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "return_token_ids": True,
            "stream_options": {"include_usage": True}}


async def run_level(url: str, args: argparse.Namespace, prompts: list[list[int]], conc: int) -> tuple[list[Req], float]:
    n_req = len(prompts)
    nxt = 0
    out: list[Req] = []
    limits = httpx.Limits(max_connections=conc + 4, max_keepalive_connections=conc + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.request_timeout, connect=10), limits=limits) as client:
        t0 = time.perf_counter()
        deadline = t0 + args.duration

        async def worker() -> None:
            nonlocal nxt
            while nxt < n_req and time.perf_counter() < deadline:
                i, nxt = nxt, nxt + 1
                out.append(await one_request(client, url, body_for(args, prompts[i], args.output_len)))

        await asyncio.gather(*(worker() for _ in range(conc)))
        wall = time.perf_counter() - t0
    return out, wall


async def warm_up(url: str, args: argparse.Namespace, prompts: list[list[int]], conc: int) -> list[str]:
    limits = httpx.Limits(max_connections=conc + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.request_timeout, connect=10), limits=limits) as client:
        errs = [(await one_request(client, url, body_for(args, prompts[0], 2))).error]
        rs = await asyncio.gather(*(one_request(client, url, body_for(args, p, 2)) for p in prompts[:conc]))
    return [e for e in errs + [r.error for r in rs] if e]


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


@dataclass
class Stats:
    sent: int
    ok: int
    errors: int
    short: int
    wall: float
    req_s: float
    tok_s: float
    ttft: tuple[float, float, float]
    itl: tuple[float, float, float]
    first_error: str | None


def summarize(reqs: list[Req], wall: float, n_out: int) -> Stats:
    ok = [r for r in reqs if r.error is None]
    errs = [r for r in reqs if r.error is not None]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    gaps = [g for r in ok for g in r.gaps]
    pct = lambda xs: tuple(percentile(xs, q) for q in (50, 90, 99))  # noqa: E731
    return Stats(len(reqs), len(ok), len(errs), sum(r.n_tokens != n_out for r in ok), wall, len(ok) / wall,
                 sum(r.n_tokens for r in ok) / wall, pct(ttfts), pct(gaps), errs[0].error if errs else None)


# -- main ------------------------------------------------------------------------------------------------
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--model", default=None, help="checkpoint directory (default ~/.cache/gigadecode/<preset>)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=None, help="default 1 4 16 (--quick: 1 4)")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--requests", type=int, default=None, help="requests per level, at least C (default max(8, 4*C))")
    ap.add_argument("--duration", type=float, default=60.0, help="per system and level: stop sending after this")
    ap.add_argument("--request-timeout", type=float, default=300.0)
    ap.add_argument("--kv-dtype", default="fp8", choices=["auto", "bf16", "fp8"])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--decoder", default="gk-native", choices=DECODERS)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each server process")
    ap.add_argument("--startup-timeout", type=float, default=300.0)
    ap.add_argument("--vllm-startup-timeout", type=float, default=600.0)
    ap.add_argument("--no-vllm", action="store_true", help="skip vLLM even if it is installed")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="smoke run: concurrency 1 4, prompt 16, output 8, 4 requests")
    args = ap.parse_args()
    if args.quick:
        args.concurrency, args.prompt_len, args.output_len = args.concurrency or [1, 4], 16, 8
        args.requests = args.requests or 4
    args.concurrency = args.concurrency or [1, 4, 16]
    model_dir = Path(args.model) if args.model else CACHE / args.preset
    if not (model_dir / "config.json").exists():
        print(f"writing the {args.preset} checkpoint to {model_dir} ...", flush=True)
        make_checkpoint(model_dir, args.preset, seed=0)
    args.model_name = model_dir.resolve().name
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]

    C_max, P, N, B = max(args.concurrency), args.prompt_len, args.output_len, args.block_size
    max_seqs = max(64, C_max)
    num_blocks = C_max * 2 * (-(-(P + N + B) // B)) + 64
    flags = engine_flags(args, num_blocks, max_seqs)
    n_req = {c: max(args.requests, c) if args.requests else max(8, 4 * c) for c in args.concurrency}
    rng = random.Random(args.seed)
    prompts = {c: [[rng.randrange(3, vocab) for _ in range(P)] for _ in range(n_req[c])] for c in args.concurrency}
    warm_prompts = [[rng.randrange(3, vocab) for _ in range(P)] for _ in range(C_max)]

    def on_term(signum, frame):  # make SIGTERM unwind like Ctrl-C, so the servers are stopped
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    have_vllm = importlib.util.find_spec("vllm") is not None
    vllm_status = "not installed" if not have_vllm else "--no-vllm" if args.no_vllm else "failed to start"
    with ExitStack() as stack:
        log_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="gigadecode-bench-serve-")))
        procs = Procs(log_dir, args.threads)
        stack.callback(procs.stop)
        print(f"model {model_dir}  prompt {P}  output {N}  kv {args.kv_dtype}  decoder {args.decoder}  "
              f"threads/server {args.threads}  cpus {os.cpu_count()}  requests/level "
              f"{', '.join(f'C={c}: {n_req[c]}' for c in args.concurrency)} (cap {args.duration:.0f}s)", flush=True)
        systems = start_gigadecode(procs, args, model_dir, flags)
        for s in systems:
            print(f"  {s.name} up in {s.startup_s:.1f}s:", *(f"\n    {c}" for c in s.commands), flush=True)
        if args.no_vllm:
            print("vLLM: skipped (--no-vllm)")
        elif not have_vllm:
            print("vLLM CPU is not installed here (`import vllm` fails in this venv): the vLLM column is skipped")
        else:
            v = start_vllm(procs, args, model_dir, max_seqs)
            if v is not None:
                print(f"  {v.name} up in {v.startup_s:.1f}s:\n    {v.commands[0]}", flush=True)
                systems.append(v)

        for s in list(systems):
            t0 = time.perf_counter()
            errs = asyncio.run(warm_up(s.url, args, warm_prompts, C_max))
            print(f"  warm-up {s.name}: {time.perf_counter() - t0:.1f}s (excluded)"
                  + (f"  ERRORS {len(errs)}: {errs[0]}" if errs else ""), flush=True)
            if errs and s.name == "vLLM-cpu":
                vllm_status = "failed its warm-up"
                systems.remove(s)
                procs.stop(["vllm"])

        results: dict[int, dict[str, Stats]] = {}
        for li, c in enumerate(args.concurrency):
            results[c] = {}
            order = systems if li % 2 == 0 else systems[::-1]
            for s in order:
                reqs, wall = asyncio.run(run_level(s.url, args, prompts[c], c))
                st = summarize(reqs, wall, N)
                results[c][s.name] = st
                print(f"  C={c:<3} {s.name:<9} {st.ok}/{st.sent} ok in {wall:5.1f}s  {st.tok_s:7.1f} tok/s"
                      + (f"  ERRORS {st.errors}: {st.first_error}" if st.errors else "")
                      + (f"  {st.short} requests with != {N} tokens" if st.short else ""), flush=True)

        di = next(s for s in systems if s.name == "DI")
        kv_bytes = metric(di.decode_url, "gigadecode_kv_bytes_transferred_total")  # type: ignore[attr-defined]
        kv_fail = metric(di.decode_url, "gigadecode_kv_transfer_failures_total")  # type: ignore[attr-defined]

    print("servers stopped\n")
    names = [s.name for s in systems]
    ms = lambda t: " ".join(f"{x * 1e3:>{w}.1f}" for x, w in zip(t, (11, 7, 7)))  # noqa: E731
    print(f"{'C':>3} {'system':<9} {'ok/sent':>7} {'req/s':>7} {'out tok/s':>9} | {'TTFT ms p50':>11} {'p90':>7} "
          f"{'p99':>7} | {'ITL ms p50':>11} {'p90':>7} {'p99':>7}")
    for c in args.concurrency:
        res = results[c]
        for n in names:
            st = res[n]
            print(f"{c:>3} {n:<9} {f'{st.ok}/{st.sent}':>7} {st.req_s:>7.2f} {st.tok_s:>9.1f} | "
                  f"{ms(st.ttft)} | {ms(st.itl)}")
        if "DI" in res and "both" in res:
            a, b = res["DI"], res["both"]
            r = lambda x, y, w=7: f"{x / y:>{w}.2f}" if y and y == y and x == x else f"{'-':>{w}}"  # noqa: E731
            lat = lambda xs, ys: " ".join(r(x, y, w) for x, y, w in zip(xs, ys, (11, 7, 7)))  # noqa: E731
            print(f"{c:>3} {'DI/both':<9} {'':>7} {r(a.req_s, b.req_s)} {r(a.tok_s, b.tok_s, 9)} | "
                  f"{lat(a.ttft, b.ttft)} | {lat(a.itl, b.itl)}")
        if "vLLM-cpu" not in names:
            print(f"{c:>3} {'vLLM-cpu':<9} {'skipped: ' + vllm_status}")
    print(f"\nDI/both: throughput > 1 and latency < 1 favour DI. KV moved prefill -> decode: {kv_bytes:.0f} bytes, "
          f"transfer failures {kv_fail:.0f}.")
    bad = sum(st.errors + st.short for res in results.values() for st in res.values())
    return 1 if bad else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("\ninterrupted: all servers stopped", file=sys.stderr)
        sys.exit(130)
