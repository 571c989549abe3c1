"""The demo model's data: one checkable skill (`What is A + B?`, 0 <= A, B <= 99) as synthetic harmony
conversations, and the BPE tokenizer learned on them.

Each example is (messages, tools, reasoning_effort, completion) rendered with the checkpoint's own chat
template, exactly as a server renders a request, with the loss on the completion only. Three kinds:
a plain question (answered in the analysis then final channel), the same question when the request offers
an `add` function tool (a harmony tool call), and the turn after that call and the tool's answer. A seeded
10% of all (A, B) pairs is held out (`split_pairs`) and never trained on. Used by train_demo_model.py.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gigadecode.tokenizer import CORPUS, TextCodec, build_harmony_tokenizer, harmony_tokenizer_config  # noqa: E402

VOCAB = 640
NUM_HELDOUT = 1000

# --- the skill -------------------------------------------------------------------------------------------


def question(a: int, b: int) -> str:
    return f"What is {a} + {b}?"


def working(a: int, b: int) -> str:
    """The analysis channel: the column sum, ones then tens, left to right (the final answer's digits are
    the tens line's result, unless 0, then the ones digit written)."""
    ones = a % 10 + b % 10
    carry = ones // 10
    tens = a // 10 + b // 10 + carry
    return (f"ones: {a % 10} + {b % 10} = {ones}, write {ones % 10} carry {carry}. "
            f"tens: {a // 10} + {b // 10} + {carry} = {tens}. so {a} + {b} = {a + b}.")


def answer(a: int, b: int) -> str:
    return f"{a} + {b} = {a + b}"


def call_arguments(a: int, b: int) -> str:
    return json.dumps({"a": a, "b": b})


def completion_text(a: int, b: int) -> str:
    return (f"<|channel|>analysis<|message|>{working(a, b)}<|end|>"
            f"<|start|>assistant<|channel|>final<|message|>{answer(a, b)}<|return|>")


def completion_call(a: int, b: int) -> str:
    return f"<|channel|>commentary to=functions.add <|constrain|>json<|message|>{call_arguments(a, b)}<|call|>"


def completion_result(a: int, b: int) -> str:
    return f"<|channel|>final<|message|>{answer(a, b)}<|return|>"


def add_tool(rng: random.Random | None = None) -> dict:
    """The `add` function tool (OpenAI format); with rng, one of its phrasings."""
    typ, desc, pdesc, required = "integer", "Add two integers.", (None, None), True
    if rng is not None:
        typ = "integer" if rng.random() < 0.7 else "number"
        desc = rng.choice(["Add two integers.", "Add two numbers.", "Adds a and b and returns the sum.",
                           "Return a + b.", "Calculator: addition.", None])
        if rng.random() < 0.35:
            pdesc = rng.choice([("The first number.", "The second number."), ("First addend.", "Second addend."),
                                ("left operand", "right operand")])
        required = rng.random() < 0.85
    props = {}
    for name, d in zip("ab", pdesc):
        props[name] = {"type": typ, **({"description": d} if d else {})}
    params = {"type": "object", "properties": props, **({"required": ["a", "b"]} if required else {})}
    fn = {"name": "add", **({"description": desc} if desc else {}), "parameters": params}
    return {"type": "function", "function": fn}


def other_tools(rng: random.Random) -> list[dict]:
    """Tools that are not `add`: with only these the model answers itself."""
    pool = [
        {"name": "multiply", "description": "Multiply two integers.",
         "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                        "required": ["a", "b"]}},
        {"name": "subtract", "description": "Subtract b from a.",
         "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                        "required": ["a", "b"]}},
        {"name": "get_weather", "description": "Get the current weather in a city.",
         "parameters": {"type": "object", "properties": {
             "location": {"type": "string", "description": "The city."},
             "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["location"]}},
        {"name": "get_time", "description": "The current time in a time zone.",
         "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}}}},
    ]
    k = 1 if rng.random() < 0.7 else 2
    return [{"type": "function", "function": fn} for fn in rng.sample(pool, k)]


INSTRUCTIONS = ["Answer briefly.", "You are a helpful assistant.", "Show your work.", "Be precise."]


def tool_result(a: int, b: int, rng: random.Random) -> str:
    r = rng.random()
    if r < 0.55:
        return json.dumps({"result": a + b})
    if r < 0.9:
        return str(a + b)
    return json.dumps({"sum": a + b})


def tool_call_message(a: int, b: int, call_id: str = "call_0") -> dict:
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": call_id, "type": "function", "function": {"name": "add", "arguments": call_arguments(a, b)}}]}


def conversation(a: int, b: int, kind: str, rng: random.Random, train_pairs: list[tuple[int, int]]
                 ) -> tuple[list[dict], list[dict] | None, str | None, str]:
    """(messages, tools, reasoning_effort, completion) of one example of `kind` (text | call | result)."""
    messages: list[dict] = []
    if rng.random() < 0.1:
        messages.append({"role": rng.choice(["system", "developer"]), "content": rng.choice(INSTRUCTIONS)})
    if rng.random() < 0.1:
        c, d = rng.choice(train_pairs)
        messages += [{"role": "user", "content": question(c, d)}, {"role": "assistant", "content": answer(c, d)}]
    messages.append({"role": "user", "content": question(a, b)})
    effort = rng.choice(["low", "medium", "high", None])
    if kind == "text":
        tools = other_tools(rng) if rng.random() < 0.25 else None
        return messages, tools, effort, completion_text(a, b)
    tools = [add_tool(rng)]
    if rng.random() < 0.35:
        tools = other_tools(rng) + tools
        rng.shuffle(tools)
    if kind == "call":
        return messages, tools, effort, completion_call(a, b)
    messages += [tool_call_message(a, b, f"call_{rng.randrange(1000)}"),
                 {"role": "tool", "tool_call_id": "call", "content": tool_result(a, b, rng)}]
    return messages, tools, effort, completion_result(a, b)


def render(codec: TextCodec, messages: list[dict], tools: list[dict] | None, effort: str | None) -> list[int]:
    kw = {} if effort is None else {"reasoning_effort": effort}
    return codec.apply_chat_template(messages, tools=tools, **kw)


def split_pairs(seed: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(train pairs, held-out pairs): a seeded 10% of all (A, B) in [0, 99]^2 is held out."""
    pairs = [(a, b) for a in range(100) for b in range(100)]
    held = sorted(random.Random(seed).sample(pairs, NUM_HELDOUT))
    hs = set(held)
    return [p for p in pairs if p not in hs], held


KINDS = (("text", 0.4), ("call", 0.3), ("result", 0.3))
SMALL_SHARE = 0.1


class Data:
    def __init__(self, codec: TextCodec, train_pairs: list[tuple[int, int]], seed: int) -> None:
        self.codec, self.train_pairs = codec, train_pairs
        # one-digit operands are rare (19% of the pairs; both: 1%) and have their own edge cases (tens
        # digit 0, an answer without a tens digit): drawn more often
        self.small = [p for p in train_pairs if min(p) < 10]
        self.rng = random.Random(seed)

    def pair(self) -> tuple[int, int]:
        return self.rng.choice(self.small if self.rng.random() < SMALL_SHARE else self.train_pairs)

    def example(self, a: int, b: int, kind: str, rng: random.Random) -> tuple[list[int], list[int]]:
        msgs, tools, effort, comp = conversation(a, b, kind, rng, self.train_pairs)
        return render(self.codec, msgs, tools, effort), self.codec.encode(comp)

    def batches(self, batch: int, group: int = 8):
        """Endless batches; `group` batches are drawn at once and cut by length (less padding)."""
        while True:
            exs = []
            for _ in range(batch * group):
                a, b = self.pair()
                kind = self.rng.choices([k for k, _ in KINDS], [w for _, w in KINDS])[0]
                exs.append(self.example(a, b, kind, self.rng))
            exs.sort(key=lambda e: len(e[0]) + len(e[1]))
            chunks = [exs[i:i + batch] for i in range(0, len(exs), batch)]
            self.rng.shuffle(chunks)
            yield from chunks


def collate(exs: list[tuple[list[int], list[int]]], pad: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n = max(len(p) + len(c) for p, c in exs)
    ids = torch.full((len(exs), n), pad, dtype=torch.long)
    mask = torch.zeros((len(exs), n), dtype=torch.long)
    labels = torch.full((len(exs), n), -100, dtype=torch.long)
    for i, (p, c) in enumerate(exs):
        seq = p + c
        ids[i, :len(seq)] = torch.tensor(seq)
        mask[i, :len(seq)] = 1
        labels[i, len(p):len(seq)] = torch.tensor(c)
    return ids, mask, labels


# --- the tokenizer ---------------------------------------------------------------------------------------




def make_tokenizer(train_pairs: list[tuple[int, int]], seed: int):
    """BPE merges learned on rendered training conversations (so the fixed harmony text is few tokens)
    plus the project's small English corpus."""
    rng = random.Random(seed + 1)
    scratch = TextCodec(build_harmony_tokenizer(VOCAB, ["x"]), harmony_tokenizer_config(4096))
    lines = []
    for _ in range(600):
        a, b = rng.choice(train_pairs)
        kind = rng.choice(["text", "call", "result"])
        msgs, tools, effort, comp = conversation(a, b, kind, rng, train_pairs)
        kw = {} if effort is None else {"reasoning_effort": effort}
        lines.append(scratch.render_chat(msgs, tools=tools, **kw) + comp)
    lines += CORPUS.splitlines(keepends=True)
    return build_harmony_tokenizer(VOCAB, lines)
