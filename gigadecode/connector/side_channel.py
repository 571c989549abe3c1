"""The KV side channel: a producer's `GET /kv/handshake` (its KV layout and NIXL agent metadata), for peers
that prove the deployment key only.

The answer holds memory addresses, so the server answers only a request whose `X-Gigadecode-KV-Auth`
header carries a fresh `params.handshake_token` (403 otherwise), and signs its body with the same key
(`params.answer_signature`, in the same header) so the consumer knows it paired with a real producer.
`fetch_handshake` is the consumer's side; it blocks on the network, so the connector runs it on a worker
thread (`HandshakeCache`: once per producer, failures remembered for a back-off), never on the engine's
step loop.
"""

from __future__ import annotations

import base64
import hmac
import json
import socket
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

from .base import HandshakeError, KVLayout
from .params import AUTH_HEADER, RemoteRank, answer_signature, check_handshake_token, handshake_token


class SideChannel:
    """A tiny threaded HTTP server on the producer: `GET /kv/handshake` -> `info()` as JSON."""

    def __init__(self, host: str, port: int, info: Callable[[], dict[str, Any]], key: bytes) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:          # noqa: N802
                if self.path.rstrip("/") != "/kv/handshake":
                    self.send_error(404)
                    return
                if not check_handshake_token(key, self.headers.get(AUTH_HEADER)):
                    self.send_error(403, "the KV handshake needs a peer with this deployment's KV secret")
                    return
                body = json.dumps(info()).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.send_header(AUTH_HEADER, answer_signature(key, body))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a: Any) -> None:
                pass

        class Server(ThreadingHTTPServer):     # IPv6 for a host with a ':' (as the API socket), else IPv4
            address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            self.httpd = Server((host, port), Handler)
        except OSError as e:                   # taken, not this machine's, does not resolve: say which
            raise ValueError(f"the KV side channel cannot listen on {host}:{port}: {e.strerror or e}") from None
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True, name="kv-side-channel")
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def fetch_handshake(host: str, port: int, key: bytes, timeout_s: float = 5.0) -> dict[str, Any]:
    """The producer's handshake answer (blocking); HandshakeError on any failure or an unsigned answer."""
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}/kv/handshake"     # an IPv6 address bracketed
    req = urllib.request.Request(url, headers={AUTH_HEADER: handshake_token(key)})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            body = r.read()
            proof = r.headers.get(AUTH_HEADER, "")
    except urllib.error.HTTPError as e:
        hint = " (the two engines were started with different KV secrets?)" if e.code == 403 else ""
        raise HandshakeError(f"KV handshake with {url} failed: HTTP {e.code} {e.reason}{hint}") from None
    except Exception as e:  # noqa: BLE001 - any failure to reach the producer is a handshake failure
        raise HandshakeError(f"KV handshake with {url} failed: {type(e).__name__}: {e}") from None
    if not hmac.compare_digest(proof, answer_signature(key, body)):
        raise HandshakeError(f"KV handshake with {url}: the answer is not signed with this deployment's KV secret")
    try:
        info = json.loads(body)
    except json.JSONDecodeError as e:
        raise HandshakeError(f"KV handshake with {url}: the answer is not JSON ({e})") from None
    if not isinstance(info, dict) or not isinstance(info.get("layout"), dict) \
            or not isinstance(info.get("agent_metadata"), str):
        raise HandshakeError(f"KV handshake with {url}: the answer lacks layout / agent_metadata")
    return info


class BackedOffFetches:
    """Handshakes fetched on a worker thread (the step loop never waits on the network), one per peer at a
    time; a failure is remembered for `BACKOFF_S`, so the requests that need that peer fail at once
    instead of each retrying it."""

    BACKOFF_S = 5.0

    def __init__(self, thread_name: str) -> None:
        self.pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix=thread_name)
        self.pending: dict[str, Future] = {}
        self.failed: dict[str, tuple[float, str]] = {}     # peer -> (when, error)

    def poll(self, key: str, fetch: Callable[[], Any], finish: Callable[[Any], Any], what: str) -> Any:
        """`finish(fetch())` once the fetch (started on the first call) is done, None while it runs;
        HandshakeError when either failed (now or within the back-off). `what` names the peer in errors."""
        when, err = self.failed.get(key, (0.0, ""))
        if time.monotonic() - when < self.BACKOFF_S:
            raise HandshakeError(f"{err} (not retried for {self.BACKOFF_S:.0f} s)")
        fut = self.pending.get(key)
        if fut is None:
            self.pending[key] = self.pool.submit(fetch)
            return None
        if not fut.done():
            return None
        del self.pending[key]
        try:
            result = finish(fut.result())
        except Exception as e:  # noqa: BLE001 - malformed answers are handshake failures too
            msg = str(e) if isinstance(e, HandshakeError) else f"KV handshake with {what} failed: {type(e).__name__}: {e}"
            self.failed[key] = (time.monotonic(), msg)
            raise HandshakeError(msg) from None
        self.failed.pop(key, None)
        return result

    def give_up(self, key: str, msg: str) -> None:
        """A load stopped waiting for `key`'s fetch: remember it as failed (for the back-off)."""
        if self.pending.pop(key, None) is not None:
            self.failed[key] = (time.monotonic(), msg)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


class HandshakeCache:
    """Consumer: one handshake per gigadecode producer rank (`BackedOffFetches`), paired into the agent."""

    BACKOFF_S = BackedOffFetches.BACKOFF_S

    def __init__(self, key: bytes, timeout_s: float) -> None:
        self.key, self.timeout_s = key, timeout_s
        self.fetches = BackedOffFetches("kv-handshake")

    def ready(self, agent, src: RemoteRank) -> str | None:
        """The paired remote's name, or None while its handshake runs; HandshakeError when it failed (now or
        within the back-off)."""
        name = src.remote_engine_id
        if name in agent.remotes:
            return name

        def pair(info: dict) -> str:
            layout = KVLayout.from_dict(info["layout"])
            if layout.agent_name != name:      # a new engine behind the same address (a restarted server)
                raise HandshakeError(f"the prefill engine at {src.remote_host}:{src.remote_port} is "
                                     f"{layout.agent_name!r} now, not the {name!r} these params are from: that "
                                     f"engine was stopped or restarted since it answered them, and its KV is gone")
            agent.add_remote(name, base64.b64decode(info["agent_metadata"]), layout)
            return name
        return self.fetches.poll(name, lambda: fetch_handshake(src.remote_host, src.remote_port, self.key,
                                                               self.timeout_s), pair, name)

    def give_up(self, name: str, agent) -> None:
        if name not in agent.remotes:
            self.fetches.give_up(name, f"KV handshake with {name} timed out after {self.timeout_s:.3g} s")

    def close(self) -> None:
        self.fetches.close()
