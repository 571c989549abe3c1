"""Prefix caching: the time to the first token of a prompt that starts like an earlier one, with and without
`--enable-prefix-caching`.

Each round is a chat-like request: a shared prefix of --prefix tokens (a system prompt, or the earlier turns
of a conversation) and a fresh suffix of --suffix tokens, one generated token. Two engines on the same stacked
weights (bf16, packed-FP8 KV, the serving defaults) take the same prompts in turn, A B A B: the caching one
finds the prefix's whole blocks (computed once before the timed rounds) and prefills only the rest; the other
prefills everything. Printed: each side's median TTFT and the ratio, and the prompt tokens each computed.

    .venv/bin/python bench/prefix_cache.py [--preset small] [--prefix 1024] [--suffix 64] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gigadecode.checkpoint import make_checkpoint  # noqa: E402
from gigadecode.config import GptOssConfig  # noqa: E402
from gigadecode.engine import LLMEngine  # noqa: E402
from gigadecode.engine_config import EngineConfig  # noqa: E402
from gigadecode.runner import ModelRunner  # noqa: E402
from gigadecode.sampling import SamplingParams  # noqa: E402
from gigadecode.weights import load_weights  # noqa: E402

CACHE = Path.home() / ".cache" / "gigadecode"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--prefix", type=int, default=1024)
    ap.add_argument("--suffix", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    ckpt = make_checkpoint(CACHE / args.preset, args.preset)
    cfg = GptOssConfig.from_hf(ckpt)
    weights = load_weights(ckpt, cfg, torch.bfloat16)
    engines = {}
    for cache in (True, False):
        ecfg = EngineConfig(dtype="bfloat16", kv_dtype="fp8", enable_prefix_caching=cache,
                            max_model_len=args.prefix + args.suffix + 8)
        engines[cache] = LLMEngine(ModelRunner(ckpt, ecfg, cfg=cfg, weights=weights))
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, cfg.vocab_size, (args.prefix,), generator=g).tolist()
    one = SamplingParams(temperature=0.0, max_tokens=1)
    for eng in engines.values():                          # warm-up; the caching engine computes the prefix
        eng.warm_up()
        eng.generate([prefix + [1]], one)
    ttft: dict[bool, list[float]] = {True: [], False: []}
    computed = {c: e.stats.prefill_tokens for c, e in engines.items()}
    for r in range(args.rounds):
        prompt = prefix + torch.randint(0, cfg.vocab_size, (args.suffix,), generator=g).tolist()
        outs = {}
        for cache in (True, False) if r % 2 == 0 else (False, True):
            t0 = time.perf_counter()
            outs[cache] = engines[cache].generate([prompt], one)[0].output_ids
            ttft[cache].append(time.perf_counter() - t0)
        same = "same token" if outs[True] == outs[False] else f"tokens {outs[True]} vs {outs[False]} (bf16 near-tie)"
        print(f"round {r}: cached {ttft[True][-1] * 1e3:.1f} ms, uncached {ttft[False][-1] * 1e3:.1f} ms, {same}",
              flush=True)
    per_round = {c: (e.stats.prefill_tokens - computed[c]) / args.rounds for c, e in engines.items()}
    a, b = statistics.median(ttft[True]), statistics.median(ttft[False])
    print(f"{args.preset}, prefix {args.prefix} + suffix {args.suffix} tokens, {torch.get_num_threads()} threads: "
          f"TTFT cached {a * 1e3:.1f} ms vs uncached {b * 1e3:.1f} ms (medians of {args.rounds}): {b / a:.2f}x; "
          f"prompt tokens computed per request {per_round[True]:.0f} vs {per_round[False]:.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
