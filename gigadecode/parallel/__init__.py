"""Tensor, data and expert parallel decode (TP × DP × EP) on torch.distributed: the engines on a layout.

The rank layout and its collectives (`ParallelContext`) are one floor down, in `gigadecode.distributed`
(re-exported here):

- `engine`: the parallel engine (an `LLMEngine` replica per rank, `DistributedEngine` on rank 0, `run_worker`).
- `launch`: `run_parallel_generate` (prompts to the end on a layout; tests and benchmarks).
- `connector`: `TPGroupConnector`, a TP group's per-rank NIXL connectors deciding transfers together (DI).
- `spawn`: `run_world`, a local gloo world for tests and benchmarks.
"""

from ..distributed import (CollectiveStats, LayoutError, ParallelContext, ParallelLayout, build_layout,
                           init_distributed, make_parallel_context)

__all__ = ["CollectiveStats", "LayoutError", "ParallelContext", "ParallelLayout", "build_layout",
           "init_distributed", "make_parallel_context"]
