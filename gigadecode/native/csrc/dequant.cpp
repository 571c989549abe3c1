// The small MXFP4 and activation ops of the per-layer model: the exact MXFP4 -> dense decode (into a reused
// transient) and the fused clamped SwiGLU.
#include "common.h"

namespace gd {

// blocks [..., R, G, 16], scales [..., R, G] -> out [..., R, G*32] (float32 or bfloat16, contiguous; exact)
void mxfp4_dequant_into(const at::Tensor& blocks, const at::Tensor& scales, at::Tensor out) {
  TORCH_CHECK(blocks.scalar_type() == at::kByte && scales.scalar_type() == at::kByte, "MXFP4 must be uint8");
  TORCH_CHECK(blocks.dim() >= 2 && blocks.size(-1) == 16 && blocks.sizes().slice(0, blocks.dim() - 1) == scales.sizes(),
              "MXFP4 shape mismatch: blocks ", blocks.sizes(), " vs scales ", scales.sizes());
  TORCH_CHECK(out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16,
              "dequant dtype must be float32 or bfloat16");
  TORCH_CHECK(out.is_contiguous() && out.numel() == scales.numel() * 32 && out.dim() == scales.dim() &&
              out.size(-1) == scales.size(-1) * 32, "dequant out must be contiguous [..., R, G*32] for scales ",
              scales.sizes(), " (got ", out.sizes(), ")");
  at::Tensor b = blocks.contiguous(), s = scales.contiguous();
  const int64_t groups = s.numel();
  const uint8_t* bp = b.data_ptr<uint8_t>();
  const uint8_t* sp = s.data_ptr<uint8_t>();
  const float* e8 = e8m0_table();
  const bool bf = out.scalar_type() == at::kBFloat16;
  void* op = out.data_ptr();
  at::parallel_for(0, groups, 256, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const VF sc = vset1(e8[sp[g]]);
      for (int c = 0; c < 16 / W; ++c) {             // W bytes -> 2W values
        VF even, odd, first, second;
        vdecode_e2m1(bp + g * 16 + c * W, sc, even, odd);
        vinterleave(even, odd, first, second);
        const int64_t o = g * 32 + c * 2 * W;
        if (bf) {
          vstore_bf16_exact(static_cast<uint16_t*>(op) + o, first);
          vstore_bf16_exact(static_cast<uint16_t*>(op) + o + W, second);
        } else {
          vstore(static_cast<float*>(op) + o, first);
          vstore(static_cast<float*>(op) + o + W, second);
        }
      }
    }
  });
}

at::Tensor mxfp4_dequant(const at::Tensor& blocks, const at::Tensor& scales, at::ScalarType dtype) {
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "dequant dtype must be float32 or bfloat16");
  TORCH_CHECK(scales.dim() >= 1, "MXFP4 scales must have a group dimension");
  std::vector<int64_t> shape(scales.sizes().begin(), scales.sizes().end());
  shape.back() *= 32;
  at::Tensor out = at::empty(shape, blocks.options().dtype(dtype));
  mxfp4_dequant_into(blocks, scales, out);
  return out;
}

// gate_up [T, 2I] (bias added; gate = even, up = odd columns) -> (up + 1) · gate · sigmoid(alpha · gate) [T, I]
// with gate clamped above at `limit` and up to [-limit, limit]; fp32 math, one rounding to x's dtype
at::Tensor swiglu(const at::Tensor& gate_up, double alpha, double limit) {
  check_float_like(gate_up, "gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "swiglu: gate_up must be [T, 2I], got ", gate_up.sizes());
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2;
  at::Tensor out = at::empty({T, I}, gate_up.options());
  const bool bf = gate_up.scalar_type() == at::kBFloat16;
  const float a = float(alpha), lim = float(limit);
  const void* src = gate_up.data_ptr();
  at::parallel_for(0, T, 8, [&](int64_t t0, int64_t t1) {
    float* act = scratch(0, 2 * I + W);
    float* up = act + I;
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t i = 0; i < I; ++i) {
        const int64_t o = t * 2 * I + 2 * i;
        const float g = bf ? bf16_to_f32(static_cast<const uint16_t*>(src)[o]) : static_cast<const float*>(src)[o];
        const float u = bf ? bf16_to_f32(static_cast<const uint16_t*>(src)[o + 1])
                           : static_cast<const float*>(src)[o + 1];
        act[i] = std::min(g, lim);
        up[i] = std::min(std::max(u, -lim), lim);
      }
      swiglu_inplace(act, up, I, a, bf);
      store_row(act, out, t * I, I);
    }
  });
  return out;
}

}  // namespace gd
