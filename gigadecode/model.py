"""The per-layer GPT-OSS model (the seed's "native per-layer model"): the prefill role and the oracle.

It runs a flat batch of sequence chunks (prefill chunks and single-token decodes alike) layer by layer:
attention writes the chunk's K/V into the paged cache through the layer's group block table (bf16: RoPE and the
write in the native kernel the decode step uses, so both leave the same bytes), then
reads back the keys it may see (sliding layers only the window, `q - W < k <= q`) and attends with
sinks, flash style (bf16: the native `prefill_attention` kernel; otherwise `ops.flash_sink_attention`:
tiled online softmax, GQA without repeated K/V, fully masked key tiles skipped); MoE reads only the experts
the tokens hit (bf16 MXFP4: the grouped native kernel). Weights are views `stack[i]` of the stacks
that `weights.load_weights` filled, so this model and the GK program share one copy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from . import native
from .config import GptOssConfig
from .distributed.context import ParallelContext
from .kv.cache import KVCache
from .ops import flash_sink_attention, moe_tokens, rms_norm, swiglu
from .rope import Rope, apply_rope
from .routed_moe import native_routed_moe
from .weights import ModelWeights



MOE_SLICE = 1024      # tokens per native MoE call (its scratch is ~4 (2I + I/2 + H) bytes per token and slot)


@dataclass
class SeqChunk:
    """One sequence's tokens in a forward pass: positions [start, start + len(token_ids))."""

    token_ids: list[int]
    start: int
    block_tables: list[list[int]]     # per KV group: block ids for blocks 0..; 0 = null (freed / none)
    want_logits: Literal["last", "all", "none"] = "last"


@dataclass
class ForwardOutput:
    logits: list[torch.Tensor] = field(default_factory=list)   # per chunk: [1 or T, V] (or empty)


class GptOssModel:
    """Per-layer reference model over `ModelWeights` and a `KVCache`.

    `parallel` (this rank's `ParallelContext`, None = one rank, no collectives): the weights are
    this rank's shard; attention runs the local heads and all-reduces the o-proj over TP, the MoE runs the
    local experts and sums over EP, and the logits are this rank's vocabulary columns
    `[vocab_start, vocab_stop)` (use `parallel.greedy` / `parallel.gather_logits`)."""

    def __init__(self, cfg: GptOssConfig, weights: ModelWeights, dtype: torch.dtype,
                 parallel: ParallelContext | None = None) -> None:
        self.cfg, self.w, self.dtype = cfg, weights, dtype
        self.parallel = parallel
        self.rope = Rope(cfg, dtype)
        self.scale = cfg.head_dim ** -0.5
        nh, d = weights.layers[0].sinks.shape[0], cfg.head_dim
        self.num_heads = nh
        self.num_kv_heads = (weights.layers[0].qkv_w.shape[0] // d - nh) // 2
        self._transients: dict[tuple, torch.Tensor] = {}
        # fp32 (the exact mode) runs transformers' own torch ops; bf16 (serving) the fused native kernels,
        # whose fp32 math rounds once where torch rounds each bf16 op
        fused = dtype != torch.float32
        self._norm = native.rms_norm if fused else rms_norm
        self._swiglu = native.swiglu if fused else swiglu
        # bf16 MXFP4 experts: the grouped kernel (rows decoded once per strip into cache, fused gather, SwiGLU
        # and gate-weighted sum), ~1.05-1.15x the decode-then-oneDNN path at 512 tokens, ~3x at decode sizes
        self._native_moe = fused and weights.mxfp4 and native.available()
        # bf16 attention over the gathered keys on the native flash kernel (fp32 softmax; bf16 pair products
        # where the CPU has `vdpbf16ps`, fp32 products elsewhere)
        self._native_attention = fused and native.prefill_attention_supported(dtype, cfg.head_dim)

    # ----------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, chunks: list[SeqChunk], kv: KVCache) -> ForwardOutput:
        cfg, w, par = self.cfg, self.w, self.parallel
        ids = torch.tensor([t for c in chunks for t in c.token_ids], dtype=torch.long)
        pos = (torch.cat([torch.arange(c.start, c.start + len(c.token_ids)) for c in chunks]) if chunks
               else torch.zeros(0, dtype=torch.long))     # a DP group with no work still joins the collectives
        cos, sin = self.rope.cos_sin(pos)
        x = w.embed[ids]                                                     # [N, H]
        counts = par.ep_token_counts(x.shape[0]) if par is not None else None
        lm_head = w.lm_head if par is None else w.lm_head[: par.vocab_len]  # real vocabulary rows only
        B, groups = kv.block_size, kv.config.layer_group                   # each token's KV slot, per group
        slots = {g: torch.tensor([c.block_tables[g][p // B] * B + p % B for c in chunks
                                  for p in range(c.start, c.start + len(c.token_ids))], dtype=torch.long)
                 for g in set(groups)} if par is None or par.dcp_size == 1 else {}   # DCP: its own, local
        for layer, lw in enumerate(w.layers):
            h = self._norm(x, lw.input_norm, cfg.rms_norm_eps)
            x = x + self.attention(layer, h, cos, sin, chunks, kv, slots.get(groups[layer]))
            h = self._norm(x, lw.post_norm, cfg.rms_norm_eps)
            x = x + self.moe(layer, h, counts)
        x = self._norm(x, w.norm, cfg.rms_norm_eps)
        out, off = ForwardOutput(), 0
        for c in chunks:
            n = len(c.token_ids)
            if c.want_logits == "all":
                out.logits.append(native.projection(x[off: off + n], lm_head))
            elif c.want_logits == "last":
                out.logits.append(native.projection(x[off + n - 1: off + n], lm_head))
            else:
                out.logits.append(torch.empty(0))
            off += n
        return out

    def moe(self, layer: int, h: torch.Tensor, counts: list[int] | None = None) -> torch.Tensor:
        cfg, lw, par = self.cfg, self.w.layers[layer], self.parallel
        offset = par.expert_offset if par is not None else 0
        if self._native_moe:
            def local(t: torch.Tensor) -> torch.Tensor:
                return native_routed_moe(t, lw, cfg.num_experts_per_tok, cfg.swiglu_alpha, cfg.swiglu_limit,
                                         offset, router_linear=native.projection, max_tokens=MOE_SLICE)
        else:
            def local(t: torch.Tensor) -> torch.Tensor:    # each hit expert decoded once per chunk (exact)
                return moe_tokens(t, lw, cfg.num_experts_per_tok, cfg.swiglu_alpha, cfg.swiglu_limit, offset,
                                  decode=self._expert_transients, act=self._swiglu)
        return local(h) if par is None else par.ep_moe(h, local, counts)

    def _expert_transients(self, blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """One expert matrix decoded into this model's reused transient of its shape: an expert's w1 [2I, H]
        and w2 [H, I] never share a shape, and each is consumed by its GEMM before the next expert is decoded.
        Reuse keeps the transient in cache (a fresh one per expert costs page faults and DRAM writes)."""
        shape = (*scales.shape[:-1], scales.shape[-1] * 32)
        buf = self._transients.get((shape, dtype))
        if buf is None:
            buf = self._transients[(shape, dtype)] = torch.empty(shape, dtype=dtype)
        return native.mxfp4_dequant_into(blocks, scales, buf)

    # ----------------------------------------------------------------------------------------------
    def attention(self, layer: int, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  chunks: list[SeqChunk], kv: KVCache, slots: torch.Tensor | None) -> torch.Tensor:
        """h [N, H] -> [N, H]. `slots` [N]: each token's KV slot in this layer's group, the chunks' tokens in
        order (None under DCP, whose ranks hold their own tokens' slots)."""
        cfg, lw, d = self.cfg, self.w.layers[layer], self.cfg.head_dim
        nh, nkv = self.num_heads, self.num_kv_heads
        qkv = native.projection(h, lw.qkv_w, lw.qkv_b)        # [N, (nh + 2 nkv) d]
        group = kv.config.layer_group[layer]
        window = cfg.attention_window if cfg.is_sliding(layer) else None
        B = kv.block_size
        dcp = self.parallel is not None and self.parallel.dcp_size > 1
        kb, vb = kv.layer_kv(layer)
        if self._native_attention and not dcp:
            # RoPE and the K/V write in one call, the decode step's kernel (fp32 math, rounded once into the
            # cache), so prefill and decode leave the same bytes for the same K/V
            q = native.rope_kv_write(qkv, cos, sin, kb, vb, slots, nh, kv.k_scale, kv.v_scale).to(qkv.dtype)
            k = v = None                                                     # [N, nh, d] q; K/V in the cache
        else:
            q = apply_rope(qkv[:, : nh * d].view(-1, nh, d), cos, sin)
            k = apply_rope(qkv[:, nh * d: (nh + nkv) * d].view(-1, nkv, d), cos, sin)
            v = qkv[:, (nh + nkv) * d:].view(-1, nkv, d)
        if dcp:
            a = self._dcp_attention(layer, q, k, v, chunks, kv, group, window)
            return self.parallel.row_parallel_linear(a, lw.o_w, lw.o_b, native.projection)
        rep = nh // nkv                                                      # local heads (TP shard)
        outs, off = [], 0
        for c in chunks:
            n = len(c.token_ids)
            table = c.block_tables[group]
            qpos = torch.arange(c.start, c.start + n)
            if k is not None:
                kv.write(layer, slots[off: off + n], k[off: off + n], v[off: off + n])
            lo = max(0, c.start - window + 1) if window else 0
            b0, b1 = lo // B, (c.start + n - 1) // B
            ids = torch.tensor(table[b0: b1 + 1], dtype=torch.long)
            if self._native_attention:                                      # keys, values [S, nkv, d]
                keys, vals = native.kv_gather(kb, vb, ids, kv.k_scale, kv.v_scale, kv.compute_dtype)
                o = native.prefill_attention(q[off: off + n], keys, vals, qpos, b0 * B, lw.sinks, self.scale,
                                             window or 0)
            else:
                keys, vals = kv.gather(layer, ids)
                o = flash_sink_attention(q[off: off + n], keys, vals, qpos, torch.arange(b0 * B, (b1 + 1) * B),
                                         lw.sinks, self.scale, window or None,
                                         tile=max(256, 2**16 // (rep * min(n, 128))), q_tile=128)
            outs.append(o.reshape(n, nh * d))                                # [n, nh d]
            off += n
        a = torch.cat(outs) if outs else h.new_zeros(0, nh * d)
        if self.parallel is not None:
            return self.parallel.row_parallel_linear(a, lw.o_w, lw.o_b, native.projection)
        return native.projection(a, lw.o_w, lw.o_b)

    def _dcp_attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       chunks: list[SeqChunk], kv: KVCache, group: int, window: int | None) -> torch.Tensor:
        """Attention on a DCP rank (`parallel.dcp_size > 1`): q [N, nh, d] this rank's heads, k, v [N, nkv, d]
        every token's K/V -> [N, nh*d]. Writes only the tokens this rank holds (local slots), attends with
        every q head of its DCP group over its own tokens (no sink: partial output and LSE, key positions
        from the local indices) and merges the group's partials (`ParallelContext.dcp_merge`)."""
        par, B, d = self.parallel, kv.block_size, self.cfg.head_dim
        tokens = par.tokens
        qg = par.dcp_gather_heads(q)                                         # [N, dcp·nh, d]
        hg = qg.shape[1]
        outs, lses, off = [], [], 0
        for c in chunks:
            n = len(c.token_ids)
            table = c.block_tables[group]
            mine = [i for i in range(n) if tokens.owns(c.start + i)]
            if mine:
                li = [tokens.local_index(c.start + i) for i in mine]
                slots = torch.tensor([table[x // B] * B + x % B for x in li], dtype=torch.long)
                sel = torch.tensor(mine, dtype=torch.long) + off
                kv.write(layer, slots, k[sel], v[sel])
            first = tokens.count(max(0, c.start - window + 1)) if window else 0
            last = tokens.count(c.start + n) - 1                             # local range any query sees
            if last < first:
                outs.append(qg.new_zeros(n, hg, d, dtype=torch.float32))
                lses.append(torch.full((n, hg), float("-inf")))
            else:
                b0, b1 = first // B, last // B
                keys, vals = kv.gather(layer, torch.tensor(table[b0: b1 + 1], dtype=torch.long))
                kpos = tokens.positions(torch.arange(b0 * B, (b1 + 1) * B))
                o, lse = flash_sink_attention(qg[off: off + n], keys, vals, torch.arange(c.start, c.start + n), kpos,
                                              None, self.scale, window, q_tile=128)
                outs.append(o)
                lses.append(lse)
            off += n
        o = torch.cat(outs) if outs else qg.new_zeros(0, hg, d, dtype=torch.float32)
        lse = torch.cat(lses) if lses else torch.zeros(0, hg)
        a = par.dcp_merge(o, lse, self.w.layers[layer].sinks)                      # [N, nh, d] fp32 (collective)
        return a.flatten(1).to(q.dtype)                                               # [N, nh·d] (N may be 0)
