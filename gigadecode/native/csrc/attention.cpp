// Decode attention over the paged KV, read in place (the KV write and the other small pieces around it are
// in rope_norm.cpp).
//
// KV layouts (one buffer half): plain [nb, kv, B, d] (fp32 / bf16 / fp8), packed-FP8 K [nb, kv, B/2, d, 2]
// (element [b, h, p, j, s] = token 2p+s, dim j). FP8 is e4m3 with a per-tensor scale (stored = x / scale).
// Attention for slot b reads the blocks of its table row that hold frame positions [lo, pos] (lo = pos-W+1
// on sliding layers, 0 on full ones; the partial op's lo = first) with an online softmax; the work is split
// over slots (each item all of a slot's kv heads, which share its blocks) or, with fewer slots than twice the
// threads, over (slot, kv head) and, when that leaves threads idle on a long context, over block ranges merged
// by their log-sum-exp. The sink joins the softmax denominator at the merge:
// out = Σ_s o_s e^{m_s-M} / (Σ_s l_s e^{m_s-M} + e^{sink-M}). Without a sink (the partial op, for decode
// context parallelism) the merge also gives lse = M + log Σ_s l_s e^{m_s-M}, so ranks holding disjoint
// parts of a sequence merge their partials exactly, adding the sink once.
#include "common.h"
#include "decode_span.h"
#include "kv_layout.h"

namespace gd {

namespace {

// heads one pass of accumulate_v holds in its ACC accumulator registers, at NV = d / W vectors a row
constexpr int ACC = W == 16 ? 16 : 8;
constexpr int heads_per_pass(int NV) { return NV >= ACC ? 1 : ACC / NV; }

// o[r] += Σ_t p[r][t] · V[t] for the rep heads of a group: NV = d / W vectors a row (rows `vr`, converted
// as they are read: fp32 rows, or the cache's own when every head fits one pass, so each is converted once)
template <int NV, typename VT>
void accumulate_v(const VT* vr, int64_t nt, int64_t d, const float* sc, int64_t ld, int64_t rep, float* o) {
  constexpr int RG = heads_per_pass(NV);
  for (int64_t r0 = 0; r0 < rep; r0 += RG) {
    const int rn = int(std::min<int64_t>(RG, rep - r0));
    VF acc[RG][NV];
    for (int i = 0; i < RG; ++i)
      if (i < rn)
        for (int c = 0; c < NV; ++c) acc[i][c] = vload(o + (r0 + i) * (d + 2) + c * W);
    for (int64_t t = 0; t < nt; ++t) {
      VF v[NV];
      int c = 0;
      if constexpr (std::is_same_v<VT, uint8_t>) {   // FP8 rows: four or two vectors' bytes at once (convert_row's)
        for (; c + 4 <= NV; c += 4) vload4_fp8_div256(vr + t * d + c * W, v + c);
        for (; c + 2 <= NV; c += 2) vload2_fp8_div256(vr + t * d + c * W, v[c], v[c + 1]);
      }
      for (; c < NV; ++c) v[c] = kvload(vr + t * d + c * W);
      for (int i = 0; i < RG; ++i)
        if (i < rn) {
          const VF p = vset1(sc[(r0 + i) * ld + t]);
          for (int c = 0; c < NV; ++c) acc[i][c] = vfma(p, v[c], acc[i][c]);
        }
    }
    for (int i = 0; i < RG; ++i)
      if (i < rn)
        for (int c = 0; c < NV; ++c) vstore(o + (r0 + i) * (d + 2) + c * W, acc[i][c]);
  }
}

// accumulate_v for nv = d / W in 1..8
template <typename VT>
void accumulate_v_n(int64_t nv, const VT* vr, int64_t nt, int64_t d, const float* sc, int64_t ld, int64_t rep,
                    float* o) {
  switch (nv) {
    case 1: accumulate_v<1>(vr, nt, d, sc, ld, rep, o); break;
    case 2: accumulate_v<2>(vr, nt, d, sc, ld, rep, o); break;
    case 3: accumulate_v<3>(vr, nt, d, sc, ld, rep, o); break;
    case 4: accumulate_v<4>(vr, nt, d, sc, ld, rep, o); break;
    case 5: accumulate_v<5>(vr, nt, d, sc, ld, rep, o); break;
    case 6: accumulate_v<6>(vr, nt, d, sc, ld, rep, o); break;
    case 7: accumulate_v<7>(vr, nt, d, sc, ld, rep, o); break;
    default: accumulate_v<8>(vr, nt, d, sc, ld, rep, o);
  }
}

// Scores sc[r * ld + t - t0] for t in [t0, t1] of one block's K against the rep q heads (qs [rep][2d]: packed,
// each dim twice; plain, the first d). K is read in rows of n values, eight rows at a time, each converted
// once (kf [8][n]) and dotted with every head through eight independent accumulators, reduced together
// (vstore_sum_even_odd_x8): packed K's row is a token pair [d][2] (n = 2d; its even lanes are token 2p, its
// odd lanes 2p+1), plain K's a token (n = d; both lanes' sums are its score).
template <typename KT>
void block_scores(const KT* Kb, const float* qs, int64_t t0, int64_t t1, int64_t d, int64_t rep, int64_t ld,
                  bool packed, float* kf, float* sc) {
  const int64_t n = packed ? 2 * d : d, nv = n / W * W;
  const int64_t r0 = packed ? t0 / 2 : t0, r1 = packed ? t1 / 2 : t1;   // rows (pairs or tokens)
  for (int64_t q0 = r0; q0 <= r1; q0 += 8) {
    const int nr = int(std::min<int64_t>(8, r1 - q0 + 1));
    for (int i = 0; i < nr; ++i) convert_row(Kb + (q0 + i) * n, n, kf + i * n);
    if (nr < 8) std::fill(kf + nr * n, kf + 8 * n, 0.f);   // a block's last rows: all 8 are dotted
    for (int64_t r = 0; r < rep; ++r) {
      const float* qr = qs + r * 2 * d;
      VF acc[8];                                      // a fixed count, fully unrolled: kept in registers
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) acc[i] = vzero();
      for (int64_t c = 0; c < nv; c += W) {
        const VF qv = vload(qr + c);
#pragma GCC unroll 8
        for (int i = 0; i < 8; ++i) acc[i] = vfma(vload(kf + i * n + c), qv, acc[i]);
      }
      alignas(64) float tok[16];                      // row i: even-lane sum 2i, odd-lane sum 2i + 1
      vstore_sum_even_odd_x8(tok, acc);
      for (int i = 0; i < nr; ++i)
        for (int64_t c = nv; c < n; ++c) tok[2 * i + c % 2] += kf[i * n + c] * qr[c];
      if (packed) {
        const int64_t a = std::max(t0, 2 * q0), e = std::min(t1, 2 * q0 + 2 * nr - 1);
        for (int64_t t = a; t <= e; ++t) sc[r * ld + t - t0] = tok[t - 2 * q0];
      } else {
        for (int i = 0; i < nr; ++i) sc[r * ld + q0 + i - t0] = tok[2 * i] + tok[2 * i + 1];
      }
    }
  }
}

// The lanes form of packed K's scores: a vector holds lane_heads(D) heads × D dims × a token pair, so one FMA
// scores a token pair for several heads at once and the sums need no lane reductions. D = 1 (W / 2 heads) where
// the group's heads fill its vectors at least 3/4 (GPT-OSS's 8 q heads a kv head on AVX-512), else D = 2 (W / 4
// heads; d even) where they fill those, else 0: the dot-product form (block_scores).
constexpr int lane_heads(int D) { return W / (2 * D); }
inline int64_t lane_groups(int64_t rep, int D) { return (rep + lane_heads(D) - 1) / lane_heads(D); }
inline int lanes_dims(int64_t rep, int64_t d) {
  if (4 * rep >= 3 * lane_groups(rep, 1) * lane_heads(1)) return 1;
  if (d % 2 == 0 && 4 * rep >= 3 * lane_groups(rep, 2) * lane_heads(2)) return 2;
  return 0;
}

// The q vectors of the lanes form for D dims a lane group: qh [lane_groups][d / D][W], lane 2D·i + 2m + s of
// vector jj = q head g·lane_heads + i's dim jj·D + m (each twice: s = token 0 / 1 of a pair; zero past rep)
template <int D>
void lanes_q(const float* q, int64_t rep, int64_t d, float qmul, float* qh) {
  constexpr int LH = lane_heads(D);
  std::fill(qh, qh + lane_groups(rep, D) * (d / D) * W, 0.f);
  for (int64_t r = 0; r < rep; ++r)
    for (int64_t j = 0; j < d; ++j) {
      float* lane = qh + ((r / LH) * (d / D) + j / D) * W + 2 * D * (r % LH) + 2 * (j % D);
      lane[0] = lane[1] = q[r * d + j] * qmul;
    }
}

// block_scores' lanes form (packed K, qh from lanes_q). Eight token pairs are converted (kf [8][2d]); for each
// D dims the q vector meets each pair's D × (k[2p][j], k[2p+1][j]) broadcast to every lane group, so acc[i] lane
// 2D·h + 2m + s sums head h's products of token 2(q0 + i) + s over dims ≡ m (mod D); one transpose a group
// (adding the D sums) puts each head's 16 scores in a row of sc (through `tmp` where the visible range cuts them).
template <int D, typename KT>
void block_scores_lanes(const KT* Kb, const float* qh, int64_t t0, int64_t t1, int64_t d, int64_t rep, int64_t ld,
                        float* kf, float* sc) {
  constexpr int LH = lane_heads(D);
  const int64_t n = 2 * d, r0 = t0 / 2, r1 = t1 / 2;
  alignas(64) float tmp[LH * 16];
  for (int64_t q0 = r0; q0 <= r1; q0 += 8) {
    const int nr = int(std::min<int64_t>(8, r1 - q0 + 1));
    for (int i = 0; i < nr; ++i) convert_row(Kb + (q0 + i) * n, n, kf + i * n);
    if (nr < 8) std::fill(kf + nr * n, kf + 8 * n, 0.f);   // a block's last pairs: all 8 are dotted
    const int64_t a = std::max(t0, 2 * q0), e = std::min(t1, 2 * q0 + 2 * nr - 1);   // tokens kept
    const bool whole = a == 2 * q0 && e == 2 * q0 + 15;
    for (int64_t g = 0; g * LH < rep; ++g) {
      const float* qg = qh + g * (d / D) * W;
      VF acc[8];
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) acc[i] = vzero();
      for (int64_t jj = 0; jj < d / D; ++jj) {
        const VF qv = vload(qg + jj * W);
#pragma GCC unroll 8
        for (int i = 0; i < 8; ++i) {
          const float* k = kf + i * n + 2 * D * jj;
          acc[i] = vfma(qv, D == 1 ? vbroadcast_pair(k) : vbroadcast_quad(k), acc[i]);
        }
      }
      const int nh = int(std::min<int64_t>(LH, rep - g * LH));
      float* rows = sc + g * LH * ld;
      float* out = whole ? rows + 2 * q0 - t0 : tmp;
      const int64_t out_ld = whole ? ld : 16;
      if constexpr (D == 1) vstore_pairs_transposed(acc, out, out_ld, nh);
      else vstore_quads_summed_transposed(acc, out, out_ld, nh);
      if (!whole)
        for (int h = 0; h < nh; ++h)
          for (int64_t t = a; t <= e; ++t) rows[h * ld + t - t0] = tmp[h * 16 + t - 2 * q0];
    }
  }
}

// One (slot, kv heads [h0, h1), block range) item: partials (o [rep, d] unnormalized, m [rep], l [rep]) of
// head h into part + (h - h0) * stride. The range is read in spans of blocks (`SPAN_TOKENS`); within a span the
// heads take turns (K of each block scored, one softmax update, then o += p · V block by block), so a block's
// heads, contiguous in the cache, are read close together.
template <typename KT, typename VT>
void attend_range(const AttnShape& s, const float* q, const KT* K, const VT* V, const int64_t* table, int64_t lo,
                  int64_t pos, int64_t jb0, int64_t jb1, int64_t b, int64_t h0, int64_t h1, float qmul, float* part,
                  int64_t stride) {
  const int64_t rep = s.rep, d = s.d, B = s.B, kv = s.kv;
  const int64_t span_blocks = std::max<int64_t>(1, SPAN_TOKENS / B), ld = span_blocks * B;
  const int lanes = s.packed ? lanes_dims(rep, d) : 0;   // D of the lanes form, 0: the dot-product form
  const int64_t q_floats = lanes ? lane_groups(rep, lanes) * (d / lanes) * W : rep * 2 * d;   // a kv head's qs
  float* qs_all = scratch(0, (h1 - h0) * q_floats);  // q · scale · k multiplier (packed: each dim twice), a head
  float* sc = scratch(1, rep * ld + W);              // scores of one span [rep][ld]
  float* kf = scratch(3, 16 * d);                     // 8 rows of K (token pairs or tokens) in fp32
  float* vf = scratch(2, B * d);                      // a block's V rows in fp32 (slot 2: free until the merge)
  for (int64_t h = h0; h < h1; ++h) {
    float* qs = qs_all + (h - h0) * q_floats;
    const float* qh = q + (b * s.nh + h * rep) * d;    // the group's rep heads [rep][d]
    if (lanes == 1) lanes_q<1>(qh, rep, d, qmul, qs);
    else if (lanes == 2) lanes_q<2>(qh, rep, d, qmul, qs);
    else
      for (int64_t r = 0; r < rep; ++r)
        for (int64_t j = 0; j < d; ++j) {
          if (s.packed) qs[r * 2 * d + 2 * j] = qs[r * 2 * d + 2 * j + 1] = qh[r * d + j] * qmul;
          else qs[r * 2 * d + j] = qh[r * d + j] * qmul;
        }
    float* o = part + (h - h0) * stride;                // [rep][d + 2]: o, then m, l
    for (int64_t r = 0; r < rep; ++r) {
      std::fill(o + r * (d + 2), o + r * (d + 2) + d, 0.f);
      o[r * (d + 2) + d] = -INFINITY;
      o[r * (d + 2) + d + 1] = 0.f;
    }
  }
  const int64_t nv = d % W ? 0 : d / W;
  const bool vector_rows = nv >= 1 && nv <= 8;       // accumulate_v's sizes; else the scalar loop
  for (int64_t j0 = jb0; j0 <= jb1; j0 += span_blocks) {
    const int64_t j1 = std::min(jb1, j0 + span_blocks - 1);
    for (int64_t h = h0; h < h1; ++h) {
      const float* qs = qs_all + (h - h0) * q_floats;
      float* o = part + (h - h0) * stride;
      // scores sc[r][n ..): each K element converted once, then dotted with every q head of the group
      int64_t n = 0;
      for (int64_t jb = j0; jb <= j1; ++jb) {
        int64_t t0, t1;
        const int64_t nt = visible_in_block(jb, B, lo, pos, t0, t1);
        if (nt <= 0) continue;
        if (jb + 2 <= jb1) {                            // blocks are scattered: fetch two ahead by hand
          const int64_t nxt = table[b * s.n_table + jb + 2];
          prefetch_rows(K + (nxt * kv + h) * B * d, B * d * int64_t(sizeof(KT)));
          prefetch_rows(V + (nxt * kv + h) * B * d, B * d * int64_t(sizeof(VT)));
        }
        const int64_t bid = table[b * s.n_table + jb];
        const KT* Kb = K + (bid * kv + h) * B * d;
        if (lanes == 1) block_scores_lanes<1>(Kb, qs, t0, t1, d, rep, ld, kf, sc + n);
        else if (lanes == 2) block_scores_lanes<2>(Kb, qs, t0, t1, d, rep, ld, kf, sc + n);
        else block_scores(Kb, qs, t0, t1, d, rep, ld, s.packed, kf, sc + n);
        n += nt;
      }
      if (n == 0) continue;
      softmax_update(sc, ld, n, rep, d, o);
      // o += p · V with the accumulators in registers: V read in place when every head fits one pass, else
      // each block's V rows converted to fp32 once first
      n = 0;
      for (int64_t jb = j0; jb <= j1; ++jb) {
        int64_t t0, t1;
        const int64_t nt = visible_in_block(jb, B, lo, pos, t0, t1);
        if (nt <= 0) continue;
        const VT* Vr = V + (table[b * s.n_table + jb] * kv + h) * B * d + t0 * d;
        const float* p = sc + n;
        n += nt;
        if (vector_rows && rep <= heads_per_pass(int(nv))) {
          accumulate_v_n(nv, Vr, nt, d, p, ld, rep, o);
          continue;
        }
        convert_row(Vr, nt * d, vf);                    // the block's rows are contiguous
        if (vector_rows) {
          accumulate_v_n(nv, vf, nt, d, p, ld, rep, o);
        } else {
          for (int64_t t = 0; t < nt; ++t)
            for (int64_t r = 0; r < rep; ++r)
              for (int64_t c = 0; c < d; ++c) o[r * (d + 2) + c] += p[r * ld + t] * vf[t * d + c];
        }
      }
    }
  }
}

// Whether any of n partial sums (stride floats apart) is NaN
inline bool any_nan_sum(const float* l, int64_t n, int64_t stride) {
  for (int64_t i = 0; i < n; ++i)
    if (l[i * stride] != l[i * stride]) return true;
  return false;
}

// Slot b attends to frame positions [lo[b], pos[b]] (lo >= 0; pos < lo: nothing) when active[b]. out
// [Bt, nh·d] (fp32 or bf16); sinks: one per q head, or null for none; lse [Bt, nh] (or null): the merged
// log-sum-exp of the scaled scores (with the sink's term when there is one), -inf where nothing is visible.
template <typename KT, typename VT>
void attention_impl(const AttnShape& s, const float* q, const KT* K, const VT* V, const int64_t* table,
                    const int64_t* lo, const int64_t* pos, const bool* active, const FloatView* sinks, float qmul,
                    float vmul, at::Tensor& out, float* lse) {
  const int64_t base = s.Bt * s.kv, nthreads = at::get_num_threads();
  int64_t max_blocks = 1;                             // the most blocks one slot reads
  for (int64_t b = 0; b < s.Bt; ++b)
    if (active[b] && pos[b] >= lo[b]) max_blocks = std::max(max_blocks, pos[b] / s.B - lo[b] / s.B + 1);
  // items: (slot, G kv heads, block range): every head of a slot in one item where the slots alone keep the
  // threads busy (a block's heads read together), else one head an item and, where that still leaves threads
  // idle on a long context, S block ranges a head
  const int64_t G = s.Bt >= 2 * nthreads ? s.kv : 1, groups = s.Bt * (s.kv / G);
  int64_t S = 1;
  if (groups < 2 * nthreads && max_blocks >= 8) S = std::max<int64_t>(1, std::min((2 * nthreads + groups - 1) / groups, max_blocks / 4));
  const int64_t stride = s.rep * (s.d + 2);
  float* part = shared_scratch(0, base * S * stride);   // [Bt][kv][S] partials
  // FP8 KV on AMX tiles where the CPU has them (attention_tiles.cpp)
  const bool tiles = std::is_same_v<KT, uint8_t> && std::is_same_v<VT, uint8_t> && decode_tiles_take(s);
  at::parallel_for(0, groups * S, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / (S * (s.kv / G)), h0 = (i / S) % (s.kv / G) * G, sp = i % S;
      float* pr = part + ((b * s.kv + h0) * S + sp) * stride;   // head h's at pr + (h - h0) * S * stride
      const int64_t p = pos[b], l0 = lo[b];
      const int64_t jb0 = l0 / s.B, jb1 = p / s.B, nb = jb1 - jb0 + 1;
      const int64_t a = jb0 + nb * sp / S, e = jb0 + nb * (sp + 1) / S - 1;
      if (!active[b] || p < l0 || e < a) {
        for (int64_t h = 0; h < G; ++h)
          for (int64_t r = 0; r < s.rep; ++r) {
            pr[h * S * stride + r * (s.d + 2) + s.d] = -INFINITY;
            pr[h * S * stride + r * (s.d + 2) + s.d + 1] = 0.f;
          }
        continue;
      }
      if constexpr (std::is_same_v<KT, uint8_t> && std::is_same_v<VT, uint8_t>) {
        if (tiles) {
          attend_range_tiles(s, q, K, V, table, l0, p, a, e, b, h0, h0 + G, qmul, pr, S * stride);
          continue;
        }
      }
      attend_range<KT, VT>(s, q, K, V, table, l0, p, a, e, b, h0, h0 + G, qmul, pr, S * stride);
    }
  });
  // merge the block ranges (with the sink when there is one)
  at::parallel_for(0, base, 1, [&](int64_t i0, int64_t i1) {
    float* row = scratch(2, s.d);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / s.kv, h = i % s.kv;
      for (int64_t r = 0; r < s.rep; ++r) {
        const int64_t qh = h * s.rep + r;
        std::fill(row, row + s.d, 0.f);
        float ls = -INFINITY;
        if (active[b]) {
          const float sink = sinks ? (*sinks)[qh] : -INFINITY;
          float M = sink;
          for (int64_t sp = 0; sp < S; ++sp) M = std::max(M, part[(i * S + sp) * stride + r * (s.d + 2) + s.d]);
          if (M > -INFINITY) {                        // else no sink and nothing visible: 0, lse -inf
            float L = sinks ? std::exp(sink - M) : 0.f;
            for (int64_t sp = 0; sp < S; ++sp) {
              const float* pr = part + (i * S + sp) * stride + r * (s.d + 2);
              if (pr[s.d + 1] == 0.f) continue;
              const float f = std::exp(pr[s.d] - M);
              L += pr[s.d + 1] * f;
              for (int64_t j = 0; j < s.d; ++j) row[j] += pr[j] * f;
            }
            const float inv = vmul / L;
            for (int64_t j = 0; j < s.d; ++j) row[j] *= inv;
            ls = M + std::log(L);
          } else if (sinks || M != M || any_nan_sum(part + i * S * stride + r * (s.d + 2) + s.d + 1, S, stride)) {
            // a NaN sink, a sink of -inf with no score above it (the twin's softmax: -inf - -inf), or visible
            // scores that were all NaN (the maxima drop a NaN, so such a range reads m = -inf as if it saw
            // nothing; its sum is NaN): NaN, as the twin, not "nothing visible" (the partial op's, no sink)
            std::fill(row, row + s.d, NAN);
            ls = NAN;
          }
        }
        store_row(row, out, (b * s.nh + qh) * s.d, s.d);
        if (lse) lse[b * s.nh + qh] = ls;
      }
    }
  });
}

template <typename F>
void dispatch_kv(const at::Tensor& k, const at::Tensor& v, F&& f) {
  auto with_v = [&](auto kp) {
    switch (elem_of(v)) {
      case Elem::F32: f(kp, static_cast<const float*>(v.data_ptr())); break;
      case Elem::BF16: f(kp, static_cast<const uint16_t*>(v.data_ptr())); break;
      default: f(kp, static_cast<const uint8_t*>(v.data_ptr()));
    }
  };
  switch (elem_of(k)) {
    case Elem::F32: with_v(static_cast<const float*>(k.data_ptr())); break;
    case Elem::BF16: with_v(static_cast<const uint16_t*>(k.data_ptr())); break;
    default: with_v(static_cast<const uint8_t*>(k.data_ptr()));
  }
}

// The checks both attention ops share; returns the shape (window / lower bounds are the caller's).
AttnShape attention_args(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                         const at::Tensor& table, const at::Tensor& pos, const at::Tensor& active) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && q.dim() == 3 && q.is_contiguous(), "q must be float32 [Bt, nh, d]");
  const auto [nb, kv, B, d] = kv_dims(k_cache, v_cache);
  const int64_t Bt = q.size(0), nh = q.size(1);
  TORCH_CHECK(q.size(2) == d && nh % kv == 0, "q ", q.sizes(), " does not fit KV heads ", kv, " × dim ", d);
  TORCH_CHECK(table.scalar_type() == at::kLong && table.dim() == 2 && table.size(0) == Bt && table.is_contiguous(),
              "table must be int64 [Bt, n]");
  TORCH_CHECK(pos.scalar_type() == at::kLong && pos.numel() == Bt && active.scalar_type() == at::kBool &&
              active.numel() == Bt && pos.is_contiguous() && active.is_contiguous(),
              "pos (int64) and active (bool) must be [Bt], contiguous");
  return AttnShape{Bt, nh, kv, nh / kv, d, B, table.size(1), k_cache.dim() == 5};
}

// Slot b reads frame positions [lo, pos] of its table row: they must lie in the table, their blocks in (0, nb).
void check_blocks(const AttnShape& s, int64_t nb, const int64_t* tb, int64_t b, int64_t lo, int64_t pos) {
  TORCH_CHECK(pos >= 0 && pos / s.B < s.n_table, "slot ", b, ": position ", pos, " past its table");
  for (int64_t j = lo / s.B; j <= pos / s.B; ++j)
    TORCH_CHECK(tb[b * s.n_table + j] > 0 && tb[b * s.n_table + j] < nb, "slot ", b, ": block id ",
                tb[b * s.n_table + j], " out of range");
}

// Per-slot lower bounds, reused across calls (a decode step allocates nothing once warm).
int64_t* lower_bounds(int64_t Bt) {
  thread_local std::vector<int64_t> lo;
  if (int64_t(lo.size()) < Bt) lo.resize(Bt);
  return lo.data();
}

// attention_impl for the KV buffers' element types, FP8 scales folded into the q and V multipliers
void run_attention(const AttnShape& s, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                   const int64_t* table, const int64_t* lo, const int64_t* pos, const bool* active,
                   const FloatView* sinks, double scale, double k_scale, double v_scale, at::Tensor& out,
                   float* lse) {
  dispatch_kv(k_cache, v_cache, [&](auto kp, auto vp) {
    using KT = std::remove_cv_t<std::remove_pointer_t<decltype(kp)>>;
    using VT = std::remove_cv_t<std::remove_pointer_t<decltype(vp)>>;
    attention_impl<KT, VT>(s, q.data_ptr<float>(), kp, vp, table, lo, pos, active, sinks,
                           float(scale) * kv_multiplier<KT>(k_scale), kv_multiplier<VT>(v_scale), out, lse);
  });
}

}  // namespace

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& table, const at::Tensor& pos, const at::Tensor& active,
                                  const at::Tensor& sinks, int64_t window, double scale, double k_scale,
                                  double v_scale, at::ScalarType out_dtype) {
  const AttnShape s = attention_args(q, k_cache, v_cache, table, pos, active);
  TORCH_CHECK(sinks.numel() == s.nh, "sinks must have one value per q head");
  TORCH_CHECK(window >= 0, "window must be >= 0");
  TORCH_CHECK(out_dtype == at::kFloat || out_dtype == at::kBFloat16, "out_dtype must be float32 or bfloat16");
  const int64_t* tb = table.data_ptr<int64_t>();
  const int64_t* ps = pos.data_ptr<int64_t>();
  const bool* ac = active.data_ptr<bool>();
  int64_t* lo = lower_bounds(s.Bt);
  for (int64_t b = 0; b < s.Bt; ++b) {
    lo[b] = 0;
    if (!ac[b]) continue;
    if (window) lo[b] = std::max<int64_t>(0, ps[b] - window + 1);
    check_blocks(s, v_cache.size(0), tb, b, lo[b], ps[b]);
  }
  at::Tensor sk = sinks.contiguous();
  const FloatView sv(sk);
  at::Tensor out = at::empty({s.Bt, s.nh * s.d}, q.options().dtype(out_dtype));
  run_attention(s, q, k_cache, v_cache, tb, lo, ps, ac, &sv, scale, k_scale, v_scale, out, nullptr);
  return out;
}

// Decode context parallelism: slot b attends to frame positions [first, pos] only, without the sink.
// -> (out [Bt, nh, d] fp32 normalized over those keys, lse [Bt, nh] fp32 their log-sum-exp; 0 / -inf where
// nothing is visible: inactive, pos < 0 or first > pos).
std::tuple<at::Tensor, at::Tensor> paged_decode_attention_partial(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& table,
    const at::Tensor& pos, const at::Tensor& first, const at::Tensor& active, double scale, double k_scale,
    double v_scale) {
  const AttnShape s = attention_args(q, k_cache, v_cache, table, pos, active);
  TORCH_CHECK(first.scalar_type() == at::kLong && first.numel() == s.Bt && first.is_contiguous(),
              "first must be int64 [Bt]");
  const int64_t* tb = table.data_ptr<int64_t>();
  const int64_t* ps = pos.data_ptr<int64_t>();
  const int64_t* fs = first.data_ptr<int64_t>();
  const bool* ac = active.data_ptr<bool>();
  int64_t* lo = lower_bounds(s.Bt);
  for (int64_t b = 0; b < s.Bt; ++b) {
    lo[b] = std::max<int64_t>(0, fs[b]);
    if (ac[b] && ps[b] >= lo[b]) check_blocks(s, v_cache.size(0), tb, b, lo[b], ps[b]);
  }
  at::Tensor out = at::empty({s.Bt, s.nh, s.d}, q.options());
  at::Tensor lse = at::empty({s.Bt, s.nh}, q.options());
  run_attention(s, q, k_cache, v_cache, tb, lo, ps, ac, nullptr, scale, k_scale, v_scale, out,
                lse.data_ptr<float>());
  return {out, lse};
}

}  // namespace gd
