"""The rank layout of a TP × DP × EP decode deployment (pure Python: no process groups here).

World size = tp · dp. Ranks are numbered **TP-fastest**:

    rank = dp_rank · tp + tp_rank

- **TP groups**: dp groups of `tp` consecutive ranks, `tp_groups[g] = (g·tp, …, g·tp + tp - 1)`. The ranks of
  one TP group serve the same requests (one DP replica of attention) and split its q / kv heads, the
  o-proj input features and the lm_head vocabulary.
- **DP**: DP group g is TP group g; prompt i goes to DP group `i % dp`.
- **EP groups**: world/ep groups of `ep` consecutive ranks, `ep_groups[j] = (j·ep, …, j·ep + ep - 1)`;
  `ep_rank = rank % ep` holds the contiguous experts `[ep_rank·E/ep, (ep_rank+1)·E/ep)`. Each EP group
  holds every expert exactly once (world/ep expert replicas in all). EP groups must line up with TP
  groups: either `ep % tp == 0` (an EP group is `ep/tp` whole TP groups = `ep/tp` DP groups, whose tokens
  are gathered for the MoE) or `tp % ep == 0` (an EP group lies inside one TP group: its ranks already
  hold the same tokens). `ep_span = max(1, ep // tp)` is the number of DP groups one EP group covers.

- **DCP groups** (decode context parallel, `dcp` dividing `tp`): each TP group splits into tp/dcp groups of
  `dcp` consecutive ranks, `dcp_rank = tp_rank % dcp`. The ranks of a DCP group hold the same kv heads
  (kv shard `tp_rank // dcp` of tp/dcp) and different tokens of every sequence (`kv.dcp.TokenShard`);
  their q heads differ as without DCP. tp/dcp must not exceed the kv heads (a kv head held twice is what
  DCP removes).

The seed's TP8 × DP16 × EP128 on 128 ranks: 16 TP groups (0–7, 8–15, …, 120–127), one EP group
(0–127) spanning all 16 DP groups, one expert per rank for 128 experts.

Meshes are tuples of tuples (the seed's `ReplicaGroup` arguments).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import GptOssConfig
from ..argmax import vocab_shard
from ..weights import Shard


class LayoutError(ValueError):
    """An impossible TP × DP × EP layout (the message says why)."""


Mesh2D = tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class ParallelLayout:
    tp: int
    dp: int
    ep: int
    dcp: int = 1

    # -- sizes -------------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.tp * self.dp

    @property
    def ep_span(self) -> int:
        """DP groups covered by one EP group (1: the EP group's ranks hold the same tokens)."""
        return max(1, self.ep // self.tp)

    @property
    def num_ep_groups(self) -> int:
        return self.world_size // self.ep

    # -- meshes ------------------------------------------------------------------------------------
    @property
    def tp_groups(self) -> Mesh2D:
        return tuple(tuple(range(g * self.tp, (g + 1) * self.tp)) for g in range(self.dp))

    @property
    def dcp_groups(self) -> Mesh2D:
        return tuple(tuple(range(g * self.dcp, (g + 1) * self.dcp)) for g in range(self.world_size // self.dcp))

    @property
    def ep_groups(self) -> Mesh2D:
        return tuple(tuple(range(g * self.ep, (g + 1) * self.ep)) for g in range(self.num_ep_groups))

    # -- one rank ----------------------------------------------------------------------------------
    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank {rank} outside the world of {self.world_size} ranks")

    def tp_rank(self, rank: int) -> int:
        self._check_rank(rank)
        return rank % self.tp

    def dp_rank(self, rank: int) -> int:
        self._check_rank(rank)
        return rank // self.tp

    def ep_rank(self, rank: int) -> int:
        self._check_rank(rank)
        return rank % self.ep

    def dcp_rank(self, rank: int) -> int:
        self._check_rank(rank)
        return rank % self.dcp

    def ep_slot(self, rank: int) -> int:
        """Which of the EP group's `ep_span` DP groups this rank's tokens are (0 when ep_span == 1)."""
        return self.ep_rank(rank) // self.tp if self.ep >= self.tp else 0

    def tp_group_of(self, rank: int) -> tuple[int, ...]:
        return self.tp_groups[self.dp_rank(rank)]

    def ep_group_of(self, rank: int) -> tuple[int, ...]:
        self._check_rank(rank)
        return self.ep_groups[rank // self.ep]

    def shard(self, rank: int) -> Shard:
        return Shard(tp_rank=self.tp_rank(rank), tp_size=self.tp, ep_rank=self.ep_rank(rank), ep_size=self.ep,
                     dcp_size=self.dcp)

    def expert_range(self, rank: int, num_experts: int) -> tuple[int, int]:
        n = num_experts // self.ep
        e0 = self.ep_rank(rank) * n
        return e0, e0 + n

    def vocab_range(self, rank: int, vocab_size: int) -> tuple[int, int]:
        return vocab_shard(vocab_size, self.tp, self.tp_rank(rank))

    def describe(self) -> str:
        dcp = f", DCP groups of {self.dcp}" if self.dcp > 1 else ""
        return (f"TP{self.tp} × DP{self.dp} × EP{self.ep} (world {self.world_size}: {self.dp} TP groups of "
                f"{self.tp}, {self.num_ep_groups} EP group(s) of {self.ep} spanning {self.ep_span} DP group(s){dcp})")


def build_layout(tp: int, dp: int, ep: int, world_size: int | None = None,
                 cfg: GptOssConfig | None = None, dcp: int = 1) -> ParallelLayout:
    """Validate (tp, dp, ep, dcp) against the world size and (optionally) the model; LayoutError says why."""
    for name, v in (("tp", tp), ("dp", dp), ("ep", ep), ("dcp", dcp)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise LayoutError(f"--{name} must be a positive integer (got {v!r})")
    world = tp * dp
    if world_size is not None and world_size != world:
        raise LayoutError(f"world size {world_size} != tp*dp = {tp}*{dp} = {world} "
                          f"(start tp*dp processes, e.g. torchrun --nproc-per-node {world})")
    if world % ep:
        raise LayoutError(f"--ep {ep} does not divide the world size --tp × --dp = {world} (EP groups are ep "
                          f"consecutive ranks)")
    if ep % tp and tp % ep:
        raise LayoutError(f"--ep {ep} and --tp {tp}: one must divide the other (an EP group must be whole TP "
                          f"groups or lie inside one TP group)")
    if tp % dcp:
        raise LayoutError(f"--dcp {dcp} does not divide --tp {tp} (a DCP group is dcp ranks of one TP group)")
    if cfg is not None:
        nh, kv, E = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.num_local_experts
        if nh % tp:
            raise LayoutError(f"--tp {tp} does not divide the model's num_attention_heads={nh} (every TP rank "
                              f"computes num_attention_heads / tp query heads)")
        if kv % tp and tp % kv:
            raise LayoutError(f"--tp {tp} and the model's num_key_value_heads={kv}: one must divide the other "
                              f"(kv heads are split, or replicated when tp > kv heads)")
        if E % ep:
            raise LayoutError(f"--ep {ep} does not divide the model's num_local_experts={E} (every EP rank holds "
                              f"num_local_experts / ep experts)")
        if dcp > 1 and (tp // dcp > kv or kv % (tp // dcp)):
            raise LayoutError(f"--dcp {dcp} with --tp {tp}: the kv heads are split over tp/dcp = {tp // dcp} ranks, "
                              f"which must divide num_key_value_heads={kv} (with more, every kv head would still be "
                              f"held twice: raise --dcp to {tp // kv} or more)")
    return ParallelLayout(tp, dp, ep, dcp)
