"""Cold start: how a fresh `gigadecode serve` answers its first request, with the start-up warm-up (the
default) and with `--no-warmup`.

Each round starts one server of each kind in turn (order alternating round by round, so both share the
machine's noise), waits for `/health`, then sends `--requests` streaming `/v1/completions` one after another:
a prompt of `--prompt-len` random token ids (distinct per request, the same list for both kinds), greedy,
`ignore_eos`, `--output-len` new tokens. Measured at the client:
  ready s       process start -> `/health` answers (weights, KV pool, and the warm-up where it runs)
  first TTFT    the first request's send -> first token-carrying SSE chunk
  steady TTFT   the median TTFT of the requests after it
  first/steady  what the first request pays beyond the others (1.00 = full speed from the first request)
  first ITL     the first request's median gap between tokens, against the steady requests'
Reported per kind: the median over rounds of each figure, and of the per-round first/steady ratio.

    .venv/bin/python bench/cold_start.py [--preset small] [--rounds 3] [--prompt-len 500] [--requests 4]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gigadecode.demo import wait_healthy  # noqa: E402
from gigadecode.ports import free_port  # noqa: E402

CACHE = Path(os.environ.get("GIGADECODE_CACHE", Path.home() / ".cache" / "gigadecode"))
KINDS = {"warm-up": [], "no warm-up": ["--no-warmup"]}


def stream_one(port: int, model: str, prompt: list[int], max_tokens: int) -> tuple[float, list[float]]:
    """-> (TTFT s, gaps between token-carrying chunks s) of one streaming completion."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                       "ignore_eos": True, "stream": True}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    stamps: list[float] = []
    with urllib.request.urlopen(req, timeout=600) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if any(c.get("text") for c in json.loads(line[6:]).get("choices", [])):
                stamps.append(time.perf_counter())
    if not stamps:
        raise SystemExit("a request returned no tokens")
    return stamps[0] - t0, [b - a for a, b in zip(stamps, stamps[1:])]


def run_server(model_dir: Path, flags: list[str], prompts: list[list[int]], output_len: int, threads: int) -> dict:
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    t0 = time.perf_counter()
    proc = subprocess.Popen([str(ROOT / ".venv" / "bin" / "gigadecode"), "serve", "--model", str(model_dir),
                             "--port", str(port), "--threads", str(threads), *flags],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc, timeout_s=600.0)
        ready = time.perf_counter() - t0
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=10) as r:
            name = json.load(r)["data"][0]["id"]
        runs = [stream_one(port, name, p, output_len) for p in prompts]
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    steady = statistics.median(t for t, _ in runs[1:])
    steady_itl = statistics.median(g for _, gaps in runs[1:] for g in gaps)
    return {"ready": ready, "first": runs[0][0], "steady": steady, "ratio": runs[0][0] / steady,
            "first_itl": statistics.median(runs[0][1]), "steady_itl": steady_itl}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--model", default=None, help="checkpoint dir (default: the preset's under the cache)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=500)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--requests", type=int, default=4, help="per server: the first, then the steady ones")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    args = ap.parse_args()
    if args.requests < 2 or args.output_len < 2:
        raise SystemExit("--requests and --output-len must be >= 2 (a first request and one to compare it with)")
    model_dir = Path(args.model) if args.model else CACHE / args.preset
    if not (model_dir / "config.json").exists():
        if args.model:
            raise SystemExit(f"no checkpoint at {model_dir}")
        from gigadecode.checkpoint import make_checkpoint
        make_checkpoint(model_dir, args.preset)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    rnd = random.Random(0)
    prompts = [[rnd.randrange(3, vocab) for _ in range(args.prompt_len)] for _ in range(args.requests)]
    print(f"{model_dir}  prompt {args.prompt_len} tokens, {args.output_len} new, {args.requests} requests a "
          f"server, {args.rounds} rounds, threads {args.threads}", flush=True)
    results: dict[str, list[dict]] = {k: [] for k in KINDS}
    for i in range(args.rounds):
        order = list(KINDS) if i % 2 == 0 else list(reversed(KINDS))
        for kind in order:
            r = run_server(model_dir, KINDS[kind], prompts, args.output_len, args.threads)
            results[kind].append(r)
            print(f"round {i} {kind:<11} ready {r['ready']:.1f} s  first TTFT {r['first'] * 1e3:.0f} ms  steady "
                  f"{r['steady'] * 1e3:.0f} ms  ({r['ratio']:.2f}x)  ITL first {r['first_itl'] * 1e3:.1f} ms  "
                  f"steady {r['steady_itl'] * 1e3:.1f} ms", flush=True)
    print(f"\n{'server':<11} {'ready s':>8} {'first TTFT ms':>14} {'steady TTFT ms':>15} {'first/steady':>13} "
          f"{'first ITL ms':>13} {'steady ITL ms':>14}")
    for kind, rs in results.items():
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        print(f"{kind:<11} {med['ready']:>8.1f} {med['first'] * 1e3:>14.0f} {med['steady'] * 1e3:>15.0f} "
              f"{med['ratio']:>12.2f}x {med['first_itl'] * 1e3:>13.1f} {med['steady_itl'] * 1e3:>14.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
