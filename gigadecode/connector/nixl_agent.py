"""One NIXL agent over an engine's KV buffers: register, hand-shake, READ blocks, notifications.

`NixlKVAgent` wraps one `nixl_agent` (UCX backend, progress thread off by default). Both engines create
one and `register_kv(kv_cache)`. The producer (prefill) hands `metadata()` (bytes) and `layout()` (a
`KVLayout`, `to_dict()` for JSON) to the consumer out of band (HTTP, later); the consumer calls
`add_remote(name, metadata, layout)`, which checks the layouts first (`check_compatible`), then
`read(remote, pairs, notif)` / `wait(handle, timeout_s)` (or `read_blocks` for both). The producer learns
that a READ completed from the notification: `get_notifs() -> {consumer agent name: [notif bytes, ...]}`.

Regions: per buffer i, K = `group_bufs[i][0]` then V = `group_bufs[i][1]`; a region whose base address was
already registered is skipped. Block b of region r is the descriptor `base_r + b·block_len` (length
`block_len = kv·block·d·itemsize`); every region's descriptors are prepared once (local at `register_kv`,
remote at `add_remote`), and a read of pairs [(rb, lb), ...] selects descriptor `r·num_blocks + b` on both
sides for every region r.

Head mapping (prefill TP != decode TP): the layout carries the rank's kv head range (`kv_head_start`,
`total_kv_heads`; `register_kv(kv, kv_head_start=...)`). When two layouts hold different heads, `read` moves
only the shared heads: kv heads are outermost in a block (also for packed K), so they are one byte range
per block, `base + b·block_len + offset` for `length` bytes, on each side (`base.head_byte_range`). Those
partial-block descriptor lists are prepared on first use and cached per (offset, length).

NIXL facts (nixl 1.5.1, UCX backend, loopback, no GPU):
- Progress: with the progress thread off, a READ only completes while the *target* agent is progressed
  too. The producer must therefore call `get_notifs()` (or `progress()`) regularly (its engine loop does,
  every step) or be built with `progress_thread=True`; a producer that stops progressing makes the
  consumer's READs time out (`TransferTimeout`: the stalled-prefill failure). UCX data goes by cma
  (process_vm_readv) zero-copy, control by tcp; about one READ still completes right after the target
  stops progressing, the next ones do not. A producer runs the progress thread (READs then complete
  while its engine is inside a long prefill step), made to sleep in poll() between UCX events
  (`PROGRESS_WAKE_US`): as nixl's Python API builds it, it polls without pause and takes a whole core
  (a DI decode co-located on 2 cores ran ~10x slower; an idle prefill server sat at 100% CPU).
- Errors surface as Python exceptions from the bindings (`nixlInvalidParamError` for an out-of-range
  descriptor index, `nixlRemoteDisconnectError` from `transfer` or `check_xfer_state` once the peer is
  gone), not only as an "ERR" state; all become `TransferError` here. Block ids are validated first.
- float8 tensors register as they are (registration only uses `data_ptr()` and the byte length).
- `add_remote_agent` returns the peer's name as bytes; notification dicts are keyed by str.
- Releasing an in-flight transfer cancels it (its notification is never delivered); after a timeout or
  an error the local blocks' content is undefined and the caller must free them.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # nixl logs every backend/agent creation at INFO to stdout

import nixl._bindings as _nixl_bindings  # noqa: E402  (a real dependency: fail loudly if missing)
from nixl._api import nixl_agent, nixl_agent_config  # noqa: E402

from .base import (HandshakeError, KVLayout, TransferError, TransferTimeout, check_compatible,  # noqa: E402
                   head_byte_range)

log = logging.getLogger("gigadecode.nixl")

NIXL_ERRORS: tuple[type[BaseException], ...] = tuple(
    getattr(_nixl_bindings, n) for n in dir(_nixl_bindings)
    if n.startswith("nixl") and n.endswith("Error") and isinstance(getattr(_nixl_bindings, n), type))


def _nixl_failure(e: BaseException) -> str:
    """A NIXL exception in words; a lost peer says what that means for a READ from it."""
    why = f"{type(e).__name__}: {e}"
    if type(e).__name__ == "nixlRemoteDisconnectError":
        why += " (that prefill engine is gone: stopped or restarted, and its KV with it)"
    return why


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def block_descs(region_addrs: Sequence[int], num_blocks: int, block_len: int, device_id: int = 0,
                offset: int = 0, length: int | None = None) -> np.ndarray:
    """[num_regions * num_blocks, 3] uint64 (addr, len, dev): row r·num_blocks + b is block b of region r,
    or with `offset`/`length` the byte range [offset, offset + length) of that block (a kv-head slice)."""
    length = block_len if length is None else length
    if offset < 0 or length <= 0 or offset + length > block_len:
        raise ValueError(f"byte range [{offset}, {offset + length}) is not inside a block of {block_len} bytes")
    base = np.asarray(region_addrs, dtype=np.uint64)[:, None] + np.uint64(offset)
    offs = np.arange(num_blocks, dtype=np.uint64)[None, :] * np.uint64(block_len)
    out = np.empty((len(region_addrs) * num_blocks, 3), dtype=np.uint64)
    out[:, 0] = (base + offs).reshape(-1)
    out[:, 1] = length
    out[:, 2] = device_id
    return out


@dataclass
class _Remote:
    name: str
    layout: KVLayout
    dlist: Any                       # prepped remote descriptor list
    sub_dlists: dict[tuple[int, int], Any] = field(default_factory=dict)   # (offset, length) -> dlist


@dataclass
class ReadHandle:
    """A posted READ. `state`: PROC | DONE | ERR | TIMEOUT; `error` set on ERR / TIMEOUT."""

    remote: str
    num_pairs: int
    num_descs: int
    nbytes: int
    notif: bytes
    t_posted: float
    xfer: Any = None                 # nixl_xfer_handle; None for an empty read
    state: str = "PROC"
    error: str | None = None
    t_done: float | None = None
    released: bool = field(default=False, repr=False)

    @property
    def seconds(self) -> float | None:
        return None if self.t_done is None else self.t_done - self.t_posted

# The progress thread sleeps in poll() on its UCX workers' event fds, waking on traffic and at the latest
# after this long. nixl's Python API builds its agent with 0 (poll returns at once: a thread that takes a
# whole core while the agent lives, which on a CPU engine is a core taken from the kernels), so the agent is
# made with this value instead (`_new_agent`).
PROGRESS_WAKE_US = 10_000


def _new_agent(name: str, config: Any) -> Any:
    """`nixl_agent(name, config)` with the progress thread's poll timeout `PROGRESS_WAKE_US` (the API has no
    parameter for it: the native agent is built with that value by wrapping the bindings' constructor for
    the duration of this call)."""
    from nixl import _api
    bind = getattr(_api, "nixlBind", None)
    native = getattr(bind, "nixlAgent", None)
    if native is None:                       # another nixl layout: its own default
        log.warning("nixl's agent constructor not found; the progress thread keeps nixl's poll timeout")
        return nixl_agent(name, config)

    def with_wake(agent_name: str, agent_config: Any) -> Any:
        agent_config.pthrDelay = PROGRESS_WAKE_US
        return native(agent_name, agent_config)

    bind.nixlAgent = with_wake
    try:
        return nixl_agent(name, config)
    finally:
        bind.nixlAgent = native


class NixlKVAgent:
    """One engine's NIXL agent over its KV buffers (see the module docstring)."""

    def __init__(self, name: str, *, engine_id: str | None = None, host: str = "127.0.0.1", port: int = 0,
                 model_id: str = "", progress_thread: bool = False, backends: Sequence[str] = ("UCX",)) -> None:
        self.name = name
        self.engine_id = engine_id or name
        self.host, self.port, self.model_id = host, port, model_id
        try:
            self.agent = _new_agent(name, nixl_agent_config(backends=list(backends),
                                                            enable_prog_thread=progress_thread))
        except NIXL_ERRORS as e:
            raise TransferError(f"cannot create NIXL agent {name!r} with backends {list(backends)}: "
                                f"{type(e).__name__}: {e} (UCX_TLS must include tcp)") from e
        missing = [b for b in backends if b not in self.agent.backends]
        if missing:
            raise TransferError(f"NIXL backend(s) {missing} not available (plugins: {self.agent.get_plugin_list()})")
        self._layout: KVLayout | None = None
        self._tensors: list[torch.Tensor] = []     # the registered regions (kept alive while registered)
        self._reg = None                           # nixlRegDList, for deregistration
        self._local_dlist = None
        self._local_sub: dict[tuple[int, int], Any] = {}     # (offset, length) -> prepped local dlist
        self._remotes: dict[str, _Remote] = {}

    # -- registration ------------------------------------------------------------------------------
    def register_kv(self, kv_cache: Any, kv_head_start: int = 0, total_kv_heads: int | None = None) -> KVLayout:
        """Register K and V of every buffer of a `KVCache` (`group_bufs[i]: [2, nb, kv, block, d]`).

        With TP, `kv_head_start` is the first global kv head this rank's cache holds (`shard_ranges(cfg,
        shard)["kv_heads"][0]`); `total_kv_heads` defaults to the cache's model config (0 if it has none).
        Both go into the layout so a peer with another TP size can map heads (`read` does it)."""
        if self._layout is not None:
            raise RuntimeError(f"agent {self.name!r} already registered its KV")
        regions: list[torch.Tensor] = []
        seen: set[int] = set()
        for buf in kv_cache.group_bufs:
            if buf.dim() != 5 or buf.shape[0] != 2:
                raise ValueError(f"KV buffer must be [2, num_blocks, kv, block, d], got {tuple(buf.shape)}")
            for half in (buf[0], buf[1]):
                if not half.is_contiguous():
                    raise ValueError("KV region is not contiguous")
                if half.data_ptr() in seen:          # a buffer shared by paired layers: registered once
                    continue
                seen.add(half.data_ptr())
                regions.append(half)
        first = regions[0]
        nb, kv, block, d = first.shape
        block_len = kv * block * d * first.element_size()
        if any(r.shape != first.shape or r.dtype != first.dtype or r.device != first.device for r in regions):
            raise ValueError("KV regions differ in shape, dtype or device")
        cuda = first.device.type == "cuda"
        mem_type, dev = ("VRAM", first.device.index or 0) if cuda else ("DRAM", 0)
        try:
            self._reg = self.agent.register_memory(regions)
            self._local_dlist = self.agent.prep_xfer_dlist(
                "NIXL_INIT_AGENT", block_descs([r.data_ptr() for r in regions], nb, block_len, dev), mem_type)
        except NIXL_ERRORS as e:
            raise TransferError(f"NIXL registration of {len(regions)} KV regions failed: "
                                f"{type(e).__name__}: {e}") from e
        self._tensors = regions
        self._layout = KVLayout(
            engine_id=self.engine_id, agent_name=self.name, host=self.host, port=self.port,
            model_id=self.model_id, dtype=_dtype_name(first.dtype), packed=bool(getattr(kv_cache, "packed", False)),
            block_size=block, kv_heads=kv, head_dim=d, num_blocks=nb, block_len=block_len,
            num_groups=len(kv_cache.config.groups) if hasattr(kv_cache, "config") else 1,
            num_buffers=len(kv_cache.group_bufs), num_regions=len(regions),
            region_addrs=tuple(r.data_ptr() for r in regions), mem_type=mem_type, device_id=dev,
            kv_head_start=int(kv_head_start), total_kv_heads=int(
                total_kv_heads if total_kv_heads is not None
                else getattr(getattr(kv_cache, "cfg", None), "num_key_value_heads", 0)),
            k_scale=float(getattr(kv_cache, "k_scale", 1.0)), v_scale=float(getattr(kv_cache, "v_scale", 1.0)))
        return self._layout

    def layout(self) -> KVLayout:
        if self._layout is None:
            raise RuntimeError(f"agent {self.name!r}: register_kv first")
        return self._layout

    def metadata(self) -> bytes:
        """This agent's NIXL metadata (connection info + registered memory), for `add_remote` on a peer."""
        self.layout()
        return self.agent.get_agent_metadata()

    # -- peers -------------------------------------------------------------------------------------
    def add_remote(self, name: str, agent_metadata: bytes, remote_layout: KVLayout) -> str:
        """Pair with a producer: check layouts (HandshakeError on mismatch), load its metadata, prep its blocks."""
        local = self.layout()
        if remote_layout.agent_name != name:
            raise HandshakeError(f"remote layout belongs to agent {remote_layout.agent_name!r}, not {name!r}")
        check_compatible(local, remote_layout)
        if name in self._remotes:                    # a re-handshake (e.g. the peer restarted)
            self.remove_remote(name)
        try:
            loaded = self.agent.add_remote_agent(agent_metadata)
        except NIXL_ERRORS as e:
            raise HandshakeError(f"cannot load NIXL metadata of {name!r}: {type(e).__name__}: {e}") from e
        loaded = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        if loaded != name:
            self.agent.remove_remote_agent(loaded)
            raise HandshakeError(f"NIXL metadata is for agent {loaded!r}, expected {name!r}")
        rl = remote_layout
        try:
            dlist = self.agent.prep_xfer_dlist(
                name, block_descs(rl.region_addrs, rl.num_blocks, rl.block_len, rl.device_id), rl.mem_type)
        except NIXL_ERRORS as e:
            self.agent.remove_remote_agent(name)
            raise HandshakeError(f"remote regions of {name!r} do not match its NIXL metadata: "
                                 f"{type(e).__name__}: {e}") from e
        self._remotes[name] = _Remote(name, rl, dlist)
        return name

    def remove_remote(self, name: str) -> None:
        r = self._remotes.pop(name, None)
        if r is not None:
            for d in r.sub_dlists.values():
                d.release()
            r.dlist.release()
            self.agent.remove_remote_agent(name)

    def remote_layout(self, name: str) -> KVLayout:
        r = self._remotes.get(name)
        if r is None:
            raise TransferError(f"unknown remote agent {name!r} (known: {sorted(self._remotes)}); add_remote first")
        return r.layout

    @property
    def remotes(self) -> list[str]:
        return list(self._remotes)

    # -- transfers ---------------------------------------------------------------------------------
    def read(self, remote: str, pairs: Sequence[tuple[int, int]], notif: bytes = b"",
             sub_range: tuple[int, int] | None = None, local_offset: int = 0) -> ReadHandle:
        """Post a READ of remote block rb into local block lb for each (rb, lb) in `pairs`, in every region.

        `notif` is delivered to the remote agent (its `get_notifs()`) when the READ completes. Returns at
        once; finish with `wait` (blocking) or `poll`. An empty `pairs` only sends `notif`.

        Head mapping (`head_ratio != 1`, prefill TP != decode TP): when the two layouts hold different kv
        head ranges, only the shared heads move: their byte range of each remote block (heads are
        outermost within a block, also for packed K) into their byte range of the local block
        (`base.head_byte_range`). `sub_range=(offset, length)` overrides it: read bytes [offset, offset +
        length) of each remote block into [local_offset, local_offset + length) of the local block. Partial
        ranges use extra descriptor lists, prepared on first use and cached per (offset, length).
        """
        local = self.layout()
        r = self._remotes.get(remote)
        if r is None:
            raise TransferError(f"unknown remote agent {remote!r} (known: {sorted(self._remotes)}); add_remote first")
        if sub_range is None:
            roff, loff, length = head_byte_range(local, r.layout)
        else:
            (roff, length), loff = (int(x) for x in sub_range), int(local_offset)
            if length <= 0 or roff < 0 or loff < 0 or roff + length > r.layout.block_len \
                    or loff + length > local.block_len:
                raise TransferError(f"sub_range: bytes [{roff}, {roff + length}) of a remote block "
                                    f"({r.layout.block_len} bytes) into [{loff}, {loff + length}) of a local "
                                    f"block ({local.block_len} bytes) is out of range")
        notif = notif.encode() if isinstance(notif, str) else bytes(notif)
        arr = np.asarray(pairs, dtype=np.int64).reshape(-1, 2)
        rb, lb = arr[:, 0], arr[:, 1]
        if len(arr):
            bad = rb[(rb < 0) | (rb >= r.layout.num_blocks)]
            if len(bad):
                raise TransferError(f"remote block id {int(bad[0])} out of range [0, {r.layout.num_blocks}) "
                                    f"of agent {remote!r}")
            bad = lb[(lb < 0) | (lb >= local.num_blocks)]
            if len(bad):
                raise TransferError(f"local block id {int(bad[0])} out of range [0, {local.num_blocks})")
            if len(np.unique(lb)) != len(lb):
                raise TransferError("a local block id appears twice in one read")
        handle = ReadHandle(remote, len(arr), len(arr) * local.num_regions,
                            len(arr) * local.num_regions * length, notif, time.monotonic())
        if not len(arr):
            if notif:
                self._nixl(self.agent.send_notif, remote, notif, what="send notification")
            handle.state, handle.t_done = "DONE", time.monotonic()
            return handle
        local_dl, remote_dl = self._dlists(r, roff, loff, length)
        reg = np.arange(local.num_regions, dtype=np.int64)[:, None]
        local_idx = (reg * local.num_blocks + lb[None, :]).reshape(-1).astype(np.int32)
        remote_idx = (reg * r.layout.num_blocks + rb[None, :]).reshape(-1).astype(np.int32)
        handle.xfer = self._nixl(self.agent.make_prepped_xfer, "READ", local_dl, local_idx,
                                 remote_dl, remote_idx, notif, what="prepare READ")
        state = "ERR"
        try:
            state = self.agent.transfer(handle.xfer)
        except NIXL_ERRORS as e:
            self._fail(handle, f"posting READ from {remote!r} failed: {_nixl_failure(e)}")
        if state == "ERR":
            self._fail(handle, f"posting READ from {remote!r} failed (state ERR)")
        if state == "DONE":
            self._finish(handle)
        return handle

    def _dlists(self, r: _Remote, roff: int, loff: int, length: int) -> tuple[Any, Any]:
        """(local, remote) prepped descriptor lists for byte range (offset, length) of every block."""
        local = self.layout()
        rl = r.layout
        if (loff, length) == (0, local.block_len):
            local_dl = self._local_dlist
        else:
            local_dl = self._local_sub.get((loff, length))
            if local_dl is None:
                local_dl = self._nixl(self.agent.prep_xfer_dlist, "NIXL_INIT_AGENT",
                                      block_descs(local.region_addrs, local.num_blocks, local.block_len,
                                                  local.device_id, loff, length),
                                      local.mem_type, what="prepare local partial-block descriptors")
                self._local_sub[(loff, length)] = local_dl
        if (roff, length) == (0, rl.block_len):
            remote_dl = r.dlist
        else:
            remote_dl = r.sub_dlists.get((roff, length))
            if remote_dl is None:
                remote_dl = self._nixl(self.agent.prep_xfer_dlist, r.name,
                                       block_descs(rl.region_addrs, rl.num_blocks, rl.block_len, rl.device_id,
                                                   roff, length),
                                       rl.mem_type, what="prepare remote partial-block descriptors")
                r.sub_dlists[(roff, length)] = remote_dl
        return local_dl, remote_dl

    def poll(self, handle: ReadHandle) -> bool:
        """Non-blocking: True once the READ is done (the handle is then released); raises TransferError."""
        if handle.state == "DONE":
            return True
        if handle.state != "PROC":
            raise TransferError(handle.error or f"READ in state {handle.state}")
        state = "ERR"
        try:
            state = self.agent.check_xfer_state(handle.xfer)
        except NIXL_ERRORS as e:
            self._fail(handle, f"READ from {handle.remote!r} failed: {_nixl_failure(e)}")
        if state == "ERR":
            self._fail(handle, f"READ from {handle.remote!r} failed (state ERR)")
        if state == "DONE":
            self._finish(handle)
            return True
        return False

    def wait(self, handle: ReadHandle, timeout_s: float = 30.0) -> ReadHandle:
        """Block until the READ is done. TransferError on failure, TransferTimeout (the READ is cancelled)
        after `timeout_s`; the handle is always released."""
        deadline = handle.t_posted + timeout_s
        spins = 0
        try:
            while not self.poll(handle):
                now = time.monotonic()
                if now >= deadline:
                    handle.state = "TIMEOUT"
                    handle.error = (f"READ of {handle.num_pairs} blocks ({handle.nbytes} bytes) from "
                                    f"{handle.remote!r} not done after {timeout_s:.3g} s (is the producer "
                                    f"progressing its agent?); cancelled, local blocks are undefined")
                    raise TransferTimeout(handle.error)
                spins += 1
                # Busy-poll briefly (a small read is done in microseconds), then yield the core to the peer.
                time.sleep(0 if spins < 64 else min(1e-3, 1e-5 * (spins - 63)))
        finally:
            self._release(handle)
        return handle

    def read_blocks(self, remote: str, pairs: Sequence[tuple[int, int]], notif: bytes = b"",
                    timeout_s: float = 30.0) -> ReadHandle:
        """`read` + `wait`."""
        return self.wait(self.read(remote, pairs, notif), timeout_s)

    def get_notifs(self) -> dict[str, list[bytes]]:
        """Notifications not returned before, {sender agent name: [msg, ...]}; also progresses the agent."""
        new = self._nixl(self.agent.update_notifs, what="get notifications")
        self.agent.notifs = {}
        return {k: list(v) for k, v in new.items() if v}

    def progress(self) -> None:
        """Progress the agent (a producer must, often: peers' READs complete only then); keeps notifications."""
        self._nixl(self.agent.update_notifs, what="progress the agent")

    def send_notif(self, remote: str, msg: bytes) -> None:
        self._nixl(self.agent.send_notif, remote, msg, what="send notification")

    def close(self) -> None:
        """Forget the peers, release the descriptor lists, deregister the KV."""
        for name in list(self._remotes):
            try:
                self.remove_remote(name)
            except NIXL_ERRORS:
                pass
        for d in self._local_sub.values():
            d.release()
        self._local_sub = {}
        if self._local_dlist is not None:
            self._local_dlist.release()
            self._local_dlist = None
        if self._reg is not None:
            self.agent.deregister_memory(self._reg)
            self._reg = None
        self._tensors = []
        self._layout = None

    def __enter__(self) -> NixlKVAgent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ---------------------------------------------------------------------------------
    @staticmethod
    def _nixl(fn: Any, *args: Any, what: str) -> Any:
        try:
            return fn(*args)
        except NIXL_ERRORS as e:
            raise TransferError(f"NIXL could not {what}: {type(e).__name__}: {e}") from e

    def _finish(self, handle: ReadHandle) -> None:
        handle.state, handle.t_done = "DONE", time.monotonic()
        self._release(handle)

    def _fail(self, handle: ReadHandle, msg: str) -> None:
        handle.state, handle.error = "ERR", msg
        self._release(handle)
        raise TransferError(msg)

    def _release(self, handle: ReadHandle) -> None:
        """Release (cancelling if in flight); a handle NIXL cannot cancel is left to its leak list."""
        if handle.released or handle.xfer is None:
            handle.released = True
            return
        handle.released = True
        try:
            handle.xfer.release()
        except NIXL_ERRORS as e:
            if handle.state == "DONE":
                raise TransferError(f"releasing a finished READ failed: {type(e).__name__}: {e}") from e
            handle.error = f"{handle.error or ''}; release failed: {type(e).__name__}: {e}".lstrip("; ")
