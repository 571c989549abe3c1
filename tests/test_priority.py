"""Priority scheduling (`--scheduling-policy priority`, vLLM's): the scheduler on a tiny KV pool against
hand-written expectations (admission order, preemption victims, the waiting queue after a preemption, a DI
consumer's admission); the engine's outputs under priority equal fcfs's while the order requests get their
first token follows priority; the refusals (a non-integer priority, a non-zero one under fcfs)."""

from __future__ import annotations

from typing import Any

import pytest

from gigadecode.engine_config import EngineConfig
from gigadecode.kv.manager import KVCacheManager
from gigadecode.kv.spec import FullAttentionSpec, make_kv_cache_config
from gigadecode.request import Request, RequestError, Status
from gigadecode.sampling import SamplingParams
from gigadecode.scheduler import Scheduler

BLOCK = 4


def make_scheduler(policy: str, usable_blocks: int, **kw) -> Scheduler:
    """One full-attention layer: a request of n tokens holds ceil(n / 4) blocks."""
    kvc = make_kv_cache_config({0: FullAttentionSpec(BLOCK, 1, 8, 4)}, usable_blocks + 1)
    ecfg = EngineConfig(block_size=BLOCK, scheduling_policy=policy, **kw)
    return Scheduler(ecfg, KVCacheManager(kvc, BLOCK))


def req(name: str, prompt_len: int, priority: int = 0, max_tokens: int = 4) -> Request:
    return Request(name, list(range(1, prompt_len + 1)), SamplingParams(temperature=0.0, max_tokens=max_tokens),
                   priority=priority)


def run_step(s: Scheduler) -> tuple[list[str], list[str], list[str]]:
    """One step as the engine takes it (every computed sequence end samples token 7; a request finishes at
    max_tokens) -> (admitted this step, decoded, finished)."""
    running_before = {r.request_id for r in s.running}
    plan = s.schedule()
    admitted = [r.request_id for r, _ in plan.prefills if r.request_id not in running_before]
    admitted += [r.request_id for r in plan.decodes if r.request_id not in running_before]
    done = []
    for r, n in plan.prefills + [(r, 1) for r in plan.decodes]:
        r.num_computed += n
        if r.num_computed == r.num_tokens:
            r.output_ids.append(7)
            if len(r.output_ids) == r.params.max_tokens:
                s.finish(r, "length")
                done.append(r.request_id)
    return admitted, [r.request_id for r in plan.decodes], done


@pytest.mark.parametrize("policy, expected", [("fcfs", ["A", "B", "C", "D"]), ("priority", ["B", "D", "C", "A"])])
def test_admission_order(policy, expected):
    """One sequence at a time: requests are admitted in arrival order (fcfs) or by (priority, arrival)."""
    s = make_scheduler(policy, usable_blocks=64, max_num_seqs=1)
    for name, prio in (("A", 2), ("B", -1), ("C", 1), ("D", -1)):
        s.add(req(name, 5, prio if policy == "priority" else 0))
    order = []
    while s.has_unfinished():
        admitted, _, _ = run_step(s)
        order += admitted
    assert order == expected


def test_priority_orders_the_queue_not_running_requests():
    """vLLM's v1 scheduler: a better priority that arrives while the running set is full waits for a free
    seat (it does not preempt anyone), then goes before everyone who waits."""
    s = make_scheduler("priority", usable_blocks=64, max_num_seqs=1)
    s.add(req("A", 5, priority=5, max_tokens=3))
    assert run_step(s)[0] == ["A"]
    s.add(req("B", 5, priority=9))
    s.add(req("C", 5, priority=0))
    steps = [run_step(s) for _ in range(3)]
    assert [a for a, _, _ in steps] == [[], [], ["C"]]           # A runs to its end: 3 tokens
    assert [d for _, _, d in steps] == [[], ["A"], []]
    assert [r.request_id for r in s.waiting] == ["B"]
    assert s.num_preemptions == 0


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_preemption_victim(policy):
    """6 usable blocks of 4 tokens. A, B (priority 1) take 2 blocks each for their 7-token prompts; a step
    later C (priority 0) takes the last 2. Next step A's decode needs a 3rd block: fcfs preempts the newest
    running request (C), priority the one of the largest (priority, arrival) (B); D (priority 2) waits
    behind the preempted request (fcfs: at the front of the queue; priority: at its place)."""
    prio = (lambda p: p) if policy == "priority" else (lambda p: 0)
    s = make_scheduler(policy, usable_blocks=6, max_prefill_tokens=16)
    s.add(req("A", 7, prio(1), max_tokens=8))
    s.add(req("B", 7, prio(1), max_tokens=8))
    assert run_step(s)[0] == ["A", "B"]
    s.add(req("C", 7, prio(0), max_tokens=8))
    assert run_step(s)[:2] == (["C"], ["A", "B"])
    assert s.kv_manager.num_free_blocks == 0
    s.add(req("D", 3, prio(2), max_tokens=8))
    admitted, decoded, _ = run_step(s)
    victim, kept = ("C", ["A", "B"]) if policy == "fcfs" else ("B", ["A", "C"])
    assert s.num_preemptions == 1 and admitted == []
    assert decoded == kept
    assert sorted(r.request_id for r in s.running) == kept
    assert [r.request_id for r in s.waiting] == [victim, "D"]
    v = next(r for r in s.waiting if r.request_id == victim)
    assert v.status == Status.WAITING and v.num_computed == 0 and v.num_preemptions == 1
    while s.has_unfinished():                                   # everyone finishes, the pool is whole again
        run_step(s)
    assert s.kv_manager.num_free_blocks == 6


def test_preempted_request_reenters_at_its_place():
    """Under priority a preempted request goes back by (priority, arrival), so a waiting request of better
    priority still goes first (fcfs puts it at the front, see above)."""
    s = make_scheduler("priority", usable_blocks=4, max_prefill_tokens=16)
    s.add(req("A", 7, 0, max_tokens=8))
    s.add(req("B", 7, 3, max_tokens=8))
    assert run_step(s)[0] == ["A", "B"]
    s.add(req("C", 7, 1))                                       # 2 blocks: never free in these steps
    run_step(s)                                                 # decodes at position 7: no new block
    assert s.num_preemptions == 0
    run_step(s)                                                 # A needs a 3rd block: B (3, 1) goes
    assert s.num_preemptions == 1
    assert [r.request_id for r in s.waiting] == ["C", "B"]


def test_remote_admission_follows_priority():
    """A DI consumer's request waits in the same queue: admitted (blocks for its remote tokens) in order."""
    s = make_scheduler("priority", usable_blocks=64, max_num_seqs=1)
    x, y = req("X", 8, priority=1), req("Y", 8, priority=0)
    x.remote_tokens = y.remote_tokens = 7
    s.add(x)
    s.add(y)
    plan = s.schedule()
    assert [r.request_id for r in plan.remote_admits] == ["Y"]
    assert y.status == Status.WAITING_FOR_REMOTE_KV and [r.request_id for r in s.waiting] == ["X"]


def test_check_priority():
    fcfs, prio = make_scheduler("fcfs", 8), make_scheduler("priority", 8)
    fcfs.check_priority(0)
    prio.check_priority(-5)
    prio.check_priority(10**30)
    with pytest.raises(RequestError, match="not enabled") as e:
        fcfs.check_priority(1)
    assert e.value.param == "priority"
    for bad in (True, 1.0, "1", None):
        with pytest.raises(RequestError, match="integer") as e:
            prio.check_priority(bad)
        assert e.value.param == "priority"


# ------------------------------------------------------------------------------------------------------
# the engine: the same outputs as fcfs, the first tokens in priority order
# ------------------------------------------------------------------------------------------------------
PRIORITIES = [3, 0, 2, 0, 1, -1, 3, 1]
LENGTHS = [4, 9, 3, 14, 6, 2, 11, 7]


def _engine_run(ckpt, policy: str, proposer=None, **kw) -> tuple[dict[int, list[int]], list[int], dict[int, int], Any]:
    """Every request added before the first step (prompts: a shared 8-token prefix, then a random part
    twice, for the prefix cache and the n-gram drafts) -> (outputs by index, indices in the order their first
    token came, first-token step by index, the engine's stats)."""
    from .helpers import random_prompt
    from .test_engine import greedy, make_engine

    eng = make_engine(ckpt, scheduling_policy=policy, **kw)
    if proposer is not None:
        eng.scheduler.proposer = proposer
    ids = [eng.add_request(list(range(11, 19)) + random_prompt(n, 1024, seed=900 + i) * 2, greedy(10 + i % 4),
                           priority=p if policy == "priority" else 0)
           for i, (n, p) in enumerate(zip(LENGTHS, PRIORITIES))]
    index = {rid: i for i, rid in enumerate(ids)}
    first: dict[int, int] = {}
    step = 0
    while eng.has_unfinished():
        for out in eng.step():
            if out.new_token_ids and index[out.request_id] not in first:
                first[index[out.request_id]] = step
        step += 1
    order = sorted(first, key=lambda i: (first[i], i))
    assert eng.kv_manager.num_free_blocks == eng.runner.kv.num_blocks - 1
    return {i: eng.requests[rid].output_ids for rid, i in index.items()}, order, first, eng.stats


BY_PRIORITY = sorted(range(len(PRIORITIES)), key=lambda i: (PRIORITIES[i], i))    # [5, 1, 3, 4, 7, 2, 0, 6]


@pytest.mark.parametrize("extra", [{}, {"enable_prefix_caching": True}, {"speculative": True}],
                         ids=["plain", "prefix-caching", "speculative"])
def test_engine_one_at_a_time_follows_priority(tiny_ckpt, extra):
    """One sequence at a time: fcfs serves the requests in arrival order, priority in (priority, arrival)
    order, and every request's greedy output is the same under both (speculative: priority's run verifies
    drafts read from fcfs's outputs, 30 % of them wrong, test_speculative's OracleProposer)."""
    from gigadecode.speculative import SpeculativeConfig

    from .test_speculative import OracleProposer

    out_f, order_f, _, _ = _engine_run(tiny_ckpt, "fcfs", max_num_seqs=1,
                                       **{k: v for k, v in extra.items() if k != "speculative"})
    proposer = None
    if extra.get("speculative"):
        extra = {"speculative": SpeculativeConfig(num_speculative_tokens=3, adaptive=False)}
        proposer = OracleProposer({f"req-{i}": o for i, o in out_f.items()}, 3, 0.3, 1024)
    out_p, order_p, _, st = _engine_run(tiny_ckpt, "priority", proposer, max_num_seqs=1, **extra)
    assert order_f == list(range(len(PRIORITIES)))
    assert order_p == BY_PRIORITY
    assert out_p == out_f
    if "enable_prefix_caching" in extra:
        assert st.prefix_cache_hits > 0
    if "speculative" in extra:
        assert st.spec_accepted_tokens > 0


def test_engine_preempting_pool_keeps_outputs(tiny_ckpt):
    """A pool too small for the batch: requests are preempted and recomputed, their outputs unchanged; a
    request never gets its first token after one of a worse (priority, arrival)."""
    kw = dict(max_num_seqs=8, num_blocks=29, max_prefill_tokens=32)
    out_f, _, _, st_f = _engine_run(tiny_ckpt, "fcfs", **kw)
    out_p, _, first, st_p = _engine_run(tiny_ckpt, "priority", **kw)
    assert st_p.preemptions > 0 and st_f.preemptions > 0, "the pool is meant to be small enough to preempt"
    assert out_p == out_f
    steps = [first[i] for i in BY_PRIORITY]
    assert steps == sorted(steps)


def test_engine_refuses_priority_under_fcfs(tiny_ckpt):
    from .test_engine import greedy, make_engine

    eng = make_engine(tiny_ckpt)
    with pytest.raises(RequestError, match="not enabled") as e:
        eng.add_request([5, 6, 7], greedy(2), priority=1)
    assert e.value.param == "priority" and not eng.requests and not eng.has_unfinished()
    eng.add_request([5, 6, 7], greedy(2), priority=0)
    eng = make_engine(tiny_ckpt, scheduling_policy="priority")
    with pytest.raises(RequestError, match="integer"):
        eng.add_request([5, 6, 7], greedy(2), priority=True)
    assert not eng.requests
