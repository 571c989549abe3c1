"""The hard token masks of a sampling step: vLLM's `allowed_token_ids` and `bad_words`, and a grammar's mask.

`SamplingParams` carries the first two as token ids (`check_allowed`, `check_bad_words` normalize them); the
server turns vLLM's `bad_words` strings into id sequences (`server/extras.py`). `constrain` applies them to a
batch's working logits inside `Sampler.sample`, after logit_bias, min_tokens and the penalties:

- allowed_token_ids: every other token's logit is -inf (vLLM's whitelist).
- bad words, vLLM's rule: a word's last token is forbidden whenever the request's *output* so far (the prompt
  does not count) ends with the word's other tokens; a one-token word is always forbidden. A forbidden token
  is never sampled, so speculative decoding (whose drafts are accepted only when the sampler draws them
  again, with the accepted tokens in the output) never accepts one either.
- a structured-output grammar's mask (`structured.py`): the tokens it allows next.

They are hard: when they and min_tokens' masking leave nothing, min_tokens gives way (the row is masked from
the raw logits instead; the grammar already won over min_tokens this way). When they alone leave nothing (an
allowed set that the bad words or the grammar exclude entirely), the request cannot go on: its row is
reported (`SampleResult.failed`) and the engine fails that request alone.

A request that uses none of them costs one attribute test per step; nothing here builds a tensor for it.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import torch

#: Most token id sequences one request's bad words may come to (after both spellings are tokenized).
MAX_BAD_WORDS = 1024

#: Why a request whose own masks leave no token failed: its client's doing, so the server answers 400.
MASKS_EXCLUDE_ALL = ("no token is left to sample: allowed_token_ids, bad_words and the structured-output grammar "
                     "together exclude every token")


def _ids(value: Any, what: str) -> tuple[int, ...]:
    """A list of token ids (ints, not bools) >= 0, or ValueError saying what is wrong."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ValueError(f"must be a list of token ids (got {type(value).__name__} {value!r})")
    for t in value:
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise ValueError(f"{what} must be integers (got {type(t).__name__} {t!r})")
        if t < 0:
            raise ValueError(f"{what} must be >= 0 (got {t})")
    return tuple(int(t) for t in value)


def check_allowed(value: Any) -> tuple[int, ...] | None:
    """`allowed_token_ids` -> its distinct ids, sorted (None: no whitelist). ValueError when it is not a
    non-empty list of ids (vLLM refuses an empty list too: it would allow nothing)."""
    if value is None:
        return None
    ids = _ids(value, "token ids")
    if not ids:
        raise ValueError("must not be empty (leave it out to allow every token)")
    return tuple(sorted(set(ids)))


def check_bad_words(value: Any) -> tuple[tuple[int, ...], ...]:
    """`bad_words_token_ids` -> a tuple of non-empty id tuples. ValueError when it is anything else."""
    if value is None:
        return ()
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ValueError(f"must be a list of token id lists (got {type(value).__name__})")
    words = tuple(_ids(w, "token ids") for w in value)
    if any(not w for w in words):
        raise ValueError("a bad word must have at least one token")
    if len(words) > MAX_BAD_WORDS:
        raise ValueError(f"at most {MAX_BAD_WORDS} token sequences (got {len(words)})")
    return words


def out_of_vocab(allowed: tuple[int, ...] | None, bad_words: tuple[tuple[int, ...], ...],
                 vocab_size: int) -> tuple[str, list[int]] | None:
    """The first of ("allowed_token_ids", ids) / ("bad_words", ids) naming ids >= vocab_size, or None."""
    bad = [t for t in allowed or () if t >= vocab_size]
    if bad:
        return "allowed_token_ids", bad
    bad = sorted({t for w in bad_words for t in w if t >= vocab_size})
    return ("bad_words", bad) if bad else None


def forbids_every_allowed(allowed: tuple[int, ...] | None, bad_words: tuple[tuple[int, ...], ...]) -> bool:
    """Whether one-token bad words forbid every id of the whitelist: such a request could never sample a token."""
    return allowed is not None and set(allowed) <= {w[0] for w in bad_words if len(w) == 1}


def banned_now(bad_words: tuple[tuple[int, ...], ...], output_ids: Sequence[int]) -> list[int]:
    """The tokens bad words forbid after `output_ids` (vLLM's rule: each word whose tokens but the last end
    the output, or that has one token, forbids its last token)."""
    n = len(output_ids)
    out = []
    for w in bad_words:
        k = len(w) - 1
        if k == 0:
            out.append(w[0])
        elif k <= n and all(output_ids[n - k + j] == w[j] for j in range(k)):
            out.append(w[-1])
    return out


@lru_cache(maxsize=256)
def _allowed_mask(ids: tuple[int, ...], vocab_size: int) -> torch.Tensor:
    """[V] bool, True at `ids` (cached: a request's whitelist is the same every step; never written to)."""
    m = torch.zeros(vocab_size, dtype=torch.bool)
    m[list(ids)] = True
    return m


def constrain(x: torch.Tensor, raw: torch.Tensor, params: Sequence[Any], output_ids: Sequence[Sequence[int]],
              grammar: Sequence[torch.Tensor | None] | None) -> dict[int, str]:
    """Mask rows of the working logits x [B, V] (float32, already biased and penalized) in place to the tokens
    the hard constraints leave (module docstring); `raw` [B, V]: the model's logits, `grammar`: per row None
    or a [V] bool mask of the tokens a grammar allows. -> {row: why} for rows left with no token at all: those
    rows are set to zeros (finite even where the raw row holds NaN) so the batch samples normally, and their
    token must be discarded."""
    rows = [i for i, p in enumerate(params)
            if p.allowed_token_ids is not None or p.bad_words_token_ids or (grammar and grammar[i] is not None)]
    dead: dict[int, str] = {}
    v = x.shape[1]
    for i in rows:
        p = params[i]
        keep = grammar[i].to(x.device) if grammar and grammar[i] is not None else None
        if p.allowed_token_ids is not None:
            m = _allowed_mask(p.allowed_token_ids, v).to(x.device)
            keep = m if keep is None else keep & m
        if p.bad_words_token_ids:
            banned = banned_now(p.bad_words_token_ids, output_ids[i])
            if banned:
                keep = torch.ones(v, dtype=torch.bool, device=x.device) if keep is None else keep.clone()
                keep[banned] = False                     # a fresh tensor: never the cached or the grammar's mask
        if keep is None:                                 # bad words that forbid nothing at this step
            continue
        row = x[i].masked_fill(~keep, -math.inf)
        if not bool(torch.isfinite(row).any()):          # min_tokens masked the only tokens left: it gives way
            row = raw[i].float().masked_fill(~keep, -math.inf)
        if not bool(torch.isfinite(row).any()):
            dead[i] = MASKS_EXCLUDE_ALL
            row = torch.zeros_like(row)
        x[i] = row
    return dead
