"""`POST /v1/responses`: OpenAI's Responses API, the one GPT-OSS's own guides use, over the chat route's
machinery. The input items become chat messages rendered by the checkpoint's chat template (`instructions`
as a developer message, a developer or system message that opens the input appended to it;
`function_call` / `function_call_output` items as a call and the tool's answer, `reasoning` items as the
next assistant turn's analysis, an assistant message right before a call, its preamble, as part of that call's
turn; another assistant message with `phase: "commentary"` goes to the template with `channel: "commentary"`,
which this project's harmony template renders as a commentary message and GPT-OSS's published one, which has
no such message, as a final one). Each harmony message of the reply becomes an output item of its own, in
order (`response_items`): analysis -> a `reasoning` item, a preamble -> a `message` with `phase:
"commentary"`, a call -> a `function_call` item, final -> a `message` with `phase: "final_answer"` (with
`text.format` a preamble goes to the reasoning, as in chat, so the only message is the structured answer).
Streamed, the same items come as OpenAI's typed events (`response.output_item.added`,
`response.reasoning_text.delta`, `response.output_text.delta`, `response.function_call_arguments.done`, ...,
`response.completed`).

The server keeps nothing: `previous_response_id`, `conversation`, a stored `prompt` and `background` are
refused (send the whole conversation as `input`), as are built-in tools (web search, file search, code
interpreter, MCP) and non-text inputs.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import Field, StrictBool, StrictInt, StrictStr

from ..connector.params import KVTransferParams
from . import deps
from .chat import chat_prompt
from .outputs import Choice, TextRenderer, error_kind, merge, run_to_end, start
from .protocol import (APIError, ChatBody, _Model, errors_named, forced_call, parse, read_json,
                       request_priority, sampling_params)
from .response_items import ItemRenderer, OutputItems, new_id

router = APIRouter()
log = logging.getLogger("gigadecode.server")

TEXT_PARTS = ("input_text", "output_text", "text")


class ResponsesBody(_Model):
    model: StrictStr | None = None
    input: StrictStr | list[dict[str, Any]]
    instructions: StrictStr | None = None
    max_output_tokens: StrictInt | None = Field(default=None, ge=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: StrictStr | dict[str, Any] | None = "auto"
    reasoning: dict[str, Any] | None = None
    stream: StrictBool | None = False
    previous_response_id: StrictStr | None = None
    background: StrictBool | None = False
    text: dict[str, Any] | None = None
    include: list[StrictStr] | None = None
    top_logprobs: StrictInt | None = None
    truncation: Literal["disabled"] | None = "disabled"
    kv_transfer_params: KVTransferParams | None = None     # DI, as on the other routes (the proxy sends them)


def _refuse(req: ResponsesBody) -> None:
    """400 for what a stateless server over a harmony model cannot do (naming the field)."""
    if req.previous_response_id is not None:
        raise APIError(400, "this server keeps no responses: send the whole conversation as `input`",
                       param="previous_response_id")
    if req.background:
        raise APIError(400, "background responses are not supported", param="background")
    # what a server keeps would be part of the prompt: a stored conversation's items, a stored prompt template
    for field_, what in (("conversation", "conversations"), ("prompt", "prompt templates")):
        if getattr(req, field_, None) is not None:
            raise APIError(400, f"this server keeps no {what}: send the whole conversation as `input` (and "
                                f"the instructions as `instructions`)", param=field_)
    for i, what in enumerate(req.include or ()):
        if what != "reasoning.encrypted_content":   # agents ask for it with store=false: the reasoning is in
            raise APIError(400, f"include {what!r} is not supported", param=f"include.{i}")   # plain text here
    if req.top_logprobs:
        raise APIError(400, "top_logprobs are not supported on /v1/responses (use /v1/chat/completions)",
                       param="top_logprobs")


def _guided(req: ResponsesBody, scope: str) -> tuple[str, str, str] | None:
    """`text.format`: text, json_object, or json_schema ({"type": "json_schema", "name", "schema", "strict"})."""
    fmt = (req.text or {}).get("format")
    if fmt is None or fmt == {"type": "text"}:
        return None
    if isinstance(fmt, dict) and fmt.get("type") == "json_object":
        return ("json_object", "", scope)
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema" and isinstance(fmt.get("schema"), dict):
        return ("json", json.dumps(fmt["schema"]), scope)
    raise APIError(400, "text.format must be text, json_object or json_schema (with a `schema` object)",
                   param="text.format")


def _text(content: Any, where: str) -> str:
    """A message's content (a string or text parts) as text."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where}: content must be a string or a list of text parts", param=where)
    out = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise APIError(400, f"{where}.{j}: only text parts are supported (got {kind!r})", param=f"{where}.{j}")
        out.append(part["text"])
    return "".join(out)


def chat_messages(req: ResponsesBody) -> list[dict[str, Any]]:
    """The input items (and instructions) as chat messages."""
    items = [{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
    messages: list[dict[str, Any]] = []
    if req.instructions:
        messages.append({"role": "developer", "content": req.instructions})
    thinking: str | None = None                      # a reasoning item: the next assistant turn's analysis

    def assistant(m: dict[str, Any]) -> dict[str, Any]:
        nonlocal thinking
        if thinking is not None:
            m["reasoning_content"], thinking = thinking, None
        return m

    for i, it in enumerate(items):
        where = f"input.{i}"
        kind = it.get("type", "message")
        if kind == "message":
            role = it.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise APIError(400, f"{where}: role must be user, system, developer or assistant (got {role!r})",
                               param=f"{where}.role")
            m = {"role": role, "content": _text(it.get("content"), f"{where}.content")}
            if i == 0 and req.instructions and role in ("system", "developer"):
                messages[0]["content"] += "\n\n" + m["content"]    # the template reads one developer message
                continue
            if role != "assistant":
                thinking = None                      # reasoning no output followed in its turn
            elif it.get("phase") == "commentary":    # a preamble: for a template that renders harmony's channel
                m["channel"] = "commentary"
            messages.append(assistant(m) if role == "assistant" else m)
        elif kind == "function_call":
            name, args, call_id = it.get("name"), it.get("arguments", "{}"), it.get("call_id")
            if not isinstance(name, str) or not isinstance(args, str) or not isinstance(call_id, str):
                raise APIError(400, f"{where}: a function_call needs string name, arguments and call_id", param=where)
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
            prev, last = (items[i - 1] if i else {}), (messages[-1] if messages else {})
            if (prev.get("type", "message") == "message" and prev.get("role") == "assistant"
                    and last.get("role") == "assistant" and "tool_calls" not in last):
                # the preamble the model wrote before this call: one turn, as chat answers it (content, reasoning,
                # call), so that the reasoning stays before the call and the preamble is no final answer
                last.pop("channel", None)
                assistant(last)["tool_calls"] = [call]
            else:
                messages.append(assistant({"role": "assistant", "content": None, "tool_calls": [call]}))
        elif kind == "function_call_output":
            out, call_id = it.get("output"), it.get("call_id")
            if not isinstance(call_id, str):
                raise APIError(400, f"{where}: a function_call_output needs a string call_id", param=where)
            messages.append({"role": "tool", "tool_call_id": call_id,
                             "content": out if isinstance(out, str) else _text(out, f"{where}.output")})
        elif kind == "reasoning":
            parts = it.get("content") or it.get("summary") or []
            if not isinstance(parts, list) or not all(isinstance(p, dict) and isinstance(p.get("text", ""), str)
                                                      for p in parts):
                raise APIError(400, f"{where}: a reasoning item's content (or summary) must be a list of "
                                    f"{{\"text\": string}} parts", param=f"{where}.content")
            text = "".join(p.get("text", "") for p in parts)
            thinking = text if thinking is None else thinking + "\n" + text    # one turn's analysis messages
        else:
            raise APIError(400, f"{where}: input items of type {kind!r} are not supported", param=f"{where}.type")
    return messages


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses' flat function tools as chat's ({"type": "function", "function": {...}})."""
    if not tools:
        return None
    out = []
    for i, t in enumerate(tools):
        if t.get("type") != "function":
            raise APIError(400, f"tools.{i}: only function tools are supported (got {t.get('type')!r})",
                           param=f"tools.{i}.type")
        out.append({"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters")
                                                     if t.get(k) is not None}})
    return out


def _responses_param(e: APIError) -> APIError:
    """A 400 about the chat messages or tools the body became names the Responses field they came from:
    `messages...` -> `input`, `tools.N.function.X` -> `tools.N.X` (Responses' tools are flat)."""
    p = e.param or ""
    if p == "messages" or p.startswith("messages."):
        new = "input"
    elif re.fullmatch(r"tools\.\d+\.function(\..+)?", p):
        new = p.replace(".function", "", 1)
    else:
        return e
    if e.message.startswith(p):
        e.message = new + e.message[len(p):]
    e.param = new
    return e


@router.post("/v1/responses", dependencies=[Depends(deps.check_key)])
async def responses(request: Request) -> Response:
    raw = await read_json(request)
    req = parse(ResponsesBody, raw)
    deps.check_model(request, req.model)
    _refuse(req)
    aeng, name = deps.engine(request), deps.answer_model(request, req.model)
    codec = aeng.codec
    if codec is None:
        raise APIError(400, "this model has no tokenizer, so it cannot take messages; use /v1/completions "
                            "with token ids", param="input")
    effort = (req.reasoning or {}).get("effort")
    effort = "low" if effort == "minimal" else effort         # GPT-OSS's lowest
    if effort not in (None, "low", "medium", "high"):
        raise APIError(400, f"reasoning.effort must be minimal, low, medium or high (got {effort!r})",
                       param="reasoning.effort")
    try:
        chat = parse(ChatBody, {"messages": chat_messages(req), "tools": chat_tools(req.tools),
                                "tool_choice": "none" if req.tool_choice == "none" else "auto",
                                "reasoning_effort": effort})
        prompt = await asyncio.to_thread(chat_prompt, codec, chat)
    except APIError as e:
        raise _responses_param(e) from None
    max_tokens = req.max_output_tokens or max(1, aeng.max_model_len - len(prompt))
    from ..harmony import HarmonyTokens
    tokens = HarmonyTokens.from_codec(codec)
    structured = _guided(req, "final" if tokens is not None else "all")
    guided = forced_call(raw, chat_tools(req.tools), False, tokens is not None, structured)
    final_only = structured is not None       # the message is the structured answer alone (no preamble)
    # a grammar that does not compile: text.format's schema, or a forced call's tool parameters
    with errors_named("max_tokens", "max_output_tokens"), \
            errors_named("guided", "text.format" if guided is structured else "tools"):
        params = sampling_params(raw, max_tokens, None, deps.sampling_defaults(aeng), None, guided)
        kv = deps.advertised(request, req.kv_transfer_params)
        _, choices = await start(aeng, [prompt], params, "resp", 1, kv, "input",
                                 lambda: (ItemRenderer(codec, tokens, final_only) if tokens is not None
                                          else TextRenderer(codec)),
                                 [], priority=request_priority(raw),
                                 request_id=deps.handoff_request_id(request, "resp", kv))
    c = choices[0]
    head = {"id": new_id("resp"), "object": "response", "created_at": int(time.time()), "model": name,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "temperature": params.temperature, "top_p": params.top_p, "tools": req.tools or [],
            "tool_choice": req.tool_choice or "auto", "parallel_tool_calls": raw.get("parallel_tool_calls", True),
            "reasoning": {"effort": effort, "summary": None}, "text": req.text or {"format": {"type": "text"}},
            "truncation": "disabled", "metadata": raw.get("metadata") or {}, "error": None,
            "incomplete_details": None, "usage": None}

    def final(items: OutputItems) -> dict[str, Any]:
        incomplete = c.finish_reason == "length"
        status = "incomplete" if incomplete else "completed"
        for it in items.items:
            it["status"] = "incomplete" if incomplete and it is items.items[-1] else "completed"
        out_n, thought = len(c.token_ids), getattr(c.renderer, "reasoning_tokens", 0)   # harmony's reasoning
        return {**head, "status": status, "output": items.items,
                "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
                "usage": {"input_tokens": len(prompt), "input_tokens_details": {"cached_tokens": c.num_cached_tokens or 0},
                          "output_tokens": out_n,
                          "output_tokens_details": {"reasoning_tokens": thought},
                          "total_tokens": len(prompt) + out_n},
                "kv_transfer_params": c.kv_transfer_params}

    if req.stream:
        return StreamingResponse(_events(c, head, final), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    gone = await run_to_end(request, choices)
    if gone is not None:
        return gone
    items = OutputItems()
    for p in c.pieces:
        items.push(p)
    items.close()
    return JSONResponse(final(items))


async def _events(c: Choice, head: dict[str, Any], final: Any) -> AsyncIterator[str]:
    """The stream: response.created / in_progress, each piece's events as it comes, the last item closed,
    response.completed (or response.incomplete); a failed request ends with an `error` event."""
    seq = 0

    def event(ev: dict[str, Any]) -> str:
        nonlocal seq
        ev = {**ev, "sequence_number": seq}
        seq += 1
        return f"event: {ev['type']}\ndata: {json.dumps(ev, separators=(',', ':'), ensure_ascii=False)}\n\n"

    items = OutputItems()
    started = {**head, "status": "in_progress", "output": []}
    try:
        yield event({"type": "response.created", "response": started})
        yield event({"type": "response.in_progress", "response": started})
        async for _, out in merge([c.stream]):
            for p in c.absorb(out):
                for ev in items.push(p):
                    yield event(ev)
            if c.done:
                break
        if c.error is not None:
            code = error_kind(c.error)[2]
            yield event({"type": "error", "code": code, "message": f"request failed: {c.error}", "param": None})
            return
        for ev in items.close("incomplete" if c.finish_reason == "length" else "completed"):
            yield event(ev)
        body = final(items)
        yield event({"type": f"response.{body['status']}", "response": body})
    except (asyncio.CancelledError, GeneratorExit):
        raise
    except Exception as e:  # noqa: BLE001 - the stream already started: report in-band
        log.exception("stream failed")
        yield event({"type": "error", "code": None, "message": f"internal error: {type(e).__name__}: {e}",
                     "param": None})
    finally:
        c.stream.close()
