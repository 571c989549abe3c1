"""What a stock vLLM prefill engine (NixlConnector producer, pull mode, TP 1) tells the others: its handshake,
the process that gave it, and its prefill answer as our params (the router's side).

Handshake (`fetch_handshake`): a ZMQ REQ to `remote_host:remote_port` sending msgpack
`[b"get_meta_msg", pp_rank, tp_rank]`; the answer is two frames, a msgpack map {compatibility_hash,
agent_metadata_bytes} (and a timestamp), the bytes again a msgpack map of the agent metadata
(`VllmAgentMetadata`).

Which process (`VllmAgentMetadata.process`): vLLM keeps an engine id fixed in `--kv-transfer-config` across
restarts, so the engine id does not say which process holds a request's blocks, and vLLM's answer has nothing
else that would. Its handshake does: the NIXL agent's metadata (a fresh agent name and transport address in
every process) and the addresses of its KV regions, encoded once when the process registers its KV and
answered unchanged for its life. Their digest names the process. The router (`server.proxy`) asks the side
channel right after each answer (`AnsweringProcess`: one probe serves every answer that came before it started)
and signs that digest into the params (`producer_process`); a decode engine reads the KV only from a pairing
with the same digest (`vllm_producer.VllmReader`). A probe reaches the process that answered unless vLLM was
stopped, restarted and listening again within `PROBE_TIMEOUT_S` of the answer (a vLLM process loads a model
first: it takes longer than that to start). Where a probe finished before the prefill was sent, its process
must be the same one (`ProducerRestarted` otherwise: a restart fell between the two probes, so which process
answered is unknown, and the router prefills once more), so then no timing is assumed at all.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from dataclasses import dataclass
from typing import Any

from .base import HandshakeError
from .params import KVParamsError, KVTransferParams, parse_kv_params

GET_META_MSG = b"get_meta_msg"
PROBE_TIMEOUT_S = 3.0       # the router's side-channel probe after an answer; shorter than any vLLM start-up


# --------------------------------------------------------------------------------------------------
# the handshake
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class VllmAgentMetadata:
    """What a vLLM producer's side channel tells a consumer (the fields this reader uses)."""

    engine_id: str
    agent_metadata: bytes
    kv_caches_base_addr: tuple[int, ...]
    num_blocks: int
    block_lens: tuple[int, ...]
    block_strides: tuple[int, ...]
    kv_cache_layout: str
    block_size: int
    attn_backend_name: str
    compatibility_hash: str = ""

    @classmethod
    def from_payload(cls, payload: bytes) -> VllmAgentMetadata:
        """Decode the first answer frame; HandshakeError naming what is missing or mistyped."""
        import msgspec
        try:
            outer = msgspec.msgpack.decode(payload)
            inner = msgspec.msgpack.decode(outer["agent_metadata_bytes"])
            meta = cls(engine_id=str(inner["engine_id"]), agent_metadata=bytes(inner["agent_metadata"]),
                       kv_caches_base_addr=tuple(int(a) for a in inner["kv_caches_base_addr"]),
                       num_blocks=int(inner["num_blocks"]), block_lens=tuple(int(x) for x in inner["block_lens"]),
                       block_strides=tuple(int(x) for x in inner.get("block_strides") or inner["block_lens"]),
                       kv_cache_layout=str(inner.get("kv_cache_layout", "")), block_size=int(inner["block_size"]),
                       attn_backend_name=str(inner.get("attn_backend_name", "")),
                       compatibility_hash=str(outer.get("compatibility_hash", "")))
        except (KeyError, TypeError, ValueError, msgspec.DecodeError) as e:
            raise HandshakeError(f"the vLLM side channel answered something that is not NIXL agent metadata: "
                                 f"{type(e).__name__}: {e}") from None
        n = len(meta.kv_caches_base_addr)
        if not n or len(meta.block_lens) != n or len(meta.block_strides) != n or meta.num_blocks < 1:
            raise HandshakeError(f"vLLM agent metadata of {meta.engine_id}: {n} regions, "
                                 f"{len(meta.block_lens)} block lengths, {meta.num_blocks} blocks")
        return meta

    @property
    def process(self) -> str:
        """The producer process's name: a digest of what is fixed for its life and new in every process (its
        NIXL agent's metadata and its KV's addresses), 32 hex chars."""
        h = hashlib.sha256(self.engine_id.encode() + b"\0" + self.agent_metadata)
        h.update(",".join(map(str, self.kv_caches_base_addr)).encode())
        return h.hexdigest()[:32]


def fetch_handshake(host: str, port: int, timeout_s: float, tp_rank: int = 0) -> VllmAgentMetadata:
    """One request to a vLLM producer's ZMQ side channel (always the well-formed 3-element message: a
    malformed one stops vLLM's listener for every consumer)."""
    import msgspec
    import zmq
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.REQ)
    ms = max(1, int(timeout_s * 1000))
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, ms)
    sock.setsockopt(zmq.SNDTIMEO, ms)
    try:
        host_part = f"[{host}]" if ":" in host else host
        sock.connect(f"tcp://{host_part}:{port}")
        sock.send(msgspec.msgpack.encode((GET_META_MSG, 0, tp_rank)))
        frames = sock.recv_multipart()
    except zmq.Again:
        raise HandshakeError(f"the vLLM side channel {host}:{port} did not answer in {timeout_s:.3g} s") from None
    except zmq.ZMQError as e:
        raise HandshakeError(f"the vLLM side channel {host}:{port} failed: {e}") from None
    finally:
        sock.close(0)
    if len(frames) != 2:
        raise HandshakeError(f"the vLLM side channel {host}:{port} answered {len(frames)} frames, expected 2")
    return VllmAgentMetadata.from_payload(frames[0])


# --------------------------------------------------------------------------------------------------
# the params (router side)
# --------------------------------------------------------------------------------------------------
def from_vllm_answer(answer: Any, lease_s: float, margin_s: float = 2.0) -> KVTransferParams:
    """vLLM's `kv_transfer_params` answer -> our (unsigned) params for a decode engine: `producer: "vllm"`,
    its block lists as they are (null entries kept: their position says which block they stand for),
    `num_computed_tokens` = remote_num_tokens, and the lease end this router's clock expects (vLLM's
    lease, `lease_s`, less `margin_s`), and `issued_at`: now, when vLLM answered. KVParamsError when the
    answer is not a pull-mode TP-1 producer's."""
    if not isinstance(answer, dict):
        raise KVParamsError(f"the vLLM prefill answered kv_transfer_params that are not an object: {answer!r}")
    need = ("remote_engine_id", "remote_host", "remote_port", "remote_request_id", "remote_block_ids",
            "remote_num_tokens")
    missing = [k for k in need if answer.get(k) is None]
    if missing:
        raise KVParamsError(f"the vLLM prefill's kv_transfer_params lack {', '.join(missing)} (is it a NixlConnector "
                            f"producer, and did the prefill finish?)")
    for k in ("tp_size", "pp_size", "dcp_size"):
        if answer.get(k, 1) != 1:
            raise KVParamsError(f"the vLLM prefill has {k}={answer[k]}: only TP 1 / PP 1 / DCP 1 vLLM producers "
                                f"are read")
    if answer.get("transfer_mode", "pull") != "pull":
        raise KVParamsError(f"the vLLM prefill uses transfer_mode {answer['transfer_mode']!r}; only 'pull' is read")
    now = time.time()
    return parse_kv_params({
        "do_remote_prefill": True, "producer": "vllm", "remote_engine_id": answer["remote_engine_id"],
        "remote_host": answer["remote_host"], "remote_port": answer["remote_port"],
        "remote_request_id": answer["remote_request_id"],
        "remote_block_ids": [list(ids) for ids in answer["remote_block_ids"]],
        "num_computed_tokens": answer["remote_num_tokens"], "lease_expires": now + lease_s - margin_s,
        "issued_at": now})


class ProducerRestarted(HandshakeError):
    """The producer's process changed between the probe before a prefill and the one after its answer."""


class AnsweringProcess:
    """The router's view of which vLLM process answered a prefill (see the module docstring): `seen()` before
    the prefill is sent, `of(params, seen, answered)` after its answer -> the process's name, from a probe of the
    side channel started after `answered` (one probe serves every answer that came before it started)."""

    def __init__(self, timeout_s: float = PROBE_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s
        self.known: dict[tuple[str, int], tuple[float, VllmAgentMetadata]] = {}   # side channel -> last probe's
        self.probes: dict[tuple[str, int], tuple[float, asyncio.Future]] = {}      # in flight: (start, result)

    def seen(self) -> dict[tuple[str, int], str]:
        """The processes probes that have finished saw, by side channel: taken before a prefill is sent."""
        return {k: meta.process for k, (_, meta) in self.known.items()}

    async def of(self, params: KVTransferParams, seen: dict[tuple[str, int], str], answered: float) -> str:
        """The name of the process that answered `params` (received at monotonic `answered`); HandshakeError
        when its side channel does not answer in time or is another engine now, ProducerRestarted when the
        probe before the prefill saw another process (a restart fell in between: which one answered is unknown)."""
        key = (params.remote_host, params.remote_port)
        where = f"the vLLM prefill's side channel {key[0]}:{key[1]}"
        start, meta = self.known.get(key, (float("-inf"), None))
        if start < answered:
            start, fut = self.probes.get(key, (float("-inf"), None))
            if fut is None or start < answered:
                start = time.monotonic()
                fut = asyncio.ensure_future(asyncio.to_thread(fetch_handshake, *key, self.timeout_s))
                self.probes[key] = (start, fut)
                fut.add_done_callback(lambda f, key=key, start=start: self._done(key, start, f))
            meta = await asyncio.shield(fut)    # a client that leaves does not cancel the others' probe
        if meta.engine_id != params.remote_engine_id:
            raise HandshakeError(f"{where} is engine {meta.engine_id!r} now, not the {params.remote_engine_id!r} "
                                 f"that answered: it was restarted, the KV went with it")
        before = seen.get(key)
        if before is not None and before != meta.process:
            raise ProducerRestarted(f"{where} answers from another process than before this prefill was sent (a "
                                    f"restart): which one holds its KV is unknown")
        return meta.process

    def _done(self, key: tuple[str, int], start: float, fut: asyncio.Future) -> None:
        if self.probes.get(key, (0.0, None))[1] is fut:
            del self.probes[key]
        if not fut.cancelled() and fut.exception() is None and (key not in self.known or self.known[key][0] < start):
            self.known[key] = (start, fut.result())
