"""The DI proxy's decode leg: pick a decode server, fail over, return or relay its answer, and release the
prefill's KV lease when the decode side will never read it.

A decode server that fails *before its answer starts* leaves the rotation (`Pool.mark_down`) and the request
goes to the next one: one that could not be reached (`httpx.ConnectError`, `ConnectTimeout`), and one that dropped the
connection without a word (`RemoteProtocolError` "Server disconnected without sending a response", a reset
or a failed write: a server shutting down closes its idle pooled connections, and a request sent on one just
then meets that). Trying another is safe: a decode request has no effect but its answer, and the prefill's KV
is leased until a decode server has read it (one that already had would make the next one's read fail with
that error, never read other KV). Not behind a vLLM prefill (`reread_safe=False`): it frees its blocks once a
decode server has read them and its answer has no CRC, so a second reader could decode another request's KV;
there only a decode server nothing reached is retried. A server that took the request and said nothing within
`--decode-timeout-s` is a 504; once its answer has started, a failure ends the stream with an error event
(`relay`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from .disconnect import CLIENT_CLOSED, ClientGone, unless_disconnected
from .errors import error_body
from .proxy_pool import Pool, Upstream
from .proxy_tls import failure

log = logging.getLogger("gigadecode.proxy")

RELEASE_TIMEOUT_S = 5.0          # a lease release (best effort: the lease runs out otherwise)


def proxy_error(status: int, message: str, type: str = "server_error", code: str | None = None) -> JSONResponse:
    """An error in OpenAI's shape, from the proxy itself."""
    return JSONResponse(error_body(message, type, None, code), status_code=status)


def _within(aw: Awaitable, timeout_s: float | None) -> Awaitable:
    return aw if timeout_s is None else asyncio.wait_for(aw, timeout_s)


def _decode_timeout(decodes: Pool, up: Upstream, timeout_s: float | None) -> JSONResponse:
    log.warning("decode server %s did not answer within %s s", up.url, timeout_s)
    decodes.mark_down(up, f"did not start an answer within {timeout_s} s")
    return proxy_error(504, f"decode server {up.url} did not start its answer within {timeout_s} s",
                       code="decode_timeout")


# failures that sent nothing: a refused connection, and a connect that timed out (a host gone)
_UNREACHED = (httpx.ConnectError, httpx.ConnectTimeout)


def _never_answered(e: httpx.TransportError, reread_safe: bool) -> bool:
    """Whether a failure before any answer leaves the request free to go to another decode server: one nothing
    reached, or (`reread_safe`: the KV's bytes are checked) one that dropped it, which may have read the KV."""
    if isinstance(e, _UNREACHED):
        return True
    return reread_safe and isinstance(e, (httpx.NetworkError, httpx.RemoteProtocolError))


def _next_server(decodes: Pool, up: Upstream, e: httpx.TransportError) -> str:
    """A decode server that was not reached, or dropped the request before answering: out of the rotation
    -> why, for the client should no other answer."""
    why = failure(e, up.url)
    what = "unreachable" if isinstance(e, _UNREACHED) else "dropped the request before answering"
    log.warning("decode server %s %s: %s", up.url, what, why)
    decodes.mark_down(up, f"{what}: {why}")
    return f"decode server {up.url} {what}: {why}"


def _no_decode_server(last: str) -> JSONResponse:
    return proxy_error(502, f"no decode server could be reached; last: {last}", code="decode_failed")


async def decode_whole(http: httpx.AsyncClient, decodes: Pool, path: str, headers: dict[str, str],
                       prefill: Callable[[], Awaitable[dict[str, Any] | Response]],
                       timeout_s: float | None = None, reread_safe: bool = True) -> Response:
    """Non-streaming: `prefill()` (-> the decode body, or the answer to give), then one decode request whose
    answer is returned as it is (a 504 when it takes longer than `timeout_s`)."""
    dbody = await prefill()
    if isinstance(dbody, Response):
        return dbody
    tried: list[Upstream] = []
    last = "no decode server"
    while (up := decodes.pick(tried)) is not None:
        tried.append(up)
        up.in_flight += 1
        try:
            r = await _within(http.post(up.url + path, json=dbody, headers=headers), timeout_s)
        except TimeoutError:
            return _decode_timeout(decodes, up, timeout_s)
        except httpx.TransportError as e:
            if _never_answered(e, reread_safe):
                last = _next_server(decodes, up, e)
                continue
            decodes.mark_down(up, f"failed: {(why := failure(e, up.url))}")
            return proxy_error(502, f"decode server {up.url} failed: {why}", code="decode_failed")
        finally:
            up.in_flight -= 1
        decodes.mark_up(up)
        return Response(r.content, status_code=r.status_code,
                        media_type=r.headers.get("content-type", "application/json"))
    return _no_decode_server(last)


async def decode_stream(http: httpx.AsyncClient, decodes: Pool, request: Request, path: str,
                        headers: dict[str, str], dbody: dict[str, Any],
                        release: Callable[[], Awaitable[None]], timeout_s: float | None = None,
                        reread_safe: bool = True) -> Response:
    """Streaming: the first decode server whose answer starts -> that answer, relayed (`relay`). `release`
    ends the prefill's lease, called wherever the decode side will not read it."""
    tried: list[Upstream] = []
    last = "no decode server"
    while (up := decodes.pick(tried)) is not None:
        tried.append(up)
        up.in_flight += 1
        req = http.build_request("POST", up.url + path, json=dbody, headers=headers)
        try:
            r = await unless_disconnected(request, _within(http.send(req, stream=True), timeout_s))
        except TimeoutError:                 # it took the request and said nothing: a 504, KV released
            up.in_flight -= 1
            await release()
            return _decode_timeout(decodes, up, timeout_s)
        except (httpx.TransportError, ClientGone) as e:   # it failed, or the client left, before the headers
            up.in_flight -= 1
            if isinstance(e, httpx.TransportError) and _never_answered(e, reread_safe):
                last = _next_server(decodes, up, e)
                continue
            await release()
            if isinstance(e, ClientGone):
                return Response(status_code=CLIENT_CLOSED)
            decodes.mark_down(up, f"failed: {(why := failure(e, up.url))}")
            return proxy_error(502, f"decode server {up.url} failed: {why}", code="decode_failed")
        except BaseException:
            up.in_flight -= 1
            raise
        decodes.mark_up(up)
        if r.status_code >= 400:
            await release()
        events = relay(r, up, release, path == "/v1/responses", lambda why: decodes.mark_down(up, why))
        return StreamingResponse(events, status_code=r.status_code,
                                 media_type=r.headers.get("content-type", "text/event-stream"),
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    await release()
    return _no_decode_server(last)


async def release_lease(http: httpx.AsyncClient, leased: dict[str, Any], headers: dict[str, str]) -> None:
    """Tell the prefill server that its params will never be read (it frees the blocks now, not when the
    lease runs out), or, before they came, that the prefill named `handoff` will never be asked for (it ends
    that request, running or leased); best effort: a failure leaves the lease to run out."""
    if leased is None:
        return
    kv, handoff, url = leased.pop("kv", None), leased.pop("handoff", None), leased.pop("url", None)
    if (kv is None and handoff is None) or url is None:
        return
    body = {"kv_transfer_params": kv} if kv is not None else {"handoff": handoff}
    try:
        r = await http.post(url, json=body, headers=headers, timeout=RELEASE_TIMEOUT_S)
        if r.status_code != 200:
            log.warning("prefill server %s refused to release a lease: %s %s", url, r.status_code, r.text[:200])
    except (httpx.HTTPError, RuntimeError) as e:      # RuntimeError: the proxy's client closed (shutting down)
        log.warning("prefill server %s unreachable to release a lease: %s", url,
                    failure(e, url) if isinstance(e, httpx.HTTPError) else e)


background: set[asyncio.Task] = set()         # releases scheduled by streams that ended early
_SEQ = re.compile(rb'"sequence_number":\s*(\d+)')   # a /v1/responses event's number


async def relay(r: httpx.Response, up: Upstream, release: Callable[[], Awaitable[None]],
                responses: bool = False, failed: Callable[[str], None] = lambda why: None) -> AsyncIterator[bytes]:
    """The decode server's stream, whole SSE events as they come; closing it (client gone) closes the upstream
    request. A stream that does not run to its end (the client left, the decode server failed) releases the
    prefill's lease: the decode side may never have read it (a release after the read is a no-op). A failure
    mid-stream drops the event it cut in half and ends as a single server ends a failed stream: an error chunk
    and [DONE], or on /v1/responses an `error` event numbered after the last one relayed, and `failed(why)`
    is told (the server leaves the rotation)."""
    ended, tail, seq = False, b"", -1
    try:
        async for chunk in r.aiter_raw():
            tail += chunk
            cut = tail.rfind(b"\n\n") + 2
            if cut > 1:
                whole, tail = tail[:cut], tail[cut:]
                if responses and (n := _SEQ.findall(whole)):
                    seq = int(n[-1])
                yield whole
        if tail:                         # not SSE (an error's JSON body): as it came
            yield tail
        ended = True
    except httpx.TransportError as e:
        msg = f"decode server {up.url} failed mid-stream: {type(e).__name__}: {e}"
        failed(msg)
        if responses:
            ev = {"type": "error", "code": "decode_failed", "message": msg, "param": None, "sequence_number": seq + 1}
            yield f"event: error\ndata: {json.dumps(ev)}\n\n".encode()
        else:
            err = {"message": msg, "type": "server_error", "param": None, "code": "decode_failed"}
            yield f"data: {json.dumps({'error': err})}\n\ndata: [DONE]\n\n".encode()
    finally:
        up.in_flight -= 1
        if not ended:                  # a task: this generator may be closing under a cancellation
            in_background(release())
        await r.aclose()


def in_background(coro: Awaitable[None]) -> None:
    """Run `coro` (a release) as a task of its own, kept alive until it is done."""
    task = asyncio.get_running_loop().create_task(coro)
    background.add(task)
    task.add_done_callback(background.discard)
