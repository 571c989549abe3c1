"""Continuous batching against each request run alone, on random odd checkpoints and engines (tests/engine_diff.py):
what tests/test_isolation.py does through the server on the tiny preset, here through the engine on 1-3 layer
models of odd vocabularies, head dims, windows and expert counts, with both decoders, blocks of 1 to 64 tokens,
n-gram and suffix drafts, warm-up, aborts of running requests and refused requests mid-load, and the step outputs
checked against the requests' final state."""

from __future__ import annotations

import pytest

from .engine_diff import FEATURES, check_case

# Six cases that go through every FEATURES entry between them, in a few seconds; each also catches one or more of
# these engine bugs when they are planted (a sliding block freed one token early, a preempted request's
# generator reseeded, a prefix block named without its last token, an aborted request's blocks kept, a first draft
# accepted unchecked).
FAST_SEEDS = (8, 14, 67, 87, 114, 125)


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
