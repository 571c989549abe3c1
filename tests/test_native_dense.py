"""The native dense kernels against their torch twins (`gigadecode.native.twins`): `linear` (every product form,
odd row counts, reductions that are not a multiple of the vector width), `rms_norm`, the exact MXFP4 dequant and
`swiglu`; and every op's fake implementation against its kernel's output shapes.

The kernels are called through `torch.ops.gigadecode_native` directly (not the Python wrappers, which fall
back to the twins), so a pass here is about the C++ code. Skipped as a whole where the kernels cannot be built.
"""

from __future__ import annotations

import math

import pytest
import torch

from gigadecode import native
from gigadecode.mxfp4 import encode_mxfp4
from gigadecode.native import twins

from native_cases import (ALL_FORMS, BF16, F32, NAMES, OPS, assert_rounded, bits, gen, make_kv, moe_weights,
                          num_threads, products, randn)

if OPS is None:
    pytest.skip(f"native kernels not available here: {native.status()}", allow_module_level=True)


# ---- linear ------------------------------------------------------------------------------------------

# 40, 95, 130: past 32, where CPUs without bf16 GEMMs still take it (strips of rows converted once: AVX2 from 40,
# AVX-512 without BF16 from 64)
LIN_M = (1, 2, 3, 5, 8, 16, 17, 32, 33, 40, 48, 64, 95, 130)
LIN_N = (1, 3, 33, 130)


# bf16 x bf16 under each product form (AVX-512 from 4 rows: the pair tiles, in fp32, unless the form is bf16)
# (and on AMX tiles from 5 rows, where the CPU has them: K even; 5-64 rows our own tile code, one to four tiles'
# inputs, N = 1, 3, 33, 130: groups of 16 rows and a short one, K = 70, 200: a last step of 32 past K; 95, 130
# rows oneDNN's GEMM: blocks of 32 inputs and their tails, strips of 64 rows and a short one)
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
    for M in (5, 41, 65):                             # 41 / 65: the strips of rows (AVX2 / AVX-512), 4 threads
        x = randn(g, M, 200)
        with num_threads(4):
            out = OPS.linear(x, w, b)
        torch.testing.assert_close(out, twins.linear(x, w, b), rtol=1e-5, atol=2e-4)
    assert OPS.linear(torch.zeros(0, 200), w, b).shape == (0, 130)


@pytest.mark.parametrize("bf16_gemm", [True, False])
def test_linear_row_limit_follows_the_bf16_gemm(monkeypatch, bf16_gemm):
    """`native.linear` hands rows past its limit to `gemm.linear`: past 56 where the CPU has bf16 GEMMs (or
    the weight is fp32), past 64 there for bf16 weights and inputs on AMX tiles (our own tile code), past 96
    for a bf16 weight where it has none (its GEMM converts the weight first), past 256 there on the AVX2 build
    and the AVX-512 build without BF16 (which convert the weight's rows once per strip themselves)."""
    from gigadecode import gemm
    monkeypatch.setattr(gemm, "BF16_GEMM_IN_BF16", bf16_gemm)
    to_gemm = []
    monkeypatch.setattr(gemm, "linear", lambda x, w, b=None: to_gemm.append(x.shape[0]) or twins.linear(x, w, b))
    g = gen("limit")
    w16, w32 = randn(g, 24, 40, dtype=BF16), randn(g, 24, 40)
    rows = (32, 33, 56, 57, 64, 65, 96, 97, 256, 257)
    for M in rows:
        x = randn(g, M, 40, dtype=BF16)
        for w in (w16, w32):
            assert_rounded(native.linear(x, w), twins.linear(x.float(), w), 1e-5 * math.sqrt(40))
    past = ((64 if native.amx_tiles() == "on" else 56) if bf16_gemm
            else 256 if native.isa() in ("avx2", "avx512") else 96)
    assert to_gemm == [M for M in rows for w_is_16 in (True, False) if M > (past if w_is_16 else 56)]


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


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_swiglu_huge_negative_gate_as_the_twin(dtype):
    """A gate of -inf or far below 0 (-1e30, -3e38) in every lane of a vector and in the scalar tail: g ·
    sigmoid(alpha · g) is -0 for a finite g and NaN for -inf (-inf · 0), as the twin's. The bf16 path's
    vectorized exp clamped e^-alpha·g at e^88.3, so a gate of -3e38 gave a finite -1.35 · (up + 1) and -inf
    gave ±inf."""
    I = 37                                             # vectors of 8 / 16 and a tail
    gate_up = randn(gen(61, str(dtype)), 4, 2 * I, scale=3.0, dtype=dtype)
    for row, value in enumerate((float("-inf"), -3e38, -1e30, -60.0)):
        gate_up[row, 0::2] = value
    out, ref = OPS.swiglu(gate_up, 1.702, 7.0), twins.swiglu(gate_up, 1.702, 7.0)
    nan = ref.isnan()
    assert nan[0].all() and not nan[1:].any()
    assert torch.equal(out.isnan(), nan)
    torch.testing.assert_close(out[1:].float(), ref[1:].float(), rtol=0, atol=1e-30)


def test_swiglu_refuses_odd_columns():
    with pytest.raises(RuntimeError, match=r"\[T, 2I\]"):
        OPS.swiglu(torch.zeros(2, 5), 1.702, 7.0)


# ---- every op's fake implementation ------------------------------------------------------------------

def test_fake_implementations_match_the_kernels_shapes():
    """Every op has a fake (meta) implementation with the kernel's output shape and dtype, so a traced or
    compiled program sees it as one opaque node."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    g = gen(21)
    B, d, nb, kv, nh = 4, 16, 6, 2, 4
    buf, K, V = make_kv(g, "fp8-packed", nb, kv, B, d)
    weights = moe_weights(g, 3, 64, 32, F32)
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
