"""Tensor, data and expert parallel decode (TP × DP × EP) on torch.distributed.

- `mesh`: the rank layout (`build_layout`, `ParallelLayout`: TP / EP replica groups as tuples of tuples).
- `context`: `ParallelContext` (process groups + counted collectives), `make_parallel_context`.
- `launch`: `run_parallel_generate` and `python -m gigadecode.parallel.launch` (under torchrun).
"""

from .context import CollectiveStats, ParallelContext, init_distributed, make_parallel_context
from .mesh import LayoutError, ParallelLayout, build_layout

__all__ = ["CollectiveStats", "LayoutError", "ParallelContext", "ParallelLayout", "build_layout",
           "init_distributed", "make_parallel_context"]
