"""The harmony output parser: channels, tool calls (both recipient placements), streaming in any chunking,
multi-byte text split over tokens, malformed output, and finish_reason. Token sequences are written by
hand as harmony text and encoded with the tiny checkpoint's real tokenizer (special-token strings in the
text become their ids)."""

from __future__ import annotations

import itertools
import json
import re

import pytest

from gigadecode.harmony import Delta, HarmonyStreamParser, HarmonyTokens, ParsedMessage, parse_harmony
from gigadecode.tokenizer import TextCodec, build_tiny_tokenizer

CALL_ID = re.compile(r"^call_[0-9a-f]{24}$")


@pytest.fixture(scope="module")
def codec(tiny_ckpt) -> TextCodec:
    c = TextCodec.from_dir(tiny_ckpt)
    assert c is not None
    return c


@pytest.fixture(scope="module")
def toks(codec) -> HarmonyTokens:
    t = HarmonyTokens.from_codec(codec)
    assert t is not None
    return t


def ids_of(codec: TextCodec, *pieces: str) -> list[int]:
    """Each piece encoded on its own (so text pieces never merge across the pieces) and concatenated."""
    return [i for p in pieces for i in codec.encode(p)]


def joined(deltas: list[Delta], kind: str) -> str | None:
    return "".join(d.text for d in deltas if d.kind == kind) or None


def run(codec, toks, ids, chunk: int = 1, counter: bool = True):
    """Parse ids pushed `chunk` at a time; check the stream adds up to result(). -> (parser, deltas, result)"""
    n = itertools.count()
    kw = {"new_id": lambda: f"call_{next(n):024x}"} if counter else {}
    p = HarmonyStreamParser(codec, toks, **kw)
    deltas: list[Delta] = []
    for k in range(0, len(ids), chunk):
        deltas += p.push_many(ids[k:k + chunk]) if chunk > 1 else p.push(ids[k])
    deltas += p.finish()
    res = p.result()
    assert joined(deltas, "reasoning") == res.reasoning_content
    assert joined(deltas, "content") == res.content
    calls = [d for d in deltas if d.kind == "tool_call"]
    assert [(d.index, d.id, d.name, d.arguments) for d in calls] == \
        [(i, c.id, c.name, c.arguments) for i, c in enumerate(res.tool_calls)]
    assert all(d.text == "" for d in calls)
    return p, deltas, res


def test_from_codec(codec, toks):
    for field_, name in (("start", "<|start|>"), ("end", "<|end|>"), ("message", "<|message|>"),
                         ("channel", "<|channel|>"), ("constrain", "<|constrain|>"), ("return_", "<|return|>"),
                         ("call", "<|call|>")):
        assert getattr(toks, field_) == codec.token_id(name)
    assert HarmonyTokens.from_codec(None) is None


def test_from_codec_without_harmony_tokens():
    tok = build_tiny_tokenizer(262)  # no room for the harmony extras: only pad/bos/eos specials
    codec = TextCodec(tok)
    assert codec.token_id("<|return|>") is not None and codec.token_id("<|start|>") is None
    assert HarmonyTokens.from_codec(codec) is None


ANALYSIS_FINAL = ("<|channel|>analysis<|message|>", "The user asks what a GPU does.", "<|end|>",
                  "<|start|>assistant<|channel|>final<|message|>", "A GPU runs many numbers at once.",
                  "<|return|>")


def test_analysis_then_final_any_chunking(codec, toks):
    ids = ids_of(codec, *ANALYSIS_FINAL)
    results = [run(codec, toks, ids, chunk) for chunk in (1, 3, len(ids))]
    for _, deltas, res in results:
        assert res == ParsedMessage("The user asks what a GPU does.", "A GPU runs many numbers at once.", [])
        assert [d.kind for d in deltas] == sorted((d.kind for d in deltas), key=["reasoning", "content"].index)
    assert results[0][1] == results[1][1] == results[2][1]  # the same deltas, however the ids arrive
    assert parse_harmony(codec, toks, ids) == results[0][2]
    p, deltas, _ = results[0]
    assert len(deltas) > 4  # streamed piece by piece, not at the end
    assert p.finish_reason("stop") == "stop"


def test_tool_call_recipient_after_channel_with_constrain(codec, toks):
    ids = ids_of(codec, "<|channel|>analysis<|message|>", "Need to add.", "<|end|>",
                 "<|start|>assistant<|channel|>commentary to=functions.add <|constrain|>json<|message|>",
                 ' {"a": 1, "b": 2} ', "<|call|>")
    p, deltas, res = run(codec, toks, ids, counter=False)
    assert res.reasoning_content == "Need to add." and res.content is None
    [call] = res.tool_calls
    assert (call.name, call.arguments) == ("add", '{"a": 1, "b": 2}') and CALL_ID.match(call.id)
    [d] = [d for d in deltas if d.kind == "tool_call"]
    assert (d.index, d.id, d.name, json.loads(d.arguments)) == (0, call.id, "add", {"a": 1, "b": 2})
    assert p.finish_reason("stop") == "tool_calls"


@pytest.mark.parametrize("first", [True, False])
def test_tool_call_recipient_before_channel(codec, toks, first):
    # As the first message the header continues the prompt's "<|start|>assistant"; later it is explicit.
    head = [] if first else ["<|channel|>analysis<|message|>", "Look it up.", "<|end|>", "<|start|>assistant"]
    ids = ids_of(codec, *head, " to=functions.get_weather", "<|channel|>commentary json<|message|>",
                 '{"city": "Paris"}', "<|call|>")
    p, _, res = run(codec, toks, ids)
    assert res.content is None  # no header text leaks
    assert res.reasoning_content == (None if first else "Look it up.")
    assert [(c.name, c.arguments) for c in res.tool_calls] == [("get_weather", '{"city": "Paris"}')]
    assert p.finish_reason("stop") == "tool_calls"


def test_two_tool_calls(codec, toks):
    call = ("<|start|>assistant<|channel|>commentary to=functions.{} <|constrain|>json<|message|>", "<|call|>")
    ids = ids_of(codec, "<|channel|>analysis<|message|>", "Two calls.", "<|end|>",
                 call[0].format("add"), '{"a": 1}', call[1], call[0].format("mul"), '{"a": 2}', call[1])
    for chunk in (1, 3):
        p, deltas, res = run(codec, toks, ids, chunk, counter=False)
        assert [(c.name, c.arguments) for c in res.tool_calls] == [("add", '{"a": 1}'), ("mul", '{"a": 2}')]
        assert [d.index for d in deltas if d.kind == "tool_call"] == [0, 1]
        assert len({c.id for c in res.tool_calls}) == 2 and all(CALL_ID.match(c.id) for c in res.tool_calls)
        assert res.content is None and p.finish_reason("stop") == "tool_calls"


def test_preamble_then_tool_call(codec, toks):
    ids = ids_of(codec, "<|channel|>commentary<|message|>", "I will add them.", "<|end|>",
                 "<|start|>assistant<|channel|>commentary to=functions.add<|message|>", '{"a": 1}', "<|call|>")
    p, deltas, res = run(codec, toks, ids)
    assert res.content == "I will add them."
    assert [(c.name, c.arguments) for c in res.tool_calls] == [("add", '{"a": 1}')]
    assert [d.kind for d in deltas][-1] == "tool_call"
    assert p.finish_reason("stop") == "tool_calls"


def test_unjoined_deltas_name_their_message_and_channel(codec, toks):
    """`join=False` (/v1/responses' items): no "\\n" between messages of a kind; each delta names its message (a
    number per message, in order) and channel, a call and a malformed call's text included."""
    bad = "<|start|>assistant<|channel|>commentary to=functions.add<|message|>{oops<|call|>"
    ids = ids_of(codec, "<|channel|>analysis<|message|>", "One.", "<|end|>", "<|start|>assistant<|channel|>analysis"
                 "<|message|>", "Two.", "<|end|>", "<|start|>assistant<|channel|>commentary<|message|>", "Adding.",
                 "<|end|>", "<|start|>assistant<|channel|>commentary to=functions.add<|message|>", '{"a": 1}',
                 "<|call|>", bad, "<|start|>assistant<|channel|>final<|message|>", "Done.", "<|return|>")
    p = HarmonyStreamParser(codec, toks, join=False)
    deltas = p.push_many(ids) + p.finish()
    by_message: dict[int, list[Delta]] = {}
    for d in deltas:
        by_message.setdefault(d.message, []).append(d)
    got = [(ds[0].kind, ds[0].channel, "".join(d.text or d.arguments or "" for d in ds)) for ds in by_message.values()]
    assert got == [("reasoning", "analysis", "One."), ("reasoning", "analysis", "Two."),
                   ("content", "commentary", "Adding."), ("tool_call", "commentary", '{"a": 1}'),
                   ("content", "commentary", "functions.add {oops"), ("content", "final", "Done.")]
    assert sorted(by_message) == list(by_message) and len(by_message) == len(set(by_message))
    joined_res = parse_harmony(codec, toks, ids)        # the default joins them, as chat shows them
    assert (joined_res.reasoning_content, joined_res.content) == ("One.\nTwo.", "Adding.\nfunctions.add {oops\nDone.")


@pytest.mark.parametrize("cut", ["analysis", "final"])
def test_unterminated_channel(codec, toks, cut):
    if cut == "analysis":
        ids = ids_of(codec, "<|channel|>analysis<|message|>", "The user asks")  # max_tokens hit mid-reasoning
        expect = ParsedMessage("The user asks", None, [])
    else:
        ids = ids_of(codec, "<|channel|>analysis<|message|>", "Think.", "<|end|>",
                     "<|start|>assistant<|channel|>final<|message|>", "The answer is")
        expect = ParsedMessage("Think.", "The answer is", [])
    p, _, res = run(codec, toks, ids)
    assert res == expect and p.finish_reason("length") == "length"


def test_body_cut_by_a_new_header(codec, toks):
    # No <|end|>: the next <|start|> closes the analysis message.
    ids = ids_of(codec, "<|channel|>analysis<|message|>", "Think.",
                 "<|start|>assistant<|channel|>final<|message|>", "Done.", "<|return|>")
    assert run(codec, toks, ids)[2] == ParsedMessage("Think.", "Done.", [])


def test_header_without_message_is_content(codec, toks):
    ids = ids_of(codec, "<|start|>assistant<|channel|>final", "<|end|>")  # cut by a terminator: malformed
    assert run(codec, toks, ids)[2] == ParsedMessage(None, "assistantfinal", [])


@pytest.mark.parametrize("header", ["<|start|>assistant<|channel|>final", "<|channel|>", "<|channel|>analysis",
                                    "<|start|>", "<|start|>assistant<|channel|>commentary to=functions.add"])
def test_header_cut_by_the_end_is_dropped(codec, toks, header):
    # max_tokens ends the output inside a header: harmony's framing, not text for the client
    ids = ids_of(codec, "<|channel|>analysis<|message|>", "Think.", "<|end|>", header)
    p, deltas, res = run(codec, toks, ids)
    assert res == ParsedMessage("Think.", None, []) and {d.kind for d in deltas} == {"reasoning"}
    p, deltas, res = run(codec, toks, ids_of(codec, header))   # the whole output a header
    assert res == ParsedMessage(None, None, []) and deltas == []


def test_unknown_channel_is_content(codec, toks):
    ids = ids_of(codec, "<|channel|>weather<|message|>", "Rain.", "<|end|>",
                 "<|start|>assistant<|channel|>final<|message|>", "Sun.", "<|return|>")
    assert run(codec, toks, ids)[2] == ParsedMessage(None, "Rain.\nSun.", [])  # messages joined by "\n"


@pytest.mark.parametrize("args", ["{bad json", ""])
def test_invalid_json_arguments_are_content(codec, toks, args):
    ids = ids_of(codec, "<|channel|>commentary to=functions.add <|constrain|>json<|message|>", args, "<|call|>")
    p, deltas, res = run(codec, toks, ids)
    assert res == ParsedMessage(None, f"functions.add {args}".strip(), [])
    assert not [d for d in deltas if d.kind == "tool_call"]
    assert p.finish_reason("stop") == "stop"


def test_unterminated_tool_call_is_content(codec, toks):
    ids = ids_of(codec, "<|channel|>commentary to=functions.add <|constrain|>json<|message|>", '{"a": ')
    p, _, res = run(codec, toks, ids)
    assert res == ParsedMessage(None, 'functions.add {"a":', []) and p.finish_reason("length") == "length"


@pytest.mark.parametrize("text", ["Hello, world! The model reads the prompt.", "tomorrow there will be rain",
                                  "  to be or not to be", "\nThe answer is 42."])
def test_plain_text_without_harmony_tokens(codec, toks, text):
    ids = ids_of(codec, text, "<|return|>")
    p = HarmonyStreamParser(codec, toks)
    early = [d for i in ids[:-1] for d in p.push(i)]
    assert early and all(d.kind == "content" for d in early)  # streamed, not held to the end
    _, _, res = run(codec, toks, ids)
    assert res == ParsedMessage(None, text, [])


def test_stray_text_before_header(codec, toks):
    ids = ids_of(codec, "Hello.", "<|channel|>final<|message|>", "Hi.", "<|return|>")
    assert run(codec, toks, ids)[2] == ParsedMessage(None, "Hello.\nHi.", [])
    ids = ids_of(codec, "\n", "<|channel|>final<|message|>", "Hi.", "<|return|>")  # whitespace: no content
    assert run(codec, toks, ids)[2] == ParsedMessage(None, "Hi.", [])


def test_multibyte_split_across_tokens(codec, toks):
    text = "Grüße 🙂 中文 naïve"
    body = codec.encode(text)
    assert any("\ufffd" in codec.decode([i]) for i in body)  # some characters do span several tokens
    ids = ids_of(codec, "<|channel|>analysis<|message|>", text, "<|end|>",
                 "<|start|>assistant<|channel|>final<|message|>") + body + ids_of(codec, "<|return|>")
    for chunk in (1, 3):
        _, deltas, res = run(codec, toks, ids, chunk)
        assert res == ParsedMessage(text, text, [])
        assert not any("\ufffd" in d.text for d in deltas)
    # Cut inside a character: the remainder is U+FFFD, as a full decode would give.
    _, _, res = run(codec, toks, ids_of(codec, "<|channel|>final<|message|>") + codec.encode("ok 🙂")[:-1])
    assert res.content == codec.decode(codec.encode("ok 🙂")[:-1])


def test_finish_reason(codec, toks):
    call = ids_of(codec, "<|channel|>commentary to=functions.add<|message|>", '{"a": 1}', "<|call|>")
    p, _, _ = run(codec, toks, call)
    assert p.finish_reason("stop") == "tool_calls"
    assert p.finish_reason("length") == "tool_calls"  # the last token was <|call|>
    assert p.finish_reason("abort") == "abort"
    cut = ids_of(codec, "<|channel|>commentary to=functions.add<|message|>", '{"a": 1}')  # valid, not closed
    p, _, res = run(codec, toks, cut)
    assert len(res.tool_calls) == 1 and p.finish_reason("length") == "length"
    text = ids_of(codec, "<|channel|>final<|message|>", "Hi.", "<|return|>")
    p, _, _ = run(codec, toks, text)
    assert p.finish_reason("stop") == "stop" and p.finish_reason(None) is None


def test_never_raises_and_finish_is_idempotent(codec, toks):
    specials = ids_of(codec, "<|start|><|end|><|message|><|channel|><|constrain|><|return|><|call|>")
    words = codec.encode(" to=functions.f json {} final analysis x")
    seq = [specials[i % len(specials)] if i % 3 else words[i % len(words)] for i in range(200)]
    p, _, res = run(codec, toks, seq)
    assert isinstance(res, ParsedMessage)
    assert p.finish() == [] and p.push(words[0]) == [] and p.result() == res
