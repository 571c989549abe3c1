"""The OpenAI-compatible HTTP API over one `AsyncEngine` (FastAPI), and `gigadecode serve`.

Routes
  POST /v1/completions        prompt: str | [ids] | [str, …] | [[ids], …] (one choice per prompt)
  POST /v1/chat/completions   messages -> the tokenizer's chat template
  GET  /v1/models             the served model (id = --served-model-name, default the model dir's name)
  GET  /health                200 while the engine thread runs, else 503
  GET  /metrics               Prometheus text (see async_engine.EngineMetrics)
  GET  /kv/handshake          the KV connector's handshake (DI), 404 when the engine has none

Request fields beyond OpenAI's (vLLM's names): top_k, min_p, seed, min_tokens, ignore_eos,
repetition_penalty, stop_token_ids, return_token_ids (each choice then carries `token_ids`, plus
`prompt_token_ids`) and kv_transfer_params (passed to `engine.add_request`; a finished request's
`kv_transfer_params_out` comes back as the body's top-level `kv_transfer_params`, in the last chunk
when streaming). Streaming is SSE in OpenAI's chunk format, ending with `data: [DONE]`.

Errors use OpenAI's shape `{"error": {"message", "type", "param", "code"}}`: 400 for malformed JSON,
missing / invalid fields, invalid sampling values (param = the field), prompts longer than the context;
401 for a wrong API key (when one is set); 404 for an unknown model or route; 500 for a request the
engine failed (e.g. a failed KV transfer: `Request.error`), sent as an SSE error event mid-stream.
A client that disconnects (streaming or not) aborts its request, which frees its KV.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field, is_dataclass
from pathlib import Path
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..connector.params import AUTH_HEADER, KVTransferParams, check_handshake_token
from ..sampling import MAX_LOGPROBS, SamplingError, SamplingParams
from .async_engine import AsyncEngine, EngineDeadError, RequestStream
from .body import BodyError, BodyLimit, load_object

log = logging.getLogger("gigadecode.server")

#: --role -> EngineConfig.kv_role
ROLES = {"prefill": "kv_producer", "decode": "kv_consumer", "both": "kv_both"}
#: sampling fields read from the body as they are (SamplingParams checks types and ranges)
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "seed", "min_tokens", "ignore_eos",
                 "stop_token_ids", "repetition_penalty", "presence_penalty", "frequency_penalty")
DEFAULT_COMPLETION_MAX_TOKENS = 16          # OpenAI's default for /v1/completions
LOGPROB_FLOOR = -9999.0                     # JSON has no -inf
DISCONNECT_POLL_S = 0.2
DEFAULT_MAX_REQUEST_BYTES = 4 << 20         # --max-request-bytes


# --------------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------------
class APIError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


def _validation_error(errors: Sequence[dict[str, Any]]) -> APIError:
    err = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    loc = [str(p) for p in err.get("loc", ()) if p not in ("body",)]
    if err.get("type") == "json_invalid":
        return APIError(400, f"malformed JSON body: {err.get('msg')}", code="invalid_json")
    param = ".".join(loc) or None
    return APIError(400, f"{param}: {err.get('msg')}" if param else str(err.get("msg")), param=param)


def _engine_error(e: BaseException, prompt_param: str) -> APIError:
    """`AsyncEngine.submit`'s exception -> the HTTP error."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, SamplingError):
        return APIError(400, str(e), param=e.param)
    if isinstance(e, EngineDeadError):
        return APIError(503, str(e), type="server_error", code="engine_unavailable")
    if isinstance(e, ValueError):          # RequestError and other refusals of add_request
        msg = str(e)
        param = getattr(e, "param", None) or (prompt_param if msg.startswith("prompt") else
                                              ("kv_transfer_params" if "kv_transfer" in msg else None))
        code = "context_length_exceeded" if "context" in msg else None
        if param is not None and param.startswith("kv_transfer_params"):
            code = "invalid_kv_transfer_params"
        return APIError(400, msg, param=param, code=code)
    return APIError(500, f"the engine refused the request: {type(e).__name__}: {e}", type="server_error")


# --------------------------------------------------------------------------------------------------
# Request bodies (structure only: sampling values are checked by SamplingParams)
# --------------------------------------------------------------------------------------------------
class _Model(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Model):
    include_usage: StrictBool | None = False


class _Body(_Model):
    model: StrictStr | None = None
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    n: StrictInt | None = 1
    stop: StrictStr | list[StrictStr] | None = None
    return_token_ids: StrictBool | None = False
    kv_transfer_params: KVTransferParams | None = None


class CompletionBody(_Body):
    prompt: StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]]
    echo: StrictBool | None = False
    suffix: StrictStr | None = None
    best_of: StrictInt | None = None


class ContentPart(_Model):
    type: StrictStr
    text: StrictStr | None = None


class ChatMessage(_Model):
    role: StrictStr
    content: StrictStr | list[ContentPart] | None = None


class ChatBody(_Body):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: StrictBool | None = False
    top_logprobs: StrictInt | None = None
    add_generation_prompt: StrictBool | None = True


async def _read_json(request: Request) -> dict[str, Any]:
    try:
        return load_object(await request.body())
    except BodyError as e:
        raise APIError(400, str(e), code="invalid_json") from None


def _parse(model: type[BaseModel], body: dict[str, Any]) -> Any:
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise _validation_error(e.errors()) from None


def _unsupported(req: _Body) -> None:
    if req.n not in (None, 1):
        raise APIError(400, "only n=1 is supported", param="n")
    if req.stop:
        raise APIError(400, "stop strings are not supported; use stop_token_ids", param="stop")


def _sampling(raw: dict[str, Any], max_tokens: Any, logprobs: int | None) -> SamplingParams:
    d = {k: raw[k] for k in SAMPLING_KEYS if k in raw}
    d["max_tokens"] = max_tokens
    d["logprobs"] = logprobs
    try:
        return SamplingParams.from_dict(d)
    except SamplingError as e:
        raise APIError(400, str(e), param=e.param) from None


# --------------------------------------------------------------------------------------------------
# Output assembly
# --------------------------------------------------------------------------------------------------
def _tok_text(codec: Any, token_id: int) -> str:
    return codec.decode([token_id], skip_special_tokens=False) if codec is not None else f"token_id:{token_id}"


def _lp(v: float) -> float:
    return max(float(v), LOGPROB_FLOOR)


@dataclass
class _Choice:
    """One prompt's request and what it produced so far."""

    index: int
    stream: RequestStream
    prompt_ids: list[int]
    decoder: Any = None                                  # StreamDecoder when the model has a tokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Any] = field(default_factory=list)     # TokenLogprobs
    finish_reason: str | None = None
    error: str | None = None
    kv_transfer_params: dict | None = None
    text_offset: int = 0

    def absorb(self, out: Any) -> None:
        self.token_ids.extend(out.new_token_ids)
        self.logprobs.extend(out.new_logprobs or ())
        if out.finished:
            self.finish_reason = out.finish_reason
            self.error = out.error
            self.kv_transfer_params = getattr(out, "kv_transfer_params", None)

    def delta_text(self, out: Any) -> str:
        if self.decoder is None:
            return ""
        text = "".join(self.decoder.push(t) for t in out.new_token_ids)
        return text + self.decoder.flush() if out.finished else text


def completion_logprobs(codec: Any, lps: Sequence[Any], offset: int = 0) -> dict[str, Any]:
    """OpenAI's legacy completions logprobs object."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for lp in lps:
        s = _tok_text(codec, lp.token_id)
        top = {_tok_text(codec, t): _lp(v) for t, v in lp.top}
        top.setdefault(s, _lp(lp.logprob))
        tokens.append(s)
        token_lps.append(_lp(lp.logprob))
        tops.append(top)
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(codec: Any, lps: Sequence[Any]) -> dict[str, Any]:
    """OpenAI's chat logprobs object."""
    def entry(t: int, v: float) -> dict[str, Any]:
        s = _tok_text(codec, t)
        return {"token": s, "logprob": _lp(v), "bytes": list(s.encode("utf-8"))}
    return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                        for lp in lps]}


def _usage(choices: Sequence[_Choice]) -> dict[str, int]:
    p = sum(len(c.prompt_ids) for c in choices)
    g = sum(len(c.token_ids) for c in choices)
    return {"prompt_tokens": p, "completion_tokens": g, "total_tokens": p + g}


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'), ensure_ascii=False)}\n\n"


async def _merge(streams: Sequence[RequestStream]) -> AsyncIterator[tuple[int, Any]]:
    """(choice index, RequestOutput) from several streams as they come; closing it aborts them all."""
    if len(streams) == 1:
        try:
            async for out in streams[0]:
                yield 0, out
        finally:
            streams[0].close()
        return
    q: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, s: RequestStream) -> None:
        try:
            async for out in s:
                q.put_nowait((i, out))
        except Exception as e:  # noqa: BLE001 - re-raised by the consumer
            q.put_nowait((i, e))
        finally:
            q.put_nowait((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(streams)
        while left:
            i, item = await q.get()
            if item is None:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for s in streams:
            s.close()
        for t in tasks:
            t.cancel()


async def _unless_disconnected(request: Request, coro: Any) -> Any:
    """Await coro; cancel it (aborting its requests) when the client goes away first."""
    task = asyncio.ensure_future(coro)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                raise _ClientGone()
    finally:
        if not task.done():
            task.cancel()


class _ClientGone(Exception):
    pass


# --------------------------------------------------------------------------------------------------
# The app
# --------------------------------------------------------------------------------------------------
def build_app(engine: AsyncEngine | Callable[[], AsyncEngine], served_model_name: str,
              api_key: str | None = None, role: str = "both", kv_advertise_host: str | None = None,
              max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> FastAPI:
    """The FastAPI app. `engine` is an AsyncEngine or a zero-argument factory called at startup; the
    app's lifespan starts its thread and stops it at shutdown. A prefill server's answers tell decode
    engines to reach its KV side channel at `kv_advertise_host` (default: the address each request
    reached this server on). Bodies over `max_request_bytes` get 413 before they are parsed."""
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
            aeng.stop()

    app = FastAPI(title="gigadecode", lifespan=lifespan)
    app.add_middleware(BodyLimit, max_bytes=max_request_bytes)
    app.state.engine = engine if hasattr(engine, "submit") else None
    created = int(time.time())

    def eng() -> AsyncEngine:
        aeng = app.state.engine
        if aeng is None:
            raise APIError(503, "the engine is starting", type="server_error", code="engine_unavailable")
        return aeng

    # -- error handlers ---------------------------------------------------------------------------
    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        return error_response(e)

    @app.exception_handler(RequestValidationError)
    async def _req_validation(request: Request, e: RequestValidationError) -> JSONResponse:
        return error_response(_validation_error(e.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if e.status_code < 500 else "server_error"
        return JSONResponse(error_body(str(e.detail), kind), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception) -> JSONResponse:
        log.exception("unhandled error in %s", request.url.path)
        return JSONResponse(error_body(f"internal error: {type(e).__name__}: {e}", "server_error"),
                            status_code=500)

    def check_key(request: Request) -> None:
        if not api_key:
            return
        auth = request.headers.get("authorization", "")
        if not secrets.compare_digest(auth.encode(), f"Bearer {api_key}".encode()):
            raise APIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                           code="invalid_api_key")

    auth = [Depends(check_key)]

    def check_model(req: _Body) -> None:
        if req.model is not None and req.model != served_model_name:
            raise APIError(404, f"the model `{req.model}` does not exist (this server serves "
                                f"`{served_model_name}`)", param="model", code="model_not_found")

    # -- info routes ------------------------------------------------------------------------------
    @app.get("/health")
    async def health() -> JSONResponse:
        aeng = app.state.engine
        if aeng is None or not aeng.is_running:
            return JSONResponse(error_body("the engine is not running", "server_error", code="engine_unavailable"),
                                status_code=503)
        return JSONResponse({"status": "ok", "role": role, "model": served_model_name})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(eng().metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=auth)
    async def models() -> JSONResponse:
        aeng = eng()
        return JSONResponse({"object": "list", "data": [{
            "id": served_model_name, "object": "model", "created": created, "owned_by": "gigadecode",
            "root": aeng.model_dir, "parent": None, "max_model_len": aeng.max_model_len}]})

    @app.get("/kv/handshake")
    async def kv_handshake(request: Request) -> JSONResponse:
        aeng = eng()
        conn = getattr(aeng.engine, "connector", None)
        if conn is None or not hasattr(conn, "handshake_info"):
            raise APIError(404, "this engine has no KV connector (no handshake to serve)", code="no_connector")
        key = getattr(getattr(conn, "inner", conn), "key", None)
        if key is None or not check_handshake_token(key, request.headers.get(AUTH_HEADER)):
            raise APIError(403, f"the KV handshake answers only a peer with this deployment's KV secret "
                                f"(a fresh token in {AUTH_HEADER})", type="permission_error", code="kv_auth")
        info = await aeng.call(lambda e: _jsonable(e.connector.handshake_info()))
        return JSONResponse(info)

    # -- generation -------------------------------------------------------------------------------
    async def start(request: Request, aeng: AsyncEngine, prompts: list[list[int]], params: SamplingParams,
                    prefix: str, kv: KVTransferParams | None, prompt_param: str) -> tuple[str, list[_Choice]]:
        if kv is not None and len(prompts) != 1:
            raise APIError(400, "kv_transfer_params needs exactly one prompt", param="kv_transfer_params")
        if kv is not None and kv.do_remote_decode:
            # where decode engines reach this prefill's side channel: the flag, else the address the client
            # reached this server on (never a host the client names)
            server = request.scope.get("server") or (None, None)
            kv = kv.model_copy(update={"remote_host": kv_advertise_host or server[0] or None})
        base = f"{prefix}-{uuid.uuid4().hex}"
        choices: list[_Choice] = []
        try:
            for i, ids in enumerate(prompts):
                rid = base if len(prompts) == 1 else f"{base}-{i}"
                try:
                    stream = await aeng.submit(ids, params, rid, kv)
                except Exception as e:  # noqa: BLE001 - mapped to an HTTP error
                    raise _engine_error(e, prompt_param) from None
                dec = None
                if aeng.codec is not None:
                    from ..tokenizer import StreamDecoder
                    dec = StreamDecoder(aeng.codec)
                choices.append(_Choice(i, stream, ids, dec))
        except BaseException:
            for c in choices:
                c.stream.close()
            raise
        return base, choices

    async def collect(choices: list[_Choice]) -> None:
        async for i, out in _merge([c.stream for c in choices]):
            choices[i].absorb(out)

    def final_error(choices: list[_Choice]) -> None:
        for c in choices:
            if c.error is not None:
                raise APIError(500, f"request failed: {c.error}", type="server_error", code="request_failed")
            if c.finish_reason == "abort":
                raise APIError(500, "request was aborted", type="server_error", code="request_aborted")

    async def run_to_end(request: Request, choices: list[_Choice]) -> Response | None:
        try:
            await _unless_disconnected(request, collect(choices))
        except _ClientGone:
            return Response(status_code=499)
        final_error(choices)
        return None

    async def stream_events(choices: list[_Choice], make_chunk: Callable[[_Choice, Any, str], dict[str, Any]],
                            first: list[dict[str, Any]], usage_chunk: dict[str, Any] | None) -> AsyncIterator[str]:
        try:
            for chunk in first:
                yield _sse(chunk)
            async for i, out in _merge([c.stream for c in choices]):
                c = choices[i]
                c.absorb(out)
                if out.finished and c.error is not None:
                    yield _sse(error_body(f"request failed: {c.error}", "server_error", code="request_failed"))
                    break
                yield _sse(make_chunk(c, out, c.delta_text(out)))
            else:
                if usage_chunk is not None:
                    yield _sse({**usage_chunk, "usage": _usage(choices)})
            yield "data: [DONE]\n\n"
        except (asyncio.CancelledError, GeneratorExit):
            raise
        except Exception as e:  # noqa: BLE001 - the stream already started: report in-band
            log.exception("stream failed")
            yield _sse(error_body(f"internal error: {type(e).__name__}: {e}", "server_error"))
            yield "data: [DONE]\n\n"
        finally:
            for c in choices:
                c.stream.close()

    def sse_response(gen: AsyncIterator[str]) -> StreamingResponse:
        return StreamingResponse(gen, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.post("/v1/completions", dependencies=auth)
    async def completions(request: Request) -> Response:
        raw = await _read_json(request)
        req: CompletionBody = _parse(CompletionBody, raw)
        check_model(req)
        _unsupported(req)
        if req.echo:
            raise APIError(400, "echo is not supported", param="echo")
        if req.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        if req.best_of not in (None, 1):
            raise APIError(400, "only best_of=1 is supported", param="best_of")
        aeng = eng()
        prompts = _completion_prompts(req.prompt, aeng.codec)
        params = _sampling(raw, raw.get("max_tokens", DEFAULT_COMPLETION_MAX_TOKENS), raw.get("logprobs"))
        rid, choices = await start(request, aeng, prompts, params, "cmpl", req.kv_transfer_params, "prompt")
        now, codec = int(time.time()), aeng.codec
        head = {"id": rid, "object": "text_completion", "created": now, "model": served_model_name}

        def choice_body(c: _Choice, text: str, lps: Sequence[Any], offset: int) -> dict[str, Any]:
            d: dict[str, Any] = {"index": c.index, "text": text,
                                 "logprobs": completion_logprobs(codec, lps, offset) if params.logprobs is not None
                                 else None, "finish_reason": c.finish_reason}
            return d

        if req.stream:
            def chunk(c: _Choice, out: Any, text: str) -> dict[str, Any]:
                d = choice_body(c, text, out.new_logprobs or (), c.text_offset)
                c.text_offset += len(text)
                if not out.finished:
                    d["finish_reason"] = None
                if req.return_token_ids:
                    d["token_ids"] = list(out.new_token_ids)
                body = {**head, "choices": [d]}
                if out.finished:
                    body["kv_transfer_params"] = c.kv_transfer_params
                return body
            usage = {**head, "choices": []} if req.stream_options and req.stream_options.include_usage else None
            return sse_response(stream_events(choices, chunk, [], usage))

        gone = await run_to_end(request, choices)
        if gone is not None:
            return gone
        out_choices = []
        for c in choices:
            text = codec.decode(c.token_ids) if codec is not None else ""
            d = choice_body(c, text, c.logprobs, 0)
            if req.return_token_ids:
                d["token_ids"] = c.token_ids
                d["prompt_token_ids"] = c.prompt_ids
            out_choices.append(d)
        return JSONResponse({**head, "choices": out_choices, "usage": _usage(choices),
                             "kv_transfer_params": choices[0].kv_transfer_params if len(choices) == 1 else None})

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat_completions(request: Request) -> Response:
        raw = await _read_json(request)
        req: ChatBody = _parse(ChatBody, raw)
        check_model(req)
        _unsupported(req)
        aeng = eng()
        codec = aeng.codec
        if codec is None:
            raise APIError(400, "this model has no tokenizer, so it cannot take chat messages; use "
                                "/v1/completions with token ids", param="messages")
        prompt = _chat_prompt(codec, req)
        if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_LOGPROBS:
            raise APIError(400, f"top_logprobs must be in [0, {MAX_LOGPROBS}] (got {req.top_logprobs})",
                           param="top_logprobs")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        max_tokens = raw.get("max_completion_tokens")
        if max_tokens is None:
            max_tokens = raw.get("max_tokens")
        if max_tokens is None:
            max_tokens = max(1, aeng.max_model_len - len(prompt))
        params = _sampling(raw, max_tokens, logprobs)
        rid, choices = await start(request, aeng, [prompt], params, "chatcmpl", req.kv_transfer_params, "messages")
        now = int(time.time())
        head = {"id": rid, "object": "chat.completion.chunk" if req.stream else "chat.completion",
                "created": now, "model": served_model_name}

        if req.stream:
            def chunk(c: _Choice, out: Any, text: str) -> dict[str, Any]:
                d: dict[str, Any] = {"index": c.index, "delta": {"content": text} if text or not out.finished else {},
                                     "logprobs": chat_logprobs(codec, out.new_logprobs or ())
                                     if params.logprobs is not None else None,
                                     "finish_reason": c.finish_reason if out.finished else None}
                if req.return_token_ids:
                    d["token_ids"] = list(out.new_token_ids)
                body = {**head, "choices": [d]}
                if out.finished:
                    body["kv_transfer_params"] = c.kv_transfer_params
                return body
            first = [{**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                           "logprobs": None, "finish_reason": None}]}]
            usage = {**head, "choices": []} if req.stream_options and req.stream_options.include_usage else None
            return sse_response(stream_events(choices, chunk, first, usage))

        gone = await run_to_end(request, choices)
        if gone is not None:
            return gone
        c = choices[0]
        d: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": codec.decode(c.token_ids)},
                             "logprobs": chat_logprobs(codec, c.logprobs) if params.logprobs is not None else None,
                             "finish_reason": c.finish_reason}
        body: dict[str, Any] = {**head, "choices": [d], "usage": _usage(choices),
                                "kv_transfer_params": c.kv_transfer_params}
        if req.return_token_ids:
            d["token_ids"] = c.token_ids
            body["prompt_token_ids"] = c.prompt_ids
        return JSONResponse(body)

    return app


def _completion_prompts(prompt: Any, codec: Any) -> list[list[int]]:
    """A completions `prompt` -> one token-id list per prompt."""
    def encode(text: str) -> list[int]:
        if codec is None:
            raise APIError(400, "this model has no tokenizer; send the prompt as token ids", param="prompt")
        try:
            return codec.encode(text)
        except Exception as e:  # noqa: BLE001 - text the tokenizer cannot take is the client's input
            raise APIError(400, f"the prompt cannot be tokenized: {type(e).__name__}: {e}", param="prompt") from None
    if isinstance(prompt, str):
        return [encode(prompt)]
    if not prompt or isinstance(prompt[0], int):
        return [list(prompt)]
    if isinstance(prompt[0], str):
        return [encode(p) for p in prompt]
    return [list(p) for p in prompt]


def _chat_prompt(codec: Any, req: ChatBody) -> list[int]:
    messages = []
    for i, m in enumerate(req.messages):
        content: Any = m.content if m.content is not None else ""
        if isinstance(content, list):
            for part in content:
                if part.type != "text" or part.text is None:
                    raise APIError(400, f"messages[{i}]: only text content parts are supported (got "
                                        f"type {part.type!r})", param="messages")
            content = [{"type": "text", "text": p.text} for p in content]
        messages.append({**m.model_dump(exclude_none=True), "role": m.role, "content": content})
    try:
        return codec.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt is not False)
    except Exception as e:  # noqa: BLE001 - a template that cannot render these messages
        raise APIError(400, f"cannot apply the chat template to these messages: {type(e).__name__}: {e}",
                       param="messages") from None


def _jsonable(info: Any) -> Any:
    if isinstance(info, dict):
        return info
    if hasattr(info, "to_dict"):
        return info.to_dict()
    if is_dataclass(info):
        import base64
        return json.loads(json.dumps(asdict(info), default=lambda b: base64.b64encode(b).decode()
                                     if isinstance(b, (bytes, bytearray)) else str(b)))
    return info


# --------------------------------------------------------------------------------------------------
# `gigadecode serve`
# --------------------------------------------------------------------------------------------------
def engine_from_args(args: Any, role: str) -> Any:
    """The engine behind `serve`: kv_both alone; prefill/decode with a NIXL KV connector keyed with
    --kv-secret (a producer serves its handshake on `--host`:`--kv-port`, 0 = any free port)."""
    from ..cli import engine_config
    from ..engine import build_engine
    ecfg = engine_config(args, kv_role=ROLES[role])
    return build_engine(args.model, ecfg, host=args.host, advertise_host=getattr(args, "kv_advertise_host", None),
                        side_port=getattr(args, "kv_port", 0) or 0, progress=False)


def serve(args: Any) -> int:
    """`gigadecode serve`. With --tp/--dp/--ep (under torchrun) every rank builds its engine replica; rank 0
    serves HTTP in front of the parallel engine and the other ranks follow its steps."""
    from ..parallel.engine import is_parallel
    from ..cli import engine_config
    from ..connector.params import check_secret
    if args.role != "both":
        check_secret(getattr(args, "kv_secret", None), ROLES[args.role])     # before loading anything
    if getattr(args, "max_request_bytes", 1) < 1:
        raise ValueError(f"--max-request-bytes must be >= 1 (got {args.max_request_bytes})")
    if is_parallel(engine_config(args)):
        return _serve_parallel(args)
    t0 = time.perf_counter()
    return _serve_engine(args, engine_from_args(args, args.role), t0)


def _serve_engine(args: Any, engine: Any, t0: float) -> int:
    import prometheus_client
    import uvicorn

    from ..tokenizer import TextCodec
    prometheus_client.disable_created_metrics()
    name = args.served_model_name or Path(args.model).resolve().name
    aeng = AsyncEngine(engine, codec=TextCodec.from_dir(args.model), model_dir=str(args.model))
    app = build_app(aeng, name, api_key=args.api_key, role=args.role,
                    kv_advertise_host=getattr(args, "kv_advertise_host", None),
                    max_request_bytes=getattr(args, "max_request_bytes", DEFAULT_MAX_REQUEST_BYTES))
    used, total = engine.kv_usage()
    layout = f"TP{args.tp} × DP{args.dp} × EP{args.ep}, " if getattr(engine, "ctx", None) is not None else ""
    print(f"gigadecode serve: model {name!r} ({layout}{args.role}, {total} KV blocks, context "
          f"{aeng.max_model_len}) loaded in {time.perf_counter() - t0:.1f}s; listening on "
          f"http://{args.host}:{args.port}", flush=True)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=args.access_log,
                    timeout_graceful_shutdown=5)
    finally:
        aeng.stop(timeout=None)          # the engine thread has left its last step before anything else runs
    return 0


def _serve_parallel(args: Any) -> int:
    import os

    import torch.distributed as dist

    from ..cli import engine_config
    from ..parallel.engine import DistributedEngine, build_parallel_engine, run_worker
    ecfg = engine_config(args, kv_role=ROLES[args.role])
    if "WORLD_SIZE" not in os.environ:
        n = ecfg.tp * ecfg.dp
        raise SystemExit(f"gigadecode serve: --tp {ecfg.tp} × --dp {ecfg.dp} needs {n} ranks: start it with "
                         f"torchrun --nproc-per-node {n} -m gigadecode serve …")
    t0 = time.perf_counter()
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
            run_worker(replica, ctx)
            return 0
        with DistributedEngine(replica, ctx) as engine:
            return _serve_engine(args, engine, t0)
    finally:
        dist.destroy_process_group()
