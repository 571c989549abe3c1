"""/v1/responses' output items: the reply's pieces, in order, as OpenAI's items and, piece by piece, as the
stream's typed events.

Each harmony message of the reply is an item of its own, as vLLM makes them (`ItemRenderer` reads the reply
with `HarmonyStreamParser(join=False)`, so every piece names its message and channel):

    analysis                          -> a `reasoning` item (each analysis message its own)
    commentary without a recipient    -> a `message` item with `phase: "commentary"` (a preamble); so is any other
                                         text that is not the answer: an unknown channel, a recipient that is
                                         not a function, a call whose arguments are not JSON
    a call (`to=functions.NAME`)      -> a `function_call` item
    final                             -> a `message` item with `phase: "final_answer"` (so is text the model
                                         wrote outside harmony's messages, and all the text of a model without
                                         harmony's tokens)

The openai client's `output_text` joins the text of every message item (a preamble before the answer too);
its `responses.parse` parses only the message whose phase is `final_answer` (or that has none). With
`text.format` the parser's `final_only` puts a preamble with the reasoning, as in chat, so that `output_text`
is the structured answer alone.

In the stream an item opens (`response.output_item.added`, then `response.content_part.added` for a message
or reasoning) when a piece of another message arrives, and closes (`...text.done` or
`response.function_call_arguments.done`, `response.content_part.done`, `response.output_item.done`) before the
next one opens; `output_index` is the item's place in `output`.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .outputs import HarmonyRenderer, Piece


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass(frozen=True)
class MessagePiece(Piece):
    """A piece that names its harmony message (`message`, a number) and that message's channel."""
    message: int | None = None
    channel: str | None = None


class ItemRenderer(HarmonyRenderer):
    """HarmonyRenderer whose pieces name their message: no "\\n" joins, one item per message."""

    def __init__(self, codec: Any, tokens: Any, final_only: bool = False) -> None:
        from ..harmony import HarmonyStreamParser
        self.parser = HarmonyStreamParser(codec, tokens, final_only=final_only, join=False)

    def push(self, token_ids: Sequence[int], finished: bool) -> list[Piece]:
        deltas = [d for t in token_ids for d in self.parser.push(t)]
        if finished:
            deltas += self.parser.finish()
        return [MessagePiece(d.kind, d.text, d.index, d.id, d.name, d.arguments, d.message, d.channel)
                for d in deltas]


def phase(channel: str | None) -> str:
    """A message item's `phase`: the answer (harmony's final channel, or text outside harmony's messages), or
    commentary (anything else: a preamble, an unknown channel)."""
    return "final_answer" if channel in (None, "final") else "commentary"


class OutputItems:
    """The reply's pieces (in order) -> Responses output items, and, pushed piece by piece, the stream's
    events: an item opens when a piece of another kind, another harmony message or another call arrives, and
    closes before the next."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None
        self._key: tuple[Any, ...] | None = None       # what the open item holds: (kind, message, call index)

    def push(self, p: Any) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        kind = "function_call" if p.kind == "tool_call" else "reasoning" if p.kind == "reasoning" else "message"
        key = (kind, getattr(p, "message", None), p.index if kind == "function_call" else None)
        if self._open is None or key != self._key:
            events += self.close()
            events += self._start(kind, p)
            self._key = key
        item, at = self._open, len(self.items) - 1
        assert item is not None
        if kind == "function_call":
            if p.arguments:
                item["arguments"] += p.arguments
                events.append({"type": "response.function_call_arguments.delta", "item_id": item["id"],
                               "output_index": at, "delta": p.arguments})
        elif p.text:
            part = item["content"][0]
            part["text"] += p.text
            kind_ev = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
            ev = {"type": kind_ev, "item_id": item["id"], "output_index": at, "content_index": 0, "delta": p.text}
            events.append({**ev, "logprobs": []} if kind == "message" else ev)
        return events

    def _start(self, kind: str, p: Any) -> list[dict[str, Any]]:
        if kind == "function_call":
            item = {"type": "function_call", "id": new_id("fc"), "call_id": p.id or new_id("call"),
                    "name": p.name or "", "arguments": "", "status": "in_progress"}
        elif kind == "reasoning":
            item = {"type": "reasoning", "id": new_id("rs"), "summary": [],
                    "content": [{"type": "reasoning_text", "text": ""}], "status": "in_progress"}
        else:
            item = {"type": "message", "id": new_id("msg"), "role": "assistant", "status": "in_progress",
                    "phase": phase(getattr(p, "channel", None)),
                    "content": [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]}
        self.items.append(item)
        self._open = item
        at = len(self.items) - 1
        events = [{"type": "response.output_item.added", "output_index": at, "item": _snapshot(item, empty=True)}]
        if kind != "function_call":
            events.append({"type": "response.content_part.added", "item_id": item["id"], "output_index": at,
                           "content_index": 0, "part": {**item["content"][0], "text": ""}})
        return events

    def close(self, status: str = "completed") -> list[dict[str, Any]]:
        item, self._open, self._key = self._open, None, None
        if item is None:
            return []
        item["status"] = status
        at = self.items.index(item)
        events: list[dict[str, Any]] = []
        if item["type"] == "function_call":
            events.append({"type": "response.function_call_arguments.done", "item_id": item["id"],
                           "output_index": at, "arguments": item["arguments"]})
        else:
            part, text_kind = item["content"][0], ("output_text" if item["type"] == "message" else "reasoning_text")
            done = {"type": f"response.{text_kind}.done", "item_id": item["id"], "output_index": at,
                    "content_index": 0, "text": part["text"]}
            events.append({**done, "logprobs": []} if text_kind == "output_text" else done)
            events.append({"type": "response.content_part.done", "item_id": item["id"], "output_index": at,
                           "content_index": 0, "part": dict(part)})
        events.append({"type": "response.output_item.done", "output_index": at, "item": _snapshot(item)})
        return events


def _snapshot(item: dict[str, Any], empty: bool = False) -> dict[str, Any]:
    out = json.loads(json.dumps(item))
    if empty:
        if out["type"] == "function_call":
            out["arguments"] = ""
        else:
            out["content"] = []
    return out
