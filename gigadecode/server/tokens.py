"""vLLM's token routes: `/tokenize` (a completions prompt, or chat messages through the checkpoint's chat
template, as `/v1/chat/completions` would render them) -> {"tokens", "count", "max_model_len"} (and
"token_strs", the vocabulary's strings, with vLLM's `return_token_strs`),
`/detokenize` (token ids -> {"prompt": text}), and `/version`. The DI router asks `/tokenize` for the ids a
vLLM prefill server gets."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from .. import __version__
from . import deps
from .chat import chat_prompt
from .completions import completion_prompts
from .protocol import UNSUPPORTED_CHAT, APIError, ChatBody, _asks_nothing, parse, read_json

router = APIRouter()
#: vLLM's /tokenize fields that change the rendering, which the chat route refuses
TEMPLATE_FIELDS = ("continue_final_message", "chat_template", "chat_template_kwargs", "documents")


@router.post("/tokenize", dependencies=[Depends(deps.check_key)])
async def tokenize(request: Request) -> JSONResponse:
    """{"prompt": text or ids} or {"messages": [...], "tools", "add_generation_prompt", "reasoning_effort"}
    -> {"tokens", "count", "max_model_len"}."""
    raw = await read_json(request)
    aeng = deps.engine(request)
    if "messages" in raw:
        if aeng.codec is None:
            raise APIError(400, "this model has no tokenizer (no chat template)", param="messages")
        body = parse(ChatBody, raw)
        for k in TEMPLATE_FIELDS:                 # the chat route refuses them: no other rendering here either
            if not _asks_nothing(k, raw.get(k)):
                raise APIError(400, UNSUPPORTED_CHAT[k], param=k)
        ids = await asyncio.to_thread(chat_prompt, aeng.codec, body)
    else:
        prompt = raw.get("prompt")
        if not (isinstance(prompt, str) or (isinstance(prompt, list) and all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompt))):
            raise APIError(400, "prompt must be a string or a list of token ids (or send messages)", param="prompt")
        ids = (await asyncio.to_thread(completion_prompts, prompt, aeng.codec))[0]
    out: dict[str, Any] = {"tokens": ids, "count": len(ids), "max_model_len": aeng.max_model_len}
    strs = raw.get("return_token_strs", False)
    if not isinstance(strs, bool):
        raise APIError(400, "return_token_strs must be true or false", param="return_token_strs")
    if strs:                                      # vLLM's: the vocabulary's string of each token
        if aeng.codec is None:
            raise APIError(400, "this model has no tokenizer", param="return_token_strs")
        out["token_strs"] = [aeng.codec.token_str(t) for t in ids]
    return JSONResponse(out)


@router.post("/detokenize", dependencies=[Depends(deps.check_key)])
async def detokenize(request: Request) -> JSONResponse:
    """{"tokens": [ids]} -> {"prompt": their text}, special tokens included (as vLLM: /tokenize then
    /detokenize of chat messages gives back the rendered prompt)."""
    raw = await read_json(request)
    aeng = deps.engine(request)
    tokens: Any = raw.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise APIError(400, "tokens must be a list of token ids", param="tokens")
    vocab = aeng.engine.cfg.vocab_size
    bad = [t for t in tokens if not 0 <= t < vocab]
    if bad:
        raise APIError(400, f"token id {bad[0]} is outside the vocabulary [0, {vocab})", param="tokens")
    if aeng.codec is None:
        raise APIError(400, "this model has no tokenizer", param="tokens")
    return JSONResponse({"prompt": aeng.codec.decode(tokens, skip_special_tokens=False)})


@router.get("/version")
async def version() -> JSONResponse:
    return JSONResponse({"version": __version__})
