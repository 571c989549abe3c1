"""vLLM's offline Python API over one engine: `LLM(model).generate(prompts, params)` and `LLM.chat(messages)`.

    from gigadecode import LLM, SamplingParams
    llm = LLM("path/to/checkpoint")              # the engine `gigadecode generate` builds, with its defaults
    outs = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=16))
    print(outs[0].outputs[0].text)
    reply = llm.chat([{"role": "user", "content": "What is 2 + 3?"}], SamplingParams(max_tokens=256))[0].outputs[0]
    print(reply.reasoning_content, reply.content, reply.tool_calls)

Prompts are text, `{"prompt": text}`, `{"prompt_token_ids": [...]}` or a list of token ids, alone or in a list;
every prompt of a call is batched together, and the outputs come back in the prompts' order. `SamplingParams`
is the engine's (`sampling.SamplingParams`: vLLM's names, ranges and defaults) plus what acts on text, which
the engine never sees: `n` sequences a prompt (the j-th of a seeded request draws with seed + j, as the
server's choices do), `stop` strings (matched across tokens; the sequence ends at the token that completes
one), `include_stop_str_in_output`, `skip_special_tokens` and `truncate_prompt_tokens`.

A sequence whose max_tokens reach past the context ends at its end (finish_reason "length"), as in vLLM.
Bad input loses nothing: a prompt the engine refuses (past the context, ids outside the vocabulary) raises
before any prompt of the call runs, and a sequence that fails in the engine comes back with
`finish_reason "error"` and its `error`, the others whole.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from .sampling import SamplingError, nth_seed, truncate_prompt
from .sampling import SamplingParams as EngineSamplingParams
from .stop_strings import StopMatcher

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob"]

@dataclass(frozen=True)
class SamplingParams(EngineSamplingParams):
    """The engine's sampling parameters and vLLM's text-level ones (see the module docstring)."""

    n: int = 1
    stop: Sequence[str] | str | None = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None     # keep the prompt's last N tokens (-1: the context length)

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise SamplingError("n", f"must be an integer >= 1 (got {self.n!r})")
        stop = () if self.stop is None else (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, Sequence) or not all(isinstance(s, str) for s in stop):
            raise SamplingError("stop", f"must be a string or a list of strings (got {self.stop!r})")
        object.__setattr__(self, "stop", tuple(s for s in stop if s))
        t = self.truncate_prompt_tokens
        if t is not None and (isinstance(t, bool) or not isinstance(t, int) or not (t >= 1 or t == -1)):
            raise SamplingError("truncate_prompt_tokens", f"must be >= 1, or -1 for the context length (got {t!r})")
        for name in ("include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise SamplingError(name, f"must be a bool (got {getattr(self, name)!r})")


@dataclass
class Logprob:
    """A token's raw logprob (log-softmax of the logits), its rank among the vocabulary, its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One sequence: its text and tokens, logprobs when asked for (per token, {token id: Logprob}: the sampled
    token and the top ones), why it ended (`stop_reason`: the stop string or stop token, None at an eos or
    the length limit), and for `LLM.chat` the harmony reply parsed: reasoning, content and tool calls."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    reasoning_content: str | None = None
    content: str | None = None
    tool_calls: list[dict[str, str]] = field(default_factory=list)

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """One prompt's outputs (`n` sequences), with its token ids and, when asked for, their logprobs."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int | None = None
    finished: bool = True


class _Sequence:
    """One engine request on its way: its text so far, matched against its stop strings."""

    def __init__(self, rid: str, params: SamplingParams, codec) -> None:
        from .tokenizer import StreamDecoder
        self.rid, self.params = rid, params
        self.decoder = StreamDecoder(codec, params.skip_special_tokens) if codec is not None else None
        self.stops = StopMatcher(params.stop, params.include_stop_str_in_output)
        self.text: list[str] = []
        self.kept: int | None = None          # the tokens kept when a stop string ended it
        self.pushed = 0

    def push(self, token_ids: list[int], stop_token: bool = False) -> bool:
        """Decode the new tokens; True when a stop string completed (the tokens after its last are dropped).
        `stop_token`: the last of them is the stop token (EOS or one of `stop_token_ids`) that ended the
        sequence; as in vLLM it stays in the token ids, but its text is left out unless the params ask for
        include_stop_str_in_output."""
        if self.decoder is None or self.kept is not None:
            return False
        skip = len(token_ids) - 1 if stop_token and not self.params.include_stop_str_in_output else -1
        for i, t in enumerate(token_ids):
            self.pushed += 1
            if i == skip:
                break
            # a request's first min_tokens tokens may start a stop string but not end one (vLLM's rule)
            self.text.append(self.stops.push(self.decoder.push(t), protected=self.pushed <= self.params.min_tokens))
            if self.stops.hit:
                self.kept = self.pushed
                return True
        return False

    def finish(self) -> str:
        if self.decoder is None:
            return ""
        if self.kept is None:
            self.text.append(self.stops.push(self.decoder.flush()))
            self.text.append(self.stops.flush())
        return "".join(self.text)


class LLM:
    """A GPT-OSS checkpoint ready to generate from Python. Engine options take vLLM's names where vLLM has
    one (`kv_cache_dtype`, `max_num_batched_tokens`, `enable_prefix_caching`, `speculative_config`, ...);
    the rest are the command line's (`decoder`, `threads`, `num_blocks`, `kv_budget_gib`); every default is
    `gigadecode generate`'s. `chat_template`: a file or a Jinja template instead of the checkpoint's. `seed`:
    as `serve --seed` (sampled requests without one draw theirs from it; vLLM's LLM defaults to 0, this to
    fresh randomness)."""

    def __init__(self, model: str, *, dtype: str = "auto", kv_cache_dtype: str | None = None,
                 block_size: int = 16, num_blocks: int | None = None, kv_budget_gib: float | None = None,
                 max_model_len: int | None = None, max_num_seqs: int = 64, max_num_batched_tokens: int = 1024,
                 enable_prefix_caching: bool = False, speculative_config: Mapping | str | None = None,
                 scheduling_policy: str = "fcfs", decoder: str = "gk-native", threads: int | None = None,
                 chat_template: str | None = None, warmup: bool = True, tensor_parallel_size: int = 1,
                 seed: int | None = None) -> None:
        import json

        from .chat_template import load_chat_template_arg
        from .engine import LLMEngine
        from .engine_config import engine_config_from_args, kv_dtype_name
        from .hub import resolve_model
        from .runner import ModelRunner
        from .tokenizer import TextCodec
        if tensor_parallel_size != 1:
            raise ValueError("LLM runs one engine in this process (tensor_parallel_size 1); for TP / DP / EP run "
                             "`gigadecode serve` or `generate` under torchrun with --tp / --dp / --ep")
        self.model = str(resolve_model(model))
        try:
            kv_dtype = None if kv_cache_dtype is None else kv_dtype_name(kv_cache_dtype)
        except ValueError as e:
            raise ValueError(f"kv_cache_dtype: {e}") from None
        spec = json.dumps(speculative_config) if isinstance(speculative_config, Mapping) else speculative_config
        args = argparse.Namespace(
            model=self.model, dtype=dtype, kv_dtype=kv_dtype, block_size=block_size, num_blocks=num_blocks,
            kv_budget_gib=kv_budget_gib, decoder=decoder, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
            max_prefill_tokens=max_num_batched_tokens, threads=threads, tp=1, dp=1, ep=1,
            enable_prefix_caching=enable_prefix_caching, speculative_config=spec,
            scheduling_policy=scheduling_policy, engine_seed=seed)
        self.engine_config = engine_config_from_args(args)
        source = None if chat_template is None else load_chat_template_arg(chat_template)
        self.codec = TextCodec.from_dir(self.model, source)
        self.engine = LLMEngine(ModelRunner(self.model, self.engine_config, progress=False))
        if warmup:
            self.engine.warm_up()
        self._calls = 0

    def get_tokenizer(self):
        """The checkpoint's text codec (`encode`, `decode`, `apply_chat_template`), None without tokenizer.json."""
        return self.codec

    # -- generation ----------------------------------------------------------------------------------------
    def generate(self, prompts: Any, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 *, priority: Sequence[int] | None = None, use_tqdm: bool = False) -> list[RequestOutput]:
        """Complete each prompt (text, {"prompt": text}, {"prompt_token_ids": ids} or a list of ids; one or a
        list) with its params (one for all, or one per prompt); -> one RequestOutput a prompt, in order.
        (`use_tqdm`: taken for vLLM's scripts; no progress bar is drawn.)"""
        items = self._prompts(prompts)
        return self._run(items, self._params(sampling_params, len(items)), priority, chat=False)

    def chat(self, messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
             tools: Sequence[Mapping[str, Any]] | None = None, reasoning_effort: str | None = None,
             add_generation_prompt: bool = True, chat_template_kwargs: Mapping[str, Any] | None = None,
             use_tqdm: bool = False) -> list[RequestOutput]:
        """Reply to one conversation (a list of OpenAI-style messages) or to each of a list of them, rendered
        by the chat template with `tools` and `reasoning_effort`; each output also has the harmony reply
        parsed (`reasoning_content`, `content`, `tool_calls`)."""
        if self.codec is None:
            raise ValueError("chat needs the checkpoint's tokenizer.json and chat template")
        convs = [messages] if messages and isinstance(messages[0], Mapping) else list(messages)
        if not convs or not all(convs):
            raise ValueError("no messages given")
        extra = dict(chat_template_kwargs or {})
        if reasoning_effort is not None:
            extra["reasoning_effort"] = reasoning_effort
        items = []
        for conv in convs:
            if not isinstance(conv, Sequence) or not all(isinstance(m, Mapping) for m in conv):
                raise ValueError("messages must be a list of message dicts, or a list of such lists")
            text = self.codec.render_chat(conv, add_generation_prompt, tools=tools, **extra)
            items.append((text, self.codec.encode(text)))
        return self._run(items, self._params(sampling_params, len(items)), None, chat=True)

    def _prompts(self, prompts: Any) -> list[tuple[str | None, list[int]]]:
        """-> (text or None, token ids) per prompt."""
        single = (isinstance(prompts, (str, Mapping))
                  or (isinstance(prompts, Sequence) and prompts and all(type(t) is int for t in prompts)))
        out = []
        for p in ([prompts] if single else list(prompts)):
            if isinstance(p, Mapping) and "prompt_token_ids" in p:
                p = list(p["prompt_token_ids"])
            elif isinstance(p, Mapping) and "prompt" in p:
                p = p["prompt"]
            if isinstance(p, str):
                if self.codec is None:
                    raise ValueError("this checkpoint has no tokenizer.json: give prompts as token ids")
                out.append((p, self.codec.encode(p)))
            elif isinstance(p, Sequence) and all(type(t) is int for t in p):
                out.append((None, list(p)))
            else:
                raise ValueError(f"a prompt is text, {{'prompt': text}}, {{'prompt_token_ids': [...]}} or a "
                                 f"list of token ids (got {type(p).__name__})")
        if not out:
            raise ValueError("no prompts given")
        return out

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` / `chat` use when given no SamplingParams, as vLLM's `LLM`: vLLM's defaults with the
        checkpoint's generation_config.json sampling fields over them (temperature, top_p, top_k, min_p,
        repetition_penalty, and max_new_tokens as max_tokens; the server takes the same fields but max_new_tokens)."""
        return SamplingParams(**dict(self.engine.generation_defaults.sampling))

    def _params(self, sp: Any, n: int) -> list[SamplingParams]:
        if sp is None:
            return [self.get_default_sampling_params()] * n
        if isinstance(sp, EngineSamplingParams):
            sp = [sp] * n
        if len(sp) != n:
            raise ValueError(f"{len(sp)} sampling params for {n} prompts")
        return [p if isinstance(p, SamplingParams) else SamplingParams(**{
            f: getattr(p, f) for f in p.__dataclass_fields__}) for p in sp]

    def _run(self, items: list[tuple[str | None, list[int]]], params: list[SamplingParams],
             priority: Sequence[int] | None, chat: bool) -> list[RequestOutput]:
        eng = self.engine
        if priority is not None and len(priority) != len(items):
            raise ValueError(f"{len(priority)} priorities for {len(items)} prompts")
        if self.codec is None and any(sp.stop for sp in params):
            raise ValueError("stop strings need the checkpoint's tokenizer.json (stop_token_ids work without)")
        self._calls += 1
        seqs: list[list[_Sequence]] = [[] for _ in items]
        added: list[str] = []
        try:
            # every prompt is queued, or none is: a refused one (RequestError) takes the others back out
            for k, ((_, ids), sp) in enumerate(zip(items, params)):
                ids = truncate_prompt(ids, sp.truncate_prompt_tokens, eng.max_model_len)
                items[k] = (items[k][0], ids)
                room = eng.max_model_len - len(ids)     # vLLM's offline engine ends a sequence at the context's
                if 0 < room < sp.max_tokens:            # end ("length"), whatever max_tokens asked for
                    sp = replace(sp, max_tokens=room, min_tokens=min(sp.min_tokens, room))
                for j in range(sp.n):
                    pj = sp if j == 0 or sp.seed is None else replace(sp, seed=nth_seed(sp.seed, j))
                    rid = eng.add_request(ids, pj, request_id=f"llm-{self._calls}-{k}-{j}",
                                          priority=0 if priority is None else priority[k])
                    added.append(rid)
                    seqs[k].append(_Sequence(rid, pj, self.codec))
            by_id = {s.rid: s for row in seqs for s in row}
            while any(not eng.requests[rid].finished for rid in added):
                for out in eng.step():
                    s = by_id.get(out.request_id)
                    stop_token = out.finished and out.finish_reason == "stop"
                    if s is not None and s.push(out.new_token_ids, stop_token):
                        eng.abort(s.rid, "stop")
            return [RequestOutput(request_id=f"llm-{self._calls}-{k}", prompt=items[k][0],
                                  prompt_token_ids=list(items[k][1]),
                                  outputs=[self._completion(j, s, chat) for j, s in enumerate(row)],
                                  num_cached_tokens=eng.requests[row[0].rid].num_cached_tokens,
                                  prompt_logprobs=self._prompt_logprobs(eng.requests[row[0].rid]))
                    for k, row in enumerate(seqs)]
        finally:                                    # done, refused or interrupted: the engine keeps none of them
            for rid in added:
                eng.abort(rid)
                eng.requests.pop(rid, None)

    def _prompt_logprobs(self, r) -> list[dict[int, Logprob] | None] | None:
        return None if r.params.prompt_logprobs is None else [self._logprob_dict(lp) for lp in r.prompt_logprobs]

    def _completion(self, index: int, s: _Sequence, chat: bool) -> CompletionOutput:
        r = self.engine.requests[s.rid]
        ids = r.output_ids if s.kept is None else r.output_ids[:s.kept]
        text = s.finish()
        lps = r.output_logprobs[:len(ids)] if r.params.logprobs is not None else None
        # a stop string that the last token allowed (max_tokens) completed still ends it "stop", as in vLLM
        reason = "stop" if s.kept is not None else r.finish_reason
        stop_reason: int | str | None = s.stops.matched
        if s.kept is None and reason == "stop" and ids and ids[-1] in r.params.stop_token_ids:
            stop_reason = ids[-1]
        out = CompletionOutput(index=index, text=text, token_ids=list(ids), finish_reason=reason,
                               stop_reason=stop_reason, error=r.error,
                               logprobs=None if lps is None else [self._logprob_dict(lp) for lp in lps],
                               cumulative_logprob=None if lps is None else float(sum(lp.logprob for lp in lps)))
        if chat and self.codec is not None:
            from .generate import parse_reply
            reply = parse_reply(self.codec, list(ids))
            out.reasoning_content, out.content = reply.get("reasoning_content"), reply.get("content")
            out.tool_calls = reply.get("tool_calls", [])
        return out

    def _logprob_dict(self, lp) -> dict[int, Logprob] | None:
        """vLLM's per-token form: {token id: Logprob} for the sampled token and the top ones."""
        if lp is None:
            return None
        text = (lambda t: self.codec.decode([t], skip_special_tokens=False)) if self.codec else (lambda t: None)
        d = {t: Logprob(float(v), rank, text(t)) for rank, (t, v) in enumerate(lp.top, 1)}
        d.setdefault(lp.token_id, Logprob(float(lp.logprob), lp.rank, text(lp.token_id)))
        return d
