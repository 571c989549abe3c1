// MXFP4 expert kernels: the routed MoE for decode (grouped by expert) and the exact MXFP4 -> dense decode
// used by prefill before its oneDNN GEMMs.
//
// Weights stay in the checkpoint's MXFP4 layout, which is already the streamed one: a row's groups are
// contiguous (blocks [E, R, G, 16] bytes, two e2m1 codes per byte, low nibble first; scales [E, R, G] E8M0).
// The kernel decodes a tile of RT rows of a group into fp32 registers (codes -> values by a vector table
// lookup, times the group's power of two: exact) and multiplies them with up to TT inputs at once, so each
// selected expert's bytes stream from memory once per step for all of its tokens. Inputs are stored
// "deinterleaved" per W-byte chunk ([W even elements][W odd elements]) so the low/high nibbles of a chunk
// meet their inputs without shuffles.
#include <array>
#include <utility>

#include "bf16dot.h"
#include "common.h"

namespace gd {

namespace {

constexpr int RT_MAX = W == 16 ? 4 : 2;   // rows per register tile
constexpr int TT_MAX = W == 16 ? 4 : 2;   // inputs per register tile

// x [K] -> deinterleaved chunks: out[c*2W + i] = x[2(cW + i)], out[c*2W + W + i] = x[2(cW + i) + 1]
inline void deinterleave(const float* x, int64_t K, float* out) {
  for (int64_t c = 0; c < K / (2 * W); ++c)
    for (int i = 0; i < W; ++i) {
      out[c * 2 * W + i] = x[2 * (c * W + i)];
      out[c * 2 * W + W + i] = x[2 * (c * W + i) + 1];
    }
}

// out[t * ldo + r] = row r · input t for RT rows (row r at blk + r*G*16, scales at scl + r*G) and TT inputs
template <int RT, int TT>
struct MxTile {
static void run(const uint8_t* blk, const uint8_t* scl, int64_t G, const float* const* xs, float* out, int64_t ldo) {
  const float* e8 = e8m0_table();
  VF acc[RT][TT];
#pragma GCC unroll 16
  for (int r = 0; r < RT; ++r)
#pragma GCC unroll 16
    for (int t = 0; t < TT; ++t) acc[r][t] = vzero();
  constexpr int CPG = 16 / W;             // chunks of W bytes per 32-value group
  for (int64_t g = 0; g < G; ++g) {
    VF s[RT];
#pragma GCC unroll 16
    for (int r = 0; r < RT; ++r) s[r] = vset1(e8[scl[r * G + g]]);
#pragma GCC unroll 16
    for (int cc = 0; cc < CPG; ++cc) {
      const int64_t c = g * CPG + cc;
      VF we[RT], wo[RT];
#pragma GCC unroll 16
      for (int r = 0; r < RT; ++r) vdecode_e2m1(blk + r * G * 16 + c * W, s[r], we[r], wo[r]);
#pragma GCC unroll 16
      for (int t = 0; t < TT; ++t) {
        const VF xe = vload(xs[t] + c * 2 * W), xo = vload(xs[t] + c * 2 * W + W);
#pragma GCC unroll 16
        for (int r = 0; r < RT; ++r) acc[r][t] = vfma(wo[r], xo, vfma(we[r], xe, acc[r][t]));
      }
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < RT; ++r)
#pragma GCC unroll 16
    for (int t = 0; t < TT; ++t) out[t * ldo + r] = vsum(acc[r][t]);
}
};

template <typename XT>
using MxFn = void (*)(const uint8_t*, const uint8_t*, int64_t, const XT* const*, float*, int64_t);

// rows [r0, r1) of expert matrix (blk, scl: the expert's first row) times `n` deinterleaved inputs
// -> out[i * ldo + r] for i < n, through a table of register tiles (`make_tiles`)
template <int RTM = RT_MAX, int TTM = TT_MAX, typename XT, typename Tiles>
void expert_rows(const Tiles& tiles, const uint8_t* blk, const uint8_t* scl, int64_t G, int64_t r0, int64_t r1,
                 const XT* const* xs, int64_t n, float* out, int64_t ldo) {
  for (int64_t r = r0; r < r1; r += RTM) {
    prefetch_rows(blk + (r + PREFETCH_TILES * RTM) * G * 16, RTM * G * 16);
    const int rt = int(std::min<int64_t>(RTM, r1 - r));
    for (int64_t t = 0; t < n; t += TTM) {
      const int tt = int(std::min<int64_t>(TTM, n - t));
      tiles[rt - 1][tt - 1](blk + r * G * 16, scl + r * G, G, xs + t, out + t * ldo + r, ldo);
    }
  }
}

const auto TILES = make_tiles<MxFn<float>, MxTile, RT_MAX, TT_MAX>();

#ifdef GD_BF16DOT
// bf16 inputs: x [K] -> chunks of 128 elements (four groups) in the lane order of decode_e2m1_bf16x4,
// zero-padded to whole chunks: out[c*128 + q*32 + L*8 + i] = x[c*128 + L*32 + {2i, 16+2i, 2i+1, 17+2i}[q]]
inline void deinterleave_bf16(const float* x, int64_t K, uint16_t* out) {
  static constexpr int OFF[4] = {0, 16, 1, 17};
  const int64_t chunks = (K + 127) / 128;
  for (int64_t c = 0; c < chunks; ++c)
    for (int q = 0; q < 4; ++q)
      for (int L = 0; L < 4; ++L)
        for (int i = 0; i < 8; ++i) {
          const int64_t e = c * 128 + L * 32 + OFF[q] + 2 * i;
          out[c * 128 + q * 32 + L * 8 + i] = e < K ? f32_to_bf16(x[e]) : 0;
        }
}

// acc + scale · (one 128-value chunk of a row · the input's chunk): four exact bf16 dot products, fp32 sums
inline __m512 chunk_dot(const __m512i w[4], const uint16_t* x, __m512 scale, __m512 acc) {
  __m512 part = dot_bf16(_mm512_setzero_ps(), w[0], x);
  part = dot_bf16(part, w[1], x + 32);
  part = dot_bf16(part, w[2], x + 64);
  part = dot_bf16(part, w[3], x + 96);
  return _mm512_fmadd_ps(part, scale, acc);
}

template <int RT, int TT>
struct MxTileBf16 {
static void run(const uint8_t* blk, const uint8_t* scl, int64_t G, const uint16_t* const* xs, float* out,
                int64_t ldo) {
  // acc[RT][TT], the decoded chunks and the scales must stay within the 32 zmm registers (a spill costs more
  // than it saves): up to two inputs decode all RT rows first, more inputs decode one row at a time and
  // meet every input of the tile with it (inputs re-read from L1)
  __m512 acc[RT][TT];
#pragma GCC unroll 16
  for (int r = 0; r < RT; ++r)
#pragma GCC unroll 16
    for (int t = 0; t < TT; ++t) acc[r][t] = _mm512_setzero_ps();
  __m512 s16[RT];
  for (int64_t c = 0; c < (G + 3) / 4; ++c) {
    const int j = int(c % 4);
    if (j == 0)                                       // the next 16 groups' scales
#pragma GCC unroll 16
      for (int r = 0; r < RT; ++r) s16[r] = e8m0_x16(scl + r * G + 4 * c, int(std::min<int64_t>(16, G - 4 * c)));
    const int nbytes = int(std::min<int64_t>(64, (G - 4 * c) * 16));
    if constexpr (TT <= 2) {                          // few inputs: decode every row first (more ILP)
      __m512i w[RT][4];
#pragma GCC unroll 16
      for (int r = 0; r < RT; ++r) decode_e2m1_bf16x4(blk + r * G * 16 + c * 64, nbytes, w[r]);
#pragma GCC unroll 16
      for (int t = 0; t < TT; ++t)
#pragma GCC unroll 16
        for (int r = 0; r < RT; ++r) acc[r][t] = chunk_dot(w[r], xs[t] + c * 128, quad_scales(s16[r], j), acc[r][t]);
    } else {                                          // many: one row's chunk live at a time (no spills)
#pragma GCC unroll 16
      for (int r = 0; r < RT; ++r) {
        __m512i w[4];
        decode_e2m1_bf16x4(blk + r * G * 16 + c * 64, nbytes, w);
        const __m512 sc = quad_scales(s16[r], j);
#pragma GCC unroll 16
        for (int t = 0; t < TT; ++t) acc[r][t] = chunk_dot(w, xs[t] + c * 128, sc, acc[r][t]);
      }
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < RT; ++r)
#pragma GCC unroll 16
    for (int t = 0; t < TT; ++t) out[t * ldo + r] = _mm512_reduce_add_ps(acc[r][t]);
}
};

const auto TILES_BF16 = make_tiles<MxFn<uint16_t>, MxTileBf16, RT_MAX, TT_MAX>();
// experts with more inputs than TT_MAX: 2 rows x 8 inputs, so each row's MXFP4 is decoded once for 8 inputs
constexpr int RT_WIDE = 2, TT_WIDE = 8;
const auto TILES_BF16_WIDE = make_tiles<MxFn<uint16_t>, MxTileBf16, RT_WIDE, TT_WIDE>();

void expert_rows_bf16(const uint8_t* blk, const uint8_t* scl, int64_t G, int64_t r0, int64_t r1,
                      const uint16_t* const* xs, int64_t n, float* out, int64_t ldo) {
  if (n > TT_MAX)
    expert_rows<RT_WIDE, TT_WIDE>(TILES_BF16_WIDE, blk, scl, G, r0, r1, xs, n, out, ldo);
  else
    expert_rows(TILES_BF16, blk, scl, G, r0, r1, xs, n, out, ldo);
}
#endif

// act[i] <- (up[i] + 1) · g · sigmoid(alpha · g), g = act[i] (already clamped). `fast`: vectorized (`vexp`,
// within a few ulp), for bf16 activations that round it away; else std::exp, as the fp32 model computes it
inline void swiglu_inplace(float* act, const float* up, int64_t n, float alpha, bool fast) {
  const VF one = vset1(1.f), na = vset1(-alpha);
  int64_t i = 0;
  for (; fast && i + W <= n; i += W) {
    const VF g = vload(act + i);
    const VF sig = vdiv(one, vadd(one, vexp(vmul(na, g))));
    vstore(act + i, vmul(vadd(vload(up + i), one), vmul(g, sig)));
  }
  for (; i < n; ++i) act[i] = (up[i] + 1.f) * (act[i] / (1.f + std::exp(-alpha * act[i])));
}

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

void check_mxfp4(const at::Tensor& blocks, const at::Tensor& scales, const char* name) {
  TORCH_CHECK(blocks.scalar_type() == at::kByte && scales.scalar_type() == at::kByte, name, ": MXFP4 must be uint8");
  TORCH_CHECK(blocks.dim() == 4 && blocks.size(3) == 16 && scales.dim() == 3 &&
              blocks.sizes().slice(0, 3) == scales.sizes(), name, ": expected blocks [E, R, G, 16] and scales [E, R, G]");
  TORCH_CHECK(blocks.is_contiguous() && scales.is_contiguous(), name, ": MXFP4 tensors must be contiguous");
}

}  // namespace

// out [T, H] = sum over the (token, slot) pairs routed to local experts of gate · expert(x[token]).
// expert(x) = W2 · swiglu(W1 · x + b1) + b2, with W1 = gate_up (rows interleaved gate, up), W2 = down.
at::Tensor moe_mxfp4(const at::Tensor& x, const at::Tensor& idx, const at::Tensor& gate_w,
                     const at::Tensor& gu_blocks, const at::Tensor& gu_scales, const at::Tensor& gu_bias,
                     const at::Tensor& dn_blocks, const at::Tensor& dn_scales, const at::Tensor& dn_bias,
                     double alpha, double limit, int64_t expert_offset) {
  check_float_like(x, "x");
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
  const bool bf = x.scalar_type() == at::kBFloat16;   // bf16 activations: the exact bf16 dot-product path
#else
  const bool bf = false;
#endif
  const int64_t H64 = (H + 127) / 128 * 128, I64 = (I + 127) / 128 * 128;   // bf16 inputs: whole chunks
  float* xd = shared_scratch(0, bf ? T * H64 / 2 : T * H);        // [T, H] deinterleaved inputs
  float* gu = shared_scratch(1, P * R1);                           // [P, 2I] gate_up outputs
  float* ad = shared_scratch(2, bf ? P * I64 / 2 : P * I);         // [P, I] activations, deinterleaved
  float* y = shared_scratch(3, P * H);                             // [P, H] down outputs
  uint16_t* xd16 = reinterpret_cast<uint16_t*>(xd);
  uint16_t* ad16 = reinterpret_cast<uint16_t*>(ad);
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
#ifdef GD_BF16DOT
      if (bf) { deinterleave_bf16(xf + t * H, H, xd16 + t * H64); continue; }
#endif
      deinterleave(xf + t * H, H, xd + t * H);
    }
  });
  std::vector<const float*> xin(P), ain(P);
  std::vector<const uint16_t*> xin16(P), ain16(P);
  for (int64_t p = 0; p < P; ++p) {
    xin[p] = xd + rt.pair_token[p] * H;
    ain[p] = ad + p * I;
    xin16[p] = xd16 + rt.pair_token[p] * H64;
    ain16[p] = ad16 + p * I64;
  }
  const uint8_t* gub = gu_blocks.data_ptr<uint8_t>();
  const uint8_t* gus = gu_scales.data_ptr<uint8_t>();
  const uint8_t* dnb = dn_blocks.data_ptr<uint8_t>();
  const uint8_t* dns = dn_scales.data_ptr<uint8_t>();
  const int64_t n_act = rt.active.size();

  // one work item = a strip of RT_MAX * 4 rows of one active expert, for all of that expert's pairs
  auto run = [&](const uint8_t* blk, const uint8_t* scl, int64_t R, int64_t G, const std::vector<const float*>& in,
                 const std::vector<const uint16_t*>& in16, float* dst) {
    const int64_t strip = RT_MAX * 4, strips = (R + strip - 1) / strip;
    at::parallel_for(0, n_act * strips, 1, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t e = rt.active[i / strips], r0 = (i % strips) * strip, r1 = std::min(R, r0 + strip);
        const int64_t p0 = rt.expert_start[e], n = rt.expert_start[e + 1] - p0;
#ifdef GD_BF16DOT
        if (bf) {
          expert_rows_bf16(blk + e * R * G * 16, scl + e * R * G, G, r0, r1, in16.data() + p0, n, dst + p0 * R, R);
          continue;
        }
#endif
        expert_rows(TILES, blk + e * R * G * 16, scl + e * R * G, G, r0, r1, in.data() + p0, n, dst + p0 * R, R);
      }
    });
  };
  run(gub, gus, R1, G1, xin, xin16, gu);

  // swiglu on (gate, up) = (even, odd) columns with the gate_up bias, written deinterleaved for `down`
  std::vector<int64_t> pair_expert(P);
  for (int64_t e : rt.active)
    for (int64_t p = rt.expert_start[e]; p < rt.expert_start[e + 1]; ++p) pair_expert[p] = e;
  const float a = float(alpha), lim = float(limit);
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    float* act = scratch(2, 2 * I + W);
    float* up = act + I;
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t e = pair_expert[p];
      for (int64_t i = 0; i < I; ++i) {                // gate clamped above, up both ways, bias added
        act[i] = std::min(gu[p * R1 + 2 * i] + b1[e * R1 + 2 * i], lim);
        up[i] = std::min(std::max(gu[p * R1 + 2 * i + 1] + b1[e * R1 + 2 * i + 1], -lim), lim);
      }
      swiglu_inplace(act, up, I, a, x.scalar_type() == at::kBFloat16);
#ifdef GD_BF16DOT
      if (bf) { deinterleave_bf16(act, I, ad16 + p * I64); continue; }
#endif
      if (x.scalar_type() == at::kBFloat16)            // bf16 activations, as on the bf16 dot-product path
        for (int64_t i = 0; i < I; ++i) act[i] = bf16_to_f32(f32_to_bf16(act[i]));
      deinterleave(act, I, ad + p * I);
    }
  });
  run(dnb, dns, H, G2, ain, ain16, y);

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
        for (int64_t j = 0; j < H; ++j) row[j] += (y[p * H + j] + b2[e * H + j]) * gt;
      }
      store_row(row, out, t * H, H);
    }
  });
  return out;
}

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
