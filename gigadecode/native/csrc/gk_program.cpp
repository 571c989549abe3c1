// The GK program's layer loop as one call: every layer of a decode step — rms_norm -> qkv -> RoPE + KV write
// (packed-FP8 in place) -> paged attention over the block tables -> o-proj + residual -> rms_norm -> router +
// top-k -> the grouped MXFP4 MoE + residual — over the kernels of the other sources, called directly, in the
// order the Python loop over the ops (`gpt_oss_decode_mega_kernel` with the native blocks) calls them, so
// its result is bit-equal to that loop's. What it saves is the host work between ops: ~10 dispatches a layer
// through Python and the torch op registry.
#include "common.h"
#include "kernels.h"

namespace gd {

namespace {

// The per-layer stacks [L, ...], in the order the Python side passes them (`GK_STACKS` there)
enum Stack {
  INPUT_NORM, QKV_W, QKV_B, O_W, O_B, SINKS, POST_NORM, ROUTER_W, ROUTER_B,
  GU_BLOCKS, GU_SCALES, GU_BIAS, DN_BLOCKS, DN_SCALES, DN_BIAS, NUM_STACKS
};

}  // namespace

// x [Bt, H] (the embedded tokens) -> the hidden state after the last layer, [Bt, H]. Layer i uses KV buffer
// layer_buffer[i], the sliding (window) or full attention tables by layer_sliding[i], and group
// layer_group[i] of those tables ([G, Bt, n]) and write slots ([G, Bt]).
at::Tensor gk_decode_layers(at::Tensor x, at::TensorList stacks, at::TensorList k_bufs, at::TensorList v_bufs,
                            at::IntArrayRef layer_buffer, at::IntArrayRef layer_sliding, at::IntArrayRef layer_group,
                            const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& full_table,
                            const at::Tensor& swa_table, const at::Tensor& full_slot, const at::Tensor& swa_slot,
                            const at::Tensor& pos, const at::Tensor& pos_swa, const at::Tensor& active,
                            int64_t num_heads, int64_t window, double eps, double scale, double k_scale,
                            double v_scale, int64_t top_k, double alpha, double limit) {
  TORCH_CHECK(int64_t(stacks.size()) == NUM_STACKS, "gk_decode_layers: expected ", int64_t(NUM_STACKS), " stacks");
  const int64_t L = int64_t(layer_buffer.size());
  TORCH_CHECK(int64_t(layer_sliding.size()) == L && int64_t(layer_group.size()) == L,
              "gk_decode_layers: one buffer, kind and group per layer");
  for (const auto& t : stacks) TORCH_CHECK(t.dim() >= 1 && t.size(0) == L, "gk_decode_layers: a stack is not [L, ...]");
  TORCH_CHECK(k_bufs.size() == v_bufs.size(), "gk_decode_layers: one V buffer per K buffer");
  for (int64_t i = 0; i < L; ++i) {            // before any layer writes its KV
    TORCH_CHECK(layer_buffer[i] >= 0 && layer_buffer[i] < int64_t(k_bufs.size()), "gk_decode_layers: layer ", i,
                " buffer ", layer_buffer[i], " out of range");
    const at::Tensor& tables = layer_sliding[i] ? swa_table : full_table;
    const at::Tensor& slots = layer_sliding[i] ? swa_slot : full_slot;
    TORCH_CHECK(tables.dim() == 3 && slots.dim() == 2 && layer_group[i] >= 0 && layer_group[i] < tables.size(0) &&
                layer_group[i] < slots.size(0), "gk_decode_layers: layer ", i, " group ", layer_group[i],
                " has no table [G, Bt, n] and write slots [G, Bt]");
  }
  const at::Tensor pos_c = pos.contiguous(), pos_swa_c = pos_swa.contiguous();
  for (int64_t i = 0; i < L; ++i) {
    auto W = [&](Stack s) { return stacks[s].select(0, i); };
    const int64_t buf = layer_buffer[i], g = layer_group[i];
    at::Tensor k = k_bufs[buf], v = v_bufs[buf];
    const bool sliding = layer_sliding[i] != 0;
    const at::Tensor table = (sliding ? swa_table : full_table).select(0, g).contiguous();
    const at::Tensor slot = (sliding ? swa_slot : full_slot).select(0, g).contiguous();
    // attention, up to the o-proj
    at::Tensor h = rms_norm(x, W(INPUT_NORM), eps);
    const at::Tensor qkv = linear_small(h, W(QKV_W), W(QKV_B));
    const at::Tensor q = rope_kv_write(qkv, cos, sin, k, v, slot, num_heads, k_scale, v_scale);
    const at::Tensor a = paged_decode_attention(q, k, v, table, sliding ? pos_swa_c : pos_c, active, W(SINKS),
                                                sliding ? window : 0, scale, k_scale, v_scale, x.scalar_type());
    x = x + linear_small(a, W(O_W), W(O_B));
    // the MoE: softmax over the top-k router logits, then the grouped kernel
    h = rms_norm(x, W(POST_NORM), eps);
    const auto [top, idx] = at::topk(linear_small(h, W(ROUTER_W), W(ROUTER_B)), top_k, -1);
    x = x + moe_mxfp4(h, idx.contiguous(), at::softmax(top, -1).contiguous(), W(GU_BLOCKS), W(GU_SCALES),
                      W(GU_BIAS), W(DN_BLOCKS), W(DN_SCALES), W(DN_BIAS), alpha, limit, 0);
  }
  return x;
}

}  // namespace gd
