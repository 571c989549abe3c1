"""`run_parallel_generate`: run prompts to the end on a TP × DP × EP layout through the parallel engine and
return what `gigadecode generate --json` prints (tests and `bench/parallel.py` call it on every rank of a
world; the command line is `torchrun --nproc-per-node N -m gigadecode generate --tp … --dp … --ep …`).

Every rank calls it with the same arguments. With tp = dp = ep = 1 and no process group it is one
`LLMEngine` in this process (the single-rank reference); otherwise each rank builds its engine replica
(`parallel.engine`), rank 0 adds the prompts (each to the least-loaded DP group, so prompt i lands on
DP group i % dp) and steps the world until every request has finished, the others follow in `run_worker`.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch.distributed as dist

from ..engine_config import DECODERS, EngineConfig
from ..engine import LLMEngine
from ..runner import ModelRunner
from ..sampling import SamplingParams
from .engine import DistributedEngine, StepTrace, build_parallel_engine, run_worker
from ..distributed.mesh import build_layout


def run_parallel_generate(model_dir: str | Path, prompts: list[list[int]], tp: int = 1, dp: int = 1, ep: int = 1,
                          max_tokens: int = 16, *, ignore_eos: bool = False, decoder: str = "gk",
                          dtype: str = "float32", kv_dtype: str = "auto", block_size: int = 16,
                          params: list[SamplingParams] | None = None, report: dict | None = None,
                          **engine_kw) -> list[dict] | None:
    """-> on rank 0 one dict per prompt (input order) `{"prompt_ids", "token_ids", "finish_reason",
    "decode_tok_s"}`; None on other ranks.

    `params`: one SamplingParams per prompt (default greedy with `max_tokens` / `ignore_eos`).
    `engine_kw`: more EngineConfig fields (num_blocks, max_prefill_tokens, max_num_seqs, …).
    `report`, if given, is filled with this rank's facts: rank, layout, shard, weight bytes, and per engine
    step its wall time and collectives (`steps`: `StepTrace`s); `step_times` / `step_stats` are those of
    the pure decode steps (no prefill token that step)."""
    if decoder not in DECODERS:
        raise ValueError(f"decoder must be one of {', '.join(DECODERS)} (got {decoder!r})")
    ecfg = EngineConfig(dtype=dtype, kv_dtype=kv_dtype, block_size=block_size, decoder=decoder,
                        gk_decode=decoder != "reference", tp=tp, dp=dp, ep=ep, **engine_kw)
    if params is None:
        params = [SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)] * len(prompts)
    trace: list[StepTrace] = []
    if tp * dp == 1 and not dist.is_initialized():
        build_layout(tp, dp, ep, 1)                          # the same errors as a world would give
        runner = ModelRunner(model_dir, ecfg)
        engine, rank, shard = LLMEngine(runner), 0, None
        results = _run(engine, prompts, params, trace)
    else:
        replica, ctx = build_parallel_engine(model_dir, ecfg)
        runner, rank, shard = replica.runner, ctx.rank, ctx.shard
        if rank == 0:
            with DistributedEngine(replica, ctx, trace) as engine:
                results = _run(engine, prompts, params)
        else:
            run_worker(replica, ctx, trace)
            results = None
    if report is not None:
        decode_only = [t for t in trace if t.decode_tokens and not t.prefill_tokens]
        report.update(rank=rank, tp=tp, dp=dp, ep=ep, shard=shard, weight_bytes=runner.weights.nbytes(),
                      kv_block_bytes=runner.kv.nbytes // runner.kv.num_blocks,
                      num_layers=runner.cfg.num_hidden_layers, steps=trace,
                      step_times=[t.seconds for t in decode_only],
                      step_stats=[t.collectives for t in decode_only])
    return results


def _run(engine, prompts: list[list[int]], params: list[SamplingParams], trace: list[StepTrace] | None = None
         ) -> list[dict]:
    """Add, step to the end, collect. `trace`: record one-rank steps (a parallel engine records its own)."""
    ids = [engine.add_request(list(p), sp) for p, sp in zip(prompts, params)]
    while engine.has_unfinished():
        s0, t0 = engine.stats.as_dict(), time.perf_counter()
        engine.step()
        if trace is not None:
            trace.append(StepTrace(time.perf_counter() - t0, {"calls": {}, "bytes": {}, "by_op": {}},
                                   engine.stats.prefill_tokens - s0["prefill_tokens"],
                                   engine.stats.decode_tokens - s0["decode_tokens"], engine.kv_usage()[0]))
    out = []
    for rid in ids:
        r = engine.requests[rid]
        n, dt = len(r.output_ids), (r.last_token_time or 0) - (r.first_token_time or 0)
        out.append({"prompt_ids": r.prompt_ids, "token_ids": r.output_ids, "finish_reason": r.finish_reason,
                    "decode_tok_s": round((n - 1) / dt, 2) if n > 1 and dt > 0 else 0.0})
    return out
