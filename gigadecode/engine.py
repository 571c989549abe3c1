"""The engine: `add_request` / `step` / `abort` over a runner, a scheduler and (DI) a KV connector.

One `step` is schedule -> run -> update: the connector's events first (`kv_transfers.KVTransfers.poll`),
then `scheduler.Scheduler.schedule` says who runs (decodes, prefill chunks, DI admissions and hand-offs),
the runner runs the prefill chunks through the per-layer model and the decodes through the GK program,
the sampled tokens update the requests, and dead sliding blocks go back to the pool. A failure inside a
phase fails the requests that phase worked for, never the others (`_guarded`).
"""

from __future__ import annotations

import itertools
import logging
import random
import time
from dataclasses import replace

import torch

from .config import ConfigError
from .engine_config import EngineConfig
from .generation_config import GenerationDefaults
from .connector.params import KVParamsError, KVTransferParams, parse_kv_params
from .kv.manager import KVCacheManager
from .kv_transfers import KVTransfers
from .model import SeqChunk
from .request import EngineStats, Request, RequestError, RequestOutput, Status
from .runner import DecodeSeq, ModelRunner
from .sampling import Sampler, SamplingParams, make_generator, token_logprobs
from .scheduler import Scheduler, SchedulerOutput
from .speculative import NgramProposer
from .suffix_decoding import SuffixProposer
from .structured import GuideFactory

__all__ = ["LLMEngine", "Request", "RequestError", "RequestOutput", "Status", "build_engine"]

log = logging.getLogger("gigadecode.engine")

# DI: params whose lease ends sooner than this are refused at the door (the READ would race the lease)
LEASE_MARGIN_S = 0.5


class LLMEngine:
    def __init__(self, runner: ModelRunner, ecfg: EngineConfig | None = None, connector=None) -> None:
        self.runner = runner
        self.cfg = runner.cfg
        self.ecfg = ecfg or runner.ecfg
        self.kv_manager = KVCacheManager(runner.kv.config, runner.block_size, runner.tokens,
                                         prefix_caching=self.ecfg.enable_prefix_caching)
        # stop tokens: config.json's eos_token_id and generation_config.json's (the real GPT-OSS checkpoints
        # list <|return|> and <|call|> only there); its sampling defaults are the server's to apply
        self.generation_defaults = GenerationDefaults.from_dir(runner.model_dir)
        self.eos_token_ids = tuple(dict.fromkeys(t for t in (*self.cfg.eos_token_ids,
                                                             *self.generation_defaults.eos_token_ids)
                                                 if 0 <= t < self.cfg.vocab_size))
        self.sampler = Sampler(eos_token_ids=self.eos_token_ids)
        self.guides = GuideFactory(runner.model_dir, self.cfg.vocab_size, self.eos_token_ids)
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self.connector = connector     # DI (connector.nixl_connector.NixlConnector) or None
        self.transfers = KVTransfers(self, connector) if connector is not None else None
        spec = self.ecfg.speculative
        proposer = None if spec is None else SuffixProposer(spec) if spec.method == "suffix" else NgramProposer(spec)
        self.scheduler = Scheduler(self.ecfg, self.kv_manager,
                                   on_preempt=self.transfers.cancel if self.transfers is not None else None,
                                   proposer=proposer)
        self._stats = EngineStats()
        self.last_step_failure: str | None = None   # the error of the last phase `_guarded` isolated
        # a parallel engine's replica with TP, EP or DCP peers inside its model calls: a phase that raises ends
        # the step there and then (the error is raised), for the next phase's collectives would pair with the
        # ones a peer still waits in (mismatched collectives hang, or hand one call's data to another)
        self.lockstep = False
        # --seed: each sampled request without a seed draws one from this, in arrival order (a run is
        # reproducible whatever the batches it shares; without --seed it draws from torch's generator)
        self._seeds = random.Random(self.ecfg.seed) if self.ecfg.seed is not None else None
        self.max_model_len = self.scheduler.max_model_len = self._context_limit()

    def warm_up(self) -> float | None:
        """One prefill chunk and one decode step on borrowed KV blocks, so the first request runs at full
        speed (`warmup.warm_up`). -> seconds, or None when it failed or the pool cannot hold a 1-token chunk."""
        from .warmup import warm_up
        return warm_up(self)

    @property
    def waiting(self):
        return self.scheduler.waiting

    @property
    def running(self) -> list[Request]:
        return self.scheduler.running

    @property
    def stats(self) -> EngineStats:
        self._stats.preemptions = self.scheduler.num_preemptions
        self._stats.prefix_cache_queries = self.scheduler.prefix_queried
        self._stats.prefix_cache_hits = self.scheduler.prefix_hit
        return self._stats

    def _context_limit(self) -> int:
        """The longest sequence one request can hold alone: at every moment of its life (prefill chunks of
        `max_prefill_tokens`, a sliding group's window on top of them) its blocks fit the pool, so a request
        the engine admits can always finish. A `--max-model-len` the pool cannot hold is refused here."""
        lo, hi = 0, self.runner.max_model_len            # fits_pool(lo); find the largest such n
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self.fits_pool(mid) else (lo, mid - 1)
        asked = self.ecfg.max_model_len
        if asked is not None and lo < asked:
            raise ConfigError(f"--max-model-len {asked}: one request of {asked} tokens needs "
                              f"{self._peak_blocks(asked)} KV blocks of {self.ecfg.block_size} tokens, but the pool "
                              f"has {self.runner.kv.num_blocks - 1} (it holds {lo} tokens); raise --num-blocks or "
                              f"--kv-budget-gib, or lower --max-model-len")
        if lo < 2:                                       # not even a 1-token prompt and one generated token
            raise ConfigError(f"the KV pool ({self.runner.kv.num_blocks - 1} blocks of {self.ecfg.block_size} "
                              f"tokens) cannot hold one request of 2 tokens; raise --num-blocks or --kv-budget-gib")
        return lo

    # -- public API ------------------------------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], params: SamplingParams | None = None, request_id: str | None = None,
                    kv_transfer_params: KVTransferParams | dict | None = None, priority: int = 0,
                    now: float | None = None) -> str:
        """Queue a request; RequestError / SamplingError (nothing queued) if the engine refuses it. DI: the
        `kv_transfer_params` (parsed here when a dict) say where its KV comes from or goes to; `priority`: Request's;
        `now`: the wall clock a remote prefill's lease is judged at (a parallel engine's ranks pass rank 0's)."""
        params = params or SamplingParams()
        rid = request_id or f"req-{next(self._ids)}"
        if not isinstance(rid, str) or not rid:
            raise RequestError(f"request id must be a non-empty string (got {rid!r})")
        if rid in self.requests or self.scheduler.kv_manager.has_request(rid):   # (a finished prefill's leased KV)
            raise RequestError(f"request id {rid!r} is already in use")
        self.scheduler.check_priority(priority)
        self.check_request(prompt_ids, params)
        req = Request(rid, list(prompt_ids), params, priority=priority)
        if params.guided is not None:
            req.guide = self.guides.make(params.guided)
        if kv_transfer_params:
            self._refuse_prompt_logprobs_in_di(params)
            self._admit_di(req, self._parse_kv(kv_transfer_params), now=now)
        # the seed is drawn once nothing can refuse the request (a refused one draws none: the later requests'
        # seeds do not depend on it), as the parallel engine draws after its checks
        if self._seeds is not None and params.seed is None and not params.is_greedy:
            req.params = replace(params, seed=self._seeds.randrange(2**63))
        req.generator = make_generator(req.params.seed)
        self.requests[rid] = req
        self.scheduler.add(req)
        return rid

    def check_request(self, prompt_ids: list[int], params: SamplingParams,
                      kv_transfer_params: KVTransferParams | dict | None = None) -> None:
        """Raise SamplingError / RequestError if this engine would refuse the request (changes nothing)."""
        params.validate(self.cfg.vocab_size)
        if params.guided is not None:
            self.guides.make(params.guided)                 # a grammar that does not compile: refused here
        elif params.min_tokens and len(set(params.stop_token_ids) | set(() if params.ignore_eos else self.eos_token_ids)
                                       ) >= self.cfg.vocab_size:     # min_tokens would mask every token
            raise RequestError("min_tokens > 0 with every token id a stop token leaves nothing to sample", "min_tokens")
        if not isinstance(prompt_ids, (list, tuple)) or not prompt_ids:
            raise RequestError("prompt is empty" if not prompt_ids else "prompt must be a list of token ids",
                               param="prompt")
        for t in prompt_ids:
            if not isinstance(t, int) or isinstance(t, bool):
                raise RequestError(f"prompt token id {t!r} is not an integer", param="prompt")
            if not 0 <= t < self.cfg.vocab_size:
                raise RequestError(f"prompt token id {t!r} is outside the vocabulary [0, {self.cfg.vocab_size})",
                                   param="prompt")
        n = len(prompt_ids)
        if n >= self.max_model_len:
            raise RequestError(f"prompt has {n} tokens; this engine's context is "
                               f"{self.max_model_len} tokens (prompt + at least one generated token)", param="prompt",
                               code="context_length_exceeded")
        if n + params.max_tokens > self.max_model_len:
            raise RequestError(f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                               f"requested {n + params.max_tokens} tokens ({n} in the prompt, {params.max_tokens} "
                               f"in the completion). Please reduce the length of the prompt or completion.",
                               param="max_tokens", code="context_length_exceeded")
        if kv_transfer_params:
            self._refuse_prompt_logprobs_in_di(params)
            self._admit_di(Request("check", list(prompt_ids), params), self._parse_kv(kv_transfer_params),
                           lease_margin_s=LEASE_MARGIN_S)

    @staticmethod
    def _refuse_prompt_logprobs_in_di(params: SamplingParams) -> None:
        if params.prompt_logprobs is not None:
            raise RequestError("prompt_logprobs (or echo with logprobs) needs the prompt computed where the "
                               "request is answered: not with kv_transfer_params", param="prompt_logprobs")

    def _admit_di(self, req: Request, params: KVTransferParams, lease_margin_s: float = 0.0,
                  now: float | None = None) -> None:
        if self.transfers is None:
            if params.is_remote:
                raise RequestError("kv_transfer_params given, but this engine has no KV connector (--role both)",
                                   param="kv_transfer_params", code="invalid_kv_transfer_params")
            return
        self.transfers.admit(req, params, lease_margin_s, now)

    @staticmethod
    def _parse_kv(raw: KVTransferParams | dict) -> KVTransferParams:
        try:
            return parse_kv_params(raw)
        except KVParamsError as e:
            raise RequestError(str(e), param=e.param, code="invalid_kv_transfer_params") from None

    def abort(self, request_id: str, reason: str = "abort") -> bool:
        """End a request now. `reason` "stop": a client's stop string ended it, so it finishes stopped (its
        output up to here is whole, and suffix decoding caches it like any stopped request's)."""
        req = self.requests.get(request_id)
        if req is None or req.finished:
            return False
        self._finish(req, "stop" if reason == "stop" else "abort")
        return True

    def release_kv(self, raw: dict | KVTransferParams) -> bool:
        """A producer: end the lease of params it answered (signed with its key, naming this engine) whose
        consumer will never read them (the router's decode server refused the request, or its client left),
        so the blocks are freed now instead of when the lease runs out. -> whether a lease was ended.
        RequestError for params that are malformed, unsigned, forged or another engine's."""
        rid = self.leased_request(raw)
        return rid is not None and self.release_lease(rid)

    def leased_request(self, raw: dict | KVTransferParams) -> str | None:
        """The request whose lease `raw` (params this producer answered) names, once they are checked:
        signed with this engine's key and naming it. RequestError otherwise."""
        conn = self.connector
        if conn is None or not conn.is_producer:
            raise RequestError("this engine is not a prefill (kv_producer): it holds no leases",
                               param="kv_transfer_params", code="invalid_kv_transfer_params")
        params = self._parse_kv(raw)
        from .connector.params import verify_signature
        try:
            verify_signature(params, conn.key)
        except KVParamsError as e:
            raise RequestError(str(e), param=e.param, code="invalid_kv_transfer_params") from None
        if not conn.answers_as(params.remote_engine_id):
            raise RequestError("kv_transfer_params name another prefill engine", param="kv_transfer_params."
                               "remote_engine_id", code="invalid_kv_transfer_params")
        return params.remote_request_id

    def release_lease(self, request_id: str) -> bool:
        """A producer: end one of its requests' KV lease now (nobody will read it); its blocks are freed at
        the next step. -> whether there was such a lease (False on an engine without a producer connector)."""
        conn = self.connector
        return conn is not None and conn.is_producer and conn.release(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def num_leases(self) -> int:
        """A producer: requests whose KV is held for a decode engine's read."""
        return len(self.connector.leased_ids()) if self.connector is not None else 0

    def kv_usage(self) -> tuple[int, int]:
        """-> (KV blocks in use, usable KV blocks); the null block is not counted."""
        total = self.runner.kv.num_blocks - 1
        return total - self.kv_manager.num_free_blocks, total

    def kv_usage_per_rank(self) -> dict[int, tuple[int, int]]:
        """Rank -> (KV blocks used, usable): one rank here (a parallel engine lists each of its ranks)."""
        return {0: self.kv_usage()}

    def step(self) -> list[RequestOutput]:
        """One scheduling step: schedule -> run -> update; returns what each request produced."""
        self._stats.steps += 1
        outputs: dict[str, RequestOutput] = {}
        if self.transfers is not None:                        # landed / failed loads, freed leases
            self._guarded(self.transfers.poll, self.scheduler.awaiting_kv(), outputs)
        plan = self.scheduler.schedule()
        if self.transfers is not None:
            self.transfers.start_loads(plan.remote_admits, outputs)
            for req in plan.handoffs:
                self.transfers.hand_off(req, outputs)
        self._run(plan, outputs)
        self.scheduler.release_dead_blocks()
        return list(outputs.values())

    def _run(self, plan: SchedulerOutput, outputs: dict[str, RequestOutput]) -> None:
        """The model calls of a plan (every rank of an EP group that spans DP groups makes the same ones)."""
        rows = sum(1 + len(r.draft_ids) for r in plan.decodes)       # a request's drafts are rows too
        run_prefill, decode_rows = self.runner.agree_step(len(plan.prefills), rows)
        if run_prefill:
            self._guarded(lambda o: self._run_prefill(plan.prefills, o), [r for r, _ in plan.prefills], outputs)
        if decode_rows:
            self._guarded(lambda o: self._run_decode(plan.decodes, o, decode_rows), plan.decodes, outputs)

    def _guarded(self, phase, reqs: list[Request], outputs: dict[str, RequestOutput]) -> None:
        """Run `phase(outputs)`; if it raises, fail `reqs` (what it was working for) with the error. A `lockstep`
        replica raises it instead: it makes no collective after a phase of its own failed."""
        try:
            phase(outputs)
        except Exception as e:  # noqa: BLE001 - isolate the failure to the requests of this phase
            self._stats.step_failures += 1
            self.last_step_failure = f"engine step failed: {type(e).__name__}: {e}"
            if self.lockstep:
                raise
            log.exception("engine step phase failed for %d request(s)", len(reqs))
            for req in reqs:
                if not req.finished:
                    self.fail(req, self.last_step_failure, outputs)

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
    def _peak_blocks(self, num_tokens: int) -> int:
        """Most blocks a request of `num_tokens` tokens holds at once: its prompt prefilled
        `max_prefill_tokens` a step, so a sliding group holds a chunk and the window before it, not the whole
        prompt (the scheduler frees the blocks behind the window before it allocates a chunk's)."""
        chunk = min(self.ecfg.max_prefill_tokens, num_tokens)
        return sum(g.spec.peak_blocks(num_tokens, chunk, self.runner.tokens) for g in self.runner.kv.config.groups)

    def fits_pool(self, num_tokens: int) -> bool:
        """Whether a request of `num_tokens` tokens alone fits the pool at every step of its life."""
        return self._peak_blocks(num_tokens) <= self.runner.kv.num_blocks - 1

    # -- execution ---------------------------------------------------------------------------------------
    def _run_prefill(self, prefills: list[tuple[Request, int]], outputs: dict[str, RequestOutput]) -> None:
        chunks = []
        now = time.monotonic()
        targets = [self._prompt_targets(req, n) for req, n in prefills]      # prompt logprobs each chunk gives
        for (req, n), scored in zip(prefills, targets):
            if req.prefill_start_time is None:
                req.prefill_start_time = now
            ids = req.all_ids[req.num_computed: req.num_computed + n]
            done = req.num_computed + n == req.num_tokens
            want = "all" if scored else "last" if done else "none"
            chunks.append(SeqChunk(ids, req.num_computed, self.kv_manager.block_tables(req.request_id), want))
        logits = self.runner.prefill(chunks)
        self._stats.prefill_tokens += sum(n for _, n in prefills)
        ready, rows = [], []
        for (req, n), lg, scored in zip(prefills, logits, targets):
            if scored:
                self._record_prompt_logprobs(req, lg, scored)
            req.num_computed += n
            self._name_computed(req)
            if req.compute_limit is not None and req.num_computed == req.compute_limit:
                self.kv_manager.remove_skipped_blocks(req.request_id, req.num_computed)
                self.transfers.hand_off(req, outputs)
            elif req.num_computed == req.num_tokens:
                ready.append(req)
                rows.append(lg[-1])
        if ready:
            self._sample(ready, torch.stack(rows), outputs)

    def _name_computed(self, req: Request) -> None:
        """Prefix caching: the request's blocks whose tokens are all computed here get their names (not KV
        that came from a prefill server)."""
        if not req.remote_tokens and self.kv_manager.has_unnamed_blocks(req.request_id, req.num_computed):
            self.kv_manager.name_computed(req.request_id, req.all_ids, req.num_computed)   # once a block fills

    @staticmethod
    def _prompt_targets(req: Request, n: int) -> range:
        """The prompt positions whose logprobs a chunk of `n` tokens from `req.num_computed` gives and that are
        not recorded yet: the logits at position p score token p + 1 (a recompute after preemption records
        nothing twice)."""
        if req.params.prompt_logprobs is None:
            return range(0)
        return range(max(len(req.prompt_logprobs), req.num_computed + 1),
                     min(req.num_computed + n + 1, len(req.prompt_ids)))

    def _record_prompt_logprobs(self, req: Request, logits: torch.Tensor, targets: range) -> None:
        """logits [n, V] of a chunk starting at req.num_computed -> the logprobs of the prompt tokens `targets`."""
        a = targets.start - 1 - req.num_computed
        raw = self.runner.full_logits(logits[a: a + len(targets)])
        tokens = torch.tensor(req.prompt_ids[targets.start: targets.stop])
        req.prompt_logprobs += token_logprobs(raw, tokens, [req.params.prompt_logprobs] * len(targets))

    def _run_decode(self, decodes: list[Request], outputs: dict[str, RequestOutput], pad_to: int = 0) -> None:
        seqs = [DecodeSeq(r.last_id, r.num_computed, self.kv_manager.block_tables(r.request_id),
                          tuple(r.draft_ids)) for r in decodes]
        logits = self.runner.decode(seqs, pad_to)
        if not decodes:                        # an all-padding step (other DP groups of the EP group decode)
            return
        first = [0]                            # each request's first row: its last token's
        for r in decodes[:-1]:
            first.append(first[-1] + 1 + len(r.draft_ids))
        for r in decodes:
            r.num_computed += 1
            self._name_computed(r)
        self._sample(decodes, logits[first], outputs)
        more = self._verify_drafts(decodes, first, logits, outputs) if any(r.draft_ids for r in decodes) else 0
        self._stats.decode_tokens += len(decodes) + more

    def _verify_drafts(self, decodes: list[Request], first: list[int], logits: torch.Tensor,
                       outputs: dict[str, RequestOutput]) -> int:
        """Speculative decoding: each request's token just sampled is checked against its first draft; while
        they agree (the draft is accepted) and the request goes on, the draft's KV counts as computed and its
        row is sampled (the same sampler, params, grammar and generator as plain decoding, now seeing the
        accepted token), and so on down the drafts. The first disagreement, or the request finishing, ends it.
        -> the tokens sampled this way (each one a token without a step of its own)."""
        live = [(r, row) for r, row in zip(decodes, first) if r.draft_ids]
        drafted = [r for r, _ in live]
        self._stats.spec_drafts += len(drafted)
        self._stats.spec_draft_tokens += sum(len(r.draft_ids) for r in drafted)
        accepted = dict.fromkeys(map(id, drafted), 0)
        sampled = 0
        j = 0
        while live:
            live = [(r, row) for r, row in live if r.status != Status.FINISHED_ERROR and j < len(r.draft_ids)
                    and r.output_ids[-1] == r.draft_ids[j]]
            self._stats.spec_accepted_tokens += len(live)
            for r, _ in live:
                accepted[id(r)] += 1
            live = [(r, row) for r, row in live if not r.finished]
            for r, _ in live:
                r.num_computed += 1            # the draft is the token sampled: its KV (row j + 1) is the real one
                self._name_computed(r)
            if live:
                sampled += len(live)
                self._sample([r for r, _ in live], logits[[row + j + 1 for _, row in live]], outputs)
            j += 1
        observe = getattr(self.scheduler.proposer, "observe", None)
        if observe is not None:                # the proposer sizes later drafts by how these fared
            for r in drafted:
                observe(r, len(r.draft_ids), accepted[id(r)])
        return sampled

    def _sample(self, reqs: list[Request], logits: torch.Tensor, outputs: dict[str, RequestOutput]) -> None:
        allowed = [r.guide.allowed() if r.guide is not None else None for r in reqs]
        # the whole history (a copy of prompt + output) only where the repetition penalty reads it
        histories = [r.all_ids if r.params.repetition_penalty != 1.0 else () for r in reqs]
        res = self.runner.sample(self.sampler, logits, [r.params for r in reqs], [r.generator for r in reqs],
                                 histories, [r.output_ids for r in reqs],
                                 allowed if any(a is not None for a in allowed) else None)
        now = time.monotonic()
        for i, (req, tok) in enumerate(zip(reqs, res.token_ids.tolist())):   # one conversion, not an index each
            if req.guide is not None and req.guide.error is not None:     # its grammar broke down
                self.fail(req, req.guide.error, outputs)
                continue
            if i in res.failed:            # its logits, or its token masks left nothing: its failure alone
                self.fail(req, f"sampling failed: {res.failed[i]}", outputs)
                continue
            req.output_ids.append(tok)
            if req.guide is not None:
                req.guide.accept(tok)
            lp = res.logprobs[i] if res.logprobs else None
            if lp is not None:
                req.output_logprobs.append(lp)
            if req.first_token_time is None:
                req.first_token_time = now
            req.last_token_time = now
            out = outputs.setdefault(req.request_id, RequestOutput(req.request_id, [], False))
            if len(req.output_ids) == 1:   # the first token: from a prefill, or a decode step when the chunks
                out.num_cached_tokens = req.num_cached_tokens          # left the prompt's last token alone
                if req.params.prompt_logprobs is not None:
                    out.prompt_logprobs = list(req.prompt_logprobs)
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
        if self.transfers is not None:
            self.transfers.cancel(req)                        # a KV load in flight stops first
        req.error = error
        self.scheduler.finish(req, reason, keep_blocks)

    def fail(self, req: Request, error: str, outputs: dict[str, RequestOutput]) -> None:
        """Finish `req` with an error (its KV freed) and report it in this step's outputs."""
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
        from .safetensors_files import weights_fingerprint
        connector = NixlConnector(ecfg.kv_role, runner.kv, runner.cfg, secret=ecfg.kv_secret, host=host,
                                  advertise_host=advertise_host, side_port=side_port, lease_s=ecfg.kv_lease_s,
                                  timeout_s=ecfg.kv_transfer_timeout_s, vllm_kv_layout=ecfg.vllm_kv_layout,
                                  model_fingerprint=weights_fingerprint(runner.model_dir))
    return LLMEngine(runner, ecfg, connector)
