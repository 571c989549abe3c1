// bf16 products on AMX tiles (AVX512-BF16 builds on CPUs with AMX-BF16), through PyTorch's oneDNN
// batch-reduce GEMM (`at::native::cpublas::brgemm`: bf16 x bf16 -> fp32, no rounding of the sums to bf16):
// the MoE's experts with many bf16 inputs (moe.cpp) and the dense projections' bf16 weights at 5 inputs or
// more (linear.cpp) and prefill attention's scores and P·V (prefill_attention.cpp), where the fp32 FMAs (or vdpbf16ps) of the other forms are the bottleneck and a tile
// multiply does ~10x their products a cycle. An expert's strip of rows is decoded once
// (`decode_rows_scaled_bf16`: exact bf16 values in the 128-value chunk order of the bf16 inputs) and
// multiplied with its inputs; a dot product may take its terms in any order as long as both sides use the
// same one, so the inputs stay in the chunk order too. The GEMM wants its second operand pair-interleaved
// ("VNNI": [K/2][n][2]): that operand is the inputs, which `put_vnni` lays out once per expert (or call),
// so no weight is repacked. Products are exact, sums fp32 in the tile's order: the same values as the other
// forms up to fp32 rounding.
#pragma once

#include <ATen/native/CPUBlas.h>

#include "bf16dot.h"
#include "common.h"

namespace gd {

// whether bf16 products take AMX tiles where this file says (product_form.cpp: the CPU has AMX-BF16 and
// GIGADECODE_AMX is not 0, or the `amx_tiles` op set it)
bool amx_tiles_on();

// From 5 inputs the AMX form is ahead: the other forms' costs grow with the inputs, its cost is the strip's
// decode (an Intel Xeon with AMX, 2 threads, 8 experts of n inputs each, `small` / 20b shapes: n = 4 0.96x /
// 0.78x, 5 1.30x / 1.10x, 6 1.43x / 1.22x, 8 2.6x / 2.3x against the fp32 form)
constexpr int64_t AMX_MIN_INPUTS = 5;
constexpr int64_t AMX_BLOCK = 32;      // inputs per GEMM call (its N): two 16-column tiles
constexpr int64_t AMX_STRIP = 64;      // rows a work item (its M): 4 x 2 tiles of fp32 sums, each input tile
                                       // loaded once for four tiles of rows

#ifdef GD_BF16DOT
// Input j of an expert with n inputs, a row of K bf16 values (K even), into the expert's pair-interleaved
// inputs at `dst`: blocks of AMX_BLOCK inputs, block b at dst + b * AMX_BLOCK * K laid out [K/2][nb][2]
// (nb: the inputs in that block).
inline void put_vnni(const uint16_t* row, int64_t K, int64_t j, int64_t n, uint16_t* dst) {
  const int64_t b = j / AMX_BLOCK, jj = j % AMX_BLOCK, nb = std::min(AMX_BLOCK, n - b * AMX_BLOCK);
  uint32_t* d = reinterpret_cast<uint32_t*>(dst + b * AMX_BLOCK * K) + jj;
  const uint32_t* s = reinterpret_cast<const uint32_t*>(row);
  for (int64_t k = 0; k < K / 2; ++k) d[k * nb] = s[k];
}

// a [rows, K] bf16 (row-major) times n inputs in `put_vnni`'s layout -> out[i * ldo + r] = row r · input i,
// block by block of AMX_BLOCK inputs through an fp32 [rows, nb] tile buffer (rows <= AMX_STRIP)
inline void rows_times_inputs_amx(const uint16_t* a, int64_t rows, int64_t K, const uint16_t* vnni, int64_t n,
                                  float* out, int64_t ldo) {
  float* c = scratch(4, rows * AMX_BLOCK);
  for (int64_t b = 0; b * AMX_BLOCK < n; ++b) {
    const int64_t nb = std::min(AMX_BLOCK, n - b * AMX_BLOCK);
    at::native::cpublas::brgemm(rows, nb, K, K, nb, nb, false, reinterpret_cast<const at::BFloat16*>(a),
                                reinterpret_cast<const at::BFloat16*>(vnni + b * AMX_BLOCK * K), c, true);
    float* o = out + b * AMX_BLOCK * ldo;
    for (int64_t j = 0; j < nb; ++j)
      for (int64_t i = 0; i < rows; ++i) o[j * ldo + i] = c[i * nb + j];
  }
}

// rows [r0, r1) of an expert matrix (blk, scl: its first row; G groups a row) times its n inputs in
// `put_vnni`'s layout (K = the inputs' chunk-padded length, (G + 3) / 4 * 128) -> out[i * ldo + r] for i < n.
// False (nothing written) when a scale of the strip leaves the bf16 values subnormal or infinite.
inline bool expert_rows_amx(const uint8_t* blk, const uint8_t* scl, int64_t G, int64_t r0, int64_t r1,
                            const uint16_t* vnni, int64_t n, float* out, int64_t ldo) {
  const int64_t K = (G + 3) / 4 * 128, rows = r1 - r0;
  uint16_t* wb = reinterpret_cast<uint16_t*>(scratch(0, rows * K / 2 + 16));   // A [rows, K]
  if (!decode_rows_scaled_bf16(blk + r0 * G * 16, scl + r0 * G, G, rows, wb, K)) return false;
  rows_times_inputs_amx(wb, rows, K, vnni, n, out + r0, ldo);
  return true;
}

#endif
}  // namespace gd
