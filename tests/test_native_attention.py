"""The native KV write (`rope_kv_write`), read-back (`kv_gather`) and paged decode attention (full and partial)
against their torch twins: every KV layout (packed FP8, plain FP8 / bf16 / fp32) with odd head dims, block sizes
1..64, GQA, padded batch slots, positions at block edges, sliding windows and the block-range split of long
contexts.

The kernels are called through `torch.ops.gigadecode_native` directly (not the Python wrappers, which fall
back to the twins), so a pass here is about the C++ code. Skipped as a whole where the kernels cannot be built.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

from gigadecode import native
from gigadecode.kv.cache import FP8, token_major_to_packed
from gigadecode.native import twins

from native_cases import (AMX, BF16, F32, KV_FORMS, OPS, assert_rounded, bits, gen, kv_views, make_kv, num_threads,
                          randn, switched)

if OPS is None:
    pytest.skip(f"native kernels not available here: {native.status()}", allow_module_level=True)


# ---- KV: rope_kv_write, paged_decode_attention -------------------------------------------------------

def _fp8_table_reads() -> bool:
    """Whether this build and CPU read FP8 KV by byte table (AVX512-VBMI): 'table' can be set."""
    try:
        with switched(native.fp8_reads, "table"):
            return True
    except RuntimeError:
        return False


# the ways decode attention's fp32 form reads FP8 KV here (`native.fp8_reads`)
FP8_READS = ["fp16"] + (["table"] if _fp8_table_reads() else [])


# FP8 carries per-tensor scales != 1; plain bf16 / fp32 KV ignores them (kernel and twin), so the same odd values
# are passed for every layout
KS, VS = 0.37, 1.75


def assert_kv_written(out_buf, ref_buf, written: int):
    """Whole KV buffers after a write: bf16 / fp32 tight; FP8 by decoded value within one e4m3 step (a rounding
    tie can go either way when the fp32 input differs in its last bit), and >= 99.9% of written bytes exact."""
    if out_buf.dtype == F32:
        torch.testing.assert_close(out_buf, ref_buf, rtol=1e-6, atol=1e-6)
        return
    if out_buf.dtype == BF16:
        torch.testing.assert_close(out_buf.float(), ref_buf.float(), rtol=2.0 ** -7, atol=1e-6)
    else:
        a, b = out_buf.float(), ref_buf.float()
        step = torch.maximum(a.abs(), b.abs()) * 2.0 ** -3 + 2.0 ** -9      # one e4m3 step (subnormal: 2^-9)
        assert ((a - b).abs() <= step).all()
    mismatched = (bits(out_buf) != bits(ref_buf)).sum().item()
    assert mismatched <= 0.001 * written, f"{mismatched} of {written} written values differ"


def rope_cos_sin(g, Bt, d, dtype):
    pos = torch.randint(0, 5000, (Bt,), generator=g).float()
    inv = 150000.0 ** (-torch.arange(0, d // 2).float() / (d // 2))
    f = pos[:, None] * inv[None, :]
    return f.cos().to(dtype), f.sin().to(dtype)


def _kv_cases():
    """(layout, block size, head dim): packed FP8 needs an even block; d = 18 leaves a scalar tail."""
    cases = []
    for form in KV_FORMS:
        for B in (1, 2, 4, 16, 64):
            if form == "fp8-packed" and B == 1:
                continue
            for d in (16, 18, 64):
                cases.append((form, B, d))
    return cases


@pytest.mark.parametrize("form,B,d", _kv_cases())
def test_kv_gather(form, B, d):
    """The blocks of a table read back token-major (prefill's keys): bit-equal to the twin for both output
    dtypes, FP8 buffers holding every byte (subnormals, and e4m3's NaN codes read as NaN by the vector loads as
    by the scalar tail) with scales != 1, repeated blocks."""
    g = gen("gather", form, B, d)
    nb, kv = 7, 3
    buf, K, V = make_kv(g, form, nb, kv, B, d)
    if buf.dtype == FP8:
        raw = torch.randint(0, 256, buf.shape, generator=g, dtype=torch.uint8)
        raw.view(-1)[torch.randperm(raw.numel(), generator=g)[:64]] = torch.tensor([0x7F, 0xFF], dtype=torch.uint8).repeat(32)
        buf.view(torch.uint8).copy_(raw)
    ids = torch.tensor([5, 0, 2, 5, 6])
    for dtype in (F32, BF16):
        k, v = OPS.kv_gather(K, V, ids, KS, VS, dtype)
        rk, rv = twins.kv_gather(K, V, ids, KS, VS, dtype)
        assert k.shape == v.shape == (len(ids) * B, kv, d) and k.dtype == v.dtype == dtype
        for got, want in ((k, rk), (v, rv)):
            nan = want.isnan()
            assert torch.equal(got.isnan(), nan) and torch.equal(bits(got)[~nan], bits(want)[~nan])
    k, v = OPS.kv_gather(K, V, ids[:0], KS, VS, BF16)
    assert k.shape == v.shape == (0, kv, d)
    with pytest.raises(RuntimeError, match="outside the buffer"):
        OPS.kv_gather(K, V, torch.tensor([1, nb]), KS, VS, BF16)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        OPS.kv_gather(K, V, ids, KS, VS, torch.float16)


# head dims past 1024 (a valid GPT-OSS config bounds none): the kernel's per-slot scratch once held 1024 floats
@pytest.mark.parametrize("form,B,d", _kv_cases() + [("fp8-packed", 2, 1026), ("fp32", 4, 1536)])
def test_rope_kv_write(form, B, d):
    g = gen("rope", form, B, d)
    for i, (kv, rep) in enumerate(((1, 1), (2, 4), (3, 1))):
        nh = kv * rep
        nb = 6
        Bt = 1 + (i * 2 + B + d) % 5
        buf, K, V = make_kv(g, form, nb, kv, B, d)
        slot = torch.randperm(nb * B, generator=g)[:Bt]           # distinct slots, any block (0 included)
        qdt, cdt = ((F32, F32), (BF16, BF16), (F32, BF16))[i]
        qkv = randn(g, Bt, (nh + 2 * kv) * d, dtype=qdt, scale=2.0)
        cos, sin = rope_cos_sin(g, Bt, d, cdt)
        ks, vs = KS, VS
        ref_buf = buf.clone()
        rK, rV = kv_views(ref_buf, form)
        q = OPS.rope_kv_write(qkv, cos, sin, K, V, slot, nh, ks, vs)
        q_ref = twins.rope_kv_write(qkv, cos, sin, rK, rV, slot, nh, ks, vs)
        assert q.shape == (Bt, nh, d) and q.dtype == F32
        torch.testing.assert_close(q, q_ref, rtol=1e-6, atol=1e-6)
        assert_kv_written(buf, ref_buf, 2 * Bt * kv * d)


def test_kv_buffers_without_blocks_or_heads_or_with_odd_dims_are_refused():
    """KV buffers of block size 0 or no kv heads (an integer division by zero killed the process: SIGFPE), an
    odd head dim for RoPE (the last dim of q was never written), non-contiguous slot / pos / active (read as if
    contiguous): each refused by name, by every op that takes them."""
    q, sinks, table = torch.randn(1, 2, 16), torch.zeros(2), torch.tensor([[1, 2]])
    pos, act, first = torch.tensor([5]), torch.tensor([True]), torch.tensor([0])
    qkv, cos, sin = torch.randn(1, 3 * 16), torch.ones(1, 8), torch.zeros(1, 8)
    for shape in ((4, 1, 0, 16), (4, 0, 4, 16)):
        K, V = torch.zeros(shape), torch.zeros(shape)
        with pytest.raises(RuntimeError, match="block size and kv heads must be >= 1"):
            OPS.paged_decode_attention(q, K, V, table, pos, act, sinks, 0, 0.25, 1.0, 1.0, F32)
        with pytest.raises(RuntimeError, match="block size and kv heads must be >= 1"):
            OPS.paged_decode_attention_partial(q, K, V, table, pos, first, act, 0.25, 1.0, 1.0)
        with pytest.raises(RuntimeError, match="block size and kv heads must be >= 1"):
            OPS.rope_kv_write(qkv, cos, sin, K, V, torch.tensor([1]), 1, 1.0, 1.0)
        with pytest.raises(RuntimeError, match="block size and kv heads must be >= 1"):
            OPS.kv_gather(K, V, torch.tensor([1]), 1.0, 1.0, F32)
    K, V = torch.zeros(4, 1, 4, 5), torch.zeros(4, 1, 4, 5)
    with pytest.raises(RuntimeError, match="head dim 5 is odd"):
        OPS.rope_kv_write(torch.randn(1, 15), torch.ones(1, 2), torch.zeros(1, 2), K, V, torch.tensor([1]), 1, 1.0,
                          1.0)
    K, V = torch.zeros(4, 1, 4, 16), torch.zeros(4, 1, 4, 16)
    with pytest.raises(RuntimeError, match="slot must be int64 \\[Bt\\], contiguous"):
        OPS.rope_kv_write(torch.randn(2, 48), torch.ones(2, 8), torch.zeros(2, 8), K, V, torch.tensor([1, 9, 2, 9])[::2],
                          1, 1.0, 1.0)
    q2, t2 = torch.randn(2, 2, 16), torch.tensor([[1, 2], [3, 0]])
    for p, a in ((torch.tensor([5, 9, 1, 9])[::2], torch.tensor([True, True])),
                 (torch.tensor([5, 1]), torch.tensor([True, False, True, False])[::2])):
        with pytest.raises(RuntimeError, match="must be \\[Bt\\], contiguous"):
            OPS.paged_decode_attention(q2, K, V, t2, p, a, sinks, 0, 0.25, 1.0, 1.0, F32)
        with pytest.raises(RuntimeError, match="must be \\[Bt\\], contiguous"):
            OPS.paged_decode_attention_partial(q2, K, V, t2, p, torch.zeros(2, dtype=torch.long), a, 0.25, 1.0, 1.0)


def _fp8_sweep() -> torch.Tensor:
    """fp32 values that exercise fp32 -> e4m3 rounding: every e4m3 value, every midpoint between neighbours
    (ties, incl. the subnormal ones) and their fp32 neighbours, the ±448 clamp, inf, signed zeros."""
    codes = torch.arange(256, dtype=torch.uint8)
    vals = codes.view(FP8).float()
    vals = vals[torch.isfinite(vals)]
    pos = torch.unique(vals[vals >= 0])                                  # sorted, 0 .. 448
    mids = (pos[1:] + pos[:-1]) / 2                                      # exact in fp32
    up, down = torch.nextafter(mids, torch.tensor(math.inf)), torch.nextafter(mids, torch.tensor(-math.inf))
    big = torch.tensor([447.0, 448.0, 449.0, 463.9, 464.0, 464.1, 479.0, 480.0, 500.0, 1e4, 3e38, math.inf])
    tiny = torch.tensor([2.0 ** -10, 2.0 ** -11, 2.0 ** -20, 1e-40, 3 * 2.0 ** -11, 2.0 ** -6 - 2.0 ** -12])
    mags = torch.cat((pos, mids, up, down, big, tiny, torch.rand(300, generator=gen(7)) * 2.0 ** -6,
                      torch.exp2(torch.rand(300, generator=gen(8)) * 20 - 11)))
    return torch.cat((mags, -mags, torch.tensor([0.0, -0.0])))


@pytest.mark.parametrize("form", ["fp8-packed", "fp8"])
@pytest.mark.parametrize("scale", [1.0, 0.5, 0.37, 2.5])
def test_fp8_conversion_matches_torch(form, scale):
    """The V half is stored without RoPE: the written bytes must be torch's (x / scale).clamp(±448) -> e4m3."""
    sweep = _fp8_sweep()
    d, kv, B = 64, 2, 4
    n_tok = -(-sweep.numel() // (kv * d))
    vals = torch.cat((sweep, torch.zeros(n_tok * kv * d - sweep.numel())))
    nb = n_tok // B + 2
    buf = torch.zeros(2, nb, kv, B, d, dtype=FP8)
    K, V = kv_views(buf, form)
    slot = torch.randperm(nb * B, generator=gen(9))[:n_tok]
    finite = torch.where(torch.isfinite(vals), vals, torch.zeros(()))            # K gets no inf (inf * 0 = nan)
    qkv = torch.cat((torch.randn(n_tok, d, generator=gen(10)), finite.view(n_tok, kv * d),
                     vals.view(n_tok, kv * d)), 1)
    cos, sin = torch.ones(n_tok, d // 2), torch.zeros(n_tok, d // 2)
    OPS.rope_kv_write(qkv, cos, sin, K, V, slot, 1, scale, scale)
    blk, off = slot // B, slot % B
    want = (vals.view(n_tok, kv, d) / scale).clamp(-448, 448).to(FP8)
    got = V[blk, :, off, :]                                                        # [n_tok, kv, d]
    bad = (bits(got) != bits(want)).nonzero()
    assert bad.numel() == 0, [(vals.view(n_tok, kv, d)[tuple(i)].item(), bits(got)[tuple(i)].item(),
                               bits(want)[tuple(i)].item()) for i in bad[:10]]
    # K (RoPE with cos 1, sin 0) against the twin's bytes
    ref_buf = torch.zeros_like(buf)
    rK, rV = kv_views(ref_buf, form)
    twins.rope_kv_write(qkv, cos, sin, rK, rV, slot, 1, scale, scale)
    assert torch.equal(bits(buf), bits(ref_buf))


def test_rope_kv_write_errors():
    g = gen(11)
    buf, K, V = make_kv(g, "fp8-packed", 3, 1, 4, 16)
    qkv, cos, sin = torch.zeros(1, 3 * 16), torch.ones(1, 8), torch.zeros(1, 8)
    with pytest.raises(RuntimeError, match="outside the KV buffer"):
        OPS.rope_kv_write(qkv, cos, sin, K, V, torch.tensor([12]), 1, 1.0, 1.0)
    with pytest.raises(RuntimeError, match="does not match"):
        OPS.rope_kv_write(torch.zeros(1, 4 * 16), cos, sin, K, V, torch.tensor([1]), 1, 1.0, 1.0)
    with pytest.raises(RuntimeError, match="cos/sin"):
        OPS.rope_kv_write(qkv, torch.ones(1, 16), torch.zeros(1, 16), K, V, torch.tensor([1]), 1, 1.0, 1.0)


def make_tables(g, nb: int, B: int, pos: list[int], active: list[bool], extra: int = 1):
    """table [Bt, n] (n covers the largest position, plus `extra` unused columns of junk): each active slot
    gets distinct random block ids >= 1 for its blocks; padded slots a row of zeros."""
    n = max(p // B for p in pos) + 1 + extra
    table = torch.zeros(len(pos), n, dtype=torch.long)
    for b, (p, a) in enumerate(zip(pos, active)):
        if a:
            need = p // B + 1
            table[b, :need] = torch.randperm(nb - 1, generator=g)[:need] + 1
            table[b, need:] = torch.randint(0, nb, (n - need,), generator=g)
    return table


def check_attention(g, form, K, V, table, pos, active, nh, window, out_dtype=F32, sink_dtype=F32):
    Bt, d = table.shape[0], V.shape[-1]
    q = randn(g, Bt, nh, d, scale=2.0)
    sinks = randn(g, nh, dtype=sink_dtype)
    scale = 1.0 / math.sqrt(d)
    ks, vs = KS, VS
    pos_t, act_t = torch.tensor(pos, dtype=torch.long), torch.tensor(active)
    out = OPS.paged_decode_attention(q, K, V, table, pos_t, act_t, sinks, window, scale, ks, vs, out_dtype)
    ref32 = twins.paged_decode_attention(q, K, V, table, pos_t, act_t, sinks, window, scale, ks, vs, F32)
    assert out.shape == (Bt, nh * d) and out.dtype == out_dtype
    atol = 2e-5 * max(1.0, ref32.abs().max().item())
    if out_dtype == F32:
        torch.testing.assert_close(out, ref32, rtol=1e-5, atol=atol)
    else:
        assert_rounded(out, ref32, atol)
    assert torch.equal(out[~act_t].float(), torch.zeros(int((~act_t).sum()), nh * d))   # padded slots: 0
    return out


@pytest.mark.parametrize("form,B,d", _kv_cases())
def test_paged_decode_attention(form, B, d):
    g = gen("attn", form, B, d)
    long = max(300, 9 * B) + int(torch.randint(0, B, (1,), generator=g))
    # slots: block edges (0, B-1, B, 2B-1), a long context, padded inactive slots
    pos = [0, B - 1, B, long, 2 * B - 1, 0, 7]
    active = [True, True, True, True, True, False, False]
    nb = long // B + 4
    # (kv heads, GQA rep, which slots): all 7, then a batch of 2 (one padded), then a single slot at 0
    for i, (kv, rep, slots) in enumerate(((1, 1, range(7)), (2, 4, range(7)), (1, 4, (3, 6)), (2, 1, (0,)))):
        buf, K, V = make_kv(g, form, nb, kv, B, d)
        p, a = [pos[s] for s in slots], [active[s] for s in slots]
        table = make_tables(g, nb, B, p, a)
        for j, window in enumerate((0, 5, 16, long + 50)):
            k = i * 4 + j
            check_attention(g, form, K, V, table, p, a, kv * rep, window,
                            out_dtype=(F32, BF16)[k % 2], sink_dtype=(F32, BF16)[(k // 2) % 2])


@pytest.mark.parametrize("form", ["fp8-packed", "fp8"])
@pytest.mark.parametrize("B,d", [(4, 18), (16, 64), (2, 96)])
@pytest.mark.parametrize("half", ["K", "V"])
def test_paged_decode_attention_fp8_nan_bytes(form, B, d, half):
    """e4m3's NaN codes (0x7F, 0xFF) in the KV: where attention sees them the output is NaN, as the twin's (the
    vector loads once read them as ±480 · scale, the scalar tail as NaN); where it does not (past a slot's
    position, before its window, in a block the table does not name) the output is the twin's numbers."""
    g = gen("fp8nan", form, B, d, half)
    pos, active = [3 * B + 1, 5 * B, 2 * B - 1], [True, True, True]
    nb = 40
    for window in (0, B + 1):
        buf, K, V = make_kv(g, form, nb, 2, B, d)
        ids = (torch.randperm(nb - 1, generator=g) + 1).tolist()                # blocks no two slots share
        table = torch.tensor([ids[0:6], ids[6:12], ids[12:18]])
        raw = buf.view(torch.uint8)[0 if half == "K" else 1]                  # [nb, kv, B, d] as stored
        # slot 0: a NaN at its own visible position (kv head 1 only); slot 1: NaN just past its position and
        # before its window; slot 2: NaN in the buffer's unnamed blocks only. Dims 0 and d - 1: a vector load's
        # and (d = 18) the scalar tail's
        def plant(slot, t, head, byte):
            blk = int(table[slot, t // B])
            for j in (0, d - 1):
                if form == "fp8-packed" and half == "K":                       # [nb, kv, B/2, d, 2] in memory
                    raw.view(nb, 2, B // 2, d, 2)[blk, head, (t % B) // 2, j, t % 2] = byte
                else:
                    raw[blk, head, t % B, j] = byte
        plant(0, pos[0] - 1, 1, 0x7F)
        if window:
            plant(1, pos[1] - window, 0, 0xFF)
        plant(1, pos[1] + 1, 0, 0x7F)
        named = set(table.flatten().tolist())
        for blk in range(nb):
            if blk not in named:
                raw[blk, :, :, :] = 0xFF
        q, sinks = randn(g, 3, 8, d, scale=2.0), randn(g, 8)
        args = (q, K, V, table, torch.tensor(pos), torch.tensor(active), sinks, window, 1 / math.sqrt(d), KS, VS,
                F32)
        out, ref = OPS.paged_decode_attention(*args), twins.paged_decode_attention(*args)
        nan = ref.isnan()
        assert nan[0, 4 * d:].any() and not nan[0, :4 * d].any() and not nan[1:].any()   # the plant reached it
        assert torch.equal(out.isnan(), nan)
        torch.testing.assert_close(out[~nan], ref[~nan], rtol=1e-5, atol=2e-5 * ref[~nan].abs().max().item())


@pytest.mark.parametrize("form", ["fp8-packed", "bf16", "fp32"])
@pytest.mark.parametrize("threads", [1, 4])
def test_decode_attention_keeps_a_nan_query_or_sink(form, threads):
    """A NaN in one q head makes that head's every score NaN: the partial op (a DCP rank's share) gives NaN for
    it, out and lse, as its twin; a NaN sink makes its head NaN in the full op. Both once came out 0 (lse
    -inf): the running maxima drop a NaN, so the head read as "nothing visible" (partial) or M = NaN failed the
    M > -inf test (sink), and a DCP request whose q met a NaN weight returned tokens. The other heads and
    slots keep the twin's numbers. 4 threads: a long slot's range split, the merge across splits."""
    g = gen("nanq", form, threads)
    B, d, nb, kvh, nh = 16, 64, 40, 2, 8
    buf, K, V = make_kv(g, form, nb, kvh, B, d)
    ids = (torch.randperm(nb - 1, generator=g) + 1).tolist()
    table = torch.tensor([ids[0:18], ids[18:36]])
    pos, first, active = torch.tensor([17 * B + 3, 2 * B]), torch.tensor([B + 1, 0]), torch.tensor([True, True])
    q, sinks = randn(g, 2, nh, d, scale=2.0), randn(g, nh)
    q[0, 5, :] = float("nan")                       # slot 0, q head 5 (kv head 1): all its scores NaN
    with num_threads(threads):
        args = (q, K, V, table, pos, first, active, 1 / math.sqrt(d), KS, VS)
        (out, lse), (ref, rlse) = OPS.paged_decode_attention_partial(*args), twins.paged_decode_attention_partial(*args)
        nan_sinks = sinks.clone()
        nan_sinks[2] = float("nan")
        q_clean = q.nan_to_num()
        full_args = (q_clean, K, V, table, pos, active, nan_sinks, 0, 1 / math.sqrt(d), KS, VS, F32)
        full, rfull = OPS.paged_decode_attention(*full_args), twins.paged_decode_attention(*full_args)
    assert ref[0, 5].isnan().all() and rlse[0, 5].isnan() and ref.isnan().sum() == d and rlse.isnan().sum() == 1
    assert rfull.view(2, nh, d)[:, 2].isnan().all() and rfull.isnan().sum() == 2 * d
    for got, want in ((out, ref), (lse, rlse), (full, rfull)):
        nan = want.isnan()
        assert torch.equal(got.isnan(), nan)
        torch.testing.assert_close(got[~nan], want[~nan], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("form", ["fp8-packed", "bf16", "fp32"])
@pytest.mark.parametrize("threads", [1, 4])
def test_decode_attention_scores_all_minus_inf_weigh_nothing(form, threads):
    """A q head of -inf against keys all positive in that dim: every score -inf, so no key weighs: the full op's
    head is 0 (the sink takes it all) and the partial op's 0 with lse -inf, as their twins. The online softmax
    took e^(-inf - -inf) = NaN, so the head came out NaN and its request failed where the oracle returns
    tokens. Other heads and slots keep the twin's numbers."""
    g = gen("minf", form, threads)
    B, d, nb, kvh, nh = 16, 64, 40, 2, 8
    buf, K, V = make_kv(g, form, nb, kvh, B, d)
    k3 = K[..., 3, :] if form == "fp8-packed" else K[..., 3]         # K's dim 3 (packed: [nb, kv, B/2, d, 2])
    k3.copy_((k3.float().abs() + 0.25).to(k3.dtype))                 # > 0 everywhere
    ids = (torch.randperm(nb - 1, generator=g) + 1).tolist()
    table = torch.tensor([ids[0:18], ids[18:36]])
    pos, first, active = torch.tensor([17 * B + 3, 2 * B]), torch.tensor([B + 1, 0]), torch.tensor([True, True])
    q, sinks = randn(g, 2, nh, d, scale=2.0), randn(g, nh)
    q[0, 5, 3] = float("-inf")                      # slot 0, q head 5: every score -inf
    with num_threads(threads):
        args = (q, K, V, table, pos, active, sinks, 0, 1 / math.sqrt(d), KS, VS, F32)
        full, rfull = OPS.paged_decode_attention(*args), twins.paged_decode_attention(*args)
        args = (q, K, V, table, pos, first, active, 1 / math.sqrt(d), KS, VS)
        (out, lse), (ref, rlse) = OPS.paged_decode_attention_partial(*args), twins.paged_decode_attention_partial(*args)
        # with that head's sink -inf as well (a checkpoint may say "no sink"), nothing at all weighs: the twin's
        # softmax gives NaN (-inf - -inf), and so must the kernel, not 0
        no_sink = sinks.clone()
        no_sink[5] = float("-inf")
        args = (q, K, V, table, pos, active, no_sink, 0, 1 / math.sqrt(d), KS, VS, F32)
        full2, rfull2 = OPS.paged_decode_attention(*args), twins.paged_decode_attention(*args)
    assert rfull2.view(2, nh, d)[0, 5].isnan().all() and rfull2.isnan().sum() == d
    assert torch.isfinite(rfull).all() and (rfull.view(2, nh, d)[0, 5] == 0).all()
    assert torch.isfinite(ref).all() and (ref[0, 5] == 0).all() and rlse[0, 5] == float("-inf")
    for got, want in ((full, rfull), (out, ref), (lse, rlse), (full2, rfull2)):
        assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got == float("-inf"), want == float("-inf"))
        fin = torch.isfinite(want)
        torch.testing.assert_close(got[fin], want[fin], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("form", KV_FORMS)
@pytest.mark.parametrize("threads", [1, 4])
def test_paged_decode_attention_split_long_context(form, threads):
    """Few (slot, kv head) items and >= 8 blocks: the block ranges are split and merged by log-sum-exp
    (some ranges empty for the shorter slot)."""
    g = gen(12 + threads)
    with num_threads(threads):
        for B, d in ((2, 18), (4, 64), (16, 16)):
            if form != "fp8-packed":
                B = B // 2 if B == 2 else B                # plain layouts also at B = 1
            long = 37 * B + 3
            for pos, active in (([long], [True]), ([long, 3 * B + 1], [True, True]), ([long, 0], [True, False])):
                nb = long // B + 4
                buf, K, V = make_kv(g, form, nb, 1, B, d)
                table = make_tables(g, nb, B, pos, active, extra=0)
                for window in (0, 8 * B + 1, 100):
                    check_attention(g, form, K, V, table, pos, active, 4, window)


@pytest.mark.skipif(not AMX, reason="no AMX tiles on this CPU")
@pytest.mark.parametrize("form", ["fp8-packed", "fp8"])
@pytest.mark.parametrize("B,d,kv,rep", [(16, 64, 2, 8), (2, 18, 1, 6), (64, 128, 1, 8), (2, 48, 3, 5),
                                        (32, 100, 2, 7), (8, 16, 1, 5), (256, 32, 1, 8), (4, 130, 2, 5),
                                        (1, 40, 2, 9), (16, 64, 2, 4)])
@pytest.mark.parametrize("threads", [1, 2])
def test_paged_decode_attention_fp8_on_amx_tiles(form, B, d, kv, rep, threads):
    """FP8 KV on AMX tiles (attention_tiles.cpp: 5 to 8 q heads a kv head; the last two shapes take the fp32 form)
    against the twin at the fp32 form's tolerance, and against that form itself, tighter: the scores are its
    values up to the order of the sums and P carries 17 significant bits, so the two differ by at most ~2^-17 of
    the output's size, and the bits differ (the tiles ran). Head dims 16..130 (padded to 32; 130: nine 16-dim
    blocks, three passes of P · V), spans of one block larger than 128 tokens, odd visible counts and windows,
    block-range splits (one thread and two)."""
    if form == "fp8-packed" and B % 2:
        B += 1
    g = gen("tiles", form, B, d, kv, rep, threads)
    long = max(700, 3 * B) + int(torch.randint(0, B, (1,), generator=g))
    pos = [0, B - 1, long, B + 6, 130, 3]
    active = [True, True, True, True, True, False]
    nb = sum(p // B + 2 for p in pos) + 4
    buf, K, V = make_kv(g, form, nb, kv, B, d)
    table = make_tables(g, nb, B, pos, active)
    q, sinks = randn(g, len(pos), kv * rep, d, scale=2.0), randn(g, kv * rep)
    with num_threads(threads):
        for window in (0, 5, 100):
            args = (q, K, V, table, torch.tensor(pos), torch.tensor(active), sinks, window, 1 / math.sqrt(d), KS,
                    VS, F32)
            outs = {}
            for mode in ("on", "off"):
                with switched(native.amx_tiles, mode):
                    outs[mode] = OPS.paged_decode_attention(*args)
            ref = twins.paged_decode_attention(*args)
            size = max(1.0, ref.abs().max().item())
            for out in outs.values():
                torch.testing.assert_close(out, ref, rtol=1e-5, atol=2e-5 * size)
            # without P's last 8 of its 17 bits, the tiles land ~1e-3 of the size away
            torch.testing.assert_close(outs["on"], outs["off"], rtol=0, atol=2.0 ** -16 * size)
            assert torch.equal(outs["on"], outs["off"]) == (not 5 <= rep <= 8)
        # the scores themselves, through the partial op's log-sum-exp: the same up to fp32 rounding (q's parts
        # without its last 8 bits move it ~1e-5)
        first = torch.tensor([0, 0, long // 3, 2, 0, 0])
        lses = {}
        for mode in ("on", "off"):
            with switched(native.amx_tiles, mode):
                lses[mode] = OPS.paged_decode_attention_partial(q, K, V, table, torch.tensor(pos), first,
                                                                 torch.tensor(active), 1 / math.sqrt(d), KS, VS)[1]
        torch.testing.assert_close(lses["on"], lses["off"], rtol=1e-6, atol=1e-6)


@pytest.mark.skipif(not _fp8_table_reads(), reason="no AVX512-VBMI byte-table reads of FP8 in this build / CPU")
@pytest.mark.parametrize("form", ["fp8-packed", "fp8"])
@pytest.mark.parametrize("B,d,kv,rep", [(16, 64, 2, 8), (16, 64, 2, 4), (2, 18, 1, 6), (8, 128, 1, 3),
                                        (4, 96, 2, 1), (32, 48, 1, 12), (6, 130, 2, 2), (16, 16, 1, 16),
                                        (32, 48, 1, 5), (64, 130, 2, 3), (16, 18, 1, 7), (128, 64, 1, 1),
                                        (16, 96, 3, 2)])
def test_paged_decode_attention_fp8_read_forms(form, B, d, kv, rep):
    """The fp32 form's two ways of reading FP8 KV (`native.fp8_reads`: by byte table, through fp16) read the same
    exact values: the same outputs to the bit where they also sum alike, and the twin's, over KV holding every
    e4m3 code but NaN (subnormals, both zeros, ±448) at random: head dims with and without 64-value runs and
    scalar tails, V read in place and through its fp32 copy, the lanes and the dot-product forms of packed K's
    scores, windows. Packed K in blocks of whole 16-token groups with at most 8 q heads a kv head is scored 16
    tokens a vector by the table read (scores_transposed.h: its dims summed in another order), so there the two
    agree to fp32 rounding and their bits differ (that form ran): head dims padded to 32 (18, 48, 130), blocks of
    16 to 128 tokens, groups cut by the window and by the position."""
    if form == "fp8-packed" and B % 2:
        B += 1
    g = gen("fp8reads", form, B, d, kv, rep)
    pos, active = [0, B - 1, 200 + B, 77], [True, True, True, True]
    nb = sum(p // B + 2 for p in pos) + 4
    buf, K, V = make_kv(g, form, nb, kv, B, d)
    codes = torch.randint(0, 256, buf.shape, generator=g, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x7E                                       # no NaN codes: ±448 instead
    buf.view(torch.uint8).copy_(codes)
    table = make_tables(g, nb, B, pos, active)
    q, sinks = randn(g, len(pos), kv * rep, d, scale=0.05), randn(g, kv * rep)
    for window in (0, 13):
        args = (q, K, V, table, torch.tensor(pos), torch.tensor(active), sinks, window, 1 / math.sqrt(d), KS, VS,
                F32)
        outs = {}
        for mode in ("table", "fp16"):
            # the fp32 form's reads: where AMX tiles are on they would take 5-8 q heads a kv head whatever the read
            with switched(native.fp8_reads, mode), (switched(native.amx_tiles, "off") if native.amx_tiles() == "on"
                                                    else contextlib.nullcontext()):
                outs[mode] = OPS.paged_decode_attention(*args)
        ref = twins.paged_decode_attention(*args)
        size = max(1.0, ref.abs().max().item())
        torch.testing.assert_close(outs["table"], ref, rtol=1e-5, atol=2e-5 * size)
        transposed = form == "fp8-packed" and B % 16 == 0 and rep <= 8
        if transposed:
            torch.testing.assert_close(outs["table"], outs["fp16"], rtol=1e-6, atol=1e-6 * size)
        assert torch.equal(outs["table"], outs["fp16"]) == (not transposed)
    with pytest.raises(RuntimeError, match="fp8_reads"):
        native.fp8_reads("bf16")


@pytest.mark.parametrize("form", KV_FORMS)
@pytest.mark.parametrize("rep,d", [(4, 64), (5, 64), (8, 64), (8, 32), (3, 48)])
def test_paged_decode_attention_v_paths(form, rep, d):
    """V rows read in place (every head of a kv group fits one register pass: rep <= 16 / (d / 16)) and
    through the block's fp32 copy (they do not), against the twin."""
    g = gen("vpath", form, rep, d)
    B, pos, active = 16, [5, 40, 130], [True, True, True]
    nb = 130 // B + 8
    buf, K, V = make_kv(g, form, nb, 2, B, d)
    table = make_tables(g, nb, B, pos, active)
    for window in (0, 20):
        check_attention(g, form, K, V, table, pos, active, 2 * rep, window)


@pytest.mark.parametrize("reads", FP8_READS)
@pytest.mark.parametrize("rep,B,d", [(8, 16, 64), (8, 2, 64), (7, 32, 18), (6, 8, 64), (3, 16, 96), (12, 4, 32),
                                     (16, 64, 64), (2, 16, 64)])
def test_paged_decode_attention_score_lanes(rep, B, d, reads):
    """Packed K scored with the heads in the vector lanes (a token pair per lane pair; two dims a lane group
    where fewer heads fill a vector; partly filled last groups; blocks of fewer than 16 tokens, cut by a window
    at an odd position, and of several 16-token rows) against the twin, with FP8 read through fp16 and, where the
    CPU has it, by byte table (which scores blocks of whole 16-token groups 16 tokens a vector instead)."""
    g = gen("lanes", rep, B, d)
    pos, active = [0, 3 * B + 1, 200, 77], [True, True, True, True]
    nb = 200 // B + 16
    buf, K, V = make_kv(g, "fp8-packed", nb, 2, B, d)
    table = make_tables(g, nb, B, pos, active)
    with switched(native.fp8_reads, reads):
        for window in (0, 13, 64):
            check_attention(g, "fp8-packed", K, V, table, pos, active, 2 * rep, window)


def test_paged_decode_attention_sliding_window_null_blocks():
    """Blocks wholly before a sliding window may be freed (table entry 0): no error, same result."""
    g = gen(13)
    B, d, nb = 4, 64, 40
    buf, K, V = make_kv(g, "fp8-packed", nb, 2, B, d)
    pos = [40, 13, 2]
    table = make_tables(g, nb, B, pos, [True] * 3)
    window = 6
    for b, p in enumerate(pos):
        table[b, : max(0, p - window + 1) // B] = 0
    assert (table[0] == 0).any()
    check_attention(g, "fp8-packed", K, V, table, pos, [True] * 3, 8, window)


@pytest.mark.parametrize("form", KV_FORMS)
@pytest.mark.parametrize("B,d", [(1, 48), (2, 2), (3, 72), (8, 80), (16, 130), (64, 48)])
@pytest.mark.parametrize("window", [0, 5])
def test_paged_decode_attention_reads_only_visible_kv(form, B, d, window):
    """K and V each in an allocation of their own, the buffer's last block holding a slot's last visible
    position, and NaN in every KV element no slot sees (past a position, before a window, in the blocks no table
    names): the output is the twin's and finite, so no element outside [lo, pos] enters a sum (where a
    sanitizer build runs the test, tools/sanitize_check.py, a read past either buffer's end is reported too).
    Head dims with vector tails or none at all, contexts of exactly whole blocks and one past, a padded slot."""
    if form == "fp8-packed" and B % 2:
        B += 1
    g = gen("visible", form, B, d, window)
    kv, rep = 2, 3
    pos = [3 * B - 1, 3 * B, 0, B + 6, 4]                   # 3 whole blocks, one past, one key, padded slot
    active = [True, True, True, True, False]
    blocks = [p // B + 1 for p in pos]
    nb = sum(blocks) + 3
    ids = (torch.randperm(nb - 2, generator=g) + 1).tolist()   # 1 .. nb - 2 in random order; nb - 1 below
    table = torch.zeros(len(pos), max(blocks) + 1, dtype=torch.long)
    used = 0
    for b, (n, a) in enumerate(zip(blocks, active)):
        if a:
            row = ids[used:used + n]
            used += n
            if b == 0:
                row[-1] = nb - 1                              # the last visible block is the buffer's last
            table[b, :n] = torch.tensor(row)
    seen = torch.zeros(nb, B, dtype=torch.bool)
    for b, (p, a) in enumerate(zip(pos, active)):
        lo = max(0, p - window + 1) if window else 0
        for t in range(lo, p + 1) if a else ():
            seen[table[b, t // B], t % B] = True
    k32, v32 = torch.randn(2, nb, kv, B, d, generator=g)        # token-major [nb, kv, B, d]
    for x in (k32, v32):
        x.permute(0, 2, 1, 3)[~seen] = float("nan")             # FP8: e4m3's NaN code
    dtype = {"fp8-packed": FP8, "fp8": FP8, "bf16": BF16, "fp32": F32}[form]
    K = (token_major_to_packed(k32) if form == "fp8-packed" else k32.clone()).to(dtype)
    V = v32.clone().to(dtype)
    q, sinks = randn(g, len(pos), kv * rep, d, scale=2.0), randn(g, kv * rep)
    args = (q, K, V, table, torch.tensor(pos), torch.tensor(active), sinks, window, 1 / math.sqrt(d), KS, VS, F32)
    with num_threads(2):
        out = OPS.paged_decode_attention(*args)
    ref = twins.paged_decode_attention(*args)
    assert ref.isfinite().all()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=2e-5 * max(1.0, ref.abs().max().item()))


@pytest.mark.parametrize("out_dtype", [torch.float16, torch.float64])
def test_paged_decode_attention_other_out_dtype_is_refused(out_dtype):
    g = gen(15)
    B, d, nb = 4, 16, 10
    buf, K, V = make_kv(g, "fp32", nb, 1, B, d)
    table = make_tables(g, nb, B, [9], [True], extra=0)
    args = (torch.randn(1, 2, d, generator=g), K, V, table, torch.tensor([9]), torch.tensor([True]), torch.zeros(2),
            0, 0.25, 1.0, 1.0, out_dtype)
    with pytest.raises(RuntimeError, match="out_dtype must be float32 or bfloat16"):
        OPS.paged_decode_attention(*args)


def test_paged_decode_attention_errors():
    g = gen(14)
    B, d, nb = 4, 16, 10
    buf, K, V = make_kv(g, "fp8-packed", nb, 1, B, d)
    q, sinks = torch.randn(2, 2, d), torch.zeros(2)
    table = make_tables(g, nb, B, [9, 5], [True, True], extra=0)      # 3 columns: positions < 12
    act = torch.tensor([True, True])

    def call(table, pos, window=0, active=act, k=K, v=V):
        return OPS.paged_decode_attention(q, k, v, table, torch.tensor(pos), active, sinks, window, 0.25, 1.0,
                                          1.0, F32)

    call(table, [9, 5])
    null = table.clone()
    null[1, 0] = 0                                     # the null block for visible position 0..3 of slot 1
    with pytest.raises(RuntimeError, match="slot 1: block id 0 out of range"):
        call(null, [9, 5])
    call(null, [9, 5], window=2)                       # ... fine once the window starts past it
    oob = table.clone()
    oob[0, 1] = nb                                     # a block id past the buffer
    with pytest.raises(RuntimeError, match="slot 0: block id 10 out of range"):
        call(oob, [9, 5])
    with pytest.raises(RuntimeError, match="slot 0: position 12 past its table"):
        call(table, [12, 5])
    with pytest.raises(RuntimeError, match="slot 1: position 16 past its table"):
        call(table, [9, 16])
    with pytest.raises(RuntimeError, match="position -1"):
        call(table, [9, -1])
    call(table, [9, 99], active=torch.tensor([True, False]))    # inactive slots are not checked
    with pytest.raises(RuntimeError, match="does not match V"):
        call(table, [9, 5], k=torch.zeros(nb, 1, B, d + 2))


# ---- paged_decode_attention_partial (decode context parallelism) -------------------------------------

def visible_nothing(first, pos, active) -> torch.Tensor:
    """[Bt] bool: slots that see no key (inactive, pos < 0 or first > pos), from the lists themselves."""
    return torch.tensor([not a or max(f, 0) > p for f, p, a in zip(first, pos, active)])


def check_partial(g, K, V, table, first, pos, active, nh):
    """Kernel against twin: out and lse close, -inf lse and zero out exactly on the slots that see nothing."""
    Bt, d = table.shape[0], V.shape[-1]
    q = randn(g, Bt, nh, d, scale=2.0)
    args = (q, K, V, table, torch.tensor(pos, dtype=torch.long), torch.tensor(first, dtype=torch.long),
            torch.tensor(active), 1.0 / math.sqrt(d), KS, VS)
    out, lse = OPS.paged_decode_attention_partial(*args)
    ref, ref_lse = twins.paged_decode_attention_partial(*args)
    assert out.shape == ref.shape == (Bt, nh, d) and lse.shape == ref_lse.shape == (Bt, nh)
    assert out.dtype == lse.dtype == ref.dtype == ref_lse.dtype == F32
    empty = visible_nothing(first, pos, active)
    for o, l in ((out, lse), (ref, ref_lse)):
        assert torch.equal(torch.isneginf(l), empty[:, None].expand(Bt, nh))
        assert torch.isfinite(l[~empty]).all() and torch.isfinite(o).all()
        assert torch.equal(o[empty], torch.zeros(int(empty.sum()), nh, d))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=2e-5 * max(1.0, ref.abs().max().item()))
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)
    return out, lse


def _partial_slots(g, B: int, long: int, Bt: int):
    """(first, pos, active) for Bt slots: the long contexts first (so one or two slots split their block
    range), then the awkward ones (nothing visible: first > pos or pos < 0; first == pos; first < 0; one whole
    block; first at a block edge; padded inactive slots), then random ranges (some empty), shuffled past 2."""
    fixed = [(long // 3 + 1, long, True), (0, long, True), (5, 5, True), (B + 1, B, True), (0, 0, True),
             (B, 2 * B - 1, True), (-3, B, True), (0, -1, True), (2 * B, 3 * B + 1, True), (0, 7, False),
             (3, long, False)]
    slots = fixed[:Bt]
    while len(slots) < Bt:
        p = int(torch.randint(0, long + 1, (1,), generator=g))
        f = int(torch.randint(-2, p + 3, (1,), generator=g))
        slots.append((f, p, bool(torch.rand(1, generator=g) < 0.9)))
    if Bt > 2:
        head, rest = slots[:2], slots[2:]
        slots = head + [rest[i] for i in torch.randperm(len(rest), generator=g).tolist()]
    return [s[0] for s in slots], [s[1] for s in slots], [s[2] for s in slots]


def partial_tables(g, nb, B, first, pos, active):
    """make_tables, then the blocks before each slot's range are freed (0) and a slot that sees nothing gets a
    row of junk ids (both never read)."""
    table = make_tables(g, nb, B, [max(p, 0) for p in pos], active)
    for b, (f, p, a) in enumerate(zip(first, pos, active)):
        if a and max(f, 0) > p:
            table[b] = torch.randint(-5, 2 * nb, (table.shape[1],), generator=g)
        elif a:
            table[b, : max(f, 0) // B] = 0
    return table


@pytest.mark.parametrize("form,B,d", _kv_cases())
def test_paged_decode_attention_partial(form, B, d):
    g = gen("partial", form, B, d)
    long = max(300, 12 * B) + int(torch.randint(0, B, (1,), generator=g))
    nb = long // B + 4
    # (kv heads, GQA rep, slots, threads): one or two long slots split over block ranges (4 threads: more
    # ranges), then batches with padded slots and empty / single-key ranges
    for kv, rep, Bt, threads in ((1, 1, 1, 4), (1, 3, 2, 2), (3, 1, 5, 2), (1, 8, 17, 2), (2, 3, 33, 4)):
        buf, K, V = make_kv(g, form, nb, kv, B, d)
        first, pos, active = _partial_slots(g, B, long, Bt)
        table = partial_tables(g, nb, B, first, pos, active)
        with num_threads(threads):
            check_partial(g, K, V, table, first, pos, active, kv * rep)


def _pieces(g, lo: int, p: int, n: int):
    """n disjoint (first, pos) pieces covering [lo, p] in order; any piece may be empty (first = pos + 1)."""
    cuts = sorted(int(c) for c in torch.randint(lo, p + 2, (n - 1,), generator=g))
    edges = [lo, *cuts, p + 1]
    return [(edges[i], edges[i + 1] - 1) for i in range(n)]


def merge_with_sink(parts, sinks):
    """Exact merge of partials (out_i [Bt, nh, d], lse_i [Bt, nh]) with the sink, in float64:
    M = max(lse_i, sink); out = Σ e^{lse_i-M} out_i / (Σ e^{lse_i-M} + e^{sink-M})."""
    outs = torch.stack([o.double() for o, _ in parts])            # [P, Bt, nh, d]
    lses = torch.stack([l.double() for _, l in parts])            # [P, Bt, nh]
    sink = sinks.double()[None, :]
    M = torch.maximum(lses.amax(0), sink)
    w = torch.exp(lses - M)                                       # e^{-inf} = 0 for empty pieces
    return (w[..., None] * outs).sum(0) / (w.sum(0) + torch.exp(sink - M))[..., None]


@pytest.mark.parametrize("form", KV_FORMS)
@pytest.mark.parametrize("threads", [1, 4])
def test_paged_decode_attention_partial_merges_to_the_full_op(form, threads):
    """Each slot's visible range [lo, p] split into 2-3 disjoint pieces (first / pos differ per call, some
    pieces empty), their partials merged with the sink, must give paged_decode_attention over the whole range
    with that sink (sliding: window = p - lo + 1 for every slot; full: lo = 0): for the kernels and the twins."""
    g = gen("partial-merge", form, threads)
    for B, d, kv, rep in ((2, 18, 1, 3), (4, 64, 2, 4), (16, 16, 1, 8)):
        if form != "fp8-packed" and B == 2:
            B = 1
        long = 37 * B + 3
        nb = long // B + 4
        pos = [long, 3 * B + 1, 0, B - 1, 9 * B, 11]
        active = [True, True, True, True, True, False]
        nh = kv * rep
        buf, K, V = make_kv(g, form, nb, kv, B, d)
        q = randn(g, len(pos), nh, d, scale=2.0)
        sinks = randn(g, nh)
        scale = 1.0 / math.sqrt(d)
        pos_t, act_t = torch.tensor(pos), torch.tensor(active)
        for window in (0, 8 * B + 1, 5):
            lo = [max(0, p - window + 1) if window else 0 for p in pos]
            table = make_tables(g, nb, B, pos, active, extra=0)
            for b, l in enumerate(lo):
                table[b, : l // B] = 0                                # freed blocks before the window
            n = 3 if window != 5 else 2
            pieces = [_pieces(g, l, p, n) for l, p in zip(lo, pos)]  # [slot][piece] -> (first, pos)
            with num_threads(threads):
                for impl in (OPS, twins):
                    parts = [impl.paged_decode_attention_partial(
                        q, K, V, table, torch.tensor([pieces[b][i][1] for b in range(len(pos))]),
                        torch.tensor([pieces[b][i][0] for b in range(len(pos))]), act_t, scale, KS, VS)
                        for i in range(n)]
                    merged = merge_with_sink(parts, sinks).float().reshape(len(pos), nh * d)
                    full = impl.paged_decode_attention(q, K, V, table, pos_t, act_t, sinks, window, scale, KS, VS,
                                                       F32)
                    torch.testing.assert_close(merged, full, rtol=1e-5,
                                               atol=2e-5 * max(1.0, full.abs().max().item()))
                    assert torch.equal(merged[~act_t], torch.zeros(int((~act_t).sum()), nh * d))
        # the wrapper calls the kernel
        first_t = torch.tensor([pieces[b][0][0] for b in range(len(pos))])
        got = native.paged_decode_attention_partial(q, K, V, table, pos_t, first_t, act_t, scale, KS, VS)
        want = OPS.paged_decode_attention_partial(q, K, V, table, pos_t, first_t, act_t, scale, KS, VS)
        assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_paged_decode_attention_partial_errors():
    g = gen("partial-errors")
    B, d, nb = 4, 16, 10
    buf, K, V = make_kv(g, "fp8-packed", nb, 1, B, d)
    q = torch.randn(2, 2, d, generator=g)
    table = make_tables(g, nb, B, [9, 5], [True, True], extra=0)      # 3 columns: positions < 12
    act = torch.tensor([True, True])

    def call(table, first, pos, active=act, k=K, v=V, q=q):
        first = first if isinstance(first, torch.Tensor) else torch.tensor(first)
        return OPS.paged_decode_attention_partial(q, k, v, table, torch.tensor(pos), first, active, 0.25, 1.0, 1.0)

    call(table, [0, 0], [9, 5])
    null = table.clone()
    null[1, 0] = 0                                     # the null block for positions 0..3 of slot 1
    with pytest.raises(RuntimeError, match="slot 1: block id 0 out of range"):
        call(null, [0, 3], [9, 5])
    call(null, [0, 4], [9, 5])                         # ... fine once the range starts past it
    oob = table.clone()
    oob[0, 1] = nb                                     # a block id past the buffer (positions 4..7)
    with pytest.raises(RuntimeError, match="slot 0: block id 10 out of range"):
        call(oob, [7, 0], [9, 5])
    with pytest.raises(RuntimeError, match="slot 0: block id -1 out of range"):
        call(torch.full_like(table, -1), [3, 9], [3, 5])
    call(oob, [8, 0], [9, 5])
    with pytest.raises(RuntimeError, match="slot 0: position 12 past its table"):
        call(table, [11, 0], [12, 5])
    # nothing visible is not checked: first > pos, pos < 0, inactive
    junk = torch.full_like(table, nb + 7)
    out, lse = call(junk, [13, 0], [12, -1])
    assert torch.isneginf(lse).all() and not out.any()
    call(table, [0, 0], [9, 99], active=torch.tensor([True, False]))
    # shapes and dtypes
    with pytest.raises(RuntimeError, match="first must be int64"):
        call(table, torch.tensor([0, 0], dtype=torch.int32), [9, 5])
    with pytest.raises(RuntimeError, match="first must be int64"):
        call(table, [0, 0, 0], [9, 5])
    with pytest.raises(RuntimeError, match="pos \\(int64\\) and active"):
        call(table, [0, 0], [9, 5, 1])
    with pytest.raises(RuntimeError, match="table must be int64"):
        call(table[:1], [0, 0], [9, 5])
    with pytest.raises(RuntimeError, match="q must be float32"):
        call(table, [0, 0], [9, 5], q=q.to(BF16))
    with pytest.raises(RuntimeError, match="does not fit KV heads"):
        call(table, [0, 0], [9, 5], q=torch.zeros(2, 2, d + 2))
    with pytest.raises(RuntimeError, match="does not match V"):
        call(table, [0, 0], [9, 5], k=torch.zeros(nb, 1, B, d + 2))
