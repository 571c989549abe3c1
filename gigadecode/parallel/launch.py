"""Run greedy generation on a TP × DP × EP layout under torchrun (or one process without it).

    torchrun --nproc-per-node 4 -m gigadecode.parallel.launch --model DIR --prompt-ids 1,2,3 --tp 2 --ep 2
    torchrun --nproc-per-node 4 -m gigadecode.parallel.launch --model DIR --requests reqs.jsonl --tp 2 --dp 2 --ep 4

Each rank loads only its shard (`Shard` from the layout), prefills its DP group's prompts with the sharded
per-layer model and decodes them with the sharded GK program in lockstep (prompt i → DP group i % dp).
DP groups run the same batch bucket every step (`ceil(#prompts / dp)`; a DP group with fewer live requests
pads, one with none runs an all-padding step), so the EP collectives line up; the loop ends when every
request of every DP group has finished (one tiny all-reduce over the world per step). Rank 0 gathers
the results and prints what `gigadecode generate` prints for the same requests (greedy).

This is a small lockstep loop, not the engine (no continuous batching / chunked prefill / preemption).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ..config import EngineConfig, GptOssConfig
from ..gk.attn_control import build_attention_control
from ..gk.model import GptOssGKDecodeModel
from ..kv.cache import KVCache
from ..kv.manager import KVCacheManager
from ..kv.spec import SlidingWindowSpec, cdiv, get_kv_spec, make_kv_cache_config
from ..model import GptOssModel, SeqChunk
from ..weights import Shard, load_weights
from .context import ParallelContext, init_distributed, make_parallel_context
from .mesh import build_layout


def _num_blocks(cfg: GptOssConfig, ecfg: EngineConfig, nkv: int, lengths: list[int], max_tokens: int) -> int:
    itemsize = torch.empty((), dtype=ecfg.kv_storage_dtype()).element_size()
    groups = make_kv_cache_config(get_kv_spec(cfg, ecfg.block_size, itemsize, nkv), 1).groups
    per = [len(groups) * (cdiv(n + max_tokens, ecfg.block_size) + 1) for n in lengths]
    return 2 + sum(per)


def run_parallel_generate(model_dir: str | Path, prompts: list[list[int]], tp: int = 1, dp: int = 1, ep: int = 1,
                          max_tokens: int = 16, *, ignore_eos: bool = False, decoder: str = "gk",
                          dtype: str = "float32", kv_dtype: str = "auto", block_size: int = 16,
                          parallel: ParallelContext | None = None, report: dict | None = None
                          ) -> list[dict] | None:
    """Greedy generation of `prompts` on this rank's part of the layout -> on rank 0 one dict per prompt
    (in input order) `{"prompt_ids", "token_ids", "finish_reason", "decode_tok_s"}`; None on other ranks.

    Every rank must call it with the same arguments. With tp = dp = ep = 1 and no process group it runs
    one process with no collectives (the single-rank reference). Otherwise the default process group is
    initialized from torchrun's env vars if needed (gloo) and `parallel` built unless given.
    `decoder`: "gk" (the sharded GK program) or "reference" (the per-layer model decodes too).
    `report`, if given, is filled with this rank's facts: layout, shard, weight bytes, per-decode-step
    wall times and collective counts/bytes (`step_stats`), prefill collective counts.
    """
    if decoder not in ("gk", "reference"):
        raise ValueError(f"decoder must be gk or reference (got {decoder!r})")
    model_dir = Path(model_dir)
    cfg = GptOssConfig.from_hf(model_dir)
    distributed = parallel is not None or tp * dp > 1 or dist.is_initialized()
    if distributed:
        if parallel is None:
            init_distributed()
            parallel = make_parallel_context(cfg, tp, dp, ep) if dist.get_world_size() > 1 else None
    else:
        build_layout(tp, dp, ep, 1, cfg)
    ctx = parallel
    rank = ctx.rank if ctx is not None else 0
    dp_rank, dp_size = (ctx.dp_rank, ctx.dp_size) if ctx is not None else (0, 1)
    shard = ctx.shard if ctx is not None else Shard()

    ecfg = EngineConfig(dtype=dtype, kv_dtype=kv_dtype, block_size=block_size)
    weights = load_weights(model_dir, cfg, ecfg.torch_dtype, shard)
    model = GptOssModel(cfg, weights, ecfg.torch_dtype, parallel=ctx)
    mine = [i for i in range(len(prompts)) if i % dp_size == dp_rank]
    bucket = max(1, cdiv(len(prompts), dp_size))          # the same on every DP group
    nb = _num_blocks(cfg, ecfg, model.num_kv_heads, [len(prompts[i]) for i in mine], max_tokens)
    kv = KVCache(cfg, ecfg, nb, model.num_kv_heads)
    mgr = KVCacheManager(kv.config, block_size)
    gk = None
    if decoder == "gk":
        gk = GptOssGKDecodeModel(cfg, weights, kv.config, block_size, kv.k_scale, kv.v_scale, parallel=ctx)
        gk.bind_kv_cache(kv.bind_map())
    sliding = [isinstance(g.spec, SlidingWindowSpec) for g in kv.config.groups]
    eos = set(cfg.eos_token_ids)

    def greedy(logits: torch.Tensor) -> list[int]:
        if ctx is None:
            return logits.argmax(-1).tolist()
        return ctx.greedy(logits).tolist()

    if report is not None:
        report.update(rank=rank, tp=tp, dp=dp, ep=ep, shard=shard, weight_bytes=weights.nbytes(),
                      num_layers=cfg.num_hidden_layers, step_times=[], step_stats=[], bucket=bucket)
    # -- prefill (the per-layer model; a DP group with no prompts still joins the EP collectives) ----------
    reqs = {i: {"rid": f"r{i}", "prompt": list(prompts[i]), "out": [], "done": None, "t": []} for i in mine}
    for r in reqs.values():
        if not mgr.allocate(r["rid"], len(r["prompt"]), 0):
            raise RuntimeError("KV pool too small for the prompts")
    if ctx is not None:
        ctx.stats.reset()
    out = model.forward([SeqChunk(r["prompt"], 0, mgr.block_tables(r["rid"])) for r in reqs.values()], kv)
    first = greedy(torch.cat(out.logits)) if out.logits else []
    if report is not None and ctx is not None:
        report["prefill_stats"] = ctx.stats.snapshot()

    def accept(r: dict, tok: int) -> None:
        r["out"].append(tok)
        r["t"].append(time.perf_counter())
        if not ignore_eos and tok in eos:
            r["done"] = "stop"
        elif len(r["out"]) >= max_tokens:
            r["done"] = "length"
        if r["done"]:
            mgr.free(r["rid"])
        else:
            mgr.remove_skipped_blocks(r["rid"], len(r["prompt"]) + len(r["out"]) - 1)

    for r, t in zip(reqs.values(), first):
        accept(r, t)

    # -- decode, in lockstep over the whole world ---------------------------------------------------------
    while True:
        live = [r for r in reqs.values() if r["done"] is None]
        if ctx is not None:
            if int(ctx.all_reduce_world(torch.tensor([len(live)]))) == 0:
                break
            ctx.stats.reset()
        elif not live:
            break
        t0 = time.perf_counter()
        pos = [len(r["prompt"]) + len(r["out"]) - 1 for r in live]      # position of the token fed now
        for r, p in zip(live, pos):
            if not mgr.allocate(r["rid"], p + 1, p):
                raise RuntimeError("KV pool too small")
        tables = [mgr.block_tables(r["rid"]) for r in live]
        if gk is not None:
            ctl = build_attention_control(pos, tables, sliding, model.rope, block_size, cfg.sliding_window,
                                          batch_bucket=bucket)
            ids = torch.zeros(bucket, dtype=torch.long)
            ids[: len(live)] = torch.tensor([r["out"][-1] for r in live], dtype=torch.long)
            logits = gk.decode(ids, ctl)[: len(live)]
            nxt = greedy(logits) if live else []
        else:
            o = model.forward([SeqChunk([r["out"][-1]], p, tb) for r, p, tb in zip(live, pos, tables)], kv)
            nxt = greedy(torch.cat(o.logits)) if live else []
        for r, t in zip(live, nxt):
            accept(r, t)
        if report is not None:
            report["step_times"].append(time.perf_counter() - t0)
            if ctx is not None:
                report["step_stats"].append(ctx.stats.snapshot())

    # -- results to rank 0 ---------------------------------------------------------------------------------
    results = {}
    if ctx is None or ctx.tp_rank == 0:
        for i, r in reqs.items():
            n, ts = len(r["out"]), r["t"]
            dt = ts[-1] - ts[0] if n > 1 else 0.0
            results[i] = {"prompt_ids": r["prompt"], "token_ids": r["out"], "finish_reason": r["done"],
                          "decode_tok_s": round((n - 1) / dt, 2) if dt > 0 else 0.0}
    if ctx is not None:
        gathered = [None] * ctx.world_size if rank == 0 else None
        dist.gather_object(results, gathered, dst=0, group=ctx.world_group)
        if rank != 0:
            return None
        results = {k: v for part in gathered for k, v in part.items()}
    return [results[i] for i in range(len(prompts))]


# --------------------------------------------------------------------------------------------------
def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m gigadecode.parallel.launch",
                                description="greedy generation on TP × DP × EP (run under torchrun)")
    p.add_argument("--model", required=True)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="text (needs the checkpoint's tokenizer.json)")
    src.add_argument("--prompt-ids", help="comma-separated token ids")
    src.add_argument("--requests", help="JSON lines with prompt_ids (max_tokens per line is not supported)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--kv-dtype", default="auto", choices=["auto", "bf16", "fp8"])
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--decoder", default="gk", choices=["gk", "reference"])
    p.add_argument("--threads", type=int, default=None, help="torch threads per rank (default: 1 under torchrun)")
    p.add_argument("--json", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    under_torchrun = "WORLD_SIZE" in os.environ
    world = args.tp * args.dp
    if not under_torchrun and world > 1:
        print(f"tp*dp = {world} ranks: start with torchrun --nproc-per-node {world} -m gigadecode.parallel.launch …",
              file=sys.stderr)
        return 2
    if under_torchrun and int(os.environ["WORLD_SIZE"]) != world:
        print(f"WORLD_SIZE={os.environ['WORLD_SIZE']} but --tp {args.tp} × --dp {args.dp} = {world}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads or (1 if under_torchrun else torch.get_num_threads()))
    codec = None
    try:
        from ..tokenizer import TextCodec
        codec = TextCodec.from_dir(args.model)
    except Exception:                                     # no tokenizer: ids only
        codec = None
    if args.prompt_ids is not None:
        prompts = [[int(t) for t in args.prompt_ids.split(",") if t.strip()]]
    elif args.requests:
        prompts = [json.loads(l)["prompt_ids"] for l in Path(args.requests).read_text().splitlines() if l.strip()]
    else:
        if codec is None:
            print("this checkpoint has no tokenizer.json; use --prompt-ids", file=sys.stderr)
            return 2
        prompts = [codec.encode(args.prompt)]
    if under_torchrun:
        init_distributed()
    res = run_parallel_generate(args.model, prompts, args.tp, args.dp, args.ep, args.max_tokens,
                                ignore_eos=args.ignore_eos, decoder=args.decoder, dtype=args.dtype,
                                kv_dtype=args.kv_dtype, block_size=args.block_size)
    if res is not None:
        for r in res:
            if args.json:
                d = dict(r)
                if codec is not None:
                    d["text"] = codec.decode(r["token_ids"])
                print(json.dumps(d), flush=True)
            else:
                print(f"prompt ids: {r['prompt_ids']}")
                print(f"token ids: {r['token_ids']}")
                print(f"finish: {r['finish_reason']}  decode: {r['decode_tok_s']:.1f} tok/s "
                      f"(TP{args.tp} × DP{args.dp} × EP{args.ep}, {args.decoder}, kv {args.kv_dtype})")
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
