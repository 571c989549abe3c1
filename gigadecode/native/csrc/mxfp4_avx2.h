// The MXFP4 path of the AVX2 build (no AVX-512): codes become fp32 values by byte lookups, two groups at a
// time. A 32-byte chunk of a row (groups 2c and 2c+1, one per 128-bit lane) is split into nibbles; one
// `vpshufb` per nibble half and byte gives the low and the high byte of each value's bf16 bits (e2m1 values
// have two significant bits: bf16-exact), byte unpacks make the bf16 words and a shift / a mask their fp32
// (a bf16 is the top half of an fp32): 16 shuffles and logic ops for 64 values, against 48 for the fp32
// table lookup. The values come out in a fixed order within the chunk (`X64_ELEM`), in which the inputs are
// stored, so they meet without shuffles; the groups' powers of two multiply the chunk's partial sums.
// bf16 activations take a faster form (`MxTileI16`): the same lookups give the codes as int16 words (twice
// the value), multiplied with int16-quantized inputs by `_mm256_madd_epi16` (16 products an instruction, no
// widening to fp32): ~1.5x the fp32 tile at one or two inputs per expert, for a rounding of the inputs to
// 2^-16 of their group's largest value. fp32 activations keep the exact fp32 tile.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>

#include "common.h"

namespace gd {

// bf16 inputs on AVX2 (`MxTileI16`): a chunk of 64 inputs as int16 in the decode's word order, and its two groups'
// scales. Group g of an input: q = round(x · 32767 / m), m = max |x| over the group, so |x - q·s| <= s/2 with
// s = m / 32767: an error of at most 2^-16 of the group's largest value (bf16's own rounding is 2^-9 of each).
struct QChunk {
  int16_t q[64];          // word q*16 + L*8 + k = element 32L + {2k, 16+2k, 2k+1, 17+2k}[q] (as decode_e2m1_int16)
  float s[8];             // lanes 0..3: s / 2 of group 2c, 4..7: of group 2c+1 (the weights' words are 2 x value)
};

// The decode's word order (bf16dot.h and decode_e2m1_lut alike): word k of a group's word vector q holds the
// group's element WORD_ELEM[q] + 2k
constexpr int WORD_ELEM[4] = {0, 16, 1, 17};

// x [K] -> (K + 63) / 64 chunks, zero-padded (a missing group: q 0, s 0). A group holding a NaN or an infinity
// gets s = NaN, so every sum it enters is NaN, as with the exact values.
inline void quantize_x64(const float* x, int64_t K, QChunk* out) {
  const int64_t chunks = (K + 63) / 64;
  for (int64_t c = 0; c < chunks; ++c) {
    QChunk& o = out[c];
    for (int L = 0; L < 2; ++L) {
      const int64_t g0 = c * 64 + 32 * L, n = std::max<int64_t>(0, std::min<int64_t>(32, K - g0));
      float m = 0.f;
      bool finite = true;
      for (int64_t i = 0; i < n; ++i) {
        const float a = std::fabs(x[g0 + i]);
        finite &= a <= std::numeric_limits<float>::max();   // false for NaN and inf
        m = std::max(m, a);
      }
      if (!finite) {
        for (int q = 0; q < 4; ++q) std::fill(o.q + q * 16 + L * 8, o.q + q * 16 + L * 8 + 8, int16_t(0));
        for (int i = 0; i < 4; ++i) o.s[4 * L + i] = std::numeric_limits<float>::quiet_NaN();
        continue;
      }
      const float inv = m > 0.f ? 32767.f / m : 0.f;
      for (int q = 0; q < 4; ++q)
        for (int k = 0; k < 8; ++k) {
          const int e = WORD_ELEM[q] + 2 * k;
          const float v = e < n ? std::nearbyint(x[g0 + e] * inv) : 0.f;
          o.q[q * 16 + L * 8 + k] = int16_t(std::max(-32767.f, std::min(32767.f, v)));
        }
      for (int i = 0; i < 4; ++i) o.s[4 * L + i] = m > 0.f ? m / 32767.f * 0.5f : 0.f;
    }
  }
}

// The values a QChunk stands for, in element order: x [K] (the inverse of quantize_x64 up to its rounding)
inline void dequantize_x64(const QChunk* in, int64_t K, float* x) {
  for (int64_t c = 0; c < (K + 63) / 64; ++c)
    for (int L = 0; L < 2; ++L)
      for (int q = 0; q < 4; ++q)
        for (int k = 0; k < 8; ++k) {
          const int64_t e = c * 64 + 32 * L + WORD_ELEM[q] + 2 * k;
          if (e < K) x[e] = float(in[c].q[q * 16 + L * 8 + k]) * (2.f * in[c].s[4 * L]);
        }
}

#if !(defined(__AVX2__) && !defined(__AVX512F__))
constexpr bool X64_DECODE = false;             // the AVX2 build's decode and input order (below) are not built
#endif

}  // namespace gd

#if defined(__AVX2__) && !defined(__AVX512F__)
#define GD_X64_DECODE 1

namespace gd {

constexpr bool X64_DECODE = true;

// element (within the 64 of a chunk) of vector v (0..7), lane i (0..7): lane i / 4 = the chunk's group,
// vector v = (q, p): q the word vector (0: even elements 0..14, 1: even 16..30, 2: odd 1..15, 3: odd 17..31),
// p the half of each 32-bit lane (0: low word, 1: high word); i % 4 = the lane within the group's half
inline int x64_elem(int v, int i) {
  const int q = v / 2, p = v % 2, j = i % 4;
  return 32 * (i / 4) + 16 * (q & 1) + (q >> 1) + 4 * j + 2 * p;
}

// x [K] -> chunks of 64 values in decode order, the last one zero-padded: out[c*64 + v*8 + i] = x[c*64 + e(v, i)]
inline void arrange_x64(const float* x, int64_t K, float* out) {
  static const auto idx = [] {
    std::array<int, 64> a{};
    for (int v = 0; v < 8; ++v)
      for (int i = 0; i < 8; ++i) a[v * 8 + i] = x64_elem(v, i);
    return a;
  }();
  const int64_t chunks = (K + 63) / 64;
  for (int64_t c = 0; c < chunks; ++c) {
    const float* xc = x + c * 64;
    float* oc = out + c * 64;
    if (c * 64 + 64 <= K)
      for (int n = 0; n < 64; ++n) oc[n] = xc[idx[n]];
    else
      for (int n = 0; n < 64; ++n) oc[n] = c * 64 + idx[n] < K ? xc[idx[n]] : 0.f;
  }
}

// 32 bytes of codes (`nbytes` = 16 for a row's last, single group) -> four vectors of 16 words, word = the
// code's (lut_lo, lut_hi) bytes: w[q] lane L (group 2c+L) word k = element {2k, 16+2k, 2k+1, 17+2k}[q]
inline void decode_e2m1_lut(const uint8_t* p, int nbytes, __m256i lut_lo, __m256i lut_hi, __m256i w[4]) {
  const __m256i v = nbytes >= 32 ? _mm256_loadu_si256((const __m256i*)p)
                                 : _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i*)p));
  const __m256i nib = _mm256_set1_epi8(0x0F);
  const __m256i lo = _mm256_and_si256(v, nib), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
  const __m256i ll = _mm256_shuffle_epi8(lut_lo, lo), lh = _mm256_shuffle_epi8(lut_hi, lo);
  const __m256i hl = _mm256_shuffle_epi8(lut_lo, hi), hh = _mm256_shuffle_epi8(lut_hi, hi);
  w[0] = _mm256_unpacklo_epi8(ll, lh);
  w[1] = _mm256_unpackhi_epi8(ll, lh);
  w[2] = _mm256_unpacklo_epi8(hl, hh);
  w[3] = _mm256_unpackhi_epi8(hl, hh);
}

// The 256-bit form of `decode_e2m1_bf16x4` (bf16dot.h), whose lanes hold one group each alike: the words are
// the values' bf16 bits
inline void decode_e2m1_words(const uint8_t* p, int nbytes, __m256i w[4]) {
  // low and high bytes of the bf16 bits of 0, .5, 1, 1.5, 2, 3, 4, 6, -0, -.5, …, -6
  decode_e2m1_lut(p, nbytes, _mm256_broadcastsi128_si256(_mm_setr_epi8(0, 0, (char)0x80, (char)0xC0, 0, 0x40,
      (char)0x80, (char)0xC0, 0, 0, (char)0x80, (char)0xC0, 0, 0x40, (char)0x80, (char)0xC0)),
      _mm256_broadcastsi128_si256(_mm_setr_epi8(0, 0x3F, 0x3F, 0x3F, 0x40, 0x40, 0x40, 0x40,
      (char)0x80, (char)0xBF, (char)0xBF, (char)0xBF, (char)0xC0, (char)0xC0, (char)0xC0, (char)0xC0)), w);
}

// The same words as int16: twice the value (0, 1, 2, 3, 4, 6, 8, 12 and their negatives; -0 is 0)
inline void decode_e2m1_int16(const uint8_t* p, int nbytes, __m256i w[4]) {
  decode_e2m1_lut(p, nbytes, _mm256_broadcastsi128_si256(_mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4,
      -6, -8, -12)), _mm256_broadcastsi128_si256(_mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 0, -1, -1, -1, -1, -1, -1, -1)), w);
}

// the fp32 values of the low / high bf16 word of each 32-bit lane
inline __m256 low_words_f32(__m256i w) { return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)); }
inline __m256 high_words_f32(__m256i w) {
  return _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32(int(0xFFFF0000u))));
}

// lanes 0..3 = the power of two of group 2c, 4..7 that of group 2c+1 (0 past the row's last group)
inline __m256 chunk_scales(const float* e8, const uint8_t* s, int ngroups) {
  if (ngroups > 1) return _mm256_blend_ps(_mm256_broadcast_ss(e8 + s[0]), _mm256_broadcast_ss(e8 + s[1]), 0xF0);
  return _mm256_set_m128(_mm_setzero_ps(), _mm_set1_ps(e8[s[0]]));
}

// The powers of two of 8 consecutive groups (E8M0 bytes s[0..7]) as fp32 bits, 2^(s - 127) = s << 23 (s = 0:
// the subnormal 2^-127, bits 1 << 22, hence the max; s = 255: inf), as e8m0_table() has them. A tile takes a
// chunk's pair of scales from it with one permute (`chunk_scales_of`) instead of two loads and a blend.
inline __m256i e8m0_bits8(const uint8_t* s) {
  const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)s));
  return _mm256_max_epu32(_mm256_slli_epi32(v, 23), _mm256_set1_epi32(1 << 22));
}
// lanes 0..3 <- group 2j, 4..7 <- group 2j + 1 of an e8m0_bits8 vector: chunk j of the four it covers
inline __m256 chunk_scales_of(__m256i bits8, int j) {
  return _mm256_castsi256_ps(_mm256_permutevar8x32_epi32(
      bits8, _mm256_setr_epi32(2 * j, 2 * j, 2 * j, 2 * j, 2 * j + 1, 2 * j + 1, 2 * j + 1, 2 * j + 1)));
}

// acc + one chunk of a row (its bf16 words w) · one input chunk in the x64 order: the 8 products summed in fp32
// in two chains of four (one add to join them, not three: 1.04-1.05x the tile at two inputs, the same at one,
// where the decode's shuffles bound it), times the chunk's scales `sc`
inline __m256 f32_chunk_fma(const __m256i w[4], const float* x, __m256 sc, __m256 acc) {
  __m256 p0 = _mm256_mul_ps(low_words_f32(w[0]), _mm256_loadu_ps(x));
  __m256 p1 = _mm256_mul_ps(high_words_f32(w[0]), _mm256_loadu_ps(x + 8));
  p0 = _mm256_fmadd_ps(low_words_f32(w[1]), _mm256_loadu_ps(x + 16), p0);
  p1 = _mm256_fmadd_ps(high_words_f32(w[1]), _mm256_loadu_ps(x + 24), p1);
  p0 = _mm256_fmadd_ps(low_words_f32(w[2]), _mm256_loadu_ps(x + 32), p0);
  p1 = _mm256_fmadd_ps(high_words_f32(w[2]), _mm256_loadu_ps(x + 40), p1);
  p0 = _mm256_fmadd_ps(low_words_f32(w[3]), _mm256_loadu_ps(x + 48), p0);
  p1 = _mm256_fmadd_ps(high_words_f32(w[3]), _mm256_loadu_ps(x + 56), p1);
  return _mm256_fmadd_ps(_mm256_add_ps(p0, p1), sc, acc);
}

// acc + one chunk of a row (its int16 words w) · one int16-quantized input chunk: the products of the words
// (`_mm256_madd_epi16`, exact in int32: |sum| <= 8 · 12 · 32767), as fp32 times the input's scales, then times
// the weight's powers of two `sc` (that order keeps the scaled sum normal where the fp32 path's is). The one
// arithmetic of every int16 tile, so a token's result does not depend on which its expert took.
inline __m256 i16_chunk_fma(const __m256i w[4], const QChunk& x, __m256 sc, __m256 acc) {
  const __m256i* q = reinterpret_cast<const __m256i*>(x.q);
  __m256i s0 = _mm256_madd_epi16(w[0], _mm256_loadu_si256(q));
  __m256i s1 = _mm256_madd_epi16(w[1], _mm256_loadu_si256(q + 1));
  s0 = _mm256_add_epi32(s0, _mm256_madd_epi16(w[2], _mm256_loadu_si256(q + 2)));
  s1 = _mm256_add_epi32(s1, _mm256_madd_epi16(w[3], _mm256_loadu_si256(q + 3)));
  const __m256 f = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(s0, s1)), _mm256_loadu_ps(x.s));
  return _mm256_fmadd_ps(f, sc, acc);
}

// The two forms of the register tile: fp32 inputs in the x64 order against the codes' bf16 words widened to
// fp32 (exact), and int16-quantized inputs (`QChunk`) against the codes as int16 words (~1.5x the fp32 form at
// one or two inputs on a Zen 3: no widening of the codes, 16 products an instruction)
struct F32Form {
  using X = float;
  static void decode(const uint8_t* p, int nbytes, __m256i w[4]) { decode_e2m1_words(p, nbytes, w); }
  static __m256 fma(const __m256i w[4], const float* x, int64_t c, __m256 sc, __m256 acc) {
    return f32_chunk_fma(w, x + c * 64, sc, acc);
  }
};
struct I16Form {
  using X = QChunk;
  static void decode(const uint8_t* p, int nbytes, __m256i w[4]) { decode_e2m1_int16(p, nbytes, w); }
  static __m256 fma(const __m256i w[4], const QChunk* x, int64_t c, __m256 sc, __m256 acc) {
    return i16_chunk_fma(w, x[c], sc, acc);
  }
};

// out[t * ldo + r] = row r · input t for RT rows (row r at blk + r*G*16, scales at scl + r*G) and TT inputs
// of the form's kind, chunk by chunk: each row's chunk decoded once for all TT inputs. Whole chunks run without
// branches; a row's odd last group is the tail.
template <typename Form>
struct MxTileOf {
template <int RT, int TT>
struct Tile {
using X = typename Form::X;
// scales of four chunks at once (e8m0_bits8) in the one- and two-input tiles (the MoE op alone at batch 1 and
// 2: 1.05-1.15x on a Zen 3; the wide tiles keep the table loads: 0.88-0.93x with these, short of registers)
static constexpr bool VEC_SCALES = TT <= 2;
// chunk c of each row, its scales sc[r]
template <int NG>
static void chunk(const uint8_t* blk, int64_t G, int64_t c, const __m256* sc, const X* const* xs, __m256* acc) {
#pragma GCC unroll 16
  for (int r = 0; r < RT; ++r) {
    const uint8_t* p = blk + r * G * 16 + c * 32;
    if (c % 2 == 0) prefetch_l2(p, MOE_PREFETCH_ROWS * G * 16);
    __m256i w[4];
    Form::decode(p, NG * 16, w);
#pragma GCC unroll 16
    for (int t = 0; t < TT; ++t) acc[r * TT + t] = Form::fma(w, xs[t], c, sc[r], acc[r * TT + t]);
  }
}
// chunk c of each row with its scales from the table
template <int NG>
static void chunk_tail(const uint8_t* blk, const uint8_t* scl, int64_t G, int64_t c, const float* e8,
                       const X* const* xs, __m256* acc) {
  __m256 sc[RT];
#pragma GCC unroll 16
  for (int r = 0; r < RT; ++r) sc[r] = chunk_scales(e8, scl + r * G + 2 * c, NG);
  chunk<NG>(blk, G, c, sc, xs, acc);
}
static void run(const uint8_t* blk, const uint8_t* scl, int64_t G, const X* const* xs, float* out, int64_t ldo) {
  const float* e8 = e8m0_table();
  __m256 acc[RT * TT];                                 // acc[r * TT + t]
#pragma GCC unroll 16
  for (int i = 0; i < RT * TT; ++i) acc[i] = _mm256_setzero_ps();
  int64_t c = 0;
  for (; VEC_SCALES && c + 4 <= G / 2; c += 4) {       // four chunks (8 groups) a row: one scale load
    __m256i bits[RT];
#pragma GCC unroll 16
    for (int r = 0; r < RT; ++r) bits[r] = e8m0_bits8(scl + r * G + 2 * c);
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      __m256 sc[RT];
#pragma GCC unroll 16
      for (int r = 0; r < RT; ++r) sc[r] = chunk_scales_of(bits[r], j);
      chunk<2>(blk, G, c + j, sc, xs, acc);
    }
  }
  for (; c < G / 2; ++c) chunk_tail<2>(blk, scl, G, c, e8, xs, acc);
  if (G % 2) chunk_tail<1>(blk, scl, G, G / 2, e8, xs, acc);
#pragma GCC unroll 16
  for (int r = 0; r < RT; ++r)
#pragma GCC unroll 16
    for (int t = 0; t < TT; ++t) out[t * ldo + r] = vsum(VF{acc[r * TT + t]});
}
};
};
template <int RT, int TT> using MxTileX64 = MxTileOf<F32Form>::Tile<RT, TT>;
template <int RT, int TT> using MxTileI16 = MxTileOf<I16Form>::Tile<RT, TT>;

// The codes of `rows` rows as fp32 values times their group's power of two, each row `ld` values (whole
// 64-value chunks, zero-padded) in the x64 order: exact (a power of two only moves the exponent) while every
// scale keeps the products normal, i.e. is in [2, 252]; false (nothing written) when one is not, and the
// caller keeps the scale-after-sum tile.
inline bool decode_rows_scaled_x64(const uint8_t* blk, const uint8_t* scl, int64_t G, int64_t rows, float* out,
                                   int64_t ld) {
  for (int64_t i = 0; i < rows * G; ++i)
    if (scl[i] < 2 || scl[i] > 252) return false;
  const float* e8 = e8m0_table();
  const int64_t chunks = (G + 1) / 2;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < chunks; ++c) {
      const int ng = int(std::min<int64_t>(2, G - 2 * c));
      __m256i w[4];
      decode_e2m1_words(blk + r * G * 16 + c * 32, ng * 16, w);
      const __m256 sc = chunk_scales(e8, scl + r * G + 2 * c, ng);
      float* o = out + r * ld + c * 64;
      for (int q = 0; q < 4; ++q) {
        _mm256_storeu_ps(o + q * 16, _mm256_mul_ps(low_words_f32(w[q]), sc));
        _mm256_storeu_ps(o + q * 16 + 8, _mm256_mul_ps(high_words_f32(w[q]), sc));
      }
    }
  return true;
}

}  // namespace gd
#endif
