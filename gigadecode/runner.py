"""The model runner: weights (stacked once), the KV cache, and the two programs that use them.

Prefill chunks run through the per-layer model; decode steps run through the decoder the factory picks
(`gk_decode`: the GK program, eager or compiled; else the per-layer model one token at a time). The
runner owns `initialize_kv_cache` (one allocation per HMA buffer, bound to the GK model per buffer),
pads decode batches to the program's batch buckets, and turns logits into tokens (`sample`).

With `parallel` (a `ParallelContext`, one rank of a TP × DP × EP layout) the runner holds this rank's
shard, its programs carry the collectives, and its logits are this rank's vocabulary columns. Every rank
of a DP group runs the same engine steps (the engine is replicated, see `parallel/engine.py`); what the
ranks of an EP group that spans several DP groups must also agree on — whether this step runs a
prefill forward and how many decode rows it pads to — is settled by `agree_step` (one small all-reduce).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from . import native
from .config import ConfigError, GptOssConfig
from .distributed.context import ParallelContext
from .engine_config import EngineConfig
from .gk.attn_control import build_attention_control
from .gk.model import GptOssGKDecodeModel
from .kv.cache import KVCache
from .kv.dcp import TokenShard
from .kv.spec import SlidingWindowSpec, get_kv_spec, make_kv_cache_config
from .model import GptOssModel, SeqChunk
from .sampling import Sampler, SampleResult, SamplingParams, argmax_failures
from .weights import ModelWeights, Shard, load_weights


DEFAULT_KV_BUDGET_GIB = 2.0


@dataclass
class DecodeSeq:
    """One sequence's decode: its last token at `position`, and speculative drafts at the positions after it."""

    token_id: int
    position: int
    block_tables: list[list[int]]
    drafts: tuple[int, ...] = ()

    @property
    def rows(self) -> list[tuple[int, int]]:
        """(token, position) of each logit row this sequence takes."""
        return [(t, self.position + j) for j, t in enumerate((self.token_id, *self.drafts))]


class Decoder(Protocol):
    """A decode path: `seqs` -> the logits of their rows [sum(len(s.rows)), V] (one row per token: the last
    one and each draft; a draft's row sees the KV of the rows before it, as if they had been decoded one by
    one)."""

    def decode_batch(self, seqs: list[DecodeSeq], kv: KVCache, pad_to: int = 0) -> torch.Tensor: ...


class ReferenceDecoder:
    """The non-GK decode path: the per-layer model, one chunk per sequence (its token and drafts)."""

    def __init__(self, model: GptOssModel) -> None:
        self.model = model

    def decode_batch(self, seqs: list[DecodeSeq], kv: KVCache, pad_to: int = 0) -> torch.Tensor:
        """(`pad_to` is ignored: the per-layer model exchanges token counts itself.)"""
        out = self.model.forward([SeqChunk([s.token_id, *s.drafts], s.position, s.block_tables,
                                           "all" if s.drafts else "last") for s in seqs], kv)
        return torch.cat(out.logits) if seqs else torch.empty(0)


class GKDecoder:
    """The GK path: builds the attention control once per step and runs the whole stack in one call."""

    def __init__(self, gk: GptOssGKDecodeModel, model: GptOssModel, ecfg: EngineConfig, window: int) -> None:
        self.gk, self.rope, self.ecfg, self.window = gk, model.rope, ecfg, window
        self.tokens = gk.parallel.tokens if gk.parallel is not None else None    # DCP: local frames
        self.group_sliding = [isinstance(g.spec, SlidingWindowSpec) for g in gk.kv_config.groups]

    def decode_batch(self, seqs: list[DecodeSeq], kv: KVCache, pad_to: int = 0) -> torch.Tensor:
        """-> logits of `seqs`. The batch runs as calls of at most the biggest bucket, each padded to its
        bucket; `pad_to` > len(seqs) pads as if there were `pad_to` rows (the same calls and buckets on
        every DP group of an EP group, so their collectives line up). The native program compiles nothing
        per shape, so it runs each call at its exact row count: a padded row would cost a real row's attention
        and route to experts of its own (batch 5 padded to 8 took 1.36× the time of 5 rows on `small`)."""
        outs = []
        biggest = self.ecfg.batch_buckets[-1]
        flat = [(t, p, s.block_tables) for s in seqs for t, p in s.rows]     # a sequence's drafts: rows in order
        rows = max(len(flat), pad_to)
        for s0 in range(0, rows, biggest):
            part = flat[s0: s0 + biggest]
            n = min(biggest, rows - s0)
            bucket = n if self.gk.native else next(b for b in self.ecfg.batch_buckets if b >= n)
            ctl = build_attention_control([p for _, p, _ in part], [tb for _, _, tb in part],
                                          self.group_sliding, self.rope, self.ecfg.block_size, self.window,
                                          batch_bucket=bucket, tokens=self.tokens)
            ids = torch.zeros(bucket, dtype=torch.long)
            ids[: len(part)] = torch.tensor([t for t, _, _ in part], dtype=torch.long)
            outs.append(self.gk.decode(ids, ctl)[: len(part)])
        return torch.cat(outs) if outs else torch.empty(0)


def build_decoder(cfg: GptOssConfig, weights: ModelWeights, model: GptOssModel, kv: KVCache, ecfg: EngineConfig,
                  parallel: ParallelContext | None = None) -> Decoder:
    """The factory gate: the GK model when `gk_decode`, the per-layer model otherwise (untouched)."""
    if not ecfg.gk_decode or ecfg.decoder == "reference":
        return ReferenceDecoder(model)
    gk = GptOssGKDecodeModel(cfg, weights, kv.config, ecfg.block_size, kv.k_scale, kv.v_scale,
                             compiled=ecfg.decoder == "gk-compiled", parallel=parallel,
                             native=ecfg.decoder == "gk-native")
    gk.bind_kv_cache(kv.bind_map())
    return GKDecoder(gk, model, ecfg, cfg.attention_window)


def default_num_blocks(cfg: GptOssConfig, ecfg: EngineConfig, num_kv_heads: int, max_model_len: int) -> int:
    """Enough for max_num_seqs full-length sequences, capped by the KV memory budget; + the null block; +
    what a sliding group holds beyond its window while a prefill chunk runs, so that one request alone can
    reach `max_model_len` (the engine's `fits_pool`)."""
    itemsize = torch.empty((), dtype=ecfg.kv_storage_dtype()).element_size()
    specs = get_kv_spec(cfg, ecfg.block_size, itemsize, num_kv_heads)
    kvc = make_kv_cache_config(specs, 1)
    n_buffers = kvc.group_size
    bytes_per_block = n_buffers * 2 * num_kv_heads * ecfg.block_size * cfg.head_dim * itemsize
    budget = (ecfg.kv_budget_gib or DEFAULT_KV_BUDGET_GIB) * 1024**3
    per_seq = sum(g.spec.max_blocks(max_model_len) for g in kvc.groups)
    chunk = min(ecfg.max_prefill_tokens, max_model_len)     # a step prefills at most this many tokens in all
    peak = sum(g.spec.peak_blocks(max_model_len, chunk) for g in kvc.groups)
    want = ecfg.max_num_seqs * per_seq + max(0, peak - per_seq) + 1
    return max(2, min(want, int(budget // bytes_per_block)))


def context_length(cfg: GptOssConfig, ecfg: EngineConfig) -> int:
    """The positions one request may use: `--max-model-len`, at most the model's max_position_embeddings."""
    n, most = ecfg.max_model_len, cfg.max_position_embeddings
    if n is None:
        return most
    if n > most:
        raise ConfigError(f"--max-model-len {n} is longer than the model's context: config.json has "
                          f"max_position_embeddings={most}")
    return n


class ModelRunner:
    def __init__(self, model_dir: str | Path, ecfg: EngineConfig, cfg: GptOssConfig | None = None,
                 weights: ModelWeights | None = None, progress: bool = False,
                 parallel: ParallelContext | None = None) -> None:
        self.model_dir = Path(model_dir)
        self.cfg = cfg or GptOssConfig.from_hf(self.model_dir)
        self.ecfg = ecfg
        self.max_model_len = context_length(self.cfg, ecfg)   # before the weights load: a bad flag fails fast
        self.dtype = ecfg.torch_dtype
        if ecfg.threads is not None:
            torch.set_num_threads(ecfg.threads)
        native.load()                     # build (once per machine) or load the kernels now, not on a request
        self.parallel = parallel          # None: one rank
        shard = parallel.shard if parallel is not None else Shard()
        self.weights = weights or load_weights(self.model_dir, self.cfg, self.dtype, shard, progress=progress)
        self.cfg = self.weights.cfg                       # as loaded (an lm_head in the files unties it)
        self.model = GptOssModel(self.cfg, self.weights, self.dtype, parallel=parallel)
        self.kv = self.initialize_kv_cache()
        self.decoder = build_decoder(self.cfg, self.weights, self.model, self.kv, ecfg, parallel)

    def initialize_kv_cache(self) -> KVCache:
        nkv = self.model.num_kv_heads
        n = self.ecfg.num_blocks or default_num_blocks(self.cfg, self.ecfg, nkv, self.max_model_len)
        return KVCache(self.cfg, self.ecfg, n, nkv)

    @property
    def block_size(self) -> int:
        return self.ecfg.block_size

    @property
    def tokens(self) -> TokenShard:
        """Which tokens of each sequence this rank's KV holds (decode context parallel; all without it)."""
        return self.parallel.tokens if self.parallel is not None else TokenShard()

    def agree_step(self, num_prefill_chunks: int, num_decodes: int) -> tuple[bool, int]:
        """-> (run a prefill forward this step, decode rows to pad to). One rank: what it has. An EP group
        that spans DP groups: the maximum over the group, so every member makes the same model calls."""
        par = self.parallel
        if par is None or par.layout.ep_span == 1:
            return num_prefill_chunks > 0, num_decodes
        prefill, rows = par.agree_max([int(num_prefill_chunks > 0), num_decodes])
        return bool(prefill), rows

    def prefill(self, chunks: list[SeqChunk]) -> list[torch.Tensor]:
        """Run prompt chunks through the per-layer model -> per chunk the logits it asked for
        ([1, V] for want_logits="last", empty for "none"). With `parallel` an empty list still runs (it
        joins the EP collectives) and the logits are this rank's vocabulary columns."""
        if not chunks and self.parallel is None:
            return []
        return self.model.forward(chunks, self.kv).logits

    def decode(self, seqs: list[DecodeSeq], pad_to: int = 0) -> torch.Tensor:
        """-> logits [rows, V], a row per token of each sequence (with `parallel`: [rows, this rank's vocab
        columns]); `pad_to` counts rows."""
        if not seqs and (self.parallel is None or pad_to == 0):
            return torch.empty(0)
        return self.decoder.decode_batch(seqs, self.kv, pad_to)

    def full_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits [R, this rank's vocab columns] -> [R, V] (gathered over TP: every TP rank calls it together,
        as they run the same steps); one rank: as they are."""
        return logits if self.parallel is None else self.parallel.gather_logits(logits)

    def sample(self, sampler: Sampler, logits: torch.Tensor, params: list[SamplingParams],
               generators: list, histories: list[list[int]], outputs: list[list[int]],
               allowed: list | None = None) -> SampleResult:
        """Logits [B, V] (this rank's columns with `parallel`) -> one token per row. With `parallel`, a batch
        of plain greedy rows takes the distributed argmax (per-rank (value, index), reduced over TP); any
        other batch gathers the full logits over TP and samples them like one rank (every TP rank draws
        the same tokens: same logits, same per-request generators)."""
        par = self.parallel
        if par is not None:
            if not any(a is not None for a in allowed or ()) and all(
                    p.takes_raw_argmax(len(o)) for p, o in zip(params, outputs)):
                ids, best = par.greedy_with_values(logits)
                return SampleResult(ids, failed=argmax_failures(best))
            logits = par.gather_logits(logits)
        return sampler.sample(logits.float(), params, generators, histories, outputs, allowed)
