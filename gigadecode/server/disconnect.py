"""Awaiting work on behalf of an HTTP client that may leave: the API server and the proxy both cancel what a
request started (its engine requests, its upstream calls) when the client disconnects first, and answer a
client that left before its body was read (`client_left_mid_body`) without counting it a server error."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from starlette.requests import ClientDisconnect

DISCONNECT_POLL_S = 0.2          # how often a waiting request looks whether its client is still there
CLIENT_CLOSED = 499              # nginx's "client closed request": nobody reads the answer


class ClientGone(Exception):
    """The client disconnected before the work it asked for finished (the work was cancelled)."""


async def unless_disconnected(request: Request, coro: Awaitable[Any]) -> Any:
    """Await coro and return its result; cancel it and raise `ClientGone` when the client goes away first."""
    task = asyncio.ensure_future(coro)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ClientGone()
    finally:
        if not task.done():
            task.cancel()


async def client_left_mid_body(request: Request, e: ClientDisconnect) -> Response:
    """Exception handler for starlette's `ClientDisconnect` (a route read the body of a client that had gone):
    the client's doing, nothing started for it, so no traceback and no 500, only a 499 nobody receives."""
    return Response(status_code=CLIENT_CLOSED)


def answer_clients_that_leave(app: Any) -> None:
    """Register `client_left_mid_body` on a FastAPI app (the API server's and the proxy's)."""
    app.add_exception_handler(ClientDisconnect, client_left_mid_body)
