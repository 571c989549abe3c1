"""Which upstream server takes a proxied request (`gigadecode proxy`, `proxy.py`): the servers of one role
(`Pool`), the least loaded first, and the prefix affinity of prefill servers (`prefix_keys`): a prompt goes
where its leading chunks went before, so a prefill server with prefix caching finds them in its own pool.

A server the proxy could not reach, or that timed out or dropped a request, is out of rotation
(`mark_down`, also when the proxy's probe finds its /health failing): the others take the new requests
until its /health answers 200 again (`mark_up`, from the probe), so a dead or wedged server costs at most the
request that found it so, not one request in every few after it. When every server of a role is out, they
are all tried as before.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx

log = logging.getLogger("gigadecode.proxy")

# Prefix affinity (prefill servers): prompts are keyed by chunks of this many bytes (at most so many chunks);
# the server holding a prompt's prefix keeps it while at most AFFINITY_SLACK requests busier than the least
# loaded; the proxy remembers this many keys
AFFINITY_CHUNK, AFFINITY_MAX_CHUNKS, AFFINITY_SLACK, AFFINITY_ENTRIES = 256, 512, 2, 1 << 17


@dataclass
class Upstream:
    url: str
    in_flight: int = 0
    sent: int = 0
    down: str | None = None              # why it is out of rotation (None: in rotation)
    failures: int = 0                    # times it left the rotation, or failed while out of it
    healthy: bool | None = None          # its last /health answered 200 (None: not asked yet)
    probed_at: float | None = None       # when its last /health probe ended (time.monotonic())


def upstream_url(role: str, url: str) -> str:
    """`url` as the proxy joins paths to it (no trailing slash), refused at start unless it is an http(s) URL
    of a host (a path prefix allowed), with a valid port and no query, fragment, spaces or control characters
    (a typo otherwise failed every request it took)."""
    if not isinstance(url, str) or any(ord(c) < 0x21 or c == "\x7f" for c in url):
        raise ValueError(f"{role} server URL {url!r}: spaces or control characters")
    try:
        parsed = httpx.URL(url.rstrip("/"))
    except (httpx.InvalidURL, TypeError) as e:
        raise ValueError(f"{role} server URL {url!r}: {e}") from None
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ValueError(f"{role} server URL {url!r}: expected http://HOST:PORT or https://HOST:PORT")
    if parsed.port is not None and not 0 < parsed.port < 65536:
        raise ValueError(f"{role} server URL {url!r}: port {parsed.port} is not in 1-65535")
    if parsed.query or parsed.fragment:
        raise ValueError(f"{role} server URL {url!r}: a query or fragment has no place in a server's URL")
    return url.rstrip("/")


class Pool:
    """The servers of one role; `pick` takes the least loaded one not yet tried, or, given a request's prefix
    keys (`prefix_keys`), the server that last took the longest of them while it is at most AFFINITY_SLACK
    requests busier than the least loaded: a prefill server with prefix caching then finds the prompt's
    earlier blocks (a system prompt, a conversation's earlier turns) in its own pool."""

    def __init__(self, role: str, urls: Sequence[str]) -> None:
        if not urls:
            raise ValueError(f"the proxy needs at least one {role} server")
        self.role = role
        self.servers = [Upstream(upstream_url(role, u)) for u in urls]
        self.owner: OrderedDict[bytes, Upstream] = OrderedDict()     # prefix key -> the server that last took it

    def pick(self, exclude: Sequence[Upstream] = (), keys: Sequence[bytes] = ()) -> Upstream | None:
        """The server for a request (None: every one is in `exclude`): those in rotation first, the servers out
        of it only when no other is left."""
        left = [(s.in_flight, s.sent, i, s) for i, s in enumerate(self.servers) if s not in exclude]
        left = [t for t in left if t[3].down is None] or left
        if not left:
            return None
        s = min(left, key=lambda t: t[:3])[3]
        for key in reversed(keys):                   # the longest shared prefix first
            o = self.owner.get(key)
            if o is not None:
                if any(o is t[3] for t in left) and o.in_flight <= s.in_flight + AFFINITY_SLACK:
                    s = o
                break
        for key in keys:
            self.owner[key] = s
            self.owner.move_to_end(key)
        while len(self.owner) > AFFINITY_ENTRIES:
            self.owner.popitem(last=False)
        s.sent += 1
        return s

    def mark_down(self, up: Upstream, why: str) -> None:
        """Take `up` out of rotation (it could not be reached, timed out or dropped a request, or its /health
        failed)."""
        if up.down is None:
            log.warning("%s server %s is out of rotation until its /health answers 200: %s", self.role, up.url, why)
        up.down = why
        up.failures += 1

    def still_down(self, up: Upstream, why: str) -> None:
        """`up`, out of rotation, failed its /health again: `why` is now its reason (what keeps it out, not what
        took it out), logged when it says something new: a server that refused connections while it started
        and now refuses the proxy's TLS is told as such, not as still refusing connections."""
        if _gist(why) != _gist(up.down or ""):
            log.warning("%s server %s is still out of rotation: %s", self.role, up.url, why)
        up.down = why

    def mark_up(self, up: Upstream) -> None:
        """Put `up` back into rotation (its /health answered 200, or it served a request)."""
        if up.down is not None:
            log.warning("%s server %s is back in rotation", self.role, up.url)
        up.down = None


def _gist(why: str) -> str:
    """A reason without its numbers (a time, a count): a change of the number alone is nothing new."""
    return re.sub(r"\d+", "#", why)


def prefix_keys(body: dict[str, Any]) -> list[bytes]:
    """Keys of a request's leading prompt chunks (AFFINITY_CHUNK characters of its tools, instructions, messages,
    input or prompt, in that order, each message on its own): key k names everything up to chunk k, so two
    requests whose prompts agree on k chunks share k keys."""
    parts = []
    for name in ("tools", "instructions", "messages", "input", "prompt"):
        v = body.get(name)
        if v is None:
            continue
        if name in ("messages", "input") and isinstance(v, list):
            parts += [json.dumps(m, sort_keys=True) for m in v]
        else:
            parts.append(json.dumps(v, sort_keys=True))
    text = "\x1e".join(parts).encode()
    n = min(len(text) // AFFINITY_CHUNK, AFFINITY_MAX_CHUNKS)
    h, keys = hashlib.blake2b(digest_size=16), []
    for k in range(n):
        h.update(text[k * AFFINITY_CHUNK:(k + 1) * AFFINITY_CHUNK])
        keys.append(h.copy().digest())
    return keys
