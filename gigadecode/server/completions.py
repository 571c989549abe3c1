"""`POST /v1/completions`: raw text (or token ids) in, raw text out — no chat template, no harmony parsing.

`prompt` is a string, a list of token ids, or a list of either (one set of `n` choices per prompt). Stop
strings, `n`, `logit_bias` and logprobs (OpenAI's legacy shape) are supported; vLLM's extras
(`return_token_ids`, `kv_transfer_params`, ...) as the module `api` lists.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Sequence

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from . import deps
from .body import BodyError, load_object
from .outputs import (Choice, TextRenderer, completion_logprobs, run_to_end, sse_response, start, stream_chunk,
                      stream_events, usage)
from .protocol import (DEFAULT_COMPLETION_MAX_TOKENS, MAX_SEQUENCES, APIError, CompletionBody, sampling_params,
                       stop_strings)

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


@router.post("/tokenize", dependencies=[Depends(deps.check_key)])
async def tokenize(request: Request) -> JSONResponse:
    """vLLM's `/tokenize` (a completions prompt): {"prompt": text or ids} -> {"tokens", "count", "max_model_len"}.
    The router uses it to send a vLLM prefill the same token ids this server decodes."""
    try:
        raw = load_object(await request.body())
    except BodyError as e:
        raise APIError(400, str(e), code="invalid_json") from None
    prompt = raw.get("prompt")
    if not (isinstance(prompt, str) or (isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                                                          for t in prompt))):
        raise APIError(400, "prompt must be a string or a list of token ids", param="prompt")
    aeng = deps.engine(request)
    ids = completion_prompts(prompt, aeng.codec)[0]
    return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": aeng.max_model_len})


@router.post("/v1/completions", dependencies=[Depends(deps.check_key)])
async def completions(request: Request) -> Response:
    raw, req, aeng, name = await deps.open_generation(request, CompletionBody, chat=False)
    codec = aeng.codec
    prompts = await asyncio.to_thread(completion_prompts, req.prompt, codec)   # long text: off the event loop
    # max_tokens left out: OpenAI's 16; an explicit null: each prompt's rest of the context (as vLLM)
    rest = None
    if "max_tokens" in raw and raw["max_tokens"] is None:
        def rest(ids: list[int]) -> int:
            return max(1, aeng.max_model_len - len(ids))
    max_tokens = raw.get("max_tokens", DEFAULT_COMPLETION_MAX_TOKENS) if rest is None else max(map(rest, prompts))
    params = sampling_params(raw, max_tokens, raw.get("logprobs"), deps.sampling_defaults(aeng))
    kv = deps.advertised(request, req.kv_transfer_params)
    rid, choices = await start(aeng, prompts, params, "cmpl", req.n or 1, kv, "prompt",
                               lambda: TextRenderer(codec), stop_strings(req), max_tokens_of=rest)
    head = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": name}

    def choice_body(c: Choice, text: str, lps: Sequence[Any], first: int) -> dict[str, Any]:
        """`lps`: the logprobs of the choice's tokens from token `first` on"""
        offsets = c.renderer.token_offsets[first:first + len(lps)]
        return {"index": c.index, "text": text,
                "logprobs": completion_logprobs(codec, lps, offsets) if params.logprobs is not None else None,
                "finish_reason": c.finish_reason if c.done else None}

    if req.stream:
        started: set[int] = set()           # choices whose first chunk went out (it carries the prompt's ids)

        def chunk(c: Choice, out: Any, pieces: list) -> dict[str, Any] | None:
            text = "".join(p.text for p in pieces)
            if not text and not out.new_token_ids and not c.done:
                return None
            d = choice_body(c, text, out.new_logprobs or (), len(c.token_ids) - len(out.new_token_ids))
            if req.return_token_ids and c.index not in started:
                d["prompt_token_ids"] = c.prompt_ids
            started.add(c.index)
            return stream_chunk(head, c, d, out.new_token_ids if req.return_token_ids else None)
        include = req.stream_options and req.stream_options.include_usage
        return sse_response(stream_events(choices, chunk, [], {**head, "choices": []} if include else None))

    gone = await run_to_end(request, choices)
    if gone is not None:
        return gone
    out_choices = []
    for c in choices:
        d = choice_body(c, c.text() if codec is not None else "", c.logprobs, 0)
        if req.return_token_ids:
            d["token_ids"] = c.token_ids
            d["prompt_token_ids"] = c.prompt_ids
        out_choices.append(d)
    return JSONResponse({**head, "choices": out_choices, "usage": usage(choices),
                         "kv_transfer_params": choices[0].kv_transfer_params if len(choices) == 1 else None})
