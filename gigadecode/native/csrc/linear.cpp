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
// the register tile of rt rows from row r and tt inputs from input t, prefetching `lead` bytes ahead. A strip
// is walked a tile of inputs at a time, each over all the strip's rows: the first tile of inputs streams the
// rows from memory, the others find them in L2 (16 rows: 32-128 KB of bf16), while a tile's inputs (4 × K
// fp32, twice a row's bytes) stay in L1 for the strip's four row tiles. Walked the other way (each row tile
// through every tile of inputs), every input vector came from L2 again for each row tile: twice the L2 reads
// a multiply-add. Each tile's sums are the same either way. (An Ice Lake Xeon, 2 threads: the op at 32 rows
// 1.05-1.08x on 20b-shape's qkv, o and lm_head; a 20b-shape decode step at batch 32 1.03-1.08x, batch 8 and
// `small`'s steps unchanged; alternated in one process.)
template <typename TileCall>
void dense_rows(int64_t N, int64_t M, const TileCall& tile, int rt_max = RT_MAX, int tt_max = TT_MAX) {
  const int64_t strip = 16, strips = (N + strip - 1) / strip;
  at::parallel_for(0, strips, 1, [&](int64_t s0, int64_t s1) {
    for (int64_t s = s0; s < s1; ++s) {
      const int64_t r1 = std::min(N, (s + 1) * strip);
      for (int64_t t = 0; t < M; t += tt_max)
        for (int64_t r = s * strip; r < r1; r += rt_max) {
          const int rt = int(std::min<int64_t>(rt_max, r1 - r));
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
#if defined(GD_X64_DECODE) || (defined(__AVX512F__) && !defined(GD_BF16DOT))
#define GD_LINEAR_STRIPS 1
// Builds without bf16 products (AVX2; AVX-512 without BF16), bf16 weights, at least LINEAR_STRIP_MIN_ROWS
// inputs: each strip of 16 weight rows is converted to fp32 once into a per-thread buffer and multiplied in the
// MoE strip path's dense fp32 tiles (`dot_rows_f32`), instead of converting every row again for each tile of
// inputs (AVX2: 1.1-1.3x the 2 x 4 tiles at 48-96 rows on a Zen 3, the op alone; even at 40, slower below.
// AVX-512 without BF16, against the pair tiles, an Ice Lake Xeon, 2 threads, `small`'s lm_head and qkv and
// 20b-shape's qkv and o alternated: 0.82-1.02x at 32 rows, 0.99-1.08x at 48, 0.97-1.2x at 64, 1.1-1.45x at 96;
// since the pair tiles walk a strip a tile of inputs at a time (`dense_rows`), 0.89-1.03x at 48, 0.94-1.04x at
// 64, 0.98-1.04x at 96 (with `small`'s and 20b-shape's lm_head too): from 64; and against `gemm.linear` (MKL's
// fp32 GEMM on the weight converted block by block), which Python gives more rows: 1.04-1.78x at 64-256 rows,
// 0.95-1.17x at 384, 0.69-0.97x at 512-1,024)
constexpr int64_t LINEAR_STRIP_MIN_ROWS = W == 8 ? 40 : 64;
#endif

constexpr int64_t PAIR_MIN_INPUTS = 4;
bool pair_tiles(bool bf16_inputs, int64_t M) {
  if (W != 16 || M < PAIR_MIN_INPUTS) return false;   // AVX2 keeps the tiles and strips measured on a Zen 3
#ifdef GD_BF16DOT
  return !bf16_inputs || bf16_products() == PRODUCTS_F32;
#else
  return M < LINEAR_STRIP_MIN_ROWS;
#endif
}

#ifdef GD_LINEAR_STRIPS
// y [M, N] = x [M, K] · w [N, K]^T for bf16 w: the rows' and the inputs' fp32 copies padded to whole vectors
void linear_strips_bf16(const uint16_t* w, int64_t N, int64_t K, const float* x, int64_t M, float* y) {
  const int64_t Kw = (K + W - 1) / W * W, strip = 16;
  // AVX-512: rows a vector past a multiple of 4 KB apart (rows 4 KB apart would share L1 sets)
  const int64_t ld = W == 16 && Kw % 1024 == 0 ? Kw + W : Kw;
  const float* xs = x;
  if (ld != K) {                                      // zero-padded inputs (the padded weights are zero too)
    float* xp = shared_scratch(1, M * ld);
    for (int64_t t = 0; t < M; ++t) {
      std::copy(x + t * K, x + t * K + K, xp + t * ld);
      std::fill(xp + t * ld + K, xp + t * ld + Kw, 0.f);
    }
    xs = xp;
  }
  std::vector<const float*> xr(M);
  for (int64_t t = 0; t < M; ++t) xr[t] = xs + t * ld;
  at::parallel_for(0, (N + strip - 1) / strip, 1, [&](int64_t s0, int64_t s1) {
    float* wf = scratch(2, strip * ld);
    for (int64_t s = s0; s < s1; ++s) {
      const int64_t r0 = s * strip, nr = std::min(strip, N - r0);
      for (int64_t r = 0; r < nr; ++r) {
        bf16_to_f32_row(w + (r0 + r) * K, K, wf + r * ld);
        std::fill(wf + r * ld + K, wf + r * ld + Kw, 0.f);
      }
      dot_rows_f32(wf, ld, Kw, nr, xr.data(), M, y + r0, N);
    }
  });
}
#endif

#ifdef GD_BF16DOT
// bf16 weights x bf16 inputs on AMX tiles (`amx_tiles.h`), from this many inputs (an Intel Xeon with AMX,
// 2 threads, against the fp32 pair tiles, medians of alternated calls: `small`'s lm_head [32000, 1024] at 4 / 5
// / 8 / 16 inputs 0.89 / 1.26 / 1.44 / 2.59x, its qkv [1536, 1024] 1.58 / 2.01 / 2.48 / 3.66x, 20b-shape
// projections ([5120, 2880], [2880, 4096], [8192, 2880]) 1.05-1.11 / 1.40-1.45 / 1.69-1.78 / 2.31-2.93x; 2-3
// inputs 0.87-1.48x; the weights in the L3, called again and again; 2-4 inputs on our own tiles below, weights
// streamed from memory: 20b-shape decode steps at batch 2 / 3 / 4 0.98-1.01x). Up to LINEAR_TILE_INPUTS inputs
// our own tile code (`linear_tiles`) runs them, else oneDNN's GEMM here: the weight's rows its first operand as
// they are (strips of AMX_STRIP rows), the inputs its pair-interleaved second (laid out once a call); fp32
// sums: y [M, N].
constexpr int64_t LINEAR_AMX_MIN_ROWS = 5;
void linear_amx(const uint16_t* w, int64_t N, int64_t K, const uint16_t* x, int64_t M, float* y) {
  uint16_t* xv = reinterpret_cast<uint16_t*>(shared_scratch(8, M * K / 2 + 16));
  std::vector<const uint16_t*> rows(M);
  for (int64_t t = 0; t < M; ++t) rows[t] = x + t * K;
  for (int64_t b = 0; b * AMX_BLOCK < M; ++b) put_vnni_block(rows.data() + b * AMX_BLOCK, K, b, M, xv);
  at::parallel_for(0, (N + AMX_STRIP - 1) / AMX_STRIP, 1, [&](int64_t s0, int64_t s1) {
    for (int64_t s = s0; s < s1; ++s) {
      const int64_t r0 = s * AMX_STRIP;
      rows_times_inputs_amx(w + r0 * K, r0, std::min(AMX_STRIP, N - r0), K, xv, M, SumsToOut{y, N});
    }
    at::native::cpublas::brgemm_release();
  });
}

#ifdef GD_AMX_OWN_TILES
// Up to LINEAR_TILE_INPUTS inputs (four tiles' columns) our own tile code streams the weight rows straight onto
// the tiles: groups of 16 rows, each 64-byte column step of a group one tile, the same line of the next
// group's rows prefetched as it goes. oneDNN's GEMM over 64-row strips read a weight streamed from memory at
// about half the bandwidth (24 layers of 20b-shape's qkv and o, 2 threads, 5 / 8 / 16 inputs: 13.4-13.6 GB/s
// against 24.9 / 24.4 / 24.3 here and 25.8 for the register tiles at one input; 17 / 32 inputs 22.0 / 20.1
// against 23.5 / 21.6; 20b-shape decode steps at batch 8 / 32 1.15 / 1.03x). With the weight in the L3
// (`small`'s projections, called again and again) it is 0.7-0.95x oneDNN's, which left decode steps of
// `small` unchanged (1.00-1.02x at batch 8-32). 33 / 48 / 64 inputs: 20.4 / 19.4 / 16.4 GB/s against oneDNN's
// whole GEMM (what Python gave those rows) 12.5 / 11.4 / 11.0; at 96 even (10.7 / 10.8). Python's
// `native.LINEAR_MAX_ROWS_AMX` keeps those rows on this kernel.
constexpr int64_t LINEAR_TILE_INPUTS = 64;
constexpr int64_t LINEAR_TILE_PREFETCH_ROWS = 16;

// rows [g0, g1) of W [N, K] (groups of 16 rows from g0) times n <= LINEAR_TILE_INPUTS inputs `xv` ([Kp/2][ln][2]
// pairs, ln >= n inputs a pair-row, those past n and past K zero; Kp = K rounded up to 32) -> y[i * ldy + r], in
// column blocks of 16 inputs. The rows' steps go to tiles 2 / 3 (even / odd steps). One or two blocks: their sums
// alternate between two tiles each by the step's parity (block 0: 0 / 1, block 1: 6 / 7), so a sum tile waits
// for its last product every other step only, the inputs' step in 4 / 5 (one block: by parity; two: by block).
// Three or four blocks (ln = 16 · blocks: every tile 16 inputs wide): one sum tile a block (0, 6, 1, 7), the
// inputs' steps in 4 / 5 by turns.
__attribute__((target("amx-tile,amx-bf16")))
void rows_times_inputs_tiles(const uint16_t* w, int64_t N, int64_t K, int64_t g0, int64_t g1, const uint16_t* xv,
                             int64_t n, int64_t ln, float* y, int64_t ldy) {
  const int nb = int((n + 15) / 16);                      // column blocks
  const bool alternate = nb <= 2;
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;                                    // 16 inputs (or 32 bf16 values) a row
  }
  if (alternate) {                                        // bytes a row of blocks 0 / 1: 4 an input
    const uint16_t c0 = uint16_t(std::min<int64_t>(16, n) * 4), c1 = uint16_t(std::max<int64_t>(0, n - 16) * 4);
    cfg.colsb[0] = cfg.colsb[1] = cfg.colsb[4] = c0;
    cfg.colsb[5] = nb == 1 ? c0 : c1;
    if (nb == 2) cfg.colsb[6] = cfg.colsb[7] = c1;
  }
  _tile_loadconfig(&cfg);
  const int64_t steps = (K + 31) / 32, ldw = K * 2, ldx = ln * 4;   // ldx: bytes a pair-row of the inputs
  uint16_t* pad = reinterpret_cast<uint16_t*>(scratch(0, 16 * 32 / 2));   // a step past the rows or K: [16][32]
  float* cbuf = scratch(4, 4 * 16 * 16);                                  // tiles 0, 1, 6, 7: [16 rows][16]
  const auto a_step = [&](int64_t r0, int64_t rows, int64_t k) -> const uint16_t* {   // nullptr: read W itself
    if (rows == 16 && (k + 1) * 32 <= K) return nullptr;
    const int64_t kk = std::min<int64_t>(32, K - k * 32);
    for (int64_t r = 0; r < 16; ++r)
      for (int64_t c = 0; c < 32; ++c) pad[r * 32 + c] = r < rows && c < kk ? w[(r0 + r) * K + k * 32 + c] : 0;
    return pad;
  };
  for (int64_t r0 = g0; r0 < g1; r0 += 16) {
    const int64_t rows = std::min<int64_t>(16, N - r0);
    _tile_zero(0); _tile_zero(1); _tile_zero(6); _tile_zero(7);
    for (int64_t k = 0; k < steps; ++k) {
      if (r0 + 16 + LINEAR_TILE_PREFETCH_ROWS <= N)
        for (int64_t r = 0; r < 16; ++r) prefetch_l2(w + (r0 + r) * K + k * 32, LINEAR_TILE_PREFETCH_ROWS * ldw);
      const uint16_t* pa = a_step(r0, rows, k);
      const uint16_t* b = xv + k * 16 * ln * 2;           // the step's 16 input pairs
      // (the tile intrinsics take their tile numbers as constants: the cases spelled out)
      if (k & 1) {
        if (pa) _tile_loadd(3, pa, 64); else _tile_loadd(3, w + r0 * K + k * 32, ldw);
        if (nb == 1) { _tile_loadd(5, b, ldx); _tile_dpbf16ps(1, 3, 5); }
        else if (nb == 2) {
          _tile_loadd(4, b, ldx);       _tile_dpbf16ps(1, 3, 4);
          _tile_loadd(5, b + 32, ldx);  _tile_dpbf16ps(7, 3, 5);
        } else {
          _tile_loadd(4, b, ldx);       _tile_dpbf16ps(0, 3, 4);
          _tile_loadd(5, b + 32, ldx);  _tile_dpbf16ps(6, 3, 5);
          _tile_loadd(4, b + 64, ldx);  _tile_dpbf16ps(1, 3, 4);
          if (nb == 4) { _tile_loadd(5, b + 96, ldx); _tile_dpbf16ps(7, 3, 5); }
        }
      } else {
        if (pa) _tile_loadd(2, pa, 64); else _tile_loadd(2, w + r0 * K + k * 32, ldw);
        _tile_loadd(4, b, ldx);         _tile_dpbf16ps(0, 2, 4);
        if (nb >= 2) { _tile_loadd(5, b + 32, ldx); _tile_dpbf16ps(6, 2, 5); }
        if (nb >= 3) { _tile_loadd(4, b + 64, ldx); _tile_dpbf16ps(1, 2, 4); }
        if (nb == 4) { _tile_loadd(5, b + 96, ldx); _tile_dpbf16ps(7, 2, 5); }
      }
    }
    _tile_stored(0, cbuf, 64);
    _tile_stored(1, cbuf + 256, 64);
    _tile_stored(6, cbuf + 512, 64);
    _tile_stored(7, cbuf + 768, 64);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t j = i / 16, ii = i % 16;
      if (alternate) {                                    // block j: tiles 0 + 1 or 6 + 7
        const float* c = cbuf + j * 512 + ii;
        for (int64_t r = 0; r < rows; ++r) y[i * ldy + r0 + r] = c[r * 16] + c[256 + r * 16];
      } else {                                            // block j: tile 0, 6, 1 or 7
        const float* c = cbuf + (j == 0 ? 0 : j == 1 ? 512 : j == 2 ? 256 : 768) + ii;
        for (int64_t r = 0; r < rows; ++r) y[i * ldy + r0 + r] = c[r * 16];
      }
    }
  }
  _tile_release();
  at::native::cpublas::brgemm_release();   // the next oneDNN GEMM of this thread configures its tiles again
}

// y [M, N] fp32 = x [M, K] · W [N, K]^T for 2 <= M <= LINEAR_TILE_INPUTS, bf16 W and x, K even
void linear_tiles(const uint16_t* w, int64_t N, int64_t K, const uint16_t* x, int64_t M, float* y) {
  const int64_t Kp = (K + 31) / 32 * 32, ln = M <= 32 ? M : (M + 15) / 16 * 16;   // inputs a pair-row
  uint32_t* xv = reinterpret_cast<uint32_t*>(shared_scratch(8, ln * Kp / 2 + 16));   // [Kp/2][ln] pairs
  for (int64_t t = 0; t < ln; ++t)
    for (int64_t k = 0; k < Kp / 2; ++k)
      xv[k * ln + t] = t < M && k < K / 2 ? bf16_pair_bits(x + t * K + 2 * k) : 0;
  at::parallel_for(0, (N + 15) / 16, 1, [&](int64_t s0, int64_t s1) {
    rows_times_inputs_tiles(w, N, K, s0 * 16, std::min(N, s1 * 16), reinterpret_cast<const uint16_t*>(xv), M, ln,
                            y, N);
  });
}
#endif
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
    const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr());
    const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
#ifdef GD_AMX_OWN_TILES
    if (M <= LINEAR_TILE_INPUTS) linear_tiles(wp, N, K, xp, M, y);
    else
#endif
    linear_amx(wp, N, K, xp, M, y);
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
#ifdef GD_LINEAR_STRIPS
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
