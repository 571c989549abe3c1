"""How the DI proxy names the prefills it sends, shared by the proxy and the API server: the header, its
valid values and the request ids a named prefill may run under. Imports nothing heavy: the proxy process
runs without torch."""

from __future__ import annotations

import re
from typing import Any

# The DI proxy names each prefill it sends (32 hex digits, fresh for each): if its own client leaves before the
# answer reaches it, it cannot know whether the prefill answered (and leased its KV), so it asks /kv/release to
# end the request of that name, running or leased (`handoff_ids`)
HANDOFF_HEADER = "x-gigadecode-handoff"
_HANDOFF = re.compile(r"[0-9a-f]{32}")
HANDOFF_PREFIXES = ("cmpl", "chatcmpl", "resp")       # the generation routes' request id prefixes


def valid_handoff(handoff: Any) -> bool:
    return isinstance(handoff, str) and _HANDOFF.fullmatch(handoff) is not None


def handoff_ids(handoff: str) -> list[str]:
    """The request ids a prefill named `handoff` may have (one per generation route)."""
    return [f"{p}-handoff-{handoff}" for p in HANDOFF_PREFIXES]
