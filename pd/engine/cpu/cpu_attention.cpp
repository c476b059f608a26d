// Paged decode attention for float32 on the CPU: one query token per request against its keys,
// read straight from the KV pages through the block table (online softmax, one pass over K and V).
// AVX-512 or AVX2 + FMA inner loops where the compiler targets them, portable loops elsewhere.
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

