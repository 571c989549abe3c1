// Packed FP8 K scored 16 tokens a vector: the byte-table read's form of a span's scores (attention.cpp includes
// it inside its AVX512-VBMI namespace, which defines `fp8x4_reg`; attend_range_f32.h calls it where
// `transposed_scores_take` says).
//
// The lanes form (attend_range_f32.h) broadcasts each converted token pair from memory into a vector for a
// single FMA; the Ice Lake Xeon it was measured on loads one 512-bit vector a cycle (3.7 a ns, against 6.4 of
// 256 bits) while it issues two FMAs, a broadcast counting as a load, so it waits on its loads at ~1.1 a
// multiply-add. Here a 16-token group
// of a block (8 pair rows [32 dims][2 tokens] at a time) is transposed by three levels of in-lane unpacks (words,
// dwords, qwords) into vectors whose 128-bit lane L holds one dim's 16 tokens in order, read through the byte
// table into four fp32 vectors (a dim each), and multiplied by q broadcast, each broadcast serving G groups:
// rep · G accumulators (<= 16), one load per G multiply-adds, and the sums come out as each head's row of
// token scores (no transposes). The sums run over the dims in another order than the lanes form's (dims
// c0 + 8L + k: k, then L), so the scores agree with it to fp32 rounding, not to the bit.

// 16 tokens of one block (8 pair rows at `rows`), of which lanes [a, e] are visible; lane a's score goes to
// column `out` of each head's row
struct ScoreGroup {
  const uint8_t* rows;
  int a, e;
  int64_t out;
};

// whether a call's K takes this form: packed FP8 K in blocks of whole 16-token groups, at most 8 q heads a kv
// head (rep · G accumulators in registers)
inline bool transposed_scores_take(const AttnShape& s) { return s.packed && s.B % 16 == 0 && s.rep <= 8; }

// The 8 pair rows' dims [c0, c0 + 32) (64 bytes a row, 2 · d a row apart; dims past d read as 0) -> o[k]: 128-bit
// lane L holds dim c0 + 8L + k of the 16 tokens in order (token 2p + s: pair row p, byte s of its dim's word)
inline void transpose_pair_rows(const uint8_t* rows, int64_t d, int64_t c0, __m512i o[8]) {
  const int64_t bytes = std::min<int64_t>(64, 2 * (d - c0));
  const __mmask64 m = bytes >= 64 ? ~__mmask64(0) : (__mmask64(1) << bytes) - 1;
  __m512i r[8], a[8], b[8];
  for (int p = 0; p < 8; ++p) r[p] = _mm512_maskz_loadu_epi8(m, rows + p * 2 * d + 2 * c0);
  for (int p = 0; p < 8; p += 2) {          // lane L: dims 8L..8L+3 (a[p]), 8L+4.. (a[p+1]) of rows p, p+1
    a[p] = _mm512_unpacklo_epi16(r[p], r[p + 1]);
    a[p + 1] = _mm512_unpackhi_epi16(r[p], r[p + 1]);
  }
  for (int g = 0; g < 8; g += 4) {          // rows g..g+3: b[g + i] holds dims 8L + 2i, 8L + 2i + 1
    b[g] = _mm512_unpacklo_epi32(a[g], a[g + 2]);
    b[g + 1] = _mm512_unpackhi_epi32(a[g], a[g + 2]);
    b[g + 2] = _mm512_unpacklo_epi32(a[g + 1], a[g + 3]);
    b[g + 3] = _mm512_unpackhi_epi32(a[g + 1], a[g + 3]);
  }
  for (int i = 0; i < 4; ++i) {             // rows 0..3 and 4..7 of dims 8L + 2i (o[2i]), 8L + 2i + 1
    o[2 * i] = _mm512_unpacklo_epi64(b[i], b[i + 4]);
    o[2 * i + 1] = _mm512_unpackhi_epi64(b[i], b[i + 4]);
  }
}

// Scores of n groups against R heads (qt [R][dp]: q · multiplier, zero past d), G groups a pass, into sc (a row
// of ld floats a head); visible lanes only
template <int R, int G>
void score_groups(const ScoreGroup* gs, int64_t n, const float* qt, int64_t d, int64_t dp, int64_t ld, float* sc) {
  for (int64_t g0 = 0; g0 < n; g0 += G) {
    const int gn = int(std::min<int64_t>(G, n - g0));
    __m512 acc[R][G];
#pragma GCC unroll 8
    for (int h = 0; h < R; ++h)
#pragma GCC unroll 4
      for (int i = 0; i < G; ++i) acc[h][i] = _mm512_setzero_ps();
    for (int64_t c0 = 0; c0 < dp; c0 += 32) {
      __m512i o[G][8];
      for (int i = 0; i < G; ++i) transpose_pair_rows(gs[g0 + std::min(i, gn - 1)].rows, d, c0, o[i]);
      for (int k = 0; k < 8; ++k) {
        VF v[G][4];
#pragma GCC unroll 4
        for (int i = 0; i < G; ++i) fp8x4_reg(o[i][k], v[i]);
#pragma GCC unroll 4
        for (int L = 0; L < 4; ++L) {
          const float* qj = qt + c0 + 8 * L + k;
#pragma GCC unroll 8
          for (int h = 0; h < R; ++h) {
            const __m512 qb = _mm512_set1_ps(qj[h * dp]);
#pragma GCC unroll 4
            for (int i = 0; i < G; ++i) acc[h][i] = _mm512_fmadd_ps(v[i][L].v, qb, acc[h][i]);
          }
        }
      }
    }
    for (int i = 0; i < gn; ++i) {
      const ScoreGroup& g = gs[g0 + i];
      const __mmask16 m = __mmask16((0xFFFFu >> (15 - g.e)) & (0xFFFFu << g.a));
      for (int h = 0; h < R; ++h) {
        float* row = sc + h * ld + g.out;
        if (m == 0xFFFF) _mm512_storeu_ps(row, acc[h][i]);
        else _mm512_mask_compressstoreu_ps(row, m, acc[h][i]);
      }
    }
  }
}

// score_groups for rep in 1..8: 4 groups a pass up to 4 heads, 2 above
inline void score_groups_n(int64_t rep, const ScoreGroup* gs, int64_t n, const float* qt, int64_t d, int64_t dp,
                           int64_t ld, float* sc) {
  switch (rep) {
    case 1: score_groups<1, 4>(gs, n, qt, d, dp, ld, sc); break;
    case 2: score_groups<2, 4>(gs, n, qt, d, dp, ld, sc); break;
    case 3: score_groups<3, 4>(gs, n, qt, d, dp, ld, sc); break;
    case 4: score_groups<4, 4>(gs, n, qt, d, dp, ld, sc); break;
    case 5: score_groups<5, 2>(gs, n, qt, d, dp, ld, sc); break;
    case 6: score_groups<6, 2>(gs, n, qt, d, dp, ld, sc); break;
    case 7: score_groups<7, 2>(gs, n, qt, d, dp, ld, sc); break;
    default: score_groups<8, 2>(gs, n, qt, d, dp, ld, sc);
  }
}
