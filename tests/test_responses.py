"""`/v1/responses` through the official `openai` client, on the demo model (which reasons on harmony's analysis
channel, answers on final, and calls the `add` tool when offered): the output items carry exactly what the chat
route returns for the same conversation (reasoning, answer, tool call), a function_call_output continues it,
the stream's typed events add up to the whole response, and what a stateless server cannot do is refused."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest

from gigadecode.checkpoint import make_checkpoint
from gigadecode.request import RequestOutput
from gigadecode.server.async_engine import SHUTTING_DOWN
from gigadecode.server.chat import chat_prompt
from gigadecode.server.outputs import Choice, StopMatcher, TextRenderer
from gigadecode.server.protocol import ChatBody
from gigadecode.server.responses import ResponsesBody, _events, chat_messages, chat_tools
from gigadecode.tokenizer import TextCodec

from .test_chat_harmony import REPLY_PREAMBLE, REPLY_PREAMBLE_CALL, client_for
from .test_openai_features import _serve

ADD_CHAT = {"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}
ADD = {"type": "function", **ADD_CHAT["function"]}          # the Responses API's flat form
ASK = "What is 37 + 45?"


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("demo") / "demo", "demo")


@pytest.fixture(scope="module")
def client(demo):
    eng, srv = _serve(demo)
    with srv:
        yield eng, openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=120)


def test_reasoning_and_answer_equal_the_chat_routes(client):
    eng, c = client
    chat = c.chat.completions.create(model="m", messages=[{"role": "developer", "content": "Be precise."},
                                                          {"role": "user", "content": ASK}],
                                     temperature=0, max_tokens=128, reasoning_effort="high")
    r = c.responses.create(model="m", instructions="Be precise.", input=ASK, temperature=0, max_output_tokens=128,
                           reasoning={"effort": "high"})
    assert r.status == "completed" and [o.type for o in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == chat.choices[0].message.model_extra["reasoning_content"]
    assert r.output_text == chat.choices[0].message.content == "37 + 45 = 82"
    u = r.usage
    assert u.input_tokens == chat.usage.prompt_tokens and u.output_tokens == chat.usage.completion_tokens
    assert 0 < u.output_tokens_details.reasoning_tokens < u.output_tokens
    assert not eng.requests


def test_a_tool_call_and_its_output_continue_the_conversation(client):
    _, c = client
    chat = c.chat.completions.create(model="m", messages=[{"role": "user", "content": ASK}], tools=[ADD_CHAT],
                                     temperature=0, max_tokens=64)
    want = chat.choices[0].message.tool_calls[0].function
    r = c.responses.create(model="m", input=ASK, tools=[ADD], temperature=0, max_output_tokens=64)
    call = r.output[-1]
    assert call.type == "function_call" and (call.name, call.arguments) == (want.name, want.arguments)
    assert call.arguments == '{"a": 37, "b": 45}' and call.call_id
    # the client sends back what it got plus the tool's answer, as OpenAI's guides do
    follow = [{"role": "user", "content": ASK}, *[o.model_dump(exclude_none=True) for o in r.output],
              {"type": "function_call_output", "call_id": call.call_id, "output": "82"}]
    r2 = c.responses.create(model="m", input=follow, tools=[ADD], temperature=0, max_output_tokens=64)
    chat_msgs = [{"role": "user", "content": ASK}, chat.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": chat.choices[0].message.tool_calls[0].id, "content": "82"}]
    chat2 = c.chat.completions.create(model="m", messages=chat_msgs, tools=[ADD_CHAT], temperature=0, max_tokens=64)
    assert r2.output_text == chat2.choices[0].message.content == "37 + 45 = 82"
    assert r2.usage.input_tokens == chat2.usage.prompt_tokens


def test_the_stream_adds_up_to_the_response(client):
    _, c = client
    whole = c.responses.create(model="m", input="What is 12 + 79?", temperature=0, max_output_tokens=128)
    events = list(c.responses.create(model="m", input="What is 12 + 79?", temperature=0, max_output_tokens=128,
                                     stream=True))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert reasoning == whole.output[0].content[0].text and text == whole.output_text == "12 + 79 = 91"
    added = [e.output_index for e in events if e.type == "response.output_item.added"]
    done = [e.item.type for e in events if e.type == "response.output_item.done"]
    assert added == [0, 1] and done == ["reasoning", "message"]
    assert events[-1].response.output_text == whole.output_text
    calls = list(c.responses.create(model="m", input=ASK, tools=[ADD], temperature=0, max_output_tokens=64,
                                    stream=True))
    args = [e.arguments for e in calls if e.type == "response.function_call_arguments.done"]
    assert args == ['{"a": 37, "b": 45}']


def test_what_agents_send_is_taken(client):
    """Agent clients ask for encrypted reasoning with store=false (the reasoning is plain text here: taken, and
    the reasoning item carries it) and for the "minimal" effort (GPT-OSS's lowest, low)."""
    _, c = client
    r = c.responses.create(model="m", input=ASK, temperature=0, max_output_tokens=128, store=False,
                           include=["reasoning.encrypted_content"], reasoning={"effort": "minimal"})
    assert r.output_text == "37 + 45 = 82" and r.output[0].content[0].text and r.reasoning.effort == "low"
    with pytest.raises(openai.BadRequestError) as e:
        c.responses.create(model="m", input=ASK, include=["reasoning.encrypted_content", "file_search_call.results"])
    assert e.value.body["param"] == "include.1"


def test_cut_off_by_max_output_tokens_is_incomplete(client):
    _, c = client
    r = c.responses.create(model="m", input=ASK, temperature=0, max_output_tokens=8)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 8 and r.output[-1].status == "incomplete"
    events = list(c.responses.create(model="m", input=ASK, temperature=0, max_output_tokens=8, stream=True))
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert events[-1].type == "response.incomplete" and events[-1].response.output[-1].status == "incomplete"
    assert [i.status for i in done] == [o.status for o in events[-1].response.output] == [o.status for o in r.output]


@pytest.mark.parametrize("extra, param", [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"background": True}, "background"),
    ({"conversation": "conv_1"}, "conversation"),           # stored items would be lost unsaid
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),                # a stored prompt template likewise
    ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input.0.content.0"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input.0.type"),
    ({"reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    ({"text": {"format": {"type": "yaml"}}}, "text.format"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}}, "text.format"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"max_output_tokens": 10 ** 7}, "max_output_tokens"),
    ({"temperature": -1}, "temperature"),
    ({"input": 5}, "input"),
    ({"input": []}, "input"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "82"}]}, "input"),
    ({"tools": [{"type": "function", "parameters": {"type": "object"}}]}, "tools.0.name"),
    ({"tools": [{**ADD, "parameters": "a, b"}]}, "tools.0.parameters"),
])
def test_what_a_stateless_server_cannot_do_is_refused(client, extra, param):
    eng, c = client
    with pytest.raises(openai.BadRequestError) as e:
        c.responses.create(**{"model": "m", "input": ASK, **extra})
    assert e.value.body["param"] == param, e.value.body
    assert not eng.requests


def _rendered(demo, body):
    """The prompt the route renders for a Responses body, as text (harmony's special tokens kept)."""
    codec, req = TextCodec.from_dir(demo), ResponsesBody.model_validate(body)
    chat = ChatBody.model_validate({"messages": chat_messages(req), "tools": chat_tools(req.tools)})
    return codec.decode(chat_prompt(codec, chat), skip_special_tokens=False)


def test_each_function_call_output_goes_to_its_function(demo):
    """Two calls in one turn, then their outputs: each output is rendered as the answer of the function its
    call_id names (the template's fallback is the last call's function), reasoning before the calls."""
    tools = [ADD, {**ADD, "name": "mul"}]
    text = _rendered(demo, {"tools": tools, "input": [
        {"role": "user", "content": ASK},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "THINK"}]},
        {"type": "function_call", "call_id": "c1", "name": "add", "arguments": '{"a": 1, "b": 2}'},
        {"type": "function_call", "call_id": "c2", "name": "mul", "arguments": '{"a": 3, "b": 4}'},
        {"type": "function_call_output", "call_id": "c1", "output": "ADDED"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "MULTIPLIED"}]}]})
    assert "<|channel|>analysis<|message|>THINK<|end|><|start|>assistant<|channel|>commentary to=functions.add" in text
    assert "<|start|>functions.add to=assistant<|channel|>commentary<|message|>ADDED<|end|>" in text
    assert "<|start|>functions.mul to=assistant<|channel|>commentary<|message|>MULTIPLIED<|end|>" in text


@pytest.mark.parametrize("role", ["developer", "system"])
def test_instructions_keep_the_inputs_own_developer_message(demo, role):
    """`instructions` and a developer (or system) message opening the input both reach the prompt (the
    template reads only the first message as the developer's instructions)."""
    text = _rendered(demo, {"instructions": "Be precise.", "input": [{"role": role, "content": "Answer briefly."},
                                                                      {"role": "user", "content": ASK}]})
    assert "<|start|>developer<|message|># Instructions\n\nBe precise.\n\nAnswer briefly.<|end|>" in text


def test_a_reasoning_item_belongs_to_its_own_turn(demo):
    """Reasoning that no assistant output followed in its turn (a response cut off) is not put before the
    next turn's call."""
    text = _rendered(demo, {"tools": [ADD], "input": [
        {"role": "user", "content": ASK},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "STALE"}]},
        {"role": "user", "content": "What is 1 + 2?"},
        {"type": "function_call", "call_id": "c1", "name": "add", "arguments": '{"a": 1, "b": 2}'},
        {"type": "function_call_output", "call_id": "c1", "output": "3"}]})
    assert "STALE" not in text and "to=functions.add" in text


def test_a_preamble_before_a_call_keeps_the_reasoning_before_the_call(demo):
    """A reply of reasoning, a preamble message and a call, sent back as input (as `output` lists it): the
    reasoning stays before the call (harmony keeps a call's chain of thought) and the preamble is not rendered as
    a final answer given before the call, as the chat route renders the same turn."""
    text = _rendered(demo, {"tools": [ADD], "input": [
        {"role": "user", "content": ASK},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "THINK"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me add."}]},
        {"type": "function_call", "call_id": "c1", "name": "add", "arguments": '{"a": 1, "b": 2}'},
        {"type": "function_call_output", "call_id": "c1", "output": "3"}]})
    assert "<|channel|>analysis<|message|>THINK<|end|><|start|>assistant<|channel|>commentary to=functions.add" in text
    assert "<|channel|>final" not in text


def test_a_commentary_message_comes_back_as_commentary(demo):
    """A preamble no call followed (`phase: "commentary"`, as the output lists it) is rendered back on harmony's
    commentary channel by a template that has it (the demo model's), not as a final answer; a turn's reasoning
    items all reach the prompt, in order."""
    text = _rendered(demo, {"input": [
        {"role": "user", "content": ASK},
        {"type": "message", "role": "assistant", "phase": "commentary",
         "content": [{"type": "output_text", "text": "Let me check."}]},
        {"type": "message", "role": "assistant", "phase": "final_answer",
         "content": [{"type": "output_text", "text": "82"}]},
        {"role": "user", "content": "And 1 + 2?"}]})
    assert "<|start|>assistant<|channel|>commentary<|message|>Let me check.<|end|>" in text
    assert "<|channel|>final<|message|>82<|end|>" in text and "final<|message|>Let me check." not in text
    text = _rendered(demo, {"tools": [ADD], "input": [
        {"role": "user", "content": ASK},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "FIRST"}]},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "SECOND"}]},
        {"type": "message", "role": "assistant", "phase": "commentary",
         "content": [{"type": "output_text", "text": "Let me add."}]},
        {"type": "function_call", "call_id": "c1", "name": "add", "arguments": '{"a": 1, "b": 2}'},
        {"type": "function_call_output", "call_id": "c1", "output": "3"}]})
    assert "<|channel|>analysis<|message|>FIRST\nSECOND<|end|><|start|>assistant<|channel|>commentary to=functions.add" \
        in text
    assert "<|channel|>final" not in text and "<|channel|>commentary<|message|>Let me add." not in text


def _without_ids(output):
    return [{k: v for k, v in o.model_dump(exclude_none=True).items() if k not in ("id", "call_id")} for o in output]


def _check_stream(events, whole):
    """The stream's events, item by item as OpenAI sends them, add up to the whole (non-streamed) response."""
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events][:2] == ["response.created", "response.in_progress"]
    body = [e for e in events[2:-1]]
    for i, item in enumerate(whole.output):
        mine = [e for e in body if e.output_index == i]
        assert mine == body[:len(mine)], "one item's events at a time, in output order"
        body = body[len(mine):]
        types = [e.type for e in mine]
        if item.type == "function_call":
            assert types == ["response.output_item.added", "response.function_call_arguments.delta",
                             "response.function_call_arguments.done", "response.output_item.done"]
            assert mine[2].arguments == item.arguments
        else:
            text = "output_text" if item.type == "message" else "reasoning_text"
            assert types[:2] == ["response.output_item.added", "response.content_part.added"]
            assert set(types[2:-3]) == {f"response.{text}.delta"}
            assert types[-3:] == [f"response.{text}.done", "response.content_part.done", "response.output_item.done"]
            assert "".join(e.delta for e in mine[2:-3]) == mine[-3].text == item.content[0].text
        assert mine[-1].item.type == item.type and getattr(mine[-1].item, "phase", None) == getattr(item, "phase", None)
    assert body == [] and events[-1].type == "response.completed"
    assert _without_ids(events[-1].response.output) == _without_ids(whole.output)


def test_each_harmony_message_is_an_item_of_its_own(tiny_ckpt):
    """A reply of reasoning, a preamble and a final answer (scripted harmony): three items, the preamble a
    message with phase commentary and the answer one with phase final_answer, not one message joining them;
    streamed, each item's events in turn (the openai client's stream helper builds the same response). The
    client's `output_text` joins every message's text (its rule); with `text.format` the preamble goes with the
    reasoning, so that `output_text` is the structured answer alone, and the stream helper parses it."""
    from pydantic import BaseModel

    class Sum(BaseModel):
        sum: int
    srv, c = client_for(TextCodec.from_dir(tiny_ckpt), REPLY_PREAMBLE)
    try:
        r = c.responses.create(model="demo", input=ASK)
        assert [(o.type, getattr(o, "phase", None)) for o in r.output] == [
            ("reasoning", None), ("message", "commentary"), ("message", "final_answer")]
        assert [o.content[0].text for o in r.output] == ["Add them.", "Let me answer.", '{"sum": 82}']
        assert r.output_text == 'Let me answer.{"sum": 82}'
        _check_stream(list(c.responses.create(model="demo", input=ASK, stream=True)), r)
        with c.responses.stream(model="demo", input=ASK) as s:
            assert _without_ids(s.get_final_response().output) == _without_ids(r.output)
        with c.responses.stream(model="demo", input=ASK, text_format=Sum) as s:
            final = s.get_final_response()
        assert final.output_parsed == Sum(sum=82) and final.output_text == '{"sum": 82}'
        assert [o.type for o in final.output] == ["reasoning", "reasoning", "message"]
    finally:
        srv.__exit__()


def test_a_preamble_before_a_call_is_a_commentary_message(tiny_ckpt):
    """Reasoning, a preamble and a call: the preamble is a message with phase commentary between the reasoning
    and the function_call item, whole and streamed."""
    srv, c = client_for(TextCodec.from_dir(tiny_ckpt), REPLY_PREAMBLE_CALL)
    try:
        r = c.responses.create(model="demo", input=ASK, tools=[ADD])
        assert [(o.type, getattr(o, "phase", None)) for o in r.output] == [
            ("reasoning", None), ("message", "commentary"), ("function_call", None)]
        assert (r.output[1].content[0].text, r.output[2].arguments) == ("Let me answer.", '{"sum": 82}')
        _check_stream(list(c.responses.create(model="demo", input=ASK, tools=[ADD], stream=True)), r)
    finally:
        srv.__exit__()


class _FailingStream:
    """A request's stream that yields `outs` and then raises `exc` (if any)."""

    def __init__(self, outs, exc=None):
        self.outs, self.exc, self.closed = outs, exc, False

    async def __aiter__(self):
        for o in self.outs:
            yield o
        if self.exc is not None:
            raise self.exc

    def close(self, finish_reason="abort"):
        self.closed = True


@pytest.mark.parametrize("outs, exc, code", [
    ([RequestOutput("r", [], True, "abort", error=SHUTTING_DOWN)], None, "server_shutting_down"),
    ([RequestOutput("r", [], True, "error", error="engine step failed")], None, "request_failed"),
    ([], RuntimeError("boom"), None),
])
def test_a_failed_stream_ends_with_an_error_event(demo, outs, exc, code):
    """A stream that fails ends with OpenAI's `error` event (a shutdown named as on the other routes), not a
    cut connection, and its request is closed."""
    codec = TextCodec.from_dir(demo)
    stream = _FailingStream(outs, exc)
    c = Choice(0, 0, stream, [1, 2], TextRenderer(codec), StopMatcher([]))

    async def run():
        return [json.loads(e.split("data: ", 1)[1]) async for e in _events(c, {"id": "resp_1"}, None)]
    events = asyncio.run(run())
    assert [e["type"] for e in events] == ["response.created", "response.in_progress", "error"]
    assert events[-1]["code"] == code and events[-1]["sequence_number"] == 2 and stream.closed
