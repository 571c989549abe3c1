// The kernels' entry points (defined in their own sources), for the op registrations (ops.cpp) and the
// layer loop that calls them directly (gk_program.cpp).
#pragma once

#include <ATen/ATen.h>
#include <string>
#include <tuple>

namespace gd {
at::Tensor moe_mxfp4(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                     const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, double, double, int64_t);
at::Tensor mxfp4_dequant(const at::Tensor&, const at::Tensor&, at::ScalarType);
void mxfp4_dequant_into(const at::Tensor&, const at::Tensor&, at::Tensor);
at::Tensor swiglu(const at::Tensor&, double, double);
at::Tensor linear_small(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&);
at::Tensor paged_decode_attention(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                  const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, double, double,
                                  double, at::ScalarType);
std::tuple<at::Tensor, at::Tensor> paged_decode_attention_partial(const at::Tensor&, const at::Tensor&,
                                                                  const at::Tensor&, const at::Tensor&,
                                                                  const at::Tensor&, const at::Tensor&,
                                                                  const at::Tensor&, double, double, double);
at::Tensor rope_kv_write(const at::Tensor&, const at::Tensor&, const at::Tensor&, at::Tensor, at::Tensor,
                         const at::Tensor&, int64_t, double, double);
std::tuple<at::Tensor, at::Tensor> kv_gather(const at::Tensor&, const at::Tensor&, const at::Tensor&, double, double,
                                             at::ScalarType);
at::Tensor rms_norm(const at::Tensor&, const at::Tensor&, double);
at::Tensor prefill_attention(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
                             const at::Tensor&, double, int64_t);

bool prefill_attention_supported(int64_t);
// how the MoE multiplies bf16 inputs (bf16 dot products or fp32 FMAs): '' asks, 'auto' measures again, 'bf16' /
// 'fp32' set it
std::string product_form(const std::string&);
// whether the MoE's experts with many bf16 inputs run on AMX tiles: '' asks ('on', 'off' or 'unavailable'),
// 'auto' decides again, 'on' / 'off' set it
std::string amx_tiles_mode(const std::string&);
// how decode attention's fp32 form reads FP8 KV: '' asks ('table' or 'fp16'), 'auto' decides again, 'table' (by
// AVX512-VBMI byte table) / 'fp16' (through fp16 conversions) set it
std::string fp8_reads_mode(const std::string&);
// the fp32-product form `prefill_attention` runs where the AVX512-BF16 pair kernel does not (its inputs checked)
at::Tensor prefill_attention_f32(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
                                 const at::Tensor&, double, int64_t);

at::Tensor gk_decode_layers(at::Tensor x, at::TensorList stacks, at::TensorList k_bufs, at::TensorList v_bufs,
                            at::IntArrayRef layer_buffer, at::IntArrayRef layer_sliding, at::IntArrayRef layer_group,
                            const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& full_table,
                            const at::Tensor& swa_table, const at::Tensor& full_slot, const at::Tensor& swa_slot,
                            const at::Tensor& pos, const at::Tensor& pos_swa, const at::Tensor& active,
                            int64_t num_heads, int64_t window, double eps, double scale, double k_scale,
                            double v_scale, int64_t top_k, double alpha, double limit);
}  // namespace gd
