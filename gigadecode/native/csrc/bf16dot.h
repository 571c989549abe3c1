// The bf16 dot-product path (AVX512-BF16): when the activations are bf16, products of bf16 activations and
// bf16-exact weights are exact in fp32, so `vdpbf16ps` (32 multiply-adds into 16 fp32 lanes per
// instruction) computes what the fp32 path computes, with fp32 sums. MXFP4 codes become bf16 e2m1 values by
// two byte lookups per 64 codes; the groups' powers of two multiply the fp32 partial sums (one
// fma per four groups), so any E8M0 scale is handled as the fp32 path handles it.
#pragma once

#include "vec.h"

#if defined(__AVX512BF16__)
#define GD_BF16DOT 1

namespace gd {

inline __m512 dot_bf16(__m512 acc, __m512i w, const uint16_t* x) {
  return _mm512_dpbf16_ps(acc, (__m512bh)w, (__m512bh)_mm512_loadu_si512(x));
}

// 64 bytes of MXFP4 codes (four groups; `nbytes` < 64 at a row's end) -> 128 bf16 e2m1 values in four
// vectors by two byte lookups per nibble half. 128-bit lane L of every vector holds group L: w[0] its even
// elements 0,2..14, w[1] even 16..30, w[2] odd 1..15, w[3] odd 17..31 (the inputs are laid out alike).
inline void decode_e2m1_bf16x4(const uint8_t* p, int nbytes, __m512i w[4]) {
  // low and high bytes of the bf16 bits of 0, .5, 1, 1.5, 2, 3, 4, 6, -0, -.5, …, -6
  const __m512i lut_lo = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 0, (char)0x80, (char)0xC0, 0, 0x40, (char)0x80,
      (char)0xC0, 0, 0, (char)0x80, (char)0xC0, 0, 0x40, (char)0x80, (char)0xC0));
  const __m512i lut_hi = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 0x3F, 0x3F, 0x3F, 0x40, 0x40, 0x40, 0x40,
      (char)0x80, (char)0xBF, (char)0xBF, (char)0xBF, (char)0xC0, (char)0xC0, (char)0xC0, (char)0xC0));
  const __m512i v = nbytes >= 64 ? _mm512_loadu_si512(p)
                                 : _mm512_maskz_loadu_epi8(__mmask64((~0ull) >> (64 - nbytes)), p);
  const __m512i nib = _mm512_set1_epi8(0x0F);
  const __m512i lo = _mm512_and_si512(v, nib), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
  const __m512i ll = _mm512_shuffle_epi8(lut_lo, lo), lh = _mm512_shuffle_epi8(lut_hi, lo);
  const __m512i hl = _mm512_shuffle_epi8(lut_lo, hi), hh = _mm512_shuffle_epi8(lut_hi, hi);
  w[0] = _mm512_unpacklo_epi8(ll, lh);
  w[1] = _mm512_unpackhi_epi8(ll, lh);
  w[2] = _mm512_unpacklo_epi8(hl, hh);
  w[3] = _mm512_unpackhi_epi8(hl, hh);
}

// E8M0 bytes of up to 16 groups -> their powers of two as fp32 lanes (2^(s-127); s = 0 is 2^-127, s = 255 inf)
inline __m512 e8m0_x16(const uint8_t* s, int n) {
  const __m512i e = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(__mmask16((1u << n) - 1), s));
  __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(e, 23));
  v = _mm512_mask_mov_ps(v, _mm512_cmpeq_epi32_mask(e, _mm512_setzero_si512()),
                         _mm512_castsi512_ps(_mm512_set1_epi32(0x00400000)));
  return _mm512_mask_mov_ps(v, _mm512_cmpeq_epi32_mask(e, _mm512_set1_epi32(255)), _mm512_set1_ps(INFINITY));
}

// fp32 lanes 4L..4L+3 = scale of group 4j+L (the dpbf16 lanes lane L's words sum into), j < 4
inline __m512 quad_scales(__m512 s16, int j) {
  const __m512i idx = _mm512_add_epi32(_mm512_set1_epi32(4 * j),
                                       _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3));
  return _mm512_permutexvar_ps(idx, s16);
}

}  // namespace gd
#endif
