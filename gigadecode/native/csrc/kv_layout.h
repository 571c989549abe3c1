// The paged KV buffers' layouts, shared by the attention kernels and the KV write: one buffer half is plain
// [nb, kv, B, d] (fp32 / bf16 / fp8) or, for K, packed-FP8 [nb, kv, B/2, d, 2] (element [b, h, p, j, s] =
// token 2p+s, dim j), and the conversion of cache elements (float, bf16 or FP8 bytes) to fp32 as they are read.
#pragma once

#include <array>
#include <type_traits>

#include "common.h"

namespace gd {

// shape of one buffer half: returns (num_blocks, kv, B, d); packed K is [nb, kv, B/2, d, 2]
inline std::array<int64_t, 4> kv_dims(const at::Tensor& k, const at::Tensor& v) {
  TORCH_CHECK(v.dim() == 4 && (k.dim() == 4 || (k.dim() == 5 && k.size(4) == 2)),
              "KV: expected V [nb, kv, B, d] and K [nb, kv, B, d] or packed [nb, kv, B/2, d, 2], got K ", k.sizes(),
              " V ", v.sizes());
  TORCH_CHECK(k.is_contiguous() && v.is_contiguous(), "KV buffers must be contiguous");
  const int64_t nb = v.size(0), kv = v.size(1), B = v.size(2), d = v.size(3);
  // slots are split by B and q heads grouped by kv: neither may be 0 (an integer division by zero kills the process)
  TORCH_CHECK(B > 0 && kv > 0, "KV: block size and kv heads must be >= 1, got V ", v.sizes());
  const bool packed = k.dim() == 5;
  TORCH_CHECK(k.size(0) == nb && k.size(1) == kv && (packed ? (k.size(2) * 2 == B && k.size(3) == d) : (k.size(2) == B && k.size(3) == d)),
              "K ", k.sizes(), " does not match V ", v.sizes());
  TORCH_CHECK(!packed || elem_of(k) == Elem::FP8, "packed K must be FP8");
  return {nb, kv, B, d};
}

template <typename T>
inline VF kvload(const T* p) {
  if constexpr (std::is_same_v<T, float>) return vload(p);
  else if constexpr (std::is_same_v<T, uint16_t>) return vload_bf16(p);
  else return vload_fp8_div256(p);
}
// scalar twin of kvload (FP8 also divided by 256: the caller's multiplier folds it back)
template <typename T>
inline float kvscalar(const T* p) {
  if constexpr (std::is_same_v<T, float>) return *p;
  else if constexpr (std::is_same_v<T, uint16_t>) return bf16_to_f32(*p);
  else return fp8_to_f32(*p) * (1.f / 256.f);
}
// n cache elements -> fp32 (FP8 / 256, as kvload), four or two vectors at a time where the type has a wider load
template <typename T>
inline void convert_row(const T* src, int64_t n, float* dst) {
  int64_t c = 0;
  if constexpr (std::is_same_v<T, uint8_t>) {
    for (; c + 4 * W <= n; c += 4 * W) {
      VF v[4];
      vload4_fp8_div256(src + c, v);
      for (int i = 0; i < 4; ++i) vstore(dst + c + i * W, v[i]);
    }
    for (; c + 2 * W <= n; c += 2 * W) {
      VF a, b;
      vload2_fp8_div256(src + c, a, b);
      vstore(dst + c, a);
      vstore(dst + c + W, b);
    }
  }
  for (; c + W <= n; c += W) vstore(dst + c, kvload(src + c));
  for (; c < n; ++c) dst[c] = kvscalar(src + c);
}
// what a loaded element is multiplied by: FP8 carries its per-tensor scale (and the 256 of kvload); plain
// fp32 / bf16 KV is stored unscaled
template <typename T>
float kv_multiplier(double scale) { return std::is_same_v<T, uint8_t> ? float(scale) * 256.f : 1.f; }

}  // namespace gd
