// The int16 form of the AVX-512 build (no bf16 arithmetic: Skylake-SP to Ice Lake Xeons) on CPUs with
// AVX512-VNNI: bf16 activations meet the experts with few inputs as int16, quantized per group of 32 as the AVX2
// build's (`QChunk`, mxfp4_avx2.h: 2^-16 of the group's largest value), and the codes as int16 words, multiplied
// by `vpdpwssd` (32 products an instruction, exact int32 sums). On an Ice Lake Xeon that issues as often as an
// fp32 FMA (two a cycle), so each instruction does twice the products, and the codes become words by two byte
// shuffles and four shifts or masks a 128 values instead of the fp32 table form's ~20 instructions.
//
// A chunk is 128 values of a row: four groups, group L in 128-bit lane L (its 16 code bytes as stored). The
// nibbles' table lookups (`vpshufb`: 2 · value as int8) go to the high byte of a word, so each word is 512 ·
// value; word k of lane L in vector v holds element 32L + 4k + VNNI_ELEM[v], and the inputs are stored in the
// same order (`QChunk128`), so they meet without shuffles.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "bf16dot.h"
#include "common.h"

#if defined(__AVX512F__) && !defined(GD_BF16DOT)
#define GD_VNNI_FORM 1

namespace gd {

// Whether bf16 activations take this form: the CPU has AVX512-VNNI and `product_form` is 'int16' (its default
// there; 'fp32' keeps the exact fp32 tiles). Defined in product_form.cpp.
bool int16_products();

// word k of lane L of a decoded vector v: element 32L + 4k + VNNI_ELEM[v] of the chunk
constexpr int VNNI_ELEM[4] = {0, 2, 1, 3};

// One input's chunk of 128 values: q[v][8L + k] = round(x[32L + 4k + VNNI_ELEM[v]] · 32767 / m_L) (m_L: the
// group's largest |x|, zero past the row's end) and s[4L .. 4L + 3] = m_L / 32767 / 512 (the words are 512 ·
// value); a group holding a NaN or an infinity: q 0, s NaN (every sum it enters NaN, as with the exact values)
struct alignas(64) QChunk128 {
  int16_t q[4][32];
  float s[16];
};

// The chunks of an input's row go in pairs (2j, 2j + 1; an odd last chunk stays as it is), so each dword of a
// sum meets one group for 8 instructions (16 products) instead of 4: a pair's codes, a chunk in each of two
// vectors, are regrouped by two 64-bit unpacks into vectors whose lane L holds [dwords 0-1 of the first chunk's
// group L, dwords 0-1 of the second's] and [dwords 2-3 of each], and the inputs are stored in that order
// (`pair_chunks`). The scaling (int32 -> fp32, times the input's scales, times the row's powers of two: 3
// instructions) then comes once for 8 `vpdpwssd` instead of 4. The sums stay exact: 16 products of at most
// 32767 · 3072 (12 · 256) in a dword.
inline void pair_chunks(QChunk128& a, QChunk128& b) {
  for (int v = 0; v < 4; ++v) {
    const __m512i qa = _mm512_load_si512(a.q[v]), qb = _mm512_load_si512(b.q[v]);
    _mm512_store_si512(a.q[v], _mm512_unpacklo_epi64(qa, qb));   // the first vectors: dwords 0-1 of each
    _mm512_store_si512(b.q[v], _mm512_unpackhi_epi64(qa, qb));   // the second: dwords 2-3
  }
  // each lane's 4 scales are its group's: [a's, a's, b's, b's] for both
  const __m512i s = _mm512_unpacklo_epi64(_mm512_castps_si512(_mm512_load_ps(a.s)),
                                          _mm512_castps_si512(_mm512_load_ps(b.s)));
  _mm512_store_si512(a.s, s);
  _mm512_store_si512(b.s, s);
}

// x [K] -> (K + 127) / 128 chunks. A group at a time: its 32 values (zero past K) scaled, rounded to int32 (to nearest, even on
// ties: the CPU's default rounding) and narrowed to words, whose element order becomes the chunk's by one
// permute (word 8v + k = element 4k + VNNI_ELEM[v]) and four 16-byte stores.
inline void quantize_x128(const float* x, int64_t K, QChunk128* out) {
  const __m512i order = _mm512_set_epi16(31, 27, 23, 19, 15, 11, 7, 3, 29, 25, 21, 17, 13, 9, 5, 1,
                                         30, 26, 22, 18, 14, 10, 6, 2, 28, 24, 20, 16, 12, 8, 4, 0);
  const __m512 sign = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
  for (int64_t c = 0; c < (K + 127) / 128; ++c) {
    QChunk128& o = out[c];
    for (int L = 0; L < 4; ++L) {
      const int64_t g0 = c * 128 + 32 * L, n = std::max<int64_t>(0, std::min<int64_t>(32, K - g0));
      const __mmask16 m0 = n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1);
      const __mmask16 m1 = n >= 32 ? __mmask16(0xFFFF) : n > 16 ? __mmask16((1u << (n - 16)) - 1) : __mmask16(0);
      const __m512 a = _mm512_maskz_loadu_ps(m0, x + g0), b = _mm512_maskz_loadu_ps(m1, x + g0 + 16);
      const float m = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(a, sign), _mm512_and_ps(b, sign)));
      // a NaN or an infinity in the group (max drops a NaN operand of either side: test the values)
      const bool finite = m <= std::numeric_limits<float>::max() &&
                          !_mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q) && !_mm512_cmp_ps_mask(b, b, _CMP_UNORD_Q);
      const float inv = finite && m > 0.f ? 32767.f / m : 0.f;
      const __mmask16 keep = finite ? __mmask16(0xFFFF) : __mmask16(0);   // such a group: q 0
      const __m512i qa = _mm512_maskz_cvtps_epi32(keep, _mm512_mul_ps(a, _mm512_set1_ps(inv)));
      const __m512i qb = _mm512_maskz_cvtps_epi32(keep, _mm512_mul_ps(b, _mm512_set1_ps(inv)));
      const __m512i words = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtsepi32_epi16(qa)),
                                               _mm512_cvtsepi32_epi16(qb), 1);
      const __m512i q = _mm512_permutexvar_epi16(order, words);
      _mm_store_si128(reinterpret_cast<__m128i*>(o.q[0] + 8 * L), _mm512_castsi512_si128(q));
      _mm_store_si128(reinterpret_cast<__m128i*>(o.q[1] + 8 * L), _mm512_extracti32x4_epi32(q, 1));
      _mm_store_si128(reinterpret_cast<__m128i*>(o.q[2] + 8 * L), _mm512_extracti32x4_epi32(q, 2));
      _mm_store_si128(reinterpret_cast<__m128i*>(o.q[3] + 8 * L), _mm512_extracti32x4_epi32(q, 3));
      const float s = !finite ? std::numeric_limits<float>::quiet_NaN() : m > 0.f ? m / 32767.f / 512.f : 0.f;
      _mm_store_ps(o.s + 4 * L, _mm_set1_ps(s));
    }
  }
  for (int64_t c = 0; c + 1 < (K + 127) / 128; c += 2) pair_chunks(out[c], out[c + 1]);
}

// A row's chunk (nbytes = 16 · groups <= 64 of codes; bytes past nbytes zero)
inline __m512i load_codes(const uint8_t* p, int nbytes) {
  return nbytes == 64 ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi8(nbytes >= 64 ? ~0ull : (1ull << nbytes) - 1, p);
}

// 64 code bytes -> their words w[v]: dword e of lane L of each w[v] comes from the bytes of dword e of lane L
inline void decode_e2m1_words512(__m512i raw, __m512i w[4]) {
  const __m512i lut = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12));
  const __m512i nib = _mm512_set1_epi8(0x0F), high = _mm512_set1_epi16(short(0xFF00));
  const __m512i lo = _mm512_shuffle_epi8(lut, _mm512_and_si512(raw, nib));                          // elements 2i
  const __m512i hi = _mm512_shuffle_epi8(lut, _mm512_and_si512(_mm512_srli_epi16(raw, 4), nib));    // 2i + 1
  w[0] = _mm512_slli_epi16(lo, 8);             // byte 2k of lo: element 4k
  w[1] = _mm512_and_si512(lo, high);           // byte 2k + 1: element 4k + 2
  w[2] = _mm512_slli_epi16(hi, 8);             // element 4k + 1
  w[3] = _mm512_and_si512(hi, high);           // element 4k + 3
}

// The powers of two of a row's chunk (ng <= 4 scale bytes): lanes of group L = 2^(s_L - 127) (byte 255: inf,
// as e8m0_table; lanes past ng: 1, their words and inputs are zero)
inline __m512 e8m0_lanes(const uint8_t* s, int ng) {
  const __m128i bytes = _mm_mask_loadu_epi8(_mm_set1_epi8(0x7F), __mmask16((1u << ng) - 1), s);   // past ng: 2^0
  // lane L's dwords <- byte L (the byte shuffle works within 128-bit lanes; every lane holds `bits`)
  const __m512i ctl = _mm512_set_epi32(0x80808003, 0x80808003, 0x80808003, 0x80808003, 0x80808002, 0x80808002,
                                       0x80808002, 0x80808002, 0x80808001, 0x80808001, 0x80808001, 0x80808001,
                                       0x80808000, 0x80808000, 0x80808000, 0x80808000);
  const __m512i e = _mm512_shuffle_epi8(_mm512_broadcastd_epi32(bytes), ctl);
  return _mm512_scalef_ps(_mm512_set1_ps(1.f), _mm512_sub_ps(_mm512_cvtepi32_ps(e), _mm512_set1_ps(127.f)));
}

// The powers of two of a pair of a row's chunks (ng <= 8 scale bytes: the first chunk's 4 groups, then the
// second's), in the pair's dword order: lane L = [2^(s_L - 127)] x 2, then [2^(s_(L+4) - 127)] x 2 (past ng: 1)
inline __m512 e8m0_pair_lanes(const uint8_t* s, int ng) {
  const __m128i bytes = _mm_mask_loadu_epi8(_mm_set1_epi8(0x7F), __mmask16((1u << ng) - 1), s);
  const __m512i ctl = _mm512_set_epi32(0x80808007, 0x80808007, 0x80808003, 0x80808003, 0x80808006, 0x80808006,
                                       0x80808002, 0x80808002, 0x80808005, 0x80808005, 0x80808001, 0x80808001,
                                       0x80808004, 0x80808004, 0x80808000, 0x80808000);
  const __m512i e = _mm512_shuffle_epi8(_mm512_broadcast_i32x4(bytes), ctl);
  return _mm512_scalef_ps(_mm512_set1_ps(1.f), _mm512_sub_ps(_mm512_cvtepi32_ps(e), _mm512_set1_ps(127.f)));
}

// A pair of a row's chunks as stored (ng: the pair's groups, 5 to 8; code bytes past them zero), and the words of
// its half h (0: the dwords 0-1 of each chunk's lanes, 1: dwords 2-3; the regrouping `pair_chunks` describes):
// the one decode of a pair, for the tiles and for `decode_rows_words`
struct PairCodes {
  __m512i first, second;
};
inline PairCodes load_pair_codes(const uint8_t* p, int ng) {
  return {_mm512_loadu_si512(p), load_codes(p + 64, (ng - 4) * 16)};
}
inline void decode_pair_half(const PairCodes& pc, int h, __m512i w[4]) {
  decode_e2m1_words512(h == 0 ? _mm512_unpacklo_epi64(pc.first, pc.second)
                              : _mm512_unpackhi_epi64(pc.first, pc.second), w);
}

// A row's words as `decode_rows_words` lays them out: per pair of chunks its 8 word vectors (the first chunk's
// dwords 0-1, then 2-3, as the tiles decode them) and its powers of two (`e8m0_pair_lanes`), 9 vectors; an odd
// last chunk's 4 and its powers of two (`e8m0_lanes`), 5
inline int64_t words_row_bytes(int64_t G) {
  const int64_t chunks = (G + 3) / 4;
  return (chunks / 2 * 9 + chunks % 2 * 5) * 64;
}

// rows x (blk: their MXFP4 codes, scl: their scales, G groups a row) -> their words at out (64-byte aligned),
// `words_row_bytes(G)` a row: the decode the tiles do, done once for a strip of rows
inline void decode_rows_words(const uint8_t* blk, const uint8_t* scl, int64_t G, int64_t rows, uint8_t* out) {
  const int64_t chunks = (G + 3) / 4, rb = words_row_bytes(G);
  for (int64_t r = 0; r < rows; ++r) {
    __m512i* o = reinterpret_cast<__m512i*>(out + r * rb);
    const uint8_t* p = blk + r * G * 16;
    for (int64_t c = 0; c + 1 < chunks; c += 2, o += 9) {
      const int ng = int(std::min<int64_t>(8, G - 4 * c));
      const PairCodes pc = load_pair_codes(p + c * 64, ng);
      for (int h = 0; h < 2; ++h) {
        __m512i w[4];
        decode_pair_half(pc, h, w);
        for (int v = 0; v < 4; ++v) _mm512_store_si512(o + 4 * h + v, w[v]);
      }
      _mm512_store_ps(o + 8, e8m0_pair_lanes(scl + r * G + 4 * c, ng));
    }
    if (chunks % 2) {
      const int64_t c = chunks - 1;
      __m512i w[4];
      decode_e2m1_words512(load_codes(p + c * 64, int(G - 4 * c) * 16), w);
      for (int v = 0; v < 4; ++v) _mm512_store_si512(o + v, w[v]);
      _mm512_store_ps(o + 4, e8m0_lanes(scl + r * G + 4 * c, int(G - 4 * c)));
    }
  }
}

// out[t * ldo + r] = row r · input t for RT rows (row r at blk + r*G*16, scales at scl + r*G) and TT int16
// inputs (`quantize_x128`), a pair of chunks at a time (an odd last chunk alone): each row's codes decoded once
// for the TT inputs (one row's words live at a time: the accumulators, a row's TT sums and 4 words fit the
// registers). Every (row, input, pair) takes the same arithmetic — per dword the int32 sum of its 16 products,
// times the input's scales, times the row's powers of two (that order keeps the scaled sum normal where the
// fp32 form's is), added to the lane sums — so a token's result does not depend on the tile its expert took.
// WORDS: the rows' words as `decode_rows_words` left them (row r at blk + r * words_row_bytes(G); scl unused),
// the same arithmetic on the same words and powers of two, so the same sums as from the codes.
template <int RT, int TT, bool WORDS>
struct VnniTile {
__attribute__((target("avx512vnni")))
static void run(const uint8_t* blk, const uint8_t* scl, int64_t G, const QChunk128* const* xs, float* out,
                int64_t ldo) {
  const int64_t rb = WORDS ? words_row_bytes(G) : G * 16;
  __m512 acc[RT][TT];
#pragma GCC unroll 16
  for (int r = 0; r < RT; ++r)
#pragma GCC unroll 16
    for (int t = 0; t < TT; ++t) acc[r][t] = _mm512_setzero_ps();
  const int64_t chunks = (G + 3) / 4;
  for (int64_t c = 0; c + 1 < chunks; c += 2) {      // pairs
    const int ng = int(std::min<int64_t>(8, G - 4 * c));
#pragma GCC unroll 16
    for (int r = 0; r < RT; ++r) {
      const uint8_t* p = blk + r * rb + (WORDS ? c / 2 * 9 * 64 : c * 64);
      const __m512i* wp = reinterpret_cast<const __m512i*>(p);
      PairCodes pc;
      if constexpr (!WORDS) {
        prefetch_l2(p, MOE_PREFETCH_ROWS * G * 16);
        prefetch_l2(p + 64, MOE_PREFETCH_ROWS * G * 16);
        pc = load_pair_codes(p, ng);
      }
      __m512i sum[TT];
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        __m512i w[4];
        if constexpr (WORDS) {
          for (int v = 0; v < 4; ++v) w[v] = _mm512_load_si512(wp + 4 * h + v);
        } else {
          decode_pair_half(pc, h, w);
        }
#pragma GCC unroll 16
        for (int t = 0; t < TT; ++t) {
          const __m512i* q = reinterpret_cast<const __m512i*>(xs[t][c + h].q);
          __m512i s = h == 0 ? _mm512_setzero_si512() : sum[t];
#pragma GCC unroll 4
          for (int v = 0; v < 4; ++v) s = _mm512_dpwssd_epi32(s, w[v], _mm512_load_si512(q + v));
          sum[t] = s;
        }
      }
      const __m512 sw = WORDS ? _mm512_load_ps(wp + 8)
                              : e8m0_pair_lanes(scl + r * G + 4 * c, ng);   // (after the codes: fewer live registers)
#pragma GCC unroll 16
      for (int t = 0; t < TT; ++t)
        acc[r][t] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(sum[t]), _mm512_load_ps(xs[t][c].s)), sw, acc[r][t]);
    }
  }
  if (chunks % 2) {                                    // an odd last chunk, alone
    const int64_t c = chunks - 1;
    const int ng = int(G - 4 * c);
#pragma GCC unroll 16
    for (int r = 0; r < RT; ++r) {
      __m512i w[4];
      __m512 sw;
      if constexpr (WORDS) {
        const __m512i* wp = reinterpret_cast<const __m512i*>(blk + r * rb) + c / 2 * 9;
        for (int v = 0; v < 4; ++v) w[v] = _mm512_load_si512(wp + v);
        sw = _mm512_load_ps(wp + 4);
      } else {
        decode_e2m1_words512(load_codes(blk + r * G * 16 + c * 64, ng * 16), w);
        sw = e8m0_lanes(scl + r * G + 4 * c, ng);
      }
#pragma GCC unroll 16
      for (int t = 0; t < TT; ++t) {
        const __m512i* q = reinterpret_cast<const __m512i*>(xs[t][c].q);
        __m512i s = _mm512_setzero_si512();
#pragma GCC unroll 4
        for (int v = 0; v < 4; ++v) s = _mm512_dpwssd_epi32(s, w[v], _mm512_load_si512(q + v));
        acc[r][t] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(s), _mm512_load_ps(xs[t][c].s)), sw, acc[r][t]);
      }
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < RT; ++r)
#pragma GCC unroll 16
    for (int t = 0; t < TT; ++t) out[t * ldo + r] = _mm512_reduce_add_ps(acc[r][t]);
}
};

template <int RT, int TT>
struct MxTileVnni : VnniTile<RT, TT, false> {};
template <int RT, int TT>
struct WordTileVnni : VnniTile<RT, TT, true> {};

}  // namespace gd
#endif
