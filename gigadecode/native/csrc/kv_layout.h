// The paged KV buffers' layouts, shared by the attention kernels and the KV write: one buffer half is plain
// [nb, kv, B, d] (fp32 / bf16 / fp8) or, for K, packed-FP8 [nb, kv, B/2, d, 2] (element [b, h, p, j, s] =
// token 2p+s, dim j).
#pragma once

#include <array>

#include "common.h"

namespace gd {

// shape of one buffer half: returns (num_blocks, kv, B, d); packed K is [nb, kv, B/2, d, 2]
inline std::array<int64_t, 4> kv_dims(const at::Tensor& k, const at::Tensor& v) {
  TORCH_CHECK(v.dim() == 4 && (k.dim() == 4 || (k.dim() == 5 && k.size(4) == 2)),
              "KV: expected V [nb, kv, B, d] and K [nb, kv, B, d] or packed [nb, kv, B/2, d, 2], got K ", k.sizes(),
              " V ", v.sizes());
  TORCH_CHECK(k.is_contiguous() && v.is_contiguous(), "KV buffers must be contiguous");
  const int64_t nb = v.size(0), kv = v.size(1), B = v.size(2), d = v.size(3);
  const bool packed = k.dim() == 5;
  TORCH_CHECK(k.size(0) == nb && k.size(1) == kv && (packed ? (k.size(2) * 2 == B && k.size(3) == d) : (k.size(2) == B && k.size(3) == d)),
              "K ", k.sizes(), " does not match V ", v.sizes());
  TORCH_CHECK(!packed || elem_of(k) == Elem::FP8, "packed K must be FP8");
  return {nb, kv, B, d};
}

}  // namespace gd
