"""Text in and out: the project's own tokenizer files, and the codec the engine uses to read them.

This module owns three things:

* `build_tiny_tokenizer`: a byte-level BPE tokenizer generated offline and deterministically (same
  arguments -> the same `tokenizer.json` bytes) by training `tokenizers`' BpeTrainer on a small English
  corpus embedded below, so common words are single tokens. Real GPT-OSS tokenizers cannot be
  downloaded here; this one has the same shape: the o200k pre-tokenizer regex, byte-level bytes, the
  harmony special tokens (`<|start|>`, `<|message|>`, `<|end|>`, ...) and `<|reserved_N|>` fillers,
  and exactly `vocab_size` ids with the special tokens at the ids the model config names.
* `write_tokenizer_files`: `tokenizer.json` + `tokenizer_config.json` (bos/eos/pad, model_max_length
  and a harmony-like Jinja chat template) next to a checkpoint, loadable by transformers' AutoTokenizer.
* `TextCodec` (encode, decode, chat template) and `StreamDecoder` (token-by-token detokenization that
  never splits a multi-byte UTF-8 character) over any model directory that has a `tokenizer.json`.
* For the trained demo model (tools/train_demo_model.py): `build_harmony_tokenizer` (BPE learned on a
  given corpus, one token per digit, o200k_harmony's special tokens in their o200k order at the top of
  the vocabulary), `harmony_tokenizer_config`, and `HARMONY_CHAT_TEMPLATE`, GPT-OSS' harmony chat format
  as the gpt-oss chat template renders it (system message with `Reasoning: ...`, tools as a TypeScript
  `namespace functions`, tool calls on the commentary channel, tool results from `functions.NAME`).

Prompts given as token ids never need any of this: a model directory without a tokenizer still serves.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Iterable, Mapping, Sequence
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from .chat_template import ChatTemplateError, ChatTemplates  # noqa: F401 (ChatTemplateError re-exported)
from .tokenizer_data import CHAT_TEMPLATE, CORPUS, HARMONY_CHAT_TEMPLATE  # noqa: F401 (re-exported)

if TYPE_CHECKING:
    from .config import GptOssConfig

# tiktoken's o200k_base split pattern (the one GPT-OSS' o200k_harmony encoding uses).
O200K_PATTERN = "|".join([
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n/]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])

# Names of the tokens the config's ids point at: eos_token_ids[i] gets EOS_NAMES[i] (GPT-OSS' own order:
# 200002 <|return|>, 199999 <|endoftext|>, 200012 <|call|>).
PAD_NAME = "<|pad|>"
BOS_NAME = "<|startoftext|>"
EOS_NAMES = ("<|return|>", "<|endoftext|>", "<|call|>")
# Harmony specials reserved when there is room, in this order, unless the config already named them.
HARMONY_EXTRAS = ("<|startoftext|>", "<|endoftext|>", "<|start|>", "<|end|>", "<|message|>",
                  "<|channel|>", "<|return|>", "<|constrain|>", "<|call|>")
# Where o200k_harmony itself puts them: used when the config's ids already agree with it (the real shapes).
HARMONY_IDS = {"<|startoftext|>": 199998, "<|endoftext|>": 199999, "<|return|>": 200002,
               "<|constrain|>": 200003, "<|channel|>": 200005, "<|start|>": 200006, "<|end|>": 200007,
               "<|message|>": 200008, "<|call|>": 200012}

# --- building ---------------------------------------------------------------------------------------


@lru_cache(maxsize=1)
def _byte_chars() -> tuple[str, ...]:
    """GPT-2's byte -> printable character table (what byte-level BPE tokens are spelled in)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    chars: dict[int, str] = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return tuple(chars[b] for b in range(256))


@lru_cache(maxsize=1)
def _char_bytes() -> dict[str, int]:
    return {c: b for b, c in enumerate(_byte_chars())}


def _pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(O200K_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])


def special_tokens(vocab_size: int, eos_id: int | Sequence[int] | None, pad_id: int | None,
                   bos_id: int | None) -> dict[int, str]:
    """The special tokens' ids -> names: the ids given (out-of-range ones dropped), then the harmony
    extras where they fit: at o200k_harmony's own ids when the given ids agree with it (the real GPT-OSS
    shapes), else at the lowest free ids."""
    eos_ids = [eos_id] if isinstance(eos_id, int) else list(eos_id or ())
    table: dict[int, str] = {}
    for i, e in enumerate(eos_ids):
        if 0 <= e < vocab_size and e not in table:
            table[e] = EOS_NAMES[i] if i < len(EOS_NAMES) else f"<|eos_{i}|>"
    for ident, name in ((bos_id, BOS_NAME), (pad_id, PAD_NAME)):
        if ident is not None and 0 <= ident < vocab_size and ident not in table:
            table[ident] = name
    if len(set(table.values())) != len(table):
        raise ValueError(f"special token ids collide: {table}")
    extras = [n for n in HARMONY_EXTRAS if n not in table.values()]
    if vocab_size < 256 + len(table) + len(extras):
        extras = []  # no room: only the ids the config names
    if max(HARMONY_IDS.values()) < vocab_size and all(HARMONY_IDS.get(n) == i for i, n in table.items()):
        table.update((HARMONY_IDS[n], n) for n in extras)
    else:
        free = (i for i in range(vocab_size) if i not in table)
        table.update((next(free), n) for n in extras)
    return dict(sorted(table.items()))


@lru_cache(maxsize=8)
def _trained(n_regular: int) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    """(regular tokens: the 256 bytes in byte order then each merge's result; merges), at most n_regular
    tokens, trained on CORPUS. Deterministic: BpeTrainer breaks count ties by pair id, and the ids come
    from the fixed initial alphabet."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = _pre_tokenizer()
    trainer = trainers.BpeTrainer(vocab_size=max(n_regular, 256), min_frequency=0, show_progress=False,
                                  initial_alphabet=list(_byte_chars()), special_tokens=[])
    tok.train_from_iterator(CORPUS.splitlines(keepends=True), trainer)
    raw = json.loads(tok.to_str())["model"]["merges"]
    merges = tuple((tuple(m) if isinstance(m, list) else tuple(m.split(" ", 1))) for m in raw)
    regular = list(_byte_chars())
    seen = set(regular)
    for a, b in merges:
        if a + b not in seen:
            seen.add(a + b)
            regular.append(a + b)
    return tuple(regular[:n_regular]), merges


def build_tiny_tokenizer(vocab_size: int, eos_id: int | Sequence[int] | None = 2, pad_id: int | None = 0,
                         bos_id: int | None = 1) -> Tokenizer:
    """A byte-level BPE tokenizer of exactly `vocab_size` ids, trained on the built-in corpus.

    Special tokens sit at the ids given (see `special_tokens`); the other ids hold the 256 bytes (in byte
    order), then the learned merges, then `<|reserved_{id}|>` fillers when the corpus runs out of merges
    (past ~1500 ids). The fillers are plain vocabulary entries that no text encodes to, not added special
    tokens: 200k added tokens would make transformers take ~25 s to load the 20b shape's tokenizer (1 s
    this way). Decoding one yields its name. Same arguments -> same `to_str()`."""
    specials = special_tokens(vocab_size, eos_id, pad_id, bos_id)
    n_regular = vocab_size - len(specials)
    if n_regular < 256:
        raise ValueError(f"vocab_size {vocab_size} leaves no room for the 256 byte tokens "
                         f"and {len(specials)} special tokens")
    regular, merges = _trained(n_regular)
    fill = iter(regular)
    vocab: dict[str, int] = {}
    for i in range(vocab_size):
        if i in specials:
            vocab[specials[i]] = i
            continue
        vocab[next(fill, None) or f"<|reserved_{i}|>"] = i
    known = set(vocab)
    merges = [m for m in merges if m[0] + m[1] in known]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = _pre_tokenizer()
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(n, special=True, normalized=False) for n in specials.values()])
    assert tokenizer.get_vocab_size(with_added_tokens=True) == vocab_size
    return tokenizer


def tokenizer_config(cfg: GptOssConfig, chat_template: str = CHAT_TEMPLATE) -> dict[str, Any]:
    """The `tokenizer_config.json` dict for cfg (transformers' PreTrainedTokenizerFast reads it)."""
    specials = special_tokens(cfg.vocab_size, cfg.eos_token_ids, cfg.pad_token_id, cfg.bos_token_id)
    out: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast"}
    bos = specials.get(cfg.bos_token_id) if cfg.bos_token_id is not None else None
    if bos is None and BOS_NAME in specials.values():
        bos = BOS_NAME  # GPT-OSS names <|startoftext|> its bos token without ever adding it
    eos = next((specials[e] for e in cfg.eos_token_ids if e in specials), None)
    pad = specials.get(cfg.pad_token_id) if cfg.pad_token_id is not None else None
    for key, name in (("bos_token", bos), ("eos_token", eos), ("pad_token", pad)):
        if name is not None:
            out[key] = name
    out.update(model_max_length=cfg.max_position_embeddings, clean_up_tokenization_spaces=False,
               model_input_names=["input_ids", "attention_mask"], chat_template=chat_template)
    return out


def write_tokenizer_files(model_dir: str | Path, cfg: GptOssConfig) -> None:
    """Write `tokenizer.json` and `tokenizer_config.json` for cfg into model_dir (deterministic bytes)."""
    model_dir = Path(model_dir)
    tok = build_tiny_tokenizer(cfg.vocab_size, cfg.eos_token_ids, cfg.pad_token_id, cfg.bos_token_id)
    (model_dir / "tokenizer.json").write_text(tok.to_str(pretty=True) + "\n", encoding="utf-8")
    (model_dir / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config(cfg), indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


# --- the demo model's tokenizer: o200k_harmony's special tokens, digits one by one ------------------

# o200k's split pattern with single digits (`\p{N}` instead of `\p{N}{1,3}`): every digit is its own
# pre-token, so "1234" is four tokens "1" "2" "3" "4" and a model can add numbers digit by digit.
DIGIT_PATTERN = O200K_PATTERN.replace(r"\p{N}{1,3}", r"\p{N}")

# o200k_harmony's special tokens from <|startoftext|> (199998) to <|call|> (200012), in id order; None is a
# reserved id there (<|reserved_200000|>, ...). `build_harmony_tokenizer` puts this block at the top of
# its vocabulary in the same order, so the tokens keep their relative positions.
HARMONY_BLOCK = ("<|startoftext|>", "<|endoftext|>", None, None, "<|return|>", "<|constrain|>", None,
                 "<|channel|>", "<|start|>", "<|end|>", "<|message|>", None, None, None, "<|call|>")


_SPECIAL_RE = r"<\|[^|<>]*\|>"


def build_harmony_tokenizer(vocab_size: int, corpus: Iterable[str]) -> Tokenizer:
    """A byte-level BPE tokenizer of exactly `vocab_size` ids for small models that speak harmony.

    ids [0, 256): the bytes in byte order; then the merges BpeTrainer learns on `corpus` (its lines with
    any `<|...|>` special-token strings cut out) under `DIGIT_PATTERN` (single digits), then
    `<|reserved_{id}|>` fillers if the merges run out; the top `len(HARMONY_BLOCK)` ids hold
    o200k_harmony's special tokens in their o200k order (`harmony_special_ids`), its reserved ids named
    `<|reserved_{id}|>`, all added as special tokens. Same arguments -> the same `to_str()`."""
    import re

    n_regular = vocab_size - len(HARMONY_BLOCK)
    if n_regular < 256:
        raise ValueError(f"vocab_size {vocab_size} leaves no room for the 256 byte tokens and "
                         f"{len(HARMONY_BLOCK)} harmony tokens")
    pre = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(DIGIT_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    pieces = [p for line in corpus for p in re.split(_SPECIAL_RE, line) if p]
    trainer_tok = Tokenizer(models.BPE())
    trainer_tok.pre_tokenizer = pre
    trainer = trainers.BpeTrainer(vocab_size=n_regular, min_frequency=2, show_progress=False,
                                  initial_alphabet=list(_byte_chars()), special_tokens=[])
    trainer_tok.train_from_iterator(pieces, trainer)
    raw = json.loads(trainer_tok.to_str())["model"]["merges"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ", 1)) for m in raw]
    regular = list(_byte_chars())
    for a, b in merges:
        if len(regular) >= n_regular:
            break
        if a + b not in regular:
            regular.append(a + b)
    vocab = {tok: i for i, tok in enumerate(regular)}
    for i in range(len(regular), n_regular):
        vocab[f"<|reserved_{i}|>"] = i
    specials = [name or f"<|reserved_{n_regular + k}|>" for k, name in enumerate(HARMONY_BLOCK)]
    vocab.update((name, n_regular + k) for k, name in enumerate(specials))
    merges = [m for m in merges if m[0] + m[1] in vocab and m[0] in vocab and m[1] in vocab]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(n, special=True, normalized=False) for n in specials])
    assert tokenizer.get_vocab_size(with_added_tokens=True) == vocab_size
    return tokenizer


def harmony_special_ids(tokenizer: Tokenizer) -> dict[str, int]:
    """The harmony special tokens' ids in `tokenizer` (name -> id), for those it has."""
    names = [n for n in HARMONY_BLOCK if n]
    return {n: i for n in names if (i := tokenizer.token_to_id(n)) is not None}


def harmony_tokenizer_config(model_max_length: int, chat_template: str = HARMONY_CHAT_TEMPLATE) -> dict[str, Any]:
    """`tokenizer_config.json` for a `build_harmony_tokenizer` tokenizer: GPT-OSS' bos/eos/pad names."""
    return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|startoftext|>",
            "eos_token": "<|return|>", "pad_token": "<|endoftext|>", "model_max_length": model_max_length,
            "clean_up_tokenization_spaces": False, "model_input_names": ["input_ids", "attention_mask"],
            "chat_template": chat_template}


# --- using ------------------------------------------------------------------------------------------


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "".join(part["text"] for part in content)


LONG_TEXT_CHARS = 1 << 14          # from here on, text is encoded without holding the GIL


class TokenizerFileError(ValueError):
    """A tokenizer.json or tokenizer_config.json that cannot be read (the message names the file)."""


class TextCodec:
    """Text <-> token ids for one model directory (its tokenizer.json + tokenizer_config.json)."""

    def __init__(self, tokenizer: Tokenizer, config: Mapping[str, Any] | None = None,
                 chat_template: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.config: dict[str, Any] = dict(config or {})
        # `chat_template` (--chat-template) replaces the checkpoint's template(s); compiled here, so a bad one
        # is an error at start, not at the first chat
        self.templates = (ChatTemplates(chat_template, origin="--chat-template's") if chat_template is not None
                          else ChatTemplates(self.config.get("chat_template")))
        if chat_template is not None:
            self.templates.compiled()
        self.special_ids: frozenset[int] = frozenset(
            i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special)
        self._byte_level = isinstance(tokenizer.decoder, decoders.ByteLevel)

    @property
    def chat_template(self) -> Any:
        """The template source chats render with (a string, named templates, or None: no template)."""
        return self.templates.source

    @classmethod
    def from_dir(cls, model_dir: str | Path, chat_template: str | None = None) -> TextCodec | None:
        """The codec of model_dir, or None when it has no tokenizer.json; `chat_template` (a Jinja source)
        replaces the checkpoint's template(s)."""
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            if chat_template is not None:
                raise TokenizerFileError(f"--chat-template needs the checkpoint's tokenizer ({path} is missing)")
            return None
        cfg_path = model_dir / "tokenizer_config.json"
        try:
            config = json.loads(cfg_path.read_text(encoding="utf-8")) if cfg_path.is_file() else {}
        except (ValueError, OSError) as e:              # JSON and UTF-8 errors are ValueErrors
            raise TokenizerFileError(f"{cfg_path} is not a valid tokenizer_config.json: {e}") from None
        if not isinstance(config, dict):
            raise TokenizerFileError(f"{cfg_path} must hold a JSON object (got a {type(config).__name__})")
        # template files win over tokenizer_config's entry, as in transformers: chat_template.jinja is the default,
        # additional_chat_templates/NAME.jinja the named ones (tool_use: for a request with tools)
        files = {"default": model_dir / "chat_template.jinja"} if (model_dir / "chat_template.jinja").is_file() else {}
        if (model_dir / "additional_chat_templates").is_dir():
            files.update((f.stem, f) for f in sorted((model_dir / "additional_chat_templates").glob("*.jinja")))
        if files:
            texts = {name: f.read_text(encoding="utf-8") for name, f in files.items()}
            config["chat_template"] = texts["default"] if list(texts) == ["default"] else texts
        try:
            tokenizer = Tokenizer.from_file(str(path))
        except Exception as e:  # noqa: BLE001 - the tokenizers library raises plain Exceptions
            raise TokenizerFileError(f"{path} is not a valid tokenizer.json (Hugging Face tokenizers "
                                     f"format): {e}") from None
        return cls(tokenizer, config, chat_template)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def token_id(self, token: str) -> int | None:
        return self.tokenizer.token_to_id(token)

    def token_str(self, token_id: int) -> str | None:
        """The vocabulary's string for an id (byte-level BPE's `Ġ` spellings; transformers'
        convert_ids_to_tokens), None for an id the tokenizer does not have."""
        return self.tokenizer.id_to_token(token_id)

    def _special(self, key: str) -> int | None:
        name = self.config.get(key)
        if isinstance(name, dict):
            name = name.get("content")
        return self.tokenizer.token_to_id(name) if isinstance(name, str) else None

    @property
    def eos_token_id(self) -> int | None:
        return self._special("eos_token")

    @property
    def bos_token_id(self) -> int | None:
        return self._special("bos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._special("pad_token")

    def encode(self, text: str) -> list[int]:
        """Token ids of text; special-token strings in it (e.g. "<|start|>") become their ids. No BOS."""
        if len(text) < LONG_TEXT_CHARS:
            return self.tokenizer.encode(text, add_special_tokens=False).ids
        # the batch call releases the GIL while it works (`encode` holds it: seconds for a long text, during
        # which a server's event loop could not answer anyone); same ids
        return self.tokenizer.encode_batch([text], add_special_tokens=False)[0].ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                    tools: Sequence[Mapping[str, Any]] | None = None, **template_kwargs: Any) -> str:
        """The chat as text: tokenizer_config's Jinja template (rendered like transformers does), or the
        harmony-like `<|start|>{role}<|message|>{content}<|end|>` format when there is none.

        `tools` (OpenAI function-tool dicts) and any other keyword (e.g. `reasoning_effort="low"`) become
        template variables, as in transformers' `apply_chat_template(..., tools=..., **kwargs)`; templates
        that do not use them ignore them, and so does the template-less format."""
        if self.chat_template is None:
            text = "".join(f"<|start|>{m['role']}<|message|>{_text_of(m['content'])}<|end|>" for m in messages)
            return text + ("<|start|>assistant<|message|>" if add_generation_prompt else "")
        names = {k: v.get("content") if isinstance(v, dict) else v
                 for k, v in self.config.items() if k.endswith("_token")}
        return self.templates.render(messages, add_generation_prompt, tools, {**names, **template_kwargs})

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                            tools: Sequence[Mapping[str, Any]] | None = None, **template_kwargs: Any) -> list[int]:
        """Token ids of the rendered chat (the prompt for the assistant's reply); `tools` and the other
        keywords go to the template (see `render_chat`)."""
        return self.encode(self.render_chat(messages, add_generation_prompt, tools=tools, **template_kwargs))

    def token_bytes(self, token_id: int, skip_special_tokens: bool = True) -> bytes | None:
        """The raw bytes token_id stands for in a byte-level vocabulary (b"" for a skipped special token),
        or None when the tokenizer is not byte-level."""
        if not self._byte_level:
            return None
        if token_id in self.special_ids:
            if skip_special_tokens:
                return b""
            return (self.tokenizer.id_to_token(token_id) or "").encode("utf-8")
        tok = self.tokenizer.id_to_token(token_id)
        if tok is None:
            return b""
        table = _char_bytes()
        try:
            return bytes(table[c] for c in tok)
        except KeyError:  # not a byte-level spelling (an added non-special token): its text as is
            return tok.encode("utf-8")


class StreamDecoder:
    """Incremental detokenization: `push(id)` returns the text that id completes (possibly ""), holding
    back bytes until they form whole UTF-8 characters; `flush()` returns what is left at the end. The
    pieces joined equal `codec.decode(ids, skip_special_tokens)` of all the ids pushed."""

    def __init__(self, codec: TextCodec, skip_special_tokens: bool = True) -> None:
        self.codec = codec
        self.skip_special_tokens = skip_special_tokens
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._ids: list[int] = []  # non-byte-level fallback: all ids so far
        self._emitted = 0          # ... and how many characters of their decode went out

    def push(self, token_id: int) -> str:
        raw = self.codec.token_bytes(token_id, self.skip_special_tokens)
        if raw is not None:
            return self._utf8.decode(raw)
        self._ids.append(token_id)
        text = self.codec.decode(self._ids, self.skip_special_tokens)
        if text.endswith("\ufffd"):  # maybe an unfinished character: wait for more
            return ""
        new, self._emitted = text[self._emitted:], len(text)
        return new

    def flush(self) -> str:
        """The held-back remainder (incomplete characters become U+FFFD, as in a full decode)."""
        if self._ids:
            text = self.codec.decode(self._ids, self.skip_special_tokens)
            new, self._emitted = text[self._emitted:], len(text)
            return new
        return self._utf8.decode(b"", final=True)
