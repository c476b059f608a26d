#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define PDKV_ATTN_AVX2 1
// Scores of query head q (D floats, D % 8 == 0) against 4 rows `s_tok` apart, times sc, into out[0..3].
static inline void qk_four(const float* q, const float* k, int64_t s_tok, int64_t D, float sc, float* out) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t d = 0; d < D; d += 8) {
    const __m256 qv = _mm256_loadu_ps(q + d);
    a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + d), a0);
    a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + s_tok + d), a1);
    a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + 2 * s_tok + d), a2);
    a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + 3 * s_tok + d), a3);
  }
  // hadd twice: lane i of each 128-bit half holds half of row i's sum; add the halves.
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  const __m128 r = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  _mm_storeu_ps(out, _mm_mul_ps(r, _mm_set1_ps(sc)));
}

// acc[0, 8C) += sum_t w[t] * v[t * s_tok + (0, 8C)]: C accumulators stay in registers over the tokens.
template <int C>
static inline void pv_span(const float* w, const float* v, int64_t s_tok, int64_t cnt, float* acc) {
  __m256 r[C];
#pragma GCC unroll 8
  for (int c = 0; c < C; ++c) r[c] = _mm256_loadu_ps(acc + 8 * c);
  for (int64_t t = 0; t < cnt; ++t) {
    const __m256 wv = _mm256_set1_ps(w[t]);
    const float* vt = v + t * s_tok;
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) r[c] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(vt + 8 * c), r[c]);
  }
#pragma GCC unroll 8
  for (int c = 0; c < C; ++c) _mm256_storeu_ps(acc + 8 * c, r[c]);
}
#endif

// Scores of every query head against `cnt` consecutive tokens of one block (rows `s_tok` apart).
static inline void qk_rows(const float* qb, const float* base, int64_t s_tok, int64_t cnt, int64_t Hq, int64_t Hkv,
                           int64_t D, float sc, float* out, int64_t n) {
  const int64_t G = Hq / Hkv;
#ifdef PDKV_ATTN_AVX2
  if (D % 8 == 0) {
    for (int64_t hq = 0; hq < Hq; ++hq) {
      const float* qh = qb + hq * D;
      const float* kh = base + (hq / G) * D;
      int64_t t = 0;
      for (; t + 4 <= cnt; t += 4) qk_four(qh, kh + t * s_tok, s_tok, D, sc, out + hq * n + t);
      for (; t < cnt; ++t) {
        const float* k = kh + t * s_tok;
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t d = 0; d < D; ++d) sum += qh[d] * k[d];
        out[hq * n + t] = sum * sc;
      }
    }
    return;
  }
#endif
  for (int64_t t = 0; t < cnt; ++t) {
    const float* krow = base + t * s_tok;
    for (int64_t hq = 0; hq < Hq; ++hq) {
      const float* k = krow + (hq / G) * D;
      const float* qh = qb + hq * D;
#if defined(__AVX512F__)
      if (D % 16 == 0) {
        __m512 a = _mm512_mul_ps(_mm512_loadu_ps(qh), _mm512_loadu_ps(k));
        for (int64_t d = 16; d < D; d += 16) a = _mm512_fmadd_ps(_mm512_loadu_ps(qh + d), _mm512_loadu_ps(k + d), a);
        out[hq * n + t] = _mm512_reduce_add_ps(a) * sc;
        continue;
      }
#endif
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t d = 0; d < D; ++d) s += qh[d] * k[d];
      out[hq * n + t] = s * sc;
    }
  }
}

#if defined(__AVX512F__)
// acc[hq] += sum_t w[hq, t] * V[t][hq / G]: C = D / 16 accumulators stay in registers over the block's tokens.
template <int C>
static inline void pv_rows_avx512(const float* w, int64_t n, const float* base, int64_t s_tok, int64_t cnt, int64_t Hq,
                                  int64_t G, float* acc) {
  for (int64_t hq = 0; hq < Hq; ++hq) {
    const float* vh = base + (hq / G) * C * 16;
    const float* wh = w + hq * n;
    __m512 r[C];
    for (int c = 0; c < C; ++c) r[c] = _mm512_setzero_ps();
    for (int64_t t = 0; t < cnt; ++t) {
      const __m512 wv = _mm512_set1_ps(wh[t]);
      const float* v = vh + t * s_tok;
      for (int c = 0; c < C; ++c) r[c] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(v + 16 * c), r[c]);
    }
    float* a = acc + hq * C * 16;
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(a + 16 * c, _mm512_add_ps(_mm512_loadu_ps(a + 16 * c), r[c]));
  }
}
#endif

// acc[hq] += w[hq, t] * V[t] for `cnt` consecutive tokens of one block.
static inline void pv_rows(const float* w, int64_t n, const float* base, int64_t s_tok, int64_t cnt, int64_t Hq,
                           int64_t Hkv, int64_t D, float* acc) {
  const int64_t G = Hq / Hkv;
#if defined(__AVX512F__)
  if (D == 64) return pv_rows_avx512<4>(w, n, base, s_tok, cnt, Hq, G, acc);
  if (D == 128) return pv_rows_avx512<8>(w, n, base, s_tok, cnt, Hq, G, acc);
#endif
#ifdef PDKV_ATTN_AVX2
  if (D % 8 == 0) {  // spans of up to 64 values, each held in registers over the block's tokens
    for (int64_t hq = 0; hq < Hq; ++hq) {
      const float* vh = base + (hq / G) * D;
      for (int64_t d = 0; d < D; d += 64) {
        const float* wh = w + hq * n;
        float* a = acc + hq * D + d;
        switch (std::min<int64_t>(64, D - d) / 8) {
          case 8: pv_span<8>(wh, vh + d, s_tok, cnt, a); break;
          case 7: pv_span<7>(wh, vh + d, s_tok, cnt, a); break;
          case 6: pv_span<6>(wh, vh + d, s_tok, cnt, a); break;
          case 5: pv_span<5>(wh, vh + d, s_tok, cnt, a); break;
          case 4: pv_span<4>(wh, vh + d, s_tok, cnt, a); break;
          case 3: pv_span<3>(wh, vh + d, s_tok, cnt, a); break;
          case 2: pv_span<2>(wh, vh + d, s_tok, cnt, a); break;
          default: pv_span<1>(wh, vh + d, s_tok, cnt, a); break;
        }
      }
    }
    return;
  }
#endif
  for (int64_t t = 0; t < cnt; ++t) {
    const float* vrow = base + t * s_tok;
    for (int64_t hq = 0; hq < Hq; ++hq) {
      const float wt = w[hq * n + t];
      const float* v = vrow + (hq / G) * D;
      float* a = acc + hq * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) a[d] += wt * v[d];
    }
  }
}

// Attention of one request's Hq query heads (qb, D each) over positions [start, stop) of one layer's
// cache, read through the block table `tb`; writes (Hq, D) to `ob`. One pass with a running max
// (online softmax): each block's K and V rows are read together, once. `scores` / `acc`: scratch.
static void attend_one(const float* qb, const float* cp, const int64_t* tb, int64_t start, int64_t stop,
                       int64_t bs, int64_t s_blk, int64_t s_kv, int64_t s_tok, int64_t Hq, int64_t Hkv, int64_t D,
                       float sc, std::vector<float>& scores, std::vector<float>& acc, float* ob) {
  scores.resize(Hq * bs + 2 * Hq);
  float* sb = scores.data();
  float* mrun = sb + Hq * bs;
  float* lsum = mrun + Hq;
  std::fill(lsum, lsum + Hq, 0.f);
  acc.assign(Hq * D, 0.f);
  for (int64_t blk = start / bs, p = start; p < stop; ++blk) {
    const int64_t off = p - blk * bs, cnt = std::min(bs - off, stop - p);
    const float* base = cp + tb[blk] * s_blk + off * s_tok;
    qk_rows(qb, base, s_tok, cnt, Hq, Hkv, D, sc, sb, bs);
    for (int64_t hq = 0; hq < Hq; ++hq) {
      float* sh = sb + hq * bs;
      float mx = sh[0];
      for (int64_t t = 1; t < cnt; ++t) mx = std::max(mx, sh[t]);
      if (p == start) {
        mrun[hq] = mx;
      } else if (mx > mrun[hq]) {  // rescale what was accumulated under the old maximum
        const float corr = std::exp(mrun[hq] - mx);
        lsum[hq] *= corr;
        float* a = acc.data() + hq * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) a[d] *= corr;
        mrun[hq] = mx;
      } else {
        mx = mrun[hq];
      }
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t t = 0; t < cnt; ++t) { sh[t] = std::exp(sh[t] - mx); sum += sh[t]; }
      lsum[hq] += sum;
    }
    pv_rows(sb, bs, base + s_kv, s_tok, cnt, Hq, Hkv, D, acc.data());
    p += cnt;
  }
  for (int64_t hq = 0; hq < Hq; ++hq) {
    const float inv = 1.f / lsum[hq];
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) ob[hq * D + d] = acc[hq * D + d] * inv;
  }
}

// Runs f(b) for every request b in [0, B) on torch's intra-op threads, each thread taking a
// contiguous run of requests holding about the same number of keys (ke - ks), so that one long
// context does not leave the other threads idle. (Built with -fopenmp: without it at::parallel_for
// silently runs on one thread.)
template <typename F>
static void for_each_request_balanced(int64_t B, const int64_t* ks, const int64_t* ke, const F& f) {
  const int64_t parts = std::min<int64_t>(at::get_num_threads(), B);
  if (parts <= 1) {
    for (int64_t b = 0; b < B; ++b) f(b);
    return;
  }
  std::vector<int64_t> bounds(parts + 1, B);
  int64_t total = 0;
  for (int64_t b = 0; b < B; ++b) total += ke[b] - ks[b] + 1;
  bounds[0] = 0;
  int64_t acc = 0, k = 1;
  for (int64_t b = 0; b < B && k < parts; ++b) {
    acc += ke[b] - ks[b] + 1;
    while (k < parts && acc * parts >= total * k) bounds[k++] = b + 1;
  }
  at::parallel_for(0, parts, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      for (int64_t b = bounds[i]; b < bounds[i + 1]; ++b) f(b);
  });
}

// q: (B, Hq, D) float32 contiguous; cache: (num_blocks, 2, bs, Hkv, D) float32 (any block stride);
// block_table: (B, W) int64; key_start/key_end: (B,) int64, keys are positions [start, end).
// Returns (B, Hq, D).
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor cache, torch::Tensor block_table,
                                     torch::Tensor key_start, torch::Tensor key_end, double scale) {
  TORCH_CHECK(q.dtype() == torch::kFloat32 && cache.dtype() == torch::kFloat32, "float32 only");
  TORCH_CHECK(q.is_contiguous() && block_table.is_contiguous(), "contiguous q and block table");
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t bs = cache.size(2), Hkv = cache.size(3);
  TORCH_CHECK(cache.size(4) == D && cache.stride(4) == 1 && cache.stride(3) == D, "head_dim layout");
  const int64_t W = block_table.size(1);
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* cp = cache.data_ptr<float>();
  const int64_t* tp = block_table.data_ptr<int64_t>();
  const int64_t* ks = key_start.data_ptr<int64_t>();
  const int64_t* ke = key_end.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  for_each_request_balanced(B, ks, ke, [&](int64_t b) {
    thread_local std::vector<float> scores, acc;
    attend_one(qp + b * Hq * D, cp, tp + b * W, ks[b], ke[b], bs, cache.stride(0), cache.stride(1),
               cache.stride(2), Hq, Hkv, D, static_cast<float>(scale), scores, acc, op + b * Hq * D);
  });
  return out;
}

// y = x / rms(x) * w for one row of H values.
static inline void rms_norm_row(const float* x, const float* w, int64_t H, float eps, float* y) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < H; ++i) ss += x[i] * x[i];
  const float rstd = 1.f / std::sqrt(ss / static_cast<float>(H) + eps);
#pragma omp simd
  for (int64_t i = 0; i < H; ++i) y[i] = x[i] * rstd * w[i];
}

// y = x / rms(x) * w, row by row (x, y: (B, H)).
static void rms_norm_rows(const torch::Tensor& x, const torch::Tensor& w, float eps, torch::Tensor& y) {
  const int64_t B = x.size(0), H = x.size(1);
  for (int64_t b = 0; b < B; ++b)
    rms_norm_row(x.data_ptr<float>() + b * H, w.data_ptr<float>(), H, eps, y.data_ptr<float>() + b * H);
}

// o = silu(gate) * up for `rows` rows of [gate | up] (2I values each).
static void silu_mul_rows(const float* gu, int64_t rows, int64_t I, float* o) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = gu + r * 2 * I;
    float* out = o + r * I;
#pragma omp simd
    for (int64_t i = 0; i < I; ++i) out[i] = g[i] / (1.f + std::exp(-g[i])) * g[I + i];
  }
}

// Rotate-half RoPE of `heads` heads of D at src into dst (cos/sin: D values of this token's position).
static inline void rope_heads(const float* src, const float* cs, const float* sn, int64_t heads, int64_t D,
                              float* dst) {
  const int64_t half = D / 2;
  for (int64_t h = 0; h < heads; ++h) {
    const float* x = src + h * D;
    float* o = dst + h * D;
#pragma omp simd
    for (int64_t d = 0; d < half; ++d) o[d] = x[d] * cs[d] - x[d + half] * sn[d];
#pragma omp simd
    for (int64_t d = half; d < D; ++d) o[d] = x[d] * cs[d] + x[d - half] * sn[d];
  }
}

// y = x · Wᵀ (+ b): the packed GEMM (cpu_gemm.cpp) when w is packed (3-D), else at::linear.
static void project(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b, torch::Tensor& y) {
  if (w.dim() == 3) return packed_gemm_into(x, w, b, false, y);
  if (b.defined() && b.numel() > 0) {
    at::linear_out(y, x, w, b);
  } else {
    at::linear_out(y, x, w);
  }
}

// The shapes of one decode step and, per layer, what it reads (weights, cache, block tables).
struct StepShape {
  int64_t Hq, Hkv, D, qw, kw, H, I;
  float eps, scale;
  const float* cos;  // (B, D)
  const float* sin;
  const int64_t* slot_offsets;
  const int64_t* key_end;
};
struct LayerView {
  const torch::Tensor* w;  // the layer's 7 weights
  float* cache;
  int64_t bs, s_blk, s_kv, s_tok, W;
  const int64_t* table;
  const int64_t* key_start;
  const int64_t* slot_block;
};

// Request b's new token in one layer: RoPE, K/V written into its slot, then attention over its
// keys (the token included, read back through the page). qkv: b's q|k|v row; out: Hq * D values.
static void attend_new_token(const StepShape& s, const LayerView& lv, int64_t b, const float* qkv,
                             std::vector<float>& qbuf, std::vector<float>& scores, std::vector<float>& acc,
                             float* out) {
  qbuf.resize(s.qw);
  const float* cs = s.cos + b * s.D;
  const float* sn = s.sin + b * s.D;
  float* kdst = lv.cache + lv.slot_block[b] * lv.s_blk + s.slot_offsets[b] * lv.s_tok;
  rope_heads(qkv + s.qw, cs, sn, s.Hkv, s.D, kdst);
  std::copy(qkv + s.qw + s.kw, qkv + s.qw + 2 * s.kw, kdst + lv.s_kv);
  rope_heads(qkv, cs, sn, s.Hq, s.D, qbuf.data());
  attend_one(qbuf.data(), lv.cache, lv.table + b * lv.W, lv.key_start[b], s.key_end[b], lv.bs, lv.s_blk, lv.s_kv,
             lv.s_tok, s.Hq, s.Hkv, s.D, s.scale, scores, acc, out);
}

#ifdef PDKV_PACKED_GEMM
// Rows [r0, r1) of the residual stream x (B, H) through every layer, on the calling thread alone:
// with packed weights the requests are split over the threads once per step, and no thread waits
// for another until the step ends (a request's layer l needs only its own layer l - 1).
static void decode_rows(const StepShape& s, const std::vector<LayerView>& layers, int64_t r0, int64_t r1, float* x) {
  const int64_t R = r1 - r0, H = s.H, I = s.I, nqkv = s.qw + 2 * s.kw;
  std::vector<float> h(R * H), qkv(R * nqkv), attn(R * s.qw), gu(R * 2 * I), act(R * I), qbuf, scores, acc;
  float* xr = x + r0 * H;
  const auto panels = [](const torch::Tensor& t) { return t.size(0); };
  for (const LayerView& lv : layers) {
    const torch::Tensor* w = lv.w;
    const float* bias = w[2].numel() ? w[2].data_ptr<float>() : nullptr;
    for (int64_t r = 0; r < R; ++r) rms_norm_row(xr + r * H, w[0].data_ptr<float>(), H, s.eps, h.data() + r * H);
    packed_gemm_serial(h.data(), H, R, H, w[1].data_ptr<float>(), nqkv, bias, false, qkv.data(), nqkv, 0, panels(w[1]));
    for (int64_t r = 0; r < R; ++r)
      attend_new_token(s, lv, r0 + r, qkv.data() + r * nqkv, qbuf, scores, acc, attn.data() + r * s.qw);
    packed_gemm_serial(attn.data(), s.qw, R, s.qw, w[3].data_ptr<float>(), H, nullptr, true, xr, H, 0, panels(w[3]));
    for (int64_t r = 0; r < R; ++r) rms_norm_row(xr + r * H, w[4].data_ptr<float>(), H, s.eps, h.data() + r * H);
    packed_gemm_serial(h.data(), H, R, H, w[5].data_ptr<float>(), 2 * I, nullptr, false, gu.data(), 2 * I, 0,
                       panels(w[5]));
    silu_mul_rows(gu.data(), R, I, act.data());
    packed_gemm_serial(act.data(), I, R, I, w[6].data_ptr<float>(), H, nullptr, true, xr, H, 0, panels(w[6]));
  }
}
#endif

// Every decoder layer for a batch of decode tokens (one per request), float32 on the CPU: the
// per-layer small ops (norms, RoPE, K/V write, attention, SiLU) run here. x: (B, hidden)
// embeddings; cos/sin: (B, D). Per layer `weights` holds 7 tensors: input norm, fused q|k|v
// weight, fused q|k|v bias (may be empty), o_proj, post norm, fused gate|up weight, down_proj; the
// four matrices are all plain (N, K) or all packed (P, K, 16) with q|k|v and gate|up unpadded.
// Packed: the requests are split over the threads once (by estimated cost: projections plus keys)
// and each thread runs its requests through all layers with the packed GEMM (decode_rows). Plain:
// layer by layer, projections through at::linear, attention split by keys. Per group
// (`layer_group` maps layers to groups): the block and offset of each new token's slot, the block
// table and the first key position. Returns hidden states after the last layer (before the final norm).
torch::Tensor decode_layers(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, std::vector<torch::Tensor> weights,
                            std::vector<torch::Tensor> caches, std::vector<int64_t> layer_group,
                            std::vector<torch::Tensor> slot_blocks, torch::Tensor slot_offsets,
                            std::vector<torch::Tensor> tables, std::vector<torch::Tensor> key_starts,
                            torch::Tensor key_end, int64_t Hq, int64_t Hkv, double eps, double scale) {
  const int64_t L = static_cast<int64_t>(caches.size());
  TORCH_CHECK(L > 0 && static_cast<int64_t>(weights.size()) == 7 * L, "7 weights per layer");
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.is_contiguous() && cos.is_contiguous() && sin.is_contiguous(),
              "contiguous float32 inputs");
  const bool packed = weights[1].dim() == 3;
  const int64_t B = x.size(0), D = cos.size(1), H = x.size(1);
  const int64_t I = (packed ? weights[5].size(0) * kPanel : weights[5].size(0)) / 2;
  const StepShape s{Hq, Hkv, D, Hq * D, Hkv * D, H, I, static_cast<float>(eps), static_cast<float>(scale),
                    cos.data_ptr<float>(), sin.data_ptr<float>(), slot_offsets.data_ptr<int64_t>(),
                    key_end.data_ptr<int64_t>()};
  std::vector<LayerView> layers;
  for (int64_t l = 0; l < L; ++l) {
    const torch::Tensor& cache = caches[l];
    TORCH_CHECK(cache.size(4) == D && cache.stride(4) == 1 && cache.stride(3) == D, "head_dim layout");
    const int64_t g = layer_group[l];
    layers.push_back({weights.data() + 7 * l, cache.data_ptr<float>(), cache.size(2), cache.stride(0),
                      cache.stride(1), cache.stride(2), tables[g].size(1), tables[g].data_ptr<int64_t>(),
                      key_starts[g].data_ptr<int64_t>(), slot_blocks[g].data_ptr<int64_t>()});
  }
  x = x.clone();  // the residual stream, updated in place
#ifdef PDKV_PACKED_GEMM
  if (packed) {
    // A request's cost in key-equivalents: its keys in every layer, plus the projections (2 flops
    // per weight against ~4 per key and query dimension, keys counted 3x for being read from DRAM).
    const int64_t params = (s.qw + 2 * s.kw) * H + s.qw * H + 3 * H * I;
    const int64_t row_cost = L * std::max<int64_t>(1, 2 * params / (12 * s.qw));
    std::vector<int64_t> cost(B, row_cost);
    for (const LayerView& lv : layers)
      for (int64_t b = 0; b < B; ++b) cost[b] += s.key_end[b] - lv.key_start[b];
    const int64_t parts = std::min<int64_t>(at::get_num_threads(), B);
    std::vector<int64_t> bounds(parts + 1, B);
    int64_t total = 0;
    for (int64_t c : cost) total += c;
    bounds[0] = 0;
    int64_t run = 0, k = 1;
    for (int64_t b = 0; b < B && k < parts; ++b) {
      run += cost[b];
      while (k < parts && run * parts >= total * k) bounds[k++] = b + 1;
    }
    float* xp = x.data_ptr<float>();
    at::parallel_for(0, parts, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i)
        if (bounds[i] < bounds[i + 1]) decode_rows(s, layers, bounds[i], bounds[i + 1], xp);
    });
    return x;
  }
#endif
  TORCH_CHECK(!packed, "packed weights need the packed GEMM (AVX2 + FMA)");
  // Scratch for every layer, allocated once per call.
  auto h = torch::empty({B, H}, x.options()), tmp = torch::empty({B, H}, x.options());
  auto qkv = torch::empty({B, s.qw + 2 * s.kw}, x.options()), attn = torch::empty({B, s.qw}, x.options());
  auto gu = torch::empty({B, 2 * I}, x.options()), act = torch::empty({B, I}, x.options());
  for (int64_t l = 0; l < L; ++l) {
    const LayerView& lv = layers[l];
    const torch::Tensor* w = lv.w;
    rms_norm_rows(x, w[0], s.eps, h);
    project(h, w[1], w[2], qkv);
    const float* qkvp = qkv.data_ptr<float>();
    float* ap = attn.data_ptr<float>();
    for_each_request_balanced(B, lv.key_start, s.key_end, [&](int64_t b) {
      thread_local std::vector<float> qbuf, scores, acc;
      attend_new_token(s, lv, b, qkvp + b * qkv.size(1), qbuf, scores, acc, ap + b * s.qw);
    });
    at::linear_out(tmp, attn, w[3]);
    x.add_(tmp);
    rms_norm_rows(x, w[4], s.eps, h);
    project(h, w[5], torch::Tensor(), gu);
    at::parallel_for(0, B, 8, [&](int64_t begin, int64_t end) {
      silu_mul_rows(gu.data_ptr<float>() + begin * 2 * I, end - begin, I, act.data_ptr<float>() + begin * I);
    });
    at::linear_out(tmp, act, w[6]);
    x.add_(tmp);
  }
  return x;
}
