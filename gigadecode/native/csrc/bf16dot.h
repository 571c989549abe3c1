// The bf16 dot-product path (AVX512-BF16): when the activations are bf16, products of bf16 activations and
// bf16-exact weights are exact in fp32, so `vdpbf16ps` (32 multiply-adds into 16 fp32 lanes per
// instruction) computes what the fp32 path computes, with fp32 sums. MXFP4 codes become bf16 e2m1 values by
// one 32-entry table lookup per 32 codes; the groups' powers of two multiply the fp32 partial sums (one
// fma per two groups), so any E8M0 scale is handled as the fp32 path handles it.
#pragma once

#include "vec.h"

#if defined(__AVX512BF16__)
#define GD_BF16DOT 1

namespace gd {

inline __m512 dot_bf16(__m512 acc, __m512i w, const uint16_t* x) {
  return _mm512_dpbf16_ps(acc, (__m512bh)w, (__m512bh)_mm512_loadu_si512(x));
}

// 32 bytes of MXFP4 codes (two groups) -> bf16 e2m1 values of the low nibbles (even elements of the two
// groups, group-major) and of the high nibbles (odd elements). `half`: only the first group exists.
inline void decode_e2m1_bf16(const uint8_t* p, bool half, __m512i& lo_w, __m512i& hi_w) {
  // bf16 bits of 0, .5, 1, 1.5, 2, 3, 4, 6 and their negatives (entries 16..31 unused)
  const __m512i lut = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                       (short)0xC0C0, (short)0xC080, (short)0xC040, (short)0xC000,
                                       (short)0xBFC0, (short)0xBF80, (short)0xBF00, (short)0x8000,
                                       0x40C0, 0x4080, 0x4040, 0x4000, 0x3FC0, 0x3F80, 0x3F00, 0x0000);
  const __m256i bytes = half ? _mm256_maskz_loadu_epi8(0xFFFF, p) : _mm256_loadu_si256((const __m256i*)p);
  const __m512i b = _mm512_cvtepu8_epi16(bytes);
  lo_w = _mm512_permutexvar_epi16(_mm512_and_si512(b, _mm512_set1_epi16(0x0F)), lut);
  hi_w = _mm512_permutexvar_epi16(_mm512_srli_epi16(b, 4), lut);
}

// E8M0 bytes of up to 16 groups -> their powers of two as fp32 lanes (2^(s-127); s = 0 is 2^-127, s = 255 inf)
inline __m512 e8m0_x16(const uint8_t* s, int n) {
  const __m512i e = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(__mmask16((1u << n) - 1), s));
  __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(e, 23));
  v = _mm512_mask_mov_ps(v, _mm512_cmpeq_epi32_mask(e, _mm512_setzero_si512()),
                         _mm512_castsi512_ps(_mm512_set1_epi32(0x00400000)));
  return _mm512_mask_mov_ps(v, _mm512_cmpeq_epi32_mask(e, _mm512_set1_epi32(255)), _mm512_set1_ps(INFINITY));
}

// lanes 0..7 = scale of group 2j, lanes 8..15 = group 2j+1 (the dpbf16 lanes those groups sum into), j < 8
inline __m512 pair_scales(__m512 s16, int j) {
  const __m512i idx = _mm512_set_epi32(2 * j + 1, 2 * j + 1, 2 * j + 1, 2 * j + 1, 2 * j + 1, 2 * j + 1, 2 * j + 1,
                                       2 * j + 1, 2 * j, 2 * j, 2 * j, 2 * j, 2 * j, 2 * j, 2 * j, 2 * j);
  return _mm512_permutexvar_ps(idx, s16);
}

}  // namespace gd
#endif
