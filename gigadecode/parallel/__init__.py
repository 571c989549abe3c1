"""Tensor, data and expert parallel decode (TP × DP × EP) on torch.distributed.

- `mesh`: the rank layout (`build_layout`, `ParallelLayout`: TP / EP replica groups as tuples of tuples).
- `context`: `ParallelContext` (process groups + counted collectives), `make_parallel_context`.
- `engine`: the parallel engine (an `LLMEngine` replica per rank, `DistributedEngine` on rank 0, `run_worker`).
- `launch`: `run_parallel_generate` (prompts to the end on a layout; tests and benchmarks).
- `connector`: `TPGroupConnector`, a TP group's per-rank NIXL connectors deciding transfers together (DI).
- `spawn`: `run_world`, a local gloo world for tests and benchmarks.
"""

from .context import CollectiveStats, ParallelContext, init_distributed, make_parallel_context
from .mesh import LayoutError, ParallelLayout, build_layout

__all__ = ["CollectiveStats", "LayoutError", "ParallelContext", "ParallelLayout", "build_layout",
           "init_distributed", "make_parallel_context"]
