"""Parallel decode benchmark: step time, collectives and bytes exchanged per decode step, by layout.

Runs greedy generation through the parallel engine (GK program, eager or --decoder gk-compiled; every prompt
added at once, so after the first step every step is a pure decode step) on each TP × DP × EP layout as a
local gloo world (one torch thread per rank, loopback) and reports, per layout: the median decode-step wall time (slowest rank)
and its ratio to the first layout's (the single-rank baseline by default, measured in the same run),
aggregate tok/s, collectives per step per mesh (and per layer), the bytes one rank sends per step per mesh
(ring model: all_reduce 2(p-1)/p·S, all_gather (p-1)·S, reduce_scatter (p-1)/p·S) and the weight bytes
resident on one rank. On this 2-core machine worlds of more than 2 ranks oversubscribe the cores, so their
step times measure contention more than the layout; the counts and bytes are exact.

A layout `tp,dp,ep,dcp` adds decode context parallel: its row also shows the KV bytes one rank holds at the
peak of the run (its pool's blocks in use × bytes per block) and their ratio to the same layout without DCP
when that layout ran too (the default list ends with TP4 and TP4 × DCP2).

    .venv/bin/python bench/parallel.py [--preset tiny|small] [--layouts 1,1,1 2,1,2 1,2,2 2,2,4 4,1,4 4,1,1 4,1,1,2]
                                       [--prompts 4] [--prompt-len 40] [--max-tokens 16] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gigadecode.checkpoint import make_checkpoint  # noqa: E402
from gigadecode.config import GptOssConfig  # noqa: E402
from gigadecode.parallel.launch import run_parallel_generate  # noqa: E402
from gigadecode.distributed.mesh import build_layout  # noqa: E402
from gigadecode.parallel.spawn import generate_job, run_world  # noqa: E402

CACHE = Path.home() / ".cache" / "gigadecode"


def run_layout(model_dir: Path, prompts: list[list[int]], layout: tuple[int, ...], kw: dict) -> dict:
    tp, dp, ep, dcp = (*layout, 1)[:4]
    if dcp > 1:
        kw = {**kw, "dcp": dcp}
    if tp * dp == 1:
        rep: dict = {}
        run_parallel_generate(model_dir, prompts, 1, 1, ep, report=rep, **kw)
        reports = [rep]
    else:
        reports = [r for _, r in run_world(tp * dp, generate_job, str(model_dir), prompts, tp, dp, ep, kw)]
    L = reports[0]["num_layers"]
    steps = len(reports[0]["step_times"])
    skip = 1 if steps > 2 else 0                                  # first step: warm-up
    step_s = max(statistics.median(r["step_times"][skip:]) for r in reports)
    calls, sent = {}, {}
    for st in reports[0]["step_stats"][skip:]:
        for mesh, n in st["calls"].items():
            calls[mesh] = max(calls.get(mesh, 0), n)
        for mesh, b in st["bytes"].items():
            sent[mesh] = max(sent.get(mesh, 0), b)
    for r in reports[1:]:                                         # every rank runs the same collectives
        assert {str(s["calls"]) for s in r["step_stats"][skip:]} <= {str(s["calls"]) for s in reports[0]["step_stats"]}
    batch = len(prompts)
    kv_peak = max(max(t.kv_used for t in r["steps"]) * r["kv_block_bytes"] for r in reports)
    name = f"TP{tp}xDP{dp}xEP{ep}" + (f"xDCP{dcp}" if dcp > 1 else "")
    return {"layout": name, "tp": tp, "dp": dp, "ep": ep, "dcp": dcp, "world": tp * dp,
            "kv_bytes_per_rank": kv_peak,
            "ep_span": build_layout(tp, dp, ep).ep_span, "rows_per_dp_group": -(-batch // dp),
            "step_ms": round(step_s * 1e3, 2), "tok_s": round(batch / step_s, 1),
            "collectives_per_step": calls, "collectives_per_layer": {m: n / L for m, n in calls.items()},
            "bytes_sent_per_step": sent, "weight_bytes_per_rank": reports[0]["weight_bytes"], "steps": steps}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--model", default=None, help="checkpoint dir (default: a cached preset checkpoint)")
    ap.add_argument("--layouts", nargs="+", default=["1,1,1", "2,1,2", "1,2,2", "2,2,4", "4,1,4", "4,1,1", "4,1,1,2"],
                    help="tp,dp,ep or tp,dp,ep,dcp")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=40)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--kv-dtype", default="fp8", choices=["auto", "bf16", "fp8"])
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--decoder", default="gk", choices=["gk", "gk-compiled", "reference"],
                    help="gk-compiled: each layer's attention and MoE as compiled graphs between the collectives "
                         "(the first run of a layout compiles; Inductor caches it on disk)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model_dir = Path(args.model) if args.model else CACHE / args.preset
    if not (model_dir / "config.json").exists():
        print(f"writing the {args.preset} checkpoint to {model_dir} …", file=sys.stderr)
        make_checkpoint(model_dir, args.preset, seed=0)
    cfg = GptOssConfig.from_hf(model_dir)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, cfg.vocab_size, (args.prompt_len,), generator=g).tolist() for _ in range(args.prompts)]
    kw = dict(max_tokens=args.max_tokens, ignore_eos=True, kv_dtype=args.kv_dtype, block_size=args.block_size,
              decoder=args.decoder)
    rows = []
    for spec in args.layouts:
        layout = tuple(int(x) for x in spec.split(","))
        build_layout(*layout[:3], None, cfg, *layout[3:])
        row = run_layout(model_dir, prompts, layout, kw)
        row["step_vs_first"] = round(row["step_ms"] / (rows[0] if rows else row)["step_ms"], 2)
        base = next((r for r in rows if r["dcp"] == 1 and (r["tp"], r["dp"], r["ep"]) == layout[:3]), None)
        if row["dcp"] > 1 and base is not None:
            row["kv_bytes_vs_dcp1"] = round(row["kv_bytes_per_rank"] / base["kv_bytes_per_rank"], 3)
            row["step_vs_dcp1"] = round(row["step_ms"] / base["step_ms"], 2)
        rows.append(row)
        if args.json:
            print(json.dumps(row), flush=True)
        else:
            calls = " ".join(f"{m}:{n}" for m, n in sorted(row["collectives_per_step"].items())) or "-"
            sent = " ".join(f"{m}:{b / 1024:.1f}KiB" for m, b in sorted(row["bytes_sent_per_step"].items())) or "-"
            print(f"{row['layout']:>14}  world {row['world']:>2}  step {row['step_ms']:8.2f} ms "
                  f"({row['step_vs_first']:.2f}x {rows[0]['layout']})  "
                  f"{row['tok_s']:8.1f} tok/s  collectives/step {calls:<12}  sent/step/rank {sent:<24}  "
                  f"weights/rank {row['weight_bytes_per_rank'] / 2**20:.2f} MiB  "
                  f"KV/rank {row['kv_bytes_per_rank'] / 2**10:.1f} KiB"
                  + (f" ({row['kv_bytes_vs_dcp1']:.2f}x, step {row['step_vs_dcp1']:.2f}x DCP1)"
                     if "kv_bytes_vs_dcp1" in row else ""), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
