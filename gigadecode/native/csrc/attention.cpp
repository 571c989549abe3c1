// Decode attention over the paged KV, read in place (the KV write and the other small pieces around it are
// in rope_norm.cpp).
//
// KV layouts (one buffer half): plain [nb, kv, B, d] (fp32 / bf16 / fp8), packed-FP8 K [nb, kv, B/2, d, 2]
// (element [b, h, p, j, s] = token 2p+s, dim j). FP8 is e4m3 with a per-tensor scale (stored = x / scale).
// Attention for slot b reads the blocks of its table row that hold frame positions [lo, pos] (lo = pos-W+1
// on sliding layers, 0 on full ones; the partial op's lo = first) with an online softmax; the work is split
// over slots (each item all of a slot's kv heads, which share its blocks) or, with fewer slots than twice the
// threads, over (slot, kv head) and, when that leaves threads idle on a long context, over block ranges merged
// by their log-sum-exp. The sink joins the softmax denominator at the merge:
// out = Σ_s o_s e^{m_s-M} / (Σ_s l_s e^{m_s-M} + e^{sink-M}). Without a sink (the partial op, for decode
// context parallelism) the merge also gives lse = M + log Σ_s l_s e^{m_s-M}, so ranks holding disjoint
// parts of a sequence merge their partials exactly, adding the sink once.
#include "common.h"
#include "decode_span.h"
#include "kv_layout.h"

namespace gd {

namespace {

// FP8 KV read through fp16 (`vload4_fp8_div256`: integer shifts, then vcvtph2ps): every CPU of every build
namespace fp8_via_fp16 {
inline void load_fp8x4(const uint8_t* p, VF v[4]) { vload4_fp8_div256(p, v); }
#include "attend_range_f32.h"
}  // namespace fp8_via_fp16

#ifdef GD_FP8_TABLE_READS
// FP8 KV read by byte table (AVX512-VBMI's vpermb / vpermt2b), for CPUs that have it (`fp8_table_reads`): the
// bf16 of each magnitude code's value / 256, exact (e4m3's 3-bit significand fits bf16's 7 bits; its subnormals
// are bf16 normals), split into a high and a low byte table of 128 entries; NaN codes give NaN. 64 values in 10
// vector instructions (5 of them shuffles) against the fp16 path's ~20 (8 of its two-µop converts): on AVX-512
// only ports 0 and 5 run vector work, so every instruction saved there is an FMA's slot.
struct Fp8Bf16Table {
  alignas(64) uint8_t hi[128];
  alignas(64) uint8_t lo[128];
  alignas(64) uint8_t order[64];   // the byte permute that makes the in-lane unpacks below yield values in order
};
Fp8Bf16Table make_fp8_bf16_table() {
  Fp8Bf16Table t;
  for (int m = 0; m < 128; ++m) {
    const float v = fp8_to_f32(uint8_t(m)) * (1.f / 256.f);
    uint32_t u;
    std::memcpy(&u, &v, 4);
    t.hi[m] = uint8_t(u >> 24);
    t.lo[m] = uint8_t(u >> 16);
  }
  // unpacking (lo, hi) bytes makes word 8L + k of w0 from byte 16L + k and of w1 from byte 16L + 8 + k (128-bit
  // lane L); a dword's even word (shifted up) is value j of v[0] / v[2], its odd word value j of v[1] / v[3]
  for (int L = 0; L < 4; ++L)
    for (int k = 0; k < 8; ++k) {
      const int u = 8 * L + k;
      t.order[16 * L + k] = uint8_t(u % 2 == 0 ? u / 2 : 16 + u / 2);
      t.order[16 * L + 8 + k] = uint8_t(u % 2 == 0 ? 32 + u / 2 : 48 + u / 2);
    }
  return t;
}
const Fp8Bf16Table fp8_bf16 = make_fp8_bf16_table();

#pragma GCC push_options
#pragma GCC target("avx512vbmi")
namespace fp8_by_table {
inline void fp8x4_reg(__m512i raw, VF v[4]) {
  const __m512i x = _mm512_permutexvar_epi8(_mm512_load_si512(fp8_bf16.order), raw);
  const __m512i hi = _mm512_ternarylogic_epi32(   // the table's high byte | the code's sign
      _mm512_permutex2var_epi8(_mm512_load_si512(fp8_bf16.hi), x, _mm512_load_si512(fp8_bf16.hi + 64)), x,
      _mm512_set1_epi8(char(0x80)), 0xF8);
  const __m512i lo =
      _mm512_permutex2var_epi8(_mm512_load_si512(fp8_bf16.lo), x, _mm512_load_si512(fp8_bf16.lo + 64));
  const __m512i w0 = _mm512_unpacklo_epi8(lo, hi), w1 = _mm512_unpackhi_epi8(lo, hi);   // bf16 words
  const __m512i top = _mm512_set1_epi32(int(0xFFFF0000u));
  v[0].v = _mm512_castsi512_ps(_mm512_slli_epi32(w0, 16));
  v[1].v = _mm512_castsi512_ps(_mm512_and_si512(w0, top));
  v[2].v = _mm512_castsi512_ps(_mm512_slli_epi32(w1, 16));
  v[3].v = _mm512_castsi512_ps(_mm512_and_si512(w1, top));
}
inline void load_fp8x4(const uint8_t* p, VF v[4]) { fp8x4_reg(_mm512_loadu_si512(p), v); }
#include "scores_transposed.h"
#define GD_TRANSPOSED_SCORES 1
#include "attend_range_f32.h"
#undef GD_TRANSPOSED_SCORES
}  // namespace fp8_by_table
#pragma GCC pop_options
#endif

// The fp32 form of one item, with FP8 KV read as `fp8_table_reads` says
template <typename KT, typename VT>
void attend_range(const AttnShape& s, const float* q, const KT* K, const VT* V, const int64_t* table, int64_t lo,
                  int64_t pos, int64_t jb0, int64_t jb1, int64_t b, int64_t h0, int64_t h1, float qmul, float* part,
                  int64_t stride) {
#ifdef GD_FP8_TABLE_READS
  if constexpr (std::is_same_v<KT, uint8_t> || std::is_same_v<VT, uint8_t>) {
    if (fp8_table_reads()) {
      fp8_by_table::attend_range(s, q, K, V, table, lo, pos, jb0, jb1, b, h0, h1, qmul, part, stride);
      return;
    }
  }
#endif
  fp8_via_fp16::attend_range(s, q, K, V, table, lo, pos, jb0, jb1, b, h0, h1, qmul, part, stride);
}

// Whether any of n partial sums (stride floats apart) is NaN
inline bool any_nan_sum(const float* l, int64_t n, int64_t stride) {
  for (int64_t i = 0; i < n; ++i)
    if (l[i * stride] != l[i * stride]) return true;
  return false;
}

// Slot b attends to frame positions [lo[b], pos[b]] (lo >= 0; pos < lo: nothing) when active[b]. out
// [Bt, nh·d] (fp32 or bf16); sinks: one per q head, or null for none; lse [Bt, nh] (or null): the merged
// log-sum-exp of the scaled scores (with the sink's term when there is one), -inf where nothing is visible.
template <typename KT, typename VT>
void attention_impl(const AttnShape& s, const float* q, const KT* K, const VT* V, const int64_t* table,
                    const int64_t* lo, const int64_t* pos, const bool* active, const FloatView* sinks, float qmul,
                    float vmul, at::Tensor& out, float* lse) {
  const int64_t base = s.Bt * s.kv, nthreads = at::get_num_threads();
  int64_t max_blocks = 1;                             // the most blocks one slot reads
  for (int64_t b = 0; b < s.Bt; ++b)
    if (active[b] && pos[b] >= lo[b]) max_blocks = std::max(max_blocks, pos[b] / s.B - lo[b] / s.B + 1);
  // items: (slot, G kv heads, block range): every head of a slot in one item where the slots alone keep the
  // threads busy (a block's heads read together), else one head an item and, where that still leaves threads
  // idle on a long context, S block ranges a head
  const int64_t G = s.Bt >= 2 * nthreads ? s.kv : 1, groups = s.Bt * (s.kv / G);
  int64_t S = 1;
  if (groups < 2 * nthreads && max_blocks >= 8) S = std::max<int64_t>(1, std::min((2 * nthreads + groups - 1) / groups, max_blocks / 4));
  const int64_t stride = s.rep * (s.d + 2);
  float* part = shared_scratch(0, base * S * stride);   // [Bt][kv][S] partials
  // FP8 KV on AMX tiles where the CPU has them (attention_tiles.cpp)
  const bool tiles = std::is_same_v<KT, uint8_t> && std::is_same_v<VT, uint8_t> && decode_tiles_take(s);
  at::parallel_for(0, groups * S, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / (S * (s.kv / G)), h0 = (i / S) % (s.kv / G) * G, sp = i % S;
      float* pr = part + ((b * s.kv + h0) * S + sp) * stride;   // head h's at pr + (h - h0) * S * stride
      const int64_t p = pos[b], l0 = lo[b];
      const int64_t jb0 = l0 / s.B, jb1 = p / s.B, nb = jb1 - jb0 + 1;
      const int64_t a = jb0 + nb * sp / S, e = jb0 + nb * (sp + 1) / S - 1;
      if (!active[b] || p < l0 || e < a) {
        for (int64_t h = 0; h < G; ++h)
          for (int64_t r = 0; r < s.rep; ++r) {
            pr[h * S * stride + r * (s.d + 2) + s.d] = -INFINITY;
            pr[h * S * stride + r * (s.d + 2) + s.d + 1] = 0.f;
          }
        continue;
      }
      if constexpr (std::is_same_v<KT, uint8_t> && std::is_same_v<VT, uint8_t>) {
        if (tiles) {
          attend_range_tiles(s, q, K, V, table, l0, p, a, e, b, h0, h0 + G, qmul, pr, S * stride);
          continue;
        }
      }
      attend_range<KT, VT>(s, q, K, V, table, l0, p, a, e, b, h0, h0 + G, qmul, pr, S * stride);
    }
  });
  // merge the block ranges (with the sink when there is one)
  at::parallel_for(0, base, 1, [&](int64_t i0, int64_t i1) {
    float* row = scratch(2, s.d);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / s.kv, h = i % s.kv;
      for (int64_t r = 0; r < s.rep; ++r) {
        const int64_t qh = h * s.rep + r;
        std::fill(row, row + s.d, 0.f);
        float ls = -INFINITY;
        if (active[b]) {
          const float sink = sinks ? (*sinks)[qh] : -INFINITY;
          float M = sink;
          for (int64_t sp = 0; sp < S; ++sp) M = std::max(M, part[(i * S + sp) * stride + r * (s.d + 2) + s.d]);
          if (M > -INFINITY) {                        // else no sink and nothing visible: 0, lse -inf
            float L = sinks ? std::exp(sink - M) : 0.f;
            for (int64_t sp = 0; sp < S; ++sp) {
              const float* pr = part + (i * S + sp) * stride + r * (s.d + 2);
              if (pr[s.d + 1] == 0.f) continue;
              const float f = std::exp(pr[s.d] - M);
              L += pr[s.d + 1] * f;
              for (int64_t j = 0; j < s.d; ++j) row[j] += pr[j] * f;
            }
            const float inv = vmul / L;
            for (int64_t j = 0; j < s.d; ++j) row[j] *= inv;
            ls = M + std::log(L);
          } else if (sinks || M != M || any_nan_sum(part + i * S * stride + r * (s.d + 2) + s.d + 1, S, stride)) {
            // a NaN sink, a sink of -inf with no score above it (the twin's softmax: -inf - -inf), or visible
            // scores that were all NaN (the maxima drop a NaN, so such a range reads m = -inf as if it saw
            // nothing; its sum is NaN): NaN, as the twin, not "nothing visible" (the partial op's, no sink)
            std::fill(row, row + s.d, NAN);
            ls = NAN;
          }
        }
        store_row(row, out, (b * s.nh + qh) * s.d, s.d);
        if (lse) lse[b * s.nh + qh] = ls;
      }
    }
  });
}

template <typename F>
void dispatch_kv(const at::Tensor& k, const at::Tensor& v, F&& f) {
  auto with_v = [&](auto kp) {
    switch (elem_of(v)) {
      case Elem::F32: f(kp, static_cast<const float*>(v.data_ptr())); break;
      case Elem::BF16: f(kp, static_cast<const uint16_t*>(v.data_ptr())); break;
      default: f(kp, static_cast<const uint8_t*>(v.data_ptr()));
    }
  };
  switch (elem_of(k)) {
    case Elem::F32: with_v(static_cast<const float*>(k.data_ptr())); break;
    case Elem::BF16: with_v(static_cast<const uint16_t*>(k.data_ptr())); break;
    default: with_v(static_cast<const uint8_t*>(k.data_ptr()));
  }
}

// The checks both attention ops share; returns the shape (window / lower bounds are the caller's).
AttnShape attention_args(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                         const at::Tensor& table, const at::Tensor& pos, const at::Tensor& active) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && q.dim() == 3 && q.is_contiguous(), "q must be float32 [Bt, nh, d]");
  const auto [nb, kv, B, d] = kv_dims(k_cache, v_cache);
  const int64_t Bt = q.size(0), nh = q.size(1);
  TORCH_CHECK(q.size(2) == d && nh % kv == 0, "q ", q.sizes(), " does not fit KV heads ", kv, " × dim ", d);
  TORCH_CHECK(table.scalar_type() == at::kLong && table.dim() == 2 && table.size(0) == Bt && table.is_contiguous(),
              "table must be int64 [Bt, n]");
  TORCH_CHECK(pos.scalar_type() == at::kLong && pos.numel() == Bt && active.scalar_type() == at::kBool &&
              active.numel() == Bt && pos.is_contiguous() && active.is_contiguous(),
              "pos (int64) and active (bool) must be [Bt], contiguous");
  return AttnShape{Bt, nh, kv, nh / kv, d, B, table.size(1), k_cache.dim() == 5};
}

// Slot b reads frame positions [lo, pos] of its table row: they must lie in the table, their blocks in (0, nb).
void check_blocks(const AttnShape& s, int64_t nb, const int64_t* tb, int64_t b, int64_t lo, int64_t pos) {
  TORCH_CHECK(pos >= 0 && pos / s.B < s.n_table, "slot ", b, ": position ", pos, " past its table");
  for (int64_t j = lo / s.B; j <= pos / s.B; ++j)
    TORCH_CHECK(tb[b * s.n_table + j] > 0 && tb[b * s.n_table + j] < nb, "slot ", b, ": block id ",
                tb[b * s.n_table + j], " out of range");
}

// Per-slot lower bounds, reused across calls (a decode step allocates nothing once warm).
int64_t* lower_bounds(int64_t Bt) {
  thread_local std::vector<int64_t> lo;
  if (int64_t(lo.size()) < Bt) lo.resize(Bt);
  return lo.data();
}

// attention_impl for the KV buffers' element types, FP8 scales folded into the q and V multipliers
void run_attention(const AttnShape& s, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                   const int64_t* table, const int64_t* lo, const int64_t* pos, const bool* active,
                   const FloatView* sinks, double scale, double k_scale, double v_scale, at::Tensor& out,
                   float* lse) {
  dispatch_kv(k_cache, v_cache, [&](auto kp, auto vp) {
    using KT = std::remove_cv_t<std::remove_pointer_t<decltype(kp)>>;
    using VT = std::remove_cv_t<std::remove_pointer_t<decltype(vp)>>;
    attention_impl<KT, VT>(s, q.data_ptr<float>(), kp, vp, table, lo, pos, active, sinks,
                           float(scale) * kv_multiplier<KT>(k_scale), kv_multiplier<VT>(v_scale), out, lse);
  });
}

}  // namespace

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& table, const at::Tensor& pos, const at::Tensor& active,
                                  const at::Tensor& sinks, int64_t window, double scale, double k_scale,
                                  double v_scale, at::ScalarType out_dtype) {
  const AttnShape s = attention_args(q, k_cache, v_cache, table, pos, active);
  TORCH_CHECK(sinks.numel() == s.nh, "sinks must have one value per q head");
  TORCH_CHECK(window >= 0, "window must be >= 0");
  TORCH_CHECK(out_dtype == at::kFloat || out_dtype == at::kBFloat16, "out_dtype must be float32 or bfloat16");
  const int64_t* tb = table.data_ptr<int64_t>();
  const int64_t* ps = pos.data_ptr<int64_t>();
  const bool* ac = active.data_ptr<bool>();
  int64_t* lo = lower_bounds(s.Bt);
  for (int64_t b = 0; b < s.Bt; ++b) {
    lo[b] = 0;
    if (!ac[b]) continue;
    if (window) lo[b] = std::max<int64_t>(0, ps[b] - window + 1);
    check_blocks(s, v_cache.size(0), tb, b, lo[b], ps[b]);
  }
  at::Tensor sk = sinks.contiguous();
  const FloatView sv(sk);
  at::Tensor out = at::empty({s.Bt, s.nh * s.d}, q.options().dtype(out_dtype));
  run_attention(s, q, k_cache, v_cache, tb, lo, ps, ac, &sv, scale, k_scale, v_scale, out, nullptr);
  return out;
}

// Decode context parallelism: slot b attends to frame positions [first, pos] only, without the sink.
// -> (out [Bt, nh, d] fp32 normalized over those keys, lse [Bt, nh] fp32 their log-sum-exp; 0 / -inf where
// nothing is visible: inactive, pos < 0 or first > pos).
std::tuple<at::Tensor, at::Tensor> paged_decode_attention_partial(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& table,
    const at::Tensor& pos, const at::Tensor& first, const at::Tensor& active, double scale, double k_scale,
    double v_scale) {
  const AttnShape s = attention_args(q, k_cache, v_cache, table, pos, active);
  TORCH_CHECK(first.scalar_type() == at::kLong && first.numel() == s.Bt && first.is_contiguous(),
              "first must be int64 [Bt]");
  const int64_t* tb = table.data_ptr<int64_t>();
  const int64_t* ps = pos.data_ptr<int64_t>();
  const int64_t* fs = first.data_ptr<int64_t>();
  const bool* ac = active.data_ptr<bool>();
  int64_t* lo = lower_bounds(s.Bt);
  for (int64_t b = 0; b < s.Bt; ++b) {
    lo[b] = std::max<int64_t>(0, fs[b]);
    if (ac[b] && ps[b] >= lo[b]) check_blocks(s, v_cache.size(0), tb, b, lo[b], ps[b]);
  }
  at::Tensor out = at::empty({s.Bt, s.nh, s.d}, q.options());
  at::Tensor lse = at::empty({s.Bt, s.nh}, q.options());
  run_attention(s, q, k_cache, v_cache, tb, lo, ps, ac, nullptr, scale, k_scale, v_scale, out,
                lse.data_ptr<float>());
  return {out, lse};
}

}  // namespace gd
