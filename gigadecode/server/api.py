"""The OpenAI-compatible HTTP API over one `AsyncEngine` (FastAPI), and `gigadecode serve`.

The server is split as vLLM's entrypoints are: `protocol` (request bodies, errors, sampling fields),
`outputs` (choices, stop strings, logprobs, the submit / stream loop), `completions`, `chat` (chat
template + harmony), `admin` (health, metrics, models, KV handshake), `deps` (settings, engine, API key);
this module assembles the app and runs `serve`.

Routes
  POST /v1/completions        prompt: str | [ids] | [str, …] | [[ids], …] (n choices per prompt), raw text out
  POST /v1/chat/completions   messages -> the checkpoint's chat template; harmony channels -> reasoning,
                              content, tool_calls
  GET  /v1/models             the served model (id = --served-model-name, default the model dir's name)
  GET  /health                200 while the engine thread runs, else 503
  GET  /metrics               Prometheus text (see engine_metrics.EngineMetrics, vllm_metrics)
  GET  /kv/handshake          the KV connector's handshake (DI; needs the KV secret), 404 without a connector
  POST /kv/release            a prefill ends the lease of params it answered (the router: never to be read)

Request fields beyond OpenAI's (vLLM's names): top_k, min_p, seed, min_tokens, ignore_eos,
repetition_penalty, stop_token_ids, return_token_ids (each choice then carries `token_ids`, plus
`prompt_token_ids`: a stream sends them in each choice's first chunk), include_reasoning, allowed_token_ids,
bad_words, truncate_prompt_tokens, include_stop_str_in_output and (completions) skip_special_tokens (`extras`),
priority (passed to `engine.add_request`: --scheduling-policy priority; under fcfs only 0), and
kv_transfer_params (passed to `engine.add_request`; a finished request's `kv_transfer_params_out` comes back as
the body's top-level `kv_transfer_params`, in the last chunk when streaming). OpenAI's `stop`, `n`, `logit_bias`,
`tools`, `tool_choice` (auto | none | required | a named function) and
`reasoning_effort` are supported; the checkpoint's generation_config.json fills sampling fields a request
leaves unset. Streaming is SSE in OpenAI's chunk format, ending with `data: [DONE]`.

Errors use OpenAI's shape `{"error": {"message", "type", "param", "code"}}`: 400 for malformed JSON,
missing / invalid / unsupported fields (param = the field), prompts longer than the context; 401 for a
wrong API key (when one is set); 403 for a KV handshake without the key; 404 for an unknown model or
route; 413 for a body over --max-request-bytes; 500 for a request the engine failed (e.g. a failed KV
transfer: `Request.error`), sent as an SSE error event mid-stream. A client that disconnects (streaming or
not) aborts its request, which frees its KV.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from . import admin, chat, completions, responses, tokens
from .async_engine import AsyncEngine
from .body import BodyLimit
from .deps import ServerSettings
from .disconnect import answer_clients_that_leave
from .gc_heap import freeze_startup_heap
from .http_options import add_cors, check_http_options, scheme, uvicorn_options
from .protocol import APIError, error_body, error_response, validation_error

log = logging.getLogger("gigadecode.server")

#: --role -> EngineConfig.kv_role
ROLES = {"prefill": "kv_producer", "decode": "kv_consumer", "both": "kv_both"}
DEFAULT_MAX_REQUEST_BYTES = 4 << 20         # --max-request-bytes


def build_app(engine: AsyncEngine | Callable[[], AsyncEngine], served_model_name: str | Sequence[str],
              api_key: str | None = None, role: str = "both", kv_advertise_host: str | None = None,
              max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, lease_drain_s: float = 0.0) -> FastAPI:
    """The FastAPI app. `engine` is an AsyncEngine or a zero-argument factory called at startup; the
    app's lifespan starts its thread and stops it at shutdown. A prefill server's answers tell decode
    engines to reach its KV side channel at `kv_advertise_host` (default: the address each request
    reached this server on). Bodies over `max_request_bytes` get 413 before they are parsed.
    `served_model_name`: the model's name, or several (vLLM's aliases): requests may name any, and
    are answered under the name they gave (the first when they give none). `lease_drain_s`: at shutdown, how long
    a prefill server keeps its engine (and its KV side channel) up for the decode servers to read the KV it
    leased, once its HTTP requests are done (`AsyncEngine.drain_leases`; 0: it stops at once)."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {sorted(ROLES)} (got {role!r})")

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        aeng = engine if hasattr(engine, "submit") else engine()
        app.state.engine = aeng
        aeng.start()
        try:
            yield
        finally:
            if lease_drain_s > 0 and role == "prefill":
                left = await aeng.drain_leases(lease_drain_s)
                if left:
                    log.warning("shutting down with %d prefills' KV not read by a decode server (their requests "
                                "fail there)", left)
            aeng.stop()

    app = FastAPI(title="gigadecode", lifespan=lifespan)
    app.add_middleware(BodyLimit, max_bytes=max_request_bytes)
    app.state.engine = engine if hasattr(engine, "submit") else None
    names = (served_model_name,) if isinstance(served_model_name, str) else tuple(served_model_name)
    if not names or not all(isinstance(n, str) and n for n in names):
        raise ValueError(f"served model names must be non-empty strings (got {served_model_name!r})")
    app.state.settings = ServerSettings(names[0], api_key or None, role, kv_advertise_host, aliases=names[1:])

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        return error_response(e)

    @app.exception_handler(RequestValidationError)
    async def _req_validation(request: Request, e: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(e.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if e.status_code < 500 else "server_error"
        return JSONResponse(error_body(str(e.detail), kind), status_code=e.status_code)

    answer_clients_that_leave(app)                # a client gone before its body was read: not a 500

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception) -> JSONResponse:
        log.exception("unhandled error in %s", request.url.path)
        return JSONResponse(error_body(f"internal error: {type(e).__name__}: {e}", "server_error"),
                            status_code=500)

    for module in (admin, completions, chat, responses, tokens):
        app.include_router(module.router)
    return app


# --------------------------------------------------------------------------------------------------
# `gigadecode serve`
# --------------------------------------------------------------------------------------------------
def engine_from_args(args: Any, role: str) -> Any:
    """The engine behind `serve`: kv_both alone; prefill/decode with a NIXL KV connector keyed with
    --kv-secret (a producer serves its handshake on `--host`:`--kv-port`, 0 = any free port)."""
    from ..engine_config import engine_config_from_args as engine_config
    from ..engine import build_engine
    ecfg = engine_config(args, kv_role=ROLES[role])
    return build_engine(args.model, ecfg, host=args.host, advertise_host=getattr(args, "kv_advertise_host", None),
                        side_port=getattr(args, "kv_port", 0) or 0, progress=False)


def serve(args: Any) -> int:
    """`gigadecode serve`. With --tp/--dp/--ep (under torchrun) every rank builds its engine replica; rank 0
    serves HTTP in front of the parallel engine and the other ranks follow its steps."""
    from ..parallel.engine import is_parallel
    from ..engine_config import engine_config_from_args as engine_config
    from ..connector.params import check_secret
    if args.role != "both":
        check_secret(getattr(args, "kv_secret", None), ROLES[args.role])     # before loading anything
    if getattr(args, "max_request_bytes", 1) < 1:
        raise ValueError(f"--max-request-bytes must be >= 1 (got {args.max_request_bytes})")
    if not getattr(args, "shutdown_timeout_s", 1.0) >= 0:
        raise ValueError(f"--shutdown-timeout-s must be >= 0 (got {args.shutdown_timeout_s})")
    if serves_http():                                   # another node's ranks need not hold its certificate files
        check_http_options(args)
    stall = getattr(args, "engine_stall_timeout_s", 0.0)
    if not (stall == 0 or 1 <= stall < float("inf")):       # nan, inf and a few ms (every step) refused
        raise ValueError(f"--engine-stall-timeout-s must be 0 (off) or >= 1 and finite (got {stall})")
    if is_parallel(engine_config(args)):
        return _serve_parallel(args)
    t0 = time.perf_counter()
    sock = listen_socket(args.host, args.port)          # a taken port is said now, not after the model loads
    return _serve_engine(args, engine_from_args(args, args.role), t0, sock)


def serves_http() -> bool:
    """Whether this process serves HTTP: world rank 0 (torchrun sets RANK; a lone process is rank 0)."""
    return os.environ.get("RANK", "0") == "0"


def listen_socket(host: str, port: int) -> socket.socket:
    """The API's socket, bound before the model loads (as vLLM binds its own), so an address that is taken,
    not this machine's or does not resolve is a one-line error at once instead of after minutes of loading.
    uvicorn listens on it. The address family is the one uvicorn's own bind took: IPv6 for a host with a ':',
    else IPv4 ('' too: every interface)."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET     # uvicorn's choice: IPv4 unless an IPv6
        family, kind, proto, _, addr = socket.getaddrinfo(host or None, port, family, socket.SOCK_STREAM,   # address
                                                          flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(addr)
        except OSError:
            sock.close()
            raise
    except OSError as e:                                # socket.gaierror is one
        raise SystemExit(f"gigadecode serve: cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def _serve_engine(args: Any, engine: Any, t0: float, sock: socket.socket) -> int:
    import prometheus_client

    from ..tokenizer import TextCodec
    prometheus_client.disable_created_metrics()
    names = args.served_model_name or [Path(args.model).resolve().name]
    name = names[0]
    aeng = AsyncEngine(engine, codec=TextCodec.from_dir(args.model, getattr(args, "chat_template", None)), model_dir=str(args.model),
                       warm_up=not getattr(args, "no_warmup", False),
                       stall_timeout_s=getattr(args, "engine_stall_timeout_s", 0.0))
    app = build_app(aeng, names, api_key=args.api_key, role=args.role,
                    kv_advertise_host=getattr(args, "kv_advertise_host", None),
                    max_request_bytes=getattr(args, "max_request_bytes", DEFAULT_MAX_REQUEST_BYTES),
                    lease_drain_s=getattr(args, "shutdown_timeout_s", 5.0))
    add_cors(app, args)
    used, total = engine.kv_usage()
    layout = f"TP{args.tp} × DP{args.dp} × EP{args.ep}, " if getattr(engine, "ctx", None) is not None else ""
    print(f"gigadecode serve: model {name!r} ({layout}{args.role}, {total} KV blocks, context "
          f"{aeng.max_model_len}) loaded in {time.perf_counter() - t0:.1f}s; listening on "
          f"{scheme(args)}://{args.host}:{sock.getsockname()[1]}{uvicorn_options(args)['root_path']}", flush=True)
    grace = getattr(args, "shutdown_timeout_s", 5.0)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            access_log=args.access_log, timeout_graceful_shutdown=grace + 2.0,
                            **uvicorn_options(args))
    server = DrainingServer(config, aeng, grace)
    # an engine that can serve no more (a parallel rank failed) shuts the server down: the process exits with
    # the reason, and its end frees the other ranks (a health check would only see 503 while it lingered)
    aeng.on_dead = lambda why: setattr(server, "should_exit", True)
    freeze_startup_heap()
    try:
        server.run(sockets=[sock])
    finally:
        aeng.stop(timeout=None)          # the engine thread has left its last step before anything else runs
    if not server.started:
        raise SystemExit(f"gigadecode serve: the server on {args.host}:{args.port} did not start (see the log above)")
    if aeng.dead is not None:
        raise SystemExit(f"gigadecode serve: the engine stopped: {aeng.dead}")
    return 0


class DrainingServer(uvicorn.Server):
    """uvicorn's server, shut down the way a client should see it: on SIGTERM / SIGINT it stops accepting,
    lets requests in flight run for `grace` seconds, then stops the engine, which ends every request still
    open with "the server is shutting down" (a 503, or an error event and [DONE] in a stream) while uvicorn
    still waits for the responses, instead of uvicorn cutting the connections when its own wait is over. A
    prefill server then keeps the KV it leased for its decode servers' reads for up to `grace` more
    (`build_app`'s `lease_drain_s`)."""

    def __init__(self, config: uvicorn.Config, aeng: AsyncEngine, grace: float) -> None:
        super().__init__(config)
        self.aeng, self.grace = aeng, grace

    async def shutdown(self, sockets: Any = None) -> None:
        timer = asyncio.get_running_loop().call_later(self.grace, self._end_open_requests)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()

    def _end_open_requests(self) -> None:
        """The grace is over: stop the engine if HTTP requests are still open (they end with "shutting down").
        Once they are all done, the lifespan's lease drain is running under its own bound: left alone."""
        if self.server_state.connections or self.server_state.tasks:
            self.aeng.stop(timeout=0)


def _serve_parallel(args: Any) -> int:
    import torch.distributed as dist

    from ..engine_config import engine_config_from_args as engine_config
    from ..parallel.engine import DistributedEngine, build_parallel_engine, run_worker
    ecfg = engine_config(args, kv_role=ROLES[args.role])
    if "WORLD_SIZE" not in os.environ:
        n = ecfg.tp * ecfg.dp
        raise SystemExit(f"gigadecode serve: --tp {ecfg.tp} × --dp {ecfg.dp} needs {n} ranks: start it with "
                         f"torchrun --nproc-per-node {n} -m gigadecode serve …")
    t0 = time.perf_counter()
    sock = listen_socket(args.host, args.port) if serves_http() else None   # bound before any rank loads
    replica, ctx = build_parallel_engine(args.model, ecfg, host=args.host,
                                         advertise_host=getattr(args, "kv_advertise_host", None),
                                         side_port=getattr(args, "kv_port", 0) or 0)
    try:
        # torchrun signals every rank at once on SIGTERM/SIGINT. The other ranks stay until rank 0 has shut the
        # server down and says stop (or leave when rank 0 is gone and their collective fails); rank 0 lets
        # uvicorn shut down gracefully, and the signal uvicorn re-raises afterwards must not kill it before
        # it has told the others.
        import signal
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN if ctx.rank != 0 else lambda *_: None)
        if ctx.rank != 0:
            freeze_startup_heap()            # a full collection here would hold up every rank's collectives
            run_worker(replica, ctx)
            return 0
        with DistributedEngine(replica, ctx) as engine:
            return _serve_engine(args, engine, t0, sock)
    finally:
        dist.destroy_process_group()
