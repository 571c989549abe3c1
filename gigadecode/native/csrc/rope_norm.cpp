// The small fused pieces of a layer around attention: RoPE on q and k with the K/V written into the paged
// buffer (packed-FP8 or plain, in place), the blocks of a table read back token-major in the compute dtype
// (prefill attends over them), and RMSNorm.
#include <tuple>
#include <vector>

#include "common.h"
#include "kv_layout.h"

namespace gd {

// qkv [Bt, (nh + 2 kv) d] -> q [Bt, nh, d] fp32 with RoPE; RoPE'd k and v written to slot[b] of the KV buffer
at::Tensor rope_kv_write(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_cache,
                         at::Tensor v_cache, const at::Tensor& slot, int64_t num_heads, double k_scale, double v_scale) {
  check_float_like(qkv, "qkv");
  const auto [nb, kv, B, d] = kv_dims(k_cache, v_cache);
  const int64_t Bt = qkv.size(0), nh = num_heads, half = d / 2;
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == (nh + 2 * kv) * d, "qkv ", qkv.sizes(), " does not match ", nh,
              " q heads, ", kv, " kv heads of dim ", d);
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == Bt && cos.size(1) == half && sin.sizes() == cos.sizes(),
              "cos/sin must be [Bt, d/2]");
  TORCH_CHECK(d % 2 == 0, "rope_kv_write: head dim ", d, " is odd (RoPE rotates halves)");
  TORCH_CHECK(slot.scalar_type() == at::kLong && slot.numel() == Bt && slot.is_contiguous(),
              "slot must be int64 [Bt], contiguous");
  const bool packed = k_cache.dim() == 5;
  const Elem ke = elem_of(k_cache), ve = elem_of(v_cache);
  const float* x = rows_as_f32(qkv, 0);
  at::Tensor cc = cos.contiguous(), ss = sin.contiguous();
  const FloatView cv(cc), sv(ss);
  at::Tensor q = at::empty({Bt, nh, d}, qkv.options().dtype(at::kFloat));
  float* qo = q.data_ptr<float>();
  const int64_t* sl = slot.data_ptr<int64_t>();
  const int64_t W3 = (nh + 2 * kv) * d;
  void* kp = k_cache.data_ptr();
  void* vp = v_cache.data_ptr();
  const float ks = float(k_scale), vs = float(v_scale);
  // n values into a buffer of element type e from index i0, `stride` elements apart (FP8: x / scale clamped)
  auto store = [](void* base, Elem e, int64_t i0, int64_t stride, const float* val, int64_t n, float scale) {
    if (e == Elem::F32) {
      float* o = static_cast<float*>(base) + i0;
      for (int64_t j = 0; j < n; ++j) o[j * stride] = val[j];
    } else if (e == Elem::BF16) {
      uint16_t* o = static_cast<uint16_t*>(base) + i0;
      for (int64_t j = 0; j < n; ++j) o[j * stride] = f32_to_bf16(val[j]);
    } else {
      uint8_t* o = static_cast<uint8_t*>(base) + i0;
      for (int64_t j = 0; j < n; ++j) o[j * stride] = f32_to_fp8(std::min(std::max(val[j] / scale, -448.f), 448.f));
    }
  };
  for (int64_t b = 0; b < Bt; ++b)
    TORCH_CHECK(sl[b] >= 0 && sl[b] / B < nb, "slot ", sl[b], " outside the KV buffer");
  // slots in parallel (padding slots all write the null block 0, whose contents are never read)
  at::parallel_for(0, Bt, 1, [&](int64_t b0, int64_t b1) {
    // one RoPE'd k head [d] and the slot's cos / sin [d/2] (any head_dim: GPT-OSS configs do not bound it)
    std::vector<float> scratch(2 * d);
    float* rk = scratch.data();
    float* c = rk + d;
    float* sn = c + half;
    for (int64_t b = b0; b < b1; ++b) {
      const float* xb = x + b * W3;
      for (int64_t j = 0; j < half; ++j) {
        c[j] = cv[b * half + j];
        sn[j] = sv[b * half + j];
      }
      auto rope = [&](const float* src, float* dst) {
        for (int64_t j = 0; j < half; ++j) {
          const float x1 = src[j], x2 = src[j + half];
          dst[j] = x1 * c[j] - x2 * sn[j];
          dst[j + half] = x2 * c[j] + x1 * sn[j];
        }
      };
      for (int64_t h = 0; h < nh; ++h) rope(xb + h * d, qo + (b * nh + h) * d);
      const int64_t blk = sl[b] / B, off = sl[b] % B;
      for (int64_t h = 0; h < kv; ++h) {
        rope(xb + (nh + h) * d, rk);
        // packed K: dim j of token off at ((pair * d) + j) * 2 + off % 2; plain: token-major rows
        if (packed) store(kp, ke, (((blk * kv + h) * (B / 2) + off / 2) * d) * 2 + off % 2, 2, rk, d, ks);
        else store(kp, ke, ((blk * kv + h) * B + off) * d, 1, rk, d, ks);
        store(vp, ve, ((blk * kv + h) * B + off) * d, 1, xb + (nh + kv + h) * d, d, vs);
      }
    }
  });
  return q;
}

// n contiguous cache elements of type e from element i0 -> fp32 (`convert_row`; FP8 times `kv_multiplier`:
// (value / 256) * (256 scale), one rounding, as value * scale)
static void kv_row_f32(const void* base, Elem e, int64_t i0, int64_t n, double scale, float* out) {
  if (e == Elem::F32) return convert_row(static_cast<const float*>(base) + i0, n, out);
  if (e == Elem::BF16) return convert_row(static_cast<const uint16_t*>(base) + i0, n, out);
  convert_row(static_cast<const uint8_t*>(base) + i0, n, out);
  const float m = kv_multiplier<uint8_t>(scale);
  for (int64_t j = 0; j < n; ++j) out[j] *= m;
}

// blocks `block_ids` [n] of a K/V buffer pair -> k, v [n * B, kv, d] token-major in `dtype` (fp32 or bf16; FP8
// values times their scale, rounded once; plain bf16 / fp32 buffers unscaled)
std::tuple<at::Tensor, at::Tensor> kv_gather(const at::Tensor& k_cache, const at::Tensor& v_cache,
                                             const at::Tensor& block_ids, double k_scale, double v_scale,
                                             at::ScalarType dtype) {
  const auto [nb, kv, B, d] = kv_dims(k_cache, v_cache);
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "kv_gather: dtype must be float32 or bfloat16");
  TORCH_CHECK(block_ids.scalar_type() == at::kLong && block_ids.dim() == 1 && block_ids.is_contiguous(),
              "kv_gather: block_ids must be int64 [n]");
  const int64_t n = block_ids.numel();
  const int64_t* ids = block_ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(ids[i] >= 0 && ids[i] < nb, "kv_gather: block ", ids[i], " outside the buffer");
  at::Tensor k = at::empty({n * B, kv, d}, k_cache.options().dtype(dtype));
  at::Tensor v = at::empty({n * B, kv, d}, v_cache.options().dtype(dtype));
  const bool packed = k_cache.dim() == 5;
  const Elem ke = elem_of(k_cache), ve = elem_of(v_cache);
  const void* kp = k_cache.data_ptr();
  const void* vp = v_cache.data_ptr();
  at::parallel_for(0, n * kv, 1, [&](int64_t i0, int64_t i1) {
    float* row = scratch(0, 4 * d);                   // [d] a row; packed K: [2d] a token pair's values, then [d]
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t blk = ids[i / kv], h = i % kv, first = (i / kv) * B;   // the block's first output token
      const int64_t src = (blk * kv + h) * B * d;                         // [blk, h] in either layout
      for (int64_t t = 0; t < B; ++t) {
        const int64_t o = ((first + t) * kv + h) * d;
        kv_row_f32(vp, ve, src + t * d, d, v_scale, row);
        store_row(row, v, o, d);
        if (!packed) {
          kv_row_f32(kp, ke, src + t * d, d, k_scale, row);
          store_row(row, k, o, d);
        } else if (t % 2 == 0) {                      // tokens t, t + 1: their d (token t, token t + 1) pairs
          kv_row_f32(kp, ke, src + t * d, 2 * d, k_scale, row);
          float* one = row + 2 * d;
          for (int64_t s = 0; s < 2; ++s) {
            for (int64_t j = 0; j < d; ++j) one[j] = row[2 * j + s];
            store_row(one, k, o + s * kv * d, d);
          }
        }
      }
    }
  });
  return {k, v};
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_float_like(x, "x");
  TORCH_CHECK(x.dim() == 2 && weight.numel() == x.size(1), "rms_norm: x ", x.sizes(), " vs weight ", weight.sizes());
  const int64_t M = x.size(0), H = x.size(1);
  const float* xf = rows_as_f32(x, 0);
  const at::Tensor wc = weight.to(at::kFloat).contiguous();   // bf16 weights: H values converted once
  const float* wp = wc.data_ptr<float>();
  at::Tensor out = at::empty_like(x);
  const int64_t Hv = H / W * W;
  at::parallel_for(0, M, 4, [&](int64_t m0, int64_t m1) {
    float* row = scratch(1, H);
    for (int64_t m = m0; m < m1; ++m) {
      const float* xr = xf + m * H;
      VF acc = vzero();
      for (int64_t j = 0; j < Hv; j += W) acc = vfma(vload(xr + j), vload(xr + j), acc);
      float ss = vsum(acc);
      for (int64_t j = Hv; j < H; ++j) ss += xr[j] * xr[j];
      const float inv = 1.f / std::sqrt(ss / float(H) + float(eps));
      const VF iv = vset1(inv);
      for (int64_t j = 0; j < Hv; j += W) vstore(row + j, vmul(vload(wp + j), vmul(vload(xr + j), iv)));
      for (int64_t j = Hv; j < H; ++j) row[j] = wp[j] * (xr[j] * inv);
      store_row(row, out, m * H, H);
    }
  });
  return out;
}

}  // namespace gd
