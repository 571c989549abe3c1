"""Math shared by the per-layer model and the GK program: RMSNorm, attention with sinks, the router,
the clamped SwiGLU and MXFP4 expert MLPs. Plain PyTorch, each mirroring transformers' GptOss numerics.
"""

from __future__ import annotations

import math

import torch

from .gemm import linear, product_dtype
from .mxfp4 import decode_mxfp4
from .weights import LayerWeights


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """In fp32 (transformers keeps GPT-OSS norms in fp32), result in x's dtype."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * h).to(x.dtype)


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                   sinks: torch.Tensor, scale: float) -> torch.Tensor:
    """Softmax attention with a learned per-head sink logit (a softmax column with no value).

    q [..., H, T, d]; k, v [..., H, S, d] (kv heads already repeated, or broadcastable: GQA as [.., kv, rep,
    T, d] against [.., kv, 1, S, d]); mask [..., T, S] bool (True = attend) or broadcastable; sinks [..., H]
    (broadcastable to q's leading dims). -> [..., H, T, d]. A key no query sees adds nothing, whatever its value
    holds: a reused KV block's slots past the sequence keep the bytes of its last owner, NaN included, and a
    probability of 0 times NaN would still be NaN.
    """
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale                    # [.., H, T, S]
    mask = mask.unsqueeze(-3)                                                  # [.., 1, T, S]
    scores = scores.masked_fill(~mask, float("-inf"))
    v = v.masked_fill(~mask.any(dim=-2).unsqueeze(-1), 0.0)                    # [.., 1, S, 1]: no query sees it
    sink = sinks[..., None, None].to(scores.dtype).expand(*scores.shape[:-1], 1)
    logits = torch.cat((scores, sink), dim=-1)
    logits = logits - logits.amax(dim=-1, keepdim=True)
    probs = torch.softmax(logits, dim=-1)[..., :-1]                            # drop the sink column
    return torch.matmul(probs.to(v.dtype), v)


def route(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, top_k: int, linear=linear
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] -> (expert ids [T, k], weights [T, k]): softmax over the k chosen logits only. `linear`: the
    router projection (the GK program's native one at decode batch sizes)."""
    logits = linear(x, w, b)                                                   # [T, E]
    top, idx = torch.topk(logits, top_k, dim=-1)
    return idx, torch.softmax(top, dim=-1)



def swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gate_up [..., 2I] interleaved (gate = even, up = odd) -> (up + 1) * gate * sigmoid(alpha * gate)."""
    gate = gate_up[..., ::2].clamp(max=limit)
    up = gate_up[..., 1::2].clamp(-limit, limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def dense_expert(Wl: LayerWeights, le: int, dtype: torch.dtype, decode=decode_mxfp4
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Local expert `le` of one layer as dense w1 [2I, H], w2 [H, I] (out-features first): MXFP4 decoded into
    a transient by `decode(blocks, scales, dtype)` (the torch one or the native kernel's), dense experts as
    views."""
    if Wl.mxfp4:
        return (decode(Wl.gate_up_blocks[le], Wl.gate_up_scales[le], dtype),
                decode(Wl.down_blocks[le], Wl.down_scales[le], dtype))
    return Wl.gate_up[le].transpose(-1, -2), Wl.down[le].transpose(-1, -2)


def moe_routed(x: torch.Tensor, idx: torch.Tensor, gate_w: torch.Tensor, dense_expert, gate_up_bias: torch.Tensor,
               down_bias: torch.Tensor, alpha: float, limit: float, expert_offset: int = 0,
               act_dtype: torch.dtype | None = None, act=swiglu) -> torch.Tensor:
    """The (token, slot) pairs routed to the experts held here, summed per token: x [T, H], idx / gate_w [T, k]
    -> [T, H]. The stacks hold local experts 0..n_local-1 = global ids [expert_offset, expert_offset + n_local)
    (all experts on one rank); pairs routed elsewhere contribute nothing. Each expert hit is made dense once
    (`dense_expert(local id)` -> w1 [2I, H], w2 [H, I]) and applied to all of its tokens together.
    `act_dtype`: round the activations between the two matmuls to it (an fp32 twin of a bf16 kernel);
    `act(gate_up, alpha, limit)`: the clamped SwiGLU (`swiglu`, or the native kernel's fused one)."""
    n_local = gate_up_bias.shape[0]
    e = idx - expert_offset
    out = torch.zeros_like(x)
    for le in torch.unique(e).tolist():
        if not 0 <= le < n_local:
            continue
        tok, slot = torch.where(e == le)
        w1, w2 = dense_expert(le)
        h = linear(x[tok], w1, gate_up_bias[le])
        a = act(h, alpha, limit)
        if act_dtype is not None:
            a = a.to(act_dtype).to(x.dtype)
        h = linear(a, w2, down_bias[le])
        out.index_add_(0, tok, h * gate_w[tok, slot, None])
    return out


def moe_tokens(x: torch.Tensor, Wl: LayerWeights, top_k: int, alpha: float, limit: float,
               expert_offset: int = 0, decode=decode_mxfp4, act=swiglu) -> torch.Tensor:
    """The per-layer model's MoE over many tokens (the router sees every expert; this rank's stacks hold the
    experts from global id `expert_offset` on, see `moe_routed`). x [T, H] -> [T, H]."""
    idx, gate_w = route(x, Wl.router_w, Wl.router_b, top_k)
    wdt = product_dtype(x.dtype)            # MXFP4 decoded straight into the GEMM's dtype (fp32 without bf16 GEMMs)
    return moe_routed(x, idx, gate_w, lambda le: dense_expert(Wl, le, wdt, decode), Wl.gate_up_bias,
                      Wl.down_bias, alpha, limit, expert_offset, act=act)


_LOG2E, _LN2 = math.log2(math.e), math.log(2.0)


def _tile_bounds(pos: torch.Tensor, tile: int) -> tuple[list[int], list[int]]:
    """Per tile of `tile` consecutive entries of pos [N] (the last one possibly short): (mins, maxs)."""
    n = pos.shape[0]
    pad = -n % tile
    p = torch.cat((pos, pos[-1:].expand(pad))) if pad else pos
    p = p.view(-1, tile)
    return p.amin(1).tolist(), p.amax(1).tolist()


def flash_sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                         k_pos: torch.Tensor, sinks: torch.Tensor | None, scale: float, window: int | None = None,
                         tile: int = 256, q_tile: int = 128, fp32_scores: bool = False
                         ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Causal (optionally sliding-window) GQA attention with sinks, flash style: `sink_attention`'s result
    without the dense [heads, T, S] scores or repeated K/V.

    q [T, nh, d] (a query chunk); k, v [S, nkv, d] (the keys it may see, token-major, compute dtype);
    q_pos [T], k_pos [S] absolute positions; sinks [nh]. Query head h reads kv head h // (nh // nkv): the
    rep = nh // nkv query heads of a kv head are one [rep * tq, d] bmm operand. Query q sees key kp iff
    kp <= q and (window None or kp > q - window); a row that sees no key gives 0.

    Queries go in tiles of `q_tile`, keys in tiles of `tile`, with an online softmax (running max / sum and
    the output accumulator in fp32): memory O(q_tile * tile) per head. A key tile no query of the query
    tile sees is skipped (so a sliding layer costs O(T * W)), one all of them see whole is not masked. The
    sink enters once at the end: out (normalized over the real keys) * sigmoid(lse - sink), lse the
    log-sum-exp of the real scores (the sink is a softmax column with no value). Scores: bmm in the input
    dtype (oneDNN for bf16; ~1.5-2x faster than `fp32_scores`, whose fp32 bmm is ~3x more accurate in bf16;
    fp32 for both products on a CPU without bf16 GEMMs, `gemm.product_dtype`), then fp32, softmax in base 2
    (exp2 is ~2x cheaper than exp on CPU). -> [T, nh, d] in q's dtype.

    `sinks=None` (a DCP rank's partial attention over its own keys): no sink; -> (out [T, nh, d] fp32,
    normalized over the keys seen, 0 where none; lse [T, nh] fp32, -inf where none).
    """
    T, nh, d = q.shape
    S, nkv = k.shape[0], k.shape[1]
    rep = nh // nkv
    dt = q.dtype
    partial = sinks is None
    out = q.new_zeros(T, nh, d, dtype=torch.float32 if partial else dt)
    lse_out = torch.full((T, nh), float("-inf")) if partial else None
    if T == 0 or S == 0:
        return (out, lse_out) if partial else out
    sdt = torch.float32 if fp32_scores else product_dtype(dt)             # fp32 where bf16 GEMMs are slow
    kh = k.transpose(0, 1).to(sdt)                                         # [nkv, S, d] (views when no cast)
    vh = v.transpose(0, 1).to(product_dtype(v.dtype))
    qh = q.view(T, nkv, rep, d).permute(1, 2, 0, 3).to(sdt)                # [nkv, rep, T, d]
    c = scale * _LOG2E                                                     # scores in log2 units
    sink = None if partial else sinks.float().view(nkv, rep, 1, 1)
    kmins, kmaxs = _tile_bounds(k_pos, tile)
    qmins, qmaxs = _tile_bounds(q_pos, q_tile)
    neg = float("-inf")
    for qi, q0 in enumerate(range(0, T, q_tile)):
        q1 = min(T, q0 + q_tile)
        tq, qmin, qmax = q1 - q0, qmins[qi], qmaxs[qi]
        qp = q_pos[q0:q1, None]
        qt = qh[:, :, q0:q1].reshape(nkv, rep * tq, d)
        m = torch.full((nkv, rep * tq, 1), neg)                            # running max (log2 units)
        l = torch.zeros(nkv, rep * tq, 1)                                  # running sum of 2^(s - m)
        acc = torch.zeros(nkv, rep * tq, d)
        for ki, k0 in enumerate(range(0, S, tile)):
            kmin, kmax = kmins[ki], kmaxs[ki]
            if kmin > qmax or (window is not None and kmax <= qmin - window):
                continue                                                   # no query of the tile sees these
            k1 = min(S, k0 + tile)
            vt = vh[:, k0:k1]
            s = torch.bmm(qt, kh[:, k0:k1].transpose(1, 2)).float().mul_(c)   # [nkv, rep tq, tk]
            if kmax > qmin or (window is not None and kmin <= qmax - window):    # partly masked
                kp = k_pos[None, k0:k1]
                vis = kp <= qp
                if window is not None:
                    vis &= kp > qp - window
                s = s.view(nkv, rep, tq, -1).masked_fill_(~vis, neg).view(nkv, rep * tq, -1)
                seen = vis.any(dim=0)                                      # [tk]: keys some query sees
                if not bool(seen.all()):                                   # the others' values add nothing,
                    vt = vt.masked_fill(~seen[None, :, None], 0.0)         # even stale NaN (sink_attention)
            m_new = torch.maximum(m, s.amax(-1, keepdim=True))
            m_safe = m_new.masked_fill(m_new == neg, 0.0)                  # rows with nothing seen yet
            p = s.sub_(m_safe).exp2_()
            corr = (m - m_safe).exp2_()
            l = l.mul_(corr).add_(p.sum(-1, keepdim=True))
            acc = acc.mul_(corr).add_(torch.bmm(p.to(vt.dtype), vt))
            m = m_new
        lse = (m + l.log2()).mul_(_LN2)                                    # natural log; -inf: no key seen
        o = acc.div_(l.clamp_min(1e-30)).view(nkv, rep, tq, d)
        if partial:
            lse_out[q0:q1] = lse.view(nkv, rep, tq).permute(2, 0, 1).reshape(tq, nh)
        else:
            o = o.mul_(torch.sigmoid(lse.view(nkv, rep, tq, 1) - sink))
        out[q0:q1] = o.permute(2, 0, 1, 3).reshape(tq, nh, d).to(out.dtype)
    return (out, lse_out) if partial else out
