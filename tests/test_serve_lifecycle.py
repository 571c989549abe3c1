"""`gigadecode serve` as an operator runs it, one process on loopback: a SIGTERM ends the requests in flight as a
client can tell (an error event and [DONE], or a 503) after --shutdown-timeout-s, and a prompt that takes seconds
to tokenize does not hold the server's event loop (/health keeps answering)."""

from __future__ import annotations

import json
import signal
import time

from .helpers import stop_process_tree
from .test_serve_di import start_gigadecode
from .test_server import free_port, wait_health


def test_sigterm_ends_requests_in_flight_with_an_error_not_a_cut(tiny_ckpt):
    """On SIGTERM a server lets requests in flight run for --shutdown-timeout-s, then ends the rest as a client
    can tell: a stream gets an error event naming the shutdown and [DONE], a whole answer a 503 in OpenAI's
    shape (uvicorn used to cut both off when its own wait ran out). The process is gone soon after."""
    import threading

    import httpx
    port = free_port()
    proc = start_gigadecode(["serve", "--model", str(tiny_ckpt), "--port", str(port), "--dtype", "float32",
                             "--shutdown-timeout-s", "1"])
    url = f"http://127.0.0.1:{port}"
    body = {"prompt": [5, 6, 7], "max_tokens": 2000, "n": 4, "ignore_eos": True}
    got: dict = {}

    def whole() -> None:
        got["whole"] = httpx.post(url + "/v1/completions", json=body, timeout=60)

    try:
        wait_health(url, proc, timeout=120)
        t = threading.Thread(target=whole)
        t.start()
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            assert r.status_code == 200, r.read()
            lines = r.iter_lines()
            events = [next(lines) for _ in range(8)]              # generating
            proc.send_signal(signal.SIGTERM)
            t0 = time.monotonic()
            events += list(lines)
        t.join(30)
        data = [e.removeprefix("data: ") for e in events if e.startswith("data: ")]
        assert data[-1] == "[DONE]" and "shutting down" in json.loads(data[-2])["error"]["message"], data[-3:]
        assert json.loads(data[-2])["error"]["code"] == "server_shutting_down"      # as the 503's
        w = got["whole"]
        assert w.status_code == 503 and w.json()["error"]["code"] == "server_shutting_down", w.text
        proc.wait(30)
        assert time.monotonic() - t0 < 10
    finally:
        stop_process_tree(proc)


def test_a_long_text_prompt_does_not_hold_the_event_loop(tiny_ckpt):
    """Tokenizing a ~4 MB prompt takes seconds: it runs off the event loop, so /health keeps answering (it
    waited for the whole tokenization); the prompt itself is refused as longer than the context."""
    import threading

    import httpx
    port = free_port()
    proc = start_gigadecode(["serve", "--model", str(tiny_ckpt), "--port", str(port), "--num-blocks", "128"])
    url, got = f"http://127.0.0.1:{port}", {}

    def post() -> None:
        got["r"] = httpx.post(url + "/v1/completions", timeout=120,
                              json={"prompt": "hello world, what is 37 + 45? " * 130_000, "max_tokens": 1})
    try:
        wait_health(url, proc, timeout=120)
        t = threading.Thread(target=post)
        t.start()
        answered = [time.monotonic()]
        while t.is_alive():
            assert httpx.get(url + "/health", timeout=30).status_code == 200
            answered.append(time.monotonic())
            time.sleep(0.05)
        t.join()
        assert got["r"].status_code == 400 and "context" in got["r"].json()["error"]["message"]
        gaps = [b - a for a, b in zip(answered, answered[1:])]
        assert answered[-1] - answered[0] > 1.5 and max(gaps) < 1.0, gaps
    finally:
        stop_process_tree(proc)


def test_an_address_it_cannot_listen_on_is_said_before_the_model_loads(tiny_ckpt):
    """The API's socket is bound before the model loads: a taken port or a host name that does not resolve ends
    `serve` at once with one line naming the address (it loaded the model, printed "listening on", and only
    then failed in uvicorn's bind)."""
    import socket
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    port = taken.getsockname()[1]
    try:
        for host, p in (("127.0.0.1", port), ("no-such-host.invalid", free_port())):
            proc = start_gigadecode(["serve", "--model", str(tiny_ckpt), "--host", host, "--port", str(p)])
            try:
                out, _ = proc.communicate(timeout=120)
            finally:
                stop_process_tree(proc)
            assert proc.returncode != 0, out
            assert f"cannot listen on {host}:{p}" in out, out
            assert "loaded in" not in out and "Traceback" not in out, out
    finally:
        taken.close()


def test_the_api_socket_takes_the_address_family_uvicorn_took(monkeypatch):
    """uvicorn bound an IPv4 socket unless the host has a ':' (an IPv6 address). listen_socket took the first
    getaddrinfo answer, which for 'localhost' is ::1 where /etc/hosts names it for both (Fedora, RHEL, macOS):
    the server then listened on [::1] only and a client or proxy at 127.0.0.1 was refused."""
    import socket

    from gigadecode.server.api import listen_socket
    real = socket.getaddrinfo

    def both_families(host, port, family=0, *a, **kw):     # ::1 first, as glibc's default gai.conf orders them
        got = real(host, port, family, *a, **kw)
        if host == "localhost" and family == 0:
            got = real("::1", port, socket.AF_INET6, *a, **kw) + got
        return got

    monkeypatch.setattr(socket, "getaddrinfo", both_families)
    sock = listen_socket("localhost", 0)
    try:
        assert sock.family == socket.AF_INET and sock.getsockname()[0] == "127.0.0.1"
    finally:
        sock.close()
    sock = listen_socket("", 0)                             # uvicorn's bind took '' as every interface
    try:
        assert sock.family == socket.AF_INET and sock.getsockname()[0] == "0.0.0.0"
    finally:
        sock.close()


def test_the_startup_heap_is_frozen_and_new_garbage_still_collected():
    """`freeze_startup_heap` (in a process of its own: freezing is process-wide) moves what start-up made out of
    the collector's generations, a start-up cycle included, while a cycle made afterwards is still collected."""
    import subprocess
    import sys
    code = """
import gc, weakref
from gigadecode.server.gc_heap import freeze_startup_heap
class Node: pass
kept = Node(); kept.me = kept                           # start-up's: a live cycle
n = freeze_startup_heap()
assert n > 1000 and n == gc.get_freeze_count(), n
assert not any(o is kept for o in gc.get_objects())     # out of the collector's sight
late = Node(); late.me = late; ref = weakref.ref(late); del late   # a request's garbage cycle
gc.collect()
assert ref() is None
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_serve_freezes_the_startup_heap_before_it_serves(tiny_ckpt, monkeypatch):
    """`serve` freezes the start-up heap (model loaded, app built) before uvicorn takes a request."""
    import gc

    from gigadecode.cli import build_parser
    from gigadecode.server import api
    seen = []

    def run(self, sockets=None):
        seen.append(gc.get_freeze_count())
        self.started = True

    monkeypatch.setattr(api.DrainingServer, "run", run)
    args = build_parser().parse_args(["serve", "--model", str(tiny_ckpt), "--port", "0", "--no-warmup"])
    sock = api.listen_socket("127.0.0.1", 0)
    try:
        assert api._serve_engine(args, api.engine_from_args(args, "both"), time.perf_counter(), sock) == 0
    finally:
        gc.unfreeze()                            # this test process goes on as it was
        sock.close()
    assert len(seen) == 1 and seen[0] > 1000
