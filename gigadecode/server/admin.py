"""The server's info routes: `/health` (and vLLM's `/ping`), `/metrics` (Prometheus: our names, then vLLM's,
`vllm_metrics.py`), `/v1/models`, `/kv/handshake` (a DI producer's layout and NIXL agent metadata, for peers
that prove the deployment's KV secret only), and `/kv/release` (a DI producer ends the lease of params it
answered that will never be read)."""

from __future__ import annotations

import base64
import json
from dataclasses import asdict, is_dataclass
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ..connector.params import AUTH_HEADER, check_handshake_token
from . import deps, handoff
from .protocol import APIError, error_body
from .vllm_metrics import vllm_metrics_text

router = APIRouter()


@router.get("/health")
@router.get("/ping")                           # vLLM's (SageMaker's) name for the same check, GET or POST
@router.post("/ping")
async def health(request: Request) -> JSONResponse:
    aeng = request.app.state.engine
    if aeng is not None and aeng.dead is not None:
        return JSONResponse(error_body(f"the engine stopped: {aeng.dead}", "server_error", code="engine_dead"),
                            status_code=503)
    if aeng is None or not aeng.is_running:
        return JSONResponse(error_body("the engine is not running", "server_error", code="engine_unavailable"),
                            status_code=503)
    if not aeng.ready.is_set():              # requests sent now wait in the queue until it is done
        return JSONResponse(error_body("the engine is warming up", "server_error", code="engine_warming_up"),
                            status_code=503)
    stalled = aeng.stalled_for()
    if stalled is not None:                  # a step that never returns: healthy-looking, serving nobody
        return JSONResponse(error_body(f"the engine loop has shown no progress for {stalled:.0f} s (a step or "
                                       f"command running past --engine-stall-timeout-s "
                                       f"{aeng.stall_timeout_s:g} s)", "server_error", code="engine_stalled"),
                            status_code=503)
    s = deps.settings(request)
    return JSONResponse({"status": "ok", "role": s.role, "model": s.served_model_name})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    registry = deps.engine(request).metrics.registry
    text = generate_latest(registry) + vllm_metrics_text(registry, deps.settings(request).served_model_name)
    return Response(text, media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/models", dependencies=[Depends(deps.check_key)])
async def models(request: Request) -> JSONResponse:
    aeng, s = deps.engine(request), deps.settings(request)
    return JSONResponse({"object": "list", "data": [{
        "id": name, "object": "model", "created": s.created, "owned_by": "gigadecode",
        "root": aeng.model_dir, "parent": None, "max_model_len": aeng.max_model_len} for name in s.model_names]})


@router.get("/kv/handshake")
async def kv_handshake(request: Request) -> JSONResponse:
    aeng = deps.engine(request)
    conn = getattr(aeng.engine, "connector", None)
    if conn is None or not hasattr(conn, "handshake_info"):
        raise APIError(404, "this engine has no KV connector (no handshake to serve)", code="no_connector")
    key = getattr(conn, "key", None)
    if key is None or not check_handshake_token(key, request.headers.get(AUTH_HEADER)):
        raise APIError(403, f"the KV handshake answers only a peer with this deployment's KV secret "
                            f"(a fresh token in {AUTH_HEADER})", type="permission_error", code="kv_auth")
    return JSONResponse(await aeng.call(lambda e: _jsonable(e.connector.handshake_info())))


def _jsonable(info: Any) -> Any:
    if isinstance(info, dict):
        return info
    if hasattr(info, "to_dict"):
        return info.to_dict()
    if is_dataclass(info):
        return json.loads(json.dumps(asdict(info), default=lambda b: base64.b64encode(b).decode()
                                     if isinstance(b, (bytes, bytearray)) else str(b)))
    return info


@router.post("/kv/release", dependencies=[Depends(deps.check_key)])
async def kv_release(request: Request) -> JSONResponse:
    """A prefill server: {"kv_transfer_params": params it answered} -> {"released": bool}. The router calls it
    when the decode side will never read them (it refused the request, or the client left), so the leased
    blocks are freed at once instead of when the lease runs out. Only signed params naming this engine.
    {"handoff": name}: the router's client left while the prefill it named so (`handoff.HANDOFF_HEADER`) ran; the
    router never got its answer, so the request ends here: aborted if it runs, its lease ended if it answered,
    refused if it arrives later (`AsyncEngine.give_up`)."""
    from ..request import RequestError
    from .body import BodyError, load_object
    aeng = deps.engine(request)
    try:
        raw = load_object(await request.body())
    except BodyError as e:
        raise APIError(400, str(e), code="invalid_json") from None
    if "handoff" in raw:
        if not handoff.valid_handoff(raw["handoff"]):
            raise APIError(400, "handoff: expected the 32 hex digits the router named its prefill with",
                           param="handoff")
        rids = handoff.handoff_ids(raw["handoff"])
        aeng.give_up(rids)                # a running request first: it then never leases (the engine's order)
        released = await aeng.call(lambda e: any([e.release_lease(rid) for rid in rids]))
        return JSONResponse({"released": bool(released)})
    params = raw.get("kv_transfer_params")
    if not isinstance(params, dict):
        raise APIError(400, "kv_transfer_params: expected the object a prefill answered", param="kv_transfer_params")
    try:
        released = await aeng.call(lambda e: e.release_kv(params))
    except RequestError as e:
        raise APIError(400, str(e), param=e.param, code=e.code) from None
    return JSONResponse({"released": bool(released)})
