"""A request's state as the engine keeps it: `Status` (one enum, finish reasons included), `Request`,
`RequestOutput` (what one step produced for it), `RequestError` and the engine's counters `EngineStats`."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, fields
from enum import Enum
from typing import Any

import torch

from .connector.params import KVTransferParams
from .sampling import SamplingParams


class RequestError(ValueError):
    """A request the engine refuses (bad prompt, too long, invalid parameters); `param` names the field and
    `code` says what kind of refusal it is (the server's error body carries both)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.code = param, code


class Status(Enum):
    WAITING = "waiting"                             # queued (or preempted): nothing computed it holds
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"  # DI consumer: in the running set, its KV on the way
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self in FINISH_REASONS

    @classmethod
    def finished_with(cls, reason: str) -> Status:
        """The finished state of an OpenAI finish reason ("stop", "length", "abort", "error")."""
        try:
            return _FINISHED[reason]
        except KeyError:
            raise ValueError(f"unknown finish reason {reason!r}") from None


FINISH_REASONS = {Status.FINISHED_STOPPED: "stop", Status.FINISHED_LENGTH: "length",
                  Status.FINISHED_ABORTED: "abort", Status.FINISHED_ERROR: "error"}
_FINISHED = {v: k for k, v in FINISH_REASONS.items()}


@dataclass(eq=False)       # a request is itself: the scheduler's `in` / `remove` compare identities, not fields
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list = field(default_factory=list)
    prompt_logprobs: list = field(default_factory=lambda: [None])   # params.prompt_logprobs: per prompt token
    num_computed: int = 0
    status: Status = Status.WAITING
    error: str | None = None
    generator: torch.Generator | None = None
    num_preemptions: int = 0
    prefill_start_time: float | None = None   # when its first prefill chunk ran
    first_token_time: float | None = None
    last_token_time: float | None = None
    kv_transfer_params: KVTransferParams | None = None      # DI: what the router sent (parsed)
    kv_transfer_params_out: dict | None = None  # DI: what a producer answers (signed, for the decode engine)
    compute_limit: int | None = None            # DI producer: compute only the first N-1 prompt tokens
    remote_tokens: int = 0                      # DI consumer: prompt tokens whose KV comes from the prefill
    num_cached_tokens: int | None = None        # prefix caching: prompt tokens found in the cache at admission
    guide: Any = None                           # structured output: its grammar's state (structured.Guide)
    draft_ids: list[int] = field(default_factory=list)   # speculative decoding: this step's drafts
    ngram: Any = None                           # speculative decoding: the proposer's state (its history, acceptance)
    priority: int = 0                           # --scheduling-policy priority: lower is scheduled first
    arrival_index: int = 0                      # the scheduler's arrival order (ties of priority)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def last_id(self) -> int:
        """all_ids[-1], without the copy."""
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)

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
    prompt_logprobs: list | None = None     # with the first token, when asked for: one per prompt token
    num_cached_tokens: int | None = None    # with the first token, under prefix caching: prompt tokens found


@dataclass
class EngineStats:
    """Counters of one engine (a parallel engine sums its DP groups' with `+`)."""

    steps: int = 0
    preemptions: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    kv_bytes_transferred: int = 0
    transfer_failures: int = 0
    recomputed_after_failure: int = 0
    step_failures: int = 0
    prefix_cache_queries: int = 0     # prompt tokens of requests that looked in the prefix cache
    prefix_cache_hits: int = 0        # ... and those found there (not computed again)
    spec_drafts: int = 0              # speculative decoding: request-steps that verified drafts
    spec_draft_tokens: int = 0        # ... the drafts verified
    spec_accepted_tokens: int = 0     # ... and those accepted (each one a token without a step of its own)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    def __add__(self, other: EngineStats) -> EngineStats:
        return EngineStats(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})
