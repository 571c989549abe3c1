"""What `gigadecode proxy` knows of its upstream servers' health: the background probe that asks the servers
out of rotation for their /health (a 200 puts one back: `Pool.mark_up`), the proxy's own /health report,
and its /metrics (Prometheus text: each server's load, rotation and failures, labelled by role and URL).
Which server takes a request, and when one leaves the rotation, is `proxy_pool`'s.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import httpx

from .proxy_pool import Pool, Upstream

PROBE_S, PROBE_TIMEOUT_S = 1.0, 2.0     # how often, and how long, a server out of rotation is asked for /health
INFO_TIMEOUT_S = 5.0                    # how long a server may take to answer the proxy's own /health


async def probe_down_servers(http: httpx.AsyncClient, pools: Sequence[Pool]) -> None:
    """Every PROBE_S, ask each server out of rotation for its /health; a 200 puts it back."""
    async def probe(pool: Pool, up: Upstream) -> None:
        try:
            ok = (await http.get(up.url + "/health", timeout=PROBE_TIMEOUT_S)).status_code == 200
        except httpx.HTTPError:
            ok = False
        if ok:
            pool.mark_up(up)
    while True:
        await asyncio.sleep(PROBE_S)
        await asyncio.gather(*(probe(pool, up) for pool in pools for up in pool.servers if up.down is not None))


async def health_report(http: httpx.AsyncClient, prefills: Pool, decodes: Pool) -> tuple[int, dict[str, Any]]:
    """The proxy's /health -> (status code, body): each upstream's /health (a 200 puts it back into rotation),
    in-flight requests and rotation; 200 while a prefill and a decode server are healthy, else 503."""
    async def check(up: Upstream) -> bool:
        try:
            return (await http.get(up.url + "/health", timeout=INFO_TIMEOUT_S)).status_code == 200
        except httpx.HTTPError:
            return False
    servers = prefills.servers + decodes.servers
    ok = await asyncio.gather(*(check(s) for s in servers))
    status = dict(zip((s.url for s in servers), ok))
    p_ok = any(status[s.url] for s in prefills.servers)
    d_ok = any(status[s.url] for s in decodes.servers)
    for pool in (prefills, decodes):
        for s in pool.servers:
            if status[s.url]:
                pool.mark_up(s)

    def state(s: Upstream) -> dict[str, Any]:
        return {"healthy": status[s.url], "in_flight": s.in_flight, "in_rotation": s.down is None,
                **({"out_of_rotation_because": s.down} if s.down is not None else {})}
    body = {"status": "ok" if p_ok and d_ok else "unhealthy",
            "prefill": {s.url: state(s) for s in prefills.servers},
            "decode": {s.url: state(s) for s in decodes.servers}}
    return (200 if p_ok and d_ok else 503), body


METRICS = (("gigadecode_proxy_upstream_in_flight", "gauge", "Requests the proxy has in flight on the server.",
            lambda s: s.in_flight),
           ("gigadecode_proxy_upstream_in_rotation", "gauge", "1 while the server takes new requests, 0 while it is out "
            "of rotation (unreachable, timed out or failed; back once its /health answers 200).",
            lambda s: int(s.down is None)),
           ("gigadecode_proxy_upstream_requests_total", "counter", "Requests the proxy sent the server.",
            lambda s: s.sent),
           ("gigadecode_proxy_upstream_failures_total", "counter", "Times the server could not be reached, timed out or "
            "failed a request.", lambda s: s.failures))


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
