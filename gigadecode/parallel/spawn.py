"""Start a local gloo world of N processes on loopback and run a function on every rank (tests, bench).

`run_world(n, fn, *args)` spawns n processes (torch.multiprocessing, spawn), each initializing the default
process group (gloo, 127.0.0.1, a free port), calling `fn(rank, *args)` with one torch thread, and returns
the per-rank return values (pickled through a temp dir). `fn` must be importable (module level).
"""

from __future__ import annotations

import os
import pickle
import tempfile
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..ports import free_port


def _worker(rank: int, world: int, port: int, out_dir: str, fn, args: tuple, threads: int) -> None:
    torch.set_num_threads(threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    report = Path(out_dir, f"rank{rank}.pkl")
    try:
        result = ("ok", fn(rank, *args))
    except BaseException as e:
        # report before leaving this block: leaving it frees the failed call's frames and, with them, a TP or
        # EP rank's process groups, whose teardown while a peer still sends may end this process (a peer then
        # sees the connection close and goes on: the world's error would be the peer's, not this rank's)
        result = ("error", f"rank {rank}: {type(e).__name__}: {e}\n{traceback.format_exc()}")
        report.write_bytes(pickle.dumps(result))
    else:
        report.write_bytes(pickle.dumps(result))
    try:
        dist.destroy_process_group()
    finally:
        if result[0] == "error":
            raise SystemExit(1)


PRELOAD = ["torch", "gigadecode.parallel.launch"]


def run_world(world: int, fn, *args, threads: int = 1, start_method: str = "forkserver") -> list:
    """Run fn(rank, *args) on `world` gloo ranks -> [result of rank 0, …]. Raises with the rank's traceback.

    start_method "forkserver" (default): one server process imports torch once (`PRELOAD`) and forks the
    ranks from it (fast after the first world, and safe from a parent with threads); "spawn" re-imports
    torch in every rank; "fork" is fastest but unsafe from a parent that has used OpenMP threads."""
    if start_method == "forkserver":
        mp.set_forkserver_preload(PRELOAD)
    with tempfile.TemporaryDirectory(prefix="gigadecode-world-") as d:
        port = free_port()
        err = None
        try:
            mp.start_processes(_worker, args=(world, port, d, fn, args, threads), nprocs=world, join=True,
                               start_method=start_method)
        except Exception as e:                                    # ProcessRaisedException / ProcessExitedException
            err = e
        out = []
        for r in range(world):
            f = Path(d, f"rank{r}.pkl")
            if not f.exists():
                out.append(("error", f"rank {r}: no result ({err})"))
                continue
            out.append(pickle.loads(f.read_bytes()))
        errors = [msg for kind, msg in out if kind == "error"]
        if errors or err is not None:
            raise RuntimeError("\n".join(errors) or str(err))
        return [v for _, v in out]


# -- jobs (module level, so every start method can find them) ---------------------------------------------
def generate_job(rank: int, model_dir: str, prompts: list[list[int]], tp: int, dp: int, ep: int,
                 kwargs: dict) -> tuple[list[dict] | None, dict]:
    """`run_parallel_generate` on this rank -> (rank 0's results or None, this rank's report)."""
    from .launch import run_parallel_generate
    report: dict = {}
    res = run_parallel_generate(model_dir, prompts, tp, dp, ep, report=report, **kwargs)
    return res, report


def argmax_job(rank: int, tp: int, logits: torch.Tensor) -> tuple[list[int], list[float]]:
    """Distributed greedy over a TP world of `tp` ranks on full logits [B, V] (each rank takes its shard) ->
    (token ids, winning logits)."""
    from ..checkpoint import preset_config
    from ..distributed.context import make_parallel_context
    cfg = preset_config("tiny").with_(vocab_size=logits.shape[1])
    ctx = make_parallel_context(cfg, tp, 1, 1)
    local = logits[:, ctx.vocab_start: ctx.vocab_stop]
    ids, best = ctx.greedy_with_values(local)
    return ids.tolist(), best.tolist()
