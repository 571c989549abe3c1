"""The giga-kernel: `gpt_oss_decode_mega_kernel` runs every layer of one decode step in one call.

Inputs per step: token ids, the weights stacked once on a leading `[L, …]` axis (indexed `W[i]`),
the KV cache as per-buffer K/V tensors (`K_i`, `V_i`; K packed-FP8 `[nb, kv, B/2, d, 2]` or plain
`[nb, kv, B, d]`) or the legacy stacked `K_cache`/`V_cache` (exactly one form), and the step's
`AttentionControl`. Layer i picks its table, write index and position frame by its kind (the seed's
`i % 2`: sliding or full) and its KV buffer by `layer_buffer[i]` (the seed's `i // 2`).
MoE decodes only the experts the batch selected, each once per step for all of its tokens (one expert's
dense transient at a time); the compiled form fuses the MXFP4 decode into the dot product instead.

Everything static (layer pattern, sizes, scales) is in `KernelSpec`, so the same function is the eager
reference and, through `torch.compile(fullgraph=True)`, the compiled program (weights and KV stay inputs).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..distributed.context import ParallelContext
from ..mxfp4 import _luts
from ..kv.cache import write_kv
from ..native.twins import decode_attention, paged_decode_attention_partial
from ..ops import dense_expert, moe_routed, rms_norm, route, swiglu
from ..rope import apply_rope
from ..weights import LayerWeights
from .attn_control import AttentionControl


FP8 = torch.float8_e4m3fn


@dataclass(frozen=True)
class KernelSpec:
    num_layers: int
    num_heads: int                      # q heads on this rank
    num_kv_heads: int                   # kv heads on this rank
    head_dim: int
    window: int
    eps: float
    top_k: int
    alpha: float
    limit: float
    block_size: int
    layer_sliding: tuple[bool, ...]     # kind of layer i (the seed's i % 2)
    layer_kind_group: tuple[int, ...]   # index of layer i's group among groups of its kind
    layer_buffer: tuple[int, ...]       # KV buffer of layer i (the seed's i // 2)
    k_scale: float = 1.0
    v_scale: float = 1.0
    mxfp4: bool = True
    packed_k: bool = False              # K buffers use the packed view (a buffer passed whole is split by it)
    fused_moe: bool = False             # compiled form: decode-and-dot as one reduction (Inductor fuses it)

    @property
    def scale(self) -> float:
        return self.head_dim ** -0.5


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == FP8 else t


def _store(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    if dtype == FP8:
        return _u8((x.float() / scale).clamp(-448.0, 448.0).to(FP8))
    return x.to(dtype)


def _load(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    if x.dtype == FP8:
        y = x.float()
        return (y * scale).to(dtype) if scale != 1.0 else y.to(dtype)
    return x.to(dtype)


@torch.library.custom_op("gigadecode::write_gather_kv", mutates_args=("k_buf", "v_buf"))
def write_gather_kv(k_buf: torch.Tensor, v_buf: torch.Tensor, blk: torch.Tensor, off: torch.Tensor,
                    kq: torch.Tensor, vq: torch.Tensor, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Write one token per batch slot — k_buf[blk, :, off], v_buf[blk, :, off] = kq, vq (already in storage
    form; packed K: token 2p+s at [.., p, j, s]) — then gather the blocks of `table` [Bt, n] -> raw K
    [Bt, n, kv, B/2, d, 2] (or [Bt, n, kv, B, d]) and V [Bt, n, kv, B, d].

    One op of its own, write and read together, so a compiled program updates the KV in place: an indexed
    store into a graph input is otherwise functionalized into a copy of the whole buffer, and the two layers
    sharing a buffer (write, read, write, read) defeat Inductor's re-inplacing — a step would cost
    O(KV pool size) instead of O(its tokens)."""
    if k_buf.dim() == v_buf.dim() + 1:
        _u8(k_buf)[blk, :, off // 2, :, off % 2] = kq
    else:
        _u8(k_buf)[blk, :, off, :] = kq
    _u8(v_buf)[blk, :, off, :] = vq
    return k_buf[table], v_buf[table]


@write_gather_kv.register_fake
def _write_gather_kv_fake(k_buf, v_buf, blk, off, kq, vq, table):
    return (k_buf.new_empty((*table.shape, *k_buf.shape[1:])), v_buf.new_empty((*table.shape, *v_buf.shape[1:])))


def split_kv_buffer(buf: torch.Tensor, packed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One HMA buffer's allocation [2, nb, kv, B, d] -> (K: packed [nb, kv, B/2, d, 2] or [nb, kv, B, d], V)."""
    k = buf[0]
    if packed:
        nb, kvh, B, d = k.shape
        k = k.view(nb, kvh, B // 2, d, 2)
    return k, buf[1]


@torch.library.custom_op("gigadecode::write_gather_kv_buffer", mutates_args=("buf",))
def write_gather_kv_buffer(buf: torch.Tensor, packed: bool, blk: torch.Tensor, off: torch.Tensor, kq: torch.Tensor,
                           vq: torch.Tensor, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`write_gather_kv` on a buffer's whole allocation [2, nb, kv, B, d] (K and V are views of one tensor:
    given as two graph inputs they alias, which makes a compiled program copy them)."""
    return write_gather_kv(*split_kv_buffer(buf, packed), blk, off, kq, vq, table)


@write_gather_kv_buffer.register_fake
def _write_gather_kv_buffer_fake(buf, packed, blk, off, kq, vq, table):
    k, v = split_kv_buffer(buf, packed)
    return k.new_empty((*table.shape, *k.shape[1:])), v.new_empty((*table.shape, *v.shape[1:]))


def write_read_kv(kv: torch.Tensor | tuple[torch.Tensor, torch.Tensor], slot: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor, table: torch.Tensor, dtype: torch.dtype, spec: KernelSpec
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Write the step's token per batch slot (slot [Bt]; k, v [Bt, kv, d]) into the layer's KV — its buffer's
    allocation [2, nb, kv, B, d], or a (K, V) pair — then read the layer's table [Bt, n] -> k, v
    [Bt, kv, n*B, d] of `dtype` (token-major, frame position = column)."""
    B = spec.block_size
    if isinstance(kv, torch.Tensor):
        sd = kv.dtype
        kq, vq = _store(k, sd, spec.k_scale), _store(v, sd, spec.v_scale)
        kb, vb = write_gather_kv_buffer(kv, spec.packed_k, slot // B, slot % B, kq, vq, table)
    else:
        kq, vq = _store(k, kv[0].dtype, spec.k_scale), _store(v, kv[1].dtype, spec.v_scale)
        kb, vb = write_gather_kv(kv[0], kv[1], slot // B, slot % B, kq, vq, table)
    bt, n = table.shape                                # kb [Bt, n, kv, B/2, d, 2] or [Bt, n, kv, B, d]
    if kb.dim() == vb.dim() + 1:
        kb = kb.transpose(-1, -2)                      # [Bt, n, kv, B/2, 2, d]
    k = _load(kb, dtype, spec.k_scale).reshape(bt, n, spec.num_kv_heads, B, spec.head_dim)
    v = _load(vb, dtype, spec.v_scale)
    k = k.permute(0, 2, 1, 3, 4).reshape(bt, spec.num_kv_heads, n * B, spec.head_dim)
    v = v.permute(0, 2, 1, 3, 4).reshape(bt, spec.num_kv_heads, n * B, spec.head_dim)
    return k, v


def moe_decode(h: torch.Tensor, Wl: LayerWeights, spec: KernelSpec, expert_offset: int = 0
               ) -> torch.Tensor:
    """The eager form's MoE of one layer: h [Bt, H] -> [Bt, H]. Only the experts
    the batch selected are decoded, each once for all of its tokens (`ops.moe_routed`). With expert
    parallelism the stacks hold the experts from global id `expert_offset` on and the result is this rank's
    partial sum (pairs routed elsewhere cost nothing).

    Rounded where the native kernels round (`native.twins`), not after every torch op: MXFP4 experts as
    `moe_mxfp4` (decoded into fp32, both products, the SwiGLU and the gate-weighted sum in fp32, only the
    activations between the two products rounded to h's dtype, the result rounded once); dense experts as the
    per-layer model's (products in h's dtype, the SwiGLU in fp32 rounded once). In fp32 every cast is a no-op."""
    idx, gate_w = route(h, Wl.router_w, Wl.router_b, spec.top_k)  # [Bt, k]
    if not spec.mxfp4:
        return moe_routed(h, idx, gate_w, lambda le: dense_expert(Wl, le, h.dtype), Wl.gate_up_bias,
                          Wl.down_bias, spec.alpha, spec.limit, expert_offset, act=_swiglu_fp32)
    act = None if h.dtype == torch.float32 else h.dtype
    out = moe_routed(h.float(), idx, gate_w.float(), lambda le: dense_expert(Wl, le, torch.float32),
                     Wl.gate_up_bias.float(), Wl.down_bias.float(), spec.alpha, spec.limit, expert_offset,
                     act_dtype=act)
    return out.to(h.dtype)


def _swiglu_fp32(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """`swiglu` computed in fp32 and rounded once to gate_up's dtype (the native kernel's)."""
    return swiglu(gate_up.float(), alpha, limit).to(gate_up.dtype)


def mxfp4_matvec(blocks: torch.Tensor, scales: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Per-row MXFP4 matrix times vector without a dense weight: blocks [n, R, G, 16], scales [n, R, G],
    x [n, G*32] -> [n, R]. Dot each 32-value group, then apply the group's power of two. Written as one
    gather + multiply + reduction so Inductor emits a single fused loop (eager would materialize it)."""
    pair, scale = _luts(x.dtype)
    n, R, G, _ = blocks.shape
    vals = pair[blocks.long()]                                           # [n, R, G, 16, 2]
    part = (vals * x.view(n, 1, G, 16, 2)).sum((-1, -2))                 # [n, R, G]
    return (part * scale[scales.long()].squeeze(-1)).sum(-1)


def expert_pairs_fused(hp: torch.Tensor, e: torch.Tensor, Wl: LayerWeights, spec: KernelSpec
                       ) -> torch.Tensor:
    """Each row through its own expert: hp [M, H], e [M] local expert ids -> [M, H] (down bias included, no
    gate), the MXFP4 decode fused into the dot products (experts never dequantized to memory)."""
    if spec.mxfp4:
        g = mxfp4_matvec(Wl.gate_up_blocks[e], Wl.gate_up_scales[e], hp)
    else:
        g = torch.bmm(hp.unsqueeze(1), Wl.gate_up[e]).squeeze(1)
    a = swiglu(g + Wl.gate_up_bias[e], spec.alpha, spec.limit)        # [M, I]
    if spec.mxfp4:
        y = mxfp4_matvec(Wl.down_blocks[e], Wl.down_scales[e], a)
    else:
        y = torch.bmm(a.unsqueeze(1), Wl.down[e]).squeeze(1)
    return y + Wl.down_bias[e]


def moe_decode_fused(h: torch.Tensor, Wl: LayerWeights, spec: KernelSpec, expert_offset: int = 0
                     ) -> torch.Tensor:
    """The compiled form's MoE of one layer: every (token, slot) pair at once through `expert_pairs_fused`
    (a fixed shape). With expert parallelism (`expert_offset`, fewer local experts than the router's), pairs
    routed to other ranks' experts run on a clamped local id with gate 0."""
    idx, gate_w = route(h, Wl.router_w, Wl.router_b, spec.top_k)  # [Bt, k]
    bt, k = idx.shape
    e = idx.reshape(-1)                                                   # [Bt k]
    gate = gate_w.reshape(-1, 1)
    n_local = Wl.gate_up_bias.shape[0]
    if n_local != Wl.router_w.shape[0]:                                # EP: this rank's experts only
        e = e - expert_offset
        gate = gate * ((e >= 0) & (e < n_local)).unsqueeze(-1).to(gate.dtype)
        e = e.clamp(0, n_local - 1)
    y = expert_pairs_fused(h.repeat_interleave(k, dim=0), e, Wl, spec) * gate
    return y.view(bt, k, -1).sum(1)


class LocalPairsMoE:
    """A parallel rank's compiled MoE: route eagerly, keep only the (token, slot) pairs routed to this rank's
    experts and run them through `expert_pairs_fused`, compiled once with the pair count symbolic. Unlike
    `moe_decode_fused` under EP, other ranks' pairs cost nothing."""

    def __init__(self) -> None:
        self._fn = torch.compile(expert_pairs_fused, fullgraph=True, dynamic=False)

    def __call__(self, h: torch.Tensor, Wl: LayerWeights, spec: KernelSpec, expert_offset: int = 0
                 ) -> torch.Tensor:
        idx, gate_w = route(h, Wl.router_w, Wl.router_b, spec.top_k)  # [Bt, k]
        n_local = Wl.gate_up_bias.shape[0]
        e = idx - expert_offset
        tok, slot = ((e >= 0) & (e < n_local)).nonzero(as_tuple=True)     # [n] each
        out = torch.zeros_like(h)
        if tok.numel() == 0:
            return out
        hp, ep = h[tok], e[tok, slot]
        torch._dynamo.maybe_mark_dynamic(hp, 0)
        torch._dynamo.maybe_mark_dynamic(ep, 0)
        y = self._fn(hp, ep, Wl, spec)                                      # [n, H]
        out.index_add_(0, tok, y * gate_w[tok, slot].unsqueeze(-1))
        return out


def attention_block(x: torch.Tensor, Wl: LayerWeights, kv: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
                    cos: torch.Tensor, sin: torch.Tensor, table: torch.Tensor, slot: torch.Tensor,
                    fpos: torch.Tensor, active: torch.Tensor, *, window: int | None, spec: KernelSpec
                    ) -> torch.Tensor:
    """One layer's attention up to the o-proj: x [Bt, H] -> [Bt, nh*d] in x's dtype.
    Writes the step's K/V into the layer's KV (`write_read_kv`) and reads its table. Past the qkv projection
    everything is fp32, as in the native kernels (`rope_kv_write`, `paged_decode_attention`): RoPE, the
    scores, sink and softmax, the value sum; K and V are rounded once, into the cache, and the output once."""
    nh, kvh, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
    h = rms_norm(x, Wl.input_norm, spec.eps)
    qkv = F.linear(h, Wl.qkv_w, Wl.qkv_b).float()                  # [Bt, (nh + 2 kv) d]
    cos, sin = cos.float(), sin.float()
    q = apply_rope(qkv[:, : nh * d].reshape(-1, nh, d), cos, sin)
    k = apply_rope(qkv[:, nh * d: (nh + kvh) * d].reshape(-1, kvh, d), cos, sin)
    v = qkv[:, (nh + kvh) * d:].reshape(-1, kvh, d)
    keys, vals = write_read_kv(kv, slot, k, v, table, torch.float32, spec)
    return decode_attention(q, keys, vals, fpos, active, Wl.sinks.float(), window, spec.scale).to(x.dtype)


def rope_write_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                  slot: torch.Tensor, spec: KernelSpec) -> torch.Tensor:
    """qkv [Bt, (nh + 2 kv) d] -> q [Bt, nh, d] with RoPE (fp32); RoPE'd k and v stored at `slot` [Bt].
    RoPE in fp32 (the native `rope_kv_write`): k and v are rounded once, into the cache."""
    nh, kvh, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
    qkv, cos, sin = qkv.float(), cos.float(), sin.float()
    q = apply_rope(qkv[:, : nh * d].reshape(-1, nh, d), cos, sin)
    k = apply_rope(qkv[:, nh * d: (nh + kvh) * d].reshape(-1, kvh, d), cos, sin)
    v = qkv[:, (nh + kvh) * d:].reshape(-1, kvh, d)
    write_kv(k_buf, v_buf, slot, k, v, spec.block_size, spec.k_scale, spec.v_scale)
    return q


@dataclass(frozen=True)
class LayerBlocks:
    """The pieces the layer loop runs (eager torch functions, their compiled forms — one graph per piece,
    reused by every layer since weights come in as per-layer views — or the native kernels,
    `native_blocks.NATIVE_BLOCKS`). `linear` and `norm` serve the o-proj, post-norm and the head.
    `rope_write` and `partial_attention` are the two halves of a DCP rank's attention (`dcp_attention`)."""
    attention: Callable[..., torch.Tensor] = attention_block
    moe: Callable[..., torch.Tensor] = moe_decode
    linear: Callable[..., torch.Tensor] = F.linear
    norm: Callable[..., torch.Tensor] = rms_norm
    rope_write: Callable[..., torch.Tensor] = rope_write_kv
    partial_attention: Callable[..., tuple[torch.Tensor, torch.Tensor]] = paged_decode_attention_partial
    # every layer in one call, where it applies (one rank, no DCP): (x, W, K buffers, V buffers, ctl, spec) ->
    # the hidden state after the last layer, or None to run the loop below
    all_layers: Callable[..., torch.Tensor | None] | None = None


def dcp_attention(x: torch.Tensor, Wl: LayerWeights, kv: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
                  cos: torch.Tensor, sin: torch.Tensor, table: torch.Tensor, slot: torch.Tensor, fpos: torch.Tensor,
                  first: torch.Tensor, active: torch.Tensor, *, spec: KernelSpec, parallel: ParallelContext,
                  blocks: LayerBlocks
                  ) -> torch.Tensor:
    """One layer's attention on a DCP rank, up to the o-proj: x [Bt, H] -> [Bt, nh*d]. Writes the step's K/V
    where this rank holds the token (else into the null block), gathers the DCP group's q heads, attends
    with all of them over this rank's tokens (local frame columns [first, fpos], no sink) and merges the
    group's partials with the sink counted once (`ParallelContext.dcp_merge`)."""
    k_buf, v_buf = split_kv_buffer(kv, spec.packed_k) if isinstance(kv, torch.Tensor) else kv
    h = blocks.norm(x, Wl.input_norm, spec.eps)
    qkv = blocks.linear(h, Wl.qkv_w, Wl.qkv_b)                     # [Bt, (nh + 2 kv) d]
    q = blocks.rope_write(qkv, cos, sin, k_buf, v_buf, slot, spec)       # [Bt, nh, d] fp32
    qg = parallel.dcp_gather_heads(q)                                    # [Bt, dcp·nh, d]
    o, lse = blocks.partial_attention(qg, k_buf, v_buf, table, fpos, first, active, spec.scale, spec.k_scale,
                                      spec.v_scale)
    a = parallel.dcp_merge(o, lse, Wl.sinks)                          # [Bt, nh, d] fp32
    return a.reshape(a.shape[0], -1).to(x.dtype)


def gpt_oss_decode_mega_kernel(input_ids: torch.Tensor, W: dict[str, torch.Tensor],
                               k_bufs: tuple[torch.Tensor, ...] | None, v_bufs: tuple[torch.Tensor, ...] | None,
                               ctl: AttentionControl, *, spec: KernelSpec,
                               K_cache: torch.Tensor | None = None, V_cache: torch.Tensor | None = None,
                               return_hidden: bool = False, parallel: ParallelContext | None = None,
                               blocks: LayerBlocks | None = None,
                               kv_bufs: tuple[torch.Tensor, ...] | None = None,
                               layers: list[LayerWeights] | None = None) -> torch.Tensor:
    """One decode step over all layers. input_ids [Bt] -> logits [Bt, V] (or the final hidden [Bt, H]).

    `parallel` (this rank's `ParallelContext`; None = one rank, no collectives): W is this rank's
    shard. Per layer: local heads, o-proj all-reduced over the TP group (bias added once), MoE on the local
    experts summed over the EP group (gathering the EP group's DP tokens first when it spans several: every
    DP group must pass the same batch bucket Bt). Returns this rank's vocabulary columns
    [Bt, vocab_stop - vocab_start] (reduce with `parallel.greedy`). `blocks`: the per-layer pieces to run
    between the collectives (default: eager; the compiled parallel program passes compiled ones). `layers`:
    the per-layer views of W made once (`ModelWeights.layers`), else each step makes them (`LayerWeights.of`).
    `ctl`: the step's attention control (tables, positions, write slots, RoPE; `attn_control`), built once and
    read by every layer. Under decode context parallelism (`ctl.kv_first`: the first visible full- and
    sliding-frame column per slot) each layer's attention is `dcp_attention`."""
    cos, sin, full_table, swa_table = ctl.cos, ctl.sin, ctl.full_table, ctl.swa_table
    active, pos, pos_swa = ctl.active, ctl.pos, ctl.pos_swa
    kv_cache_update_idx, kv_cache_update_idx_swa = ctl.kv_cache_update_idx, ctl.kv_cache_update_idx_swa
    kv_first = ctl.kv_first
    assert (k_bufs is not None) + (K_cache is not None) + (kv_bufs is not None) == 1, \
        "pass exactly one KV form: per-buffer K/V, per-buffer allocations (kv_bufs) or stacked K_cache/V_cache"
    bt = input_ids.shape[0]
    assert input_ids.dim() == 1 and active.shape == (bt,) and pos.shape == (bt,) and pos_swa.shape == (bt,), \
        "input_ids, active, pos, pos_swa must be [Bt]"
    assert full_table.dim() == 3 and full_table.shape[1] == bt and swa_table.dim() == 3 and swa_table.shape[1] == bt, \
        "full_table [Gf, Bt, nf] and swa_table [Gs, Bt, ns]"
    assert cos.shape[0] == bt and kv_cache_update_idx.shape[-1] == bt and kv_cache_update_idx_swa.shape[-1] == bt
    blocks = blocks or LayerBlocks(moe=moe_decode_fused if spec.fused_moe else moe_decode)
    x = W["embed"][input_ids]                                              # [Bt, H]
    y = None
    if blocks.all_layers is not None and parallel is None and kv_first is None:
        if kv_bufs is not None:
            k_bufs, v_bufs = zip(*(split_kv_buffer(b, spec.packed_k) for b in kv_bufs))
        elif K_cache is not None:
            k_bufs, v_bufs = tuple(K_cache), tuple(V_cache)
        y = blocks.all_layers(x, W, k_bufs, v_bufs, ctl, spec)
    for i in range(spec.num_layers if y is None else 0):
        buf = spec.layer_buffer[i]
        if kv_bufs is not None:
            kv = kv_bufs[buf]                                              # [2, nb, kv, B, d]
        else:
            kv = (k_bufs[buf], v_bufs[buf]) if k_bufs is not None else (K_cache[buf], V_cache[buf])
        g = spec.layer_kind_group[i]
        if spec.layer_sliding[i]:
            table, slot, fpos, window = swa_table[g], kv_cache_update_idx_swa[g], pos_swa, spec.window
        else:
            table, slot, fpos, window = full_table[g], kv_cache_update_idx[g], pos, None

        Wl = layers[i] if layers is not None else LayerWeights.of(W, i)
        if kv_first is not None:
            first = kv_first[1] if spec.layer_sliding[i] else kv_first[0]
            a = dcp_attention(x, Wl, kv, cos, sin, table, slot, fpos, first, active, spec=spec, parallel=parallel,
                              blocks=blocks)
        else:
            a = blocks.attention(x, Wl, kv, cos, sin, table, slot, fpos, active, window=window, spec=spec)
        if parallel is None:
            x = x + blocks.linear(a, Wl.o_w, Wl.o_b)
        else:
            x = x + parallel.row_parallel_linear(a, Wl.o_w, Wl.o_b, blocks.linear)

        h = blocks.norm(x, Wl.post_norm, spec.eps)
        if parallel is None:
            x = x + blocks.moe(h, Wl, spec)
        else:
            x = x + parallel.ep_moe(h, lambda t, Wl=Wl: blocks.moe(t, Wl, spec, parallel.expert_offset))
    x = blocks.norm(x if y is None else y, W["norm"], spec.eps)
    if return_hidden:
        return x
    if parallel is not None:
        return parallel.local_logits(x, W["lm_head"], blocks.linear)
    return blocks.linear(x, W["lm_head"])
