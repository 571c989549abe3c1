"""`TPGroupConnector`: the NIXL connectors of one TP group's ranks acting as one engine's connector.

In a parallel engine every rank has its own `NixlConnector` over its own KV shard (its own NIXL agent, its
kv heads, a producer's own side channel). The engine replicas of a TP group must still take identical
scheduling decisions, but transfers land and leases end at slightly different moments on each rank. This
wrapper turns the per-rank events into group decisions, with one small all-reduce over the TP group in a
step that has transfers or leases outstanding (the sets are the same on every rank, so are the calls):

- consumer: a load is *done* once every rank's READs landed intact, *failed* as soon as one rank's failed
  (the others cancel theirs); nobody decodes from KV some rank does not hold. The producer ranks are told
  they may free (`notify`) only once the whole group holds the KV, since several decode ranks may read
  the same prefill blocks.
- consumer with decode context parallel: no rank holds every block, so once a load landed on every rank
  the group combines the ranks' partial CRCs per kv head (`connector.dcp_reads`, one all-gather of a few
  ints per head) and every rank compares with the prefill's; a mismatch fails the load on all of them.
- producer: `request_finished` gathers every rank's params over the group into one answer whose
  `remote_ranks` lists each rank's engine id, side channel, kv head start and per-head CRCs (what a
  consumer of any TP size needs to read its heads); blocks are freed once every rank was notified or saw
  its lease expire or end early (`release`, which the parallel engine makes on every rank in one step).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..connector.base import KVConnectorBase
from ..connector.dcp_reads import combine
from ..connector.params import KVTransferParams, RemoteRank
from ..distributed.context import ParallelContext


class TPGroupConnector(KVConnectorBase):
    def __init__(self, inner, ctx: ParallelContext) -> None:
        super().__init__(inner.role)
        self.inner, self.ctx = inner, ctx
        self._loading: list[str] = []              # consumer: in flight, in start order (same on every rank)
        self._local: dict[str, str | None] = {}    # consumer: resolved here: None = landed, str = error
        self._leased: list[str] = []               # producer: leased, in order
        self._freeable: set[str] = set()           # producer: notified / expired here
        self._failures = 0
        self.server_engine_ids: frozenset[str] = frozenset({inner.engine_id})   # every rank's (`answers_as`)

    @property
    def stats(self) -> dict:
        """This rank's bytes; failures as the group decided them."""
        return {**self.inner.stats, "transfer_failures": self._failures}

    @property
    def side_port(self) -> int | None:
        return self.inner.side_port

    @property
    def key(self) -> bytes:
        return self.inner.key

    @property
    def engine_id(self) -> str:
        """This rank's (rank 0's answers name it)"""
        return self.inner.engine_id

    def handshake_info(self) -> dict[str, Any]:
        return self.inner.handshake_info()

    def prefill_target(self, num_prompt_tokens: int) -> int:
        return self.inner.prefill_target(num_prompt_tokens)

    def validate_remote(self, params: KVTransferParams, prompt_ids: list[int], num_groups: int,
                        lease_margin_s: float = 0.0, now: float | None = None) -> int:
        return self.inner.validate_remote(params, prompt_ids, num_groups, lease_margin_s, now)

    # -- producer ------------------------------------------------------------------------------------
    def request_finished(self, request_id: str, block_tables: list[list[int]], num_computed: int,
                         advertise_host: str | None = None) -> KVTransferParams:
        mine = self.inner.request_finished(request_id, block_tables, num_computed, advertise_host)
        if any(mine.remote_block_ids):
            self._leased.append(request_id)
        rank = mine.ranks()[0].model_dump()
        ranks: list[Any] = [None] * self.ctx.tp_size
        if self.ctx.tp_size > 1:
            with self.ctx.failing_as("tp", "all_gather_object"):
                dist.all_gather_object(ranks, rank, group=self.ctx.tp_group)
        else:
            ranks = [rank]
        return mine.model_copy(update={"remote_ranks": [RemoteRank(**r) for r in ranks]})

    def seal(self, params: KVTransferParams, prompt_ids: list[int]) -> KVTransferParams:
        return self.inner.seal(params, prompt_ids)

    def release(self, request_id: str) -> bool:
        """End this rank's lease; every rank of the group must do so in the same step (the parallel engine
        sends the release to all of them), or the group frees the blocks when the others' run out."""
        return self.inner.release(request_id)

    def holds_lease(self, request_id: str) -> bool:
        return request_id in self._leased

    def leased_ids(self) -> list[str]:
        return list(self._leased)

    def answers_as(self, engine_id: str) -> bool:
        return engine_id in self.server_engine_ids

    # -- consumer ------------------------------------------------------------------------------------
    def start_load(self, request_id: str, params: KVTransferParams, local_tables: list[list[int]]) -> None:
        self._loading.append(request_id)
        self.inner.start_load(request_id, params, local_tables)

    def cancel(self, request_id: str) -> None:
        if request_id in self._loading:
            self._loading.remove(request_id)
        self._local.pop(request_id, None)
        self.inner.cancel(request_id)

    # -- both -------------------------------------------------------------------------------------------
    def get_finished(self) -> tuple[set[str], set[str], dict[str, str]]:
        if not self._loading and not self._leased:
            return set(), set(), {}
        sending, done, failed = self.inner.get_finished()
        self._freeable |= sending
        self._local.update({rid: None for rid in done})
        self._local.update(failed)
        # flags: [load landed here, load failed here] per load, then [lease ended here] per lease
        flags = torch.tensor([[rid in self._local and self._local[rid] is None, bool(self._local.get(rid))]
                              for rid in self._loading] + [[rid in self._freeable, False] for rid in self._leased],
                             dtype=torch.long).reshape(-1, 2)
        if self.ctx.tp_size > 1:
            self.ctx.stats.record("sched", "all_reduce", self.ctx.tp_size, flags.numel() * flags.element_size())
            with self.ctx.failing_as("tp", "transfer agreement"):
                dist.all_reduce(flags, group=self.ctx.tp_group)
        tp = self.ctx.tp_size
        g_done: set[str] = set()
        g_failed: dict[str, str] = {}
        n = len(self._loading)
        errors: dict[str, str] = {}
        if tp > 1 and int(flags[:n, 1].sum()):            # a failure somewhere: every rank learns its text
            mine = {rid: self._local[rid] for rid in self._loading if self._local.get(rid)}
            everyone: list = [None] * tp
            with self.ctx.failing_as("tp", "all_gather_object"):
                dist.all_gather_object(everyone, mine, group=self.ctx.tp_group)
            for r, part in enumerate(everyone):
                for rid, err in part.items():
                    errors.setdefault(rid, f"{err} (tensor-parallel rank {r})")
        if self.ctx.dcp_size > 1:
            landed_all = [rid for rid, (landed, bad) in zip(self._loading, flags[:n].tolist()) if landed == tp and not bad]
            errors.update(self._dcp_crc_check(landed_all))
        for rid, (landed, bad) in zip(list(self._loading), flags[:n].tolist()):
            if rid in errors and not bad:              # DCP: the group's CRC check failed
                bad = True
            if bad:
                err = errors.get(rid) or self._local.get(rid) or "KV transfer failed"
                self._local.pop(rid, None)
                self.inner.cancel(rid)                       # a READ still in flight here
                g_failed[rid] = err
                self._failures += 1
            elif landed == tp:
                self._local.pop(rid, None)
                self.inner.notify(rid)
                g_done.add(rid)
            else:
                continue
            self._loading.remove(rid)
        g_sending = {rid for rid, (ended, _) in zip(self._leased, flags[n:].tolist()) if ended == tp}
        self._leased = [rid for rid in self._leased if rid not in g_sending]
        self._freeable -= g_sending
        return g_sending, g_done, g_failed

    def _dcp_crc_check(self, rids: list[str]) -> dict[str, str]:
        """Loads that landed on every rank, checked together: -> request -> error for those whose combined
        per-head CRC32 does not match the prefill's (every rank gets the same answer)."""
        if not rids:
            return {}
        mine = {rid: self.inner.dcp_partial_crcs(rid) for rid in rids}
        everyone: list = [None] * self.ctx.tp_size
        with self.ctx.failing_as("tp", "all_gather_object"):
            dist.all_gather_object(everyone, mine, group=self.ctx.tp_group)
        errors: dict[str, str] = {}
        for rid in rids:
            parts: dict[int, list[int]] = {}
            length = mine[rid][1]
            for rank_parts in everyone:
                for h, c in rank_parts[rid][0].items():
                    parts.setdefault(h, []).append(c)
            params = self.inner.landed[rid].params
            bad = []
            for h, cs in sorted(parts.items()):
                src = next((r for r in params.ranks() if r.kv_crc32_heads is not None
                            and r.kv_head_start <= h < r.kv_head_start + len(r.kv_crc32_heads)), None)
                if src is None or combine(cs, length) != src.kv_crc32_heads[h - src.kv_head_start]:
                    bad.append(h)
            if bad:
                errors[rid] = (f"KV heads {bad} arrived corrupted or stale across the DCP group (CRC32 mismatch); "
                               f"the prefill's blocks were reused?")
        return errors

    def close(self) -> None:
        self.inner.close()
