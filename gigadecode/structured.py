"""Structured output: a request's tokens held to a JSON schema, a regex, a list of choices or a Lark grammar.

`SamplingParams.guided` = (kind, source, scope): kind "json" (source: a JSON schema), "json_object" (any JSON
object), "regex", "choice" (source: a JSON list of strings) or "grammar" (Lark, or GBNF); scope "all" (every generated
token, as /v1/completions) or "final" (only the body of a harmony `final` message: a GPT-OSS chat reply reasons
on the analysis channel freely, then answers in the format). llguidance (a Rust library, no other dependency)
compiles the grammar against the checkpoint's tokenizer.json and gives, each step, the tokens that keep the
text inside it; `Guide.allowed` turns that into a mask the sampler applies before it draws (greedy included),
and `Guide.accept` moves the grammar on by the token drawn.

The end of the structured part is the engine's: when the grammar is satisfied (or can take nothing more) the
request's end tokens are allowed (scope "all": the EOS ids; "final": `<|return|>`), and the grammar never
sees them; once one is drawn only they may follow (min_tokens or ignore_eos can run a request on past it).
A grammar that breaks down mid-way (llguidance's parser gives up, or no token fits) fails the request
(`Guide.error`): it never ends "stop" with text outside the grammar. A grammar that cannot be compiled is the request's error (RequestError, param "guided").

An object schema that lists its `properties` (or `patternProperties`) and does not say `additionalProperties`
takes no other keys (`closed_objects`), as vLLM's default backend, xgrammar, compiles schemas (its strict mode:
properties the schema does not name are not generated; vLLM's `disable_additional_properties` does the same
for llguidance) and as OpenAI's strict structured outputs require (`additionalProperties: false` on every
object). JSON Schema's own default would let the model add any key (the demo model answered `{"sum": 45,
"b": 733}` to a schema naming `sum` alone). A schema that sets `additionalProperties` (or
`unevaluatedProperties`) keeps it, and the parts of an `allOf` stay open (each closed would exclude the others'
keys). The same holds for a forced call's arguments (a tool's `parameters`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from .harmony import parse_header
from .request import RequestError

# JSON laid out as json.dumps does (", " and ": ", no other whitespace): free whitespace lets a model pad
# forever (a schema's own "x-guidance" options still apply over these)
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# how a request's error starts when its grammar broke down mid-way (the client's grammar: a 400, not a 500)
GRAMMAR_FAILED = "structured output: "
# compiled grammars kept (on the engine thread, where every running request waits for a compile): a request's
# check and admission, its n sequences and later requests with the same grammar compile it once
COMPILED_CACHE = 64


# where a JSON schema holds subschemas: one schema, a list of them, or a map of name -> schema
_SUBSCHEMA = ("additionalProperties", "unevaluatedProperties", "items", "additionalItems", "unevaluatedItems",
              "contains", "propertyNames", "not", "if", "then", "else")
_SUBSCHEMAS = ("prefixItems", "anyOf", "oneOf", "allOf")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def closed_objects(schema: Any, open_here: bool = False) -> Any:
    """A copy of `schema` in which every object schema with `properties` or `patternProperties` and no
    `additionalProperties` / `unevaluatedProperties` has `additionalProperties: false` (see the module's doc);
    `open_here`: leave this schema itself as it is (a part of an `allOf`), its subschemas not."""
    if isinstance(schema, list):                     # `items` as a list (draft 4-7 tuples)
        return [closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for k in _SUBSCHEMA:
        if k in out:
            out[k] = closed_objects(out[k])
    for k in _SUBSCHEMAS:
        if isinstance(out.get(k), list):
            out[k] = [closed_objects(s, open_here=k == "allOf") for s in out[k]]
    for k in _SUBSCHEMA_MAPS:
        if isinstance(out.get(k), dict):
            out[k] = {name: closed_objects(s) for name, s in out[k].items()}
    if (not open_here and ("properties" in out or "patternProperties" in out)
            and "additionalProperties" not in out and "unevaluatedProperties" not in out):
        out["additionalProperties"] = False
    return out


class GuideFactory:
    """One engine's grammar compiler: the tokenizer (built on first use) and the end tokens."""

    def __init__(self, model_dir: str | Path, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self.model_dir, self.vocab_size, self.eos = Path(model_dir), vocab_size, tuple(eos_token_ids)
        self._tok: Any = None
        self._special: dict[str, int] = {}
        self._compiled: dict[tuple[str, str], Any] = {}    # (kind, source) -> a fresh matcher, least recent first

    def _tokenizer(self) -> Any:
        if self._tok is None:
            import llguidance
            path = self.model_dir / "tokenizer.json"
            if not path.is_file():
                raise RequestError("structured output needs the checkpoint's tokenizer.json", param="guided")
            text = path.read_text()
            spec = json.loads(text)
            added = spec.get("added_tokens", [])
            # the tokenizer may name ids past the model's vocab (added tokens beyond the embedding): llguidance
            # needs them all; `Guide.allowed` cuts its mask to the model's vocab
            vocab = spec.get("model", {}).get("vocab") or ()
            ids = vocab.values() if isinstance(vocab, dict) else range(len(vocab))    # BPE {piece: id}; unigram
            n = max([self.vocab_size, *(i + 1 for i in ids if isinstance(i, int)), *(t["id"] + 1 for t in added)])
            self._tok = llguidance.LLTokenizer(text, n_vocab=n)
            self._special = {t["content"]: t["id"] for t in added if t.get("special")}
        return self._tok

    def make(self, guided: tuple[str, str, str]) -> Guide:
        kind, source, scope = guided
        tok = self._tokenizer()
        key = (kind, source)
        proto = self._compiled.pop(key, None)
        if proto is None:
            proto = self._compile(kind, source)
        self._compiled[key] = proto                        # most recently used last
        while len(self._compiled) > COMPILED_CACHE:
            self._compiled.pop(next(iter(self._compiled)))
        matcher = proto.deep_copy()                        # this request's own state; the compiled grammar shared
        if scope == "final":
            names = ("<|channel|>", "<|message|>", "<|constrain|>", "<|return|>")
            ids = [self._special.get(n) for n in names]
            if None in ids:
                raise RequestError("structured output in chat needs harmony's special tokens", param="guided")
            return Guide(matcher, tok, self.vocab_size, ends=(ids[3],), gate=(ids[0], ids[1], ids[2]))
        return Guide(matcher, tok, self.vocab_size, ends=self.eos)

    def _compile(self, kind: str, source: str) -> Any:
        """(kind, source) -> a fresh llguidance matcher (RequestError if it does not compile)."""
        import llguidance
        tok = self._tokenizer()
        try:
            if kind in ("json", "json_object"):
                schema = json.dumps(closed_objects(json.loads(source))) if kind == "json" else {"type": "object"}
                grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)
            elif kind == "regex":
                grammar = llguidance.LLMatcher.grammar_from_regex(source)
            elif kind == "choice":
                choices = json.loads(source)
                grammar = llguidance.LLMatcher.grammar_from_lark(
                    "start: " + " | ".join(json.dumps(c) for c in choices))
            else:                                          # Lark, or GBNF (vLLM's `::=` rules) converted
                from llguidance.gbnf_to_lark import any_to_lark
                grammar = llguidance.LLMatcher.grammar_from_lark(any_to_lark(source))
            matcher = llguidance.LLMatcher(tok, grammar)
        except Exception as e:  # noqa: BLE001 - the client's grammar: its error is the request's
            raise RequestError(f"structured output ({kind}): {e}", param="guided") from None
        if matcher.is_error():
            raise RequestError(f"structured output ({kind}): {matcher.get_error()}", param="guided")
        return matcher


class Guide:
    """One request's grammar state. `gate` (scope "final": the ids of <|channel|>, <|message|> and
    <|constrain|>): the grammar applies from the body of a message whose channel header reads `final` on."""

    def __init__(self, matcher: Any, tok: Any, vocab_size: int, ends: tuple[int, ...],
                 gate: tuple[int, int, int] | None = None) -> None:
        self.matcher, self.tok, self.vocab_size, self.ends = matcher, tok, vocab_size, tuple(ends)
        self.gate = gate
        self.active = gate is None
        self._header: list[int] | None = None          # ids from <|channel|> on, until <|message|>
        self._done = False                              # the structured part ended (an end token was drawn)
        self.error: str | None = None                   # the grammar broke down: the request fails (engine)
        # the end tokens inside the model's vocab, and the tokenizer's own EOS ids that are not ours (held out)
        self._ends = [t for t in self.ends if 0 <= t < vocab_size]
        self._own_eos = [t for t in set(getattr(tok, "eos_tokens", ()) or ()) - set(self.ends) if t < vocab_size]

    def allowed(self) -> torch.Tensor | None:
        """[V] bool: the tokens that keep the output inside the grammar (the end tokens once it is satisfied,
        and only they after one was drawn: min_tokens or ignore_eos may run on past it), or None where nothing
        is constrained (before a harmony final message)."""
        if not self.active:
            return None
        m = self.matcher
        mask = torch.zeros(self.vocab_size, dtype=torch.bool)
        if not self._done and not m.is_stopped():
            words = torch.frombuffer(bytearray(m.compute_bitmask()), dtype=torch.int32)      # [ceil(V/32)]
            bits = ((words[:, None] >> torch.arange(32, dtype=torch.int32)) & 1).flatten().bool()
            n = min(self.vocab_size, bits.numel())
            mask[:n] = bits[:n]
            mask[self._own_eos] = False                    # the tokenizer's own EOS: ours are `ends`
        if self._done or m.is_stopped() or m.is_accepting():
            mask[self._ends] = True
        if m.is_error() or not bool(mask.any()):           # the grammar broke down, or nothing fits: the
            first = (m.get_error() or "").split("\n")[0]     # request's error (the row draws an end meanwhile)
            self.error = f"{GRAMMAR_FAILED}{first or 'the grammar allows no token here'}"
            mask[:] = False
            mask[self._ends] = True
            if not bool(mask.any()):                       # no end token at all: any token (the row is failed)
                mask[:] = True
        return mask

    def accept(self, token: int) -> None:
        """The token drawn: the grammar moves on (or, before a final message, the gate watches headers)."""
        if self._done:
            return
        if self.active:
            if token in self.ends:
                self._done = True
            else:
                self.matcher.consume_token(token)
            return
        channel, message, constrain = self.gate            # type: ignore[misc]
        if token == channel:
            self._header = [token]
        elif self._header is not None:
            if token == message:                           # the header read as the harmony parser reads it
                name, recipient = parse_header(self._header, self.tok.decode_str, channel, constrain)
                self._header = None
                self.active = name == "final" and not (recipient or "").startswith("functions.")   # not a call
            else:
                self._header.append(token)


def forced_call_grammar(tools: list[dict[str, Any]], name: str | None = None) -> str:
    """A Lark grammar (llguidance's: harmony's special tokens by name) for a GPT-OSS reply that must call a
    function tool: optionally an analysis message first, then `<|channel|>commentary to=functions.NAME
    <|constrain|>json<|message|>ARGS<|call|>` with ARGS held to that tool's parameter schema; `name`: that tool
    only (OpenAI's named tool_choice), else any of `tools` ("required"). `tools` in chat's form."""
    fns = [t["function"] for t in tools if t.get("type") == "function"]
    if name is not None:
        fns = [f for f in fns if f.get("name") == name]
    if not fns:
        raise ValueError(f"tool_choice names {name!r}, which is not among the request's tools" if name
                         else "tool_choice requires a call, but the request offers no function tools")
    rules = ["start: analysis? call",
             'analysis: <|channel|> "analysis" <|message|> /(.|\\n)*/ <|end|> <|start|> "assistant"',
             "call: " + " | ".join(f"call_{i}" for i in range(len(fns)))]
    for i, f in enumerate(fns):
        schema = closed_objects(dict(f.get("parameters") or {"type": "object"}))
        schema["x-guidance"] = JSON_LAYOUT
        head = json.dumps(f"commentary to=functions.{f['name']} ")
        rules.append(f'call_{i}: <|channel|> {head} <|constrain|> "json" <|message|> args_{i} <|call|>')
        rules.append(f"args_{i}: %json {json.dumps(schema)}")
    return "\n".join(rules)
