"""The native grouped MXFP4 MoE (`moe_mxfp4`) against its torch twin: odd expert counts with idle experts and EP
offsets, every product form and tile path, many tokens per expert, wide scale ranges, batch invariance.

The kernels are called through `torch.ops.gigadecode_native` directly (not the Python wrappers, which fall
back to the twins), so a pass here is about the C++ code. Skipped as a whole where the kernels cannot be built.
"""

from __future__ import annotations

import os

import pytest
import torch

from gigadecode import native
from gigadecode.native import twins

from gigadecode.mxfp4 import encode_mxfp4
from native_cases import (ALL_FORMS, AMX, BF16, BF16_RTOL, F32, NAMES, OPS, PRODUCT_FORMS, gen, moe_weights,
                          num_threads, products, randn)

if OPS is None:
    pytest.skip(f"native kernels not available here: {native.status()}", allow_module_level=True)


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


def quantized_bf16_moe() -> bool:
    """Whether the MoE takes bf16 activations as int16 per group of 32: the AVX2 build (mxfp4_avx2.h `QChunk`), the
    AVX-512 build in its 'int16' product form (mxfp4_vnni.h `QChunk128`, CPUs with AVX512-VNNI); fp32 activations
    and the other forms compute on the exact values."""
    return native.isa() == "avx2" or (native.isa() == "avx512" and native.product_form() == "int16")


def quantize_groups_i16(x: torch.Tensor) -> torch.Tensor:
    """x [n, K] fp32 -> the values the int16 forms multiply: per group of 32 (the last one short), q = round(x ·
    32767 / m) (m = the group's max |x|), times m / 32767."""
    n, K = x.shape
    xp = torch.nn.functional.pad(x, (0, -K % 32)).view(n, -1, 32)
    m = xp.abs().amax(-1, keepdim=True)
    q = torch.where(m > 0, torch.round(xp * (32767.0 / m)).clamp(-32767, 32767) * (m / 32767.0), torch.zeros_like(xp))
    return q.view(n, -1)[:, :K]


def moe_reference_quantized(x, idx, gate_w, weights, alpha, limit, offset, quantize=True):
    """The twin's math in fp32 on the inputs and the (bf16-rounded) activations through `quantize_groups_i16`,
    as the int16 forms compute bf16 activations (`quantize=False`: on the values as they are). Also returns, per
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
    ref_q, flip = moe_reference_quantized(x, idx, gate_w, weights, alpha, limit, offset, quantized_bf16_moe())
    if quantized_bf16_moe():
        ref = ref_q
    # both round once at the end (two bf16 steps apart at most) and the activations once (an activation's
    # rounding may go the other way: `flip`, twice for two of them)
    err = (out.float() - ref.float()).abs()
    assert (err <= 2 * BF16_RTOL * ref.float().abs() + 8 * atol + 2 * flip).all(), err.max()
    if quantized_bf16_moe():   # and most outputs are the reference's to the bit (the flips are rare)
        assert (err == 0).float().mean() >= 0.8, (err == 0).float().mean()
    return out, ref


@pytest.mark.parametrize("T,E,k,H,I,offset,xdt,bdt,limit", _moe_cases())
def test_moe_mxfp4(T, E, k, H, I, offset, xdt, bdt, limit):
    g = gen(1000 * E + 10 * k + T)
    weights = moe_weights(g, E, H, I, bdt)
    n_global = offset + E + (3 if offset else 0)           # EP: ids below and above the local range
    idx, gate_w = _routing(g, T, E, k, offset, n_global)
    x = randn(g, T, H, dtype=xdt, scale=2.0)
    out, ref = _check_moe(x, idx, gate_w, weights, 1.702, limit, offset)
    local = ((idx >= offset) & (idx < offset + E)).any(1)
    assert torch.equal(out[~local].float(), torch.zeros_like(ref[~local]))   # tokens routed elsewhere: 0


def test_moe_mxfp4_edge_routing():
    g = gen(5)
    E, H, I = 3, 64, 32
    weights = moe_weights(g, E, H, I, F32)
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
    """Experts hit by >= 8 tokens (in the AVX-512 build: 24 in fp32, 32 in the int16 form) take the strip path (rows decoded once, scaled,
    then dense tiles: bf16 dot products or fp32 FMAs for bf16 inputs, `form`; fp32 FMAs for fp32 inputs, whose fp32 inputs and decoded rows
    are padded so that rows of 1024 values do not fall in the same cache sets); a strip with a scale outside
    [2, 252] (whose scaled values cannot all be normal numbers) falls back to the register tiles. Both against
    the twin, with a few tokens per expert (register tiles) alongside."""
    g = gen(11)
    E = 3
    gu_b, gu_s, gu_bias, dn_b, dn_s, dn_bias = moe_weights(g, E, H, I, BF16)
    gu_s[1, :5] = 1                                    # expert 1: gate_up rows 0..4 scaled 2^-126 …
    dn_s[2, 7, 0] = 0                                  # … expert 2: one group of a down row 2^-127 (subnormal)
    T = 35
    idx = torch.stack([torch.tensor([0, 1]) if t % 2 else torch.tensor([1, 2]) for t in range(T)])
    idx[:3] = torch.tensor([2, 0])                      # expert 0: 19 tokens, 1: 32, 2: 19
    gate_w = torch.softmax(torch.randn(T, 2, generator=g), -1)
    x = randn(g, T, H, dtype=xdt, scale=2.0)
    with products(form):
        _check_moe(x, idx, gate_w, (gu_b, gu_s, gu_bias, dn_b, dn_s, dn_bias), 1.702, 7.0, 0)


@pytest.mark.parametrize("form", ALL_FORMS)
@pytest.mark.parametrize("xdt", [BF16, F32])
def test_moe_mxfp4_strip_input_blocks(xdt, form):
    """An expert's strip meets its inputs a block of ~256 KB at a time (`for_strip_tiles`: 18 to 44 inputs of
    2,880 values, by the ISA and the inputs' dtype), every row of the strip passing over one block before the
    next: experts of 50, 37 and 13 inputs (whole blocks, a last short block, a short tile in it; one block),
    against the twin."""
    g = gen(17)
    E, H, I = 3, 2880, 32
    weights = moe_weights(g, E, H, I, BF16)
    T = 50
    idx = torch.stack([torch.tensor([0, 1]) if t < 37 else torch.tensor([0, 2]) for t in range(T)])
    # expert 0: 50 tokens, 1: 37, 2: 13
    gate_w = torch.softmax(torch.randn(T, 2, generator=g), -1)
    x = randn(g, T, H, dtype=xdt, scale=2.0)
    with products(form):
        _check_moe(x, idx, gate_w, weights, 1.702, 7.0, 0)


@pytest.mark.parametrize("form", ALL_FORMS)
@pytest.mark.parametrize("H", [1024, 288])
def test_moe_int16_sums_at_their_largest(H, form):
    """The int16 forms sum a group's int16 products in int32 lanes (the AVX-512 build's: 16 products of a group a
    lane, over a pair of 128-value chunks; AVX2's its own): with every gate_up code at +6 or -6 (the largest word,
    12 · 256) against inputs all at their group's largest (q = ±32767), the sums reach their bound and must not
    wrap (a wrapped gate would go through the clamp and the SwiGLU as a large negative, ~0). Rows of 8 chunks (4
    pairs) and of 3 (a pair and an odd last chunk), 1 and 2 tokens an expert, in every form, against the twin."""
    g = gen(19)
    E, I = 2, 64
    gu_b = torch.full((E, 2 * I, H // 32, 16), 0x77, dtype=torch.uint8)   # both nibbles 7: +6
    gu_b[1] = 0xFF                                                         # 15: -6
    gu_s = torch.full((E, 2 * I, H // 32), 127, dtype=torch.uint8)        # 2^0
    dn_b, dn_s = encode_mxfp4(randn(g, E, H, I, scale=0.1))
    weights = (gu_b, gu_s, torch.zeros(E, 2 * I), dn_b, dn_s, torch.zeros(E, H))
    x = torch.ones(3, H, dtype=BF16)
    x[1] = -1.0
    idx = torch.tensor([[0, 1], [1, 0], [1, 0]])   # expert 0: tokens 0 and 1 (+6 · 1, +6 · -1); expert 1: all three
    with products(form):
        out, ref = _check_moe(x, idx, torch.full((3, 2), 0.5), weights, 1.702, 7.0, 0)
    assert ref.float().abs().amax() > 1.0   # the clamped gates (7) and ups reach the output


@pytest.mark.skipif(not (native.isa() == "avx512" and native.product_form() == "int16"),
                    reason="the AVX-512 build's int16 form (CPUs with AVX512-VNNI)")
@pytest.mark.parametrize("H,I", [(1024, 160), (288, 96)])
def test_moe_int16_token_independent_of_its_experts_count(H, I):
    """In the AVX-512 int16 form an expert with few tokens runs register tiles that decode its codes, one with 32
    or more strips of rows decoded once into words (`decode_rows_words`) under the same tiles: the same words,
    powers of two and sums, so a token's output is the same to the bit whether its experts have 1 token or 40."""
    g = gen(23)
    E = 3
    weights = moe_weights(g, E, H, I, BF16)
    T = 40
    idx = torch.stack([torch.tensor([0, 1]) if t % 2 else torch.tensor([1, 0]) for t in range(T)])
    idx[::3, 1] = 2                                       # expert 2: 14 tokens; 0 and 1: 26-40
    gate_w = torch.softmax(torch.randn(T, 2, generator=g), -1)
    x = randn(g, T, H, dtype=BF16, scale=2.0)
    together = OPS.moe_mxfp4(x, idx, gate_w, *weights, 1.702, 7.0, 0)
    # (with the fp32 strips these experts took before, 4 of the 40 tokens differed in the last bf16 bit)
    differ = [t for t in range(T) if not torch.equal(
        OPS.moe_mxfp4(x[t:t + 1], idx[t:t + 1], gate_w[t:t + 1], *weights, 1.702, 7.0, 0), together[t:t + 1])]
    assert differ == []


def test_moe_product_forms_agree():
    """The exact product forms multiply the same exact products (bf16 values, MXFP4 values times a power of two)
    and sum them in fp32 in different orders: their outputs agree to a bf16 rounding, with 1, 2, 5 and 12 tokens an
    expert (the bf16 tile of one input; fp32 register tiles; strips); the int16 form (int16-quantized inputs) is
    within its bound of the twin on the quantized inputs; the form can be set, asked and measured again ('auto'),
    and anything else is refused."""
    g = gen(13)
    E, H, I = 4, 256, 160
    weights = moe_weights(g, E, H, I, BF16)
    idx = torch.tensor([0] + [1] * 2 + [2] * 5 + [3] * 12).view(-1, 1)
    T = len(idx)
    x = randn(g, T, H, dtype=BF16, scale=2.0)
    outs = {}
    for form in ALL_FORMS:
        with products(form):
            assert form == "amx" and native.amx_tiles() == "on" or native.product_form() == form
            outs[form] = OPS.moe_mxfp4(x, idx, torch.ones(T, 1), *weights, 1.702, 7.0, 0)
            if form == "int16":
                _check_moe(x, idx, torch.ones(T, 1), weights, 1.702, 7.0, 0)
    for form in ALL_FORMS:
        if form == "int16":
            continue
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
    gu_b, gu_s, gu_bias, dn_b, dn_s, dn_bias = moe_weights(g, E, H, I, BF16)
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


@pytest.mark.skipif(not AMX, reason="the CPU has no AMX-BF16 tiles (or the build no bf16 dot products)")
def test_moe_mxfp4_amx_activation_padding():
    """The AMX experts' activations go straight from the gate_up sums into the down projection's tile layout
    (moe.cpp `SwigluToVnni`), whose positions past I up to the next 128 are zero: a call that leaves NaN
    activations in the (reused) layout buffer, then one with I = 96 (a quarter chunk of padding) whose experts
    take both AMX forms: its output is finite and the twin's, as on a fresh buffer."""
    g = gen(7)
    H = 160
    big = moe_weights(g, 4, H, 1024, BF16)
    T = 40
    idx = torch.stack([torch.arange(T) % 4, (torch.arange(T) + 1) % 4], 1)      # 20 inputs an expert: all AMX
    x = torch.full((T, H), float("nan"), dtype=BF16)
    with products("amx"), num_threads(1):
        assert OPS.moe_mxfp4(x, idx, torch.full((T, 2), 0.5), *big, 1.702, 7.0, 0).isnan().all()
        counts = [6, 17, 12, 40]                         # our tile code, oneDNN's GEMM, ours, oneDNN's
        idx = torch.tensor([e for e, c in enumerate(counts) for _ in range(c)])[:, None]
        gate_w = torch.ones(len(idx), 1)
        weights = moe_weights(g, len(counts), H, 96, BF16)
        out, _ = _check_moe(randn(g, len(idx), H, dtype=BF16), idx, gate_w, weights, 1.702, 7.0, 0)
    assert out.isfinite().all()


def test_moe_mxfp4_bf16_wide_range_and_nan():
    """Groups whose values span 2^12 (one value far above the rest), all-zero groups and an odd group count (the
    tail chunk) stay within the bf16 bound of the twin — in the int16 forms, of the twin on the quantized inputs the
    kernel multiplies, which round the small values of such a group to 2^-16 of its largest: that rounding is
    bounded here against the exact values; a NaN in one token's input makes that token's output NaN and leaves
    the others as they were without it."""
    g = gen(23)
    E, H, I = 4, 96, 64                                # 3 groups of 32 per input row: an odd last chunk
    weights = moe_weights(g, E, H, I, BF16)
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
    weights = moe_weights(g, E, H, I, BF16)
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
    gu_b, gu_s, gu_bias, dn_b, dn_s, dn_bias = moe_weights(g, E, H, I, F32)
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
    """In an int16 form a bf16 token's output is the same to the bit whatever else its expert is given below the
    strips (AVX2: up to 7 tokens, its one- and two-input tiles and the 2 x 4 tiles; AVX-512 VNNI: up to 31, its
    4 x 1-4 and 2 x 8 tiles: one int16 arithmetic each) and whichever thread computes it; from there (the strip
    path, fp32 products of the same quantized values), elsewhere and in fp32, sums in another order: equal up to
    rounding."""
    int16_tiles_below = 8 if native.isa() == "avx2" else 32
    g = gen(31)
    for H, I, xdt in [(96, 160, BF16), (64, 128, BF16), (160, 96, F32)]:
        weights = moe_weights(g, 1, H, I, BF16)
        x = randn(g, 11, H, dtype=xdt, scale=2.0)
        one = lambda xs: OPS.moe_mxfp4(xs, torch.zeros(len(xs), 1, dtype=torch.long), torch.ones(len(xs), 1),
                                       *weights, 1.702, 7.0, 0)
        alone = torch.cat([one(x[i:i + 1]) for i in range(11)])
        for n in (2, 3, 7, 8, 11):
            with num_threads(1 + n % 3):
                together = one(x[:n])
            if xdt == BF16 and quantized_bf16_moe() and n < int16_tiles_below:
                assert torch.equal(together, alone[:n]), (H, I, n)
            else:
                torch.testing.assert_close(together.float(), alone[:n].float(), rtol=2 * BF16_RTOL, atol=1e-4)


def test_moe_mxfp4_errors():
    g = gen(6)
    weights = moe_weights(g, 2, 64, 32, F32)
    idx, gw = torch.zeros(3, 1, dtype=torch.long), torch.ones(3, 1)
    with pytest.raises(RuntimeError, match="expert shapes do not match"):
        OPS.moe_mxfp4(torch.zeros(3, 96), idx, gw, *weights, 1.702, 7.0, 0)
    with pytest.raises(RuntimeError, match="idx must be int64"):
        OPS.moe_mxfp4(torch.zeros(3, 64), idx.int(), gw, *weights, 1.702, 7.0, 0)
    for x in (torch.zeros(3, 64, 1), torch.zeros(64)):   # (3-D was taken as [T, H] and returned 3-D)
        with pytest.raises(RuntimeError, match=r"x must be \[T, H\]"):
            OPS.moe_mxfp4(x, idx, gw, *weights, 1.702, 7.0, 0)
