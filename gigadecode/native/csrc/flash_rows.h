// What both prefill attention kernels (prefill_attention.cpp: bf16 pairs; prefill_attention_f32.cpp: fp32)
// share: their work items — (kv head, 16 query positions), whose rep = nh / nkv query heads are the item's
// rows (row = t * rep + head) — the online-softmax state of every row, carried from one key window to the
// next (fp32 output row, running max, running sum), the range of keys any query sees, and the final store:
// out = acc / sum · sigmoid(lse − sink), rounded once to bf16.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>

#include "common.h"

namespace gd {

struct FlashRows {
  static constexpr int64_t QT = 16;            // query positions per work item
  int64_t T, nh, rep, ld, tiles, items, Rmax;
  float* acc;                                  // [items][Rmax][ld] output rows (ld >= d)
  float* mx;                                   // [items][Rmax] running max
  float* sum;                                  // [items][Rmax] running sum

  // rows of an item padded to a multiple of `row_group`; the state zeroed (max -inf) over the threads
  FlashRows(int64_t T_, int64_t nh_, int64_t nkv, int64_t ld_, int64_t row_group)
      : T(T_), nh(nh_), rep(nh_ / nkv), ld(ld_), tiles((T_ + QT - 1) / QT), items(nkv * tiles),
        Rmax((QT * rep + row_group - 1) / row_group * row_group) {
    acc = shared_scratch(2, items * Rmax * (ld + 2));
    mx = acc + items * Rmax * ld;
    sum = mx + items * Rmax;
    at::parallel_for(0, items, 1, [&](int64_t w0, int64_t w1) {
      for (int64_t w = w0; w < w1; ++w) {
        std::fill(acc + w * Rmax * ld, acc + (w + 1) * Rmax * ld, 0.f);
        std::fill(mx + w * Rmax, mx + (w + 1) * Rmax, -INFINITY);
        std::fill(sum + w * Rmax, sum + (w + 1) * Rmax, 0.f);
      }
    });
  }
  // item w: kv head w / tiles and QT query positions from tile_start(w); tiles alternate early / late, so
  // consecutive items (a thread's share) mix cheap and costly causal rows
  int64_t head(int64_t w) const { return w / tiles; }
  int64_t tile_start(int64_t w) const {
    const int64_t i = w % tiles;
    return (i % 2 == 0 ? i / 2 : tiles - 1 - i / 2) * QT;
  }
  int64_t rows(int64_t w) const { return std::min<int64_t>(QT, T - tile_start(w)) * rep; }
  // the query position and q head of row r of item w
  int64_t token(int64_t w, int64_t r) const { return tile_start(w) + r / rep; }
  int64_t q_head(int64_t w, int64_t r) const { return head(w) * rep + r % rep; }

  // out [T, nh, d] bf16 (zeros): each row normalized, times sigmoid(lse - sink); rows no key weighs stay 0
  // (the sink takes it all), NaN where the sink is not finite (the dense softmax's sink - sink = NaN)
  void store(at::Tensor& out, const FloatView& sinks) const {
    const int64_t d = out.size(2);
    uint16_t* o = reinterpret_cast<uint16_t*>(out.data_ptr());
    at::parallel_for(0, items, 1, [&](int64_t w0, int64_t w1) {
      for (int64_t w = w0; w < w1; ++w)
        for (int64_t r = 0; r < rows(w); ++r) {
          const float l = sum[w * Rmax + r];
          const int64_t hq = q_head(w, r);
          if (l <= 0.f) {
            if (!std::isfinite(sinks[hq])) {
              uint16_t* dst = o + (token(w, r) * nh + hq) * d;
              std::fill(dst, dst + d, f32_to_bf16(NAN));
            }
            continue;
          }
          const float lse = mx[w * Rmax + r] + std::log(l);
          // sigmoid(lse - sink) / l; a sink of +inf gives NaN, as the dense softmax (inf - inf), not 0
          const float f = sinks[hq] == INFINITY ? NAN : 1.f / l / (1.f + std::exp(sinks[hq] - lse));
          const float* a = acc + (w * Rmax + r) * ld;
          uint16_t* dst = o + (token(w, r) * nh + hq) * d;
          for (int64_t j = 0; j < d; ++j) dst[j] = f32_to_bf16(a[j] * f);   // round to nearest even
        }
    });
  }
};

// out [T, nh, d] bf16 (zeros) of a call where no query sees a key (every query before the first key, or past
// the last one by its window): each row as `store` leaves a row no key weighs, 0, or NaN for the q heads whose
// sink is not finite. (The kernels returned zeros for every row then, so a query's row came out 0 or NaN
// depending on whether another query of its chunk saw a key.)
inline void store_blind(at::Tensor& out, const FloatView& sinks) {
  const int64_t T = out.size(0), nh = out.size(1), d = out.size(2);
  uint16_t* o = reinterpret_cast<uint16_t*>(out.data_ptr());
  for (int64_t hq = 0; hq < nh; ++hq)
    if (!std::isfinite(sinks[hq]))
      for (int64_t t = 0; t < T; ++t) std::fill(o + (t * nh + hq) * d, o + (t * nh + hq + 1) * d, f32_to_bf16(NAN));
}

// The first key (index from the first, key s at position k_start + s) any of the queries sees. The layouts
// start a whole chunk earlier (`seen_keys`) and hold zeros for the keys before this one: no query weighs them,
// but a probability of 0 times a NaN left there (a block another request freed) would still be NaN.
inline int64_t first_seen_key(const int64_t* q_pos, int64_t T, int64_t k_start, int64_t window) {
  const int64_t qlo = *std::min_element(q_pos, q_pos + T);
  return window ? std::max<int64_t>(0, qlo - window + 1 - k_start) : 0;
}

// The keys any of the queries sees: [first, last], first (`first_seen_key`) rounded down to a multiple of
// `align`; first > last when none sees any
inline std::pair<int64_t, int64_t> seen_keys(const int64_t* q_pos, int64_t T, int64_t S, int64_t k_start,
                                             int64_t window, int64_t align) {
  const int64_t qhi = *std::max_element(q_pos, q_pos + T);
  const int64_t first = first_seen_key(q_pos, T, k_start, window) / align * align;
  return {first, std::min<int64_t>(S - 1, qhi - k_start)};
}

}  // namespace gd
