"""What every route of the API server needs from the app: its settings (`ServerSettings`, on
`app.state.settings`), the engine (`engine`), the API-key check (`check_key`), the model-name check and a
generation route's prologue (`open_generation`), and the id of a DI prefill the proxy named
(`handoff_request_id`; the naming itself is handoff.py's)."""

from __future__ import annotations

import re
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from pydantic import BaseModel

from ..connector.params import KVTransferParams
from .async_engine import AsyncEngine
from .handoff import HANDOFF_HEADER, valid_handoff
from .protocol import APIError, read_body


@dataclass(frozen=True)
class ServerSettings:
    served_model_name: str
    api_key: str | None = None
    role: str = "both"
    kv_advertise_host: str | None = None      # prefill: what decode engines are told (None: the reached address)
    created: int = field(default_factory=lambda: int(time.time()))
    aliases: tuple[str, ...] = ()             # more names a request may give (vLLM's --served-model-name A B ...)

    @property
    def model_names(self) -> tuple[str, ...]:
        return (self.served_model_name, *self.aliases)


def settings(request: Request) -> ServerSettings:
    return request.app.state.settings


def engine(request: Request) -> AsyncEngine:
    aeng = request.app.state.engine
    if aeng is None:
        raise APIError(503, "the engine is starting", type="server_error", code="engine_unavailable")
    return aeng


def check_key(request: Request) -> None:
    """Dependency: 401 unless the request carries the server's API key (when it has one)."""
    key = settings(request).api_key
    if not key:
        return
    auth = request.headers.get("authorization", "")
    if not secrets.compare_digest(auth.encode(), f"Bearer {key}".encode()):
        raise APIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')", code="invalid_api_key")


def check_model(request: Request, model: str | None) -> None:
    names = settings(request).model_names
    if model is not None and model not in names:
        served = ", ".join(f"`{n}`" for n in names)
        raise APIError(404, f"the model `{model}` does not exist (this server serves {served})", param="model",
                       code="model_not_found")


async def open_generation(request: Request, body: type[BaseModel], chat: bool
                          ) -> tuple[dict[str, Any], Any, AsyncEngine, str]:
    """A generation route's prologue: the body read and checked (strict JSON, parsed into `body`, unsupported
    fields refused, the model name this server's) -> (raw dict, parsed body, engine, the model name to answer
    under: `answer_model`)."""
    raw, req = await read_body(request, body, chat=chat)
    check_model(request, req.model)
    return raw, req, engine(request), answer_model(request, req.model)


def answer_model(request: Request, model: str | None) -> str:
    """The model name an answer carries, as vLLM's: the one the request gave (any of the served names,
    `check_model` passed it), else the first served name."""
    return model or settings(request).served_model_name


def advertised(request: Request, kv: KVTransferParams | None) -> KVTransferParams | None:
    """A prefill request's params with `remote_host` set to where decode engines reach this server's KV side
    channel: `--kv-advertise-host`, else the address the client reached this server on (never a host the
    client names)."""
    if kv is None or not kv.do_remote_decode:
        return kv
    server = request.scope.get("server") or (None, None)
    return kv.model_copy(update={"remote_host": settings(request).kv_advertise_host or server[0] or None})


def handoff_request_id(request: Request, prefix: str, kv: KVTransferParams | None) -> str | None:
    """A prefill request's id when the proxy named it (HANDOFF_HEADER): `{prefix}-handoff-{name}`; None (a fresh
    id) for every other request. A header that is not 32 hex digits is a 400."""
    handoff = request.headers.get(HANDOFF_HEADER)
    if handoff is None or kv is None or not kv.do_remote_decode:
        return None
    if not valid_handoff(handoff):
        raise APIError(400, f"{HANDOFF_HEADER}: expected 32 hex digits", param=HANDOFF_HEADER)
    return f"{prefix}-handoff-{handoff}"


def sampling_defaults(aeng: AsyncEngine) -> tuple:
    """The checkpoint's generation_config.json sampling fields (what a request leaves unset gets)."""
    gen = getattr(aeng.engine, "generation_defaults", None)
    return gen.sampling if gen is not None else ()
