"""`POST /v1/completions`: raw text (or token ids) in, raw text out — no chat template, no harmony parsing.

`prompt` is a string, a list of token ids, or a list of either (one set of `n` choices per prompt). Stop
strings, `n`, `logit_bias`, logprobs (OpenAI's legacy shape) and `echo` (the prompt's text, and with
`logprobs` its tokens' logprobs, before the completion's: what log-likelihood evaluations read) are
supported; vLLM's extras (`return_token_ids`, `prompt_logprobs`, `kv_transfer_params`, ...) as the module
`api` lists, and those of `extras` (`allowed_token_ids`, `bad_words`, `truncate_prompt_tokens`,
`include_stop_str_in_output`, `skip_special_tokens`).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Sequence

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from . import deps
from .extras import token_constraints, truncate
from .outputs import (Choice, TextRenderer, completion_logprobs, echoed_prompt_logprobs, run_to_end, sse_response,
                      start, stream_chunk, stream_events, usage, vllm_prompt_logprobs)
from .protocol import (DEFAULT_COMPLETION_MAX_TOKENS, MAX_SEQUENCES, APIError, CompletionBody, errors_named,
                       guided_of, request_priority, sampling_params, stop_strings)

router = APIRouter()


def completion_prompts(prompt: Any, codec: Any) -> list[list[int]]:
    """A completions `prompt` -> one token-id list per prompt."""
    def encode(text: str) -> list[int]:
        if codec is None:
            raise APIError(400, "this model has no tokenizer; send the prompt as token ids", param="prompt")
        try:
            return codec.encode(text)
        except Exception as e:  # noqa: BLE001 - text the tokenizer cannot take is the client's input
            raise APIError(400, f"the prompt cannot be tokenized: {type(e).__name__}: {e}", param="prompt") from None
    if isinstance(prompt, str):
        return [encode(prompt)]
    if not prompt or isinstance(prompt[0], int):
        return [list(prompt)]
    if len(prompt) > MAX_SEQUENCES:                  # before tokenizing them all
        raise APIError(400, f"at most {MAX_SEQUENCES} prompts per request (got {len(prompt)})", param="prompt")
    if isinstance(prompt[0], str):
        return [encode(p) for p in prompt]
    return [list(p) for p in prompt]


def _rendered(codec: Any, ids: list[int], skip_special: bool) -> tuple[str, list[int]]:
    """A prompt's text as the completion's text is rendered (special tokens left out unless `skip_special` is
    False), and where each of its tokens starts in it."""
    r = TextRenderer(codec, skip_special)
    return "".join(p.text for p in r.push(ids, True)), r.token_offsets


@router.post("/v1/completions", dependencies=[Depends(deps.check_key)])
async def completions(request: Request) -> Response:
    raw, req, aeng, name = await deps.open_generation(request, CompletionBody, chat=False)
    codec = aeng.codec
    prompts = await asyncio.to_thread(completion_prompts, req.prompt, codec)   # long text: off the event loop
    prompts = truncate(prompts, raw, aeng.max_model_len)
    skip_special = req.skip_special_tokens is not False
    # max_tokens left out: OpenAI's 16; an explicit null: each prompt's rest of the context (as vLLM)
    rest = None
    if "max_tokens" in raw and raw["max_tokens"] is None:
        def rest(ids: list[int]) -> int:
            return max(1, aeng.max_model_len - len(ids))
    max_tokens = raw.get("max_tokens", DEFAULT_COMPLETION_MAX_TOKENS) if rest is None else max(map(rest, prompts))
    # echo: the prompt's text before the completion's, and with `logprobs` the prompt tokens' logprobs before
    # the completion's (vLLM: echo asks the engine for the prompt's logprobs at the same top N)
    echo = bool(req.echo)
    # echo with max_tokens 0 (log-likelihood scoring): the prompt alone; the engine makes one token, not shown
    prompt_only = echo and raw.get("max_tokens") == 0 and not isinstance(raw.get("max_tokens"), bool)
    if prompt_only:
        if req.stream:
            raise APIError(400, "echo with max_tokens 0 is answered whole: send stream false", param="max_tokens")
        max_tokens = 1
    prompt_lps = req.prompt_logprobs if req.prompt_logprobs is not None else raw.get("logprobs") if echo else None
    guided, guided_field = guided_of(raw, "all")
    params = sampling_params(raw, max_tokens, raw.get("logprobs"), deps.sampling_defaults(aeng), prompt_lps, guided,
                             token_constraints(raw, codec))
    kv = deps.advertised(request, req.kv_transfer_params)
    with errors_named("guided", guided_field):
        rid, choices = await start(aeng, prompts, params, "cmpl", req.n or 1, kv, "prompt",
                                   lambda: TextRenderer(codec, skip_special), stop_strings(req), max_tokens_of=rest,
                                   include_stop=bool(req.include_stop_str_in_output),
                                   priority=request_priority(raw),
                                   request_id=deps.handoff_request_id(request, "cmpl", kv))
    head = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": name}
    # (text, token offsets) per prompt
    echoes = [_rendered(codec, ids, skip_special) for ids in prompts] if echo else []

    def choice_body(c: Choice, text: str, lps: Sequence[Any], first: int, with_prompt: bool) -> dict[str, Any]:
        """`lps`: the logprobs of the choice's tokens from token `first` on; `with_prompt`: the chunk (or
        whole answer) that carries the prompt (echo, vLLM's prompt_logprobs)"""
        shift = len(echoes[c.prompt_index][0]) if echo else 0     # offsets count the echoed prompt's text
        offsets = [o + shift for o in c.renderer.token_offsets[first:first + len(lps)]]
        logprobs = completion_logprobs(codec, lps, offsets) if params.logprobs is not None else None
        if echo and with_prompt:
            prompt_text, prompt_offsets = echoes[c.prompt_index]
            text = prompt_text + text
            if logprobs is not None:
                p = echoed_prompt_logprobs(codec, c.prompt_ids, c.prompt_logprobs, prompt_offsets)
                logprobs = {k: p[k] + logprobs[k] for k in logprobs}
        d = {"index": c.index, "text": text, "logprobs": logprobs, "finish_reason": c.finish_reason if c.done else None}
        if req.prompt_logprobs is not None and with_prompt:
            d["prompt_logprobs"] = vllm_prompt_logprobs(codec, c.prompt_logprobs or [None])
        return d

    if req.stream:
        started: set[int] = set()           # choices whose first chunk went out (it carries the prompt's ids)

        def chunk(c: Choice, out: Any, pieces: list) -> dict[str, Any] | None:
            text = "".join(p.text for p in pieces)
            if not text and not c.new_ids and not c.done:
                return None
            d = choice_body(c, text, c.new_logprobs, len(c.token_ids) - len(c.new_ids), c.index not in started)
            if req.return_token_ids and c.index not in started:
                d["prompt_token_ids"] = c.prompt_ids
            started.add(c.index)
            return stream_chunk(head, c, d, c.new_ids if req.return_token_ids else None)
        include = req.stream_options and req.stream_options.include_usage
        return sse_response(stream_events(choices, chunk, [], {**head, "choices": []} if include else None,
                                          bool(req.stream_options and req.stream_options.continuous)))

    gone = await run_to_end(request, choices)
    if gone is not None:
        return gone
    out_choices = []
    for c in choices:
        if prompt_only:
            d = {**choice_body(c, "", (), 0, True), "finish_reason": "length"}
        else:
            d = choice_body(c, c.text() if codec is not None else "", c.logprobs, 0, True)
        if req.return_token_ids:
            d["token_ids"] = [] if prompt_only else c.token_ids
            d["prompt_token_ids"] = c.prompt_ids
        out_choices.append(d)
    use = usage(choices)
    if prompt_only:
        use.update(completion_tokens=0, total_tokens=use["prompt_tokens"])
    return JSONResponse({**head, "choices": out_choices, "usage": use,
                         "kv_transfer_params": choices[0].kv_transfer_params if len(choices) == 1 else None})
