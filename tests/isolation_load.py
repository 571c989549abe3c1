"""A concurrent mixed load whose every answer is checked against the same request run alone.

`make_requests` draws a mix of greedy and seeded completions and chats over prompts that share prefixes, with
logprobs, stop strings, min_tokens, allowed_token_ids / bad_words, guided JSON, penalties, logit_bias, n > 1,
several prompts, echo and prompt logprobs, priorities, streamed or not. `record` runs each one alone, one after
another (the references: with 20 top logprobs, not streamed); `load` sends them all again from many `openai`
async clients at once, mixed with noise (malformed bodies that must get a 4xx, clients that leave mid-stream or
before the first byte); `compare` checks every answer against its reference: the same token ids, finish reason,
text and usage, and logprobs within a tolerance. Greedy streams may part only where the reference's top two
logprobs are a near tie (a batch rounds its last bits differently from a request alone: README), the other
token taken; a seeded request must give its very tokens.
"""

from __future__ import annotations

import asyncio
import copy
import json
import random
from typing import Any

import httpx
import openai

from .helpers import NEAR_TIE_NATS

VOCAB = 1024                 # the tiny preset's
WORDS = "the quick brown fox jumps over lazy dog alpha beta gamma delta decode prefill kernel cache block".split()
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}, "required": ["a"]}
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}]


def make_requests(seed: int, count: int, model: str, priority: bool, di: bool) -> list[dict[str, Any]]:
    """`count` requests {kind: "cmpl" | "chat", body, stream, seeded}. `di`: only what the DI proxy serves (one
    prompt a request, no prompt logprobs); `priority`: some carry a `priority`."""
    rng = random.Random(seed)
    heads = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (0, 5, 16, 17, 33, 48)]
    texts = ["You are a helpful assistant. " * 2, " ".join(rng.choice(WORDS) for _ in range(25))]

    def ids() -> list[int]:
        p = rng.choice(heads) + [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 30))]
        return (p[:8] * 8)[:rng.randint(9, 60)] if rng.random() < 0.2 else p    # repetitive: n-gram drafts hit

    def words(lo: int, hi: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))

    out = []
    for _ in range(count):
        chat, seeded, stream = rng.random() < 0.3, rng.random() < 0.3, rng.random() < 0.5
        b: dict[str, Any] = {"model": model, "max_tokens": rng.randint(1, 30), "return_token_ids": True}
        b.update({"temperature": rng.choice([0.7, 1.0, 1.5]), "seed": rng.randrange(2**31)} if seeded
                 else {"temperature": 0.0})
        for key, p, value in (("top_p", 0.1 * seeded, 0.9), ("top_k", 0.1 * seeded, 20), ("ignore_eos", 0.5, True),
                              ("n", 0.15, rng.randint(2, 3)), ("stop", 0.15, [rng.choice(["e", " t", "a", "\n", "er"])]),
                              ("include_stop_str_in_output", 0.05, True), ("stop_token_ids", 0.1, rng.sample(range(3, VOCAB), 20)),
                              ("min_tokens", 0.15, rng.randint(0, b["max_tokens"])), ("guided_json", 0.08, SCHEMA),
                              ("allowed_token_ids", 0.1, sorted(rng.sample(range(3, VOCAB), 30))),
                              ("bad_words", 0.1, rng.sample(WORDS, 3)), ("repetition_penalty", 0.1, 1.3),
                              ("frequency_penalty", 0.1, 0.5), ("logit_bias", 0.1, {str(rng.randrange(3, VOCAB)): 5}),
                              ("priority", 0.5 * priority, rng.randint(-3, 3))):
            if rng.random() < p:
                b[key] = value
        if stream and rng.random() < 0.4:
            b["stream_options"] = {"include_usage": True}
        if chat:
            b["messages"] = ([{"role": "system", "content": rng.choice(texts)}] if rng.random() < 0.6 else []) + [
                {"role": "user", "content": words(1, 10)}]
            if rng.random() < 0.4:
                b.update(logprobs=True, top_logprobs=rng.randint(0, 5))
            if rng.random() < 0.1 and "guided_json" not in b:
                b.update(tools=TOOLS, tool_choice=rng.choice(["auto", "required"]))
        else:
            b["prompt"] = ids() if rng.random() < 0.7 else rng.choice(["", *texts]) + words(1, 12)
            if not di and rng.random() < 0.08:
                b["prompt"] = [ids() for _ in range(rng.randint(2, 3))]
            if rng.random() < 0.4:
                b["logprobs"] = rng.randint(0, 5)
            if not di and rng.random() < 0.1:            # the prompt's logprobs: computed where it is answered
                b.update({"echo": True} if rng.random() < 0.5 else {"prompt_logprobs": 2})
        out.append({"kind": "chat" if chat else "cmpl", "body": b, "stream": stream, "seeded": seeded})
    return out


# --------------------------------------------------------------------------------------------------
# One request -> {choice index: {ids, lps, tops, finish, text, plp}, -1: {usage}} or {"error": ...}
# --------------------------------------------------------------------------------------------------
def _cmpl_logprobs(lp: dict | None) -> tuple[list, list]:
    return (list(lp["token_logprobs"]), list(lp["top_logprobs"])) if lp else ([], [])


def _chat_logprobs(lp: dict | None) -> tuple[list, list]:
    entries = (lp or {}).get("content") or []
    return ([e["logprob"] for e in entries],
            [{t["token"]: t["logprob"] for t in e.get("top_logprobs") or []} | {e["token"]: e["logprob"]}
             for e in entries])


async def run(client: openai.AsyncOpenAI, req: dict[str, Any], reference: bool = False) -> dict:
    """Send one request (a reference: not streamed, 20 top logprobs) and gather its answer by choice."""
    body = copy.deepcopy(req["body"])
    stream = req["stream"] and not reference
    if reference:
        body.pop("stream_options", None)
        body.update({"logprobs": 20} if req["kind"] == "cmpl" else {"logprobs": True, "top_logprobs": 20})
    kw = {k: body.pop(k) for k in ("model", "prompt", "messages") if k in body}
    api = client.completions if req["kind"] == "cmpl" else client.chat.completions
    lps_of = _cmpl_logprobs if req["kind"] == "cmpl" else _chat_logprobs
    got: dict[int, dict] = {}
    try:
        answer = await api.create(stream=stream, extra_body=body, **kw)
        chunks = [c.model_dump() async for c in answer] if stream else [answer.model_dump()]
    except openai.APIStatusError as e:
        return {"error": f"{e.status_code} {e.message}"}
    except openai.APIError as e:                     # an error event inside a stream
        return {"error": f"{type(e).__name__} {e}"}
    for chunk in chunks:
        if chunk.get("usage"):
            got[-1] = {"usage": chunk["usage"]}
        for c in chunk["choices"]:
            d = got.setdefault(c["index"], {"ids": [], "lps": [], "tops": [], "finish": None, "text": "", "plp": None})
            d["ids"] += c.get("token_ids") or []
            d["text"] += c.get("text") or (c.get("delta") or c.get("message") or {}).get("content") or ""
            lps, tops = lps_of(c.get("logprobs"))
            d["lps"] += lps
            d["tops"] += tops
            d["finish"] = c.get("finish_reason") or d["finish"]
            d["plp"] = c.get("prompt_logprobs") or chunk.get("prompt_logprobs") or d["plp"]
    return got


async def record(url: str, reqs: list[dict]) -> list[dict]:
    """The references: each request alone, one after another."""
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120) as client:
        return [await run(client, r, reference=True) for r in reqs]


# --------------------------------------------------------------------------------------------------
# The load
# --------------------------------------------------------------------------------------------------
def _malformed(rng: random.Random, model: str) -> tuple[str, bytes]:
    cases = [("/v1/completions", {"prompt": [1, 2, 3], "max_tokens": "8"}),
             ("/v1/completions", {"prompt": [1, 2, 3], "top_p": 5}),
             ("/v1/completions", {"prompt": [1, 2, VOCAB + 5]}),
             ("/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 100000}),
             ("/v1/completions", {"prompt": [rng.randrange(3, VOCAB) for _ in range(300)]}),
             ("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 400}]}),
             ("/v1/completions", {"prompt": [1, 2, 3], "guided_json": {"type": "no-such-type"}}),
             ("/v1/completions", {"prompt": [1, 2, 3], "allowed_token_ids": []}),
             ("/v1/chat/completions", {"messages": "hi"}),
             ("/v1/completions", {"prompt": [1, 2, 3], "priority": 1.5})]
    path, body = rng.choice(cases)
    return path, json.dumps({"model": model, **body}).encode() if rng.random() < 0.9 else b'{"prompt": [1, '


async def _noise(http: httpx.AsyncClient, client: openai.AsyncOpenAI, rng: random.Random, model: str,
                 problems: list[str]) -> None:
    r = rng.random()
    if r < 0.4:                                     # malformed: a 4xx
        path, content = _malformed(rng, model)
        resp = await http.post(path, content=content, headers={"content-type": "application/json"})
        if not 400 <= resp.status_code < 500:
            problems.append(f"malformed {content[:120]!r} -> {resp.status_code} {resp.text[:200]}")
    elif r < 0.75:                                  # leaves mid-stream
        stream = await client.completions.create(
            model=model, prompt=[rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 60))], max_tokens=60,
            stream=True, temperature=rng.choice([0.0, 1.0]), n=rng.choice([1, 2]), extra_body={"ignore_eos": True})
        k, leave = 0, rng.randint(1, 4)
        async for _ in stream:
            k += 1
            if k >= leave:
                break
        await stream.close()
    else:                                           # leaves before the first byte
        body = {"model": model, "prompt": [rng.randrange(3, VOCAB) for _ in range(rng.randint(20, 90))],
                "max_tokens": 30, "stream": rng.random() < 0.5}
        task = asyncio.create_task(http.post("/v1/completions", json=body))
        await asyncio.sleep(rng.uniform(0.0, 0.3))
        task.cancel()
        try:
            await task
        except (asyncio.CancelledError, httpx.HTTPError):
            pass


async def load(url: str, reqs: list[dict], clients: int, noise: int, seed: int, model: str
               ) -> tuple[list[dict], list[str]]:
    """Every request again, `clients` at a time, shuffled with `noise` noise jobs -> (answers, problems)."""
    rng = random.Random(seed)
    jobs = list(range(len(reqs))) + [-1] * noise
    rng.shuffle(jobs)
    answers: list[dict] = [{} for _ in reqs]
    problems: list[str] = []
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120) as client, \
            httpx.AsyncClient(base_url=url, timeout=120) as http:
        async def worker(w: int) -> None:
            wrng = random.Random(seed * 1000 + w)
            while jobs:
                j = jobs.pop()
                if j < 0:
                    await _noise(http, client, wrng, model, problems)
                else:
                    answers[j] = await run(client, reqs[j])
        await asyncio.gather(*(worker(w) for w in range(clients)))
    return answers, problems


# --------------------------------------------------------------------------------------------------
# The check
# --------------------------------------------------------------------------------------------------
def _prompt_logprobs(plp: list | None) -> list[dict[int, float] | None]:
    return [None if e is None else {int(t): v["logprob"] for t, v in e.items()} for e in plp or []]


def compare(req: dict, got: dict, want: dict, token_text, lp_tol: float, near_tie: float = NEAR_TIE_NATS
            ) -> list[str]:
    """Problems of one answer against its reference (none: equal as far as rounding allows)."""
    if "error" in got or "error" in want:
        return [] if "error" in got and "error" in want else [f"answer {got.get('error', 'ok')}, alone "
                                                              f"{want.get('error', 'ok')}"]
    got, want = dict(got), dict(want)
    usage, want_usage = got.pop(-1, {}).get("usage"), want.pop(-1, {}).get("usage")
    if sorted(got) != sorted(want):
        return [f"choices {sorted(got)}, alone {sorted(want)}"]
    problems = []
    if usage is not None and usage["completion_tokens"] != sum(len(c["ids"]) for c in got.values()):
        problems.append(f"usage {usage} for {sum(len(c['ids']) for c in got.values())} tokens")
    if usage is not None and want_usage is not None and usage["prompt_tokens"] != want_usage["prompt_tokens"]:
        problems.append(f"prompt_tokens {usage['prompt_tokens']}, alone {want_usage['prompt_tokens']}")
    for i, (g, w) in enumerate((got[k], want[k]) for k in sorted(got)):
        gp, wp = _prompt_logprobs(g["plp"]), _prompt_logprobs(w["plp"])
        if len(gp) != len(wp) or any((a is None) != (b is None) or a is not None
                                     and any(abs(a[t] - b[t]) > lp_tol for t in set(a) & set(b))
                                     for a, b in zip(gp, wp)):
            problems.append(f"choice {i}: prompt logprobs {gp}, alone {wp}")
        part = next((k for k, (a, b) in enumerate(zip(g["ids"], w["ids"])) if a != b), None)
        shift = len(w["lps"]) - len(w["ids"]) if req["body"].get("echo") else 0   # echo: the prompt's come first
        if part is None and len(g["ids"]) != len(w["ids"]):
            problems.append(f"choice {i}: {g['ids']} ({g['finish']}), alone {w['ids']} ({w['finish']})")
            continue
        if part is not None:
            top = w["tops"][shift + part]
            theirs, ours = token_text(w["ids"][part]), token_text(g["ids"][part])
            if req["seeded"] or ours not in top or theirs == ours or top[theirs] - top[ours] >= near_tie:
                problems.append(f"choice {i}: {g['ids']} parts at {part} from {w['ids']} alone "
                                f"(reference's top logprobs there {top})")
                continue
        elif (g["finish"], g["text"]) != (w["finish"], w["text"]):
            problems.append(f"choice {i}: {g['finish']} {g['text']!r}, alone {w['finish']} {w['text']!r}")
        if g["lps"] and len(g["lps"]) != len(g["ids"]) + shift:
            problems.append(f"choice {i}: {len(g['lps'])} logprobs for {len(g['ids'])} tokens")
        end = shift + (len(g["ids"]) if part is None else part)
        if any((a is None) != (b is None) or a is not None and abs(a - b) > lp_tol
               for a, b in zip(g["lps"][:end], w["lps"][:end])):
            problems.append(f"choice {i}: logprobs {g['lps'][:end]}, alone {w['lps'][:end]}")
    return problems
