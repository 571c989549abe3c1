// The routed MXFP4 MoE (grouped by expert), for decode batches and prefill chunks alike.
//
// Weights stay in the checkpoint's MXFP4 layout, which is already the streamed one: a row's groups are
// contiguous (blocks [E, R, G, 16] bytes, two e2m1 codes per byte, low nibble first; scales [E, R, G] E8M0),
// so each selected expert's bytes stream from memory once per step for all of its tokens. This file owns the
// op: the routing grouped by expert, the inputs laid out once for the forms the experts take (by their
// number of inputs and the CPU: `expert_rows.h`'s register tiles and strips, `amx_tiles.h`'s AMX forms), the
// work split over threads by measured cost, the SwiGLU between the two projections (for the AMX experts on their
// gate_up sums as the tiles hand them over: `SwigluToVnni`) and the gate-weighted sums.
#include <algorithm>
#include <atomic>
#include <vector>

#include "amx_tiles.h"
#include "common.h"
#include "expert_rows.h"

namespace gd {

namespace {

// runs of work items a thread of the experts' products, taken one at a time (`run` in moe_mxfp4)
constexpr int64_t MOE_CHUNKS_PER_THREAD = 8;

struct Routing {
  std::vector<int64_t> expert_start;   // [n_local + 1] first pair of each local expert (pairs sorted by expert)
  std::vector<int64_t> pair_token;     // [P] token of each pair
  std::vector<float> pair_gate;        // [P] its gate weight
  std::vector<int64_t> active;         // local experts with at least one pair, ascending
};

Routing group_by_expert(const at::Tensor& idx, const at::Tensor& gate_w, int64_t n_local, int64_t offset) {
  const int64_t T = idx.size(0), k = idx.size(1);
  const int64_t* id = idx.data_ptr<int64_t>();
  at::Tensor gw = gate_w.to(at::kFloat).contiguous();
  const float* g = gw.data_ptr<float>();
  Routing r;
  r.expert_start.assign(n_local + 1, 0);
  for (int64_t i = 0; i < T * k; ++i) {
    const int64_t e = id[i] - offset;
    if (e >= 0 && e < n_local) r.expert_start[e + 1]++;
  }
  for (int64_t e = 0; e < n_local; ++e) {
    if (r.expert_start[e + 1]) r.active.push_back(e);
    r.expert_start[e + 1] += r.expert_start[e];
  }
  const int64_t P = r.expert_start[n_local];
  r.pair_token.resize(P);
  r.pair_gate.resize(P);
  std::vector<int64_t> fill(r.expert_start.begin(), r.expert_start.end() - 1);
  for (int64_t i = 0; i < T * k; ++i) {          // token order within an expert (stable)
    const int64_t e = id[i] - offset;
    if (e < 0 || e >= n_local) continue;
    r.pair_token[fill[e]] = i / k;
    r.pair_gate[fill[e]++] = g[i];
  }
  return r;
}

// W values of a float or bf16 bias from element o
inline VF bias_vec(const FloatView& b, int64_t o) {
  return b.e == Elem::F32 ? vload(static_cast<const float*>(b.p) + o) : vload_bf16(static_cast<const uint16_t*>(b.p) + o);
}

void check_mxfp4(const at::Tensor& blocks, const at::Tensor& scales, const char* name) {
  TORCH_CHECK(blocks.scalar_type() == at::kByte && scales.scalar_type() == at::kByte, name, ": MXFP4 must be uint8");
  TORCH_CHECK(blocks.dim() == 4 && blocks.size(3) == 16 && scales.dim() == 3 &&
              blocks.sizes().slice(0, 3) == scales.sizes(), name, ": expected blocks [E, R, G, 16] and scales [E, R, G]");
  TORCH_CHECK(blocks.is_contiguous() && scales.is_contiguous(), name, ": MXFP4 tensors must be contiguous");
}

#ifdef GD_BF16DOT
// The gate_up sums of an AMX expert go straight into the down projection's inputs: each 16-row group of sums
// (8 (gate, up) row pairs: activations a0 .. a0 + 7, a0 = row / 2 a multiple of 8) through the clamps and the
// SwiGLU to bf16, written into `put_vnni_block`'s layout of the activations in `deinterleave_bf16`'s chunk
// order, where activations a and a + 4 (a % 8 < 4) share a pair: pair c·64 + q·16 + L·4 + m (c = a0 / 128,
// L = a0 % 128 / 32, m = a0 % 32 / 8) holds activations a0 + q and a0 + q + 4 of each input. So the [pairs, 2I]
// sums never go to memory and back, and neither the SwiGLU nor the activations' layout is a pass of its own
// (a 512-token prefill: `small` 1.11x, `20b-shape` 1.09x). The values are those of the pass the other experts take.
struct SwigluToVnni {
  const FloatView& bias;   // gate_up's [E, 2I]
  int64_t bias0;           // the expert's first
  int64_t R1, I64;         // 2I; I in whole 128-value chunks
  uint16_t* av;            // the expert's activations, blocks of AMX_BLOCK inputs [I64 / 2][nb][2]
  float alpha, limit;
  // the pair holding activations a0 and a0 + 4 (a0 a multiple of 8); a0 + q and a0 + q + 4 are 16 q pairs on
  static int64_t first_pair(int64_t a0) { return a0 / 128 * 64 + a0 % 128 / 32 * 4 + a0 % 32 / 8; }
  void operator()(const float* c, int64_t ldc, int64_t g0, int64_t rows, int64_t j0, int64_t nb) const {
    uint32_t* d = reinterpret_cast<uint32_t*>(av + j0 * I64);   // the block's pairs [I64 / 2][nb]
    const VF na = vset1(-alpha);
    // activations of row pair (r, r + 1) of c (gate, up) for inputs j.. (m: those < nb), rounded to bf16. (2I
    // is a multiple of 64, so every strip and group of rows is whole.)
    const auto act = [&](int64_t r, int64_t j, __mmask16 m) {
      const int64_t g = g0 + r;
      VF gate{_mm512_add_ps(_mm512_maskz_loadu_ps(m, c + r * ldc + j), _mm512_set1_ps(bias[bias0 + g]))};
      VF up{_mm512_add_ps(_mm512_maskz_loadu_ps(m, c + (r + 1) * ldc + j), _mm512_set1_ps(bias[bias0 + g + 1]))};
      vclamp_gate_up(gate, up, limit);
      return (__m256i)_mm512_cvtneps_pbh(vswiglu(gate, up, na).v);
    };
    for (int64_t u = 0; u < rows; u += 16) {
      const int64_t pair0 = first_pair((g0 + u) / 2);
      for (int q = 0; q < 4; ++q)
        for (int64_t j = 0; j < nb; j += 16) {
          const __mmask16 m = nb - j >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (nb - j)) - 1);
          const __m512i lo = _mm512_cvtepu16_epi32(act(u + 2 * q, j, m));
          const __m512i hi = _mm512_cvtepu16_epi32(act(u + 2 * q + 8, j, m));
          _mm512_mask_storeu_epi32(d + (pair0 + 16 * q) * nb + j, m, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
        }
    }
    if (g0 + rows == R1)                              // the last chunk's activations past I: zeros (as the pass
      for (int64_t a0 = R1 / 2; a0 < I64; a0 += 8)   // pads them), which no group of rows writes
        for (int q = 0; q < 4; ++q) std::fill_n(d + (first_pair(a0) + 16 * q) * nb, nb, 0u);
  }
};

// sums of rows [r0, r0 + rows) of n inputs, sums[i * rows + r] (`expert_rows_bf16`, where a scale keeps an
// expert off the tiles) -> sink, a block of AMX_BLOCK inputs at a time
template <typename Sink>
void rows_to_sink(const float* sums, int64_t r0, int64_t rows, int64_t n, const Sink& sink) {
  float* c = scratch(5, rows * AMX_BLOCK);
  for (int64_t j0 = 0; j0 < n; j0 += AMX_BLOCK) {
    const int64_t nb = std::min(AMX_BLOCK, n - j0);
    transpose_to(sums + j0 * rows, rows, nb, rows, c, nb);   // c[r * nb + i] = sums[(j0 + i) * rows + r]
    sink(c, nb, r0, rows, j0, nb);
  }
}
#endif

}  // namespace

// out [T, H] = sum over the (token, slot) pairs routed to local experts of gate · expert(x[token]).
// expert(x) = W2 · swiglu(W1 · x + b1) + b2, with W1 = gate_up (rows interleaved gate, up), W2 = down.
at::Tensor moe_mxfp4(const at::Tensor& x, const at::Tensor& idx, const at::Tensor& gate_w,
                     const at::Tensor& gu_blocks, const at::Tensor& gu_scales, const at::Tensor& gu_bias,
                     const at::Tensor& dn_blocks, const at::Tensor& dn_scales, const at::Tensor& dn_bias,
                     double alpha, double limit, int64_t expert_offset) {
  check_float_like(x, "x");
  TORCH_CHECK(x.dim() == 2, "moe_mxfp4: x must be [T, H], got ", x.sizes());
  check_mxfp4(gu_blocks, gu_scales, "gate_up");
  check_mxfp4(dn_blocks, dn_scales, "down");
  TORCH_CHECK(idx.scalar_type() == at::kLong && idx.dim() == 2 && idx.size(0) == x.size(0) && idx.is_contiguous(),
              "idx must be int64 [T, k]");
  TORCH_CHECK(gate_w.sizes() == idx.sizes(), "gate_w must be [T, k] like idx");
  const int64_t T = x.size(0), H = x.size(1);
  const int64_t E = gu_blocks.size(0), R1 = gu_blocks.size(1), G1 = gu_blocks.size(2);
  const int64_t I = R1 / 2, G2 = dn_blocks.size(2);
  TORCH_CHECK(G1 * 32 == H && dn_blocks.size(1) == H && G2 * 32 == I && dn_blocks.size(0) == E && R1 % 2 == 0,
              "expert shapes do not match x: gate_up ", gu_blocks.sizes(), ", down ", dn_blocks.sizes(), ", x ", x.sizes());
  TORCH_CHECK(gu_bias.dim() == 2 && gu_bias.size(0) == E && gu_bias.size(1) == R1 && dn_bias.dim() == 2 &&
              dn_bias.size(0) == E && dn_bias.size(1) == H, "expert biases must be [E, 2I] and [E, H]");
  const FloatView b1(gu_bias), b2(dn_bias);
  Routing rt = group_by_expert(idx, gate_w, E, expert_offset);
  const int64_t P = rt.pair_token.size();
  at::Tensor out = at::zeros_like(x);
  if (P == 0) return out;

  const float* xf = rows_as_f32(x, 0);
#ifdef GD_BF16DOT
  const bool bf = x.scalar_type() == at::kBFloat16;   // bf16 activations: the exact bf16 dot-product path,
  const bool bf_f32 = bf && bf16_products() == PRODUCTS_F32;   // or fp32 FMAs where they are faster (2+ inputs)
#else
  const bool bf = false, bf_f32 = false;
#endif
  // bf16 activations on AVX2 and where AVX512-VNNI's int16 form is on: the experts run on int16-quantized inputs
  // (`expert_rows_i16`; AVX2's strips on the values they stand for, the VNNI form's on int16 words)
  const bool q16 = x.scalar_type() == at::kBFloat16 && int16_inputs();
  // whether an expert with n inputs multiplies fp32 inputs: every expert of fp32 activations; of bf16 ones,
  // those the fp32 form takes (AVX512-BF16) or AVX2's int16 form's strips; the rest bf16 or int16 inputs
  const auto fp32_expert = [&](int64_t n) {
    return q16 ? n >= Q_STRIP_MIN_INPUTS : bf ? bf_f32 && n >= F32_FORM_MIN_INPUTS : true;
  };
#ifdef GD_BF16DOT
  const bool amx = bf && amx_tiles_on();
#else
  const bool amx = false;
#endif
  const auto amx_expert = [&](int64_t n) { return amx && n >= AMX_MIN_INPUTS; };   // `amx_tiles.h`
  bool f32_inputs = false, amx_inputs = false;    // fp32 / pair-interleaved copies of the inputs: if some expert
  // takes that form. The pairs of the other experts go through the SwiGLU pass, which keeps their gate_up
  // outputs and activations in rows of its own: pass_first[e] = the pass row of e's first pair (the AMX
  // experts' SwiGLU runs on their sums in L1, `SwigluToVnni`, so they take no rows); pass_row[p] = pair p's
  // row there, -1 for the AMX experts' pairs
  std::vector<int64_t> pass_first(E, 0), pair_expert(P), pass_row(P, -1);
  int64_t pass_pairs = 0;
  for (int64_t e : rt.active) {
    const int64_t n = rt.expert_start[e + 1] - rt.expert_start[e];
    f32_inputs |= fp32_expert(n) && !amx_expert(n);
    amx_inputs |= amx_expert(n);
    for (int64_t p = rt.expert_start[e]; p < rt.expert_start[e + 1]; ++p) pair_expert[p] = e;
    if (amx_expert(n)) continue;
    pass_first[e] = pass_pairs;
    for (int64_t i = 0; i < n; ++i) pass_row[rt.expert_start[e] + i] = pass_pairs + i;
    pass_pairs += n;
  }
  const int64_t H64 = (H + 127) / 128 * 128, I64 = (I + 127) / 128 * 128;   // bf16 inputs: whole chunks
  const int64_t HS = input_stride(H), IS = input_stride(I);                 // fp32 inputs
  float* xd = shared_scratch(0, f32_inputs ? T * HS : 0);         // [T, H] fp32 inputs in the tiles' order
  const int64_t PP = pass_pairs;
  float* gu = shared_scratch(1, PP * R1);                          // [PP, 2I] gate_up outputs of the pass's pairs
  float* ad = shared_scratch(2, f32_inputs ? PP * IS : 0);         // [PP, I] their activations, likewise
  float* y = shared_scratch(3, P * H);                             // [P, H] down outputs
  uint16_t* xd16 = reinterpret_cast<uint16_t*>(shared_scratch(6, bf ? T * H64 / 2 : 0));   // bf16 inputs
  uint16_t* ad16 = reinterpret_cast<uint16_t*>(shared_scratch(7, bf ? PP * I64 / 2 : 0));
  constexpr int64_t QF = sizeof(QInput) / sizeof(float);
  const int64_t HQ = (H + Q_CHUNK - 1) / Q_CHUNK, IQ = (I + Q_CHUNK - 1) / Q_CHUNK;   // int16 inputs: chunks a row
  QInput* xq = reinterpret_cast<QInput*>(shared_scratch(4, q16 ? T * HQ * QF : 0));
  QInput* aq = reinterpret_cast<QInput*>(shared_scratch(5, q16 ? PP * IQ * QF : 0));
  uint16_t* xv = reinterpret_cast<uint16_t*>(shared_scratch(8, amx_inputs ? P * H64 / 2 : 0));   // [P, H64] and
  uint16_t* av = reinterpret_cast<uint16_t*>(shared_scratch(9, amx_inputs ? P * I64 / 2 : 0));   // [P, I64], VNNI
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
#ifdef GD_BF16DOT
      if (bf) {
        deinterleave_bf16(xf + t * H, H, xd16 + t * H64);
        if (f32_inputs) arrange_inputs(xf + t * H, H, xd + t * HS);   // bf16 values: exact in fp32
        continue;
      }
#endif
      if (q16) {
        float* v = f32_inputs ? scratch(1, H) : nullptr;   // the values, for the strips
        quantize_inputs(xf + t * H, H, xq + t * HQ, v);
        if (v) arrange_inputs(v, H, xd + t * HS);
        continue;
      }
      arrange_inputs(xf + t * H, H, xd + t * HS);
    }
  });
  std::vector<const float*> xin(P), ain(P);
  std::vector<const uint16_t*> xin16(P), ain16(P);
  std::vector<const QInput*> xinq(q16 ? P : 0), ainq(q16 ? P : 0);
  for (int64_t p = 0; p < P; ++p) {
    const int64_t q = std::max<int64_t>(pass_row[p], 0);   // (an AMX pair's activations: `av`, below)
    xin[p] = xd + rt.pair_token[p] * HS;
    ain[p] = ad + q * IS;
    xin16[p] = xd16 + rt.pair_token[p] * H64;
    ain16[p] = ad16 + q * I64;
    if (q16) xinq[p] = xq + rt.pair_token[p] * HQ, ainq[p] = aq + q * IQ;
  }
#ifdef GD_BF16DOT
  // the AMX experts' blocks of inputs (expert, first input of the block), pair-interleaved a block at a time
  std::vector<std::pair<int64_t, int64_t>> amx_blocks;
  for (int64_t e : rt.active) {
    const int64_t n = rt.expert_start[e + 1] - rt.expert_start[e];
    if (amx_expert(n))
      for (int64_t j = 0; j < n; j += AMX_BLOCK) amx_blocks.emplace_back(e, j);
  }
  at::parallel_for(0, int64_t(amx_blocks.size()), 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const auto [e, j] = amx_blocks[i];
      const int64_t first = rt.expert_start[e], n = rt.expert_start[e + 1] - first;
      put_vnni_block(xin16.data() + first + j, H64, j / AMX_BLOCK, n, xv + first * H64);
    }
  });   // (their activations are laid out so by the gate_up's sink, `SwigluToVnni`)
#endif
  const float a = float(alpha), lim = float(limit);
  const FloatView& gu_bias_view = b1;          // (`run`'s thread ranges are b0, b1)
  const uint8_t* gub = gu_blocks.data_ptr<uint8_t>();
  const uint8_t* gus = gu_scales.data_ptr<uint8_t>();
  const uint8_t* dnb = dn_blocks.data_ptr<uint8_t>();
  const uint8_t* dns = dn_scales.data_ptr<uint8_t>();

  // one work item = a strip of rows of one active expert (RT_MAX * 4 rows; on AMX tiles `amx_strip_rows`, where
  // taller strips reuse each tile of inputs for more rows), for all of that expert's pairs
  struct Item { int64_t e, r0, r1; };
  auto run = [&](const uint8_t* blk, const uint8_t* scl, int64_t R, int64_t G, const std::vector<const float*>& in,
                 const std::vector<const uint16_t*>& in16, const std::vector<const QInput*>& inq,
                 const uint16_t* vnni, float* dst, const int64_t* dst_first, bool swiglu) {
    // threads take runs of work items of about equal cost (an item's cost: its expert's inputs
    // times its rows, plus some for streaming its bytes), so one expert with many tokens does not leave a
    // thread idle
    // an item's cost a row, in the time measured for experts of n inputs (`small` and 20b shapes, one form at a
    // time): the register tiles' grows from ~9 + n (its bytes, then n inputs' products), the AMX forms' is
    // about their decode's, whatever n
    const auto item_cost = [&](int64_t n) { return amx_expert(n) ? 15 + n / 8 : n <= 4 ? 9 + n : 3 * n; };
    std::vector<Item> items;
    std::vector<int64_t> done(1, 0);                          // cumulative cost before item i
    for (int64_t e : rt.active) {
      const int64_t n = rt.expert_start[e + 1] - rt.expert_start[e];
      const int64_t strip = amx_expert(n) ? amx_strip_rows(n, G * 32) : RT_MAX * 4;
      for (int64_t r0 = 0; r0 < R; r0 += strip) {
        items.push_back({e, r0, std::min(R, r0 + strip)});
        done.push_back(done.back() + (items.back().r1 - r0) * item_cost(n));
      }
    }
    // The runs are cut finer than the threads (MOE_CHUNKS_PER_THREAD a thread) and each thread takes the next
    // free one (an atomic counter), so neither a misjudged cost nor a core slowed by something else (a VM's
    // other tenants) leaves the other threads waiting at the join.
    const int64_t threads = at::get_num_threads(), parts = threads * MOE_CHUNKS_PER_THREAD;
    const int64_t total = done.back(), n_items = items.size();
    const auto item_at = [&](int64_t c) {                 // first item of run c
      return std::lower_bound(done.begin(), done.end(), total * c / parts) - done.begin();
    };
    std::atomic<int64_t> next_run{0};
    at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
      bool used_amx = false;
      for (int64_t c; (c = next_run.fetch_add(1, std::memory_order_relaxed)) < parts;) {
        const int64_t i1 = std::min(item_at(c + 1), n_items);
        for (int64_t i = item_at(c); i < i1; ++i) {
          const int64_t e = items[i].e, r0 = items[i].r0, r1 = items[i].r1;
          const int64_t p0 = rt.expert_start[e], n = rt.expert_start[e + 1] - p0;
          const uint8_t* eb = blk + e * R * G * 16;                 // the expert's MXFP4 rows and scales
          const uint8_t* es = scl + e * R * G;
          float* out = dst + dst_first[e] * R;                      // its pairs' output rows
#ifdef GD_BF16DOT
          if (amx_expert(n)) {     // a scale outside the bf16 range: the bf16 tiles (which scale each group's sums)
            const uint16_t* v = vnni + p0 * ((G + 3) / 4 * 128);
            const auto on_tiles = [&](const auto& sink) {
              if (expert_rows_on_tiles(eb, es, G, r0, r1, v, n, sink)) return;
              // the bf16 tiles on the inputs as the tiles have them (the down projection's exist only there)
              const int64_t K = (G + 3) / 4 * 128;
              uint16_t* rows = reinterpret_cast<uint16_t*>(scratch(5, n * K / 2 + 16));
              vnni_to_rows(v, K, n, rows);
              std::vector<const uint16_t*> xs(n);
              for (int64_t j = 0; j < n; ++j) xs[j] = rows + j * K;
              if (!swiglu) return expert_rows_bf16(eb, es, G, r0, r1, xs.data(), n, out, R);
              // gate_up: the strip's sums [n, r1 - r0] in the thread's scratch (an AMX expert has no pass rows;
              // slot 1 is free once the inputs are laid out), then the same sink
              float* sums = scratch(1, n * (r1 - r0));         // sums[i * (r1 - r0) + r]: row r0 + r
              expert_rows_bf16(eb + r0 * G * 16, es + r0 * G, G, 0, r1 - r0, xs.data(), n, sums, r1 - r0);
              rows_to_sink(sums, r0, r1 - r0, n, sink);
            };
            if (swiglu) on_tiles(SwigluToVnni{gu_bias_view, e * R1, R1, I64, av + p0 * I64, a, lim});
            else on_tiles(SumsToOut{out, R});
            used_amx = true;
            continue;
          }
          if (bf && !fp32_expert(n)) {
            expert_rows_bf16(eb, es, G, r0, r1, in16.data() + p0, n, out, R);
            continue;
          }
#endif
#if defined(GD_X64_DECODE) || defined(GD_VNNI_FORM)
          if (q16 && !fp32_expert(n)) {
            expert_rows_i16(eb, es, G, r0, r1, inq.data() + p0, n, out, R);
            continue;
          }
#endif
          expert_rows_f32(eb, es, G, r0, r1, in.data() + p0, n, out, R);
        }
      }
      if (used_amx) at::native::cpublas::brgemm_release();   // the thread's AMX tile state
    });
  };
  run(gub, gus, R1, G1, xin, xin16, xinq, xv, gu, pass_first.data(), true);

  // swiglu on (gate, up) = (even, odd) columns with the gate_up bias, written deinterleaved for `down` (the AMX
  // experts' went straight to `av`: SwigluToVnni)
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    float* act = scratch(2, 2 * I + W);
    float* up = act + I;
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t e = pair_expert[p], q = pass_row[p];   // q: its row of gu, ad, ad16, aq
      if (q < 0) continue;                             // an AMX expert's pair
      const float* g = gu + q * R1;
      int64_t i = 0;                                   // gate clamped above, up both ways, bias added
      for (; i + W <= I; i += W) {
        VF gate, upv;
        const int64_t o = e * R1 + 2 * i;
        vdeinterleave(vadd(vload(g + 2 * i), bias_vec(b1, o)), vadd(vload(g + 2 * i + W), bias_vec(b1, o + W)),
                      gate, upv);
        vclamp_gate_up(gate, upv, lim);
        vstore(act + i, gate);
        vstore(up + i, upv);
      }
      for (; i < I; ++i) {
        act[i] = std::min(g[2 * i] + b1[e * R1 + 2 * i], lim);
        up[i] = std::min(std::max(g[2 * i + 1] + b1[e * R1 + 2 * i + 1], -lim), lim);
      }
      swiglu_inplace(act, up, I, a, x.scalar_type() == at::kBFloat16);
#ifdef GD_BF16DOT
      if (bf) {
        deinterleave_bf16(act, I, ad16 + q * I64);
        if (!f32_inputs) continue;
      }
#endif
      if (x.scalar_type() == at::kBFloat16)            // bf16 activations, as on the bf16 dot-product path
        for (int64_t i = 0; i < I; ++i) act[i] = bf16_to_f32(f32_to_bf16(act[i]));
      if (q16) {
        quantize_inputs(act, I, aq + q * IQ, f32_inputs ? act : nullptr);   // (in place: a group at a time)
        if (!f32_inputs) continue;
      }
      arrange_inputs(act, I, ad + q * IS);
    }
  });
  run(dnb, dns, H, G2, ain, ain16, ainq, av, y, rt.expert_start.data(), false);

  // out[t] = sum of its pairs (expert order) gate · (y + b2)
  std::vector<std::vector<int64_t>> tok_pairs(T);
  for (int64_t p = 0; p < P; ++p) tok_pairs[rt.pair_token[p]].push_back(p);
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    float* row = scratch(3, H);
    for (int64_t t = t0; t < t1; ++t) {
      if (tok_pairs[t].empty()) continue;
      std::fill(row, row + H, 0.f);
      for (int64_t p : tok_pairs[t]) {
        const float gt = rt.pair_gate[p];
        const int64_t e = pair_expert[p];
        const float* yp = y + p * H;
        int64_t j = 0;
        for (; j + W <= H; j += W)
          vstore(row + j, vfma(vadd(vload(yp + j), bias_vec(b2, e * H + j)), vset1(gt), vload(row + j)));
        for (; j < H; ++j) row[j] += (yp[j] + b2[e * H + j]) * gt;
      }
      store_row(row, out, t * H, H);
    }
  });
  return out;
}

}  // namespace gd
