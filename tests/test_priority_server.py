"""Priority scheduling through the server (the official `openai` client, `extra_body={"priority": ...}`): a
server under --scheduling-policy priority serves queued requests by priority with the outputs they have
alone; under fcfs (the default) a non-zero priority is a 400 naming the field, as is a priority that is not
an integer under either policy. The DI proxy gives the field to both servers (a vLLM prefill too)."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

from gigadecode.server.proxy import build_proxy_app

from .helpers import KV_SECRET, random_prompt
from .test_openai_features import EXTRA, _serve
from .test_server import ServerThread, fake_upstream, fake_vllm_prefill


@pytest.fixture(scope="module")
def prio(tiny_ckpt):
    eng, srv = _serve(tiny_ckpt, ["--scheduling-policy", "priority", "--max-num-seqs", "1"])
    with srv:
        yield eng, openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)


def test_queued_requests_are_served_by_priority(prio):
    """One sequence at a time: a long request holds the seat while three more queue (priorities 2, 0, 1,
    two on chat); once it is cancelled they finish in priority order, each with its output alone."""
    eng, client = prio
    prompts = [random_prompt(8, 1024, seed=70 + i) for i in range(3)]
    alone = [client.completions.create(model="m", prompt=p, max_tokens=12, temperature=0,
                                       extra_body=EXTRA).choices[0].token_ids for p in prompts]
    chat_alone = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=12, temperature=0, extra_body=EXTRA)
    blocker = client.completions.create(model="m", prompt=[5, 6, 7], max_tokens=1400, temperature=0, stream=True,
                                        extra_body={**EXTRA, "priority": -100})
    next(iter(blocker))                                     # it runs: every other request waits
    done: list[str] = []
    got: dict[str, object] = {}

    def completion(i: int, priority: int) -> None:
        r = client.completions.create(model="m", prompt=prompts[i], max_tokens=12, temperature=0,
                                      extra_body={**EXTRA, "priority": priority})
        got[f"c{i}"] = r.choices[0].token_ids
        done.append(f"c{i}")

    def chat(priority: int) -> None:
        r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=12,
                                           temperature=0, extra_body={**EXTRA, "priority": priority})
        got["chat"] = r.choices[0].message.content
        done.append("chat")

    threads = [threading.Thread(target=f, args=a) for f, a in
               ((completion, (0, 2)), (chat, (0,)), (completion, (1, 3)), (completion, (2, 1)))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while len(eng.waiting) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(eng.waiting) == 4 and not done
    blocker.close()                                         # the client leaves: the blocker is aborted
    for t in threads:
        t.join(60)
    assert done == ["chat", "c2", "c0", "c1"]
    assert [got[f"c{i}"] for i in range(3)] == alone and got["chat"] == chat_alone.choices[0].message.content


@pytest.mark.parametrize("chat", [False, True])
def test_bad_priority_is_a_400(prio, chat):
    _, client = prio

    def call(**body):
        if chat:
            return client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                                  max_tokens=2, extra_body=body)
        return client.completions.create(model="m", prompt="x", max_tokens=2, extra_body=body)
    for bad in (True, 1.5, "1", [1], {"p": 1}):
        with pytest.raises(openai.BadRequestError, match="priority must be an integer") as e:
            call(priority=bad)
        assert e.value.body["param"] == "priority"
    call(priority=None)
    call(priority=-7)


def test_fcfs_refuses_a_priority(tiny_ckpt):
    eng, srv = _serve(tiny_ckpt)
    with srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)
        for create, kw in ((client.completions.create, {"prompt": "x"}),
                           (client.chat.completions.create, {"messages": [{"role": "user", "content": "hi"}]}),
                           (client.responses.create, {"input": "hi"})):
            with pytest.raises(openai.BadRequestError, match="priority scheduling is not enabled") as e:
                create(model="m", extra_body={"priority": 1}, **kw)
            assert e.value.body["param"] == "priority"
            create(model="m", extra_body={"priority": 0}, **kw)
        assert not eng.has_unfinished()


def test_the_proxy_gives_priority_to_both_servers():
    pre_app, pre = fake_upstream("pre", "prefill")
    dec_app, dec = fake_upstream("dec", "decode")
    body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 5, "temperature": 0, "priority": 4}
    with ServerThread(pre_app) as p, ServerThread(dec_app) as d:
        with ServerThread(build_proxy_app([p.url], [d.url])) as px:
            r = httpx.post(px.url + "/v1/completions", json=body, timeout=20)
    assert r.status_code == 200, r.text
    assert pre["bodies"][0][1]["priority"] == 4 and dec["bodies"][0][1]["priority"] == 4
    vllm, seen = fake_vllm_prefill()                        # a vLLM prefill: the proxy writes its body
    dec_app, dec = fake_upstream("dec", "decode")
    with ServerThread(vllm) as v, ServerThread(dec_app) as d:
        with ServerThread(build_proxy_app([], [d.url], prefill_vllm=[v.url], kv_secret=KV_SECRET)) as px:
            r = httpx.post(px.url + "/v1/completions", json=body, timeout=20)
    assert r.status_code == 200, r.text
    assert seen[0]["priority"] == 4 and dec["bodies"][0][1]["priority"] == 4
