"""A client that leaves before its body is read is no server error, on the API server and on the proxy."""

from __future__ import annotations

import logging
import socket
import time

import httpx
import pytest

from gigadecode.cli import build_parser
from gigadecode.server.api import build_app, engine_from_args
from gigadecode.server.async_engine import AsyncEngine
from gigadecode.server.proxy import build_proxy_app

from .test_server import ServerThread

MODEL = "tiny"


# --------------------------------------------------------------------------------------------------
# A client gone before its body was read
# --------------------------------------------------------------------------------------------------
class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.seen: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.seen.append(f"{record.name}: {record.getMessage()}")


def _leave_mid_body(url: str, path: str) -> None:
    """Headers promising 100 bytes of body, 12 of them, then the client goes."""
    host, port = url.rsplit("/", 1)[1].split(":")
    with socket.create_connection((host, int(port))) as s:
        s.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                  f"Content-Length: 100\r\n\r\n{{\"prompt\": [".encode())
        time.sleep(0.1)


@pytest.mark.parametrize("which", ["server", "proxy"])
def test_a_client_gone_before_its_body_was_read_is_no_server_error(tiny_ckpt, which):
    """Its route finds the body cut off (starlette's ClientDisconnect): that was logged as an unhandled error with
    two tracebacks (a 500 for nobody), on the API server and on the proxy alike. Now it is answered 499 quietly
    and the next request is served."""
    if which == "server":
        args = build_parser().parse_args(["serve", "--model", str(tiny_ckpt), "--num-blocks", "64"])
        app = build_app(AsyncEngine(engine_from_args(args, "both")), MODEL)
        paths = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/tokenize")
    else:
        app = build_proxy_app(["http://127.0.0.1:9"], ["http://127.0.0.1:9"])   # never reached
        paths = ("/v1/completions", "/v1/chat/completions", "/v1/responses")
    records = _Records()
    loggers = [logging.getLogger(n) for n in ("uvicorn.error", "gigadecode.server", "gigadecode.proxy")]
    try:
        with ServerThread(app) as srv:
            for lg in loggers:                 # after uvicorn's start: its logging config drops earlier handlers
                lg.addHandler(records)
            for path in paths:
                _leave_mid_body(srv.url, path)
            time.sleep(0.5)
            r = httpx.post(srv.url + "/v1/completions", content=b'{"prompt": [', timeout=10,
                           headers={"content-type": "application/json"})
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"   # served as ever
    finally:
        for lg in loggers:
            lg.removeHandler(records)
    assert not records.seen, records.seen
