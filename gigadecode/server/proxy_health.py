"""What `gigadecode proxy` knows of its upstream servers' health: the background probe that asks every server
for its /health once a PROBE_S (a 200 puts one out of rotation back, `Pool.mark_up`; an error status, no
answer or no connection takes one in rotation out, `Pool.mark_down`), the proxy's own /health, answered at
once from what the probe and the requests found (never waiting on an upstream: a load balancer's or
Kubernetes' probe gives up after a second), and its /metrics (Prometheus text: each server's load, rotation
and failures, labelled by role and URL). Which server takes a request is `proxy_pool`'s.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

import httpx

from .proxy_pool import Pool, Upstream
from .proxy_tls import failure

PROBE_S, PROBE_TIMEOUT_S = 1.0, 2.0     # how often, and how long, each server is asked for its /health


async def probe_servers(http: httpx.AsyncClient, pools: Sequence[Pool]) -> None:
    """Ask each server for its /health now and then every PROBE_S, each on its own (a wedged one delays no
    other): a 200 puts a server out of rotation back (unless a request found it failing while it was asked);
    anything else takes a server in rotation out, so a server that died or stopped answering while idle is
    known before a request finds it so, and keeps one out of it out with the latest reason."""
    async def watch(pool: Pool, up: Upstream) -> None:
        while True:
            failures = up.failures          # a request that finds it failing meanwhile counts one more
            why = await _ask_health(http, up)
            up.healthy, up.probed_at = why is None, time.monotonic()
            if why is None:
                if up.failures == failures:     # an answer from before a failure does not undo it (the next does)
                    pool.mark_up(up)
            elif up.down is None:
                pool.mark_down(up, f"/health: {why}")
            else:                           # its reason now: what keeps it out
                pool.still_down(up, f"/health: {why}")
            await asyncio.sleep(PROBE_S)
    await asyncio.gather(*(watch(pool, up) for pool in pools for up in pool.servers))


async def _ask_health(http: httpx.AsyncClient, up: Upstream) -> str | None:
    """None when `up`'s /health answers 200 within PROBE_TIMEOUT_S, else what went wrong."""
    try:
        r = await http.get(up.url + "/health", timeout=PROBE_TIMEOUT_S)
    except httpx.TimeoutException:
        return f"no answer within {PROBE_TIMEOUT_S} s"
    except Exception as e:              # unreachable, or a URL httpx refuses: the others' probes go on
        return failure(e, up.url)
    return None if r.status_code == 200 else f"answered {r.status_code}: {r.text[:200]}"


def health_report(pools: Sequence[Pool]) -> tuple[int, dict[str, Any]]:
    """The proxy's /health -> (status code, body), from what it knows now: 200 while every role has a server
    in rotation whose last /health answered 200, else 503 with the reason (a load balancer's readiness: the
    proxy cannot serve, or, just after its start, does not know yet); each server's last /health answer
    (`healthy`: None before its first), in-flight requests and rotation."""
    now = time.monotonic()

    def state(s: Upstream) -> dict[str, Any]:
        return {"healthy": s.healthy, "in_flight": s.in_flight, "in_rotation": s.down is None,
                **({"out_of_rotation_because": s.down} if s.down is not None else {}),
                "last_health_check_s_ago": None if s.probed_at is None else round(now - s.probed_at, 3)}
    missing = []
    for pool in pools:
        if all(s.down is not None for s in pool.servers):
            missing.append(f"no {pool.role} server in rotation")
        elif not any(s.down is None and s.healthy for s in pool.servers):     # just started: not asked yet
            missing.append(f"no {pool.role} server in rotation has answered its /health with 200 yet")
    body: dict[str, Any] = {"status": "unhealthy" if missing else "ok"}
    if missing:
        body["reason"] = "; ".join(missing)
    body.update({pool.role: {s.url: state(s) for s in pool.servers} for pool in pools})
    return (503 if missing else 200), body


METRICS = (("gigadecode_proxy_upstream_in_flight", "gauge", "Requests the proxy has in flight on the server.",
            lambda s: s.in_flight),
           ("gigadecode_proxy_upstream_in_rotation", "gauge", "1 while the server takes new requests, 0 while it is out "
            "of rotation (unreachable, timed out or failed; back once its /health answers 200).",
            lambda s: int(s.down is None)),
           ("gigadecode_proxy_upstream_requests_total", "counter", "Requests the proxy sent the server.",
            lambda s: s.sent),
           ("gigadecode_proxy_upstream_failures_total", "counter", "Times the server could not be reached, timed out or "
            "failed a request, or left the rotation when its /health failed.", lambda s: s.failures))


def metrics_text(pools: Sequence[Pool]) -> str:
    """The proxy's /metrics (Prometheus text): each server's load, rotation and failures, labelled by role and
    URL."""
    lines = []
    for name, kind, help_, value in METRICS:
        lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}"]
        for pool in pools:
            lines += [f'{name}{{role="{_label(pool.role)}",url="{_label(s.url)}"}} {value(s)}' for s in pool.servers]
    return "\n".join(lines) + "\n"


def _label(value: str) -> str:
    """A Prometheus label value, escaped as the text format wants: a backslash, a double quote and a newline as
    \\\\, \\" and \\n (a URL given on the command line may hold any of them)."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
