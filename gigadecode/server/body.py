"""Strict JSON request bodies, shared by the API server and the proxy.

`json.loads` on its own lets through what later code cannot handle, and fails on some input with errors
that are not `JSONDecodeError`: `NaN` / `Infinity` / `1e999` (not JSON, and not re-encodable), integers
over Python's 4300-digit conversion limit (`ValueError`), nesting deep enough for `RecursionError`, and
`\\ud800`-style escapes that decode to lone surrogates (no UTF-8 encoding exists, so the tokenizer or the
proxy's re-encoding fails). `load_object` refuses all of them with one `BodyError` that says what was
wrong, so each becomes a 400 instead of a 500. `BodyLimit` answers 413 to a body over the size limit
before anything reads it.
"""

from __future__ import annotations

import json
from typing import Any, Callable

MAX_DEPTH_HINT = "nested too deeply"


class BodyError(ValueError):
    """A request body that is not a JSON object we can work with."""


def _no_constant(name: str) -> Any:
    raise BodyError(f"{name} is not valid JSON")


def _finite_float(text: str) -> float:
    v = float(text)
    if v in (float("inf"), float("-inf")):
        raise BodyError(f"the number {text[:40]} is out of range")
    return v


def load_object(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object; BodyError (a one-line reason) otherwise."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BodyError(f"malformed JSON body: not UTF-8 ({e})") from None
    try:
        body = json.loads(text, parse_constant=_no_constant, parse_float=_finite_float)
    except BodyError as e:
        raise BodyError(f"malformed JSON body: {e}") from None
    except RecursionError:
        raise BodyError(f"malformed JSON body: {MAX_DEPTH_HINT}") from None
    except ValueError as e:                  # JSONDecodeError, and int-size limits
        raise BodyError(f"malformed JSON body: {str(e)[:200]}") from None
    if not isinstance(body, dict):
        raise BodyError(f"the body must be a JSON object (got {type(body).__name__})")
    if "\\ud" in text.lower():               # only an escape can make a lone surrogate
        try:
            json.dumps(body, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise BodyError("malformed JSON body: a string holds a lone UTF-16 surrogate") from None
        except RecursionError:
            raise BodyError(f"malformed JSON body: {MAX_DEPTH_HINT}") from None
    return body


class BodyLimit:
    """ASGI middleware: a request body over `max_bytes` (by Content-Length, or counted as it streams in)
    is answered 413 before any route parses it."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or ()).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            return await self._too_large(send)
        seen = 0

        async def counted() -> dict:
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.max_bytes:
                    raise _TooLarge()
            return msg

        started = False

        async def tracked_send(msg: dict) -> None:
            nonlocal started
            started = started or msg["type"] == "http.response.start"
            await send(msg)

        try:
            await self.app(scope, counted, tracked_send)
        except _TooLarge:
            if not started:
                await self._too_large(send)

    async def _too_large(self, send: Callable) -> None:
        body = json.dumps({"error": {"message": f"request body larger than {self.max_bytes} bytes "
                                                f"(--max-request-bytes)", "type": "invalid_request_error",
                                     "param": None, "code": "request_too_large"}}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


class _TooLarge(Exception):
    pass
