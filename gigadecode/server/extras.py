"""vLLM's request extras on /v1/completions and /v1/chat/completions, from the body to the engine.

- `allowed_token_ids` (token ids) and `bad_words` (strings) become `SamplingParams.allowed_token_ids` and
  `bad_words_token_ids`, which the engine's sampler enforces (`token_masks.py`); `token_constraints`
  tokenizes each bad word as vLLM does (`bad_word_sequences`).
- `truncate_prompt_tokens`: `truncate` keeps each prompt's last N tokens (-1: the model's context length;
  more than the context length is refused, as in vLLM). For chat, the rendered conversation is truncated.
- `include_stop_str_in_output`: the route passes it to `outputs.start` (the stop string stays in the text).
- `skip_special_tokens` (completions only; chat's harmony parsing needs them skipped): special tokens' text.

The body models (protocol.py) check the fields' types; the values are checked here and by SamplingParams, each
a 400 that names its field, before anything reaches the engine.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..sampling import SamplingError, truncate_prompt
from ..token_masks import MAX_BAD_WORDS
from .protocol import APIError


def bad_word_sequences(words: list[str], codec: Any) -> list[tuple[int, ...]]:
    """vLLM's tokenization of `bad_words`: each word (leading whitespace stripped) as it is, and with one
    leading space when that spells it differently in as many tokens (a word inside text rather than at its
    start, for BPE vocabularies that fold the space into the word's first token)."""
    if codec is None:
        raise APIError(400, "bad_words: this model has no tokenizer (use logit_bias with token ids)", param="bad_words")
    seqs: list[tuple[int, ...]] = []
    for word in words:
        plain = tuple(codec.encode(word.lstrip()))
        if not plain:
            raise APIError(400, f"bad_words: {word!r} has no token to forbid", param="bad_words")
        seqs.append(plain)
        spaced = tuple(codec.encode(" " + word.lstrip()))
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            seqs.append(spaced)
        if len(seqs) > MAX_BAD_WORDS:
            raise APIError(400, f"bad_words: at most {MAX_BAD_WORDS} token sequences after tokenization",
                           param="bad_words")
    return seqs


def token_constraints(raw: Mapping[str, Any], codec: Any) -> dict[str, Any]:
    """The body's allowed_token_ids and bad_words as SamplingParams fields (nothing for what it leaves unset).
    Ranges (ids inside the vocabulary, a non-empty allowed list) are SamplingParams' and the engine's checks."""
    out: dict[str, Any] = {}
    if raw.get("allowed_token_ids") is not None:
        out["allowed_token_ids"] = raw["allowed_token_ids"]
    if raw.get("bad_words"):
        out["bad_words_token_ids"] = bad_word_sequences(raw["bad_words"], codec)
    return out


def truncate(prompts: list[list[int]], raw: Mapping[str, Any], max_model_len: int) -> list[list[int]]:
    """`truncate_prompt_tokens`: each prompt's last N tokens (`sampling.truncate_prompt`); unset: as they are."""
    try:
        return [truncate_prompt(p, raw.get("truncate_prompt_tokens"), max_model_len) for p in prompts]
    except SamplingError as e:
        raise APIError(400, str(e), param=e.param) from None
