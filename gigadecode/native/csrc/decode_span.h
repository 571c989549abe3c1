// What decode attention's two forms share (attention.cpp, attention_tiles.cpp): the shape of a call, the span of
// tokens scored before one online-softmax update and that update, and the AMX tile form's entry point.
#pragma once

#include <algorithm>
#include <cmath>

#include "common.h"

namespace gd {

struct AttnShape {
  int64_t Bt, nh, kv, rep, d, B, n_table;
  bool packed;
};

// Tokens scored before one softmax update: the blocks of a span are scored into one row of scores per head,
// so the update's fixed cost (maxima, a scalar exp, rescaling o) is paid once per ~128 tokens, not per block.
constexpr int64_t SPAN_TOKENS = 128;

// block jb's visible in-block range [t0, t1] of frame positions [lo, pos] (blocks of B) -> its token count
// (<= 0: none)
inline int64_t visible_in_block(int64_t jb, int64_t B, int64_t lo, int64_t pos, int64_t& t0, int64_t& t1) {
  t0 = std::max(lo, jb * B) - jb * B;
  t1 = std::min(pos, jb * B + B - 1) - jb * B;
  return t1 - t0 + 1;
}

// online softmax over a span's scores sc[r * ld + t] (t < n): e^(s - m) in place, m and l of each head
// updated in o ([rep][d + 2]: o, m, l) and o rescaled where the maximum moved
inline void softmax_update(float* sc, int64_t ld, int64_t n, int64_t rep, int64_t d, float* o) {
  for (int64_t r = 0; r < rep; ++r) {
    float* sr = sc + r * ld;
    float* orow = o + r * (d + 2);
    const float m_old = orow[d];
    int64_t t = 0;
    VF mx = vset1(-INFINITY);
    for (; t + W <= n; t += W) mx = vmax(mx, vload(sr + t));
    float m_new = std::max(m_old, vmaxall(mx));
    for (; t < n; ++t) m_new = std::max(m_new, sr[t]);
    if (m_new == -INFINITY && std::none_of(sr, sr + n, [](float x) { return x != x; })) {
      // every score so far -inf (an infinite q or k): no key weighs, as in the twin's softmax (the sink, or
      // nothing, takes it all), not e^(-inf - -inf) = NaN. A NaN score (the maxima drop it) goes on to NaN.
      std::fill(sr, sr + n, 0.f);
      continue;
    }
    const float corr = std::exp(m_old - m_new);     // 0 on the first span (m_old = -inf)
    const VF nm = vset1(-m_new);
    VF ls = vzero();                                // the span's sum of e^(s - m), vector lanes first
    for (t = 0; t + W <= n; t += W) {
      const VF e = vexp(vadd(vload(sr + t), nm));
      vstore(sr + t, e);
      ls = vadd(ls, e);
    }
    float l = vsum(ls);
    for (; t < n; ++t) l += sr[t] = std::exp(sr[t] - m_new);
    orow[d] = m_new;
    orow[d + 1] = orow[d + 1] * corr + l;
    if (corr != 1.f) {
      const VF cv = vset1(corr);
      int64_t j = 0;
      for (; j + W <= d; j += W) vstore(orow + j, vmul(vload(orow + j), cv));
      for (; j < d; ++j) orow[j] *= corr;
    }
  }
}

// FP8 KV read by byte table (AVX512-VBMI) in the fp32 form (attention.cpp), in AVX-512 builds (not the ISA
// check's emulated ones); `fp8_table_reads` says whether it runs (product_form.cpp: where the CPU has VBMI, unless
// GIGADECODE_FP8_READS=fp16 or the `fp8_reads` op said otherwise)
#if defined(__AVX512BW__) && !defined(SIMDE_VERSION)
#define GD_FP8_TABLE_READS 1
bool fp8_table_reads();
#endif

// The AMX tile form of one (slot, kv heads [h0, h1), block range) item over FP8 KV, with `attend_range`'s
// arguments and results (attention.cpp); run only where `decode_tiles_take` says so.
bool decode_tiles_take(const AttnShape& s);
void attend_range_tiles(const AttnShape& s, const float* q, const uint8_t* K, const uint8_t* V, const int64_t* table,
                        int64_t lo, int64_t pos, int64_t jb0, int64_t jb1, int64_t b, int64_t h0, int64_t h1,
                        float qmul, float* part, int64_t stride);

}  // namespace gd
