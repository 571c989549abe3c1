"""Decode attention alone over a paged FP8 KV cache: the op (`paged_decode_attention`) with AMX tiles on and off
(the tile form against the fp32 one, `gigadecode/native/csrc/attention_tiles.cpp`), alternated call by call so
both share the host's noise; medians, and the KV bytes a call reads per second.

Blocks are placed at random in a pool larger than the caches (as a served batch's are), or, with `--cached N`,
drawn from N blocks only (the products alone, the KV in cache). Heads default to `20b-shape`'s: 64 q heads, 8 kv
heads of 64 dims.

    .venv/bin/python bench/decode_attention.py --batch 1 8 32 --context 256 4096
    .venv/bin/python bench/decode_attention.py --batch 32 --context 4096 --window 128 --cached 64
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gigadecode import native  # noqa: E402
from gigadecode.kv.cache import token_major_to_packed  # noqa: E402


def case(batch: int, context: int, window: int, kv: int, rep: int, d: int, B: int, packed: bool, cached: int,
         g: torch.Generator):
    n_table = (context - 1) // B + 1
    nb = batch * n_table + 2
    k = torch.randn(nb, kv, B, d, generator=g) * 0.5
    K = (token_major_to_packed(k) if packed else k).to(torch.float8_e4m3fn)
    V = (torch.randn(nb, kv, B, d, generator=g) * 0.5).to(torch.float8_e4m3fn)
    ids = torch.randperm(nb - 1, generator=g)[: batch * n_table] + 1
    if cached:
        ids = ids[torch.randint(0, cached, (batch * n_table,), generator=g)]
    table = ids.view(batch, n_table)
    pos = torch.full((batch,), context - 1)
    active = torch.ones(batch, dtype=torch.bool)
    q = torch.randn(batch, kv * rep, d, generator=g)
    sinks = torch.randn(kv * rep, generator=g)
    args = (q, K, V, table, pos, active, sinks, window, 1 / math.sqrt(d), 0.5, 0.5, torch.bfloat16)
    kv_bytes = batch * min(context, window or context) * kv * d * 2
    return args, kv_bytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--context", type=int, nargs="+", default=[256, 4096])
    ap.add_argument("--window", type=int, default=0, help="sliding window (0: full attention)")
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--q-per-kv", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--plain-k", action="store_true", help="plain FP8 K instead of the packed layout")
    ap.add_argument("--cached", type=int, default=0, help="draw the blocks from this many only (KV in cache)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=5, help="calls timed per round and form")
    a = ap.parse_args()
    if native.amx_tiles() == "unavailable":
        sys.exit("decode_attention: no AMX tiles on this CPU (or no native kernels): nothing to compare")
    ops = torch.ops.gigadecode_native
    before = native.amx_tiles()
    g = torch.Generator().manual_seed(0)
    print(f"heads {a.kv_heads} kv x {a.q_per_kv} q, d {a.head_dim}, block {a.block}, "
          f"{'plain' if a.plain_k else 'packed'} FP8 K, window {a.window or '-'}, "
          f"{'cached ' + str(a.cached) + ' blocks' if a.cached else 'random blocks'}, threads {torch.get_num_threads()}")
    try:
        for batch in a.batch:
            for context in a.context:
                args, kv_bytes = case(batch, context, a.window, a.kv_heads, a.q_per_kv, a.head_dim, a.block,
                                      not a.plain_k, a.cached, g)
                times = {"on": [], "off": []}
                for _ in range(a.rounds):
                    for mode in ("on", "off"):
                        native.amx_tiles(mode)
                        ops.paged_decode_attention(*args)
                        t0 = time.perf_counter()
                        for _ in range(a.calls):
                            ops.paged_decode_attention(*args)
                        times[mode].append((time.perf_counter() - t0) / a.calls)
                on, off = statistics.median(times["on"]), statistics.median(times["off"])
                print(f"batch {batch:3d} context {context:5d}: tiles {on * 1e3:8.3f} ms ({kv_bytes / on / 1e9:5.1f} GB/s)"
                      f"  fp32 {off * 1e3:8.3f} ms ({kv_bytes / off / 1e9:5.1f} GB/s)  tiles {off / on:.2f}x")
    finally:
        native.amx_tiles(before)


if __name__ == "__main__":
    main()
