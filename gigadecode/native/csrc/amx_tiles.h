// bf16 products on AMX tiles (AVX512-BF16 builds on CPUs with AMX-BF16): the MoE's experts with 5 or more
// bf16 inputs (moe.cpp), the dense projections' bf16 weights at 5 inputs or more (linear.cpp) and prefill
// attention's scores and P·V (prefill_attention.cpp), where the fp32 FMAs (or vdpbf16ps) of the other forms are
// the bottleneck and a tile multiply does ~10x their products a cycle. Two ways onto the tiles:
// - PyTorch's oneDNN batch-reduce GEMM (`at::native::cpublas::brgemm`: bf16 x bf16 -> fp32, no rounding of the
//   sums to bf16) for attention, experts with more than AMX_TILE_INPUTS inputs and projections with more than
//   64 (linear.cpp `LINEAR_TILE_INPUTS`): an expert's strip of rows is decoded once
//   (`decode_rows_scaled_bf16`: exact bf16 values in the 128-value chunk order of the bf16 inputs) and
//   multiplied with all its inputs;
// - our own tile instructions for experts with fewer (`expert_rows_amx_l1`), whose cost is the decode: each
//   64-byte chunk of 16 rows goes to an L1 buffer and straight onto the tiles, not to L2 and back; and for
//   projections with up to 64 inputs (linear.cpp `linear_tiles`), whose weight rows stream straight onto the
//   tiles with a prefetch oneDNN's GEMM does not make.
// A dot product may take its terms in any order as long as both sides use the same one, so the inputs stay in
// the chunk order too. The tiles want the second operand pair-interleaved ("VNNI": [K/2][n][2]): that operand
// is the inputs, which `put_vnni_block` lays out once per expert (or call), so no weight is repacked. Products
// are exact, sums fp32 in the tiles' order: the same values as the other forms up to fp32 rounding.
#pragma once

#include <ATen/native/CPUBlas.h>

#include "bf16dot.h"
#include "common.h"

namespace gd {

// whether bf16 products take AMX tiles where this file says (product_form.cpp: the CPU has AMX-BF16 and
// GIGADECODE_AMX is not 0, or the `amx_tiles` op set it)
bool amx_tiles_on();

// From 5 inputs the AMX forms are ahead: the other forms' costs grow with the inputs, theirs is the decode's
// (an Intel Xeon with AMX, 2 threads, all 32 experts of a layer with n inputs each, streamed from memory,
// `small` / 20b shapes, `expert_rows_amx_l1` against the fp32 form: n = 2 0.75-0.83x / 0.85x, 4 0.88-0.90x /
// 1.03x, 5 1.17-1.21x / 1.43x, 8 2.3-2.5x)
constexpr int64_t AMX_MIN_INPUTS = 5;
constexpr int64_t AMX_BLOCK = 32;      // inputs per GEMM call (its N): two 16-column tiles
constexpr int64_t AMX_STRIP = 64;      // rows a work item (its M): 4 x 2 tiles of fp32 sums, each input tile
                                       // loaded once for four tiles of rows
// An expert with more than AMX_TILE_INPUTS inputs (oneDNN's GEMM over a decoded strip) takes strips of up to
// this many bytes of bf16 rows (AMX_STRIP to 4 AMX_STRIP rows): half the GEMM calls (and their sums' sinks)
// where rows are short. 512-token prefill of `small` (K = 1,024: 128-row strips) 1.055x (median pair 1.058, 12
// pairs; 256 rows 1.066x, median 1.041); `20b-shape` with 128-row strips (K = 2,880: 737 KB) 0.972x (median
// pair 1.019), so it keeps 64
constexpr int64_t AMX_GEMM_STRIP_BYTES = 256 * 1024;

#ifdef GD_BF16DOT
// rows[r] (16 of 16 fp32) -> out[c] = column c
inline void transpose16(const __m512 rows[16], __m512 out[16]) {
  __m512 t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(rows[2 * i], rows[2 * i + 1]);   // lane L: a0 b0 a1 b1 (a, b: rows 2i, 2i + 1)
    t[2 * i + 1] = _mm512_unpackhi_ps(rows[2 * i], rows[2 * i + 1]);   //      a2 b2 a3 b3
  }
  for (int i = 0; i < 4; ++i) {                       // u[4i + k] lane L: column 4L + k of rows 4i..4i+3
    const __m512d t0 = _mm512_castps_pd(t[4 * i]), t1 = _mm512_castps_pd(t[4 * i + 1]);
    const __m512d t2 = _mm512_castps_pd(t[4 * i + 2]), t3 = _mm512_castps_pd(t[4 * i + 3]);
    u[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(t0, t2));
    u[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(t0, t2));
    u[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(t1, t3));
    u[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(t1, t3));
  }
  for (int k = 0; k < 4; ++k) {                       // column 4L + k = lane L of u[k], u[4 + k], u[8 + k], u[12 + k]
    const __m512 v0 = _mm512_shuffle_f32x4(u[k], u[4 + k], 0x88), v1 = _mm512_shuffle_f32x4(u[k], u[4 + k], 0xDD);
    const __m512 w0 = _mm512_shuffle_f32x4(u[8 + k], u[12 + k], 0x88);
    const __m512 w1 = _mm512_shuffle_f32x4(u[8 + k], u[12 + k], 0xDD);
    out[k] = _mm512_shuffle_f32x4(v0, w0, 0x88);
    out[8 + k] = _mm512_shuffle_f32x4(v0, w0, 0xDD);
    out[4 + k] = _mm512_shuffle_f32x4(v1, w1, 0x88);
    out[12 + k] = _mm512_shuffle_f32x4(v1, w1, 0xDD);
  }
}
// in [16][16] fp32 (row r at in + r * ld) -> out[c] = column c
inline void transpose16(const float* in, int64_t ld, __m512 out[16]) {
  __m512 rows[16];
  for (int r = 0; r < 16; ++r) rows[r] = _mm512_loadu_ps(in + r * ld);
  transpose16(rows, out);
}

// Block b of n inputs (rows[j]: input b * AMX_BLOCK + j, a row of K bf16 values, K even) into the inputs'
// pair-interleaved layout at `dst`: blocks of AMX_BLOCK inputs, block b at dst + b * AMX_BLOCK * K laid out
// [K/2][nb][2] (nb: the inputs in that block). 16 inputs' 16 pairs at a time through a register transpose (one
// 64-byte store a pair row, not 16 scattered 4-byte ones), the rest one by one.
inline void put_vnni_block(const uint16_t* const* rows, int64_t K, int64_t b, int64_t n, uint16_t* dst) {
  const int64_t nb = std::min(AMX_BLOCK, n - b * AMX_BLOCK), pairs = K / 2;
  float* d = reinterpret_cast<float*>(dst + b * AMX_BLOCK * K);    // [pairs][nb] 4-byte pairs, as bits
  const int64_t nb16 = nb / 16 * 16, p16 = pairs / 16 * 16;
  for (int64_t j = 0; j < nb16; j += 16)
    for (int64_t k = 0; k < p16; k += 16) {
      __m512 in[16], col[16];
      for (int r = 0; r < 16; ++r)                  // input j + r's pairs k.. (rows may be 2-byte aligned)
        in[r] = _mm512_castsi512_ps(_mm512_loadu_si512(rows[j + r] + 2 * k));
      transpose16(in, col);
      for (int c = 0; c < 16; ++c) _mm512_storeu_ps(d + (k + c) * nb + j, col[c]);
    }
  for (int64_t j = 0; j < nb; ++j)                  // inputs past the 16s, pairs past the 16s of the others
    for (int64_t k = j < nb16 ? p16 : 0; k < pairs; ++k)
      reinterpret_cast<uint32_t*>(d)[k * nb + j] = bf16_pair_bits(rows[j] + 2 * k);
}

// `put_vnni_block`'s layout of n inputs back to rows: rows[j * K ..] = input j's K values (for a rare fallback)
inline void vnni_to_rows(const uint16_t* src, int64_t K, int64_t n, uint16_t* rows) {
  for (int64_t b = 0; b * AMX_BLOCK < n; ++b) {
    const int64_t nb = std::min(AMX_BLOCK, n - b * AMX_BLOCK);
    const uint16_t* d = src + b * AMX_BLOCK * K;                    // [K/2][nb][2]
    for (int64_t j = 0; j < nb; ++j)
      for (int64_t k = 0; k < K / 2; ++k) std::memcpy(rows + (b * AMX_BLOCK + j) * K + 2 * k, d + (k * nb + j) * 2, 4);
  }
}

// c [rows][nb] fp32 (row i at c + i * ldc) -> o[j * ldo + i] = c[i][j]: 16 x 16 blocks through registers, the
// edges one by one (against a strided scalar copy: 512-token prefill 1.03x on `small`, 1.04x on `20b-shape`)
inline void transpose_to(const float* c, int64_t ldc, int64_t rows, int64_t nb, float* o, int64_t ldo) {
  const int64_t rows16 = rows / 16 * 16, nb16 = nb / 16 * 16;
  for (int64_t i0 = 0; i0 < rows16; i0 += 16)
    for (int64_t j0 = 0; j0 < nb16; j0 += 16) {
      __m512 col[16];
      transpose16(c + i0 * ldc + j0, ldc, col);
      for (int k = 0; k < 16; ++k) _mm512_storeu_ps(o + (j0 + k) * ldo + i0, col[k]);
    }
  for (int64_t j = 0; j < nb; ++j)
    for (int64_t i = j < nb16 ? rows16 : 0; i < rows; ++i) o[j * ldo + i] = c[i * ldc + j];
}

// Where the AMX forms put their sums: a sink takes a block c [rows][nb] fp32 (row i at c + i * ldc) holding
// rows [g0, g0 + rows) of the matrix times inputs [j0, j0 + nb) (g0 a multiple of 16, j0 of AMX_BLOCK, nb at
// most AMX_BLOCK). `SumsToOut` writes them as the other forms do, out[input * ldo + row]; the MoE's gate_up
// has its own (moe.cpp `SwigluToVnni`: the SwiGLU straight into the down projection's inputs).
struct SumsToOut {
  float* out;
  int64_t ldo;
  void operator()(const float* c, int64_t ldc, int64_t g0, int64_t rows, int64_t j0, int64_t nb) const {
    transpose_to(c, ldc, rows, nb, out + j0 * ldo + g0, ldo);
  }
};

// a [rows, K] bf16 (row-major: rows g0.. of a matrix) times n inputs in `put_vnni_block`'s layout -> sink,
// block by block of AMX_BLOCK inputs through an fp32 [rows, nb] tile buffer (rows <= AMX_STRIP)
template <typename Sink>
inline void rows_times_inputs_amx(const uint16_t* a, int64_t g0, int64_t rows, int64_t K, const uint16_t* vnni,
                                  int64_t n, const Sink& sink) {
  float* c = scratch(4, rows * AMX_BLOCK);
  for (int64_t b = 0; b * AMX_BLOCK < n; ++b) {
    const int64_t nb = std::min(AMX_BLOCK, n - b * AMX_BLOCK);
    at::native::cpublas::brgemm(rows, nb, K, K, nb, nb, false, reinterpret_cast<const at::BFloat16*>(a),
                                reinterpret_cast<const at::BFloat16*>(vnni + b * AMX_BLOCK * K), c, true);
    sink(c, nb, g0, rows, b * AMX_BLOCK, nb);
  }
}

// rows [r0, r1) of an expert matrix (blk, scl: its first row; G groups a row) times its n inputs in
// `put_vnni_block`'s layout (K = the inputs' chunk-padded length, (G + 3) / 4 * 128) -> sink.
// False (nothing written) when a scale of the strip leaves the bf16 values subnormal or infinite.
template <typename Sink>
inline bool expert_rows_amx(const uint8_t* blk, const uint8_t* scl, int64_t G, int64_t r0, int64_t r1,
                            const uint16_t* vnni, int64_t n, const Sink& sink) {
  const int64_t K = (G + 3) / 4 * 128, rows = r1 - r0;
  uint16_t* wb = reinterpret_cast<uint16_t*>(scratch(0, rows * K / 2 + 16));   // A [rows, K]
  if (!decode_rows_scaled_bf16(blk + r0 * G * 16, scl + r0 * G, G, rows, wb, K)) return false;
  rows_times_inputs_amx(wb, r0, rows, K, vnni, n, sink);
  return true;
}

// Our own tile code needs a compiler that knows the AMX intrinsics (GCC 11, clang 12); an older one builds the
// kernels without it, and those experts take `expert_rows_amx`.
#if defined(__clang__)
#if __clang_major__ >= 12
#define GD_AMX_OWN_TILES 1
#endif
#elif defined(__GNUC__) && __GNUC__ >= 11
#define GD_AMX_OWN_TILES 1
#endif

#ifdef GD_AMX_OWN_TILES
// Experts with at most this many inputs (one tile's 16 columns) take `expert_rows_amx_l1`: the strip's decode
// to L2 and back was what `expert_rows_amx` cost them (all 32 experts of a `small` layer with 8 inputs each:
// 4.9 against 6.1 ms; 20b-shape decode steps at batch 32 1.15x)
constexpr int64_t AMX_TILE_INPUTS = 16;

struct alignas(64) TileConfig {                       // the `ldtilecfg` operand (palette 1)
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};                             // bytes a row, per tile
  uint8_t rows[16] = {};
};

// sum tiles C0, C1 += 16 decoded rows' chunk `a` ([16][128]) times its 64 input pairs `b` ([64][n][2]), the
// chunk's four K steps of 32 alternating between the two sums; tiles 2, 3 take the rows, 4, 5 the inputs.
// (The tile intrinsics paste their tile numbers into the instruction text, hence a macro, not a template.)
#define GD_CHUNK_PRODUCTS(NAME, C0, C1)                                                                        \
  __attribute__((target("amx-tile,amx-bf16"))) inline void NAME(const uint16_t* a, const uint16_t* b, int64_t n) { \
    const int64_t ldb = n * 4;                          /* bytes an input pair-row */                          \
    _tile_loadd(2, a, 256);                                                                                    \
    _tile_loadd(4, b, ldb);                                                                                    \
    _tile_dpbf16ps(C0, 2, 4);                                                                                  \
    _tile_loadd(3, a + 32, 256);                                                                               \
    _tile_loadd(5, b + 16 * n * 2, ldb);                                                                       \
    _tile_dpbf16ps(C1, 3, 5);                                                                                  \
    _tile_loadd(2, a + 64, 256);                                                                               \
    _tile_loadd(4, b + 32 * n * 2, ldb);                                                                       \
    _tile_dpbf16ps(C0, 2, 4);                                                                                  \
    _tile_loadd(3, a + 96, 256);                                                                               \
    _tile_loadd(5, b + 48 * n * 2, ldb);                                                                       \
    _tile_dpbf16ps(C1, 3, 5);                                                                                  \
  }
GD_CHUNK_PRODUCTS(chunk_products_even, 0, 1)
GD_CHUNK_PRODUCTS(chunk_products_odd, 6, 7)
#undef GD_CHUNK_PRODUCTS

// rows [r0, r1) (at most AMX_STRIP) of an expert matrix times its n <= AMX_TILE_INPUTS inputs in
// `put_vnni_block`'s layout -> sink, as `expert_rows_amx`. Groups of 16 rows alternate between two
// pairs of sum tiles (0, 1 and 6, 7), so a group's sums are stored once the next group's first chunk is under way
// and the store does not wait for the last products of its own group.
template <typename Sink>
__attribute__((target("amx-tile,amx-bf16")))
inline bool expert_rows_amx_l1(const uint8_t* blk, const uint8_t* scl, int64_t G, int64_t r0, int64_t r1,
                               const uint16_t* vnni, int64_t n, const Sink& sink) {
  if (!scales_fit_bf16(scl + r0 * G, (r1 - r0) * G)) return false;
  TileConfig cfg;                    // sums [16 rows][n] fp32, rows [16][32 values], inputs [16 pairs][n][2]
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = uint16_t(t == 2 || t == 3 ? 64 : n * 4);
  }
  _tile_loadconfig(&cfg);
  const ScaledChunkDecoder decode;
  const int64_t chunks = (G + 3) / 4;
  uint16_t* abuf = reinterpret_cast<uint16_t*>(scratch(0, 2 * 16 * 128 / 2));   // two [16][128] chunk buffers
  float* cbuf = scratch(4, 2 * 16 * 16);                                       // [2][16][16] sums of a group
  const auto store = [&](int64_t g0, bool odd) {        // the finished group at row g0 -> sink
    if (odd) { _tile_stored(6, cbuf, 64); _tile_stored(7, cbuf + 256, 64); }
    else { _tile_stored(0, cbuf, 64); _tile_stored(1, cbuf + 256, 64); }
    for (int r = 0; r < 16; ++r)                        // the two sums' halves of K
      _mm512_store_ps(cbuf + r * 16, _mm512_add_ps(_mm512_load_ps(cbuf + r * 16), _mm512_load_ps(cbuf + 256 + r * 16)));
    sink(cbuf, 16, g0, std::min<int64_t>(16, r1 - g0), 0, n);
  };
  // step s = (group k, chunk c): decode step s + 1 into the other buffer before step s's products load
  // theirs, so a tile load never waits for the stores that just wrote its rows
  const int64_t groups = (r1 - r0 + 15) / 16, steps = groups * chunks;
  const auto decode_step = [&](int64_t s) {
    const int64_t g0 = r0 + s / chunks * 16, c = s % chunks, rows = std::min<int64_t>(16, r1 - g0);
    uint16_t* a = abuf + (s & 1) * 16 * 128;        // a short last group: the tiles' other rows unused
    const int ng = int(std::min<int64_t>(4, G - 4 * c));
    for (int64_t r = 0; r < rows; ++r) {
      const uint8_t* p = blk + (g0 + r) * G * 16 + c * 64;
      prefetch_l2(p, MOE_PREFETCH_ROWS * G * 16);       // the same line of the next group
      decode(p, scl + (g0 + r) * G + 4 * c, ng, a + r * 128);
    }
  };
  decode_step(0);
  for (int64_t s = 0; s < steps; ++s) {
    const int64_t k = s / chunks, c = s % chunks;
    const bool odd = k & 1;
    if (s + 1 < steps) decode_step(s + 1);
    if (c == 0) { if (odd) { _tile_zero(6); _tile_zero(7); } else { _tile_zero(0); _tile_zero(1); } }
    const uint16_t* a = abuf + (s & 1) * 16 * 128;
    const uint16_t* b = vnni + c * 64 * n * 2;          // the chunk's 64 input pairs
    if (odd) chunk_products_odd(a, b, n); else chunk_products_even(a, b, n);
    if (c == 0 && k > 0) store(r0 + (k - 1) * 16, !odd);
  }
  store((r1 - r0 - 1) / 16 * 16 + r0, ((r1 - r0 - 1) / 16) & 1);
  _tile_release();
  at::native::cpublas::brgemm_release();   // the next oneDNN GEMM of this thread configures its tiles again
  return true;
}
#endif  // GD_AMX_OWN_TILES

// An AMX expert's rows [r0, r1) times its n inputs in `put_vnni_block`'s layout: our own tile code up to
// AMX_TILE_INPUTS inputs, oneDNN's GEMM over decoded strips beyond. False as those are.
template <typename Sink>
inline bool expert_rows_on_tiles(const uint8_t* blk, const uint8_t* scl, int64_t G, int64_t r0, int64_t r1,
                                 const uint16_t* vnni, int64_t n, const Sink& sink) {
#ifdef GD_AMX_OWN_TILES
  if (n <= AMX_TILE_INPUTS) return expert_rows_amx_l1(blk, scl, G, r0, r1, vnni, n, sink);
#endif
  return expert_rows_amx(blk, scl, G, r0, r1, vnni, n, sink);
}

#endif

// rows a work item of an AMX expert with n inputs of K values: our own tile code's strips, or oneDNN's taller ones
inline int64_t amx_strip_rows(int64_t n, int64_t K) {
#ifdef GD_AMX_OWN_TILES
  if (n <= AMX_TILE_INPUTS) return AMX_STRIP;
#endif
  return std::clamp(AMX_GEMM_STRIP_BYTES / (2 * K) / AMX_STRIP * AMX_STRIP, AMX_STRIP, 4 * AMX_STRIP);
}
}  // namespace gd
