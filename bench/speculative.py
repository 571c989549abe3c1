"""Speculative decoding benchmark: decode speed with drafts against plain decoding, same engine, same tokens.

A verify step of 1 + k rows reads the weights once, but its rows route to more experts than one row, so
its cost grows with k; what it buys depends on how many drafts the model accepts. This measures both, on
one checkpoint, alternating the engines (A B A B …) and quoting medians:
1. the GK step at 1 … k+1 rows of one request (ms, × one row): the break-even acceptance;
2. `--batch` requests (default 1) decoding `--tokens` tokens each together (greedy, bf16, FP8 KV), decode phase
   only (from the last request's first token to the last token):
   - `ngram`: the real n-gram proposer. On a checkpoint with random weights and random prompts nothing
     repeats, so it drafts nothing and this is the lookup's own cost;
   - `told α`: drafts told the plain run's tokens, each kept with probability α (else changed): what a
     workload whose drafts are accepted at rate α gets (code edits, quoting, extraction repeat their
     context; free text does not), with the adaptive draft length (the default) and with `fixed` k.
`=plain`: the speculative runs whose tokens equal the plain run's. In fp32 they all must (the run stops
otherwise); in bf16 a step of several rows may round a logit differently from a 1-row step (bit-identical on
`small`; up to ~0.2 on `20b-shape`, as any change of batch does), so a near-tie can flip.

    .venv/bin/python bench/speculative.py [--preset small] [--k 3] [--tokens 128] [--rounds 3] [--batch 1]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gigadecode.checkpoint import make_checkpoint  # noqa: E402
from gigadecode.engine import LLMEngine  # noqa: E402
from gigadecode.engine_config import EngineConfig  # noqa: E402
from gigadecode.runner import DecodeSeq, ModelRunner  # noqa: E402
from gigadecode.sampling import SamplingParams  # noqa: E402
from gigadecode.speculative import NgramProposer, SpeculativeConfig  # noqa: E402

CACHE = Path.home() / ".cache" / "gigadecode"


class Told(NgramProposer):
    """The n-gram proposer with its lookup replaced: drafts from the plain run's tokens, each kept with
    probability `alpha` (its draft length is the engine's: fixed, or adaptive to the acceptance)."""

    def __init__(self, cfg: SpeculativeConfig, answers: list[list[int]], alpha: float, vocab: int,
                 row_cost: float) -> None:
        super().__init__(cfg)
        self.answers, self.alpha, self.vocab, self.row_cost = answers, alpha, vocab, row_cost
        self.rng = random.Random(1)

    def drafts(self, req, k: int) -> list[int]:
        o = len(req.output_ids)
        answer = self.answers[int(req.request_id.rsplit("-", 1)[1])]
        return [t if self.rng.random() < self.alpha else (t + 1) % self.vocab for t in answer[o: o + k]]


def decode_seconds(eng: LLMEngine, prompts: list[list[int]], n: int) -> tuple[float, list[list[int]]]:
    """The requests (ids "b-0", "b-1", …) run together to the end -> (seconds from the first token to the
    last, their tokens)."""
    p = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    ids = [eng.add_request(q, p, request_id=f"b-{i}") for i, q in enumerate(prompts)]
    while eng.has_unfinished():
        eng.step()
    reqs = [eng.requests.pop(i) for i in ids]
    return (max(r.last_token_time for r in reqs) - max(r.first_token_time for r in reqs),
            [r.output_ids for r in reqs])


def step_rows_ms(runner: ModelRunner, rows: int, context: int, reps: int) -> float:
    """Median ms of a GK decode call of one request's `rows` rows at `context` (its KV borrowed and given
    back)."""
    from gigadecode.kv.manager import KVCacheManager
    mgr = KVCacheManager(runner.kv.config, runner.block_size)
    assert mgr.allocate("b", context + rows, 0)
    tables = mgr.block_tables("b")
    seq = DecodeSeq(11, context, tables, tuple(range(100, 100 + rows - 1)))
    runner.decode([seq])
    t = []
    for _ in range(reps):
        t0 = time.perf_counter()
        runner.decode([seq])
        t.append(time.perf_counter() - t0)
    mgr.free("b")
    return statistics.median(t) * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--model", default=None, help="checkpoint dir (default: the preset's, written once)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--alphas", type=float, nargs="*", default=[1.0, 0.8, 0.5, 0.0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=1, help="requests decoding together")
    args = ap.parse_args()
    model_dir = Path(args.model) if args.model else CACHE / args.preset
    if not (model_dir / "config.json").exists():
        make_checkpoint(model_dir, args.preset, seed=0)
    kv = "fp8" if args.dtype == "bfloat16" else "auto"
    spec = SpeculativeConfig(num_speculative_tokens=args.k)
    plain = LLMEngine(ModelRunner(model_dir, EngineConfig(dtype=args.dtype, kv_dtype=kv)))
    runner = plain.runner
    specu = LLMEngine(ModelRunner(model_dir, EngineConfig(dtype=args.dtype, kv_dtype=kv, speculative=spec),
                                  cfg=runner.cfg, weights=runner.weights))
    ngram = specu.scheduler.proposer
    vocab = runner.cfg.vocab_size
    print(f"model {model_dir}  dtype {args.dtype}  threads {torch.get_num_threads()}  k {args.k}  "
          f"prompt {args.prompt_len}  tokens {args.tokens}", flush=True)

    base = step_rows_ms(runner, 1, args.prompt_len, 15)
    print("GK step of one request's rows (its token + drafts), median ms:")
    for rows in range(1, args.k + 2):
        ms = step_rows_ms(runner, rows, args.prompt_len, 15) if rows > 1 else base
        print(f"  {rows} rows: {ms:7.2f} ms  ×{ms / base:.2f}  (pays from {ms / base - 1:.2f} accepted drafts a step)")

    rng = random.Random(0)
    prompt = [[rng.randrange(3, vocab) for _ in range(args.prompt_len)] for _ in range(args.batch)]
    plain.warm_up()
    specu.warm_up()                  # measures what a draft row costs (the adaptive draft length uses it)
    print(f"a draft row costs {ngram.row_cost:.2f} of a 1-row step (the warm-up's measure)")
    _, want = decode_seconds(plain, prompt, args.tokens)
    fixed = SpeculativeConfig(num_speculative_tokens=args.k, adaptive=False)
    cases = [("ngram", ngram)] + [(f"told α={a:g}{' fixed' if not c.adaptive else ''}",  # noqa: E131
                                   Told(c, want, a, vocab, ngram.row_cost))
                                  for a in args.alphas for c in (spec, fixed)]
    print(f"{args.batch} request(s), {args.tokens} tokens each, decode phase (from the last first token), "
          f"median of {args.rounds} alternated pairs:")
    print(f"  {'drafts':<18} {'plain tok/s':>11} {'spec tok/s':>10} {'speedup':>8} {'accepted':>9} {'tok/step':>8} "
          f"{'=plain':>6}")
    for name, proposer in cases:
        specu.scheduler.proposer = proposer
        tp, ts, ratio, same = [], [], [], 0
        decode_seconds(plain, prompt, args.tokens)                  # a pair not counted: both warm for this case
        decode_seconds(specu, prompt, args.tokens)
        s0 = specu.stats.as_dict()
        for _ in range(args.rounds):
            dt_p, got_p = decode_seconds(plain, prompt, args.tokens)
            dt_s, got_s = decode_seconds(specu, prompt, args.tokens)
            if args.dtype == "float32":
                assert got_p == want and got_s == want, "speculative decoding changed the tokens in fp32"
            same += got_s == got_p
            tp.append(args.batch * (args.tokens - 1) / dt_p)
            ts.append(args.batch * (args.tokens - 1) / dt_s)
            ratio.append(dt_p / dt_s)
        s1 = specu.stats.as_dict()
        drafted = s1["spec_draft_tokens"] - s0["spec_draft_tokens"]
        acc = s1["spec_accepted_tokens"] - s0["spec_accepted_tokens"]
        steps = s1["steps"] - s0["steps"] - args.rounds             # decode steps: less each run's prefill
        per_step = (args.tokens - 1) * args.rounds / max(1, steps)          # a request's tokens a step
        print(f"  {name:<18} {statistics.median(tp):11.1f} {statistics.median(ts):10.1f} "
              f"{statistics.median(ratio):7.2f}× {acc:4d}/{drafted:<4d} {per_step:8.2f} {same:>3}/{args.rounds}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
