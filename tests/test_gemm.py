"""bf16 products on CPUs without bf16 GEMMs (`gigadecode.gemm`): the blocked fp32 linear against one fp32
GEMM of the same bf16 operands, and the dispatch (bf16 through it only where the CPU lacks bf16 GEMMs)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gigadecode import gemm
from gigadecode.ops import flash_sink_attention

BF16 = torch.bfloat16


def _bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance between two bf16 tensors in units in the last place (same-sign finite values)."""
    ia, ib = a.view(torch.int16).int(), b.view(torch.int16).int()
    return int((ia - ib).abs().max())


@pytest.mark.parametrize("M,K,N,block", [(1, 64, 5, 64), (7, 96, 33, 200), (40, 160, 70, 1 << 20), (3, 32, 1, 1)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_fp32_blocks(M, K, N, block, bias):
    g = torch.Generator().manual_seed(M * 1000 + N)
    x = torch.randn(M, K, generator=g).to(BF16)
    w = torch.randn(N, K, generator=g).to(BF16)
    b = torch.randn(N, generator=g).to(BF16) if bias else None
    out = gemm.linear_fp32_blocks(x, w, b, block_elems=block)
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    assert out.dtype == BF16 and out.shape == (M, N)
    # one rounding of the fp32 result (sums may differ in their last fp32 bits between GEMM blockings)
    assert _bf16_ulps(out, ref.to(BF16)) <= 1
    torch.testing.assert_close(out.float(), ref, rtol=2 ** -8, atol=1e-6)


def test_linear_fp32_blocks_keeps_leading_dims_and_fp32_is_untouched():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 5, 48, generator=g).to(BF16)
    w = torch.randn(9, 48, generator=g).to(BF16)
    out = gemm.linear_fp32_blocks(x, w, block_elems=100)          # 2 rows a block
    assert out.shape == (2, 5, 9)
    torch.testing.assert_close(out.float(), F.linear(x.float(), w.float()), rtol=2 ** -8, atol=1e-6)
    xf, wf = x.float(), w.float()
    assert torch.equal(gemm.linear(xf, wf), F.linear(xf, wf))     # fp32: torch's own product, unchanged


@pytest.mark.parametrize("value, want", [("1", True), ("0", False)])
def test_bf16_gemm_override(monkeypatch, value, want):
    monkeypatch.setenv("GIGADECODE_BF16_GEMM", value)
    monkeypatch.setattr(gemm, "_fp32_gemm_faster", lambda: pytest.fail("measured despite the override"))
    assert gemm._bf16_gemm_in_bf16() is want


@pytest.mark.parametrize("hardware, fp32_faster", [(True, False), (True, True), (False, False), (False, True)])
def test_bf16_gemms_in_bf16_where_the_cpu_has_them_and_they_are_not_slower(monkeypatch, hardware, fp32_faster):
    monkeypatch.delenv("GIGADECODE_BF16_GEMM", raising=False)
    monkeypatch.setattr(gemm, "bf16_gemm_in_hardware", lambda: hardware)
    monkeypatch.setattr(gemm, "_fp32_gemm_faster", lambda: fp32_faster)
    assert gemm._bf16_gemm_in_bf16() is (hardware and not fp32_faster)


def test_bf16_gemm_override_ignores_other_values_with_a_warning(monkeypatch, caplog):
    monkeypatch.setattr(gemm, "bf16_gemm_in_hardware", lambda: True)
    monkeypatch.setattr(gemm, "_fp32_gemm_faster", lambda: True)
    monkeypatch.setenv("GIGADECODE_BF16_GEMM", "yes")
    assert gemm._bf16_gemm_in_bf16() is False                     # measured, as without the variable
    assert "GIGADECODE_BF16_GEMM='yes' ignored" in caplog.text


def test_fp32_gemm_measurement_times_both_forms(monkeypatch):
    """The measurement times oneDNN's bf16 GEMM and the fp32 form on the same operands, and says fp32 only
    when it is the faster by the margin (here: made 10x slower by a stand-in, then made the only cost)."""
    import time
    real = F.linear
    slow = lambda x, w: time.sleep(0.01) or real(x, w)                # noqa: E731
    monkeypatch.setattr(gemm, "linear_fp32_blocks", slow)
    assert gemm._fp32_gemm_faster(rows=8, k=32, n=16) is False
    monkeypatch.setattr(gemm, "linear_fp32_blocks", lambda x, w: real(x[:1], w[:1]))
    monkeypatch.setattr(gemm.F, "linear", slow)
    assert gemm._fp32_gemm_faster(rows=8, k=32, n=16) is True


def test_product_dtype_follows_the_hardware(monkeypatch):
    monkeypatch.setattr(gemm, "BF16_GEMM_IN_BF16", False)
    assert gemm.product_dtype(BF16) == torch.float32
    assert gemm.product_dtype(torch.float32) == torch.float32
    x, w = torch.randn(4, 32).to(BF16), torch.randn(6, 32).to(BF16)
    calls = []
    monkeypatch.setattr(gemm, "linear_fp32_blocks", lambda *a, **k: calls.append(a) or F.linear(*a))
    gemm.linear(x, w)
    assert len(calls) == 1
    monkeypatch.setattr(gemm, "BF16_GEMM_IN_BF16", True)
    assert gemm.product_dtype(BF16) == BF16
    gemm.linear(x, w)
    assert len(calls) == 1                                         # bf16 hardware: F.linear directly


@pytest.mark.parametrize("bias", [False, True])
def test_linear_with_an_fp32_weight_for_bf16_inputs(monkeypatch, bias):
    """Without bf16 GEMMs a decoded expert comes as an fp32 weight: bf16 x times it in fp32, rounded once to
    bf16 (the bf16 weight's result, whose values it holds exactly)."""
    monkeypatch.setattr(gemm, "BF16_GEMM_IN_BF16", False)
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(6, 96, generator=g).to(BF16), torch.randn(40, 96, generator=g).to(BF16)
    b = torch.randn(40, generator=g).to(BF16) if bias else None
    out = gemm.linear(x, w.float(), b)
    assert out.dtype == BF16 and out.shape == (6, 40)
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    assert _bf16_ulps(out, ref.to(BF16)) <= 1
    assert _bf16_ulps(out, gemm.linear(x, w, b)) <= 1


@pytest.mark.parametrize("hardware", [False, True])
def test_flash_attention_products_in_either_dtype(monkeypatch, hardware):
    """bf16 flash attention without bf16 GEMMs multiplies in fp32: the fp32 attention of the same bf16
    inputs, rounded once (within one bf16 step); with bf16 GEMMs the products are bf16 and the result
    differs from it in many elements."""
    monkeypatch.setattr(gemm, "BF16_GEMM_IN_BF16", hardware)
    g = torch.Generator().manual_seed(9)
    T, S, nh, nkv, d = 37, 70, 4, 2, 32
    q = torch.randn(T, nh, d, generator=g).to(BF16)
    k = torch.randn(S, nkv, d, generator=g).to(BF16)
    v = torch.randn(S, nkv, d, generator=g).to(BF16)
    sinks = torch.randn(nh, generator=g)
    qp, kp = torch.arange(S - T, S), torch.arange(S)
    out = flash_sink_attention(q, k, v, qp, kp, sinks, d ** -0.5, 16, tile=32, q_tile=16)
    ref = flash_sink_attention(q.float(), k.float(), v.float(), qp, kp, sinks, d ** -0.5, 16, tile=32, q_tile=16)
    assert out.dtype == BF16
    off = (out.float() - ref).abs() > 2 ** -8 * ref.abs() + 1e-30
    if hardware:
        assert off.float().mean() > 0.05
    else:
        assert not off.any()
