"""The KV connector interface for disaggregated inference (DI): a small cousin of vLLM's KVConnectorBase_V1.

Roles (`EngineConfig.kv_role`): the **producer** is the prefill engine (`kv_producer`), the **consumer**
the decode engine (`kv_consumer`); `kv_both` is one engine doing both (single node). As in vLLM, one
connector per engine has two halves. The *scheduler side* lives in the scheduler loop and only does
request bookkeeping (block ids, `kv_transfer_params`, leases); the *worker side* owns the KV buffers and
the transfer agent (`nixl_agent.NixlKVAgent`) and moves bytes. The scheduler side hands the worker side
one `ConnectorMetadata` per step; the worker side reports back through `get_finished`.

Method                                                      called by  what it does
  prefill_target(num_prompt_tokens) -> int                   producer   tokens to compute for a remote decode:
                                                                        N-1 (the last prompt token is
                                                                        recomputed by the decode engine)
  request_finished(request_id, block_tables, num_computed)   producer   prefill done: lease the live blocks,
                    -> kv_transfer_params                               answer the params the router forwards
  validate_remote(params, num_prompt_tokens, num_groups)     consumer   check the params -> tokens whose KV
                    -> int                                              arrives remotely (N-1)
  start_load(request_id, params, local_block_tables)         consumer   hand-shake once per producer, post
                                                                        the READ (non-blocking)
  get_finished() -> (sending, recving, failed)               both       every engine step: producer requests
                                                                        whose blocks may be freed (READ
                                                                        notification or lease expiry);
                                                                        consumer requests whose KV landed
                                                                        intact; consumer loads that failed
  cancel(request_id)                                         consumer   abort/preemption: stop a load
  handshake_info() -> dict                                   producer   layout + agent metadata (served on
                                                                        the side channel, GET /kv/handshake)
  close()                                                    both       release the agent and side channel

A failed, late or partial transfer must never let decode run on stale blocks: a consumer request listed
in `FinishedTransfers.failed` is failed (or recomputed) and its local blocks freed.

The transfer unit (docs/design.md, "Disaggregated inference"): per KV buffer one K region and one V region,
`block_len = kv·block·d·itemsize` bytes per block; block b of region r is `base_r + b·block_len`.
A block id belongs to one KV group (sliding / full) and holds, in every buffer, that group's layer, so a
request's transfer is one list of (remote block, local block) pairs applied to every region.
"""

from __future__ import annotations

import hashlib
import json
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, fields
from typing import Any

from .params import KVTransferParams


class HandshakeError(ValueError):
    """Two engines whose KV layouts (or agent metadata) cannot be paired."""


class TransferError(RuntimeError):
    """A KV transfer failed (bad block ids, the backend reported an error, the peer went away)."""


class TransferTimeout(TransferError):
    """A KV transfer was not done within its time limit (it has been cancelled)."""


_DEFAULTED = ("mem_type", "device_id", "kv_head_start", "total_kv_heads")

# Fields that must be equal on both sides, in the order they are checked (the first mismatch is named).
COMPAT_FIELDS = ("model_id", "dtype", "packed", "block_size", "kv_heads", "head_dim", "num_groups",
                 "num_buffers", "num_regions", "block_len", "k_scale", "v_scale")


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
    kv_head_start: int = 0        # TP: the first (global) kv head this rank holds
    total_kv_heads: int = 0       # TP: the model's kv heads (0 = not given: this rank holds all `kv_heads`)
    k_scale: float = 1.0          # FP8 KV: the per-tensor scales its bytes are stored with (stored = x / scale);
    v_scale: float = 1.0          # 1 for other KV dtypes. Bytes read under other scales are other keys / values

    @property
    def head_range(self) -> tuple[int, int]:
        """The global kv heads [start, stop) this rank's blocks hold."""
        return self.kv_head_start, self.kv_head_start + self.kv_heads

    @property
    def model_kv_heads(self) -> int:
        return self.total_kv_heads or self.kv_heads

    @property
    def head_bytes(self) -> int:
        """Bytes of one kv head within one block of one region (heads are outermost in a block)."""
        return self.block_len // self.kv_heads

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
        missing = sorted(n for n in names if n not in d and n not in _DEFAULTED)
        if missing:
            raise HandshakeError(f"KV layout is missing fields: {', '.join(missing)}")
        layout = cls(**{k: v for k, v in d.items() if k in names})
        sent = d.get("compat_hash")
        if sent is not None and sent != layout.compat_hash():
            raise HandshakeError(f"KV layout compat_hash {sent} does not match its fields ({layout.compat_hash()})")
        return layout


def head_mapping(local: KVLayout, remote: KVLayout) -> tuple[int, int] | None:
    """The global kv heads [h0, h1) both ranks hold when their head ranges differ but map onto each other
    (prefill TP != decode TP: same model kv heads, same bytes per head, overlapping ranges); None when the
    ranges cannot be mapped (no TP head info, different head counts or head sizes, or no overlap)."""
    if local.total_kv_heads <= 0 or remote.total_kv_heads <= 0 or local.total_kv_heads != remote.total_kv_heads:
        return None
    if local.kv_heads <= 0 or remote.kv_heads <= 0 or local.block_len % local.kv_heads \
            or remote.block_len % remote.kv_heads or local.head_bytes != remote.head_bytes:
        return None
    for lay in (local, remote):
        s0, s1 = lay.head_range
        if s0 < 0 or s1 > lay.total_kv_heads:
            return None
    h0 = max(local.head_range[0], remote.head_range[0])
    h1 = min(local.head_range[1], remote.head_range[1])
    return (h0, h1) if h0 < h1 else None


def head_byte_range(local: KVLayout, remote: KVLayout) -> tuple[int, int, int]:
    """(remote byte offset, local byte offset, length) of the shared kv heads within one block (of every
    region); (0, 0, block_len) when both hold the same heads. HandshakeError when there is no mapping."""
    if local.head_range == remote.head_range and local.block_len == remote.block_len:
        return 0, 0, local.block_len
    hm = head_mapping(local, remote)
    if hm is None:
        raise HandshakeError(f"KV layout mismatch: kv heads {local.head_range} (of {local.model_kv_heads}) local, "
                             f"{remote.head_range} (of {remote.model_kv_heads}) remote have no head mapping")
    hb = local.head_bytes
    return (hm[0] - remote.kv_head_start) * hb, (hm[0] - local.kv_head_start) * hb, (hm[1] - hm[0]) * hb


def check_compatible(local: KVLayout, remote: KVLayout) -> None:
    """Raise `HandshakeError` naming the first `COMPAT_FIELDS` entry that differs (and on a malformed remote).

    `kv_heads` (and with it `block_len`) may differ when the two ranks' kv head ranges map onto each other
    (`head_mapping`: prefill TP != decode TP); a READ then moves only the shared heads' byte range."""
    if len(remote.region_addrs) != remote.num_regions:
        raise HandshakeError(f"remote KV layout of {remote.agent_name!r} is malformed: "
                             f"{len(remote.region_addrs)} region addresses for num_regions={remote.num_regions}")
    if remote.num_blocks <= 0 or remote.block_len <= 0:
        raise HandshakeError(f"remote KV layout of {remote.agent_name!r} is malformed: "
                             f"num_blocks={remote.num_blocks}, block_len={remote.block_len}")
    differ = local.head_range != remote.head_range or local.total_kv_heads != remote.total_kv_heads
    mapped = differ and head_mapping(local, remote) is not None
    if differ and not mapped and local.kv_heads == remote.kv_heads and local.head_range != remote.head_range:
        raise HandshakeError(f"KV layout mismatch: kv_heads: local heads {local.head_range}, remote heads "
                             f"{remote.head_range} (of {local.model_kv_heads}) do not overlap")
    for name in COMPAT_FIELDS:
        a, b = getattr(local, name), getattr(remote, name)
        if mapped and name in ("kv_heads", "block_len"):
            continue                                   # checked by head_mapping (equal bytes per head)
        if a != b:
            hint = ""
            if name == "model_id":
                hint = " (the two engines run other checkpoints: their config.json or their weights differ)"
            if name == "kv_heads":
                hint = (f" (head_ratio != 1, prefill TP != decode TP, needs a head mapping: kv heads "
                        f"{local.head_range} of {local.model_kv_heads} local, {remote.head_range} of "
                        f"{remote.model_kv_heads} remote)")
            raise HandshakeError(f"KV layout mismatch: {name}: local {a}, remote {b}{hint}")
    if not mapped and local.compat_hash() != remote.compat_hash():  # unreachable while the fields agree
        raise HandshakeError(f"KV layout mismatch: compat_hash: local {local.compat_hash()}, "
                             f"remote {remote.compat_hash()}")


# config.json keys that say how the weights are stored, not which model they are (the fingerprint has the values)
STORAGE_KEYS = ("quantization_config", "torch_dtype")


def model_identity(cfg: Any, weights: str = "") -> str:
    """A model's identity for the handshake: sha256 (16 hex chars) of its config.json dict (`cfg.to_hf()`) but
    its `STORAGE_KEYS`, and `weights`, the checkpoint's `safetensors_files.weights_fingerprint` (two fine-tunes
    of one config differ; one model's values written with MXFP4 or bf16 experts do not)."""
    d = cfg.to_hf() if hasattr(cfg, "to_hf") else asdict(cfg)
    d = {k: v for k, v in d.items() if k not in STORAGE_KEYS}
    return hashlib.sha256((json.dumps(d, sort_keys=True, default=str) + weights).encode()).hexdigest()[:16]


def pair_remote_blocks(params: KVTransferParams, local_tables: list[list[int]], block_size: int
                       ) -> tuple[list[tuple[int, int]], list[list[int]]]:
    """Map each group's live remote blocks (`remote_block_ids` from `remote_first_block` on) onto the local
    blocks at the same logical indices -> (pairs, per-group local ids). Every live local block that holds
    computed tokens needs a remote block (else the prefill never sent it: the failure the N-1 rule
    prevents); blocks past the last computed token need no data."""
    n, B = params.num_computed_tokens or 0, block_size
    last = (n - 1) // B if n > 0 else -1               # last logical block holding a computed token
    pairs: list[tuple[int, int]] = []
    local_ids: list[list[int]] = []
    for g, (rids, j0, table) in enumerate(zip(params.remote_block_ids or [], params.remote_first_block or [],
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


class KVConnectorBase(ABC):
    """The connector interface the engine drives (see the module docstring for who calls what)."""

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

    # -- producer ------------------------------------------------------------------------------------
    @staticmethod
    def prefill_target(num_prompt_tokens: int) -> int:
        """Tokens a producer computes for a remote decode: N-1 (the DI truncation fix)."""
        return num_prompt_tokens - 1

    @abstractmethod
    def request_finished(self, request_id: str, block_tables: list[list[int]], num_computed: int,
                         advertise_host: str | None = None) -> KVTransferParams:
        """Producer: the first N-1 tokens are computed -> lease the blocks, return the (unsigned) params."""

    @abstractmethod
    def seal(self, params: KVTransferParams, prompt_ids: list[int]) -> KVTransferParams:
        """Producer: the params bound to the prompt (`prompt_digest`) and signed with the deployment key."""

    @abstractmethod
    def handshake_info(self) -> dict[str, Any]:
        """Producer: the layout and agent metadata a consumer needs to read from this engine."""

    # -- consumer ------------------------------------------------------------------------------------
    @abstractmethod
    def validate_remote(self, params: KVTransferParams, prompt_ids: list[int], num_groups: int,
                        lease_margin_s: float = 0.0, now: float | None = None) -> int:
        """Consumer: check a request's params (`params.KVParamsError` names what is wrong) -> remote tokens (N-1).
        `now`: the wall clock the lease is judged at (default: this process's; the ranks of a parallel engine
        pass rank 0's, so that they all decide alike)."""

    @abstractmethod
    def start_load(self, request_id: str, params: KVTransferParams, local_tables: list[list[int]]) -> None:
        """Consumer: post the READ of the remote blocks into `local_tables` (non-blocking)."""

    @abstractmethod
    def cancel(self, request_id: str) -> None:
        """Consumer: stop a load (abort or preemption); its local blocks are freed by the caller."""

    def release(self, request_id: str) -> bool:
        """Producer: end a lease early (its consumer will never read it); the blocks are freed at the next
        `get_finished`. -> whether there was such a lease. (Default: leases just run out.)"""
        return False

    def leased_ids(self) -> list[str]:
        """Producer: the requests whose blocks are held for a consumer's read (`/metrics` counts them)."""
        return []

    def answers_as(self, engine_id: str) -> bool:
        """Producer: whether params naming `engine_id` are this server's answers (a parallel server's answers
        name the rank that made them)."""
        return engine_id == getattr(self, "engine_id", None)

    # -- both ----------------------------------------------------------------------------------------
    @abstractmethod
    def get_finished(self) -> tuple[set[str], set[str], dict[str, str]]:
        """-> (producer: requests whose blocks may be freed, consumer: requests whose KV landed intact,
        consumer: failed loads {request: error}). Called every engine step."""

    @abstractmethod
    def close(self) -> None:
        """Release the transfer agent (and the side channel)."""
