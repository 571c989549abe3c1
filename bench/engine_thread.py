"""The server's engine thread against the engine on the main thread: the same requests through
`LLMEngine.generate` (what `gigadecode generate` runs) and through `AsyncEngine` (what `serve` runs: the engine
stepped on its own thread, outputs delivered to asyncio), alternated, medians and the median pair ratio.

A server's overhead over the bare engine should be a few percent; before the engine thread's start ended
the loading thread's OpenMP pool (`gigadecode/openmp.py`) it was 1.35x on 2 cores.

    .venv/bin/python bench/engine_thread.py [--preset small] [--batch 8] [--prompt-len 64] [--output-len 128]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gigadecode.checkpoint import make_checkpoint  # noqa: E402
from gigadecode.cli import build_parser, engine_config  # noqa: E402
from gigadecode.engine import build_engine  # noqa: E402
from gigadecode.sampling import SamplingParams  # noqa: E402
from gigadecode.server.async_engine import AsyncEngine  # noqa: E402

CACHE = Path.home() / ".cache" / "gigadecode"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    model_dir = CACHE / args.preset
    if not (model_dir / "config.json").exists():
        make_checkpoint(model_dir, args.preset, seed=0)
    # the defaults serve and generate use (bf16 on GPT-OSS checkpoints, FP8 KV, gk-native, all cores)
    eng = build_engine(model_dir, engine_config(build_parser().parse_args(["serve", "--model", str(model_dir)])))
    rng = random.Random(0)
    prompts = [[rng.randrange(3, eng.runner.cfg.vocab_size) for _ in range(args.prompt_len)] for _ in range(args.batch)]
    sp = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    eng.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))   # warm-up

    def on_main() -> float:
        t = time.perf_counter()
        eng.generate(prompts, sp)
        return time.perf_counter() - t

    def on_thread(rnd: int) -> float:
        aeng = AsyncEngine(eng)
        aeng.start()

        async def run() -> float:
            async def one(i: int) -> None:
                async for _ in aeng.generate(prompts[i], sp, f"r{rnd}-{i}"):
                    pass
            t = time.perf_counter()
            await asyncio.gather(*[one(i) for i in range(len(prompts))])
            return time.perf_counter() - t
        try:
            return asyncio.run(run())
        finally:
            aeng.stop(timeout=None)

    main_s, thread_s = [], []
    for rnd in range(args.rounds):
        main_s.append(on_main())
        thread_s.append(on_thread(rnd))
        print(f"round {rnd}: main thread {main_s[-1]:.2f} s, engine thread {thread_s[-1]:.2f} s", flush=True)
    ratio = statistics.median(t / m for t, m in zip(thread_s, main_s))
    n = args.batch * args.output_len
    print(f"{args.preset}, {args.batch} requests x {args.output_len} tokens: main thread "
          f"{n / statistics.median(main_s):.1f} tok/s, engine thread {n / statistics.median(thread_s):.1f} tok/s; "
          f"engine thread / main thread time {ratio:.3f} (median of pair ratios)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
