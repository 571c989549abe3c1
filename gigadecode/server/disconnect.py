"""Awaiting work on behalf of an HTTP client that may leave: the API server and the proxy both cancel what a
request started (its engine requests, its upstream calls) when the client disconnects first."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

from fastapi import Request

DISCONNECT_POLL_S = 0.2          # how often a waiting request looks whether its client is still there


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
