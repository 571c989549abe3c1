"""The dense projections at decode batch sizes, streamed from memory as a decode step reads them, and in cache.

A decode step reads every layer's qkv and o projection once, so their bytes come from DRAM; a projection
timed alone, called again and again, sits in the L3 (300 MiB on the Intel Xeon these were tuned on) and
measures something else. The AMX forms' thresholds were once set that way and read a streamed weight at half
the bandwidth. This bench times, for each row count, a pass over `--layers` layers' qkv and o of a preset's
shapes (random bf16 weights: their bytes streamed) and the same number of calls of one layer's (in cache),
each in three forms alternated round by round (medians):
- `native`: `native.linear` as decode runs it (AMX tiles on where the CPU has them: from 5 rows),
- `no-amx`: the same with the AMX tiles off (register tiles, and the pair tiles from 4 rows),
- `onednn`: `gemm.linear` (oneDNN's GEMM, what prefill's many rows take);
and reports ms and GB/s of weight bytes against the streaming-read bandwidth measured in the same run.

    .venv/bin/python bench/linear.py [--preset 20b-shape] [--rows 1 2 4 5 8 16 32] [--layers 24]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gigadecode import gemm, native  # noqa: E402
from gigadecode.checkpoint import preset_config  # noqa: E402

from decode import streaming_read_gbs  # noqa: E402

FORMS = ("native", "no-amx", "onednn")


def project(form: str, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    if form == "onednn":
        return gemm.linear(x, w)
    return native.linear(x, w)


def timed_pass(form: str, pairs: list[tuple[torch.Tensor, torch.Tensor]], xq: torch.Tensor, xo: torch.Tensor
               ) -> float:
    """Seconds for one call of each (qkv, o) pair in `pairs`, in `form`."""
    amx = native.amx_tiles()
    if amx != "unavailable":
        native.amx_tiles("off" if form == "no-amx" else "auto")
    try:
        t = time.perf_counter()
        for wq, wo in pairs:
            project(form, xq, wq)
            project(form, xo, wo)
        return time.perf_counter() - t
    finally:
        if amx != "unavailable":
            native.amx_tiles(amx)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="20b-shape")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 5, 8, 16, 32])
    ap.add_argument("--layers", type=int, default=None, help="layers streamed (default: the preset's)")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    if not native.available():
        print(f"native kernels not available: {native.status()}")
        return 1
    cfg = preset_config(args.preset)
    layers = args.layers or cfg.num_hidden_layers
    H, d = cfg.hidden_size, cfg.head_dim
    qkv_rows, o_cols = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * d, cfg.num_attention_heads * d
    g = torch.Generator().manual_seed(0)
    streamed = [(torch.randn(qkv_rows, H, generator=g).to(torch.bfloat16),
                 torch.randn(H, o_cols, generator=g).to(torch.bfloat16)) for _ in range(layers)]
    in_cache = [streamed[0]] * layers
    gb = sum(wq.numel() + wo.numel() for wq, wo in streamed) * 2 / 1e9
    bw = streaming_read_gbs()
    print(f"{args.preset}: {layers} layers of qkv [{qkv_rows}, {H}] and o [{H}, {o_cols}], bf16, {gb:.2f} GB; "
          f"threads {torch.get_num_threads()}; kernels {native.status()}; streaming read {bw:.1f} GB/s")
    print(f"{'rows':>4} {'weights':<9}" + "".join(f" {f + ' ms':>11} {'GB/s':>6}" for f in FORMS))
    for M in args.rows:
        xq = torch.randn(M, H, generator=g).to(torch.bfloat16)
        xo = torch.randn(M, o_cols, generator=g).to(torch.bfloat16)
        for name, pairs in (("streamed", streamed), ("in cache", in_cache)):
            times: dict[str, list[float]] = {f: [] for f in FORMS}
            for f in FORMS:                                   # warm-up: kernels, oneDNN's primitives
                timed_pass(f, pairs[:2], xq, xo)
            for _ in range(args.rounds):
                for f in FORMS:
                    times[f].append(timed_pass(f, pairs, xq, xo))
            row = "".join(f" {statistics.median(times[f]) * 1e3:11.1f} {gb / statistics.median(times[f]):6.1f}"
                          for f in FORMS)
            print(f"{M:>4} {name:<9}{row}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
