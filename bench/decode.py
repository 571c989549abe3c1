"""Decode and prefill benchmark: the GK program (native kernels) against the per-layer loop, transformers,
and this machine's streaming-read bandwidth, all measured in the same run.

Decode: for each batch and context, one step per decoder, alternated (A B A B …) so they share the machine's
noise; medians. The KV cache is filled with random values and block tables of the full context (the cost of
a decode step does not depend on the values), so long contexts need no prefill. Reported per step: ms,
tok/s, weight bytes read per token (from the config: attention + router + norms + lm_head + the expected
number of distinct experts a batch hits, E·(1-(1-k/E)^B), at their stored size), and MBU = bytes read per
second / the streaming-read bandwidth measured around that row (`GB/s`: torch.sum over a 1 GiB fp32 tensor,
the median of 5 passes just before the row and 5 just after; a shared machine's bandwidth can move by a quarter
from one minute to the next, and dip for a second, so each row is set against its own minutes' figure, and the
header's is the run's first); the
compute peak (a 2048^3 GEMM in the dtype the bf16 model's products run in here: bf16 where the CPU has bf16
GEMMs and they are not slower than fp32 ones, else fp32, `gigadecode.gemm`) is measured beside it, since large
batches and prefill meet it first.
`ceiling` is the step's limit on this machine from those two measurements (its weight bytes at the bandwidth
or its multiply-adds at the GEMM peak, whichever is slower) and `of it` the share of it reached: a batch-B
speedup over batch 1 can be no larger than the ratio of the two ceilings.
Prefill: tokens/s of a 512- and a 4096-token prompt through the engine's chunked prefill (`--prefill-chunk`,
default the engine's `--max-prefill-tokens`)
against transformers' `GptOssForCausalLM` forward on the same checkpoint, when it fits in memory: in bf16
where the CPU's bf16 GEMMs are as fast as its fp32 ones, else in fp32 (what a transformers user runs there).
Peak RSS is reported against the checkpoint's bytes.

    .venv/bin/python bench/decode.py [--preset small] [--batch 1 8 32] [--context 256 4096] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gigadecode import native  # noqa: E402
from gigadecode.checkpoint import make_checkpoint  # noqa: E402
from gigadecode.config import GptOssConfig  # noqa: E402
from gigadecode.engine_config import DEFAULT_MAX_PREFILL_TOKENS, EngineConfig  # noqa: E402
from gigadecode.gemm import product_dtype  # noqa: E402
from gigadecode.gk.attn_control import build_attention_control  # noqa: E402
from gigadecode.gk.model import GptOssGKDecodeModel  # noqa: E402
from gigadecode.kv.cache import KVCache  # noqa: E402
from gigadecode.kv.manager import KVCacheManager  # noqa: E402
from gigadecode.kv.spec import SlidingWindowSpec  # noqa: E402
from gigadecode.model import GptOssModel, SeqChunk  # noqa: E402
from gigadecode.weights import load_weights  # noqa: E402

CACHE = Path.home() / ".cache" / "gigadecode"


def streaming_read_samples(gib: float = 1.0, reps: int = 5) -> list[float]:
    """GB/s of `reps` sums over a `gib` GiB fp32 tensor (each one whole pass over it)."""
    x = torch.ones(int(gib * 2**30) // 4)
    x.sum()
    t = [_timed(x.sum) for _ in range(reps)]
    del x
    return [int(gib * 2**30) / s / 1e9 for s in t]


def streaming_read_gbs(gib: float = 1.0, reps: int = 5) -> float:
    return statistics.median(streaming_read_samples(gib, reps))


def gemm_peak_gmacs(dtype: torch.dtype, n: int = 2048, reps: int = 5) -> float:
    """This machine's compute peak as oneDNN reaches it: an n x n x n matmul in `dtype`, median of `reps`
    (multiply-adds per second, in G). Batch-32 decode and prefill are bounded by it, not by bandwidth."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    a @ b
    return n ** 3 / statistics.median([_timed(lambda: a @ b) for _ in range(reps)]) / 1e9


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def weight_bytes_per_step(cfg: GptOssConfig, w, batch: int) -> float:
    t = w.tensors
    dense = sum(t[n].numel() * t[n].element_size() for n in
                ("qkv_w", "qkv_b", "o_w", "o_b", "sinks", "router_w", "router_b", "input_norm", "post_norm",
                 "norm", "lm_head") if n in t)
    E, k = cfg.num_local_experts, cfg.num_experts_per_tok
    names = ("gate_up_blocks", "gate_up_scales", "down_blocks", "down_scales") if w.mxfp4 else ("gate_up", "down")
    per_expert = sum(t[n][0, 0].numel() * t[n].element_size() for n in names + ("gate_up_bias", "down_bias"))
    hit = E * (1 - (1 - k / E) ** batch)
    return dense + cfg.num_hidden_layers * hit * per_expert + batch * cfg.hidden_size * t["embed"].element_size()


def macs_per_token(cfg: GptOssConfig, context: int) -> float:
    """Multiply-adds of one decode token: the projections, the k routed experts, the lm_head, and attention
    over `context` keys (a sliding layer sees at most its window): QK and PV, 2 · heads · d per key."""
    H, d, nh, nkv = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    I, E, k = cfg.intermediate_size, cfg.num_local_experts, cfg.num_experts_per_tok
    per_layer = H * (nh + 2 * nkv) * d + nh * d * H + H * E + k * 3 * H * I
    attn = sum(2 * nh * d * (min(context, cfg.sliding_window) if cfg.is_sliding(i) else context)
               for i in range(cfg.num_hidden_layers))
    return cfg.num_hidden_layers * per_layer + attn + cfg.vocab_size * H


def ceiling_tok_s(cfg: GptOssConfig, wbytes: float, batch: int, context: int, bw_gbs: float,
                  gemm_gmacs: float) -> float:
    """This machine's limit for a decode step, measured in the same run: its weight bytes (`wbytes`) at the
    streaming bandwidth, or its multiply-adds at the GEMM peak, whichever takes longer (tokens per second)."""
    t = max(wbytes / (bw_gbs * 1e9), batch * macs_per_token(cfg, context) / (gemm_gmacs * 1e9))
    return batch / t


class DecodeBench:
    """One batch × context: a KV pool of random values and full tables, one GK model per decoder."""

    def __init__(self, cfg, w, model, dtype: str, batch: int, context: int, block: int, decoders: list[str]) -> None:
        self.cfg, self.model, self.batch, self.block, self.pos = cfg, model, batch, block, context
        ecfg = EngineConfig(dtype=dtype, kv_dtype="fp8", block_size=block)
        per_seq = -(-(context + 1) // block)   # full group; the sliding group keeps a window (after a transient)
        self.kv = KVCache(cfg, ecfg, batch * (per_seq + -(-cfg.sliding_window // block) + 2) + per_seq + 2)
        for buf in self.kv.group_bufs:                       # random KV: values do not change the cost
            buf.copy_((torch.randn(buf.shape) * 0.5).to(buf.dtype))
        self.mgr = KVCacheManager(self.kv.config, block)
        self.rids = [f"r{i}" for i in range(batch)]
        for r in self.rids:
            assert self.mgr.allocate(r, context + 1, 0)
            self.mgr.remove_skipped_blocks(r, context)
        self.sliding = [isinstance(g.spec, SlidingWindowSpec) for g in self.kv.config.groups]
        self.gk = {}
        for d in decoders:
            if d == "per-layer":
                continue
            m = GptOssGKDecodeModel(cfg, w, self.kv.config, block, self.kv.k_scale, self.kv.v_scale,
                                    compiled=d == "gk-compiled", native=d == "gk-native")
            m.bind_kv_cache(self.kv.bind_map())
            self.gk[d] = m

    def step(self, decoder: str) -> None:
        # every decoder re-writes the same position: the same work each sample, no growth
        tables = [self.mgr.block_tables(r) for r in self.rids]
        # a different token per slot, so even the first layer routes the batch's tokens to different experts
        # (one token id for all would send the whole batch to the same 4 there)
        ids = [3 + (i * 7919) % (self.cfg.vocab_size - 3) for i in range(self.batch)]
        if decoder == "per-layer":
            self.model.forward([SeqChunk([t], self.pos, tb) for t, tb in zip(ids, tables)], self.kv)
            return
        ctl = build_attention_control([self.pos] * self.batch, tables, self.sliding, self.model.rope, self.block,
                                      self.cfg.sliding_window, batch_bucket=self.batch)
        self.gk[decoder].decode(torch.tensor(ids), ctl)


def prefill_tok_s(cfg, w, model, dtype: str, n: int, reps: int, chunk: int = DEFAULT_MAX_PREFILL_TOKENS) -> float:
    """Chunked prefill (`chunk` tokens a chunk) of an n-token prompt through the per-layer model, median."""
    ecfg = EngineConfig(dtype=dtype, kv_dtype="fp8", block_size=16)
    kv = KVCache(cfg, ecfg, -(-n // 16) * 2 + 2)
    mgr = KVCacheManager(kv.config, 16)
    prompt = torch.randint(3, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(0)).tolist()
    times = []
    for rep in range(reps):
        rid = f"p{rep}"
        assert mgr.allocate(rid, n, 0)
        t0 = time.perf_counter()
        for s in range(0, n, chunk):
            model.forward([SeqChunk(prompt[s: s + chunk], s, mgr.block_tables(rid), "last")], kv)
        times.append(time.perf_counter() - t0)
        mgr.free(rid)
    return n / statistics.median(times)


def transformers_dtype() -> torch.dtype:
    """What a transformers user runs on this CPU, the faster of its two forwards: bf16 where bf16 GEMMs are as
    fast as fp32 ones (AMX, AVX512-BF16 on a Zen 4: the probe our own projections choose by, `product_dtype`);
    fp32 where they are not (AVX2: torch's bf16 matmul ~100x slower than its fp32 one; an Ice Lake Xeon, whose
    oneDNN runs bf16 GEMMs without bf16 instructions at a fourth of its fp32 GEMM's rate: transformers' fp32
    forward there prefilled `small` 2.2x faster than its bf16 one)."""
    return product_dtype(torch.bfloat16)


def transformers_prefill_tok_s(model_dir: Path, cfg, n: int, reps: int, budget_s: float = 60.0) -> float | None:
    """transformers' forward (in `transformers_dtype()`) over an n-token prompt: median of up to `reps` runs,
    fewer once they have taken `budget_s`."""
    try:
        from transformers import GptOssForCausalLM
    except ImportError:
        return None
    m = GptOssForCausalLM.from_pretrained(model_dir, torch_dtype=transformers_dtype()).eval()
    ids = torch.randint(3, cfg.vocab_size, (1, n), generator=torch.Generator().manual_seed(0))
    times = []
    with torch.inference_mode():
        m(ids[:, :16])
        for _ in range(reps):
            times.append(_timed(lambda: m(ids, logits_to_keep=1)))
            if sum(times) > budget_s:
                break
    del m
    gc.collect()
    return n / statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--model", default=None, help="checkpoint dir (default: the preset's, written once)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--batch", type=int, nargs="*", default=[1, 8, 32])
    ap.add_argument("--context", type=int, nargs="+", default=[256, 4096])
    ap.add_argument("--decoders", nargs="+", default=["gk-native", "per-layer"])
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--prefill", type=int, nargs="*", default=[512, 4096])
    ap.add_argument("--prefill-chunk", type=int, default=DEFAULT_MAX_PREFILL_TOKENS,
                    help=f"prompt tokens a prefill step (default {DEFAULT_MAX_PREFILL_TOKENS}, the engine's)")
    ap.add_argument("--no-transformers", action="store_true", help="skip the transformers prefill baseline")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()
    model_dir = Path(args.model) if args.model else CACHE / args.preset
    if not (model_dir / "config.json").exists():
        print(f"writing the {args.preset} checkpoint to {model_dir} ...", flush=True)
        make_checkpoint(model_dir, args.preset, seed=0)
    ckpt_bytes = sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))
    bw = streaming_read_gbs()
    gemm_dtype = product_dtype(getattr(torch, args.dtype))
    gemm = gemm_peak_gmacs(gemm_dtype)
    gemm_name = str(gemm_dtype).removeprefix("torch.").replace("float32", "fp32").replace("bfloat16", "bf16")
    print(f"model {model_dir} ({ckpt_bytes / 1e9:.2f} GB)  dtype {args.dtype}  threads {torch.get_num_threads()}  "
          f"kernels {native.status()}  streaming read {bw:.1f} GB/s  {gemm_name} GEMM {gemm:.0f} GMAC/s", flush=True)
    cfg = GptOssConfig.from_hf(model_dir)
    dt = getattr(torch, args.dtype)
    w = load_weights(model_dir, cfg, dt)
    model = GptOssModel(cfg, w, dt)
    results: dict = {"model": str(model_dir), "bandwidth_gbs": bw, "gemm_gmacs": gemm, "gemm_dtype": gemm_name, "dtype": args.dtype,
                     "decode": [], "prefill": []}

    print(f"{'batch':>5} {'ctx':>5} {'decoder':<11} {'ms/step':>8} {'tok/s':>8} {'MB/tok':>7} {'GB/s':>5} {'MBU':>5} {'x base':>7} "
          f"{'ceiling':>8} {'of it':>5}")
    for context in args.context:
        for batch in args.batch:
            bw_samples = streaming_read_samples()             # before the row's KV pool: no higher peak RSS
            b = DecodeBench(cfg, w, model, args.dtype, batch, context, args.block_size, args.decoders)
            for d in args.decoders:                           # warm-up
                b.step(d)
            times: dict[str, list[float]] = {d: [] for d in args.decoders}
            for _ in range(args.steps):
                for d in args.decoders:
                    times[d].append(_timed(lambda: b.step(d)))
            del b
            gc.collect()
            row_bw = statistics.median(bw_samples + streaming_read_samples())   # and after it, once it is freed
            wbytes = weight_bytes_per_step(cfg, w, batch)
            base = statistics.median(times[args.decoders[-1]])
            ceiling = ceiling_tok_s(cfg, wbytes, batch, context, row_bw, gemm)
            for d in args.decoders:
                med = statistics.median(times[d])
                mbu = wbytes / med / 1e9 / row_bw
                row = dict(batch=batch, context=context, decoder=d, ms_per_step=med * 1e3, tok_s=batch / med,
                           mb_per_token=wbytes / batch / 1e6, bandwidth_gbs=row_bw, mbu=mbu, vs_base=base / med,
                           ceiling_tok_s=ceiling)
                results["decode"].append(row)
                print(f"{batch:>5} {context:>5} {d:<11} {med * 1e3:>8.1f} {batch / med:>8.1f} "
                      f"{wbytes / batch / 1e6:>7.1f} {row_bw:>5.1f} {100 * mbu:>4.0f}% {base / med:>7.2f} "
                      f"{ceiling:>8.0f} {100 * batch / med / ceiling:>4.0f}%", flush=True)

    for n in args.prefill:
        ours = prefill_tok_s(cfg, w, model, args.dtype, n, reps=3, chunk=args.prefill_chunk)
        row = dict(tokens=n, chunk=args.prefill_chunk, gigadecode_tok_s=ours)
        print(f"prefill {n:>5} tokens ({args.prefill_chunk} a chunk): gigadecode {ours:8.1f} tok/s", end="", flush=True)
        results["prefill"].append(row)
        print()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024     # before transformers loads its copy
    results["peak_rss_bytes"] = peak
    print(f"peak RSS {peak / 1e9:.2f} GB = {peak / ckpt_bytes:.2f}x the checkpoint's bytes", flush=True)
    if args.prefill and not args.no_transformers:
        del model, w
        gc.collect()
        tf_dtype = transformers_dtype()
        tf_name = str(tf_dtype).removeprefix("torch.").replace("bfloat16", "bf16").replace("float32", "fp32")
        results["transformers_dtype"] = tf_name
        # experts dequantized at load: ~4x MXFP4's bytes in bf16, ~8x in fp32
        tf_bytes = ckpt_bytes * (4 if tf_dtype == torch.bfloat16 else 8)
        avail = int(Path("/proc/meminfo").read_text().split("MemAvailable:")[1].split()[0]) * 1024
        if tf_bytes > 0.8 * avail:
            print(f"transformers baseline skipped: a {tf_name} copy (~{tf_bytes / 1e9:.0f} GB) does not fit in memory")
        else:
            rate = None                                    # transformers' tok/s at the previous (shorter) prompt
            for row in sorted(results["prefill"], key=lambda r: r["tokens"]):
                if rate and row["tokens"] / rate > 600:       # a run would take over 10 minutes: say so, skip it
                    print(f"prefill {row['tokens']:>5} tokens: transformers skipped (~{row['tokens'] / rate / 60:.0f}"
                          f" min a run at its {rate:.1f} tok/s of the shorter prompt)", flush=True)
                    continue
                tf = rate = transformers_prefill_tok_s(model_dir, cfg, row["tokens"], reps=3)
                if tf:
                    row["transformers_tok_s"] = tf
                    print(f"prefill {row['tokens']:>5} tokens: transformers {tf_name} {tf:8.1f} tok/s -> gigadecode "
                          f"{row['gigadecode_tok_s'] / tf:.2f}x", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
