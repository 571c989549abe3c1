"""Token sampling: per-request parameters and the batch sampler.

This module owns
- `SamplingParams`: vLLM's sampling fields, names and defaults, validated on construction (and against a
  vocabulary by `validate`); `from_dict` builds one from API / JSONL input.
- `Sampler`: one step for a batch of requests: min-tokens masking, repetition / frequency / presence
  penalties, the hard token masks (`token_masks.py`), then greedy (the distributed argmax, `argmax.py`) or temperature,
  min-p, top-k, top-p and a multinomial draw from each request's own `torch.Generator`; plus the raw
  logprobs vLLM returns.

Stop checks (EOS, stop ids, max_tokens) belong to the engine; this module only masks EOS / stop ids
while a request is below `min_tokens`.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

import torch

from .argmax import greedy, shard_argmax
from .token_masks import check_allowed, check_bad_words, constrain, forbids_every_allowed, out_of_vocab

#: Temperatures below this are greedy (vLLM's `_SAMPLING_EPS`): dividing logits by a smaller one
#: overflows float32 and the distribution is a one-hot anyway.
GREEDY_EPS = 1e-5
#: Structured output (`SamplingParams.guided`, compiled by `structured.py`): what the grammar is, and whether it
#: holds the whole output or only a harmony final message
GUIDED_KINDS = ("json", "json_object", "regex", "choice", "grammar")
GUIDED_SCOPES = ("all", "final")
#: Most top logprobs a request may ask for per token (vLLM's default `max_logprobs`).
MAX_LOGIT_BIAS = 1024                      # tokens one request may bias
MAX_LOGPROBS = 20
#: `torch.Generator.manual_seed` accepts exactly this range.
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1


class SamplingError(ValueError):
    """An invalid sampling parameter (or sampler input); `param` names it."""

    def __init__(self, param: str, message: str) -> None:
        self.param = param
        super().__init__(f"invalid sampling parameter {param}: {message}")


# --------------------------------------------------------------------------------------------------
# SamplingParams
# --------------------------------------------------------------------------------------------------
def _real(name: str, value: Any) -> float:
    """A finite real number (int or float, not bool) as float, or SamplingError."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise SamplingError(name, f"must be a number (got {type(value).__name__} {value!r})")
    v = float(value)
    if not math.isfinite(v):
        raise SamplingError(name, f"must be finite (got {v})")
    return v


def _int(name: str, value: Any) -> int:
    """An integer (not bool, not float) as int, or SamplingError."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise SamplingError(name, f"must be an integer (got {type(value).__name__} {value!r})")
    return int(value)


def nth_seed(seed: int, j: int) -> int:
    """The seed of a seeded request's j-th sequence (n > 1): seed + j, wrapped past the top of the range
    `torch.Generator.manual_seed` takes (a request may send the largest seed with n > 1)."""
    s = seed + j
    return s - 2**64 if s > SEED_MAX else s


def truncate_prompt(ids: list[int], keep: int | None, max_model_len: int) -> list[int]:
    """vLLM's truncate_prompt_tokens: the prompt's last `keep` tokens (vLLM truncates on the left; -1: the
    context length); None: the prompt as it is. SamplingError for a value vLLM refuses."""
    if keep is None:
        return ids
    if isinstance(keep, bool) or not isinstance(keep, int) or keep == 0 or keep < -1:
        raise SamplingError("truncate_prompt_tokens", f"must be >= 1, or -1 for the context length (got {keep!r})")
    n = max_model_len if keep == -1 else keep
    if n > max_model_len:
        raise SamplingError("truncate_prompt_tokens", f"{n} is greater than the context length (max_model_len "
                                                      f"{max_model_len}): select a smaller truncation size")
    return ids[-n:]


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling parameters; vLLM's names, defaults and ranges.

    temperature 0 (anything below `GREEDY_EPS`) is greedy, as is top_k == 1. top_k 0 or -1 turns
    top-k off (-1 is stored as 0). logprobs: None returns none; N >= 0 returns the sampled token's
    logprob plus the top N. prompt_logprobs: the same for every prompt token after the first (the logprob
    of that token given the ones before it, the first is None): vLLM's field, which OpenAI's `echo` asks for.
    guided: (kind, source, scope) holds the output to a grammar (`structured.py`). allowed_token_ids and
    bad_words_token_ids: vLLM's whitelist and its bad words as token ids (`token_masks.py`). Values are
    type-checked (a string, bool, NaN or inf is an error) and normalized (floats stored as float,
    stop_token_ids as a tuple) on construction.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    guided: tuple[str, str, str] | None = None       # structured output: (kind, source, scope), structured.py
    logit_bias: tuple[tuple[int, float], ...] = ()   # (token id, bias in [-100, 100]) added to the logits
    allowed_token_ids: tuple[int, ...] | None = None # vLLM's: only these may be sampled (token_masks.py)
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()   # vLLM's bad_words, tokenized (token_masks.py)

    def __post_init__(self) -> None:
        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        def need(cond: bool, name: str, rule: str) -> None:
            if not cond:
                raise SamplingError(name, f"{rule} (got {getattr(self, name)!r})")

        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty"):
            put(name, _real(name, getattr(self, name)))
        for name in ("top_k", "max_tokens", "min_tokens"):
            put(name, _int(name, getattr(self, name)))
        for name in ("seed", "logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                put(name, _int(name, getattr(self, name)))
        if not isinstance(self.ignore_eos, bool):
            raise SamplingError("ignore_eos", f"must be a bool (got {type(self.ignore_eos).__name__} "
                                              f"{self.ignore_eos!r})")
        stop = self.stop_token_ids
        if stop is None:
            stop = ()
        if isinstance(stop, (str, bytes)) or not isinstance(stop, Sequence):
            raise SamplingError("stop_token_ids", f"must be a list of token ids (got {type(stop).__name__} "
                                                  f"{stop!r})")
        put("stop_token_ids", tuple(_int("stop_token_ids", t) for t in stop))
        bias = self.logit_bias if self.logit_bias is not None else ()
        if isinstance(bias, Mapping):                # OpenAI: {"token id": bias}
            items = []
            for k, v in bias.items():
                if isinstance(k, str) and k.strip().lstrip("-").isdigit():
                    k = int(k)
                items.append((_int("logit_bias", k), _real("logit_bias", v)))
            bias = tuple(items)
        elif isinstance(bias, (str, bytes)) or not isinstance(bias, Sequence):
            raise SamplingError("logit_bias", f"must map token ids to biases (got {type(bias).__name__})")
        else:
            bias = tuple((_int("logit_bias", t), _real("logit_bias", b)) for t, b in bias)
        put("logit_bias", bias)
        for name, check in (("allowed_token_ids", check_allowed), ("bad_words_token_ids", check_bad_words)):
            try:
                put(name, check(getattr(self, name)))
            except ValueError as e:
                raise SamplingError(name, str(e)) from None
        if forbids_every_allowed(self.allowed_token_ids, self.bad_words_token_ids):
            raise SamplingError("bad_words", "one-token bad words forbid every token allowed_token_ids allows: "
                                             "nothing could be sampled")
        g = self.guided
        if g is not None:
            if (isinstance(g, (str, bytes)) or not isinstance(g, Sequence) or len(g) != 3
                    or not all(isinstance(x, str) for x in g)):
                raise SamplingError("guided", f"must be [kind, source, scope] strings (got {g!r})")
            if g[0] not in GUIDED_KINDS or g[2] not in GUIDED_SCOPES:
                raise SamplingError("guided", f"kind must be one of {GUIDED_KINDS} and scope one of {GUIDED_SCOPES} "
                                              f"(got {g!r})")
            put("guided", tuple(g))

        need(self.temperature >= 0.0, "temperature", "must be >= 0 (0 = greedy)")
        need(0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]")
        need(self.top_k >= -1, "top_k", "must be -1 or 0 (off), or >= 1")
        if self.top_k == -1:
            put("top_k", 0)
        need(0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]")
        if self.seed is not None:
            need(SEED_MIN <= self.seed <= SEED_MAX, "seed", f"must be in [{SEED_MIN}, {SEED_MAX}]")
        need(self.max_tokens >= 1, "max_tokens", "must be >= 1")
        need(self.min_tokens >= 0, "min_tokens", "must be >= 0")
        need(self.min_tokens <= self.max_tokens, "min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        need(all(t >= 0 for t in self.stop_token_ids), "stop_token_ids", "token ids must be >= 0")
        need(self.repetition_penalty > 0.0, "repetition_penalty", "must be > 0 (1 = off)")
        need(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]")
        need(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]")
        if self.logprobs is not None:
            need(0 <= self.logprobs <= MAX_LOGPROBS, "logprobs", f"must be in [0, {MAX_LOGPROBS}]")
        if self.prompt_logprobs is not None:
            need(0 <= self.prompt_logprobs <= MAX_LOGPROBS, "prompt_logprobs", f"must be in [0, {MAX_LOGPROBS}]")
        need(len(self.logit_bias) <= MAX_LOGIT_BIAS, "logit_bias", f"may bias at most {MAX_LOGIT_BIAS} tokens")
        need(all(t >= 0 and -100.0 <= b <= 100.0 for t, b in self.logit_bias), "logit_bias",
             "token ids must be >= 0 and biases in [-100, 100]")

    # ----------------------------------------------------------------------------------------------
    def validate(self, vocab_size: int) -> None:
        """The vocabulary-dependent checks: every stop token id must be in [0, vocab_size)."""
        bad = [t for t in self.stop_token_ids if t >= vocab_size]
        if bad:
            raise SamplingError("stop_token_ids", f"token ids must be in [0, {vocab_size}) (got {bad})")
        bad = [t for t, _ in self.logit_bias if t >= vocab_size]
        if bad:
            raise SamplingError("logit_bias", f"token ids must be in [0, {vocab_size}) (got {bad})")
        bad_ids = out_of_vocab(self.allowed_token_ids, self.bad_words_token_ids, vocab_size)
        if bad_ids is not None:
            raise SamplingError(bad_ids[0], f"token ids must be in [0, {vocab_size}) (got {bad_ids[1]})")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SamplingParams:
        """From API / JSONL input. Unknown keys are ignored (as OpenAI-style servers do); known keys are
        type-checked; an explicit null for a field whose default is not None means the default."""
        if not isinstance(d, Mapping):
            raise SamplingError("sampling parameters", f"must be an object (got {type(d).__name__})")
        kwargs: dict[str, Any] = {}
        for f in fields(cls):
            if f.name not in d:
                continue
            v = d[f.name]
            default = f.default if f.default is not MISSING else None
            if v is None and default is not None:
                continue
            kwargs[f.name] = v
        return cls(**kwargs)

    @property
    def is_greedy(self) -> bool:
        """Argmax decoding: temperature below `GREEDY_EPS`, or top_k == 1."""
        return self.temperature < GREEDY_EPS or self.top_k == 1

    def takes_raw_argmax(self, num_output: int) -> bool:
        """True when, with `num_output` tokens generated, the next token is the argmax of the raw logits:
        greedy, and nothing masks, penalizes or reports them (no logprobs, penalties, logit bias, token
        allow / ban lists, and min_tokens reached)."""
        return (self.is_greedy and self.logprobs is None and self.repetition_penalty == 1.0
                and self.presence_penalty == 0.0 and self.frequency_penalty == 0.0 and not self.logit_bias
                and num_output >= self.min_tokens and self.allowed_token_ids is None
                and not self.bad_words_token_ids)


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    """The request's own generator (None for an unseeded request, which draws from torch's default
    generator). It must live on the logits' device."""
    if seed is None:
        return None
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


# --------------------------------------------------------------------------------------------------
# Sampler
# --------------------------------------------------------------------------------------------------
# why a row could not be sampled (SampleResult.failed): its request fails, the rest of the batch goes on
NON_FINITE = "the model's logits for this request hold NaN or +inf (a corrupt checkpoint, or values past its dtype)"
NO_TOKEN_LEFT = "no token is left to sample: every logit is -inf"


def argmax_failures(best: torch.Tensor) -> dict[int, str]:
    """The rows a raw argmax cannot serve, from each row's winning logit best [B] (NaN wherever the row holds
    one, as torch.argmax picks it): NaN / +inf -> NON_FINITE, -inf (nothing left) -> NO_TOKEN_LEFT."""
    return {i: NO_TOKEN_LEFT if float(best[i]) == -math.inf else NON_FINITE
            for i in (~torch.isfinite(best)).nonzero().flatten().tolist()}


@dataclass(frozen=True)
class TokenLogprobs:
    """Raw logprobs (log_softmax of the model's logits, before penalties and temperature) for one
    sampled token. rank: 1 + the number of other tokens with logprob >= the sampled one's (vLLM's rank);
    top: the request's top-N (token id, logprob), best first (empty when N = 0)."""

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class SampleResult:
    token_ids: torch.Tensor                                # [B] int64, on the logits' device
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)  # per request; None if not asked
    # rows that could not be sampled -> why (their token is meaningless): NaN / +inf logits, none left finite, or
    # hard token masks (token_masks) that leave nothing
    failed: dict[int, str] = field(default_factory=dict)


class Sampler:
    """Samples one token per request from a batch of logits.

    Per request, in vLLM v1's order: (1) while fewer than min_tokens tokens were generated, the stop
    ids (and EOS unless ignore_eos) are masked to -inf; (2) repetition penalty over prompt + output
    tokens (logit > 0 divided by it, else multiplied), then frequency (× count) and presence penalties
    over output tokens, subtracted, then the hard masks (token_masks.py); (3) greedy requests take the
    distributed argmax; the rest divide by temperature, drop tokens with prob < min_p × max prob, keep the
    top_k largest logits (ties with the k-th kept), keep the smallest most-probable set whose probability
    reaches top_p (at least one), and draw once with `torch.multinomial` from their own generator
    (unseeded: torch's default one).

    A seeded request's draw depends only on its own logits, params, history and generator, never on the
    rest of the batch. A row whose logits hold NaN or +inf, or that has no finite logit left to draw, is that
    row's failure alone (`SampleResult.failed`), never the batch's.
    """

    def __init__(self, *, num_shards: int = 1, eos_token_ids: Sequence[int] = ()) -> None:
        if num_shards < 1:
            raise ValueError(f"num_shards must be >= 1 (got {num_shards})")
        self.num_shards = num_shards
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)

    # ----------------------------------------------------------------------------------------------
    def sample(self, logits: torch.Tensor, params: Sequence[SamplingParams],
               generators: Sequence[torch.Generator | None] | None = None,
               prompt_and_output_ids: Sequence[Sequence[int] | torch.Tensor] | None = None,
               output_ids: Sequence[Sequence[int] | torch.Tensor] | None = None,
               allowed: Sequence[torch.Tensor | None] | None = None) -> SampleResult:
        """logits [B, V] (float32; other float dtypes are upcast); params, generators, histories: one per
        row. Histories may be omitted (no penalties apply), as may generators (all unseeded). `allowed`: per
        row None or a [V] bool mask of the only tokens it may draw (structured output), applied last with the
        params' allowed_token_ids and bad words (`token_masks.constrain`; rows they leave empty: `failed`)."""
        if logits.dim() != 2 or logits.shape[1] == 0:
            raise SamplingError("logits", f"must be [B, V] with V >= 1 (got shape {tuple(logits.shape)})")
        b, v = logits.shape
        dev = logits.device
        generators = [None] * b if generators is None else list(generators)
        prompt_and_output_ids = [()] * b if prompt_and_output_ids is None else list(prompt_and_output_ids)
        output_ids = [()] * b if output_ids is None else list(output_ids)
        for name, seq in (("params", params), ("generators", generators),
                          ("prompt_and_output_ids", prompt_and_output_ids), ("output_ids", output_ids)):
            if len(seq) != b:
                raise SamplingError(name, f"needs one entry per logits row ({b}), got {len(seq)}")
        for p in params:
            if not isinstance(p, SamplingParams):
                raise SamplingError("params", f"must be SamplingParams (got {type(p).__name__})")
            p.validate(v)
        bad_eos = [t for t in self.eos_token_ids if not 0 <= t < v]
        if bad_eos:
            raise SamplingError("eos_token_ids", f"must be in [0, {v}) (got {bad_eos})")
        if (allowed is None or all(a is None for a in allowed)) and all(
                p.takes_raw_argmax(len(o)) for p, o in zip(params, output_ids)):
            return self._raw_argmax(logits)

        raw = logits
        x = logits.float()                                                   # [B, V] working copy
        if x is logits:
            x = x.clone()
        failed: dict[int, str] = {}
        bad_rows = (x.isnan() | (x == math.inf)).any(dim=1)                  # [B]
        failed.update(dict.fromkeys(bad_rows.nonzero().flatten().tolist(), NON_FINITE))
        x[bad_rows] = 0.0                                                    # drawn from, then discarded

        for i, p in enumerate(params):                                     # OpenAI's logit_bias, first
            if p.logit_bias:
                ids = torch.tensor([t for t, _ in p.logit_bias], device=dev)
                x[i].index_add_(0, ids, torch.tensor([b for _, b in p.logit_bias], device=dev, dtype=x.dtype))
        self._mask_min_tokens(x, params, output_ids)
        self._apply_penalties(x, params, prompt_and_output_ids, output_ids)
        # min_tokens gives way to the hard masks from the raw logits: a failed row's are zeros there too (its NaN /
        # +inf would reach the draw, and torch.multinomial would fail the whole batch)
        fallback = raw.float().masked_fill(bad_rows[:, None], 0.0) if failed else raw
        for i, why in constrain(x, fallback, params, output_ids, allowed).items():   # grammar, allowed ids, bad words
            failed.setdefault(i, why)

        tokens = torch.empty(b, dtype=torch.int64, device=dev)               # [B]
        greedy_rows = [i for i, p in enumerate(params) if p.is_greedy]
        random_rows = [i for i, p in enumerate(params) if not p.is_greedy]
        if greedy_rows:
            gi = torch.tensor(greedy_rows, device=dev)
            tokens[gi] = greedy(x[gi], self.num_shards)
            for j in (x[gi].amax(dim=-1) == -math.inf).nonzero().flatten().tolist():
                failed.setdefault(greedy_rows[j], NO_TOKEN_LEFT)
        if random_rows:
            ri = torch.tensor(random_rows, device=dev)
            tokens[ri] = self._sample_random(x[ri], [params[i] for i in random_rows],
                                             [generators[i] for i in random_rows], random_rows, failed)
        return SampleResult(tokens, self._logprobs(raw, params, tokens, skip=failed), failed)

    @staticmethod
    def _raw_argmax(logits: torch.Tensor) -> SampleResult:
        """A batch of rows that all take the argmax of their raw logits [B, V]: one pass, no working copy (a
        decode step's common case). The same tokens and failures as the general path: torch.argmax picks a
        NaN wherever a row holds one, so the winning logit is NaN or +inf exactly for the rows that path calls
        non-finite, and -inf exactly for rows with no token left."""
        best, tokens = shard_argmax(logits, 0)                               # [B], [B]
        return SampleResult(tokens, [None] * logits.shape[0], argmax_failures(best))

    # ----------------------------------------------------------------------------------------------
    def _mask_min_tokens(self, x: torch.Tensor, params: Sequence[SamplingParams],
                         output_ids: Sequence[Sequence[int] | torch.Tensor]) -> None:
        for i, p in enumerate(params):
            if len(output_ids[i]) < p.min_tokens:
                stop = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos_token_ids))
                if stop:
                    x[i, torch.tensor(sorted(stop), device=x.device)] = -math.inf

    def _apply_penalties(self, x: torch.Tensor, params: Sequence[SamplingParams],
                         prompt_and_output_ids: Sequence[Sequence[int] | torch.Tensor],
                         output_ids: Sequence[Sequence[int] | torch.Tensor]) -> None:
        v = x.shape[1]

        def ids_of(name: str, seq: Sequence[int] | torch.Tensor) -> torch.Tensor:
            t = torch.as_tensor(seq, dtype=torch.int64, device=x.device).flatten()   # [N]
            if t.numel() and (int(t.min()) < 0 or int(t.max()) >= v):
                raise SamplingError(name, f"token ids must be in [0, {v})")
            return t

        for i, p in enumerate(params):
            if p.repetition_penalty != 1.0:
                seen = ids_of("prompt_and_output_ids", prompt_and_output_ids[i]).unique()
                if seen.numel():
                    vals = x[i, seen]
                    x[i, seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
            if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0:
                out, counts = ids_of("output_ids", output_ids[i]).unique(return_counts=True)
                if out.numel():
                    x[i, out] -= p.frequency_penalty * counts.to(x.dtype) + p.presence_penalty

    def _sample_random(self, x: torch.Tensor, params: list[SamplingParams],
                       generators: list[torch.Generator | None], rows: list[int],
                       failed: dict[int, str]) -> torch.Tensor:
        """x [R, V] penalized logits of the non-greedy rows -> sampled ids [R] (rows with none left: `failed`)."""
        r, v = x.shape
        dev = x.device
        x = x / torch.tensor([p.temperature for p in params], device=dev)[:, None]

        min_p = torch.tensor([p.min_p for p in params], device=dev)                 # [R]
        if bool((min_p > 0).any()):
            probs = x.softmax(dim=-1)                                                # [R, V]
            x = x.masked_fill(probs < min_p[:, None] * probs.amax(dim=-1, keepdim=True), -math.inf)

        k_rows = [j for j, p in enumerate(params) if 0 < p.top_k < v]
        if k_rows:      # keep logits >= the k-th largest (ties with it kept); topk, not a full sort
            kj = torch.tensor(k_rows, device=dev)
            k = torch.tensor([params[j].top_k for j in k_rows], device=dev)            # [Rk]
            xk = x[kj]                                                               # [Rk, V]
            kth = xk.topk(int(k.max()), dim=-1).values.gather(1, (k - 1)[:, None])   # [Rk, 1]
            x[kj] = xk.masked_fill(xk < kth, -math.inf)
        p_rows = [j for j, p in enumerate(params) if p.top_p < 1.0]
        if p_rows:      # keep the most probable tokens until their mass reaches top_p (at least one)
            pj = torch.tensor(p_rows, device=dev)
            top_p = torch.tensor([params[j].top_p for j in p_rows], device=dev)        # [Rp]
            sx, order = x[pj].sort(dim=-1, descending=True, stable=True)             # [Rp, V] each
            sp = sx.softmax(dim=-1)
            before = sp.cumsum(dim=-1) - sp                                          # mass ranked above
            drop = before >= top_p[:, None]
            drop[:, 0] = False
            x[pj] = torch.empty_like(sx).scatter_(1, order, sx.masked_fill(drop, -math.inf))

        dead = x.amax(dim=-1) == -math.inf
        for j in dead.nonzero().flatten().tolist():
            failed.setdefault(rows[j], NO_TOKEN_LEFT)
        x[dead] = 0.0
        probs = x.softmax(dim=-1)                                                    # [R, V]
        out = torch.empty(r, dtype=torch.int64, device=dev)
        for j, g in enumerate(generators):
            if g is not None and g.device.type != dev.type:
                raise SamplingError("generators", f"request row {rows[j]}: generator on {g.device}, logits on "
                                                  f"{dev} (use make_generator(seed, device=logits.device))")
            out[j] = torch.multinomial(probs[j], 1, generator=g)[0]
        return out

    @staticmethod
    def _logprobs(raw: torch.Tensor, params: Sequence[SamplingParams],
                  tokens: torch.Tensor, skip: Mapping[int, str] = {}) -> list[TokenLogprobs | None]:
        result: list[TokenLogprobs | None] = [None] * len(params)
        rows = [i for i, p in enumerate(params) if p.logprobs is not None and i not in skip]
        if not rows:
            return result
        ri = torch.tensor(rows, device=raw.device)
        for i, lp in zip(rows, token_logprobs(raw[ri], tokens[ri], [params[i].logprobs for i in rows])):
            result[i] = lp
        return result


def token_logprobs(raw: torch.Tensor, tokens: torch.Tensor, tops: Sequence[int]) -> list[TokenLogprobs]:
    """Raw logits [R, V], one token per row [R] and how many top entries each row reports -> per row the
    token's logprob (log_softmax in fp32), its rank and the top `tops[r]` (token id, logprob), best first."""
    lp = torch.log_softmax(raw.float(), dim=-1)                                  # [R, V]
    tok = tokens.to(device=lp.device, dtype=torch.long)                          # [R]
    tok_lp = lp.gather(1, tok[:, None])                                          # [R, 1]
    ranks = (lp >= tok_lp).sum(dim=-1)                                           # [R]
    n_max = min(max(tops), lp.shape[1])
    top_v, top_i = lp.topk(n_max, dim=-1)                                        # [R, n_max]
    tok_l, tok_lp_l, ranks_l = tok.tolist(), tok_lp.squeeze(1).tolist(), ranks.tolist()
    top_v_l, top_i_l = top_v.tolist(), top_i.tolist()
    out = []
    for j, k in enumerate(tops):
        n = min(k, lp.shape[1])
        out.append(TokenLogprobs(tok_l[j], tok_lp_l[j], ranks_l[j], tuple(zip(top_i_l[j][:n], top_v_l[j][:n]))))
    return out
