"""The KV memory plan of one rank: weights, activations, and how many KV blocks the rest holds.

Owns the arithmetic behind `gigadecode plan` and the engine's default `num_blocks`. Everything is
*per rank* (one TP×EP shard); every rank of a TP group holds the same `num_blocks` (its kv-head slice
of each block), which is what the seed calls "per engine".

- weights: `build_stacked_weight_specs` with this rank's `Shard` — q heads and kv heads split over TP
  (kv heads replicated when TP > kv heads: `max(kv // tp, 1)` per rank), o-proj split by TP, lm_head
  split by vocabulary over TP, experts split `E / ep`, MXFP4 experts counted as their MXFP4 bytes
  (blocks + scales), embeddings, router and norms replicated. Non-expert weights are bf16 (the
  checkpoint's precision), norms fp32.
- activations: a documented floor, `estimate_activation_bytes` (override with `activation_gib`).
- budget: `kv_budget_gib`, or `device_memory_gib × memory_utilization − weights − activations`
  (no GK-specific cap: each HMA buffer is indexed base-0, see below).
- `bytes_per_block`: all `group_size` buffers × 2 (K, V) × kv heads per rank × block × head_dim ×
  itemsize (fp8 = 1, bf16 = 2); `num_blocks = floor(budget / bytes_per_block)`, the null block 0 included.
- `kv_tokens = num_blocks × block_size`: tokens of full-attention context. A block id belongs to
  one group, so a request of T tokens takes `cdiv(T, B)` full-group blocks plus at most
  `cdiv(W-1, B) + 1` sliding-group blocks; vLLM's log line divides by the number of groups instead
  (`num_blocks // num_groups × B`, reported here as `kv_tokens_vllm_log`).
- uint32 offset: one buffer half (K or V) spans `num_blocks × kv × block × d` elements
  (`max_buffer_offset`), which must stay < 2**32. The old stacked layout (one K tensor stacked over
  the `group_size` buffers, `[group_size, num_blocks, kv, block, d]`) spanned `group_size` times that,
  capping `num_blocks` at `floor((2**32 − 1) / (group_size × kv × block × d))`
  (`stacked_layout_cap_blocks`); a stack over all L layers (or over K and V together) halves it again
  (`stacked_all_layers_cap_blocks`).

The seed's anchor (120B decode rank, TP8 × DP16 × EP128, 18 buffers, kv 1, block 128, d 64, FP8):
≈36,175 blocks, ≈9.94 GiB. `bytes_per_block` is 294,912 B, so 36,175 blocks are exactly 9.936 GiB.
Inputs reproducing it: a Trainium2 chip has 96 GiB HBM for 8 physical NeuronCores, so at lnc1 one
rank has 12 GiB; with `memory_utilization = 0.99`, the rank's real 120B weights (1.906 GiB: 1.08 GiB
replicated bf16 embedding, 0.13 GiB lm_head vocab shard, 0.22 GiB attention, 0.44 GiB MXFP4 for its
one expert per layer, the rest router/norms) and the 18 MiB activation floor, the plan gives 36,253
blocks (9.96 GiB), +0.2% from the seed. The seed's "~2.54M KV tokens" matches neither count:
36,175 × 128 = 4.63M tokens of full-attention context (our `kv_tokens`), and vLLM's per-group log
convention gives 36,175 // 2 × 128 = 2.32M; we report both. The seed's "about 2x the stacked cap"
fits the all-layers stack (14,563 blocks, 2.48× for 36,175) rather than the group_size stack (29,127, 1.24×).

DCP (decode context parallel, `--dcp N`, N dividing tp): the N consecutive ranks of a DCP group hold the same
kv heads and split every sequence's tokens round-robin in chunks of `--dcp-interleave` tokens (I, a multiple
of the block size; `kv.dcp.TokenShard`). The kv heads are split over tp/N shards instead of tp, so a rank holds
`kv // (tp/N)` heads (`local_heads` with `Shard(dcp_size=N)`; tp/N must divide the kv heads, so N ≥ tp/kv).
Where tp/N < kv heads a rank holds more heads than without DCP: `bytes_per_block` grows (×N when tp ≤ kv,
×N·kv/tp when tp > kv) and `num_blocks` shrinks by as much, while each block holds 1/N of a sequence's
tokens: no more sequences fit than with N = tp/kv. Where tp > kv heads, every kv head was held tp/kv times
without DCP; at N = tp/kv a rank still holds one head (same `bytes_per_block`, same `num_blocks`) but only
its 1/N of every sequence's tokens, so the group holds N× the context and N× the sequences at a long context
(120B, 8 kv heads, TP16 --dcp 2). The DCP numbers, all per rank:
- `kv_tokens_per_rank = num_blocks × B`: the tokens this rank's pool holds (its share of the group's context).
- `kv_context_tokens`: the longest single sequence whose full-attention blocks fit the usable pool
  (`num_blocks − 1`) on every rank of the group. Every rank allocates what the fullest rank (0) needs, so it is
  the largest T with `cdiv(most(T), B) ≤ num_blocks − 1`: the position of rank 0's local index
  `(num_blocks − 1) × B`, i.e. `(num_blocks − 1) × B × N` when I = B (`(num_blocks − 1) × B` without DCP).
- at `--context T` (default `max_position_embeddings`): `blocks_per_seq` = the sum over the KV groups of
  `spec.peak_blocks(T, min(T, 512), TokenShard(N, 0, I))`, the blocks one request of T tokens (prefilled 512
  tokens a step) holds at once on every rank, and `max_concurrent_seqs = (num_blocks − 1) // blocks_per_seq`.
- `baseline_dcp1`: the same layout without DCP (its own weights, budget and blocks), and `dcp_seqs_ratio`,
  `max_concurrent_seqs` over the baseline's. With `--dcp 1` the baseline is the plan itself.
`max_sliding_blocks_per_request` stays the bound without DCP; `blocks_per_seq` counts the DCP sliding blocks.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import TYPE_CHECKING, Any

from .config import GptOssConfig
from .kv.dcp import TokenShard
from .kv.spec import cdiv, get_kv_spec, group_kv_specs
from .engine_config import DEFAULT_MAX_PREFILL_TOKENS

# torch, the mesh and the weights' specs are imported where they are used: the command line builds this
# command's flags whatever the command, the DI proxy's included, which runs without torch
if TYPE_CHECKING:
    import torch

GIB = 1024**3
UINT32_OFFSET_LIMIT = 2**32
KV_ITEMSIZE = {"fp8": 1, "bf16": 2}
ACT_BYTES = 4                 # activations counted in fp32
DEFAULT_MAX_NUM_SEQS = 64     # EngineConfig.max_num_seqs
DEFAULT_PREFILL_CHUNK = DEFAULT_MAX_PREFILL_TOKENS   # prefill tokens a step, for `blocks_per_seq`

REQUIRED_KEYS = ("num_blocks", "kv_bytes", "kv_tokens", "bytes_per_block", "weight_bytes_per_rank",
                 "max_buffer_offset")


def check_layout(cfg: GptOssConfig, tp: int, dp: int, ep: int, dcp: int = 1) -> tuple[int, int]:
    """Validate the parallel layout -> (q heads, kv heads) per rank. Raises ValueError with the reason.

    The engine's checks (`build_layout`, with the messages a world would give: heads and experts divide over
    TP and EP, EP groups line up with TP groups, `dcp` divides tp and tp/dcp divides the kv heads)."""
    from .distributed.mesh import build_layout
    from .weights import Shard, local_heads
    build_layout(tp, dp, ep, None, cfg, dcp)                 # LayoutError (a ValueError) says why
    return local_heads(cfg, Shard(0, tp, 0, ep, dcp))


def weight_breakdown(cfg: GptOssConfig, *, tp: int = 1, ep: int = 1, dtype: torch.dtype | None = None,
                     dcp: int = 1) -> dict[str, int]:
    """Bytes of each weight stack one rank holds (MXFP4 experts as blocks + scales; with DCP the k/v rows of
    this rank's tp/dcp kv shard), non-expert weights in `dtype` (default bf16)."""
    import torch
    from .weights import Shard, build_stacked_weight_specs
    dtype = torch.bfloat16 if dtype is None else dtype
    layout = "mxfp4" if cfg.experts_mxfp4 else "bf16"
    specs = build_stacked_weight_specs(cfg, dtype, layout, Shard(0, tp, 0, ep, dcp))
    return {s.name: math.prod(s.shape) * torch.empty((), dtype=s.dtype).element_size() for s in specs}


def estimate_activation_bytes(cfg: GptOssConfig, *, tp: int = 1, ep: int = 1,
                              max_num_seqs: int = DEFAULT_MAX_NUM_SEQS, dcp: int = 1) -> int:
    """A floor for one decode step's live activations, fp32, `max_num_seqs` tokens.

    Per token: 8 hidden-size vectors (residual, norm outputs, attention and MoE outputs, collective
    buffers), this rank's fused qkv row, top_k expert `gate_up` rows (2·I each) and this rank's
    vocabulary shard of logits. Attention scores are not counted (the decode program streams them).
    """
    from .weights import Shard, local_heads
    nh, kv = local_heads(cfg, Shard(0, tp, 0, ep, dcp))
    per_token = (8 * cfg.hidden_size + (nh + 2 * kv) * cfg.head_dim
                 + cfg.num_experts_per_tok * 2 * cfg.intermediate_size + cdiv(cfg.vocab_size, tp))
    return max_num_seqs * per_token * ACT_BYTES


def plan_memory(cfg: GptOssConfig, *, tp: int = 1, dp: int = 1, ep: int = 1, block_size: int = 16,
                kv_dtype: str = "fp8", device_memory_gib: float | None = None, memory_utilization: float = 0.9,
                kv_budget_gib: float | None = None, activation_gib: float | None = None,
                max_num_seqs: int = DEFAULT_MAX_NUM_SEQS, dcp: int = 1, dcp_interleave: int | None = None,
                context: int | None = None, max_prefill_tokens: int = DEFAULT_PREFILL_CHUNK) -> dict[str, Any]:
    """The KV plan of one rank (see the module docstring). Raises ValueError on an impossible layout/budget.

    `dcp`: decode context parallel size; `dcp_interleave`: tokens per round-robin chunk (None: block_size);
    `context`: the sequence length of `blocks_per_seq` / `max_concurrent_seqs` (None: max_position_embeddings);
    `max_prefill_tokens`: the engine's prefill chunk (a sliding-window group holds a chunk and the window before it).
    """
    if not isinstance(max_prefill_tokens, int) or max_prefill_tokens <= 0:
        raise ValueError(f"--max-prefill-tokens must be a positive integer (got {max_prefill_tokens!r})")
    if kv_dtype not in KV_ITEMSIZE:
        raise ValueError(f"--kv-dtype must be one of {sorted(KV_ITEMSIZE)} (got {kv_dtype!r})")
    if not isinstance(block_size, int) or block_size <= 0 or (kv_dtype == "fp8" and block_size % 2):
        raise ValueError(f"--block-size must be a positive integer (even for packed fp8); got {block_size!r}")
    if (device_memory_gib is None) == (kv_budget_gib is None):
        raise ValueError("give exactly one of device_memory_gib (--device-memory-gib) and "
                         "kv_budget_gib (--kv-budget-gib)")
    if not 0.0 < memory_utilization <= 1.0:
        raise ValueError(f"--memory-utilization must be in (0, 1] (got {memory_utilization})")
    interleave = block_size if dcp_interleave is None else dcp_interleave
    if isinstance(interleave, bool) or not isinstance(interleave, int) or interleave < 1 or interleave % block_size:
        raise ValueError(f"--dcp-interleave {interleave!r} must be a positive multiple of --block-size {block_size} "
                         f"(a KV block holds the tokens of one DCP rank)")
    context = cfg.max_position_embeddings if context is None else context
    if isinstance(context, bool) or not isinstance(context, int) or context < 1:
        raise ValueError(f"--context must be a positive integer (got {context!r})")
    nh, kv = check_layout(cfg, tp, dp, ep, dcp)
    itemsize = KV_ITEMSIZE[kv_dtype]
    d, L = cfg.head_dim, cfg.num_hidden_layers

    # HMA grouping: group_size buffers, each shared by one layer per group.
    groups, buffers = group_kv_specs(get_kv_spec(cfg, block_size, itemsize, kv))
    group_size, num_groups = len(buffers), len(groups)

    breakdown = weight_breakdown(cfg, tp=tp, ep=ep, dcp=dcp)
    weight_bytes = sum(breakdown.values())
    if activation_gib is not None and not (math.isfinite(activation_gib) and activation_gib >= 0):
        raise ValueError(f"--activation-gib must be >= 0 and finite (got {activation_gib})")
    act_bytes = (round(activation_gib * GIB) if activation_gib is not None
                 else estimate_activation_bytes(cfg, tp=tp, ep=ep, max_num_seqs=max_num_seqs, dcp=dcp))

    device_bytes = None
    if kv_budget_gib is not None:
        if not (math.isfinite(kv_budget_gib) and kv_budget_gib > 0):
            raise ValueError(f"--kv-budget-gib must be > 0 and finite (got {kv_budget_gib})")
        budget = kv_budget_gib * GIB
    else:
        if not (math.isfinite(device_memory_gib) and device_memory_gib > 0):
            raise ValueError(f"--device-memory-gib must be > 0 and finite (got {device_memory_gib})")
        device_bytes = device_memory_gib * GIB
        usable = device_bytes * memory_utilization
        budget = usable - weight_bytes - act_bytes
        if budget <= 0:
            raise ValueError(
                f"memory budget too small: {device_memory_gib} GiB × {memory_utilization} = {usable / GIB:.3f} GiB "
                f"does not hold this rank's weights ({weight_bytes / GIB:.3f} GiB) and activations "
                f"({act_bytes / GIB:.3f} GiB); raise --device-memory-gib or --tp/--ep")

    per_buffer_half_elems = kv * block_size * d               # one block of one buffer's K (or V)
    bytes_per_block = group_size * 2 * per_buffer_half_elems * itemsize
    num_blocks = int(budget // bytes_per_block)
    if num_blocks < 2:
        raise ValueError(f"KV budget {budget / GIB:.4f} GiB holds {num_blocks} blocks of {bytes_per_block} B; "
                         f"need at least 2 (block 0 is the null block)")

    kv_bytes = num_blocks * bytes_per_block
    max_offset = num_blocks * per_buffer_half_elems
    offset_ok = max_offset < UINT32_OFFSET_LIMIT
    violations = [] if offset_ok else [
        f"one buffer half spans {max_offset} elements >= 2**32 (uint32 DMA offset); at most "
        f"{(UINT32_OFFSET_LIMIT - 1) // per_buffer_half_elems} blocks fit"]
    stacked_cap = (UINT32_OFFSET_LIMIT - 1) // (group_size * per_buffer_half_elems)
    stacked_all_cap = (UINT32_OFFSET_LIMIT - 1) // (L * per_buffer_half_elems)
    window = cfg.attention_window if any(cfg.is_sliding(i) for i in range(L)) else 0

    # DCP: this rank's share of every sequence; the blocks one sequence of `context` tokens holds at once.
    tokens = TokenShard(dcp, 0, interleave) if dcp > 1 else None
    shard0 = tokens or TokenShard()
    kv_context = shard0.position((num_blocks - 1) * block_size)   # largest T: cdiv(most(T), B) <= num_blocks - 1
    blocks_per_seq = sum(g.spec.peak_blocks(context, min(context, max_prefill_tokens), tokens) for g in groups)
    max_seqs = (num_blocks - 1) // blocks_per_seq
    dcp_numbers = {"kv_heads_per_rank": kv, "num_blocks": num_blocks, "kv_tokens_per_rank": num_blocks * block_size,
                   "blocks_per_seq": blocks_per_seq, "max_concurrent_seqs": max_seqs}
    if dcp > 1:
        base = plan_memory(cfg, tp=tp, dp=dp, ep=ep, block_size=block_size, kv_dtype=kv_dtype,
                           device_memory_gib=device_memory_gib, memory_utilization=memory_utilization,
                           kv_budget_gib=kv_budget_gib, activation_gib=activation_gib, max_num_seqs=max_num_seqs,
                           context=context, max_prefill_tokens=max_prefill_tokens)["baseline_dcp1"]
    else:
        base = dict(dcp_numbers)

    return {
        "num_layers": L,
        "group_size": group_size,
        "num_groups": num_groups,
        "tp": tp, "dp": dp, "ep": ep, "world_size": tp * dp,
        "q_heads_per_rank": nh,
        "kv_heads_per_rank": kv,
        "experts_per_rank": cfg.num_local_experts // ep,
        "experts_layout": "mxfp4" if cfg.experts_mxfp4 else "bf16",
        "head_dim": d,
        "block_size": block_size,
        "kv_dtype": kv_dtype,
        "kv_itemsize": itemsize,
        "sliding_window": window,
        "device_memory_bytes": None if device_bytes is None else int(device_bytes),
        "memory_utilization": None if device_bytes is None else memory_utilization,
        "weight_bytes_per_rank": weight_bytes,
        "weight_breakdown": breakdown,
        "activation_bytes": act_bytes,
        "kv_budget_bytes": int(budget),
        "bytes_per_block": bytes_per_block,
        "num_blocks": num_blocks,
        "usable_blocks": num_blocks - 1,
        "kv_bytes": kv_bytes,
        "kv_gib": kv_bytes / GIB,
        "kv_tokens": num_blocks * block_size,
        "kv_tokens_vllm_log": num_blocks // num_groups * block_size,
        "max_sliding_blocks_per_request": cdiv(window - 1, block_size) + 1 if window else 0,
        "max_buffer_offset": max_offset,
        "offset_limit": UINT32_OFFSET_LIMIT,
        "offset_ok": offset_ok,
        "violations": violations,
        "max_blocks_uint32": (UINT32_OFFSET_LIMIT - 1) // per_buffer_half_elems,
        "stacked_layout_cap_blocks": stacked_cap,
        "stacked_cap_ratio": num_blocks / stacked_cap if stacked_cap else None,
        "stacked_all_layers_cap_blocks": stacked_all_cap,
        "stacked_all_layers_cap_ratio": num_blocks / stacked_all_cap if stacked_all_cap else None,
        "dcp": dcp,
        "dcp_interleave": interleave,
        "kv_tokens_per_rank": num_blocks * block_size,
        "kv_context_tokens": kv_context,
        "context": context,
        "blocks_per_seq": blocks_per_seq,
        "max_concurrent_seqs": max_seqs,
        "baseline_dcp1": base,
        "dcp_seqs_ratio": max_seqs / base["max_concurrent_seqs"] if base["max_concurrent_seqs"] else None,
    }


# --------------------------------------------------------------------------------------------------
def _bytes(n: int | None) -> str:
    if n is None:
        return "-"
    return f"{n:,} B ({n / GIB:.3f} GiB)"


def format_plan(d: dict[str, Any]) -> str:
    """A human-readable table of a `plan_memory` result."""
    rows: list[tuple[str, str]] = [
        ("layout", f"TP{d['tp']} × DP{d['dp']} × EP{d['ep']} (world {d['world_size']})"),
        ("per rank", f"{d['q_heads_per_rank']} q heads, {d['kv_heads_per_rank']} kv heads, "
                     f"{d['experts_per_rank']} experts ({d['experts_layout']})"),
        ("KV buffers", f"{d['group_size']} buffers × {d['num_groups']} groups, block {d['block_size']}, "
                       f"head_dim {d['head_dim']}, {d['kv_dtype']}"),
        ("device memory", _bytes(d["device_memory_bytes"])
         + ("" if d["memory_utilization"] is None else f" × {d['memory_utilization']}")),
        ("weights / rank", _bytes(d["weight_bytes_per_rank"])),
        ("activations", _bytes(d["activation_bytes"])),
        ("KV budget", _bytes(d["kv_budget_bytes"])),
        ("bytes / block", f"{d['bytes_per_block']:,} B"),
        ("num_blocks", f"{d['num_blocks']:,} (null block 0 included)"),
        ("KV bytes", _bytes(d["kv_bytes"])),
        ("KV tokens", f"{d['kv_tokens']:,} of full-attention context "
                      f"(vLLM log convention: {d['kv_tokens_vllm_log']:,})"),
        ("sliding blocks", f"≤ {d['max_sliding_blocks_per_request']} per decoding request"),
        ("DCP", "1 (off: every rank holds every token)" if d["dcp"] == 1 else
                f"{d['dcp']} ranks per group, interleave {d['dcp_interleave']} tokens "
                f"(each rank holds 1/{d['dcp']} of every sequence)"),
        ("KV tokens / rank", f"{d['kv_tokens_per_rank']:,} (this rank's share); "
                             f"{d['kv_context_tokens']:,} tokens of one sequence's context per DCP group"),
        (f"at context {d['context']:,}", f"{d['blocks_per_seq']:,} blocks per sequence -> "
                                         f"{d['max_concurrent_seqs']:,} concurrent sequences"),
        ("max buffer offset", f"{d['max_buffer_offset']:,} elements "
                              f"({'ok' if d['offset_ok'] else 'VIOLATION'}: < 2**32; "
                              f"{d['max_blocks_uint32']:,} blocks fit)"),
        ("old stacked cap", f"{d['stacked_layout_cap_blocks']:,} blocks over {d['group_size']} buffers "
                            f"({d['stacked_cap_ratio']:.2f}×); {d['stacked_all_layers_cap_blocks']:,} over "
                            f"{d['num_layers']} layers ({d['stacked_all_layers_cap_ratio']:.2f}×)"),
    ]
    if d["dcp"] > 1:                     # after "at context T": the same layout and context without DCP
        b = d["baseline_dcp1"]
        ratio = "-" if d["dcp_seqs_ratio"] is None else f"{d['dcp_seqs_ratio']:.2f}×"
        at = next(i for i, (k, _) in enumerate(rows) if k.startswith("at context")) + 1
        rows.insert(at, (f"DCP {d['dcp']} vs 1", f"{ratio} seqs ({d['max_concurrent_seqs']:,} vs "
                                                 f"{b['max_concurrent_seqs']:,}; without DCP: {b['kv_heads_per_rank']} "
                                                 f"kv heads, {b['num_blocks']:,} blocks, {b['blocks_per_seq']:,} per "
                                                 f"sequence)"))
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    lines += [f"violation: {v}" for v in d["violations"]]
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
def add_plan_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """`plan (--model DIR | --preset NAME) [--tp N --dp N --ep N] [--dcp N [--dcp-interleave I]] [--context T]
    [--max-prefill-tokens N] [--block-size B] [--kv-dtype fp8|bf16] (--device-memory-gib G [--memory-utilization U] | --kv-budget-gib G)
    [--json]`."""
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", metavar="DIR", help="model directory (its config.json)")
    src.add_argument("--preset", metavar="NAME",
                     help="a make-checkpoint preset's config: tiny | small | 20b-shape | 120b-shape | demo")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    parser.add_argument("--dp", type=int, default=1, help="data-parallel size")
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel size")
    parser.add_argument("--dcp", type=int, default=1, metavar="N",
                        help="decode context parallel: ranks of a TP group that share kv heads and split every "
                             "sequence's tokens (divides --tp; tp/dcp must divide the kv heads)")
    parser.add_argument("--dcp-interleave", type=int, default=None, metavar="I",
                        help="DCP: tokens per round-robin chunk (default: --block-size; a multiple of it)")
    parser.add_argument("--context", type=int, default=None, metavar="T",
                        help="sequence length for blocks per sequence and concurrent sequences "
                             "(default: the model's max_position_embeddings)")
    parser.add_argument("--max-prefill-tokens", "--max-num-batched-tokens", dest="max_prefill_tokens", type=int,
                        default=DEFAULT_PREFILL_CHUNK,
                        help=f"the engine's prefill chunk, for the blocks a sliding-window layer holds "
                             f"(default {DEFAULT_PREFILL_CHUNK}, the engine's)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    parser.add_argument("--kv-dtype", choices=sorted(KV_ITEMSIZE), default="fp8", help="KV storage dtype (default fp8)")
    mem = parser.add_mutually_exclusive_group(required=True)
    mem.add_argument("--device-memory-gib", type=float, metavar="G", help="device memory per rank, GiB")
    mem.add_argument("--kv-budget-gib", type=float, metavar="G", help="KV budget per rank, GiB (used as is)")
    parser.add_argument("--memory-utilization", type=float, default=None, metavar="U",
                        help="fraction of --device-memory-gib to use (default 0.9)")
    parser.add_argument("--activation-gib", type=float, default=None, metavar="G",
                        help="activation memory per rank (default: a floor, one decode step of 64 sequences in fp32)")
    parser.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    return parser


def run_plan(args: argparse.Namespace) -> int:
    """Run `gigadecode plan`; prints the plan (or `gigadecode plan: error: …` on stderr, exit 2)."""
    from .checkpoint import preset_config

    try:
        if args.memory_utilization is not None and args.kv_budget_gib is not None:
            raise ValueError("--memory-utilization applies to --device-memory-gib, not --kv-budget-gib")
        cfg = preset_config(args.preset) if args.preset else GptOssConfig.from_hf(args.model)
        plan = plan_memory(cfg, tp=args.tp, dp=args.dp, ep=args.ep, block_size=args.block_size,
                           kv_dtype=args.kv_dtype, device_memory_gib=args.device_memory_gib,
                           memory_utilization=0.9 if args.memory_utilization is None else args.memory_utilization,
                           kv_budget_gib=args.kv_budget_gib, activation_gib=args.activation_gib,
                           dcp=args.dcp, dcp_interleave=args.dcp_interleave, context=args.context,
                           max_prefill_tokens=args.max_prefill_tokens)
    except ValueError as e:
        print(f"gigadecode plan: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(plan) if args.json else format_plan(plan))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = add_plan_arguments(argparse.ArgumentParser(prog="gigadecode plan", description="KV memory plan"))
    return run_plan(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
