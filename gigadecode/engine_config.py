"""Engine configuration: `EngineConfig` (dtypes, KV block size and dtype, decoder, roles, parallel sizes,
threads), validated at construction, and the one place the command line's flags become it
(`engine_config_from_args`)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .config import ConfigError, GptOssConfig
from .speculative import SpeculativeConfig

# Prompt tokens a step prefills at most, by default. A chunk decodes each used MXFP4 expert once for all of its
# tokens, so longer chunks prefill long prompts faster (a 4,096-token prompt, AMX host: `small` 1.18x and
# `20b-shape` 1.14x at 1,024 against 512, 1.21x / 1.18x at 2,048), while the decodes batched into a step with a
# chunk wait for all of it: 1,024 takes most of the gain at half of 2,048's step.
DEFAULT_MAX_PREFILL_TOKENS = 1024

# torch is imported where a dtype is asked for: the command line builds its flags from this module for every
# command, the DI proxy's included, which runs without torch
if TYPE_CHECKING:
    import torch

DTYPES = ("bfloat16", "float32")     # the kernels compute in these two (torch.<name>)
KV_DTYPES = ("auto", "bf16", "fp8")


def default_threads() -> int:
    """OMP_NUM_THREADS when set, else the cores this process may run on, shared among the ranks torchrun
    started on this node. torchrun sets OMP_NUM_THREADS=1 for every rank when it starts several and the
    variable is unset, so under torchrun a 1 is taken for that default, not a choice (`--threads 1` is)."""
    omp = os.environ.get("OMP_NUM_THREADS", "")
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    torchrun_default = omp == "1" and local_ranks > 1 and "TORCHELASTIC_RUN_ID" in os.environ
    if omp.isdigit() and int(omp) > 0 and not torchrun_default:
        return int(omp)
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:                     # not Linux
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, local_ranks))


# `--threads` past this many per CPU only oversubscribes the cores; tens of thousands crash OpenMP's thread start
MAX_THREADS_PER_CPU = 8

# decode paths: the GK program on the native kernels, in eager torch, compiled by Inductor; the per-layer model
DECODERS = ("gk-native", "gk", "gk-compiled", "reference")


@dataclass(frozen=True)
class EngineConfig:
    """What the engine adds to the model config."""

    dtype: str = "float32"             # compute dtype of activations and non-expert weights
    kv_dtype: str = "auto"             # auto = model dtype (what transformers does); bf16; fp8 (packed)
    block_size: int = 16               # tokens per KV block
    num_blocks: int | None = None      # KV pool size (incl. null block 0); None = from the memory budget
    kv_budget_gib: float | None = None  # KV memory budget when num_blocks is None
    k_scale: float = 1.0               # FP8 per-tensor scales: stored = x / scale
    v_scale: float = 1.0
    gk_decode: bool = True             # decode through the GK program (else the per-layer model)
    decoder: str = "gk-native"         # gk-native (kernels) | gk (eager torch) | gk-compiled | reference
    kv_role: str = "kv_both"           # kv_producer | kv_consumer | kv_both
    max_num_seqs: int = 64
    max_model_len: int | None = None   # longest sequence (prompt + output) a request may reach; None = the model's
    max_prefill_tokens: int = DEFAULT_MAX_PREFILL_TOKENS   # chunked prefill budget per step
    batch_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    threads: int | None = None         # kernel threads (None = `default_threads()`)
    tp: int = 1
    dp: int = 1
    ep: int = 1
    dcp: int = 1                       # decode context parallel: ranks of a TP group sharing kv heads, split tokens
    dcp_interleave: int | None = None  # DCP: tokens per round-robin chunk (None = block_size; a multiple of it)
    distributed_timeout_s: float = 300.0  # parallel: a collective's longest wait for a peer once serving (hung rank)
    kv_lease_s: float = 30.0            # DI producer: how long leased blocks wait for the consumer's read
    kv_transfer_timeout_s: float = 10.0  # DI consumer: handshake + read time limit
    kv_failure_policy: str = "fail"     # DI consumer: fail | recompute (prefill locally) on a failed transfer
    kv_secret: str | None = field(default=None, repr=False)   # DI: the key P and D sign/verify KV params with
    vllm_kv_layout: str = "auto"        # DI consumer of a vLLM prefill: its CPU KV page order (auto | vec | amx)
    enable_prefix_caching: bool = False  # full KV blocks found again by their tokens (kv/prefix_cache.py)
    speculative: SpeculativeConfig | None = None   # n-gram drafts verified in the decode step (speculative.py)
    scheduling_policy: str = "fcfs"    # fcfs | priority (requests' `priority`: admission order, preemption victims)
    seed: int | None = None            # vLLM's --seed: requests without one draw theirs from it, in arrival order

    def __post_init__(self) -> None:
        from numbers import Integral, Real

        def at_least(flag: str, v: Any, lo: int, why: str = "") -> None:
            if not isinstance(v, Integral) or isinstance(v, bool):
                raise ConfigError(f"{flag} must be an integer >= {lo} (got {v!r}{why})")
            if v < lo:
                raise ConfigError(f"{flag} must be >= {lo} (got {v}{why})")

        def positive(flag: str, v: Any, at_least: float | None = None) -> None:
            """A finite number > 0, or >= `at_least` when given."""
            if (not isinstance(v, Real) or isinstance(v, bool) or not math.isfinite(v)
                    or not (v >= at_least if at_least is not None else v > 0)):
                bound = f">= {at_least:g}" if at_least is not None else "> 0"
                raise ConfigError(f"{flag} must be {bound} and finite (got {v!r})")

        if self.dtype not in DTYPES:
            raise ConfigError(f"--dtype must be one of {sorted(DTYPES)} (got {self.dtype!r})")
        if self.kv_dtype not in KV_DTYPES:
            raise ConfigError(f"--kv-dtype must be one of {KV_DTYPES} (got {self.kv_dtype!r})")
        if (not isinstance(self.block_size, Integral) or self.block_size <= 0
                or (self.kv_dtype == "fp8" and self.block_size % 2)):
            raise ConfigError(f"--block-size must be positive (and even for the packed fp8 KV cache, --kv-dtype fp8: "
                              f"the GK decoders' default); got {self.block_size}")
        if self.num_blocks is not None:
            at_least("--num-blocks", self.num_blocks, 2, "; block 0 is the reserved null block")
        if self.kv_budget_gib is not None:
            positive("--kv-budget-gib", self.kv_budget_gib)
        at_least("--max-num-seqs", self.max_num_seqs, 1)
        if self.max_model_len is not None:
            at_least("--max-model-len", self.max_model_len, 2, ": a prompt token and a generated one")
        at_least("--max-prefill-tokens", self.max_prefill_tokens, 1)
        b = self.batch_buckets
        if (not isinstance(b, (tuple, list)) or not b
                or not all(isinstance(x, Integral) and not isinstance(x, bool) and x >= 1 for x in b)
                or any(x >= y for x, y in zip(b, b[1:]))):
            raise ConfigError(f"batch_buckets must be a non-empty, strictly increasing sequence of positive "
                              f"integers (got {b!r})")
        if self.decoder not in DECODERS:
            raise ConfigError(f"--decoder must be {'|'.join(DECODERS)} (got {self.decoder!r})")
        if self.threads is not None:
            at_least("--threads", self.threads, 1)
            most = MAX_THREADS_PER_CPU * (os.cpu_count() or 1)
            if self.threads > most:
                raise ConfigError(f"--threads {self.threads} is more than {MAX_THREADS_PER_CPU} per CPU of this machine "
                                  f"({most}): the kernels run no faster for it, and OpenMP fails to start thousands "
                                  f"of threads (it aborts the process)")
        for flag, v in (("--tp", self.tp), ("--dp", self.dp), ("--ep", self.ep), ("--dcp", self.dcp)):
            at_least(flag, v, 1)
        if self.tp % self.dcp:
            raise ConfigError(f"--dcp {self.dcp} must divide --tp {self.tp} (a DCP group is dcp ranks of one TP group)")
        if self.dcp_interleave is not None:
            at_least("--dcp-interleave", self.dcp_interleave, 1)
            if self.dcp_interleave % self.block_size:
                raise ConfigError(f"--dcp-interleave {self.dcp_interleave} must be a multiple of --block-size "
                                  f"{self.block_size} (a KV block holds the tokens of one DCP rank)")
        if self.enable_prefix_caching and self.dcp > 1:
            raise ConfigError("--enable-prefix-caching needs every token's KV on one rank: not with --dcp")
        if self.speculative is not None and not isinstance(self.speculative, SpeculativeConfig):
            raise ConfigError(f"speculative must be a SpeculativeConfig (got {self.speculative!r})")
        if self.dcp > 1 and self.kv_role == "kv_producer":
            raise ConfigError("--dcp is for decode engines: a prefill engine keeps every token (its decode "
                              "engines read their DCP share of it)")
        positive("--distributed-timeout-s", self.distributed_timeout_s, at_least=1)   # shorter fails healthy worlds
        positive("--kv-lease-s", self.kv_lease_s)
        positive("--kv-transfer-timeout-s", self.kv_transfer_timeout_s)
        if self.kv_role not in ("kv_producer", "kv_consumer", "kv_both"):
            raise ConfigError(f"kv_role must be kv_producer|kv_consumer|kv_both (got {self.kv_role!r})")
        if self.vllm_kv_layout not in ("auto", "vec", "amx"):
            raise ConfigError(f"--vllm-kv-layout must be auto|vec|amx (got {self.vllm_kv_layout!r})")
        if self.seed is not None and (not isinstance(self.seed, Integral) or isinstance(self.seed, bool)
                                      or not 0 <= self.seed < 2**63):
            raise ConfigError(f"--seed must be an integer in [0, 2^63) (got {self.seed!r})")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ConfigError(f"--scheduling-policy must be fcfs|priority (got {self.scheduling_policy!r})")
        if self.kv_failure_policy not in ("fail", "recompute"):
            raise ConfigError(f"kv_failure_policy must be fail|recompute (got {self.kv_failure_policy!r})")
        if self.k_scale <= 0 or self.v_scale <= 0 or not math.isfinite(self.k_scale * self.v_scale):
            raise ConfigError("k_scale and v_scale must be positive and finite")

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch
        return getattr(torch, self.dtype)

    @property
    def dcp_chunk(self) -> int:
        """Tokens per DCP round-robin chunk."""
        return self.dcp_interleave or self.block_size

    def kv_storage_dtype(self) -> torch.dtype:
        import torch
        if self.kv_dtype == "fp8":
            return torch.float8_e4m3fn
        if self.kv_dtype == "bf16":
            return torch.bfloat16
        return self.torch_dtype


KV_DTYPE_NAMES = {"auto": "auto", "bf16": "bf16", "bfloat16": "bf16", "fp8": "fp8", "fp8_e4m3": "fp8"}
# --dtype: ours and vLLM's spellings of the two compute dtypes
DTYPE_NAMES = {"auto": "auto", "float32": "float32", "float": "float32", "fp32": "float32", "bfloat16": "bfloat16",
               "bf16": "bfloat16"}


def dtype_name(text: str) -> str:
    """A compute dtype (auto / float32 / bfloat16) from ours or vLLM's --dtype spellings; vLLM's half / float16
    is refused with what to use instead."""
    if text in DTYPE_NAMES:
        return DTYPE_NAMES[text]
    if text in ("half", "float16", "fp16"):
        raise ValueError(f"--dtype {text}: float16 compute is not supported (the kernels compute in bfloat16 or "
                         "float32); use bfloat16, or auto, which runs a float16 checkpoint in float32 (exact)")
    raise ValueError(f"invalid --dtype {text!r}: choose from auto, bfloat16, float32")


def kv_dtype_name(text: str) -> str:
    """A KV dtype as the engine names it (auto / bf16 / fp8), from ours or vLLM's --kv-cache-dtype spellings."""
    if text in KV_DTYPE_NAMES:
        return KV_DTYPE_NAMES[text]
    why = " (the FP8 KV cache stores e4m3)" if str(text).startswith("fp8") else ""
    raise ValueError(f"invalid KV dtype {text!r}{why}: choose from auto, bf16, fp8")


def engine_config_from_args(args: Any, kv_role: str = "kv_both") -> EngineConfig:
    """The `EngineConfig` of a command line (`gigadecode generate` / `serve` flags). `--dtype auto` is the
    checkpoint's `torch_dtype` when it is bfloat16, else float32 (which holds float16 weights exactly)."""
    dtype = dtype_name(getattr(args, "dtype", "auto") or "auto")
    if dtype == "auto":
        dtype = GptOssConfig.from_hf(args.model).torch_dtype
        dtype = dtype if dtype in DTYPES else "float32"
    kv_dtype = args.kv_dtype or ("auto" if args.decoder == "reference" else "fp8")
    return EngineConfig(dtype=dtype, kv_dtype=kv_dtype, block_size=args.block_size,
                        threads=default_threads() if getattr(args, "threads", None) is None else args.threads,
                        num_blocks=args.num_blocks, kv_budget_gib=args.kv_budget_gib,
                        decoder=args.decoder, gk_decode=args.decoder != "reference", kv_role=kv_role,
                        max_num_seqs=args.max_num_seqs, max_model_len=getattr(args, "max_model_len", None),
                        max_prefill_tokens=args.max_prefill_tokens,
                        tp=args.tp, dp=args.dp, ep=args.ep, dcp=getattr(args, "dcp", 1),
                        dcp_interleave=getattr(args, "dcp_interleave", None),
                        distributed_timeout_s=getattr(args, "distributed_timeout_s", 300.0),
                        kv_lease_s=getattr(args, "kv_lease_s", 30.0),
                        kv_transfer_timeout_s=getattr(args, "kv_transfer_timeout_s", 10.0),
                        kv_failure_policy=getattr(args, "kv_failure_policy", "fail"),
                        vllm_kv_layout=getattr(args, "vllm_kv_layout", "auto"),
                        enable_prefix_caching=bool(getattr(args, "enable_prefix_caching", False)),
                        speculative=SpeculativeConfig.parse(getattr(args, "speculative_config", None)),
                        scheduling_policy=getattr(args, "scheduling_policy", None) or "fcfs",
                        seed=getattr(args, "engine_seed", None),
                        kv_secret=getattr(args, "kv_secret", None) or None)
