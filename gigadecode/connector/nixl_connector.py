"""The NIXL connector: the DI protocol between a prefill engine (producer) and a GK decode engine (consumer).

Both roles need the deployment's KV secret (`secret`): it signs and checks the params and the handshake
(`params`: what is covered and what is not).

Producer (`kv_producer`): a request with `kv_transfer_params={"do_remote_decode": true}` and N prompt
tokens is prefilled for its first **N-1** tokens only (the DI truncation fix, below). Its blocks are then
held under a lease and the engine answers `kv_transfer_params`: engine id, side-channel host/port, request
id, per KV group the block ids still live (the sliding list clipped to the window) and the logical index
of the first one, `num_computed_tokens = N-1`, the lease deadline, a CRC32 of the KV bytes and one CRC32
per kv head (`kv_crc32_heads`, from global head `kv_head_start`: a decode rank of another TP size checks the
head slice it read), the KV layout id and the prompt digest, all signed (`seal`). The blocks are freed when
the consumer's READ notification arrives or when the lease expires.

Consumer (`kv_consumer`): a request carrying those params is checked at the door (`validate_remote`:
signature, prompt digest, layout, lease, not used before) and admitted with N-1 tokens computed; its
local blocks are allocated as if it had computed them (dead sliding blocks are null). The producer's
layout is fetched once per peer over the side channel (HTTP `GET /kv/handshake`, on a worker thread:
`HandshakeCache`; a failure is remembered for a back-off) and checked, then one READ moves every (remote,
local) block pair in every K and V region, notifying the producer. When the bytes land their CRC32 is
checked; only then does the request decode token N-1 with the GK program. A failed handshake, READ error,
time-out, expired lease, missing block or CRC mismatch never lets decode run on those blocks: the request
fails with a clear error (or, with policy `recompute`, is prefilled locally) and its blocks are freed; it
never fails another request.

Tensor parallel on either side (`head_ratio != 1`): each engine rank has its own connector over the kv heads
it holds (`kv_head_start`). A parallel producer's answer lists every rank (`remote_ranks`, see
`parallel.connector.TPGroupConnector`); a consumer posts one READ per producer rank whose heads overlap its
own, moving only the shared heads' bytes of each block, and checks those heads' CRC32s. A consumer rank of
a TP group does not notify the producer itself (`notify_on_read=False`): its group does, once every rank
holds intact KV.

Decode context parallel on the consumer (`tokens`): each rank reads only the remote blocks it owns, and its
TP group checks the CRCs together (`dcp_reads`).

The N-1 rule: the decode node recomputes the last prompt token, so it holds N-1 computed tokens and its
sliding group keeps blocks from token N-1-W+1 = N-W on. A prefill that computed all N tokens would apply
the sliding skip at N and free the block starting at N-W+1 whenever N-W+1 is a block boundary (with W a
multiple of the block size: N % block == block-1): that block is then never sent. Both nodes therefore
operate at N-1.
"""

from __future__ import annotations

import base64
import socket
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from ..kv.dcp import TokenShard
from .base import HandshakeError, KVConnectorBase, TransferError, model_identity, pair_remote_blocks
from .dcp_reads import dcp_pairs, partial_head_crcs, stream_length
from .kv_crc import crc_matches, kv_crc32, kv_crc32_heads
from .nixl_agent import NixlKVAgent, ReadHandle
from .params import (KVParamsError, KVTransferParams, RemoteRank, check_secret, kv_layout_id, prompt_digest, sign,
                     verify)
from .side_channel import HandshakeCache, SideChannel


@dataclass
class _Lease:
    block_ids: list[list[int]]
    expires: float                      # wall clock (time.time())


@dataclass
class _Read:
    """One READ of a load: from one producer rank, the kv heads [heads) both hold."""
    remote: str
    handle: ReadHandle
    heads: tuple[int, int]
    source: RemoteRank                  # that producer rank (its request id and CRCs)
    done: bool = False


@dataclass
class _Load:
    request_id: str
    params: KVTransferParams
    local_tables: list[list[int]] = field(default_factory=list)
    reads: list[_Read] = field(default_factory=list)
    pairs: list[tuple[int, int]] = field(default_factory=list)
    local_ids: list[list[int]] = field(default_factory=list)
    t_start: float = 0.0
    dcp_slots: list[list[tuple[int, int]]] | None = None   # DCP: per group (remote index, local id) read here
    posted: bool = False                # False while a handshake it needs is in flight
    error: str | None = None

    @property
    def nbytes(self) -> int:
        return sum(r.handle.nbytes for r in self.reads)


class NixlConnector(KVConnectorBase):
    """One engine's NIXL connector (the interface and who calls what: `base.KVConnectorBase`)."""

    NOTIF_FLUSH_S = 2.0       # consumer: how long the agent is progressed after a notification (not a READ's)

    def __init__(self, role: str, kv, cfg, *, secret: str | None, host: str = "127.0.0.1",
                 advertise_host: str | None = None, side_port: int = 0, lease_s: float = 30.0,
                 timeout_s: float = 10.0, engine_id: str | None = None, kv_head_start: int = 0,
                 notify_on_read: bool = True, tokens: TokenShard = TokenShard(), vllm_kv_layout: str = "auto",
                 consumers: int = 1, model_fingerprint: str = "") -> None:
        """`secret`: the deployment key shared by prefill and decode engines (required). `model_fingerprint`:
        the checkpoint's weights fingerprint, part of the KV layout id (a pair running other weights is
        refused). `host`: where a
        producer's side channel listens (0.0.0.0 = every interface); `advertise_host`: what its answers
        tell decode engines to connect to (default `host`, or this machine's name when `host` is a wildcard).
        `kv_head_start`: the first global kv head this cache holds (a TP rank's shard; 0 = all heads).
        `notify_on_read` False: a consumer does not tell the producer when its READs land; `notify` does
        it later (a TP group's ranks notify once all of them hold intact KV). `tokens`: a consumer rank's DCP
        share (it reads the blocks it owns; its group checks the CRCs, `dcp_partial_crcs`). `vllm_kv_layout`
        and `consumers` (the ranks that read each request) serve loads from vLLM producers (`vllm_producer`)."""
        super().__init__(role)
        self.tokens = tokens
        self.vllm_kv_layout, self.consumers = vllm_kv_layout, consumers
        self._vllm = None
        self.key = check_secret(secret, role)
        self.kv, self.cfg = kv, cfg
        self.engine_id = engine_id or f"{role}-{uuid.uuid4().hex[:8]}"
        self.lease_s, self.timeout_s = lease_s, timeout_s
        self.notify_on_read = notify_on_read
        self.host = advertise_host or (host if host not in ("", "0.0.0.0", "::") else socket.gethostname())
        self.agent = NixlKVAgent(self.engine_id, engine_id=self.engine_id, host=self.host,
                                 model_id=model_identity(cfg, model_fingerprint),
                                 progress_thread=role != "kv_consumer")
        lay = self.agent.register_kv(kv, kv_head_start=kv_head_start, total_kv_heads=cfg.num_key_value_heads)
        self.layout_id = kv_layout_id(lay.model_id, lay.dtype, lay.packed, lay.block_size, lay.head_dim,
                                      lay.num_groups, lay.num_buffers, lay.model_kv_heads, lay.k_scale, lay.v_scale)
        self.side = SideChannel(host, side_port, self.handshake_info, self.key) if role != "kv_consumer" else None
        self.leases: dict[str, _Lease] = {}
        self.loads: dict[str, _Load] = {}
        self.landed: dict[str, _Load] = {}         # notify_on_read False: landed, producer not told yet
        self.given_up: dict[str, KVTransferParams] = {}   # loads cancelled before their READs were posted
        self.flush_until = 0.0                     # consumer: progress the agent until then (notifications out)
        self.used: dict[tuple[str, str], float] = {}   # consumer: (producer engine, its request) -> lease end
        self.handshakes = HandshakeCache(self.key, timeout_s)
        self.stats = {"kv_bytes_transferred": 0, "transfer_failures": 0, "transfer_seconds": 0.0}

    @property
    def side_port(self) -> int | None:
        return self.side.port if self.side else None

    def handshake_info(self) -> dict[str, Any]:
        return {"layout": self.agent.layout().to_dict(),
                "agent_metadata": base64.b64encode(self.agent.metadata()).decode()}

    # -- producer ------------------------------------------------------------------------------------
    def request_finished(self, request_id: str, block_tables: list[list[int]], num_computed: int,
                         advertise_host: str | None = None) -> KVTransferParams:
        """Prefill of N-1 tokens is done: lease the live blocks, answer the (unsigned: `seal`) params, which
        point decode engines at `advertise_host` (default: this connector's)."""
        first, ids = [], []
        for table in block_tables:
            j = next((i for i, b in enumerate(table) if b != 0), len(table))
            live = table[j:]
            if any(b == 0 for b in live):
                raise TransferError(f"request {request_id}: a null block inside the live window {table}")
            first.append(j)
            ids.append(live)
        expires = time.time() + self.lease_s
        if any(ids):                      # a 1-token prompt leaves nothing to send, hence no lease
            self.leases[request_id] = _Lease(ids, expires)
        return KVTransferParams(
            do_remote_prefill=True, remote_engine_id=self.engine_id, remote_host=advertise_host or self.host,
            remote_port=self.side_port, remote_request_id=request_id, remote_block_ids=ids,
            remote_first_block=first, num_computed_tokens=num_computed, lease_expires=expires,
            kv_crc32=kv_crc32(self.kv, ids), kv_head_start=self.agent.layout().kv_head_start,
            kv_crc32_heads=kv_crc32_heads(self.kv, ids), kv_layout_id=self.layout_id)

    def leased_ids(self) -> list[str]:
        return list(self.leases)

    def release(self, request_id: str) -> bool:
        lease = self.leases.get(request_id)
        if lease is None:
            return False
        lease.expires = 0.0
        return True

    def seal(self, params: KVTransferParams, prompt_ids: list[int]) -> KVTransferParams:
        return sign(params.model_copy(update={"prompt_digest": prompt_digest(prompt_ids)}), self.key)

    # -- consumer ------------------------------------------------------------------------------------
    def validate_remote(self, params: KVTransferParams, prompt_ids: list[int], num_groups: int,
                        lease_margin_s: float = 0.0, now: float | None = None) -> int:
        """Check a consumer request's params (KVParamsError names the field): signed with our key, for this
        prompt and KV layout, not used before, lease not over (`lease_margin_s` early), well formed.
        -> the number of prompt tokens whose KV arrives (N-1)."""
        verify(params, self.key, prompt_ids, self.layout_id)
        if params.producer == "vllm":
            return self._validate_vllm(params, prompt_ids, num_groups, lease_margin_s, now)
        rank_keys = ("remote_engine_id", "remote_host", "remote_port", "remote_request_id")
        need = ("remote_block_ids", "remote_first_block", "num_computed_tokens", "lease_expires",
                *(() if params.remote_ranks else (*rank_keys, "kv_crc32")))
        missing = [k for k in need if getattr(params, k) is None]
        if missing:
            raise KVParamsError(f"kv_transfer_params is missing {', '.join(missing)}",
                                f"kv_transfer_params.{missing[0]}")
        n = params.num_computed_tokens
        if n != len(prompt_ids) - 1:
            raise KVParamsError(f"kv_transfer_params.num_computed_tokens is {n}, expected {len(prompt_ids) - 1} "
                                f"(prompt length - 1)", "kv_transfer_params.num_computed_tokens")
        if len(params.remote_block_ids) != num_groups or len(params.remote_first_block) != num_groups:
            raise KVParamsError(f"kv_transfer_params has block ids for {len(params.remote_block_ids)} KV groups, "
                                f"this engine has {num_groups}", "kv_transfer_params.remote_block_ids")
        now = time.time() if now is None else now
        if now + lease_margin_s > params.lease_expires:
            raise KVParamsError(f"the prefill lease of {params.remote_request_id or 'these params'} is over "
                                f"(expired {now - params.lease_expires:.1f} s ago, or too close to expiry): its "
                                f"blocks may hold another request's KV now", "kv_transfer_params.lease_expires")
        self.used = {k: t for k, t in self.used.items() if t > now}
        if any(self._use_key(params, r) in self.used for r in params.ranks()):
            raise KVParamsError("these kv_transfer_params were used already (each prefill's KV is read once)",
                                "kv_transfer_params.remote_request_id")
        return n

    def _validate_vllm(self, params: KVTransferParams, prompt_ids: list[int], num_groups: int,
                       lease_margin_s: float, now: float | None) -> int:
        """`validate_remote` for the router-signed answer of a vLLM producer."""
        if not self.tokens.trivial:
            raise KVParamsError("a decode engine with --dcp reads from gigadecode prefill engines only",
                                "kv_transfer_params.producer")
        missing = [k for k in ("remote_engine_id", "remote_host", "remote_port", "remote_request_id",
                               "remote_block_ids", "num_computed_tokens", "lease_expires") if getattr(params, k) is None]
        if missing:
            raise KVParamsError(f"kv_transfer_params is missing {', '.join(missing)}", f"kv_transfer_params.{missing[0]}")
        n = params.num_computed_tokens
        if n != len(prompt_ids) - 1:
            raise KVParamsError(f"the vLLM prefill computed {n} tokens, expected {len(prompt_ids) - 1} (prompt length - 1:"
                                f" send it the prompt without its last token)", "kv_transfer_params.num_computed_tokens")
        if len(params.remote_block_ids) != num_groups:
            raise KVParamsError(f"the vLLM prefill answered block ids for {len(params.remote_block_ids)} KV groups, "
                                f"this engine has {num_groups}", "kv_transfer_params.remote_block_ids")
        now = time.time() if now is None else now
        if now + lease_margin_s > params.lease_expires:
            raise KVParamsError("the vLLM prefill's lease of these params is over (or too close to it)",
                                "kv_transfer_params.lease_expires")
        self.used = {k: t for k, t in self.used.items() if t > now}
        if self._use_key(params, params.ranks()[0]) in self.used:
            raise KVParamsError("these kv_transfer_params were used already (each prefill's KV is read once)",
                                "kv_transfer_params.remote_request_id")
        return n

    @property
    def vllm(self):
        """The reads from vLLM producers (made on first use)."""
        if self._vllm is None:
            from .vllm_producer import VllmReader
            lay = self.agent.layout()
            self._vllm = VllmReader(self.agent, self.kv, self.cfg, heads=lay.head_range, timeout_s=self.timeout_s,
                                    layout=self.vllm_kv_layout, consumers=self.consumers)
        return self._vllm

    @staticmethod
    def _use_key(params: KVTransferParams, rank: RemoteRank) -> tuple[str, str]:
        return rank.remote_engine_id, rank.remote_request_id

    def start_load(self, request_id: str, params: KVTransferParams, local_tables: list[list[int]]) -> None:
        """Claim the params, start the handshakes this load needs (on a worker thread, once per producer rank)
        and post the READs as soon as all are done; every failure is reported by `get_finished`."""
        if params.producer == "vllm":
            self.used[self._use_key(params, params.ranks()[0])] = params.lease_expires or 0.0
            self.vllm.start_load(request_id, params, local_tables)
            return
        load = _Load(request_id, params, local_tables, t_start=time.monotonic())
        self.loads[request_id] = load
        try:
            if time.time() > params.lease_expires:
                raise TransferError(f"the prefill lease of {params.remote_request_id} expired before the read")
            for r in params.ranks():
                key = self._use_key(params, r)
                if key in self.used:
                    raise TransferError(f"kv_transfer_params of {r.remote_request_id} were used already")
                self.used[key] = params.lease_expires
            self._advance(load)
        except Exception as e:  # noqa: BLE001 - a load's failure is that request's, never the step's
            self._fail_load(load, e)

    def _advance(self, load: _Load) -> None:
        """Post the load's READs once every producer rank it needs is paired (handshakes done)."""
        l0, l1 = self.agent.layout().head_range
        ranks = self._source_ranks(load.params)
        remotes = [self.handshakes.ready(self.agent, r) for r in ranks]   # starts missing handshakes
        if any(name is None for name in remotes):
            return
        if self.tokens.trivial:
            load.pairs, load.local_ids = pair_remote_blocks(load.params, load.local_tables, self.kv.block_size)
        else:
            windows = [getattr(g.spec, "sliding_window", None) for g in self.kv.config.groups]
            load.pairs, load.dcp_slots = dcp_pairs(load.params, load.local_tables, self.kv.block_size, self.tokens,
                                                   windows)
            load.local_ids = [[lb for _, lb in m] for m in load.dcp_slots]
        covered: set[int] = set()
        for remote, src in zip(remotes, ranks):
            r0, r1 = self.agent.remote_layout(remote).head_range
            h0, h1 = max(l0, r0), min(l1, r1)
            if h0 >= h1 or covered >= set(range(h0, h1)):
                continue                          # none (or only already covered) of our heads
            covered |= set(range(h0, h1))
            notif = src.remote_request_id.encode()
            handle = self.agent.read(remote, load.pairs, notif=notif if self.notify_on_read else b"")
            load.reads.append(_Read(remote, handle, (h0, h1), src))
        if covered != set(range(l0, l1)):
            raise HandshakeError(f"the prefill ranks hold kv heads {sorted(covered)} of the [{l0}, {l1}) this "
                                 f"engine needs")
        load.posted = True

    def _source_ranks(self, params: KVTransferParams) -> list[RemoteRank]:
        """The producer ranks a load reads from: those holding kv heads of this engine."""
        l0, l1 = self.agent.layout().head_range
        return [r for r in params.ranks() if r.kv_crc32_heads is None
                or r.kv_head_start < l1 and l0 < r.kv_head_start + len(r.kv_crc32_heads)] or params.ranks()

    def _fail_load(self, load: _Load, e: BaseException) -> None:
        self._release(load)
        load.error = str(e) if isinstance(e, (TransferError, HandshakeError)) else f"{type(e).__name__}: {e}"

    def _release(self, load: _Load) -> None:
        for r in load.reads:
            if not r.done:
                self.agent._release(r.handle)
        load.reads = []

    # -- both -------------------------------------------------------------------------------------------
    def get_finished(self) -> tuple[set[str], set[str], dict[str, str]]:
        """-> (producer requests whose blocks may be freed, consumer requests whose KV landed intact,
        consumer requests whose load failed: request -> error)."""
        sending: set[str] = set()
        if self.leases:
            for _, msgs in self.agent.get_notifs().items():
                for m in msgs:
                    rid = m.decode(errors="replace")
                    if rid in self.leases:
                        sending.add(rid)
            now = time.time()
            sending |= {rid for rid, lease in self.leases.items() if lease.expires <= now}
            for rid in sending:
                self.leases.pop(rid, None)
        done: set[str] = set()
        failed: dict[str, str] = {}
        if self._vllm is not None:
            v_done, v_failed = self._vllm.get_finished()
            done |= v_done
            failed.update(v_failed)
            self.stats["transfer_failures"] += len(v_failed)
            for rid in v_done:
                self.stats["kv_bytes_transferred"] += self._vllm.landed[rid].nbytes
                if self.notify_on_read:
                    self._vllm.notify(rid)
        if self.given_up or self.flush_until > time.monotonic():
            self._tell_given_up()
        for rid, load in list(self.loads.items()):
            err = self._poll_load(load)
            if err is False:
                continue
            del self.loads[rid]
            if err is None:
                done.add(rid)
                self.stats["kv_bytes_transferred"] += load.nbytes
                self.stats["transfer_seconds"] += time.monotonic() - load.t_start
                if not self.notify_on_read:
                    self.landed[rid] = load
            else:
                self._release(load)
                failed[rid] = err
                self.stats["transfer_failures"] += 1
        return sending, done, failed

    def _poll_load(self, load: _Load) -> str | None | bool:
        """One load's state: False = still in flight, None = landed intact, str = why it failed."""
        if load.error is not None:
            return load.error
        try:
            if not load.posted:
                self._advance(load)
            if load.posted:
                for r in load.reads:
                    r.done = r.done or self.agent.poll(r.handle)
            if not load.posted or not all(r.done for r in load.reads):
                if time.monotonic() - load.t_start <= self.timeout_s:
                    return False
                if not load.posted:
                    for r in load.params.ranks():
                        self.handshakes.give_up(r.remote_engine_id, self.agent)
                    return (f"KV handshake with the prefill engine "
                            f"{', '.join(r.remote_engine_id for r in load.params.ranks())} timed out after "
                            f"{self.timeout_s:.3g} s (no answer)")
                late = [r.remote for r in load.reads if not r.done]
                return f"KV transfer from {', '.join(late)} timed out after {self.timeout_s:.3g} s"
            if load.dcp_slots is not None:
                return None                       # DCP: no rank can check alone; its TP group does
            heads = self.agent.layout().head_range
            bad = [r for r in load.reads
                   if not crc_matches(self.kv, load.local_ids, r.source, heads, None if len(load.reads) == 1 else r.heads)]
            if bad:
                return (f"KV heads {', '.join(f'[{r.heads[0]}, {r.heads[1]})' for r in bad)} from "
                        f"{', '.join(r.remote for r in bad)} arrived corrupted or stale (CRC32 mismatch); "
                        f"the prefill's blocks were reused?")
            return None
        except Exception as e:  # noqa: BLE001 - one load's failure never breaks the step
            self._fail_load(load, e)
            return load.error

    def dcp_partial_crcs(self, request_id: str) -> tuple[dict[int, int], int]:
        """(DCP, a landed load) -> ({global kv head: crc32 of its stream with the blocks not read here as
        zeros}, the stream's length in bytes): what the TP group combines (`dcp_reads.combine`)."""
        load = self.landed[request_id]
        lens = [len(ids) for ids in load.params.remote_block_ids]
        l0, l1 = self.agent.layout().head_range
        crcs = partial_head_crcs(self.kv, load.dcp_slots, lens, (0, l1 - l0))
        return {l0 + i: c for i, c in enumerate(crcs)}, stream_length(self.kv, lens)

    def notify(self, request_id: str) -> None:
        """(`notify_on_read` False) tell every producer rank a landed load read from that it may free."""
        if self._vllm is not None and request_id in self._vllm.landed:
            self._vllm.notify(request_id)
            return
        load = self.landed.pop(request_id, None)
        self._free_at_producers(load.reads if load is not None else [])

    def cancel(self, request_id: str) -> None:
        """A consumer gives up its KV (aborted, preempted, failed): stop its reads and tell the producer ranks
        it reads from to free the blocks now (or once paired: `_tell_given_up`), not when the lease runs out
        (best effort)."""
        if self._vllm is not None:
            self._vllm.cancel(request_id)
        loads = [ld for ld in (self.landed.pop(request_id, None), self.loads.pop(request_id, None)) if ld is not None]
        reads = [r for ld in loads for r in ld.reads]
        for ld in loads:
            self._release(ld)
            if not ld.posted and ld.error is None:       # its handshake still runs: tell the producer once done
                self.given_up[request_id] = ld.params
        self._free_at_producers(reads, best_effort=True)

    def _tell_given_up(self) -> None:
        """Loads cancelled while a handshake they needed ran (no READ, so no notification yet): tell their
        producer ranks to free once paired. Forgotten when a handshake fails or the lease ends (which frees).
        A message may have to connect to its peer first: the agent (no progress thread here) is progressed for
        `NOTIF_FLUSH_S` after one is sent, or it would wait for the next READ to that peer."""
        for rid, params in list(self.given_up.items()):
            ranks = self._source_ranks(params)
            try:
                names = [self.handshakes.ready(self.agent, r) for r in ranks]
            except HandshakeError:
                names = []
            if None in names and time.time() < params.lease_expires:
                continue
            del self.given_up[rid]
            for name, r in zip(names, ranks):
                if name is None:                       # its lease is over: nothing left to free
                    continue
                try:
                    self.agent.send_notif(name, r.remote_request_id.encode())
                    self.flush_until = time.monotonic() + self.NOTIF_FLUSH_S
                except Exception:  # noqa: BLE001 - best effort: the lease frees the blocks when it runs out
                    pass
        if self.flush_until > time.monotonic():
            try:
                self.agent.progress()
            except TransferError:
                self.flush_until = 0.0

    def _free_at_producers(self, reads, best_effort: bool = False) -> None:
        """Notify the producer rank of each read (the notification is its remote request id) that it may free
        those blocks. `best_effort`: a send that fails is left to the lease, which frees them when it runs out;
        otherwise the failure propagates to the caller."""
        for r in reads:
            try:
                self.agent.send_notif(r.remote, r.source.remote_request_id.encode())
                self.flush_until = time.monotonic() + self.NOTIF_FLUSH_S   # maybe not connected yet
            except Exception:  # noqa: BLE001 - which failures are fatal is the caller's choice
                if not best_effort:
                    raise

    def close(self) -> None:
        if self._vllm is not None:
            self._vllm.close()
        self.handshakes.close()
        if self.side is not None:
            self.side.close()
        self.agent.close()
