// Registers the native kernels as torch ops (namespace `gigadecode_native`), so Python calls them like any
// op and a compiled program sees each as one opaque node (fake implementations live in Python).
#include <torch/library.h>

#include "common.h"
#include "kernels.h"

namespace gd {
std::string isa() { return GD_ISA; }
}  // namespace gd

TORCH_LIBRARY(gigadecode_native, m) {
  m.def("moe_mxfp4(Tensor x, Tensor idx, Tensor gate_w, Tensor gate_up_blocks, Tensor gate_up_scales, "
        "Tensor gate_up_bias, Tensor down_blocks, Tensor down_scales, Tensor down_bias, float alpha, float limit, "
        "int expert_offset) -> Tensor");
  m.def("mxfp4_dequant(Tensor blocks, Tensor scales, ScalarType dtype) -> Tensor");
  m.def("mxfp4_dequant_into(Tensor blocks, Tensor scales, Tensor(a!) out) -> ()");
  m.def("swiglu(Tensor gate_up, float alpha, float limit) -> Tensor");
  m.def("linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor table, Tensor pos, Tensor active, "
        "Tensor sinks, int window, float scale, float k_scale, float v_scale, ScalarType out_dtype) -> Tensor");
  m.def("paged_decode_attention_partial(Tensor q, Tensor k_cache, Tensor v_cache, Tensor table, Tensor pos, "
        "Tensor first, Tensor active, float scale, float k_scale, float v_scale) -> (Tensor, Tensor)");
  m.def("rope_kv_write(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot, "
        "int num_heads, float k_scale, float v_scale) -> Tensor");
  m.def("kv_gather(Tensor k_cache, Tensor v_cache, Tensor block_ids, float k_scale, float v_scale, ScalarType dtype) "
        "-> (Tensor, Tensor)");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("prefill_attention(Tensor q, Tensor k, Tensor v, Tensor q_pos, int k_start, Tensor sinks, float scale, "
        "int window) -> Tensor");
  m.def("gk_decode_layers(Tensor x, Tensor[] stacks, Tensor(a!)[] k_bufs, Tensor(b!)[] v_bufs, int[] layer_buffer, "
        "int[] layer_sliding, int[] layer_group, Tensor cos, Tensor sin, Tensor full_table, Tensor swa_table, "
        "Tensor full_slot, Tensor swa_slot, Tensor pos, Tensor pos_swa, Tensor active, int num_heads, int window, "
        "float eps, float scale, float k_scale, float v_scale, int top_k, float alpha, float limit) -> Tensor");
  m.def("isa() -> str", &gd::isa);
  m.def("prefill_attention_supported(int head_dim) -> bool", &gd::prefill_attention_supported);
  m.def("product_form(str form) -> str", &gd::product_form);
  m.def("amx_tiles(str mode) -> str", &gd::amx_tiles_mode);
  m.def("fp8_reads(str mode) -> str", &gd::fp8_reads_mode);
}

TORCH_LIBRARY_IMPL(gigadecode_native, CPU, m) {
  m.impl("moe_mxfp4", &gd::moe_mxfp4);
  m.impl("mxfp4_dequant", &gd::mxfp4_dequant);
  m.impl("mxfp4_dequant_into", &gd::mxfp4_dequant_into);
  m.impl("swiglu", &gd::swiglu);
  m.impl("linear", &gd::linear_small);
  m.impl("paged_decode_attention", &gd::paged_decode_attention);
  m.impl("paged_decode_attention_partial", &gd::paged_decode_attention_partial);
  m.impl("rope_kv_write", &gd::rope_kv_write);
  m.impl("kv_gather", &gd::kv_gather);
  m.impl("rms_norm", &gd::rms_norm);
  m.impl("prefill_attention", &gd::prefill_attention);
  m.impl("gk_decode_layers", &gd::gk_decode_layers);
}
