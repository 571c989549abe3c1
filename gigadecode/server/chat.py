"""`POST /v1/chat/completions`: messages through the checkpoint's chat template, the reply through harmony.

The prompt is rendered by the checkpoint's own template (`chat_template.jinja` / `tokenizer_config.json`, or
`--chat-template`'s)
with what GPT-OSS's template takes: system / developer / user messages, earlier assistant turns (with
`tool_calls` and `reasoning` or `reasoning_content`, passed to the template as `thinking`; a call's turn that
has both keeps that and leaves its content, a preamble, out: GPT-OSS's template takes one; several calls go to
the template as one message each, since it renders a message's first call only), `role: "tool"` results,
`tools` (OpenAI function tools; `tool_choice: "none"` leaves them out, "required" or a named function holds
the reply to a call: `structured.forced_call_grammar`) and `reasoning_effort` (low | medium | high; OpenAI's
minimal is low). On a tokenizer with harmony's special tokens the output is parsed by channel
(`harmony.HarmonyStreamParser`): analysis -> `reasoning` (vLLM's name; also as `reasoning_content`, its former
one, which clients of DeepSeek's API read), final -> `content`, calls on commentary
-> `tool_calls` with `finish_reason: "tool_calls"` — whole, and as stream deltas with vLLM's field names. A
preamble (commentary without a recipient) is content too, as in vLLM, except when structured output holds the
answer: then `content` is the final message alone, so that it parses, and a preamble goes with the reasoning.
Without those tokens the output is plain content. vLLM's `allowed_token_ids`, `bad_words`,
`truncate_prompt_tokens` (of the rendered prompt) and `include_stop_str_in_output` apply as in /v1/completions
(`extras`).
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from ..sampling import MAX_LOGPROBS
from . import deps
from .extras import token_constraints, truncate
from .outputs import (Choice, HarmonyRenderer, TextRenderer, chat_logprobs, run_to_end, sse_response, start,
                      stream_chunk, stream_events, usage, vllm_prompt_logprobs)
from .protocol import (APIError, ChatBody, errors_named, forced_call, guided_of, request_priority,
                       sampling_params, stop_strings)

router = APIRouter()


def chat_prompt(codec: Any, req: ChatBody) -> list[int]:
    """The rendered prompt's token ids; 400 when the template cannot render these messages."""
    messages = []
    called: dict[str, str] = {}          # tool call id -> its function's name, for the tool messages that answer it
    for i, m in enumerate(req.messages):
        content: Any = m.content if m.content is not None else ""
        if isinstance(content, list):
            for j, part in enumerate(content):
                if part.type != "text":
                    raise APIError(400, f"messages[{i}]: only text content parts are supported (got "
                                        f"type {part.type!r})", param=f"messages.{i}.content.{j}.type")
                if part.text is None:
                    raise APIError(400, f"messages[{i}]: content part {j} has no text",
                                   param=f"messages.{i}.content.{j}.text")
            content = "".join(p.text for p in content)
        d = {**m.model_dump(exclude_none=True), "role": m.role, "content": content}
        if d.get("tool_calls"):
            d["tool_calls"] = [_arguments_as_object(c) for c in d["tool_calls"]]
            called.update((c["id"], c["function"]["name"]) for c in d["tool_calls"] if c.get("id"))
        if m.role == "tool" and m.name is None and m.tool_call_id in called:
            d["name"] = called[m.tool_call_id]       # the template's fallback is the last call's function
        thinking = m.reasoning_content if m.reasoning_content is not None else m.reasoning
        if thinking is not None:
            d["thinking"] = thinking                     # the GPT-OSS template's name for it
            if thinking and content and d.get("tool_calls"):
                # GPT-OSS's published template renders one analysis message before a call, from `thinking` or
                # `content`, and refuses both (a 400 for a reply with a preamble fed back): the call's turn
                # keeps its chain of thought, as harmony wants, and leaves its preamble out
                d["content"] = ""
        calls = d.get("tool_calls") or []
        messages.append({**d, "tool_calls": calls[:1]} if calls else d)
        for call in calls[1:]:       # GPT-OSS's published template renders a message's first call only
            messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
    extra: dict[str, Any] = {}
    if req.tools and req.tool_choice != "none":
        extra["tools"] = [t.model_dump(exclude_none=True) for t in req.tools]
    if req.reasoning_effort is not None:      # OpenAI's "minimal" is GPT-OSS's lowest, as on /v1/responses
        extra["reasoning_effort"] = "low" if req.reasoning_effort == "minimal" else req.reasoning_effort
    from ..tokenizer import ChatTemplateError
    try:
        return codec.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt is not False,
                                         **extra)
    except ChatTemplateError as e:        # the server's template, not these messages: no chat request can run
        raise APIError(500, str(e), type="server_error", code="chat_template") from None
    except Exception as e:  # noqa: BLE001 - a template that cannot render these messages
        raise APIError(400, f"cannot apply the chat template to these messages: {type(e).__name__}: {e}",
                       param="messages") from None


def _arguments_as_object(call: dict[str, Any]) -> dict[str, Any]:
    """An earlier call with its arguments as the JSON value they encode. OpenAI sends them as a JSON string,
    but chat templates take an object (transformers' convention; vLLM parses them too): GPT-OSS's published
    template renders `arguments|tojson`, which would put a quoted string into the prompt. Arguments that are
    not JSON stay text; empty ones are {}."""
    fn = call["function"]
    try:
        args = json.loads(fn["arguments"]) if fn["arguments"].strip() else {}
    except ValueError:
        return call
    return {**call, "function": {**fn, "arguments": args}}


def _message(c: Choice, include_reasoning: bool) -> dict[str, Any]:
    calls = c.tool_calls()
    msg: dict[str, Any] = {"role": "assistant", "content": c.text() or (None if calls else "")}
    reasoning = c.text("reasoning")
    if reasoning and include_reasoning:
        msg["reasoning"] = msg["reasoning_content"] = reasoning       # vLLM's name now, and its former one
    if calls:
        msg["tool_calls"] = calls
    return msg


def _delta(pieces: list, include_reasoning: bool) -> dict[str, Any]:
    d: dict[str, Any] = {}
    for p in pieces:
        if p.kind == "content":
            d["content"] = d.get("content", "") + p.text
        elif p.kind == "reasoning" and include_reasoning:
            d["reasoning"] = d["reasoning_content"] = d.get("reasoning", "") + p.text
        elif p.kind == "tool_call":
            call: dict[str, Any] = {"index": p.index or 0, "function": {"arguments": p.arguments or ""}}
            if p.id is not None:
                call.update(id=p.id, type="function")
                call["function"]["name"] = p.name
            d.setdefault("tool_calls", []).append(call)
    return d


@router.post("/v1/chat/completions", dependencies=[Depends(deps.check_key)])
async def chat_completions(request: Request) -> Response:
    raw, req, aeng, name = await deps.open_generation(request, ChatBody, chat=True)
    codec = aeng.codec
    if codec is None:
        raise APIError(400, "this model has no tokenizer, so it cannot take chat messages; use "
                            "/v1/completions with token ids", param="messages")
    prompt = await asyncio.to_thread(chat_prompt, codec, req)     # a long prompt must not hold the event loop
    prompt = truncate([prompt], raw, aeng.max_model_len)[0]       # vLLM's truncate_prompt_tokens
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_LOGPROBS:
        raise APIError(400, f"top_logprobs must be in [0, {MAX_LOGPROBS}] (got {req.top_logprobs})",
                       param="top_logprobs")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    prompt_logprobs = req.prompt_logprobs
    if req.stream and prompt_logprobs is not None:   # vLLM's rule: no chunk carries them (0 asks for none)
        if prompt_logprobs != 0:
            raise APIError(400, "`prompt_logprobs` are not available when `stream=True`.", param="prompt_logprobs")
        prompt_logprobs = None
    max_tokens, max_param = raw.get("max_completion_tokens"), "max_completion_tokens"
    if max_tokens is None:
        max_tokens, max_param = raw.get("max_tokens"), "max_tokens"
    if max_tokens is None:
        max_tokens = max(1, aeng.max_model_len - len(prompt))
    from ..harmony import HarmonyTokens
    tokens = HarmonyTokens.from_codec(codec)
    # structured output holds the answer (harmony's final message), not the reasoning before it
    guided, guided_field = guided_of(raw, "final" if tokens is not None else "all")
    final_only = guided is not None           # content is the structured answer alone (no preamble before it)
    tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
    forced = forced_call(raw, tools, True, tokens is not None, guided)
    if forced is not guided:       # a forced call's grammar: a schema it cannot compile is a tool's parameters
        guided, guided_field = forced, "tools"
    with errors_named("max_tokens", max_param):
        params = sampling_params(raw, max_tokens, logprobs, deps.sampling_defaults(aeng), prompt_logprobs,
                                 guided, token_constraints(raw, codec))

    def renderer() -> Any:
        return HarmonyRenderer(codec, tokens, final_only) if tokens is not None else TextRenderer(codec)

    kv = deps.advertised(request, req.kv_transfer_params)
    with errors_named("max_tokens", max_param), errors_named("guided", guided_field):
        rid, choices = await start(aeng, [prompt], params, "chatcmpl", req.n or 1, kv, "messages", renderer,
                                   stop_strings(req), include_stop=bool(req.include_stop_str_in_output),
                                   priority=request_priority(raw),
                                   request_id=deps.handoff_request_id(request, "chatcmpl", kv))
    head = {"id": rid, "object": "chat.completion.chunk" if req.stream else "chat.completion",
            "created": int(time.time()), "model": name}
    reasoning = req.include_reasoning is not False

    if req.stream:
        unsent: dict[int, list[Any]] = {}      # logprobs of tokens whose chunk had nothing to show (harmony headers)

        def chunk(c: Choice, out: Any, pieces: list) -> dict[str, Any] | list[dict[str, Any]] | None:
            delta = _delta(pieces, reasoning)
            lps = unsent.setdefault(c.index, [])
            lps.extend(c.new_logprobs)
            if not delta and not c.done and not (req.return_token_ids and c.new_ids):
                return None
            d: dict[str, Any] = {"index": c.index, "delta": delta,
                                 "logprobs": chat_logprobs(codec, lps) if params.logprobs is not None else None,
                                 "finish_reason": c.finish_reason if c.done else None}
            unsent[c.index] = []
            ids = c.new_ids if req.return_token_ids else None
            if not (c.done and "tool_calls" in delta):
                return stream_chunk(head, c, d, ids)
            # A call's delta comes whole as the call ends, mostly with the output's last token: the finish goes in
            # a chunk of its own after it, as OpenAI sends it, since the openai client's stream helper closes a
            # call (`tool_calls.function.arguments.done`) only on a chunk after that call's delta
            call = stream_chunk(head, c, {**d, "finish_reason": None}, ids)
            call.pop("kv_transfer_params", None)
            end = {"index": c.index, "delta": {}, "logprobs": None, "finish_reason": c.finish_reason}
            return [call, stream_chunk(head, c, end, [] if ids is not None else None)]
        continuous = bool(req.stream_options and req.stream_options.continuous)
        first = [{**head, "choices": [{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                       "logprobs": None, "finish_reason": None}],
                  **({"prompt_token_ids": c.prompt_ids} if req.return_token_ids else {}),
                  **({"usage": usage([c])} if continuous else {})} for c in choices]   # vLLM: 0 tokens yet
        include = req.stream_options and req.stream_options.include_usage
        return sse_response(stream_events(choices, chunk, first, {**head, "choices": []} if include else None,
                                          continuous))

    gone = await run_to_end(request, choices)
    if gone is not None:
        return gone
    out = []
    for c in choices:
        d: dict[str, Any] = {"index": c.index, "message": _message(c, reasoning),
                             "logprobs": chat_logprobs(codec, c.logprobs) if params.logprobs is not None else None,
                             "finish_reason": c.finish_reason}
        if req.return_token_ids:
            d["token_ids"] = c.token_ids
        out.append(d)
    body: dict[str, Any] = {**head, "choices": out, "usage": usage(choices),
                            "kv_transfer_params": choices[0].kv_transfer_params if len(choices) == 1 else None}
    if req.return_token_ids:
        body["prompt_token_ids"] = choices[0].prompt_ids
    if req.prompt_logprobs is not None:                  # vLLM's field: the rendered prompt's tokens, scored
        body["prompt_logprobs"] = vllm_prompt_logprobs(codec, choices[0].prompt_logprobs or [None])
    return JSONResponse(body)
