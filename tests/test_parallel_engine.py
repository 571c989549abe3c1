"""The parallel engine (`gigadecode.parallel.engine`): continuous batching, chunked prefill, preemption,
sampling and aborts on TP × DP × EP worlds give exactly what one rank's `LLMEngine` gives.

One scripted session runs on both: requests arrive while others run (staggered), prompts are prefilled
in chunks while other requests decode (so, where an EP group spans DP groups, one group prefills while
another decodes and the engine pads their model calls to match), the KV pool is small enough that
requests are preempted and recomputed, the sampling mixes plain greedy (distributed argmax) with seeded
temperature / top-k / top-p sampling, penalties, min_tokens and logprobs (gathered logits), one request
is aborted mid-way and bad requests are refused while the rest keep running. The parallel engine warms up
first (every replica at once), the single rank does not: the warm-up changes no token.
"""

from __future__ import annotations

import os
import re

import pytest

from gigadecode.engine_config import EngineConfig
from gigadecode.engine import LLMEngine, RequestError
from gigadecode.runner import ModelRunner
from gigadecode.sampling import SamplingError, SamplingParams

from .helpers import random_prompt

ENGINE = dict(kv_dtype="fp8", block_size=4, num_blocks=40, max_prefill_tokens=16, max_num_seqs=8)
LENGTHS = [3, 17, 5, 23, 9, 30, 12, 2]
MASK_ALLOWED = list(range(100, 160))
MASK_BAD_WORDS = [[101], [102], [103, 104]]


def _params(i: int) -> SamplingParams:
    kinds = [
        dict(temperature=0.0, max_tokens=10, ignore_eos=True),                       # plain greedy
        dict(temperature=0.8, top_k=50, seed=11, max_tokens=9, ignore_eos=True),      # seeded sampling
        dict(temperature=0.0, repetition_penalty=1.3, max_tokens=8, ignore_eos=True),  # greedy, penalized
        dict(temperature=1.0, top_p=0.9, seed=5, frequency_penalty=0.5, max_tokens=7, ignore_eos=True),
        dict(temperature=0.0, logprobs=2, prompt_logprobs=1, max_tokens=6, ignore_eos=True),  # + logprobs
        dict(temperature=0.0, min_tokens=4, max_tokens=12),                          # stops at EOS after 4
        dict(temperature=0.0, max_tokens=12, guided=("regex", "[a-z]{2,8}", "all")),  # structured (gathered)
        # greedy, but not the distributed argmax: vLLM's whitelist and bad words mask the gathered logits
        dict(temperature=0.0, max_tokens=10, ignore_eos=True, allowed_token_ids=MASK_ALLOWED,
             bad_words_token_ids=MASK_BAD_WORDS),
    ]
    return SamplingParams(**kinds[i % len(kinds)])


# --scheduling-policy priority: the requests' priorities (the others, 0)
PRIORITIES = [2, 0, 1, 3, 0, 2, -1, 1]


def session(engine, vocab: int, priority: bool = False) -> dict:
    """The scripted session (on one rank's LLMEngine or on rank 0 of a parallel engine) -> per request
    its tokens, finish reason and logprobs, plus what the engine refused and the step of each request's first
    token. `priority`: the requests r0.. have PRIORITIES (the engine's policy is priority)."""
    prompts = [random_prompt(n, vocab, seed=300 + n) for n in LENGTHS]
    refused = []
    first: dict[str, int] = {}
    steps = 0

    def step() -> None:
        nonlocal steps
        for o in engine.step():
            if o.new_token_ids:
                first.setdefault(o.request_id, steps)
        steps += 1

    def add(i: int) -> str:
        return engine.add_request(prompts[i], _params(i), request_id=f"r{i}",
                                  priority=PRIORITIES[i] if priority else 0)
    ids = [add(i) for i in range(4)]
    for bad in ([vocab + 5], [1] * 10_000):
        try:
            engine.add_request(bad, SamplingParams(max_tokens=2))
        except RequestError as e:
            refused.append(type(e).__name__)
    for bad_params in (dict(temperature=-1.0), dict(allowed_token_ids=[vocab + 1])):
        try:
            engine.add_request([1, 2], SamplingParams(**bad_params))
        except SamplingError as e:
            refused.append(e.param)
    for _ in range(3):
        step()
    ids += [add(i) for i in range(4, len(prompts))]
    # unseeded: rank 0 seeds it for the whole DP group; ignore_eos so its length does not depend on the draw
    engine.add_request(prompts[0], SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True),
                       request_id="unseeded")
    step()
    step()
    engine.abort("r1")
    while engine.has_unfinished():
        step()
    out = {}
    unseeded_ids = engine.requests["unseeded"].output_ids
    for rid in ids:
        r = engine.requests[rid]
        lps = [(lp.token_id, round(lp.logprob, 3)) for lp in r.output_logprobs] if r.output_logprobs else []
        if r.params.prompt_logprobs is not None:      # the prompt's (logits gathered over TP), then the output's
            lps = [(lp.token_id, round(lp.logprob, 3)) for lp in r.prompt_logprobs[1:]] + lps
        out[rid] = (r.output_ids, r.finish_reason, lps)
    # a server forgets each request once it has finished (the aborted one too): the engine serves on
    for rid in [*ids, "unseeded"]:
        engine.requests.pop(rid)
    engine.add_request(prompts[2], _params(2), request_id="after-forgetting")
    while engine.has_unfinished():
        engine.step()
    r = engine.requests["after-forgetting"]
    out["after-forgetting"] = (r.output_ids, r.finish_reason, [(lp.token_id, round(lp.logprob, 3))
                                                              for lp in r.output_logprobs or []])
    return {"requests": out, "refused": refused, "unseeded_ids": unseeded_ids, "first": first}


class DraftsFrom:
    """Speculative decoding's proposer, told the single rank's tokens: drafts the next 3 of them, a fifth
    changed (by the request and its length alone, so every replica of a DP group drafts the same)."""

    def __init__(self, plain: dict[str, list[int]], vocab: int) -> None:
        self.plain, self.vocab = plain, vocab

    def propose(self, req, limit: int) -> list[int]:
        import random
        o = len(req.output_ids)
        rng = random.Random(f"{req.request_id}:{o}")
        return [t if rng.random() > 0.2 else (t + 1) % self.vocab
                for t in self.plain.get(req.request_id, [])[o: o + min(3, limit)]]


def world_session(rank: int, model_dir: str, layout: tuple[int, int, int], drafts: dict | None = None,
                  policy: str = "fcfs") -> dict:
    """On every rank of a run_world: build the parallel engine; rank 0 runs `session`. Every rank also
    returns the tokens its own replica produced per request (the ranks of a DP group must agree). With
    `drafts` (request -> tokens) the engine decodes speculatively, drafting from them; with "suffix", by suffix
    decoding (every replica caches its finished outputs alike). `policy`: the engines' scheduling policy
    (priority: the session's requests have PRIORITIES)."""
    from gigadecode.parallel.engine import DistributedEngine, build_parallel_engine, run_worker
    from gigadecode.speculative import SpeculativeConfig
    import torch
    torch.manual_seed(1000 + rank)            # ranks' global generators differ (as they may in real worlds)
    tp, dp, ep = layout
    spec = (SpeculativeConfig(method="suffix", num_speculative_tokens=4, suffix_decoding_min_token_prob=0.0)
            if drafts == "suffix" else SpeculativeConfig(num_speculative_tokens=3) if drafts is not None else None)
    replica, ctx = build_parallel_engine(model_dir, EngineConfig(tp=tp, dp=dp, ep=ep, speculative=spec,
                                                                 scheduling_policy=policy, **ENGINE))
    if isinstance(drafts, dict):
        replica.scheduler.proposer = DraftsFrom(drafts, replica.cfg.vocab_size)
    produced: dict[str, list[int]] = {}
    step = replica.step

    def recording_step():
        outs = step()
        for o in outs:
            produced.setdefault(o.request_id, []).extend(o.new_token_ids)
        return outs
    replica.step = recording_step
    if ctx.rank != 0:
        run_worker(replica, ctx)
        return {"dp_rank": ctx.dp_rank, "produced": produced}
    with DistributedEngine(replica, ctx) as eng:
        # every replica warms up in lockstep first (its forward's collectives must line up): tokens unchanged
        res = {"warm_up_s": eng.warm_up(), **session(eng, replica.cfg.vocab_size, policy == "priority")}
        res["preemptions"] = eng.stats.preemptions
        res["spec_accepted"] = eng.stats.spec_accepted_tokens
        res["kv_used"] = eng.kv_usage()[0]
        res["unseeded"] = res.pop("unseeded_ids")
    return {**res, "dp_rank": ctx.dp_rank, "produced": produced}


@pytest.fixture(scope="module")
def single(tiny_ckpt):
    eng = LLMEngine(ModelRunner(tiny_ckpt, EngineConfig(**ENGINE)))
    res = session(eng, eng.cfg.vocab_size)
    res["preemptions"] = eng.stats.preemptions
    assert res["preemptions"] > 0, "the pool is meant to be small enough to preempt"
    return res


def test_single_rank_session_is_sane(single, tiny_ckpt):
    reqs = single["requests"]
    assert single["refused"] == ["RequestError", "RequestError", "temperature", "allowed_token_ids"]
    assert reqs["r1"][1] == "abort" and 0 < len(reqs["r1"][0]) < 9
    assert all(reqs[r][1] in ("length", "stop") for r in reqs if r != "r1")
    assert len(reqs["r4"][2]) == LENGTHS[4] - 1 + 6                  # logprobs for every token after the first
    from gigadecode.tokenizer import TextCodec
    codec = TextCodec.from_dir(tiny_ckpt)
    toks, reason, _ = reqs["r6"]
    assert reason == "stop" and re.fullmatch("[a-z]{2,8}", codec.decode(toks[:-1])), codec.decode(toks)
    toks = reqs["r7"][0]
    assert len(toks) == 10 and set(toks) <= set(MASK_ALLOWED) and not {101, 102} & set(toks)
    assert all(toks[i:i + 2] != [103, 104] for i in range(len(toks) - 1))


LAYOUTS = [
    pytest.param((2, 1, 2), False, "fcfs", id="tp2-dp1-ep2"),
    pytest.param((1, 2, 2), False, "fcfs", id="tp1-dp2-ep2"),
    pytest.param((2, 2, 4), False, "fcfs", id="tp2-dp2-ep4"),
    pytest.param((2, 2, 4), True, "fcfs", id="tp2-dp2-ep4-speculative"),
    pytest.param((2, 1, 2), "suffix", "fcfs", id="tp2-dp1-ep2-suffix"),
    pytest.param((2, 1, 2), False, "priority", id="tp2-dp1-ep2-priority"),
]


@pytest.fixture(scope="module")
def single_priority(tiny_ckpt):
    eng = LLMEngine(ModelRunner(tiny_ckpt, EngineConfig(scheduling_policy="priority", **ENGINE)))
    return {**session(eng, eng.cfg.vocab_size, priority=True), "preemptions": eng.stats.preemptions}


@pytest.mark.parametrize("layout, drafts, policy", LAYOUTS)
def test_parallel_engine_session_equals_single_rank(tiny_ckpt, single, layout, drafts, policy, request):
    """... and with speculative decoding (drafts as extra decode rows: the EP agreement pads rows, TP
    gathers the drafts' logits, each replica verifies alike) the same tokens again; under priority
    scheduling (priority travels to every rank with the request) the tokens of fcfs, and on one DP group
    every request's first token in the step one rank's priority scheduler gives it."""
    from gigadecode.parallel.spawn import run_world
    tp, dp, ep = layout
    plain = {rid: toks for rid, (toks, _, _) in single["requests"].items()} if drafts is True else drafts or None
    outs = run_world(tp * dp, world_session, str(tiny_ckpt), layout, plain, policy)
    got = outs[0]
    if policy == "priority":
        alone = request.getfixturevalue("single_priority")
        assert got["first"] == alone["first"] and alone["first"] != single["first"]
        assert got["preemptions"] == alone["preemptions"]
    if drafts:                                # "after-forgetting" repeats r2: suffix decoding drafts its output
        assert got["spec_accepted"] > 0
    assert got["refused"] == single["refused"]
    for rid, (toks, reason, lps) in single["requests"].items():
        g_toks, g_reason, g_lps = got["requests"][rid]
        if rid == "r1":                       # aborted: when depends on batching (and drafts); one a prefix of the other
            n = min(len(g_toks), len(toks))
            assert g_reason == "abort" and g_toks[:n] == toks[:n]
            continue
        assert (g_toks, g_reason) == (toks, reason), rid
        assert [t for t, _ in g_lps] == [t for t, _ in lps]
        assert all(abs(a - b) < 2e-3 for (_, a), (_, b) in zip(g_lps, lps))
    assert got["kv_used"] == 0 and got["warm_up_s"] > 0
    assert len(got["unseeded"]) == 6
    # every rank of a DP group produced the same tokens (unseeded sampling included: rank 0 seeds it)
    by_group: dict[int, dict] = {}
    for o in outs:
        first = by_group.setdefault(o["dp_rank"], o["produced"])
        assert o["produced"] == first
    assert sum(len(v) for g in by_group.values() for v in g.values()) > 0
    if dp == 1 and policy == "fcfs":                     # the same pool and batch as one rank: it preempts too
        assert got["preemptions"] > 0


def test_parallel_engine_refuses_without_a_world(tiny_ckpt):
    from gigadecode.cli import main
    env_ws = os.environ.pop("WORLD_SIZE", None)
    try:
        assert main(["generate", "--model", str(tiny_ckpt), "--prompt-ids", "1,2", "--tp", "2"]) == 2
    finally:
        if env_ws is not None:
            os.environ["WORLD_SIZE"] = env_ws


# --------------------------------------------------------------------------------------------------
# a rank whose step raises: the world stops with the error, it never hangs
# --------------------------------------------------------------------------------------------------
def fail_second_decode(replica) -> None:
    """The replica's second decode call raises "injected fault" (the others decode)."""
    decode, calls = replica.runner.decode, []

    def failing_decode(*args, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected fault")
        return decode(*args, **kw)
    replica.runner.decode = failing_decode


def faulty_dp_session(rank: int, model_dir: str) -> dict | None:
    """DP 2 (no TP / EP / DCP peer): rank 1's second decode call raises. Its requests fail with the error,
    rank 0's group decodes on, and the engine takes requests after it."""
    from gigadecode.parallel.engine import DistributedEngine, build_parallel_engine, run_worker
    replica, ctx = build_parallel_engine(model_dir, EngineConfig(dp=2, **ENGINE))
    if rank == 1:
        fail_second_decode(replica)
    if ctx.rank != 0:
        run_worker(replica, ctx)
        return None
    p = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    with DistributedEngine(replica, ctx) as eng:
        for i, n in enumerate((4, 9, 2, 7)):
            eng.add_request(list(range(5, 5 + n)), p, request_id=f"r{i}")
        while eng.has_unfinished():
            eng.step()
        seen = {rid: (r.finish_reason, r.error, len(r.output_ids)) for rid, r in eng.requests.items()}
        eng.add_request([5, 6, 7], p, request_id="later")
        while eng.has_unfinished():
            eng.step()
        later = (eng.requests["later"].finish_reason, len(eng.requests["later"].output_ids))
    return {"requests": seen, "later": later}


def test_a_pure_dp_replica_whose_step_raises_fails_its_requests_and_serves_on(tiny_ckpt):
    from gigadecode.parallel.spawn import run_world
    res = run_world(2, faulty_dp_session, str(tiny_ckpt))[0]
    reasons = [r for r, _, _ in res["requests"].values()]
    assert reasons.count("error") >= 1 and reasons.count("length") >= 1, res
    assert all("injected fault" in err for r, err, _ in res["requests"].values() if r == "error")
    assert all(n == 6 for r, _, n in res["requests"].values() if r == "length")
    assert res["later"][0] == "length" and res["later"][1] == 6


def fail_prefill(replica, nth: int, after_fault: list[int]) -> None:
    """The replica's `nth` prefill call raises "injected fault" (the warm-up's is the first, where a session warms
    up); from then on `after_fault[0]` counts the collectives this rank starts."""
    prefill, calls = replica.runner.prefill, []

    def failing_prefill(*args, **kw):
        calls.append(1)
        if len(calls) == nth:
            after_fault.append(0)
            raise RuntimeError("injected fault")
        return prefill(*args, **kw)
    replica.runner.prefill = failing_prefill
    stats, record = replica.runner.parallel.stats, replica.runner.parallel.stats.record

    def counting(*args, **kw):
        if after_fault:
            after_fault[0] += 1
        return record(*args, **kw)
    stats.record = counting


def faulty_rank_session(rank: int, model_dir: str, bad_rank: int, phase: str = "decode") -> dict | None:
    """TP 2 × EP 2: `bad_rank`'s second decode call raises (its TP peer is then inside that phase's collectives),
    or with `phase` "prefill" its second prefill call, or with "warm-up" the warm-up's prefill. Rank 0 (warming
    the world up first for "warm-up") runs three requests to the end (a fourth unless "decode": its long prompt
    is prefilled in chunks while the others decode, so the second prefill call shares its step with a decode),
    tries one more and prints what it saw (its peer may fail the world before run_world could hand the result
    back). The bad rank prints how many collectives it started after its fault."""
    from gigadecode.parallel.engine import DistributedEngine, build_parallel_engine, run_worker
    replica, ctx = build_parallel_engine(model_dir, EngineConfig(tp=2, ep=2, **ENGINE))
    after_fault: list[int] = []
    if rank == bad_rank and phase == "decode":
        fail_second_decode(replica)
    elif rank == bad_rank:
        fail_prefill(replica, 1 if phase == "warm-up" else 2, after_fault)
    try:
        if ctx.rank != 0:
            run_worker(replica, ctx)
            return None
        lengths = (4, 9, 2) if phase == "decode" else (4, 9, 2, 40)
        stopped = None
        with DistributedEngine(replica, ctx) as eng:
            try:
                if phase == "warm-up":
                    eng.warm_up()
                for i, n in enumerate(lengths):
                    eng.add_request(list(range(5, 5 + n)), SamplingParams(temperature=0.0, max_tokens=6,
                                                                          ignore_eos=True), request_id=f"r{i}")
                while eng.has_unfinished():
                    eng.step()
            except RuntimeError as e:        # the world stopped before the requests were in
                stopped = str(e)
            seen = {rid: (r.finish_reason, r.error) for rid, r in eng.requests.items()}
            try:
                eng.add_request([5, 6], SamplingParams(max_tokens=2))
                later = None
            except RuntimeError as e:
                later = str(e)
        print("RESULT", {"requests": seen, "later": later, "stopped": stopped}, flush=True)
    finally:
        if after_fault:
            print(f"COLLECTIVES AFTER THE FAULT: {after_fault[0]}", flush=True)
    return None


_FAULTY_WORLD = """
import sys
from gigadecode.parallel.spawn import run_world
from tests.test_parallel_engine import faulty_rank_session
try:
    run_world(2, faulty_rank_session, sys.argv[1], int(sys.argv[2]), sys.argv[3])
except RuntimeError as e:
    print("RAISED", e, flush=True)
"""


def _faulty_world(model_dir, bad_rank: int, phase: str, timeout: float = 120) -> str:
    """Run `faulty_rank_session` on a world of 2 in a subprocess -> what it printed (fails on a hang)."""
    import subprocess
    import sys
    from pathlib import Path
    from .helpers import stop_process_tree
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.Popen([sys.executable, "-c", _FAULTY_WORLD, str(model_dir), str(bad_rank), phase], cwd=root,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONPATH": str(root)})
    try:
        return proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        stop_process_tree(proc, timeout=5)
        pytest.fail(f"the world hung after rank {bad_rank}'s {phase} raised")


def _rank_0_result(out: str) -> dict:
    line = next((ln for ln in out.splitlines() if ln.startswith("RESULT")), None)
    assert line is not None, out[-3000:]
    return eval(line[len("RESULT "):])     # noqa: S307 - the dict this test's job printed


@pytest.mark.parametrize("bad_rank", [0, 1])
def test_a_rank_whose_step_raises_stops_the_world_with_the_error(tiny_ckpt, bad_rank):
    """The failing rank's TP peer waits inside a collective it will never join (gloo gives up after 30
    minutes): the rank leaves the world (`RankFailure`), which ends its peers' collectives, and rank 0 fails
    every unfinished request with the error and refuses new ones, instead of every rank hanging."""
    out = _faulty_world(tiny_ckpt, bad_rank, "decode")
    if bad_rank == 1:                         # the worker leaves with the error; rank 0's collective fails
        assert "RankFailure: rank 1: engine step failed: RuntimeError: injected fault" in out, out[-3000:]
    else:                                     # rank 0 itself: every request finished with the error
        res = _rank_0_result(out)
        assert {reason for reason, _ in res["requests"].values()} == {"error"}
        assert all("injected fault" in err for _, err in res["requests"].values())
        assert "this parallel engine stopped" in res["later"] and "injected fault" in res["later"]
        # rank 1, whose collective with the rank that left failed, says so in an operator's words
        assert "peer rank 0 of the world was lost: rank 1's TP " in out, out[-3000:]


@pytest.mark.parametrize("bad_rank, phase", [(0, "prefill"), (1, "prefill"), (1, "warm-up")])
def test_a_rank_whose_prefill_raises_makes_no_collective_after_it(tiny_ckpt, bad_rank, phase):
    """A lockstep rank's prefill raises in a step that also decodes (or in the warm-up): the rank stops at that
    phase. Going on to the decode phase (or the step after the warm-up) would start its collectives against
    the peer's pending prefill ones (gloo aborts the process on the size mismatch, or hands one call's data to
    the other, whose tokens a client would get); instead it starts none, leaves the world, and the world stops
    promptly with the error."""
    out = _faulty_world(tiny_ckpt, bad_rank, phase, timeout=60)
    assert "COLLECTIVES AFTER THE FAULT: 0" in out, out[-3000:]
    if bad_rank == 1:
        assert "RankFailure: rank 1: engine step failed: RuntimeError: injected fault" in out, out[-3000:]
    else:
        res = _rank_0_result(out)
        assert {reason for reason, _ in res["requests"].values()} == {"error"}, res
        assert all("injected fault" in err for _, err in res["requests"].values())


def test_a_lockstep_rank_logs_why_it_leaves_before_it_raises(caplog):
    """The rank's own log says why it left the world before anything is torn down (see the test below: the
    teardown may end the process before Python prints the traceback), in the words its peers' error gives."""
    from types import SimpleNamespace
    from gigadecode.parallel.engine import RankFailure, StepInbox, _replica_step

    class Replica:
        def step(self):
            raise ValueError("a kernel said no")

        class stats:
            @staticmethod
            def as_dict():
                return {"prefill_tokens": 0, "decode_tokens": 0}

    ctx = SimpleNamespace(rank=3, dp_rank=0, tp_size=2, ep_size=1, dcp_size=1,
                          stats=SimpleNamespace(reset=lambda: None))
    with caplog.at_level("ERROR", logger="gigadecode.parallel.engine"), pytest.raises(RankFailure) as err:
        _replica_step(Replica(), ctx, StepInbox(), None)
    assert str(err.value) == "rank 3: engine step failed: ValueError: a kernel said no"
    assert [r.getMessage() for r in caplog.records] == [
        "world rank 3 leaves the world: rank 3: engine step failed: ValueError: a kernel said no"]


def abort_the_last_request_job(rank: int, model_dir: str) -> tuple[int, bool] | None:
    """TP 2: rank 0 aborts its only request mid-way and steps while `has_unfinished()` -> (KV blocks used
    after, has_unfinished after)."""
    from gigadecode.parallel.engine import DistributedEngine, build_parallel_engine, run_worker
    replica, ctx = build_parallel_engine(model_dir, EngineConfig(tp=2, **ENGINE))
    if ctx.rank != 0:
        run_worker(replica, ctx)
        return None
    with DistributedEngine(replica, ctx) as eng:
        rid = eng.add_request(list(range(5, 14)), SamplingParams(temperature=0.0, max_tokens=20))
        eng.step()
        eng.step()
        eng.abort(rid)
        while eng.has_unfinished():
            eng.step()
        return eng.kv_usage()[0], eng.has_unfinished()


def test_aborting_the_last_request_frees_its_kv_on_every_rank(tiny_ckpt):
    """The abort reaches the ranks with the next step: `has_unfinished()` stays True until it has gone, so a
    script's step loop frees the request's KV instead of leaving it held until some later request."""
    from gigadecode.parallel.spawn import run_world
    assert run_world(2, abort_the_last_request_job, str(tiny_ckpt))[0] == (0, False)


class _EndsTheProcessWhenFreed:
    """Ends its process when the last reference to it goes, as a TP rank's process group can when it is torn
    down while its peer still sends (a native abort): what a rank must have reported by then."""

    def __del__(self):
        os._exit(3)


def raise_holding_a_fragile_group(rank: int) -> None:
    """Rank 1 raises with a `_EndsTheProcessWhenFreed` in the failed call's frame; rank 0 returns."""
    if rank == 1:
        group = _EndsTheProcessWhenFreed()     # noqa: F841 - freed with this frame, after the raise
        raise RuntimeError("rank 1's own failure")


def test_a_rank_reports_its_error_before_the_failed_calls_objects_are_freed():
    """A worker whose step raised frees that step's frames when its report is written, and with them its
    process groups: the peer, seeing the connection close, goes on and can end the world first. The failed
    rank's error must be on record by then, else the world says only that its peer was lost (a CI run lost
    "rank 1: engine step failed: … injected fault" that way)."""
    from gigadecode.parallel.spawn import run_world
    with pytest.raises(RuntimeError, match="rank 1: RuntimeError: rank 1's own failure"):
        run_world(2, raise_holding_a_fragile_group)


def test_every_rank_judges_a_steps_adds_at_rank_0s_clock():
    """The ranks of a TP group must admit a step's requests alike (diverged batches abort the world): the
    DI lease of each add is judged at the clock rank 0 sent with the step, not at each rank's own."""
    from types import SimpleNamespace
    from gigadecode.parallel.engine import StepInbox, _replica_step

    class Seen(Exception):
        pass

    seen = []

    class Replica:
        def add_request(self, *args, **kw):
            seen.append(kw.get("now"))
            raise Seen

    inbox = StepInbox(adds=[(0, "r0", [5, 6, 7], SamplingParams(), None, 0)], now=1234.5)
    with pytest.raises(Seen):
        _replica_step(Replica(), SimpleNamespace(dp_rank=0), inbox, None)
    assert seen == [1234.5]


# --------------------------------------------------------------------------------------------------
# a rank that hangs: its peers' collectives give up after --distributed-timeout-s, not gloo's 30 minutes
# --------------------------------------------------------------------------------------------------
def hung_peer_job(rank: int) -> tuple[float, str | None]:
    """A TP 2 × EP 2 world on the tiny config. Start-up: rank 1 joins a TP all_reduce 1.5 s late, which is
    waited for. Then every rank arms a 1 s timeout; rank 1 hangs (sleeps) while rank 0 waits in a TP
    all_reduce, and rank 0 hangs while rank 1 waits for the step broadcast (as a worker of an idle server
    would, were rank 0 stuck). -> (this rank's start-up wait, (seconds, error) of its wait on the hung peer)."""
    import time

    import torch

    from gigadecode.checkpoint import preset_config
    from gigadecode.distributed.context import CollectiveFailed, make_parallel_context
    from gigadecode.parallel.engine import _exchange

    def timed(call) -> tuple[float, str | None]:
        t0 = time.monotonic()
        try:
            call()
        except CollectiveFailed as e:
            return time.monotonic() - t0, str(e)
        return time.monotonic() - t0, None

    ctx = make_parallel_context(preset_config("tiny"), 2, 1, 2)
    if rank == 1:
        time.sleep(1.5)
    startup = timed(lambda: ctx.all_reduce_tp(torch.ones(4)))
    assert startup[1] is None, startup
    ctx.arm_timeout(1.0)
    if rank == 0:
        hung = timed(lambda: ctx.all_reduce_tp(torch.ones(4)))    # rank 1 is asleep
        time.sleep(4.0)                                           # ... and now rank 0 hangs
    else:
        time.sleep(2.5)
        hung = timed(lambda: _exchange(ctx, None))                # rank 0 is asleep
    return startup[0], hung


def test_a_hung_peer_fails_the_collective_after_the_armed_timeout():
    """gloo honours `ParallelContext.arm_timeout` on the TP group and on the world's step broadcast (a pickled
    broadcast_object_list); the failure names the silent peer and the timeout, in an operator's words. Before
    arming (start-up: ranks load their shards at their own pace) a late peer is waited for."""
    from gigadecode.parallel.spawn import run_world
    (up0, (took0, err0)), (_, (took1, err1)) = run_world(2, hung_peer_job)
    assert up0 >= 1.0, up0                                       # rank 0 waited for the late rank 1, unharmed
    for took, err, peer, rank, what in ((took0, err0, 1, 0, "TP all_reduce"),
                                         (took1, err1, 0, 1, "WORLD step broadcast")):
        assert err is not None and 1.0 <= took < 2.5, (took, err)
        assert err.startswith(f"peer rank {peer} did not answer within 1 s (hung?"), err
        assert f"rank {rank}'s {what} with it timed out: RuntimeError: " in err and "Timed out" in err, err
