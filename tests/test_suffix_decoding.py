"""Suffix decoding: its drafts against a brute-force walk of the depth-limited suffix tree (occurrences found
by comparing every window of every sequence, no index), the cache of earlier outputs (what it keeps, its
index merged or not), the config, and the engine: plain decoding's tokens with drafts from the
request's own history and from earlier requests' outputs, in fewer steps once those outputs are cached."""

from __future__ import annotations

import dataclasses
import random
from collections import Counter

import numpy as np
import pytest

from gigadecode import suffix_decoding
from gigadecode.config import ConfigError
from gigadecode.sampling import SamplingParams
from gigadecode.speculative import SpeculativeConfig
from gigadecode.suffix_decoding import SEPARATOR, ResponseCache, best_prefix, suffix_candidate, suffix_drafts

from .helpers import random_prompt
from .test_speculative import _weights, engine, run


def brute_drafts(own: list[int], cached: list[list[int]], k: int, depth: int, factor: float,
                 min_prob: float) -> list[int]:
    """The method by its definition: for each source (the request's own tokens, whose last window is not an
    earlier occurrence; then the cached outputs, each its own sequence) and each m, the node of the last m
    tokens is every earlier window equal to them; walk to the most frequent next token (ties: the smaller)
    while the product of child / node counts stays >= min_prob, at most min(k, m * factor, depth - m)
    tokens; the walk with the largest sum of probabilities wins (on ties: the own history's before the cached
    outputs', and within one source the longer match)."""
    pattern = own[-depth:]
    best: tuple[list[int], float] = ([], 0.0)
    for seqs, last_end in (([own], lambda s: len(own) - 1), (cached, lambda s: len(cached[s]))):
        for m in range(min(depth, len(pattern)), 0, -1):
            ctx = pattern[-m:]
            occ = [(s, e) for s, seq in enumerate(seqs) for e in range(m, last_end(s) + 1) if seq[e - m:e] == ctx]
            if not occ:
                continue
            limit = min(k, int(m * factor + 1e-6), depth - m)
            toks: list[int] = []
            prob, score = 1.0, 0.0
            while len(toks) < limit and occ:
                follow = Counter(seqs[s][e] for s, e in occ if e < len(seqs[s]))
                if not follow:
                    break
                top = max(follow.values())
                tok = min(t for t, c in follow.items() if c == top)
                p = prob * top / len(occ)
                if p < min_prob:
                    break
                prob = p
                toks.append(tok)
                score += p
                occ = [(s, e + 1) for s, e in occ if e < len(seqs[s]) and seqs[s][e] == tok]
            if score > best[1]:
                best = (toks, score)
    return best[0]


def cfg(k: int = 4, depth: int = 24, factor: float = 1.0, min_prob: float = 0.1, cached: int = 10000):
    return SpeculativeConfig(method="suffix", num_speculative_tokens=k, suffix_decoding_max_tree_depth=depth,
                             suffix_decoding_max_spec_factor=factor, suffix_decoding_min_token_prob=min_prob,
                             suffix_decoding_max_cached_requests=cached)


def cached_outputs(cache: ResponseCache) -> list[list[int]]:
    toks = cache.tokens[: cache.n].tolist()
    out, cur = [], []
    for t in toks:
        if t == SEPARATOR:
            out.append(cur)
            cur = []
        else:
            cur.append(t)
    assert not cur
    return out


@pytest.mark.parametrize("seed", range(60))
def test_drafts_match_the_brute_force_walk(seed, monkeypatch):
    rng = random.Random(seed)
    if seed % 3 == 0:                      # the index rebuilt now and then, the latest outputs beside it
        monkeypatch.setattr(suffix_decoding, "MIN_REBUILD", rng.randint(1, 30))
    vocab = rng.randint(2, 6)
    c = cfg(k=rng.randint(1, 10), depth=rng.randint(1, 9), factor=rng.choice([0.5, 1.0, 1.5, 3.0]),
            min_prob=rng.choice([0.0, 0.1, 0.3, 0.6]), cached=rng.randint(0, 12))
    cache = ResponseCache(c.suffix_decoding_max_cached_requests)
    outputs = []
    for _ in range(rng.randint(0, 20)):
        o = [rng.randrange(vocab) for _ in range(rng.randint(0, 12))]
        outputs.append(o)
        cache.add(o)
    kept = cached_outputs(cache)
    assert len(kept) == len(cache) <= c.suffix_decoding_max_cached_requests
    real = [o for o in outputs if o]
    assert kept == (real[len(real) - len(kept):] if kept else [])        # the latest ones, in order
    if c.suffix_decoding_max_cached_requests:
        assert len(kept) >= min(len(real), c.suffix_decoding_max_cached_requests * 3 // 4)
    for _ in range(8):
        own = [rng.randrange(vocab) for _ in range(rng.randint(1, 30))]
        got = suffix_drafts(np.array(own, dtype=np.int32), cache, c.num_speculative_tokens, c)
        assert got == brute_drafts(own, kept, c.num_speculative_tokens, c.suffix_decoding_max_tree_depth,
                                   c.suffix_decoding_max_spec_factor, c.suffix_decoding_min_token_prob), (own, kept)


@pytest.mark.parametrize("seed", range(20))
def test_best_prefix_maximizes_expected_tokens_per_cost(seed):
    rng = random.Random(seed)
    probs, p = [], 1.0
    for _ in range(rng.randint(0, 12)):
        p *= rng.choice([1.0, 1.0, 0.9, 0.5, 0.2])
        probs.append(p)
    c = rng.choice([0.05, 0.2, 0.4, 1.0])
    rates = [(1 + sum(probs[:j])) / (1 + c * j) for j in range(len(probs) + 1)]
    assert best_prefix(probs, c) == rates.index(max(rates))
    if probs and probs[0] == 1.0 and c < 1.0:
        assert best_prefix(probs, c) >= 1                       # a sure draft always pays


def test_candidate_probabilities():
    c = cfg(k=8, min_prob=0.0)
    cache = ResponseCache(10)
    for o in ([1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 6, 7]):
        cache.add(o)
    # "1 2" occurs 3 times: 3 follows twice (2/3), then 4 or 5 once each (1/2 of that; the smaller id wins)
    toks, probs = suffix_candidate(np.array([9, 1, 2], np.int32), cache, 8, c)
    assert toks == [3, 4] and probs == pytest.approx([2 / 3, 1 / 3])


def test_drafts_cases():
    c = cfg(k=8, depth=24, min_prob=0.1)
    empty = ResponseCache(10)
    # its own history: "1 2 3 4 ... 1 2" -> 3 4 (a match of 2 tokens drafts at most 2)
    assert suffix_drafts(np.array([1, 2, 3, 4, 9, 1, 2], np.int32), empty, 8, c) == [3, 4]
    # an earlier output continues the pattern: drafted from the cache, even past the own history's end
    cache = ResponseCache(10)
    cache.add([7, 1, 2, 3, 4, 5, 6])
    assert suffix_drafts(np.array([9, 1, 2, 3], np.int32), cache, 8, c) == [4, 5, 6]
    # two outputs disagree after "1 2": the more frequent continuation, at its estimated probability
    cache.add([1, 2, 8])
    cache.add([1, 2, 8])
    assert suffix_drafts(np.array([5, 1, 2], np.int32), cache, 8, c) == [8]
    assert suffix_drafts(np.array([5, 1, 2], np.int32), cache, 8, cfg(k=8, min_prob=0.7)) == []
    # nothing matches
    assert suffix_drafts(np.array([42], np.int32), cache, 8, c) == []
    # a tie across sources: the own history's 2-token match ("1 2" -> 3 4) over the cache's 3-token one
    # ("7 1 2" -> 5 6), both 2 drafts at probability 1 (k = 2); the docs said the longer match won
    tie = ResponseCache(10)
    tie.add([7, 1, 2, 5, 6, 8])
    assert suffix_drafts(np.array([1, 2, 3, 4, 7, 1, 2], np.int32), tie, 2, cfg(k=2)) == [3, 4]
    assert suffix_drafts(np.array([1, 2, 3, 4, 7, 1, 2], np.int32), tie, 3, cfg(k=3)) == [5, 6, 8]


def test_config():
    c = SpeculativeConfig.parse('{"method": "suffix"}')
    assert (c.method, c.num_speculative_tokens, c.suffix_decoding_max_tree_depth) == ("suffix", 16, 24)
    assert (c.suffix_decoding_max_cached_requests, c.suffix_decoding_max_spec_factor,
            c.suffix_decoding_min_token_prob) == (10000, 1.0, 0.1)
    c = SpeculativeConfig.parse({"method": "suffix", "suffix_decoding_max_tree_depth": 6,
                                 "suffix_decoding_min_token_prob": 0.25, "suffix_decoding_max_cached_requests": 0})
    assert (c.num_speculative_tokens, c.suffix_decoding_min_token_prob, c.suffix_decoding_max_cached_requests) == \
        (6, 0.25, 0)
    for raw, words in (
            ('{"method": "suffix", "prompt_lookup_min": 2}', "do not apply"),
            ('{"method": "ngram", "num_speculative_tokens": 2, "suffix_decoding_max_tree_depth": 8}', "do not apply"),
            ('{"method": "suffix", "suffix_decoding_min_token_prob": 1.5}', "[0.0, 1.0]"),
            ('{"method": "suffix", "suffix_decoding_max_spec_factor": -1}', "suffix_decoding_max_spec_factor"),
            ('{"method": "suffix", "suffix_decoding_max_tree_depth": 0}', "suffix_decoding_max_tree_depth"),
            ('{"method": "suffix", "suffix_decoding_max_cached_requests": -1}', ">= 0"),
            ('{"method": "suffix", "num_speculative_tokens": 17}', "<= 16"),
            ('{"method": "eagle", "num_speculative_tokens": 3}', "suffix")):
        with pytest.raises(ConfigError) as e:
            SpeculativeConfig.parse(raw)
        assert words in str(e.value), (raw, str(e.value))


@pytest.mark.parametrize("decoder, adaptive", [("gk-native", False), ("gk-native", True), ("reference", True)])
def test_engine_gives_plain_tokens_and_learns_from_earlier_outputs(tiny_ckpt, decoder, adaptive):
    """The real proposer in the engine: prompts that repeat themselves (drafts from the request's own
    history) and, in a second round, the same requests again (drafts from the first round's outputs, now
    cached). Every round gives plain decoding's tokens; the second needs far fewer steps."""
    vocab = _weights(str(tiny_ckpt))[0].vocab_size
    base = [random_prompt(n, vocab, seed=n) for n in (5, 9, 3)]
    prompts = [b * 3 for b in base]
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=7, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, presence_penalty=0.4)]
    kw = dict(decoder=decoder, gk_decode=decoder != "reference", kv_dtype="auto" if decoder == "reference" else "fp8")
    plain = run(engine(tiny_ckpt, **kw), prompts, params)
    eng = engine(tiny_ckpt, SpeculativeConfig(method="suffix", num_speculative_tokens=8, adaptive=adaptive), **kw)
    assert run(eng, prompts, params) == plain
    first_steps, first_accepted = eng.stats.steps, eng.stats.spec_accepted_tokens
    assert len(eng.scheduler.proposer.cache) == 3
    again = {f"r{i + 3}": v for i, v in enumerate(plain.values())}
    got = run_from(eng, prompts, params, start=3)
    assert got == again
    second_steps = eng.stats.steps - first_steps
    assert eng.stats.spec_accepted_tokens - first_accepted > 0.6 * sum(len(o) for o, _, _ in plain.values())
    assert second_steps < 0.6 * first_steps
    assert eng.kv_manager.num_free_blocks == eng.runner.kv.num_blocks - 1


def run_from(eng, prompts, params, start: int) -> dict[str, tuple]:
    """`run`, with request ids from r{start} on (an engine that served requests before)."""
    ids = [eng.add_request(p, sp, request_id=f"r{start + i}") for i, (p, sp) in enumerate(zip(prompts, params))]
    while eng.has_unfinished():
        eng.step()
    return {i: (eng.requests[i].output_ids, eng.requests[i].finish_reason,
                [(lp.token_id, round(lp.logprob, 4)) if hasattr(lp, "token_id") else lp
                 for lp in eng.requests[i].output_logprobs]) for i in ids}


def test_aborted_and_failed_outputs_are_not_cached(tiny_ckpt):
    vocab = _weights(str(tiny_ckpt))[0].vocab_size
    eng = engine(tiny_ckpt, SpeculativeConfig(method="suffix", num_speculative_tokens=4))
    p = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    eng.add_request(random_prompt(6, vocab, seed=1), p, request_id="a")
    eng.add_request(random_prompt(6, vocab, seed=2), p, request_id="b")
    for _ in range(3):
        eng.step()
    eng.abort("a")
    while eng.has_unfinished():
        eng.step()
    assert cached_outputs(eng.scheduler.proposer.cache) == [eng.requests["b"].output_ids]


@pytest.mark.parametrize("factor", ["1e308", "1e400", "Infinity", "1" + "0" * 400])
def test_a_huge_spec_factor_drafts_as_an_unlimited_one(factor):
    """max_spec_factor is any number >= 0 (1e400 is JSON's inf): m · factor must not overflow into an
    exception at the first lookup (it did: int(inf)); it then limits nothing, as a factor of 100 here."""
    c = SpeculativeConfig.parse('{"method": "suffix", "num_speculative_tokens": 6, '
                                '"suffix_decoding_max_spec_factor": %s}' % factor)
    cache = ResponseCache(10)
    cache.add([7, 1, 2, 3, 4, 5, 6, 8, 9])
    for own in ([9, 1, 2], [1, 2, 3, 4, 1, 2], [5, 5, 5, 5], [4]):
        got = suffix_drafts(np.array(own, np.int32), cache, 6, c)
        assert got == brute_drafts(own, [[7, 1, 2, 3, 4, 5, 6, 8, 9]], 6, 24, 100.0, 0.1), own
    assert suffix_drafts(np.array([9, 1], np.int32), cache, 6, c) == [2, 3, 4, 5, 6, 8]

    class Req:
        prompt_ids, output_ids, ngram = [3, 1], [2], None
    proposer = suffix_decoding.SuffixProposer(dataclasses.replace(c, adaptive=False))
    proposer.finished(type("Done", (), {"output_ids": [7, 1, 2, 3, 4, 5, 6, 8, 9]})(), "stop")
    assert proposer.propose(Req(), 4) == [3, 4, 5, 6]              # "1 2" matched: 4 (the limit), not 2


def test_a_repeated_token_costs_a_chunk_and_one_walk(monkeypatch):
    """One token repeated 100k times (a model stuck in a loop): the lookup scans the history's latest chunk
    for the last token, not all of it, and walks the nodes of every length (which hold the same occurrences)
    as one walk that goes on where a shorter node allows more; it was a 100k scan and a walk per length
    (1 + 2 + ... + 12 steps, ~3 ms a step)."""
    h = np.full(100_000, 7, np.int32)
    steps, scanned = [], []
    walk, flatnonzero = suffix_decoding._walk, np.flatnonzero

    def counting_walk(*a, **kw):
        out = walk(*a, **kw)
        steps.append(len(out[0]) - len(a[5] if len(a) > 5 and a[5] else kw.get("toks") or ()))
        return out

    def counting_flatnonzero(x):
        scanned.append(np.size(x))
        return flatnonzero(x)
    monkeypatch.setattr(suffix_decoding, "_walk", counting_walk)
    monkeypatch.setattr(np, "flatnonzero", counting_flatnonzero)
    # every length m <= 23 matches; m = 12 walks the most (min(k, m, depth - m) = 12) at ~1 each
    assert suffix_drafts(h, ResponseCache(10), 16, cfg(k=16, depth=24)) == [7] * 12
    assert sum(steps) <= 16, steps
    assert max(scanned) <= 4 * suffix_decoding.OCCURRENCE_CAP, scanned


@pytest.mark.parametrize("raw, words", [
    # a method this engine lacks is named as such, not as a missing num_speculative_tokens (it was, for any
    # method without one: suffix decoding's default made num_speculative_tokens look like the only problem)
    ('{"method": "eagle"}', "method 'eagle' is not available"),
    ('{"method": "draft_model", "suffix_decoding_max_tree_depth": 4}', "method 'draft_model' is not available"),
    ('{"method": ["suffix"]}', "method ['suffix'] is not available"),
    ('{"method": 7, "num_speculative_tokens": 2}', "method 7 is not available"),
    ('{"method": "suffix", "suffix_decoding_max_spec_factor": NaN}', "suffix_decoding_max_spec_factor"),
    ('{"method": "suffix", "suffix_decoding_min_token_prob": null, "num_speculative_tokens": true}', ">= 1"),
    ('{"method": "suffix", "suffix_decoding_max_tree_depth": "8"}', "suffix_decoding_max_tree_depth"),
    ('{"method": "suffix", "suffix_decoding_max_cached_requests": 1e3}', "suffix_decoding_max_cached_requests"),
    ('{"method": "suffix", "num_speculative_tokens": 1e400}', "num_speculative_tokens"),
])
def test_config_refusals_name_the_problem(raw, words):
    with pytest.raises(ConfigError) as e:
        SpeculativeConfig.parse(raw)
    assert words in str(e.value), str(e.value)
