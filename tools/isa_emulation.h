// The AVX-512 (F/BW/VL/DQ/BF16) intrinsics the native kernels use, for a build that runs on an AVX2 CPU
// (tools/isa_check.py): GCC's own vector types first, then SIMDe's portable implementations under the
// intrinsics' names, then the few SIMDe 0.8.2 lacks or gets wrong, written here after the instructions'
// definitions (its masked loads read, and its masked stores write zeros over, the lanes a mask leaves out).
// For checking the AVX-512 code paths' results where no AVX-512 CPU is at hand; never for speed.
#pragma once
#include <x86intrin.h>
#include <cstdint>
#include <cstring>
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>

namespace gd_emu {

template <class To, class From> inline To bits(const From& x) {
  static_assert(sizeof(To) == sizeof(From));
  To y;
  std::memcpy(&y, &x, sizeof y);
  return y;
}
struct F32x16 { float v[16]; };
struct I32x16 { int32_t v[16]; };
struct U8x16 { uint8_t v[16]; };
struct U8x64 { uint8_t v[64]; };
struct I16x16 { int16_t v[16]; };
struct U16x16 { uint16_t v[16]; };
struct U16x32 { uint16_t v[32]; };

// vmovdqu8 with a zero mask: bytes whose mask bit is clear are neither read nor kept
inline __m512i maskz_loadu_epi8_512(uint64_t k, const void* p) {
  U8x64 b{};
  for (int i = 0; i < 64; ++i) if ((k >> i) & 1) b.v[i] = static_cast<const uint8_t*>(p)[i];
  return bits<__m512i>(b);
}
inline __m128i maskz_loadu_epi8_128(uint16_t k, const void* p) {
  U8x16 b{};
  for (int i = 0; i < 16; ++i) if ((k >> i) & 1) b.v[i] = static_cast<const uint8_t*>(p)[i];
  return bits<__m128i>(b);
}
// vmovups / vmovdqu32 with a mask: lanes whose mask bit is clear are neither read (zeros) nor written (memory
// keeps them: a block's last inputs must not clear the next block's, which another thread may be writing)
inline __m512 maskz_loadu_ps(uint16_t k, const void* p) {
  F32x16 f{};
  for (int i = 0; i < 16; ++i) if ((k >> i) & 1) f.v[i] = static_cast<const float*>(p)[i];
  return bits<__m512>(f);
}
inline void mask_storeu_epi32(void* p, uint16_t k, __m512i a) {
  const I32x16 v = bits<I32x16>(a);
  for (int i = 0; i < 16; ++i) if ((k >> i) & 1) static_cast<int32_t*>(p)[i] = v.v[i];
}
// GCC's order: the 256-bit halves, then the 128-bit halves, then pairs
inline float reduce_add_ps(__m512 a) {
  const F32x16 f = bits<F32x16>(a);
  float s8[8], s4[4];
  for (int i = 0; i < 8; ++i) s8[i] = f.v[i] + f.v[i + 8];
  for (int i = 0; i < 4; ++i) s4[i] = s8[i] + s8[i + 4];
  return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}
inline __m256i cvtepi32_epi16(__m512i a) {                         // truncation
  const I32x16 x = bits<I32x16>(a);
  I16x16 y;
  for (int i = 0; i < 16; ++i) y.v[i] = int16_t(x.v[i]);
  return bits<__m256i>(y);
}
inline __m512i cvtepu8_epi32(__m128i a) {
  const U8x16 x = bits<U8x16>(a);
  I32x16 y;
  for (int i = 0; i < 16; ++i) y.v[i] = x.v[i];
  return bits<__m512i>(y);
}
inline __m512i mask_sub_epi16(__m512i src, uint32_t k, __m512i a, __m512i b) {   // lanes of k: a - b
  U16x32 y = bits<U16x32>(src);
  const U16x32 x = bits<U16x32>(a), z = bits<U16x32>(b);
  for (int i = 0; i < 32; ++i) if ((k >> i) & 1) y.v[i] = uint16_t(x.v[i] - z.v[i]);
  return bits<__m512i>(y);
}
inline uint16_t cmpeq_epi8_mask_128(__m128i a, __m128i b) {
  const U8x16 x = bits<U8x16>(a), y = bits<U8x16>(b);
  uint16_t m = 0;
  for (int i = 0; i < 16; ++i) m |= uint16_t(x.v[i] == y.v[i]) << i;
  return m;
}
inline uint16_t cmplt_epi32_mask(__m512i a, __m512i b) {
  const I32x16 x = bits<I32x16>(a), y = bits<I32x16>(b);
  uint16_t m = 0;
  for (int i = 0; i < 16; ++i) m |= uint16_t(x.v[i] < y.v[i]) << i;
  return m;
}
// vcvtneps2bf16: round to nearest even, denormal inputs as zero, NaN quieted
inline uint16_t to_bf16(float f) {
  const uint32_t u = bits<uint32_t>(f);
  if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x7fffffu)) return uint16_t((u >> 16) | 0x40);
  if ((u & 0x7f800000u) == 0) return uint16_t((u >> 16) & 0x8000);
  return uint16_t((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}
inline __m256bh cvtneps_pbh(__m512 a) {
  const F32x16 f = bits<F32x16>(a);
  U16x16 y;
  for (int i = 0; i < 16; ++i) y.v[i] = to_bf16(f.v[i]);
  return bits<__m256bh>(y);
}
inline __m512bh cvtne2ps_pbh(__m512 a, __m512 b) {                   // low half from b, high half from a
  const F32x16 fa = bits<F32x16>(a), fb = bits<F32x16>(b);
  U16x32 y;
  for (int i = 0; i < 16; ++i) y.v[i] = to_bf16(fb.v[i]), y.v[16 + i] = to_bf16(fa.v[i]);
  return bits<__m512bh>(y);
}

}  // namespace gd_emu

#define _mm512_maskz_loadu_epi8(k, p) gd_emu::maskz_loadu_epi8_512((k), (p))
#define _mm_maskz_loadu_epi8(k, p) gd_emu::maskz_loadu_epi8_128((k), (p))
#undef _mm512_maskz_loadu_ps                                        // SIMDe's (see the top)
#undef _mm512_mask_storeu_epi32
#define _mm512_maskz_loadu_ps(k, p) gd_emu::maskz_loadu_ps((k), (p))
#define _mm512_mask_storeu_epi32(p, k, a) gd_emu::mask_storeu_epi32((p), (k), (a))
#define _mm512_reduce_add_ps(a) gd_emu::reduce_add_ps(a)
#define _mm512_cvtepi32_epi16(a) gd_emu::cvtepi32_epi16(a)
#define _mm512_cvtepu8_epi32(a) gd_emu::cvtepu8_epi32(a)
#define _mm512_cmplt_epi32_mask(a, b) gd_emu::cmplt_epi32_mask((a), (b))
#define _mm_cmpeq_epi8_mask(a, b) gd_emu::cmpeq_epi8_mask_128((a), (b))
#define _mm512_mask_sub_epi16(src, k, a, b) gd_emu::mask_sub_epi16((src), (k), (a), (b))
#define _mm512_cvtneps_pbh(a) gd_emu::cvtneps_pbh(a)
#define _mm512_cvtne2ps_pbh(a, b) gd_emu::cvtne2ps_pbh((a), (b))
