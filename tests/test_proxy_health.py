"""The DI proxy's rotation, its own /health and /metrics (`server/proxy_health.py`), against in-process
upstreams: /health answers at once from what the background probe knows (a wedged upstream never holds it),
the probe finds a server that failed or died while idle without a request paying for it, a request that
times out takes its server out too, a role with no server in rotation makes the proxy's /health a 503 naming
it, and /metrics is valid Prometheus text whatever the URLs hold (read back with prometheus_client's own
parser)."""

from __future__ import annotations

import socket
import time

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from prometheus_client.parser import text_string_to_metric_families

from gigadecode.server import proxy_health
from gigadecode.server.proxy import build_proxy_app
from gigadecode.server.proxy_pool import Pool

from .test_server import ServerThread, fake_upstream, free_port


def switchable_upstream() -> tuple[FastAPI, dict]:
    """A server whose /health answers 200 while state["healthy"], else 503; state["health_gets"] counts them."""
    app, state = FastAPI(), {"healthy": True, "health_gets": 0}

    @app.get("/health")
    async def health():
        state["health_gets"] += 1
        if state["healthy"]:
            return {"status": "ok"}
        return JSONResponse({"error": {"message": "the engine stopped"}}, status_code=503)
    return app, state


@pytest.fixture
def fast_probe(monkeypatch):
    """Probe every 0.1 s, each for at most 0.5 s: the tests see the probe's verdicts within a second."""
    monkeypatch.setattr(proxy_health, "PROBE_S", 0.1)
    monkeypatch.setattr(proxy_health, "PROBE_TIMEOUT_S", 0.5)


def get_health(url: str) -> httpx.Response:
    """The proxy's /health, which must answer within a Kubernetes probe's default 1 s timeout."""
    return httpx.get(url + "/health", timeout=1.0)


def wait_health(url: str, until, timeout_s: float = 5.0) -> httpx.Response:
    t0 = time.monotonic()
    while not until(r := get_health(url)):
        assert time.monotonic() - t0 < timeout_s, r.text
        time.sleep(0.05)
    return r


def test_health_answers_at_once_with_a_wedged_upstream(fast_probe):
    """A decode server that takes connections and never answers (stopped, wedged) leaves the rotation by the
    probe alone, and the proxy's /health never waits on it: 200, a prefill and a decode server being in
    rotation. /metrics says the same, the URL with a double quote in its label read back as it is."""
    wedged = socket.socket()
    wedged.bind(("127.0.0.1", 0))
    wedged.listen(16)                                     # the kernel accepts; nothing ever answers
    wedged_url = f"http://127.0.0.1:{wedged.getsockname()[1]}"
    quoted = f'http://127.0.0.1:{free_port()}/a"b'          # nothing listens there
    p_app, _ = switchable_upstream()
    d_app, _ = switchable_upstream()
    try:
        with ServerThread(p_app) as p, ServerThread(d_app) as d, \
                ServerThread(build_proxy_app([p.url], [wedged_url, d.url, quoted])) as px:
            r = wait_health(px.url, lambda r: not r.json()["decode"][wedged_url]["in_rotation"]
                            and not r.json()["decode"][quoted]["in_rotation"])
            assert r.status_code == 200 and r.json()["status"] == "ok", r.text
            state = r.json()["decode"][wedged_url]
            assert state["healthy"] is False and "/health" in state["out_of_rotation_because"]
            assert r.json()["decode"][d.url]["in_rotation"] and r.json()["decode"][d.url]["healthy"]
            assert r.json()["prefill"][p.url]["in_rotation"]
            families = {f.name: f for f in text_string_to_metric_families(httpx.get(px.url + "/metrics").text)}
            in_rotation = {(s.labels["role"], s.labels["url"]): s.value
                           for s in families["gigadecode_proxy_upstream_in_rotation"].samples}
            assert in_rotation == {("prefill", p.url): 1, ("decode", wedged_url): 0, ("decode", d.url): 1,
                                   ("decode", quoted): 0}
    finally:
        wedged.close()


def test_health_is_503_naming_the_role_with_no_server_in_rotation(fast_probe):
    """A decode server whose /health turns 503, then a prefill server that dies, while no request comes: the
    probe takes each out of rotation, and the proxy's /health is a 503 naming the role that has none left,
    with each server's state as before; a server whose /health answers 200 again is back."""
    p_app, _ = switchable_upstream()
    d_app, d_state = switchable_upstream()
    with ServerThread(d_app) as d:
        p = ServerThread(p_app).__enter__()
        try:
            with ServerThread(build_proxy_app([p.url], [d.url])) as px:
                wait_health(px.url, lambda r: r.status_code == 200)
                d_state["healthy"] = False
                r = wait_health(px.url, lambda r: r.status_code == 503)
                body = r.json()
                assert body["status"] == "unhealthy" and body["reason"] == "no decode server in rotation", body
                assert body["decode"][d.url]["in_rotation"] is False and body["decode"][d.url]["healthy"] is False
                assert "503" in body["decode"][d.url]["out_of_rotation_because"]
                assert body["prefill"][p.url]["in_rotation"] is True

                d_state["healthy"] = True
                r = wait_health(px.url, lambda r: r.status_code == 200)
                assert r.json()["status"] == "ok" and r.json()["decode"][d.url]["in_rotation"], r.text

                p.__exit__(None, None, None)                       # the prefill server dies while idle
                r = wait_health(px.url, lambda r: r.status_code == 503)
                assert r.json()["reason"] == "no prefill server in rotation", r.text
                assert r.json()["prefill"][p.url]["in_rotation"] is False
        finally:
            p.__exit__(None, None, None)


def test_a_server_out_of_rotation_shows_what_keeps_it_out_now(fast_probe, caplog):
    """A decode server the proxy could not reach at first (not started yet) that then answers its /health with
    an error (here a 500; behind TLS, the proxy's certificate refused): its reason in /health is the latest
    failure, not the first, and the log says the new one once (not again when only a number in it changes).
    The reason stayed "ConnectError" for as long as the server was out, hiding what kept it out."""
    app, state = FastAPI(), {"status": 503, "message": "loading 1 of 9"}

    @app.get("/health")
    async def health():
        return JSONResponse({"error": {"message": state["message"]}}, status_code=state["status"])
    p_app, _ = switchable_upstream()
    d = ServerThread(app)                        # its port bound, not listening until it starts
    d_url = d.url
    with ServerThread(p_app) as p, caplog.at_level("WARNING", logger="gigadecode.proxy"), \
            ServerThread(build_proxy_app([p.url], [d_url])) as px:
        r = wait_health(px.url, lambda r: r.json()["decode"][d_url]["healthy"] is False)
        assert "ConnectError" in r.json()["decode"][d_url]["out_of_rotation_because"], r.text
        with d:                                  # the server starts
            r = wait_health(px.url, lambda r: "503" in r.json()["decode"][d_url]["out_of_rotation_because"])
            assert "loading 1 of 9" in r.json()["decode"][d_url]["out_of_rotation_because"]
            state["message"] = "loading 2 of 9"
            wait_health(px.url, lambda r: "2 of 9" in r.json()["decode"][d_url]["out_of_rotation_because"])
            state.update(status=500, message="the engine failed")
            r = wait_health(px.url, lambda r: "500" in r.json()["decode"][d_url]["out_of_rotation_because"])
            assert r.status_code == 503 and r.json()["decode"][d_url]["in_rotation"] is False
            still = [m for m in caplog.messages if "is still out of rotation" in m]
            assert len(still) == 2 and "loading 1 of 9" in still[0] and "the engine failed" in still[1], still


def test_a_request_that_times_out_takes_its_server_out_of_rotation(monkeypatch):
    """A decode server that takes connections and never answers, before the probe has a verdict on it (its
    /health may take a minute here): the first request it gets pays the decode time-out (a 504) and takes it out
    of rotation; the requests after it go to the other one, none to it."""
    monkeypatch.setattr(proxy_health, "PROBE_TIMEOUT_S", 60.0)
    wedged = socket.socket()
    wedged.bind(("127.0.0.1", 0))
    wedged.listen(16)
    wedged_url = f"http://127.0.0.1:{wedged.getsockname()[1]}"
    p_app, _ = fake_upstream("pre", "prefill")
    d_app, dec = fake_upstream("dec", "decode")
    body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 5}
    try:
        with ServerThread(p_app) as p, ServerThread(d_app) as d, \
                ServerThread(build_proxy_app([p.url], [wedged_url, d.url], decode_timeout_s=0.5)) as px:
            r = httpx.post(px.url + "/v1/completions", json=body, timeout=20)     # the first in list order
            assert r.status_code == 504 and r.json()["error"]["code"] == "decode_timeout", r.text
            for stream in (False, True, False):       # in rotation, it would take every other one (list order)
                r = httpx.post(px.url + "/v1/completions", json={**body, "stream": stream}, timeout=20)
                assert r.status_code == 200, r.text
            assert len(dec["bodies"]) == 3
            state = get_health(px.url).json()["decode"][wedged_url]
            assert state["in_rotation"] is False and "did not start an answer" in state["out_of_rotation_because"]
            assert state["healthy"] is None                                        # the probe has no verdict yet
    finally:
        wedged.close()


def test_health_is_503_until_a_server_of_each_role_has_answered(monkeypatch):
    """Just started, the proxy knows nothing of a server its probe is still waiting on: not ready (503, the
    reason naming the role), however sure the other role is."""
    monkeypatch.setattr(proxy_health, "PROBE_TIMEOUT_S", 60.0)
    wedged = socket.socket()
    wedged.bind(("127.0.0.1", 0))
    wedged.listen(16)
    wedged_url = f"http://127.0.0.1:{wedged.getsockname()[1]}"
    d_app, _ = switchable_upstream()
    try:
        with ServerThread(d_app) as d, ServerThread(build_proxy_app([wedged_url], [d.url])) as px:
            r = wait_health(px.url, lambda r: r.json()["decode"][d.url]["healthy"])
            assert r.status_code == 503, r.text
            assert r.json()["reason"] == "no prefill server in rotation has answered its /health with 200 yet"
            assert r.json()["prefill"][wedged_url] == {"healthy": None, "in_flight": 0, "in_rotation": True,
                                                       "last_health_check_s_ago": None}
    finally:
        wedged.close()


def test_health_asks_no_upstream_itself():
    """The proxy's /health sends nothing upstream: the probe's one GET a server every PROBE_S is all the
    servers see, however often the proxy is asked."""
    p_app, p_state = switchable_upstream()
    d_app, d_state = switchable_upstream()
    with ServerThread(p_app) as p, ServerThread(d_app) as d, ServerThread(build_proxy_app([p.url], [d.url])) as px:
        gets, t0 = p_state["health_gets"] + d_state["health_gets"], time.monotonic()
        for _ in range(20):
            assert get_health(px.url).status_code == 200
        rounds = (time.monotonic() - t0) / proxy_health.PROBE_S + 2       # the probe's, at most
        assert p_state["health_gets"] + d_state["health_gets"] - gets <= 2 * rounds


def test_metrics_escape_label_values():
    """Prometheus text format: a backslash, a double quote and a newline in a label value are written \\\\, \\"
    and \\n; the parser reads back each URL as it was given."""
    urls = ['http://h:1/a"b', "http://h:2/a\\b", "http://h:3/a\nb", 'http://h:4/\\"\\n']
    pool = Pool("decode", [f"http://h:{i}" for i in range(1, 5)])
    for up, url in zip(pool.servers, urls):      # set past the start-up check, which refuses a newline
        up.url = url
    text = proxy_health.metrics_text([pool])
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("gigadecode_proxy_upstream_in_flight", "gigadecode_proxy_upstream_in_rotation"):
        assert [s.labels for s in families[name].samples] == [{"role": "decode", "url": u} for u in urls]


@pytest.mark.parametrize("url, why", [
    ("http://127.0.0.1:8100\n", "control characters"), ("http://a b:1", "spaces"),
    ("127.0.0.1:8100", "http://HOST:PORT"), ("ftp://h:1", "http://HOST:PORT"), ("http://:80", "http://HOST:PORT"),
    ("http://h:99999", "port 99999"), ("http://h:1?x=1", "query or fragment")])
def test_a_malformed_upstream_url_is_refused_at_start(url, why, capsys):
    """A URL the proxy cannot send to is refused when it starts, naming it (a newline in one made every request
    it took a 500 from httpx.InvalidURL); a trailing slash or a path prefix is taken."""
    with pytest.raises(ValueError, match=why):
        build_proxy_app(["http://127.0.0.1:8100"], [url])
    from gigadecode.cli import main
    assert main(["proxy", "--prefill", url, "--decode", "http://127.0.0.1:8200"]) == 2
    assert "prefill server URL" in capsys.readouterr().err
    app = build_proxy_app(["http://127.0.0.1:8100/", "http://gw/prefill-a/"], ["http://127.0.0.1:8200"])
    assert app is not None


def test_a_lease_is_released_under_the_prefill_servers_path_prefix():
    """A prefill server behind a path prefix (http://host/prefill-a, a reverse proxy's route: the proxy takes
    it) has its lease released at that prefix's /kv/release, as its prefill and its handoff release are: the
    release used to go to the host's root /kv/release (someone else's route, or a 404), and the lease was held
    until it ran out. Upstreams are an httpx mock: every URL the proxy asks is recorded."""
    import asyncio
    asked: list[tuple[str, str]] = []

    def answer(request: httpx.Request) -> httpx.Response:
        asked.append((request.method, str(request.url)))
        if request.url.path.endswith("/health"):
            return httpx.Response(200, json={"status": "ok"})
        if request.url.host == "pre.test" and request.url.path == "/prefill-a/v1/completions":
            return httpx.Response(200, json={"id": "p", "choices": [], "kv_transfer_params": {
                "do_remote_prefill": True, "remote_engine_id": "pre", "remote_block_ids": [[3]]}})
        if request.url.host == "dec.test" and request.url.path == "/v1/completions":   # the decode refuses it
            return httpx.Response(400, json={"error": {"message": "no", "type": "invalid_request_error",
                                                       "param": None, "code": None}})
        if request.url.path.endswith("/kv/release"):
            return httpx.Response(200, json={"released": True})
        return httpx.Response(404, json={"detail": "Not Found"})

    async def run() -> int:
        client = httpx.AsyncClient(transport=httpx.MockTransport(answer))
        app = build_proxy_app(["http://pre.test/prefill-a/"], ["http://dec.test"], client=client)
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://px") as hc:
                r = await hc.post("/v1/completions", json={"model": "m", "prompt": [1, 2, 3], "max_tokens": 2})
        await client.aclose()
        return r.status_code

    assert asyncio.run(run()) == 400
    releases = [url for method, url in asked if url.endswith("/kv/release")]
    assert releases == ["http://pre.test/prefill-a/kv/release"], asked


def test_a_health_answer_from_before_a_failure_does_not_undo_it(monkeypatch):
    """A probe whose /health answer (200) was on its way when a request found the server failing (it timed out,
    dropped a stream) leaves the server out of rotation: that answer predates the failure. Only a /health asked
    after it puts the server back (it used to be back in rotation at once, for requests to find it failing)."""
    import asyncio
    monkeypatch.setattr(proxy_health, "PROBE_S", 30.0)     # one probe in this test's time

    async def run() -> tuple[str | None, bool | None]:
        asked, answer_now = asyncio.Event(), asyncio.Event()

        async def answer(request: httpx.Request) -> httpx.Response:
            asked.set()
            await answer_now.wait()
            return httpx.Response(200, json={"status": "ok"})

        pool = Pool("decode", ["http://dec.test"])
        up = pool.servers[0]
        async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as http:
            probe = asyncio.create_task(proxy_health.probe_servers(http, [pool]))
            await asyncio.wait_for(asked.wait(), 5)
            pool.mark_down(up, "did not start an answer within 1 s")    # a request's verdict, mid-probe
            answer_now.set()
            for _ in range(20):                                          # the probe handles its answer
                await asyncio.sleep(0.01)
            probe.cancel()
            await asyncio.gather(probe, return_exceptions=True)
        return up.down, up.healthy

    down, healthy = asyncio.run(run())
    assert down == "did not start an answer within 1 s" and healthy is True


def test_a_release_on_its_way_at_shutdown_still_reaches_the_prefill_server():
    """A lease release scheduled in the background (a stream that ended early) when the proxy shuts down is
    sent before the proxy's client closes: it used to meet the closed client ("Task exception was never
    retrieved"), and the prefill held the lease until it ran out."""
    import asyncio

    from gigadecode.server import proxy_decode
    app, got = FastAPI(), []

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.post("/kv/release")
    async def release(body: dict):
        await asyncio.sleep(0.3)                 # the release is still on its way when the proxy stops
        got.append(body)
        return {"released": True}

    with ServerThread(app) as up:
        papp = build_proxy_app([up.url], [up.url])

        async def run():
            async with papp.router.lifespan_context(papp):
                lease = {"handoff": "ab" * 16, "url": up.url + "/kv/release"}
                proxy_decode.in_background(proxy_decode.release_lease(papp.state.client, lease, {}))
        asyncio.run(run())
    assert got == [{"handoff": "ab" * 16}]


def test_proxy_runs_without_torch():
    """`gigadecode proxy` is a router: its process imports no torch (nor the engine) — the command line's
    parser (every command's flags), the proxy app and the vLLM handshake it may speak load without it, so a
    router starts in a fraction of a second at tens of MB instead of ~2 s and ~260 MB."""
    import subprocess
    import sys
    code = ("import sys; from gigadecode import cli; cli.build_parser(); "
            "from gigadecode.server.proxy import build_proxy_app, run_proxy; "
            "import gigadecode.connector.vllm_handshake; "
            "heavy = sorted(m for m in sys.modules if m in ('torch', 'gigadecode.engine', 'gigadecode.model') "
            "or m.startswith(('torch.', 'gigadecode.native'))); print(heavy)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]", r.stdout
