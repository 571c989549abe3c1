// The vector layer every kernel is written against: one fp32 vector type `VF` of W lanes and the loads
// the kernels need (bf16, fp16 bits, FP8 e4m3, MXFP4 nibbles). Built once per ISA: with -mavx512f … the
// type is a __m512 (W = 16), otherwise with -mavx2 -mfma -mf16c a __m256 (W = 8). Kernels never test the
// ISA themselves; they use W and these functions.
#pragma once

#include <immintrin.h>
#include <cstdint>
#include <cstring>
#include <cmath>

namespace gd {

// The line `lead` bytes past p, into L2 (the prefetch of a weight stream; see common.h). Never faults.
inline void prefetch_l2(const void* p, int64_t lead) {
  _mm_prefetch(static_cast<const char*>(p) + lead, _MM_HINT_T1);
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
#if defined(__AVX512BF16__)
#define GD_ISA "avx512-bf16"
#else
#define GD_ISA "avx512"
#endif
constexpr int W = 16;
struct VF { __m512 v; };
inline VF vzero() { return {_mm512_setzero_ps()}; }
inline VF vset1(float x) { return {_mm512_set1_ps(x)}; }
inline VF vload(const float* p) { return {_mm512_loadu_ps(p)}; }
inline void vstore(float* p, VF a) { _mm512_storeu_ps(p, a.v); }
inline VF vfma(VF a, VF b, VF c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline VF vmul(VF a, VF b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline VF vadd(VF a, VF b) { return {_mm512_add_ps(a.v, b.v)}; }
inline VF vdiv(VF a, VF b) { return {_mm512_div_ps(a.v, b.v)}; }
inline float vsum(VF a) { return _mm512_reduce_add_ps(a.v); }
inline float vmaxall(VF a) { return _mm512_reduce_max_ps(a.v); }
// W bf16 values -> fp32 (bf16 is the top half of an fp32)
inline VF vload_bf16(const uint16_t* p) {
  __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(w, 16))};
}
// 2W bf16 values -> fp32, the even-indexed W in `even`, the odd-indexed in `odd`: each 32-bit word holds an
// even element in its low half and the next odd one in its high half, so a shift and a mask split them (no
// shuffle, which would take the port of one of the two FMA pipes on Intel cores)
inline void vload_bf16_pairs(const uint16_t* p, VF& even, VF& odd) {
  const __m512i w = _mm512_loadu_si512(p);
  even.v = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  odd.v = _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(int(0xFFFF0000u))));
}
// W FP8 e4m3 bytes -> fp32 / 256: the byte's exponent and mantissa bits placed into an fp16 (bias 15 vs 7:
// a factor 2^-8 for normal and subnormal values alike, which the caller folds into its scale). e4m3fn's NaN
// (S.1111.111) would land on the finite fp16 1.875 (480 / 256): those lanes are set to fp16 NaN, as the
// scalar fp8_to_f32 and torch read them.
inline VF vload_fp8_div256(const uint8_t* p) {
  const __m128i raw = _mm_loadu_si128((const __m128i*)p);
  // byte << 8, arithmetic >> 1: sign at bit 15, exponent and mantissa at bits 13..7; clear the sign copy at 14
  __m256i b = _mm256_slli_epi16(_mm256_cvtepu8_epi16(raw), 8);
  __m256i h = _mm256_and_si256(_mm256_srai_epi16(b, 1), _mm256_set1_epi16(short(0xBFFF)));
  const __mmask16 nan = _mm_cmpeq_epi8_mask(_mm_or_si128(raw, _mm_set1_epi8(char(0x80))), _mm_set1_epi8(char(0xFF)));
  h = _mm256_mask_mov_epi16(h, nan, _mm256_set1_epi16(short(0x7E00)));
  return {_mm512_cvtph_ps(h)};
}
inline void vload2_fp8_div256(const uint8_t* p, VF& first, VF& second) {
  first = vload_fp8_div256(p);
  second = vload_fp8_div256(p + 16);
}
// 4W bytes -> the four vectors at p, p + W, p + 2W, p + 3W, the integer steps on 32 lanes at a time: the
// bytes' qwords reordered so that unpacking them under zero bytes (in-lane: 128-bit lane i takes qwords 2i,
// 2i+1) yields the byte << 8 words in element order, 0-31 and 32-63. 64 values in ~17 instructions instead of
// ~40 (no widening shuffle a vector, no NaN fix-up a vector): the NaN test runs once over the 64 bytes, and a
// group holding an e4m3fn NaN takes the one-vector path above.
inline void vload4_fp8_div256(const uint8_t* p, VF v[4]) {
  const __m512i raw = _mm512_loadu_si512(p);
  if (_mm512_cmpeq_epi8_mask(_mm512_or_si512(raw, _mm512_set1_epi8(char(0x80))), _mm512_set1_epi8(char(0xFF)))) {
    for (int i = 0; i < 4; ++i) v[i] = vload_fp8_div256(p + i * W);
    return;
  }
  const __m512i b = _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 4, 1, 5, 2, 6, 3, 7), raw);
  const __m512i z = _mm512_setzero_si512(), keep = _mm512_set1_epi16(short(0xBFFF));
  // byte << 8, arithmetic >> 1, the sign copy at bit 14 cleared (vload_fp8_div256's steps)
  const __m512i lo = _mm512_and_si512(_mm512_srai_epi16(_mm512_unpacklo_epi8(z, b), 1), keep);
  const __m512i hi = _mm512_and_si512(_mm512_srai_epi16(_mm512_unpackhi_epi8(z, b), 1), keep);
  v[0].v = _mm512_cvtph_ps(_mm512_castsi512_si256(lo));
  v[1].v = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(lo, 1));
  v[2].v = _mm512_cvtph_ps(_mm512_castsi512_si256(hi));
  v[3].v = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(hi, 1));
}
// MXFP4: W bytes (2W e2m1 codes, low nibble first) -> values of the low nibbles (even elements) and of the
// high nibbles (odd elements), each times `scale`.
inline void vdecode_e2m1(const uint8_t* p, VF scale, VF& even, VF& odd) {
  // the table times the group's power of two: one multiply for both halves (the same products, so the same
  // values: x · 2^k is exact or rounds alike whichever operand is looked up first)
  const __m512 lut = _mm512_mul_ps(_mm512_setr_ps(0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f, -0.f, -.5f, -1.f, -1.5f,
                                                  -2.f, -3.f, -4.f, -6.f), scale.v);
  __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
  even.v = _mm512_permutexvar_ps(b, lut);                              // permutexvar uses the low 4 bits
  odd.v = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), lut);
}
// Eight vectors' even- and odd-lane sums at once: out lane 2i = Σ even lanes of v[i], 2i+1 = Σ odd lanes
// (a transpose-add tree, 22 instructions for the 16 sums instead of ~8 for each vector alone)
inline VF vsum_even_odd_x8(const VF v[8]) {
  __m512 s[4], t[2];
  for (int i = 0; i < 4; ++i)                                        // 512 -> 256 per vector, two a register
    s[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i].v, v[2 * i + 1].v, 0x44),
                         _mm512_shuffle_f32x4(v[2 * i].v, v[2 * i + 1].v, 0xEE));
  for (int i = 0; i < 2; ++i)                                        // 256 -> 128: quarter k = vector 4i+k
    t[i] = _mm512_add_ps(_mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], 0xDD));
  // 128 -> 64: quarter k = [E_k, O_k, E_k+4, O_k+4]
  const __m512 u = _mm512_add_ps(_mm512_shuffle_ps(t[0], t[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm512_shuffle_ps(t[0], t[1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512i order = _mm512_setr_epi32(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
  return {_mm512_permutexvar_ps(order, u)};
}
inline void vstore_sum_even_odd_x8(float* out, const VF v[8]) { vstore(out, vsum_even_odd_x8(v)); }
// The two floats at p (a token pair of packed K) in every 64-bit lane pair (a broadcast load: no shuffle port)
inline VF vbroadcast_pair(const float* p) {
  double x;
  std::memcpy(&x, p, sizeof x);
  return {_mm512_castpd_ps(_mm512_set1_pd(x))};
}
// The four floats at p (two dims of a packed-K token pair) in every 128-bit lane (a broadcast load)
inline VF vbroadcast_quad(const float* p) { return {_mm512_broadcast_f32x4(_mm_loadu_ps(p))}; }
// Eight vectors of W/4 float quads (m0 s0, m0 s1, m1 s0, m1 s1), each quad's two pairs added and transposed:
// out[h * ld + 2i + s] = lanes 4h + s + 4h + 2 + s of v[i] for h < nh (i < 8: 16 floats a row). Pairs of
// vectors are added pair-wise (64-bit unpacks), then their 128-bit lanes transposed.
inline void vstore_quads_summed_transposed(const VF v[8], float* out, int64_t ld, int nh) {
  __m512d z[4];                                       // 128-bit lane L: quad L's sums, rows 2k and 2k + 1
  for (int k = 0; k < 4; ++k) {
    const __m512d a = _mm512_castps_pd(v[2 * k].v), b = _mm512_castps_pd(v[2 * k + 1].v);
    z[k] = _mm512_castps_pd(_mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                                          _mm512_castpd_ps(_mm512_unpackhi_pd(a, b))));
  }
  const __m512d y0 = _mm512_shuffle_f64x2(z[0], z[1], 0x44), y1 = _mm512_shuffle_f64x2(z[0], z[1], 0xEE);
  const __m512d y2 = _mm512_shuffle_f64x2(z[2], z[3], 0x44), y3 = _mm512_shuffle_f64x2(z[2], z[3], 0xEE);
  const __m512d row[4] = {_mm512_shuffle_f64x2(y0, y2, 0x88), _mm512_shuffle_f64x2(y0, y2, 0xDD),
                          _mm512_shuffle_f64x2(y1, y3, 0x88), _mm512_shuffle_f64x2(y1, y3, 0xDD)};
  for (int h = 0; h < nh; ++h) _mm512_storeu_pd(reinterpret_cast<double*>(out + h * ld), row[h]);
}
// Eight vectors of W/2 float pairs, transposed as 64-bit elements: out[h * ld + 2i + s] = lane 2h + s of v[i]
// for the pairs h < nh (i < 8: 16 floats a row). Three rounds of 8 shuffles: pairs of vectors, 256-bit and
// 128-bit halves.
inline void vstore_pairs_transposed(const VF v[8], float* out, int64_t ld, int nh) {
  __m512d t[8];
  for (int k = 0; k < 4; ++k) {                       // lane L: (v2k, v2k+1)'s pair 2L (even t) / 2L+1 (odd t)
    const __m512d a = _mm512_castps_pd(v[2 * k].v), b = _mm512_castps_pd(v[2 * k + 1].v);
    t[2 * k] = _mm512_unpacklo_pd(a, b);
    t[2 * k + 1] = _mm512_unpackhi_pd(a, b);
  }
  for (int par = 0; par < 2; ++par) {
    // u0: pairs par, 4+par of rows 0-3; u1: 2+par, 6+par of rows 0-3; u2, u3: the same of rows 4-7
    const __m512d u0 = _mm512_shuffle_f64x2(t[par], t[2 + par], 0x88), u1 = _mm512_shuffle_f64x2(t[par], t[2 + par], 0xDD);
    const __m512d u2 = _mm512_shuffle_f64x2(t[4 + par], t[6 + par], 0x88), u3 = _mm512_shuffle_f64x2(t[4 + par], t[6 + par], 0xDD);
    const __m512d row[4] = {_mm512_shuffle_f64x2(u0, u2, 0x88), _mm512_shuffle_f64x2(u1, u3, 0x88),
                            _mm512_shuffle_f64x2(u0, u2, 0xDD), _mm512_shuffle_f64x2(u1, u3, 0xDD)};
    for (int k = 0; k < 4; ++k) {                     // pair h = 2k + par
      const int h = 2 * k + par;
      if (h < nh) _mm512_storeu_pd(reinterpret_cast<double*>(out + h * ld), row[k]);
    }
  }
}
// (even, odd) lanes -> the 2W values in element order: first = e0 o0 e1 o1 … (W lanes), second = the rest
inline void vinterleave(VF even, VF odd, VF& first, VF& second) {
  const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i hi = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  first.v = _mm512_permutex2var_ps(even.v, lo, odd.v);
  second.v = _mm512_permutex2var_ps(even.v, hi, odd.v);
}
// 2W values in element order (first, second) -> their even and odd elements
inline void vdeinterleave(VF first, VF second, VF& even, VF& odd) {
  const __m512i e = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  even.v = _mm512_permutex2var_ps(first.v, e, second.v);
  odd.v = _mm512_permutex2var_ps(first.v, _mm512_add_epi32(e, _mm512_set1_epi32(1)), second.v);
}
// min / max; NaN in b propagates (so vmin(vset1(limit), x) clamps like torch.clamp)
inline VF vmin(VF a, VF b) { return {_mm512_min_ps(a.v, b.v)}; }
inline VF vmax(VF a, VF b) { return {_mm512_max_ps(a.v, b.v)}; }
// W fp32 values that are exact in bf16 -> bf16 (truncation is then exact)
inline void vstore_bf16_exact(uint16_t* p, VF a) {
  _mm256_storeu_si256((__m256i*)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(a.v), 16)));
}
// e^x for x <= 88 (x = -inf gives ~1e-38; callers never use masked lanes): 2^n · p(f), Cephes' polynomial.
// The clamp keeps NaN: max / min return their second operand when either is NaN, so x goes second (a NaN
// score must give NaN, as std::exp and torch do, not e^-87)
// (`hi`: the upper clamp; 88.3 keeps 2^n finite, past 88.73 n reaches 128 and 2^n's bits are +inf)
inline VF vexp_upto(VF x, float hi) {
  __m512 v = _mm512_min_ps(_mm512_set1_ps(hi), _mm512_max_ps(_mm512_set1_ps(-87.3f), x.v));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(v, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 f = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), v);
  f = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), f);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(f, f), _mm512_add_ps(f, _mm512_set1_ps(1.f)));
  __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return {_mm512_mul_ps(p, _mm512_castsi512_ps(e))};
}
inline VF vexp(VF x) { return vexp_upto(x, 88.3f); }
// e^x where x past ~88.4 gives +inf (vexp gives e^88.3 there), through the exponent bits at n = 128, at no
// extra instruction: a sigmoid's 1 / (1 + e^-x) must reach 0, so that g · sigmoid(alpha · g) of a huge
// negative g is -0 (NaN for -inf), as torch and std::exp give
inline VF vexp_or_inf(VF x) { return vexp_upto(x, 89.f); }
#else
#define GD_ISA "avx2"
constexpr int W = 8;
struct VF { __m256 v; };
inline VF vzero() { return {_mm256_setzero_ps()}; }
inline VF vset1(float x) { return {_mm256_set1_ps(x)}; }
inline VF vload(const float* p) { return {_mm256_loadu_ps(p)}; }
inline void vstore(float* p, VF a) { _mm256_storeu_ps(p, a.v); }
inline VF vfma(VF a, VF b, VF c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
inline VF vmul(VF a, VF b) { return {_mm256_mul_ps(a.v, b.v)}; }
inline VF vadd(VF a, VF b) { return {_mm256_add_ps(a.v, b.v)}; }
inline VF vdiv(VF a, VF b) { return {_mm256_div_ps(a.v, b.v)}; }
inline float vsum(VF a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline float vmaxall(VF a) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline VF vload_bf16(const uint16_t* p) {
  __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p));
  return {_mm256_castsi256_ps(_mm256_slli_epi32(w, 16))};
}
inline void vload_bf16_pairs(const uint16_t* p, VF& even, VF& odd) {
  const __m256i w = _mm256_loadu_si256((const __m256i*)p);
  even.v = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  odd.v = _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32(int(0xFFFF0000u))));
}
// fp16 bits h of FP8 bytes / 256 (below) -> the same, with e4m3fn's NaN (S.1111.111, which lands on the finite
// fp16 ±1.875 = 480 / 256) made an fp16 NaN by setting the exponent's top bits: S.11111.11 (as torch reads it)
inline __m128i fp8_half_nan(__m128i h) {
  const __m128i nan = _mm_cmpeq_epi16(_mm_and_si128(h, _mm_set1_epi16(0x7FFF)), _mm_set1_epi16(0x3F80));
  return _mm_or_si128(h, _mm_and_si128(nan, _mm_set1_epi16(0x7C00)));
}
inline __m256i fp8_half_nan(__m256i h) {
  const __m256i nan = _mm256_cmpeq_epi16(_mm256_and_si256(h, _mm256_set1_epi16(0x7FFF)), _mm256_set1_epi16(0x3F80));
  return _mm256_or_si256(h, _mm256_and_si256(nan, _mm256_set1_epi16(0x7C00)));
}
inline VF vload_fp8_div256(const uint8_t* p) {
  __m128i b = _mm_slli_epi16(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i*)p)), 8);
  __m128i h = _mm_and_si128(_mm_srai_epi16(b, 1), _mm_set1_epi16(short(0xBFFF)));
  return {_mm256_cvtph_ps(fp8_half_nan(h))};
}
// FP8 e4m3 bytes as the high byte of 16-bit words (byte << 8) -> the fp16 bits of their values / 256: the
// arithmetic shift moves exponent and mantissa under fp16's, keeping the sign; the mask clears the sign copy
inline __m256i fp8_words_to_half(__m256i b) {
  return fp8_half_nan(_mm256_and_si256(_mm256_srai_epi16(b, 1), _mm256_set1_epi16(short(0xBFFF))));
}
// 2W FP8 bytes at once: the integer steps on 16 lanes (8 instructions for 16 values instead of 12)
inline void vload2_fp8_div256(const uint8_t* p, VF& first, VF& second) {
  const __m256i h = fp8_words_to_half(_mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)p)), 8));
  first.v = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
  second.v = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
}
// 4W FP8 bytes -> the four vectors at p, p + W, p + 2W, p + 3W, all in-lane: unpacking the bytes under zero
// bytes gives the byte << 8 words directly (no lane-crossing widening, no shift: 13 instructions for 32
// values instead of 16); the low unpack holds bytes 0-7 and 16-23, the high one 8-15 and 24-31
inline void vload4_fp8_div256(const uint8_t* p, VF v[4]) {
  const __m256i b = _mm256_loadu_si256((const __m256i*)p), z = _mm256_setzero_si256();
  const __m256i lo = fp8_words_to_half(_mm256_unpacklo_epi8(z, b));
  const __m256i hi = fp8_words_to_half(_mm256_unpackhi_epi8(z, b));
  v[0].v = _mm256_cvtph_ps(_mm256_castsi256_si128(lo));
  v[1].v = _mm256_cvtph_ps(_mm256_castsi256_si128(hi));
  v[2].v = _mm256_cvtph_ps(_mm256_extracti128_si256(lo, 1));
  v[3].v = _mm256_cvtph_ps(_mm256_extracti128_si256(hi, 1));
}
inline void vdecode_e2m1(const uint8_t* p, VF scale, VF& even, VF& odd) {
  // magnitude from an 8-entry table (times the group's power of two: one multiply), sign from bit 3 of the code
  const __m256 lut = _mm256_mul_ps(_mm256_setr_ps(0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f), scale.v);
  __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p));
  __m256i hi = _mm256_srli_epi32(b, 4);
  __m256 lo_m = _mm256_permutevar8x32_ps(lut, b);                     // uses the low 3 bits
  __m256 hi_m = _mm256_permutevar8x32_ps(lut, hi);
  __m256i lo_s = _mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(8)), 28);
  __m256i hi_s = _mm256_slli_epi32(_mm256_and_si256(hi, _mm256_set1_epi32(8)), 28);
  even.v = _mm256_xor_ps(lo_m, _mm256_castsi256_ps(lo_s));
  odd.v = _mm256_xor_ps(hi_m, _mm256_castsi256_ps(hi_s));
}
// Eight vectors' even- and odd-lane sums at once: out[2i] = Σ even lanes of v[i], out[2i + 1] = Σ odd lanes.
// A vector is four (even, odd) pairs; pairs of vectors are added pair-chunk-wise (64-bit unpacks), then the
// 128-bit halves of two such results (18 instructions for the 16 sums instead of ~5 for each pair).
inline void vstore_sum_even_odd_x8(float* out, const VF v[8]) {
  __m256 s[4];
  for (int i = 0; i < 4; ++i) {                      // [v2i.c0+c1, v2i+1.c0+c1 | v2i.c2+c3, v2i+1.c2+c3]
    const __m256d a = _mm256_castps_pd(v[2 * i].v), b = _mm256_castps_pd(v[2 * i + 1].v);
    s[i] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(a, b)), _mm256_castpd_ps(_mm256_unpackhi_pd(a, b)));
  }
  for (int j = 0; j < 2; ++j)                         // the pairs of v[4j .. 4j+3], in order
    _mm256_storeu_ps(out + 8 * j, _mm256_add_ps(_mm256_permute2f128_ps(s[2 * j], s[2 * j + 1], 0x20),
                                                _mm256_permute2f128_ps(s[2 * j], s[2 * j + 1], 0x31)));
}
// The two floats at p (a token pair of packed K) in every 64-bit lane pair
inline VF vbroadcast_pair(const float* p) {
  double x;
  std::memcpy(&x, p, sizeof x);
  return {_mm256_castpd_ps(_mm256_set1_pd(x))};
}
// The four floats at p (two dims of a packed-K token pair) in both 128-bit lanes (a broadcast load)
inline VF vbroadcast_quad(const float* p) { return {_mm256_broadcast_ps(reinterpret_cast<const __m128*>(p))}; }
// Eight vectors of W/4 float quads (m0 s0, m0 s1, m1 s0, m1 s1), each quad's two pairs added and transposed:
// out[h * ld + 2i + s] = lanes 4h + s + 4h + 2 + s of v[i] for h < nh (i < 8: 16 floats a row)
inline void vstore_quads_summed_transposed(const VF v[8], float* out, int64_t ld, int nh) {
  __m256 z[4];                                        // 128-bit lane L: quad L's sums, rows 2k and 2k + 1
  for (int k = 0; k < 4; ++k) {
    const __m256d a = _mm256_castps_pd(v[2 * k].v), b = _mm256_castps_pd(v[2 * k + 1].v);
    z[k] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(a, b)), _mm256_castpd_ps(_mm256_unpackhi_pd(a, b)));
  }
  _mm256_storeu_ps(out, _mm256_permute2f128_ps(z[0], z[1], 0x20));          // quad 0: the low lanes
  _mm256_storeu_ps(out + 8, _mm256_permute2f128_ps(z[2], z[3], 0x20));
  if (nh > 1) {                                                               // quad 1: the high lanes
    _mm256_storeu_ps(out + ld, _mm256_permute2f128_ps(z[0], z[1], 0x31));
    _mm256_storeu_ps(out + ld + 8, _mm256_permute2f128_ps(z[2], z[3], 0x31));
  }
}
// Eight vectors of W/2 float pairs, transposed as 64-bit elements: out[h * ld + 2i + s] = lane 2h + s of v[i]
// for the pairs h < nh (i < 8: 16 floats a row, rows 0-3 of v in its first vector, 4-7 in its second)
inline void vstore_pairs_transposed(const VF v[8], float* out, int64_t ld, int nh) {
  for (int half = 0; half < 2; ++half) {
    const VF* w = v + 4 * half;
    const __m256d a = _mm256_castps_pd(w[0].v), b = _mm256_castps_pd(w[1].v);
    const __m256d c = _mm256_castps_pd(w[2].v), e = _mm256_castps_pd(w[3].v);
    const __m256d t0 = _mm256_unpacklo_pd(a, b), t1 = _mm256_unpackhi_pd(a, b);   // pairs 0, 2 / 1, 3 of rows 0-1
    const __m256d t2 = _mm256_unpacklo_pd(c, e), t3 = _mm256_unpackhi_pd(c, e);   // the same of rows 2-3
    const __m256d row[4] = {_mm256_permute2f128_pd(t0, t2, 0x20), _mm256_permute2f128_pd(t1, t3, 0x20),
                            _mm256_permute2f128_pd(t0, t2, 0x31), _mm256_permute2f128_pd(t1, t3, 0x31)};
    for (int h = 0; h < nh; ++h) _mm256_storeu_pd(reinterpret_cast<double*>(out + h * ld + 8 * half), row[h]);
  }
}
inline void vinterleave(VF even, VF odd, VF& first, VF& second) {
  const __m256 a = _mm256_unpacklo_ps(even.v, odd.v), b = _mm256_unpackhi_ps(even.v, odd.v);  // in-lane pairs
  first.v = _mm256_permute2f128_ps(a, b, 0x20);
  second.v = _mm256_permute2f128_ps(a, b, 0x31);
}
inline void vdeinterleave(VF first, VF second, VF& even, VF& odd) {
  const __m256 a = first.v, b = second.v;
  even.v = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, 0x88)), 0xD8));
  odd.v = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, 0xDD)), 0xD8));
}
inline VF vmin(VF a, VF b) { return {_mm256_min_ps(a.v, b.v)}; }
inline VF vmax(VF a, VF b) { return {_mm256_max_ps(a.v, b.v)}; }
inline void vstore_bf16_exact(uint16_t* p, VF a) {
  const __m256i s = _mm256_srli_epi32(_mm256_castps_si256(a.v), 16);
  _mm_storeu_si128((__m128i*)p, _mm_packus_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1)));
}
inline VF vexp_upto(VF x, float hi) {   // as above: x second in the clamp, so NaN stays NaN
  __m256 v = _mm256_min_ps(_mm256_set1_ps(hi), _mm256_max_ps(_mm256_set1_ps(-87.3f), x.v));
  __m256 n = _mm256_round_ps(_mm256_mul_ps(v, _mm256_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 f = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), v);
  f = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), f);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(f, f), _mm256_add_ps(f, _mm256_set1_ps(1.f)));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return {_mm256_mul_ps(p, _mm256_castsi256_ps(e))};
}
inline VF vexp(VF x) { return vexp_upto(x, 88.3f); }
inline VF vexp_or_inf(VF x) { return vexp_upto(x, 89.f); }   // as above
#endif

// ---- scalar conversions (exact, round-to-nearest-even like torch's casts) ---------------------------
inline float bf16_to_f32(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);   // NaN stays NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}
// e4m3fn (bias 7, no infinities, max 448): value of one byte
inline float fp8_to_f32(uint8_t b) {
  int e = (b >> 3) & 0xF, m = b & 7;
  float v = e == 0 ? std::ldexp(float(m), -9) : std::ldexp(float(8 + m), e - 10);
  if (e == 15 && m == 7) v = NAN;
  return (b & 0x80) ? -v : v;
}
// fp32 -> e4m3fn, saturating to ±448 (the caller clamps as the torch code does), ties to even; on the bits
// (checked against the frexp / nearbyint form it replaced over all 2^32 inputs: 8x faster)
inline uint8_t f32_to_fp8(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  const uint8_t sign = uint8_t((u >> 24) & 0x80);
  u &= 0x7fffffffu;
  if (u > 0x7f800000u) return 0x7F;                    // NaN
  if (u >= 0x43E00000u) return sign | 0x7E;            // |x| >= 448
  if (u < 0x3C800000u) {                               // |x| < 2^-6: subnormal, a step of 2^-9
    float a;
    std::memcpy(&a, &u, 4);
    const float q = (a * 512.f + 8388608.f) - 8388608.f;  // to an integer, ties to even (q <= 8: 8 is the
    return sign | uint8_t(q);                              // smallest normal, the same bits)
  }
  // 1.m rounded to three mantissa bits, ties to even (a carry moves into the exponent), rebiased 127 -> 7
  const uint32_t r = (u + 0x7FFFFu + ((u >> 20) & 1u)) >> 20;
  return sign | uint8_t(r - ((127 - 7) << 3));
}

}  // namespace gd
