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


def test_padded_rows_are_few_and_close_above_the_granule():
    """Past ROW_GRANULE rows a bf16 GEMM runs at a bounded set of row counts (31 up to 1,024 rows, fewer than
    16 more for each 1,024 after), fewer than 32 rows above the rows asked for up to 1,024, under 6.25% past."""
    g = gemm.ROW_GRANULE
    seen = []
    for m in range(1, 4097):
        p = gemm.padded_rows(m)
        if m <= g:
            assert p == m
            continue
        assert m <= p < m + g * -(-m // 1024) and p % g == 0
        assert p - m < max(g, m / 16)
        seen.append(p)
    assert seen == sorted(seen)
    assert len(set(p for p in seen if p <= 1024)) == 1024 // g - 1
    assert len(set(seen)) < 70


@pytest.mark.parametrize("M", [33, 70, 96, 1000, 1030])
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_linear_runs_at_padded_rows_and_returns_its_own(monkeypatch, M, bias):
    """With bf16 GEMMs in bf16 a bf16 linear of M rows runs oneDNN at `padded_rows(M)` rows and returns M rows
    equal (within one bf16 rounding) to the fp32 product of its operands: the padding rows, zeros, never
    reach the result. fp32 and 3-D inputs run as they are."""
    monkeypatch.setattr(gemm, "BF16_GEMM_IN_BF16", True)
    g = torch.Generator().manual_seed(M)
    K, N = 72, 40
    x = torch.randn(M + 3, K, generator=g).to(BF16)[3:]          # a row slice (storage offset), as a chunk's
    w = torch.randn(N, K, generator=g).to(BF16)
    b = torch.randn(N, generator=g).to(BF16) if bias else None
    rows, real = [], F.linear
    monkeypatch.setattr(gemm.F, "linear", lambda a, *r: rows.append(a.shape[0]) or real(a, *r))
    out = gemm.linear(x, w, b)
    assert rows == [gemm.padded_rows(M)] and out.shape == (M, N) and out.dtype == BF16 and out.is_contiguous()
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    torch.testing.assert_close(out.float(), ref, rtol=2 ** -7, atol=2 ** -7 * ref.abs().max().item())
    rows.clear()
    gemm.linear(x.float(), w.float())
    gemm.linear(x.view(1, M, K), w)
    assert rows == [M, 1]


def test_prime_row_counts_builds_each_shape_once_per_padded_row_count(monkeypatch):
    monkeypatch.setattr(gemm, "BF16_GEMM_IN_BF16", True)
    calls, real = [], F.linear
    monkeypatch.setattr(gemm.F, "linear", lambda a, w, b=None: calls.append((a.shape[0], tuple(w.shape), b is None))
                        or real(a, w, b))
    qkv, o = torch.zeros(48, 16, dtype=BF16), torch.zeros(16, 32, dtype=BF16)
    bias = torch.zeros(48, dtype=BF16)
    n = gemm.prime_row_counts([(qkv, bias), (qkv.clone(), bias), (o, None), (torch.zeros(8, 16), None)], 100)
    counts = [64, 96, 128]                                       # padded_rows(100) = 128
    assert n == 6 and sorted(calls) == sorted([(m, (48, 16), False) for m in counts] + [(m, (16, 32), True) for m in counts])
    monkeypatch.setattr(gemm, "BF16_GEMM_IN_BF16", False)        # bf16 products in fp32: nothing to build
    assert gemm.prime_row_counts([(qkv, bias)], 100) == 0
