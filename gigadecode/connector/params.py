"""The typed `kv_transfer_params` and what makes them trustworthy: parsing, signing, the handshake proof.

A request's `kv_transfer_params` cross two boundaries a client controls: the router forwards the
prefill engine's answer to a decode engine, and anyone who can reach the decode API can send any params.
So they are
- **parsed** into a frozen, strictly typed `KVTransferParams` at the HTTP and engine boundaries (a wrong
  type, a negative block id, an unknown key is a 400 naming the field: `parse_kv_params`), never read
  as a loose dict inside the engine step;
- **signed** by the producer (`sign`: HMAC-SHA256 with the deployment key shared by prefill and decode
  engines, over a canonical encoding of every field) and bound to the prompt (`prompt_digest`: SHA-256 of
  the prompt token ids) and to the KV layout (`kv_layout_id`: model identity, KV dtype, packing, block
  size, head size, groups, buffers, FP8 scales). The consumer checks all three (`verify`) before it reads
  a byte: a client cannot forge block ids or CRCs, point the decode engine at blocks of another request,
  or send prompt B with the params of prompt A.
- The side channel that hands out NIXL metadata (memory addresses) answers only a peer that proves the
  same key (`handshake_token` / `check_handshake_token`: a time-stamped HMAC in a request header), and
  signs its answer (`answer_signature`) so a consumer knows it paired with a real producer.

Threats covered: forged or altered params (block ids, CRCs, hosts), a prompt swap, a replay after the
lease (the signed `lease_expires`; and within the lease the consumer refuses params it already used),
KV of another model or layout, a handshake from a peer without the key. Not covered: a peer that holds
the key (the key is the trust boundary: keep it off client machines), eavesdropping on the unencrypted
side channel and NIXL traffic (use a private network, as with vLLM's NixlConnector), and denial of service
by a client that floods the prefill engine with valid requests.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import struct
import time
from typing import Annotated, Any, Literal, Sequence

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError, field_validator

SECRET_ENV = "GIGADECODE_KV_SECRET"
MIN_SECRET_CHARS = 16
AUTH_HEADER = "X-Gigadecode-KV-Auth"
HANDSHAKE_SKEW_S = 120.0            # a handshake token older (or newer) than this is refused
MAX_LIST = 1 << 20                  # no request has more KV blocks than this

U32 = Annotated[StrictInt, Field(ge=0, le=0xFFFFFFFF)]
Count = Annotated[StrictInt, Field(ge=0)]
Name = Annotated[StrictStr, Field(min_length=1, max_length=256)]
Port = Annotated[StrictInt, Field(ge=1, le=65535)]
Hex = Annotated[StrictStr, Field(pattern=r"^[0-9a-f]{16,128}$")]


class KVParamsError(ValueError):
    """kv_transfer_params that are malformed, forged, for another prompt, or not usable by this engine.
    `param` names the offending field (dotted path under kv_transfer_params)."""

    def __init__(self, message: str, param: str = "kv_transfer_params") -> None:
        super().__init__(message)
        self.param = param


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)


class RemoteRank(_Frozen):
    """One rank of a tensor-parallel prefill engine: where to read its kv heads and their CRCs."""

    remote_engine_id: Name
    remote_host: Name
    remote_port: Port
    remote_request_id: Name
    kv_head_start: Count = 0
    kv_crc32: U32 | None = None
    kv_crc32_heads: Annotated[list[U32], Field(max_length=4096)] | None = None


class KVTransferParams(_Frozen):
    """The `kv_transfer_params` a request carries (vLLM's key names, plus the integrity fields)."""

    do_remote_decode: StrictBool = False        # router -> producer: keep the KV for a remote decode
    do_remote_prefill: StrictBool = False       # router -> consumer: the KV comes from a remote prefill
    producer: Literal["vllm"] | None = None     # None: a gigadecode prefill; "vllm": a stock vLLM one (the
    #                                             router signed its answer; `connector.vllm_producer`)
    remote_engine_id: Name | None = None
    remote_host: Name | None = None
    remote_port: Port | None = None
    remote_request_id: Name | None = None
    remote_block_ids: Annotated[list[Annotated[list[Count], Field(max_length=MAX_LIST)]],
                                Field(max_length=64)] | None = None   # per KV group, live blocks only
    remote_first_block: Annotated[list[Count], Field(max_length=64)] | None = None  # logical index of [g][0]
    num_computed_tokens: Count | None = None     # tokens whose KV the remote blocks hold (N-1)
    lease_expires: float | None = None           # producer wall clock: the blocks are freed after this
    issued_at: float | None = None               # router wall clock when a vLLM prefill answered (`producer:
    #                                              "vllm"`: a reader refuses params older than a restart it saw)
    producer_process: Hex | None = None          # the vLLM process that answered (`vllm_handshake`): read only
    #                                              from a pairing with it
    kv_crc32: U32 | None = None                  # CRC32 of the KV bytes (group, block, buffer, K then V)
    kv_head_start: Count | None = None           # the first global kv head the CRCs start from
    kv_crc32_heads: Annotated[list[U32], Field(max_length=4096)] | None = None   # one CRC32 per kv head
    remote_ranks: Annotated[list[RemoteRank], Field(min_length=1, max_length=1024)] | None = None
    prompt_digest: Hex | None = None             # sha256 of the prompt token ids (`prompt_digest`)
    kv_layout_id: Hex | None = None              # the producer's `kv_layout_id`
    signature: Hex | None = None                 # HMAC-SHA256 over everything else (`sign`)

    @field_validator("lease_expires", "issued_at")
    @classmethod
    def _finite(cls, v: float | None) -> float | None:
        if v is not None and not math.isfinite(v):
            raise ValueError("must be a finite number")
        return v

    @property
    def is_remote(self) -> bool:
        return self.do_remote_decode or self.do_remote_prefill

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict without unset (None) fields: what the HTTP layer answers."""
        return self.model_dump(exclude_none=True)

    def ranks(self) -> list[RemoteRank]:
        """The producer ranks to read from: `remote_ranks`, or the params themselves (one rank)."""
        if self.remote_ranks:
            return list(self.remote_ranks)
        return [RemoteRank(remote_engine_id=self.remote_engine_id, remote_host=self.remote_host,
                           remote_port=self.remote_port, remote_request_id=self.remote_request_id,
                           kv_head_start=self.kv_head_start or 0, kv_crc32=self.kv_crc32,
                           kv_crc32_heads=self.kv_crc32_heads)]


def parse_kv_params(raw: Any) -> KVTransferParams:
    """A client's (or the router's) kv_transfer_params -> `KVTransferParams`; KVParamsError naming the
    first bad field ("kv_transfer_params.remote_first_block.0: Input should be a valid integer")."""
    if isinstance(raw, KVTransferParams):
        return raw
    if not isinstance(raw, dict):
        raise KVParamsError(f"kv_transfer_params must be a JSON object (got {type(raw).__name__})")
    try:
        return KVTransferParams.model_validate(raw)
    except ValidationError as e:
        err = e.errors()[0]
        path = ".".join(["kv_transfer_params", *(str(p) for p in err.get("loc", ()))])
        raise KVParamsError(f"{path}: {err.get('msg')}", param=path) from None


# --------------------------------------------------------------------------------------------------
# signing
# --------------------------------------------------------------------------------------------------
def check_secret(secret: str | None, role: str) -> bytes:
    """The deployment key as bytes; ValueError (saying how to set one) when it is missing or too short."""
    what = {"kv_producer": "a prefill", "kv_consumer": "a decode"}.get(role, "a DI")
    if not secret:
        raise ValueError(f"{what} engine needs the KV secret its prefill and decode engines share (it signs "
                         f"and checks kv_transfer_params): set {SECRET_ENV} (or --kv-secret) to the same random "
                         f"string on both, e.g. `export {SECRET_ENV}=$(python -c 'import secrets; "
                         f"print(secrets.token_hex(32))')`")
    if len(secret) < MIN_SECRET_CHARS:
        raise ValueError(f"the KV secret must have at least {MIN_SECRET_CHARS} characters (got {len(secret)})")
    return secret.encode()


def prompt_digest(prompt_ids: Sequence[int]) -> str:
    """SHA-256 (hex) of the prompt token ids as little-endian uint32s."""
    return hashlib.sha256(struct.pack(f"<{len(prompt_ids)}I", *prompt_ids)).hexdigest()


def kv_layout_id(model_id: str, dtype: str, packed: bool, block_size: int, head_dim: int, num_groups: int,
                 num_buffers: int, model_kv_heads: int, k_scale: float = 1.0, v_scale: float = 1.0) -> str:
    """What a producer's and a consumer's KV must agree on whatever their TP sizes (16 hex chars); the FP8
    scales too: the same bytes under other scales are other keys and values."""
    blob = json.dumps([model_id, dtype, bool(packed), block_size, head_dim, num_groups, num_buffers,
                       model_kv_heads, float(k_scale), float(v_scale)])
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _canonical(params: KVTransferParams) -> bytes:
    d = params.model_dump(exclude={"signature"}, exclude_none=True)
    return json.dumps(d, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def sign(params: KVTransferParams, key: bytes) -> KVTransferParams:
    """The params with `signature` = HMAC-SHA256(key, canonical JSON of every other field)."""
    mac = hmac.new(key, _canonical(params), hashlib.sha256).hexdigest()
    return params.model_copy(update={"signature": mac})


def verify_signature(params: KVTransferParams, key: bytes) -> None:
    """KVParamsError unless the params are signed with `key` (as a producer of this deployment answered them)."""
    if params.signature is None:
        raise KVParamsError("kv_transfer_params are not signed: only the params a prefill engine answered "
                            "(sharing this engine's KV secret) can be used", "kv_transfer_params.signature")
    mac = hmac.new(key, _canonical(params), hashlib.sha256).hexdigest()
    if not hmac.compare_digest(mac, params.signature):
        raise KVParamsError("kv_transfer_params signature does not match: the params were altered, forged, or "
                            "signed with another KV secret", "kv_transfer_params.signature")


def verify(params: KVTransferParams, key: bytes, prompt_ids: Sequence[int], layout_id: str) -> None:
    """KVParamsError unless the params are signed with `key`, for exactly `prompt_ids`, by a producer whose
    KV layout is `layout_id`. Checked in that order, before anything else reads the params."""
    verify_signature(params, key)
    if params.producer is None and params.kv_layout_id != layout_id:   # a vLLM producer's: checked at handshake
        raise KVParamsError(f"kv_transfer_params are for KV layout {params.kv_layout_id}, this engine's is "
                            f"{layout_id} (another model (config or weights), KV dtype, block size or "
                            f"FP8 scales)",
                            "kv_transfer_params.kv_layout_id")
    if params.prompt_digest != prompt_digest(prompt_ids):
        raise KVParamsError("kv_transfer_params belong to another prompt (prompt digest mismatch): the KV was "
                            "computed for different tokens", "kv_transfer_params.prompt_digest")


# --------------------------------------------------------------------------------------------------
# the handshake proof
# --------------------------------------------------------------------------------------------------
def handshake_token(key: bytes, now: float | None = None) -> str:
    """`<unix seconds>.<HMAC>`: sent in `AUTH_HEADER` by a consumer asking for a producer's handshake."""
    ts = str(int(time.time() if now is None else now))
    return f"{ts}.{hmac.new(key, b'gigadecode-kv-handshake:' + ts.encode(), hashlib.sha256).hexdigest()}"


def check_handshake_token(key: bytes, token: str | None, now: float | None = None) -> bool:
    """Does `token` prove the key (and is it fresh)?"""
    if not token or token.count(".") != 1:
        return False
    ts, mac = token.split(".")
    if not ts.isdigit() or abs((time.time() if now is None else now) - int(ts)) > HANDSHAKE_SKEW_S:
        return False
    want = hmac.new(key, b"gigadecode-kv-handshake:" + ts.encode(), hashlib.sha256).hexdigest()
    return hmac.compare_digest(want, mac)


def answer_signature(key: bytes, body: bytes) -> str:
    """The producer's proof over its handshake answer (sent back in `AUTH_HEADER`)."""
    return hmac.new(key, b"gigadecode-kv-answer:" + body, hashlib.sha256).hexdigest()
