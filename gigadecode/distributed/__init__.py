"""The ranks of a TP × DP × EP (× DCP) layout and the collectives between them, on torch.distributed.

The lower half of parallel decode, which the model, the GK program and the runner use:

- `mesh`: the rank layout (`build_layout`, `ParallelLayout`: TP / EP / DCP replica groups as tuples of tuples).
- `context`: `ParallelContext` (this rank's place, its process groups and the counted collectives the
  decode program and the per-layer model call), `make_parallel_context`, `init_distributed`.

The engines that run on such a layout (one `LLMEngine` replica per rank, launch, local worlds) are in
`gigadecode.parallel`, one floor up.
"""

from .context import CollectiveStats, ParallelContext, init_distributed, make_parallel_context
from .mesh import LayoutError, ParallelLayout, build_layout

__all__ = ["CollectiveStats", "LayoutError", "ParallelContext", "ParallelLayout", "build_layout",
           "init_distributed", "make_parallel_context"]
