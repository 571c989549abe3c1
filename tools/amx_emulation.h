// The AMX-BF16 tile instructions and PyTorch's bf16 batch-reduce GEMM, emulated, for a build of the native
// kernels that runs their AMX paths on a CPU without AMX (tools/isa_check.py's `avx512-bf16-amx` check,
// force-included ahead of every source; the sources' `at::native::cpublas::` calls are renamed to
// `gd_amx_emu::` there). For checking the AMX paths' results on any x86-64; never for speed.
//
// Tiles: eight thread-local [16][64-byte] registers shaped by the last `_tile_loadconfig` (palette 1: each
// tile's rows and bytes a row). A load or store moves the configured rows x bytes, the rest of a tile stays
// zero; the shape rules of the instructions are checked (a break aborts, where the hardware faults).
// `_tile_dpbf16ps(c, a, b)`: c[m][n] += a's row m · b's column n over K = a.colsb / 4 pairs, b laid out
// [K][n][2] ("VNNI"). The sums are those of an Emerald Rapids Xeon's tiles, bit for bit (tests/
// test_amx_emulation.py compares on a CPU with AMX): the even products of a (a[m][2k] * b[k][2n], exact in
// fp32) are summed in k order, the odd ones apart, each sum rounded to fp32 at every step, and c gets
// (even + odd) in one rounded add; bf16 subnormal inputs count as zero and a subnormal result is flushed to
// zero (DAZ / FTZ, whatever MXCSR says). (Not the Intel SDM's pseudocode, which adds the pair's products to
// c one after the other: that rounds about half the sums of random 16-pair tiles otherwise.)
// `brgemm` (bf16 x bf16 -> fp32, B pair-interleaved [K/2][ld_b][2]) sums as PyTorch 2.13's oneDNN AMX kernel
// does, bit for bit: K in equal steps of the most pairs up to a tile's 16 that divide K/2 (K = 98: 7 steps
// of 7 pairs), each step a tile product into the sums, which start as C (add_C) or zero.
#pragma once
#include <immintrin.h>

#include <c10/core/ScalarType.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace gd_amx_emu {

[[noreturn]] inline void fault(const char* what) {   // where the hardware raises #UD / #GP
  std::fprintf(stderr, "amx_emulation: %s\n", what);
  std::abort();
}

struct Tiles {
  bool configured = false;
  uint8_t rows[8] = {};
  uint16_t colsb[8] = {};
  alignas(64) uint8_t data[8][16][64] = {};
};
inline Tiles& tiles() {
  static thread_local Tiles t;
  return t;
}
// oneDNN loads its tile configuration at a GEMM only when the thread's last GEMM had another shape, so our
// own tile code after a GEMM must end in `brgemm_release` (or a next GEMM of that shape runs on our tiles'
// shapes); a GEMM after tile code without it aborts here, whatever its shape. `gemm_loaded`: oneDNN holds
// its configuration loaded; `clobbered`: our tile code replaced it since.
struct GemmContext {
  bool gemm_loaded = false, clobbered = false;
};
inline GemmContext& gemm_context() {
  static thread_local GemmContext g;
  return g;
}

// bf16 -> fp32 with denormals as zero; an fp32 result with a subnormal flushed to zero
inline float bf16_daz(uint16_t h) {
  uint32_t u = (h & 0x7f80u) == 0 ? uint32_t(h & 0x8000u) << 16 : uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline float ftz(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7f800000u) == 0) u &= 0x80000000u;
  std::memcpy(&f, &u, 4);
  return f;
}

// c[m][n] (ldc floats a row) += a's row m (lda bf16 a row) · b's column n (b: [pairs][ldb][2]), m < M, n < N,
// over `pairs` pairs, in the tiles' order: even and odd products summed apart, then c + (even + odd)
inline void dot_pairs(const uint16_t* a, int64_t lda, const uint16_t* b, int64_t ldb, float* c, int64_t ldc,
                      int64_t M, int64_t N, int64_t pairs) {
  static thread_local std::vector<float> sums;
  sums.resize(2 * N);
  float* even = sums.data();
  float* odd = even + N;
  for (int64_t m = 0; m < M; ++m) {
    std::fill(even, even + 2 * N, 0.f);
    for (int64_t k = 0; k < pairs; ++k) {
      const float a0 = bf16_daz(a[m * lda + 2 * k]), a1 = bf16_daz(a[m * lda + 2 * k + 1]);
      const uint16_t* bk = b + k * ldb * 2;
      for (int64_t n = 0; n < N; ++n) {   // products exact in fp32: a fused add rounds as a separate one
        even[n] = ftz(even[n] + a0 * bf16_daz(bk[2 * n]));
        odd[n] = ftz(odd[n] + a1 * bf16_daz(bk[2 * n + 1]));
      }
    }
    for (int64_t n = 0; n < N; ++n) c[m * ldc + n] = ftz(c[m * ldc + n] + ftz(even[n] + odd[n]));
  }
}

inline void tile_loadconfig(const void* config) {
  const uint8_t* p = static_cast<const uint8_t*>(config);
  Tiles& t = tiles();
  t = Tiles{};
  gemm_context().clobbered |= gemm_context().gemm_loaded;
  if (p[0] == 0) return;                                       // palette 0: tiles off
  if (p[0] != 1 || p[1] != 0) fault("ldtilecfg: palette other than 1, or a start row");
  for (int i = 0; i < 16; ++i) {
    uint16_t colsb;
    std::memcpy(&colsb, p + 16 + 2 * i, 2);
    const uint8_t rows = p[48 + i];
    if (i >= 8 ? colsb || rows : rows > 16 || colsb > 64 || (rows == 0) != (colsb == 0))
      fault("ldtilecfg: a tile's shape beyond 16 rows x 64 bytes (or of tiles 8-15)");
    if (i < 8) t.rows[i] = rows, t.colsb[i] = colsb;
  }
  t.configured = true;
}
inline Tiles& configured(int i) {
  Tiles& t = tiles();
  if (!t.configured || i < 0 || i > 7 || t.rows[i] == 0) fault("a tile instruction on an unconfigured tile");
  return t;
}
inline void tile_loadd(int i, const void* base, int64_t stride) {
  Tiles& t = configured(i);
  std::memset(t.data[i], 0, sizeof t.data[i]);
  for (int r = 0; r < t.rows[i]; ++r) std::memcpy(t.data[i][r], static_cast<const char*>(base) + r * stride, t.colsb[i]);
}
inline void tile_stored(int i, void* base, int64_t stride) {
  Tiles& t = configured(i);
  for (int r = 0; r < t.rows[i]; ++r) std::memcpy(static_cast<char*>(base) + r * stride, t.data[i][r], t.colsb[i]);
}
inline void tile_zero(int i) { std::memset(configured(i).data[i], 0, sizeof tiles().data[i]); }
inline void tile_release() {
  tiles() = Tiles{};
  gemm_context().clobbered |= gemm_context().gemm_loaded;
}
inline void tile_dpbf16ps(int c, int a, int b) {
  Tiles& t = configured(c);
  configured(a), configured(b);
  if (c == a || c == b || a == b) fault("tdpbf16ps: a tile used twice");
  if (t.colsb[a] % 4 || t.colsb[c] % 4 || t.colsb[a] / 4 != t.rows[b] || t.colsb[c] != t.colsb[b] ||
      t.rows[c] != t.rows[a])
    fault("tdpbf16ps: the tiles' shapes do not match");
  dot_pairs(reinterpret_cast<const uint16_t*>(t.data[a]), 32, reinterpret_cast<const uint16_t*>(t.data[b]), 16,
            reinterpret_cast<float*>(t.data[c]), 16, t.rows[c], t.colsb[c] / 4, t.colsb[a] / 4);
}

// PyTorch's `at::native::cpublas` calls of the kernels: C [M][ld_c] (+)= A [M][ld_a] x B [K/2][ld_b][2]
inline void brgemm(int64_t M, int64_t N, int64_t K, int64_t ld_a, int64_t ld_b, int64_t ld_c, bool add_C,
                   const at::BFloat16* A, const at::BFloat16* B, float* C, bool is_vnni = false) {
  if (!is_vnni || K % 2) fault("brgemm: bf16 operands other than pair-interleaved B with K even");
  GemmContext& g = gemm_context();
  if (g.clobbered) fault("brgemm after our own tile code without brgemm_release: it would run on our tiles");
  tiles() = Tiles{};                                   // its configuration replaces ours
  g.gemm_loaded = true;
  if (!add_C)
    for (int64_t m = 0; m < M; ++m) std::fill(C + m * ld_c, C + m * ld_c + N, 0.f);
  const uint16_t* a = reinterpret_cast<const uint16_t*>(A);
  const uint16_t* b = reinterpret_cast<const uint16_t*>(B);
  int64_t step = std::max<int64_t>(1, std::min<int64_t>(16, K / 2));   // pairs a tile product
  while ((K / 2) % step) --step;
  for (int64_t k0 = 0; k0 < K; k0 += 2 * step) dot_pairs(a + k0, ld_a, b + k0 * ld_b, ld_b, C, ld_c, M, N, step);
}
inline void brgemm_release(bool = true) {
  tiles() = Tiles{};
  gemm_context() = GemmContext{};
}
inline bool could_pack(c10::ScalarType t) { return t == c10::kBFloat16; }   // "AMX present"

}  // namespace gd_amx_emu

#ifndef GD_AMX_EMU_KEEP_INTRINSICS   // (the comparison with the real tiles keeps both)
#undef _tile_loadd
#undef _tile_stored
#undef _tile_zero
#undef _tile_dpbf16ps
#define _tile_loadconfig(config) gd_amx_emu::tile_loadconfig(config)
#define _tile_loadd(t, base, stride) gd_amx_emu::tile_loadd((t), (base), (stride))
#define _tile_stored(t, base, stride) gd_amx_emu::tile_stored((t), (base), (stride))
#define _tile_zero(t) gd_amx_emu::tile_zero(t)
#define _tile_dpbf16ps(c, a, b) gd_amx_emu::tile_dpbf16ps((c), (a), (b))
#define _tile_release() gd_amx_emu::tile_release()
#endif
