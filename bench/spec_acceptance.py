"""Draft acceptance of the model-free proposers on a trained checkpoint: plain decoding, n-gram lookup and
suffix decoding on the same chat requests, served one after another as a user sends them (so suffix
decoding's cache of earlier outputs fills as the run goes on). Greedy, fp32, so every run must give plain
decoding's tokens (the run stops otherwise).

Reported per proposer: decode steps, drafts made and accepted, acceptance, tokens per step, and the wall
time of the whole run (this machine is noisy: the steps are the stable figure). The default checkpoint is the
packaged `demo` model, which answers "What is A + B?" with its working on harmony's analysis channel; its
steps take ~1 ms of host work, so there fewer steps do not mean less time. `--model small` (a preset,
written once under ~/.cache/gigadecode) reads ~210 MB of weights a step; its random weights give outputs
that repeat nothing, so `--repeat R` sends each of `--requests` random prompts R times in a row (a client's
retries, an eval's repeated samples): the second answer can be drafted from the first's, cached.

    .venv/bin/python bench/spec_acceptance.py [--model demo] [--requests 24] [--k 4] [--proposers plain suffix]
    .venv/bin/python bench/spec_acceptance.py --model small --dtype bfloat16 --requests 4 --repeat 2 --max-tokens 64
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gigadecode.engine import LLMEngine  # noqa: E402
from gigadecode.engine_config import EngineConfig  # noqa: E402
from gigadecode.checkpoint import PRESETS, TRAINED, make_checkpoint  # noqa: E402
from gigadecode.hub import resolve_model  # noqa: E402
from gigadecode.runner import ModelRunner  # noqa: E402
from gigadecode.sampling import SamplingParams  # noqa: E402
from gigadecode.speculative import SpeculativeConfig  # noqa: E402
from gigadecode.tokenizer import TextCodec  # noqa: E402


def serve_one_by_one(eng: LLMEngine, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], float]:
    outs = []
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        rid = eng.add_request(p, SamplingParams(temperature=0.0, max_tokens=max_tokens), request_id=f"q{i}")
        while eng.has_unfinished():
            eng.step()
        outs.append(eng.requests[rid].output_ids)
    return outs, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo")
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens (ngram; suffix's cap)")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="bfloat16 runs FP8 KV (greedy tokens may then differ from plain decoding's at a near-tie)")
    ap.add_argument("--repeat", type=int, default=1, help="send each prompt this many times in a row")
    ap.add_argument("--prompt-len", type=int, default=128, help="random prompts' length (preset models)")
    ap.add_argument("--proposers", nargs="*", default=None,
                    help="run only these (plain, ngram, suffix, suffix-fixed); the tokens are then checked against "
                         "plain decoding's only if it runs first")
    args = ap.parse_args()
    rng = random.Random(0)
    if args.model in PRESETS:
        model_dir = Path.home() / ".cache" / "gigadecode" / args.model
        if not (model_dir / "config.json").exists():
            make_checkpoint(model_dir, args.model, seed=0)
        prompts = [[rng.randrange(3, 1000) for _ in range(args.prompt_len)] for _ in range(args.requests)]
    else:
        model_dir = TRAINED[args.model] if args.model in TRAINED else resolve_model(args.model)
        codec = TextCodec.from_dir(model_dir)
        prompts = [codec.apply_chat_template([{"role": "user", "content": f"What is {rng.randrange(100)} + "
                                                                           f"{rng.randrange(100)}?"}])
                   for _ in range(args.requests)]
    prompts = [p for p in prompts for _ in range(args.repeat)]
    runs = {
        "plain": None,
        "ngram": SpeculativeConfig(num_speculative_tokens=args.k),
        "suffix": SpeculativeConfig(method="suffix", num_speculative_tokens=args.k),
        "suffix-fixed": SpeculativeConfig(method="suffix", num_speculative_tokens=args.k, adaptive=False),
    }
    base, shared = None, None
    print(f"{args.model}: {len(prompts)} requests one after another, greedy, {args.dtype}, k = {args.k}")
    print(f"{'proposer':<15} {'tokens':>7} {'steps':>6} {'drafted':>8} {'accepted':>9} {'accept':>7} "
          f"{'tok/step':>9} {'wall s':>7}")
    for name, spec in runs.items():
        if args.proposers is not None and name not in args.proposers:
            continue
        ecfg = EngineConfig(dtype=args.dtype, kv_dtype="fp8" if args.dtype == "bfloat16" else "auto",
                            speculative=spec)
        runner = ModelRunner(model_dir, ecfg, **shared) if shared else ModelRunner(model_dir, ecfg)
        shared = shared or dict(cfg=runner.cfg, weights=runner.weights)       # one copy of the weights
        eng = LLMEngine(runner)
        eng.warm_up()                 # (and a draft row's cost measured, for the adaptive lengths)
        outs, wall = serve_one_by_one(eng, prompts, args.max_tokens)
        if base is None:
            base = outs
        elif outs != base:
            msg = f"{name}: the tokens differ from plain decoding's"
            if args.dtype == "float32":
                sys.exit(msg)
            print(f"  ({msg}: bf16 rounds a multi-row step differently)")
        s = eng.stats
        n = sum(map(len, outs))
        acc = s.spec_accepted_tokens / s.spec_draft_tokens if s.spec_draft_tokens else 0.0
        print(f"{name:<15} {n:>7} {s.steps:>6} {s.spec_draft_tokens:>8} {s.spec_accepted_tokens:>9} "
              f"{acc:>7.0%} {n / s.steps:>9.2f} {wall:>7.1f}")


if __name__ == "__main__":
    main()
