"""vLLM's sampling extras: `allowed_token_ids`, `bad_words`, `include_stop_str_in_output`,
`truncate_prompt_tokens` and `skip_special_tokens` (completions).

In the engine (every decoder, with speculative decoding's drafts, with a grammar, next to requests that use
none of them) and through the real server with the official `openai` client. The oracles do not use the code
under test: transformers' logits (teacher-forced, restricted to the allowed set or stripped of the banned
tokens by the rule written out here), the plain output's own tokens and text, and the truncated prompt run
directly. Behind a vLLM prefill the proxy truncates the ids it sends."""

from __future__ import annotations

import random
import re

import httpx
import openai
import pytest
import torch

from gigadecode.connector.params import prompt_digest
from gigadecode.sampling import SamplingError, SamplingParams
from gigadecode.server.proxy import build_proxy_app
from gigadecode.speculative import SpeculativeConfig
from gigadecode.tokenizer import TextCodec

from .helpers import KV_SECRET, hf_logits, random_prompt
from .test_engine import make_engine
from .test_openai_features import _serve
from .test_server import ServerThread, fake_upstream, fake_vllm_prefill
from .test_speculative import OracleProposer

DECODERS = ["gk-native", "gk", "reference"]
VOCAB = 1024


def _kw(decoder: str) -> dict:
    """fp32 compute and KV: transformers' numbers (FP8 KV moves a logit by tenths of a nat on the tiny model)"""
    return dict(decoder=decoder, gk_decode=decoder != "reference", kv_dtype="auto")


def _greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


def banned_by(words: list[list[int]], out: list[int]) -> set[int]:
    """vLLM's bad-words rule, written out: a word's last token is banned after an output ending with the rest."""
    return {w[-1] for w in words if len(w) - 1 <= len(out) and out[len(out) - len(w) + 1:] == w[:-1]}


def assert_masked_argmax(hf, prompt: list[int], out: list[int], keep, clear: float) -> int:
    """Each token of `out` is transformers' argmax (teacher-forced) over the tokens `keep(i)` leaves at step i,
    wherever the top two of those are more than `clear` × max |logit| apart -> how many steps were that clear."""
    ref = hf_logits(hf, prompt + out)[len(prompt) - 1: len(prompt) - 1 + len(out)]
    checked = 0
    for i, row in enumerate(ref):
        mask = torch.zeros(row.shape[0], dtype=torch.bool)
        mask[sorted(keep(i))] = True
        r = row.masked_fill(~mask, -torch.inf)
        top2 = r.topk(2).values
        if top2[0] - top2[1] > clear * row.abs().max():
            assert int(r.argmax()) == out[i], (i, out)
            checked += 1
    return checked


# -- the engine ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("decoder", DECODERS)
def test_allowed_token_ids_in_the_engine(tiny_ckpt, hf_model, decoder):
    """Greedy: transformers' argmax over the allowed set; seeded sampling: only allowed ids; a request beside
    them that sets nothing decodes as it does alone."""
    rng = random.Random(1)
    allowed = sorted(rng.sample(range(3, VOCAB), 40))
    prompts = [random_prompt(n, VOCAB, seed=40 + n) for n in (7, 13, 4)]
    eng = make_engine(tiny_ckpt, **_kw(decoder))
    alone = eng.generate([prompts[2]], _greedy(12))[0].output_ids
    reqs = eng.generate(prompts, [_greedy(14, allowed_token_ids=allowed),
                                  SamplingParams(temperature=1.0, seed=3, max_tokens=14, ignore_eos=True,
                                                 allowed_token_ids=allowed), _greedy(12)])
    assert all(t in allowed for r in reqs[:2] for t in r.output_ids)
    assert not set(alone) <= set(allowed)              # the whitelist changed something
    assert reqs[2].output_ids == alone
    assert assert_masked_argmax(hf_model, prompts[0], reqs[0].output_ids, lambda i: allowed, 1e-3) >= 10


@pytest.mark.parametrize("decoder", DECODERS)
def test_bad_words_in_the_engine(tiny_ckpt, hf_model, decoder):
    """A one-token word never comes out, a two-token word never whole; the output is the plain one until the
    plain one would have said a word, and transformers' argmax without the banned tokens throughout."""
    prompt = random_prompt(11, VOCAB, seed=77)
    eng = make_engine(tiny_ckpt, **_kw(decoder))
    plain = eng.generate([prompt], _greedy(20))[0].output_ids
    one, two = plain[4], plain[8:10]
    words = [[one], two]
    assert one not in two
    out = eng.generate([prompt], _greedy(20, bad_words_token_ids=words))[0].output_ids
    assert one not in out and all(out[i:i + 2] != two for i in range(len(out) - 1))
    first = next(i for i in range(len(plain)) if plain[i] in banned_by(words, plain[:i]))
    assert out[:first] == plain[:first] and out[first] != plain[first]
    n = assert_masked_argmax(hf_model, prompt, out, lambda i: set(range(VOCAB)) - banned_by(words, out[:i]), 1e-3)
    assert n >= 12
    # the two-token word alone: its first token may come out, its second not right after it
    out2 = eng.generate([prompt], _greedy(20, bad_words_token_ids=[two]))[0].output_ids
    assert out2[:9] == plain[:9] and out2[9] != plain[9] and out2[8] == two[0]
    assert assert_masked_argmax(hf_model, prompt, out2, lambda i: set(range(VOCAB)) - banned_by([two], out2[:i]),
                                1e-3) >= 12


@pytest.mark.parametrize("proposer", ["drafts-with-banned-tokens", "ngram", "suffix"])
def test_speculative_drafts_never_pass_the_masks(tiny_ckpt, proposer):
    """Drafts are verified by the same sampler: drafts read from the unconstrained output (so full of banned and
    unlisted tokens), the n-gram lookup and suffix decoding all give the tokens of plain decoding with the masks."""
    prompts = [random_prompt(n, VOCAB, seed=90 + n) for n in (9, 5, 12)]
    rng = random.Random(2)
    allowed = sorted(rng.sample(range(3, VOCAB), 60))
    free = make_engine(tiny_ckpt).generate(prompts, _greedy(24))
    words = [[free[1].output_ids[3]], free[1].output_ids[10:12]]
    params = [_greedy(24, allowed_token_ids=allowed), _greedy(24, bad_words_token_ids=words),
              SamplingParams(temperature=0.8, seed=5, max_tokens=24, ignore_eos=True, allowed_token_ids=allowed,
                             bad_words_token_ids=[[allowed[0]], allowed[1:3]])]
    want = [r.output_ids for r in make_engine(tiny_ckpt).generate(prompts, params)]
    if proposer == "suffix":
        spec = SpeculativeConfig(method="suffix", num_speculative_tokens=4, suffix_decoding_min_token_prob=0.0,
                                 adaptive=False)
    else:
        spec = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1, adaptive=False)
    eng = make_engine(tiny_ckpt, speculative=spec)
    if proposer == "drafts-with-banned-tokens":
        eng.scheduler.proposer = OracleProposer({f"req-{i}": r.output_ids for i, r in enumerate(free)}, 4, 0.0, VOCAB)
    elif proposer == "suffix":            # its cache holds the unconstrained outputs: it drafts them
        eng.generate(prompts, _greedy(24))
    got = eng.generate(prompts, params)
    assert [r.output_ids for r in got] == want
    assert eng.stats.spec_draft_tokens > 0


def test_masks_with_a_grammar_and_a_request_they_leave_nothing(tiny_ckpt):
    """allowed_token_ids and bad words narrow a grammar further; a request whose masks and grammar leave no
    token fails alone (a 400-free engine error), the batch goes on."""
    codec = TextCodec.from_dir(tiny_ckpt)
    letters = {c: codec.encode(c) for c in "abcdefghijklmnopqrstuvwxyz"}
    assert all(len(v) == 1 for v in letters.values())
    first_half = [letters[c][0] for c in "abcdefghijklm"]
    eng = make_engine(tiny_ckpt)
    regex = ("regex", "[a-z]{3,8}", "all")
    prompt = random_prompt(6, VOCAB, seed=8)
    free = eng.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, guided=regex))[0].output_ids
    banned = [[free[0]], [free[1]]]
    reqs = eng.generate([prompt] * 4, [
        SamplingParams(temperature=0.0, max_tokens=12, guided=regex, allowed_token_ids=first_half + [2]),
        SamplingParams(temperature=0.0, max_tokens=12, guided=regex, bad_words_token_ids=banned),
        SamplingParams(temperature=0.0, max_tokens=12, guided=regex, allowed_token_ids=first_half),  # no EOS: dead end
        _greedy(6)])
    a, b, dead, other = reqs
    assert a.finish_reason == "stop" and re.fullmatch("[a-m]{3,8}", codec.decode(a.output_ids[:-1]))
    assert b.finish_reason == "stop" and re.fullmatch("[a-z]{3,8}", codec.decode(b.output_ids[:-1]))
    assert free[0] not in b.output_ids and free[1] not in b.output_ids
    assert dead.finish_reason == "error" and "no token is left" in dead.error
    assert re.fullmatch("[a-m]{3,8}", codec.decode(dead.output_ids))     # it ran to the grammar's end first
    assert other.finish_reason == "length" and len(other.output_ids) == 6


BAD_PARAMS = [
    (dict(allowed_token_ids=[]), "allowed_token_ids"), (dict(allowed_token_ids=["1"]), "allowed_token_ids"),
    (dict(allowed_token_ids=[True]), "allowed_token_ids"), (dict(allowed_token_ids=[-1]), "allowed_token_ids"),
    (dict(allowed_token_ids="12"), "allowed_token_ids"), (dict(bad_words_token_ids=[[]]), "bad_words_token_ids"),
    (dict(bad_words_token_ids=[[1.5]]), "bad_words_token_ids"), (dict(bad_words_token_ids=[5]), "bad_words_token_ids"),
    (dict(allowed_token_ids=[5, 6], bad_words_token_ids=[[6], [5], [7, 5]]), "bad_words"),   # nothing left, ever
]


def test_bad_values_are_refused_and_the_engine_serves_on(tiny_ckpt):
    for kw, param in BAD_PARAMS:
        with pytest.raises(SamplingError) as e:
            SamplingParams(**kw)
        assert e.value.param == param, kw
    eng = make_engine(tiny_ckpt)
    prompt = random_prompt(5, VOCAB, seed=1)
    for kw, param in ((dict(allowed_token_ids=[3, VOCAB]), "allowed_token_ids"),
                      (dict(bad_words_token_ids=[[4, VOCAB + 7]]), "bad_words")):
        with pytest.raises(SamplingError) as e:
            eng.add_request(prompt, _greedy(3, **kw))
        assert e.value.param == param
    assert SamplingParams.from_dict({"allowed_token_ids": [9, 4, 9]}).allowed_token_ids == (4, 9)
    SamplingParams(allowed_token_ids=[5, 6], bad_words_token_ids=[[6], [7, 5]])   # 5 stays: not refused
    assert len(eng.generate([prompt], _greedy(3))[0].output_ids) == 3


# -- the server --------------------------------------------------------------------------------------------------
EXTRA = {"ignore_eos": True, "return_token_ids": True}


@pytest.fixture(scope="module")
def live(tiny_ckpt):
    eng, srv = _serve(tiny_ckpt, ["--dtype", "float32", "--kv-dtype", "auto"])     # transformers' numbers
    with srv:
        yield TextCodec.from_dir(tiny_ckpt), openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0,
                                                           timeout=60)


def _complete(client, prompt, n=16, **extra):
    return client.completions.create(model="m", prompt=prompt, max_tokens=n, temperature=0,
                                     extra_body={**EXTRA, **extra}).choices[0]


def _streamed(client, prompt, n=16, **extra) -> tuple[str, list[int], str | None]:
    text, ids, reason = "", [], None
    for ch in client.completions.create(model="m", prompt=prompt, max_tokens=n, temperature=0, stream=True,
                                        extra_body={**EXTRA, **extra}):
        c = ch.choices[0]
        text += c.text
        ids += c.model_extra.get("token_ids") or []
        reason = c.finish_reason or reason
    return text, ids, reason


def test_allowed_token_ids_through_the_server(live, hf_model):
    codec, client = live
    prompt = random_prompt(9, VOCAB, seed=21)
    allowed = sorted(random.Random(4).sample(range(3, VOCAB), 30))
    c = _complete(client, prompt, allowed_token_ids=allowed)
    assert set(c.token_ids) <= set(allowed) and not set(_complete(client, prompt).token_ids) <= set(allowed)
    assert assert_masked_argmax(hf_model, prompt, c.token_ids, lambda i: allowed, 1e-3) >= 10
    text, ids, _ = _streamed(client, prompt, allowed_token_ids=allowed)
    assert (text, ids) == (c.text, c.token_ids)
    r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=10,
                                       temperature=0, extra_body={**EXTRA, "allowed_token_ids": allowed})
    assert r.choices[0].model_extra["token_ids"] and set(r.choices[0].model_extra["token_ids"]) <= set(allowed)


def _word(codec, ids: list[int]) -> str | None:
    """The text of `ids` when vLLM's tokenization of it as a bad word (as is, or with one leading space) is them."""
    s = codec.decode(ids).lstrip()
    return s if s and ids in (codec.encode(s), codec.encode(" " + s)) else None


def test_bad_words_through_the_server(live):
    codec, client = live
    prompt = random_prompt(10, VOCAB, seed=33)
    plain = _complete(client, prompt, n=24).token_ids
    one = next(plain[i:i + 1] for i in range(2, len(plain)) if _word(codec, plain[i:i + 1]))
    two = next(plain[i:i + 2] for i in range(2, len(plain) - 1) if _word(codec, plain[i:i + 2])
               and not set(plain[i:i + 2]) & set(one))
    words = [_word(codec, one), _word(codec, two)]
    c = _complete(client, prompt, n=24, bad_words=words)
    out = c.token_ids
    assert one[0] not in out and all(out[i:i + 2] != two for i in range(len(out) - 1))
    assert out != plain and len(out) == 24
    assert _streamed(client, prompt, n=24, bad_words=words)[1] == out
    r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=12,
                                       temperature=0, extra_body={**EXTRA, "bad_words": words})
    assert r.choices[0].finish_reason in ("length", "stop")
    # a word inside text: its token carries the space before it, which vLLM's second spelling (" " + word) is
    spaced = next(t for t in range(3, VOCAB) if codec.decode([t]).startswith(" ") and codec.decode([t]).strip()
                  and codec.encode(codec.decode([t]).lstrip()) != [t] and codec.encode(codec.decode([t])) == [t])
    bias = {str(spaced): 100}
    assert _complete(client, prompt, n=6, logit_bias=bias).token_ids == [spaced] * 6
    out = _complete(client, prompt, n=6, logit_bias=bias, bad_words=[codec.decode([spaced]).strip()]).token_ids
    assert spaced not in out and len(out) == 6


def test_include_stop_str_in_output(live):
    codec, client = live
    prompt = random_prompt(12, VOCAB, seed=5)
    full = _complete(client, prompt, n=24)
    text = full.text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    assert text.index(stop) > 0
    upto = text[:text.index(stop) + len(stop)]
    c = _complete(client, prompt, n=24, stop=[stop, "zzzz-never"], include_stop_str_in_output=True)
    assert (c.text, c.finish_reason) == (upto, "stop")
    assert _complete(client, prompt, n=24, stop=stop).text == text[:text.index(stop)]        # without: cut
    assert _streamed(client, prompt, 24, stop=stop, include_stop_str_in_output=True)[::2] == (upto, "stop")
    # a stop token id: its text is kept too (vLLM renders the token that stopped it)
    t = full.token_ids[6]
    k = full.token_ids.index(t)
    kept = _complete(client, prompt, n=24, stop_token_ids=[t], ignore_eos=False, include_stop_str_in_output=True)
    assert kept.text == codec.decode(full.token_ids[:k + 1]) and kept.token_ids == full.token_ids[:k + 1]
    assert _complete(client, prompt, n=24, stop_token_ids=[t]).text == codec.decode(full.token_ids[:k])
    msg = [{"role": "user", "content": "hi"}]
    plain = client.chat.completions.create(model="m", messages=msg, max_tokens=16, temperature=0, extra_body=EXTRA)
    content = plain.choices[0].message.content
    if content and len(content) > 4:
        s = content[2:4]
        r = client.chat.completions.create(model="m", messages=msg, max_tokens=16, temperature=0, stop=s,
                                           extra_body={**EXTRA, "include_stop_str_in_output": True})
        assert r.choices[0].message.content == content[:content.index(s) + 2]


def test_truncate_prompt_tokens(live):
    _, client = live
    prompt = random_prompt(20, VOCAB, seed=9)
    c = client.completions.create(model="m", prompt=prompt, max_tokens=8, temperature=0,
                                  extra_body={**EXTRA, "truncate_prompt_tokens": 7})
    direct = _complete(client, prompt[-7:], n=8)
    assert c.choices[0].token_ids == direct.token_ids and c.usage.prompt_tokens == 7
    assert c.choices[0].model_extra["prompt_token_ids"] == prompt[-7:]
    assert _complete(client, prompt, n=8).token_ids != direct.token_ids        # the cut changed the answer
    whole = _complete(client, prompt, n=8).token_ids
    assert _complete(client, prompt, n=8, truncate_prompt_tokens=-1).token_ids == whole      # -1: the context
    msg = [{"role": "user", "content": "hello there"}]
    chat = client.chat.completions.create(model="m", messages=msg, max_tokens=6, temperature=0, extra_body=EXTRA)
    cut = client.chat.completions.create(model="m", messages=msg, max_tokens=6, temperature=0,
                                         extra_body={**EXTRA, "truncate_prompt_tokens": 5})
    ids = chat.model_extra["prompt_token_ids"][-5:]
    assert cut.model_extra["prompt_token_ids"] == ids and cut.usage.prompt_tokens == 5
    assert cut.choices[0].model_extra["token_ids"] == _complete(client, ids, n=6).token_ids


def test_skip_special_tokens_false_on_completions(live):
    codec, client = live
    special = sorted(t for t in codec.special_ids if t != 2)[3]
    prompt = random_prompt(6, VOCAB, seed=2)
    bias = {str(special): 100}                                     # a special token every time
    c = _complete(client, prompt, n=4, logit_bias=bias, skip_special_tokens=False)
    assert c.token_ids == [special] * 4
    assert c.text == codec.decode(c.token_ids, skip_special_tokens=False) != codec.decode(c.token_ids)
    assert _complete(client, prompt, n=4, logit_bias=bias).text == codec.decode(c.token_ids)
    echoed = client.completions.create(model="m", prompt=[special, *prompt], max_tokens=1, echo=True,
                                       extra_body={"skip_special_tokens": False})
    assert echoed.choices[0].text.startswith(codec.decode([special], skip_special_tokens=False))


BAD_BODIES = [({"allowed_token_ids": []}, "allowed_token_ids"), ({"allowed_token_ids": [VOCAB]}, "allowed_token_ids"),
              ({"allowed_token_ids": ["5"]}, "allowed_token_ids.0"), ({"allowed_token_ids": 5}, "allowed_token_ids"),
              ({"bad_words": [7]}, "bad_words.0"), ({"bad_words": "x"}, "bad_words"),
              ({"bad_words": [" "]}, "bad_words"),
              ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
              ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
              ({"truncate_prompt_tokens": 10**6}, "truncate_prompt_tokens"),
              ({"truncate_prompt_tokens": 1.5}, "truncate_prompt_tokens"),
              ({"include_stop_str_in_output": 1}, "include_stop_str_in_output")]


def test_masks_that_leave_no_token_mid_way_are_the_requests_400(live):
    """allowed_token_ids without EOS under a grammar that must end: the request runs to the grammar's end, then
    nothing is left. The client's own doing: a 400 `no_token_left` (it was a 500), an invalid_request_error event
    in a stream; the next request is served."""
    codec, client = live
    first_half = [codec.encode(c)[0] for c in "abcdefghijklm"]
    body = {"guided_regex": "[a-z]{3,8}", "allowed_token_ids": first_half}
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="m", prompt="x", max_tokens=12, temperature=0, extra_body=body)
    assert e.value.body["code"] == "no_token_left" and "exclude every token" in e.value.body["message"]
    with pytest.raises(openai.APIError) as e:
        for _ in client.completions.create(model="m", prompt="x", max_tokens=12, temperature=0, stream=True,
                                           extra_body=body):
            pass
    assert e.value.body["type"] == "invalid_request_error" and e.value.body["code"] == "no_token_left"
    assert len(_complete(client, [5, 6, 7], n=3).token_ids) == 3


@pytest.mark.parametrize("chat", [False, True])
def test_bad_values_are_a_400_naming_the_field(live, chat):
    codec, client = live
    a = codec.encode("a")
    assert len(a) == 1
    nothing_left = ({"allowed_token_ids": a, "bad_words": ["a"]}, "bad_words")    # the whitelist, all bad words
    for body, param in BAD_BODIES + [nothing_left] + (
            [({"skip_special_tokens": False}, "skip_special_tokens")] if chat else
            [({"skip_special_tokens": "no"}, "skip_special_tokens")]):
        with pytest.raises(openai.BadRequestError) as e:
            if chat:
                client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                               extra_body=body)
            else:
                client.completions.create(model="m", prompt="hi", max_tokens=2, extra_body=body)
        assert e.value.body["param"] == param, body
    assert len(_complete(client, [5, 6, 7], n=3).token_ids) == 3           # served on


def test_the_proxy_truncates_what_it_sends_a_vllm_prefill():
    """Behind a vLLM prefill the proxy sends the prompt's ids itself: with truncate_prompt_tokens it sends the
    last N (less the last one) and binds the params to those N, which the decode server keeps too."""
    vllm, seen = fake_vllm_prefill()
    dec_app, dec = fake_upstream("dec", "decode")
    ids = list(range(10, 30))
    with ServerThread(vllm) as v, ServerThread(dec_app) as d:
        proxy = build_proxy_app([], [d.url], prefill_vllm=[v.url], kv_secret=KV_SECRET)
        with ServerThread(proxy) as px:
            r = httpx.post(px.url + "/v1/completions", json={"model": "m", "prompt": ids, "max_tokens": 2,
                                                              "truncate_prompt_tokens": 6}, timeout=20)
    assert r.status_code == 200, r.text
    assert seen[0]["prompt"] == ids[-6:-1]
    body = dec["bodies"][0][1]
    assert body["prompt"] == ids[-6:] and body["kv_transfer_params"]["prompt_digest"] == prompt_digest(ids[-6:])
