"""The engine: requests, a continuous-batching scheduler, and `add_request` / `step` / `abort`.

Each step the scheduler
1. keeps every running request that needs exactly one more token computed in the decode batch (the GK
   program, padded to its batch bucket), growing its KV by one slot when a block fills;
2. spends a prefill token budget (`max_prefill_tokens`) on running prompts first, then on waiting
   requests in arrival order (chunked prefill through the per-layer model, so a long prompt never
   stalls running decodes for more than one chunk);
3. admits only what the KV pool holds; when a running request cannot grow, the newest running request
   is preempted: its blocks are freed and it is recomputed later from prompt + output so far (its
   sampler generator is kept, so its output does not change).
A request needs tokens `[num_computed, len(prompt + output))` computed; when the last of them is
computed its logits are sampled. A DI consumer request arrives with its KV already in place for all but
the last prompt token (`num_computed = N-1`), so its first step is a decode.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from enum import Enum

import torch

from .config import EngineConfig, GenerationDefaults
from .connector.params import KVParamsError, KVTransferParams, parse_kv_params
from .kv.manager import KVCacheManager
from .model import SeqChunk
from .runner import DecodeSeq, ModelRunner
from .sampling import Sampler, SamplingParams, make_generator

log = logging.getLogger("gigadecode.engine")


class RequestError(ValueError):
    """A request the engine refuses (bad prompt, too long, invalid parameters); `param` names the field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


# DI: params whose lease ends sooner than this are refused at the door (the READ would race the lease)
LEASE_MARGIN_S = 0.5


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list = field(default_factory=list)
    num_computed: int = 0
    status: Status = Status.WAITING
    finish_reason: str | None = None
    error: str | None = None
    generator: torch.Generator | None = None
    num_preemptions: int = 0
    prefill_start_time: float | None = None   # when its first prefill chunk ran
    first_token_time: float | None = None
    last_token_time: float | None = None
    kv_ready: bool = True              # False while a DI consumer waits for its KV to arrive
    kv_transfer_params: KVTransferParams | None = None      # DI: what the router sent (parsed)
    kv_transfer_params_out: dict | None = None  # DI: what a producer answers (signed, for the decode engine)
    compute_limit: int | None = None            # DI producer: compute only the first N-1 prompt tokens
    remote_tokens: int = 0                      # DI consumer: prompt tokens whose KV comes from the prefill

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.status == Status.FINISHED

    @property
    def target(self) -> int:
        """Tokens that must be computed (a DI producer stops at N-1; everyone else computes all)."""
        return self.num_tokens if self.compute_limit is None else self.compute_limit


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    new_logprobs: list = field(default_factory=list)
    error: str | None = None


class LLMEngine:
    def __init__(self, runner: ModelRunner, ecfg: EngineConfig | None = None, connector=None) -> None:
        self.runner = runner
        self.cfg = runner.cfg
        self.ecfg = ecfg or runner.ecfg
        self.kv_manager = KVCacheManager(runner.kv.config, runner.block_size, runner.tokens)
        # stop tokens: config.json's eos_token_id and generation_config.json's (the real GPT-OSS checkpoints
        # list <|return|> and <|call|> only there); its sampling defaults are the server's to apply
        self.generation_defaults = GenerationDefaults.from_dir(runner.model_dir)
        self.eos_token_ids = tuple(dict.fromkeys(t for t in (*self.cfg.eos_token_ids,
                                                             *self.generation_defaults.eos_token_ids)
                                                 if 0 <= t < self.cfg.vocab_size))
        self.sampler = Sampler(eos_token_ids=self.eos_token_ids)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._ids = itertools.count()
        self.connector = connector     # DI (connector.nixl_connector.NixlConnector) or None
        self.stats = {"preemptions": 0, "steps": 0, "prefill_tokens": 0, "decode_tokens": 0,
                      "kv_bytes_transferred": 0, "transfer_failures": 0, "recomputed_after_failure": 0,
                      "step_failures": 0}
        self.max_model_len = self._context_limit()

    def _context_limit(self) -> int:
        """The longest sequence one request can hold alone: at every moment of its life (prefill chunks of
        `max_prefill_tokens`, a sliding group's window on top of them) its blocks fit the pool, so a request
        the engine admits can always finish."""
        usable, chunk = self.runner.kv.num_blocks - 1, self.ecfg.max_prefill_tokens
        specs = [g.spec for g in self.runner.kv.config.groups]

        def fits(n: int) -> bool:
            return sum(s.peak_blocks(n, min(chunk, n), self.runner.tokens) for s in specs) <= usable
        lo, hi = 0, self.runner.max_model_len            # fits(lo); find the largest such n
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
        return lo

    # -- public API ------------------------------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], params: SamplingParams | None = None,
                    request_id: str | None = None,
                    kv_transfer_params: KVTransferParams | dict | None = None) -> str:
        """Queue a request; RequestError / SamplingError (nothing queued) if the engine refuses it. DI:
        `kv_transfer_params` (parsed here when a dict) say where its KV comes from or goes to."""
        params = params or SamplingParams()
        rid = request_id or f"req-{next(self._ids)}"
        if not isinstance(rid, str) or not rid:
            raise RequestError(f"request id must be a non-empty string (got {rid!r})")
        if rid in self.requests:
            raise RequestError(f"request id {rid!r} is already in use")
        self.check_request(prompt_ids, params)
        req = Request(rid, list(prompt_ids), params, generator=make_generator(params.seed))
        if kv_transfer_params:
            self._admit_di(req, self._parse_kv(kv_transfer_params))
        self.requests[rid] = req
        self.waiting.append(req)
        return rid

    def check_request(self, prompt_ids: list[int], params: SamplingParams,
                      kv_transfer_params: KVTransferParams | dict | None = None) -> None:
        """Raise SamplingError / RequestError if this engine would refuse the request (changes nothing)."""
        params.validate(self.cfg.vocab_size)
        if not isinstance(prompt_ids, (list, tuple)) or not prompt_ids:
            raise RequestError("prompt is empty" if not prompt_ids else "prompt must be a list of token ids")
        if any((not isinstance(t, int)) or isinstance(t, bool) or t < 0 or t >= self.cfg.vocab_size
               for t in prompt_ids):
            bad = next(t for t in prompt_ids if not isinstance(t, int) or isinstance(t, bool) or t < 0
                       or t >= self.cfg.vocab_size)
            raise RequestError(f"prompt token id {bad!r} is outside the vocabulary [0, {self.cfg.vocab_size})")
        n = len(prompt_ids)
        if n >= self.max_model_len:
            raise RequestError(f"prompt has {n} tokens; this engine's context is "
                               f"{self.max_model_len} tokens (prompt + at least one generated token)")
        if n + params.max_tokens > self.max_model_len:
            raise RequestError(f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                               f"requested {n + params.max_tokens} tokens ({n} in the prompt, {params.max_tokens} "
                               f"in the completion). Please reduce the length of the prompt or completion.",
                               param="max_tokens")
        if not self._fits_pool(n + 1):
            raise RequestError(f"prompt of {n} tokens can never fit the KV pool "
                               f"({self.runner.kv.num_blocks - 1} blocks of {self.runner.block_size})")
        if kv_transfer_params:
            self._admit_di(Request("check", list(prompt_ids), params), self._parse_kv(kv_transfer_params),
                           lease_margin_s=LEASE_MARGIN_S)

    @staticmethod
    def _parse_kv(raw: KVTransferParams | dict) -> KVTransferParams:
        try:
            return parse_kv_params(raw)
        except KVParamsError as e:
            raise RequestError(str(e), param=e.param) from None

    def abort(self, request_id: str) -> bool:
        req = self.requests.get(request_id)
        if req is None or req.finished:
            return False
        self._finish(req, "abort")
        return True

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def kv_usage(self) -> tuple[int, int]:
        """-> (KV blocks in use, usable KV blocks); the null block is not counted."""
        total = self.runner.kv.num_blocks - 1
        return total - self.kv_manager.num_free_blocks, total

    def kv_usage_per_rank(self) -> dict[int, tuple[int, int]]:
        """Rank -> (KV blocks used, usable): one rank here (a parallel engine lists each of its ranks)."""
        return {0: self.kv_usage()}

    def step(self) -> list[RequestOutput]:
        """Run one scheduling step; returns what each request produced (and which finished)."""
        self.stats["steps"] += 1
        outputs: dict[str, RequestOutput] = {}
        # A failure inside a phase fails the requests that phase worked for, never the others.
        if self.connector is not None:
            self._guarded(self._poll_connector, [r for r in self.running if not r.kv_ready], outputs)
        decodes, prefills = self._schedule(outputs)
        run_prefill, decode_rows = self.runner.agree_step(len(prefills), len(decodes))
        if run_prefill:
            self._guarded(lambda o: self._run_prefill(prefills, o), [r for r, _ in prefills], outputs)
        if decode_rows:
            self._guarded(lambda o: self._run_decode(decodes, o, decode_rows), decodes, outputs)
        for req in list(self.running):
            if not req.finished:
                self.kv_manager.remove_skipped_blocks(req.request_id, req.num_computed)
        return list(outputs.values())

    def _guarded(self, phase, reqs: list[Request], outputs: dict[str, RequestOutput]) -> None:
        """Run `phase(outputs)`; if it raises, fail `reqs` (what it was working for) with the error."""
        try:
            phase(outputs)
        except Exception as e:  # noqa: BLE001 - isolate the failure to the requests of this phase
            log.exception("engine step phase failed for %d request(s)", len(reqs))
            self.stats["step_failures"] += 1
            for req in reqs:
                if not req.finished:
                    self._fail(req, f"engine step failed: {type(e).__name__}: {e}", outputs)

    def generate(self, prompts: list[list[int]], params: list[SamplingParams] | SamplingParams | None = None
                 ) -> list[Request]:
        """Run prompts to completion (all batched together); returns the finished requests in order."""
        if not isinstance(params, list):
            params = [params or SamplingParams()] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params)]
        while self.has_unfinished():
            self.step()
        return [self.requests[i] for i in ids]

    # -- scheduling --------------------------------------------------------------------------------------
    def _fits_pool(self, num_tokens: int) -> bool:
        return sum(self.kv_manager.blocks_needed(num_tokens)) <= self.runner.kv.num_blocks - 1

    def _schedule(self, outputs: dict[str, RequestOutput]) -> tuple[list[Request], list[tuple[Request, int]]]:
        decodes: list[Request] = []
        # 1. running requests that need one token: grow KV by one slot, preempting the newest if needed.
        for req in list(self.running):
            if req.status != Status.RUNNING or not req.kv_ready or req.num_tokens - req.num_computed != 1:
                continue
            while not self.kv_manager.allocate(req.request_id, req.num_tokens, req.num_computed):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is req:
                    break
            if req.status == Status.RUNNING:
                decodes.append(req)
        decodes = [r for r in decodes if r.status == Status.RUNNING]
        # 2. prefill budget: running prompts first, then waiting requests (FIFO).
        budget = self.ecfg.max_prefill_tokens
        prefills: list[tuple[Request, int]] = []
        for req in self.running:
            if budget <= 0:
                break
            todo = req.target - req.num_computed
            if req.status != Status.RUNNING or not req.kv_ready or todo <= 1 and req in decodes:
                continue
            if todo > 1 or (todo == 1 and req.compute_limit is not None):
                n = min(todo, budget)
                if self.kv_manager.allocate(req.request_id, req.num_computed + n, req.num_computed):
                    prefills.append((req, n))
                    budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.ecfg.max_num_seqs:
            req = self.waiting[0]
            if req.remote_tokens:
                if not self._admit_remote(req):
                    break
                continue
            todo = req.target - req.num_computed
            if todo == 0:                      # a DI producer with a 1-token prompt: nothing to send
                self.waiting.popleft()
                self._producer_done(req, outputs)
                continue
            n = min(todo, budget)
            if not self.kv_manager.allocate(req.request_id, req.num_computed + n, req.num_computed):
                break
            self.waiting.popleft()
            req.status = Status.RUNNING
            self.running.append(req)
            if n == 1 and req.num_computed > 0 and req.compute_limit is None:
                decodes.append(req)
            else:
                prefills.append((req, n))
            budget -= n
        return decodes, prefills

    def _preempt(self, req: Request) -> None:
        """Free all of req's KV; it is recomputed from prompt + output later (the output stays the same).
        A DI consumer's remote KV is given up too (an in-flight READ is cancelled first): it recomputes locally."""
        if req.remote_tokens and self.connector is not None:
            if not req.kv_ready:
                self.connector.cancel(req.request_id)
            req.remote_tokens, req.kv_ready = 0, True
        self.kv_manager.free(req.request_id)
        self.running.remove(req)
        req.num_computed = 0
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.stats["preemptions"] += 1
        self.waiting.appendleft(req)

    # -- execution ---------------------------------------------------------------------------------------
    def _run_prefill(self, prefills: list[tuple[Request, int]], outputs: dict[str, RequestOutput]) -> None:
        chunks = []
        now = time.monotonic()
        for req, n in prefills:
            if req.prefill_start_time is None:
                req.prefill_start_time = now
            ids = req.all_ids[req.num_computed: req.num_computed + n]
            done = req.num_computed + n == req.num_tokens
            chunks.append(SeqChunk(ids, req.num_computed, self.kv_manager.block_tables(req.request_id),
                                   "last" if done else "none"))
        logits = self.runner.prefill(chunks)
        self.stats["prefill_tokens"] += sum(n for _, n in prefills)
        ready, rows = [], []
        for (req, n), lg in zip(prefills, logits):
            req.num_computed += n
            if req.compute_limit is not None and req.num_computed == req.compute_limit:
                self.kv_manager.remove_skipped_blocks(req.request_id, req.num_computed)
                self._producer_done(req, outputs)
            elif req.num_computed == req.num_tokens:
                ready.append(req)
                rows.append(lg[-1])
        if ready:
            self._sample(ready, torch.stack(rows), outputs)

    def _run_decode(self, decodes: list[Request], outputs: dict[str, RequestOutput], pad_to: int = 0) -> None:
        seqs = [DecodeSeq(r.all_ids[-1], r.num_computed, self.kv_manager.block_tables(r.request_id))
                for r in decodes]
        logits = self.runner.decode(seqs, pad_to)
        if not decodes:                        # an all-padding step (other DP groups of the EP group decode)
            return
        self.stats["decode_tokens"] += len(decodes)
        for r in decodes:
            r.num_computed += 1
        self._sample(decodes, logits, outputs)

    def _sample(self, reqs: list[Request], logits: torch.Tensor, outputs: dict[str, RequestOutput]) -> None:
        res = self.runner.sample(self.sampler, logits, [r.params for r in reqs], [r.generator for r in reqs],
                                 [r.all_ids for r in reqs], [r.output_ids for r in reqs])
        now = time.monotonic()
        for i, req in enumerate(reqs):
            tok = int(res.token_ids[i])
            req.output_ids.append(tok)
            lp = res.logprobs[i] if res.logprobs else None
            if lp is not None:
                req.output_logprobs.append(lp)
            if req.first_token_time is None:
                req.first_token_time = now
            req.last_token_time = now
            out = outputs.setdefault(req.request_id, RequestOutput(req.request_id, [], False))
            out.new_token_ids.append(tok)
            if lp is not None:
                out.new_logprobs.append(lp)
            reason = self._stop_reason(req, tok)
            if reason:
                self._finish(req, reason)
                out.finished, out.finish_reason = True, reason

    def _stop_reason(self, req: Request, tok: int) -> str | None:
        p = req.params
        if len(req.output_ids) >= p.min_tokens:
            if not p.ignore_eos and tok in self.eos_token_ids:
                return "stop"
            if tok in p.stop_token_ids:
                return "stop"
        if len(req.output_ids) >= p.max_tokens:
            return "length"
        if req.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _finish(self, req: Request, reason: str, error: str | None = None, keep_blocks: bool = False) -> None:
        req.status = Status.FINISHED
        req.finish_reason = reason
        req.error = error
        if not keep_blocks:
            self.kv_manager.free(req.request_id)
        if self.connector is not None and req.remote_tokens and not req.kv_ready:
            self.connector.cancel(req.request_id)
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)

    # -- disaggregated inference ---------------------------------------------------------------------------
    def _admit_di(self, req: Request, params: KVTransferParams, lease_margin_s: float = 0.0) -> None:
        if self.connector is None:
            if params.is_remote:
                raise RequestError("kv_transfer_params given, but this engine has no KV connector (--role both)",
                                   param="kv_transfer_params")
            return
        if params.do_remote_decode and params.do_remote_prefill:
            raise RequestError("kv_transfer_params: do_remote_decode and do_remote_prefill exclude each other",
                               param="kv_transfer_params")
        req.kv_transfer_params = params
        if params.do_remote_decode:
            if not self.connector.role == "kv_producer":
                raise RequestError("do_remote_decode needs a prefill engine (--role prefill)",
                                   param="kv_transfer_params.do_remote_decode")
            req.compute_limit = self.connector.prefill_target(len(req.prompt_ids))
        elif params.do_remote_prefill:
            if not self.connector.role == "kv_consumer":
                raise RequestError("do_remote_prefill needs a decode engine (--role decode)",
                                   param="kv_transfer_params.do_remote_prefill")
            if len(req.prompt_ids) == 1:       # 1-token prompt: nothing was prefilled remotely
                req.kv_transfer_params = None
                return
            try:
                req.remote_tokens = self.connector.validate_remote(params, req.prompt_ids,
                                                                   len(self.runner.kv.config.groups), lease_margin_s)
            except KVParamsError as e:
                if self.ecfg.kv_failure_policy != "recompute":
                    raise RequestError(str(e), param=e.param) from None
                # Never use KV we cannot vouch for: prefill the prompt actually sent, here.
                req.kv_transfer_params, req.remote_tokens = None, 0
                if req.request_id != "check":
                    self.stats["recomputed_after_failure"] += 1
        else:
            req.kv_transfer_params = None

    def _admit_remote(self, req: Request) -> bool:
        """Consumer: allocate blocks as if N-1 tokens were computed, then start the load (a failure there
        is that request's: `get_finished` reports it)."""
        n = req.remote_tokens
        if not self.kv_manager.allocate(req.request_id, n + 1, n):
            return False
        self.waiting.popleft()
        req.status = Status.RUNNING
        req.num_computed = n
        req.kv_ready = False
        self.running.append(req)
        self.connector.start_load(req.request_id, req.kv_transfer_params, self.kv_manager.block_tables(req.request_id))
        return True

    def _producer_done(self, req: Request, outputs: dict[str, RequestOutput]) -> None:
        """Producer: the first N-1 tokens are computed; lease the blocks and answer the signed params."""
        tables = self.kv_manager.block_tables(req.request_id) if self.kv_manager.has_request(req.request_id) else \
            [[] for _ in self.runner.kv.config.groups]
        host = req.kv_transfer_params.remote_host if req.kv_transfer_params is not None else None
        try:
            out = self.connector.request_finished(req.request_id, tables, req.num_computed, advertise_host=host)
            req.kv_transfer_params_out = self.connector.seal(out, req.prompt_ids).to_dict()
        except Exception as e:  # noqa: BLE001 - this request's failure only
            log.exception("answering the KV params of %s failed", req.request_id)
            self._fail(req, f"KV handoff failed: {type(e).__name__}: {e}", outputs)
            return
        if req in self.running:
            self.running.remove(req)
        self._finish(req, "length", keep_blocks=True)
        outputs[req.request_id] = RequestOutput(req.request_id, [], True, "length")

    def _poll_connector(self, outputs: dict[str, RequestOutput]) -> None:
        sending, done, failed = self.connector.get_finished()
        for rid in sending:                    # producer: the consumer read them (or the lease expired)
            self.kv_manager.free(rid)
        for rid in done:
            req = self.requests.get(rid)
            if req is not None and not req.finished:
                req.kv_ready = True
        for rid, err in failed.items():
            req = self.requests.get(rid)
            if req is None or req.finished:
                continue
            self.kv_manager.free(rid)
            if self.ecfg.kv_failure_policy == "recompute":
                # Never decode from KV that did not arrive intact: prefill the prompt here instead.
                self.running.remove(req)
                req.num_computed, req.remote_tokens, req.kv_ready = 0, 0, True
                req.status = Status.WAITING
                self.waiting.appendleft(req)
                self.stats["recomputed_after_failure"] += 1
            else:
                self._fail(req, f"KV transfer failed: {err}", outputs)
        for k in ("kv_bytes_transferred", "transfer_failures"):
            self.stats[k] = self.connector.stats[k]

    def _fail(self, req: Request, error: str, outputs: dict[str, RequestOutput]) -> None:
        self._finish(req, "error", error=error)
        outputs[req.request_id] = RequestOutput(req.request_id, [], True, "error", error=error)


def build_engine(model_dir, ecfg: EngineConfig, *, host: str = "127.0.0.1", advertise_host: str | None = None,
                 side_port: int = 0, runner: ModelRunner | None = None, progress: bool = False) -> LLMEngine:
    """An engine for `ecfg.kv_role`: a runner, and for a prefill (kv_producer) or decode (kv_consumer) role a
    NIXL connector over the runner's KV, keyed with `ecfg.kv_secret` (a producer serves its handshake on
    `host:side_port`, 0 = any free port, and tells decode engines to connect to `advertise_host`)."""
    runner = runner or ModelRunner(model_dir, ecfg, progress=progress)
    connector = None
    if ecfg.kv_role != "kv_both":
        from .connector.nixl_connector import NixlConnector
        connector = NixlConnector(ecfg.kv_role, runner.kv, runner.cfg, secret=ecfg.kv_secret, host=host,
                                  advertise_host=advertise_host, side_port=side_port, lease_s=ecfg.kv_lease_s,
                                  timeout_s=ecfg.kv_transfer_timeout_s, vllm_kv_layout=ecfg.vllm_kv_layout)
    return LLMEngine(runner, ecfg, connector)
