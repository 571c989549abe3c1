// Prefill attention on bf16: a chunk's queries against the keys they may see, flash style, with the sink, GQA
// and a sliding window; the native form of `ops.flash_sink_attention` (sinks given). The op (`prefill_attention`,
// at the end) checks its inputs and runs the pair kernel below on AVX512-BF16 builds for head dims that are
// multiples of 16 up to 128, and the fp32-product kernel (prefill_attention_f32.cpp) everywhere else.
//
// q [T, nh, d], k / v [S, nkv, d] bf16 token-major (key s at position k_start + s), q_pos [T] -> [T, nh, d].
// Query q sees key kp iff kp <= q and (window == 0 or kp > q - window); a row that sees no key gives 0.
//
// Layouts that put the reduced dimension in bf16 pairs, so `vdpbf16ps` needs no horizontal sums:
// - scores: per kv head, K as d/2 rows of key-lane words (Kt[p][s] = k[s][2p], k[s][2p+1]); a query's pair of
//   dims p is broadcast and meets 16 keys per instruction -> 16 scores in the lanes;
// - values: per kv head, V as key pairs (Vp[j][i] = v[2j][i], v[2j+1][i]); a row's pair of probabilities is
//   broadcast and meets 16 output dims per instruction.
// Keys are taken in windows of KW (the layouts of one window at a time: scratch bounded by KW, not by the
// context), each row's online-softmax state carried from one window to the next.
// Work: (kv head, 16 query positions) items over the threads; the rep = nh / nkv query heads of a kv head are
// its rows (row = t * rep + head), processed 8 at a time for the scores and in groups of 16 / (d / 16) for PV.
// Key chunks of 32 are skipped for a row group none of whose queries sees them. Softmax in fp32, P rounded to
// bf16 for PV (as the torch form does), the sink applied at the end as out * sigmoid(lse - sink). Where the CPU
// has AMX tiles (`amx_tiles.h`) the two products run there instead (`amx_window`), on the same layouts.
#include <algorithm>
#include <cmath>
#include <vector>

#include "amx_tiles.h"
#include "bf16dot.h"
#include "common.h"
#include "flash_rows.h"
#include "kernels.h"

namespace gd {

#ifdef GD_BF16DOT
namespace {     // the pair kernel (AVX512-BF16)

constexpr int KC = 32;         // keys per chunk: two vectors of scores
constexpr int RG = 8;          // rows per score group
constexpr int64_t KW = 4096;   // keys per window of the pair layouts (a multiple of KC)

// acc[r][j] += p(row r) · Vp rows [j0, j0 + 16) over one chunk's key pairs, RP rows, DV vectors of 16 dims
template <int RP, int DV>
void pv_rows(const uint32_t* pb, int64_t pb_ld, const uint32_t* vp, int64_t d, int npairs, float* acc,
             int64_t acc_ld) {
  __m512 o[RP][DV];                                   // all in registers (fully unrolled)
#pragma GCC unroll 16
  for (int r = 0; r < RP; ++r)
#pragma GCC unroll 16
    for (int j = 0; j < DV; ++j) o[r][j] = _mm512_loadu_ps(acc + r * acc_ld + 16 * j);
  for (int sp = 0; sp < npairs; ++sp) {
    __m512i vv[DV];
#pragma GCC unroll 16
    for (int j = 0; j < DV; ++j) vv[j] = _mm512_loadu_si512(vp + sp * d + 16 * j);
#pragma GCC unroll 16
    for (int r = 0; r < RP; ++r) {
      const __m512i p = _mm512_set1_epi32(int(pb[r * pb_ld + sp]));
#pragma GCC unroll 16
      for (int j = 0; j < DV; ++j) o[r][j] = _mm512_dpbf16_ps(o[r][j], (__m512bh)vv[j], (__m512bh)p);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < RP; ++r)
#pragma GCC unroll 16
    for (int j = 0; j < DV; ++j) _mm512_storeu_ps(acc + r * acc_ld + 16 * j, o[r][j]);
}

using PvFn = void (*)(const uint32_t*, int64_t, const uint32_t*, int64_t, int, float*, int64_t);

template <int DV>
constexpr PvFn pv_for() { return &pv_rows<(DV <= 4 ? 4 : 2), DV>; }
constexpr PvFn PV[9] = {nullptr, pv_for<1>(), pv_for<2>(), pv_for<3>(), pv_for<4>(), pv_for<5>(), pv_for<6>(),
                        pv_for<7>(), pv_for<8>()};

// the head dims the pair kernel takes (d / 2 pairs, 16 output dims a vector, up to 8 vectors in registers)
bool pair_kernel_takes(int64_t d) { return d % 16 == 0 && d >= 16 && d <= 128; }

// The chunks of `chunk` keys, counted from the window's first key ws, that queries at positions qmin..qmax may
// see among the window's keys [ws, we): (the first chunk's first key, the last key); none when first > last.
// whether any of n score vectors holds a NaN: the maximum over them drops a NaN (vmaxps returns its second
// operand when either is NaN), so a row whose only visible scores are NaN would read as "no key weighs" and
// give 0 where the twin's softmax gives NaN. Asked only when the maximum is -inf.
inline bool scores_hold_nan(const __m512* v, int n) {
  __mmask16 m = 0;
  for (int i = 0; i < n; ++i) m |= _mm512_cmp_ps_mask(v[i], v[i], _CMP_UNORD_Q);
  return m != 0;
}

// A row's visible keys (indices from the first key) as the 32-bit lane bounds its masks compare against: key idx
// is visible iff idx < end and, with a window, idx > after. Clamped to [-1, S], where they mean the same, so a
// query 2^31 or more positions from k_start cannot wrap around (the key indices fit 32 bits: S < 2^31); cast
// unclamped, a query before k_start by 2^32 - 1 saw the first key
inline std::pair<int, int> lane_bounds(int64_t pos, int64_t k_start, int64_t window, int64_t S) {
  const int64_t end = std::clamp<int64_t>(pos - k_start + 1, 0, S);
  const int64_t after = window ? std::clamp<int64_t>(pos - window - k_start, -1, S) : -1;
  return {int(end), int(after)};
}

inline std::pair<int64_t, int64_t> seen_chunks(int64_t ws, int64_t we, int64_t qmin, int64_t qmax, int64_t k_start,
                                               int64_t window, int64_t chunk) {
  const int64_t last = std::min<int64_t>(we - 1, qmax - k_start);
  const int64_t first = std::max<int64_t>(ws, window ? qmin - window + 1 - k_start : 0);
  return {ws + (first - ws) / chunk * chunk, last};
}

// The AMX form of one window's items (CPUs with AMX-BF16, `amx_tiles.h`): the pair layouts above are the
// batch-reduce GEMM's pair-interleaved operands as they are (Kt: [d/2][keys][2], Vp: [keys/2][d][2]), so per
// chunk of KCA keys an item's R rows take one GEMM for their scores (q rows gathered once an item) and one
// for P·V into the rows' fp32 sums; the online softmax between them as in the pair kernel.
constexpr int64_t KCA = 128;   // keys per chunk: a [R, 128] score tile per GEMM

void amx_window(const FlashRows& st, const uint16_t* qd, const int64_t* qp, const uint32_t* kt, const uint32_t* vpairs,
                int64_t ws, int64_t we, int64_t Sw, int64_t k_start, int64_t window, float sc) {
  const int64_t nh = st.nh, d = st.ld, half = d / 2;
  at::parallel_for(0, st.items, 1, [&](int64_t w0, int64_t w1) {
    uint16_t* qrows = reinterpret_cast<uint16_t*>(scratch(0, st.Rmax * half + 16));   // [R][d] bf16
    float* scores = scratch(1, st.Rmax * KCA);                                          // [R][KCA]
    uint16_t* prob = reinterpret_cast<uint16_t*>(scratch(4, st.Rmax * KCA / 2 + 16));   // [R][KCA] bf16
    std::vector<int64_t> rpos(st.Rmax);
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t h = st.head(w), R = st.rows(w);
      float* acc = st.acc + w * st.Rmax * d;
      float* mx = st.mx + w * st.Rmax;
      float* sum = st.sum + w * st.Rmax;
      int64_t qmin = INT64_MAX, qmax = INT64_MIN;
      for (int64_t r = 0; r < R; ++r) {
        const int64_t t = st.token(w, r);
        rpos[r] = qp[t];
        qmin = std::min(qmin, rpos[r]);
        qmax = std::max(qmax, rpos[r]);
        std::copy(qd + (t * nh + st.q_head(w, r)) * d, qd + (t * nh + st.q_head(w, r)) * d + d, qrows + r * d);
      }
      const uint32_t* kth = kt + h * half * Sw;
      const uint32_t* vph = vpairs + h * (Sw / 2) * d;
      const auto [c_first, last] = seen_chunks(ws, we, qmin, qmax, k_start, window, KCA);
      for (int64_t c0 = c_first; c0 <= last; c0 += KCA) {
        const int64_t lc = c0 - ws;                                  // the chunk's column in the window
        at::native::cpublas::brgemm(R, KCA, d, d, Sw, KCA, false, reinterpret_cast<const at::BFloat16*>(qrows),
                                    reinterpret_cast<const at::BFloat16*>(kth + lc), scores, true);
        for (int64_t r = 0; r < R; ++r) {                            // online softmax, as the pair kernel's
          const auto [limit, after] = lane_bounds(rpos[r], k_start, window, we);
          __m512 sv[KCA / 16];
          __mmask16 vis[KCA / 16];
          __mmask16 any = 0;
          __m512 vmax = _mm512_set1_ps(-INFINITY);
          for (int v = 0; v < KCA / 16; ++v) {
            const __m512i idx = _mm512_add_epi32(_mm512_set1_epi32(int(c0 + 16 * v)), lane);
            __mmask16 m = _mm512_cmplt_epi32_mask(idx, _mm512_set1_epi32(limit));
            if (window) m &= _mm512_cmpgt_epi32_mask(idx, _mm512_set1_epi32(after));
            vis[v] = m;
            any |= m;
            sv[v] = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), m,
                                       _mm512_mul_ps(_mm512_loadu_ps(scores + r * KCA + 16 * v), _mm512_set1_ps(sc)));
            vmax = _mm512_max_ps(vmax, sv[v]);
          }
          uint16_t* prow = prob + r * KCA;
          const float cmax = _mm512_reduce_max_ps(vmax);
          if (!any || (cmax == -INFINITY && !scores_hold_nan(sv, KCA / 16))) {
            std::fill(prow, prow + KCA, uint16_t(0));
            continue;
          }
          const float mnew = std::max(mx[r], cmax);
          const float corr = mx[r] == -INFINITY ? 0.f : std::exp(mx[r] - mnew);
          const __m512 mv = _mm512_set1_ps(mnew);
          __m512 psum = _mm512_setzero_ps();
          for (int v = 0; v < KCA / 16; v += 2) {
            const __m512 p0 = _mm512_maskz_mov_ps(vis[v], vexp({_mm512_sub_ps(sv[v], mv)}).v);
            const __m512 p1 = _mm512_maskz_mov_ps(vis[v + 1], vexp({_mm512_sub_ps(sv[v + 1], mv)}).v);
            psum = _mm512_add_ps(psum, _mm512_add_ps(p0, p1));
            _mm512_storeu_si512(prow + 16 * v, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));   // keys in order
          }
          sum[r] = sum[r] * corr + _mm512_reduce_add_ps(psum);
          mx[r] = mnew;
          if (corr != 1.f) {
            float* a = acc + r * d;
            for (int64_t j = 0; j < d; j += 16) _mm512_storeu_ps(a + j, _mm512_mul_ps(_mm512_loadu_ps(a + j), _mm512_set1_ps(corr)));
          }
        }
        at::native::cpublas::brgemm(R, d, KCA, KCA, d, d, true, reinterpret_cast<const at::BFloat16*>(prob),
                                    reinterpret_cast<const at::BFloat16*>(vph + (lc / 2) * d), acc, true);
      }
    }
    at::native::cpublas::brgemm_release();
  });
}

at::Tensor prefill_attention_pairs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                   const at::Tensor& q_pos, int64_t k_start, const at::Tensor& sinks, double scale,
                                   int64_t window) {
  const int64_t T = q.size(0), nh = q.size(1), d = q.size(2), S = k.size(0), nkv = k.size(1);
  at::Tensor out = at::zeros({T, nh, d}, q.options());
  if (T == 0 || S == 0) return out;
  const int64_t half = d / 2, DV = d / 16;
  const uint16_t* kp = reinterpret_cast<const uint16_t*>(k.data_ptr());
  const uint16_t* vptr = reinterpret_cast<const uint16_t*>(v.data_ptr());
  const uint16_t* qd = reinterpret_cast<const uint16_t*>(q.data_ptr());
  const int64_t* qp = q_pos.data_ptr<int64_t>();
  at::Tensor sk = sinks.contiguous();
  // keys any query sees, in windows of KW: the pair layouts of one window at a time (scratch bounded by KW,
  // not by the context), every item's rows carried through them
  const auto [k_first, k_last] = seen_keys(qp, T, S, k_start, window, KC);
  if (k_last < k_first) {                                              // no query sees a key
    store_blind(out, FloatView(sk));
    return out;
  }
  const int64_t k_seen = first_seen_key(qp, T, k_start, window);       // keys before it: zeros in the layouts
  FlashRows st(T, nh, nkv, d, RG);                                     // every row's softmax state
  const float sc = float(scale);
  const int rp = DV <= 4 ? 4 : 2;
  const PvFn pv = PV[DV];
  const bool amx = amx_tiles_on();
  const int64_t chunk = amx ? KCA : KC;
  for (int64_t ws = k_first; ws <= k_last; ws += KW) {
    const int64_t we = std::min<int64_t>(std::min<int64_t>(S, k_last + 1), ws + KW);   // keys [ws, we)
    const int64_t Sw = (we - ws + chunk - 1) / chunk * chunk;         // padded to whole chunks (zeros)
    // Kt [nkv][half][Sw] and Vp [nkv][Sw / 2][d] 32-bit words of keys ws..
    uint32_t* kt = reinterpret_cast<uint32_t*>(shared_scratch(0, nkv * half * Sw));
    uint32_t* vpairs = reinterpret_cast<uint32_t*>(shared_scratch(1, nkv * (Sw / 2) * d));
    at::parallel_for(0, nkv * (Sw / 2), 16, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t h = i / (Sw / 2), j = i % (Sw / 2);             // local key pair j of kv head h
        for (int e = 0; e < 2; ++e) {
          const int64_t s = ws + 2 * j + e, col = 2 * j + e;
          if (s >= we || s < k_seen) {
            for (int64_t p = 0; p < half; ++p) kt[(h * half + p) * Sw + col] = 0;
            continue;
          }
          const uint16_t* row = kp + (s * nkv + h) * d;
          for (int64_t p = 0; p < half; ++p) kt[(h * half + p) * Sw + col] = bf16_pair_bits(row + 2 * p);
        }
        uint32_t* dst = vpairs + (h * (Sw / 2) + j) * d;
        const int64_t s0 = ws + 2 * j;
        const uint16_t* v0 = s0 < we && s0 >= k_seen ? vptr + (s0 * nkv + h) * d : nullptr;
        const uint16_t* v1 = s0 + 1 < we && s0 + 1 >= k_seen ? vptr + ((s0 + 1) * nkv + h) * d : nullptr;
        for (int64_t c = 0; c < d; ++c) dst[c] = uint32_t(v0 ? v0[c] : 0) | uint32_t(v1 ? v1[c] : 0) << 16;
      }
    });
    if (amx) {
      amx_window(st, qd, qp, kt, vpairs, ws, we, Sw, k_start, window, sc);
      continue;
    }

    at::parallel_for(0, st.items, 1, [&](int64_t w0, int64_t w1) {
      uint32_t* pb = reinterpret_cast<uint32_t*>(scratch(0, st.Rmax * KC / 2));   // [R][KC / 2] bf16 prob. pairs
      int64_t* rpos = reinterpret_cast<int64_t*>(scratch(1, 2 * st.Rmax));        // [R] row positions
      for (int64_t w = w0; w < w1; ++w) {
        const int64_t h = st.head(w), R = st.rows(w), Rp = (R + RG - 1) / RG * RG;
        float* acc = st.acc + w * st.Rmax * d;
        float* mx = st.mx + w * st.Rmax;
        float* sum = st.sum + w * st.Rmax;
        int64_t qmin = INT64_MAX, qmax = INT64_MIN;
        for (int64_t r = 0; r < Rp; ++r) {
          rpos[r] = qp[st.token(w, std::min(r, R - 1))];
          qmin = std::min(qmin, rpos[r]);
          qmax = std::max(qmax, rpos[r]);
        }
        const uint32_t* kth = kt + h * half * Sw;
        const uint32_t* vph = vpairs + h * (Sw / 2) * d;
        const auto [c_first, last] = seen_chunks(ws, we, qmin, qmax, k_start, window, KC);
        for (int64_t c0 = c_first; c0 <= last; c0 += KC) {
          const int64_t lc = c0 - ws;                                // the chunk's column in the window
          for (int64_t g = 0; g < Rp; g += RG) {
            int64_t gmin = INT64_MAX, gmax = INT64_MIN;
            for (int r = 0; r < RG; ++r) gmin = std::min(gmin, rpos[g + r]), gmax = std::max(gmax, rpos[g + r]);
            if (k_start + c0 > gmax || (window && k_start + c0 + KC - 1 <= gmin - window)) {
              for (int r = 0; r < RG; ++r) std::fill(pb + (g + r) * (KC / 2), pb + (g + r + 1) * (KC / 2), 0u);
              continue;                                              // no query of the group sees the chunk
            }
            // scores of RG rows × 32 keys: the query's dim pairs broadcast against 16 keys a vector
            // (the sums stay in registers through the loop, fully unrolled, and go to `sbuf` once after it: read
            // with a row index the softmax loop below picks at run time, they were stored every iteration)
            __m512 s[RG][2];
#pragma GCC unroll 16
            for (int r = 0; r < RG; ++r) s[r][0] = s[r][1] = _mm512_setzero_ps();
            const uint16_t* qrow[RG];
            for (int r = 0; r < RG; ++r) {
              const int64_t row = std::min<int64_t>(g + r, R - 1), t = st.token(w, row), hq = st.q_head(w, row);
              qrow[r] = qd + (t * nh + hq) * d;
            }
            for (int64_t p = 0; p < half; ++p) {
              const __m512i k0 = _mm512_loadu_si512(kth + p * Sw + lc), k1 = _mm512_loadu_si512(kth + p * Sw + lc + 16);
#pragma GCC unroll 16
              for (int r = 0; r < RG; ++r) {
                const __m512i qb = _mm512_set1_epi32(int(bf16_pair_bits(qrow[r] + 2 * p)));
                s[r][0] = _mm512_dpbf16_ps(s[r][0], (__m512bh)k0, (__m512bh)qb);
                s[r][1] = _mm512_dpbf16_ps(s[r][1], (__m512bh)k1, (__m512bh)qb);
              }
            }
            alignas(64) float sbuf[RG][KC];
#pragma GCC unroll 16
            for (int r = 0; r < RG; ++r) {
              _mm512_store_ps(sbuf[r], s[r][0]);
              _mm512_store_ps(sbuf[r] + 16, s[r][1]);
            }
            // online softmax per row; invisible keys (future, outside the window, padding) get probability 0
            const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
            for (int r = 0; r < RG; ++r) {
              const int64_t row = g + r;
              const auto [limit, after] = lane_bounds(rpos[row], k_start, window, we);
              __mmask16 vis[2];
              __m512 sr[2];
              for (int hlf = 0; hlf < 2; ++hlf) {
                const int64_t base = c0 + 16 * hlf;                  // key index of lane 0
                const __m512i idx = _mm512_add_epi32(_mm512_set1_epi32(int(base)), lane);
                __mmask16 m = _mm512_cmplt_epi32_mask(idx, _mm512_set1_epi32(limit));
                if (window) m &= _mm512_cmpgt_epi32_mask(idx, _mm512_set1_epi32(after));
                vis[hlf] = m;
                sr[hlf] = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), m, _mm512_mul_ps(_mm512_load_ps(sbuf[r] + 16 * hlf), _mm512_set1_ps(sc)));
              }
              uint32_t* prow = pb + row * (KC / 2);
              const float cmax = _mm512_reduce_max_ps(_mm512_max_ps(sr[0], sr[1]));
              if (!(vis[0] | vis[1]) || (cmax == -INFINITY && !scores_hold_nan(sr, 2))) {
                std::fill(prow, prow + KC / 2, 0u);
                continue;
              }
              const float mnew = std::max(mx[row], cmax);
              const float corr = mx[row] == -INFINITY ? 0.f : std::exp(mx[row] - mnew);
              const __m512 mv = _mm512_set1_ps(mnew);
              const __m512 p0 = _mm512_maskz_mov_ps(vis[0], vexp({_mm512_sub_ps(sr[0], mv)}).v);
              const __m512 p1 = _mm512_maskz_mov_ps(vis[1], vexp({_mm512_sub_ps(sr[1], mv)}).v);
              sum[row] = sum[row] * corr + _mm512_reduce_add_ps(_mm512_add_ps(p0, p1));
              mx[row] = mnew;
              if (corr != 1.f) {
                float* a = acc + row * d;
                for (int64_t j = 0; j < d; j += 16) _mm512_storeu_ps(a + j, _mm512_mul_ps(_mm512_loadu_ps(a + j), _mm512_set1_ps(corr)));
              }
              // 32 probabilities -> 16 bf16 pairs (keys 2i, 2i+1): the pair order of Vp
              const __m512i pairs = (__m512i)_mm512_cvtne2ps_pbh(p1, p0);
              _mm512_storeu_si512(prow, pairs);
            }
            for (int64_t r = g; r < g + RG; r += rp)
              pv(pb + r * (KC / 2), KC / 2, vph + (lc / 2) * d, d, KC / 2, acc + r * d, d);
          }
        }
      }
    });
  }

  st.store(out, FloatView(sk));
  return out;
}

}  // namespace
#endif

// whether this build runs the kernel for head dim d (every build, every head dim; the Python side asks)
bool prefill_attention_supported(int64_t d) { return d >= 1; }

at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& q_pos,
                             int64_t k_start, const at::Tensor& sinks, double scale, int64_t window) {
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 &&
              v.scalar_type() == at::kBFloat16, "prefill_attention: q, k, v must be bfloat16");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes() && q.size(2) == k.size(2),
              "prefill_attention: q [T, nh, d], k and v [S, nkv, d] (got ", q.sizes(), ", ", k.sizes(), ")");
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous(), "prefill_attention: contiguous inputs");
  const int64_t T = q.size(0), nh = q.size(1), d = q.size(2), S = k.size(0), nkv = k.size(1);
  TORCH_CHECK(nkv > 0 && nh % nkv == 0, "prefill_attention: ", nh, " q heads over ", nkv, " kv heads");
  TORCH_CHECK(prefill_attention_supported(d), "prefill_attention: head dim ", d, " (must be >= 1)");
  TORCH_CHECK(q_pos.scalar_type() == at::kLong && q_pos.numel() == T && q_pos.is_contiguous(), "q_pos must be int64 [T]");
  TORCH_CHECK(sinks.numel() == nh, "sinks must have one value per q head");
  TORCH_CHECK(window >= 0, "window must be >= 0");
  TORCH_CHECK(S < (int64_t(1) << 31), "prefill_attention: key indices must fit 32 bits");
  // A window that reaches past the first key for every query excludes nothing: run it as no window. (The pair
  // kernel's masks take the window's bound as a 32-bit lane value: a window of 2^32 or more, longer than any
  // context, wrapped around and hid the keys it should show.)
  if (window > 0 && T > 0 && *std::max_element(q_pos.data_ptr<int64_t>(), q_pos.data_ptr<int64_t>() + T) - window < k_start)
    window = 0;
#ifdef GD_BF16DOT
  if (pair_kernel_takes(d)) return prefill_attention_pairs(q, k, v, q_pos, k_start, sinks, scale, window);
#endif
  return prefill_attention_f32(q, k, v, q_pos, k_start, sinks, scale, window);
}

}  // namespace gd
