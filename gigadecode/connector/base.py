"""The KV connector interface for disaggregated inference (DI): a small cousin of vLLM's KVConnectorBase_V1.

Roles (`EngineConfig.kv_role`): the **producer** is the prefill engine (`kv_producer`), the **consumer**
the decode engine (`kv_consumer`); `kv_both` is one engine doing both (single node). As in vLLM, one
connector per engine has two halves. The *scheduler side* lives in the scheduler loop and only does
request bookkeeping (block ids, `kv_transfer_params`, leases); the *worker side* owns the KV buffers and
the transfer agent (`nixl_agent.NixlKVAgent`) and moves bytes. The scheduler side hands the worker side
one `ConnectorMetadata` per step; the worker side reports back through `get_finished`.

Scheduler side                                              called by  what it does
  get_num_new_matched_tokens(request_id, num_prompt_tokens, params)
                                                             consumer   tokens whose KV arrives remotely
                                                                        (N-1 for a prompt of N: the last
                                                                        prompt token is recomputed here)
  update_state_after_alloc(request_id, local_block_ids, num_external_tokens)
                                                             consumer   record the local blocks (per KV
                                                                        group) the remote blocks land in
  request_finished(request_id, block_ids) -> (delay_free, kv_transfer_params)
                                                             producer   at the end of prefill: keep the
                                                                        blocks under a lease and answer
                                                                        the params the router forwards
  build_connector_meta() -> ConnectorMetadata                both       this step's reads / leases
Worker side
  register_kv_caches(kv_cache)                               both       register per-buffer K and V regions
  handshake_info() -> HandshakeInfo                          producer   layout + agent metadata, served to
                                                                        consumers (HTTP, later)
  add_remote(info)                                           consumer   check the layout, load the metadata
  start_load_kv(meta)                                        consumer   post the READs (non-blocking)
  get_finished() -> FinishedTransfers                        both       producer: requests whose blocks may
                                                                        be freed (READ notification arrived,
                                                                        or the lease expired); consumer:
                                                                        requests whose blocks landed, and
                                                                        requests whose transfer failed

A failed, late or partial transfer must never let decode run on stale blocks: a consumer request listed
in `FinishedTransfers.failed` is failed (or recomputed) and its local blocks freed.

The transfer unit (DESIGN.md "Disaggregated inference"): per KV buffer one K region and one V region,
`block_len = kv·block·d·itemsize` bytes per block; block b of region r is `base_r + b·block_len`.
A block id belongs to one KV group (sliding / full) and holds, in every buffer, that group's layer, so a
request's transfer is one list of (remote block, local block) pairs applied to every region.
"""

from __future__ import annotations

import hashlib
import json
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Sequence


class HandshakeError(ValueError):
    """Two engines whose KV layouts (or agent metadata) cannot be paired."""


class TransferError(RuntimeError):
    """A KV transfer failed (bad block ids, the backend reported an error, the peer went away)."""


class TransferTimeout(TransferError):
    """A KV transfer was not done within its time limit (it has been cancelled)."""


# Fields that must be equal on both sides, in the order they are checked (the first mismatch is named).
COMPAT_FIELDS = ("model_id", "dtype", "packed", "block_size", "kv_heads", "head_dim", "num_groups",
                 "num_buffers", "num_regions", "block_len")


@dataclass(frozen=True)
class KVLayout:
    """What one engine's registered KV looks like to a peer (sent in the handshake).

    `region_addrs[r]` is the base address of region r in the owner's address space; regions are ordered
    buffer by buffer, K then V (`2i` = K of buffer i, `2i+1` = V), minus any region whose base address was
    already registered. `num_blocks`, the addresses and the endpoint fields may differ between peers; the
    `COMPAT_FIELDS` may not.
    """

    engine_id: str
    agent_name: str
    host: str
    port: int
    model_id: str                 # identity of the model, e.g. `model_identity(cfg)` (hash of config.json)
    dtype: str                    # KV storage dtype, torch name without "torch." ("float8_e4m3fn", "bfloat16")
    packed: bool                  # packed-FP8 K ([nb, kv, block//2, d, 2]); V is never packed
    block_size: int               # tokens per block
    kv_heads: int                 # kv heads held by this rank
    head_dim: int
    num_blocks: int
    block_len: int                # bytes of one block of one region: kv·block·d·itemsize
    num_groups: int               # KV groups (GPT-OSS: 2, sliding then full)
    num_buffers: int              # per-buffer allocations (group_size)
    num_regions: int
    region_addrs: tuple[int, ...]
    mem_type: str = "DRAM"        # "DRAM" | "VRAM"
    device_id: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "region_addrs", tuple(int(a) for a in self.region_addrs))

    def compat_hash(self) -> str:
        """sha256 (hex, 16 chars) over the `COMPAT_FIELDS`: equal on two engines that can pair."""
        blob = json.dumps({k: getattr(self, k) for k in COMPAT_FIELDS}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (with `compat_hash`), for the HTTP handshake."""
        d = asdict(self)
        d["region_addrs"] = list(self.region_addrs)
        d["compat_hash"] = self.compat_hash()
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KVLayout:
        names = {f.name for f in fields(cls)}
        missing = sorted(n for n in names if n not in d and n not in ("mem_type", "device_id"))
        if missing:
            raise HandshakeError(f"KV layout is missing fields: {', '.join(missing)}")
        layout = cls(**{k: v for k, v in d.items() if k in names})
        sent = d.get("compat_hash")
        if sent is not None and sent != layout.compat_hash():
            raise HandshakeError(f"KV layout compat_hash {sent} does not match its fields ({layout.compat_hash()})")
        return layout


def check_compatible(local: KVLayout, remote: KVLayout) -> None:
    """Raise `HandshakeError` naming the first `COMPAT_FIELDS` entry that differs (and on a malformed remote)."""
    if len(remote.region_addrs) != remote.num_regions:
        raise HandshakeError(f"remote KV layout of {remote.agent_name!r} is malformed: "
                             f"{len(remote.region_addrs)} region addresses for num_regions={remote.num_regions}")
    if remote.num_blocks <= 0 or remote.block_len <= 0:
        raise HandshakeError(f"remote KV layout of {remote.agent_name!r} is malformed: "
                             f"num_blocks={remote.num_blocks}, block_len={remote.block_len}")
    for name in COMPAT_FIELDS:
        a, b = getattr(local, name), getattr(remote, name)
        if a != b:
            hint = " (head_ratio != 1, prefill TP != decode TP, is not supported yet)" if name == "kv_heads" else ""
            raise HandshakeError(f"KV layout mismatch: {name}: local {a}, remote {b}{hint}")
    if local.compat_hash() != remote.compat_hash():  # unreachable while the fields agree; kept as a guard
        raise HandshakeError(f"KV layout mismatch: compat_hash: local {local.compat_hash()}, "
                             f"remote {remote.compat_hash()}")


def model_identity(cfg: Any) -> str:
    """A model's identity for the handshake: sha256 (16 hex chars) of its config.json dict (`cfg.to_hf()`)."""
    d = cfg.to_hf() if hasattr(cfg, "to_hf") else asdict(cfg)
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]


def pair_blocks(remote_block_ids: Sequence[Sequence[int]], local_block_ids: Sequence[Sequence[int]]
                ) -> list[tuple[int, int]]:
    """Per-group block lists -> one (remote, local) pair list for `NixlKVAgent.read`.

    Group g's lists must have equal length. A pair where both ids are the null block 0 (a freed sliding
    entry) is skipped; a null block on one side only is an error (it would read or write nothing useful).
    """
    if len(remote_block_ids) != len(local_block_ids):
        raise TransferError(f"block lists for {len(remote_block_ids)} remote groups vs {len(local_block_ids)} local")
    pairs: list[tuple[int, int]] = []
    for g, (rs, ls) in enumerate(zip(remote_block_ids, local_block_ids)):
        if len(rs) != len(ls):
            raise TransferError(f"group {g}: {len(rs)} remote blocks vs {len(ls)} local blocks")
        for r, lo in zip(rs, ls):
            if r == 0 and lo == 0:
                continue
            if r == 0 or lo == 0:
                raise TransferError(f"group {g}: null block paired with a real one (remote {r}, local {lo})")
            pairs.append((int(r), int(lo)))
    return pairs


@dataclass
class KVTransferParams:
    """The `kv_transfer_params` a request carries (vLLM's keys)."""

    do_remote_decode: bool = False         # router -> producer: keep the KV for a remote decode
    do_remote_prefill: bool = False        # router -> consumer: the KV comes from a remote prefill
    remote_engine_id: str | None = None
    remote_host: str | None = None
    remote_port: int | None = None
    remote_request_id: str | None = None
    remote_block_ids: list[list[int]] | None = None   # per KV group (sliding list clipped to the window)
    num_computed_tokens: int | None = None            # tokens whose KV the remote blocks hold (N-1)

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> KVTransferParams:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in (d or {}).items() if k in names})


@dataclass(frozen=True)
class HandshakeInfo:
    """What a producer serves to consumers: its layout and its transfer agent's metadata."""

    layout: KVLayout
    agent_metadata: bytes


@dataclass
class ReadRequest:
    """One consumer request's transfer: read `remote_block_ids[g]` into `local_block_ids[g]` for each group."""

    request_id: str
    remote_engine_id: str
    remote_request_id: str
    remote_block_ids: list[list[int]]
    local_block_ids: list[list[int]]


@dataclass
class ConnectorMetadata:
    """Scheduler side -> worker side, once per step."""

    reqs_to_recv: dict[str, ReadRequest] = field(default_factory=dict)   # consumer: reads to post
    reqs_to_send: dict[str, float] = field(default_factory=dict)         # producer: request -> lease expiry


@dataclass
class FinishedTransfers:
    """Worker side -> scheduler side."""

    sending: set[str] = field(default_factory=set)        # producer: blocks may be freed
    recving: set[str] = field(default_factory=set)        # consumer: blocks landed, request may decode
    failed: dict[str, str] = field(default_factory=dict)  # consumer: request -> error; fail it, free its blocks


class KVConnectorBase(ABC):
    """The connector interface (see the module docstring for who calls what)."""

    def __init__(self, role: str) -> None:
        if role not in ("kv_producer", "kv_consumer", "kv_both"):
            raise ValueError(f"kv_role must be kv_producer|kv_consumer|kv_both (got {role!r})")
        self.role = role

    @property
    def is_producer(self) -> bool:
        return self.role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.role in ("kv_consumer", "kv_both")

    # -- scheduler side ----------------------------------------------------------------------------
    @abstractmethod
    def get_num_new_matched_tokens(self, request_id: str, num_prompt_tokens: int,
                                   params: KVTransferParams) -> int:
        """Consumer: how many prompt tokens' KV will be loaded remotely (0: none, compute locally)."""

    @abstractmethod
    def update_state_after_alloc(self, request_id: str, local_block_ids: list[list[int]],
                                 num_external_tokens: int) -> None:
        """Consumer: the local blocks (per KV group) allocated for the remote tokens."""

    @abstractmethod
    def request_finished(self, request_id: str, block_ids: list[list[int]]) -> tuple[bool, dict[str, Any] | None]:
        """Producer: prefill is done -> (delay freeing the blocks, kv_transfer_params for the router)."""

    @abstractmethod
    def build_connector_meta(self) -> ConnectorMetadata:
        """Both: the reads to post / leases to watch this step (and reset the pending state)."""

    # -- worker side -------------------------------------------------------------------------------
    @abstractmethod
    def register_kv_caches(self, kv_cache: Any) -> None:
        """Both: register the engine's KV buffers (a `gigadecode.kv.cache.KVCache`)."""

    @abstractmethod
    def handshake_info(self) -> HandshakeInfo:
        """Producer: the layout and agent metadata a consumer needs to read from this engine."""

    @abstractmethod
    def add_remote(self, info: HandshakeInfo) -> str:
        """Consumer: check the remote layout against ours and load its metadata; returns the peer's name."""

    @abstractmethod
    def start_load_kv(self, meta: ConnectorMetadata) -> None:
        """Consumer: post the READs for `meta.reqs_to_recv` (non-blocking)."""

    @abstractmethod
    def get_finished(self) -> FinishedTransfers:
        """Both: poll transfers and notifications; report finished and failed requests."""
