"""Draft acceptance of the model-free proposers on a trained checkpoint: plain decoding, n-gram lookup and
suffix decoding on the same chat requests, served one after another as a user sends them (so suffix
decoding's cache of earlier outputs fills as the run goes on). Greedy, fp32, so every run must give plain
decoding's tokens (the run stops otherwise).

Reported per proposer: decode steps, drafts made and accepted, acceptance, tokens per step, and the wall
time of the whole run (this machine is noisy: the steps are the stable figure; on `small` a draft row costs
~0.2-0.4 of a one-row step, `bench/speculative.py`). The default checkpoint is the packaged `demo` model, which
answers "What is A + B?" with its working on harmony's analysis channel.

    .venv/bin/python bench/spec_acceptance.py [--model demo] [--requests 24] [--k 4] [--proposers plain suffix]
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
from gigadecode.checkpoint import TRAINED  # noqa: E402
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
    ap.add_argument("--proposers", nargs="*", default=None,
                    help="run only these (plain, ngram, suffix, suffix-fixed); the tokens are then checked against "
                         "plain decoding's only if it runs first")
    args = ap.parse_args()
    model_dir = TRAINED[args.model] if args.model in TRAINED else resolve_model(args.model)
    codec = TextCodec.from_dir(model_dir)
    rng = random.Random(0)
    prompts = [codec.apply_chat_template([{"role": "user", "content": f"What is {rng.randrange(100)} + "
                                                                       f"{rng.randrange(100)}?"}])
               for _ in range(args.requests)]
    runs = {
        "plain": None,
        "ngram": SpeculativeConfig(num_speculative_tokens=args.k),
        "suffix": SpeculativeConfig(method="suffix", num_speculative_tokens=args.k),
        "suffix-fixed": SpeculativeConfig(method="suffix", num_speculative_tokens=args.k, adaptive=False),
    }
    base = None
    print(f"{args.model}: {args.requests} chat requests one after another, greedy, fp32, k = {args.k}")
    print(f"{'proposer':<15} {'tokens':>7} {'steps':>6} {'drafted':>8} {'accepted':>9} {'accept':>7} "
          f"{'tok/step':>9} {'wall s':>7}")
    for name, spec in runs.items():
        if args.proposers is not None and name not in args.proposers:
            continue
        ecfg = EngineConfig(dtype="float32", kv_dtype="auto", speculative=spec)
        eng = LLMEngine(ModelRunner(model_dir, ecfg))
        outs, wall = serve_one_by_one(eng, prompts, args.max_tokens)
        if base is None:
            base = outs
        elif outs != base:
            sys.exit(f"{name}: the tokens differ from plain decoding's")
        s = eng.stats
        n = sum(map(len, outs))
        acc = s.spec_accepted_tokens / s.spec_draft_tokens if s.spec_draft_tokens else 0.0
        print(f"{name:<15} {n:>7} {s.steps:>6} {s.spec_draft_tokens:>8} {s.spec_accepted_tokens:>9} "
              f"{acc:>7.0%} {n / s.steps:>9.2f} {wall:>7.1f}")


if __name__ == "__main__":
    main()
