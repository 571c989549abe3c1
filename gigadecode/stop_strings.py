"""OpenAI `stop` strings on a choice's decoded text: `StopMatcher`.

Stop strings are matched on the text as it is rendered, across token boundaries: text that could still
become a stop string is held back until it cannot (or the sequence ends). The first match ends the choice;
what follows it is cut, and so is the match itself unless the request asked for vLLM's
`include_stop_str_in_output`, which keeps the text up to the end of the stop string (streamed too: the held
back text comes out with the match). Text pushed as `protected` (that of a request's first `min_tokens`
tokens) may start a match but not end one (vLLM's rule).
"""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    """Cuts content at the first stop string, across pushes; `include`: keep the stop string itself."""

    def __init__(self, stops: Sequence[str], include: bool = False) -> None:
        self.stops = [s for s in stops if s]
        self.include = include
        self.held = ""
        self.hit = False
        self.matched: str | None = None    # the stop string that ended the text
        self._base = 0              # where `held` starts in the content pushed so far
        self._min_end = 0           # a match must end past this position

    def push(self, text: str, protected: bool = False) -> str:
        if not self.stops or self.hit:
            return "" if self.hit else text
        buf = self.held + text
        if protected:
            self._min_end = self._base + len(buf)
        found = [(i, s) for i, s in ((buf.find(s, max(0, self._min_end - self._base - len(s) + 1)), s)
                                     for s in self.stops) if i >= 0]
        if found:
            self.hit, self.held = True, ""
            at = min(i for i, _ in found)
            # the earliest match ends the text; among stop strings matching there, the first listed
            self.matched = next(s for i, s in found if i == at)
            return buf[:at + len(self.matched)] if self.include else buf[:at]
        keep = 0                                  # longest tail of buf that starts some stop string
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), keep, -1):
                if s.startswith(buf[-k:]):
                    keep = k
                    break
        self.held = buf[len(buf) - keep:] if keep else ""
        self._base += len(buf) - keep
        return buf[:len(buf) - keep]

    def flush(self) -> str:
        out, self.held = ("" if self.hit else self.held), ""
        return out
