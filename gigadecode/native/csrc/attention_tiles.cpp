// Decode attention's two products on AMX tiles, for FP8 KV (packed or plain K, plain V) on CPUs with AMX-BF16:
// the form attention.cpp's items take where `decode_tiles_take` says so (5 to 8 q heads a kv head). The fp32
// form spends ~90 instructions a token and kv head (FP8 widened to fp32, an FMA a vector per q head, the score
// sums reduced across lanes); here tile multiplies do a span's products:
// - FP8 -> bf16 is exact (e4m3's 3-bit significand fits bf16's 8; the values / 256, as `kvload`'s), by a
//   128-entry table of each bf16 byte (`vpermi2b`, two instructions for 64 values);
// - q · qmul goes on the tiles as three bf16 parts, hi + mid + lo = the fp32 value exactly (truncations: hi the
//   top 8 significant bits, mid the next 8, lo the last 8), so each product is exact in fp32 and the scores are
//   the fp32 form's up to the order of their sums;
// - the probabilities as two parts, hi (truncated) + mid (the rest rounded): 17 significant bits, so P · V is
//   within ~2^-17 of the output's size of the fp32 form's (the FP8 values P weighs carry 4);
// - bf16 subnormals count as 0 on the tiles: a part below 2^-126, which weighs nothing beside the rest.
// Per span of blocks (`SPAN_TOKENS`) and kv head:
// - scores: the span's visible K rows, one token a row ([n][dp] bf16, dp = d padded to 32; packed K's token
//   pairs split by a byte permute), times q's parts laid out [dp/2][16][2] (hi in column r, mid in 8 + r, lo
//   in a second tile's column r) -> [16 tokens][16] sum tiles, two groups of 16 tokens at a time (independent
//   sums), each transposed to the [head][token] rows `softmax_update` reads, columns r and 8 + r added;
// - P · V: P's parts [16][np] (hi in row r, mid in row 8 + r; np = n padded to 32) times the visible V rows
//   pair-interleaved [np/2][dp][2] -> [16][16 dims] sum tiles, rows r and 8 + r added into o.
// Only visible tokens enter a tile (a NaN in a row no one sees stays out, as in the fp32 form); padding is
// zeros. A tile load waits for the stores that wrote its rows, so the (span, kv head) steps are pipelined: the
// next step's K rows and V pairs are written (into the other of two buffers) while this step's tiles work.
// `20b-shape`'s attention alone (8 kv heads of 64 dims, 8 q heads each, blocks of 16, 2 threads, random
// blocks), against the fp32 form in the same process: 4,096 tokens at batch 32 / 8 / 1 1.21 / 1.29 / 1.32x,
// 256 tokens at batch 32 / 8 1.28 / 1.26x, a 128-token window 1.17x; over 64 blocks in cache 1.40x. Measured
// and dropped: this file's first form (three parts for P too, each part a product of its own into the same sums,
// no pipeline: 1.16 / 1.21x at 4,096 tokens);
// the next span's blocks fetched a few lines at a time while the tiles work, in place of two blocks ahead
// (0.85x: the prefetches wait for fill buffers and hold the tile work behind them); a span's K rows of every
// kv head at once, read in memory order (no gain: the rows of 8 heads no longer stay in L1); P · V in passes
// of two 16-dim blocks with their own V tiles (1.00x).
#include <cstring>
#include <vector>

#include "amx_tiles.h"
#include "decode_span.h"

namespace gd {

#if defined(GD_BF16DOT) && defined(GD_AMX_OWN_TILES)
#define GD_DECODE_TILES 1
#endif

#ifdef GD_DECODE_TILES
namespace {

#ifdef SIMDE_VERSION   // tools/isa_check.py's emulated builds: SIMDe supplies VBMI, and no AVX-512 code may be emitted
#define GD_TILES_TARGET __attribute__((target("amx-tile,amx-bf16")))
#else
#define GD_TILES_TARGET __attribute__((target("amx-tile,amx-bf16,avx512vbmi")))
#endif

// the bf16 bits of e4m3 magnitude code m (0..127) / 256 (`fp8_to_f32`'s value; 127 is NaN)
uint16_t fp8_div256_bf16(int m) {
  const float v = fp8_to_f32(uint8_t(m)) * (1.f / 256.f);
  uint32_t u;
  std::memcpy(&u, &v, 4);
  return uint16_t(u >> 16);                            // exact: at most 4 significant bits
}

struct Fp8Table {                                      // by magnitude code: high bytes [128], low bytes [128]
  __m512i hi0, hi1, lo0, lo1;
};
const Fp8Table& fp8_table() {
  static const Fp8Table t = [] {
    alignas(64) uint8_t hi[128], lo[128];
    for (int m = 0; m < 128; ++m) {
      hi[m] = uint8_t(fp8_div256_bf16(m) >> 8);
      lo[m] = uint8_t(fp8_div256_bf16(m) & 0xFF);
    }
    return Fp8Table{_mm512_load_si512(hi), _mm512_load_si512(hi + 64), _mm512_load_si512(lo),
                    _mm512_load_si512(lo + 64)};
  }();
  return t;
}

// The byte permute that puts 64 values (value u at byte src(u)) where `fp8_words` turns them into words u in
// order: its unpacks interleave within 128-bit lanes, so lane L's low 8 bytes become words 8L..8L+7 of the first
// vector and its high 8 bytes words 8L..8L+7 of the second (32 + 8L..)
template <typename F>
__m512i unpack_order(F src) {
  alignas(64) uint8_t idx[64];
  for (int L = 0; L < 4; ++L)
    for (int k = 0; k < 8; ++k) {
      idx[16 * L + k] = uint8_t(src(8 * L + k));
      idx[16 * L + 8 + k] = uint8_t(src(32 + 8 * L + k));
    }
  return _mm512_load_si512(idx);
}

struct Orders {
  __m512i plain, pairs, vnni;
};
const Orders& orders() {
  static const Orders o{
      unpack_order([](int u) { return u; }),                                  // 64 dims of one token
      unpack_order([](int u) { return u < 32 ? 2 * u : 2 * (u - 32) + 1; }),  // packed [32 dims][2 tokens] -> two rows
      unpack_order([](int u) { return (u & 1) * 32 + u / 2; })};              // rows a, b (32 dims each) -> [dim][2]
  return o;
}

// 64 FP8 bytes, permuted by an `unpack_order` -> 64 bf16 words (w0: words 0..31, w1: 32..63)
GD_TILES_TARGET inline void fp8_words(__m512i raw, __m512i order, const Fp8Table& t, __m512i& w0, __m512i& w1) {
  const __m512i x = _mm512_permutexvar_epi8(order, raw);
  const __m512i hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(t.hi0, x, t.hi1), x,
                                               _mm512_set1_epi8(char(0x80)), 0xF8);   // table | sign
  const __m512i lo = _mm512_permutex2var_epi8(t.lo0, x, t.lo1);
  w0 = _mm512_unpacklo_epi8(lo, hi);
  w1 = _mm512_unpackhi_epi8(lo, hi);
}

// masks of the first n lanes (n <= 0: none)
inline __mmask64 first_bytes(int64_t n) {
  return n >= 64 ? ~__mmask64(0) : (__mmask64(1) << std::max<int64_t>(n, 0)) - 1;
}
inline __mmask16 first_floats(int64_t n) {
  return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << std::max<int64_t>(n, 0)) - 1);
}

// lanes holding an infinity or a NaN (exponent all ones)
inline __mmask16 not_finite(__m512 x) {
  const __m512i e = _mm512_set1_epi32(0x7F800000);
  return _mm512_cmpeq_epi32_mask(_mm512_and_si512(_mm512_castps_si512(x), e), e);
}

// 16 fp32 -> their bf16 truncations (as fp32 bits) and the exact rests x - hi (an infinity: itself, then 0; a NaN:
// NaN, then 0)
GD_TILES_TARGET inline __m512 split_hi(__m512 x, __m512i& hi) {
  const __mmask16 special = not_finite(x), nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  hi = _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(int(0xFFFF0000u)));
  hi = _mm512_mask_mov_epi32(hi, nan, _mm512_set1_epi32(0x7FC00000));   // a truncated NaN could read as inf
  return _mm512_maskz_sub_ps(__mmask16(~special), x, _mm512_castsi512_ps(hi));
}
// the bf16 words of 16 values held as fp32 bits whose low 16 bits are 0
GD_TILES_TARGET inline __m256i bf16_words(__m512i bits) { return _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16)); }

// 16 fp32 -> two bf16 parts, hi (the value truncated to bf16) and mid (the rest rounded to bf16): hi + mid is
// the value to 17 significant bits
GD_TILES_TARGET inline void split2(__m512 x, __m256i& hi16, __m256i& mid16) {
  __m512i hi;
  const __m512 rest = split_hi(x, hi);
  hi16 = bf16_words(hi);
  mid16 = (__m256i)_mm512_cvtneps_pbh(rest);
}

// one kv head's q · qmul (rep <= 8 rows of d) as three bf16 parts whose sum is each value exactly -> the
// scores' second operands, two tiles a K step ks at qh + ks * 1024 words, each [16 dim pairs][16 columns][2]:
// the first with the hi part of head r in column r and its mid part in column 8 + r, the second with its lo part
// in column r (others and dims >= d: 0), so a score tile's columns r and 8 + r add up to head r's scores
GD_TILES_TARGET void q_parts(const float* qk, int64_t rep, int64_t d, int64_t dp, float qmul, uint16_t* qh) {
  std::fill(qh, qh + dp / 32 * 1024, uint16_t(0));
  alignas(32) uint32_t pairs[3][8];
  for (int64_t r = 0; r < rep; ++r)
    for (int64_t j0 = 0; j0 < d; j0 += 16) {
      const __m512 x =
          _mm512_mul_ps(_mm512_maskz_loadu_ps(first_floats(d - j0), qk + r * d + j0), _mm512_set1_ps(qmul));
      __m512i hi, mid;                                  // truncations: exact rests
      const __m512 lo = split_hi(split_hi(x, hi), mid);  // exactly a bf16
      _mm256_store_si256(reinterpret_cast<__m256i*>(pairs[0]), bf16_words(hi));
      _mm256_store_si256(reinterpret_cast<__m256i*>(pairs[1]), bf16_words(mid));
      _mm256_store_si256(reinterpret_cast<__m256i*>(pairs[2]), bf16_words(_mm512_castps_si512(lo)));
      uint32_t* tile = reinterpret_cast<uint32_t*>(qh + j0 / 32 * 1024);
      const int64_t p0 = (j0 % 32) / 2;                 // dims j0 + 2i, + 1: pair p0 + i of the step
      for (int i = 0; i < 8; ++i) {
        tile[(p0 + i) * 16 + r] = pairs[0][i];
        tile[(p0 + i) * 16 + 8 + r] = pairs[1][i];
        tile[256 + (p0 + i) * 16 + r] = pairs[2][i];
      }
    }
}

// visible tokens [t0, t1] of one block's K (kb: the block's rows of this kv head) -> bf16 rows at `ab` (dp words
// a row)
GD_TILES_TARGET void k_rows(const uint8_t* kb, bool packed, int64_t t0, int64_t t1, int64_t d, int64_t dp,
                            const Fp8Table& tb, const Orders& od, uint16_t* ab) {
  __m512i w0, w1;
  if (packed) {                                        // [B/2][d][2]: a pair row of 2d bytes
    for (int64_t p = t0 / 2; p <= t1 / 2; ++p)
      for (int64_t c = 0; c < d; c += 32) {            // dims c.. of tokens 2p (w0) and 2p + 1 (w1)
        fp8_words(_mm512_maskz_loadu_epi8(first_bytes(2 * (d - c)), kb + p * 2 * d + 2 * c), od.pairs, tb, w0, w1);
        if (2 * p >= t0) _mm512_storeu_si512(ab + (2 * p - t0) * dp + c, w0);
        if (2 * p + 1 <= t1) _mm512_storeu_si512(ab + (2 * p + 1 - t0) * dp + c, w1);
      }
    return;
  }
  for (int64_t t = t0; t <= t1; ++t)
    for (int64_t c = 0; c < d; c += 64) {
      fp8_words(_mm512_maskz_loadu_epi8(first_bytes(d - c), kb + t * d + c), od.plain, tb, w0, w1);
      _mm512_storeu_si512(ab + (t - t0) * dp + c, w0);
      if (c + 32 < dp) _mm512_storeu_si512(ab + (t - t0) * dp + c + 32, w1);
    }
}

// V rows a, b (either null: zeros) -> one pair row [dp][2] of bf16 words
GD_TILES_TARGET void v_pair(const uint8_t* a, const uint8_t* b, int64_t d, int64_t dp, const Fp8Table& tb,
                            const Orders& od, uint16_t* row) {
  __m512i w0, w1;
  for (int64_t c = 0; c < dp; c += 32) {
    const __mmask64 m = first_bytes(std::min<int64_t>(32, d - c));
    const __m512i x = a ? _mm512_maskz_loadu_epi8(m, a + c) : _mm512_setzero_si512();   // 32 bytes each
    const __m512i y = b ? _mm512_maskz_loadu_epi8(m, b + c) : _mm512_setzero_si512();
    fp8_words(_mm512_inserti64x4(x, _mm512_castsi512_si256(y), 1), od.vnni, tb, w0, w1);
    _mm512_storeu_si512(row + 2 * c, w0);
    _mm512_storeu_si512(row + 2 * c + 32, w1);
  }
}

}  // namespace

// 5 to 8 q heads a kv head: at most 8 (two parts each: the score tile's 16 columns, the P tile's 16 rows); at
// least 5, as the tiles cost the same for any count and the fp32 form's cost grows with it (4 kv heads of 64
// dims, batch 32, 4,096 tokens: 1 / 2 / 4 / 6 q heads a kv head 0.81 / 0.88 / 1.01 / 1.14x the fp32 form);
// AMX tiles on (product_form.cpp: the CPU has AMX-BF16 and VBMI, and GIGADECODE_AMX is not 0)
bool decode_tiles_take(const AttnShape& s) { return s.rep >= 5 && s.rep <= 8 && amx_tiles_on(); }

GD_TILES_TARGET
void attend_range_tiles(const AttnShape& s, const float* q, const uint8_t* K, const uint8_t* V, const int64_t* table,
                        int64_t lo, int64_t pos, int64_t jb0, int64_t jb1, int64_t b, int64_t h0, int64_t h1,
                        float qmul, float* part, int64_t stride) {
  const int64_t rep = s.rep, d = s.d, B = s.B, kv = s.kv, G = h1 - h0;
  const int64_t dp = (d + 31) / 32 * 32, steps = dp / 32, qwords = steps * 1024;
  const int64_t span_blocks = std::max<int64_t>(1, SPAN_TOKENS / B), cap = span_blocks * B;
  const int64_t ld = (cap + 31) / 32 * 32, npmax = ld;
  const Fp8Table& tb = fp8_table();
  const Orders& od = orders();
  uint16_t* qb = reinterpret_cast<uint16_t*>(scratch(0, G * qwords / 2));
  float* sc = scratch(1, rep * ld);                                 // scores, then P, of a span [rep][ld]
  const int64_t ab_words = ld * dp, pb_words = 16 * npmax, vb_words = npmax * dp;   // multiples of 32
  // two of each buffer a head writes before its tiles read them: a tile load waits for the stores that wrote
  // its rows, so one head's rows are written while the tiles of the head before work
  uint16_t* ab2 = reinterpret_cast<uint16_t*>(scratch(3, ab_words + pb_words + vb_words + 512 + 16 * dp));
  uint16_t* pb2 = ab2 + 2 * ab_words;                               // P parts [16][npmax]: hi rows 0.., mid 8..
  uint16_t* vb2 = pb2 + 2 * pb_words;                               // V pairs [np/2][dp][2]
  float* cbuf = reinterpret_cast<float*>(vb2 + 2 * vb_words);       // two score tiles [2][16][16]
  float* obuf = cbuf + 512;                                         // a span's P · V [16][dp]
  thread_local std::vector<const uint8_t*> vrow_buf;                // the span's visible V rows
  if (int64_t(vrow_buf.size()) < cap) vrow_buf.resize(cap);
  const uint8_t** vrows = vrow_buf.data();

  for (int64_t h = h0; h < h1; ++h) {
    q_parts(q + (b * s.nh + h * rep) * d, rep, d, dp, qmul, qb + (h - h0) * qwords);
    float* o = part + (h - h0) * stride;                            // [rep][d + 2]: o, then m, l
    for (int64_t r = 0; r < rep; ++r) {
      std::fill(o + r * (d + 2), o + r * (d + 2) + d, 0.f);
      o[r * (d + 2) + d] = -INFINITY;
      o[r * (d + 2) + d + 1] = 0.f;
    }
  }
  for (int64_t half = 0; half < 4; ++half)                          // P rows of no head: 0
    std::fill(pb2 + (8 * half + rep) * npmax, pb2 + 8 * (half + 1) * npmax, uint16_t(0));
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
  const int64_t cblocks = (d + 15) / 16;
  // head h's K rows and V pairs of the span [j0, j1] into buffer set `set`; -> the span's visible tokens
  auto rows_of = [&](int64_t h, int64_t j0, int64_t j1, int set) {
    uint16_t* ab = ab2 + set * ab_words;
    int64_t n = 0;
    for (int64_t jb = j0; jb <= j1; ++jb) {
      int64_t t0, t1;
      const int64_t nt = visible_in_block(jb, B, lo, pos, t0, t1);
      if (nt <= 0) continue;
      if (jb + 2 <= jb1) {                                          // blocks are scattered: fetch two ahead
        const int64_t nxt = table[b * s.n_table + jb + 2];
        prefetch_rows(K + (nxt * kv + h) * B * d, B * d);
        prefetch_rows(V + (nxt * kv + h) * B * d, B * d);
      }
      const int64_t bid = table[b * s.n_table + jb];
      k_rows(K + (bid * kv + h) * B * d, s.packed, t0, t1, d, dp, tb, od, ab + n * dp);
      const uint8_t* vr = V + (bid * kv + h) * B * d;
      for (int64_t t = t0; t <= t1; ++t) vrows[n + t - t0] = vr + t * d;
      n += nt;
    }
    uint16_t* vb = vb2 + set * vb_words;
    for (int64_t i = 0; i < (n + 31) / 32 * 16; ++i)
      v_pair(2 * i < n ? vrows[2 * i] : nullptr, 2 * i + 1 < n ? vrows[2 * i + 1] : nullptr, d, dp, tb, od,
             vb + i * dp * 2);
    return n;
  };
  // items of the pipeline: (span, head), each one's rows written while the tiles of the one before work
  const int64_t heads = h1 - h0, nspans = (jb1 - jb0) / span_blocks + 1, items = nspans * heads;
  auto span_of = [&](int64_t it, int64_t& j0, int64_t& j1) {
    j0 = jb0 + it / heads * span_blocks;
    j1 = std::min(jb1, j0 + span_blocks - 1);
  };
  int64_t j0, j1;
  span_of(0, j0, j1);
  int64_t n_next = rows_of(h0, j0, j1, 0);
  for (int64_t it = 0; it < items; ++it) {
    const int set = int(it & 1), h = h0 + it % heads;
    const int64_t n = n_next;
    if (n == 0) {                                                   // nothing visible in this span
      if (it + 1 < items) {
        span_of(it + 1, j0, j1);
        n_next = rows_of(h0 + (it + 1) % heads, j0, j1, 1 - set);
      }
      continue;
    }
    const uint16_t* qh = qb + (h - h0) * qwords;
    const uint16_t* ab = ab2 + set * ab_words;
    uint16_t* pb = pb2 + set * pb_words;
    const uint16_t* vb = vb2 + set * vb_words;
    float* o = part + (h - h0) * stride;
    // scores, 32 tokens at a time: two sum tiles 0, 1 on K rows 2, 3; a step's q tiles in 4, 5 (even steps) or
    // 6, 7 (odd), loaded from L1 again each time (no step waits for the tiles the one before still reads)
#define GD_SCORE_STEP(QA, QB)                                                   \
    {                                                                           \
      _tile_loadd(2, ah + ks * 32, dp * 2);                                     \
      _tile_loadd(3, ah + 16 * dp + ks * 32, dp * 2);                           \
      _tile_loadd(QA, qh + ks * 1024, 64);                                      \
      _tile_loadd(QB, qh + ks * 1024 + 512, 64);                                \
      _tile_dpbf16ps(0, 2, QA);                                                 \
      _tile_dpbf16ps(1, 3, QA);                                                 \
      _tile_dpbf16ps(0, 2, QB);                                                 \
      _tile_dpbf16ps(1, 3, QB);                                                 \
    }
    for (int64_t g0 = 0; g0 < n; g0 += 32) {
      const uint16_t* ah = ab + g0 * dp;
      _tile_zero(0);
      _tile_zero(1);
      for (int64_t ks = 0; ks < steps; ++ks) {
        if (ks & 1) GD_SCORE_STEP(6, 7) else GD_SCORE_STEP(4, 5)
      }
      _tile_stored(0, cbuf, 64);
      _tile_stored(1, cbuf + 256, 64);
      for (int g = 0; g < (g0 + 16 < n ? 2 : 1); ++g) {
        __m512 cols[16];
        transpose16(cbuf + 256 * g, 16, cols);
        for (int64_t r = 0; r < rep; ++r)                           // ld: whole 32s
          _mm512_storeu_ps(sc + r * ld + g0 + 16 * g, _mm512_add_ps(cols[r], cols[8 + r]));
      }
    }
#undef GD_SCORE_STEP
    softmax_update(sc, ld, n, rep, d, o);
    const int64_t np = (n + 31) / 32 * 32;
    for (int64_t r = 0; r < rep; ++r)                               // P's parts: hi rows r, mid rows 8 + r
      for (int64_t t = 0; t < np; t += 16) {
        __m256i hi, mid;
        split2(_mm512_maskz_loadu_ps(first_floats(n - t), sc + r * ld + t), hi, mid);
        _mm256_store_si256(reinterpret_cast<__m256i*>(pb + r * npmax + t), hi);
        _mm256_store_si256(reinterpret_cast<__m256i*>(pb + (8 + r) * npmax + t), mid);
      }
    if (it + 1 < items) {                                           // the next item's rows
      span_of(it + 1, j0, j1);
      n_next = rows_of(h0 + (it + 1) % heads, j0, j1, 1 - set);
    }
    // P · V: sums 0..3 (four 16-dim blocks a pass), P in tiles 4 / 5 by step, V blocks in 6 / 7 in turn
    const int64_t vstride = dp * 4;                                 // bytes a V pair row
#define GD_PV_STEP(PT)                                                          \
    {                                                                           \
      _tile_loadd(PT, pb + ks * 32, npmax * 2);                                 \
      const uint16_t* vk = vb + ks * 16 * dp * 2 + cb0 * 32;                    \
      _tile_loadd(6, vk, vstride);                                              \
      _tile_dpbf16ps(0, PT, 6);                                                 \
      if (nb > 1) { _tile_loadd(7, vk + 32, vstride); _tile_dpbf16ps(1, PT, 7); } \
      if (nb > 2) { _tile_loadd(6, vk + 64, vstride); _tile_dpbf16ps(2, PT, 6); } \
      if (nb > 3) { _tile_loadd(7, vk + 96, vstride); _tile_dpbf16ps(3, PT, 7); } \
    }
    for (int64_t cb0 = 0; cb0 < cblocks; cb0 += 4) {
      const int64_t nb = std::min<int64_t>(4, cblocks - cb0);
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t ks = 0; ks < np / 32; ++ks) {
        if (ks & 1) GD_PV_STEP(5) else GD_PV_STEP(4)
      }
      _tile_stored(0, obuf + cb0 * 16, dp * 4);
      if (nb > 1) _tile_stored(1, obuf + cb0 * 16 + 16, dp * 4);
      if (nb > 2) _tile_stored(2, obuf + cb0 * 16 + 32, dp * 4);
      if (nb > 3) _tile_stored(3, obuf + cb0 * 16 + 48, dp * 4);
    }
#undef GD_PV_STEP
    // o += hi row r + mid row 8 + r (the tail without a masked store: the ISA check's SIMDe writes 0 past the mask)
    for (int64_t r = 0; r < rep; ++r) {
      float* orow = o + r * (d + 2);
      const float *hi = obuf + r * dp, *mid = obuf + (8 + r) * dp;
      int64_t j = 0;
      for (; j + 16 <= d; j += 16)
        _mm512_storeu_ps(orow + j, _mm512_add_ps(_mm512_loadu_ps(orow + j),
                                                 _mm512_add_ps(_mm512_loadu_ps(hi + j), _mm512_loadu_ps(mid + j))));
      for (; j < d; ++j) orow[j] += hi[j] + mid[j];
    }
  }
  _tile_release();
  at::native::cpublas::brgemm_release();   // the next oneDNN GEMM of this thread configures its tiles again
}

#else   // no tile code in this build

bool decode_tiles_take(const AttnShape&) { return false; }
void attend_range_tiles(const AttnShape&, const float*, const uint8_t*, const uint8_t*, const int64_t*, int64_t,
                        int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float, float*, int64_t) {
  TORCH_CHECK(false, "attend_range_tiles: not in this build");
}

#endif

}  // namespace gd
