// The routed MXFP4 MoE (grouped by expert), for decode batches and prefill chunks alike.
//
// Weights stay in the checkpoint's MXFP4 layout, which is already the streamed one: a row's groups are
// contiguous (blocks [E, R, G, 16] bytes, two e2m1 codes per byte, low nibble first; scales [E, R, G] E8M0).
// The kernel decodes a tile of RT rows of a group into fp32 registers (codes -> values by a vector table
// lookup, times the group's power of two: exact) and multiplies them with up to TT inputs at once, so each
// selected expert's bytes stream from memory once per step for all of its tokens. Inputs are stored
// "deinterleaved" per W-byte chunk ([W even elements][W odd elements]) so the low/high nibbles of a chunk
// meet their inputs without shuffles. bf16 inputs on AVX512-BF16 take `bf16dot.h`'s path, and the AVX2
// build its own decode and input order (`mxfp4_avx2.h`; there bf16 inputs are quantized to int16 per group
// of 32, and experts with few tokens multiply them in integers: `MxTileI16`).
#include <algorithm>
#include <array>
#include <utility>

#include "amx_tiles.h"
#include "bf16dot.h"
#include "common.h"
#include "mxfp4_avx2.h"

namespace gd {

namespace {

constexpr int RT_MAX = W == 16 ? 4 : 2;   // rows per register tile
constexpr int TT_MAX = W == 16 ? 4 : 2;   // inputs per register tile

// x [K] -> deinterleaved chunks: out[c*2W + i] = x[2(cW + i)], out[c*2W + W + i] = x[2(cW + i) + 1]
inline void deinterleave(const float* x, int64_t K, float* out) {
  for (int64_t c = 0; c < K / (2 * W); ++c)
    for (int i = 0; i < W; ++i) {
      out[c * 2 * W + i] = x[2 * (c * W + i)];
      out[c * 2 * W + W + i] = x[2 * (c * W + i) + 1];
    }
}

// out[t * ldo + r] = row r · input t for RT rows (row r at blk + r*G*16, scales at scl + r*G) and TT inputs
template <int RT, int TT>
struct MxTile {
static void run(const uint8_t* blk, const uint8_t* scl, int64_t G, const float* const* xs, float* out, int64_t ldo) {
  const float* e8 = e8m0_table();
  VF acc[RT][TT];
#pragma GCC unroll 16
  for (int r = 0; r < RT; ++r)
#pragma GCC unroll 16
    for (int t = 0; t < TT; ++t) acc[r][t] = vzero();
  constexpr int CPG = 16 / W;             // chunks of W bytes per 32-value group
  for (int64_t g = 0; g < G; ++g) {
    VF s[RT];
#pragma GCC unroll 16
    for (int r = 0; r < RT; ++r) s[r] = vset1(e8[scl[r * G + g]]);
#pragma GCC unroll 16
    for (int cc = 0; cc < CPG; ++cc) {
      const int64_t c = g * CPG + cc;
      VF we[RT], wo[RT];
#pragma GCC unroll 16
      for (int r = 0; r < RT; ++r) {
        vdecode_e2m1(blk + r * G * 16 + c * W, s[r], we[r], wo[r]);
        if ((c * W) % 64 == 0) prefetch_l2(blk + r * G * 16 + c * W, MOE_PREFETCH_ROWS * G * 16);
      }
#pragma GCC unroll 16
      for (int t = 0; t < TT; ++t) {
        const VF xe = vload(xs[t] + c * 2 * W), xo = vload(xs[t] + c * 2 * W + W);
#pragma GCC unroll 16
        for (int r = 0; r < RT; ++r) acc[r][t] = vfma(wo[r], xo, vfma(we[r], xe, acc[r][t]));
      }
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < RT; ++r)
#pragma GCC unroll 16
    for (int t = 0; t < TT; ++t) out[t * ldo + r] = vsum(acc[r][t]);
}
};

template <typename XT>
using MxFn = void (*)(const uint8_t*, const uint8_t*, int64_t, const XT* const*, float*, int64_t);

// rows [r0, r1) of expert matrix (blk, scl: the expert's first row) times `n` deinterleaved inputs
// -> out[i * ldo + r] for i < n, through a table of register tiles (`make_tiles`)
template <int RTM = RT_MAX, int TTM = TT_MAX, typename XT, typename Tiles>
void expert_rows(const Tiles& tiles, const uint8_t* blk, const uint8_t* scl, int64_t G, int64_t r0, int64_t r1,
                 const XT* const* xs, int64_t n, float* out, int64_t ldo) {
  for (int64_t r = r0; r < r1; r += RTM) {
    const int rt = int(std::min<int64_t>(RTM, r1 - r));
    for (int64_t t = 0; t < n; t += TTM) {
      const int tt = int(std::min<int64_t>(TTM, n - t));
      tiles[rt - 1][tt - 1](blk + r * G * 16, scl + r * G, G, xs + t, out + t * ldo + r, ldo);
    }
  }
}

const auto TILES = make_tiles<MxFn<float>, MxTile, RT_MAX, TT_MAX>();

// Experts with at least this many inputs decode each strip of rows once, scaled, into a per-thread buffer and
// run dense tiles over it (at the dot-product peak: the decode is paid once per strip, not once per tile of
// inputs). Fewer inputs keep the register tiles (no buffer round trip).
constexpr int64_t STRIP_MIN_INPUTS = 8;

// bf16 inputs, where the CPU's fp32 FMAs multiply faster than its vdpbf16ps (`bf16_products()`, measured once):
// experts with at least this many inputs take the fp32 form (`expert_rows_f32`: its strips from
// STRIP_MIN_INPUTS, its register tiles below that). On an Intel Xeon (Emerald Rapids) decode steps of `small`
// at batch 8 / 32 ran 1.10x / 1.12x against the bf16 form from two inputs. A lone input's bf16 tile once read
// its expert's bytes faster (batch 1 lost 3% in the fp32 form), so one-input experts kept the bf16 form; since
// the vpermw decode it is the other way: every expert in the fp32 form ran decode steps of `small` at batch
// 1 / 2 / 4 / 8 1.02 / 1.03 / 1.025 / 1.025-1.035x, and of two 120b-shape layers (DRAM-bound) at batch 1 / 8
// 1.00 / 1.03x (alternated in one process, 20 pairs each).
constexpr int64_t F32_FORM_MIN_INPUTS = 1;

#ifdef GD_X64_DECODE
// fp32 inputs in the x64 order of `mxfp4_avx2.h`, each row padded to whole 64-value chunks
inline int64_t input_stride(int64_t K) { return (K + 63) / 64 * 64; }
inline int64_t dot_length(int64_t K) { return input_stride(K); }   // the padding: zeros on both sides
inline void arrange_inputs(const float* x, int64_t K, float* out) { arrange_x64(x, K, out); }
inline bool decode_rows_scaled_f32(const uint8_t* blk, const uint8_t* scl, int64_t G, int64_t rows, float* out,
                                   int64_t ld) {
  return decode_rows_scaled_x64(blk, scl, G, rows, out, ld);
}

const auto TILES_X64 = make_tiles<MxFn<float>, MxTileX64, RT_MAX, TT_MAX>();
// experts with 3 to 7 inputs: 2 rows x 4 inputs, so each row's chunk is decoded once for four inputs
// (1.1-1.3x the 2 x 2 tiles at 3-6 inputs on a Zen 3, the tile alone; the same sums in the same order)
constexpr int TT_X64_WIDE = 4;
const auto TILES_X64_WIDE = make_tiles<MxFn<float>, MxTileX64, RT_MAX, TT_X64_WIDE>();
// bf16 inputs: int16-quantized (`QChunk`) for every expert. Fewer than STRIP_MIN_INPUTS: register tiles
// (`MxTileI16`), one row for one or two inputs, two rows for three or more (the fastest of 1-2 rows on a Zen 3,
// the tile alone); more: the fp32 strip path (`expert_rows_f32`) over the same quantized values (faster there:
// the decode is paid once a strip, and fp32 FMAs beat the int16 products' per-chunk scaling).
const auto TILES_I16 = make_tiles<MxFn<QChunk>, MxTileI16, 1, 2>();
const auto TILES_I16_WIDE = make_tiles<MxFn<QChunk>, MxTileI16, 2, TT_X64_WIDE>();
void expert_rows_i16(const uint8_t* blk, const uint8_t* scl, int64_t G, int64_t r0, int64_t r1,
                     const QChunk* const* xs, int64_t n, float* out, int64_t ldo) {
  if (n > 2)
    expert_rows<2, TT_X64_WIDE>(TILES_I16_WIDE, blk, scl, G, r0, r1, xs, n, out, ldo);
  else
    expert_rows<1, 2>(TILES_I16, blk, scl, G, r0, r1, xs, n, out, ldo);
}
#else
// fp32 inputs deinterleaved, each row one vector longer than its K values: rows 4 KB apart (K = 1024) would
// fall in the same L1 sets, as would the strip path's decoded rows (laid out alike)
inline int64_t input_stride(int64_t K) { return K + W; }
inline int64_t dot_length(int64_t K) { return K; }
inline void arrange_inputs(const float* x, int64_t K, float* out) { deinterleave(x, K, out); }

// The codes of `rows` rows as fp32 values times their group's power of two, each row `ld` values in the
// inputs' deinterleaved order (per W-byte chunk: the low nibbles' values, then the high nibbles'): exact while
// every scale keeps the values normal, i.e. is in [2, 252]; false (nothing written) when one is not, and the
// caller keeps the register tiles (which scale each group's products instead).
inline bool decode_rows_scaled_f32(const uint8_t* blk, const uint8_t* scl, int64_t G, int64_t rows, float* out,
                                   int64_t ld) {
  for (int64_t i = 0; i < rows * G; ++i)
    if (scl[i] < 2 || scl[i] > 252) return false;
  const float* e8 = e8m0_table();
  constexpr int CPG = 16 / W;                           // chunks of W bytes per 32-value group
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < G; ++g) {
      const VF s = vset1(e8[scl[r * G + g]]);
      for (int cc = 0; cc < CPG; ++cc) {
        const int64_t c = g * CPG + cc;
        VF even, odd;
        vdecode_e2m1(blk + r * G * 16 + c * W, s, even, odd);
        vstore(out + r * ld + c * 2 * W, even);
        vstore(out + r * ld + c * 2 * W + W, odd);
      }
    }
  return true;
}
#endif

// fp32 inputs (`arrange_inputs`' order). Experts with STRIP_MIN_INPUTS or more: each strip of rows decoded once,
// scaled, into a per-thread buffer and multiplied in dense fp32 tiles (`dot_rows_f32`); fewer: register tiles
void expert_rows_f32(const uint8_t* blk, const uint8_t* scl, int64_t G, int64_t r0, int64_t r1,
                     const float* const* xs, int64_t n, float* out, int64_t ldo) {
  const int64_t ld = input_stride(G * 32);
  if (n >= STRIP_MIN_INPUTS) {
    float* wb = scratch(0, (r1 - r0) * ld);
    if (decode_rows_scaled_f32(blk + r0 * G * 16, scl + r0 * G, G, r1 - r0, wb, ld)) {
      dot_rows_f32(wb, ld, dot_length(G * 32), r1 - r0, xs, n, out + r0, ldo);
      return;
    }
  }
#ifdef GD_X64_DECODE
  if (n > 2)
    expert_rows<RT_MAX, TT_X64_WIDE>(TILES_X64_WIDE, blk, scl, G, r0, r1, xs, n, out, ldo);
  else
    expert_rows(TILES_X64, blk, scl, G, r0, r1, xs, n, out, ldo);
#else
  expert_rows(TILES, blk, scl, G, r0, r1, xs, n, out, ldo);
#endif
}

#ifdef GD_BF16DOT
template <int RT, int TT>
struct MxTileBf16 {
static void run(const uint8_t* blk, const uint8_t* scl, int64_t G, const uint16_t* const* xs, float* out,
                int64_t ldo) {
  // acc[RT][TT], the decoded chunks and the scales must stay within the 32 zmm registers (a spill costs more
  // than it saves): tiles of up to two inputs, or of at most 8 (row, input) pairs, decode all RT rows first;
  // bigger tiles decode one row at a time and meet every input of the tile with it (inputs re-read from L1)
  __m512 acc[RT * TT];                                // acc[r * TT + t]
#pragma GCC unroll 16
  for (int i = 0; i < RT * TT; ++i) acc[i] = _mm512_setzero_ps();
  __m512 s16[RT];
  for (int64_t c = 0; c < (G + 3) / 4; ++c) {
    const int j = int(c % 4);
    if (j == 0)                                       // the next 16 groups' scales
#pragma GCC unroll 16
      for (int r = 0; r < RT; ++r) s16[r] = e8m0_x16(scl + r * G + 4 * c, int(std::min<int64_t>(16, G - 4 * c)));
    const int nbytes = int(std::min<int64_t>(64, (G - 4 * c) * 16));
#pragma GCC unroll 16
    for (int r = 0; r < RT; ++r) prefetch_l2(blk + r * G * 16 + c * 64, MOE_PREFETCH_ROWS * G * 16);
    if constexpr (TT <= 2 || RT * TT <= 8) {          // small tile: decode every row first (more ILP)
      __m512i w[RT][4];
#pragma GCC unroll 16
      for (int r = 0; r < RT; ++r) decode_e2m1_bf16x4(blk + r * G * 16 + c * 64, nbytes, w[r]);
#pragma GCC unroll 16
      for (int t = 0; t < TT; ++t)
#pragma GCC unroll 16
        for (int r = 0; r < RT; ++r) acc[r * TT + t] = chunk_dot(w[r], xs[t] + c * 128, quad_scales(s16[r], j), acc[r * TT + t]);
    } else {                                          // many: one row's chunk live at a time (no spills)
#pragma GCC unroll 16
      for (int r = 0; r < RT; ++r) {
        __m512i w[4];
        decode_e2m1_bf16x4(blk + r * G * 16 + c * 64, nbytes, w);
        const __m512 sc = quad_scales(s16[r], j);
#pragma GCC unroll 16
        for (int t = 0; t < TT; ++t) acc[r * TT + t] = chunk_dot(w, xs[t] + c * 128, sc, acc[r * TT + t]);
      }
    }
  }
  float sums[RT * TT];
  hsums(acc, sums);
#pragma GCC unroll 16
  for (int r = 0; r < RT; ++r)
#pragma GCC unroll 16
    for (int t = 0; t < TT; ++t) out[t * ldo + r] = sums[r * TT + t];
}
};

const auto TILES_BF16 = make_tiles<MxFn<uint16_t>, MxTileBf16, RT_MAX, TT_MAX>();
// experts with 3 or 4 inputs: 2 rows a tile, both decoded first (4 x 4 would decode a row at a time):
// 1.04-1.06x on the MoE of 16-48 tokens, measured alternated
constexpr int RT_MID = 2;
const auto TILES_BF16_MID = make_tiles<MxFn<uint16_t>, MxTileBf16, RT_MID, TT_MAX>();
// experts with more inputs than TT_MAX: 2 rows x 8 inputs, so each row's MXFP4 is decoded once for 8 inputs
constexpr int RT_WIDE = 2, TT_WIDE = 8;
const auto TILES_BF16_WIDE = make_tiles<MxFn<uint16_t>, MxTileBf16, RT_WIDE, TT_WIDE>();

// bf16 strips (`STRIP_MIN_INPUTS`) run `DotTileBf16`
const auto TILES_DOT = make_tiles<DotFnBf16, DotTileBf16, RT_MAX, TT_MAX>();

void expert_rows_bf16(const uint8_t* blk, const uint8_t* scl, int64_t G, int64_t r0, int64_t r1,
                      const uint16_t* const* xs, int64_t n, float* out, int64_t ldo) {
  const int64_t ld = (G + 3) / 4 * 128;              // a row's values in whole 128-value chunks, like the inputs
  if (n >= STRIP_MIN_INPUTS) {
    uint16_t* wb = reinterpret_cast<uint16_t*>(scratch(0, (r1 - r0) * ld / 2 + 16));
    if (decode_rows_scaled_bf16(blk + r0 * G * 16, scl + r0 * G, G, r1 - r0, wb, ld)) {
      for (int64_t r = 0; r < r1 - r0; r += RT_MAX) {  // a tile's rows stay in L1 while the inputs pass
        const int rt = int(std::min<int64_t>(RT_MAX, r1 - r0 - r));
        for (int64_t t = 0; t < n; t += TT_MAX)
          TILES_DOT[rt - 1][int(std::min<int64_t>(TT_MAX, n - t)) - 1](wb + r * ld, ld, ld, xs + t,
                                                                      out + t * ldo + r0 + r, ldo, 0);
      }
      return;
    }
  }
  if (n > TT_MAX)
    expert_rows<RT_WIDE, TT_WIDE>(TILES_BF16_WIDE, blk, scl, G, r0, r1, xs, n, out, ldo);
  else if (n > 2)
    expert_rows<RT_MID, TT_MAX>(TILES_BF16_MID, blk, scl, G, r0, r1, xs, n, out, ldo);
  else
    expert_rows(TILES_BF16, blk, scl, G, r0, r1, xs, n, out, ldo);
}
#endif

struct Routing {
  std::vector<int64_t> expert_start;   // [n_local + 1] first pair of each local expert (pairs sorted by expert)
  std::vector<int64_t> pair_token;     // [P] token of each pair
  std::vector<float> pair_gate;        // [P] its gate weight
  std::vector<int64_t> active;         // local experts with at least one pair, ascending
};

Routing group_by_expert(const at::Tensor& idx, const at::Tensor& gate_w, int64_t n_local, int64_t offset) {
  const int64_t T = idx.size(0), k = idx.size(1);
  const int64_t* id = idx.data_ptr<int64_t>();
  at::Tensor gw = gate_w.to(at::kFloat).contiguous();
  const float* g = gw.data_ptr<float>();
  Routing r;
  r.expert_start.assign(n_local + 1, 0);
  for (int64_t i = 0; i < T * k; ++i) {
    const int64_t e = id[i] - offset;
    if (e >= 0 && e < n_local) r.expert_start[e + 1]++;
  }
  for (int64_t e = 0; e < n_local; ++e) {
    if (r.expert_start[e + 1]) r.active.push_back(e);
    r.expert_start[e + 1] += r.expert_start[e];
  }
  const int64_t P = r.expert_start[n_local];
  r.pair_token.resize(P);
  r.pair_gate.resize(P);
  std::vector<int64_t> fill(r.expert_start.begin(), r.expert_start.end() - 1);
  for (int64_t i = 0; i < T * k; ++i) {          // token order within an expert (stable)
    const int64_t e = id[i] - offset;
    if (e < 0 || e >= n_local) continue;
    r.pair_token[fill[e]] = i / k;
    r.pair_gate[fill[e]++] = g[i];
  }
  return r;
}

// W values of a float or bf16 bias from element o
inline VF bias_vec(const FloatView& b, int64_t o) {
  return b.e == Elem::F32 ? vload(static_cast<const float*>(b.p) + o) : vload_bf16(static_cast<const uint16_t*>(b.p) + o);
}

void check_mxfp4(const at::Tensor& blocks, const at::Tensor& scales, const char* name) {
  TORCH_CHECK(blocks.scalar_type() == at::kByte && scales.scalar_type() == at::kByte, name, ": MXFP4 must be uint8");
  TORCH_CHECK(blocks.dim() == 4 && blocks.size(3) == 16 && scales.dim() == 3 &&
              blocks.sizes().slice(0, 3) == scales.sizes(), name, ": expected blocks [E, R, G, 16] and scales [E, R, G]");
  TORCH_CHECK(blocks.is_contiguous() && scales.is_contiguous(), name, ": MXFP4 tensors must be contiguous");
}

}  // namespace

// out [T, H] = sum over the (token, slot) pairs routed to local experts of gate · expert(x[token]).
// expert(x) = W2 · swiglu(W1 · x + b1) + b2, with W1 = gate_up (rows interleaved gate, up), W2 = down.
at::Tensor moe_mxfp4(const at::Tensor& x, const at::Tensor& idx, const at::Tensor& gate_w,
                     const at::Tensor& gu_blocks, const at::Tensor& gu_scales, const at::Tensor& gu_bias,
                     const at::Tensor& dn_blocks, const at::Tensor& dn_scales, const at::Tensor& dn_bias,
                     double alpha, double limit, int64_t expert_offset) {
  check_float_like(x, "x");
  check_mxfp4(gu_blocks, gu_scales, "gate_up");
  check_mxfp4(dn_blocks, dn_scales, "down");
  TORCH_CHECK(idx.scalar_type() == at::kLong && idx.dim() == 2 && idx.size(0) == x.size(0) && idx.is_contiguous(),
              "idx must be int64 [T, k]");
  TORCH_CHECK(gate_w.sizes() == idx.sizes(), "gate_w must be [T, k] like idx");
  const int64_t T = x.size(0), H = x.size(1);
  const int64_t E = gu_blocks.size(0), R1 = gu_blocks.size(1), G1 = gu_blocks.size(2);
  const int64_t I = R1 / 2, G2 = dn_blocks.size(2);
  TORCH_CHECK(G1 * 32 == H && dn_blocks.size(1) == H && G2 * 32 == I && dn_blocks.size(0) == E && R1 % 2 == 0,
              "expert shapes do not match x: gate_up ", gu_blocks.sizes(), ", down ", dn_blocks.sizes(), ", x ", x.sizes());
  TORCH_CHECK(gu_bias.dim() == 2 && gu_bias.size(0) == E && gu_bias.size(1) == R1 && dn_bias.dim() == 2 &&
              dn_bias.size(0) == E && dn_bias.size(1) == H, "expert biases must be [E, 2I] and [E, H]");
  const FloatView b1(gu_bias), b2(dn_bias);
  Routing rt = group_by_expert(idx, gate_w, E, expert_offset);
  const int64_t P = rt.pair_token.size();
  at::Tensor out = at::zeros_like(x);
  if (P == 0) return out;

  const float* xf = rows_as_f32(x, 0);
#ifdef GD_BF16DOT
  const bool bf = x.scalar_type() == at::kBFloat16;   // bf16 activations: the exact bf16 dot-product path,
  const bool bf_f32 = bf && bf16_products() == PRODUCTS_F32;   // or fp32 FMAs where they are faster (2+ inputs)
#else
  const bool bf = false, bf_f32 = false;
#endif
  // bf16 activations on AVX2: the experts run on int16-quantized inputs (`expert_rows_i16`; strips on their values)
  const bool q16 = X64_DECODE && x.scalar_type() == at::kBFloat16;
  // whether an expert with n inputs multiplies fp32 inputs: every expert of fp32 activations; of bf16 ones,
  // those the fp32 form takes (AVX512-BF16) or the strips (AVX2's int16 inputs); the rest bf16 or int16 inputs
  const auto fp32_expert = [&](int64_t n) {
    return q16 ? n >= STRIP_MIN_INPUTS : bf ? bf_f32 && n >= F32_FORM_MIN_INPUTS : true;
  };
#ifdef GD_BF16DOT
  const bool amx = bf && amx_tiles_on();
#else
  const bool amx = false;
#endif
  const auto amx_expert = [&](int64_t n) { return amx && n >= AMX_MIN_INPUTS; };   // `amx_tiles.h`
  bool f32_inputs = false, amx_inputs = false;    // fp32 / pair-interleaved copies of the inputs: if some expert
  for (int64_t e : rt.active) {                   // takes that form
    const int64_t n = rt.expert_start[e + 1] - rt.expert_start[e];
    f32_inputs |= fp32_expert(n) && !amx_expert(n);
    amx_inputs |= amx_expert(n);
  }
  const int64_t H64 = (H + 127) / 128 * 128, I64 = (I + 127) / 128 * 128;   // bf16 inputs: whole chunks
  const int64_t HS = input_stride(H), IS = input_stride(I);                 // fp32 inputs
  float* xd = shared_scratch(0, f32_inputs ? T * HS : 0);         // [T, H] fp32 inputs in the tiles' order
  float* gu = shared_scratch(1, P * R1);                           // [P, 2I] gate_up outputs
  float* ad = shared_scratch(2, f32_inputs ? P * IS : 0);          // [P, I] activations, likewise
  float* y = shared_scratch(3, P * H);                             // [P, H] down outputs
  uint16_t* xd16 = reinterpret_cast<uint16_t*>(shared_scratch(6, bf ? T * H64 / 2 : 0));   // bf16 inputs
  uint16_t* ad16 = reinterpret_cast<uint16_t*>(shared_scratch(7, bf ? P * I64 / 2 : 0));
  constexpr int64_t QF = sizeof(QChunk) / sizeof(float);
  const int64_t HQ = (H + 63) / 64, IQ = (I + 63) / 64;           // int16 inputs: chunks a row
  QChunk* xq = reinterpret_cast<QChunk*>(shared_scratch(4, q16 ? T * HQ * QF : 0));
  QChunk* aq = reinterpret_cast<QChunk*>(shared_scratch(5, q16 ? P * IQ * QF : 0));
  uint16_t* xv = reinterpret_cast<uint16_t*>(shared_scratch(8, amx_inputs ? P * H64 / 2 : 0));   // [P, H64] and
  uint16_t* av = reinterpret_cast<uint16_t*>(shared_scratch(9, amx_inputs ? P * I64 / 2 : 0));   // [P, I64], VNNI
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
#ifdef GD_BF16DOT
      if (bf) {
        deinterleave_bf16(xf + t * H, H, xd16 + t * H64);
        if (f32_inputs) arrange_inputs(xf + t * H, H, xd + t * HS);   // bf16 values: exact in fp32
        continue;
      }
#endif
      if (q16) {
        quantize_x64(xf + t * H, H, xq + t * HQ);
        float* v = f32_inputs ? scratch(1, H) : nullptr;   // the values, for the strips
        if (v) { dequantize_x64(xq + t * HQ, H, v); arrange_inputs(v, H, xd + t * HS); }
        continue;
      }
      arrange_inputs(xf + t * H, H, xd + t * HS);
    }
  });
  std::vector<const float*> xin(P), ain(P);
  std::vector<const uint16_t*> xin16(P), ain16(P);
  std::vector<const QChunk*> xinq(q16 ? P : 0), ainq(q16 ? P : 0);
  for (int64_t p = 0; p < P; ++p) {
    xin[p] = xd + rt.pair_token[p] * HS;
    ain[p] = ad + p * IS;
    xin16[p] = xd16 + rt.pair_token[p] * H64;
    ain16[p] = ad16 + p * I64;
    if (q16) xinq[p] = xq + rt.pair_token[p] * HQ, ainq[p] = aq + p * IQ;
  }
  std::vector<int64_t> pair_expert(P);
  for (int64_t e : rt.active)
    for (int64_t p = rt.expert_start[e]; p < rt.expert_start[e + 1]; ++p) pair_expert[p] = e;
#ifdef GD_BF16DOT
  const auto pair_count = [&](int64_t p) {
    const int64_t e = pair_expert[p];
    return rt.expert_start[e + 1] - rt.expert_start[e];
  };
  if (amx_inputs)                                  // the AMX experts' inputs, pair-interleaved per expert
    at::parallel_for(0, P, 8, [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t first = rt.expert_start[pair_expert[p]];
        if (amx_expert(pair_count(p))) put_vnni(xin16[p], H64, p - first, pair_count(p), xv + first * H64);
      }
    });
#endif
  const uint8_t* gub = gu_blocks.data_ptr<uint8_t>();
  const uint8_t* gus = gu_scales.data_ptr<uint8_t>();
  const uint8_t* dnb = dn_blocks.data_ptr<uint8_t>();
  const uint8_t* dns = dn_scales.data_ptr<uint8_t>();

  // one work item = a strip of rows of one active expert (RT_MAX * 4 rows; AMX_STRIP on AMX tiles, where
  // taller strips reuse each tile of inputs for more rows), for all of that expert's pairs
  struct Item { int64_t e, r0, r1; };
  auto run = [&](const uint8_t* blk, const uint8_t* scl, int64_t R, int64_t G, const std::vector<const float*>& in,
                 const std::vector<const uint16_t*>& in16, const std::vector<const QChunk*>& inq,
                 const uint16_t* vnni, float* dst) {
    // threads take contiguous runs of work items of about equal cost (an item's cost: its expert's inputs
    // times its rows, plus some for streaming its bytes), so one expert with many tokens does not leave a
    // thread idle
    // an item's cost a row, in the time measured for experts of n inputs (`small` and 20b shapes, one form at a
    // time): the register tiles' grows from ~9 + n (its bytes, then n inputs' products), the AMX forms' is
    // about their decode's, whatever n
    const auto item_cost = [&](int64_t n) { return amx_expert(n) ? 15 + n / 8 : n <= 4 ? 9 + n : 3 * n; };
    std::vector<Item> items;
    std::vector<int64_t> done(1, 0);                          // cumulative cost before item i
    for (int64_t e : rt.active) {
      const int64_t n = rt.expert_start[e + 1] - rt.expert_start[e];
      const int64_t strip = amx_expert(n) ? AMX_STRIP : RT_MAX * 4;
      for (int64_t r0 = 0; r0 < R; r0 += strip) {
        items.push_back({e, r0, std::min(R, r0 + strip)});
        done.push_back(done.back() + (items.back().r1 - r0) * item_cost(n));
      }
    }
    const int64_t parts = at::get_num_threads(), total = done.back(), n_items = items.size();
    at::parallel_for(0, parts, 1, [&](int64_t b0, int64_t b1) {
      const int64_t i0 = std::lower_bound(done.begin(), done.end(), total * b0 / parts) - done.begin();
      const int64_t i1 = std::lower_bound(done.begin(), done.end(), total * b1 / parts) - done.begin();
      bool used_amx = false;
      for (int64_t i = i0; i < std::min(i1, n_items); ++i) {
        const int64_t e = items[i].e, r0 = items[i].r0, r1 = items[i].r1;
        const int64_t p0 = rt.expert_start[e], n = rt.expert_start[e + 1] - p0;
        const uint8_t* eb = blk + e * R * G * 16;                 // the expert's MXFP4 rows and scales
        const uint8_t* es = scl + e * R * G;
        float* out = dst + p0 * R;                                // its pairs' output rows
#ifdef GD_BF16DOT
        if (amx_expert(n)) {     // a scale outside the bf16 range: the bf16 tiles (which scale each group's sums)
          const uint16_t* v = vnni + p0 * ((G + 3) / 4 * 128);
          if (!(n <= AMX_TILE_INPUTS ? expert_rows_amx_l1(eb, es, G, r0, r1, v, n, out, R)
                                     : expert_rows_amx(eb, es, G, r0, r1, v, n, out, R)))
            expert_rows_bf16(eb, es, G, r0, r1, in16.data() + p0, n, out, R);
          used_amx = true;
          continue;
        }
        if (bf && !fp32_expert(n)) {
          expert_rows_bf16(eb, es, G, r0, r1, in16.data() + p0, n, out, R);
          continue;
        }
#endif
#ifdef GD_X64_DECODE
        if (q16 && !fp32_expert(n)) {
          expert_rows_i16(eb, es, G, r0, r1, inq.data() + p0, n, out, R);
          continue;
        }
#endif
        expert_rows_f32(eb, es, G, r0, r1, in.data() + p0, n, out, R);
      }
      if (used_amx) at::native::cpublas::brgemm_release();   // the thread's AMX tile state
    });
  };
  run(gub, gus, R1, G1, xin, xin16, xinq, xv, gu);

  // swiglu on (gate, up) = (even, odd) columns with the gate_up bias, written deinterleaved for `down`
  const float a = float(alpha), lim = float(limit);
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    float* act = scratch(2, 2 * I + W);
    float* up = act + I;
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t e = pair_expert[p];
      const float* g = gu + p * R1;
      int64_t i = 0;                                   // gate clamped above, up both ways, bias added
      for (; i + W <= I; i += W) {
        VF gate, upv;
        const int64_t o = e * R1 + 2 * i;
        vdeinterleave(vadd(vload(g + 2 * i), bias_vec(b1, o)), vadd(vload(g + 2 * i + W), bias_vec(b1, o + W)),
                      gate, upv);
        vstore(act + i, vmin(vset1(lim), gate));
        vstore(up + i, vmin(vset1(lim), vmax(vset1(-lim), upv)));
      }
      for (; i < I; ++i) {
        act[i] = std::min(g[2 * i] + b1[e * R1 + 2 * i], lim);
        up[i] = std::min(std::max(g[2 * i + 1] + b1[e * R1 + 2 * i + 1], -lim), lim);
      }
      swiglu_inplace(act, up, I, a, x.scalar_type() == at::kBFloat16);
#ifdef GD_BF16DOT
      if (bf) {
        deinterleave_bf16(act, I, ad16 + p * I64);
        const int64_t first = rt.expert_start[e];
        if (amx_expert(pair_count(p))) put_vnni(ad16 + p * I64, I64, p - first, pair_count(p), av + first * I64);
        if (!f32_inputs) continue;
      }
#endif
      if (x.scalar_type() == at::kBFloat16)            // bf16 activations, as on the bf16 dot-product path
        for (int64_t i = 0; i < I; ++i) act[i] = bf16_to_f32(f32_to_bf16(act[i]));
      if (q16) {
        quantize_x64(act, I, aq + p * IQ);
        if (!f32_inputs) continue;
        dequantize_x64(aq + p * IQ, I, act);
      }
      arrange_inputs(act, I, ad + p * IS);
    }
  });
  run(dnb, dns, H, G2, ain, ain16, ainq, av, y);

  // out[t] = sum of its pairs (expert order) gate · (y + b2)
  std::vector<std::vector<int64_t>> tok_pairs(T);
  for (int64_t p = 0; p < P; ++p) tok_pairs[rt.pair_token[p]].push_back(p);
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    float* row = scratch(3, H);
    for (int64_t t = t0; t < t1; ++t) {
      if (tok_pairs[t].empty()) continue;
      std::fill(row, row + H, 0.f);
      for (int64_t p : tok_pairs[t]) {
        const float gt = rt.pair_gate[p];
        const int64_t e = pair_expert[p];
        const float* yp = y + p * H;
        int64_t j = 0;
        for (; j + W <= H; j += W)
          vstore(row + j, vfma(vadd(vload(yp + j), bias_vec(b2, e * H + j)), vset1(gt), vload(row + j)));
        for (; j < H; ++j) row[j] += (yp[j] + b2[e * H + j]) * gt;
      }
      store_row(row, out, t * H, H);
    }
  });
  return out;
}

}  // namespace gd
