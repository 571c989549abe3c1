"""The native CPU kernels (`gigadecode.native`, csrc/) against their torch twins (`gigadecode.native.twins`),
over awkward shapes: odd row counts, reductions that are not a multiple of the vector width (scalar tails),
odd expert counts with idle experts and EP offsets, every KV layout (packed FP8, plain FP8 / bf16 / fp32) with
odd head dims, block sizes 1..64, GQA, padded batch slots, positions at block edges, sliding windows and the
block-range split of long contexts. Skipped as a whole where the kernels cannot be built here.

The kernels are called through `torch.ops.gigadecode_native` directly (not the Python wrappers, which fall
back to the twins), so a pass here is about the C++ code.
"""

from __future__ import annotations

import contextlib
import math
import os
import zlib

import pytest
import torch

from gigadecode import native
from gigadecode.kv.cache import FP8, pack_k_view
from gigadecode.mxfp4 import encode_mxfp4
from gigadecode.native import twins

OPS = native.load()
if OPS is None:
    pytest.skip(f"native kernels not available here: {native.status()}", allow_module_level=True)

F32, BF16 = torch.float32, torch.bfloat16
NAMES = {F32: "f32", BF16: "bf16"}
BF16_RTOL = 2.0 ** -8          # bf16 round-to-nearest: at most half an ulp = 2^-8 of the value


def gen(*key) -> torch.Generator:
    """A generator seeded from `key` (stable across runs, unlike hash())."""
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def randn(g: torch.Generator, *shape, dtype=F32, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


@contextlib.contextmanager
def num_threads(n: int):
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def assert_rounded(out: torch.Tensor, ref32: torch.Tensor, atol: float) -> None:
    """A bf16 result against the fp32 reference it rounds: within bf16 rounding (+ atol for fp32 order)."""
    assert out.dtype == BF16 and ref32.dtype == F32
    torch.testing.assert_close(out.float(), ref32, rtol=BF16_RTOL, atol=atol)


def bits(t: torch.Tensor) -> torch.Tensor:
    """Bit patterns (so -0.0 != +0.0)."""
    return t.view({F32: torch.int32, BF16: torch.int16, FP8: torch.uint8}[t.dtype])


# the forms the products of bf16 inputs and bf16-exact weights (experts, dense bf16 weights) can take on this
# build (`native.product_form`)
PRODUCT_FORMS = ["bf16", "fp32"] if native.isa() == "avx512-bf16" else ["fp32"]


# ... those, each with AMX tiles off, plus 'amx' where the CPU has AMX-BF16 (`native.amx_tiles`): the MoE's
# experts with 5+ inputs and linear's bf16 weights at 16+ rows on AMX tiles, the rest in the measured form
AMX = native.amx_tiles() != "unavailable"
ALL_FORMS = PRODUCT_FORMS + (["amx"] if AMX else [])


@contextlib.contextmanager
def products(form: str):
    """moe_mxfp4 and linear multiplying bf16 inputs in `form` ('bf16' dot products or 'fp32' FMAs, AMX tiles
    off; 'amx': AMX tiles on), restored after."""
    before, amx_before = native.product_form(), native.amx_tiles()
    if form != "amx":
        native.product_form(form)
    if AMX:
        native.amx_tiles("on" if form == "amx" else "off")
    try:
        yield
    finally:
        native.product_form(before)
        if AMX:
            native.amx_tiles(amx_before)


# ---- linear ------------------------------------------------------------------------------------------

# 40, 95, 130: past 32, where CPUs without bf16 GEMMs still take it (AVX2: strips of rows converted once from 40)
LIN_M = (1, 2, 3, 5, 8, 17, 33, 40, 95, 130)
LIN_N = (1, 3, 33, 130)


# bf16 x bf16 under each product form (AVX-512 from 4 rows: the pair tiles, in fp32, unless the form is bf16)
# (and on AMX tiles from 5 rows, where the CPU has them: K even; 5, 8, 17, 33, 40, 95, 130 rows: blocks of 32 inputs
# and their tails, N = 130: strips of 64 rows and a short one)
LIN_CASES = [(F32, F32, None)] + [(BF16, BF16, f) for f in ALL_FORMS] + [(F32, BF16, None), (BF16, F32, None)]


@pytest.mark.parametrize("xdt,wdt,form", LIN_CASES,
                         ids=[f"{NAMES[x]}x-{NAMES[w]}w" + (f"-{f}" if f else "") for x, w, f in LIN_CASES])
@pytest.mark.parametrize("K", [1, 7, 70, 200, 64, 1024])
def test_linear(xdt, wdt, form, K):
    with products(form or native.product_form()):
        check_linear(xdt, wdt, K)


def check_linear(xdt, wdt, K):
    g = gen(K)
    for N in LIN_N:
        w = randn(g, N, K, dtype=wdt)
        biases = (None, randn(g, N, dtype=F32), randn(g, N, dtype=BF16))
        for M in LIN_M:
            x = randn(g, M, K, dtype=xdt)
            for b in biases:
                out = OPS.linear(x, w, b)
                assert out.shape == (M, N) and out.dtype == xdt
                ref32 = twins.linear(x.float(), w, b)
                atol = 1e-5 * math.sqrt(K)
                if xdt == F32:
                    torch.testing.assert_close(out, ref32, rtol=1e-5, atol=atol)
                else:
                    assert_rounded(out, ref32, atol)


def test_linear_multithreaded_and_empty():
    g = gen(1)
    w, b = randn(g, 130, 200, dtype=BF16), randn(g, 130)
    for M in (5, 41):                                 # 41: AVX2's strips of rows, over 4 threads
        x = randn(g, M, 200)
        with num_threads(4):
            out = OPS.linear(x, w, b)
        torch.testing.assert_close(out, twins.linear(x, w, b), rtol=1e-5, atol=2e-4)
    assert OPS.linear(torch.zeros(0, 200), w, b).shape == (0, 130)


@pytest.mark.parametrize("bf16_gemm", [True, False])
def test_linear_row_limit_follows_the_bf16_gemm(monkeypatch, bf16_gemm):
    """`native.linear` hands rows past its limit to `gemm.linear`: past 32 where the CPU has bf16 GEMMs (or
    the weight is fp32), past 96 for a bf16 weight where it has none (its GEMM converts the weight first),
    past 256 there on the AVX2 build (which converts the weight's rows once per strip itself)."""
    from gigadecode import gemm
    monkeypatch.setattr(gemm, "BF16_GEMM_IN_BF16", bf16_gemm)
    to_gemm = []
    monkeypatch.setattr(gemm, "linear", lambda x, w, b=None: to_gemm.append(x.shape[0]) or twins.linear(x, w, b))
    g = gen("limit")
    w16, w32 = randn(g, 24, 40, dtype=BF16), randn(g, 24, 40)
    rows = (32, 33, 96, 97, 256, 257)
    for M in rows:
        x = randn(g, M, 40, dtype=BF16)
        for w in (w16, w32):
            assert_rounded(native.linear(x, w), twins.linear(x.float(), w), 1e-5 * math.sqrt(40))
    past = 32 if bf16_gemm else 256 if native.isa() == "avx2" else 96
    assert to_gemm == [M for M in rows for w_is_16 in (True, False) if M > (past if w_is_16 else 32)]


def test_linear_shape_errors():
    with pytest.raises(RuntimeError, match="linear: x"):
        OPS.linear(torch.zeros(2, 7), torch.zeros(3, 8), None)
    with pytest.raises(RuntimeError, match="linear: x"):
        OPS.linear(torch.zeros(2, 3, 8), torch.zeros(3, 8), None)
    with pytest.raises(RuntimeError, match="bias has 4 values for 3 rows"):
        OPS.linear(torch.zeros(2, 8), torch.zeros(3, 8), torch.zeros(4))
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        OPS.linear(torch.zeros(2, 8, dtype=torch.float64), torch.zeros(3, 8), None)


# ---- rms_norm ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("xdt", [F32, BF16])
@pytest.mark.parametrize("wdt", [F32, BF16])
def test_rms_norm(xdt, wdt):
    g = gen(2)
    for H in (1, 33, 100, 2880):
        w = randn(g, H, dtype=wdt)
        for M in (1, 3, 17):
            x = randn(g, M, H, dtype=xdt, scale=3.0)
            for eps in (1e-5, 1e-2):
                out = OPS.rms_norm(x, w, eps)
                assert out.shape == x.shape and out.dtype == xdt
                ref32 = twins.rms_norm(x.float(), w, eps)
                if xdt == F32:
                    torch.testing.assert_close(out, ref32, rtol=1e-5, atol=1e-6)
                else:
                    assert_rounded(out, ref32, 1e-6)


# ---- mxfp4_dequant (exact) ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("lead", [(3, 5), (7,), (), (1, 1)], ids=["E3R5", "R7", "G-only", "E1R1"])
def test_mxfp4_dequant_exact(dtype, lead):
    g = gen(3)
    for G in (1, 2, 5):
        # encoded weights
        w = randn(g, *lead, G * 32, scale=0.1)
        if not lead:
            w = w.view(1, G * 32)
        blocks, scales = encode_mxfp4(w)
        if not lead:                                 # blocks [G, 16], scales [G]: one row, no row dim
            blocks, scales = blocks[0], scales[0]
        out = OPS.mxfp4_dequant(blocks, scales, dtype)
        ref = twins.mxfp4_dequant(blocks, scales, dtype)
        assert out.shape == ref.shape == (*scales.shape[:-1], G * 32) and out.dtype == dtype
        assert torch.equal(bits(out), bits(ref))
        # random bytes, scales 2^-27 .. 2^23 (no inf)
        blocks = torch.randint(0, 256, (*lead, G, 16), generator=g, dtype=torch.uint8)
        scales = torch.randint(100, 151, (*lead, G), generator=g, dtype=torch.uint8)
        out = OPS.mxfp4_dequant(blocks, scales, dtype)
        ref = twins.mxfp4_dequant(blocks, scales, dtype)
        assert torch.equal(bits(out), bits(ref))


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_mxfp4_dequant_every_scale_and_noncontiguous(dtype):
    g = gen(4)
    # every code with every scale byte: 0 (a subnormal power of two) .. 254, and 255 (inf, 0 * inf = nan)
    codes = torch.arange(256, dtype=torch.uint8).view(16, 16)
    blocks = codes.expand(256, 16, 16).contiguous().view(256, 16, 16)    # [R=256, G=16, 16]
    scales = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(256, 1).expand(256, 16).contiguous()
    out = OPS.mxfp4_dequant(blocks, scales, dtype)
    ref = twins.mxfp4_dequant(blocks, scales, dtype)
    fin = torch.isfinite(ref)
    assert torch.equal(bits(out)[fin], bits(ref)[fin])
    torch.testing.assert_close(out, ref, rtol=0, atol=0, equal_nan=True)
    # a strided slice of the rows (the kernel copies to contiguous)
    blocks = torch.randint(0, 256, (3, 9, 4, 16), generator=g, dtype=torch.uint8)[:, 1::2]
    scales = torch.randint(110, 140, (3, 9, 4), generator=g, dtype=torch.uint8)[:, 1::2]
    assert not blocks.is_contiguous()
    assert torch.equal(bits(OPS.mxfp4_dequant(blocks, scales, dtype)), bits(twins.mxfp4_dequant(blocks, scales, dtype)))
    with num_threads(4):                          # parallel over >= 2048 groups
        blocks = torch.randint(0, 256, (2, 70, 40, 16), generator=g, dtype=torch.uint8)
        scales = torch.randint(100, 151, (2, 70, 40), generator=g, dtype=torch.uint8)
        out = OPS.mxfp4_dequant(blocks, scales, dtype)
    assert torch.equal(bits(out), bits(twins.mxfp4_dequant(blocks, scales, dtype)))


def test_mxfp4_dequant_errors():
    b, s = torch.zeros(2, 3, 16, dtype=torch.uint8), torch.zeros(2, 3, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="shape mismatch"):
        OPS.mxfp4_dequant(b, s[:, :2], F32)
    with pytest.raises(RuntimeError, match="dtype"):
        OPS.mxfp4_dequant(b, s, torch.float16)


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_mxfp4_dequant_into_writes_the_same_values_in_place(dtype):
    g = gen(5)
    for lead, G in (((3, 5), 4), ((7,), 1), ((2, 33), 3)):
        blocks = torch.randint(0, 256, (*lead, G, 16), generator=g, dtype=torch.uint8)
        scales = torch.randint(100, 151, (*lead, G), generator=g, dtype=torch.uint8)
        out = torch.full((*lead, G * 32), float("nan"), dtype=dtype)
        ptr = out.data_ptr()
        assert OPS.mxfp4_dequant_into(blocks, scales, out) is None
        assert out.data_ptr() == ptr
        assert torch.equal(bits(out), bits(twins.mxfp4_dequant(blocks, scales, dtype)))
    with pytest.raises(RuntimeError, match="contiguous"):
        OPS.mxfp4_dequant_into(blocks, scales, torch.empty(*lead, G * 32 + 1, dtype=dtype)[..., 1:])
    with pytest.raises(RuntimeError, match="contiguous"):
        OPS.mxfp4_dequant_into(blocks, scales, torch.empty(*lead, G * 16, dtype=dtype))
    with pytest.raises(RuntimeError, match="dtype"):
        OPS.mxfp4_dequant_into(blocks, scales, torch.empty(*lead, G * 32, dtype=torch.float16))


# ---- swiglu ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("T,I", [(1, 1), (3, 17), (33, 64), (8, 1000)])
def test_swiglu_against_twin(dtype, T, I):
    """The clamped SwiGLU over interleaved (gate, up) columns: values far past the clamp on both sides, tails
    shorter than a vector; fp32 math rounded once, so bf16 results are the twin's (fp32 math, one rounding)
    to within one bf16 rounding, fp32 to a few ulp (the vectorized exp)."""
    g = gen(6, T, I)
    gate_up = randn(g, T, 2 * I, scale=6.0, dtype=dtype)
    out = OPS.swiglu(gate_up, 1.702, 7.0)
    ref32 = twins.swiglu(gate_up.float(), 1.702, 7.0)
    assert out.shape == (T, I) and out.dtype == dtype
    if dtype == F32:
        torch.testing.assert_close(out, ref32, rtol=1e-6, atol=1e-6)
    else:
        assert_rounded(out, ref32, 1e-6)


def test_swiglu_refuses_odd_columns():
    with pytest.raises(RuntimeError, match=r"\[T, 2I\]"):
        OPS.swiglu(torch.zeros(2, 5), 1.702, 7.0)


# ---- moe_mxfp4 ---------------------------------------------------------------------------------------

def _moe_cases():
    """(T, E, k, H, I, offset, x dtype, bias dtype, limit): every (E, k) with k <= min(4, E) at every T."""
    dims = [(32, 32), (64, 96), (96, 64), (160, 160), (32, 160), (160, 32)]
    cases, i = [], 0
    for E in (1, 3, 7):
        for k in range(1, min(4, E) + 1):
            for T in (1, 2, 5, 33):
                H, I = dims[i % len(dims)]
                offset = (0, 2, 5)[i % 3]
                xdt = (F32, BF16)[(i // 2) % 2]
                bdt = (F32, BF16)[(i // 3) % 2]
                limit = (7.0, 0.3)[(i // 5) % 2]
                name = f"T{T}-E{E}-k{k}-H{H}-I{I}-off{offset}-x{NAMES[xdt]}-bias{NAMES[bdt]}-lim{limit}"
                cases.append(pytest.param(T, E, k, H, I, offset, xdt, bdt, limit, id=name))
                i += 1
    return cases


def _moe_weights(g, E, H, I, bdt):
    gu_b, gu_s = encode_mxfp4(randn(g, E, 2 * I, H, scale=0.1))
    dn_b, dn_s = encode_mxfp4(randn(g, E, H, I, scale=0.1))
    return gu_b, gu_s, randn(g, E, 2 * I, dtype=bdt, scale=0.1), dn_b, dn_s, randn(g, E, H, dtype=bdt, scale=0.1)


def _routing(g, T, E, k, offset, n_global):
    """idx [T, k] of distinct global ids per token, drawn from all ids but one local expert (idle) when E >= 3;
    tokens 0 and 1 share their experts (one expert hit by several tokens)."""
    idle = offset + 1 if E >= 3 and n_global - 1 >= k else None
    cand = [e for e in range(n_global) if e != idle]
    rows = [torch.tensor(cand)[torch.randperm(len(cand), generator=g)[:k]] for _ in range(T)]
    if T >= 2:
        rows[1] = rows[0].flip(0)
    idx = torch.stack(rows).long()
    gate_w = torch.softmax(torch.randn(T, k, generator=g), -1)
    return idx, gate_w


# The AVX2 build's MoE takes bf16 activations as int16 per group of 32 (mxfp4_avx2.h `QChunk`); fp32
# activations and the AVX-512 builds compute on the exact values.
QUANTIZED_BF16_MOE = native.isa() == "avx2"
def quantize_groups_i16(x: torch.Tensor) -> torch.Tensor:
    """x [n, K] fp32 -> the values the AVX2 kernel multiplies: per group of 32 (the last one short), q = round(x ·
    32767 / m) (m = the group's max |x|), times m / 32767."""
    n, K = x.shape
    xp = torch.nn.functional.pad(x, (0, -K % 32)).view(n, -1, 32)
    m = xp.abs().amax(-1, keepdim=True)
    q = torch.where(m > 0, torch.round(xp * (32767.0 / m)).clamp(-32767, 32767) * (m / 32767.0), torch.zeros_like(xp))
    return q.view(n, -1)[:, :K]


def moe_reference_quantized(x, idx, gate_w, weights, alpha, limit, offset, quantize=True):
    """The twin's math in fp32 on the inputs and the (bf16-rounded) activations through `quantize_groups_i16`,
    as the AVX2 kernel computes bf16 activations (`quantize=False`: on the values as they are). Also returns, per
    output, what one activation's bf16 rounding going the other way moves it by at most (2^-8 of the largest
    |gate · w2[h, j] · a_j|): the kernel's SwiGLU (a vectorized exp within a few ulp) and its fp32 sums (in the
    order of its form: register tiles, AMX tiles) can round an activation to the neighbouring bf16 value."""
    gu_b, gu_s, gu_bias, dn_b, dn_s, dn_bias = weights
    xf, out = x.float(), torch.zeros(x.shape, dtype=F32)
    flip = torch.zeros(x.shape, dtype=F32)
    e = idx - offset
    for le in torch.unique(e).tolist():
        if not 0 <= le < gu_b.shape[0]:
            continue
        tok, slot = torch.where(e == le)
        w1 = twins.mxfp4_dequant(gu_b[le], gu_s[le], F32)
        w2 = twins.mxfp4_dequant(dn_b[le], dn_s[le], F32)
        q = quantize_groups_i16 if quantize else (lambda v: v)
        h = q(xf[tok]) @ w1.T + gu_bias[le].float()
        a = twins.swiglu(h, alpha, limit).to(BF16).float()
        y = q(a) @ w2.T + dn_bias[le].float()
        g = gate_w[tok, slot, None].float()
        out.index_add_(0, tok, y * g)
        flip.index_add_(0, tok, 2.0 ** -8 * (a.abs()[:, None, :] * w2.abs()[None]).amax(-1) * g.abs())
    return out.to(x.dtype), flip


def _check_moe(x, idx, gate_w, weights, alpha, limit, offset):
    out = OPS.moe_mxfp4(x, idx, gate_w, *weights, alpha, limit, offset)
    ref = twins.moe_mxfp4(x, idx, gate_w, *weights, alpha, limit, offset)   # bf16 x: bf16 activations too
    assert out.shape == x.shape and out.dtype == x.dtype
    atol = 1e-5 * max(1.0, ref.float().abs().max().item())
    if x.dtype == F32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=atol)
        return out, ref
    ref_q, flip = moe_reference_quantized(x, idx, gate_w, weights, alpha, limit, offset, QUANTIZED_BF16_MOE)
    if QUANTIZED_BF16_MOE:
        ref = ref_q
    # both round once at the end (two bf16 steps apart at most) and the activations once (an activation's
    # rounding may go the other way: `flip`, twice for two of them)
    err = (out.float() - ref.float()).abs()
    assert (err <= 2 * BF16_RTOL * ref.float().abs() + 8 * atol + 2 * flip).all(), err.max()
    if QUANTIZED_BF16_MOE:   # and most outputs are the reference's to the bit (the flips are rare)
        assert (err == 0).float().mean() >= 0.8, (err == 0).float().mean()
    return out, ref


@pytest.mark.parametrize("T,E,k,H,I,offset,xdt,bdt,limit", _moe_cases())
def test_moe_mxfp4(T, E, k, H, I, offset, xdt, bdt, limit):
    g = gen(1000 * E + 10 * k + T)
    weights = _moe_weights(g, E, H, I, bdt)
    n_global = offset + E + (3 if offset else 0)           # EP: ids below and above the local range
    idx, gate_w = _routing(g, T, E, k, offset, n_global)
    x = randn(g, T, H, dtype=xdt, scale=2.0)
    out, ref = _check_moe(x, idx, gate_w, weights, 1.702, limit, offset)
    local = ((idx >= offset) & (idx < offset + E)).any(1)
    assert torch.equal(out[~local].float(), torch.zeros_like(ref[~local]))   # tokens routed elsewhere: 0


def test_moe_mxfp4_edge_routing():
    g = gen(5)
    E, H, I = 3, 64, 32
    weights = _moe_weights(g, E, H, I, F32)
    x = randn(g, 6, H)
    # every pair outside the local range [4, 7): all zeros (the kernel's P == 0 path)
    idx = torch.tensor([[0, 1], [2, 3], [7, 8], [9, 0], [1, 3], [8, 2]])
    out, _ = _check_moe(x, idx, torch.full((6, 2), 0.5), weights, 1.702, 7.0, 4)
    assert torch.equal(out, torch.zeros_like(x))
    # one token routed twice to the same expert, bf16 gate weights, many threads
    idx = torch.tensor([[1, 1], [0, 2], [2, 2], [1, 0], [0, 0], [2, 1]])
    with num_threads(4):
        _check_moe(x, idx, torch.rand(6, 2, generator=g).to(BF16), weights, 1.702, 7.0, 0)
    # large activations: the swiglu clamps bite
    _check_moe(x * 40, idx, torch.rand(6, 2, generator=g), weights, 1.702, 7.0, 0)


@pytest.mark.parametrize("form", ALL_FORMS)
@pytest.mark.parametrize("H,I,xdt", [(160, 96, BF16), (256, 128, BF16), (32, 288, BF16), (1024, 64, BF16),
                                     (160, 96, F32), (1024, 64, F32)])
def test_moe_mxfp4_many_tokens_per_expert(H, I, xdt, form):
    """Experts hit by >= 8 tokens take the strip path (rows decoded once, scaled, then dense tiles: bf16 dot
    products or fp32 FMAs for bf16 inputs, `form`; fp32 FMAs for fp32 inputs, whose fp32 inputs and decoded rows
    are padded so that rows of 1024 values do not fall in the same cache sets); a strip with a scale outside
    [2, 252] (whose scaled values cannot all be normal numbers) falls back to the register tiles. Both against
    the twin, with a few tokens per expert (register tiles) alongside."""
    g = gen(11)
    E = 3
    gu_b, gu_s, gu_bias, dn_b, dn_s, dn_bias = _moe_weights(g, E, H, I, BF16)
    gu_s[1, :5] = 1                                    # expert 1: gate_up rows 0..4 scaled 2^-126 …
    dn_s[2, 7, 0] = 0                                  # … expert 2: one group of a down row 2^-127 (subnormal)
    T = 29
    idx = torch.stack([torch.tensor([0, 1]) if t % 2 else torch.tensor([1, 2]) for t in range(T)])
    idx[:3] = torch.tensor([2, 0])                      # expert 0: 17 tokens, 1: 29, 2: 15
    gate_w = torch.softmax(torch.randn(T, 2, generator=g), -1)
    x = randn(g, T, H, dtype=xdt, scale=2.0)
    with products(form):
        _check_moe(x, idx, gate_w, (gu_b, gu_s, gu_bias, dn_b, dn_s, dn_bias), 1.702, 7.0, 0)


def test_moe_product_forms_agree():
    """The product forms multiply the same exact products (bf16 values, MXFP4 values times a power of two) and
    sum them in fp32 in different orders: their outputs agree to a bf16 rounding, with 1, 2, 5 and 12 tokens an
    expert (the bf16 tile of one input; fp32 register tiles; strips); the form can be set, asked and measured
    again ('auto'), and anything else is refused."""
    g = gen(13)
    E, H, I = 4, 256, 160
    weights = _moe_weights(g, E, H, I, BF16)
    idx = torch.tensor([0] + [1] * 2 + [2] * 5 + [3] * 12).view(-1, 1)
    T = len(idx)
    x = randn(g, T, H, dtype=BF16, scale=2.0)
    outs = {}
    for form in ALL_FORMS:
        with products(form):
            assert form == "amx" and native.amx_tiles() == "on" or native.product_form() == form
            outs[form] = OPS.moe_mxfp4(x, idx, torch.ones(T, 1), *weights, 1.702, 7.0, 0)
    for form in ALL_FORMS:
        torch.testing.assert_close(outs["fp32"].float(), outs[form].float(), rtol=2 * BF16_RTOL, atol=1e-4)
    before = native.product_form()
    assert native.product_form("auto") in PRODUCT_FORMS
    native.product_form(before)
    with pytest.raises(RuntimeError, match="product_form"):
        native.product_form("int8")
    if "bf16" not in PRODUCT_FORMS:
        with pytest.raises(RuntimeError, match="no bf16 dot products"):
            native.product_form("bf16")


@pytest.mark.skipif(not AMX, reason="the CPU has no AMX-BF16 tiles (or the build no bf16 dot products)")
@pytest.mark.parametrize("H,I,offset", [(160, 96, 0), (736, 224, 2), (96, 1056, 0)])
def test_moe_mxfp4_amx_form(H, I, offset):
    """The AMX forms (`amx_tiles.h`): experts with 5 to 16 bf16 inputs on our own tile code (one tile of
    inputs), more through oneDNN's GEMM in blocks of 32 inputs (partial and whole blocks); experts of 1-4 inputs
    alongside (the other forms); strips of 64 rows (R = 192, 160, 448, 736, 2112, 96: whole and short last
    strips), rows whose group count is not a multiple of four (the chunk-padded K: H = 160, 736, 96), in each
    AMX form an expert with a scale outside [2, 252] (its values not all normal bf16: that strip falls back to
    the bf16 tiles), EP ids outside the local range; against the twin, and agreeing with the AMX form off to a
    bf16 rounding. The switch can be asked, set and refused."""
    g = gen(H + I)
    counts = [5, 8, 1, 16, 17, 31, 32, 4, 33, 70, 2, 12]   # first slots; a second slot for every fifth token
    E = len(counts)
    ids = torch.tensor([e for e, c in enumerate(counts) for _ in range(c)])
    T = len(ids)
    other = torch.full((T,), offset + E + 1)           # routed to another rank (outside the local range) ...
    other[::5] = torch.where(ids[::5] == 9, 6, 9) + offset   # ... or to one of the experts with many
    idx = torch.stack([ids + offset, other], 1)[torch.randperm(T, generator=g)]
    n = torch.bincount(idx.flatten() - offset, minlength=E + 2)[:E]
    small, tiled, gemm = [(n >= lo) & (n <= hi) for lo, hi in ((1, 4), (5, 16), (17, 10**6))]
    assert small.sum() >= 2 and tiled.sum() >= 3 and gemm.sum() >= 3, n.tolist()
    gu_b, gu_s, gu_bias, dn_b, dn_s, dn_bias = _moe_weights(g, E, H, I, BF16)
    e_tiled, e_gemm = int(tiled.nonzero()[1]), int(gemm.nonzero()[1])
    gu_s[e_tiled, 70] = 1                              # one gate_up row in the second strip at 2^-126
    gu_s[e_gemm, 70] = 1
    dn_s[e_tiled, 2, 0] = 0                            # a down group at 2^-127 (subnormal)
    dn_s[e_gemm, 2, 0] = 0
    weights = (gu_b, gu_s, gu_bias, dn_b, dn_s, dn_bias)
    gate_w = torch.softmax(torch.randn(T, 2, generator=g), -1)
    x = randn(g, T, H, dtype=BF16, scale=2.0)
    outs = {}
    for form in ("amx", "fp32"):
        with products(form), num_threads(3):
            outs[form], _ = _check_moe(x, idx, gate_w, weights, 1.702, 7.0, offset)
    _, flip = moe_reference_quantized(x, idx, gate_w, weights, 1.702, 7.0, offset, quantize=False)
    err = (outs["amx"].float() - outs["fp32"].float()).abs()          # a bf16 rounding, or an activation's
    assert (err <= 2 * BF16_RTOL * outs["fp32"].float().abs() + 1e-4 + 2 * flip).all(), err.max()
    before = native.amx_tiles()
    auto = "off" if os.environ.get("GIGADECODE_AMX") == "0" else "on"      # 'auto' decides again, as at start
    assert native.amx_tiles("off") == "off" and native.amx_tiles("auto") == auto
    native.amx_tiles(before)
    with pytest.raises(RuntimeError, match="amx_tiles"):
        native.amx_tiles("int8")


def test_moe_mxfp4_bf16_wide_range_and_nan():
    """Groups whose values span 2^12 (one value far above the rest), all-zero groups and an odd group count (the
    tail chunk) stay within the bf16 bound of the twin — on AVX2, of the twin on the int16-quantized inputs the
    kernel multiplies, which round the small values of such a group to 2^-16 of its largest: that rounding is
    bounded here against the exact values; a NaN in one token's input makes that token's output NaN and leaves
    the others as they were without it."""
    g = gen(23)
    E, H, I = 4, 96, 64                                # 3 groups of 32 per input row: an odd last chunk
    weights = _moe_weights(g, E, H, I, BF16)
    T = 5
    x = randn(g, T, H, scale=0.01)
    x[:, ::32] = 40.0                                  # each group: one value ~2^12 above the others
    x[1, 32:64] = 0                                    # an all-zero group
    x = x.to(BF16)
    idx = torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0], [0, 2]])
    gate_w = torch.softmax(torch.randn(T, 2, generator=g), -1)
    out, _ = _check_moe(x, idx, gate_w, weights, 1.702, 7.0, 0)
    exact = twins.moe_mxfp4(x, idx, gate_w, *weights, 1.702, 7.0, 0).float()
    # each input off by <= 2^-16 of its group's largest: the outputs stay within half a bf16 step of the largest
    assert (out.float() - exact).abs().max() <= BF16_RTOL / 2 * exact.abs().max()
    bad = x.clone()
    bad[2, 50] = float("nan")
    out_nan = OPS.moe_mxfp4(bad, idx, gate_w, *weights, 1.702, 7.0, 0)
    assert torch.isnan(out_nan[2]).all()
    assert torch.equal(out_nan[[0, 1, 3, 4]], out[[0, 1, 3, 4]])


@pytest.mark.parametrize("form", ALL_FORMS)
def test_moe_mxfp4_register_tile_paths(form):
    """bf16 experts with 1, 2, 3, 4, 6 and 9 tokens in one call: every register tile (4 rows x 1-2 inputs,
    2 rows x 3-4 inputs decoded first, 2 rows x 8; in the fp32 form, fp32 tiles from 2 inputs) and the strip
    path, against the twin."""
    g = gen(17)
    E, H, I = 6, 160, 96
    weights = _moe_weights(g, E, H, I, BF16)
    counts = [1, 2, 3, 4, 6, 9]
    ids = torch.tensor([e for e, c in enumerate(counts) for _ in range(c)])
    idx = ids[torch.randperm(len(ids), generator=g)].view(-1, 1)
    x = randn(g, len(ids), H, dtype=BF16, scale=2.0)
    with products(form):
        _check_moe(x, idx, torch.ones(len(ids), 1), weights, 1.702, 7.0, 0)
        # two slots a token: expert hit counts mixed across the paths
        idx2 = torch.stack([idx[:, 0], (idx[:, 0] + 1 + torch.arange(len(ids)) % 3) % E], 1)
        _check_moe(x, idx2, torch.softmax(torch.randn(len(ids), 2, generator=g), -1), weights, 1.702, 7.0, 0)


@pytest.mark.parametrize("xdt", [F32, BF16])
def test_moe_mxfp4_long_rows_scales(xdt):
    """Rows of 19 and 13 groups: the register tiles take the scales of four chunks (8 groups) at once, then
    single chunks, then the odd last group. Every group its own power of two, so a scale applied to the wrong
    group shows; scale byte 0 (the subnormal 2^-127, made visible by inputs near 2^120) and 255 (inf: the
    row's outputs not finite wherever the twin's are not), with 1, 2 and 3 tokens an expert (the tiles of one
    and two inputs, and the wide ones), against the twin."""
    g = gen(41)
    E, H, I = 2, 32 * 19, 32 * 13
    gu_b, gu_s, gu_bias, dn_b, dn_s, dn_bias = _moe_weights(g, E, H, I, F32)
    gu_s = torch.randint(118, 132, gu_s.shape, generator=g, dtype=torch.uint8)
    dn_s = torch.randint(118, 132, dn_s.shape, generator=g, dtype=torch.uint8)
    for T in (1, 2, 3, 6):
        idx = (torch.arange(T) % E).view(T, 1)
        x = randn(g, T, H, dtype=xdt, scale=2.0)
        _check_moe(x, idx, torch.ones(T, 1), (gu_b, gu_s, gu_bias, dn_b, dn_s, dn_bias), 1.702, 7.0, 0)
        # every gate_up group at 2^-127: with inputs ~2^120 its sums are ~2^-7, not 0
        huge = (x.float() * 2.0 ** 120).to(xdt)
        _check_moe(huge, idx, torch.ones(T, 1), (gu_b, torch.zeros_like(gu_s), gu_bias, dn_b, dn_s, dn_bias),
                   1.702, 7.0, 0)
        # one group of one down row at inf, inside the first eight groups and in a single chunk after them
        for grp in (5, 9):
            inf_s = dn_s.clone()
            inf_s[:, 3, grp] = 255
            w = (gu_b, gu_s, gu_bias, dn_b, inf_s, dn_bias)
            out = OPS.moe_mxfp4(x, idx, torch.ones(T, 1), *w, 1.702, 7.0, 0)
            ref = twins.moe_mxfp4(x, idx, torch.ones(T, 1), *w, 1.702, 7.0, 0)
            assert not torch.isfinite(ref[:, 3]).any()
            assert torch.equal(torch.isfinite(out), torch.isfinite(ref)), (T, grp)


def test_moe_mxfp4_batch_invariant():
    """On AVX2 a bf16 token's output is the same to the bit whatever else its expert is given up to 7 tokens (the
    one- and two-input tiles and the 2 x 4 tiles: one int16 arithmetic) and whichever thread computes it; from 8
    tokens (the strip path, fp32 products of the same quantized values), elsewhere and in fp32, sums in another
    order: equal up to rounding."""
    g = gen(31)
    for H, I, xdt in [(96, 160, BF16), (64, 128, BF16), (160, 96, F32)]:
        weights = _moe_weights(g, 1, H, I, BF16)
        x = randn(g, 11, H, dtype=xdt, scale=2.0)
        one = lambda xs: OPS.moe_mxfp4(xs, torch.zeros(len(xs), 1, dtype=torch.long), torch.ones(len(xs), 1),
                                       *weights, 1.702, 7.0, 0)
        alone = torch.cat([one(x[i:i + 1]) for i in range(11)])
        for n in (2, 3, 7, 8, 11):
            with num_threads(1 + n % 3):
                together = one(x[:n])
            if xdt == BF16 and QUANTIZED_BF16_MOE and n < 8:
                assert torch.equal(together, alone[:n]), (H, I, n)
            else:
                torch.testing.assert_close(together.float(), alone[:n].float(), rtol=2 * BF16_RTOL, atol=1e-4)


def test_moe_mxfp4_errors():
    g = gen(6)
    weights = _moe_weights(g, 2, 64, 32, F32)
    idx, gw = torch.zeros(3, 1, dtype=torch.long), torch.ones(3, 1)
    with pytest.raises(RuntimeError, match="expert shapes do not match"):
        OPS.moe_mxfp4(torch.zeros(3, 96), idx, gw, *weights, 1.702, 7.0, 0)
    with pytest.raises(RuntimeError, match="idx must be int64"):
        OPS.moe_mxfp4(torch.zeros(3, 64), idx.int(), gw, *weights, 1.702, 7.0, 0)


# ---- KV: rope_kv_write, paged_decode_attention -------------------------------------------------------

KV_FORMS = ("fp8-packed", "fp8", "bf16", "fp32")


def make_kv(g, form: str, nb: int, kv: int, B: int, d: int):
    """(buf [2, nb, kv, B, d] filled with random values, K view, V view)."""
    dtype = {"fp8-packed": FP8, "fp8": FP8, "bf16": BF16, "fp32": F32}[form]
    buf = torch.zeros(2, nb, kv, B, d, dtype=dtype)
    buf.copy_(torch.randn(2, nb, kv, B, d, generator=g).to(dtype))
    return buf, *kv_views(buf, form)


def kv_views(buf, form):
    return (pack_k_view(buf[0]) if form == "fp8-packed" else buf[0]), buf[1]


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


def test_fake_implementations_match_the_kernels_shapes():
    """Every op has a fake (meta) implementation with the kernel's output shape and dtype, so a traced or
    compiled program sees it as one opaque node."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    g = gen(21)
    B, d, nb, kv, nh = 4, 16, 6, 2, 4
    buf, K, V = make_kv(g, "fp8-packed", nb, kv, B, d)
    weights = _moe_weights(g, 3, 64, 32, F32)
    x, idx, gw = torch.randn(5, 64, generator=g), torch.tensor([[0, 1]] * 5), torch.full((5, 2), 0.5)
    table, pos, act = torch.tensor([[1, 2]]), torch.tensor([5]), torch.tensor([True])
    calls = [
        lambda: OPS.moe_mxfp4(x, idx, gw, *weights, 1.702, 7.0, 0),
        lambda: OPS.mxfp4_dequant(weights[0], weights[1], BF16),
        lambda: OPS.swiglu(x, 1.702, 7.0),
        lambda: OPS.linear(x, torch.randn(7, 64, generator=g), None),
        lambda: OPS.paged_decode_attention(torch.randn(1, nh, d, generator=g), K, V, table, pos, act,
                                           torch.zeros(nh), 0, 0.25, 1.0, 1.0, BF16),
        lambda: OPS.paged_decode_attention_partial(torch.randn(1, nh, d, generator=g), K, V, table, pos,
                                                   torch.tensor([2]), act, 0.25, 1.0, 1.0),
        lambda: OPS.rope_kv_write(torch.randn(1, (nh + 2 * kv) * d, generator=g), torch.ones(1, d // 2),
                                  torch.zeros(1, d // 2), K.clone(), V.clone(), torch.tensor([5]), nh, 1.0, 1.0),
        lambda: OPS.rms_norm(x, torch.ones(64), 1e-5),
    ]
    real = [c() for c in calls]
    with FakeTensorMode(allow_non_fake_inputs=True):
        fake = [c() for c in calls]
    flat = lambda outs: [t for o in outs for t in (o if isinstance(o, (tuple, list)) else (o,))]  # noqa: E731
    real, fake = flat(real), flat(fake)
    assert len(real) == len(fake) == len(calls) + 1               # the partial op returns (out, lse)
    for r, f in zip(real, fake):
        assert (f.shape, f.dtype) == (r.shape, r.dtype)
