"""Prefill attention: the native flash kernel against the torch flash form (`ops.flash_sink_attention`), both
in one process and alternated call by call (medians and the median pair ratio) — the op alone over a chunk
of queries at the end of a long context, and a whole chunked prefill of a preset's model with the one or the
other as its attention (everything else shared).

    .venv/bin/python bench/prefill_attention.py --preset small --context 4096 --prefill 512 4096
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from decode import CACHE, prefill_tok_s  # noqa: E402
from gigadecode import native  # noqa: E402
from gigadecode.checkpoint import make_checkpoint  # noqa: E402
from gigadecode.config import GptOssConfig  # noqa: E402
from gigadecode.model import GptOssModel  # noqa: E402
from gigadecode.ops import flash_sink_attention  # noqa: E402
from gigadecode.weights import load_weights  # noqa: E402


def alternate(runs: dict, rounds: int) -> dict[str, list[float]]:
    """seconds of each run, A B A B …"""
    times: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(rounds):
        for name, fn in runs.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return times


def op_case(cfg: GptOssConfig, chunk: int, context: int, rounds: int) -> None:
    nh, nkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    g = torch.Generator().manual_seed(0)
    q = torch.randn(chunk, nh, d, generator=g).bfloat16()
    k = torch.randn(context, nkv, d, generator=g).bfloat16()
    v = torch.randn(context, nkv, d, generator=g).bfloat16()
    sinks = torch.randn(nh, generator=g).bfloat16()
    q_pos, k_pos = torch.arange(context - chunk, context), torch.arange(context)
    tile = max(256, 2**16 // (nh // nkv * min(chunk, 128)))        # as the per-layer model calls it
    times = alternate({
        "torch": lambda: flash_sink_attention(q, k, v, q_pos, k_pos, sinks, d ** -0.5, None, tile=tile, q_tile=128),
        "native": lambda: native.prefill_attention(q, k, v, q_pos, 0, sinks, d ** -0.5, 0),
    }, rounds)
    macs = 2 * chunk * (context - chunk / 2) * nh * d               # QK and PV over the causal keys
    t, n = statistics.median(times["torch"]), statistics.median(times["native"])
    ratio = statistics.median(a / b for a, b in zip(times["torch"], times["native"]))
    print(f"op: {chunk} queries at the end of {context} keys, {nh} q / {nkv} kv heads of {d}: torch {t * 1e3:.1f} ms "
          f"({macs / t / 1e9:.1f} GMAC/s), native {n * 1e3:.1f} ms ({macs / n / 1e9:.1f} GMAC/s), "
          f"native x{ratio:.2f} (median pair ratio)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--model", default=None, help="checkpoint dir (default: the preset's, written once)")
    ap.add_argument("--context", type=int, nargs="*", default=[4096], help="op: keys before the chunk's end")
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--prefill", type=int, nargs="*", default=[512, 4096], help="prompt lengths to prefill")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    if not native.prefill_attention_supported(torch.bfloat16, 64):
        print("the native kernels are not built here")
        return 1
    model_dir = Path(args.model) if args.model else CACHE / args.preset
    if not (model_dir / "config.json").exists():
        make_checkpoint(model_dir, args.preset, seed=0)
    cfg = GptOssConfig.from_hf(model_dir)
    print(f"{model_dir.name}: native ISA {native.isa()}, {torch.get_num_threads()} threads")
    for context in args.context:
        op_case(cfg, min(args.chunk, context), context, args.rounds)
    if args.prefill:
        w = load_weights(model_dir, cfg, torch.bfloat16)
        model = GptOssModel(cfg, w, torch.bfloat16)
        for n in args.prefill:
            rates: dict[str, list[float]] = {"torch": [], "native": []}
            for _ in range(max(1, args.rounds // 2 if n > 1024 else args.rounds)):
                for name in rates:
                    model._native_attention = name == "native"
                    rates[name].append(prefill_tok_s(cfg, w, model, "bfloat16", n, 1))
            ratio = statistics.median(b / a for a, b in zip(rates["torch"], rates["native"]))
            print(f"prefill of {n} tokens: torch attention {statistics.median(rates['torch']):.1f} tok/s, native "
                  f"{statistics.median(rates['native']):.1f} tok/s, native x{ratio:.2f} (median pair ratio)")
        model._native_attention = native.prefill_attention_supported(torch.bfloat16, cfg.head_dim)
    return 0


if __name__ == "__main__":
    sys.exit(main())
