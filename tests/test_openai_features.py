"""OpenAI request features beyond plain sampling, through the real app in-process (uvicorn in a thread) and
the official `openai` client: `stop` strings (matched across token boundaries, cut from the text, whole
and streamed), `n` > 1, `logit_bias`, generation_config.json (its eos ids stop generation, its sampling
defaults fill unset fields), unsupported fields refused by name, and `--model` by Hugging Face repo id."""

from __future__ import annotations

import json
import shutil

import openai
import pytest

from gigadecode.cli import build_parser
from gigadecode.server.api import build_app, engine_from_args
from gigadecode.server.async_engine import AsyncEngine
from gigadecode.tokenizer import TextCodec

from .helpers import random_prompt
from .test_server import ServerThread

FLAGS = ["--num-blocks", "128", "--block-size", "16", "--kv-dtype", "fp8", "--max-num-seqs", "16"]
EXTRA = {"ignore_eos": True, "return_token_ids": True}


def _serve(model_dir):
    args = build_parser().parse_args(["serve", "--model", str(model_dir), *FLAGS])
    eng = engine_from_args(args, "both")
    return eng, ServerThread(build_app(AsyncEngine(eng, codec=TextCodec.from_dir(model_dir),
                                                   model_dir=str(model_dir)), "m"))


@pytest.fixture(scope="module")
def live(tiny_ckpt):
    eng, srv = _serve(tiny_ckpt)
    with srv:
        yield eng, openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)


def _greedy_text(client, prompt, n_tokens, **kw):
    r = client.completions.create(model="m", prompt=prompt, max_tokens=n_tokens, temperature=0, extra_body=EXTRA,
                                  **kw)
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


def test_unsupported_fields_are_refused_by_name(live):
    _, client = live
    msgs = [{"role": "user", "content": "hi"}]
    for kw, field in (({"response_format": {"type": "json_object"}}, "response_format"),
                      ({"tool_choice": "required", "tools": [{"type": "function", "function": {"name": "f"}}]},
                       "tool_choice")):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="m", messages=msgs, max_tokens=2, **kw)
        assert e.value.body["param"] == field
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="m", prompt="x", max_tokens=2, n=0)
    assert e.value.body["param"] == "n"


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
