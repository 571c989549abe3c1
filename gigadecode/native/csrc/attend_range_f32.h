// The fp32 form of one decode-attention item (attention.cpp: a slot, its kv heads, a range of blocks) and the
// kernels under it: K scored a block at a time (the dot-product form, or the lanes form for packed K; the byte-table
// read scores packed K 16 tokens a vector where it can, scores_transposed.h), one online-softmax update a span, V
// accumulated in registers.
//
// Included once for each way of reading FP8 KV, inside a namespace that first defines
//   void load_fp8x4(const uint8_t* p, VF v[4])   // 4W FP8 bytes -> four vectors of fp32 (value / 256)
// (attention.cpp: through fp16 on every CPU, or by byte table where AVX512-VBMI is, compiled for it), so each
// form's kernels are compiled whole around their own reads. No include guard, on purpose.

// n cache elements -> fp32 (FP8 / 256): FP8 four vectors at a time through load_fp8x4, the rest as convert_row
// (its own loop, not convert_row's with the read passed in: that template is compiled outside the table read's
// VBMI functions, which could then not be inlined into it)
template <typename T>
inline void kv_row_f32(const T* src, int64_t n, float* dst) {
  int64_t c = 0;
  if constexpr (std::is_same_v<T, uint8_t>) {
    for (; c + 4 * W <= n; c += 4 * W) {
      VF v[4];
      load_fp8x4(src + c, v);
      for (int i = 0; i < 4; ++i) vstore(dst + c + i * W, v[i]);
    }
  }
  convert_row(src + c, n - c, dst + c);
}

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
      if constexpr (std::is_same_v<VT, uint8_t>) {   // FP8 rows: four or two vectors' bytes at once (kv_row_f32's)
        for (; c + 4 <= NV; c += 4) load_fp8x4(vr + t * d + c * W, v + c);
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
    for (int i = 0; i < nr; ++i) kv_row_f32(Kb + (q0 + i) * n, n, kf + i * n);
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
    for (int i = 0; i < nr; ++i) kv_row_f32(Kb + (q0 + i) * n, n, kf + i * n);
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
#ifdef GD_TRANSPOSED_SCORES
  const bool transposed = std::is_same_v<KT, uint8_t> && transposed_scores_take(s);   // scores_transposed.h
#else
  constexpr bool transposed = false;
#endif
  const int lanes = s.packed && !transposed ? lanes_dims(rep, d) : 0;   // D of the lanes form, 0: dot products
  const int64_t dp = (d + 31) / 32 * 32;              // the transposed form's q rows: zero past d
  const int64_t q_floats = transposed ? rep * dp : lanes ? lane_groups(rep, lanes) * (d / lanes) * W : rep * 2 * d;
  float* qs_all = scratch(0, (h1 - h0) * q_floats);  // q · scale · k multiplier (packed: each dim twice), a head
  float* sc = scratch(1, rep * ld + W);              // scores of one span [rep][ld]
  float* kf = scratch(3, 16 * d);                     // 8 rows of K (token pairs or tokens) in fp32
  float* vf = scratch(2, B * d);                      // a block's V rows in fp32 (slot 2: free until the merge)
  for (int64_t h = h0; h < h1; ++h) {
    float* qs = qs_all + (h - h0) * q_floats;
    const float* qh = q + (b * s.nh + h * rep) * d;    // the group's rep heads [rep][d]
    if (transposed) {
      std::fill(qs, qs + rep * dp, 0.f);
      for (int64_t r = 0; r < rep; ++r)
        for (int64_t j = 0; j < d; ++j) qs[r * dp + j] = qh[r * d + j] * qmul;
    } else if (lanes == 1) lanes_q<1>(qh, rep, d, qmul, qs);
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
#ifdef GD_TRANSPOSED_SCORES
  thread_local std::vector<ScoreGroup> group_buf;     // a span's visible 16-token groups
  if (transposed && int64_t(group_buf.size()) < ld / 16 + 1) group_buf.resize(ld / 16 + 1);
#endif
  for (int64_t j0 = jb0; j0 <= jb1; j0 += span_blocks) {
    const int64_t j1 = std::min(jb1, j0 + span_blocks - 1);
    for (int64_t h = h0; h < h1; ++h) {
      const float* qs = qs_all + (h - h0) * q_floats;
      float* o = part + (h - h0) * stride;
      // scores sc[r][n ..): each K element converted once, then dotted with every q head of the group
      int64_t n = 0, groups = 0;
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
#ifdef GD_TRANSPOSED_SCORES
        if (transposed) {                               // the block's 16-token groups holding tokens [t0, t1]
          if constexpr (std::is_same_v<KT, uint8_t>)
            for (int64_t g = t0 / 16; g <= t1 / 16; ++g) {
              const int a = int(std::max(t0, 16 * g) - 16 * g), e = int(std::min(t1, 16 * g + 15) - 16 * g);
              group_buf[groups++] = ScoreGroup{Kb + g * 16 * d, a, e, n + 16 * g + a - t0};
            }
          n += nt;
          continue;
        }
#endif
        if (lanes == 1) block_scores_lanes<1>(Kb, qs, t0, t1, d, rep, ld, kf, sc + n);
        else if (lanes == 2) block_scores_lanes<2>(Kb, qs, t0, t1, d, rep, ld, kf, sc + n);
        else block_scores(Kb, qs, t0, t1, d, rep, ld, s.packed, kf, sc + n);
        n += nt;
      }
#ifdef GD_TRANSPOSED_SCORES
      if (groups) score_groups_n(rep, group_buf.data(), groups, qs, d, dp, ld, sc);
#endif
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
        kv_row_f32(Vr, nt * d, vf);                    // the block's rows are contiguous
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
