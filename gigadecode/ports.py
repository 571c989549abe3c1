"""Free TCP ports on loopback for the servers and worlds this process starts (the demo, local worlds, tests).

A port the kernel hands out for `bind(port 0)` comes from the ephemeral range that outgoing connections
draw from too, so between its release and the server's bind a connection (an HTTP client, gloo, UCX) can
take it, and two such calls in a row can return the same port. `free_port` picks below that range instead,
checks that the port binds, and never hands out the same port twice in one process.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

LOWEST = 20000                       # below: well-known and registered services more often listen
_given: set[int] = set()
_rng = random.SystemRandom()


def _ephemeral_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768                 # Linux's default range starts here


def _binds(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A port on `host` that nothing listens on, outside the ephemeral range where it can."""
    top = _ephemeral_start() - 1
    if top - LOWEST >= 1000:
        for _ in range(256):
            port = _rng.randint(LOWEST, top)
            if port not in _given and _binds(host, port):
                _given.add(port)
                return port
    while True:                      # no room below the ephemeral range: the kernel's pick, not one we gave
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port not in _given:
            _given.add(port)
            return port
