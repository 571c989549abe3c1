"""The OpenAI protocol of the server: request bodies, errors in OpenAI's shape, and the sampling parameters a
body asks for.

Bodies are parsed in two steps: `read_json` (strict JSON, `body.load_object`) and `parse` into the pydantic
models below (structure and types; a bad field is a 400 whose `param` names it). Sampling values are checked
by `SamplingParams`. What a body asks for that this server does not do is a 400 naming the field
(`refuse_unsupported`: OpenAI's fields this server does not do, and vLLM's extras that would change the
output), never silently ignored; fields that change nothing here (`user`, `metadata`, `store`, `cache_salt`,
...) are accepted, and other unknown keys ignored, as vLLM ignores them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, Literal

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError

from ..connector.params import KVTransferParams
from ..sampling import SamplingError, SamplingParams
from .async_engine import EngineDeadError
from .body import BodyError, load_object
from .errors import APIError, error_body, error_response  # noqa: F401  (the routes import them from here too)

#: sampling fields read from the body as they are (SamplingParams checks types and ranges)
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "seed", "min_tokens", "ignore_eos",
                 "stop_token_ids", "repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias")
DEFAULT_COMPLETION_MAX_TOKENS = 16          # OpenAI's default for /v1/completions
MAX_N = 16                                  # choices per request
MAX_SEQUENCES = 1024                        # prompts × n per request (a bound on what one body can queue)
MAX_STOP_STRINGS = 16


_UNION_MEMBER = re.compile(r"(str|int|float|bool|[a-z_]+\[.*\]|[A-Z]\w*)")


def _is_union_member(part: Any) -> bool:
    """Whether a part of a pydantic error's `loc` is the union member the value was tried as (`str`,
    `list[int]`, `dict[str,any]`), not a field name, key or index."""
    return isinstance(part, str) and _UNION_MEMBER.fullmatch(part) is not None


def validation_error(errors: Sequence[dict[str, Any]]) -> APIError:
    err = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    if err.get("type") == "json_invalid":
        return APIError(400, f"malformed JSON body: {err.get('msg')}", code="invalid_json")

    def path(e: Mapping[str, Any]) -> list[str]:
        return [str(p) for p in e.get("loc", ()) if p != "body" and not _is_union_member(p)]

    loc, msg = path(err), str(err.get("msg"))
    raw = tuple(err.get("loc", ()))
    tag = next((i for i, p in enumerate(raw) if _is_union_member(p)), None)
    if tag is not None:
        # A value no member of a union field takes (`stop: str | list[str]`) fails once per member, each
        # error under the member's name (`stop`, `list[str]`, 0): name the place without those names, where
        # a member got furthest into the value, with what each member wanted there.
        same = [e for e in errors if tuple(e.get("loc", ()))[:tag] == raw[:tag]
                and len(e.get("loc", ())) > tag and _is_union_member(e["loc"][tag])]
        loc = max((path(e) for e in same), key=len)
        wanted = list(dict.fromkeys(str(e.get("msg")) for e in same if path(e) == loc))
        msg = ", or ".join([wanted[0]] + [w.removeprefix("Input should be ") for w in wanted[1:]])
    param = ".".join(loc) or None
    return APIError(400, f"{param}: {msg}" if param else msg, param=param)


def engine_error(e: BaseException, prompt_param: str) -> APIError:
    """`AsyncEngine.submit`'s exception -> the HTTP error."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, SamplingError):
        return APIError(400, str(e), param=e.param)
    if isinstance(e, EngineDeadError):
        return APIError(503, str(e), type="server_error", code="engine_unavailable")
    if isinstance(e, ValueError):          # RequestError (its field and kind) and other refusals of add_request
        param, code = getattr(e, "param", None), getattr(e, "code", None)
        if param == "prompt":
            param = prompt_param               # "messages" for chat
        if code is None and param is not None and param.startswith("kv_transfer_params"):
            code = "invalid_kv_transfer_params"
        return APIError(400, str(e), param=param, code=code)
    return APIError(500, f"the engine refused the request: {type(e).__name__}: {e}", type="server_error")


# --------------------------------------------------------------------------------------------------
# Request bodies (structure only: sampling values are checked by SamplingParams)
# --------------------------------------------------------------------------------------------------
class _Model(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Model):
    include_usage: StrictBool | None = False
    continuous_usage_stats: StrictBool | None = False      # vLLM: usage in every chunk (with include_usage)

    @property
    def continuous(self) -> bool:
        return bool(self.include_usage and self.continuous_usage_stats)


class _Body(_Model):
    model: StrictStr | None = None
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    n: StrictInt | None = Field(default=1, ge=1, le=MAX_N)
    stop: StrictStr | list[StrictStr] | None = Field(default=None)
    logit_bias: dict[StrictStr, StrictInt | StrictFloat] | None = None
    return_token_ids: StrictBool | None = False
    prompt_logprobs: StrictInt | None = None
    kv_transfer_params: KVTransferParams | None = None
    allowed_token_ids: list[StrictInt] | None = None         # vLLM's extras (extras.py)
    bad_words: list[StrictStr] | None = None
    include_stop_str_in_output: StrictBool | None = False
    truncate_prompt_tokens: StrictInt | None = None


class CompletionBody(_Body):
    prompt: StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]]
    echo: StrictBool | None = False
    suffix: StrictStr | None = None
    best_of: StrictInt | None = None
    skip_special_tokens: StrictBool | None = True


class ContentPart(_Model):
    type: StrictStr
    text: StrictStr | None = None


class FunctionCall(_Model):
    name: StrictStr
    arguments: StrictStr = "{}"


class ToolCall(_Model):
    id: StrictStr | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Model):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[ContentPart] | None = None
    name: StrictStr | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: StrictStr | None = None
    reasoning_content: StrictStr | None = None
    reasoning: StrictStr | None = None            # vLLM's name for reasoning_content


class FunctionDef(_Model):
    name: StrictStr = Field(min_length=1, max_length=128)
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None


class Tool(_Model):
    type: Literal["function"]
    function: FunctionDef


class ChatBody(_Body):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: StrictBool | None = False
    top_logprobs: StrictInt | None = None
    add_generation_prompt: StrictBool | None = True
    tools: list[Tool] | None = None
    tool_choice: StrictStr | dict[str, Any] | None = None
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = None     # minimal: GPT-OSS's low
    include_reasoning: StrictBool | None = True


async def read_json(request: Request) -> dict[str, Any]:
    try:
        return load_object(await request.body())
    except BodyError as e:
        raise APIError(400, str(e), code="invalid_json") from None


def parse(model: type[BaseModel], body: dict[str, Any]) -> Any:
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise validation_error(e.errors()) from None


def stop_strings(req: _Body) -> list[str]:
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > MAX_STOP_STRINGS:
        raise APIError(400, f"stop: at most {MAX_STOP_STRINGS} stop strings", param="stop")
    return [s for s in stop if s]


UNSUPPORTED_CHAT = {"functions": "the legacy `functions` field is not supported; use `tools`",
                    "function_call": "the legacy `function_call` field is not supported; use `tool_choice`",
                    "audio": "audio output is not supported", "modalities": "only text output is supported",
                    "prediction": "predicted outputs are not supported",
                    "continue_final_message": "continue_final_message is not supported",
                    "chat_template": "a request's own chat_template is not supported (the server's is used)",
                    "chat_template_kwargs": "chat_template_kwargs are not supported (use reasoning_effort)",
                    "documents": "documents are not supported",
                    "echo": "echo is not supported in chat (it is in /v1/completions)",
                    "skip_special_tokens": "skip_special_tokens=false is not supported in chat (harmony's special "
                                           "tokens are parsed, not shown; it is in /v1/completions)",
                    "best_of": "only best_of=1 is supported"}
UNSUPPORTED_COMPLETION = {"suffix": "suffix is not supported",
                          "best_of": "only best_of=1 is supported"}
# vLLM's extra fields that would change the output, on either route: a 400 unless the value is what this
# server does anyway (`_ASKS_NOTHING`), so a client never gets output that differs from what it asked for
UNSUPPORTED_EITHER = {
    "guided_whitespace_pattern": "guided_whitespace_pattern is not supported (JSON is laid out as json.dumps does)",
    "use_beam_search": "beam search is not supported", "length_penalty": "length_penalty needs beam search, "
                                                                      "which is not supported",
    "return_tokens_as_token_ids": "return_tokens_as_token_ids is not supported (use return_token_ids)",
    "detokenize": "detokenize=false is not supported",
    "logits_processors": "logits_processors are not supported", "vllm_xargs": "vllm_xargs are not supported",
}
# values of those fields that ask for exactly what the server does (None: the field left unset)
_ASKS_NOTHING: dict[str, tuple[Any, ...]] = {
    "use_beam_search": (False,), "length_penalty": (1, 1.0),
    "return_tokens_as_token_ids": (False,), "detokenize": (True,),
    "skip_special_tokens": (True,),
    "echo": (False,), "best_of": (1,), "continue_final_message": (False,), "chat_template_kwargs": ({},),
    "modalities": (["text"],), "documents": ([],), "suffix": ("",),
}


def _asks_nothing(key: str, value: Any) -> bool:
    # exact types: JSON true must not pass for 1, nor 0 for false
    return value is None or any(type(value) is type(v) and value == v for v in _ASKS_NOTHING.get(key, ()))


def refuse_unsupported(raw: Mapping[str, Any], chat: bool) -> None:
    """400 naming the first field this server would otherwise have to ignore, or fields that contradict each
    other (OpenAI's and vLLM's refusals)."""
    for k, why in {**(UNSUPPORTED_CHAT if chat else UNSUPPORTED_COMPLETION), **UNSUPPORTED_EITHER}.items():
        if not _asks_nothing(k, raw.get(k)):
            raise APIError(400, why, param=k)
    if chat:
        forced_tool(raw.get("tool_choice"), chat_form=True)           # a shape it cannot read: 400 here
        top = raw.get("top_logprobs")
        if top is not None and top != 0 and raw.get("logprobs") is not True:   # 0 asks for nothing (as vLLM)
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    if raw.get("stream_options") and raw.get("stream") is not True:
        raise APIError(400, "stream_options can only be set when stream is true", param="stream_options")
    request_priority(raw)


def request_priority(raw: Mapping[str, Any]) -> int:
    """vLLM's `priority` (unset or null: 0; lower is scheduled first): an integer, not a boolean. Whether
    the engine takes a non-zero one (--scheduling-policy priority) is the engine's to say (a 400 naming it)."""
    v = raw.get("priority")
    if v is None:
        return 0
    if type(v) is not int:
        raise APIError(400, f"priority must be an integer (got {v!r})", param="priority")
    return v


def sampling_params(raw: Mapping[str, Any], max_tokens: Any, logprobs: int | None,
                    defaults: Sequence[tuple[str, Any]] = (), prompt_logprobs: int | None = None,
                    guided: tuple[str, str, str] | None = None, extra: Mapping[str, Any] | None = None
                    ) -> SamplingParams:
    """The body's sampling fields; `defaults` (the checkpoint's generation_config.json) fill what it leaves
    unset (an explicit null counts as unset, as in vLLM); `extra`: fields the route worked out (vLLM's token
    masks, `extras.token_constraints`)."""
    d = {k: v for k, v in defaults if k != "max_tokens"}
    d.update({k: raw[k] for k in SAMPLING_KEYS if raw.get(k) is not None})
    d["max_tokens"] = max_tokens
    d["logprobs"] = logprobs
    d["prompt_logprobs"] = prompt_logprobs
    d["guided"] = guided
    d.update(extra or {})
    try:
        return SamplingParams.from_dict(d)
    except SamplingError as e:
        raise APIError(400, str(e), param=e.param) from None


async def read_body(request: Request, model: type[BaseModel], chat: bool) -> tuple[dict[str, Any], Any]:
    """A generation route's body: strict JSON, parsed into `model`, unsupported fields refused ->
    (the raw dict, the parsed body)."""
    raw = await read_json(request)
    req = parse(model, raw)
    refuse_unsupported(raw, chat=chat)
    return raw, req


# --------------------------------------------------------------------------------------------------
# Structured output
# --------------------------------------------------------------------------------------------------
GUIDED_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                 "structured_outputs")


@contextmanager
def errors_named(engine_param: str, field_: str | None) -> Iterator[None]:
    """A 400 the engine names by its own parameter (`max_tokens`, `guided`) is named by the field the client
    set it with (`max_completion_tokens`, `max_output_tokens`, `response_format`, ...), in its message too."""
    try:
        yield
    except APIError as e:
        if e.param == engine_param and field_ is not None and field_ != engine_param:
            e.param = field_
            e.message = e.message.replace(f"parameter {engine_param}", f"parameter {field_}", 1)
        raise


def forced_tool(choice: Any, chat_form: bool) -> tuple[bool, str | None]:
    """`tool_choice` -> (a call is required, the function it must call or None for any). "auto" / "none" /
    absent: (False, None); "required"; a named function: chat's {"type": "function", "function": {"name"}},
    the Responses API's {"type": "function", "name"}."""
    if choice in (None, "auto", "none"):
        return False, None
    if choice == "required":
        return True, None
    if isinstance(choice, Mapping) and choice.get("type") == "function":
        name = (choice.get("function") or {}).get("name") if chat_form else choice.get("name")
        if isinstance(name, str) and name:
            return True, name
    raise APIError(400, "tool_choice must be \"auto\", \"none\", \"required\" or a named function", param="tool_choice")


def forced_call(raw: Mapping[str, Any], tools: list[dict[str, Any]] | None, chat_form: bool, harmony: bool,
                guided: tuple[str, str, str] | None) -> tuple[str, str, str] | None:
    """A forced tool call (`tool_choice` "required" or named) as the grammar of a harmony call to one of the
    tools (`structured.forced_call_grammar`; `tools` in chat's form), or `guided` as it was."""
    need, name = forced_tool(raw.get("tool_choice"), chat_form)
    if not need:
        return guided
    if not harmony:
        raise APIError(400, "a forced tool call needs a harmony chat template (GPT-OSS's)", param="tool_choice")
    if guided is not None:
        raise APIError(400, "a forced tool call and structured output cannot be asked for together", param="tool_choice")
    from ..structured import forced_call_grammar
    try:
        return ("grammar", forced_call_grammar(tools or [], name), "all")
    except ValueError as e:
        raise APIError(400, f"tool_choice: {e}", param="tool_choice") from None


def guided_of(raw: Mapping[str, Any], scope: str) -> tuple[tuple[str, str, str] | None, str | None]:
    """The body's structured-output request (OpenAI's `response_format`, vLLM's `guided_*` fields or its
    `structured_outputs`) -> ((kind, source, scope) for SamplingParams.guided, or None; the field it came
    from). At most one may be set."""
    given = [k for k in GUIDED_FIELDS if raw.get(k) is not None
             and not (k == "response_format" and raw[k] == {"type": "text"})]
    if not given:
        return None, None
    if len(given) > 1:
        raise APIError(400, f"give one structured-output field, not {' and '.join(given)}", param=given[1])
    field_ = given[0]
    v = raw[field_]
    spec: dict[str, Any]
    if field_ == "response_format":
        if not isinstance(v, Mapping) or v.get("type") not in ("json_object", "json_schema"):
            raise APIError(400, "response_format: type must be text, json_object or json_schema", param=field_)
        if v["type"] == "json_object":
            spec = {"json_object": True}
        else:
            js = v.get("json_schema")
            if not isinstance(js, Mapping) or not isinstance(js.get("schema", {}), Mapping):
                raise APIError(400, "response_format.json_schema must be an object with a `schema` object",
                               param="response_format.json_schema")
            spec = {"json": js.get("schema", {})}
    elif field_ == "structured_outputs":
        if not isinstance(v, Mapping):
            raise APIError(400, "structured_outputs must be an object", param=field_)
        # options that would change the output (`disable_additional_properties` asks for what the server does:
        # structured.closed_objects)
        for k, unset in (("whitespace_pattern", None), ("structural_tag", None)):
            if v.get(k, unset) not in (unset, None):
                raise APIError(400, f"structured_outputs.{k} is not supported", param=f"{field_}.{k}")
        spec = {k: v[k] for k in ("json", "regex", "choice", "grammar", "json_object") if v.get(k) not in (None, False)}
        if len(spec) != 1:
            raise APIError(400, "structured_outputs: give exactly one of json, regex, choice, grammar, json_object",
                           param=field_)
    else:
        spec = {field_.removeprefix("guided_"): v}
    (kind, value), = spec.items()
    if kind == "json_object":
        return ("json_object", "", scope), field_
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise APIError(400, f"{field_}: the schema is not JSON: {e}", param=field_) from None
        if not isinstance(value, Mapping):
            raise APIError(400, f"{field_}: the schema must be a JSON object", param=field_)
        return ("json", json.dumps(value), scope), field_
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise APIError(400, f"{field_}: choices must be a non-empty list of strings", param=field_)
        return ("choice", json.dumps(value), scope), field_
    if not isinstance(value, str) or not value:
        raise APIError(400, f"{field_}: the {kind} must be a non-empty string", param=field_)
    return (kind, value, scope), field_
