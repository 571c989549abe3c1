// Prefill attention with fp32 products: the form of `prefill_attention` for builds without `vdpbf16ps`
// (AVX2, AVX-512 without BF16) and, on AVX512-BF16 builds, for head dims its pair kernel does not take.
// A chunk's queries against the keys they may see, flash style, with the sink, GQA and a sliding window;
// the contract of `prefill_attention` (prefill_attention.cpp): q [T, nh, d], k / v [S, nkv, d] bf16
// token-major (key s at position k_start + s), q_pos [T] -> [T, nh, d] bf16; query q sees key kp iff kp <= q
// and (window == 0 or kp > q - window); a row that sees no key gives 0.
//
// The bf16 inputs become fp32 once, in layouts that need no horizontal sums, one window of KW keys at a time
// (scratch bounded by KW, not by the context):
// - Kt [nkv][Sw / KC][d][KC]: a chunk of KC keys as d rows of KC lanes, contiguous; a query's dim p is
//   broadcast against W keys a vector -> W scores in the lanes;
// - Vf [nkv][Sw][dp] (dp = d rounded up to W, zero-padded): a row's probability of key s is broadcast against
//   W output dims a vector.
// Work: (kv head, 16 query positions) items over the threads; the rep = nh / nkv query heads of a kv head are
// its rows (row = t * rep + head), RG at a time for the scores and RP at a time for PV. Keys go in spans of
// SPAN = 16W (the online softmax's max, rescale and sums once a span and row), scored in chunks of KC = 2W (a
// register tile of RG rows × KC keys); a row group skips the chunks none of its queries sees (causal and
// window). Softmax in fp32 with the probabilities kept in fp32 for PV (as the torch form's on a CPU without
// bf16 GEMMs), the sink applied at the end as out * sigmoid(lse - sink), one rounding to bf16.
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "common.h"
#include "flash_rows.h"
#include "kernels.h"

namespace gd {
namespace {

constexpr int KC = 2 * W;               // keys per chunk: two vectors of scores
constexpr int RG = W == 16 ? 8 : 6;     // rows per score group: 2 RG accumulators + 2 keys + a broadcast
constexpr int RP = RG;                  // rows per PV tile: the score group's (a divisor of RG would do)
constexpr int CB = W == 16 ? 3 : 2;     // output vectors per PV tile: RP · CB accumulators, each V vector loaded
                                        // once for RP rows (2 rows × 4 vectors: GCC re-loaded V for each row)
constexpr int SPAN = 8 * KC;            // keys per online-softmax update (its max, rescale and sums)
constexpr int64_t KW = 2048;            // keys per window of the fp32 layouts (a multiple of SPAN)
static_assert(RG % RP == 0 && KW % SPAN == 0, "tiles must nest");

// acc[r][0 .. NV W) += Σ_s p[r][s] · v[s][0 .. NV W) for RP rows (p rows p_ld apart) over n keys
template <int NV>
void pv_tile(const float* p, int64_t p_ld, const float* v, int64_t dp, int64_t n, float* acc, int64_t acc_ld) {
  VF o[RP][NV];
#pragma GCC unroll 8
  for (int r = 0; r < RP; ++r)
#pragma GCC unroll 8
    for (int j = 0; j < NV; ++j) o[r][j] = vload(acc + r * acc_ld + j * W);
  for (int64_t s = 0; s < n; ++s) {
    VF vv[NV];
#pragma GCC unroll 8
    for (int j = 0; j < NV; ++j) vv[j] = vload(v + s * dp + j * W);
#pragma GCC unroll 8
    for (int r = 0; r < RP; ++r) {
      const VF pb = vset1(p[r * p_ld + s]);
#pragma GCC unroll 8
      for (int j = 0; j < NV; ++j) o[r][j] = vfma(pb, vv[j], o[r][j]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < RP; ++r)
#pragma GCC unroll 8
    for (int j = 0; j < NV; ++j) vstore(acc + r * acc_ld + j * W, o[r][j]);
}

using PvFn = void (*)(const float*, int64_t, const float*, int64_t, int64_t, float*, int64_t);
constexpr PvFn PV[4] = {nullptr, &pv_tile<1>, &pv_tile<2>, &pv_tile<3>};
static_assert(CB <= 3, "PV has tiles of up to 3 vectors");

}  // namespace

at::Tensor prefill_attention_f32(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 const at::Tensor& q_pos, int64_t k_start, const at::Tensor& sinks, double scale,
                                 int64_t window) {
  // the caller (`prefill_attention`) has checked dtypes, shapes and contiguity
  const int64_t T = q.size(0), nh = q.size(1), d = q.size(2), S = k.size(0), nkv = k.size(1);
  at::Tensor out = at::zeros({T, nh, d}, q.options());
  if (T == 0 || S == 0) return out;
  const int64_t dp = (d + W - 1) / W * W, DVp = dp / W;               // rows padded to dp outputs
  const uint16_t* kp = reinterpret_cast<const uint16_t*>(k.data_ptr());
  const uint16_t* vptr = reinterpret_cast<const uint16_t*>(v.data_ptr());
  const uint16_t* qd = reinterpret_cast<const uint16_t*>(q.data_ptr());
  const int64_t* qp = q_pos.data_ptr<int64_t>();
  at::Tensor sk = sinks.contiguous();
  const auto [k_first, k_last] = seen_keys(qp, T, S, k_start, window, KC);
  if (k_last < k_first) {                                              // no query sees a key
    store_blind(out, FloatView(sk));
    return out;
  }
  const int64_t k_seen = first_seen_key(qp, T, k_start, window);       // keys before it: zeros in the layouts
  FlashRows st(T, nh, nkv, dp, RG);                                    // every row's softmax state
  const float sc = float(scale);
  for (int64_t ws = k_first; ws <= k_last; ws += KW) {
    const int64_t we = std::min<int64_t>(std::min<int64_t>(S, k_last + 1), ws + KW);   // keys [ws, we)
    const int64_t Sw = (we - ws + KC - 1) / KC * KC;                  // padded to whole chunks (zeros)
    float* kt = shared_scratch(0, nkv * d * Sw);                      // Kt [nkv][Sw / KC][d][KC]
    float* vf = shared_scratch(1, nkv * Sw * dp);                     // Vf [nkv][Sw][dp]
    at::parallel_for(0, nkv * Sw, 64, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t h = i / Sw, col = i % Sw, s = ws + col;         // local key col of kv head h
        float* vrow = vf + (h * Sw + col) * dp;
        float* kc = kt + (h * Sw + col / KC * KC) * d + col % KC;    // the key's lane in its chunk's rows
        if (s >= we || s < k_seen) {
          for (int64_t p = 0; p < d; ++p) kc[p * KC] = 0.f;
          std::fill(vrow, vrow + dp, 0.f);
          continue;
        }
        const uint16_t* krow = kp + (s * nkv + h) * d;
        const uint16_t* vsrc = vptr + (s * nkv + h) * d;
        for (int64_t p = 0; p < d; ++p) kc[p * KC] = bf16_to_f32(krow[p]);
        for (int64_t p = 0; p < d; ++p) vrow[p] = bf16_to_f32(vsrc[p]);
        std::fill(vrow + d, vrow + dp, 0.f);
      }
    });

    at::parallel_for(0, st.items, 1, [&](int64_t w0, int64_t w1) {
      float* pb = scratch(0, st.Rmax * SPAN);                           // [R][SPAN] scores, then probabilities
      float* qf = scratch(1, st.Rmax * d);                              // [R][d] the rows' queries in fp32
      int64_t* rpos = reinterpret_cast<int64_t*>(scratch(2, 2 * st.Rmax));   // [R] row positions
      for (int64_t w = w0; w < w1; ++w) {
        const int64_t h = st.head(w), R = st.rows(w), Rp = (R + RG - 1) / RG * RG;
        float* acc = st.acc + w * st.Rmax * dp;
        float* mx = st.mx + w * st.Rmax;
        float* sum = st.sum + w * st.Rmax;
        int64_t qmin = INT64_MAX, qmax = INT64_MIN;
        for (int64_t r = 0; r < Rp; ++r) {                           // padding rows repeat the last real one
          const int64_t row = std::min(r, R - 1), t = st.token(w, row), hq = st.q_head(w, row);
          rpos[r] = qp[t];
          qmin = std::min(qmin, rpos[r]);
          qmax = std::max(qmax, rpos[r]);
          const uint16_t* src = qd + (t * nh + hq) * d;
          for (int64_t p = 0; p < d; ++p) qf[r * d + p] = bf16_to_f32(src[p]);
        }
        const float* kth = kt + h * Sw * d;
        const float* vfh = vf + h * Sw * dp;
        const int64_t last = std::min<int64_t>(we - 1, qmax - k_start);
        const int64_t first = std::max<int64_t>(ws, window ? qmin - window + 1 - k_start : 0);
        const int64_t c_end = ws + (last - ws) / KC * KC + KC;      // past the chunk of the last seen key
        for (int64_t s0 = ws + (first - ws) / KC * KC; s0 < c_end; s0 += SPAN) {
          const int64_t s1 = std::min<int64_t>(s0 + SPAN, c_end);
          for (int64_t g = 0; g < Rp; g += RG) {
            int64_t gmin = INT64_MAX, gmax = INT64_MIN;
            for (int r = 0; r < RG; ++r) gmin = std::min(gmin, rpos[g + r]), gmax = std::max(gmax, rpos[g + r]);
            // the group's chunks in the span: from the first one its earliest window reaches to the one
            // holding the last key its latest query sees
            const int64_t low = window ? gmin - window + 1 - k_start : s0, high = gmax - k_start;
            const int64_t cs = low > s0 ? ws + (low - ws) / KC * KC : s0;
            if (high < cs) continue;                                 // no query of the group sees the span
            const int64_t ce = std::min<int64_t>(s1, ws + (high - ws) / KC * KC + KC), n = ce - cs;
            if (n <= 0) continue;
            // scores of RG rows × KC keys at a time: each query dim broadcast against W keys a vector
            const float* qg = qf + g * d;
            for (int64_t c = cs; c < ce; c += KC) {
              const float* kc = kth + (c - ws) * d;                   // the chunk's [d][KC]
              VF sr[RG][2];
              for (int r = 0; r < RG; ++r) sr[r][0] = sr[r][1] = vzero();
              for (int64_t p = 0; p < d; ++p) {
                const VF k0 = vload(kc + p * KC), k1 = vload(kc + p * KC + W);
#pragma GCC unroll 8
                for (int r = 0; r < RG; ++r) {
                  const VF qb = vset1(qg[r * d + p]);
                  sr[r][0] = vfma(qb, k0, sr[r][0]);
                  sr[r][1] = vfma(qb, k1, sr[r][1]);
                }
              }
              for (int r = 0; r < RG; ++r) {
                vstore(pb + (g + r) * SPAN + (c - cs), vmul(sr[r][0], vset1(sc)));
                vstore(pb + (g + r) * SPAN + (c - cs) + W, vmul(sr[r][1], vset1(sc)));
              }
            }
            // online softmax per row over the span; invisible keys (future, outside the window, padding) get
            // probability 0
            for (int r = 0; r < RG; ++r) {
              const int64_t row = g + r, pos = rpos[row];
              float* prow = pb + row * SPAN;
              // the row's visible keys: [lo, hi) (indices from the first key)
              const int64_t lo = std::max<int64_t>(cs, window ? pos - window + 1 - k_start : cs);
              const int64_t hi = std::min<int64_t>({ce, we, pos - k_start + 1});
              if (hi <= lo) {
                std::fill(prow, prow + n, 0.f);
                continue;
              }
              std::fill(prow, prow + (lo - cs), -INFINITY);
              std::fill(prow + (hi - cs), prow + n, -INFINITY);
              VF m = vload(prow);
              for (int64_t i = W; i < n; i += W) m = vmax(m, vload(prow + i));
              const float cmax = vmaxall(m);
              // only -inf scores (infinite inputs): no key weighs. A NaN score is not one of them, though the
              // max dropped it (vmax returns its second operand when either is NaN): it runs on to a NaN row,
              // as the twin's softmax gives
              if (cmax == -INFINITY && std::none_of(prow + (lo - cs), prow + (hi - cs), [](float x) { return x != x; })) {
                std::fill(prow, prow + n, 0.f);
                continue;
              }
              const float mnew = std::max(mx[row], cmax);
              const float corr = mx[row] == -INFINITY ? 0.f : std::exp(mx[row] - mnew);
              const VF neg = vset1(-mnew);
              VF tot = vzero();
              for (int64_t i = 0; i < n; i += W) {
                const VF e = vexp(vadd(vload(prow + i), neg));
                vstore(prow + i, e);
              }
              std::fill(prow, prow + (lo - cs), 0.f);                  // masked lanes: 0 (exp gave ~1e-38)
              std::fill(prow + (hi - cs), prow + n, 0.f);
              for (int64_t i = 0; i < n; i += W) tot = vadd(tot, vload(prow + i));
              sum[row] = sum[row] * corr + vsum(tot);
              mx[row] = mnew;
              if (corr != 1.f) {
                float* a = acc + row * dp;
                for (int64_t j = 0; j < dp; j += W) vstore(a + j, vmul(vload(a + j), vset1(corr)));
              }
            }
            for (int64_t r = g; r < g + RG; r += RP)
              for (int64_t c = 0; c < DVp; c += CB)
                PV[std::min<int64_t>(CB, DVp - c)](pb + r * SPAN, SPAN, vfh + (cs - ws) * dp + c * W, dp, n,
                                                   acc + r * dp + c * W, dp);
          }
        }
      }
    });
  }

  st.store(out, FloatView(sk));
  return out;
}

}  // namespace gd
