// Helpers shared by the kernels: per-thread scratch that grows and is reused (a decode step allocates
// nothing per call once warm), element loads by dtype, E8M0 scales, a vectorized exp, checks.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <array>
#include <utility>
#include <vector>

#include "vec.h"

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#endif

namespace gd {

// n floats of `b`, grown when short, starting on a 64-byte line: a vector load from a row that starts
// mid-line splits across two lines every other time (malloc gives 16-byte alignment; a 32-byte AVX2 tile
// reading its inputs from such a buffer ran at half speed on a Zen 3)
inline float* aligned_part(std::vector<float>& b, size_t n) {
#if defined(__SANITIZE_ADDRESS__)
  // AddressSanitizer builds (tools/sanitize_check.py): only the n floats asked for are addressable, so an
  // access past them (or a slot reused while an earlier, longer request of it is still read) is reported
  // instead of landing in the slack or in stale contents
  ASAN_UNPOISON_MEMORY_REGION(b.data(), b.capacity() * sizeof(float));
#endif
  if (b.size() < n + 16) b.resize(n + 16);
  const uintptr_t p = reinterpret_cast<uintptr_t>(b.data());
  float* part = b.data() + ((64 - (p & 63)) & 63) / sizeof(float);
#if defined(__SANITIZE_ADDRESS__)
  ASAN_POISON_MEMORY_REGION(b.data(), (part - b.data()) * sizeof(float));
  ASAN_POISON_MEMORY_REGION(part + n, (b.data() + b.capacity() - (part + n)) * sizeof(float));
#endif
  return part;
}
// Reused scratch: `slot` separates the buffers one op needs at the same time. Each thread has its own.
inline float* scratch(int slot, size_t n) {
  thread_local std::vector<float> bufs[6];
  return aligned_part(bufs[slot], n);
}
// Scratch shared by the workers of one op: the calling thread's (workers write disjoint parts). Apart from
// `scratch`, which the calling thread also uses as a worker.
inline float* shared_scratch(int slot, size_t n) {
  thread_local std::vector<float> bufs[10];
  return aligned_part(bufs[slot], n);
}

enum class Elem { F32, BF16, FP8 };

inline Elem elem_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return Elem::F32;
    case at::kBFloat16: return Elem::BF16;
    case at::kFloat8_e4m3fn: case at::kByte: return Elem::FP8;
    default: TORCH_CHECK(false, "unsupported dtype ", t.scalar_type());
  }
}

inline float load_elem(const void* p, Elem e, int64_t i) {
  switch (e) {
    case Elem::F32: return static_cast<const float*>(p)[i];
    case Elem::BF16: return bf16_to_f32(static_cast<const uint16_t*>(p)[i]);
    default: return fp8_to_f32(static_cast<const uint8_t*>(p)[i]);
  }
}

// A float tensor of one row of a small (bias / norm / sink) tensor, read in place whatever its dtype.
struct FloatView {
  const void* p;
  Elem e;
  explicit FloatView(const at::Tensor& t) : p(t.data_ptr()), e(elem_of(t)) {
    TORCH_CHECK(t.is_contiguous(), "expected a contiguous tensor");
    TORCH_CHECK(e != Elem::FP8, "expected a float or bf16 tensor");
  }
  float operator[](int64_t i) const { return load_elem(p, e, i); }
};

// E8M0 byte -> 2^(s - 127) (s = 0 gives the fp32 subnormal 2^-127, s = 255 overflows to inf like torch's table)
inline const float* e8m0_table() {
  static const std::vector<float> t = [] {
    std::vector<float> v(256);
    for (int s = 0; s < 256; ++s) v[s] = float(std::ldexp(1.0, s - 127));
    return v;
  }();
  return t.data();
}

// n bf16 values -> fp32 (exact)
inline void bf16_to_f32_row(const uint16_t* p, int64_t n, float* out) {
  int64_t i = 0;
  for (; i + W <= n; i += W) vstore(out + i, vload_bf16(p + i));
  for (; i < n; ++i) out[i] = bf16_to_f32(p[i]);
}

// rows of `x` [M, K] (float or bf16) as contiguous fp32 [M, K] (a prefill chunk's rows converted over the
// threads; a decode batch's, too few to share, by the caller)
inline const float* rows_as_f32(const at::Tensor& x, int slot) {
  const int64_t n = x.numel();
  if (x.scalar_type() == at::kFloat) return x.data_ptr<float>();
  float* out = scratch(slot, n);
  const uint16_t* p = reinterpret_cast<const uint16_t*>(x.data_ptr());
  at::parallel_for(0, n, 1 << 16, [&](int64_t i0, int64_t i1) { bf16_to_f32_row(p + i0, i1 - i0, out + i0); });
  return out;
}

inline void store_row(const float* src, at::Tensor& out, int64_t off, int64_t n) {
  if (out.scalar_type() == at::kFloat) {
    std::memcpy(out.data_ptr<float>() + off, src, n * sizeof(float));
  } else {
    uint16_t* d = reinterpret_cast<uint16_t*>(out.data_ptr()) + off;
    int64_t i = 0;
#if defined(__AVX512BF16__)
    for (; i + 16 <= n; i += 16)                    // round to nearest even, as f32_to_bf16
      _mm256_storeu_si256((__m256i*)(d + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + i)));
#endif
    for (; i < n; ++i) d[i] = f32_to_bf16(src[i]);
  }
}

// Software prefetch of a weight stream, spread over the loop that reads it: every 64-byte line a tile loads
// from a row is paired with a prefetch of the line `lead` bytes further down the stream, so DRAM requests
// go out at the rate the tile consumes them, while it computes (on this Zen 4 the core otherwise computes
// and waits for memory in turn: with 8 inputs the dense stream ran at 1 / (1/compute + 1/DRAM)). A burst of
// a whole tile's rows a few tiles ahead, as before, gave 10-36% less (alternated decode steps: `20b-shape`
// batch 1 211 -> 155 ms, batch 8 599 -> 497 ms; `small` 1.07-1.1x). Into L2, not L1: a lead that covers
// DRAM latency would evict the tile's own lines from the 32 KB L1. Past-the-end is harmless (no fault).
constexpr int64_t LINEAR_PREFETCH_LEAD = 32 * 1024;   // bytes ahead in a dense weight's row stream
constexpr int64_t MOE_PREFETCH_ROWS = 16;             // rows ahead in an expert matrix (8 KB for H = 1024)
// (`prefetch_l2`, in vec.h, issues the prefetch of one such line.)

// A whole block at once (attention: the blocks of a table are scattered, so the next one is fetched by hand)
inline void prefetch_rows(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(c + off, _MM_HINT_T1);
}

// GPT-OSS's clamps on the gate_up sums (bias added) before the SwiGLU: the gate from above, the up both ways
inline void vclamp_gate_up(VF& gate, VF& up, float limit) {
  gate = vmin(vset1(limit), gate);
  up = vmin(vset1(limit), vmax(vset1(-limit), up));
}
// the fast SwiGLU of a clamped gate g and up u: (u + 1) · g · sigmoid(alpha · g), na = -alpha
inline VF vswiglu(VF g, VF u, VF na) {
  const VF one = vset1(1.f);
  const VF sig = vdiv(one, vadd(one, vexp_or_inf(vmul(na, g))));
  return vmul(vadd(u, one), vmul(g, sig));
}
// act[i] <- (up[i] + 1) · g · sigmoid(alpha · g), g = act[i] (already clamped). `fast`: vectorized (`vexp`,
// within a few ulp), for bf16 activations that round it away; else std::exp, as the fp32 model computes it
inline void swiglu_inplace(float* act, const float* up, int64_t n, float alpha, bool fast) {
  const VF na = vset1(-alpha);
  int64_t i = 0;
  for (; fast && i + W <= n; i += W) vstore(act + i, vswiglu(vload(act + i), vload(up + i), na));
  if (fast && i < n) {                             // the tail the same way (as the MoE's AMX experts take every value)
    alignas(64) float g[W] = {}, u[W] = {};
    std::copy(act + i, act + n, g);
    std::copy(up + i, up + n, u);
    vstore(g, vswiglu(vload(g), vload(u), na));
    std::copy(g, g + (n - i), act + i);
    return;
  }
  for (; i < n; ++i) act[i] = (up[i] + 1.f) * (act[i] / (1.f + std::exp(-alpha * act[i])));
}

// A table of register-tile kernels Tile<rt, tt>::run for every rt <= RT and tt <= TT, so a tail tile of any
// size runs a fully unrolled kernel: tiles[rt - 1][tt - 1].
template <typename Fn, template <int, int> class Tile, int RT, int... TTs>
constexpr std::array<Fn, sizeof...(TTs)> tile_row(std::integer_sequence<int, TTs...>) {
  return {&Tile<RT, TTs + 1>::run...};
}
template <typename Fn, template <int, int> class Tile, int TT, int... RTs>
constexpr std::array<std::array<Fn, TT>, sizeof...(RTs)> tile_table(std::integer_sequence<int, RTs...>) {
  return {tile_row<Fn, Tile, RTs + 1>(std::make_integer_sequence<int, TT>{})...};
}
template <typename Fn, template <int, int> class Tile, int RT, int TT>
constexpr auto make_tiles() { return tile_table<Fn, Tile, TT>(std::make_integer_sequence<int, RT>{}); }

// out[t * ldo + r] = w row r · x[t] for RT rows (row r at w + r*ldw) and TT inputs of K fp32 values (K a
// multiple of W): fp32 products and sums, all accumulators in registers
template <int RT, int TT>
struct DotTileF32 {
static void run(const float* w, int64_t ldw, int64_t K, const float* const* xs, float* out, int64_t ldo) {
  VF acc[RT * TT];
#pragma GCC unroll 16
  for (int i = 0; i < RT * TT; ++i) acc[i] = vzero();
  for (int64_t k = 0; k < K; k += W) {
    VF x[TT];
#pragma GCC unroll 16
    for (int t = 0; t < TT; ++t) x[t] = vload(xs[t] + k);
#pragma GCC unroll 16
    for (int r = 0; r < RT; ++r) {
      const VF wv = vload(w + r * ldw + k);
#pragma GCC unroll 16
      for (int t = 0; t < TT; ++t) acc[r * TT + t] = vfma(wv, x[t], acc[r * TT + t]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < RT; ++r)
#pragma GCC unroll 16
    for (int t = 0; t < TT; ++t) out[t * ldo + r] = vsum(acc[r * TT + t]);
}
};

// Strips of rows meet their inputs a block of about this many bytes at a time, every row of the strip passing
// over a block while it is in L2: an expert's inputs read from L3 once a strip, not once per tile of rows. All
// at once, a 20b-shape expert's ~128 inputs of a 1,024-token prefill chunk (1.5 MB in fp32) missed an Ice Lake
// Xeon's 1.25 MB L2 on every tile of rows: its MoE ran at 41 GMAC/s against 85 at 512 tokens.
constexpr int64_t STRIP_INPUT_BLOCK_BYTES = 256 * 1024;
// The tiles of a strip of `rows` rows times n inputs of `input_bytes` each: tile(r, rt, t, tt) for rt <= RT rows
// from r and tt <= TT inputs from t, the inputs a block at a time (a multiple of TT inputs of about
// STRIP_INPUT_BLOCK_BYTES), every tile of rows meeting a block before the next block; each tile's rows stay in
// L1 while a block passes
template <int RT, int TT, typename Tile>
inline void for_strip_tiles(int64_t rows, int64_t n, int64_t input_bytes, const Tile& tile) {
  const int64_t tb = std::max<int64_t>(TT, STRIP_INPUT_BLOCK_BYTES / std::max<int64_t>(1, input_bytes) / TT * TT);
  for (int64_t t0 = 0; t0 < n; t0 += tb) {
    const int64_t t1 = std::min(n, t0 + tb);
    for (int64_t r = 0; r < rows; r += RT)
      for (int64_t t = t0; t < t1; t += TT)
        tile(r, int(std::min<int64_t>(RT, rows - r)), t, int(std::min<int64_t>(TT, t1 - t)));
  }
}

// out[t * ldo + r] = row r · input t for `rows` fp32 rows of K values (row r at w + r*ld; K a multiple of W,
// zero-padded) and n inputs of K values, in DotTileF32 tiles (`for_strip_tiles`: a block of inputs stays in L2
// for all the rows). The
// strip paths (decoded MXFP4 expert rows, bf16 weight rows converted once) run on it. AVX2: 4 rows × 3 inputs
// (12 accumulators + 3 inputs + the row being read: all 16 registers; 1.2x the 3 x 3 tile alone on a Zen 3);
// AVX-512: 4 × 6 (24 + 6 + 1 of the 32). Each sum is one tile's, over all K: the blocks change no result.
inline void dot_rows_f32(const float* w, int64_t ld, int64_t K, int64_t rows, const float* const* xs, int64_t n,
                         float* out, int64_t ldo) {
  constexpr int RT = 4, TT = W == 16 ? 6 : 3;
  static const auto tiles = make_tiles<void (*)(const float*, int64_t, int64_t, const float* const*, float*,
                                                int64_t), DotTileF32, RT, TT>();
  for_strip_tiles<RT, TT>(rows, n, K * int64_t(sizeof(float)), [&](int64_t r, int rt, int64_t t, int tt) {
    tiles[rt - 1][tt - 1](w + r * ld, ld, K, xs + t, out + t * ldo + r, ldo);
  });
}

inline void check_float_like(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, name,
              " must be float32 or bfloat16 (got ", t.scalar_type(), ")");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

}  // namespace gd
