"""The chat endpoint's harmony output, end to end through the real app and the official `openai` client,
with an engine that replies a scripted harmony token sequence (encoded with the tiny checkpoint's
tokenizer, which carries harmony's special tokens): reasoning_content apart from content, tool calls whole
and streamed (`finish_reason: "tool_calls"`), stop strings applied to content only, malformed output as
text, a preamble kept out of a structured answer, and `/v1/completions` left raw."""

from __future__ import annotations

import json
from types import SimpleNamespace

import openai
import pytest

from gigadecode.engine import RequestOutput
from gigadecode.request import EngineStats
from gigadecode.server.api import build_app
from gigadecode.server.async_engine import AsyncEngine
from gigadecode.tokenizer import TextCodec
from gigadecode.tokenizer_data import HARMONY_CHAT_TEMPLATE

from .test_server import ServerThread

REPLY_ANSWER = ("<|channel|>analysis<|message|>ones: 7 + 5 = 12, carry 1. tens: 3 + 4 + 1 = 8.<|end|>"
                "<|start|>assistant<|channel|>final<|message|>37 + 45 = 82<|return|>")
REPLY_CALL = ("<|channel|>analysis<|message|>Use the tool.<|end|><|start|>assistant<|channel|>commentary "
              "to=functions.add <|constrain|>json<|message|>{\"a\": 37, \"b\": 45}<|call|>")
REPLY_BAD = "<|channel|>commentary to=functions.add <|constrain|>json<|message|>{\"a\": 37,<|call|>"


class ScriptedEngine:
    """Replies `script(prompt)`'s token ids, one per step (the AsyncEngine contract, no model)."""

    max_model_len = 4096

    def __init__(self, codec: TextCodec, reply: str, stop_ids: set[int]) -> None:
        self.codec, self.reply, self.stop_ids = codec, reply, stop_ids
        self.running, self.waiting, self.requests, self.stats = [], [], {}, EngineStats()
        self.runner = SimpleNamespace(kv=SimpleNamespace(num_blocks=9))

    def add_request(self, prompt_ids, params, request_id=None, **kw):
        req = SimpleNamespace(request_id=request_id, finished=False, finish_reason=None, error=None,
                              kv_transfer_params_out=None, todo=self.codec.encode(self.reply)[:params.max_tokens])
        self.requests[request_id] = req
        self.running.append(req)
        return request_id

    def has_unfinished(self):
        return bool(self.running)

    def kv_usage(self):
        return 0, 8

    def step(self):
        outs = []
        for r in list(self.running):
            tok = r.todo.pop(0)
            done = not r.todo or tok in self.stop_ids
            if done:
                r.finished, r.finish_reason = True, "stop" if tok in self.stop_ids else "length"
                self.running.remove(r)
            outs.append(RequestOutput(r.request_id, [tok], done, r.finish_reason))
        return outs

    def abort(self, rid):
        r = self.requests.get(rid)
        if r is not None and not r.finished:
            r.finished, r.finish_reason = True, "abort"
            self.running.remove(r)
            return True
        return False


@pytest.fixture(scope="module")
def codec(tiny_ckpt):
    return TextCodec.from_dir(tiny_ckpt)


def client_for(codec, reply):
    stop = {codec.token_id("<|return|>"), codec.token_id("<|call|>")}
    app = build_app(AsyncEngine(ScriptedEngine(codec, reply, stop), codec=codec), "demo")
    srv = ServerThread(app)
    srv.__enter__()
    return srv, openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=30)


MSGS = [{"role": "user", "content": "What is 37 + 45?"}]
TOOLS = [{"type": "function", "function": {"name": "add", "description": "a + b", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}]


def test_reasoning_apart_from_content(codec):
    srv, c = client_for(codec, REPLY_ANSWER)
    try:
        r = c.chat.completions.create(model="demo", messages=MSGS, max_tokens=200)
        m = r.choices[0].message
        assert m.content == "37 + 45 = 82" and r.choices[0].finish_reason == "stop"
        assert m.model_extra["reasoning_content"] == "ones: 7 + 5 = 12, carry 1. tens: 3 + 4 + 1 = 8."
        content = reasoning = ""
        for ch in c.chat.completions.create(model="demo", messages=MSGS, max_tokens=200, stream=True):
            d = ch.choices[0].delta
            content += d.content or ""
            reasoning += (d.model_extra or {}).get("reasoning_content") or ""
        assert content == m.content and reasoning == m.model_extra["reasoning_content"]
        r = c.chat.completions.create(model="demo", messages=MSGS, max_tokens=200, stop=[" = "])
        assert r.choices[0].message.content == "37 + 45" and r.choices[0].finish_reason == "stop"
        assert "=" in r.choices[0].message.model_extra["reasoning_content"]    # stop strings cut content only
        raw = c.completions.create(model="demo", prompt="x", max_tokens=200)      # completions stay raw
        assert "ones: 7 + 5" in raw.choices[0].text and "37 + 45 = 82" in raw.choices[0].text
    finally:
        srv.__exit__()


def test_tool_call_whole_and_streamed(codec):
    srv, c = client_for(codec, REPLY_CALL)
    try:
        r = c.chat.completions.create(model="demo", messages=MSGS, tools=TOOLS, max_tokens=200)
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls" and not ch.message.content
        (call,) = ch.message.tool_calls
        assert call.type == "function" and call.function.name == "add" and call.id.startswith("call_")
        assert json.loads(call.function.arguments) == {"a": 37, "b": 45}
        calls: dict[int, dict] = {}
        reasons = []
        for chunk in c.chat.completions.create(model="demo", messages=MSGS, tools=TOOLS, max_tokens=200,
                                               stream=True):
            d = chunk.choices[0].delta
            reasons.append(chunk.choices[0].finish_reason)
            for tc in d.tool_calls or []:
                e = calls.setdefault(tc.index, {"id": tc.id, "name": None, "arguments": ""})
                e["name"] = e["name"] or (tc.function.name if tc.function else None)
                e["arguments"] += (tc.function.arguments or "") if tc.function else ""
        assert list(calls) == [0] and calls[0]["name"] == "add" and calls[0]["id"].startswith("call_")
        assert json.loads(calls[0]["arguments"]) == {"a": 37, "b": 45} and reasons[-1] == "tool_calls"
        # the tool result goes back as role "tool" after the assistant's call: the template renders it
        follow = MSGS + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                         {"role": "tool", "tool_call_id": call.id, "content": "82"}]
        assert c.chat.completions.create(model="demo", messages=follow, tools=TOOLS, max_tokens=5).choices
    finally:
        srv.__exit__()


def test_malformed_output_is_text_not_500(codec):
    srv, c = client_for(codec, REPLY_BAD)
    try:
        r = c.chat.completions.create(model="demo", messages=MSGS, tools=TOOLS, max_tokens=200)
        assert r.choices[0].finish_reason == "stop" and not r.choices[0].message.tool_calls
        assert "functions.add" in r.choices[0].message.content and "37" in r.choices[0].message.content
        r = c.chat.completions.create(model="demo", messages=MSGS, max_tokens=6)      # cut mid-channel
        assert r.choices[0].finish_reason == "length"
    finally:
        srv.__exit__()


def test_a_stop_string_after_a_tool_call_still_reports_tool_calls(codec):
    """The model called a tool, went on (ignore_eos: <|call|> did not stop it) and hit a stop string in its
    answer: the call is returned and finish_reason says tool_calls (as without the stop string), not stop."""
    reply = REPLY_CALL + "<|start|>assistant<|channel|>final<|message|>The answer is 82.<|return|>"
    app = build_app(AsyncEngine(ScriptedEngine(codec, reply, {codec.token_id("<|return|>")}), codec=codec), "demo")
    with ServerThread(app) as srv:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=30)
        for stop, content in ((None, "The answer is 82."), (["answer"], "The ")):
            ch = c.chat.completions.create(model="demo", messages=MSGS, tools=TOOLS, max_tokens=200, stop=stop,
                                           extra_body={"ignore_eos": True}).choices[0]
            assert (ch.finish_reason, len(ch.message.tool_calls), ch.message.content) == ("tool_calls", 1, content)


# The message loop of the chat template openai/gpt-oss-20b and -120b publish, cut to what renders an earlier call
# and its result: the analysis before the call from `thinking` or `content` (both: an error), the call's arguments
# through `tojson`, as transformers' templates take them (an object)
PUBLISHED_CALL_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message.role == 'assistant' and 'tool_calls' in message -%}"
    "{%- set tool_call = message.tool_calls[0] -%}"
    "{%- if message.content and message.thinking -%}"
    "{{- raise_exception('Cannot pass both content and thinking in an assistant message with tool calls! "
    "Put the analysis message in one or the other, but not both.') -}}"
    "{%- elif message.content -%}"
    "{{- '<|start|>assistant<|channel|>analysis<|message|>' + message.content + '<|end|>' -}}"
    "{%- elif message.thinking -%}"
    "{{- '<|start|>assistant<|channel|>analysis<|message|>' + message.thinking + '<|end|>' -}}"
    "{%- endif -%}"
    "{%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif -%}"
    "{{- '<|start|>assistant to=functions.' + tool_call.name + '<|channel|>commentary json<|message|>' -}}"
    "{{- tool_call.arguments|tojson -}}{{- '<|call|>' -}}"
    "{%- elif message.role == 'tool' -%}"
    "{{- '<|start|>functions.add to=assistant<|channel|>commentary<|message|>' + message.content|tojson + '<|end|>' -}}"
    "{%- else -%}{{- '<|start|>' + message.role + '<|message|>' + message.content + '<|end|>' -}}{%- endif -%}"
    "{%- endfor -%}{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}")


@pytest.mark.parametrize("published", [False, True])     # the demo model's template, or GPT-OSS's
def test_an_earlier_calls_arguments_are_rendered_as_json_not_as_a_quoted_string(codec, published):
    """OpenAI clients send an earlier call's arguments back as the JSON string the server answered; chat
    templates render them with `tojson` (GPT-OSS's published one does, always), which would quote that string
    ("{\\"a\\": 37, ...}"): the prompt must hold the call as the model wrote it, as vLLM renders it."""
    template = PUBLISHED_CALL_TEMPLATE if published else HARMONY_CHAT_TEMPLATE
    codec = TextCodec(codec.tokenizer, {**codec.config, "chat_template": template})
    srv, c = client_for(codec, REPLY_ANSWER)
    try:
        call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 37, "b": 45}'}}
        follow = MSGS + [{"role": "assistant", "content": None, "tool_calls": [call]},
                         {"role": "tool", "tool_call_id": "call_1", "content": "82"}]
        r = c.chat.completions.create(model="demo", messages=follow, tools=TOOLS, max_tokens=5,
                                      extra_body={"return_token_ids": True})
        prompt = codec.decode(r.model_extra["prompt_token_ids"], skip_special_tokens=False)
        assert '<|message|>{"a": 37, "b": 45}<|call|>' in prompt, prompt
    finally:
        srv.__exit__()


REPLY_PREAMBLE = ("<|channel|>analysis<|message|>Add them.<|end|><|start|>assistant<|channel|>commentary<|message|>"
                  "Let me answer.<|end|><|start|>assistant<|channel|>final<|message|>{\"sum\": 82}<|return|>")


def test_a_preamble_before_a_structured_answer_is_not_content(codec):
    """GPT-OSS may write a preamble (commentary without a recipient) before its final message; structured
    output holds the final message only, so with `response_format` (`text.format`) the content must be that
    message alone, or OpenAI's `parse` helpers fail on `Let me answer.\\n{...}`. Unstructured, a preamble stays
    content, as in vLLM."""
    from pydantic import BaseModel

    class Sum(BaseModel):
        sum: int
    srv, c = client_for(codec, REPLY_PREAMBLE)
    try:
        fmt = {"type": "json_schema", "json_schema": {"name": "Sum", "schema": Sum.model_json_schema()}}
        m = c.chat.completions.create(model="demo", messages=MSGS, response_format=fmt).choices[0].message
        assert m.content == '{"sum": 82}' and m.model_extra["reasoning_content"] == "Add them.\nLet me answer."
        assert c.chat.completions.parse(model="demo", messages=MSGS, response_format=Sum).choices[0].message.parsed \
            == Sum(sum=82)
        content = reasoning = ""
        for ch in c.chat.completions.create(model="demo", messages=MSGS, stream=True,
                                            response_format={"type": "json_object"}):
            content += ch.choices[0].delta.content or ""
            reasoning += (ch.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
        assert (content, reasoning) == ('{"sum": 82}', "Add them.\nLet me answer.")
        r = c.responses.parse(model="demo", input="What is 37 + 45?", text_format=Sum)
        # one item per harmony message; the preamble goes with the reasoning, so output_text is the answer alone
        assert r.output_parsed == Sum(sum=82) and [o.type for o in r.output] == ["reasoning", "reasoning", "message"]
        assert [o.content[0].text for o in r.output[:2]] == ["Add them.", "Let me answer."]
        assert (r.output[2].phase, r.output_text) == ("final_answer", '{"sum": 82}')
        preamble_and_analysis = len(codec.encode("Add them.")) + len(codec.encode("Let me answer."))
        assert r.usage.output_tokens_details.reasoning_tokens == preamble_and_analysis
        plain = c.chat.completions.create(model="demo", messages=MSGS).choices[0].message   # no grammar: as vLLM
        assert plain.content == 'Let me answer.\n{"sum": 82}' and plain.model_extra["reasoning_content"] == "Add them."
    finally:
        srv.__exit__()


REPLY_PREAMBLE_CALL = (REPLY_PREAMBLE.replace("final", "commentary to=functions.add <|constrain|>json")
                       .replace("<|return|>", "<|call|>"))


def _follow_prompt(codec, template, assistant):
    """The prompt a follow-up renders, after the call turn `assistant` and the tool's answer."""
    follow = MSGS + [assistant, {"role": "tool", "tool_call_id": "call_1", "content": "82"}]
    srv, c = client_for(TextCodec(codec.tokenizer, {**codec.config, "chat_template": template}), REPLY_ANSWER)
    try:
        r = c.chat.completions.create(model="demo", messages=follow, tools=TOOLS, max_tokens=5,
                                      extra_body={"return_token_ids": True})
        return codec.decode(r.model_extra["prompt_token_ids"], skip_special_tokens=False)
    finally:
        srv.__exit__()


CALL = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"sum": 82}'}}


@pytest.mark.parametrize("published", [False, True])
def test_a_call_turn_with_reasoning_and_a_preamble_comes_back(codec, published):
    """A reply with reasoning, a preamble (content) and a call, sent back as the next request's history: GPT-OSS's
    published template refuses `thinking` beside content before a call, which made the follow-up a 400; the
    call's turn keeps its chain of thought (harmony keeps it before a call), as the demo template does."""
    template = PUBLISHED_CALL_TEMPLATE if published else HARMONY_CHAT_TEMPLATE
    sent = {"role": "assistant", "content": "Let me answer.", "reasoning_content": "Add them.", "tool_calls": [CALL]}
    assert "<|channel|>analysis<|message|>Add them.<|end|>" in _follow_prompt(codec, template, sent)


@pytest.mark.parametrize("field", ["reasoning", "reasoning_content"])
def test_reasoning_goes_out_and_comes_back_under_vllms_names(codec, field):
    """vLLM answers the chain of thought as `reasoning` (it was `reasoning_content`, which DeepSeek's clients
    read): both are sent, whole and streamed, and an earlier call's turn sent back with either keeps it in the
    prompt, with GPT-OSS's published template too (it reads `thinking` only)."""
    srv, c = client_for(codec, REPLY_PREAMBLE_CALL)
    try:
        m = c.chat.completions.create(model="demo", messages=MSGS, tools=TOOLS).choices[0].message
        assert m.model_extra["reasoning"] == m.model_extra["reasoning_content"] == "Add them."
        assert m.content == "Let me answer." and m.tool_calls[0].function.arguments == '{"sum": 82}'
        deltas = [ch.choices[0].delta.model_extra or {} for ch in c.chat.completions.create(
            model="demo", messages=MSGS, tools=TOOLS, stream=True)]
        assert "".join(d.get("reasoning") or "" for d in deltas) == "Add them."
        assert "".join(d.get("reasoning_content") or "" for d in deltas) == "Add them."
    finally:
        srv.__exit__()
    sent = {"role": "assistant", "content": None, field: "Add them.", "tool_calls": [CALL]}
    assert "<|channel|>analysis<|message|>Add them.<|end|>" in _follow_prompt(codec, PUBLISHED_CALL_TEMPLATE, sent)


def test_the_stream_helper_closes_a_streamed_call(codec):
    """The openai client's `chat.completions.stream` fires `tool_calls.function.arguments.done` (with the parsed
    arguments) on a chunk after the call's delta: the call's delta ends the output, so the finish_reason comes in
    a chunk of its own (an empty delta), as OpenAI sends it."""
    from pydantic import BaseModel

    class add(BaseModel):  # noqa: N801 - the tool's name
        a: int
        b: int
    srv, c = client_for(codec, REPLY_CALL)
    try:
        with c.chat.completions.stream(model="demo", messages=MSGS, tools=[openai.pydantic_function_tool(add)]) as s:
            done = [e for e in s if e.type == "tool_calls.function.arguments.done"]
            final = s.get_final_completion()
        assert [(e.name, e.index, e.parsed_arguments) for e in done] == [("add", 0, add(a=37, b=45))]
        assert final.choices[0].finish_reason == "tool_calls"
        last = list(c.chat.completions.create(model="demo", messages=MSGS, tools=TOOLS, stream=True))[-1].choices[0]
        assert (last.delta.tool_calls, last.delta.content, last.finish_reason) == (None, None, "tool_calls")
    finally:
        srv.__exit__()


def test_usage_counts_the_reasoning_tokens(codec):
    """As OpenAI's reasoning models (and /v1/responses here) report it: `completion_tokens_details.reasoning_tokens`,
    the tokens of the analysis text, whole and in the streamed usage, summed over the choices; none for
    /v1/completions, which parses no channels."""
    thought = len(codec.encode("ones: 7 + 5 = 12, carry 1. tens: 3 + 4 + 1 = 8."))
    srv, c = client_for(codec, REPLY_ANSWER)
    try:
        u = c.chat.completions.create(model="demo", messages=MSGS, n=2).usage
        assert u.completion_tokens_details.reasoning_tokens == 2 * thought < u.completion_tokens
        chunks = list(c.chat.completions.create(model="demo", messages=MSGS, stream=True,
                                                stream_options={"include_usage": True}))
        assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == thought
        assert c.completions.create(model="demo", prompt="x", max_tokens=200).usage.completion_tokens_details is None
    finally:
        srv.__exit__()


def test_minimal_reasoning_effort_is_gpt_oss_low(codec):
    """OpenAI's `reasoning_effort: "minimal"` (the openai client offers it) is GPT-OSS's lowest, as /v1/responses
    takes `reasoning.effort: "minimal"`, not a 400."""
    srv, c = client_for(TextCodec(codec.tokenizer, {**codec.config, "chat_template": HARMONY_CHAT_TEMPLATE}),
                        REPLY_ANSWER)
    try:
        def prompt(effort):
            r = c.chat.completions.create(model="demo", messages=MSGS, max_tokens=1, reasoning_effort=effort,
                                          extra_body={"return_token_ids": True})
            return codec.decode(r.model_extra["prompt_token_ids"], skip_special_tokens=False)
        assert "Reasoning: low" in prompt("minimal") and prompt("minimal") == prompt("low") != prompt("high")
    finally:
        srv.__exit__()


@pytest.mark.parametrize("published", [False, True])     # the demo model's template, or GPT-OSS's
def test_every_call_of_an_earlier_turn_reaches_the_prompt(codec, published):
    """A turn with two calls (parallel tool calls, as this server answers them) sent back with both results:
    GPT-OSS's published template renders only a message's first call, so each call must reach it as a message
    of its own, or the second call vanishes from the prompt while its result stays."""
    template = PUBLISHED_CALL_TEMPLATE if published else HARMONY_CHAT_TEMPLATE
    calls = [{"id": f"call_{i}", "type": "function", "function": {"name": "add", "arguments": f'{{"a": {i}, "b": 2}}'}}
             for i in (1, 3)]
    follow = MSGS + [{"role": "assistant", "content": None, "reasoning_content": "Two sums.", "tool_calls": calls},
                     {"role": "tool", "tool_call_id": "call_1", "content": "3"},
                     {"role": "tool", "tool_call_id": "call_3", "content": "5"}]
    srv, c = client_for(TextCodec(codec.tokenizer, {**codec.config, "chat_template": template}), REPLY_ANSWER)
    try:
        r = c.chat.completions.create(model="demo", messages=follow, tools=TOOLS, max_tokens=5,
                                      extra_body={"return_token_ids": True})
        prompt = codec.decode(r.model_extra["prompt_token_ids"], skip_special_tokens=False)
    finally:
        srv.__exit__()
    assert prompt.count("Two sums.") == 1, prompt
    first, second = prompt.index('{"a": 1, "b": 2}<|call|>'), prompt.index('{"a": 3, "b": 2}<|call|>')
    assert first < second < prompt.index("<|start|>functions.add to=assistant"), prompt      # both calls, then results
