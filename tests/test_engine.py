"""The engine: continuous batching equals running alone, preemption keeps outputs, seeded sampling is
per-request, bad input is refused while everyone else keeps being served."""

from __future__ import annotations

import functools

import pytest
import torch

from gigadecode.config import ConfigError
from gigadecode.engine_config import EngineConfig
from gigadecode import warmup
from gigadecode.engine import LLMEngine, RequestError
from gigadecode.kv.spec import SlidingWindowSpec
from gigadecode.runner import ModelRunner
from gigadecode.sampling import SamplingError, SamplingParams
from gigadecode.weights import load_weights

from . import helpers
from .helpers import cdiv, random_prompt

LENGTHS = [1, 2, 3, 4, 5, 7, 9, 15, 16, 17, 19, 23, 30, 41, 50, 64]
MAX_TOKENS = [20, 5, 12, 30, 8, 17, 25, 3, 14, 22, 9, 28, 11, 6, 19, 13]


@functools.lru_cache(maxsize=4)
def _weights(path: str):
    from gigadecode.config import GptOssConfig
    cfg = GptOssConfig.from_hf(path)
    return cfg, load_weights(path, cfg)


def make_engine(ckpt, **kw) -> LLMEngine:
    cfg, w = _weights(str(ckpt))
    ecfg = EngineConfig(**{"kv_dtype": "fp8", "block_size": 4, "num_blocks": 600, **kw})
    return LLMEngine(ModelRunner(ckpt, ecfg, cfg=cfg, weights=w))


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def run_alone(ckpt, prompt, params, **kw) -> list[int]:
    eng = make_engine(ckpt, **kw)
    return eng.generate([prompt], params)[0].output_ids


def run_staggered(eng: LLMEngine, prompts, params) -> dict[str, list[int]]:
    """Requests join at different steps: one new request every other step."""
    pending = list(zip(prompts, params))
    ids = []
    step = 0
    while pending or eng.has_unfinished():
        if pending and step % 2 == 0:
            p, sp = pending.pop(0)
            ids.append(eng.add_request(p, sp))
        eng.step()
        step += 1
    return {i: eng.requests[i].output_ids for i in ids}


@pytest.fixture(scope="module")
def prompts(tiny_ckpt):
    return [random_prompt(n, 1024, seed=500 + i) for i, n in enumerate(LENGTHS)]


@pytest.fixture(scope="module")
def alone(tiny_ckpt, prompts):
    return [run_alone(tiny_ckpt, p, greedy(m)) for p, m in zip(prompts, MAX_TOKENS)]


def test_continuous_batching_equals_alone(tiny_ckpt, prompts, alone):
    eng = make_engine(tiny_ckpt, max_prefill_tokens=24)        # long prompts are chunked
    out = run_staggered(eng, prompts, [greedy(m) for m in MAX_TOKENS])
    assert list(out.values()) == alone
    assert eng.kv_manager.num_free_blocks == eng.runner.kv.num_blocks - 1


def test_preemption_keeps_outputs(tiny_ckpt, prompts, alone):
    # 2 groups; 64 usable blocks of 4 tokens cannot hold 16 requests of up to 94 tokens at once.
    eng = make_engine(tiny_ckpt, num_blocks=65, max_prefill_tokens=64)
    out = run_staggered(eng, prompts, [greedy(m) for m in MAX_TOKENS])
    assert eng.stats.preemptions > 0
    assert list(out.values()) == alone
    assert eng.kv_manager.num_free_blocks == 64


def test_prompt_logprobs_match_transformers_through_chunks_and_preemption(tiny_ckpt, hf_model, prompts):
    """prompt_logprobs: per prompt token its logprob given the tokens before it (the first: None), with its rank
    and the top N — transformers' log_softmax over the same prompt, gathered over prefill chunks (24 tokens)
    and recorded once when a preempted request is computed again; the generated tokens are those of the same
    engine without them."""
    kw = dict(dtype="float32", kv_dtype="auto", num_blocks=45, max_prefill_tokens=24)
    asks = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, prompt_logprobs=(None if i % 4 == 0 else 2))
            for i, m in enumerate(MAX_TOKENS)]
    eng = make_engine(tiny_ckpt, **kw)
    out = run_staggered(eng, prompts, asks)
    assert sum(eng.requests[r].num_preemptions for r, sp in zip(out, asks) if sp.prompt_logprobs) >= 2
    assert list(out.values()) == list(run_staggered(make_engine(tiny_ckpt, **kw), prompts,
                                                    [greedy(m) for m in MAX_TOKENS]).values())
    checked = 0
    for rid, prompt, sp in zip(out, prompts, asks):
        got = eng.requests[rid].prompt_logprobs
        if sp.prompt_logprobs is None:
            continue
        assert len(got) == len(prompt) and got[0] is None
        if len(prompt) == 1:
            continue
        ref = torch.log_softmax(helpers.hf_logits(hf_model, prompt)[:-1], dim=-1)       # row i scores token i + 1
        target = torch.tensor(prompt[1:])
        ref_lp = ref[torch.arange(len(prompt) - 1), target]
        assert [g.token_id for g in got[1:]] == prompt[1:]
        assert torch.allclose(torch.tensor([g.logprob for g in got[1:]]), ref_lp, atol=1e-3)
        ranks = torch.tensor([g.rank for g in got[1:]])             # 1 + the tokens at least as likely
        assert ((ranks >= (ref > ref_lp[:, None] + 1e-4).sum(-1) + 1) & (ranks <= (ref >= ref_lp[:, None] - 1e-4).sum(-1))).all()
        top = ref.topk(3, dim=-1)
        clear = (top.values[:, 1] - top.values[:, 2] > 1e-3) & (top.values[:, 0] - top.values[:, 1] > 1e-3)
        for i in torch.nonzero(clear).flatten().tolist():
            assert [t for t, _ in got[i + 1].top] == top.indices[i, :2].tolist()
            checked += 1
    assert checked > 50


def _delivered_prompt_logprobs(eng: LLMEngine, prompt: list[int], params: SamplingParams) -> list:
    """Run one request alone -> the prompt logprobs its RequestOutputs carried (what a server sends)."""
    rid = eng.add_request(prompt, params)
    got = None
    while eng.has_unfinished():
        for out in eng.step():
            if out.request_id == rid and out.prompt_logprobs is not None:
                assert got is None, "prompt logprobs delivered twice"
                got = out.prompt_logprobs
    return got


@pytest.mark.parametrize("length", [25, 49, 50])
def test_prompt_logprobs_delivered_when_chunks_leave_the_last_prompt_token_alone(tiny_ckpt, length):
    """A prompt of k x 24 + 1 tokens at --max-prefill-tokens 24 has its last token computed by a decode step
    (the scheduler leaves a lone remaining token to the decodes), so its first token is sampled there: that
    output must carry the prompt logprobs as a prefill's does (they were dropped, so a request's prompt logprobs
    came or went with how the step budget happened to cut its prompt). Oracle: the same prompt prefilled in one
    chunk."""
    kw = dict(dtype="float32", kv_dtype="auto")
    prompt = random_prompt(length, 1024, seed=900 + length)
    sp = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, prompt_logprobs=2)
    want = _delivered_prompt_logprobs(make_engine(tiny_ckpt, max_prefill_tokens=64, **kw), prompt, sp)
    got = _delivered_prompt_logprobs(make_engine(tiny_ckpt, max_prefill_tokens=24, **kw), prompt, sp)
    assert want is not None and len(want) == length and want[0] is None
    assert got is not None and len(got) == length and got[0] is None, length
    assert [g.token_id for g in got[1:]] == prompt[1:]
    assert torch.allclose(torch.tensor([g.logprob for g in got[1:]]), torch.tensor([w.logprob for w in want[1:]]),
                          atol=1e-4)


def _conversations(vocab: int) -> tuple[list[list[int]], list[int]]:
    """Prompts sharing a 37-token system prompt, and one of them again as a second turn (first turn + its
    reply + a new question: the reply's KV was written by decode steps)."""
    system = random_prompt(37, vocab, seed=70)
    firsts = [system + random_prompt(3 + 4 * i, vocab, seed=71 + i) for i in range(5)]
    return firsts, [9 + i for i in range(5)]


@pytest.mark.parametrize("num_blocks", [600, 44], ids=["roomy", "preempting"])
def test_prefix_caching_matches_transformers_and_the_uncached_engine(tiny_ckpt, hf_model, num_blocks):
    """--enable-prefix-caching: requests that start like earlier ones (a shared system prompt, a second turn
    whose first turn and reply are cached) take those blocks instead of computing them (most of their prompt
    tokens are hits), and give transformers' greedy tokens and those of the same engine without the cache, in
    fp32; with a pool small enough to preempt too. Afterwards every block is free (named ones included)."""
    kw = dict(dtype="float32", kv_dtype="auto", num_blocks=num_blocks, max_prefill_tokens=24)
    firsts, lens = _conversations(1024)

    def run(cache: bool) -> tuple[LLMEngine, list[list[int]], list[list[int]]]:
        eng = make_engine(tiny_ckpt, enable_prefix_caching=cache, **kw)
        outs = list(run_staggered(eng, firsts, [greedy(n) for n in lens]).values())
        seconds = [f + o + random_prompt(6, 1024, seed=90 + i) for i, (f, o) in enumerate(zip(firsts, outs))]
        return eng, outs, list(run_staggered(eng, seconds, [greedy(8) for _ in seconds]).values())

    eng, outs, outs2 = run(True)
    plain_eng, plain, plain2 = run(False)
    assert (outs, outs2) == (plain, plain2)
    st = eng.stats
    assert st.prefix_cache_hits >= (0.45 if num_blocks == 600 else 0.2) * st.prefix_cache_queries > 0
    assert st.prefill_tokens < plain_eng.stats.prefill_tokens
    assert st.preemptions > 0 if num_blocks == 44 else st.preemptions == 0
    seconds = [f + o + random_prompt(6, 1024, seed=90 + i) for i, (f, o) in enumerate(zip(firsts, outs))]
    assert helpers.assert_teacher_forced_argmax(hf_model, firsts + seconds, outs + outs2, clear=1e-3) > 30
    assert eng.kv_manager.num_free_blocks == num_blocks - 1


def test_prefix_hit_admitted_with_one_token_of_budget_prefills_it(tiny_ckpt, hf_model):
    """A request whose cached prefix leaves several tokens to compute, admitted with one token of the step's
    prefill budget left (another prompt took the rest), computes its next prompt token as a 1-token prefill
    chunk: not as a decode of its last token at the wrong position (which wrote that KV into a block that
    was then named)."""
    kw = dict(dtype="float32", kv_dtype="auto", max_prefill_tokens=8)
    first = random_prompt(13, 1024, seed=80)
    other = random_prompt(7, 1024, seed=81)
    second = first[:12] + random_prompt(6, 1024, seed=82)          # 12 cached tokens, 6 to compute

    def run(cache: bool) -> tuple[LLMEngine, list[list[int]]]:
        eng = make_engine(tiny_ckpt, enable_prefix_caching=cache, **kw)
        outs = [eng.generate([first], greedy(4))[0].output_ids]
        ids = [eng.add_request(other, greedy(4)), eng.add_request(second, greedy(6))]   # other takes 7 of 8
        while eng.has_unfinished():
            eng.step()
        return eng, outs + [eng.requests[i].output_ids for i in ids]

    eng, outs = run(True)
    assert eng.requests[list(eng.requests)[-1]].num_cached_tokens == 12
    assert outs == run(False)[1]
    assert helpers.assert_teacher_forced_argmax(hf_model, [first, other, second], outs, clear=1e-3) > 8
    assert eng.kv_manager.num_free_blocks == eng.runner.kv.num_blocks - 1


@pytest.mark.parametrize("num_blocks, max_prefill_tokens", [(600, 64), (100, 512)])
def test_warm_up_runs_the_model_and_leaves_nothing_behind(tiny_ckpt, prompts, alone, num_blocks, max_prefill_tokens,
                                                          monkeypatch):
    """`warm_up` builds the prefill projections' GEMMs for a chunk's row counts, runs a prefill chunk and a
    decode step on borrowed blocks (a pool too small for a whole chunk gets a shorter one) and changes nothing
    a request sees: the pool is free again, nothing is counted, and the tokens are those of an engine that
    never warmed up."""
    eng = make_engine(tiny_ckpt, num_blocks=num_blocks, max_prefill_tokens=max_prefill_tokens)
    primed = []
    monkeypatch.setattr(warmup, "prime_row_counts", lambda p, rows: primed.append((p, rows)))
    kv_before = [b.clone() for b in eng.runner.kv.group_bufs]
    calls = []
    for name in ("prefill", "decode"):                      # the runner's two programs, each called once
        fn = getattr(eng.runner, name)
        setattr(eng.runner, name, lambda *a, _fn=fn, _name=name, **k: calls.append((_name, a)) or _fn(*a, **k))
    took = eng.warm_up()
    assert took is not None and took > 0
    assert [c[0] for c in calls] == ["prefill", "decode"]
    lw = eng.runner.weights.layers[0]
    assert len(primed) == 1 and primed[0][1] == max_prefill_tokens
    same = lambda a, b: a.data_ptr() == b.data_ptr() and a.shape == b.shape     # noqa: E731 - the same view
    want = [lw.qkv_w, lw.qkv_b, lw.o_w, lw.o_b, lw.router_w, lw.router_b]
    assert len(primed[0][0]) == 3 and all(map(same, [t for p in primed[0][0] for t in p], want))
    n = len(calls[0][1][0][0].token_ids)
    # many distinct tokens, so the chunk routes over many experts with uneven counts (as a prompt does)
    assert len(set(calls[0][1][0][0].token_ids)) > n // 2
    if num_blocks == 600:
        assert n == max_prefill_tokens
    else:                                                   # halved until its blocks fit the pool
        assert n < max_prefill_tokens and eng.fits_pool(n + 1) and not eng.fits_pool(2 * n + 1)
    assert any(not torch.equal(a, b) for a, b in zip(kv_before, eng.runner.kv.group_bufs))   # KV was written
    assert eng.kv_manager.num_free_blocks == num_blocks - 1 and not eng.requests
    assert eng.stats.prefill_tokens == eng.stats.decode_tokens == eng.stats.steps == 0
    out = run_staggered(eng, prompts[:6], [greedy(m) for m in MAX_TOKENS[:6]])
    assert list(out.values()) == alone[:6]


def test_a_failed_warm_up_leaves_the_engine_serving(tiny_ckpt, prompts, alone, caplog):
    eng = make_engine(tiny_ckpt)
    real_decode = eng.runner.decode

    def decode(*a, **k):
        raise RuntimeError("injected warm-up failure")

    eng.runner.decode = decode
    assert eng.warm_up() is None
    assert "warm-up failed" in caplog.text and "injected warm-up failure" in caplog.text
    assert eng.kv_manager.num_free_blocks == eng.runner.kv.num_blocks - 1 and not eng.requests
    eng.runner.decode = real_decode
    assert eng.generate([prompts[3]], greedy(MAX_TOKENS[3]))[0].output_ids == alone[3]


def test_a_prompt_as_long_as_the_context_runs_in_a_small_pool(tiny_ckpt):
    """The engine admits what its max_model_len advertises: a sliding group holds a prefill chunk and the
    window before it, not the whole prompt, so a prompt filling the context runs in a pool far smaller than
    the whole prompt in every group, with the tokens of a roomy pool. (The admission check once counted the
    whole prompt in every group and refused prompts shorter than max_model_len.)"""
    eng = make_engine(tiny_ckpt, num_blocks=41, max_prefill_tokens=16)
    n = eng.max_model_len - 2
    assert n > 100 and len(eng.runner.kv.config.groups) * cdiv(n + 1, 4) > 40
    prompt = random_prompt(n, 1024, seed=77)
    assert eng.generate([prompt], greedy(2))[0].output_ids == run_alone(tiny_ckpt, prompt, greedy(2))
    assert eng.kv_manager.num_free_blocks == 40
    with pytest.raises(RequestError, match="maximum context length"):
        eng.add_request(prompt + [5], greedy(2))


@pytest.mark.parametrize("max_num_seqs,block_size,max_prefill_tokens", [(1, 16, 512), (1, 6, 100), (3, 4, 37)])
def test_the_default_pool_holds_the_whole_context(tiny_ckpt, max_num_seqs, block_size, max_prefill_tokens):
    """Without --num-blocks the pool is sized for max_num_seqs full-length sequences, and a lone request can
    reach max_position_embeddings: the sliding group's prefill chunk on top of its window is counted (it once
    was not, and one sequence's pool advertised a context 512 tokens short)."""
    eng = make_engine(tiny_ckpt, num_blocks=None, max_num_seqs=max_num_seqs, block_size=block_size,
                      max_prefill_tokens=max_prefill_tokens)
    assert eng.max_model_len == eng.cfg.max_position_embeddings
    per_seq = sum(cdiv(eng.cfg.sliding_window - 1, block_size) + 1 if isinstance(g.spec, SlidingWindowSpec)
                  else cdiv(eng.max_model_len, block_size) for g in eng.runner.kv.config.groups)
    assert eng.runner.kv.num_blocks - 1 >= max_num_seqs * per_seq     # and still max_num_seqs sequences


@pytest.mark.parametrize("block_size", [16, 6])
def test_max_model_len_caps_the_context_and_sizes_the_default_pool(tiny_ckpt, block_size):
    """`--max-model-len` (vLLM's flag): requests past it are refused by name, one that fills it runs, and the
    default pool is sized for max_num_seqs sequences of that length, not of max_position_embeddings."""
    full = make_engine(tiny_ckpt, num_blocks=None, max_num_seqs=2, block_size=block_size)
    eng = make_engine(tiny_ckpt, num_blocks=None, max_num_seqs=2, block_size=block_size, max_model_len=97)
    assert eng.max_model_len == 97 and full.max_model_len == full.cfg.max_position_embeddings > 97
    assert eng.runner.kv.num_blocks < full.runner.kv.num_blocks
    prompt = random_prompt(90, 1024, seed=5)
    assert eng.generate([prompt], greedy(7))[0].output_ids == run_alone(tiny_ckpt, prompt, greedy(7),
                                                                         block_size=block_size)
    with pytest.raises(RequestError, match="maximum context length is 97 tokens"):
        eng.add_request(prompt, greedy(8))
    with pytest.raises(RequestError, match="this engine's context is 97 tokens"):
        eng.add_request(random_prompt(97, 1024, seed=6), greedy(1))


def test_max_model_len_past_the_model_or_the_pool_is_refused(tiny_ckpt):
    """A --max-model-len the model cannot reach (past max_position_embeddings) or the given pool cannot hold
    is a start-up error naming both numbers, never a silently shorter context."""
    most = make_engine(tiny_ckpt, num_blocks=8).cfg.max_position_embeddings
    with pytest.raises(ConfigError, match=f"--max-model-len {most + 1} is longer than the model's context: "
                                          f"config.json has max_position_embeddings={most}"):
        make_engine(tiny_ckpt, max_model_len=most + 1)
    with pytest.raises(ConfigError, match=r"--max-model-len 200: one request of 200 tokens needs \d+ KV blocks "
                                          r"of 4 tokens, but the pool has 7 \(it holds \d+ tokens\)"):
        make_engine(tiny_ckpt, num_blocks=8, max_model_len=200)
    assert make_engine(tiny_ckpt, num_blocks=8, max_model_len=12).max_model_len == 12
    # a pool that holds no request at all is a start-up error, not an engine that refuses every prompt
    with pytest.raises(ConfigError, match=r"the KV pool \(1 blocks of 4 tokens\) cannot hold one request of 2 "
                                          r"tokens; raise --num-blocks"):
        make_engine(tiny_ckpt, num_blocks=2)


def test_seeded_sampling_is_per_request(tiny_ckpt, prompts):
    sp = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=1234, max_tokens=16, ignore_eos=True)
    solo = run_alone(tiny_ckpt, prompts[5], sp)
    eng = make_engine(tiny_ckpt)
    others = [SamplingParams(temperature=1.0, seed=s, max_tokens=10, ignore_eos=True) for s in (1, 2, None)]
    out = run_staggered(eng, [prompts[0], prompts[9], prompts[5], prompts[12]], [others[0], others[1], sp, others[2]])
    assert list(out.values())[2] == solo
    assert solo != run_alone(tiny_ckpt, prompts[5], SamplingParams(**{**sp.__dict__, "seed": 99}))


def test_engine_seed_makes_unseeded_runs_reproducible(tiny_ckpt, prompts):
    """--seed (vLLM's): sampled requests without a seed draw theirs from it in arrival order, so the same
    requests give the same tokens run after run, batched together or one at a time, and another --seed other
    tokens; a request's own seed and greedy requests are untouched (they draw nothing from it)."""
    sp = [SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True),
          SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
          SamplingParams(temperature=0.9, top_k=40, max_tokens=12, ignore_eos=True),
          SamplingParams(temperature=1.0, seed=77, max_tokens=12, ignore_eos=True)]
    ps = [prompts[0], prompts[9], prompts[5], prompts[12]]

    def together(seed):
        return [r.output_ids for r in make_engine(tiny_ckpt, seed=seed).generate(ps, sp)]

    def one_by_one(seed):
        eng = make_engine(tiny_ckpt, seed=seed)
        return [eng.generate([p], q)[0].output_ids for p, q in zip(ps, sp)]

    a = together(3)
    assert a == together(3) == one_by_one(3)
    b = together(4)
    assert b[0] != a[0] and b[2] != a[2] and b[1] == a[1] and b[3] == a[3]
    assert a[3] == run_alone(tiny_ckpt, ps[3], sp[3])                    # its own seed, as without --seed
    with pytest.raises(ConfigError, match="--seed must be an integer"):
        make_engine(tiny_ckpt, seed=-1)


def test_a_refused_request_draws_no_seed_from_the_engines(tiny_ckpt, prompts):
    """--seed: a request the engine refuses (here kv_transfer_params with prompt_logprobs, refused after the
    sampling checks) was never queued, so it draws no seed: the unseeded requests after it sample what they
    sample without it. It drew one before its refusal, and every later request's tokens shifted."""
    sp = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    bad = SamplingParams(temperature=1.0, max_tokens=4, prompt_logprobs=0)
    eng = make_engine(tiny_ckpt, seed=3)
    with pytest.raises(RequestError, match="prompt_logprobs"):
        eng.add_request(prompts[1], bad, kv_transfer_params={"do_remote_prefill": True})
    assert not eng.requests
    got = [r.output_ids for r in eng.generate([prompts[0], prompts[5]], sp)]
    assert got == [r.output_ids for r in make_engine(tiny_ckpt, seed=3).generate([prompts[0], prompts[5]], sp)]


def test_invalid_requests_are_refused_and_others_served(tiny_ckpt, prompts, alone):
    eng = make_engine(tiny_ckpt)
    good = eng.add_request(prompts[3], greedy(MAX_TOKENS[3]))
    eng.step()
    with pytest.raises(SamplingError, match="temperature"):
        eng.add_request(prompts[1], SamplingParams(temperature=-1.0))
    with pytest.raises(SamplingError, match="top_p"):
        eng.add_request(prompts[1], SamplingParams.from_dict({"top_p": 1.5}))
    with pytest.raises(RequestError, match="vocabulary"):
        eng.add_request([5, 1024], greedy(3))
    with pytest.raises(RequestError, match="empty"):
        eng.add_request([], greedy(3))
    with pytest.raises(RequestError, match="context"):
        eng.add_request([5] * 5000, greedy(3))
    with pytest.raises(SamplingError, match="stop_token_ids"):
        eng.add_request(prompts[1], SamplingParams(stop_token_ids=[4096]))
    with pytest.raises(RequestError, match="already in use"):
        eng.add_request(prompts[1], greedy(3), request_id=good)
    while eng.has_unfinished():
        eng.step()
    assert eng.requests[good].output_ids == alone[3]


def test_abort_frees_blocks(tiny_ckpt, prompts):
    eng = make_engine(tiny_ckpt)
    a = eng.add_request(prompts[14], greedy(30))
    b = eng.add_request(prompts[13], greedy(5))
    eng.step()
    eng.step()
    assert eng.abort(a)
    assert eng.requests[a].finish_reason == "abort"
    assert not eng.abort(a)
    while eng.has_unfinished():
        eng.step()
    assert eng.requests[b].finish_reason == "length"
    assert eng.kv_manager.num_free_blocks == eng.runner.kv.num_blocks - 1


def test_stop_tokens_and_eos(tiny_ckpt, prompts, alone):
    ref = alone[0]
    stop_at = ref[4]
    first = ref.index(stop_at)
    eng = make_engine(tiny_ckpt)
    r = eng.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[stop_at]))[0]
    assert r.output_ids == ref[: first + 1] and r.finish_reason == "stop"


@pytest.mark.parametrize("min_tokens", [0, 1, 5])
def test_min_tokens_suppresses_eos_then_honours_it(tiny_ckpt, prompts, alone, min_tokens):
    """EOS is made the argmax at every step (logit_bias +100). While fewer than `min_tokens` tokens were
    generated it is masked, so the greedy tokens without it come out (the unbiased greedy run's, which holds
    no EOS there); the very next token is EOS, and it ends the request ("stop", EOS included). With
    ignore_eos, EOS is an ordinary token (vLLM's rule: min_tokens then masks only the stop ids): it comes out
    at every step, min_tokens or not, and ends nothing."""
    eng = make_engine(tiny_ckpt)
    ref = alone[0]                                         # greedy, ignore_eos, 20 tokens
    eos = eng.eos_token_ids[0]
    assert not set(ref[:5]) & set(eng.eos_token_ids)
    sp = SamplingParams(temperature=0.0, max_tokens=20, min_tokens=min_tokens, logit_bias={eos: 100.0})
    r = eng.generate([prompts[0]], sp)[0]
    assert r.output_ids == ref[:min_tokens] + [eos] and r.finish_reason == "stop"
    r = eng.generate([prompts[0]], SamplingParams(**{**sp.__dict__, "ignore_eos": True, "max_tokens": 8}))[0]
    assert r.output_ids == [eos] * 8 and r.finish_reason == "length"


@pytest.mark.parametrize("min_tokens", [0, 3])
def test_min_tokens_suppresses_stop_token_ids(tiny_ckpt, prompts, alone, min_tokens):
    """The same for a stop token id: masked below `min_tokens`, then it stops the request."""
    eng = make_engine(tiny_ckpt)
    ref = alone[0]
    stop_at = next(t for t in range(3, 1024) if t not in ref)
    r = eng.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=20, min_tokens=min_tokens,
                                                  stop_token_ids=[stop_at], logit_bias={stop_at: 100.0}))[0]
    assert r.output_ids == ref[:min_tokens] + [stop_at] and r.finish_reason == "stop"


def test_reference_decoder_gives_same_tokens(tiny_ckpt, prompts, alone):
    eng = make_engine(tiny_ckpt, decoder="reference", gk_decode=False)
    outs = eng.generate(prompts[:6], [greedy(m) for m in MAX_TOKENS[:6]])
    assert [r.output_ids for r in outs] == alone[:6]


def test_logprobs(tiny_ckpt, prompts):
    eng = make_engine(tiny_ckpt)
    r = eng.generate([prompts[2]], SamplingParams(temperature=0.0, max_tokens=4, logprobs=3, ignore_eos=True))[0]
    assert len(r.output_logprobs) == 4
    for tok, lp in zip(r.output_ids, r.output_logprobs):
        assert lp.token_id == tok and lp.rank == 1 and len(lp.top) == 3 and lp.top[0][0] == tok
        assert lp.logprob <= 0.0 and torch.isfinite(torch.tensor(lp.logprob))


def test_a_failing_phase_fails_only_its_own_requests(tiny_ckpt):
    """A decode batch that raises fails the requests in that batch, never the one prefilling beside it (and
    vice versa); the engine keeps serving and frees every block."""
    eng = make_engine(tiny_ckpt, max_prefill_tokens=8)
    decoding, prefilling = random_prompt(6, 1024, seed=91), random_prompt(60, 1024, seed=92)
    d = eng.add_request(decoding, greedy(30))
    for _ in range(3):                              # d is decoding now
        eng.step()
    p = eng.add_request(prefilling, greedy(10))      # 60 tokens in chunks of 8: prefills for 8 steps
    real_decode = eng.runner.decode
    calls = {"n": 0}

    def flaky(seqs, *a, **kw):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected decode failure")
        return real_decode(seqs, *a, **kw)

    eng.runner.decode = flaky
    while eng.has_unfinished():
        eng.step()
    assert eng.requests[d].finish_reason == "error" and "injected decode failure" in eng.requests[d].error
    assert eng.requests[p].error is None
    assert eng.requests[p].output_ids == run_alone(tiny_ckpt, prefilling, greedy(10), max_prefill_tokens=8)
    assert eng.stats.step_failures == 1 and eng.kv_manager.num_free_blocks == 599

    real_prefill = eng.runner.prefill
    eng.runner.decode = real_decode
    d = eng.add_request(decoding, greedy(30))
    for _ in range(3):
        eng.step()
    eng.runner.prefill = lambda chunks: (_ for _ in ()).throw(RuntimeError("injected prefill failure"))
    p = eng.add_request(prefilling, greedy(10))
    eng.step()
    eng.runner.prefill = real_prefill
    while eng.has_unfinished():
        eng.step()
    assert eng.requests[p].finish_reason == "error" and "injected prefill failure" in eng.requests[p].error
    assert eng.requests[d].output_ids == run_alone(tiny_ckpt, decoding, greedy(30), max_prefill_tokens=8)
    assert eng.kv_manager.num_free_blocks == 599
