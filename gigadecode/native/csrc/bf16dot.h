// The bf16 dot-product path (AVX512-BF16): when the activations are bf16, products of bf16 activations and
// bf16-exact weights are exact in fp32, so `vdpbf16ps` (32 multiply-adds into 16 fp32 lanes per
// instruction) computes what the fp32 path computes, with fp32 sums. MXFP4 codes become bf16 e2m1 values by
// one word permute per 32 codes; the groups' powers of two multiply the fp32 partial sums (one
// fma per four groups), so any E8M0 scale is handled as the fp32 path handles it.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>

#include "common.h"
#include "vec.h"

#if defined(__AVX512BF16__)
#define GD_BF16DOT 1

namespace gd {

// Two consecutive bf16 values as one 32-bit word (the first in the low half), read through memcpy (one load):
// a bf16 tensor is only 2-byte aligned (a contiguous view may start at an odd element), and a uint32_t
// pointer into it is a misaligned access
inline uint32_t bf16_pair_bits(const uint16_t* p) {
  uint32_t u;
  std::memcpy(&u, p, 4);
  return u;
}

inline __m512 dot_bf16(__m512 acc, __m512i w, const uint16_t* x) {
  return _mm512_dpbf16_ps(acc, (__m512bh)w, (__m512bh)_mm512_loadu_si512(x));
}

// How the MoE multiplies bf16 activations: bf16 dot products or fp32 FMAs on the same exact values, whichever
// this CPU runs faster, measured at first use (product_form.cpp)
enum ProductForm : int { PRODUCTS_AUTO = 0, PRODUCTS_BF16 = 1, PRODUCTS_F32 = 2 };
ProductForm bf16_products();

// Horizontal sums of many accumulators at once (a tile's epilogue): reducing 16 vectors one by one takes
// ~8 shuffles and adds each, on the pipe the dot products need; transposing as they are added takes ~3.
// Lane L (128 bits) of the result: the lane-L partial sums of a0..a3.
inline __m512 lane_sums4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  const __m512 s01 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
  const __m512 s23 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
  return _mm512_add_ps(_mm512_shuffle_ps(s01, s23, 0x44), _mm512_shuffle_ps(s01, s23, 0xEE));
}
// n accumulators (fully unrolled callers) -> their sums in out[0..n): sixteen at a time, then four, then one
// (every loop unrolled, so a caller's accumulators are indexed by constants and stay in registers: with a
// loop left rolled for odd counts, GCC kept e.g. a 2 x 7 tile's 14 sums in memory, stored every step)
template <int N>
inline void hsums(const __m512 (&a)[N], float* out) {
  int i = 0;
#pragma GCC unroll 16
  for (; i + 16 <= N; i += 16) {
    const __m512 u0 = lane_sums4(a[i], a[i + 1], a[i + 2], a[i + 3]);
    const __m512 u1 = lane_sums4(a[i + 4], a[i + 5], a[i + 6], a[i + 7]);
    const __m512 u2 = lane_sums4(a[i + 8], a[i + 9], a[i + 10], a[i + 11]);
    const __m512 u3 = lane_sums4(a[i + 12], a[i + 13], a[i + 14], a[i + 15]);
    // lane pairs (0, 2) and (1, 3) added, then lanes (0, 1): lane g of the result = the sums of u_g
    const __m512 w01 = _mm512_add_ps(_mm512_shuffle_f32x4(u0, u1, 0x44), _mm512_shuffle_f32x4(u0, u1, 0xEE));
    const __m512 w23 = _mm512_add_ps(_mm512_shuffle_f32x4(u2, u3, 0x44), _mm512_shuffle_f32x4(u2, u3, 0xEE));
    _mm512_storeu_ps(out + i, _mm512_add_ps(_mm512_shuffle_f32x4(w01, w23, 0x88), _mm512_shuffle_f32x4(w01, w23, 0xDD)));
  }
#pragma GCC unroll 16
  for (; i + 4 <= N; i += 4) {
    const __m512 u = lane_sums4(a[i], a[i + 1], a[i + 2], a[i + 3]);
    const __m512 h = _mm512_add_ps(u, _mm512_shuffle_f32x4(u, u, 0x4E));   // lanes (0+2, 1+3, ..)
    _mm_storeu_ps(out + i, _mm512_castps512_ps128(_mm512_add_ps(h, _mm512_shuffle_f32x4(h, h, 0xB1))));
  }
#pragma GCC unroll 16
  for (; i < N; ++i) out[i] = _mm512_reduce_add_ps(a[i]);
}

// The decode's word order: word k of a group's 128-bit lane in word vector q holds the group's element 4k + q
// (the inputs are laid out alike, so every vdpbf16ps lane sums products of matching elements)
constexpr int bf16_word_elem(int q, int k) { return 4 * k + q; }

// 64 bytes of MXFP4 codes (four groups; `nbytes` < 64 at a row's end) -> 128 bf16 e2m1 values in four
// vectors (`bf16_word_elem`'s order; 128-bit lane L of every vector holds group L). Each 16-bit word holds four
// codes, elements 4k..4k+3; vpermw looks up the word's low 5 bits in a 32-word table (the 16 bf16 values of
// e2m1, twice), so shifting the word by 0, 4, 8, 12 bits gives vector q = every word's code q as bf16: four
// permutes and three shifts per 128 values (two byte lookups per nibble half and their interleave took eight
// shuffles, all on the port the permutes use).
inline void decode_e2m1_bf16x4(const uint8_t* p, int nbytes, __m512i w[4]) {
  // the bf16 bits of 0, .5, 1, 1.5, 2, 3, 4, 6, -0, -.5, …, -6, in both halves
  const __m512i lut = _mm512_broadcast_i64x4(_mm256_setr_epi16(0, 0x3F00, 0x3F80, 0x3FC0, 0x4000, 0x4040,
      0x4080, 0x40C0, short(0x8000), short(0xBF00), short(0xBF80), short(0xBFC0), short(0xC000), short(0xC040),
      short(0xC080), short(0xC0C0)));
  const __m512i v = nbytes >= 64 ? _mm512_loadu_si512(p)
                                 : _mm512_maskz_loadu_epi8(__mmask64((~0ull) >> (64 - nbytes)), p);
  w[0] = _mm512_permutexvar_epi16(v, lut);
  w[1] = _mm512_permutexvar_epi16(_mm512_srli_epi16(v, 4), lut);
  w[2] = _mm512_permutexvar_epi16(_mm512_srli_epi16(v, 8), lut);
  w[3] = _mm512_permutexvar_epi16(_mm512_srli_epi16(v, 12), lut);
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

// Whether every E8M0 scale of `n` keeps its group's e2m1 values normal bf16 numbers (in [2, 252], where
// 0.5 * 2^(s-127) .. 6 * 2^(s-127) are), as the exact bf16 decode below needs: `vdpbf16ps` and AMX tiles
// flush subnormals.
inline bool scales_fit_bf16(const uint8_t* scl, int64_t n) {
  const __m512i s_lo = _mm512_set1_epi8(2), s_hi = _mm512_set1_epi8(char(252));
  for (int64_t i = 0; i < n; i += 64) {
    const __mmask64 m = n - i >= 64 ? ~0ull : (~0ull) >> (64 - (n - i));
    const __m512i v = _mm512_maskz_loadu_epi8(m, scl + i);
    if ((_mm512_cmplt_epu8_mask(v, s_lo) | _mm512_cmpgt_epu8_mask(v, s_hi)) & m) return false;
  }
  return true;
}

// A row's 64-byte chunk of MXFP4 codes (four groups) as 128 exact bf16 values times their group's power of
// two, in the lane order of decode_e2m1_bf16x4 (scales as `scales_fit_bf16` requires). One 64-entry table
// of the chunk's four groups (entry 16L + code: group L's value of `code`, its exponent already moved by the
// group's scale) is looked up by vpermt2w with index code | L << 4 (L: the word's 128-bit lane, i.e. its
// group), so the scaling is paid once a chunk on 64 table entries, not on its 128 values.
struct ScaledChunkDecoder {
  static constexpr __mmask32 NONZERO = 0xFEFEFEFEu;    // every table entry but codes 0 and 8 (±0) of each 16
  __m512i base, pick01, pick23, lane_bits, nibble;
  ScaledChunkDecoder() {
    const __m512i lut = _mm512_broadcast_i64x4(_mm256_setr_epi16(0, 0x3F00, 0x3F80, 0x3FC0, 0x4000, 0x4040,
        0x4080, 0x40C0, short(0x8000), short(0xBF00), short(0xBF80), short(0xBFC0), short(0xC000), short(0xC040),
        short(0xC080), short(0xC0C0)));
    // the codes' bf16 bits less the exponent bias 127 << 7, so that adding s << 7 scales by 2^(s-127); the
    // zeros stay as they are
    base = _mm512_mask_sub_epi16(lut, NONZERO, lut, _mm512_set1_epi16(127 << 7));
    // vpshufb controls: scale byte L of a broadcast dword into the low byte of the words of table half 0
    // (groups 0, 1: 128-bit lanes 0-1 take byte 0, lanes 2-3 byte 1) or half 1 (groups 2, 3), high bytes zero
    pick01 = _mm512_set_epi64(0x8001800180018001ll, 0x8001800180018001ll, 0x8001800180018001ll,
        0x8001800180018001ll, 0x8000800080008000ll, 0x8000800080008000ll, 0x8000800080008000ll, 0x8000800080008000ll);
    pick23 = _mm512_add_epi16(pick01, _mm512_set1_epi16(2));
    lane_bits = _mm512_set_epi64(0x0030003000300030ll, 0x0030003000300030ll, 0x0020002000200020ll,
        0x0020002000200020ll, 0x0010001000100010ll, 0x0010001000100010ll, 0, 0);
    nibble = _mm512_set1_epi16(0x000F);
  }
  // the chunk at p (ng < 4 groups: the row's last, zero-padded), its ng scales at s -> o[0, 128)
  inline void operator()(const uint8_t* p, const uint8_t* s, int ng, uint16_t* o) const {
    uint32_t s4 = 0;                                      // past the row: scale 0, its codes (0) stay 0
    if (ng == 4) std::memcpy(&s4, s, 4); else std::memcpy(&s4, s, size_t(ng));
    const __m512i sb = _mm512_set1_epi32(int(s4));
    const __m512i t0 = _mm512_mask_add_epi16(base, NONZERO, base, _mm512_slli_epi16(_mm512_shuffle_epi8(sb, pick01), 7));
    const __m512i t1 = _mm512_mask_add_epi16(base, NONZERO, base, _mm512_slli_epi16(_mm512_shuffle_epi8(sb, pick23), 7));
    const __m512i v = ng == 4 ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi8(__mmask64((~0ull) >> (64 - ng * 16)), p);
    // nibble q of every word (q = 0: bits 0-3, ..., 3: bits 12-15) | its lane's group
    const auto index = [&](__m512i w) { return _mm512_ternarylogic_epi32(w, nibble, lane_bits, 0xEA); };   // w & nibble | lane
    _mm512_storeu_si512(o, _mm512_permutex2var_epi16(t0, index(v), t1));
    _mm512_storeu_si512(o + 32, _mm512_permutex2var_epi16(t0, index(_mm512_srli_epi16(v, 4)), t1));
    _mm512_storeu_si512(o + 64, _mm512_permutex2var_epi16(t0, index(_mm512_srli_epi16(v, 8)), t1));
    _mm512_storeu_si512(o + 96, _mm512_permutex2var_epi16(t0, _mm512_or_si512(_mm512_srli_epi16(v, 12), lane_bits), t1));
  }
};

// The MXFP4 codes of `rows` rows (row r at blk + r*G*16, scales at scl + r*G) as bf16 values times their
// group's power of two (`ScaledChunkDecoder`), each row `ld` values (G*32 rounded up to whole 128-value chunks,
// zero-padded). False (nothing written) when a scale does not fit (`scales_fit_bf16`); the caller keeps the
// scale-after-dot tiles then.
inline bool decode_rows_scaled_bf16(const uint8_t* blk, const uint8_t* scl, int64_t G, int64_t rows, uint16_t* out,
                                    int64_t ld) {
  if (!scales_fit_bf16(scl, rows * G)) return false;   // the rows' scales are contiguous
  const ScaledChunkDecoder decode;
  const int64_t chunks = (G + 3) / 4;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < chunks; ++c) {
      prefetch_l2(blk + r * G * 16 + c * 64, MOE_PREFETCH_ROWS * G * 16);   // a line of the row 16 rows on
      decode(blk + r * G * 16 + c * 64, scl + r * G + 4 * c, int(std::min<int64_t>(4, G - 4 * c)), out + r * ld + c * 128);
    }
  return true;
}

// out[t * ldo + r] = w row r · x[t] for RT rows (row r at w + r*ldw) and TT inputs of K bf16 values:
// exact products, fp32 sums; all accumulators in registers (fully unrolled). `lead` > 0: each row's line
// `lead` bytes ahead is prefetched as the row is read (`prefetch_l2`; 0 for rows already in cache).
template <int RT, int TT>
struct DotTileBf16 {
static void run(const uint16_t* w, int64_t ldw, int64_t K, const uint16_t* const* xs, float* out, int64_t ldo,
                int64_t lead) {
  __m512 acc[RT * TT];                                // acc[r * TT + t]
  const uint16_t* x[TT];
#pragma GCC unroll 16
  for (int t = 0; t < TT; ++t) x[t] = xs[t];
#pragma GCC unroll 16
  for (int i = 0; i < RT * TT; ++i) acc[i] = _mm512_setzero_ps();
  const int64_t Kv = K / 32 * 32;
  for (int64_t k = 0; k < Kv; k += 32) {
    __m512i wv[RT];
#pragma GCC unroll 16
    for (int r = 0; r < RT; ++r) {
      wv[r] = _mm512_loadu_si512(w + r * ldw + k);
      if (lead) prefetch_l2(w + r * ldw + k, lead);
    }
#pragma GCC unroll 16
    for (int t = 0; t < TT; ++t)
#pragma GCC unroll 16
      for (int r = 0; r < RT; ++r) acc[r * TT + t] = dot_bf16(acc[r * TT + t], wv[r], x[t] + k);
  }
  float sums[RT * TT];
  hsums(acc, sums);
#pragma GCC unroll 16
  for (int r = 0; r < RT; ++r)
#pragma GCC unroll 16
    for (int t = 0; t < TT; ++t) {
      float s = sums[r * TT + t];
      for (int64_t k = Kv; k < K; ++k) s += bf16_to_f32(w[r * ldw + k]) * bf16_to_f32(x[t][k]);
      out[t * ldo + r] = s;
    }
}
};
using DotFnBf16 = void (*)(const uint16_t*, int64_t, int64_t, const uint16_t* const*, float*, int64_t, int64_t);

// bf16 inputs: x [K] -> chunks of 128 elements (four groups) in the lane order of decode_e2m1_bf16x4,
// zero-padded to whole chunks: out[c*128 + q*32 + L*8 + i] = x[c*128 + L*32 + 4i + q]
inline void deinterleave_bf16(const float* x, int64_t K, uint16_t* out) {
  // word j of output vector q: from input vector 2h + (j / 8) % 2 (h = j / 16) at bf16_word_elem(q, j % 8);
  // vector pairs (0, 1) fill words 0..15, (2, 3) words 16..31 (permutex2var: index 32+ = the second vector)
  static const auto idx = [] {
    std::array<std::array<int16_t, 32>, 4> v{};
    for (int q = 0; q < 4; ++q)
      for (int j = 0; j < 32; ++j) v[q][j] = int16_t(32 * ((j / 8) % 2) + bf16_word_elem(q, j % 8));
    return v;
  }();
  const int64_t full = K / 128, chunks = (K + 127) / 128;
  for (int64_t c = 0; c < full; ++c) {
    __m512i in[4];                                   // in[L] = x[c*128 + 32L ..][:32] as bf16 (RNE)
    for (int L = 0; L < 4; ++L) {
      const float* p = x + c * 128 + 32 * L;
      in[L] = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(p + 16), _mm512_loadu_ps(p));
    }
    for (int q = 0; q < 4; ++q) {
      const __m512i ix = _mm512_loadu_si512(idx[q].data());
      const __m512i lo = _mm512_permutex2var_epi16(in[0], ix, in[1]), hi = _mm512_permutex2var_epi16(in[2], ix, in[3]);
      _mm512_storeu_si512(out + c * 128 + q * 32, _mm512_mask_mov_epi16(lo, 0xFFFF0000u, hi));
    }
  }
  for (int64_t c = full; c < chunks; ++c)            // the zero-padded last chunk
    for (int q = 0; q < 4; ++q)
      for (int L = 0; L < 4; ++L)
        for (int i = 0; i < 8; ++i) {
          const int64_t e = c * 128 + L * 32 + bf16_word_elem(q, i);
          out[c * 128 + q * 32 + L * 8 + i] = e < K ? f32_to_bf16(x[e]) : 0;
        }
}

// acc + scale · (one 128-value chunk of a row · the input's chunk): four exact bf16 dot products, fp32 sums
inline __m512 chunk_dot(const __m512i w[4], const uint16_t* x, __m512 scale, __m512 acc) {
  __m512 part = dot_bf16(_mm512_setzero_ps(), w[0], x);
  part = dot_bf16(part, w[1], x + 32);
  part = dot_bf16(part, w[2], x + 64);
  part = dot_bf16(part, w[3], x + 96);
  return _mm512_fmadd_ps(part, scale, acc);
}

}  // namespace gd
#endif
