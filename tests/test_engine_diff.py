"""Continuous batching against each request run alone, on random odd checkpoints and engines (tests/engine_diff.py):
what tests/test_isolation.py does through the server on the tiny preset, here through the engine on 1-3 layer
models of odd vocabularies, head dims, windows and expert counts, with both decoders, blocks of 1 to 64 tokens,
n-gram and suffix drafts, warm-up, aborts of running requests and refused requests mid-load, and the step outputs
checked against the requests' final state."""

from __future__ import annotations

from dataclasses import replace

import pytest

from gigadecode.llm import SamplingParams
from gigadecode.sampling import TokenLogprobs

from .engine_diff import FEATURES, check_case

# Seven cases that go through every FEATURES entry between them, in a few seconds; each also catches one or more of
# these engine bugs when they are planted (a sliding block freed one token early, a preempted request's
# generator reseeded, a prefix block named without its last token, an aborted request's blocks kept, a first draft
# accepted unchecked, min_tokens' mask lost in a batch of more than one).
FAST_SEEDS = (8, 14, 66, 67, 87, 114, 125)


@pytest.fixture(scope="module")
def root(ckpt_root):
    return ckpt_root / "engine-diff"


def _check(seeds, root) -> None:
    seen, problems = set(), []
    for seed in seeds:
        outcome = check_case(seed, root)
        seen |= outcome.exercised
        problems += [f"case {seed} (python -m tests.engine_diff {seed} 1): {p}" for p in outcome.problems]
    assert not problems, f"{len(problems)} problem(s):\n" + "\n".join(problems[:20])
    assert seen == FEATURES, f"not exercised: {sorted(FEATURES - seen)}"


def test_a_mixed_load_gives_every_request_its_tokens_alone(root):
    _check(FAST_SEEDS, root)


@pytest.mark.slow
def test_a_wide_sweep_of_mixed_loads(root):
    """200 cases (~2 minutes)."""
    _check(range(200), root)


def _lone_step(pick: int, lp: float, **others: float) -> TokenLogprobs:
    top = sorted([(pick, lp), *((int(t[1:]), v) for t, v in others.items())], key=lambda e: -e[1])
    return TokenLogprobs(pick, lp, 1 + sum(v >= lp for _, v in top if _ != pick), tuple(top))


def test_a_token_the_request_could_not_take_is_no_near_tie():
    """A greedy answer that parts from its lone run on a token the request's masks forbid there is a problem,
    however close (or far above the pick) its logprob: an EOS under min_tokens (made likely by a logit_bias), a
    token outside allowed_token_ids. The lone run's pick won by the mask, not by a hair, so a batch that lost
    a request's mask must not pass as a near-tie."""
    from .engine_diff import EOS, Answer, Seq, compare
    alone = Answer([5, 6, 7], "length", [_lone_step(5, -3.0, t2=-1.0), _lone_step(6, -1.0), _lone_step(7, -1.0)],
                   None)
    under_min = Seq([3, 4], SamplingParams(temperature=0.0, max_tokens=3, min_tokens=3,
                                           logit_bias=((EOS, 8.0),)), 0)
    assert compare(under_min, Answer([EOS], "stop", [], None), alone)
    free = replace(under_min, params=replace(under_min.params, min_tokens=0, logit_bias=()))
    tie = Answer([5, 6, 7], "length", [_lone_step(5, -1.0, t9=-1.0001), _lone_step(6, -1.0), _lone_step(7, -1.0)],
                 None)
    assert not compare(free, Answer([9, 4], "length", [], None), tie)      # a near-tie it may take
    only = replace(free, params=replace(free.params, allowed_token_ids=(5, 6, 7)))
    assert compare(only, Answer([9, 4], "length", [], None), tie)


def test_a_near_tie_is_what_fp32_rounding_can_flip():
    """A greedy answer may take the lone run's runner-up only where the two are closer than the load may move two
    logprobs (2 LP_TOL, fp32): a flip across 0.004 nats moved the two 20 times what `compare` lets one move
    (0.01 nats, the bf16 tests' near-tie, passed it)."""
    from .engine_diff import LP_TOL, Answer, Seq, compare
    greedy = Seq([3, 4], SamplingParams(temperature=0.0, max_tokens=3), 0)
    for gap, parts in ((LP_TOL, False), (0.004, True)):
        alone = Answer([5, 6, 7], "length", [_lone_step(5, -1.0, t9=-1.0 - gap), _lone_step(6, -1.0),
                                             _lone_step(7, -1.0)], None)
        assert bool(compare(greedy, Answer([9, 4], "length", [], None), alone)) == parts, gap


def test_a_top_logprob_the_lone_run_ranks_below_its_list_is_a_difference():
    """A top entry the lone run's longer list (MAX_LOGPROBS) lacks must be no likelier than that list's last:
    one above it is a token from elsewhere (another row's top list passed: only the tokens both lists named
    were compared)."""
    from .engine_diff import _lp_close
    alone = _lone_step(5, -1.0, t6=-2.0, t7=-3.0)
    assert _lp_close(_lone_step(5, -1.0, t6=-2.0), alone, 2)
    assert _lp_close(_lone_step(5, -1.0, t8=-3.0), alone, 2)           # a tie with the lone list's last
    assert not _lp_close(_lone_step(5, -1.0, t9=-1.5), alone, 2)       # above its last: not the lone run's
