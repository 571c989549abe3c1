"""The demo model served as GPT-OSS users use it, through the official `openai` client, against `serve
--role both` and against the DI proxy (prefill -> NIXL -> GK decode): reasoning_content apart from content
(whole and streamed), a tool call parsed into `tool_calls` and the follow-up with the tool's result
answered, stop strings, n=2, and the stop tokens generation_config.json lists (<|return|>, <|call|>)."""

from __future__ import annotations

import contextlib
import json

import openai
import pytest

from gigadecode.checkpoint import make_checkpoint

from .helpers import stop_process_tree
from .test_serve_di import di_servers, start_gigadecode
from .test_server import free_port, wait_health

FLAGS = ["--served-model-name", "demo", "--num-blocks", "256", "--block-size", "16", "--max-num-seqs", "16"]
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}
ASK = [{"role": "user", "content": "What is 37 + 45?"}]


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("demo") / "demo", "demo")


@contextlib.contextmanager
def single(model_dir):
    port = free_port()
    proc = start_gigadecode(["serve", "--model", str(model_dir), "--port", str(port), *FLAGS])
    try:
        wait_health(f"http://127.0.0.1:{port}", proc, timeout=120)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_process_tree(proc)


@pytest.fixture(scope="module", params=["both", "di"])
def url(request, demo_dir):
    if request.param == "both":
        with single(demo_dir) as u:
            yield u
    else:
        with di_servers(demo_dir, FLAGS, FLAGS) as urls:
            yield urls["proxy"]


def test_reasoning_and_content(url):
    c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
    r = c.chat.completions.create(model="demo", messages=ASK, temperature=0, max_tokens=128)
    m = r.choices[0].message
    assert m.content == "37 + 45 = 82" and r.choices[0].finish_reason == "stop"
    assert "ones: 7 + 5 = 12" in m.model_extra["reasoning_content"]
    content = reasoning = ""
    for ch in c.chat.completions.create(model="demo", messages=ASK, temperature=0, max_tokens=128, stream=True):
        if ch.choices:
            content += ch.choices[0].delta.content or ""
            reasoning += (ch.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
    assert content == m.content and reasoning == m.model_extra["reasoning_content"]


def test_tool_call_round_trip(url):
    c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
    r = c.chat.completions.create(model="demo", messages=ASK, tools=[ADD], temperature=0, max_tokens=128)
    assert r.choices[0].finish_reason == "tool_calls"          # stopped on <|call|> (generation_config)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 37, "b": 45}
    names, args = [], ""
    for ch in c.chat.completions.create(model="demo", messages=ASK, tools=[ADD], temperature=0, max_tokens=128,
                                        stream=True):
        for tc in (ch.choices[0].delta.tool_calls or []) if ch.choices else []:
            names += [tc.function.name] if tc.function and tc.function.name else []
            args += tc.function.arguments or "" if tc.function else ""
    assert names == ["add"] and json.loads(args) == {"a": 37, "b": 45}
    follow = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                    {"role": "tool", "tool_call_id": call.id, "content": "82"}]
    r = c.chat.completions.create(model="demo", messages=follow, tools=[ADD], temperature=0, max_tokens=128)
    assert r.choices[0].message.content == "37 + 45 = 82" and r.choices[0].finish_reason == "stop"



def test_responses_api(url):
    """/v1/responses on `serve` and through the DI proxy (its prefill asked for one output token): the
    reasoning item, the answer, a function_call and the answer after its output, whole and streamed."""
    c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
    r = c.responses.create(model="demo", input="What is 37 + 45?", temperature=0, max_output_tokens=128)
    assert [o.type for o in r.output] == ["reasoning", "message"] and r.output_text == "37 + 45 = 82"
    assert "ones: 7 + 5 = 12" in r.output[0].content[0].text
    streamed = [e for e in c.responses.create(model="demo", input="What is 37 + 45?", temperature=0,
                                              max_output_tokens=128, stream=True)]
    assert "".join(e.delta for e in streamed if e.type == "response.output_text.delta") == "37 + 45 = 82"
    tool = {"type": "function", **ADD["function"]}
    r = c.responses.create(model="demo", input="What is 37 + 45?", tools=[tool], temperature=0, max_output_tokens=128)
    call = r.output[-1]
    assert call.type == "function_call" and json.loads(call.arguments) == {"a": 37, "b": 45}
    follow = [{"role": "user", "content": "What is 37 + 45?"}, *[o.model_dump(exclude_none=True) for o in r.output],
              {"type": "function_call_output", "call_id": call.call_id, "output": "82"}]
    r = c.responses.create(model="demo", input=follow, tools=[tool], temperature=0, max_output_tokens=128)
    assert r.output_text == "37 + 45 = 82" and r.status == "completed"


def test_stop_strings_and_n(url):
    c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
    r = c.chat.completions.create(model="demo", messages=ASK, temperature=0, max_tokens=128, stop=[" = "], n=2)
    assert [ch.index for ch in r.choices] == [0, 1]
    for ch in r.choices:
        assert ch.message.content == "37 + 45" and ch.finish_reason == "stop"


def test_a_stop_token_ends_the_reasoning_without_its_text(url, demo_dir):
    """`stop_token_ids` with a text token of the analysis channel: the reasoning ends before that token's text
    (which stays in the token ids), as vLLM leaves a stop token out of the output."""
    from gigadecode.tokenizer import TextCodec
    codec = TextCodec.from_dir(demo_dir)
    c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
    full = c.chat.completions.create(model="demo", messages=ASK, temperature=0, max_tokens=128,
                                     extra_body={"return_token_ids": True}).choices[0]
    ids, reasoning = full.model_extra["token_ids"], full.message.model_extra["reasoning_content"]
    j = next(i for i, t in enumerate(ids) if "=" in codec.decode([t]))
    want = reasoning[:reasoning.index(codec.decode([ids[j]]))]
    assert want.startswith("ones: ")
    for stream in (False, True):
        r = c.chat.completions.create(model="demo", messages=ASK, temperature=0, max_tokens=128, stream=stream,
                                      extra_body={"return_token_ids": True, "stop_token_ids": [ids[j]]})
        if stream:
            chunks = [ch for ch in r if ch.choices]
            got = "".join((ch.choices[0].delta.model_extra or {}).get("reasoning_content") or "" for ch in chunks)
            got_ids = [t for ch in chunks for t in ch.choices[0].model_extra.get("token_ids") or []]
            finish = chunks[-1].choices[0].finish_reason
        else:
            ch = r.choices[0]
            got, got_ids, finish = ch.message.model_extra["reasoning_content"], ch.model_extra["token_ids"], ch.finish_reason
        assert (got, got_ids, finish) == (want, ids[:j + 1], "stop")


def test_reasoning_usage_call_chunks_closed_schemas_and_response_items(url):
    """What the OpenAI routes gained, the same through the DI proxy as on `serve`: vLLM's `reasoning` beside
    `reasoning_content` and usage's reasoning_tokens; a streamed call's finish_reason in a chunk of its own (the
    openai stream helper fires tool_calls.function.arguments.done); a schema that does not say
    additionalProperties takes no other key; /v1/responses' stream helper events and `responses.parse`."""
    from pydantic import BaseModel
    c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
    r = c.chat.completions.create(model="demo", messages=ASK, temperature=0, max_tokens=128)
    m, u = r.choices[0].message, r.usage
    assert m.model_extra["reasoning"] == m.model_extra["reasoning_content"] and "ones: 7 + 5 = 12" in m.model_extra["reasoning"]
    assert 0 < u.completion_tokens_details.reasoning_tokens < u.completion_tokens
    with c.chat.completions.stream(model="demo", messages=ASK, tools=[ADD], temperature=0, max_tokens=128) as s:
        events = [e for e in s]
    done = [e for e in events if e.type == "tool_calls.function.arguments.done"]
    assert len(done) == 1 and done[0].name == "add" and json.loads(done[0].arguments) == {"a": 37, "b": 45}
    last = [e.chunk.choices[0] for e in events if e.type == "chunk" and e.chunk.choices][-1]
    assert last.finish_reason == "tool_calls" and not last.delta.tool_calls        # a chunk of its own
    schema = {"type": "object", "properties": {"sum": {"type": "integer"}}, "required": ["sum"]}
    r = c.chat.completions.create(model="demo", messages=ASK, temperature=0, max_tokens=128, response_format={
        "type": "json_schema", "json_schema": {"name": "s", "schema": schema}})
    assert list(json.loads(r.choices[0].message.content)) == ["sum"]
    tool = {"type": "function", **ADD["function"]}
    with c.responses.stream(model="demo", input="What is 37 + 45?", tools=[tool], temperature=0,
                            max_output_tokens=128) as s:
        types = [e.type for e in s]
        final = s.get_final_response()
    assert "response.function_call_arguments.done" in types and types[-1] == "response.completed"
    assert [o.type for o in final.output] == ["function_call"] and json.loads(final.output[0].arguments) == {"a": 37, "b": 45}

    class Sum(BaseModel):
        sum: int
    r = c.responses.parse(model="demo", input="What is 37 + 45?", text_format=Sum, temperature=0, max_output_tokens=128)
    assert [(o.type, getattr(o, "phase", None)) for o in r.output] == [("reasoning", None), ("message", "final_answer")]
    assert isinstance(r.output_parsed, Sum)


def test_a_suffix_decoding_decode_server_behind_the_proxy(demo_dir):
    """A decode server with `--speculative-config '{"method": "suffix"}'` behind the proxy: an answer a stop string
    ended joins its cache (the server ends the engine request "stop"; an abort is never cached), so the same
    request streamed next drafts it from there (23 of its 28 tokens accepted here; 4 from its own history alone);
    a tool call as on `serve`; no KV held on either server once they are done."""
    from .test_server import metrics, wait_idle
    with di_servers(demo_dir, FLAGS, FLAGS + ["--speculative-config", '{"method": "suffix"}']) as urls:
        c = openai.OpenAI(base_url=urls["proxy"] + "/v1", api_key="x", max_retries=0, timeout=120)
        body = dict(model="demo", prompt="What is 37 + 45?", temperature=0, max_tokens=100, stop=[" = 53."])
        r = c.completions.create(**body)              # the stop string ends it long before max_tokens or <|return|>
        text, n = r.choices[0].text, r.usage.completion_tokens
        assert r.choices[0].finish_reason == "stop" and text.startswith(" write 5 carry 1") and n > 12
        accepted = wait_idle(urls["decode"], timeout=10)["gigadecode_spec_decode_num_accepted_tokens_total"]
        chunks = [ch.choices[0] for ch in c.completions.create(**body, stream=True)]
        assert "".join(ch.text for ch in chunks) == text and chunks[-1].finish_reason == "stop"
        m = wait_idle(urls["decode"], timeout=10)
        assert m["gigadecode_spec_decode_num_accepted_tokens_total"] - accepted >= n // 2, n
        r = c.chat.completions.create(model="demo", messages=ASK, tools=[ADD], temperature=0, max_tokens=128)
        assert r.choices[0].finish_reason == "tool_calls"
        assert json.loads(r.choices[0].message.tool_calls[0].function.arguments) == {"a": 37, "b": 45}
        wait_idle(urls["decode"], timeout=10)
        assert wait_idle(urls["prefill"], timeout=10)["gigadecode_kv_leases"] == 0
