"""Structured output (`structured.py`, llguidance): the output held to a JSON schema, a regex, choices or a Lark
grammar — over the whole output (completions) or only a harmony final message (chat: the reasoning stays free)
— checked by parsing what comes out with Python's own json / re, never by the grammar that made it; a request
that asks for none is not touched by a guided neighbour in its batch; bad grammars are the request's error."""

from __future__ import annotations

import json
import re
import shutil

import httpx
import openai
import pytest
import torch

from gigadecode.checkpoint import make_checkpoint
from gigadecode.engine import LLMEngine, RequestError
from gigadecode.engine_config import EngineConfig
from gigadecode.runner import ModelRunner
from gigadecode.sampling import Sampler, SamplingError, SamplingParams
from gigadecode.tokenizer import TextCodec

from .test_openai_features import _serve

SCHEMA = {"type": "object", "properties": {"sum": {"type": "integer"}, "words": {"type": "array", "items": {
    "type": "string", "enum": ["one", "two", "three"]}, "maxItems": 3}, "ok": {"type": "boolean"}},
    "required": ["sum", "ok"], "additionalProperties": False}


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    d = make_checkpoint(tmp_path_factory.mktemp("demo") / "demo", "demo")
    eng = LLMEngine(ModelRunner(d, EngineConfig(dtype="float32", kv_dtype="auto", num_blocks=200, block_size=4)))
    return d, eng, TextCodec.from_dir(d)


def _check_schema(obj: dict) -> None:
    assert set(obj) <= {"sum", "words", "ok"} and {"sum", "ok"} <= set(obj)
    assert isinstance(obj["sum"], int) and not isinstance(obj["sum"], bool) and isinstance(obj["ok"], bool)
    assert all(w in ("one", "two", "three") for w in obj.get("words", [])) and len(obj.get("words", [])) <= 3


def test_chat_answer_follows_the_schema_and_the_reasoning_stays_free(demo):
    d, eng, codec = demo
    prompt = codec.apply_chat_template([{"role": "user", "content": "What is 37 + 45?"}])
    free = eng.generate([prompt], SamplingParams(temperature=0, max_tokens=128))[0]
    guided = [("json", json.dumps(SCHEMA), "final")] * 2 + [("json_object", "", "final")]
    outs = eng.generate([prompt] * 3, [SamplingParams(temperature=t, seed=5, max_tokens=160, guided=g)
                                       for t, g in zip((0, 1.0, 0), guided)])
    text = codec.decode(free.output_ids, skip_special_tokens=False)
    head = "<|start|>assistant<|channel|>final<|message|>"
    for r in outs:
        got = codec.decode(r.output_ids, skip_special_tokens=False)
        assert r.finish_reason == "stop" and got.endswith("<|return|>")
        reasoning, answer = got.split(head)
        assert reasoning == text.split(head)[0]                # the analysis message is the free run's
        obj = json.loads(answer.removesuffix("<|return|>"))
        assert isinstance(obj, dict)
    for r in outs[:2]:
        _check_schema(json.loads(codec.decode(r.output_ids, skip_special_tokens=False).split(head)[1][:-10]))


@pytest.mark.parametrize("kind, source, check", [
    ("regex", r"[0-9]{3}-[a-z]{2,4}", lambda s: re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", s)),
    ("choice", json.dumps(["red", "green", "blue jay"]), lambda s: s in ("red", "green", "blue jay")),
    ("grammar", 'start: "(" item ")" | "(" item "," item ")" | "(" item "," item "," item ")"\nitem: /[a-c]{1,3}/',
     lambda s: re.fullmatch(r"\([a-c]{1,3}(,[a-c]{1,3}){0,2}\)", s)),
    ("json", json.dumps(SCHEMA), lambda s: _check_schema(json.loads(s)) is None),
])
def test_whole_output_follows_the_grammar_sampled_or_greedy(demo, kind, source, check):
    _, eng, codec = demo
    prompts = [codec.encode("The answer: "), codec.encode("What is 2 + 2?")]
    params = [SamplingParams(temperature=t, seed=s, max_tokens=64, guided=(kind, source, "all"))
              for t, s in ((0, None), (1.0, 1), (1.3, 2))]
    for r in eng.generate([prompts[i % 2] for i in range(3)], params):
        assert r.finish_reason == "stop", codec.decode(r.output_ids, skip_special_tokens=False)
        assert r.output_ids[-1] in eng.eos_token_ids
        assert check(codec.decode(r.output_ids[:-1], skip_special_tokens=False))


def test_an_unguided_request_is_untouched_by_a_guided_neighbour_and_preemption_keeps_the_grammar(demo):
    d, _, codec = demo
    eng = LLMEngine(ModelRunner(d, EngineConfig(dtype="float32", kv_dtype="auto", num_blocks=60, block_size=4,
                                                max_prefill_tokens=16)))
    plain = codec.encode("What is 12 + 30?")
    alone = eng.generate([plain], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0].output_ids
    chat = codec.apply_chat_template([{"role": "user", "content": "What is 3 + 4?"}])
    guided = SamplingParams(temperature=0, max_tokens=110, guided=("json", json.dumps(SCHEMA), "final"))
    rs = eng.generate([plain, chat, chat, chat], [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)]
                      + [guided] * 3)
    assert eng.stats.preemptions > 0
    assert rs[0].output_ids == alone
    for r in rs[1:]:
        _check_schema(json.loads(codec.decode(r.output_ids, skip_special_tokens=False)
                                 .split("<|channel|>final<|message|>")[1].removesuffix("<|return|>")))


def test_bad_grammars_are_the_requests_error(demo):
    _, eng, _ = demo
    before = len(eng.requests)
    for g in (("regex", "((", "all"), ("json", "{not json", "all"), ("grammar", "start: undefined_rule", "all")):
        with pytest.raises(RequestError) as e:
            eng.add_request([5, 6], SamplingParams(guided=g))
        assert e.value.param == "guided"
    with pytest.raises(SamplingError):
        SamplingParams(guided=("xml", "", "all"))
    with pytest.raises(SamplingError):
        SamplingParams(guided=("regex", "a", "middle"))
    assert len(eng.requests) == before                             # nothing queued
    # the engine serves on (ignore_eos: an unseeded draw at temperature 1 may pick EOS, ~0.5% of the time)
    assert eng.generate([[5, 6]], SamplingParams(max_tokens=2, ignore_eos=True))[0].finish_reason == "length"


def test_the_sampler_draws_only_allowed_tokens():
    """The mask holds for greedy and sampled rows alike, rows without one are left alone, and a mask that
    min_tokens would leave empty (its only token is an EOS) still wins."""
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    allowed = torch.zeros(50, dtype=torch.bool)
    allowed[[3, 17]] = True
    eos = torch.zeros(50, dtype=torch.bool)
    eos[7] = True
    s = Sampler(eos_token_ids=(7,))
    ps = [SamplingParams(temperature=0), SamplingParams(temperature=2.0, seed=1), SamplingParams(temperature=0)]
    for _ in range(20):
        r = s.sample(logits, ps, [None, torch.Generator().manual_seed(_), None], allowed=[allowed, allowed, None])
        assert r.token_ids[0].item() in (3, 17) and r.token_ids[1].item() in (3, 17)
        assert r.token_ids[2].item() == logits[2].argmax().item()
    r = s.sample(logits[:1], [SamplingParams(temperature=0, min_tokens=4)], output_ids=[[]], allowed=[eos])
    assert r.token_ids.tolist() == [7]


def test_the_server_fields(demo):
    """OpenAI's response_format (chat), vLLM's guided_* and structured_outputs (completions, GBNF converted),
    the Responses API's text.format; a bad one is a 400 naming its field."""
    d, _, _ = demo
    eng, srv = _serve(d)
    with srv:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=120)
        ask = [{"role": "user", "content": "What is 37 + 45?"}]
        r = c.chat.completions.create(model="m", messages=ask, temperature=0, max_tokens=160, response_format={
            "type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}})
        _check_schema(json.loads(r.choices[0].message.content))
        assert "ones: 7 + 5 = 12" in r.choices[0].message.model_extra["reasoning_content"]
        r = c.responses.create(model="m", input="What is 37 + 45?", temperature=0, max_output_tokens=160,
                               text={"format": {"type": "json_schema", "name": "answer", "schema": SCHEMA}})
        _check_schema(json.loads(r.output_text))
        for extra, check in (({"guided_choice": ["yes", "no"]}, lambda s: s in ("yes", "no")),
                             ({"guided_regex": "[a-c]{5}"}, lambda s: re.fullmatch("[a-c]{5}", s)),
                             ({"structured_outputs": {"grammar": 'root ::= "x" [0-9] [0-9]'}},
                              lambda s: re.fullmatch("x[0-9]{2}", s)),
                             ({"guided_json": json.dumps(SCHEMA)}, lambda s: _check_schema(json.loads(s)) is None)):
            out = c.completions.create(model="m", prompt="x", max_tokens=60, temperature=0, extra_body=extra)
            assert out.choices[0].finish_reason == "stop" and check(out.choices[0].text), (extra, out.choices[0].text)
        for extra, param in (({"guided_regex": "(("}, "guided_regex"), ({"guided_json": {"type": "nope"}}, "guided_json"),
                             ({"guided_choice": []}, "guided_choice"), ({"response_format": {"type": "yaml"}}, "response_format"),
                             ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice")):
            with pytest.raises(openai.BadRequestError) as e:
                c.completions.create(model="m", prompt="x", max_tokens=2, extra_body=extra)
            assert e.value.body["param"] == param, e.value.body
        # a grammar that compiles but breaks down mid-way is the request's error too: a 400 (it was a 500
        # server_error), and in a stream an invalid_request_error event
        broken = {"guided_json": json.dumps({"type": "object", "properties": {"a": {"$ref": "#/$defs/x"}},
                                             "required": ["a"], "$defs": {"x": {"type": "array", "minItems": 1,
                                                                                "items": {"$ref": "#/$defs/x"}}}})}
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(model="m", prompt="x", max_tokens=30, temperature=0, extra_body=broken)
        assert e.value.body["code"] == "grammar_failed" and "structured output" in e.value.body["message"]
        body = {"model": "m", "prompt": "x", "max_tokens": 30, "temperature": 0, "stream": True, **broken}
        events = [json.loads(line[6:]) for line in httpx.post(srv.url + "/v1/completions", json=body, timeout=120)
                  .text.splitlines() if line.startswith("data: {")]
        assert events[-1]["error"]["type"] == "invalid_request_error", events[-1]
        assert events[-1]["error"]["code"] == "grammar_failed"
        assert not eng.requests


SUM_ONLY = {"type": "object", "properties": {"sum": {"type": "integer"}}, "required": ["sum"]}   # no additionalProperties


def test_an_object_schema_that_does_not_say_additional_properties_takes_no_other_keys(demo):
    """Held to a schema naming `sum` alone, the demo model (greedy) went on with another key (`{"sum": 45, "b":
    733}`): JSON Schema allows it, but vLLM's default backend (xgrammar, strict mode) generates no property the
    schema does not name, and OpenAI's strict mode requires additionalProperties false; so here too, in chat and
    the Responses API. A schema that says `additionalProperties: true` keeps them (the model's own extra key)."""
    d, _, _ = demo
    eng, srv = _serve(d)
    with srv:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=120)
        ask = [{"role": "user", "content": "What is 37 + 45?"}]

        def chat(schema):
            r = c.chat.completions.create(model="m", messages=ask, temperature=0, max_tokens=160, response_format={
                "type": "json_schema", "json_schema": {"name": "answer", "schema": schema}})
            return json.loads(r.choices[0].message.content)
        assert set(chat(SUM_ONLY)) == {"sum"}
        r = c.responses.create(model="m", input="What is 37 + 45?", temperature=0, max_output_tokens=160,
                               text={"format": {"type": "json_schema", "name": "answer", "schema": SUM_ONLY}})
        assert set(json.loads(r.output_text)) == {"sum"}
        assert set(chat({**SUM_ONLY, "additionalProperties": True})) > {"sum"}
        assert not eng.requests


def test_closed_objects():
    """Where `additionalProperties: false` goes: every object schema that lists properties and says nothing of
    other keys (nested, in $defs, in anyOf and array items, a tool's parameters); not one that says it (or
    unevaluatedProperties), not an allOf part (it would exclude its siblings' keys), not a const value."""
    from gigadecode.structured import closed_objects, forced_call_grammar
    obj = {"type": "object", "properties": {"a": {"type": "integer"}}}
    closed = {**obj, "additionalProperties": False}
    schema = {"type": "object", "properties": {"x": obj, "l": {"type": "array", "items": obj}},
              "$defs": {"D": obj}, "anyOf": [obj, {"type": "string"}],
              "allOf": [obj], "not": {"const": {"properties": {}}},
              "patternProperties": {"^p": {**obj, "additionalProperties": True}}}
    assert closed_objects(schema) == {
        "type": "object", "properties": {"x": closed, "l": {"type": "array", "items": closed}},
        "$defs": {"D": closed}, "anyOf": [closed, {"type": "string"}],
        "allOf": [obj], "not": {"const": {"properties": {}}},
        "patternProperties": {"^p": {**obj, "additionalProperties": True}}, "additionalProperties": False}
    assert closed_objects({**obj, "unevaluatedProperties": False}) == {**obj, "unevaluatedProperties": False}
    assert closed_objects({"type": "object"}) == {"type": "object"} and obj == {"type": "object", "properties": {
        "a": {"type": "integer"}}}
    assert '"additionalProperties": false' in forced_call_grammar([ADD])


ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
MUL = {"type": "function", "function": {"name": "multiply", "description": "Multiply two numbers.", "parameters": {
    "type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}}, "required": ["x", "y"],
    "additionalProperties": False}}}


def test_a_forced_tool_call(demo):
    """tool_choice "required" (any of the tools) or a named function: the reply is a harmony call to it, its
    arguments held to the tool's schema (the demo model, asked a sum with only `multiply` offered, answers
    itself unless forced); chat and the Responses API; a named tool that is not offered, or a forced call with
    structured output, is a 400 naming tool_choice, a tool schema that does not compile one naming tools."""
    d, _, _ = demo
    eng, srv = _serve(d)
    ask = [{"role": "user", "content": "What is 37 + 45?"}]
    with srv:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=120)
        free = c.chat.completions.create(model="m", messages=ask, tools=[MUL], temperature=0, max_tokens=128)
        assert free.choices[0].message.content == "37 + 45 = 82" and not free.choices[0].message.tool_calls
        for choice, tools in (("required", [MUL]), ({"type": "function", "function": {"name": "multiply"}}, [ADD, MUL])):
            r = c.chat.completions.create(model="m", messages=ask, tools=tools, tool_choice=choice, temperature=0,
                                          max_tokens=160)
            (call,) = r.choices[0].message.tool_calls
            assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "multiply"
            args = json.loads(call.function.arguments)
            assert set(args) == {"x", "y"} and all(isinstance(v, (int, float)) for v in args.values())
        r = c.responses.create(model="m", input="What is 37 + 45?", temperature=0, max_output_tokens=160,
                               tools=[{"type": "function", **MUL["function"]}],
                               tool_choice={"type": "function", "name": "multiply"})
        assert r.output[-1].type == "function_call" and r.output[-1].name == "multiply"
        assert set(json.loads(r.output[-1].arguments)) == {"x", "y"}
        for extra in ({"tool_choice": {"type": "function", "function": {"name": "divide"}}},
                      {"tool_choice": "required", "response_format": {"type": "json_object"}},
                      {"tool_choice": {"type": "function"}}):
            with pytest.raises(openai.BadRequestError) as e:
                c.chat.completions.create(model="m", messages=ask, tools=[ADD, MUL], max_tokens=4, **extra)
            assert e.value.body["param"] == "tool_choice", e.value.body
        # a forced call's tool schema that does not compile is a 400 naming `tools` (not an internal name, nor
        # the Responses API's text.format)
        broken = {"name": "add", "parameters": {"type": "object", "properties": {"a": {"$ref": "#/$defs/none"}}}}
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model="m", messages=ask, tools=[{"type": "function", "function": broken}],
                                      tool_choice="required", max_tokens=4)
        assert e.value.body["param"] == "tools" and "/$defs/none" in e.value.body["message"], e.value.body
        with pytest.raises(openai.BadRequestError) as e:
            c.responses.create(model="m", input="hi", tools=[{"type": "function", **broken}], max_output_tokens=4,
                               tool_choice={"type": "function", "name": "add"})
        assert e.value.body["param"] == "tools" and "/$defs/none" in e.value.body["message"], e.value.body
        assert not eng.requests


def test_the_output_stays_at_the_grammars_end_under_min_tokens_and_ignore_eos(demo):
    """Once the grammar is complete only the end tokens may follow, even when min_tokens or ignore_eos keep
    the request going: no free text after the JSON (a "stop" parses, a "length" is the JSON and end tokens)."""
    _, eng, codec = demo
    schema = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
                         "additionalProperties": False})
    chat = codec.apply_chat_template([{"role": "user", "content": "What is 3 + 4?"}])
    params = [SamplingParams(temperature=0, max_tokens=100, min_tokens=20, guided=("json", schema, "all")),
              SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, guided=("json", schema, "all")),
              SamplingParams(temperature=1.0, seed=3, max_tokens=200, ignore_eos=True, guided=("json", schema, "final"))]
    rs = eng.generate([codec.encode("x"), codec.encode("x"), chat], params)
    assert [r.finish_reason for r in rs] == ["stop", "length", "length"]
    for r in rs[:2]:
        assert set(json.loads(codec.decode(r.output_ids)).keys()) == {"a"}
    answer = codec.decode(rs[2].output_ids, skip_special_tokens=False).split("<|channel|>final<|message|>")[1]
    assert set(json.loads(answer.split("<|return|>")[0])) == {"a"} and answer.endswith("<|return|>")
    assert not answer.replace("<|return|>", "").removeprefix(answer.split("<|return|>")[0])



def test_a_grammar_that_breaks_down_is_the_requests_error_not_a_stop(demo):
    """A schema llguidance compiles but cannot follow (here an array that must hold itself: the parser gives
    up as too complex) fails the request; it never ends "stop" with text that does not parse. A neighbour
    in the same batch is unaffected."""
    _, eng, codec = demo
    schema = json.dumps({"type": "object", "properties": {"a": {"$ref": "#/$defs/x"}}, "required": ["a"],
                         "$defs": {"x": {"type": "array", "items": {"$ref": "#/$defs/x"}, "minItems": 1}}})
    rs = eng.generate([codec.encode("x")] * 2, [SamplingParams(temperature=0, max_tokens=30, guided=("json", schema, "all")),
                                             SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)])
    assert rs[0].finish_reason == "error" and "structured output" in rs[0].error, (rs[0].finish_reason, rs[0].error)
    assert rs[1].finish_reason == "length" and len(rs[1].output_ids) == 5


def test_a_tokenizer_with_ids_beyond_the_models_vocab(demo, tmp_path):
    """tokenizer.json may name more ids than the model's vocab_size (added tokens past the embedding): the
    grammar is compiled over the tokenizer's ids and the mask cut to the model's."""
    d, _, codec = demo
    big = tmp_path / "big"
    shutil.copytree(d, big)
    tok = json.loads((big / "tokenizer.json").read_text())
    tok["added_tokens"].append({"id": 640, "content": "<|extra|>", "single_word": False, "lstrip": False,
                                "rstrip": False, "normalized": False, "special": True})
    (big / "tokenizer.json").write_text(json.dumps(tok))
    eng = LLMEngine(ModelRunner(big, EngineConfig(dtype="float32", kv_dtype="auto", num_blocks=64, block_size=4)))
    assert eng.cfg.vocab_size == 640
    r = eng.generate([codec.encode("x")], SamplingParams(temperature=0, max_tokens=20,
                                                         guided=("regex", "[a-c]{3}", "all")))[0]
    assert r.finish_reason == "stop" and re.fullmatch("[a-c]{3}", codec.decode(r.output_ids[:-1]))


def test_structured_outputs_options_that_change_the_output_are_refused():
    """vLLM's structured_outputs options: those asking for what the server does anyway are accepted (among them
    `disable_additional_properties`: an object schema that does not say additionalProperties takes no other
    keys here, as with xgrammar), those it would silently ignore (a whitespace pattern, a structural tag) are a
    400 naming the option, as guided_whitespace_pattern is."""
    from gigadecode.server.protocol import APIError, guided_of
    schema = {"type": "object"}
    for extra in ({"disable_any_whitespace": True}, {"disable_fallback": True}, {"whitespace_pattern": None},
                  {"disable_additional_properties": False}, {"disable_additional_properties": True}):
        assert guided_of({"structured_outputs": {"json": schema, **extra}}, "all")[0] == ("json", '{"type": "object"}', "all")
    for extra in ({"whitespace_pattern": "[ ]*"}, {"structural_tag": '{"type": "structural_tag"}'}):
        with pytest.raises(APIError) as e:
            guided_of({"structured_outputs": {"json": schema, **extra}}, "all")
        assert e.value.status == 400 and e.value.param == "structured_outputs." + next(iter(extra)), e.value.param


def test_a_grammar_is_compiled_once_and_each_request_gets_its_own_state(demo, monkeypatch):
    """Compiling runs on the engine thread (every running request waits): add_request (and its
    check_request), the n sequences of one request and later requests with the same grammar compile it
    once; each gets its own copy of the matcher, which its tokens alone move on."""
    _, eng, codec = demo
    compiled = []
    real = type(eng.guides)._compile
    monkeypatch.setattr(type(eng.guides), "_compile", lambda self, k, s: compiled.append(k) or real(self, k, s))
    g = ("regex", "[a-c]{2}x[0-9]{2}", "all")
    rs = eng.generate([codec.encode("x")] * 3, [SamplingParams(temperature=1.0, seed=s, max_tokens=20, guided=g)
                                                for s in range(3)])
    assert compiled == ["regex"]
    for r in rs:
        assert r.finish_reason == "stop" and re.fullmatch("[a-c]{2}x[0-9]{2}", codec.decode(r.output_ids[:-1]))
    a, b = eng.guides.make(g), eng.guides.make(g)
    fresh = b.allowed()
    a.accept(codec.encode("a")[0])
    assert torch.equal(b.allowed(), fresh) and not torch.equal(a.allowed(), fresh)


def test_the_final_message_is_found_as_the_harmony_renderer_finds_it(demo):
    """The grammar opens on the body of a message whose channel is `final`, its header read as the harmony
    parser reads it: `<|constrain|>` splits words (`final<|constrain|>json`), a recipient may follow."""
    d, eng, codec = demo
    sp = {t["content"]: t["id"] for t in json.loads((d / "tokenizer.json").read_text())["added_tokens"]}
    g = ("json", json.dumps({"type": "object"}), "final")

    def opened(header: list[int]) -> bool:
        guide = eng.guides.make(g)
        for t in [sp["<|channel|>"], *header, sp["<|message|>"]]:
            assert guide.allowed() is None
            guide.accept(t)
        return guide.allowed() is not None

    enc, constrain = codec.encode, sp["<|constrain|>"]
    assert opened(enc("final")) and opened(enc("final ") + [constrain] + enc("json"))
    assert opened(enc("final") + [constrain] + enc("json")) and opened(enc(" final"))
    assert not opened(enc("analysis")) and not opened(enc("commentary to=functions.add ") + [constrain] + enc("json"))
    assert not opened(enc("finalize")) and not opened(enc("analysis final"))
