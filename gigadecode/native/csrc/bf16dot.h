// The bf16 dot-product path (AVX512-BF16): when the activations are bf16, products of bf16 activations and
// bf16-exact weights are exact in fp32, so `vdpbf16ps` (32 multiply-adds into 16 fp32 lanes per
// instruction) computes what the fp32 path computes, with fp32 sums. MXFP4 codes become bf16 weights by
// one 16-entry table lookup per 32 codes, and the group's power of two is added to their exponent field
// (codes of magnitude 0 stay 0). Valid for E8M0 scales in [BF16_SCALE_MIN, BF16_SCALE_MAX] (the caller checks).
#pragma once

#include "vec.h"

#if defined(__AVX512BF16__)
#define GD_BF16DOT 1

namespace gd {

constexpr int BF16_SCALE_MIN = 3, BF16_SCALE_MAX = 250;   // keeps 2^(s-127) · e2m1 a normal bf16

inline __m512 dot_bf16(__m512 acc, __m512i w, const uint16_t* x) {
  return _mm512_dpbf16_ps(acc, (__m512bh)w, (__m512bh)_mm512_loadu_si512(x));
}

// 32 bytes of MXFP4 codes (two groups: scales s0, s1) -> bf16 weights of the low nibbles (even elements of
// the two groups, group-major) and of the high nibbles (odd elements). `half`: only the first group exists.
inline void decode_e2m1_bf16(const uint8_t* p, int s0, int s1, bool half, __m512i& lo_w, __m512i& hi_w) {
  // bf16 bits of 0, .5, 1, 1.5, 2, 3, 4, 6 and their negatives (entries 16..31 unused)
  const __m512i lut = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                       (short)0xC0C0, (short)0xC080, (short)0xC040, (short)0xC000,
                                       (short)0xBFC0, (short)0xBF80, (short)0xBF00, (short)0x8000,
                                       0x40C0, 0x4080, 0x4040, 0x4000, 0x3FC0, 0x3F80, 0x3F00, 0x0000);
  const __m256i bytes = half ? _mm256_maskz_loadu_epi8(0xFFFF, p) : _mm256_loadu_si256((const __m256i*)p);
  const __m512i b = _mm512_cvtepu8_epi16(bytes);
  const __m512i lo = _mm512_and_si512(b, _mm512_set1_epi16(0x0F)), hi = _mm512_srli_epi16(b, 4);
  const __m512i sadd = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi16(short((s0 - 127) << 7))),
                                          _mm256_set1_epi16(short((s1 - 127) << 7)), 1);
  const __m512i seven = _mm512_set1_epi16(7);
  lo_w = _mm512_permutexvar_epi16(lo, lut);
  hi_w = _mm512_permutexvar_epi16(hi, lut);
  lo_w = _mm512_mask_add_epi16(lo_w, _mm512_test_epi16_mask(lo, seven), lo_w, sadd);
  hi_w = _mm512_mask_add_epi16(hi_w, _mm512_test_epi16_mask(hi, seven), hi_w, sadd);
}

}  // namespace gd
#endif
