"""The DI router (`gigadecode proxy`): prefill on one server, decode on another, like vLLM's
disaggregated proxy.

For each POST /v1/completions, /v1/chat/completions or /v1/responses:
1. send the client's body to a prefill server (the least loaded, or the one that took the longest prefix of
   its prompt while it is not much busier: `Pool.pick`) with `max_tokens=1` (and `max_completion_tokens=1`, or
   `max_output_tokens=1`),
   `stream=false` and `kv_transfer_params={"do_remote_decode": true}`; a prefill server that cannot be
   reached or answers 5xx is retried on the next one (each at most once); a 4xx goes back to the
   client as it is;
2. send the client's original body plus the `kv_transfer_params` the prefill answered to a decode
   server, and stream (whole SSE events) or return its answer as it is (`proxy_decode`: a decode server
   that cannot be reached, or drops the request before its answer starts, is retried on the next one);
3. if the decode side will never read those params (it refused the request, none was reachable, or the
   client left before it had them), POST them to the prefill server's `/kv/release`, which frees the
   leased blocks at once instead of when the lease runs out. Each prefill is sent under a fresh name
   (`handoff.HANDOFF_HEADER`): when the client leaves, or the prefill times out, before its answer came, the
   proxy cannot know whether the server answered (leasing the KV) just then, so it asks `/kv/release` to end
   the request of that name, running or leased.
Behind stock vLLM prefill servers (`--prefill-vllm`, /v1/completions): the proxy has the prompt's token ids
(given, or from the decode server's `/tokenize`), sends the vLLM prefill `prompt[:-1]` with `max_tokens=1`
and `kv_transfer_params={"do_remote_decode": true}` (vLLM keeps every token it computes: one fewer makes its
blocks exactly the N-1 a decode engine needs), turns vLLM's answer into the decode engines' params
(`connector.vllm_handshake.from_vllm_answer`), binds them to the whole prompt and signs them with the
deployment's KV secret (the decode servers accept no unsigned params) together with the vLLM process that
answered (asked of vLLM's side channel right after the answer: `connector.vllm_handshake`; a decode server
reads only from that process), and sends the full prompt's ids to a decode server.
Each role's server is the least loaded one (in-flight requests, then fewest sent, then list order) of those
in rotation: a server that could not be reached, timed out, or dropped a request mid-way is left out
(`Pool.mark_down`) until its /health answers 200 again; the proxy asks each server's /health every second
(`proxy_health.probe_servers`), so new requests go around a dead or wedged server, even one that died while
idle, and come back to it once it has returned.
A client that disconnects closes the upstream request (which aborts it there). GET /health reports, at once,
what the proxy knows of the upstreams' health (a 503 naming the role while one has no server in rotation),
GET /metrics each one's load, rotation and failures (Prometheus), both from `proxy_health`; GET /v1/models
is the answer of the first decode server (in rotation first) that gives one within `INFO_TIMEOUT_S`.
Authorization headers are forwarded to the upstreams. One HTTP client sends every upstream request (the
prefills, decodes, `/kv/release`, `/tokenize`, `/v1/models`, the health probes), `https://` ones with
`proxy_tls`'s context: the CA bundle the servers are checked against and the proxy's client certificate for
servers that require one (`--upstream-ssl-*`).
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
import uuid
from collections.abc import Sequence
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from .body import BodyError, BodyLimit, load_object
from .handoff import HANDOFF_HEADER
from .disconnect import CLIENT_CLOSED, ClientGone, answer_clients_that_leave, unless_disconnected
from .gc_heap import freeze_startup_heap
from .http_options import add_cors, check_http_options, scheme, uvicorn_options
from .proxy_health import health_report, metrics_text, probe_servers
from .proxy_decode import (RELEASE_TIMEOUT_S, background, decode_stream, decode_whole, in_background, proxy_error,
                           release_lease)
from .proxy_pool import Pool, Upstream, prefix_keys
from .proxy_tls import failure, upstream_tls_context, warn_if_unused

log = logging.getLogger("gigadecode.proxy")

FORWARD_HEADERS = ("authorization", "x-request-id")
CONNECT_TIMEOUT_S = 10.0
# Pooled connections to the servers are dropped after this many idle seconds: below uvicorn's keep-alive
# timeout (5 s), so the proxy never sends a request on a connection the server is closing at that moment
# (httpx's default expiry is also 5 s: that race surfaced as a rare ReadError, "prefill server unreachable")
KEEPALIVE_EXPIRY_S = 2.0
INFO_TIMEOUT_S = 5.0             # how long a decode server may take to answer /v1/models

def _headers(request: Request) -> dict[str, str]:
    return {k: v for k, v in request.headers.items() if k.lower() in FORWARD_HEADERS}


def build_proxy_app(prefill: Sequence[str], decode: Sequence[str], client: httpx.AsyncClient | None = None,
                    max_request_bytes: int = 4 << 20, prefill_vllm: Sequence[str] = (), kv_secret: str | None = None,
                    vllm_lease_s: float = 30.0, prefill_timeout_s: float | None = None,
                    decode_timeout_s: float | None = None, upstream_tls: ssl.SSLContext | None = None) -> FastAPI:
    """`upstream_tls`: the context every request to an `https://` server is made with (`proxy_tls`: the CA
    bundle its certificate is checked against, the proxy's client certificate); None: the system's CAs, no
    client certificate.
    `prefill_timeout_s`: how long one prefill server may take to answer before the next one is tried
    (None: no limit; a stopped or wedged prefill server otherwise holds its requests forever).
    `decode_timeout_s`: how long the decode server may take to start its answer (its response headers: a
    stream's first bytes, a non-streaming request's whole answer) before the client gets a 504 and the
    prefill's lease is released (None: no limit). It is not retried elsewhere: the decode server may have
    read the KV already."""
    for name, t in (("prefill", prefill_timeout_s), ("decode", decode_timeout_s)):
        if t is not None and not t > 0:
            raise ValueError(f"--{name}-timeout-s must be > 0 (got {t})")
    if prefill and prefill_vllm:
        raise ValueError("give gigadecode prefill servers (--prefill) or vLLM ones (--prefill-vllm), not both")
    vllm = bool(prefill_vllm)
    key = None
    if vllm:
        from ..connector.params import check_secret
        from ..connector.vllm_handshake import AnsweringProcess
        key = check_secret(kv_secret, "kv_consumer")
        processes = AnsweringProcess()              # which vLLM process answered each prefill
    prefills, decodes = Pool("prefill", prefill or prefill_vllm), Pool("decode", decode)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        own = client is None
        app.state.client = client or httpx.AsyncClient(
            # https:// servers checked against --upstream-ssl-ca-certs, else the system's CAs (OpenSSL's default
            # paths, which honour SSL_CERT_FILE / SSL_CERT_DIR), where a deployment installs its own CA; httpx's
            # default is certifi's bundle, which holds no private CA. This client sends every upstream request.
            verify=upstream_tls or ssl.create_default_context(),
            timeout=httpx.Timeout(None, connect=CONNECT_TIMEOUT_S),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256,
                                keepalive_expiry=KEEPALIVE_EXPIRY_S))
        probe = asyncio.get_running_loop().create_task(probe_servers(app.state.client, (prefills, decodes)))
        try:
            yield
        finally:
            probe.cancel()
            # releases still on their way (streams that ended early) finish before the client closes under
            # them: each is bounded by RELEASE_TIMEOUT_S, and one cut off leaves its lease to run out
            pending = [t for t in background if t.get_loop() is asyncio.get_running_loop()]
            await asyncio.wait([probe, *pending], timeout=RELEASE_TIMEOUT_S + 1)
            if own:
                await app.state.client.aclose()

    app = FastAPI(title="gigadecode proxy", lifespan=lifespan)
    app.add_middleware(BodyLimit, max_bytes=max_request_bytes)
    answer_clients_that_leave(app)              # a client gone before its body was read: not a 500
    app.state.prefills, app.state.decodes = prefills, decodes

    async def do_prefill(http: httpx.AsyncClient, path: str, body: dict[str, Any], headers: dict[str, str],
                         leased: dict[str, Any]) -> httpx.Response | JSONResponse:
        pbody = {**body, "max_tokens": 1, "n": 1, "stream": False, "kv_transfer_params": {"do_remote_decode": True}}
        if "max_completion_tokens" in body or path.endswith("/chat/completions"):
            pbody["max_completion_tokens"] = 1
        if path == "/v1/responses":
            pbody["max_output_tokens"] = 1
        pbody.pop("stream_options", None)
        if isinstance(body.get("min_tokens"), int):        # the decode server applies it; the prefill makes 1
            pbody["min_tokens"] = min(body["min_tokens"], 1)
        return await post_prefill(http, path, pbody, headers, leased)

    async def post_prefill(http: httpx.AsyncClient, path: str, pbody: dict[str, Any], headers: dict[str, str],
                           leased: dict[str, Any] | None = None) -> httpx.Response | JSONResponse:
        """`leased` (gigadecode prefill servers): holds each attempt's name and release URL while it runs, for
        `release_lease` should the client leave meanwhile."""
        tried: list[Upstream] = []
        last = "no prefill server"
        keys = prefix_keys(pbody)                  # the prefill server that holds the prompt's prefix, if any
        while (up := prefills.pick(tried, keys)) is not None:
            tried.append(up)
            up.in_flight += 1
            attempt = headers
            if leased is not None:
                leased.update(handoff=uuid.uuid4().hex, url=up.url + "/kv/release")
                attempt = {**headers, HANDOFF_HEADER: leased["handoff"]}
            try:
                r = await http.post(up.url + path, json=pbody, headers=attempt, timeout=httpx.Timeout(
                    prefill_timeout_s, connect=CONNECT_TIMEOUT_S))
            except httpx.TransportError as e:   # (a TimeoutException is one)
                last = (f"prefill server {up.url} did not answer within {prefill_timeout_s} s"
                        if isinstance(e, httpx.TimeoutException) else
                        f"prefill server {up.url} unreachable: {failure(e, up.url)}")
                log.warning(last)
                prefills.mark_down(up, last)
                if leased is not None:          # it may answer late, or have answered before the connection
                    if not isinstance(e, httpx.ConnectError):    # broke: end that request (this attempt's name)
                        in_background(release_lease(http, dict(leased), headers))
                    leased.clear()
                continue
            finally:
                up.in_flight -= 1
            if leased is not None:              # answered: what it leased (if anything) is in its answer,
                leased.clear()                  # released at this server's /kv/release (under its path prefix)
                leased["url"] = up.url + "/kv/release"
            prefills.mark_up(up)
            if r.status_code >= 500:
                last = f"prefill server {up.url} answered {r.status_code}: {r.text[:500]}"
                log.warning(last)
                continue
            return r
        return proxy_error(502, f"every prefill server failed; last: {last}", code="prefill_failed")

    async def handle(request: Request, path: str) -> Response:
        try:
            body = load_object(await request.body())
        except BodyError as e:
            return proxy_error(400, str(e), "invalid_request_error", "invalid_json")
        prompts = body.get("prompt")
        if (isinstance(prompts, list) and len(prompts) > 1
                and all(isinstance(p, (str, list)) for p in prompts)):
            return proxy_error(400, f"the DI proxy serves one prompt a request (got {len(prompts)}): send each as its "
                               f"own request", "invalid_request_error", "invalid_prompt")
        http: httpx.AsyncClient = app.state.client
        headers = _headers(request)

        # the prefill's params and its release URL until the decode has them (while it runs: its name, `handoff`)
        leased: dict[str, Any] = {}

        async def prepare_decode() -> httpx.Response | Response:
            if vllm:
                return await vllm_prefill(http, path, body, headers)
            pr = await do_prefill(http, path, body, headers, leased)
            if not isinstance(pr, httpx.Response):
                return pr
            if pr.status_code >= 400:       # the client's mistake: answer it as the prefill did
                return Response(pr.content, status_code=pr.status_code,
                                media_type=pr.headers.get("content-type", "application/json"))
            try:
                kv = pr.json().get("kv_transfer_params")
            except (ValueError, AttributeError):
                return proxy_error(502, f"prefill server answered a body that is not a JSON object: {pr.text[:200]}",
                              code="prefill_failed")
            dbody = dict(body)
            if kv is not None:
                dbody["kv_transfer_params"] = kv
                leased["kv"] = kv               # (post_prefill left the answering server's release URL)
            else:
                dbody.pop("kv_transfer_params", None)
            return dbody

        stream = body.get("stream") is True
        if not stream:
            try:
                r = await unless_disconnected(request, decode_whole(http, decodes, path, headers, prepare_decode,
                                                                    decode_timeout_s, reread_safe=not vllm))
            except ClientGone:
                await release_lease(http, leased, headers)
                return Response(status_code=CLIENT_CLOSED)
            if r.status_code >= 400:           # the decode side refused or failed: it will not read the KV
                await release_lease(http, leased, headers)
            return r

        # streaming: prefill (watching for disconnect), then relay the decode server's stream
        try:
            dbody = await unless_disconnected(request, prepare_decode())
        except ClientGone:
            await release_lease(http, leased, headers)
            return Response(status_code=CLIENT_CLOSED)
        if isinstance(dbody, Response):
            return dbody
        return await decode_stream(http, decodes, request, path, headers, dbody,
                                   lambda: release_lease(http, leased, headers), decode_timeout_s,
                                   reread_safe=not vllm)

    async def vllm_prefill(http: httpx.AsyncClient, path: str, body: dict[str, Any], headers: dict[str, str]
                           ) -> dict[str, Any] | Response:
        """The vLLM prefill of `body` -> the decode server's body (the prompt's ids, signed params)."""
        from ..connector.base import HandshakeError
        from ..connector.params import prompt_digest, sign
        from ..connector.vllm_handshake import ProducerRestarted, from_vllm_answer
        if path != "/v1/completions":
            return proxy_error(400, "behind a vLLM prefill the proxy serves /v1/completions only (send the chat "
                               "template's token ids as the prompt)", "invalid_request_error", "unsupported")
        ids = body.get("prompt")
        if isinstance(ids, str):
            up = decodes.pick()
            try:
                r = await http.post(up.url + "/tokenize", json={"prompt": ids}, headers=headers)
            except httpx.TransportError as e:
                return proxy_error(502, f"decode server {up.url} unreachable to tokenize: {failure(e, up.url)}",
                              code="decode_failed")
            if r.status_code != 200:
                return Response(r.content, status_code=r.status_code, media_type="application/json")
            ids = r.json()["tokens"]
        if not (isinstance(ids, list) and ids and all(isinstance(t, int) and not isinstance(t, bool) for t in ids)):
            return proxy_error(400, "behind a vLLM prefill a request has one prompt: a string or a list of token ids",
                               "invalid_request_error", "invalid_prompt")
        cut = body.get("truncate_prompt_tokens")      # vLLM's: the decode server keeps the last N tokens, so the
        if isinstance(cut, int) and not isinstance(cut, bool) and cut >= 1:   # KV must be the same N tokens'
            ids = ids[-cut:]
        dbody = {**body, "prompt": ids}
        dbody.pop("kv_transfer_params", None)
        if len(ids) < 2:                               # nothing to prefill remotely
            return dbody
        pbody = {"model": body.get("model"), "prompt": ids[:-1], "max_tokens": 1, "temperature": 0.0, "stream": False,
                 "kv_transfer_params": {"do_remote_decode": True}}
        if body.get("priority") is not None:           # its place in the prefill's queue too (vLLM's field)
            pbody["priority"] = body["priority"]
        for again in (False, True):
            seen = processes.seen()                   # the vLLM processes known before this prefill
            pr = await post_prefill(http, path, pbody, headers)
            answered = time.monotonic()
            if not isinstance(pr, httpx.Response):
                return pr
            if pr.status_code >= 400:
                return Response(pr.content, status_code=pr.status_code,
                                media_type=pr.headers.get("content-type", "application/json"))
            try:
                params = from_vllm_answer(pr.json().get("kv_transfer_params"), vllm_lease_s)
                params = params.model_copy(update={"producer_process": await processes.of(params, seen, answered)})
            except ProducerRestarted as e:            # once: the next prefill's answer is one the probe can place
                if again:
                    return proxy_error(502, f"the vLLM prefill's answer cannot be used: {e}", code="prefill_failed")
                log.warning("%s; prefilling again", e)
                continue
            except (ValueError, AttributeError, HandshakeError) as e:
                return proxy_error(502, f"the vLLM prefill's answer cannot be used: {e}", code="prefill_failed")
            dbody["kv_transfer_params"] = sign(params.model_copy(update={"prompt_digest": prompt_digest(ids)}),
                                               key).to_dict()
            return dbody

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await handle(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await handle(request, "/v1/chat/completions")

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        return await handle(request, "/v1/responses")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        http: httpx.AsyncClient = app.state.client
        last = "no decode server"
        for up in sorted(decodes.servers, key=lambda s: s.down is not None):     # those in rotation first
            try:
                r = await http.get(up.url + "/v1/models", headers=_headers(request), timeout=INFO_TIMEOUT_S)
            except httpx.TransportError as e:     # a wedged one too: the next answers (it hung the route)
                last = f"{up.url}: {failure(e, up.url)}"
                decodes.mark_down(up, f"/v1/models: {last}")
                continue
            return Response(r.content, status_code=r.status_code,
                            media_type=r.headers.get("content-type", "application/json"))
        return proxy_error(502, f"no decode server answered: {last}")

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(metrics_text((prefills, decodes)), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/health")
    async def health() -> JSONResponse:
        status, body = health_report((prefills, decodes))
        return JSONResponse(body, status_code=status)

    return app


def run_proxy(args: Any) -> int:
    import uvicorn
    vllm = getattr(args, "prefill_vllm", None) or []
    if not args.prefill and not vllm:
        raise ValueError("give the prefill servers: --prefill URL ... (gigadecode) or --prefill-vllm URL ... (vLLM)")
    check_http_options(args)
    upstream_tls = upstream_tls_context(args)
    warn_if_unused(args, [*args.prefill, *vllm, *args.decode])
    app = build_proxy_app(args.prefill, args.decode, max_request_bytes=getattr(args, "max_request_bytes", 4 << 20),
                          prefill_vllm=vllm, kv_secret=getattr(args, "kv_secret", None),
                          vllm_lease_s=getattr(args, "vllm_kv_lease_s", 30.0),
                          prefill_timeout_s=getattr(args, "prefill_timeout_s", None),
                          decode_timeout_s=getattr(args, "decode_timeout_s", None), upstream_tls=upstream_tls)
    add_cors(app, args)
    print(f"gigadecode proxy: prefill {args.prefill or vllm}{' (vLLM)' if vllm else ''} -> decode {args.decode}; listening on "
          f"{scheme(args)}://{args.host}:{args.port}{uvicorn_options(args)['root_path']}", flush=True)
    freeze_startup_heap()
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=args.access_log,
                timeout_graceful_shutdown=5, **uvicorn_options(args))
    return 0
