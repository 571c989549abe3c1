"""Parsing GPT-OSS' harmony output into reasoning, content and tool calls, token by token.

GPT-OSS writes its reply as a sequence of messages, each a header and a body between special tokens:

    <|start|>assistant<|channel|>analysis<|message|>REASONING<|end|>
    <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{"a": 1}<|call|>
    <|start|>assistant to=functions.NAME<|channel|>commentary json<|message|>{"a": 1}<|call|>
    <|start|>assistant<|channel|>final<|message|>ANSWER<|return|>

The prompt ends with `<|start|>assistant`, so the completion's first message starts at its header's
remainder (`<|channel|>...` or ` to=functions.NAME<|channel|>...`). The header holds the role, an
optional recipient (`to=...`, before or after `<|channel|>`), the channel name and an optional content
type (`json` or `<|constrain|>json`). A body ends with `<|end|>`, `<|call|>` (a tool call: the engine
stops there) or `<|return|>` (the last message). Where the body goes:

    recipient `functions.NAME`  -> a tool call NAME(arguments = the body, a JSON string), any channel
    channel `analysis`          -> reasoning_content
    anything else               -> content (`final`, `commentary` without recipient = a preamble shown to
                                   the user, an unknown channel, a recipient that is not a function)

With `final_only` (a chat reply whose answer structured output holds: `response_format`, `guided_json`, ...)
content is the `final` message's text alone, the text the grammar held, so that it parses; the other messages
that are not calls (a preamble, an unknown channel) go with the reasoning. Without it a preamble would be
joined to the JSON answer (`Let me answer.\n{"a": 1}`), which OpenAI's `parse` helpers cannot read.

The state machine (`HarmonyStreamParser.push`), over token ids; the special tokens are looked up by name:

    HEADER  collect header tokens; <|message|> -> BODY. At the completion's start the header is implicit:
            text that cannot begin a header (anything but whitespace and `to=...`) is plain text the model
            wrote without harmony tokens -> IDLE, as content.
    BODY    detokenize (one StreamDecoder per message, so multi-byte characters survive token splits) and
            stream reasoning / content; a tool call's arguments are held until the call ends.
            <|end|> / <|call|> / <|return|> -> IDLE; <|start|> / <|channel|> -> HEADER (unterminated body).
    IDLE    between messages; <|start|> / <|channel|> -> HEADER, <|message|> -> BODY (empty header);
            stray text -> content.

Malformed output never raises:
* output that ends mid-body (max_tokens) keeps what was written, in its channel (`finish()` flushes it);
* a header that never reaches `<|message|>` becomes content (its text, special tokens dropped);
* a tool call whose arguments are not valid JSON (or that names no function) becomes content: the raw
  text of the call, `functions.NAME ARGS` (what vLLM does too). To decide that before anything is sent,
  a call's arguments are streamed as ONE delta when the call ends, not token by token;
* separate messages of the same kind are joined with "\\n" (in the stream as in `result()`), unless the parser
  is made with `join=False`: then every delta names the message it comes from (`Delta.message`, 0, 1, ... in
  the order the reply wrote them, text outside any message counted as one) and its `channel`, and no "\\n" is
  added; /v1/responses makes each message an output item of its own that way.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Literal

from .tokenizer import StreamDecoder, TextCodec

_NAMES = {"start": "<|start|>", "end": "<|end|>", "message": "<|message|>", "channel": "<|channel|>",
          "constrain": "<|constrain|>", "return_": "<|return|>", "call": "<|call|>"}
_FUNCTIONS = "functions."


def parse_header(ids: Iterable[int], decode: Callable[[list[int]], str], channel_id: int,
                 constrain_id: int) -> tuple[str | None, str | None]:
    """(channel, recipient) of a message header's ids (`<|channel|>` and `<|constrain|>` included, as markers
    that split words): the first word after `<|channel|>` that is not `to=…`, and the `to=` recipient
    wherever it stands (`assistant to=functions.x<|channel|>commentary` or `commentary to=functions.x`)."""
    parts: list[list[int]] = [[]]  # split at the markers: [role/recipient, channel ..., constrain ...]
    marks: list[int | None] = [None]
    for i in ids:
        if i in (channel_id, constrain_id):
            parts.append([])
            marks.append(i)
        else:
            parts[-1].append(i)
    words = [(m, decode(p).split()) for m, p in zip(marks, parts)]
    recipient = next((w[3:] for _, ws in words for w in ws if w.startswith("to=")), None)
    channel = next((w for m, ws in words if m == channel_id for w in ws if not w.startswith("to=")), None)
    return channel, recipient


@dataclass(frozen=True)
class HarmonyTokens:
    """The ids of the harmony special tokens in one tokenizer."""

    start: int
    end: int
    message: int
    channel: int
    constrain: int
    return_: int
    call: int

    @classmethod
    def from_codec(cls, codec: TextCodec | None) -> HarmonyTokens | None:
        """The codec's harmony ids, or None when it lacks any of them (then serve plain text)."""
        if codec is None:
            return None
        ids = {field_: codec.token_id(name) for field_, name in _NAMES.items()}
        if any(i is None for i in ids.values()) or len(set(ids.values())) != len(ids):
            return None
        return cls(**ids)  # type: ignore[arg-type]


@dataclass(frozen=True)
class ToolCall:
    id: str            # "call_" + 24 hex digits, unique per call
    name: str          # the function's name, without "functions."
    arguments: str     # the JSON text exactly as the model wrote it, stripped


@dataclass(frozen=True)
class Delta:
    """One streamed piece. reasoning/content: `text`. tool_call: `index` (0, 1, ... per well-formed call),
    `id` and `name` (set on the call's first delta) and an `arguments` fragment; `text` is "". `message`: the
    number of the harmony message it comes from (a new number: a new message), `channel`: that message's
    channel (None for text outside any harmony message)."""

    kind: Literal["reasoning", "content", "tool_call"]
    text: str = ""
    index: int | None = None
    id: str | None = None
    name: str | None = None
    arguments: str | None = None
    message: int | None = None
    channel: str | None = None


@dataclass
class ParsedMessage:
    reasoning_content: str | None = None
    content: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)


def new_tool_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _could_be_header(text: str) -> bool:
    """Whether text may still be the start of the completion's implicit header (` to=functions.X`)."""
    s = text.lstrip()
    return s.startswith("to=") or "to=".startswith(s)


class _Body:
    """The message being read: where its text goes, and its own detokenizer."""

    def __init__(self, codec: TextCodec, kind: str, number: int, recipient: str | None = None,
                 channel: str | None = None) -> None:
        self.kind = kind            # "reasoning" | "content" | "tool"
        self.number = number        # the message's place in the reply (Delta.message)
        self.recipient, self.channel = recipient, channel
        self.decoder = StreamDecoder(codec)
        self.held: list[str] = []   # a tool call's arguments, until the call ends
        self.started = False        # has any text of this message gone out (for the "\n" joins)


_HEADER, _BODY, _IDLE = "header", "body", "idle"


class HarmonyStreamParser:
    """Feed it the completion's token ids (`push` one at a time, or `push_many`); `finish()` at the end;
    `result()` for the whole message. The deltas, concatenated, are exactly `result()`."""

    def __init__(self, codec: TextCodec, tokens: HarmonyTokens,
                 new_id: Callable[[], str] = new_tool_call_id, final_only: bool = False, join: bool = True) -> None:
        self.codec, self.t, self._new_id = codec, tokens, new_id
        self._final_only = final_only    # content is the final channel's text alone (see the module's doc)
        self._join = join                # a later message of a kind starts with "\n" (see the module's doc)
        self._messages = 0               # messages (and runs of text outside them) opened so far
        self._terminators = frozenset((tokens.end, tokens.return_, tokens.call))
        self._state = _HEADER
        self._implicit = True            # the first header: its "<|start|>assistant" was in the prompt
        self._header: list[int] = []     # header ids, <|channel|> / <|constrain|> markers included
        self._body: _Body | None = None  # the message (or stray text run, kind "content") being read
        self._text: dict[str, list[str]] = {"reasoning": [], "content": []}
        self._calls: list[ToolCall] = []
        self._last: int | None = None
        self._finished = False
        self.reasoning_tokens = 0        # tokens of reasoning bodies so far (usage's reasoning_tokens)

    # --- feeding ---------------------------------------------------------------------------------

    def push(self, token_id: int) -> list[Delta]:
        out: list[Delta] = []
        if self._finished:
            return out
        t, tok = self.t, token_id
        self._last = tok
        if self._state == _HEADER:
            if tok == t.message:
                self._open_body()
            elif tok in (t.channel, t.constrain):
                self._header.append(tok)
                self._implicit = False
            elif tok == t.start or tok in self._terminators:
                self._header_as_content(out)
                self._state, self._implicit = (_HEADER if tok == t.start else _IDLE), False
            elif tok not in self.codec.special_ids:
                self._header.append(tok)
                if self._implicit and not _could_be_header(self.codec.decode(self._header)):
                    # Plain text without harmony tokens: stream it as content from here on.
                    self._state, self._implicit, self._body = _IDLE, False, self._new_body("content")
                    for i in self._header:
                        self._emit(out, self._body, self._body.decoder.push(i))
                    self._header = []
        elif tok in self._terminators or tok in (t.start, t.channel):
            self._close_body(out)
            self._state = _HEADER if tok in (t.start, t.channel) else _IDLE
            self._header = [tok] if tok == t.channel else []
        elif self._state == _IDLE and tok == t.message:  # a body without any header: content
            self._close_body(out)
            self._state, self._body = _BODY, self._new_body("content")
        elif tok not in self.codec.special_ids:          # body text, or stray text between messages
            if self._body is None:
                self._body = self._new_body("content")
            self.reasoning_tokens += self._body.kind == "reasoning"
            self._emit(out, self._body, self._body.decoder.push(tok))
        return out

    def push_many(self, token_ids: Iterable[int]) -> list[Delta]:
        return [d for i in token_ids for d in self.push(i)]

    def finish(self) -> list[Delta]:
        """The end of the output: flush an unterminated body. A header the end cut short (max_tokens within
        `<|channel|>final`, say) is dropped: it is harmony's framing, not text, unless it is plain text that
        only looked like a header's start (no harmony marker yet). Later calls return []."""
        out: list[Delta] = []
        if not self._finished:
            if self._state == _HEADER and self._implicit:
                self._header_as_content(out)
            self._header = []
            self._close_body(out)
            self._finished = True
        return out

    # --- results ---------------------------------------------------------------------------------

    def result(self) -> ParsedMessage:
        """The whole parsed message (finishes the parser first if needed)."""
        self.finish()
        return ParsedMessage(reasoning_content="".join(self._text["reasoning"]) or None,
                             content="".join(self._text["content"]) or None, tool_calls=list(self._calls))

    @property
    def tool_calls(self) -> list[ToolCall]:
        return list(self._calls)

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """"tool_calls" when a well-formed call was parsed and the engine stopped on a stop token (the
        call's <|call|>, or <|return|>), else the engine's reason."""
        stopped = engine_reason == "stop" or self._last in (self.t.call, self.t.return_)
        if self._calls and stopped and engine_reason not in ("abort", "error"):
            return "tool_calls"
        return engine_reason

    # --- internals -------------------------------------------------------------------------------

    def _emit(self, out: list[Delta], body: _Body, piece: str) -> None:
        if not piece:
            return
        if body.kind == "tool":
            body.held.append(piece)
            return
        acc = self._text[body.kind]
        if self._join and not body.started and acc:
            piece = "\n" + piece  # a new message of a kind that already has text
        body.started = True
        acc.append(piece)
        out.append(Delta(body.kind, piece, message=body.number, channel=body.channel))  # type: ignore[arg-type]

    def _parse_header(self) -> tuple[str | None, str | None]:
        """(channel, recipient) of the header collected so far."""
        return parse_header(self._header, self.codec.decode, self.t.channel, self.t.constrain)

    def _open_body(self) -> None:
        channel, recipient = self._parse_header()
        if recipient is not None and recipient.startswith(_FUNCTIONS):
            kind = "tool"
        elif self._final_only:
            kind = "content" if channel == "final" else "reasoning"
        else:
            kind = "reasoning" if channel == "analysis" else "content"
        self._body = self._new_body(kind, recipient, channel)
        self._state, self._header, self._implicit = _BODY, [], False

    def _new_body(self, kind: str, recipient: str | None = None, channel: str | None = None) -> _Body:
        self._messages += 1
        return _Body(self.codec, kind, self._messages - 1, recipient, channel)

    def _header_as_content(self, out: list[Delta]) -> None:
        """A header cut short (no <|message|>): its text is content."""
        self._close_body(out)
        if self._header:
            self._emit(out, self._new_body("content"), self.codec.decode(self._header))
        self._header = []

    def _close_body(self, out: list[Delta]) -> None:
        body, self._body = self._body, None
        if body is None:
            return
        self._emit(out, body, body.decoder.flush())
        if body.kind != "tool":
            return
        name = (body.recipient or "")[len(_FUNCTIONS):]
        args = "".join(body.held).strip()
        try:
            json.loads(args)
            ok = bool(name)
        except ValueError:
            ok = False
        if not ok:  # not a usable call: its raw text as content
            self._emit(out, self._new_body("content", None, body.channel), f"{body.recipient} {args}".rstrip())
            return
        call = ToolCall(self._new_id(), name, args)
        out.append(Delta("tool_call", index=len(self._calls), id=call.id, name=name, arguments=args,
                         message=body.number, channel=body.channel))
        self._calls.append(call)


def parse_harmony(codec: TextCodec, tokens: HarmonyTokens, token_ids: Iterable[int]) -> ParsedMessage:
    """The whole completion at once."""
    p = HarmonyStreamParser(codec, tokens)
    p.push_many(token_ids)
    return p.result()
