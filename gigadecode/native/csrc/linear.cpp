// Dense projections at small batch (qkv, o, router, lm_head): y [M, N] = x [M, K] · W [N, K]^T + b.
// Memory-bound: each weight row streams once per call for all M inputs (register tiles of RT rows × TT
// inputs, fp32 accumulation, bf16 or fp32 weights), prefetched LINEAR_PREFETCH_LEAD bytes ahead as it is
// read; from a few inputs on, compute-bound, where bf16 rows meet the inputs in the fastest form of their
// products this build and CPU have (`pair_tiles`). Many rows (prefill) go to `gemm.linear` instead (Python
// side: oneDNN's bf16 GEMM, or MKL's fp32 one where that is faster).
#include <array>
#include <utility>
#include <vector>

#include "amx_tiles.h"
#include "bf16dot.h"
#include "common.h"
#include "mxfp4_avx2.h"

namespace gd {

namespace {

constexpr int RT_MAX = 4;
constexpr int TT_MAX = W == 16 ? 4 : 2;

template <typename WT>
inline VF wload(const WT* p) {
  if constexpr (std::is_same_v<WT, float>) return vload(p);
  else return vload_bf16(p);
}
template <typename WT>
inline float wscalar(const WT* p) {
  if constexpr (std::is_same_v<WT, float>) return *p;
  else return bf16_to_f32(*p);
}

template <typename WT>
struct DenseTile {
template <int RT, int TT>
struct Tile {
static void run(const WT* w, int64_t K, const float* x, int64_t ldx, float* out, int64_t ldo, int64_t lead) {
  VF acc[RT][TT];
#pragma GCC unroll 16
  for (int r = 0; r < RT; ++r)
#pragma GCC unroll 16
    for (int t = 0; t < TT; ++t) acc[r][t] = vzero();
  const int64_t Kv = K / W * W;
  for (int64_t k = 0; k < Kv; k += W) {
    VF xv[TT];
#pragma GCC unroll 16
    for (int t = 0; t < TT; ++t) xv[t] = vload(x + t * ldx + k);
#pragma GCC unroll 16
    for (int r = 0; r < RT; ++r) {
      const VF wv = wload(w + r * K + k);
      if (lead && (k * int64_t(sizeof(WT))) % 64 == 0) prefetch_l2(w + r * K + k, lead);   // once per line
#pragma GCC unroll 16
      for (int t = 0; t < TT; ++t) acc[r][t] = vfma(wv, xv[t], acc[r][t]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < RT; ++r)
#pragma GCC unroll 16
    for (int t = 0; t < TT; ++t) {
      float s = vsum(acc[r][t]);
      for (int64_t k = Kv; k < K; ++k) s += wscalar(w + r * K + k) * x[t * ldx + k];
      out[t * ldo + r] = s;
    }
}
};
};

// bf16 weight rows x fp32 inputs in fp32 FMAs, the rows converted in registers: every 2W bf16 values of a row
// split into their even and odd elements (`vload_bf16_pairs`), against inputs deinterleaved alike per 2W values
// (`arrange_pairs`; a row's last K % 2W values stay in order, multiplied one by one)
template <int RT, int TT>
struct PairTile {
static void run(const uint16_t* w, int64_t K, const float* x, int64_t ldx, float* out, int64_t ldo, int64_t lead) {
  VF acc[RT][TT];
#pragma GCC unroll 16
  for (int r = 0; r < RT; ++r)
#pragma GCC unroll 16
    for (int t = 0; t < TT; ++t) acc[r][t] = vzero();
  const int64_t Kp = K / (2 * W) * (2 * W);
  for (int64_t k = 0; k < Kp; k += 2 * W) {
    VF xe[TT], xo[TT];
#pragma GCC unroll 16
    for (int t = 0; t < TT; ++t) {
      xe[t] = vload(x + t * ldx + k);
      xo[t] = vload(x + t * ldx + k + W);
    }
#pragma GCC unroll 16
    for (int r = 0; r < RT; ++r) {
      VF we, wo;
      vload_bf16_pairs(w + r * K + k, we, wo);
      if (lead && (k * 2) % 64 == 0) prefetch_l2(w + r * K + k, lead);   // once per line
#pragma GCC unroll 16
      for (int t = 0; t < TT; ++t) {
        acc[r][t] = vfma(we, xe[t], acc[r][t]);
        acc[r][t] = vfma(wo, xo[t], acc[r][t]);
      }
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < RT; ++r)
#pragma GCC unroll 16
    for (int t = 0; t < TT; ++t) {
      float s = vsum(acc[r][t]);
      for (int64_t k = Kp; k < K; ++k) s += bf16_to_f32(w[r * K + k]) * x[t * ldx + k];
      out[t * ldo + r] = s;
    }
}
};

// x [M, K] (float or bf16) -> fp32 rows `ld` apart in PairTile's order: per 2W values the even elements, then
// the odd ones; the last K % 2W in order
float* arrange_pairs(const at::Tensor& x, int64_t M, int64_t K, int64_t ld) {
  float* out = shared_scratch(1, M * ld);
  const int64_t Kp = K / (2 * W) * (2 * W);
  const bool f32 = x.scalar_type() == at::kFloat;
  for (int64_t t = 0; t < M; ++t) {
    float* o = out + t * ld;
    if (f32) {
      const float* p = x.data_ptr<float>() + t * K;
      for (int64_t k = 0; k < Kp; k += 2 * W) {
        VF e, d;
        vdeinterleave(vload(p + k), vload(p + k + W), e, d);
        vstore(o + k, e);
        vstore(o + k + W, d);
      }
      for (int64_t k = Kp; k < K; ++k) o[k] = p[k];
    } else {
      const uint16_t* p = reinterpret_cast<const uint16_t*>(x.data_ptr()) + t * K;
      for (int64_t k = 0; k < Kp; k += 2 * W) {
        VF e, d;
        vload_bf16_pairs(p + k, e, d);
        vstore(o + k, e);
        vstore(o + k + W, d);
      }
      for (int64_t k = Kp; k < K; ++k) o[k] = bf16_to_f32(p[k]);
    }
  }
  return out;
}

template <typename WT, typename XT>
using DenseFn = void (*)(const WT*, int64_t, const XT*, int64_t, float*, int64_t, int64_t);

// y [M, N] = x [M, K] · w [N, K]^T: strips of 16 rows over the threads; `tile(rt, tt, r, t, lead)` computes
// the register tile of rt rows from row r and tt inputs from input t, prefetching `lead` bytes ahead (only
// the first tile of inputs streams the rows from memory; the others find them in cache)
template <typename TileCall>
void dense_rows(int64_t N, int64_t M, const TileCall& tile, int rt_max = RT_MAX, int tt_max = TT_MAX) {
  const int64_t strip = 16, strips = (N + strip - 1) / strip;
  at::parallel_for(0, strips, 1, [&](int64_t s0, int64_t s1) {
    for (int64_t s = s0; s < s1; ++s) {
      const int64_t r1 = std::min(N, (s + 1) * strip);
      for (int64_t r = s * strip; r < r1; r += rt_max) {
        const int rt = int(std::min<int64_t>(rt_max, r1 - r));
        for (int64_t t = 0; t < M; t += tt_max)
          tile(rt, int(std::min<int64_t>(tt_max, M - t)), r, t, t == 0 ? LINEAR_PREFETCH_LEAD : 0);
      }
    }
  });
}

const auto TILES_F32 = make_tiles<DenseFn<float, float>, DenseTile<float>::Tile, RT_MAX, TT_MAX>();
const auto TILES_PAIRS = make_tiles<DenseFn<uint16_t, float>, PairTile, RT_MAX, TT_MAX>();
const auto TILES_BF16W = make_tiles<DenseFn<uint16_t, float>, DenseTile<uint16_t>::Tile, RT_MAX, TT_MAX>();
// AVX2 (16 registers), three or more inputs: 2 rows x 4 inputs (8 accumulators), each row converted once
// for four inputs instead of twice for 2 x 2
constexpr int RT_WIDE = 2, TT_WIDE = 4;
const auto TILES_BF16W_WIDE = make_tiles<DenseFn<uint16_t, float>, DenseTile<uint16_t>::Tile, RT_WIDE, TT_WIDE>();

#ifdef GD_BF16DOT
// bf16 weights × bf16 inputs: 32 exact products per instruction, fp32 sums
const auto TILES_BF16 = make_tiles<DotFnBf16, DotTileBf16, RT_MAX, TT_MAX>();
#endif

// From how many inputs a bf16 weight takes the pair tiles (AVX-512 builds): there the tiles are compute-bound,
// and converting the rows by shift and mask in registers beats converting each vector with a shuffle
// (`DenseTile`: 1.05-1.2x at 4-32 inputs, AVX-512 build, Intel Xeon) or vdpbf16ps where the CPU's FMAs
// multiply faster (`bf16_products()`; 1.2-1.4x on `small`'s qkv, o and lm_head, 1.0-1.35x on a 20b-shape qkv
// and o: the same exact products, other sums). One input (or two) reads the bf16 bytes faster as they are.
constexpr int64_t PAIR_MIN_INPUTS = 4;
bool pair_tiles(bool bf16_inputs, int64_t M) {
  if (W != 16 || M < PAIR_MIN_INPUTS) return false;   // AVX2 keeps the tiles and strips measured on a Zen 3
#ifdef GD_BF16DOT
  return !bf16_inputs || bf16_products() == PRODUCTS_F32;
#else
  return true;
#endif
}

#ifdef GD_X64_DECODE
// AVX2, bf16 weights, at least LINEAR_STRIP_MIN_ROWS inputs: each strip of 16 weight rows is converted to fp32
// once into a per-thread buffer and multiplied in the MoE strip path's dense fp32 tiles (`dot_rows_f32`),
// instead of converting every row again for each tile of inputs (1.1-1.3x the 2 x 4 tiles at 48-96 rows on a
// Zen 3, the op alone; even at 40, slower below)
constexpr int64_t LINEAR_STRIP_MIN_ROWS = 40;

// y [M, N] = x [M, K] · w [N, K]^T for bf16 w: the rows' and the inputs' fp32 copies padded to whole vectors
void linear_strips_bf16(const uint16_t* w, int64_t N, int64_t K, const float* x, int64_t M, float* y) {
  const int64_t K8 = (K + 7) / 8 * 8, strip = 16;
  const float* xs = x;
  if (K8 != K) {                                      // zero-padded inputs (the padded weights are zero too)
    float* xp = shared_scratch(1, M * K8);
    for (int64_t t = 0; t < M; ++t) {
      std::copy(x + t * K, x + t * K + K, xp + t * K8);
      std::fill(xp + t * K8 + K, xp + t * K8 + K8, 0.f);
    }
    xs = xp;
  }
  std::vector<const float*> xr(M);
  for (int64_t t = 0; t < M; ++t) xr[t] = xs + t * K8;
  at::parallel_for(0, (N + strip - 1) / strip, 1, [&](int64_t s0, int64_t s1) {
    float* wf = scratch(2, strip * K8);
    for (int64_t s = s0; s < s1; ++s) {
      const int64_t r0 = s * strip, nr = std::min(strip, N - r0);
      for (int64_t r = 0; r < nr; ++r) {
        bf16_to_f32_row(w + (r0 + r) * K, K, wf + r * K8);
        std::fill(wf + r * K8 + K, wf + r * K8 + K8, 0.f);
      }
      dot_rows_f32(wf, K8, K8, nr, xr.data(), M, y + r0, N);
    }
  });
}
#endif

#ifdef GD_BF16DOT
// bf16 weights x bf16 inputs on AMX tiles (`amx_tiles.h`), from this many inputs (an Intel Xeon with AMX,
// 2 threads, against the fp32 pair tiles, medians of alternated calls: `small`'s lm_head [32000, 1024] at 4 / 5
// / 8 / 16 inputs 0.89 / 1.26 / 1.44 / 2.59x, its qkv [1536, 1024] 1.58 / 2.01 / 2.48 / 3.66x, 20b-shape
// projections ([5120, 2880], [2880, 4096], [8192, 2880]) 1.05-1.11 / 1.40-1.45 / 1.69-1.78 / 2.31-2.93x; 2-3
// inputs 0.87-1.48x). The weight's rows are the GEMM's first operand as they are (strips of AMX_STRIP rows),
// the inputs its pair-interleaved second (laid out once a call); fp32 sums: y [M, N].
constexpr int64_t LINEAR_AMX_MIN_ROWS = 5;
void linear_amx(const uint16_t* w, int64_t N, int64_t K, const uint16_t* x, int64_t M, float* y) {
  uint16_t* xv = reinterpret_cast<uint16_t*>(shared_scratch(8, M * K / 2 + 16));
  for (int64_t t = 0; t < M; ++t) put_vnni(x + t * K, K, t, M, xv);
  at::parallel_for(0, (N + AMX_STRIP - 1) / AMX_STRIP, 1, [&](int64_t s0, int64_t s1) {
    for (int64_t s = s0; s < s1; ++s) {
      const int64_t r0 = s * AMX_STRIP;
      rows_times_inputs_amx(w + r0 * K, std::min(AMX_STRIP, N - r0), K, xv, M, y + r0, N);
    }
    at::native::cpublas::brgemm_release();
  });
}
#endif

}  // namespace

at::Tensor linear_small(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  check_float_like(x, "x");
  check_float_like(w, "weight");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "linear: x ", x.sizes(), " vs weight ", w.sizes());
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0) return out;
  float* y = x.scalar_type() == at::kFloat ? out.data_ptr<float>() : shared_scratch(0, M * N);
#ifdef GD_BF16DOT
  if (x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16 && K % 2 == 0 &&
      M >= LINEAR_AMX_MIN_ROWS && amx_tiles_on()) {
    linear_amx(reinterpret_cast<const uint16_t*>(w.data_ptr()), N, K, reinterpret_cast<const uint16_t*>(x.data_ptr()),
               M, y);
  } else
#endif
  if (w.scalar_type() == at::kBFloat16 && pair_tiles(x.scalar_type() == at::kBFloat16, M)) {
    const int64_t ld = (K + W - 1) / W * W + W;   // one vector past: rows 4 KB apart would share L1 sets
    const float* xp = arrange_pairs(x, M, K, ld);
    const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr());
    dense_rows(N, M, [&](int rt, int tt, int64_t r, int64_t t, int64_t lead) {
      TILES_PAIRS[rt - 1][tt - 1](wp + r * K, K, xp + t * ld, ld, y + t * N + r, N, lead);
    });
  } else
#ifdef GD_BF16DOT
  if (x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16) {
    const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr());
    const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
    std::vector<const uint16_t*> xs(M);
    for (int64_t t = 0; t < M; ++t) xs[t] = xp + t * K;
    dense_rows(N, M, [&](int rt, int tt, int64_t r, int64_t t, int64_t lead) {
      TILES_BF16[rt - 1][tt - 1](wp + r * K, K, K, xs.data() + t, y + t * N + r, N, lead);
    });
  } else
#endif
  {
    const float* xf = rows_as_f32(x, 0);
    auto rows = [&](const auto& tiles, const auto* wp, int rt_max = RT_MAX, int tt_max = TT_MAX) {
      dense_rows(N, M, [&](int rt, int tt, int64_t r, int64_t t, int64_t lead) {
        tiles[rt - 1][tt - 1](wp + r * K, K, xf + t * K, K, y + t * N + r, N, lead);
      }, rt_max, tt_max);
    };
    const uint16_t* wp16 = reinterpret_cast<const uint16_t*>(w.data_ptr());
    if (w.scalar_type() == at::kFloat) rows(TILES_F32, w.data_ptr<float>());
#ifdef GD_X64_DECODE
    else if (M >= LINEAR_STRIP_MIN_ROWS) linear_strips_bf16(wp16, N, K, xf, M, y);
#endif
    else if (W == 8 && M > 2) rows(TILES_BF16W_WIDE, wp16, RT_WIDE, TT_WIDE);   // 1.06-1.17x at 4-16 rows
    else rows(TILES_BF16W, wp16);
  }
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "linear: bias has ", bias->numel(), " values for ", N, " rows");
    const FloatView b(*bias);
    for (int64_t t = 0; t < M; ++t)
      for (int64_t n = 0; n < N; ++n) y[t * N + n] += b[n];
  }
  if (x.scalar_type() != at::kFloat) store_row(y, out, 0, M * N);
  return out;
}

}  // namespace gd
