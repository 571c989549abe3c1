"""The parallel engine: an `LLMEngine` replica on every rank of a TP × DP × EP layout, stepped in lockstep
and fronted by world rank 0.

Every rank builds the same engine over its own shard (`build_parallel_engine`). The ranks of one DP group
hold the same requests and take the same scheduling decisions — the scheduler is deterministic, every
TP rank samples the same token (the distributed argmax, or the same gathered logits with the same
per-request generator; rank 0 gives a seed to every non-greedy request that has none) — so their model
calls, and the TP collectives inside them, line up by construction. DP groups hold different requests;
where an EP group spans DP groups the runner's `agree_step` pads their model calls to match.

World rank 0's `DistributedEngine` is what `generate` and the server drive: it has LLMEngine's interface
(`add_request`, `abort`, `step`, `has_unfinished`, `requests`, `running`, `waiting`, `kv_usage`, `stats`,
`max_model_len`). Each of its steps
1. broadcasts a `StepInbox` to the world: new requests (each placed on the least-loaded DP group after
   rank 0 validated it), aborts, DI leases to end early, or stop;
2. steps rank 0's own replica, while every other rank does the same in `run_worker`;
3. gathers from the first TP rank of each DP group that group's `RequestOutput`s and a small status, and
   applies them to its mirror `Request`s (which is what `requests` holds on rank 0).
A rank whose step raises with TP, EP or DCP peers cannot go on in lockstep: its peers may be waiting inside a
collective it will never join, and gloo frees them only when its process ends. Nor may it start another
collective after its failed phase (`LLMEngine.lockstep`: the step stops there, raising), for that one would
pair with a peer's pending call of another phase (gloo aborts the process on the size mismatch, or hands one
call's data to the other). (A pure DP replica has no such peer: it fails its requests and serves on.) So the
rank raises `RankFailure` out of its step: a worker's process exits with it (its peers' collectives then fail,
and they stop alike; torchrun ends the rest), and rank 0's `DistributedEngine` finishes every unfinished
request with that error and stops (every later step raises `RankFailure`). A collective that fails because a
peer is gone says so (`distributed.context.CollectiveFailed`: "peer rank 1 of the world was lost: …", gloo's
error kept), rather than blaming the rank that saw it. A rank that hangs fails nothing by itself (its sockets
stay open): once the world has stepped, every collective waits at most `--distributed-timeout-s` for a peer
(`_arm_after_first_step`), then fails as above ("peer rank 1 did not answer within 300 s (hung? …)"); an idle
server's steps are the heartbeat that keeps a healthy world inside it.

Disaggregated roles work the same way: each rank has a NIXL connector over its kv heads and a TP group's
connectors agree on every transfer event (`parallel.connector.TPGroupConnector`), so a prefill engine of one
TP size feeds a decode engine of another (each decode rank reads its heads' slice of the blocks of whichever
prefill ranks hold them). Three world collectives per step (broadcast, the EP agreement, gather), a few
hundred bytes.

This is SGLang's arrangement (a scheduler on every rank, requests broadcast from rank 0) rather than vLLM's
(one scheduler shipping each step's batch to workers): nothing per step is serialized but new requests.
"""

from __future__ import annotations

import logging
import os
import random
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch.distributed as dist

from ..config import GptOssConfig
from ..engine_config import EngineConfig
from ..connector.params import KVTransferParams
from ..engine import LLMEngine, Request, RequestError, RequestOutput, Status
from ..request import EngineStats
from ..runner import ModelRunner
from ..sampling import SamplingParams
from ..distributed.context import CollectiveFailed, ParallelContext, init_distributed, make_parallel_context
from ..distributed.mesh import LayoutError

log = logging.getLogger(__name__)


class RankFailure(RuntimeError):
    """A rank's engine step raised (or a collective with a rank that did failed): the world cannot go on in
    lockstep, so this rank leaves it."""


@dataclass
class StepInbox:
    """What world rank 0 tells every rank before a step."""
    adds: list[tuple[int, str, list[int], SamplingParams, KVTransferParams | None, int]] = field(default_factory=list)
    #     (dp group, request id, prompt, params, kv_transfer_params, priority)
    aborts: list[tuple[int, str, str]] = field(default_factory=list)             # (dp group, id, reason)
    releases: list[str] = field(default_factory=list)     # DI producer: leases to end now, on every rank
    warm_up: bool = False                                 # every replica runs `LLMEngine.warm_up` first
    stop: bool = False
    # rank 0's wall clock as it sends the step: every rank judges the adds' DI leases at it, so the ranks of a
    # TP group cannot split on a lease that runs out between their clocks (diverged batches abort the world)
    now: float | None = None


@dataclass
class GroupReport:
    """What the first TP rank of a DP group sends back after a step."""
    dp_rank: int
    outputs: list[RequestOutput]
    running: list[str]
    waiting: list[str]
    kv_used: int
    kv_total: int
    stats: dict
    transfer_params: dict[str, dict] = field(default_factory=dict)   # DI producer: request id -> its answer
    leased: list[str] = field(default_factory=list)   # DI producer: requests whose KV the group holds for a read


@dataclass
class RankKV:
    """What every other rank sends back after a step: its own KV pool's use (DCP ranks hold other tokens)."""
    rank: int
    kv_used: int
    kv_total: int
    kv_bytes: int = 0                   # KV bytes this rank's connector moved (its share of the heads)


@dataclass
class StepTrace:
    """One step as this rank saw it (benchmarks and tests): wall time, the collectives it made and whether
    it ran prefill / decode tokens."""
    seconds: float
    collectives: dict
    prefill_tokens: int
    decode_tokens: int
    kv_used: int = 0                    # this rank's KV blocks in use after the step


def build_parallel_engine(model_dir: str | Path, ecfg: EngineConfig, progress: bool = False, *,
                          host: str = "127.0.0.1", advertise_host: str | None = None, side_port: int = 0
                          ) -> tuple[LLMEngine, ParallelContext]:
    """This rank's engine replica over its shard, and its context. Every rank calls it (collectively); the
    default process group is initialized from torchrun's environment if it is not already.

    A prefill or decode role (`ecfg.kv_role`) gets a NIXL connector per rank over its kv heads, joined
    with its TP group's (`TPGroupConnector`); a producer rank serves its handshake on `host:side_port +
    rank` (side_port 0: any free port), which its answers advertise."""
    _, world = init_distributed()
    if world != ecfg.tp * ecfg.dp:
        raise LayoutError(f"--tp {ecfg.tp} × --dp {ecfg.dp} = {ecfg.tp * ecfg.dp} ranks, but the world has {world}")
    cfg = GptOssConfig.from_hf(model_dir)
    ctx = make_parallel_context(cfg, ecfg.tp, ecfg.dp, ecfg.ep, ecfg.dcp, ecfg.dcp_chunk)
    runner = ModelRunner(model_dir, ecfg, cfg, progress=progress and ctx.rank == 0, parallel=ctx)
    connector = None
    if ecfg.kv_role != "kv_both":
        from ..connector.nixl_connector import NixlConnector
        from ..safetensors_files import weights_fingerprint
        from ..weights import shard_ranges
        from .connector import TPGroupConnector
        inner = NixlConnector(ecfg.kv_role, runner.kv, cfg, secret=ecfg.kv_secret, host=host,
                              advertise_host=advertise_host, side_port=side_port + ctx.rank if side_port
                              else 0, lease_s=ecfg.kv_lease_s, timeout_s=ecfg.kv_transfer_timeout_s,
                              engine_id=f"{ecfg.kv_role}-{uuid.uuid4().hex[:8]}-r{ctx.rank}",
                              kv_head_start=shard_ranges(cfg, ctx.shard)["kv_heads"][0], notify_on_read=False,
                              tokens=ctx.tokens, vllm_kv_layout=ecfg.vllm_kv_layout, consumers=ctx.tp_size,
                              model_fingerprint=weights_fingerprint(runner.model_dir))
        connector = TPGroupConnector(inner, ctx)
        ids: list = [None] * ctx.world_size       # a DP group's answers name its own rank: release checks all
        dist.all_gather_object(ids, inner.engine_id, group=ctx.world_group)
        connector.server_engine_ids = frozenset(ids)
    engine = LLMEngine(runner, ecfg, connector)
    engine.lockstep = has_lockstep_peers(ctx)
    return engine, ctx


# --------------------------------------------------------------------------------------------------
# what every rank does each step
# --------------------------------------------------------------------------------------------------
def _replica_step(engine: LLMEngine, ctx: ParallelContext, inbox: StepInbox,
                  trace: list[StepTrace] | None) -> GroupReport | None:
    """Apply the inbox to this rank's replica, step it, and (first TP rank of the group) report."""
    outputs: list[RequestOutput] = []
    for g, rid, prompt, params, kv_params, priority in inbox.adds:    # in rank 0's order: the same arrivals
        if g != ctx.dp_rank:
            continue
        try:
            engine.add_request(prompt, params, request_id=rid, kv_transfer_params=kv_params, priority=priority,
                               now=inbox.now)
        except ValueError as e:              # rank 0 checked it; only a replica out of step gets here
            outputs.append(RequestOutput(rid, [], True, "error", error=str(e)))
    for g, rid, reason in inbox.aborts:
        if g == ctx.dp_rank:
            engine.abort(rid, reason)
            engine.requests.pop(rid, None)
    for rid in inbox.releases:               # every rank of the group holding the lease ends it in this step
        engine.release_lease(rid)
    # peers inside this step's collectives (TP, EP, DCP): a rank that raised cannot rejoin them (a lockstep
    # replica raises at its first failed phase, before any later collective). A replica without any (pure DP)
    # reaches the step's gather whatever happened: it fails its requests and serves on
    if inbox.warm_up:                        # every rank at once: the forward's collectives line up
        try:
            engine.warm_up()                 # only a lockstep replica's raises (a failed one is logged)
        except Exception as e:
            raise _leave_the_world(ctx, e) from e
    s0 = engine.stats.as_dict()
    ctx.stats.reset()
    t0 = time.perf_counter()
    try:
        outputs += engine.step()
    except Exception as e:
        if has_lockstep_peers(ctx):
            raise _leave_the_world(ctx, e) from e
        outputs += _fail_running(engine, f"engine step failed: {type(e).__name__}: {e}")
    if trace is not None:
        trace.append(StepTrace(time.perf_counter() - t0, ctx.stats.snapshot(),
                               engine.stats.prefill_tokens - s0["prefill_tokens"],
                               engine.stats.decode_tokens - s0["decode_tokens"], engine.kv_usage()[0]))
    transfer_params = {}
    for out in outputs:
        if out.finished:
            req = engine.requests.pop(out.request_id, None)
            if req is not None and out.error is None:
                out.error = req.error
            if req is not None and req.kv_transfer_params_out is not None:
                transfer_params[out.request_id] = req.kv_transfer_params_out
    used, total = engine.kv_usage()
    if ctx.tp_rank != 0:
        return RankKV(ctx.rank, used, total, engine.stats.kv_bytes_transferred)
    return GroupReport(ctx.dp_rank, outputs, [r.request_id for r in engine.running],
                       [r.request_id for r in engine.waiting], used, total, engine.stats.as_dict(), transfer_params,
                       engine.connector.leased_ids() if engine.connector is not None else [])


def has_lockstep_peers(ctx: ParallelContext) -> bool:
    """Whether this rank's model calls hold collectives with peers (TP, EP or DCP): then it cannot go on after
    a failure of its own (`LLMEngine.lockstep`). A pure DP replica has none."""
    return ctx.tp_size > 1 or ctx.ep_size > 1 or ctx.dcp_size > 1


def _leave_the_world(ctx: ParallelContext, e: Exception) -> RankFailure:
    """Why this rank leaves the world (a collective with a peer failed, `CollectiveFailed`: a peer it lost,
    which one where the group tells it; or its own step's error), logged at once: the process groups' teardown
    on the way out can end the process before its traceback is printed, while its peers go on to say only
    that this rank was lost."""
    own = f"rank {ctx.rank}: engine step failed: {type(e).__name__}: {e}"
    text = str(e) if isinstance(e, CollectiveFailed) else own
    log.error("world rank %d leaves the world: %s", ctx.rank, text, exc_info=e)
    return RankFailure(text)


def _fail_running(engine: LLMEngine, msg: str) -> list[RequestOutput]:
    victims = list(engine.running) or list(engine.waiting)
    for req in victims:
        engine.abort(req.request_id)
        req.error = msg
    return [RequestOutput(r.request_id, [], True, "error", error=msg) for r in victims]


def _exchange(ctx: ParallelContext, inbox: StepInbox | None) -> StepInbox:
    box = [inbox]
    with ctx.failing_as("world", "step broadcast"):
        dist.broadcast_object_list(box, src=0, group=ctx.world_group)
    return box[0]


def _arm_after_first_step(engine: LLMEngine, ctx: ParallelContext) -> None:
    """Once the world has stepped together, a collective waits at most `--distributed-timeout-s` for a peer.
    Before, the start-up timeout holds: the ranks load their shards (and rank 0 its tokenizer, `generate` its
    requests) at their own pace, and the first step is the warm-up. Serving, no wait is that long: lockstep
    ranks meet in every layer's collectives (a wait is one layer's imbalance, not a step's), DP groups that no
    EP group spans wait in the step gather for the slowest group's step (one prefill chunk at most), and an
    idle server still steps every `server.async_engine.IDLE_STEP_S` (its heartbeat)."""
    if ctx.timeout_s != engine.ecfg.distributed_timeout_s:
        ctx.arm_timeout(engine.ecfg.distributed_timeout_s)


def run_worker(engine: LLMEngine, ctx: ParallelContext, trace: list[StepTrace] | None = None) -> None:
    """Every rank but 0: step this replica as rank 0 says until it says stop."""
    while True:
        inbox = _exchange(ctx, None)
        if inbox.stop:
            dist.barrier(group=ctx.world_group)      # nobody tears the group down while a message is in flight
            return
        report = _replica_step(engine, ctx, inbox, trace)
        with ctx.failing_as("world", "step gather"):
            dist.gather_object(report, None, dst=0, group=ctx.world_group)
        _arm_after_first_step(engine, ctx)


# --------------------------------------------------------------------------------------------------
# world rank 0
# --------------------------------------------------------------------------------------------------
class DistributedEngine:
    """World rank 0's engine: LLMEngine's interface over the DP groups' replicas (see the module doc)."""

    def __init__(self, replica: LLMEngine, ctx: ParallelContext, trace: list[StepTrace] | None = None) -> None:
        if ctx.rank != 0:
            raise ValueError("DistributedEngine runs on world rank 0; other ranks call run_worker")
        self.replica, self.ctx, self.trace = replica, ctx, trace
        self.cfg = replica.cfg
        self.runner = replica.runner            # rank 0's (its KV pool has the size of every DP group's)
        self.max_model_len = replica.max_model_len
        self.eos_token_ids, self.generation_defaults = replica.eos_token_ids, replica.generation_defaults
        self.connector = replica.connector      # rank 0's (its handshake; every rank's is in a producer's answer)
        self.requests: dict[str, Request] = {}  # mirrors of every request, updated from the groups' outputs
        self._group: dict[str, int] = {}        # unfinished request id -> DP group (a caller may forget
                                                #   finished requests: a server drops them from `requests`)
        self._inbox = StepInbox()
        self._ids = 0
        self._reports: dict[int, GroupReport] = {}
        self._rank_kv: dict[int, tuple[int, int]] = {}   # world rank -> (blocks used, usable) after the last step
        self._rank_bytes: dict[int, int] = {}   # world rank (not a group's first) -> KV bytes its connector moved
        # unseeded requests get a seed here, so every TP rank draws alike (from --seed, or fresh randomness)
        self._seed = random.Random(replica.ecfg.seed) if replica.ecfg.seed is not None else random.SystemRandom()
        self._stopped = False
        self._failure: str | None = None        # why the world stopped (a rank failed); no collective after it

    # -- LLMEngine's interface ---------------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, kv_transfer_params: KVTransferParams | dict | None = None,
                    priority: int = 0) -> str:
        if self._failure is not None:
            raise RankFailure(f"this parallel engine stopped: {self._failure}")
        params = params or SamplingParams()
        if request_id is None:
            request_id, self._ids = f"req-{self._ids}", self._ids + 1
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        self.replica.scheduler.check_priority(priority)     # the replicas' policy (every rank has the same)
        kv = LLMEngine._parse_kv(kv_transfer_params) if kv_transfer_params else None
        self.replica.check_request(prompt_ids, params, kv)   # every group's replica would agree
        if not params.is_greedy and params.seed is None:    # every TP rank must draw the same tokens
            params = replace(params, seed=self._seed.randrange(2**63))
        load = [0] * self.ctx.dp_size
        for g in self._group.values():                      # the unfinished requests' groups
            load[g] += 1
        for g, rep in self._reports.items():                # and a prefill's KV held for a read
            load[g] += len(rep.leased)
        g = min(range(self.ctx.dp_size), key=lambda i: (load[i], i))
        self.requests[request_id] = Request(request_id, list(prompt_ids), params, priority=priority)
        self._group[request_id] = g
        self._inbox.adds.append((g, request_id, list(prompt_ids), params, kv, priority))
        return request_id

    def abort(self, request_id: str, reason: str = "abort") -> bool:
        """`LLMEngine.abort` on the ranks of the request's group, in the next step."""
        req = self.requests.get(request_id)
        if req is None or req.finished:
            return False
        reason = "stop" if reason == "stop" else "abort"
        req.status = Status.finished_with(reason)
        self._inbox.aborts.append((self._group.pop(request_id), request_id, reason))
        return True

    def release_kv(self, raw: dict) -> bool:
        """The params are checked as one rank's engine checks them (rank 0 answers for its group); the
        lease is then ended on every rank in the next step (`release_lease`)."""
        rid = self.replica.leased_request(raw)
        return rid is not None and self.release_lease(rid)

    def release_lease(self, request_id: str) -> bool:
        """A producer: end a request's KV lease on every rank, in the same step (a TP group frees blocks
        only once all its ranks ended the lease). -> whether a DP group held that lease at its last step."""
        conn = self.connector
        if conn is None or not conn.is_producer:
            return False
        self._inbox.releases.append(request_id)
        return conn.holds_lease(request_id) or any(request_id in rep.leased for rep in self._reports.values())

    def has_unfinished(self) -> bool:
        """A request runs, or an abort or lease release waits for the next step to reach the ranks (the usual
        `while has_unfinished(): step()` delivers it: else the replicas would hold that KV until some later
        step)."""
        pending = self._failure is None and bool(self._inbox.aborts or self._inbox.releases)
        return pending or any(not r.finished for r in self.requests.values())

    def warm_up(self) -> float:
        """Every rank warms its replica up (`LLMEngine.warm_up`, the same calls on every rank), in one
        step of otherwise nothing; call it on the thread that steps this engine. -> seconds it took here."""
        t0 = time.perf_counter()
        self._inbox.warm_up = True
        self.step()
        return time.perf_counter() - t0

    def step(self) -> list[RequestOutput]:
        if self._failure is not None:
            raise RankFailure(f"this parallel engine stopped: {self._failure}")
        if self._stopped:
            raise RuntimeError("this parallel engine was shut down")
        inbox, self._inbox = self._inbox, StepInbox()
        inbox.now = time.time()
        try:
            _exchange(self.ctx, inbox)
            mine = _replica_step(self.replica, self.ctx, inbox, self.trace)
            gathered: list[GroupReport | None] = [None] * self.ctx.world_size
            with self.ctx.failing_as("world", "step gather"):
                dist.gather_object(mine, gathered, dst=0, group=self.ctx.world_group)
        except Exception as e:  # noqa: BLE001 - this rank's step, or a collective with a rank that left
            return self._stop_after_failure(e)
        _arm_after_first_step(self.replica, self.ctx)
        outputs = []
        now = time.monotonic()
        for r, rep in enumerate(gathered):
            if rep is None:
                continue
            self._rank_kv[r] = (rep.kv_used, rep.kv_total)
            if isinstance(rep, RankKV):
                self._rank_bytes[r] = rep.kv_bytes
                continue
            self._reports[rep.dp_rank] = rep
            for out in rep.outputs:
                if out.request_id in rep.transfer_params and out.request_id in self.requests:
                    self.requests[out.request_id].kv_transfer_params_out = rep.transfer_params[out.request_id]
                if self._apply(out, now):
                    outputs.append(out)
        return outputs

    @property
    def failure(self) -> str | None:
        """Why this engine stopped (a rank failed), or None while it serves: the server reads it."""
        return self._failure

    def _stop_after_failure(self, e: Exception) -> list[RequestOutput]:
        """A rank failed: finish every unfinished request with the error, and make no collective again (a
        peer may be gone, or waiting in one that will never complete). -> the requests' final outputs."""
        log.error("parallel engine stopped: %s: %s", type(e).__name__, e, exc_info=e)
        self._failure = str(e) if isinstance(e, (RankFailure, CollectiveFailed)) else \
            f"a rank failed: {type(e).__name__}: {e}"
        self._stopped = True
        msg = f"parallel engine stopped: {self._failure}"
        outputs = []
        for rid in list(self._group):
            req = self.requests.get(rid)
            self._group.pop(rid)
            if req is None or req.finished:
                continue
            req.status, req.error = Status.finished_with("error"), msg
            outputs.append(RequestOutput(rid, [], True, "error", error=msg))
        return outputs

    def _apply(self, out: RequestOutput, now: float) -> bool:
        req = self.requests.get(out.request_id)
        if req is None or req.finished:          # aborted (or forgotten) here meanwhile
            return False
        req.output_ids += out.new_token_ids
        req.output_logprobs += out.new_logprobs
        if out.prompt_logprobs is not None:
            req.prompt_logprobs = list(out.prompt_logprobs)
        if out.num_cached_tokens is not None:
            req.num_cached_tokens = out.num_cached_tokens
        if out.new_token_ids:
            req.first_token_time = req.first_token_time or now
            req.last_token_time = now
            req.status = Status.RUNNING
        if out.finished:
            req.status, req.error = Status.finished_with(out.finish_reason or "error"), out.error
            self._group.pop(out.request_id, None)
        return True

    @property
    def running(self) -> list[Request]:
        return self._listed("running")

    @property
    def waiting(self) -> list[Request]:
        return self._listed("waiting")

    def _listed(self, which: str) -> list[Request]:
        ids = [rid for rep in self._reports.values() for rid in getattr(rep, which)]
        return [self.requests[i] for i in ids if i in self.requests and not self.requests[i].finished]

    def kv_usage(self) -> tuple[int, int]:
        """Summed over the DP groups (each has its own pool)."""
        if len(self._reports) < self.ctx.dp_size:          # before the first step: every pool is empty
            return 0, self.replica.kv_usage()[1] * self.ctx.dp_size
        return (sum(r.kv_used for r in self._reports.values()), sum(r.kv_total for r in self._reports.values()))

    def kv_usage_per_rank(self) -> dict[int, tuple[int, int]]:
        """World rank -> (KV blocks used, usable) of its own pool, as of the last step."""
        if len(self._rank_kv) < self.ctx.world_size:
            return {r: (0, self.replica.kv_usage()[1]) for r in range(self.ctx.world_size)}
        return dict(sorted(self._rank_kv.items()))

    @property
    def stats(self) -> EngineStats:
        """Summed over the DP groups (rank 0's own before the first step)."""
        if not self._reports:
            return self.replica.stats
        total = sum((EngineStats(**rep.stats) for rep in self._reports.values()), EngineStats())
        total.kv_bytes_transferred += sum(self._rank_bytes.values())    # each TP rank reads its own heads
        return total

    def num_leases(self) -> int:
        """Summed over the DP groups, as of the last step."""
        return sum(len(rep.leased) for rep in self._reports.values())

    def shutdown(self) -> None:
        """Tell every other rank to leave `run_worker` (idempotent)."""
        if not self._stopped:
            self._stopped = True
            _exchange(self.ctx, StepInbox(stop=True))
            dist.barrier(group=self.ctx.world_group)

    def __enter__(self) -> DistributedEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def is_parallel(ecfg: EngineConfig) -> bool:
    """True when the engine flags ask for more than one rank (or torchrun started several)."""
    return ecfg.tp * ecfg.dp * ecfg.ep > 1 or int(os.environ.get("WORLD_SIZE", "1")) > 1

