"""Engine benchmark: our engine (continuous batching, chunked prefill, the native GK decode program) against
transformers' `generate` on the same checkpoint.

At each concurrency C, C greedy requests (prompt --prompt-len random tokens, exactly --output-len new
tokens: ignore_eos) arrive together. Our engine runs them to completion through `add_request` / `step`
with the engine's defaults (`--decoder gk-native`, bf16 compute, packed-FP8 KV, all cores); transformers'
`GptOssForCausalLM.generate` runs the same prompts as one batch (left padding + attention mask, greedy,
`eos_token_id=-1`) in bf16 where this CPU's bf16 GEMMs are as fast as its fp32 ones, else in fp32 (what a
transformers user runs there; `gigadecode.gemm.product_dtype`). Both are measured the same way: output
tok/s = C * output-len / wall time (prefill included); TTFT = arrival -> first token; inter-token latency
(ITL) = gaps between a request's consecutive tokens (ours: the end of the engine step that produced it;
transformers: a logits processor's timestamp per step), median and p90 over all requests. The runs are
interleaved per concurrency, so each ratio ours/transformers shares the machine's noise.

`in model` is the share of our wall time spent inside the model runner's prefill and decode calls (the
kernels); the rest is the engine's own work per step (scheduling, block tables, sampling, stop checks,
outputs) — what a step costs beyond the decode program that `bench/decode.py` times alone.

A warm-up (excluded, its time printed) runs first: two batch-1 decode calls for the native and eager
decoders; for gk-compiled two calls at every batch bucket and KV table width the timed runs use (its
compilation; Inductor caches it on disk); and a short transformers `generate`.

Greedy check: our batch-1 tokens vs transformers' batch-1 tokens for the same prompt, both fp32 (an extra
fp32 / model-dtype-KV batch-1 run of ours when the timed runs use other settings), so they must be equal.
The `=HF` column counts requests whose tokens equal transformers' at every concurrency (informational:
bf16, FP8 KV or batching may change near-ties).

    .venv/bin/python bench/engine.py [--preset small] [--concurrency 1 8 32] [--prompt-len 64]
        [--output-len 64] [--dtype bfloat16] [--kv-dtype fp8] [--decoders gk-native] [--no-hf] [--threads N]
        [--quick]
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
from gigadecode.engine_config import DECODERS, EngineConfig, default_threads  # noqa: E402
from gigadecode.engine import build_engine  # noqa: E402
from gigadecode.gemm import product_dtype  # noqa: E402
from gigadecode.gk.attn_control import next_pow2  # noqa: E402
from gigadecode.runner import DecodeSeq, ModelRunner  # noqa: E402
from gigadecode.sampling import SamplingParams  # noqa: E402

CACHE = Path.home() / ".cache" / "gigadecode"


class Result:
    def __init__(self, n_tokens: int, wall: float, ttft: list[float], itl: list[float],
                 tokens: list[list[int]], in_model: float | None = None) -> None:
        self.tok_s = n_tokens / wall
        self.wall = wall
        self.in_model = in_model                         # share of the wall time inside the model runner
        self.ttft = statistics.median(ttft)
        self.itl_med = statistics.median(itl) if itl else float("nan")
        self.itl_p90 = percentile(itl, 90) if itl else float("nan")
        self.tokens = tokens


def percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


# -- ours ----------------------------------------------------------------------------------------------
MODEL_CALLS = ("prefill", "decode", "full_logits")     # the runner's calls that run the model's kernels


def run_ours(eng, prompts: list[list[int]], n_out: int) -> Result:
    sp = SamplingParams(temperature=0.0, max_tokens=n_out, ignore_eos=True)
    runner, in_model = eng.runner, [0.0]

    def timed(fn):
        def call(*args, **kwargs):
            t = time.monotonic()
            try:
                return fn(*args, **kwargs)
            finally:
                in_model[0] += time.monotonic() - t
        return call

    for name in MODEL_CALLS:                             # instance attributes shadow the methods for this run
        setattr(runner, name, timed(getattr(runner, name)))
    try:
        t0 = time.monotonic()
        rids = [eng.add_request(p, sp) for p in prompts]
        stamps: dict[str, list[float]] = {r: [] for r in rids}
        while eng.has_unfinished():
            outs = eng.step()
            now = time.monotonic()
            for o in outs:
                if o.error:
                    raise RuntimeError(f"request {o.request_id} failed: {o.error}")
                if o.request_id in stamps:
                    stamps[o.request_id].extend([now] * len(o.new_token_ids))
        wall = time.monotonic() - t0
    finally:
        for name in MODEL_CALLS:
            delattr(runner, name)
    toks = [eng.requests[r].output_ids for r in rids]
    assert all(len(t) == n_out for t in toks), [len(t) for t in toks]
    itl = [b - a for r in rids for a, b in zip(stamps[r], stamps[r][1:])]
    return Result(len(prompts) * n_out, wall, [stamps[r][0] - t0 for r in rids], itl, toks, in_model[0] / wall)


def warm_up_decoder(eng, concurrency: list[int], prompt_len: int, n_out: int) -> float:
    """Two decode calls per (batch bucket, full-table width) the timed runs will use, on scratch blocks of the
    still-empty pool (prefill overwrites them before anything reads them). Two: the first compiled program
    of a process compiles twice (its trace fills `mxfp4._LUT_CACHE`, a guard of the first graph)."""
    B = eng.runner.block_size
    buckets = eng.ecfg.batch_buckets
    positions = range(prompt_len, prompt_len + n_out - 1)
    widths: dict[int, int] = {}
    for p in positions:
        widths.setdefault(next_pow2(p // B + 1), p)
    n_groups = len(eng.runner.kv.config.groups)
    t0 = time.perf_counter()
    if eng.ecfg.decoder != "gk-compiled":          # eager: shapes do not matter, batch 1 is enough
        concurrency, widths = [1], {0: prompt_len}
    for c in concurrency:
        bucket = next(b for b in buckets if b >= min(c, buckets[-1]))
        for p in widths.values():
            table = list(range(1, p // B + 2))
            for _ in range(2):
                eng.runner.decode([DecodeSeq(7, p, [table] * n_groups) for _ in range(bucket)])
    return time.perf_counter() - t0


# -- transformers ----------------------------------------------------------------------------------------
def load_hf(model_dir: Path, dtype: torch.dtype):
    import transformers
    from transformers import GptOssForCausalLM

    transformers.logging.set_verbosity_error()
    m = GptOssForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
    m.eval()
    return m


def run_hf(hf, prompts: list[list[int]], n_out: int, pad_id: int) -> Result:
    from transformers import LogitsProcessor, LogitsProcessorList

    class Stamp(LogitsProcessor):
        def __init__(self) -> None:
            self.t: list[float] = []

        def __call__(self, input_ids, scores):
            self.t.append(time.monotonic())
            return scores

    L = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), L), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), L), dtype=torch.long)
    for i, p in enumerate(prompts):                      # left padding
        ids[i, L - len(p):] = torch.tensor(p)
        mask[i, L - len(p):] = 1
    stamp = Stamp()
    t0 = time.monotonic()
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=n_out, eos_token_id=-1,
                          pad_token_id=pad_id, logits_processor=LogitsProcessorList([stamp]))
    wall = time.monotonic() - t0
    toks = out[:, L:].tolist()
    assert all(len(t) == n_out for t in toks), [len(t) for t in toks]
    itl = [b - a for a, b in zip(stamp.t, stamp.t[1:])] * len(prompts)
    return Result(len(prompts) * n_out, wall, [stamp.t[0] - t0] * len(prompts), itl, toks)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--model", default=None, help="checkpoint directory (default ~/.cache/gigadecode/<preset>)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--kv-dtype", default="fp8", choices=["auto", "bf16", "fp8"])
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--decoders", nargs="+", default=["gk-native"], choices=DECODERS)
    ap.add_argument("--compiled", action="store_true", help="also run the gk-compiled decoder")
    ap.add_argument("--no-hf", action="store_true", help="skip transformers (and the greedy check)")
    ap.add_argument("--threads", type=int, default=0,
                    help="threads, ours and transformers (default 0: the engine's default, the cores available)")
    ap.add_argument("--quick", action="store_true", help="tiny preset (concurrency 1 8, 16 output tokens)")
    args = ap.parse_args()
    if args.quick:
        args.preset, args.concurrency, args.output_len = "tiny", [1, 8], 16
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = args.threads or default_threads()
    hf_dtype = product_dtype(getattr(torch, args.dtype))
    model_dir = Path(args.model) if args.model else CACHE / args.preset
    if not (model_dir / "config.json").exists():
        print(f"writing the {args.preset} checkpoint to {model_dir} ...", flush=True)
        make_checkpoint(model_dir, args.preset, seed=0)

    P, N, B = args.prompt_len, args.output_len, args.block_size
    num_blocks = max(args.concurrency) * 2 * (-(-(P + N + B) // B)) + 16
    base = dict(block_size=B, num_blocks=num_blocks, max_num_seqs=max(64, max(args.concurrency)))
    decoders = list(dict.fromkeys(args.decoders + (["gk-compiled"] if args.compiled else [])))
    t_load = time.perf_counter()
    engines, runner = {}, None
    for d in decoders:
        ecfg = EngineConfig(dtype=args.dtype, kv_dtype=args.kv_dtype, decoder=d, threads=threads, **base)
        r = ModelRunner(model_dir, ecfg, weights=runner.weights if runner else None)
        runner = runner or r
        engines[d] = build_engine(model_dir, ecfg, runner=r)
    cfg = runner.cfg
    print(f"model {model_dir}  dtype {args.dtype}  kv {args.kv_dtype}  block {B}  threads {threads}"
          f"  prompt {P}  output {N}  (ours loaded in {time.perf_counter() - t_load:.0f}s)", flush=True)
    for d, eng in engines.items():
        print(f"  warm-up {d}: {warm_up_decoder(eng, args.concurrency, P, N):.1f}s "
              f"({'incl. compilation, ' if d == 'gk-compiled' else ''}excluded)", flush=True)
    hf = None
    if not args.no_hf:
        t0 = time.perf_counter()
        hf = load_hf(model_dir, hf_dtype)
        pad = cfg.pad_token_id if cfg.pad_token_id is not None else 0
        t1 = time.perf_counter()
        run_hf(hf, [[5, 6, 7, 8]], 2, pad)
        print(f"  transformers ({str(hf_dtype).removeprefix('torch.')}) loaded in {t1 - t0:.0f}s, warm-up "
              f"{time.perf_counter() - t1:.1f}s (excluded)", flush=True)

    g = torch.Generator().manual_seed(0)
    results: dict[int, dict[str, Result]] = {}
    for c in args.concurrency:
        prompts = [torch.randint(3, cfg.vocab_size, (P,), generator=g).tolist() for _ in range(c)]
        results[c] = {}
        for d, eng in engines.items():
            results[c][d] = run_ours(eng, prompts, N)
            print(f"  C={c} {d}: {results[c][d].wall:.1f}s", flush=True)
        if hf is not None:
            results[c]["transformers"] = run_hf(hf, prompts, N, pad)
            print(f"  C={c} transformers: {results[c]['transformers'].wall:.1f}s", flush=True)
        if c == 1:
            prompt1 = prompts[0]

    print(f"\n{'C':>3} {'engine':<13} {'tok/s':>8} {'wall s':>7} {'TTFT ms':>9} {'ITL med ms':>10} "
          f"{'ITL p90 ms':>10} {'in model':>8} {'tok/s ours/HF':>13} {'=HF':>6}")
    for c, res in results.items():
        ref = res.get("transformers")
        for name, r in res.items():
            ratio = f"{r.tok_s / ref.tok_s:.2f}" if ref and name != "transformers" else "-"
            same = (f"{sum(a == b for a, b in zip(r.tokens, ref.tokens))}/{c}"
                    if ref and name != "transformers" else "-")
            in_model = f"{r.in_model:.0%}" if r.in_model is not None else "-"
            print(f"{c:>3} {name:<13} {r.tok_s:>8.2f} {r.wall:>7.1f} {r.ttft * 1e3:>9.1f} {r.itl_med * 1e3:>10.1f} "
                  f"{r.itl_p90 * 1e3:>10.1f} {in_model:>8} {ratio:>13} {same:>6}")

    if hf is not None and 1 in results:
        if hf_dtype == torch.float32:
            want = results[1]["transformers"].tokens[0]
        else:                                            # the check is fp32 against fp32
            del hf
            want = run_hf(load_hf(model_dir, torch.float32), [prompt1], N, pad).tokens[0]
        print()
        for d in decoders:
            if args.dtype == "float32" and args.kv_dtype == "auto":
                got, how = results[1][d].tokens[0], "the timed batch-1 run"
            else:
                ecfg = EngineConfig(dtype="float32", kv_dtype="auto", decoder=d, threads=threads, **base)
                w = runner.weights if args.dtype == "float32" else None
                eng = build_engine(model_dir, ecfg, runner=ModelRunner(model_dir, ecfg, weights=w))
                got, how = run_ours(eng, [prompt1], N).tokens[0], "an extra fp32 / kv auto batch-1 run"
            first_diff = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
            print(f"greedy check, batch 1 ({how}, {d} vs transformers fp32, {N} tokens): "
                  f"{'EQUAL' if got == want else f'DIFFERENT from token {first_diff}'}")
            if got != want:
                print(f"  ours:         {got}\n  transformers: {want}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
