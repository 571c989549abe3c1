"""Speculative decoding: the n-gram lookup against a brute-force scan, the config's refusals, and the engine
with drafts giving exactly the tokens (and logprobs) of plain decoding — greedy, seeded sampling,
penalties, min_tokens, stop ids, preemption, prefix caching, every decoder — in fewer steps, with every KV
block back in the pool at the end."""

from __future__ import annotations

import random

import numpy as np
import pytest

from gigadecode.config import ConfigError
from gigadecode.engine import LLMEngine
from gigadecode.engine_config import EngineConfig
from gigadecode.runner import ModelRunner
from gigadecode.sampling import SamplingParams
from gigadecode.speculative import NgramProposer, SpeculativeConfig, best_draft_length, lookup

from .helpers import random_prompt
from .test_engine import _weights


# -- the lookup ------------------------------------------------------------------------------------------

def brute_lookup(h: list[int], k: int, lo: int, hi: int) -> list[int]:
    """The definition, scanned: the longest n in hi..lo whose suffix occurs earlier with something after it;
    of those occurrences the latest; its continuation read through the drafts themselves."""
    L = len(h)
    for n in range(hi, lo - 1, -1):
        if n >= L:
            continue
        suffix = h[L - n:]
        ends = [e for e in range(n, L) if h[e - n: e] == suffix]      # e <= L - 1: a token follows
        if ends:
            ext = list(h)
            e = ends[-1]
            for j in range(k):
                ext.append(ext[e + j])
            return ext[L:]
    return []


@pytest.mark.parametrize("seed", range(40))
def test_lookup_matches_brute_force(seed):
    rng = random.Random(seed)
    vocab = rng.choice([2, 3, 5, 20])                   # small vocabularies: many (and overlapping) matches
    h = [rng.randrange(vocab) for _ in range(rng.randrange(1, 60))]
    if rng.random() < 0.3:                               # periodic tails
        period = h[-rng.randrange(1, 6):]
        h = h + period * rng.randrange(1, 4)
    lo = rng.randrange(1, 4)
    hi = lo + rng.randrange(0, 4)
    k = rng.randrange(1, 7)
    assert lookup(np.array(h, dtype=np.int32), k, lo, hi) == brute_lookup(h, k, lo, hi), (h, k, lo, hi)


def test_lookup_cases():
    a = np.array
    assert lookup(a([1, 2, 3, 9, 1, 2], dtype=np.int32), 2, 2, 4) == [3, 9]
    # the longest match wins over a later, shorter one
    assert lookup(a([7, 1, 2, 5, 8, 2, 6, 1, 2], dtype=np.int32), 1, 1, 3) == [5]
    # a repeating pattern keeps repeating past the end of the history
    assert lookup(a([4, 5, 4, 5, 4, 5], dtype=np.int32), 5, 2, 2) == [4, 5, 4, 5, 4]
    assert lookup(a([1, 2, 3], dtype=np.int32), 3, 1, 3) == []                # nothing occurred before
    assert lookup(a([1, 2, 1], dtype=np.int32), 3, 2, 3) == []                # only a 1-token match, lo = 2
    assert lookup(a([5], dtype=np.int32), 3, 1, 1) == []


def test_proposer_keeps_its_history_in_step():
    class Req:
        prompt_ids = [1, 2, 3, 4, 1, 2]
        output_ids: list[int] = []
        ngram = None
    r = Req()
    p = NgramProposer(SpeculativeConfig(num_speculative_tokens=3, adaptive=False))
    assert p.propose(r, 10) == [3, 4, 1]
    r.output_ids = [3, 4, 9, 9]
    assert p.propose(r, 10) == []                    # [9, 9]: never before
    r.output_ids = [3, 4, 9, 9, 1, 2, 3]
    assert p.propose(r, 2) == [4, 9]                 # the latest occurrence; limit caps the drafts
    assert p.propose(r, 0) == []


def test_best_draft_length():
    assert best_draft_length(0.0, 0.4, 5) == 0
    assert best_draft_length(0.35, 0.4, 5) == 0          # a draft pays only when accepted more often than it costs
    assert best_draft_length(0.5, 0.4, 5) == 1
    assert best_draft_length(0.99, 0.4, 5) == 5
    for a in (0.1, 0.3, 0.5, 0.7, 0.9):
        for c in (0.1, 0.3, 0.6):
            k = best_draft_length(a, c, 8)
            rate = [sum(a ** j for j in range(n + 1)) / (1 + c * n) for n in range(9)]
            assert rate[k] == max(rate), (a, c, k, rate)


def test_adaptive_draft_length_follows_acceptance():
    """A request whose drafts keep failing stops drafting, tries again now and then, and drafts the most
    once they are accepted; with adaptive false the proposer always drafts the most it can."""
    class Req:
        prompt_ids = [1, 2, 3, 4, 5, 6, 7, 8] * 4
        output_ids: list[int] = []
        ngram = None
    r = Req()
    p = NgramProposer(SpeculativeConfig(num_speculative_tokens=4))
    p.row_cost = 0.4
    lengths = []
    for _ in range(60):                                 # every draft rejected
        d = p.propose(r, 10)
        lengths.append(len(d))
        p.observe(r, len(d), 0)
    assert lengths[0] >= 2 and lengths[-30:].count(0) >= 20 and max(lengths[-30:]) >= 1   # stops; probes again
    for _ in range(30):                                 # now every draft accepted
        d = p.propose(r, 10)
        p.observe(r, len(d), len(d))
    assert len(p.propose(r, 10)) == 4
    fixed = NgramProposer(SpeculativeConfig(num_speculative_tokens=4, adaptive=False))
    r2 = Req()
    for _ in range(20):
        assert len(fixed.propose(r2, 10)) == 4
        fixed.observe(r2, 4, 0)


def test_warm_up_measures_what_a_draft_row_costs(tiny_ckpt):
    eng = engine(tiny_ckpt, SpeculativeConfig(num_speculative_tokens=3))
    assert eng.scheduler.proposer.row_cost == 0.4
    assert eng.warm_up() is not None
    assert 0.05 <= eng.scheduler.proposer.row_cost <= 1.5
    assert eng.kv_manager.num_free_blocks == eng.runner.kv.num_blocks - 1


# -- the config ------------------------------------------------------------------------------------------

def test_config_parse():
    c = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3}')
    assert (c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == (3, 2, 4)
    c = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 6})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (6, 6)         # a lone bound sets both (vLLM)
    assert SpeculativeConfig.parse(None) is None and SpeculativeConfig.parse("") is None


@pytest.mark.parametrize("raw, words", [
    ("{", "not valid JSON"),
    ("[1]", "JSON object"),
    ('{"num_speculative_tokens": 3}', "method"),
    ('{"method": "eagle", "num_speculative_tokens": 3}', "ngram"),
    ('{"method": "ngram"}', "num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": 99}', "<= 16"),
    ('{"method": "ngram", "num_speculative_tokens": true}', "num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 3}', "larger"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "model": "x"}', "unknown field"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0}', "disable_by_batch_size"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "adaptive": "yes"}', "adaptive"),
])
def test_config_refused(raw, words):
    with pytest.raises(ConfigError, match=words):
        SpeculativeConfig.parse(raw)


# -- the engine ------------------------------------------------------------------------------------------

def engine(ckpt, spec: SpeculativeConfig | None = None, **kw) -> LLMEngine:
    cfg, w = _weights(str(ckpt))
    ecfg = EngineConfig(**{"kv_dtype": "fp8", "block_size": 4, "num_blocks": 600, "speculative": spec, **kw})
    return LLMEngine(ModelRunner(ckpt, ecfg, cfg=cfg, weights=w))


class OracleProposer:
    """Drafts read from a plain run's outputs, each changed with probability `wrong` (so drafts are accepted
    whole, in part, or not at all); the engine must give the plain run's tokens whatever it is told."""

    def __init__(self, plain: dict[str, list[int]], k: int, wrong: float, vocab: int, seed: int = 0) -> None:
        self.plain, self.k, self.wrong, self.vocab = plain, k, wrong, vocab
        self.rng = random.Random(seed)
        self.calls = 0

    def propose(self, req, limit: int) -> list[int]:
        self.calls += 1
        assert limit >= 0
        o = len(req.output_ids)
        want = self.plain[req.request_id][o: o + min(self.k, limit)]
        return [(t + 1 + self.rng.randrange(self.vocab - 1)) % self.vocab if self.rng.random() < self.wrong else t
                for t in want]


def params_mix(vocab: int) -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.9, seed=11, max_tokens=19, ignore_eos=True),
        SamplingParams(temperature=1.0, top_p=0.8, top_k=50, seed=3, max_tokens=21, repetition_penalty=1.3,
                       presence_penalty=0.5, frequency_penalty=0.3, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=16, logprobs=3, ignore_eos=True),
        SamplingParams(temperature=0.7, seed=5, max_tokens=30, min_tokens=12),
        SamplingParams(temperature=0.0, max_tokens=18, stop_token_ids=(7, 9, 11, 13, 17, 19, 23, 29, 31)),
        SamplingParams(temperature=0.8, seed=2, max_tokens=1, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, logit_bias=((5, 3.0),)),
    ]


def run(eng: LLMEngine, prompts, params, staggered: bool = False) -> dict[str, tuple]:
    """Run the requests (all at once, or one joining every other step) -> id: (tokens, finish, logprobs)."""
    ids, pending, step = [], list(zip(prompts, params)), 0
    while pending or eng.has_unfinished():
        while pending and (not staggered or step % 2 == 0):
            p, sp = pending.pop(0)
            ids.append(eng.add_request(p, sp, request_id=f"r{len(ids)}"))
            if staggered:
                break
        eng.step()
        step += 1
    return {i: (eng.requests[i].output_ids, eng.requests[i].finish_reason,
                [(lp.token_id, round(lp.logprob, 4)) if hasattr(lp, "token_id") else lp
                 for lp in eng.requests[i].output_logprobs]) for i in ids}


@pytest.mark.parametrize("decoder", ["gk-native", "gk", "reference",
                                     # compiles a graph per batch bucket: ~5 minutes here
                                     pytest.param("gk-compiled", marks=pytest.mark.slow)])
@pytest.mark.parametrize("wrong", [0.0, 0.3])
def test_drafts_give_plain_decoding_tokens(tiny_ckpt, decoder, wrong):
    vocab = _weights(str(tiny_ckpt))[0].vocab_size
    prompts = [random_prompt(n, vocab, seed=n) for n in (9, 1, 14, 6, 23, 3, 17, 5)]
    params = params_mix(vocab)
    kw = dict(decoder=decoder, gk_decode=decoder != "reference", kv_dtype="auto" if decoder == "reference" else "fp8")
    plain_eng = engine(tiny_ckpt, **kw)
    plain = run(plain_eng, prompts, params, staggered=True)
    eng = engine(tiny_ckpt, SpeculativeConfig(num_speculative_tokens=5), **kw)
    eng.scheduler.proposer = OracleProposer({i: o for i, (o, _, _) in plain.items()}, 5, wrong, vocab)
    got = run(eng, prompts, params, staggered=True)
    assert got == plain
    s = eng.stats
    assert 0 < s.spec_drafts <= s.spec_draft_tokens and 0 < s.spec_accepted_tokens <= s.spec_draft_tokens
    if wrong == 0.0:
        assert s.spec_accepted_tokens == s.spec_draft_tokens             # perfect drafts: all taken
    assert s.steps < plain_eng.stats.steps
    assert s.decode_tokens == plain_eng.stats.decode_tokens              # tokens made by decode steps
    assert eng.kv_manager.num_free_blocks == eng.runner.kv.num_blocks - 1


def test_drafts_under_preemption_and_tight_pool(tiny_ckpt):
    """A pool too small for everyone: drafts take only free blocks (never preempt), requests are preempted
    and recomputed, and the outputs stay plain decoding's."""
    vocab = _weights(str(tiny_ckpt))[0].vocab_size
    prompts = [random_prompt(n, vocab, seed=100 + n) for n in (21, 30, 11, 26, 19, 8)]
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=28, ignore_eos=True)
              for i in range(len(prompts))]
    plain_eng = engine(tiny_ckpt, num_blocks=70, max_prefill_tokens=16)
    plain = run(plain_eng, prompts, params)
    eng = engine(tiny_ckpt, SpeculativeConfig(num_speculative_tokens=4), num_blocks=70, max_prefill_tokens=16)
    eng.scheduler.proposer = OracleProposer({i: o for i, (o, _, _) in plain.items()}, 4, 0.2, vocab, seed=1)
    assert run(eng, prompts, params) == plain
    assert eng.stats.preemptions > 0 and eng.stats.spec_accepted_tokens > 0
    assert eng.kv_manager.num_free_blocks == eng.runner.kv.num_blocks - 1


def test_drafts_stop_at_max_tokens_and_the_context(tiny_ckpt):
    """The drafts of a step never run past max_tokens or the context: the proposer is asked for no more."""
    vocab = _weights(str(tiny_ckpt))[0].vocab_size
    prompt = random_prompt(20, vocab, seed=5)
    limits = []

    class Greedy(OracleProposer):
        def propose(self, req, limit):
            limits.append((len(req.output_ids), req.num_tokens, limit))
            return super().propose(req, limit)

    for max_model_len, max_tokens in ((40, 30), (None, 13)):
        kw = {"max_model_len": max_model_len} if max_model_len else {}
        p = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        plain_eng = engine(tiny_ckpt, **kw)
        if max_model_len:
            p = SamplingParams(temperature=0.0, max_tokens=max_model_len - len(prompt), ignore_eos=True)
        plain = run(plain_eng, [prompt], [p])
        eng = engine(tiny_ckpt, SpeculativeConfig(num_speculative_tokens=7), **kw)
        eng.scheduler.proposer = Greedy({"r0": plain["r0"][0]}, 7, 0.0, vocab)
        limits.clear()
        assert run(eng, [prompt], [p]) == plain
        assert len(plain["r0"][0]) == p.max_tokens
        for n_out, n_tokens, limit in limits:
            assert limit == min(p.max_tokens - n_out, eng.max_model_len - n_tokens) - 1


def test_ngram_proposer_in_the_engine(tiny_ckpt):
    """The real proposer: prompts that hold every token of the vocabulary, so every sampled token matched
    something before (prompt_lookup_min 1) and drafts are made every step; outputs stay plain decoding's."""
    vocab = _weights(str(tiny_ckpt))[0].vocab_size
    rng = random.Random(0)
    prompts = []
    for i in range(3):
        p = list(range(vocab))
        rng.shuffle(p)
        prompts.append(p[: vocab - 7 * i])
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=4, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)]
    kw = dict(num_blocks=1200, max_model_len=vocab + 32)
    plain = run(engine(tiny_ckpt, **kw), prompts, params)
    spec = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)
    eng = engine(tiny_ckpt, spec, **kw)
    assert run(eng, prompts, params) == plain
    assert eng.stats.spec_draft_tokens > 0
    assert eng.kv_manager.num_free_blocks == eng.runner.kv.num_blocks - 1


def test_disable_by_batch_size(tiny_ckpt):
    vocab = _weights(str(tiny_ckpt))[0].vocab_size
    prompts = [random_prompt(8, vocab, seed=s) for s in range(3)]
    params = [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)] * 3
    plain = run(engine(tiny_ckpt), prompts, params)
    for limit, drafted in ((3, False), (4, True)):
        eng = engine(tiny_ckpt, SpeculativeConfig(num_speculative_tokens=2, disable_by_batch_size=limit))
        eng.scheduler.proposer = OracleProposer({i: o for i, (o, _, _) in plain.items()}, 2, 0.0, vocab)
        assert run(eng, prompts, params) == plain
        assert (eng.stats.spec_draft_tokens > 0) == drafted


def test_drafts_with_prefix_caching(tiny_ckpt):
    """Accepted drafts' blocks are named like any computed block: a later request that shares the whole
    conversation takes them from the cache, and its tokens are still plain decoding's."""
    vocab = _weights(str(tiny_ckpt))[0].vocab_size
    first = random_prompt(13, vocab, seed=9)
    p = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    plain_eng = engine(tiny_ckpt)
    out1 = run(plain_eng, [first], [p])["r0"][0]
    second = first + out1 + random_prompt(5, vocab, seed=10)
    out2 = plain_eng.generate([second], p)[0].output_ids

    eng = engine(tiny_ckpt, SpeculativeConfig(num_speculative_tokens=4), enable_prefix_caching=True)
    eng.scheduler.proposer = OracleProposer({"r0": out1, "r1": out2}, 4, 0.25, vocab)
    assert run(eng, [first], [p])["r0"][0] == out1
    assert eng.add_request(second, p, request_id="r1") == "r1"
    while eng.has_unfinished():
        eng.step()
    assert eng.requests["r1"].output_ids == out2
    assert eng.requests["r1"].num_cached_tokens >= 4 * ((len(first) + len(out1) - 1) // 4) - 4
    assert eng.stats.spec_accepted_tokens > 0


def test_drafts_fill_a_step_up_to_the_largest_batch_bucket(tiny_ckpt):
    """A step's rows (each decoding request's token and its drafts) stay within the largest batch bucket, so
    its logits are those of one GK call, as without drafts; the outputs stay plain decoding's."""
    vocab = _weights(str(tiny_ckpt))[0].vocab_size
    prompts = [random_prompt(n, vocab, seed=40 + n) for n in (4, 9, 13)]
    params = [SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)] * 3
    plain = run(engine(tiny_ckpt, batch_buckets=(1, 2, 4)), prompts, params)
    eng = engine(tiny_ckpt, SpeculativeConfig(num_speculative_tokens=3), batch_buckets=(1, 2, 4))
    eng.scheduler.proposer = OracleProposer({i: o for i, (o, _, _) in plain.items()}, 3, 0.0, vocab)
    rows = []
    schedule = eng.scheduler.schedule

    def recording():
        plan = schedule()
        rows.append((len(plan.decodes), sum(len(r.draft_ids) for r in plan.decodes)))
        return plan
    eng.scheduler.schedule = recording
    assert run(eng, prompts, params) == plain
    assert all(n + d <= 4 for n, d in rows), rows
    assert any(n == 3 and d == 1 for n, d in rows) and any(n == 2 and d == 2 for n, d in rows), rows
