"""The continuous-batching scheduler: who runs this step, and which KV blocks they hold.

Each step `schedule()`
1. keeps every running request that needs exactly one more token computed in the decode batch (the GK
   program), growing its KV by one slot when a block fills; with speculative decoding (`proposer`) it also
   gets its drafts (`Request.draft_ids`) and their slots, where the pool has them without preempting anyone;
2. spends a prefill token budget (`max_prefill_tokens`) on running prompts first, then on waiting
   requests in queue order (chunked prefill through the per-layer model, so a long prompt never
   stalls running decodes for more than one chunk);
3. admits only what the KV pool holds; when a running request cannot grow, the newest running request
   is preempted: its blocks are freed and it is recomputed later from prompt + output so far (its
   sampler generator is kept, so its output does not change).
Scheduling policy (`EngineConfig.scheduling_policy`, vLLM's `--scheduling-policy`): "fcfs" queues by arrival
and a preempted request goes back to the front; "priority" keeps the waiting queue sorted by
(`Request.priority`, arrival) -- lower values first, a preempted request re-enters at its place -- and the
victim of a preemption is the running request with the largest (priority, arrival). As in vLLM's v1
scheduler, a waiting request never preempts a running one: priority orders admissions and chooses victims.
Arrival is the order of `add` (`Request.arrival_index`), the same on every TP rank.
A request needs tokens `[num_computed, len(prompt + output))` computed; when the last of them is
computed its logits are sampled. A DI consumer request is admitted with blocks for its N-1 remote tokens
(`remote_admits`; it waits for its KV as `WAITING_FOR_REMOTE_KV`, then its first step is a decode), a DI
producer request with nothing to compute goes straight to its hand-off (`handoffs`).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from .engine_config import EngineConfig
from .kv.manager import KVCacheManager
from .request import Request, RequestError, Status


@dataclass
class SchedulerOutput:
    """One step's plan."""

    decodes: list[Request] = field(default_factory=list)              # one token each, through the GK program
    prefills: list[tuple[Request, int]] = field(default_factory=list)  # (request, tokens this step)
    remote_admits: list[Request] = field(default_factory=list)        # DI consumer: blocks allocated, load next
    handoffs: list[Request] = field(default_factory=list)             # DI producer: nothing left to compute


class Scheduler:
    """Owns the waiting queue, the running set and the KV block tables (`kv_manager`). `on_preempt(req)`
    runs before a preempted request gives up its blocks (the engine cancels a KV load in flight);
    `proposer` (speculative.NgramProposer, suffix_decoding.SuffixProposer) drafts tokens for decoding requests."""

    def __init__(self, ecfg: EngineConfig, kv_manager: KVCacheManager,
                 on_preempt: Callable[[Request], None] | None = None, proposer=None,
                 max_model_len: int | None = None) -> None:
        self.ecfg, self.kv_manager, self.on_preempt = ecfg, kv_manager, on_preempt
        self.proposer, self.max_model_len = proposer, max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.prefix_queried = 0        # prompt tokens of admissions that looked in the prefix cache
        self.prefix_hit = 0            # ... and those found there
        self.priority = ecfg.scheduling_policy == "priority"
        self._arrivals = itertools.count()

    def check_priority(self, priority: object) -> None:
        """RequestError (param "priority") unless `priority` is an int this policy takes: any int under
        "priority", only 0 under "fcfs" (vLLM refuses a non-zero priority when priority scheduling is off)."""
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise RequestError(f"priority must be an integer (got {priority!r})", param="priority")
        if priority != 0 and not self.priority:
            raise RequestError(f"got priority {priority}, but priority scheduling is not enabled "
                               f"(--scheduling-policy priority)", param="priority")

    def add(self, req: Request) -> None:
        req.arrival_index = next(self._arrivals)
        self._enqueue(req, front=False)

    @staticmethod
    def _key(req: Request) -> tuple[int, int]:
        return req.priority, req.arrival_index

    def _enqueue(self, req: Request, front: bool) -> None:
        """Into the waiting queue: fcfs at the back (a new request) or the front (a preempted or requeued one);
        priority at its (priority, arrival) place, the queue staying sorted."""
        if not self.priority:
            (self.waiting.appendleft if front else self.waiting.append)(req)
            return
        key = self._key(req)
        at = next((i for i, r in enumerate(self.waiting) if self._key(r) > key), len(self.waiting))
        self.waiting.insert(at, req)

    def _victim(self) -> Request:
        """Whom to preempt when the pool is short: the newest running request (fcfs), or the one with the
        largest (priority, arrival) (priority)."""
        return max(self.running, key=self._key) if self.priority else self.running[-1]

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def awaiting_kv(self) -> list[Request]:
        return [r for r in self.running if r.status == Status.WAITING_FOR_REMOTE_KV]

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self._grow_decodes(out)
        budget = self._continue_prefills(out, self.ecfg.max_prefill_tokens)
        self._admit_waiting(out, budget)
        self._draft_decodes(out)
        return out

    def _grow_decodes(self, out: SchedulerOutput) -> None:
        """Running requests that need one token: one more slot each, preempting `_victim()` while the pool is
        short (possibly the request itself)."""
        for req in list(self.running):
            if req.status != Status.RUNNING or req.num_tokens - req.num_computed != 1:
                continue
            while not self._allocate(req, req.num_tokens, req.num_computed):
                victim = self._victim()
                self.preempt(victim)
                if victim is req:
                    break
            if req.status == Status.RUNNING:
                out.decodes.append(req)
        out.decodes = [r for r in out.decodes if r.status == Status.RUNNING]

    def _allocate(self, req: Request, num_tokens: int, num_computed: int) -> bool:
        """`kv_manager.allocate` for a decode, a prefill chunk or an admission; where the pool is short, the
        blocks running requests still hold for rejected drafts go back first (speculation never preempts or
        delays anyone; while the pool has room they stay, for the request's next drafts)."""
        if self.kv_manager.allocate(req.request_id, num_tokens, num_computed):
            return True
        if self.proposer is None:
            return False
        freed = sum(self.kv_manager.trim(r.request_id, r.num_tokens) for r in self.running)
        return freed > 0 and self.kv_manager.allocate(req.request_id, num_tokens, num_computed)

    def _draft_decodes(self, out: SchedulerOutput) -> None:
        """Speculative decoding, last in the plan: drafts for the decoding requests, in the KV blocks left free
        after every decode, prefill chunk and admission took theirs (speculation never preempts or delays
        anyone), and in the rows left in the largest batch bucket (a step's logits stay those of one GK call:
        a [rows, vocab] fp32 tensor is 51 MB at 64 rows of GPT-OSS's vocabulary). None while
        `disable_by_batch_size` requests or more decode."""
        for req in self.running:
            req.draft_ids = []
        spec = self.ecfg.speculative
        if self.proposer is None or spec is None:
            return
        if spec.disable_by_batch_size is not None and len(out.decodes) >= spec.disable_by_batch_size:
            return
        room = self.ecfg.batch_buckets[-1] - len(out.decodes)    # rows: one GK call at most, as without drafts
        for req in out.decodes:
            if room <= 0:
                break
            room -= self._draft(req, room)

    def _draft(self, req: Request, room: int) -> int:
        """Up to `room` drafts for a decoding request and KV slots for them, if the pool has those free. A step
        emits at most drafts + 1 tokens, so the drafts stop short of max_tokens and of the context. -> drafts."""
        p = req.params
        limit = min(room, p.max_tokens - len(req.output_ids) - 1)
        if self.max_model_len is not None:
            limit = min(limit, self.max_model_len - req.num_tokens - 1)
        drafts = self.proposer.propose(req, limit) if limit > 0 else []
        if drafts and self.kv_manager.allocate(req.request_id, req.num_tokens + len(drafts), req.num_computed):
            req.draft_ids = drafts
        return len(req.draft_ids)

    def _continue_prefills(self, out: SchedulerOutput, budget: int) -> int:
        """Running prompts with more than one token left (or a producer's last one) take the budget first."""
        for req in self.running:
            if budget <= 0:
                break
            todo = req.target - req.num_computed
            decoding = todo == 1 and req in out.decodes
            producer_last = todo == 1 and req.compute_limit is not None
            if req.status != Status.RUNNING or decoding or not (todo > 1 or producer_last):
                continue
            n = min(todo, budget)
            if self._allocate(req, req.num_computed + n, req.num_computed):
                out.prefills.append((req, n))
                budget -= n
        return budget

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        """Waiting requests in queue order, while the budget, the pool and `max_num_seqs` allow (the first that
        does not fit stops the admissions: no one passes it)."""
        while self.waiting and budget > 0 and len(self.running) < self.ecfg.max_num_seqs:
            req = self.waiting[0]
            if req.remote_tokens:                  # DI consumer: blocks as if N-1 tokens were computed
                n = req.remote_tokens
                if not self._allocate(req, n + 1, n):
                    break
                self.waiting.popleft()
                req.status, req.num_computed = Status.WAITING_FOR_REMOTE_KV, n
                self.running.append(req)
                out.remote_admits.append(req)
                continue
            todo = req.target - req.num_computed
            if todo == 0:                          # a DI producer with a 1-token prompt: nothing to send
                self.waiting.popleft()
                out.handoffs.append(req)
                continue
            hit = self._cached_prefix(req)         # 0 unless nothing was computed yet
            start = req.num_computed + hit
            n = min(todo - hit, budget)
            if not self._allocate(req, start + n, start):
                if hit:
                    self.kv_manager.free(req.request_id)      # the cached blocks' references go back
                break
            self.waiting.popleft()
            if self.kv_manager.prefix is not None and req.params.prompt_logprobs is None:
                self.prefix_queried += req.target
                self.prefix_hit += hit
                if req.num_cached_tokens is None:
                    req.num_cached_tokens = hit
            req.num_computed = start
            req.status = Status.RUNNING
            self.running.append(req)
            if n == 1 and 0 < req.num_computed == req.num_tokens - 1 and req.compute_limit is None:
                out.decodes.append(req)            # a cached prefix left only the last token (not: 1 token of budget)
            else:
                out.prefills.append((req, n))
            budget -= n

    def _cached_prefix(self, req: Request) -> int:
        """Tokens of a fresh (or preempted) request found in the prefix cache, its blocks then taken: whole
        blocks, at least one token left to compute. Not for a request whose prompt logprobs must be computed,
        nor for one whose KV is on its way from a prefill server."""
        if (self.kv_manager.prefix is None or req.num_computed or req.remote_tokens
                or req.params.prompt_logprobs is not None):
            return 0
        return self.kv_manager.take_cached_prefix(req.request_id, req.all_ids, req.target - 1)

    def preempt(self, req: Request) -> None:
        """Free all of req's KV; it is recomputed from prompt + output later (the output stays the same).
        A DI consumer's remote KV is given up too: it recomputes locally."""
        if self.on_preempt is not None:
            self.on_preempt(req)
        req.remote_tokens, req.draft_ids = 0, []
        self.kv_manager.free(req.request_id)
        self.running.remove(req)
        req.num_computed = 0
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(req, front=True)

    def requeue(self, req: Request) -> None:
        """A running request back to the front of the queue (fcfs; its place under priority) with nothing
        computed (its blocks are freed)."""
        self.kv_manager.free(req.request_id)
        self.running.remove(req)
        req.num_computed, req.remote_tokens, req.status = 0, 0, Status.WAITING
        self._enqueue(req, front=True)

    def finish(self, req: Request, reason: str, keep_blocks: bool = False) -> None:
        req.status = Status.finished_with(reason)
        finished = getattr(self.proposer, "finished", None)
        if finished is not None:           # suffix decoding caches the outputs of finished requests
            finished(req, reason)
        if not keep_blocks:
            self.kv_manager.free(req.request_id)
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)

    def release_dead_blocks(self) -> None:
        """After a step: sliding blocks no query can see any more go back to the pool."""
        for req in self.running:
            self.kv_manager.remove_skipped_blocks(req.request_id, req.num_computed)
