"""OpenAI request features beyond plain sampling, through the real app in-process (uvicorn in a thread) and
the official `openai` client: `stop` strings (matched across token boundaries, cut from the text, whole
and streamed), `n` > 1, `logit_bias`, generation_config.json (its eos ids stop generation, its sampling
defaults fill unset fields), unsupported fields refused by name, and `--model` by Hugging Face repo id."""

from __future__ import annotations

import json
import shutil
import time

import httpx
import openai
import pytest

import gigadecode
from gigadecode.cli import build_parser
from gigadecode.server.api import build_app, engine_from_args
from gigadecode.server.async_engine import AsyncEngine
from gigadecode.tokenizer import TextCodec

from .helpers import random_prompt
from .test_server import ServerThread

# 160 blocks: one request of ~1,400 tokens (88 full-attention blocks, and the sliding ones of a 1,024-token
# prefill chunk, 65 + 1) fits the pool
FLAGS = ["--num-blocks", "160", "--block-size", "16", "--kv-dtype", "fp8", "--max-num-seqs", "16"]
EXTRA = {"ignore_eos": True, "return_token_ids": True}


def _serve(model_dir, extra=()):
    args = build_parser().parse_args(["serve", "--model", str(model_dir), *FLAGS, *extra])
    eng = engine_from_args(args, "both")
    return eng, ServerThread(build_app(AsyncEngine(eng, codec=TextCodec.from_dir(model_dir),
                                                   model_dir=str(model_dir)), "m"))


@pytest.fixture(scope="module")
def live(tiny_ckpt):
    eng, srv = _serve(tiny_ckpt)
    with srv:
        yield eng, openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)


def _greedy_text(client, prompt, n_tokens, extra=None, **kw):
    r = client.completions.create(model="m", prompt=prompt, max_tokens=n_tokens, temperature=0,
                                  extra_body={**EXTRA, **(extra or {})}, **kw)
    return r.choices[0]


def test_stop_strings_cut_across_token_boundaries(live, tiny_ckpt):
    _, client = live
    codec = TextCodec.from_dir(tiny_ckpt)
    prompt = random_prompt(12, 1024, seed=5)
    full = _greedy_text(client, prompt, 24)
    text = full.text
    # a stop string that spans a token boundary: 2 characters either side of where one token's text ends
    bounds = [len(codec.decode(full.token_ids[:i])) for i in range(1, len(full.token_ids))]
    p = next(b for b in bounds[3:] if 2 <= b <= len(text) - 2 and text[:b] == codec.decode(full.token_ids[:bounds.index(b) + 1]))
    stop = text[p - 2:p + 2]
    cut = text[:text.index(stop)]
    got = _greedy_text(client, prompt, 24, stop=[stop, "zzzz-never"])
    assert got.text == cut and got.finish_reason == "stop"
    assert len(got.token_ids) < len(full.token_ids)                # generation stopped there
    streamed, reasons = "", []
    for ch in client.completions.create(model="m", prompt=prompt, max_tokens=24, temperature=0, stream=True,
                                        stop=stop, extra_body=EXTRA):
        streamed += ch.choices[0].text
        reasons.append(ch.choices[0].finish_reason)
    assert streamed == cut and reasons[-1] == "stop"
    assert _greedy_text(client, prompt, 24, stop="zzzz-never").text == text      # no match: all of it


def test_n_choices(live):
    _, client = live
    r = client.completions.create(model="m", prompt=[5, 6, 7], max_tokens=2, temperature=0)
    assert r.usage.prompt_tokens_details is None                  # no prefix caching: no cached count
    prompt = random_prompt(9, 1024, seed=6)
    greedy = client.completions.create(model="m", prompt=prompt, max_tokens=8, temperature=0, n=2, extra_body=EXTRA)
    assert [c.index for c in greedy.choices] == [0, 1]
    assert greedy.choices[0].token_ids == greedy.choices[1].token_ids           # greedy: the same sequence twice
    assert greedy.usage.prompt_tokens == 9 and greedy.usage.completion_tokens == 16
    sampled = client.completions.create(model="m", prompt=prompt, max_tokens=8, temperature=1.0, seed=3, n=3,
                                        extra_body=EXTRA)
    seqs = [tuple(c.token_ids) for c in sampled.choices]
    assert len(set(seqs)) > 1                                                   # the n draws differ
    again = client.completions.create(model="m", prompt=prompt, max_tokens=8, temperature=1.0, seed=3, n=3,
                                      extra_body=EXTRA)
    assert [tuple(c.token_ids) for c in again.choices] == seqs                  # and are reproducible
    idx = set()
    for ch in client.completions.create(model="m", prompt=prompt, max_tokens=4, temperature=0, n=2, stream=True,
                                        extra_body=EXTRA):
        idx |= {c.index for c in ch.choices}
    assert idx == {0, 1}
    chat = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          temperature=0, n=2, extra_body={"ignore_eos": True})
    assert [c.index for c in chat.choices] == [0, 1]


def test_n_choices_with_the_largest_seed(live):
    """The j-th of n seeded sequences draws with seed + j: from the top of the seed range that wraps around
    instead of failing the request with a 500 (any seed a single request takes, n > 1 takes too)."""
    eng, client = live
    top = 2**64 - 1
    r = client.completions.create(model="m", prompt=[5, 6, 7], max_tokens=4, temperature=1.0, seed=top, n=3,
                                  extra_body=EXTRA)
    assert [c.index for c in r.choices] == [0, 1, 2]
    again = client.completions.create(model="m", prompt=[5, 6, 7], max_tokens=4, temperature=1.0, seed=top, n=3,
                                      extra_body=EXTRA)
    assert [c.token_ids for c in again.choices] == [c.token_ids for c in r.choices]
    single = client.completions.create(model="m", prompt=[5, 6, 7], max_tokens=4, temperature=1.0, seed=top,
                                       extra_body=EXTRA)
    assert single.choices[0].token_ids == r.choices[0].token_ids       # choice 0 draws with the seed itself
    assert not eng.requests



def test_an_explicit_null_max_tokens_runs_each_prompt_to_the_context(live):
    """max_tokens left out is OpenAI's 16; an explicit null is each prompt's rest of the context, as in vLLM
    (prompts of different lengths get different budgets)."""
    _, client = live
    ctx = client.models.list().data[0].max_model_len
    prompts = [random_prompt(ctx - 5, 1024, seed=7), random_prompt(ctx - 3, 1024, seed=8)]
    r = client.completions.create(model="m", prompt=prompts, max_tokens=None, temperature=0, extra_body=EXTRA)
    assert [len(c.token_ids) for c in r.choices] == [5, 3]
    assert [c.finish_reason for c in r.choices] == ["length", "length"]
    with pytest.raises(openai.BadRequestError, match="maximum context length"):   # left out: 16, past the context
        client.completions.create(model="m", prompt=prompts[:1], temperature=0, extra_body=EXTRA)



def test_echo_with_logprobs_scores_the_prompt(live, tiny_ckpt):
    """echo + logprobs, as log-likelihood evaluations send it (lm-eval's local-completions: max_tokens 1,
    logprobs 1): the prompt's text and then the completion's, and per token of both its logprob (the prompt's
    first: null) — the prompt's those of vLLM's prompt_logprobs field, the completion's those of the same
    request without echo — with offsets into that text; streamed alike. Without logprobs only the text."""
    _, client = live
    codec = TextCodec.from_dir(tiny_ckpt)
    text = "the quick brown fox jumps over the lazy dog, and then"
    ids = codec.encode(text)
    kw = dict(model="m", prompt=text, max_tokens=3, temperature=0, logprobs=2, extra_body=EXTRA)
    plain = client.completions.create(**kw).choices[0]
    echo = client.completions.create(echo=True, **kw).choices[0]
    assert echo.text == text + plain.text and echo.token_ids == plain.token_ids
    lp = echo.logprobs
    n = len(ids)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[n:] == plain.logprobs.token_logprobs and lp.tokens[n:] == plain.logprobs.tokens
    assert lp.text_offset[n:] == [o + len(text) for o in plain.logprobs.text_offset]
    assert [text[a:b] for a, b in zip(lp.text_offset[:n], lp.text_offset[1:n + 1])] == lp.tokens[:n]
    assert all(v <= 0 and len(t) >= 1 for v, t in zip(lp.token_logprobs[1:n], lp.top_logprobs[1:n]))
    # the same numbers through vLLM's prompt_logprobs field: {token id: {logprob, rank, decoded_token}}
    field = client.completions.create(**{**kw, "extra_body": {**EXTRA, "prompt_logprobs": 2}}).choices[0]
    plp = field.model_extra["prompt_logprobs"]
    assert len(plp) == n and plp[0] is None
    assert [e[str(t)]["logprob"] for e, t in zip(plp[1:], ids[1:])] == lp.token_logprobs[1:n]
    assert all(1 <= e[str(t)]["rank"] and len(e) in (2, 3) for e, t in zip(plp[1:], ids[1:]))
    # streamed: the prompt with the first chunk
    chunks = list(client.completions.create(echo=True, stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks) == echo.text
    assert [v for c in chunks for v in c.choices[0].logprobs.token_logprobs] == lp.token_logprobs
    # max_tokens 0 (log-likelihood scoring): the prompt alone, nothing generated counted
    zero = client.completions.create(model="m", prompt=text, max_tokens=0, temperature=0, echo=True, logprobs=1)
    zl = zero.choices[0].logprobs
    assert zero.choices[0].text == text and zero.usage.completion_tokens == 0 and len(zl.tokens) == n
    assert zl.token_logprobs[1:] == lp.token_logprobs[1:n] and zero.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="m", prompt=text, max_tokens=0)              # without echo: as before
    # no logprobs: the text only
    bare = client.completions.create(model="m", prompt=[ids, ids[:5]], max_tokens=2, temperature=0, echo=True,
                                     n=2, extra_body=EXTRA)
    assert [c.text[:len(text)] for c in bare.choices[:2]] == [text, text] and bare.choices[0].logprobs is None
    assert all(c.text.startswith(codec.decode(ids[:5])) for c in bare.choices[2:])


def test_prompt_logprobs_are_refused_where_the_prompt_is_not_computed(live):
    """A DI request (kv_transfer_params) gets its prompt's KV from elsewhere: prompt_logprobs (or echo with
    logprobs) is a 400 naming the field, before anything is queued; chat's echo is refused."""
    eng, client = live
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="m", prompt=[5, 6, 7], max_tokens=2, echo=True, logprobs=1,
                                  extra_body={"kv_transfer_params": {"do_remote_decode": True}})
    assert e.value.body["param"] == "prompt_logprobs"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="m", prompt=[5, 6, 7], max_tokens=2, extra_body={"prompt_logprobs": 21})
    assert e.value.body["param"] == "prompt_logprobs"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       extra_body={"echo": True})
    assert e.value.body["param"] == "echo"
    chat = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                          extra_body={"prompt_logprobs": 0, **EXTRA})
    plp = chat.model_extra["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(chat.model_extra["prompt_token_ids"])
    # a streamed chat completion has nowhere to put them: a 400 as in vLLM (0, which asks for none, streams)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       stream=True, extra_body={"prompt_logprobs": 1})
    assert e.value.body["param"] == "prompt_logprobs"
    chunks = list(client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=2, stream=True, extra_body={"prompt_logprobs": 0}))
    assert chunks[-1].choices[0].finish_reason == "length"
    assert not eng.requests



def test_tokenize_detokenize_and_version_routes(live, tiny_ckpt):
    """vLLM's token routes: /tokenize a prompt (the completions' ids) or chat messages (the ids the chat route
    renders for them, tools and reasoning effort included), /detokenize back to text, /version."""
    _, client = live
    codec = TextCodec.from_dir(tiny_ckpt)
    url = str(client.base_url).removesuffix("/v1/")
    msgs = [{"role": "user", "content": "What is 2 + 3?"}]
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    with httpx.Client(base_url=url, timeout=30) as hc:
        r = hc.post("/tokenize", json={"prompt": "hello there"}).json()
        assert r["tokens"] == codec.encode("hello there") and r["count"] == len(r["tokens"]) and r["max_model_len"] > 0
        assert "token_strs" not in r
        # vLLM's return_token_strs: the vocabulary's strings, which transformers' tokenizer gives for the ids
        from transformers import PreTrainedTokenizerFast
        hf = PreTrainedTokenizerFast(tokenizer_file=str(tiny_ckpt / "tokenizer.json"))
        r = hc.post("/tokenize", json={"prompt": "hello there", "return_token_strs": True}).json()
        assert r["token_strs"] == hf.convert_ids_to_tokens(r["tokens"]) and len(r["token_strs"]) == r["count"]
        assert hc.post("/tokenize", json={"prompt": "x", "return_token_strs": "yes"}).status_code == 400
        chat = client.chat.completions.create(model="m", messages=msgs, max_tokens=1, tools=tools,
                                              reasoning_effort="high", extra_body={"return_token_ids": True})
        r = hc.post("/tokenize", json={"messages": msgs, "tools": tools, "reasoning_effort": "high"}).json()
        assert r["tokens"] == chat.model_extra["prompt_token_ids"]
        back = hc.post("/detokenize", json={"tokens": r["tokens"]}).json()["prompt"]      # special tokens kept
        assert back == codec.render_chat(msgs, tools=tools, reasoning_effort="high")
        for bad, param in (({"tokens": [1, "x"]}, "tokens"), ({"tokens": [10 ** 9]}, "tokens"),
                           ({"prompt": {"x": 1}}, "prompt"), ({"messages": []}, "messages"),
                           # what the chat route refuses is not rendered some other way here either
                           ({"messages": msgs, "continue_final_message": True}, "continue_final_message"),
                           ({"messages": msgs, "chat_template": "{{ messages }}"}, "chat_template"),
                           ({"messages": msgs, "chat_template_kwargs": {"enable_thinking": False}},
                            "chat_template_kwargs")):
            e = hc.post("/detokenize" if "tokens" in bad else "/tokenize", json=bad)
            assert e.status_code == 400 and e.json()["error"]["param"] == param, bad
        assert hc.get("/version").json()["version"] == gigadecode.__version__



def test_prefix_caching_reports_cached_tokens(tiny_ckpt):
    """With --enable-prefix-caching a prompt that starts like an earlier one reports its cached tokens in
    usage.prompt_tokens_details (chat, completions, responses' input_tokens_details) and in /metrics, and its
    tokens are those of the first run; without it no prompt_tokens_details."""
    eng, srv = _serve(tiny_ckpt, ["--enable-prefix-caching"])
    with srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)
        base = random_prompt(40, 1024, seed=41)
        first = client.completions.create(model="m", prompt=base, max_tokens=6, temperature=0, extra_body=EXTRA)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        again = client.completions.create(model="m", prompt=base + [7, 8], max_tokens=6, temperature=0,
                                          extra_body=EXTRA)
        assert again.usage.prompt_tokens_details.cached_tokens == 32        # two whole 16-token blocks
        same = client.completions.create(model="m", prompt=base, max_tokens=6, temperature=0, extra_body=EXTRA)
        assert same.choices[0].token_ids == first.choices[0].token_ids
        msgs = [{"role": "user", "content": "the same question, asked twice " * 4}]
        client.chat.completions.create(model="m", messages=msgs, max_tokens=2)
        chat = client.chat.completions.create(model="m", messages=msgs, max_tokens=2)
        assert chat.usage.prompt_tokens_details.cached_tokens >= 16
        client.responses.create(model="m", input="the same question, asked twice " * 4, max_output_tokens=2)
        r = client.responses.create(model="m", input="the same question, asked twice " * 4, max_output_tokens=2)
        assert r.usage.input_tokens_details.cached_tokens >= 16
        m = httpx.get(srv.url + "/metrics").text
        hits = float(next(ln.split()[-1] for ln in m.splitlines() if ln.startswith("gigadecode_prefix_cache_hits_total")))
        assert hits >= 32 + 16 + 16


def test_speculative_decoding_serves_plain_decoding_tokens(live, tiny_ckpt):
    """`serve --speculative-config` (n-gram drafts, vLLM's flag): greedy and seeded answers, whole and
    streamed, are the plain server's tokens; /metrics counts drafts and accepted ones. The prompt holds
    nearly every token of the vocabulary, so each sampled token matched before and the n-gram proposer
    drafts every step (a random model rarely repeats itself, so few are accepted); then drafts told the
    answer (a stand-in proposer) are accepted, several tokens a step, and the answers stay the same."""
    import random
    _, plain = live
    perm = list(range(1024))
    random.Random(5).shuffle(perm)
    prompt = perm[:1000]
    cfg = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}'
    eng, srv = _serve(tiny_ckpt, ["--speculative-config", cfg])

    class Told:
        def __init__(self, answer):
            self.answer = answer

        def propose(self, req, limit):
            o = len(req.output_ids)
            return self.answer[o: o + min(3, limit)]

    def metrics():
        m = httpx.get(srv.url + "/metrics").text
        return {ln.split()[0]: float(ln.split()[-1]) for ln in m.splitlines() if ln.startswith("gigadecode_spec")}

    with srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)
        ngram = eng.scheduler.proposer
        for told in (False, True):
            for kw in ({"temperature": 0}, {"temperature": 1.0, "seed": 17, "top_p": 0.9}):
                want = plain.completions.create(model="m", prompt=prompt, max_tokens=12, extra_body=EXTRA, **kw)
                ids = want.choices[0].token_ids
                eng.scheduler.proposer = Told(ids) if told else ngram
                got = client.completions.create(model="m", prompt=prompt, max_tokens=12, extra_body=EXTRA, **kw)
                assert got.choices[0].token_ids == ids and len(ids) == 12
                streamed = client.completions.create(model="m", prompt=prompt, max_tokens=12, stream=True,
                                                     extra_body=EXTRA, **kw)
                assert "".join(c.choices[0].text for c in streamed if c.choices) == want.choices[0].text
            value = metrics()
            assert value["gigadecode_spec_decode_num_draft_tokens_total"] >= value["gigadecode_spec_decode_num_drafts_total"] > 0
            if told:
                assert value["gigadecode_spec_decode_num_accepted_tokens_total"] >= 4 * 8   # 3 + 3 + 2 a request
    with pytest.raises(Exception, match="ngram"):
        _serve(tiny_ckpt, ["--speculative-config", '{"method": "eagle", "num_speculative_tokens": 2}'])


def test_suffix_decoding_caches_what_a_stop_string_ended(live, tiny_ckpt):
    """`serve --speculative-config '{"method": "suffix"}'`: an answer a stop string ended ("stop" to the
    client) joins suffix decoding's cache as one that ran to its length does (the server ends the engine
    request at the stop string; that was an abort, never cached). The repeated request drafts from the cache
    and /metrics counts it; the tokens stay plain decoding's."""
    _, plain = live
    prompt = random_prompt(30, 1024, seed=8)
    want = plain.completions.create(model="m", prompt=prompt, max_tokens=24, temperature=0, extra_body=EXTRA)
    eng, srv = _serve(tiny_ckpt, ["--speculative-config", '{"method": "suffix"}'])
    cache = eng.scheduler.proposer.cache

    def cached(n: int) -> bool:                 # the engine thread caches it after the answer went out
        t0 = time.monotonic()
        while len(cache) < n and time.monotonic() - t0 < 5:
            time.sleep(0.02)
        return len(cache) == n

    with srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)
        got = client.completions.create(model="m", prompt=prompt, max_tokens=24, temperature=0, extra_body=EXTRA)
        assert got.choices[0].token_ids == want.choices[0].token_ids and got.choices[0].finish_reason == "length"
        assert cached(1)
        text = want.choices[0].text
        stop = text[len(text) // 2: len(text) // 2 + 3]
        got = client.completions.create(model="m", prompt=prompt, max_tokens=24, temperature=0, stop=[stop],
                                        extra_body=EXTRA)
        assert got.choices[0].finish_reason == "stop" and got.choices[0].text == text[: text.index(stop)]
        assert cached(2)
        assert list(cache.tokens[: cache.n]).count(-1) == 2
        m = httpx.get(srv.url + "/metrics").text
        spec = {ln.split()[0]: float(ln.split()[-1]) for ln in m.splitlines() if ln.startswith("gigadecode_spec")}
        assert spec["gigadecode_spec_decode_num_accepted_tokens_total"] > 0, spec     # drafted from the first


def test_logit_bias_forces_and_bans_tokens(live):
    _, client = live
    prompt = random_prompt(9, 1024, seed=7)
    r = client.completions.create(model="m", prompt=prompt, max_tokens=5, temperature=0,
                                  logit_bias={"321": 100}, extra_body=EXTRA)
    assert r.choices[0].token_ids == [321] * 5
    base = _greedy_text(client, prompt, 5).token_ids
    r = client.completions.create(model="m", prompt=prompt, max_tokens=5, temperature=0,
                                  logit_bias={str(base[0]): -100}, extra_body=EXTRA)
    assert r.choices[0].token_ids[0] != base[0]
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        client.completions.create(model="m", prompt=prompt, max_tokens=2, logit_bias={"5": 500})
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        client.completions.create(model="m", prompt=prompt, max_tokens=2, logit_bias={"99999999": 1})


# vLLM fields that would change the output: a value asking for something this server does not do is a 400
# naming the field on both routes; the value that asks for what it does anyway is accepted
REFUSED_EITHER = [("guided_whitespace_pattern", "[ ]*", None),
                  ("use_beam_search", True, False), ("length_penalty", 0.5, 1.0),
                  ("return_tokens_as_token_ids", True, False), ("detokenize", False, True),
                  ("logits_processors", ["m.f"], None), ("priority", 1, 0)]
REFUSED_CHAT = [("echo", True, False), ("best_of", 2, 1), ("continue_final_message", True, False),
                ("skip_special_tokens", False, True),
                ("chat_template", "{{ messages }}", None), ("chat_template_kwargs", {"reasoning_effort": "low"}, {}),
                ("functions", [{"name": "f"}], None), ("audio", {"voice": "x"}, None)]
REFUSED_COMPLETION = [("suffix", "z", ""), ("best_of", 2, 1)]


@pytest.mark.parametrize("chat", [False, True])
def test_unsupported_fields_are_refused_by_name(live, chat):
    _, client = live
    msgs = [{"role": "user", "content": "hi"}]

    def call(**body):
        if chat:
            return client.chat.completions.create(model="m", messages=msgs, max_tokens=2, extra_body=body)
        return client.completions.create(model="m", prompt="x", max_tokens=2, extra_body=body)

    for field, refused, accepted in REFUSED_EITHER + (REFUSED_CHAT if chat else REFUSED_COMPLETION):
        with pytest.raises(openai.BadRequestError) as e:
            call(**{field: refused})
        assert e.value.body["param"] == field, field
        if accepted is not None:
            call(**{field: accepted})
    call(user="u", metadata={"k": "v"}, store=False, cache_salt="s", frequency_penalty=0.0)   # change nothing here
    with pytest.raises(openai.BadRequestError) as e:            # stream options without a stream (as vLLM)
        call(stream_options={"include_usage": True})
    assert e.value.body["param"] == "stream_options"
    if chat:
        with pytest.raises(openai.BadRequestError) as e:
            call(tool_choice={"type": "function", "function": {"name": "g"}},     # not among the tools
                 tools=[{"type": "function", "function": {"name": "f"}}])
        assert e.value.body["param"] == "tool_choice"
        with pytest.raises(openai.BadRequestError) as e:        # top_logprobs without logprobs (as vLLM)
            call(top_logprobs=2)
        assert e.value.body["param"] == "top_logprobs"
        assert call(top_logprobs=0).choices[0].logprobs is None     # asks for nothing: accepted (as vLLM)
    else:
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="m", prompt="x", max_tokens=2, n=0)
        assert e.value.body["param"] == "n"


# a field whose value no member of its union takes: (body, param, message) — the param names the field (not
# pydantic's member tag, `stop.str`), at the place the value went wrong, with what each member wanted there
UNION_TYPE_ERRORS = [
    ({"prompt": "x", "stop": 5}, "stop", "stop: Input should be a valid string, or a valid list"),
    ({"prompt": "x", "stop": ["a", 5]}, "stop.1", "stop.1: Input should be a valid string"),
    ({"prompt": None}, "prompt", "prompt: Input should be a valid string, or a valid list"),
    ({"prompt": [1.5, 2]}, "prompt.0", "prompt.0: Input should be a valid integer, or a valid string, or a valid list"),
    ({"prompt": "x", "logit_bias": {"7": "up"}}, "logit_bias.7",
     "logit_bias.7: Input should be a valid integer, or a valid number"),
    ({"messages": [{"role": "user", "content": [{"type": 5, "text": "hi"}]}]}, "messages.0.content.0.type",
     "messages.0.content.0.type: Input should be a valid string"),
    ({"messages": [{"role": "user", "content": "hi"}], "tool_choice": 5}, "tool_choice",
     "tool_choice: Input should be a valid string, or a valid dictionary"),
]


@pytest.mark.parametrize("body,param,message", UNION_TYPE_ERRORS)
def test_type_errors_in_union_fields_name_the_field(live, body, param, message):
    _, client = live
    with pytest.raises(openai.BadRequestError) as e:
        if "messages" in body:
            client.chat.completions.create(model="m", max_tokens=2, **body)
        else:
            client.completions.create(model="m", max_tokens=2, **body)
    assert (e.value.body["param"], e.value.body["message"]) == (param, message)


def test_errors_in_max_completion_tokens_name_it(live):
    """Chat takes OpenAI's `max_completion_tokens` (before `max_tokens`); a bad value is a 400 naming the
    field the client sent, not `max_tokens`, which it did not."""
    _, client = live
    msgs = [{"role": "user", "content": "hi"}]
    for value, code in (("5", None), (0, None), (10**6, "context_length_exceeded")):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="m", messages=msgs, max_completion_tokens=value)
        body = e.value.body
        assert (body["param"], body["code"]) == ("max_completion_tokens", code), body
        assert code is not None or "max_completion_tokens" in body["message"], body
    r = client.chat.completions.create(model="m", messages=msgs, max_completion_tokens=3, max_tokens=5,
                                       extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=msgs, max_tokens=0)
    assert e.value.body["param"] == "max_tokens"


def test_text_offset_is_the_position_in_the_text(live, tiny_ckpt):
    # special tokens are left out of the text, so their strings must not move the offsets of what follows;
    # streamed and whole answers agree
    _, client = live
    codec = TextCodec.from_dir(tiny_ckpt)
    prompt = random_prompt(10, 1024, seed=9)
    special = min(codec.special_ids)                              # ignore_eos: any special will do
    for bias, n_tok in (({}, 12), ({str(special): 100}, 4)):
        r = client.completions.create(model="m", prompt=prompt, max_tokens=n_tok, temperature=0, logprobs=1,
                                      logit_bias=bias, extra_body=EXTRA).choices[0]
        ids, offs = r.token_ids, r.logprobs.text_offset
        assert len(offs) == len(ids) == n_tok
        assert offs == [len(codec.decode(ids[:i])) for i in range(len(ids))]   # decode() leaves specials out
        assert all(o <= len(r.text) for o in offs)
        if bias:
            assert r.text == "" and offs == [0] * n_tok
        streamed = [o for ch in client.completions.create(model="m", prompt=prompt, max_tokens=n_tok, temperature=0,
                                                          logprobs=1, logit_bias=bias, stream=True, extra_body=EXTRA)
                    if ch.choices and ch.choices[0].logprobs for o in ch.choices[0].logprobs.text_offset]
        assert streamed == offs


def test_a_stop_string_counts_as_stop_in_the_metrics(live, tiny_ckpt):
    from .test_server import metrics
    _, client = live
    url = str(client.base_url).rstrip("/").removesuffix("/v1")
    prompt = random_prompt(12, 1024, seed=5)
    text = _greedy_text(client, prompt, 12).text
    key = 'gigadecode_requests_total{finish_reason="%s"}'
    before = metrics(url)
    got = _greedy_text(client, prompt, 12, stop=text[3:6])
    assert got.finish_reason == "stop"
    for _ in range(100):                                         # the abort lands on the engine thread
        after = metrics(url)
        if after.get(key % "stop", 0) > before.get(key % "stop", 0):
            break
        time.sleep(0.05)
    assert after.get(key % "stop", 0) == before.get(key % "stop", 0) + 1
    assert after.get(key % "abort", 0) == before.get(key % "abort", 0)


def test_generation_config_stop_tokens_and_defaults(tiny_ckpt, tmp_path):
    """generation_config.json's eos ids stop generation (config.json's alone would not), and its sampling
    defaults apply to a request that sets none."""
    d = tmp_path / "m"
    shutil.copytree(tiny_ckpt, d)
    eng0, srv0 = _serve(d)
    prompt = random_prompt(10, 1024, seed=8)
    with srv0:
        c0 = openai.OpenAI(base_url=srv0.url + "/v1", api_key="x", max_retries=0, timeout=60)
        ids = c0.completions.create(model="m", prompt=prompt, max_tokens=12, temperature=0,
                                    extra_body={"return_token_ids": True}).choices[0].token_ids
    stop_tok = ids[3]
    assert stop_tok not in eng0.eos_token_ids and stop_tok not in ids[:3]
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [stop_tok], "temperature": 0.0}))
    eng, srv = _serve(d)
    assert stop_tok in eng.eos_token_ids and set(eng0.eos_token_ids) <= set(eng.eos_token_ids)
    with srv:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)
        r = c.completions.create(model="m", prompt=prompt, max_tokens=12, extra_body={"return_token_ids": True})
        assert r.choices[0].token_ids == ids[:4] and r.choices[0].finish_reason == "stop"   # greedy by default


def test_model_by_hugging_face_repo_id(tiny_ckpt, tmp_path, monkeypatch):
    """`--model org/name` finds the snapshot in the local Hugging Face cache (offline); a clear error when
    it is not there."""
    from gigadecode.config import ConfigError
    from gigadecode.hub import resolve_model
    cache = tmp_path / "hub"
    snap = cache / "models--acme--gpt-oss-tiny" / "snapshots" / ("0" * 40)
    shutil.copytree(tiny_ckpt, snap)
    (cache / "models--acme--gpt-oss-tiny" / "refs").mkdir()
    (cache / "models--acme--gpt-oss-tiny" / "refs" / "main").write_text("0" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as hc
    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(cache))
    assert resolve_model("acme/gpt-oss-tiny").resolve() == snap.resolve()
    with pytest.raises(ConfigError, match="no snapshot of the Hugging Face repo 'acme/missing'"):
        resolve_model("acme/missing")


def test_chat_logprobs_streamed_cover_every_token(live, tiny_ckpt):
    # tokens that show nothing (a harmony header's) still have their logprobs streamed, with the next chunk
    _, client = live
    codec = TextCodec.from_dir(tiny_ckpt)
    msgs = [{"role": "user", "content": "hi"}]
    for bias in ({}, {str(codec.token_id("<|channel|>")): 100}):
        kw = dict(model="m", messages=msgs, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2,
                  logit_bias=bias)
        whole = client.chat.completions.create(extra_body=EXTRA, **kw).choices[0]
        assert len(whole.logprobs.content) == len(whole.token_ids) == 6
        streamed = [e for ch in client.chat.completions.create(stream=True, extra_body={"ignore_eos": True}, **kw)
                    if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
        assert [e.token for e in streamed] == [e.token for e in whole.logprobs.content]
        assert all(len(e.top_logprobs) == 2 for e in streamed)


def test_min_tokens_holds_back_stop_strings(live, tiny_ckpt):
    """As in vLLM: no stop string may end in the text of the first `min_tokens` tokens (it may start there);
    whole and streamed answers agree."""
    _, client = live
    codec = TextCodec.from_dir(tiny_ckpt)
    m = 6
    for seed in range(40):                       # a prompt whose text has a character both before and after
        prompt = random_prompt(12, 1024, seed=seed)
        full = _greedy_text(client, prompt, 24)
        bound = len(codec.decode(full.token_ids[:m]))    # the text of the first m tokens
        both = [ch for ch in set(full.text[:bound]) if ch in full.text[bound:]]
        if both:
            break
    else:
        pytest.skip("no prompt with a character on both sides of the min_tokens boundary")
    stop = sorted(both)[0]
    cut = full.text[:full.text.index(stop, bound)]   # the first match that ends past the boundary
    got = _greedy_text(client, prompt, 24, {"min_tokens": m}, stop=[stop])
    assert full.text.index(stop) < bound                    # without min_tokens it would stop earlier
    assert (got.text, got.finish_reason) == (cut, "stop") and len(got.token_ids) > m
    streamed = "".join(ch.choices[0].text for ch in client.completions.create(
        model="m", prompt=prompt, max_tokens=24, temperature=0, stream=True, stop=[stop],
        extra_body={**EXTRA, "min_tokens": m}))
    assert streamed == cut


def test_a_stop_token_is_left_out_of_the_text(live, tiny_ckpt):
    """A sequence ended by one of `stop_token_ids` keeps the token in its ids and logprobs, not in its text
    (vLLM without include_stop_str_in_output); whole and streamed."""
    _, client = live
    codec = TextCodec.from_dir(tiny_ckpt)
    prompt = random_prompt(12, 1024, seed=3)
    full = _greedy_text(client, prompt, 16)
    j = next(i for i in range(3, 16) if full.token_ids[i] not in full.token_ids[:i]
             and full.token_ids[i] not in codec.special_ids and codec.decode([full.token_ids[i]]))
    stop_id = full.token_ids[j]
    r = client.completions.create(model="m", prompt=prompt, max_tokens=16, temperature=0, logprobs=1,
                                  extra_body={**EXTRA, "stop_token_ids": [stop_id]}).choices[0]
    assert r.finish_reason == "stop" and r.token_ids == full.token_ids[:j + 1]
    assert r.text == codec.decode(full.token_ids[:j]) and len(r.logprobs.tokens) == j + 1
    assert r.logprobs.text_offset[-1] == len(r.text)
    chunks = list(client.completions.create(model="m", prompt=prompt, max_tokens=16, temperature=0, stream=True,
                                            extra_body={**EXTRA, "stop_token_ids": [stop_id]}))
    assert "".join(ch.choices[0].text for ch in chunks) == r.text
    assert [t for ch in chunks for t in ch.choices[0].model_extra["token_ids"]] == r.token_ids


def test_streams_send_the_prompt_token_ids_first(live, tiny_ckpt):
    """return_token_ids: the first chunk of each choice carries the prompt's ids (vLLM's place for them)."""
    _, client = live
    prompt = random_prompt(9, 1024, seed=4)
    chunks = list(client.completions.create(model="m", prompt=prompt, max_tokens=4, temperature=0, stream=True,
                                            n=2, extra_body=EXTRA))
    for i in range(2):
        mine = [ch.choices[0].model_extra for ch in chunks if ch.choices and ch.choices[0].index == i]
        assert mine[0]["prompt_token_ids"] == prompt and all("prompt_token_ids" not in c for c in mine[1:])
    chat = list(client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                               stream=True, extra_body=EXTRA))
    want = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                          extra_body=EXTRA).model_extra["prompt_token_ids"]
    assert chat[0].model_extra["prompt_token_ids"] == want and len(want) > 1
    assert all("prompt_token_ids" not in (ch.model_extra or {}) for ch in chat[1:])


def test_a_request_queues_at_most_1024_sequences(live):
    """prompts × n is bounded (a 140 KB body of 20,000 prompts used to queue them all, and went on after its
    client left): past the bound a 400 naming `prompt`, before anything is queued."""
    eng, client = live
    for prompts, n in (([[1, 2]] * 1025, 1), ([[1, 2]] * 65, 16), (["ab"] * 1025, 1)):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="m", prompt=prompts, max_tokens=1, n=n)
        assert e.value.body["param"] == "prompt" and "at most 1024" in e.value.body["message"]
    assert not eng.requests
    r = client.completions.create(model="m", prompt=[[1, 2]] * 64, max_tokens=1, n=16)
    assert len(r.choices) == 1024



def test_continuous_usage_counts_each_chunks_own_choice(live):
    """vLLM's continuous_usage_stats with several choices: each chunk's usage is its own choice's so far (its
    prompt's tokens, the tokens it generated), as vLLM counts it, not the whole request's; the last chunk
    (include_usage) has the whole request's."""
    _, client = live
    prompts = [random_prompt(5, 1024, seed=7), random_prompt(11, 1024, seed=8)]
    chunks = list(client.completions.create(
        model="m", prompt=prompts, max_tokens=4, temperature=0, n=2, stream=True, extra_body=EXTRA,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    made: dict[int, int] = {}
    for ch in chunks[:-1]:
        (c,) = ch.choices
        made[c.index] = made.get(c.index, 0) + len(c.model_extra["token_ids"])
        assert (ch.usage.prompt_tokens, ch.usage.completion_tokens) == (len(prompts[c.index // 2]), made[c.index])
    assert made == {i: 4 for i in range(4)} and chunks[-1].usage.completion_tokens == 16
    assert chunks[-1].usage.prompt_tokens == 16
    messages = [{"role": "user", "content": "hi"}]
    chat = list(client.chat.completions.create(
        model="m", messages=messages, max_tokens=3, n=2, stream=True, extra_body=EXTRA,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    made = {}
    for ch in chat[:-1]:
        (c,) = ch.choices
        made[c.index] = made.get(c.index, 0) + len(c.model_extra.get("token_ids") or [])
        assert ch.usage.completion_tokens == made[c.index]
    assert made == {0: 3, 1: 3} and chat[-1].usage.completion_tokens == 6
