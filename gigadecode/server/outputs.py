"""From engine outputs to what a client sees: one `Choice` per generated sequence, the text it renders
(stop strings applied), logprobs in OpenAI's shapes, and the submit / collect / stream loop the completion
and chat routes share.

A `Choice` turns each `RequestOutput`'s new token ids into `Piece`s through its renderer: `TextRenderer`
(detokenized text, all of it content) or, for chat on a harmony tokenizer, `HarmonyRenderer` (reasoning,
content and tool-call pieces from `harmony.HarmonyStreamParser`). Content passes a `StopMatcher`
(`../stop_strings.py`): OpenAI `stop` strings are matched on the decoded text across token boundaries, what
follows a match is cut (the match too, unless vLLM's `include_stop_str_in_output`), the choice finishes
with `stop` and its engine request is aborted.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from ..sampling import SamplingParams, nth_seed
from ..stop_strings import StopMatcher
from ..structured import GRAMMAR_FAILED
from ..token_masks import MASKS_EXCLUDE_ALL
from .async_engine import SHUTTING_DOWN, AsyncEngine, RequestStream
from .disconnect import CLIENT_CLOSED, ClientGone, unless_disconnected
from .protocol import MAX_SEQUENCES, APIError, engine_error, error_body

log = logging.getLogger("gigadecode.server")

LOGPROB_FLOOR = -9999.0                     # JSON has no -inf


# --------------------------------------------------------------------------------------------------
# Rendering
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Piece:
    """A rendered fragment: kind "content" | "reasoning" | "tool_call" (then index/id/name/arguments)."""
    kind: str
    text: str = ""
    index: int | None = None
    id: str | None = None
    name: str | None = None
    arguments: str | None = None


class TextRenderer:
    """Detokenized text (multi-byte characters never split; special tokens left out unless
    `skip_special_tokens` is False, vLLM's field), all of it content. `token_offsets[i]`: where token i's text
    starts in the text rendered so far (OpenAI's `text_offset`)."""

    def __init__(self, codec: Any, skip_special_tokens: bool = True) -> None:
        from ..tokenizer import StreamDecoder
        self.decoder = StreamDecoder(codec, skip_special_tokens) if codec is not None else None
        self.token_offsets: list[int] = []
        self._length = 0

    def push(self, token_ids: Sequence[int], finished: bool) -> list[Piece]:
        if self.decoder is None:                       # no tokenizer: no text, every token at offset 0
            self.token_offsets += [0] * len(token_ids)
            return []
        parts = []
        for t in token_ids:
            self.token_offsets.append(self._length)
            parts.append(self.decoder.push(t))
            self._length += len(parts[-1])
        if finished:
            parts.append(self.decoder.flush())
            self._length += len(parts[-1])
        text = "".join(parts)
        return [Piece("content", text)] if text else []

    def skip(self, token_id: int) -> list[Piece]:
        """A stop token that ended the sequence: counted (its offset), not rendered."""
        self.token_offsets.append(self._length)
        return []

    def finish_reason(self, engine_reason: str | None) -> str | None:
        return engine_reason


class HarmonyRenderer:
    """GPT-OSS's harmony channels: analysis -> reasoning, final (and preambles) -> content, calls -> tool_call;
    `final_only` (a structured answer): content is the final message alone, preambles go with the reasoning."""

    def __init__(self, codec: Any, tokens: Any, final_only: bool = False) -> None:
        from ..harmony import HarmonyStreamParser
        self.parser = HarmonyStreamParser(codec, tokens, final_only=final_only)

    def push(self, token_ids: Sequence[int], finished: bool) -> list[Piece]:
        deltas = [d for t in token_ids for d in self.parser.push(t)]
        if finished:
            deltas += self.parser.finish()
        return [Piece(d.kind, d.text, d.index, d.id, d.name, d.arguments) for d in deltas]

    def skip(self, token_id: int) -> list[Piece]:
        """A stop token that ended the sequence: harmony's own (special, no text) still ends the message."""
        return self.push([token_id], False) if token_id in self.parser.codec.special_ids else []

    def finish_reason(self, engine_reason: str | None) -> str | None:
        return self.parser.finish_reason(engine_reason)

    @property
    def reasoning_tokens(self) -> int:
        return self.parser.reasoning_tokens


# --------------------------------------------------------------------------------------------------
# One generated sequence
# --------------------------------------------------------------------------------------------------
@dataclass
class Choice:
    """One sequence's request and what it produced so far."""

    index: int
    prompt_index: int
    stream: RequestStream
    prompt_ids: list[int]
    renderer: Any
    stop: StopMatcher
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Any] = field(default_factory=list)     # TokenLogprobs
    pieces: list[Piece] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    kv_transfer_params: dict | None = None
    done: bool = False
    min_tokens: int = 0
    prompt_logprobs: list[Any] | None = None               # TokenLogprobs per prompt token (the first: None)
    num_cached_tokens: int | None = None                   # prefix caching: prompt tokens found in the cache
    new_ids: list[int] = field(default_factory=list)        # the token ids the last `absorb` kept of its output
    new_logprobs: list[Any] = field(default_factory=list)   # ... and their logprobs (what a stream chunk sends)

    def absorb(self, out: Any) -> list[Piece]:
        """Take one RequestOutput -> the new pieces (stop strings applied). A stop string finishes the choice
        and aborts its engine request; outputs after that (its abort) are ignored. As in vLLM, no stop string
        may end in the text of the first `min_tokens` tokens, and the stop token (EOS or one of
        `stop_token_ids`) that ended a sequence stays in its token ids but not in its text (unless the request
        asked for include_stop_str_in_output: then its text is rendered too, as vLLM does)."""
        if self.done:
            self.new_ids, self.new_logprobs = [], []
            return []
        if len(out.new_token_ids) > 1:
            return self._absorb_each(out)
        ids = list(out.new_token_ids)
        self.new_ids, self.new_logprobs = list(ids), list(out.new_logprobs or ())
        first = len(self.token_ids)
        self.token_ids.extend(ids)
        self.logprobs.extend(out.new_logprobs or ())
        if getattr(out, "prompt_logprobs", None) is not None:
            self.prompt_logprobs = list(out.prompt_logprobs)
        if getattr(out, "num_cached_tokens", None) is not None:
            self.num_cached_tokens = out.num_cached_tokens
        stop_id = (ids.pop() if ids and out.finished and out.finish_reason == "stop" and not self.stop.include
                   else None)
        k = min(len(ids), max(0, self.min_tokens - first))
        rendered = [(p, True) for p in self.renderer.push(ids[:k], False)]
        rendered += [(p, False) for p in self.renderer.push(ids[k:], False)]
        if stop_id is not None:
            rendered += [(p, False) for p in self.renderer.skip(stop_id)]
        if out.finished:
            rendered += [(p, False) for p in self.renderer.push([], True)]
        new: list[Piece] = []
        for p, protected in rendered:
            if p.kind == "content":
                p = replace(p, text=self.stop.push(p.text, protected))
            if p.text or p.kind == "tool_call":
                new.append(p)
        if self.stop.hit:
            self.done, self.finish_reason = True, self.renderer.finish_reason("stop")   # a call before: tool_calls
            self.stream.close("stop")            # abort the engine request: nothing after the stop is wanted
        elif out.finished:
            tail = self.stop.flush()
            if tail:
                new.append(Piece("content", tail))
            self.done = True
            self.finish_reason = self.renderer.finish_reason(out.finish_reason)
            self.error = out.error
            self.kv_transfer_params = getattr(out, "kv_transfer_params", None)
        self.pieces.extend(new)
        return new

    def _absorb_each(self, out: Any) -> list[Piece]:
        """An output of several tokens (speculative decoding's accepted drafts), taken one token at a time as
        plain decoding gives them: a stop string ends the choice at the token that completes it, not with the
        tokens (ids, logprobs, usage) sampled after it in the same step."""
        ids, lps, new = list(out.new_token_ids), list(out.new_logprobs or ()), []
        kept_ids: list[int] = []
        kept_lps: list[Any] = []
        for i, t in enumerate(ids):
            last = i == len(ids) - 1
            part = replace(out, new_token_ids=[t], new_logprobs=lps[i: i + 1], finished=out.finished and last,
                           finish_reason=out.finish_reason if last else None, error=out.error if last else None)
            if i:
                part.prompt_logprobs = part.num_cached_tokens = None
            if last and hasattr(out, "kv_transfer_params"):      # set on the final output, not a field
                part.kv_transfer_params = out.kv_transfer_params
            new += self.absorb(part)
            kept_ids += self.new_ids
            kept_lps += self.new_logprobs
            if self.done:
                break
        self.new_ids, self.new_logprobs = kept_ids, kept_lps
        return new

    def text(self, kind: str = "content") -> str:
        return "".join(p.text for p in self.pieces if p.kind == kind)

    def tool_calls(self) -> list[dict[str, Any]]:
        calls: dict[int, dict[str, Any]] = {}
        for p in self.pieces:
            if p.kind == "tool_call":
                c = calls.setdefault(p.index or 0, {"id": p.id, "type": "function",
                                                    "function": {"name": p.name, "arguments": ""}})
                c["function"]["arguments"] += p.arguments or ""
        return [calls[i] for i in sorted(calls)]


# --------------------------------------------------------------------------------------------------
# Logprobs and usage
# --------------------------------------------------------------------------------------------------
def _tok_text(codec: Any, token_id: int) -> str:
    return codec.decode([token_id], skip_special_tokens=False) if codec is not None else f"token_id:{token_id}"


def _lp(v: float) -> float:
    return max(float(v), LOGPROB_FLOOR)


def completion_logprobs(codec: Any, lps: Sequence[Any], offsets: Sequence[int]) -> dict[str, Any]:
    """OpenAI's legacy completions logprobs object; `offsets`: each token's position in the choice's text."""
    tokens, token_lps, tops = [], [], []
    for lp in lps:
        s = _tok_text(codec, lp.token_id)
        top = {_tok_text(codec, t): _lp(v) for t, v in lp.top}
        top.setdefault(s, _lp(lp.logprob))
        tokens.append(s)
        token_lps.append(_lp(lp.logprob))
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": list(offsets)}


def echoed_prompt_logprobs(codec: Any, prompt_ids: Sequence[int], plps: Sequence[Any] | None,
                           offsets: Sequence[int]) -> dict[str, Any]:
    """The legacy completions logprobs object of an echoed prompt: the first token (and any the engine did not
    score) with a null logprob and null top_logprobs, as vLLM writes them; `offsets` as in completion_logprobs."""
    d: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": list(offsets)}
    for i, t in enumerate(prompt_ids):
        lp = plps[i] if plps is not None and i < len(plps) else None
        if lp is None:
            d["tokens"].append(_tok_text(codec, t))
            d["token_logprobs"].append(None)
            d["top_logprobs"].append(None)
            continue
        one = completion_logprobs(codec, [lp], [0])
        for k in ("tokens", "token_logprobs", "top_logprobs"):
            d[k] += one[k]
    return d


def vllm_prompt_logprobs(codec: Any, plps: Sequence[Any]) -> list[dict[int, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs`: per prompt token None (the first) or {token id: {logprob, rank,
    decoded_token}} for the prompt's token and the top ones asked for."""
    out: list[dict[int, dict[str, Any]] | None] = []
    for lp in plps:
        if lp is None:
            out.append(None)
            continue
        d = {lp.token_id: {"logprob": _lp(lp.logprob), "rank": lp.rank, "decoded_token": _tok_text(codec, lp.token_id)}}
        for rank, (t, v) in enumerate(lp.top, 1):
            d.setdefault(t, {"logprob": _lp(v), "rank": rank, "decoded_token": _tok_text(codec, t)})
        out.append(d)
    return out


def chat_logprobs(codec: Any, lps: Sequence[Any]) -> dict[str, Any]:
    """OpenAI's chat logprobs object."""
    def entry(t: int, v: float) -> dict[str, Any]:
        s = _tok_text(codec, t)
        return {"token": s, "logprob": _lp(v), "bytes": list(s.encode("utf-8"))}
    return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                        for lp in lps]}


def usage(choices: Sequence[Choice]) -> dict[str, Any]:
    """Prompt tokens counted once per prompt (n choices of one prompt share it), as OpenAI does; with prefix
    caching, `prompt_tokens_details.cached_tokens` (those the first choice of each prompt found cached); harmony
    chat: `completion_tokens_details.reasoning_tokens` (OpenAI's, for reasoning models)."""
    firsts = {c.prompt_index: c for c in reversed(choices)}.values()
    p = sum(len(c.prompt_ids) for c in firsts)
    g = sum(len(c.token_ids) for c in choices)
    out: dict[str, Any] = {"prompt_tokens": p, "completion_tokens": g, "total_tokens": p + g}
    if all(hasattr(c.renderer, "reasoning_tokens") for c in choices):
        out["completion_tokens_details"] = {"reasoning_tokens": sum(c.renderer.reasoning_tokens for c in choices)}
    cached = [c.num_cached_tokens for c in firsts if c.num_cached_tokens is not None]
    if cached:
        out["prompt_tokens_details"] = {"cached_tokens": sum(cached)}
    return out


def stream_chunk(head: dict[str, Any], c: Choice, d: dict[str, Any], token_ids: Sequence[int] | None
                 ) -> dict[str, Any]:
    """One SSE chunk of choice `c`: its choice body `d` (with the new token ids when the request asked for them),
    and on its last chunk the request's `kv_transfer_params` (a prefill's answer for the decode side)."""
    if token_ids is not None:
        d["token_ids"] = list(token_ids)
    body = {**head, "choices": [d]}
    if c.done:
        body["kv_transfer_params"] = c.kv_transfer_params
    return body


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'), ensure_ascii=False)}\n\n"


# --------------------------------------------------------------------------------------------------
# Submit, collect, stream
# --------------------------------------------------------------------------------------------------
async def start(aeng: AsyncEngine, prompts: list[list[int]], params: SamplingParams, prefix: str, n: int,
                kv: Any, prompt_param: str, make_renderer: Callable[[], Any],
                stops: Sequence[str], max_tokens_of: Callable[[list[int]], int] | None = None,
                include_stop: bool = False, priority: int = 0, request_id: str | None = None
                ) -> tuple[str, list[Choice]]:
    """Submit `n` sequences per prompt (choice index = prompt index · n + j). A seeded request's j-th
    sequence draws with seed + j (`sampling.nth_seed`). DI params go with the first sequence of the (single) prompt only: a
    prefill's KV is read once; the other sequences prefill here. `max_tokens_of(prompt)`, when given, sets each
    prompt's max_tokens (the rest of the context, for a request that leaves it open); `include_stop`: vLLM's
    include_stop_str_in_output; `priority`: every sequence's (the request's `priority` field); `request_id`: the
    id to run under (a DI prefill the proxy named: `deps.handoff_request_id`), else a fresh one."""
    if len(prompts) * n > MAX_SEQUENCES:
        raise APIError(400, f"a request may ask for at most {MAX_SEQUENCES} sequences (prompts × n; got "
                            f"{len(prompts)} × {n})", param=prompt_param)
    if kv is not None and len(prompts) != 1:
        raise APIError(400, "kv_transfer_params needs exactly one prompt", param="kv_transfer_params")
    if kv is not None and kv.do_remote_decode and n != 1:
        raise APIError(400, "a prefill request (do_remote_decode) takes n=1", param="n")
    base = request_id or f"{prefix}-{uuid.uuid4().hex}"
    choices: list[Choice] = []
    try:
        for pi, ids in enumerate(prompts):
            prompt_params = params if max_tokens_of is None else replace(params, max_tokens=max_tokens_of(ids))
            for j in range(n):
                index = pi * n + j
                rid = base if len(prompts) * n == 1 else f"{base}-{index}"
                p = (prompt_params if j == 0 or params.seed is None
                     else replace(prompt_params, seed=nth_seed(params.seed, j)))
                try:
                    stream = await aeng.submit(ids, p, rid, kv if index == 0 else None, priority)
                except Exception as e:  # noqa: BLE001 - mapped to an HTTP error
                    raise engine_error(e, prompt_param) from None
                choices.append(Choice(index, pi, stream, ids, make_renderer(), StopMatcher(stops, include_stop),
                                      min_tokens=p.min_tokens))
    except BaseException:
        for c in choices:
            c.stream.close()
        raise
    return base, choices


async def merge(streams: Sequence[RequestStream]) -> AsyncIterator[tuple[int, Any]]:
    """(choice index, RequestOutput) from several streams as they come; closing it aborts them all."""
    if len(streams) == 1:
        try:
            async for out in streams[0]:
                yield 0, out
        finally:
            streams[0].close()
        return
    q: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, s: RequestStream) -> None:
        try:
            async for out in s:
                q.put_nowait((i, out))
        except Exception as e:  # noqa: BLE001 - re-raised by the consumer
            q.put_nowait((i, e))
        finally:
            q.put_nowait((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(streams)
        while left:
            i, item = await q.get()
            if item is None:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for s in streams:
            s.close()
        for t in tasks:
            t.cancel()


async def _collect(choices: list[Choice]) -> None:
    async for i, out in merge([c.stream for c in choices]):
        choices[i].absorb(out)
        if all(c.done for c in choices):
            break


def error_kind(error: str) -> tuple[int, str, str]:
    """A failed request's error -> (status, type, code) of its answer or in-band error event."""
    if error == SHUTTING_DOWN:
        return 503, "server_error", "server_shutting_down"
    if error.startswith(GRAMMAR_FAILED):                          # the request's own grammar broke down
        return 400, "invalid_request_error", "grammar_failed"
    if error.endswith(MASKS_EXCLUDE_ALL):                         # its allowed_token_ids / bad_words / grammar
        return 400, "invalid_request_error", "no_token_left"
    return 500, "server_error", "request_failed"


def _final_error(choices: list[Choice]) -> None:
    for c in choices:
        if c.error is not None:
            status, type_, code = error_kind(c.error)
            raise APIError(status, f"request failed: {c.error}", type=type_, code=code)
        if c.finish_reason == "abort":
            raise APIError(500, "request was aborted", type="server_error", code="request_aborted")


async def run_to_end(request: Request, choices: list[Choice]) -> Response | None:
    """Non-streaming: every choice to its end (None), or 499 when the client left; failures raise."""
    try:
        await unless_disconnected(request, _collect(choices))
        if await request.is_disconnected():   # it left after the last look, before the end: nobody takes the answer
            raise ClientGone()
    except ClientGone:
        for c in choices:                  # a prefill that finished unseen: its params can never be read
            c.stream.release_lease()
        return Response(status_code=CLIENT_CLOSED)
    _final_error(choices)
    return None


async def stream_events(choices: list[Choice], make_chunk: Callable[[Choice, Any, list[Piece]], dict | list | None],
                        first: list[dict[str, Any]], usage_chunk: dict[str, Any] | None,
                        continuous_usage: bool = False) -> AsyncIterator[str]:
    """SSE: `first` chunks, then the chunks of each output (`make_chunk`: one, a list, or None = nothing to send; with
    `continuous_usage`, vLLM's `continuous_usage_stats`, each carries the usage so far of its own choice: that
    choice's prompt and tokens, as vLLM counts it), the usage chunk (the whole request's) when asked, `[DONE]`. A
    failed request ends the stream with an error event."""
    try:
        for chunk in first:
            yield sse(chunk)
        async for i, out in merge([c.stream for c in choices]):
            c = choices[i]
            if c.done:
                continue
            pieces = c.absorb(out)
            if c.done and c.error is not None:
                _, type_, code = error_kind(c.error)
                yield sse(error_body(f"request failed: {c.error}", type_, code=code))
                break
            made = make_chunk(c, out, pieces)
            for chunk in [] if made is None else made if isinstance(made, list) else [made]:
                if continuous_usage:
                    chunk["usage"] = usage([c])
                yield sse(chunk)
            if all(c.done for c in choices):
                break
        if all(c.done and c.error is None for c in choices) and usage_chunk is not None:
            yield sse({**usage_chunk, "usage": usage(choices)})
        yield "data: [DONE]\n\n"
    except (asyncio.CancelledError, GeneratorExit):
        raise
    except Exception as e:  # noqa: BLE001 - the stream already started: report in-band
        log.exception("stream failed")
        yield sse(error_body(f"internal error: {type(e).__name__}: {e}", "server_error"))
        yield "data: [DONE]\n\n"
    finally:
        for c in choices:
            c.stream.close()


def sse_response(gen: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(gen, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
