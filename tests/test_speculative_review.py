"""Speculative decoding, adversarially: configs and request shapes the main tests (test_speculative.py) do not
have — sliding windows shorter than the drafts, block sizes of 1 and 3, one and three layers, odd vocabularies,
top-1 routing, dense bf16 experts — and what a step of several tokens a request means past the engine (the
server's stop strings)."""

from __future__ import annotations

import random

import pytest

from gigadecode.request import RequestOutput
from gigadecode.server.outputs import Choice, StopMatcher, TextRenderer
from gigadecode.tokenizer import TextCodec


class _Stream:
    def __init__(self) -> None:
        self.closed = False

    def close(self, *_a) -> None:
        self.closed = True


def _choice(codec, stops, min_tokens=0) -> Choice:
    return Choice(0, 0, _Stream(), [1, 2], TextRenderer(codec), StopMatcher(stops), min_tokens=min_tokens)


@pytest.mark.parametrize("min_tokens", [0, 2])
def test_a_stop_string_inside_a_steps_tokens_cuts_there(tiny_ckpt, min_tokens):
    """With drafts a step gives a request several tokens at once; a stop string that ends in the first of them
    must leave the choice where plain decoding (one token a step) leaves it: the same token ids, logprobs and
    usage, not the tokens sampled after the stop in the same step."""
    codec = TextCodec.from_dir(tiny_ckpt)
    rng = random.Random(3)
    while True:
        ids = [rng.randrange(3, 1000) for _ in range(6)]
        texts = [codec.decode([t]) for t in ids]
        if all(len(t) >= 2 for t in texts) and texts[2] not in "".join(texts[:2]):
            break
    stop = texts[2][-2:] if len(texts[2]) >= 2 else texts[2]
    lps = [f"lp{i}" for i in range(6)]
    one = _choice(codec, [stop], min_tokens)
    for i, t in enumerate(ids):
        one.absorb(RequestOutput("r", [t], False, new_logprobs=[lps[i]]))
        if one.done:
            break
    assert one.done and one.finish_reason == "stop"
    many = _choice(codec, [stop], min_tokens)
    many.absorb(RequestOutput("r", ids[:1], False, new_logprobs=lps[:1]))
    many.absorb(RequestOutput("r", ids[1:5], False, new_logprobs=lps[1:5]))      # a step with 3 accepted drafts
    assert many.done and many.finish_reason == "stop" and many.stream.closed
    assert (many.token_ids, many.logprobs, many.text()) == (one.token_ids, one.logprobs, one.text())
    # what a streamed chunk sends of that output (its token ids and logprobs): only what the choice kept
    assert (many.new_ids, many.new_logprobs) == (one.token_ids[1:], one.logprobs[1:])


@pytest.mark.parametrize("raw, words", [
    ('{"method": "ngram", "num_speculative_tokens": null}', "num_speculative_tokens"),
    ('{"method": null, "num_speculative_tokens": 2}', "method"),
])
def test_config_nulls_are_refused_with_a_config_error(raw, words):
    """A JSON null for a required field is the flag's error (ConfigError, which the CLI reports), not a
    TypeError from the dataclass, nor a silently assumed method."""
    from gigadecode.config import ConfigError
    from gigadecode.speculative import SpeculativeConfig
    with pytest.raises(ConfigError, match=words):
        SpeculativeConfig.parse(raw)


# -- the engine on configs the main tests do not have -------------------------------------------------------

F, S = "full_attention", "sliding_attention"
ODD = {
    # a window of 2 (shorter than the 1 + 4 rows of a verify step), top-1 routing, an odd vocabulary
    "window2-top1": (dict(layer_types=(S, F), sliding_window=2, vocab_size=517, num_experts_per_tok=1), "mxfp4"),
    # three layers, a window of 3, head dim 24 (no power of two)
    "three-layers": (dict(layer_types=(S, F, S), sliding_window=3, vocab_size=389, head_dim=24), "mxfp4"),
    # one sliding layer of window 2, dense bf16 experts (gk-native's eager expert loop), top-1
    "one-layer-bf16": (dict(layer_types=(S,), sliding_window=2, vocab_size=1021, num_experts_per_tok=1), "bf16"),
}


@pytest.fixture(scope="module")
def odd_ckpts(tmp_path_factory):
    from gigadecode.checkpoint import make_checkpoint, preset_config
    root = tmp_path_factory.mktemp("spec-odd")
    out = {}
    for name, (over, experts) in ODD.items():
        cfg = preset_config("tiny", experts).with_(num_hidden_layers=len(over["layer_types"]), **over)
        out[name] = make_checkpoint(root / name, cfg=cfg, seed=7, experts=experts)
    return out


def _engine(ckpt, spec=None, **kw):
    from gigadecode.engine import LLMEngine
    from gigadecode.engine_config import EngineConfig
    from gigadecode.runner import ModelRunner
    from .test_engine import _weights
    cfg, w = _weights(str(ckpt))
    ecfg = EngineConfig(**{"dtype": "float32", "kv_dtype": "auto", "block_size": 2, "num_blocks": 300,
                           "speculative": spec, **kw})
    return LLMEngine(ModelRunner(ckpt, ecfg, cfg=cfg, weights=w))


def _run(eng, prompts, params, staggered=True, abort=None):
    """-> id: (tokens, finish reason, logprobs); `abort`: id -> the step after which it is aborted."""
    ids, pending, step = [], list(zip(prompts, params)), 0
    while pending or eng.has_unfinished():
        if pending and (not staggered or step % 2 == 0):
            for p, sp in pending[: 1 if staggered else len(pending)]:
                ids.append(eng.add_request(p, sp, request_id=f"r{len(ids)}"))
            del pending[: 1 if staggered else len(pending)]
        eng.step()
        step += 1
        for rid, at in (abort or {}).items():
            if at == step and rid in eng.requests:
                eng.abort(rid)
    return {i: (list(eng.requests[i].output_ids), eng.requests[i].finish_reason,
                [(lp.token_id, lp.logprob) for lp in eng.requests[i].output_logprobs]) for i in ids}


def _assert_same(got, want):
    """Tokens and finish reasons exactly; logprobs to float noise (plain fp32 decoding itself moves them by
    ~1e-6 with the batch's shape)."""
    assert got.keys() == want.keys()
    for i in want:
        assert got[i][:2] == want[i][:2], i
        assert [t for t, _ in got[i][2]] == [t for t, _ in want[i][2]], i
        assert all(abs(a - b) < 1e-4 for (_, a), (_, b) in zip(got[i][2], want[i][2])), i


def _spec_equals_plain(ckpt, prompts, params, k, wrong, seed=0, staggered=True, abort=None, setup=None, **kw):
    from gigadecode.speculative import SpeculativeConfig
    from .test_speculative import OracleProposer
    plain_eng = _engine(ckpt, **kw)
    plain = _run(plain_eng, prompts, params, staggered, abort)
    eng = _engine(ckpt, SpeculativeConfig(num_speculative_tokens=k), **kw)
    vocab = eng.cfg.vocab_size
    eng.scheduler.proposer = OracleProposer({i: o for i, (o, _, _) in plain.items()}, k, wrong, vocab, seed)
    if setup is not None:
        setup(eng)
    got = _run(eng, prompts, params, staggered, abort)
    if abort:
        for rid in abort:         # when an abort lands depends on the tokens a step makes: a prefix either way
            (g, gr, _), (w, wr, _) = got.pop(rid), plain.pop(rid)
            n = min(len(g), len(w))
            assert gr == wr == "abort" and g[:n] == w[:n]
    _assert_same(got, plain)
    s = eng.stats
    assert s.spec_draft_tokens > 0 and s.spec_accepted_tokens <= s.spec_draft_tokens
    assert wrong == 1.0 or s.spec_accepted_tokens > 0
    if not (abort or s.preemptions or plain_eng.stats.preemptions):   # a recompute makes some tokens in prefill
        assert s.decode_tokens == plain_eng.stats.decode_tokens
    assert eng.kv_manager.num_free_blocks == eng.runner.kv.num_blocks - 1
    return eng, plain_eng


def _mix(vocab: int):
    from gigadecode.sampling import SamplingParams
    return [SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True, logprobs=1),
            SamplingParams(temperature=0.9, seed=3, max_tokens=12, ignore_eos=True, logprobs=2),
            SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=2),
            SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
            SamplingParams(temperature=1.0, seed=5, max_tokens=15, min_tokens=5, presence_penalty=0.5,
                           stop_token_ids=tuple(range(3, vocab, 7)))]


@pytest.mark.parametrize("decoder, block_size, kv_dtype", [("gk-native", 1, "auto"), ("gk-native", 2, "fp8"),
                                                           ("gk", 3, "auto"), ("reference", 1, "auto")])
@pytest.mark.parametrize("name", ODD)
def test_drafts_on_odd_configs(odd_ckpts, name, decoder, block_size, kv_dtype):
    """Windows of 2 and 3 under verify steps of 5 rows, blocks of 1 to 3 tokens (a row's position crosses
    blocks its request got for the drafts alone), one and three layers, top-1, dense bf16 experts: the tokens
    of plain decoding, every block back in the pool."""
    from .helpers import random_prompt
    ckpt = odd_ckpts[name]
    vocab = ODD[name][0]["vocab_size"]
    prompts = [random_prompt(n, vocab, seed=n) for n in (1, 5, 11, 2, 7)]
    _spec_equals_plain(ckpt, prompts, _mix(vocab), k=4, wrong=0.3, decoder=decoder, gk_decode=decoder != "reference",
                       block_size=block_size, kv_dtype=kv_dtype)


@pytest.mark.parametrize("decoder", ["gk-native", "gk"])
def test_a_requests_rows_split_across_gk_calls(odd_ckpts, decoder):
    """More rows than the largest batch bucket (the scheduler plans no more than it; the runner still takes
    them): a request's token and 6 drafts run as GK calls of 3, 3 and 1 rows, in order, and give the logits of
    the same tokens decoded one step at a time, under a window of 2 with blocks of 1."""
    import torch
    from gigadecode.engine_config import EngineConfig
    from gigadecode.kv.manager import KVCacheManager
    from gigadecode.model import SeqChunk
    from gigadecode.runner import DecodeSeq, ModelRunner
    from .helpers import random_prompt
    runner = ModelRunner(odd_ckpts["window2-top1"], EngineConfig(decoder=decoder, batch_buckets=(1, 3), block_size=1,
                                                                 kv_dtype="auto", num_blocks=100))
    mgr = KVCacheManager(runner.kv.config, 1)
    prompt, toks = random_prompt(9, 517, seed=3), random_prompt(7, 517, seed=4)
    tables = {}
    for rid in ("drafts", "steps"):                       # each its own blocks: neither reads the other's KV
        assert mgr.allocate(rid, len(prompt) + len(toks), 0)
        tables[rid] = mgr.block_tables(rid)
        runner.prefill([SeqChunk(prompt, 0, tables[rid], "none")])
    many = runner.decode([DecodeSeq(toks[0], len(prompt), tables["drafts"], tuple(toks[1:]))])
    one = torch.cat([runner.decode([DecodeSeq(t, len(prompt) + j, tables["steps"])]) for j, t in enumerate(toks)])
    assert many.shape == one.shape == (len(toks), 517)
    torch.testing.assert_close(many, one, rtol=0, atol=1e-5)


def test_context_boundary_eos_in_drafts_and_aborts(odd_ckpts):
    """Prompts of max_model_len - 1 and - 2 tokens (no room for a draft) and shorter ones that run to the very
    end of the context; EOS and stop ids met inside accepted drafts, held back by min_tokens until then;
    requests aborted between steps; KV of every kind back in the pool."""
    from gigadecode.sampling import SamplingParams
    from .helpers import random_prompt
    ckpt = odd_ckpts["three-layers"]
    mml = 13
    prompts = [random_prompt(n, 389, seed=n) for n in (mml - 1, mml - 2, mml - 6, 1, 3, 2, 2)]
    params = [SamplingParams(temperature=0.0, max_tokens=mml - len(p), ignore_eos=True) for p in prompts[:4]]
    params += [SamplingParams(temperature=0.0, max_tokens=10, min_tokens=4, logit_bias=((2, 30.0),)),   # eos id 2
               SamplingParams(temperature=0.8, seed=1, max_tokens=10, min_tokens=3,
                              stop_token_ids=tuple(range(3, 389, 2))),
               SamplingParams(temperature=0.0, max_tokens=11, ignore_eos=True)]
    eng, plain = _spec_equals_plain(ckpt, prompts, params, k=6, wrong=0.25, max_model_len=mml, block_size=2,
                                    num_blocks=60, staggered=False, abort={"r6": 2})
    assert eng.max_model_len == mml
    fin = {i: r.finish_reason for i, r in plain.requests.items()}
    assert fin["r4"] == "stop" and fin["r5"] == "stop" and len(plain.requests["r4"].output_ids) >= 4


def test_drafts_against_a_grammar_same_prompts_and_a_tight_shared_cache(tmp_path):
    """Structured output (a regex and a JSON schema, greedy and seeded, one held at the grammar's end by
    min_tokens) with drafts that mostly break the grammar; the same prompt four times with prompt logprobs on
    one; prefix caching in a pool tight enough to preempt: plain decoding's tokens, all blocks back."""
    import json
    from gigadecode.checkpoint import make_checkpoint
    from gigadecode.sampling import SamplingParams
    from gigadecode.tokenizer import TextCodec
    ckpt = make_checkpoint(tmp_path / "demo", "demo")
    prompt = TextCodec.from_dir(ckpt).encode("Give me a code: ")
    schema = json.dumps({"type": "object", "properties": {"sum": {"type": "integer"}, "ok": {"type": "boolean"}},
                         "required": ["sum", "ok"], "additionalProperties": False})
    params = [SamplingParams(temperature=0.0, max_tokens=20, guided=("regex", r"[0-9]{3}-[a-z]{2,4}", "all")),
              SamplingParams(temperature=1.0, seed=4, max_tokens=20, guided=("regex", r"[0-9]{3}-[a-z]{2,4}", "all")),
              SamplingParams(temperature=0.0, max_tokens=40, guided=("json", schema, "all")),
              SamplingParams(temperature=1.0, seed=9, max_tokens=40, guided=("json", schema, "all"), min_tokens=3),
              SamplingParams(temperature=0.0, max_tokens=12, guided=("regex", r"[a-c]{3}", "all"), ignore_eos=True,
                             min_tokens=8),
              SamplingParams(temperature=0.7, seed=2, max_tokens=16, ignore_eos=True, prompt_logprobs=1)]
    for wrong in (0.5, 1.0):                  # 1.0: every draft changed, most of them off the grammar
        eng, _ = _spec_equals_plain(ckpt, [prompt] * len(params), params, k=4, wrong=wrong, staggered=False,
                                    block_size=4, num_blocks=200)
        assert len(eng.requests["r5"].prompt_logprobs) == len(prompt)
    # prefix caching, the same prompt again and again, a pool that preempts
    prompts = [prompt + [7, 8, 9]] * 4 + [prompt]
    params = [SamplingParams(temperature=0.9, seed=s, max_tokens=24, ignore_eos=True) for s in range(4)]
    params.append(SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    eng, plain = _spec_equals_plain(ckpt, prompts, params, k=4, wrong=0.3, block_size=2, num_blocks=40,
                                    enable_prefix_caching=True)
    assert plain.stats.preemptions > 0 and eng.stats.prefix_cache_hits > 0


@pytest.mark.parametrize("prefix_caching, num_blocks", [(False, 26), (True, 32)])
def test_no_preemption_while_rejected_drafts_hold_blocks(odd_ckpts, prefix_caching, num_blocks):
    """Drafts take only blocks left free, and speculation never preempts anyone: a request whose drafts were
    rejected keeps their blocks for its next drafts, but when another request cannot grow they go back to
    the pool before anyone is preempted."""
    from gigadecode.kv.spec import cdiv
    from gigadecode.sampling import SamplingParams
    from .helpers import random_prompt
    ckpt = odd_ckpts["three-layers"]
    prompts = [random_prompt(n, 389, seed=40 + n) for n in (9, 14, 5, 11, 7, 3, 12, 6)]
    params = [SamplingParams(temperature=0.9 if i % 2 else 0.0, seed=i, max_tokens=10, ignore_eos=True)
              for i in range(len(prompts))]
    leftovers = []

    def watch(eng):
        sch, preempt = eng.scheduler, eng.scheduler.preempt

        def checked(req):
            leftovers.append(sum(max(0, len(m.tables.get(r.request_id, [])) - cdiv(r.num_tokens, m.block_size))
                                 for r in sch.running for m in eng.kv_manager.managers))
            preempt(req)
        sch.preempt = checked

    eng, plain = _spec_equals_plain(ckpt, prompts, params, k=4, wrong=0.5, setup=watch, block_size=2,
                                    num_blocks=num_blocks, max_prefill_tokens=4, enable_prefix_caching=prefix_caching)
    assert plain.stats.preemptions > 0 and leftovers and not any(leftovers), leftovers
