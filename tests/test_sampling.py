"""Sampling: the distributed argmax equals torch.argmax, seeded sampling is batch-independent, and each
filter / penalty / logprob does what vLLM does, on constructed cases. All CPU, all fast."""

from __future__ import annotations

import math

import pytest
import torch

from gigadecode.argmax import NO_INDEX, greedy, reduce_argmax, shard_argmax, vocab_shard
from gigadecode.sampling import (
    NO_TOKEN_LEFT,
    NON_FINITE,
    Sampler,
    SamplingError,
    SamplingParams,
    make_generator,
)

SHARDS = (1, 2, 3, 4, 7)


# --------------------------------------------------------------------------------------------------
# distributed argmax
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("num_shards", SHARDS)
@pytest.mark.parametrize("vocab", [1000, 1001])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_matches_argmax_random(num_shards, vocab, dtype):
    g = torch.Generator().manual_seed(vocab * 10 + num_shards)
    logits = torch.randn(16, vocab, generator=g).to(dtype)        # bf16 makes many ties
    assert torch.equal(greedy(logits, num_shards), torch.argmax(logits, dim=-1))


def _tie_rows(v: int, shard: int) -> torch.Tensor:
    inf = math.inf
    rows = [
        torch.zeros(v),                                            # all equal
        torch.full((v,), -inf),                                    # all -inf
        torch.full((v,), 3.0),
    ]
    r = torch.zeros(v); r[0] = r[-1] = 1.0; rows.append(r)        # max at both ends
    r = torch.zeros(v); r[-1] = 1.0; rows.append(r)                # max only at the end
    r = torch.full((v,), -inf); r[-1] = -5.0; rows.append(r)       # -inf except the last
    r = torch.full((v,), -inf); r[min(shard, v - 1)] = r[-1] = 0.0; rows.append(r)
    for b in range(shard, v, shard):                               # ties straddling each shard boundary
        r = torch.randn(v) - 10; r[b - 1] = r[b] = 2.0; rows.append(r)
        r = torch.randn(v) - 10; r[b] = r[min(b + 1, v - 1)] = 2.0; rows.append(r)   # inside a shard
    r = torch.zeros(v); r[1] = -0.0; r[0] = -1.0; rows.append(r)   # -0.0 == 0.0
    r = torch.tensor([float(i % 3) for i in range(v)]); rows.append(r)   # the max repeats in every shard
    return torch.stack(rows)


@pytest.mark.parametrize("num_shards", (1, 2, 3, 4, 5, 12, 13, 20))
def test_greedy_ties_and_neg_inf(num_shards):
    v = 12
    logits = _tie_rows(v, -(-v // num_shards))
    assert torch.equal(greedy(logits, num_shards), torch.argmax(logits, dim=-1))


@pytest.mark.parametrize("num_shards", (1, 2, 3, 4))
def test_greedy_nan_like_torch_argmax(num_shards):
    logits = torch.randn(4, 10)
    logits[0, 7] = math.nan
    logits[1, 2] = logits[1, 8] = math.nan
    logits[2, :] = math.nan
    logits[3, 9] = math.nan
    assert torch.equal(greedy(logits, num_shards), torch.argmax(logits, dim=-1))


def test_shard_and_reduce_as_ranks_do():
    """What ranks do: shard_argmax on their slice, all_gather (a list of [B] tensors), reduce."""
    logits = torch.randn(5, 103)
    logits[0, 50] = logits[0, 51] = 9.0                           # tie at the 2-shard boundary (52 | 51)
    vals, idxs = [], []
    for rank in range(2):
        start, stop = vocab_shard(103, 2, rank)
        v, i = shard_argmax(logits[:, start:stop], start)
        assert v.shape == i.shape == (5,) and i.dtype == torch.int64
        vals.append(v), idxs.append(i)
    assert vocab_shard(103, 2, 0) == (0, 52) and vocab_shard(103, 2, 1) == (52, 103)
    assert torch.equal(reduce_argmax(vals, idxs), torch.argmax(logits, dim=-1))
    assert torch.equal(reduce_argmax(torch.stack(vals), torch.stack(idxs)), torch.argmax(logits, dim=-1))


def test_empty_shard_never_wins():
    v, i = shard_argmax(torch.empty(3, 0), 10)
    assert torch.all(v == -math.inf) and torch.all(i == NO_INDEX)
    full = torch.full((3, 4), -math.inf)
    v0, i0 = shard_argmax(full, 0)
    assert torch.equal(reduce_argmax([v, v0], [i, i0]), torch.zeros(3, dtype=torch.int64))
    assert vocab_shard(5, 4, 3) == (5, 5)                          # ceil(5/4)=2: shards 2,2,1,0


# --------------------------------------------------------------------------------------------------
# Sampler: reproducibility
# --------------------------------------------------------------------------------------------------
V = 64
_W = torch.randn(V, V, generator=torch.Generator().manual_seed(123)) * 3    # a toy "model"


def _logits(history: list[int]) -> torch.Tensor:
    return _W[history[-1]]                                                   # [V]


def _run(params: list[SamplingParams], prompts: list[list[int]], steps: int) -> list[list[int]]:
    sampler = Sampler()
    gens = [make_generator(p.seed) for p in params]
    outs: list[list[int]] = [[] for _ in params]
    for _ in range(steps):
        hist = [pr + o for pr, o in zip(prompts, outs)]
        logits = torch.stack([_logits(h) for h in hist])                     # [B, V]
        res = sampler.sample(logits, params, gens, hist, outs)
        for o, t in zip(outs, res.token_ids.tolist()):
            o.append(t)
    return outs


def test_seeded_request_is_batch_independent():
    target = SamplingParams(temperature=0.9, top_p=0.9, top_k=30, min_p=0.01, seed=7,
                            repetition_penalty=1.1, frequency_penalty=0.2, presence_penalty=0.1, max_tokens=20)
    prompt = [3, 5, 9]
    alone = _run([target], [prompt], 20)[0]
    others = [
        SamplingParams(temperature=1.3, seed=1),
        SamplingParams(temperature=0.5, top_k=5),                                    # unseeded
        SamplingParams(temperature=0.0),                                             # greedy
        SamplingParams(temperature=1.0, top_p=0.5, seed=99, repetition_penalty=1.5),
        SamplingParams(temperature=0.7, min_p=0.2),                                  # unseeded
    ]
    torch.manual_seed(0)
    batch = others[:2] + [target] + others[2:]
    prompts = [[1], [2, 2], prompt, [7], [8, 8, 8], [11]]
    batched = _run(batch, prompts, 20)[2]
    torch.manual_seed(1)                                          # other unseeded draws: still the same
    batched2 = _run(list(reversed(batch)), list(reversed(prompts)), 20)[3]
    assert alone == batched == batched2
    assert len(set(alone)) > 3                                    # it really sampled


def test_generator_none_for_no_seed():
    assert make_generator(None) is None
    a, b = make_generator(5), make_generator(5)
    assert torch.equal(torch.rand(3, generator=a), torch.rand(3, generator=b))


# --------------------------------------------------------------------------------------------------
# Sampler: greedy and filters
# --------------------------------------------------------------------------------------------------
def _separated(b: int, v: int, seed: int = 0) -> torch.Tensor:
    """Random logits whose top-1 beats top-2 by >= 0.5."""
    x = torch.randn(b, v, generator=torch.Generator().manual_seed(seed))
    x[torch.arange(b), x.argmax(-1)] += 0.5
    return x


@pytest.mark.parametrize("p", [SamplingParams(temperature=0.0), SamplingParams(temperature=1e-6),
                               SamplingParams(temperature=1e-3, seed=3),
                               SamplingParams(temperature=5.0, top_k=1, seed=3),
                               SamplingParams(top_p=1e-6, seed=3), SamplingParams(min_p=1.0, seed=3)],
                         ids=["t0", "t1e-6", "t1e-3", "topk1", "topp_tiny", "minp1"])
def test_greedy_equivalents(p):
    x = _separated(32, 500)
    for num_shards in (1, 3):
        res = Sampler(num_shards=num_shards).sample(x, [p] * 32, [make_generator(p.seed) for _ in range(32)])
        assert torch.equal(res.token_ids, x.argmax(-1))


def test_greedy_ties_pick_lowest_index():
    x = torch.zeros(2, 10)
    x[0, 3] = x[0, 7] = 1.0
    res = Sampler(num_shards=2).sample(x, [SamplingParams(temperature=0.0), SamplingParams(top_k=1)])
    assert res.token_ids.tolist() == [3, 0]


def _draws(logits: torch.Tensor, p: SamplingParams, n: int = 2000) -> torch.Tensor:
    """n draws for one request (one row repeated; each row its own generator)."""
    gens = [make_generator(s) for s in range(n)]
    return Sampler().sample(logits.expand(n, -1), [p] * n, gens).token_ids


PROBS = torch.tensor([0.05, 0.5, 0.15, 0.3])                     # sorted: 1 (0.5), 3 (0.3), 2 (0.15), 0


def test_top_k():
    x = torch.randn(50, generator=torch.Generator().manual_seed(1))
    top3 = set(x.topk(3).indices.tolist())
    assert set(_draws(x, SamplingParams(top_k=3)).tolist()) == top3


def test_top_k_keeps_ties_with_kth():
    x = torch.tensor([0.0, 1.0, 1.0, 1.0, 0.5])
    assert set(_draws(x, SamplingParams(top_k=2)).tolist()) == {1, 2, 3}


def test_top_p():
    d = _draws(PROBS.log(), SamplingParams(top_p=0.75))           # 0.5 < 0.75 <= 0.8: keep {1, 3}
    assert set(d.tolist()) == {1, 3}
    assert abs((d == 1).float().mean().item() - 0.5 / 0.8) < 0.05
    assert set(_draws(PROBS.log(), SamplingParams(top_p=0.5)).tolist()) == {1}    # 0.5 alone reaches it
    assert set(_draws(PROBS.log(), SamplingParams(top_p=1.0)).tolist()) == {0, 1, 2, 3}


def test_min_p():
    d = _draws(PROBS.log(), SamplingParams(min_p=0.5))            # keep prob >= 0.25: {1, 3}
    assert set(d.tolist()) == {1, 3}
    assert abs((d == 1).float().mean().item() - 0.5 / 0.8) < 0.05


def test_temperature_sharpens():
    hot = _draws(PROBS.log(), SamplingParams(temperature=2.0, seed=0))
    cold = _draws(PROBS.log(), SamplingParams(temperature=0.5, seed=0))
    # p^(1/T) normalized: T=0.5 -> 0.25/0.3575 = 0.70 for token 1
    assert abs((cold == 1).float().mean().item() - 0.25 / (0.0025 + 0.25 + 0.0225 + 0.09)) < 0.05
    assert (hot == 1).float().mean() < (cold == 1).float().mean()


# --------------------------------------------------------------------------------------------------
# Sampler: penalties and min_tokens
# --------------------------------------------------------------------------------------------------
def _pick(x: list[float], p: SamplingParams, prompt_and_output: list[int], output: list[int],
          sampler: Sampler | None = None) -> int:
    res = (sampler or Sampler()).sample(torch.tensor([x]), [p], [None], [prompt_and_output], [output])
    return int(res.token_ids[0])


def test_repetition_penalty():
    p = SamplingParams(temperature=0.0, repetition_penalty=1.2)
    assert _pick([2.0, 1.9, 0.0], p, [], []) == 0
    assert _pick([2.0, 1.9, 0.0], p, [0, 2], []) == 1             # 2.0 / 1.2 = 1.67 < 1.9 (prompt token)
    assert _pick([2.0, 1.9, 0.0], p, [2, 0], [0]) == 1            # an output token
    assert _pick([-0.5, -0.55, -3.0], p, [0], []) == 1            # negative: -0.5 * 1.2 = -0.6 < -0.55
    assert _pick([2.0, 1.9, 0.0], SamplingParams(temperature=0.0, repetition_penalty=0.5), [1], []) == 1


def test_frequency_and_presence_penalties():
    x = [1.0, 0.9, 0.0]
    fp = SamplingParams(temperature=0.0, frequency_penalty=0.06)
    assert _pick(x, fp, [0], [0]) == 0                            # 1.0 - 0.06 = 0.94 > 0.9
    assert _pick(x, fp, [0, 0], [0, 0]) == 1                      # 1.0 - 0.12 = 0.88 < 0.9
    assert _pick(x, fp, [0, 0, 0], []) == 0                       # prompt tokens do not count
    pp = SamplingParams(temperature=0.0, presence_penalty=0.2)
    assert _pick([1.0, 0.7, 0.0], pp, [0] * 5, [0] * 5) == 0      # 0.8 > 0.7: not scaled by count
    assert _pick([1.0, 0.9, 0.0], pp, [0], [0]) == 1              # 0.8 < 0.9
    assert _pick([1.0, 0.7, 0.0], SamplingParams(temperature=0.0, frequency_penalty=0.2), [0] * 5, [0] * 5) == 1
    neg = SamplingParams(temperature=0.0, presence_penalty=-0.5)  # negative: encourages repeats
    assert _pick([0.5, 0.9, 0.0], neg, [0], [0]) == 0


def test_min_tokens_masks_eos_and_stop_ids():
    s = Sampler(eos_token_ids=(0,))
    x = [3.0, 2.0, 1.0, 0.0]
    p = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[1])
    assert _pick(x, p, [9 % 4], [], s) == 2                       # EOS 0 and stop 1 masked
    assert _pick(x, p, [3, 3], [3, 3], s) == 0                    # min_tokens reached
    ign = SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True, stop_token_ids=[1])
    assert _pick(x, ign, [], [], s) == 0                          # EOS allowed with ignore_eos


# --------------------------------------------------------------------------------------------------
# Sampler: logprobs and errors
# --------------------------------------------------------------------------------------------------
def test_logprobs_are_raw_log_softmax():
    x = torch.randn(4, 300, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(temperature=0.7, repetition_penalty=1.3, logprobs=5, seed=1),
              SamplingParams(temperature=0.0, logprobs=0),
              SamplingParams(temperature=1.0),
              SamplingParams(temperature=0.0, logprobs=20, presence_penalty=2.0)]
    hist = [[1, 2, 3]] * 4
    res = Sampler().sample(x, params, [make_generator(p.seed) for p in params], hist, hist)
    ref = torch.log_softmax(x, dim=-1)
    assert res.logprobs[2] is None
    for i in (0, 1, 3):
        lp = res.logprobs[i]
        tok = int(res.token_ids[i])
        assert lp.token_id == tok
        assert lp.logprob == pytest.approx(ref[i, tok].item(), abs=1e-6)
        assert lp.rank == int((ref[i] >= ref[i, tok]).sum())
        n = params[i].logprobs
        assert len(lp.top) == n
        if n:
            ids, vals = zip(*lp.top)
            assert list(ids) == ref[i].topk(n).indices.tolist()
            assert list(vals) == pytest.approx(ref[i].topk(n).values.tolist(), abs=1e-6)
    assert res.logprobs[1].rank == 1                              # greedy, unpenalized: the top token


def test_nan_logits_fail_their_row():
    x = torch.zeros(2, 5)
    x[1, 3] = math.nan
    assert Sampler().sample(x, [SamplingParams()] * 2).failed == {1: NON_FINITE}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_raw_argmax_batch_equals_the_general_path(dtype):
    """A batch of plain greedy rows takes the one-pass argmax; the same rows with logprobs asked (which the
    sampler's general path serves: working copy, non-finite scan, masks, greedy) give the same tokens and
    the same failures — ties, NaN anywhere, +inf, -inf rows, -inf but one."""
    inf, v = math.inf, 37
    rows = _tie_rows(v, 8)
    extra = torch.randn(6, v)
    extra[0, 5] = math.nan                                         # NaN among finite values
    extra[1, 3] = inf                                              # +inf
    extra[2, 4], extra[2, 9] = inf, math.nan                       # both
    extra[3, :] = -inf
    extra[3, 0] = inf                                              # +inf among -inf
    extra[4, 2] = -inf                                             # one -inf
    extra[5, 7] = extra[5, 11] = 1e30                              # finite ties
    x = torch.cat([rows, extra]).to(dtype)                         # [B, V]
    b = x.shape[0]
    plain = Sampler(eos_token_ids=[1]).sample(x, [SamplingParams(temperature=0.0)] * b)
    general = Sampler(eos_token_ids=[1]).sample(x, [SamplingParams(temperature=0.0, logprobs=0)] * b)
    assert plain.failed == general.failed
    assert set(plain.failed) == {1, b - 6, b - 5, b - 4, b - 3}
    assert plain.failed[1] == NO_TOKEN_LEFT and plain.failed[b - 6] == NON_FINITE
    ok = [i for i in range(b) if i not in plain.failed]
    assert torch.equal(plain.token_ids[ok], general.token_ids[ok])
    assert torch.equal(plain.token_ids[ok], torch.argmax(x[ok].float(), dim=-1))
    assert plain.logprobs == [None] * b


def test_stop_ids_outside_vocab():
    p = SamplingParams(stop_token_ids=[3, 100])
    p.validate(101)
    with pytest.raises(SamplingError, match=r"stop_token_ids.*\[0, 100\)"):
        p.validate(100)
    with pytest.raises(SamplingError, match="stop_token_ids"):
        Sampler().sample(torch.zeros(1, 100), [p])


def test_history_ids_outside_vocab():
    with pytest.raises(SamplingError, match="prompt_and_output_ids"):
        Sampler().sample(torch.zeros(1, 10), [SamplingParams(repetition_penalty=1.1)], [None], [[10]], [[]])


INVALID = [
    ("temperature", -0.1), ("temperature", math.nan), ("temperature", math.inf), ("temperature", "0.7"),
    ("temperature", True), ("temperature", None),
    ("top_p", 0.0), ("top_p", 1.01), ("top_p", -1.0), ("top_p", math.nan), ("top_p", "1"),
    ("top_k", -2), ("top_k", 2.0), ("top_k", "5"), ("top_k", True),
    ("min_p", -0.01), ("min_p", 1.5), ("min_p", math.inf),
    ("seed", 1.5), ("seed", "7"), ("seed", 2**64), ("seed", -(2**63) - 1),
    ("max_tokens", 0), ("max_tokens", -3), ("max_tokens", 16.0),
    ("min_tokens", -1), ("min_tokens", 17),
    ("ignore_eos", 1), ("ignore_eos", "yes"),
    ("stop_token_ids", [-1]), ("stop_token_ids", "12"), ("stop_token_ids", 5), ("stop_token_ids", [1.0]),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0), ("repetition_penalty", math.inf),
    ("presence_penalty", 2.01), ("presence_penalty", -2.5), ("presence_penalty", math.nan),
    ("frequency_penalty", 3.0), ("frequency_penalty", -2.01), ("frequency_penalty", -math.inf),
    ("logprobs", -1), ("logprobs", 21), ("logprobs", 1.0), ("logprobs", True),
]


@pytest.mark.parametrize(("name", "value"), INVALID, ids=[f"{n}={v!r}" for n, v in INVALID])
def test_invalid_parameter_names_itself(name, value):
    with pytest.raises(SamplingError, match=rf"\b{name}\b") as e:
        SamplingParams(**{name: value})
    assert e.value.param == name
    assert isinstance(e.value, ValueError)


def test_valid_edges_and_normalization():
    SamplingParams(temperature=0, top_p=1, min_p=1, presence_penalty=-2, frequency_penalty=2, logprobs=20,
                   seed=2**64 - 1, min_tokens=16, top_k=1)
    assert SamplingParams(top_k=-1) == SamplingParams(top_k=0)
    p = SamplingParams(temperature=1, stop_token_ids=[5, 6])
    assert isinstance(p.temperature, float) and p.stop_token_ids == (5, 6)
    assert SamplingParams(temperature=0).is_greedy and SamplingParams(top_k=1).is_greedy
    assert not SamplingParams().is_greedy


def test_from_dict():
    p = SamplingParams.from_dict({"temperature": 0.5, "max_tokens": None, "seed": None, "logprobs": None,
                                  "stop_token_ids": None, "prompt_ids": [1, 2], "echo": True})
    assert p == SamplingParams(temperature=0.5)
    assert SamplingParams.from_dict({"top_k": -1, "stop_token_ids": [1]}).stop_token_ids == (1,)
    with pytest.raises(SamplingError, match="temperature"):
        SamplingParams.from_dict({"temperature": "hot"})
    with pytest.raises(SamplingError, match="max_tokens"):
        SamplingParams.from_dict({"max_tokens": "16"})
    with pytest.raises(SamplingError):
        SamplingParams.from_dict([("temperature", 1.0)])


def test_bad_inputs():
    with pytest.raises(SamplingError, match="params"):
        Sampler().sample(torch.zeros(2, 5), [SamplingParams()])
    with pytest.raises(SamplingError, match="params"):
        Sampler().sample(torch.zeros(1, 5), [{"temperature": 0.0}])
    with pytest.raises(SamplingError, match="logits"):
        Sampler().sample(torch.zeros(5), [SamplingParams()])
    x = torch.full((1, 4), -math.inf)
    x[0, 0] = 0.0
    res = Sampler().sample(x, [SamplingParams(min_tokens=1, stop_token_ids=[0])], [None], [[]], [[]])
    assert res.failed == {0: NO_TOKEN_LEFT}                     # the only finite token is a stop id
    assert Sampler().sample(x, [SamplingParams()]).token_ids.tolist() == [0]


def test_logit_bias():
    """OpenAI's logit_bias ({"token id": bias}) is added to the logits before anything else; bad values are
    refused by name."""
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    s = Sampler()
    forced = SamplingParams(temperature=0.0, logit_bias={"0": 100})
    assert s.sample(logits, [forced]).token_ids.tolist() == [0]
    banned = SamplingParams(temperature=0.0, logit_bias={"3": -100, "2": -100.0})
    assert s.sample(logits, [banned]).token_ids.tolist() == [1]
    assert SamplingParams(logit_bias=[(1, 2.5)]).logit_bias == ((1, 2.5),)
    for bad in ({"x": 1}, {"1": 101}, {"-1": 1}, {"1": "a"}, "no", {"1": float("nan")}):
        with pytest.raises(SamplingError, match="logit_bias"):
            SamplingParams(logit_bias=bad)
    with pytest.raises(SamplingError, match="logit_bias"):
        SamplingParams(logit_bias={"9": 1}).validate(4)
