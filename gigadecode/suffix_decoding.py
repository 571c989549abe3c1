"""Suffix decoding (`--speculative-config '{"method": "suffix"}'`, vLLM's method name and fields): drafts from
what followed the request's latest tokens before, in its own prompt and output and in the outputs of earlier
requests, so a workload that repeats itself across requests (agent loops, tool calls, templated answers)
drafts from the first token of an output on.

The method (SuffixDecoding, Oliaro et al. 2024) matches the request's last tokens in a suffix tree of depth
D and walks down it. We keep no tree; its nodes are found on a token array instead. For the last m tokens
(the pattern, m <= D), the ends of their earlier occurrences are one node: its count is their number, and
its children's counts are how often each token follows them. From a node, drafting takes the most frequent
next token while the product of child count / node count along the way (the draft's estimated probability)
stays at least `suffix_decoding_min_token_prob`. It drafts at most min(k, m · max_spec_factor, D - m)
tokens. Of every m and both sources (the request's own history, the cache of earlier outputs), the walk with
the largest sum of probabilities is the draft (on a tie: the request's own before the cache's, and within
one source the longer match's).

The cache holds the outputs of requests that finished (stop or length), up to
`suffix_decoding_max_cached_requests` of them. Past that, the oldest quarter goes at once, so it holds 75-100%
of them. It stores 12 bytes per cached token: the token, and a sorted index of where each token id occurs.
Outputs added since the index was last built are merged into it when they reach a sixteenth of it (a sort of
the new part and one pass over the index: ~60 ms at 5M cached tokens); until then a dict holds where their
tokens are. Other requests' outputs only decide what gets drafted: verification keeps every token the
request's own (speculative.py).
"""

from __future__ import annotations

from array import array
from collections import deque
from typing import Any

import numpy as np

from .speculative import DEFAULT_ROW_COST, SpeculativeConfig, _RequestDrafts

__all__ = ["SuffixProposer", "ResponseCache", "suffix_drafts"]

SEPARATOR = -1                  # after each cached output: nothing matches or follows across it
OCCURRENCE_CAP = 1024           # the latest occurrences of a pattern's last token taken as its node
MIN_REBUILD = 1 << 16           # tokens added since the index was built before they may be merged into it


class ResponseCache:
    """The outputs of earlier requests as one token array, a SEPARATOR after each, oldest first, and where
    each token id occurs in it."""

    def __init__(self, max_requests: int) -> None:
        self.max_requests = max_requests
        self.tokens = np.empty(4096, dtype=np.int32)
        self.n = 0
        self.lengths: deque[int] = deque()            # each output's length + 1 (its separator), oldest first
        self._sorted = np.empty(0, dtype=np.int32)     # tokens[:n_indexed], sorted
        self._where = np.empty(0, dtype=np.int32)      # their positions (ascending within a token id)
        self.n_indexed = 0
        self._recent: dict[int, array] = {}            # token id -> its positions from n_indexed on (int64)

    def __len__(self) -> int:
        return len(self.lengths)

    def add(self, ids: list[int]) -> None:
        """Cache one finished request's output (the oldest quarter goes when it is full)."""
        if self.max_requests == 0 or not ids:
            return
        m = len(ids) + 1
        if self.n + m > len(self.tokens):
            grown = np.empty(max(self.n + m, 2 * len(self.tokens)), dtype=np.int32)
            grown[: self.n] = self.tokens[: self.n]
            self.tokens = grown
        self.tokens[self.n: self.n + m - 1] = ids
        self.tokens[self.n + m - 1] = SEPARATOR
        for i, t in enumerate(ids, self.n):
            self._recent.setdefault(t, array("q")).append(i)
        self.n += m
        self.lengths.append(m)
        if len(self.lengths) > self.max_requests:
            keep = self.max_requests - self.max_requests // 4
            drop = sum(self.lengths.popleft() for _ in range(len(self.lengths) - keep))
            self.tokens[: self.n - drop] = self.tokens[drop: self.n].copy()
            self.n -= drop
            live = self._where >= drop                 # the index, in its order, without the dropped outputs
            self._sorted, self._where = self._sorted[live], self._where[live] - drop
            self.n_indexed = max(0, self.n_indexed - drop)
            self._merge_recent()
        elif self.n - self.n_indexed > max(MIN_REBUILD, self.n_indexed // 16):
            self._merge_recent()

    def _merge_recent(self) -> None:
        """Merge tokens[n_indexed:n] into the sorted index, each after the equal ids already there (whose
        positions are smaller): a sort of the new part and one pass over the index, not a sort of it all."""
        new = np.argsort(self.tokens[self.n_indexed: self.n], kind="stable") + self.n_indexed
        ids = self.tokens[new]
        at = np.searchsorted(self._sorted, ids, side="right")
        self._sorted = np.insert(self._sorted, at, ids)
        self._where = np.insert(self._where, at, new.astype(np.int32))
        self.n_indexed = self.n
        self._recent = {}

    def ends_of(self, token: int) -> np.ndarray:
        """The ends (exclusive) of the latest OCCURRENCE_CAP occurrences of `token`, ascending."""
        t = np.int32(token)          # (a Python int would make numpy widen the whole index to compare)
        lo, hi = np.searchsorted(self._sorted, t, "left"), np.searchsorted(self._sorted, t, "right")
        recent = self._recent.get(token)
        tail = np.frombuffer(recent, dtype=np.int64)[-OCCURRENCE_CAP:] if recent else np.empty(0, np.int64)
        main = self._where[max(lo, hi - (OCCURRENCE_CAP - tail.size)): hi]
        return np.concatenate([main.astype(np.int64), tail]) + 1


def _nodes(h: np.ndarray, ends: np.ndarray, pattern: np.ndarray, depth: int) -> list[tuple[int, np.ndarray]]:
    """The nodes a pattern reaches in h: for m = 1 .. min(depth, len(pattern)) while its last m tokens occur,
    (m, the ends of those occurrences), given `ends` for m = 1 (the ends of pattern[-1]'s occurrences)."""
    P = len(pattern)
    out = [(1, ends)]
    for m in range(2, min(depth, P) + 1):
        e = ends[ends >= m]
        e = e[h[e - m] == pattern[P - m]]
        if e.size == 0:
            break
        out.append((m, e))
        ends = e
    return out


def _walk(h: np.ndarray, L: int, ends: np.ndarray, k: int, min_prob: float, toks: list[int] | None = None,
          probs: list[float] | None = None) -> tuple[list[int], list[float], np.ndarray | None]:
    """Down from the node whose occurrences end at `ends` in h[:L]: up to k drafts, each the token that most
    often follows (ties: the smaller id) while the running product of child / node counts stays >= min_prob.
    Given `toks` and `probs` (a walk that stopped at its limit, `ends` where it got to), it goes on from there.
    -> (drafts, their estimated probabilities, the ends to go on from if it stopped at k, else None)."""
    toks = list(toks or ())
    probs = list(probs or ())
    prob = probs[-1] if probs else 1.0
    while len(toks) < k and ends.size:
        if ends.size == 1:                       # one occurrence: its continuation, at the same probability
            e, want = int(ends[0]), k - len(toks)
            seg = h[e: min(L, e + want)]
            cut = np.flatnonzero(seg == SEPARATOR)
            seg = seg[: cut[0]] if cut.size else seg
            toks += seg.tolist()
            probs += [prob] * len(seg)
            return toks, probs, (np.array([e + want], np.int64) if len(seg) == want else None)
        nxt_at = ends[ends < L]
        nxt = h[nxt_at]
        real = nxt != SEPARATOR
        nxt_at, nxt = nxt_at[real], nxt[real]
        if nxt.size == 0:
            break
        if (nxt == nxt[0]).all():                # one child (a repeated or periodic history): no sort needed
            tok, count = int(nxt[0]), nxt.size
        else:
            vals, counts = np.unique(nxt, return_counts=True)
            i = int(np.argmax(counts))
            tok, count = int(vals[i]), int(counts[i])
        p = prob * float(count) / ends.size      # the node's count: every occurrence, followed or not
        if p < min_prob:
            break
        prob = p
        toks.append(tok)
        probs.append(p)
        ends = nxt_at[nxt == tok] + 1
    return toks, probs, (ends if len(toks) == k and ends.size else None)


Candidate = tuple[list[int], list[float]]       # drafts and their estimated probabilities


def _limit(m: int, k: int, depth: int, factor: float) -> int:
    """The most drafts a match of m tokens may walk: min(k, m · factor, depth - m). m · factor is only made an
    int where it is the smaller (a factor of 1e308, inf or a 400-digit integer is valid config and must not
    overflow)."""
    limit = min(k, depth - m)
    spec = m * factor
    return min(limit, int(spec + 1e-6)) if spec < limit else limit


def _best(h: np.ndarray, L: int, ends: np.ndarray, pattern: np.ndarray, k: int, cfg: SpeculativeConfig,
          best: Candidate) -> Candidate:
    """The best walk from the nodes of `pattern` in h[:L] (ends: those of its last token), or `best`: the
    longest match first, a shorter one only where its score is larger (so a tie keeps the longer match)."""
    depth, factor = cfg.suffix_decoding_max_tree_depth, cfg.suffix_decoding_max_spec_factor
    score = sum(best[1])
    last = None            # the last node walked: (its occurrences, limit, drafts, estimates, ends to go on from)
    for m, e in reversed(_nodes(h, ends, pattern, depth)):
        limit = _limit(m, k, depth, factor)
        if limit <= score:                       # a walk scores at most its limit (each estimate is <= 1)
            continue
        if last is not None and e.size == last[0]:
            # the occurrences of the longer node walked before it (the same set: each node's hold the next
            # longer one's), so the same walk: a prefix of that one, or that one gone on where it stopped at
            # its limit (a repeated token: one walk, not one per length)
            if limit <= last[1] or last[4] is None:
                continue
            toks, probs, where = _walk(h, L, last[4], limit, cfg.suffix_decoding_min_token_prob, last[2], last[3])
        else:
            toks, probs, where = _walk(h, L, e, limit, cfg.suffix_decoding_min_token_prob)
        last = (e.size, limit, toks, probs, where)
        if sum(probs) > score:
            best, score = (toks, probs), sum(probs)
    return best


def _latest_ends(h: np.ndarray, n: int, token: np.int32) -> np.ndarray:
    """The ends (exclusive) of the latest OCCURRENCE_CAP occurrences of `token` in h[:n], ascending: searched
    from the end in growing chunks, so a history of one token repeated 100k times costs a chunk, not 100k."""
    found: list[np.ndarray] = []
    count, hi, chunk = 0, n, 4 * OCCURRENCE_CAP
    while hi > 0 and count < OCCURRENCE_CAP:
        lo = max(0, hi - chunk)
        at = np.flatnonzero(h[lo:hi] == token) + lo
        found.append(at)
        count += at.size
        hi, chunk = lo, chunk * 4
    return np.concatenate(found[::-1])[-OCCURRENCE_CAP:] + 1 if count else np.empty(0, np.int64)


def suffix_drafts(h: np.ndarray, cache: ResponseCache, k: int, cfg: SpeculativeConfig) -> list[int]:
    """h [L] a request's token ids (prompt + output so far) -> at most k drafts: the best walk from its last
    tokens' nodes in its own earlier tokens and in the cached outputs, or [] where neither has one."""
    return suffix_candidate(h, cache, k, cfg)[0]


def suffix_candidate(h: np.ndarray, cache: ResponseCache, k: int, cfg: SpeculativeConfig) -> Candidate:
    """`suffix_drafts` with the drafts' estimated probabilities."""
    L = len(h)
    if L == 0 or k <= 0:
        return [], []
    pattern = h[max(0, L - cfg.suffix_decoding_max_tree_depth):]
    last = h[L - 1]
    best: Candidate = ([], [])
    own = _latest_ends(h, L - 1, last)                    # earlier ends only: the pattern's own is not one
    if own.size:
        best = _best(h, L, own, pattern, k, cfg, best)
    if cache.n:
        ends = cache.ends_of(int(last))
        if ends.size:
            best = _best(cache.tokens, cache.n, ends, pattern, k, cfg, best)
    return best


def best_prefix(probs: list[float], row_cost: float) -> int:
    """How many of a walk's drafts to send: the j that maximizes the tokens a verify step is expected to give
    per cost, (1 + p_1 + … + p_j) / (1 + c·j), with p_i the chance draft i (and every one before it) is
    accepted, as the walk estimated it, and c what a draft row costs."""
    best, best_rate, gain = 0, 1.0, 1.0
    for j, p in enumerate(probs, 1):
        gain += p
        rate = gain / (1.0 + row_cost * j)
        if rate > best_rate:
            best, best_rate = j, rate
    return best


class SuffixProposer:
    """Drafts by suffix decoding (`suffix_candidate`); with `adaptive`, as many as their estimated
    probabilities pay for (`best_prefix`; `row_cost` as the n-gram proposer's, measured at the warm-up).
    `finished` caches a request's output for the requests after it. (No `observe`: the walk's own estimates
    size the drafts, not the request's acceptance so far.)"""

    def __init__(self, cfg: SpeculativeConfig) -> None:
        self.cfg = cfg
        self.row_cost = DEFAULT_ROW_COST
        self.cache = ResponseCache(cfg.suffix_decoding_max_cached_requests)

    def propose(self, req: Any, limit: int) -> list[int]:
        """Up to min(num_speculative_tokens, limit) drafts for `req` (its `ngram` slot keeps its history)."""
        if req.ngram is None:
            req.ngram = _RequestDrafts()
        k = min(self.cfg.num_speculative_tokens, limit)
        if k <= 0:
            return []
        toks, probs = suffix_candidate(req.ngram.sync(req.prompt_ids, req.output_ids), self.cache, k, self.cfg)
        return toks[: best_prefix(probs, self.row_cost)] if self.cfg.adaptive else toks

    def finished(self, req: Any, reason: str) -> None:
        """A request ended: its output joins the cache if it ran to a stop or its length."""
        if reason in ("stop", "length"):
            self.cache.add(req.output_ids)
