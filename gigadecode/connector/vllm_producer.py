"""A stock vLLM prefill engine as a KV producer: the decode engine's reads from it.

vLLM's NixlConnector producer (`kv_role: kv_producer`, pull mode, CPU, TP 1) answers a prefill with
`kv_transfer_params` {remote_engine_id, remote_host, remote_port, remote_request_id (its internal id),
remote_block_ids (one list per KV group, sliding group first; the sliding list is the tail of the
sequence, possibly led by the null block 0), remote_num_tokens, tp_size, transfer_mode: "pull", …}. The
router (`server.proxy`, which holds this deployment's KV secret) turns that answer into our signed params
with `producer: "vllm"` (`vllm_handshake.from_vllm_answer`), so a decode engine still accepts only params its
router made.

The handshake (`vllm_handshake.fetch_handshake`) gives the agent metadata: engine_id, NIXL agent_metadata,
kv_caches_base_addr (one region per pair of layers 2r, 2r+1), num_blocks, block_lens, block_strides,
kv_cache_layout, block_size, attn_backend_name. vLLM's compatibility hash cannot be recomputed outside vLLM
and only consumers check it: the reader checks the geometry itself instead (the region count against its HMA
buffers, the page size against the model's kv heads, head dim and the vLLM block size, from which the KV
element size follows: 1 = FP8, 2 = bf16, 4 = fp32).

Reads (`VllmReader`): block b of region r is `base[r] + b·stride[r]` (`block_lens[r]` bytes: the page of
layer 2r when b is in the sliding list, of layer 2r+1 when in the full list). The page's inner order is
not in the handshake (`vllm_layout`): `--vllm-kv-layout` says it (default: "amx" for bf16 pages with a
block size multiple of 32 on a CPU with AMX, else "vec" — vLLM's own rule, assuming the producer runs on
the same kind of CPU). One READ moves every live page into a staging buffer registered for that load; the
tokens this engine needs are then repacked into its own blocks (its block size may differ: a local block
takes tokens from whichever remote block holds them). Then, and only then, the producer is told
`"<remote_request_id>:<consumers>"` (it frees its blocks once every consumer said so); while a load waits
the reader sends `"HB:<id>"` every `HEARTBEAT_S` to extend the lease. Nothing else is ever sent: any other
notification would stop vLLM's engine. There is no CRC in vLLM's answer, so a load that has not landed
before the lease the router computed (`lease_expires`) is failed, never decoded.

A restarted producer: vLLM keeps an engine id fixed in `--kv-transfer-config` across restarts, so a new
process (new NIXL agent, new memory) answers under the id this reader paired with, and its block ids name
other requests' KV. The router signs which process answered (`producer_process`, `vllm_handshake`); a load
reads only through a pairing with that process (`_same_process`): when the pairing is with another one, a
fresh handshake decides: the answering process is still there (this pairing is stale: vLLM restarted since
it was made) -> pair with it anew and read; it is gone -> the request fails, reading nothing. A READ that
fails in NIXL (an "ERR" state or a NIXL exception: the peer is gone) fails its request, naming the engine,
and drops that pairing (`_unpair`); the old agent leaves NIXL once no load holds it. That READ's staging
buffer stays registered (`stranded`, kept alive): measured with nixl 1.5.1, deregistering a staging buffer
whose READ post failed on a lost peer aborts the process in about one run of four ("ucp_rcache: destroying
inuse region … ref 4294967288", then a double free). Params without `producer_process` (signed by a router
from before it) fall back on time: the reader notes when it dropped an engine's pairing (`lost_at`), and
their load fails before any handshake or read when they were issued (`issued_at`, the router's clock) before
`lost_at + RESTART_SKEW_S` (`_refuse_if_restarted`); a reader that had no pairing when the engine restarted
cannot tell those apart.

The N-1 rule: vLLM computes and keeps every token it is given, so the router sends it `prompt[:-1]`; its
block lists then cover exactly the N-1 tokens this engine's decode needs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .base import HandshakeError, TransferError
from .params import KVTransferParams
from .side_channel import BackedOffFetches
from .vllm_handshake import VllmAgentMetadata, fetch_handshake
from .vllm_layout import LAYOUTS, default_layout, repack_tokens, token_plan

HEARTBEAT_S = 5.0
RESTART_SKEW_S = 2.0        # router vs decode host clocks: params issued this soon after a lost pairing are refused
ELEMENT = {1: torch.float8_e4m3fn, 2: torch.bfloat16, 4: torch.float32}


# --------------------------------------------------------------------------------------------------
# the reads (decode side)
# --------------------------------------------------------------------------------------------------
@dataclass
class _VllmLoad:
    request_id: str
    params: KVTransferParams
    local_tables: list[list[int]]
    t_start: float
    remote: str | None = None             # the producer's NIXL agent, once paired
    meta: VllmAgentMetadata | None = None
    staging: torch.Tensor | None = None
    reg: Any = None
    xfer: Any = None
    ids: list[list[int]] = field(default_factory=list)   # per group: the remote ids read (null skipped)
    error: str | None = None
    lost: bool = False                    # its READ failed in NIXL: the peer is gone (`_read_failed`)
    landed: bool = False
    nbytes: int = 0


class VllmReader:
    """The decode engine's reads from vLLM producers (`NixlConnector` delegates loads whose params say
    `producer: "vllm"`). `heads` [h0, h1): the model kv heads this cache holds; `consumers`: how many
    ranks read each request (the TP group: each says `:consumers`, vLLM frees after that many)."""

    def __init__(self, agent, kv, cfg, *, heads: tuple[int, int], timeout_s: float, layout: str = "auto",
                 consumers: int = 1) -> None:
        if layout not in ("auto", *LAYOUTS):
            raise ValueError(f"--vllm-kv-layout must be auto|{'|'.join(LAYOUTS)} (got {layout!r})")
        from .nixl_agent import NIXL_ERRORS     # here, not at the top: the router imports this module too
        self.nixl_errors = NIXL_ERRORS
        self.agent, self.kv, self.cfg = agent, kv, cfg
        self.heads, self.timeout_s, self.layout, self.consumers = heads, timeout_s, layout, consumers
        self.windows = [getattr(g.spec, "sliding_window", None) for g in kv.config.groups]
        self.loads: dict[str, _VllmLoad] = {}
        self.landed: dict[str, _VllmLoad] = {}
        self.paired: dict[str, tuple[str, VllmAgentMetadata]] = {}   # engine id -> (agent name, metadata)
        self.dropped: set[str] = set()      # agents of dropped pairings, removed once no load holds them
        self.lost_at: dict[str, float] = {}  # engine id -> wall clock when its last pairing was dropped
        self.stranded: list[tuple[Any, torch.Tensor]] = []   # staging NIXL may still touch: kept registered
        self.fetches = BackedOffFetches("vllm-handshake")
        self._last_hb = 0.0

    # -- the interface NixlConnector calls ----------------------------------------------------------
    def start_load(self, request_id: str, params: KVTransferParams, local_tables: list[list[int]]) -> None:
        load = _VllmLoad(request_id, params, local_tables, time.monotonic())
        self.loads[request_id] = load
        self._advance(load)

    def get_finished(self) -> tuple[set[str], dict[str, str]]:
        done: set[str] = set()
        failed: dict[str, str] = {}
        self._heartbeat()
        for rid, load in list(self.loads.items()):
            if load.error is None:
                self._advance(load)
            if load.error is not None:
                failed[rid] = load.error
            elif load.landed:
                done.add(rid)
            else:
                continue
            del self.loads[rid]
            if load.error is None:
                self.landed[rid] = load
            else:
                self._release(load, tell_producer=True)
        self._remove_dropped()
        return done, failed

    def notify(self, request_id: str) -> None:
        """The KV is in place on every rank: the producer may free its blocks."""
        load = self.landed.pop(request_id, None)
        if load is not None:
            self._release(load, tell_producer=True)

    def cancel(self, request_id: str) -> None:
        load = self.loads.pop(request_id, None) or self.landed.pop(request_id, None)
        if load is not None:
            self._release(load, tell_producer=True)

    def close(self) -> None:
        for rid in list(self.loads) + list(self.landed):
            self.cancel(rid)
        self.fetches.close()
        for name in {name for name, _ in self.paired.values()} | self.dropped:
            try:
                self.agent.agent.remove_remote_agent(name)
            except Exception:  # noqa: BLE001 - closing
                pass

    # -- one load -------------------------------------------------------------------------------------
    def _advance(self, load: _VllmLoad) -> None:
        if load.landed:
            return
        try:
            if time.time() > (load.params.lease_expires or 0):
                raise TransferError(f"the vLLM prefill's lease of {load.params.remote_request_id} may be over (no CRC "
                                    f"to prove its blocks still hold this request's KV): not decoded")
            if load.remote is None:
                if load.params.producer_process is None:
                    self._refuse_if_restarted(load.params)  # before any handshake: nothing is read
                paired = self._paired(load.params)
                if paired is not None:
                    paired = self._same_process(load.params, paired)
                if paired is None:
                    if time.monotonic() - load.t_start > self.timeout_s:
                        raise HandshakeError(f"KV handshake with the vLLM prefill {load.params.remote_engine_id} "
                                             f"timed out after {self.timeout_s:.3g} s")
                    return
                load.remote, load.meta = paired
                self._post(load)
            if load.xfer is not None and not load.landed:
                try:
                    state = self.agent.agent.check_xfer_state(load.xfer)
                except self.nixl_errors as e:
                    raise self._read_failed(load, f"{type(e).__name__}: {e}") from None
                if state == "ERR":
                    raise self._read_failed(load, "state ERR")
                if state == "DONE":
                    self._repack(load)
                    load.landed = True
                elif time.monotonic() - load.t_start > self.timeout_s:
                    raise TransferError(f"KV transfer from the vLLM prefill {load.params.remote_engine_id} timed "
                                        f"out after {self.timeout_s:.3g} s")
        except Exception as e:  # noqa: BLE001 - a load's failure is its request's
            load.error = str(e) if isinstance(e, (TransferError, HandshakeError)) else f"{type(e).__name__}: {e}"

    def _paired(self, params: KVTransferParams) -> tuple[str, VllmAgentMetadata] | None:
        """`params`' engine's pairing (agent name, metadata), handshaking first (None while that runs)."""
        eid = params.remote_engine_id
        if eid in self.paired:
            return self.paired[eid]
        return self.fetches.poll(eid, lambda: fetch_handshake(params.remote_host, params.remote_port, self.timeout_s),
                                 lambda meta: self._pair(params, meta), f"vLLM {eid}")

    def _pair(self, params: KVTransferParams, meta: VllmAgentMetadata) -> tuple[str, VllmAgentMetadata]:
        eid = params.remote_engine_id
        if meta.engine_id != eid:
            raise HandshakeError(f"the vLLM prefill at {params.remote_host}:{params.remote_port} is engine "
                                 f"{meta.engine_id!r} now, not the {eid!r} these params are from: that engine was "
                                 f"stopped or restarted since it answered them, and its KV is gone")
        self._check_geometry(meta)
        name = self.agent.agent.add_remote_agent(meta.agent_metadata)
        self.paired[eid] = (name.decode() if isinstance(name, bytes) else str(name), meta)
        return self.paired[eid]

    def _same_process(self, params: KVTransferParams, paired: tuple[str, VllmAgentMetadata]
                      ) -> tuple[str, VllmAgentMetadata] | None:
        """A pairing with the process that answered `params` (`producer_process`; any pairing for params without
        it): `paired` when it is that process's, else, after a fresh handshake (None while it runs), a new
        pairing when that process still answers (`paired` was stale: vLLM restarted since); TransferError when
        another process does (the one that answered is gone, and its KV with it)."""
        want, eid = params.producer_process, params.remote_engine_id
        if want is None or paired[1].process == want:
            return paired
        fresh = self.fetches.poll(f"{eid} again", lambda: fetch_handshake(params.remote_host, params.remote_port,
                                                                          self.timeout_s), lambda meta: meta,
                                  f"vLLM {eid}")
        if fresh is None:
            return None
        if fresh.process != want:
            raise TransferError(f"the vLLM prefill {eid} that answered these params is gone (it was restarted or "
                                f"stopped since): its KV went with it; not decoded")
        current = self.paired.get(eid)              # another load may have paired anew meanwhile
        if current is not None and current[1].process == want:
            return current
        if current is not None:                     # stale: its agent leaves NIXL once no load holds it
            self._unpair(eid, current[0])
        return self._pair(params, fresh)

    def _geometry(self, meta: VllmAgentMetadata) -> tuple[int, torch.dtype, str]:
        """-> (page bytes, element dtype, layout) of a producer's pages."""
        H, D = self.cfg.num_key_value_heads, self.cfg.head_dim
        page = meta.block_lens[0]
        elem, rest = divmod(page, 2 * H * meta.block_size * D)
        if rest or elem not in ELEMENT:
            raise HandshakeError(f"vLLM pages of {page} bytes do not hold {H} kv heads × block {meta.block_size} × "
                                 f"dim {D} of 1, 2 or 4 bytes (another model?)")
        layout = self.layout if self.layout != "auto" else default_layout(elem, meta.block_size)
        return page, ELEMENT[elem], layout

    def _check_geometry(self, meta: VllmAgentMetadata) -> None:
        if meta.kv_cache_layout and meta.kv_cache_layout != "LBHNC":
            raise HandshakeError(f"vLLM KV cache layout {meta.kv_cache_layout!r}: only LBHNC (CPU_ATTN) is read")
        if meta.attn_backend_name and meta.attn_backend_name != "CPU_ATTN":
            raise HandshakeError(f"vLLM attention backend {meta.attn_backend_name!r}: only CPU_ATTN pages can be "
                                 f"repacked")
        if len(meta.kv_caches_base_addr) != self.kv.config.group_size:
            raise HandshakeError(f"the vLLM prefill has {len(meta.kv_caches_base_addr)} KV regions, this engine "
                                 f"{self.kv.config.group_size} buffers (one per pair of layers): another model?")
        if len(set(meta.block_lens)) != 1:
            raise HandshakeError(f"vLLM regions of different page sizes {sorted(set(meta.block_lens))}")
        self._geometry(meta)

    def _post(self, load: _VllmLoad) -> None:
        """One READ of every live page (each region, each non-null block of both lists) into staging."""
        meta = load.meta
        page, _, _ = self._geometry(meta)
        load.ids = [[b for b in ids if b != 0] for ids in load.params.remote_block_ids]
        flat = [b for ids in load.ids for b in ids]
        if any(not 0 < b < meta.num_blocks for b in flat):
            raise TransferError(f"vLLM block id out of range [1, {meta.num_blocks})")
        regions = len(meta.kv_caches_base_addr)
        if not flat:
            load.landed = True
            return
        load.staging = torch.empty(regions, len(flat), page, dtype=torch.uint8)
        load.reg = self.agent.agent.register_memory([load.staging])
        base = load.staging.data_ptr()
        local = np.array([(base + (r * len(flat) + i) * page, page, 0) for r in range(regions)
                          for i in range(len(flat))], dtype=np.uint64)
        remote = np.array([(meta.kv_caches_base_addr[r] + b * meta.block_strides[r], meta.block_lens[r], 0)
                           for r in range(regions) for b in flat], dtype=np.uint64)
        a = self.agent.agent
        try:
            load.xfer = a.initialize_xfer("READ", a.get_xfer_descs(local, "DRAM"), a.get_xfer_descs(remote, "DRAM"),
                                          load.remote, b"")
            state = a.transfer(load.xfer)
        except self.nixl_errors as e:
            raise self._read_failed(load, f"posting it: {type(e).__name__}: {e}") from None
        if state == "ERR":
            raise self._read_failed(load, "posting it: state ERR")
        load.nbytes = load.staging.numel()

    # -- a lost producer ------------------------------------------------------------------------------
    def _read_failed(self, load: _VllmLoad, why: str) -> TransferError:
        """A READ NIXL failed: the producer behind this pairing is gone (or unreachable). Drop the pairing so
        the next request to that engine id handshakes anew (a restarted vLLM keeps a fixed engine id);
        this request fails (its KV, if the engine restarted, went with the old process)."""
        eid = load.params.remote_engine_id
        load.lost = True
        self._unpair(eid, load.remote)
        return TransferError(f"READ from the vLLM prefill {eid} failed ({why}): that engine may have been stopped "
                             f"or restarted, its KV with it; this request is not decoded, the next one to it "
                             f"handshakes anew")

    def _unpair(self, eid: str, name: str | None) -> None:
        """Forget `eid`'s pairing if it is still with agent `name` (a later one is kept) and note when
        (`lost_at`); the agent leaves NIXL once no load holds it (`_remove_dropped`)."""
        if name is not None and eid in self.paired and self.paired[eid][0] == name:
            del self.paired[eid]
            self.dropped.add(name)
            self.lost_at[eid] = time.time()

    def _refuse_if_restarted(self, params: KVTransferParams) -> None:
        """TransferError when `params` may be from a process of their engine id that this reader lost: issued
        (router clock) before the loss was noticed (this clock) plus the skew, or of unknown issue time."""
        eid = params.remote_engine_id
        lost = self.lost_at.get(eid)
        if lost is not None and (params.issued_at is None or params.issued_at < lost + RESTART_SKEW_S):
            when = "at an unknown time" if params.issued_at is None else \
                f"{lost - params.issued_at:.1f} s before this decode server lost it"
            raise TransferError(f"the vLLM prefill {eid} was restarted (or lost) after these params were issued "
                                f"({when}): their KV went with the old process; not decoded")

    def _remove_dropped(self) -> None:
        """Remove from NIXL the agents of dropped pairings no load holds any more (a load holds its agent until
        released: its transfer handle, the notification it still owes)."""
        held = {load.remote for load in (*self.loads.values(), *self.landed.values())}
        for name in self.dropped - held:
            self.dropped.discard(name)
            try:
                self.agent.agent.remove_remote_agent(name)
            except self.nixl_errors:        # unknown to NIXL already: nothing to remove
                pass

    def _repack(self, load: _VllmLoad) -> None:
        """Staging pages -> this engine's blocks: per region (= buffer), per group, the tokens it needs."""
        meta = load.meta
        _, dtype, layout = self._geometry(meta)
        plans = token_plan(load.params, meta.block_size, load.local_tables, self.kv.block_size, self.windows)
        offsets = np.cumsum([0] + [len(ids) for ids in load.ids])
        for g, plan in enumerate(plans):
            if not plan:
                continue
            nonnull = [i for i, b in enumerate(load.params.remote_block_ids[g]) if b != 0]
            col = {k: int(offsets[g]) + nonnull.index(k) for k in set(k for k, _, _ in plan)}
            repack_tokens(self.kv, load.staging, torch.tensor([col[k] for k, _, _ in plan], dtype=torch.long),
                          torch.tensor([t for _, t, _ in plan], dtype=torch.long),
                          torch.tensor([s for _, _, s in plan], dtype=torch.long), self.heads,
                          self.cfg.num_key_value_heads, self.cfg.head_dim, meta.block_size, dtype, layout)

    def _release(self, load: _VllmLoad, tell_producer: bool) -> None:
        a = self.agent.agent
        if load.xfer is not None:
            try:
                a.release_xfer_handle(load.xfer)
            except Exception:  # noqa: BLE001 - an in-flight READ NIXL cannot cancel: its staging stays registered
                self.stranded.append((load.reg, load.staging))
                return
            load.xfer = None
        if load.reg is not None:
            if load.lost:                 # see the module docstring: deregistering it can abort the process
                self.stranded.append((load.reg, load.staging))
            else:
                a.deregister_memory(load.reg)
            load.reg, load.staging = None, None
        if tell_producer and load.remote is not None:
            # "<id>:<n>": the producer frees once n consumers said so (the only message besides "HB:")
            self._send(load.params.remote_engine_id, load.remote,
                       f"{load.params.remote_request_id}:{self.consumers}".encode())
            load.remote = None

    def _send(self, eid: str, remote: str, msg: bytes) -> None:
        """A notification; a producer that cannot be reached any more is unpaired (its blocks went with it)."""
        try:
            self.agent.agent.send_notif(remote, msg)
        except self.nixl_errors:
            self._unpair(eid, remote)

    def _heartbeat(self) -> None:
        now = time.monotonic()
        if now - self._last_hb < HEARTBEAT_S:
            return
        self._last_hb = now
        waiting: dict[tuple[str, str], list[str]] = {}
        for load in self.loads.values():
            if load.remote is not None:
                waiting.setdefault((load.params.remote_engine_id, load.remote), []).append(
                    load.params.remote_request_id)
        for (eid, remote), ids in waiting.items():
            self._send(eid, remote, ("HB:" + ",".join(ids)).encode())
