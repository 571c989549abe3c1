"""`ParallelContext`: this rank's place in the TP × DP × EP layout, its process groups, and the few
collectives the decode program and the per-layer model call (each counted, per mesh, with its bytes).

Passing `parallel=None` (the default everywhere) means one rank and no collectives: the code paths are
exactly the single-process ones. With a context:

- attention (TP): each TP rank computes its q heads against its kv heads; the o-proj is row-parallel
  (this rank's head columns), partial sums are **all-reduced over the TP group**, then the o-proj bias is
  added once (`row_parallel_linear`). One TP collective per layer.
- MoE (EP): every EP rank holds E/ep experts and computes their contributions for *all* tokens of its EP
  group; the partial outputs are summed over the EP group (`ep_moe`):
  - `ep_span == 1` (the EP group lies inside a TP group, so its ranks hold the same tokens): one
    all-reduce over EP.
  - `ep_span > 1` (the EP group covers `ep_span` DP groups): **all-gather over EP** of each rank's hidden
    states (one copy per DP group is used), MoE on the local experts for those tokens, then back to the
    owners: a **reduce-scatter over EP** when tp == 1 (every rank is its own DP group), else an all-reduce
    over EP of the `[ep_span, N, H]` partials (cheaper than reduce-scattering tp duplicate copies) from
    which each rank takes its DP group's rows. Two EP collectives per layer.
  Every DP group of an EP group must present the same number of tokens per call (the decode program's
  batch bucket; the per-layer model exchanges its token counts once per forward and pads).
- attention (DCP, `dcp > 1`): the ranks of a DCP group hold the same kv heads and different tokens
  (`kv.dcp.TokenShard`). Each rank **all-gathers the group's q** (`all_gather_dcp`), attends with every
  q head of the group over its own tokens without the sink (partial output, normalized over its keys,
  and its log-sum-exp), then `dcp_merge`: all-gather of the LSEs, each rank rescales its partial by
  e^(lse_r - M), a **reduce-scatter over the DCP group** sums the partials back to the heads' owners, and
  the sink joins the denominator once (vLLM's `cp_lse_ag_out_rs` shape). Three DCP collectives per layer.
- lm_head (TP, vocab-sharded): logits are local `[B, vocab_stop - vocab_start]` (padding rows of an uneven
  last shard are never used); `greedy` = `shard_argmax` per rank, one all-gather of (value bits, index)
  over TP, `reduce_argmax`: identical to `torch.argmax` over the full vocabulary, ties included.
"""

from __future__ import annotations

import math
import os
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.distributed_c10d import _set_pg_timeout

from ..config import GptOssConfig
from ..gemm import linear
from ..kv.dcp import TokenShard
from ..argmax import reduce_argmax, shard_argmax
from .mesh import Mesh2D, ParallelLayout, build_layout

_INT_OF = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class CollectiveFailed(RuntimeError):
    """A collective with peer ranks raised (gloo's error inside): said in an operator's terms, which peer if the
    group tells it (`collective_failure`)."""


# what gloo (and the sockets under it) says when a peer's process ended ...
_PEER_LOST = ("connection reset", "connection closed", "broken pipe", "connection refused")
# ... and when a peer is there but did not join the collective within the group's timeout (a hung rank)
_PEER_SILENT = ("timed out", "timeout")

# gloo's own wait, until `arm_timeout`: long enough for every rank to load its shard and warm up
STARTUP_TIMEOUT = dist.default_pg_timeout


def collective_failure(rank: int, group: tuple[int, ...] | range, what: str, e: BaseException,
                       timeout_s: float | None = None) -> CollectiveFailed:
    """`e`, raised by rank `rank`'s collective `what` (e.g. "TP all_reduce") over the ranks `group`, as the
    failure an operator reads: "peer rank 1 of the world was lost: rank 0's TP all_reduce with it failed:
    RuntimeError: [gloo …] Connection reset by peer", or, for a collective that waited out the group's
    `timeout_s`, "peer rank 1 did not answer within 60 s (hung?): …". A group of two names the peer; a
    larger one its ranks (gloo's error names an address, not a rank)."""
    peers = [r for r in group if r != rank]
    who = (f"peer rank {peers[0]}" if len(peers) == 1 else
           f"a peer rank (one of ranks {', '.join(map(str, peers))})" if peers else "a peer rank")
    cause = f"{type(e).__name__}: {e}"
    text = str(e).lower()
    if any(sign in text for sign in _PEER_SILENT):
        within = f"within {timeout_s:g} s" if timeout_s is not None else "in time"
        return CollectiveFailed(f"{who} did not answer {within} (hung? see --distributed-timeout-s): rank {rank}'s "
                                f"{what} with it timed out: {cause}")
    if any(sign in text for sign in _PEER_LOST):
        return CollectiveFailed(f"{who} of the world was lost: rank {rank}'s {what} with it failed: {cause}")
    return CollectiveFailed(f"rank {rank}'s {what} with {who} failed: {cause}")


@dataclass
class CollectiveStats:
    """Collective calls and bytes per mesh ("tp", "ep", "world"). `bytes` is what one rank sends under a
    ring algorithm: all_reduce 2(p-1)/p·S, all_gather (p-1)·S_in, reduce_scatter (p-1)/p·S_in."""

    calls: Counter = field(default_factory=Counter)
    bytes: Counter = field(default_factory=Counter)
    by_op: Counter = field(default_factory=Counter)

    def record(self, mesh: str, op: str, p: int, nbytes: int) -> None:
        self.calls[mesh] += 1
        self.by_op[f"{mesh}.{op}"] += 1
        if op == "all_reduce":
            sent = 2 * (p - 1) * nbytes // p
        elif op == "all_gather":
            sent = (p - 1) * nbytes
        else:   # reduce_scatter: nbytes is the full input
            sent = (p - 1) * nbytes // p
        self.bytes[mesh] += sent

    def reset(self) -> None:
        self.calls.clear()
        self.bytes.clear()
        self.by_op.clear()

    def snapshot(self) -> dict:
        return {"calls": dict(self.calls), "bytes": dict(self.bytes), "by_op": dict(self.by_op)}


@dataclass
class ParallelContext:
    layout: ParallelLayout
    rank: int
    tp_group: object | None                 # torch.distributed ProcessGroup (None when tp == 1)
    ep_group: object | None                 # (None when ep == 1)
    num_experts: int
    vocab_size: int
    world_group: object | None = None       # None = the default group
    stats: CollectiveStats = field(default_factory=CollectiveStats)
    dcp_group: object | None = None         # (None when dcp == 1)
    dcp_interleave: int = 1                 # DCP: tokens per round-robin chunk
    # how long one collective waits for its peers before it fails (gloo's wait on every group of this rank)
    timeout_s: float = STARTUP_TIMEOUT.total_seconds()

    # -- layout ------------------------------------------------------------------------------------
    @property
    def tp_mesh(self) -> Mesh2D:
        return self.layout.tp_groups

    @property
    def ep_mesh(self) -> Mesh2D:
        return self.layout.ep_groups

    @property
    def tp_size(self) -> int:
        return self.layout.tp

    @property
    def dp_size(self) -> int:
        return self.layout.dp

    @property
    def ep_size(self) -> int:
        return self.layout.ep

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def dcp_size(self) -> int:
        return self.layout.dcp

    @property
    def dcp_rank(self) -> int:
        return self.layout.dcp_rank(self.rank)

    @property
    def tokens(self) -> TokenShard:
        """Which tokens of every sequence this rank's KV holds (all of them without DCP)."""
        if self.dcp_size == 1:
            return TokenShard()
        return TokenShard(self.dcp_size, self.dcp_rank, self.dcp_interleave)

    @property
    def tp_rank(self) -> int:
        return self.layout.tp_rank(self.rank)

    @property
    def dp_rank(self) -> int:
        return self.layout.dp_rank(self.rank)

    @property
    def ep_rank(self) -> int:
        return self.layout.ep_rank(self.rank)

    @property
    def shard(self):
        return self.layout.shard(self.rank)

    @property
    def expert_offset(self) -> int:
        return self.layout.expert_range(self.rank, self.num_experts)[0]

    @property
    def vocab_start(self) -> int:
        return self.layout.vocab_range(self.rank, self.vocab_size)[0]

    @property
    def vocab_stop(self) -> int:
        return self.layout.vocab_range(self.rank, self.vocab_size)[1]

    @property
    def vocab_len(self) -> int:
        """Real vocabulary rows of this rank's lm_head shard (the rest of the stack is zero padding)."""
        return self.vocab_stop - self.vocab_start

    # -- counted collectives -------------------------------------------------------------------------
    def mesh_ranks(self, mesh: str) -> tuple[int, ...]:
        """The world ranks of this rank's group of `mesh` ("tp", "ep", "dcp"; anything else: the world)."""
        lay = self.layout
        groups = {"tp": lay.tp_groups, "ep": lay.ep_groups, "dcp": lay.dcp_groups}.get(mesh)
        if groups is None:
            return tuple(range(self.world_size))
        return next(g for g in groups if self.rank in g)

    @contextmanager
    def failing_as(self, mesh: str, op: str) -> Iterator[None]:
        """Around one collective over this rank's `mesh` group: an error it raises (a peer's process ended, or
        it stopped answering) comes out as `CollectiveFailed`, naming the peer where the group tells it."""
        try:
            yield
        except CollectiveFailed:
            raise
        except RuntimeError as e:            # gloo's errors (DistBackendError is one)
            raise collective_failure(self.rank, self.mesh_ranks(mesh), f"{mesh.upper()} {op}", e,
                                     self.timeout_s) from e

    def arm_timeout(self, seconds: float) -> None:
        """From now on a collective of this rank (on the world and on its TP, EP and DCP groups) fails after
        waiting `seconds` for a peer, instead of the start-up timeout (`STARTUP_TIMEOUT`): a rank that hangs
        then stops the world within that time. Local to this rank; every rank arms its own."""
        groups = {id(g): g for g in (self.world_group, self.tp_group, self.ep_group, self.dcp_group)
                  if g is not None}
        wait = timedelta(seconds=seconds)
        _set_pg_timeout(wait, None)           # the default group (the world when world_group is None)
        for g in groups.values():
            _set_pg_timeout(wait, g)
        self.timeout_s = seconds

    def all_reduce_tp(self, x: torch.Tensor) -> torch.Tensor:
        """In place: x = sum over the TP group (no-op for tp == 1)."""
        if self.tp_size > 1:
            self.stats.record("tp", "all_reduce", self.tp_size, x.numel() * x.element_size())
            with self.failing_as("tp", "all_reduce"):
                dist.all_reduce(x, group=self.tp_group)
        return x

    def all_reduce_ep(self, x: torch.Tensor) -> torch.Tensor:
        if self.ep_size > 1:
            self.stats.record("ep", "all_reduce", self.ep_size, x.numel() * x.element_size())
            with self.failing_as("ep", "all_reduce"):
                dist.all_reduce(x, group=self.ep_group)
        return x

    def _all_gather(self, x: torch.Tensor, group, p: int, mesh: str) -> torch.Tensor:
        x = x.contiguous().reshape(1, -1) if x.dim() == 0 else x.contiguous()
        out = x.new_empty((p * x.shape[0], *x.shape[1:]))              # the concatenation form (gloo)
        self.stats.record(mesh, "all_gather", p, x.numel() * x.element_size())
        with self.failing_as(mesh, "all_gather"):
            _all_gather_single(out, x, group=group)
        return out.view(p, *x.shape)

    def all_gather_tp(self, x: torch.Tensor) -> torch.Tensor:
        """-> [tp, *x.shape] (x itself unsqueezed for tp == 1)."""
        if self.tp_size == 1:
            return x.unsqueeze(0)
        return self._all_gather(x, self.tp_group, self.tp_size, "tp")

    def all_gather_ep(self, x: torch.Tensor) -> torch.Tensor:
        """-> [ep, *x.shape]."""
        if self.ep_size == 1:
            return x.unsqueeze(0)
        return self._all_gather(x, self.ep_group, self.ep_size, "ep")

    def all_gather_dcp(self, x: torch.Tensor) -> torch.Tensor:
        """-> [dcp, *x.shape]."""
        if self.dcp_size == 1:
            return x.unsqueeze(0)
        return self._all_gather(x, self.dcp_group, self.dcp_size, "dcp")

    def dcp_gather_heads(self, q: torch.Tensor) -> torch.Tensor:
        """q [T, h, d] of this rank's heads -> [T, dcp·h, d]: every head of the DCP group, in head order."""
        if self.dcp_size == 1:
            return q
        g = self.all_gather_dcp(q)                                             # [dcp, T, h, d]
        T, h, d = q.shape                                                      # T may be 0 (a padded step)
        return g.permute(1, 0, 2, 3).reshape(T, self.dcp_size * h, d)

    def dcp_merge(self, o: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
        """Exact merge of the DCP group's partial attentions. o [T, dcp·h, d]: every group head over this
        rank's tokens, normalized over them; lse [T, dcp·h] their log-sum-exp (-inf: no key here); sinks [h]
        this rank's heads. -> this rank's heads' attention [T, h, d] (fp32):

            M = max_r lse_r,  out = Σ_r e^(lse_r - M)·o_r / (Σ_r e^(lse_r - M) + e^(sink - M))"""
        T, hg, d = o.shape
        n, h = self.dcp_size, hg // self.dcp_size
        o, lse = o.float(), lse.float()
        lses = self.all_gather_dcp(lse)                                        # [dcp, T, hg]
        m = lses.amax(0)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))             # nothing seen anywhere: 0
        part = o * torch.exp(lse - m).unsqueeze(-1)                            # [T, hg, d]
        part = part.view(T, n, h, d).transpose(0, 1).contiguous()              # [dcp, T, h, d]
        out = self._reduce_scatter(part, self.dcp_group, n, "dcp")             # [T, h, d] this rank's heads
        mine = slice(self.dcp_rank * h, (self.dcp_rank + 1) * h)
        denom = torch.exp(lses[:, :, mine] - m[:, mine]).sum(0) + torch.exp(sinks.float() - m[:, mine])
        return out / denom.unsqueeze(-1)

    def _reduce_scatter(self, x: torch.Tensor, group, p: int, mesh: str) -> torch.Tensor:
        """x [p, …] -> [...]: this rank's slot of the sum over the group."""
        out = x.new_empty(x.shape[1:])
        self.stats.record(mesh, "reduce_scatter", p, x.numel() * x.element_size())
        x = x.reshape(-1, *x.shape[2:]).contiguous()
        with self.failing_as(mesh, "reduce_scatter"):
            _reduce_scatter_single(out, x, group=group)
        return out

    def reduce_scatter_ep(self, x: torch.Tensor) -> torch.Tensor:
        """x [ep, …] -> [...]: this EP rank's slot of the sum over the EP group."""
        if self.ep_size == 1:
            return x[0]
        return self._reduce_scatter(x, self.ep_group, self.ep_size, "ep")

    def agree_max(self, values: list[int]) -> list[int]:
        """The element-wise maximum of small ints over the EP group (the engine's per-step agreement on
        model calls; counted under the "sched" mesh, not as a model collective)."""
        if self.ep_size == 1:
            return list(values)
        t = torch.tensor(values, dtype=torch.long)
        self.stats.record("sched", "all_reduce", self.ep_size, t.numel() * t.element_size())
        with self.failing_as("ep", "step agreement"):
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.ep_group)
        return t.tolist()

    def all_reduce_world(self, x: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        if self.world_size > 1:
            self.stats.record("world", "all_reduce", self.world_size, x.numel() * x.element_size())
            with self.failing_as("world", "all_reduce"):
                dist.all_reduce(x, op=op, group=self.world_group)
        return x

    # -- the model's parallel pieces -----------------------------------------------------------------
    def row_parallel_linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
                            linear: Callable[..., torch.Tensor] = linear) -> torch.Tensor:
        """o-proj over this rank's head columns, summed over TP, bias added once (after the sum). `linear`: the
        caller's projection (the native small-batch kernel in decode), the same one its single-rank path uses."""
        if self.tp_size == 1:
            return linear(x, w, b)
        y = self.all_reduce_tp(linear(x, w))
        return y if b is None else y + b

    def ep_token_counts(self, n: int) -> list[int] | None:
        """Token counts of every EP rank (one small all-gather), or None when they hold the same tokens."""
        if self.ep_size == 1 or self.layout.ep_span == 1:
            return None
        return self.all_gather_ep(torch.tensor([n], dtype=torch.long)).flatten().tolist()

    def ep_moe(self, h: torch.Tensor, local_moe: Callable[[torch.Tensor], torch.Tensor],
               counts: list[int] | None = None) -> torch.Tensor:
        """h [N, H] this DP group's tokens -> the full MoE output [N, H]; `local_moe(tokens)` returns the
        contribution of this rank's experts. `counts`: token count of every EP rank (None = all N)."""
        if self.ep_size == 1:
            return local_moe(h)
        lay = self.layout
        if lay.ep_span == 1:
            return self.all_reduce_ep(local_moe(h))
        n, hid = h.shape
        counts = counts or [n] * self.ep_size
        n_max = max(counts)
        hp = h if n == n_max else F.pad(h, (0, 0, 0, n_max - n))
        g = self.all_gather_ep(hp)                                          # [ep, n_max, H]
        reps = [s * lay.tp for s in range(lay.ep_span)]                     # one rank per DP group
        rows = torch.cat([g[r, : counts[r]] for r in reps])                 # [sum n_s, H]
        y = local_moe(rows)
        ys = y.new_zeros(lay.ep_span, n_max, hid)
        off = 0
        for s, r in enumerate(reps):
            ys[s, : counts[r]] = y[off: off + counts[r]]
            off += counts[r]
        if lay.tp == 1:
            out = self.reduce_scatter_ep(ys)                                # [n_max, H]
        else:
            out = self.all_reduce_ep(ys)[lay.ep_slot(self.rank)]
        return out[:n]

    def local_logits(self, x: torch.Tensor, lm_head: torch.Tensor,
                     linear: Callable[..., torch.Tensor] = linear) -> torch.Tensor:
        """x [B, H] -> this rank's real vocabulary columns [B, vocab_len] (padding rows left out)."""
        return linear(x, lm_head[: self.vocab_len])

    def greedy(self, logits: torch.Tensor) -> torch.Tensor:
        """Distributed greedy argmax over local logits [B, vocab_len] -> global token ids [B] (int64),
        exactly torch.argmax over the whole vocabulary (ties to the lowest id, NaN wins)."""
        return self.greedy_with_values(logits)[0]

    def greedy_with_values(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`greedy`, and each row's winning logit [B], the same on every TP rank: NaN when the row holds a NaN
        anywhere, +inf for a +inf, -inf when the whole row is -inf."""
        vals, idx = shard_argmax(logits, self.vocab_start)
        if self.tp_size == 1:
            return idx, vals
        ity = _INT_OF[vals.element_size()]
        packed = torch.stack((vals.contiguous().view(ity).to(torch.int64), idx))   # [2, B] exact bits
        g = self.all_gather_tp(packed)                                              # [tp, 2, B]
        values = g[:, 0].to(ity).view(vals.dtype)
        nan = values.isnan().any(dim=0)
        best = values.masked_fill(values.isnan(), -math.inf).amax(dim=0).masked_fill(nan, math.nan)
        return reduce_argmax(values, g[:, 1]), best

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Local logits [B, vocab_len] -> the full [B, V] on every TP rank (for non-greedy sampling)."""
        if self.tp_size == 1:
            return logits
        width = -(-self.vocab_size // self.tp_size)
        lp = F.pad(logits, (0, width - logits.shape[1]))
        g = self.all_gather_tp(lp)                                                  # [tp, B, width]
        return g.permute(1, 0, 2).reshape(logits.shape[0], -1)[:, : self.vocab_size]


# --------------------------------------------------------------------------------------------------
def init_distributed(backend: str | None = None) -> tuple[int, int]:
    """init_process_group from torchrun's env vars (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) unless it
    is already initialized -> (rank, world size). Backend: gloo on CPU (default), nccl with CUDA. Its
    timeout is the start-up one (ranks join as their imports finish, then load shards of their own for
    minutes); the engine arms the short one once the world has stepped (`ParallelContext.arm_timeout`)."""
    if not dist.is_initialized():
        backend = backend or os.environ.get("GIGADECODE_DIST_BACKEND") or "gloo"
        dist.init_process_group(backend, timeout=STARTUP_TIMEOUT)
    return dist.get_rank(), dist.get_world_size()


def make_parallel_context(cfg: GptOssConfig, tp: int, dp: int, ep: int, dcp: int = 1,
                          dcp_interleave: int = 1) -> ParallelContext:
    """Build this rank's context on an initialized default process group. Every rank must call it (the
    TP, EP and DCP groups are created collectively, in mesh order)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    layout = build_layout(tp, dp, ep, world, cfg, dcp)
    tp_group = ep_group = dcp_group = None
    for ranks in layout.tp_groups:
        g = dist.new_group(list(ranks)) if tp > 1 else None
        if rank in ranks:
            tp_group = g
    for ranks in layout.ep_groups:
        g = dist.new_group(list(ranks)) if ep > 1 else None
        if rank in ranks:
            ep_group = g
    if dcp > 1:
        for ranks in layout.dcp_groups:
            g = dist.new_group(list(ranks))
            if rank in ranks:
                dcp_group = g
    return ParallelContext(layout, rank, tp_group, ep_group, cfg.num_local_experts, cfg.vocab_size,
                           dcp_group=dcp_group, dcp_interleave=dcp_interleave)
