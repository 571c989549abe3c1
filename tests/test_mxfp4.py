"""MXFP4 decode/encode against hand-made bytes with known values (and transformers' dequantizer)."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from gigadecode.mxfp4 import decode_mxfp4, encode_mxfp4

# e2m1 by code, written out by hand (not imported): sign bit 3, exponent bits 2-1, mantissa bit 0.
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def one_group(codes: list[int], scale: int = 127) -> tuple[torch.Tensor, torch.Tensor]:
    """32 codes -> blocks [1, 1, 16], scales [1, 1] (one row, one group), low nibble first."""
    assert len(codes) == 32
    b = [codes[2 * j] | (codes[2 * j + 1] << 4) for j in range(16)]
    return torch.tensor([[b]], dtype=torch.uint8), torch.tensor([[scale]], dtype=torch.uint8)


ALL_CODES = list(range(16)) * 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_every_code_at_unit_scale(dtype):
    blocks, scales = one_group(ALL_CODES, 127)
    out = decode_mxfp4(blocks, scales, dtype)
    assert out.shape == (1, 32) and out.dtype == dtype
    assert out[0].tolist() == E2M1 * 2


def test_sign_handling_and_negative_zero():
    out = decode_mxfp4(*one_group(ALL_CODES))[0]
    for c in range(8):
        assert out[c + 8].item() == -out[c].item()
    assert out[8].item() == 0.0 and torch.signbit(out[8])          # code 8 is -0
    assert not torch.signbit(out[0])                                 # code 0 is +0
    assert out[1].item() == 0.5 and out[9].item() == -0.5           # the subnormal


def test_low_nibble_first():
    blocks = torch.zeros(1, 1, 16, dtype=torch.uint8)
    blocks[0, 0, 0] = 0x21       # low nibble 1 (0.5), high nibble 2 (1.0)
    blocks[0, 0, 1] = 0xF7       # low 7 (6.0), high 15 (-6.0)
    blocks[0, 0, 15] = 0x3A      # low 10 (-1.0), high 3 (1.5)
    out = decode_mxfp4(blocks, torch.tensor([[127]], dtype=torch.uint8))[0].tolist()
    assert out[:4] == [0.5, 1.0, 6.0, -6.0]
    assert out[30:] == [-1.0, 1.5]
    assert out[4:30] == [0.0] * 26


@pytest.mark.parametrize("scale", [127 + 10, 127 - 10, 127 + 1, 127 - 1, 100, 160])
def test_scales(scale):
    out = decode_mxfp4(*one_group(ALL_CODES, scale), torch.float32)[0]
    assert out.tolist() == [v * 2.0 ** (scale - 127) for v in E2M1 * 2]


def test_scale_extremes_are_exact_powers_of_two_without_nan():
    # E8M0 0 = 2**-127, 254 = 2**127 (255 is the format's NaN, not used by checkpoints).
    lo = decode_mxfp4(*one_group(ALL_CODES, 0), torch.float32)[0]
    assert not lo.isnan().any()
    assert lo.tolist() == [v * 2.0 ** -127 for v in E2M1 * 2]       # fp32 subnormals, exact
    assert lo[2].item() == 2.0 ** -127 and lo[1].item() == 2.0 ** -128

    hi = decode_mxfp4(*one_group(ALL_CODES, 254), torch.float64)[0]
    assert hi.tolist() == [v * 2.0 ** 127 for v in E2M1 * 2]        # exact in float64
    hi32 = decode_mxfp4(*one_group(ALL_CODES, 254), torch.float32)[0]
    assert not hi32.isnan().any()                                    # 0 * 2**127 is 0, never NaN
    assert hi32[0].item() == 0.0 and hi32[2].item() == 2.0 ** 127 and hi32[3].item() == 1.5 * 2.0 ** 127
    # >= 2 * 2**127 exceeds fp32: the correctly rounded result is +-inf.
    assert hi32[4].item() == math.inf and hi32[15].item() == -math.inf


def test_groups_rows_and_leading_dims():
    """[E, rows, G, 16] -> [E, rows, G*32]: each group uses its own scale, groups concatenate in order."""
    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 5, 4, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(117, 138, (3, 5, 4), generator=g, dtype=torch.uint8)
    out = decode_mxfp4(blocks, scales)
    assert out.shape == (3, 5, 128) and out.dtype == torch.float32
    lut = torch.tensor(E2M1, dtype=torch.float64)
    for e, r, gi in [(0, 0, 0), (2, 4, 3), (1, 2, 1), (2, 0, 2)]:
        codes = []
        for byte in blocks[e, r, gi].tolist():
            codes += [byte & 0xF, byte >> 4]
        want = lut[codes] * 2.0 ** (int(scales[e, r, gi]) - 127)
        assert out[e, r, gi * 32:(gi + 1) * 32].double().tolist() == want.tolist()


def test_matches_transformers_dequantizer():
    """Same bytes -> same values as transformers' MXFP4 dequantization (which returns [E, K, rows])."""
    g = torch.Generator().manual_seed(1)
    blocks = torch.randint(0, 256, (4, 64, 2, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(110, 140, (4, 64, 2), generator=g, dtype=torch.uint8)
    ref = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    assert torch.equal(decode_mxfp4(blocks, scales).transpose(-1, -2), ref)


# ---------------------------------------------------------------------------------------------------------
def _canonical(shape: tuple[int, ...], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random codes (no -0) with a +-6 in every group, random scales: the encoder's canonical form."""
    g = torch.Generator().manual_seed(seed)
    *rows, groups = shape
    codes = torch.randint(0, 15, (*rows, groups, 32), generator=g)
    codes = torch.where(codes >= 8, codes + 1, codes)            # 0..7, 9..15 (no -0)
    pos = torch.randint(0, 32, (*rows, groups, 1), generator=g)
    six = torch.where(torch.rand((*rows, groups, 1), generator=g) < 0.5, 7, 15)
    codes = codes.scatter(-1, pos, six)
    pairs = codes.reshape(*rows, groups, 16, 2)
    blocks = (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8)
    scales = torch.randint(90, 165, (*rows, groups), generator=g, dtype=torch.uint8)
    return blocks, scales


def test_encode_decode_round_trip_exact():
    blocks, scales = _canonical((6, 10, 3), seed=2)
    w = decode_mxfp4(blocks, scales)
    b2, s2 = encode_mxfp4(w)
    assert torch.equal(b2, blocks) and torch.equal(s2, scales)    # same bytes back
    assert torch.equal(decode_mxfp4(b2, s2), w)


def test_encode_representable_values_without_a_six():
    """Values exactly representable in some scale round-trip exactly even when the encoder picks another scale."""
    g = torch.Generator().manual_seed(3)
    w = torch.tensor(E2M1[:8], dtype=torch.float32)[torch.randint(0, 6, (4, 64), generator=g)]  # max |v| <= 3
    w = w * torch.where(torch.rand(4, 64, generator=g) < 0.5, -1.0, 1.0) * 2.0 ** -5
    assert torch.equal(decode_mxfp4(*encode_mxfp4(w)), w)


def test_encode_rounds_to_nearest_ties_to_lower_magnitude():
    w = torch.zeros(1, 32)
    w[0, :6] = torch.tensor([6.0, 5.0, 2.5, 0.25, -5.0, -0.25])
    w[0, 6:9] = torch.tensor([5.1, 0.3, -1.3])
    b, s = encode_mxfp4(w)
    assert s.item() == 127
    out = decode_mxfp4(b, s)[0, :9].tolist()
    assert out == [6.0, 4.0, 2.0, 0.0, -4.0, 0.0, 6.0, 0.5, -1.5]
    assert not torch.signbit(decode_mxfp4(b, s)[0, 5])          # -0.25 -> +0 (no -0 emitted)


def test_encode_all_zero_group_is_finite():
    b, s = encode_mxfp4(torch.zeros(2, 64))
    assert torch.equal(decode_mxfp4(b, s), torch.zeros(2, 64))


def test_shape_and_dtype_errors():
    blocks, scales = one_group(ALL_CODES)
    with pytest.raises(TypeError, match="uint8"):
        decode_mxfp4(blocks.to(torch.int16), scales)
    with pytest.raises(TypeError, match="uint8"):
        decode_mxfp4(blocks, scales.to(torch.int32))
    with pytest.raises(TypeError, match="uint8"):
        decode_mxfp4(blocks.float(), scales)
    with pytest.raises(ValueError, match="shape"):
        decode_mxfp4(blocks[..., :15], scales)                     # 15 bytes per group
    with pytest.raises(ValueError, match="shape"):
        decode_mxfp4(blocks, torch.zeros(1, 2, dtype=torch.uint8))  # scales for 2 groups, blocks for 1
    with pytest.raises(ValueError, match="shape"):
        decode_mxfp4(blocks.reshape(1, 16), scales)               # no group dim
    with pytest.raises(ValueError, match="multiple of 32"):
        encode_mxfp4(torch.zeros(2, 48))
