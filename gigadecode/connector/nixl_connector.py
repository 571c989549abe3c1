"""The NIXL connector: the DI protocol between a prefill engine (producer) and a GK decode engine (consumer).

Producer (`kv_producer`): a request with `kv_transfer_params={"do_remote_decode": true}` and N prompt
tokens is prefilled for its first **N-1** tokens only (the DI truncation fix, below). Its blocks are then
held under a lease and the engine answers `kv_transfer_params`: engine id, side-channel host/port, request
id, per KV group the block ids still live (the sliding list clipped to the window) and the logical index
of the first one, `num_computed_tokens = N-1`, the lease deadline, a CRC32 of the KV bytes and one CRC32
per kv head (`kv_crc32_heads`, from global head `kv_head_start`: a decode rank of another TP size checks the
head slice it read). The blocks
are freed when the consumer's READ notification arrives or when the lease expires.

Consumer (`kv_consumer`): a request carrying those params is admitted with N-1 tokens computed; its
local blocks are allocated as if it had computed them (dead sliding blocks are null), the producer's
layout is fetched once per peer over the side channel (HTTP `GET /kv/handshake`) and checked, then one
READ moves every (remote, local) block pair in every K and V region, notifying the producer. When the
bytes land their CRC32 is checked; only then does the request decode token N-1 with the GK program.
A failed handshake, READ error, time-out, expired lease, missing block or CRC mismatch never lets decode
run on those blocks: the request fails with a clear error (or, with policy `recompute`, is prefilled
locally) and its blocks are freed.

Tensor parallel on either side (`head_ratio != 1`): each engine rank has its own connector over the kv heads
it holds (`kv_head_start`). A parallel producer's answer lists every rank (`remote_ranks`, see
`parallel.connector.TPGroupConnector`); a consumer posts one READ per producer rank whose heads overlap its
own, moving only the shared heads' bytes of each block, and checks those heads' CRC32s. A consumer rank of
a TP group does not notify the producer itself (`notify_on_read=False`): its group does, once every rank
holds intact KV.

The N-1 rule: the decode node recomputes the last prompt token, so it holds N-1 computed tokens and its
sliding group keeps blocks from token N-1-W+1 = N-W on. A prefill that computed all N tokens would apply
the sliding skip at N and free the block starting at N-W+1 whenever N-W+1 is a block boundary (with W a
multiple of the block size: N % block == block-1): that block is then never sent. Both nodes therefore
operate at N-1.
"""

from __future__ import annotations

import base64
import json
import threading
import time
import urllib.request
import uuid
import zlib
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch

from .base import HandshakeError, KVConnectorBase, KVLayout, TransferError, model_identity
from .nixl_agent import NixlKVAgent, ReadHandle


def kv_crc32(kv, block_ids: list[list[int]]) -> int:
    """CRC32 of a request's KV bytes: group by group, block by block, every buffer's K then V."""
    crc = 0
    for ids in block_ids:
        if not ids:
            continue
        idx = torch.tensor(ids, dtype=torch.long)
        for buf in kv.group_bufs:
            for half in (buf[0], buf[1]):
                crc = zlib.crc32(half.view(torch.uint8).index_select(0, idx).numpy().tobytes(), crc)
    return crc


def kv_crc32_heads(kv, block_ids: list[list[int]], heads: tuple[int, int] | None = None) -> list[int]:
    """One CRC32 per kv head of the cache (local head index h in `heads`, default all): that head's bytes
    of a request's KV, group by group, block by block, every buffer's K then V. Lets a consumer that
    holds other kv heads (prefill TP != decode TP) check exactly the slice it read."""
    h0, h1 = heads if heads is not None else (0, kv.group_bufs[0].shape[2])
    crcs = [0] * (h1 - h0)
    for ids in block_ids:
        if not ids:
            continue
        idx = torch.tensor(ids, dtype=torch.long)
        for buf in kv.group_bufs:
            for half in (buf[0], buf[1]):                   # [nb, kv, ...]: heads outermost within a block
                sel = half.view(torch.uint8).index_select(0, idx)
                for i, h in enumerate(range(h0, h1)):
                    crcs[i] = zlib.crc32(sel[:, h].contiguous().numpy().tobytes(), crcs[i])
    return crcs


def crc_matches(kv, local_ids: list[list[int]], params: dict[str, Any], local_heads: tuple[int, int],
                heads: tuple[int, int] | None = None) -> bool:
    """Did the KV of `local_ids` arrive intact? Global kv heads `heads` (default: all of `local_heads`, the
    heads this cache holds) are checked against the producer's per-head CRCs (`kv_crc32_heads`, from global
    head `kv_head_start` on) when both sides hold different heads, else against its whole-block `kv_crc32`."""
    h0, h1 = heads or local_heads
    r0 = int(params.get("kv_head_start", 0))
    per_head = params.get("kv_crc32_heads")
    if heads is None and per_head is not None and (r0, r0 + len(per_head)) == tuple(local_heads):
        return kv_crc32(kv, local_ids) == int(params["kv_crc32"])
    if per_head is None:
        if (h0, h1) != tuple(local_heads):
            return False                                  # no per-head CRCs to check a slice against
        return kv_crc32(kv, local_ids) == int(params["kv_crc32"])
    if h0 < r0 or h1 > r0 + len(per_head):
        return False
    got = kv_crc32_heads(kv, local_ids, (h0 - local_heads[0], h1 - local_heads[0]))
    return got == [int(c) for c in per_head[h0 - r0: h1 - r0]]


def pair_remote_blocks(params: dict[str, Any], local_tables: list[list[int]], block_size: int
                       ) -> tuple[list[tuple[int, int]], list[list[int]]]:
    """Map each group's live remote blocks (`remote_block_ids` from `remote_first_block` on) onto the local
    blocks at the same logical indices -> (pairs, per-group local ids). Every live local block that holds
    computed tokens needs a remote block (else the prefill never sent it: the failure the N-1 rule
    prevents); blocks past the last computed token need no data."""
    n, B = int(params["num_computed_tokens"]), block_size
    last = (n - 1) // B if n > 0 else -1               # last logical block holding a computed token
    pairs: list[tuple[int, int]] = []
    local_ids: list[list[int]] = []
    for g, (rids, j0, table) in enumerate(zip(params["remote_block_ids"], params["remote_first_block"],
                                               local_tables)):
        mine: list[int] = []
        for j, lb in enumerate(table[: last + 1]):
            if lb == 0:
                continue
            if not j0 <= j < j0 + len(rids):
                raise TransferError(f"KV group {g}: logical block {j} was not sent by the prefill "
                                    f"(it sent blocks {j0}..{j0 + len(rids) - 1})")
            pairs.append((int(rids[j - j0]), int(lb)))
            mine.append(int(lb))
        if len(mine) != len(rids):
            raise TransferError(f"KV group {g}: the prefill sent {len(rids)} blocks, {len(mine)} are live here")
        local_ids.append(mine)
    return pairs, local_ids


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
    source: dict[str, Any]              # that producer rank's params (CRCs from its kv_head_start)
    done: bool = False


@dataclass
class _Load:
    request_id: str
    params: dict[str, Any]
    local_tables: list[list[int]] = field(default_factory=list)
    reads: list[_Read] = field(default_factory=list)
    pairs: list[tuple[int, int]] = field(default_factory=list)
    local_ids: list[list[int]] = field(default_factory=list)
    t_start: float = 0.0

    @property
    def nbytes(self) -> int:
        return sum(r.handle.nbytes for r in self.reads)


def producer_ranks(params: dict[str, Any]) -> list[dict[str, Any]]:
    """The producer ranks a consumer reads from: `remote_ranks` (a tensor-parallel prefill engine: one entry
    per TP rank with its engine id, side channel and kv heads) or the params themselves (one rank)."""
    return list(params.get("remote_ranks") or [params])


class _SideChannel:
    """A tiny HTTP server on the producer: `GET /kv/handshake` -> layout + agent metadata (JSON)."""

    def __init__(self, host: str, port: int, info) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:          # noqa: N802
                if self.path.rstrip("/") != "/kv/handshake":
                    self.send_error(404)
                    return
                body = json.dumps(info()).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True, name="kv-side-channel")
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def fetch_handshake(host: str, port: int, timeout_s: float = 5.0) -> dict[str, Any]:
    url = f"http://{host}:{port}/kv/handshake"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return json.loads(r.read())
    except Exception as e:  # noqa: BLE001 - any failure to reach the producer is a handshake failure
        raise HandshakeError(f"KV handshake with {url} failed: {type(e).__name__}: {e}") from None


class NixlConnector(KVConnectorBase):
    """One engine's NIXL connector (the interface and who calls what: `base.KVConnectorBase`)."""

    def __init__(self, role: str, kv, cfg, *, host: str = "127.0.0.1", side_port: int = 0,
                 lease_s: float = 30.0, timeout_s: float = 10.0, engine_id: str | None = None,
                 kv_head_start: int = 0, notify_on_read: bool = True) -> None:
        """`kv_head_start`: the first global kv head this cache holds (a TP rank's shard; 0 = all heads).
        `notify_on_read` False: a consumer does not tell the producer when its READs land; `notify` does
        it later (a TP group's ranks notify once all of them hold intact KV)."""
        super().__init__(role)
        self.kv, self.cfg = kv, cfg
        self.engine_id = engine_id or f"{role}-{uuid.uuid4().hex[:8]}"
        self.lease_s, self.timeout_s = lease_s, timeout_s
        self.notify_on_read = notify_on_read
        self.agent = NixlKVAgent(self.engine_id, engine_id=self.engine_id, host=host, model_id=model_identity(cfg),
                                 progress_thread=role != "kv_consumer")
        self.agent.register_kv(kv, kv_head_start=kv_head_start, total_kv_heads=cfg.num_key_value_heads)
        self.host = host
        self.side = _SideChannel(host, side_port, self.handshake_info) if role != "kv_consumer" else None
        self.leases: dict[str, _Lease] = {}
        self.loads: dict[str, _Load] = {}
        self.landed: dict[str, _Load] = {}         # notify_on_read False: landed, producer not told yet
        self.stats = {"kv_bytes_transferred": 0, "transfer_failures": 0, "transfer_seconds": 0.0}

    @property
    def side_port(self) -> int | None:
        return self.side.port if self.side else None

    def handshake_info(self) -> dict[str, Any]:
        return {"layout": self.agent.layout().to_dict(),
                "agent_metadata": base64.b64encode(self.agent.metadata()).decode()}

    # -- producer ------------------------------------------------------------------------------------
    def request_finished(self, request_id: str, block_tables: list[list[int]], num_computed: int) -> dict[str, Any]:
        """Prefill of N-1 tokens is done: lease the live blocks, answer the params for the router."""
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
        return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": self.engine_id,
                "remote_host": self.host, "remote_port": self.side_port, "remote_request_id": request_id,
                "remote_block_ids": ids, "remote_first_block": first, "num_computed_tokens": num_computed,
                "lease_expires": expires, "kv_crc32": kv_crc32(self.kv, ids),
                "kv_head_start": self.agent.layout().kv_head_start, "kv_crc32_heads": kv_crc32_heads(self.kv, ids)}

    # -- consumer ------------------------------------------------------------------------------------
    @staticmethod
    def validate_remote(params: dict[str, Any], num_prompt_tokens: int, num_groups: int) -> int:
        """Check a consumer request's params; returns the number of prompt tokens whose KV arrives (N-1)."""
        need = ("remote_engine_id", "remote_host", "remote_port", "remote_request_id", "remote_block_ids",
                "remote_first_block", "num_computed_tokens", "kv_crc32")
        missing = [k for k in need if params.get(k) is None]
        if missing:
            raise ValueError(f"kv_transfer_params is missing {', '.join(missing)}")
        n = params["num_computed_tokens"]
        if n != num_prompt_tokens - 1:
            raise ValueError(f"kv_transfer_params.num_computed_tokens is {n}, expected {num_prompt_tokens - 1} "
                             f"(prompt length - 1)")
        ids, first = params["remote_block_ids"], params["remote_first_block"]
        if len(ids) != num_groups or len(first) != num_groups:
            raise ValueError(f"kv_transfer_params has block ids for {len(ids)} KV groups, this engine has {num_groups}")
        return n

    def start_load(self, request_id: str, params: dict[str, Any], local_tables: list[list[int]]) -> None:
        """Handshake (once per producer rank) and post one READ per producer rank holding some of this cache's
        kv heads (each moves only the shared heads); failures are reported by `get_finished`."""
        load = _Load(request_id, params, local_tables, t_start=time.monotonic())
        self.loads[request_id] = load
        try:
            if time.time() > float(params.get("lease_expires", float("inf"))):
                raise TransferError(f"the prefill lease of {params['remote_request_id']} expired before the read")
            remotes = [(self._ensure_remote(src), src) for src in producer_ranks(params)]   # handshakes first
            load.pairs, load.local_ids = self._pairs(params, local_tables)
            l0, l1 = self.agent.layout().head_range
            covered = set()
            for remote, src in remotes:
                r0, r1 = self.agent.remote_layout(remote).head_range
                h0, h1 = max(l0, r0), min(l1, r1)
                if h0 >= h1 or covered >= set(range(h0, h1)):
                    continue                          # none (or only already covered) of our heads
                covered |= set(range(h0, h1))
                notif = str(src.get("remote_request_id", params["remote_request_id"])).encode()
                handle = self.agent.read(remote, load.pairs, notif=notif if self.notify_on_read else b"")
                load.reads.append(_Read(remote, handle, (h0, h1), src))
            if covered != set(range(l0, l1)):
                raise HandshakeError(f"the prefill ranks hold kv heads {sorted(covered)} of the [{l0}, {l1}) this "
                                     f"engine needs")
        except (TransferError, HandshakeError, ValueError, KeyError) as e:
            self._release(load)
            load.params = {**params, "_error": f"{type(e).__name__}: {e}" if isinstance(e, KeyError) else str(e)}

    def _release(self, load: _Load) -> None:
        for r in load.reads:
            if not r.done:
                self.agent._release(r.handle)
        load.reads = []

    def _ensure_remote(self, src: dict[str, Any]) -> str:
        name = src["remote_engine_id"]
        if name not in self.agent.remotes:
            info = fetch_handshake(src["remote_host"], int(src["remote_port"]), self.timeout_s)
            layout = KVLayout.from_dict(info["layout"])
            self.agent.add_remote(layout.agent_name, base64.b64decode(info["agent_metadata"]), layout)
            if layout.agent_name != name:
                raise HandshakeError(f"side channel answered for engine {layout.agent_name!r}, params name {name!r}")
        return name

    def _pairs(self, params: dict[str, Any], local_tables: list[list[int]]
               ) -> tuple[list[tuple[int, int]], list[list[int]]]:
        return pair_remote_blocks(params, local_tables, self.kv.block_size)

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
        for rid, load in list(self.loads.items()):
            err = load.params.get("_error")
            if err is None:
                try:
                    for r in load.reads:
                        r.done = r.done or self.agent.poll(r.handle)
                    if not all(r.done for r in load.reads):
                        if time.monotonic() - load.t_start <= self.timeout_s:
                            continue
                        late = [r.remote for r in load.reads if not r.done]
                        err = f"KV transfer from {', '.join(late)} timed out after {self.timeout_s:.3g} s"
                except TransferError as e:
                    err = str(e)
                if err is None:
                    bad = [r for r in load.reads
                           if not crc_matches(self.kv, load.local_ids, r.source, self.agent.layout().head_range,
                                              None if len(load.reads) == 1 else r.heads)]
                    if bad:
                        err = (f"KV heads {', '.join(f'[{r.heads[0]}, {r.heads[1]})' for r in bad)} from "
                               f"{', '.join(r.remote for r in bad)} arrived corrupted or stale (CRC32 mismatch); "
                               f"the prefill's blocks were reused?")
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

    def notify(self, request_id: str) -> None:
        """(`notify_on_read` False) tell every producer rank a landed load read from that it may free."""
        load = self.landed.pop(request_id, None)
        for r in (load.reads if load is not None else []):
            self.agent.send_notif(r.remote, str(r.source.get("remote_request_id",
                                                             load.params["remote_request_id"])).encode())

    def cancel(self, request_id: str) -> None:
        self.landed.pop(request_id, None)
        load = self.loads.pop(request_id, None)
        if load is not None:
            self._release(load)

    def close(self) -> None:
        if self.side is not None:
            self.side.close()
        self.agent.close()


def build_engine(model_dir, ecfg, *, host: str = "127.0.0.1", side_port: int = 0, runner=None, progress: bool = False):
    """An engine for `ecfg.kv_role`: kv_both runs alone; a producer or consumer gets a NIXL connector
    (a producer also serves its handshake on `host:side_port`, 0 = any free port)."""
    from ..engine import LLMEngine
    from ..runner import ModelRunner

    runner = runner or ModelRunner(model_dir, ecfg, progress=progress)
    connector = None
    if ecfg.kv_role != "kv_both":
        connector = NixlConnector(ecfg.kv_role, runner.kv, runner.cfg, host=host, side_port=side_port,
                                  lease_s=ecfg.kv_lease_s, timeout_s=ecfg.kv_transfer_timeout_s)
    return LLMEngine(runner, ecfg, connector)
