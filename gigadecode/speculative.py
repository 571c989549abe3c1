"""Speculative decoding by n-gram lookup: draft tokens from the request's own history, verified in one step.

`--speculative-config '{"method": "ngram", "num_speculative_tokens": 3}'` (vLLM's flag and fields). Each
decode step, a request whose last `n` tokens (`prompt_lookup_max` down to `prompt_lookup_min`) occurred
before in its prompt or output gets the tokens that followed that occurrence (the latest one, longest `n`
first) as drafts. The step runs the request's last token and its drafts as consecutive rows of the decode
batch — the GK program writes every row's KV before any row attends, so row j sees the rows before it
exactly as if they had been decoded one by one — and gets one row of logits per token.

Verification samples the rows in order with the request's own sampler, exactly as plain decoding would
(penalties, grammar, min_tokens and the seeded generator see each accepted token before the next row is
sampled), and stops at the first sampled token that differs from its draft. With one fixed draft per
position this *is* speculative sampling's rule (accept a draft with the probability the model gives it;
on rejection draw from the rest), so every output has the distribution of plain decoding — and greedy and
seeded requests produce the very same tokens, only up to `k + 1` of them a step. The rejected drafts' KV is
simply not counted as computed: the next step writes those positions again before anyone reads them.

What it costs: a verify step of `1 + k` rows reads the weights once, but its rows route to more experts
(on `small`, 4 rows take ~1.9× a 1-row step), so it pays where the output repeats its context (code edits,
quoting, extraction, JSON over given fields); `disable_by_batch_size` stops drafting when the batch is
already big enough to be bound by compute.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .config import ConfigError

__all__ = ["SpeculativeConfig", "NgramProposer"]

MAX_SPECULATIVE_TOKENS = 16
METHOD_ERROR = ("--speculative-config: method {!r} is not available here; this engine drafts by n-gram lookup "
                "(\"method\": \"ngram\") or suffix decoding (\"suffix\")")


NGRAM_FIELDS = ("prompt_lookup_min", "prompt_lookup_max")
SUFFIX_FIELDS = ("suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests",
                 "suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob")


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `speculative_config` for its model-free methods: `ngram` (this module) and `suffix`
    (`suffix_decoding.py`), with vLLM's fields and defaults."""

    num_speculative_tokens: int
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    disable_by_batch_size: int | None = None    # no drafts while this many requests (or more) decode
    adaptive: bool = True                       # per request, as many drafts as its acceptance pays for
    method: str = "ngram"
    suffix_decoding_max_tree_depth: int = 24            # the longest pattern + drafts matched
    suffix_decoding_max_cached_requests: int = 10000    # finished requests whose outputs are kept (0: none)
    suffix_decoding_max_spec_factor: float = 1.0        # drafts <= factor x the matched pattern's length
    suffix_decoding_min_token_prob: float = 0.1         # drafting stops below this estimated probability

    def __post_init__(self) -> None:
        if not isinstance(self.method, str) or self.method not in ("ngram", "suffix"):
            raise ConfigError(METHOD_ERROR.format(self.method))
        if not isinstance(self.adaptive, bool):
            raise ConfigError(f"--speculative-config: adaptive must be true or false (got {self.adaptive!r})")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "disable_by_batch_size",
                     "suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests"):
            v = getattr(self, name)
            if v is None and name == "disable_by_batch_size":
                continue
            least = 0 if name == "suffix_decoding_max_cached_requests" else 1
            if not isinstance(v, int) or isinstance(v, bool) or v < least:
                raise ConfigError(f"--speculative-config: {name} must be an integer >= {least} (got {v!r})")
        for name, lo, hi in (("suffix_decoding_max_spec_factor", 0.0, math.inf),
                             ("suffix_decoding_min_token_prob", 0.0, 1.0)):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not lo <= v <= hi:
                raise ConfigError(f"--speculative-config: {name} must be a number in [{lo}, {hi}] (got {v!r})")
        if self.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
            raise ConfigError(f"--speculative-config: num_speculative_tokens must be <= {MAX_SPECULATIVE_TOKENS} "
                              f"(got {self.num_speculative_tokens})")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ConfigError(f"--speculative-config: prompt_lookup_min {self.prompt_lookup_min} is larger than "
                              f"prompt_lookup_max {self.prompt_lookup_max}")

    @classmethod
    def parse(cls, raw: str | dict | None) -> SpeculativeConfig | None:
        """The flag's JSON (or a dict) -> the config; None or "" -> None (no speculation). ConfigError names
        what is wrong. As in vLLM, a lone prompt_lookup_min or prompt_lookup_max sets both, and suffix
        decoding's num_speculative_tokens defaults to its tree depth (here at most 16)."""
        if raw is None or raw == "" or raw == {}:
            return None
        if isinstance(raw, str):
            try:
                raw = json.loads(raw)
            except json.JSONDecodeError as e:
                raise ConfigError(f"--speculative-config is not valid JSON: {e}") from None
        if not isinstance(raw, dict):
            raise ConfigError("--speculative-config must be a JSON object, e.g. "
                              "'{\"method\": \"ngram\", \"num_speculative_tokens\": 3}'")
        d: dict[str, Any] = dict(raw)
        known = {"method", "num_speculative_tokens", "disable_by_batch_size", "adaptive", *NGRAM_FIELDS,
                 *SUFFIX_FIELDS}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"--speculative-config: unknown field(s) {unknown}; this engine reads {sorted(known)}")
        method = d.get("method")
        if method is None:
            raise ConfigError("--speculative-config needs \"method\": \"ngram\" or \"suffix\"")
        if not isinstance(method, str) or method not in ("ngram", "suffix"):
            raise ConfigError(METHOD_ERROR.format(method))    # before the fields, which depend on it
        other = SUFFIX_FIELDS if method == "ngram" else NGRAM_FIELDS
        stray = sorted(k for k in other if d.get(k) is not None)
        if stray:
            raise ConfigError(f"--speculative-config: {stray} do not apply to method {method!r}")
        if d.get("num_speculative_tokens") is None:
            if method != "suffix":
                raise ConfigError("--speculative-config needs num_speculative_tokens (the drafts per step)")
            depth = d.get("suffix_decoding_max_tree_depth")
            d["num_speculative_tokens"] = min(MAX_SPECULATIVE_TOKENS, depth if isinstance(depth, int) and
                                              not isinstance(depth, bool) and depth >= 1 else
                                              cls.suffix_decoding_max_tree_depth)
        lo, hi = d.get("prompt_lookup_min"), d.get("prompt_lookup_max")
        if lo is None and hi is not None:
            d["prompt_lookup_min"] = hi
        elif hi is None and lo is not None:
            d["prompt_lookup_max"] = lo
        return cls(**{k: v for k, v in d.items() if v is not None or k == "disable_by_batch_size"})


class _RequestDrafts:
    """What the proposer keeps per request: its token ids as a growing int32 array (the lookup compares
    whole arrays at once) and its drafts' acceptance so far, as decayed counts."""

    __slots__ = ("ids", "n", "accepted", "tried")

    def __init__(self) -> None:
        self.ids = np.empty(64, dtype=np.int32)
        self.n = 0
        self.accepted = 0.0          # drafts accepted (decayed)
        self.tried = 0.0             # drafts whose verdict was reached: the accepted ones and each first rejection

    def acceptance(self) -> float:
        """The chance a draft is accepted, estimated: the decayed counts, plus PRIOR_WEIGHT drafts at PRIOR."""
        return (self.accepted + PRIOR * PRIOR_WEIGHT) / (self.tried + PRIOR_WEIGHT)

    def sync(self, prompt: list[int], output: list[int]) -> np.ndarray:
        """Append what prompt + output (which only grows) has beyond what is held -> the history [L]."""
        p, m = len(prompt), len(prompt) + len(output)
        if m < self.n:                      # cannot happen for one request; start over rather than lie
            self.n = 0
        if m > len(self.ids):
            grown = np.empty(max(m, 2 * len(self.ids)), dtype=np.int32)
            grown[: self.n] = self.ids[: self.n]
            self.ids = grown
        if self.n < p:
            self.ids[self.n: p] = prompt[self.n:]
            self.n = p
        if m > self.n:
            self.ids[self.n: m] = output[self.n - p:]
            self.n = m
        return self.ids[: m]


# The adaptive draft length: a request's acceptance estimate starts at PRIOR (as if PRIOR_WEIGHT drafts had
# been seen), its counts decay by DECAY every step it is proposed for — so a request that stopped drafting
# drifts back to the prior and tries again — and a draft row costs `row_cost` of a one-row step (measured at
# the engine's warm-up; DEFAULT_ROW_COST until then).
PRIOR, PRIOR_WEIGHT, DECAY = 0.7, 1.0, 0.95
DEFAULT_ROW_COST = 0.4


def measure_row_cost(step: Callable[[int], None], k: int, reps: int = 3) -> float:
    """What a draft row costs as a share of a one-row decode step: `step(d)` runs one decode step of a
    request's token and d drafts; the fastest of `reps` steps with 0 and with k drafts, alternated ->
    (t_k / t_0 - 1) / k, clamped to [0.05, 1.5]."""
    best = {0: math.inf, k: math.inf}
    for _ in range(reps):
        for d in (0, k):
            t0 = time.perf_counter()
            step(d)
            best[d] = min(best[d], time.perf_counter() - t0)
    return min(1.5, max(0.05, (best[k] / best[0] - 1.0) / k))


def best_draft_length(acceptance: float, row_cost: float, most: int) -> int:
    """The k in 0..most that maximizes tokens per cost of a verify step, (1 + a + a² + … + a^k) / (1 + c·k):
    each draft is accepted with chance a only if the ones before it were, and each costs c of a row."""
    best, best_rate, gain, term = 0, 1.0, 1.0, 1.0
    for k in range(1, most + 1):
        term *= acceptance
        gain += term
        rate = gain / (1.0 + row_cost * k)
        if rate > best_rate:
            best, best_rate = k, rate
    return best


class NgramProposer:
    """Drafts for one request from its own history (prompt + output so far); with `adaptive`, at most as
    many as its drafts' acceptance so far pays for (`best_draft_length`), told by `observe`."""

    def __init__(self, cfg: SpeculativeConfig) -> None:
        self.cfg = cfg
        self.row_cost = DEFAULT_ROW_COST

    def propose(self, req: Any, limit: int) -> list[int]:
        """Up to min(num_speculative_tokens, limit) drafts for `req` (its `ngram` slot keeps the state
        between steps), or [] when its last tokens never occurred before."""
        if req.ngram is None:
            req.ngram = _RequestDrafts()
        st = req.ngram
        k = min(self.cfg.num_speculative_tokens, limit)
        if self.cfg.adaptive:
            st.accepted *= DECAY
            st.tried *= DECAY
            k = min(k, best_draft_length(st.acceptance(), self.row_cost, self.cfg.num_speculative_tokens))
        return self.drafts(req, k) if k > 0 else []

    def drafts(self, req: Any, k: int) -> list[int]:
        """The n-gram lookup over the request's history: at most k drafts."""
        return lookup(req.ngram.sync(req.prompt_ids, req.output_ids), k, self.cfg.prompt_lookup_min,
                      self.cfg.prompt_lookup_max)

    def observe(self, req: Any, drafted: int, accepted: int) -> None:
        """A verify step's verdict on `req`'s drafts: `accepted` of `drafted` (the first `accepted` ones)."""
        st = req.ngram
        if st is not None and drafted:
            st.accepted += accepted
            st.tried += accepted + (accepted < drafted)


def lookup(h: np.ndarray, k: int, lo: int, hi: int) -> list[int]:
    """h [L] token ids -> the k tokens that followed the latest earlier occurrence of h's longest suffix of
    lo..hi tokens, extended through the drafts themselves where that occurrence runs into the end (a
    repeating pattern keeps repeating), or [] if no suffix of lo tokens occurred before.

    One pass over h: the earlier ends e (exclusive, e <= L-1: something follows) whose last token equals
    h[-1], then the match is extended backwards on those candidates only."""
    L = len(h)
    if L <= lo or k <= 0:
        return []
    ends = np.flatnonzero(h[: L - 1] == h[L - 1]) + 1            # h[e-1] == h[L-1]
    if ends.size == 0:
        return []
    length = np.ones(ends.size, dtype=np.int64)                  # matched suffix length at each end
    alive = np.ones(ends.size, dtype=bool)
    for j in range(2, hi + 1):
        if j > L - 1:
            break
        ok = alive & (ends - j >= 0)
        ok[ok] = h[ends[ok] - j] == h[L - j]
        length[ok] = j
        alive = ok
        if not alive.any():
            break
    best = int(length.max())
    if best < lo:
        return []
    e = int(ends[np.flatnonzero(length == best)[-1]])           # the latest of the longest
    out: list[int] = []
    for j in range(k):                                          # h[e + j], reading drafts past the end
        p = e + j
        out.append(int(h[p]) if p < L else out[p - L])
    return out
