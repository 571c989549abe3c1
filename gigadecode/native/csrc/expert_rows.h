// One expert's rows times its inputs, in each form the MoE kernel (moe.cpp) picks per expert: register tiles
// that decode a tile of RT rows of a group into registers (codes -> values by a vector table lookup, times
// the group's power of two: exact) and multiply them with up to TT inputs at once (fp32 inputs `MxTile`, bf16
// ones `MxTileBf16`, AVX2's int16-quantized ones `MxTileI16`), and, for experts with many inputs, strips of
// rows decoded once into a buffer and multiplied in dense tiles. fp32 inputs are "deinterleaved" per W-byte
// chunk ([W even elements][W odd elements]) so the low/high nibbles of a chunk meet their inputs without
// shuffles; the AVX2 build has its own decode and input order (`mxfp4_avx2.h`). The AMX forms are in
// `amx_tiles.h`.
#pragma once

#include <algorithm>
#include <array>
#include <limits>

#include "bf16dot.h"
#include "common.h"
#include "mxfp4_avx2.h"
#include "mxfp4_vnni.h"

namespace gd {

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
// inputs). Fewer inputs keep the register tiles (no buffer round trip). The AVX-512 build without bf16
// arithmetic keeps them up to 23: on an Ice Lake Xeon its 4 x 4 fp32 tiles ran the MoE op at 69-91 GMAC/s (2
// threads) from 8 to 24 inputs an expert, the strips at 42-46 at 8 and ~90 from 24 (every expert given n fp32
// tokens, alternated: the tiles 1.56-1.70x at 8, 1.12-1.18x at 16, 0.98-1.02x at 24, 0.80x at 64; `small`'s and
// 20b's expert shapes).
#if defined(__AVX512F__) && !defined(GD_BF16DOT)
constexpr int64_t STRIP_MIN_INPUTS = 24;
#else
constexpr int64_t STRIP_MIN_INPUTS = 8;
#endif

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
inline void expert_rows_i16(const uint8_t* blk, const uint8_t* scl, int64_t G, int64_t r0, int64_t r1,
                     const QChunk* const* xs, int64_t n, float* out, int64_t ldo) {
  if (n > 2)
    expert_rows<2, TT_X64_WIDE>(TILES_I16_WIDE, blk, scl, G, r0, r1, xs, n, out, ldo);
  else
    expert_rows<1, 2>(TILES_I16, blk, scl, G, r0, r1, xs, n, out, ldo);
}
#endif
#ifdef GD_VNNI_FORM
// bf16 inputs on CPUs with AVX512-VNNI (`mxfp4_vnni.h`, `int16_products()`): int16-quantized (`QChunk128`) for
// every expert, as AVX2's. Fewer than Q_WORD_STRIP_MIN_INPUTS: its register tiles, 4 rows x up to 4 inputs, 2 rows
// x 8 from 5 (each row's chunks decoded once for 8 inputs); more: each strip of rows decoded once into words
// (`decode_rows_words`) and multiplied by the same tiles over them (`WordTileVnni`), the same sums either way.
// The register tiles ran at 93-104 GMAC/s (2 threads) from 5 to 31 inputs an expert on an Ice Lake Xeon, where
// the fp32 strips (which these experts took from 32 inputs before the word strips) reach 48-50 at 8 inputs,
// ~90 at 32 and 103 at 64.
using QInput = QChunk128;
constexpr int64_t Q_CHUNK = 128;
constexpr int64_t Q_STRIP_MIN_INPUTS = std::numeric_limits<int64_t>::max();   // (no expert takes the fp32 strips)
constexpr int64_t Q_WORD_STRIP_MIN_INPUTS = 24;
inline bool int16_inputs() { return int16_products(); }
// x [K] -> chunks; `values`: the values they stand for, which no expert of this form asks for (its strips are
// int16 too), so always null
inline void quantize_inputs(const float* x, int64_t K, QInput* out, float* values) {
  TORCH_INTERNAL_ASSERT(values == nullptr, "quantize_inputs: the VNNI form has no fp32 strips");
  quantize_x128(x, K, out);
}
const auto TILES_VNNI = make_tiles<MxFn<QChunk128>, MxTileVnni, RT_MAX, TT_MAX>();
constexpr int TT_VNNI_WIDE = 8;
const auto TILES_VNNI_WIDE = make_tiles<MxFn<QChunk128>, MxTileVnni, 2, TT_VNNI_WIDE>();
const auto TILES_VNNI_WORDS = make_tiles<MxFn<QChunk128>, WordTileVnni, RT_MAX, TT_MAX>();
inline void expert_rows_i16(const uint8_t* blk, const uint8_t* scl, int64_t G, int64_t r0, int64_t r1,
                            const QInput* const* xs, int64_t n, float* out, int64_t ldo) {
  if (n >= Q_WORD_STRIP_MIN_INPUTS) {
    const int64_t rb = words_row_bytes(G);
    uint8_t* wb = reinterpret_cast<uint8_t*>(scratch(0, (r1 - r0) * rb / 4));
    decode_rows_words(blk + r0 * G * 16, scl + r0 * G, G, r1 - r0, wb);
    const int64_t input_bytes = (G + 3) / 4 * int64_t(sizeof(QChunk128));
    for_strip_tiles<RT_MAX, TT_MAX>(r1 - r0, n, input_bytes, [&](int64_t r, int rt, int64_t t, int tt) {
      TILES_VNNI_WORDS[rt - 1][tt - 1](wb + r * rb, nullptr, G, xs + t, out + t * ldo + r0 + r, ldo);
    });
  } else if (n > TT_MAX) {
    expert_rows<2, TT_VNNI_WIDE>(TILES_VNNI_WIDE, blk, scl, G, r0, r1, xs, n, out, ldo);
  } else {
    expert_rows(TILES_VNNI, blk, scl, G, r0, r1, xs, n, out, ldo);
  }
}
#else
// bf16 inputs as int16 where the build multiplies them so (AVX2's `QChunk`; never on the AVX512-BF16 build)
using QInput = QChunk;
constexpr int64_t Q_CHUNK = 64;
constexpr int64_t Q_STRIP_MIN_INPUTS = STRIP_MIN_INPUTS;
inline bool int16_inputs() { return X64_DECODE; }
inline void quantize_inputs(const float* x, int64_t K, QInput* out, float* values) {
  quantize_x64(x, K, out);
  if (values) dequantize_x64(out, K, values);
}
#endif

#ifndef GD_X64_DECODE
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
inline void expert_rows_f32(const uint8_t* blk, const uint8_t* scl, int64_t G, int64_t r0, int64_t r1,
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
// How far ahead MxTileBf16 prefetches its rows' codes and scales: twice MOE_PREFETCH_ROWS. On a Zen 5 one
// thread streamed an expert's codes at ~22 GB/s with 16 rows of lead (1-input experts, the op alone) against
// 39 for a plain sum over memory, and a fifth of the tile's time went to the scale loads, which nothing
// prefetched. With the scales prefetched and 32 rows of lead, decode steps (alternated in one process):
// `20b-shape` batch 8 1.14x, `small` batch 1 1.01x (64 rows: 1.14x and 0.99x).
constexpr int64_t BF16_TILE_PREFETCH_ROWS = 2 * MOE_PREFETCH_ROWS;

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
    if (j == 0)                                       // the next 16 groups' scales, and the same of the row
#pragma GCC unroll 16                                 // BF16_TILE_PREFETCH_ROWS on (a stream of their own)
      for (int r = 0; r < RT; ++r) {
        s16[r] = e8m0_x16(scl + r * G + 4 * c, int(std::min<int64_t>(16, G - 4 * c)));
        prefetch_l2(scl + r * G + 4 * c, BF16_TILE_PREFETCH_ROWS * G);
      }
    const int nbytes = int(std::min<int64_t>(64, (G - 4 * c) * 16));
#pragma GCC unroll 16
    for (int r = 0; r < RT; ++r) prefetch_l2(blk + r * G * 16 + c * 64, BF16_TILE_PREFETCH_ROWS * G * 16);
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

inline void expert_rows_bf16(const uint8_t* blk, const uint8_t* scl, int64_t G, int64_t r0, int64_t r1,
                      const uint16_t* const* xs, int64_t n, float* out, int64_t ldo) {
  const int64_t ld = (G + 3) / 4 * 128;              // a row's values in whole 128-value chunks, like the inputs
  if (n >= STRIP_MIN_INPUTS) {
    uint16_t* wb = reinterpret_cast<uint16_t*>(scratch(0, (r1 - r0) * ld / 2 + 16));
    if (decode_rows_scaled_bf16(blk + r0 * G * 16, scl + r0 * G, G, r1 - r0, wb, ld)) {
      for_strip_tiles<RT_MAX, TT_MAX>(r1 - r0, n, ld * 2, [&](int64_t r, int rt, int64_t t, int tt) {
        TILES_DOT[rt - 1][tt - 1](wb + r * ld, ld, ld, xs + t, out + t * ldo + r0 + r, ldo, 0);
      });
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

}  // namespace gd
