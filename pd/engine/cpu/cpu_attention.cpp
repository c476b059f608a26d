// Paged decode attention for float32 on the CPU: one query token against its keys, read straight from
// the KV pages through the block table. Two passes over the keys: every score first (K read once),
// then one softmax per head over all of them, then the weighted V rows (V read once). A query's keys
// may be cut into parts, each computed on its own (its max, sum and unnormalised output) and merged:
// so that one long context splits over the threads. Vector loops over `vec` (cpu_gemm.cpp: AVX-512 or
// AVX2 + FMA) where the build has it, portable loops elsewhere.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

// One layer's pages and the shape of its heads, as a query reads them.
struct PagedKV {
  const float* cache;   // (num_blocks, 2, bs, Hkv, D): K at offset 0 of a block, V at s_kv
  const int64_t* table;  // the query's block table row
  int64_t bs, s_blk, s_kv, s_tok, Hq, Hkv, D;
  float scale;
};

// f(rows, next, cnt, i) for each run of keys of [p0, p1) within one page: `rows` is the K row of its
// first key (V is s_kv further on, rows s_tok apart), `next` the first K row of the page after it (null
// at the end: pages are scattered, so the next one is prefetched by hand), `cnt` its keys and `i` the
// index of its first key from p0.
template <typename F>
static inline void for_each_page(const PagedKV& kv, int64_t p0, int64_t p1, const F& f) {
  int64_t blk = p0 / kv.bs, off = p0 - blk * kv.bs;
  for (int64_t p = p0, i = 0; p < p1; ++blk, off = 0) {
    const int64_t cnt = std::min(kv.bs - off, p1 - p);
    const float* next = p + cnt < p1 ? kv.cache + kv.table[blk + 1] * kv.s_blk : nullptr;
    f(kv.cache + kv.table[blk] * kv.s_blk + off * kv.s_tok, next, cnt, i);
    p += cnt;
    i += cnt;
  }
}

#ifdef PDKV_PACKED_GEMM
static inline float vhsum(vec a) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps(a);
#else
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
#endif
}
// Query heads of one group handled together: their accumulators stay in registers with the key or
// value vectors (AVX2 has 16 registers, AVX-512 32).
#if defined(__AVX512F__)
static constexpr int kHeadsAtOnce = 4;
#else
static constexpr int kHeadsAtOnce = 2;
#endif

// out[g * n] = scale * (q_g · k) for the GH query heads q_g (D apart) sharing the key row k.
template <int GH>
static inline void qk_heads(const float* q, const float* k, int64_t D, float sc, float* out, int64_t n) {
  vec a[GH];
  for (int g = 0; g < GH; ++g) a[g] = vzero();
  for (int64_t d = 0; d < D; d += kWidth) {
    const vec kv = vload(k + d);
    for (int g = 0; g < GH; ++g) a[g] = vfma(vload(q + g * D + d), kv, a[g]);
  }
  for (int g = 0; g < GH; ++g) out[g * n] = vhsum(a[g]) * sc;
}

// The sums of four vectors' lanes, as one 4-float vector (cheaper than four vhsum).
static inline __m128 vhsum4(vec a0, vec a1, vec a2, vec a3) {
#if defined(__AVX512F__)
  const auto fold = [](vec a) {  // (the high half through a double view: AVX512F alone, no DQ)
    return _mm256_add_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
  };
  const __m256 b0 = fold(a0), b1 = fold(a1), b2 = fold(a2), b3 = fold(a3);
#else
  const __m256 b0 = a0, b1 = a1, b2 = a2, b3 = a3;
#endif
  // hadd twice: lane i of each 128-bit half holds half of vector i's sum; add the halves
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(b0, b1), _mm256_hadd_ps(b2, b3));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// qk_heads for the four keys at k, k + s_tok, k + 2 s_tok, k + 3 s_tok: out[g * n + t], t < 4.
template <int GH>
static inline void qk_heads4(const float* q, const float* k, int64_t s_tok, int64_t D, float sc, float* out,
                             int64_t n) {
  vec a[GH][4];
  for (int g = 0; g < GH; ++g)
    for (int t = 0; t < 4; ++t) a[g][t] = vzero();
  for (int64_t d = 0; d < D; d += kWidth) {
    vec kv[4];
    for (int t = 0; t < 4; ++t) kv[t] = vload(k + t * s_tok + d);
    for (int g = 0; g < GH; ++g) {
      const vec qv = vload(q + g * D + d);
      for (int t = 0; t < 4; ++t) a[g][t] = vfma(qv, kv[t], a[g][t]);
    }
  }
  for (int g = 0; g < GH; ++g)
    _mm_storeu_ps(out + g * n, _mm_mul_ps(vhsum4(a[g][0], a[g][1], a[g][2], a[g][3]), _mm_set1_ps(sc)));
}

// acc[g][d0, d0 + C * kWidth) = sum over keys [p0, p1) of w[g][i] * V_i[d0, ...) for the GH query heads
// of one group (weights n apart, key p0 + i at index i): the accumulators stay in registers.
template <int GH, int C>
static void pv_heads(const PagedKV& kv, int64_t h, int64_t d0, int64_t p0, int64_t p1, const float* w, int64_t n,
                     float* acc) {
  vec r[GH][C];
  for (int g = 0; g < GH; ++g)
    for (int c = 0; c < C; ++c) r[g][c] = vzero();
  const int64_t at = kv.s_kv + h * kv.D + d0;  // this head's values, from d0, in a key's K row
  for_each_page(kv, p0, p1, [&](const float* rows, const float* next, int64_t cnt, int64_t i0) {
    for (int64_t t = 0; t < cnt; ++t) {
      if (next != nullptr)  // the next page's row t, while this one is read
        for (int c = 0; c < C * kWidth; c += 16) __builtin_prefetch(next + t * kv.s_tok + at + c);
      const float* vt = rows + t * kv.s_tok + at;
      vec x[C];
      for (int c = 0; c < C; ++c) x[c] = vload(vt + c * kWidth);
      for (int g = 0; g < GH; ++g) {
        const vec wg = vset1(w[g * n + i0 + t]);
        for (int c = 0; c < C; ++c) r[g][c] = vfma(wg, x[c], r[g][c]);
      }
    }
  });
  for (int g = 0; g < GH; ++g)
    for (int c = 0; c < C; ++c) vstore(acc + g * kv.D + d0 + c * kWidth, r[g][c]);
}

template <int GH>
static void pv_group(const PagedKV& kv, int64_t h, int64_t p0, int64_t p1, const float* w, int64_t n, float* acc) {
  int64_t d0 = 0;
  for (; d0 + 4 * kWidth <= kv.D; d0 += 4 * kWidth) pv_heads<GH, 4>(kv, h, d0, p0, p1, w, n, acc);
  for (; d0 < kv.D; d0 += kWidth) pv_heads<GH, 1>(kv, h, d0, p0, p1, w, n, acc);
}

// The query heads [g, g + count) of kv head h, count <= kHeadsAtOnce, in one pass per call: for one key,
// or (Four) for four keys s_tok apart.
template <bool Four>
static void qk_some(int64_t count, const float* q, const float* k, int64_t s_tok, int64_t D, float sc, float* out,
                    int64_t n) {
  switch (count) {
    case 4:
      if constexpr (kHeadsAtOnce >= 4) {
        if constexpr (Four) return qk_heads4<4>(q, k, s_tok, D, sc, out, n); else return qk_heads<4>(q, k, D, sc, out, n);
      }
      [[fallthrough]];
    case 3:
      if constexpr (kHeadsAtOnce >= 3) {
        if constexpr (Four) return qk_heads4<3>(q, k, s_tok, D, sc, out, n); else return qk_heads<3>(q, k, D, sc, out, n);
      }
      [[fallthrough]];
    case 2:
      if constexpr (Four) return qk_heads4<2>(q, k, s_tok, D, sc, out, n); else return qk_heads<2>(q, k, D, sc, out, n);
    default:
      if constexpr (Four) return qk_heads4<1>(q, k, s_tok, D, sc, out, n); else return qk_heads<1>(q, k, D, sc, out, n);
  }
}
static void pv_some(int64_t count, const PagedKV& kv, int64_t h, int64_t p0, int64_t p1, const float* w, int64_t n,
                    float* acc) {
  switch (count) {
    case 4: if constexpr (kHeadsAtOnce >= 4) return pv_group<4>(kv, h, p0, p1, w, n, acc); [[fallthrough]];
    case 3: if constexpr (kHeadsAtOnce >= 3) return pv_group<3>(kv, h, p0, p1, w, n, acc); [[fallthrough]];
    case 2: return pv_group<2>(kv, h, p0, p1, w, n, acc);
    default: return pv_group<1>(kv, h, p0, p1, w, n, acc);
  }
}
#endif

// Scores of every query head against keys [p0, p1): s[hq * n + i] for key p0 + i.
static void scores_of(const PagedKV& kv, const float* q, int64_t p0, int64_t p1, float* s, int64_t n) {
  const int64_t G = kv.Hq / kv.Hkv, D = kv.D;
  for_each_page(kv, p0, p1, [&](const float* rows, const float* next, int64_t cnt, int64_t i0) {
    if (next != nullptr)  // the next page's rows (all heads) while this one is read
      for (int64_t t = 0; t < cnt; ++t)
        for (int64_t c = 0; c < kv.Hkv * D; c += 16) __builtin_prefetch(next + t * kv.s_tok + c);
    int64_t t = 0;
#ifdef PDKV_PACKED_GEMM
    if (D % kWidth == 0) {
      for (; t + 4 <= cnt; t += 4)
        for (int64_t h = 0; h < kv.Hkv; ++h)
          for (int64_t g = 0; g < G; g += kHeadsAtOnce)
            qk_some<true>(std::min<int64_t>(kHeadsAtOnce, G - g), q + (h * G + g) * D, rows + t * kv.s_tok + h * D,
                          kv.s_tok, D, kv.scale, s + (h * G + g) * n + i0 + t, n);
      for (; t < cnt; ++t)
        for (int64_t h = 0; h < kv.Hkv; ++h)
          for (int64_t g = 0; g < G; g += kHeadsAtOnce)
            qk_some<false>(std::min<int64_t>(kHeadsAtOnce, G - g), q + (h * G + g) * D, rows + t * kv.s_tok + h * D,
                           kv.s_tok, D, kv.scale, s + (h * G + g) * n + i0 + t, n);
    }
#endif
    for (; t < cnt; ++t)
      for (int64_t hq = 0; hq < kv.Hq; ++hq) {
        const float* qh = q + hq * D;
        const float* kh = rows + t * kv.s_tok + (hq / G) * D;
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t d = 0; d < D; ++d) sum += qh[d] * kh[d];
        s[hq * n + i0 + t] = sum * kv.scale;
      }
  });
}

// acc (Hq, D) = sum over keys [p0, p1) of w[hq][i] * V[hq / G].
static void weighted_values(const PagedKV& kv, int64_t p0, int64_t p1, const float* w, int64_t n, float* acc) {
  const int64_t G = kv.Hq / kv.Hkv, D = kv.D;
  for (int64_t h = 0; h < kv.Hkv; ++h) {
    int64_t g = 0;
#ifdef PDKV_PACKED_GEMM
    if (D % kWidth == 0)
      for (; g < G; g += kHeadsAtOnce)
        pv_some(std::min<int64_t>(kHeadsAtOnce, G - g), kv, h, p0, p1, w + (h * G + g) * n, n, acc + (h * G + g) * D);
#endif
    for (; g < G; ++g) {
      float* a = acc + (h * G + g) * D;
      std::fill(a, a + D, 0.f);
      const float* wg = w + (h * G + g) * n;
      for_each_page(kv, p0, p1, [&](const float* rows, const float*, int64_t cnt, int64_t i0) {
        for (int64_t t = 0; t < cnt; ++t) {
          const float* v = rows + t * kv.s_tok + kv.s_kv + h * D;
          const float wt = wg[i0 + t];
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) a[d] += wt * v[d];
        }
      });
    }
  }
}

// The largest of x[0, n), n > 0 (a vector max: the compiler leaves the plain loop scalar, one
// dependent max per key).
static inline float row_max(const float* x, int64_t n) {
  float mx = x[0];
  int64_t i = 0;
#if defined(__AVX512F__)
  if (n >= 16) {
    __m512 v = _mm512_loadu_ps(x);
    for (i = 16; i + 16 <= n; i += 16) v = _mm512_max_ps(v, _mm512_loadu_ps(x + i));
    mx = _mm512_reduce_max_ps(v);
  }
#elif defined(PDKV_PACKED_GEMM)
  if (n >= 8) {
    __m256 v = _mm256_loadu_ps(x);
    for (i = 8; i + 8 <= n; i += 8) v = _mm256_max_ps(v, _mm256_loadu_ps(x + i));
    const __m128 h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 h2 = _mm_max_ps(h, _mm_movehl_ps(h, h));
    mx = _mm_cvtss_f32(_mm_max_ss(h2, _mm_movehdup_ps(h2)));
  }
#endif
  for (; i < n; ++i) mx = std::max(mx, x[i]);
  return mx;
}

// Attention of one query (Hq heads of D: q) over keys [p0, p1), p0 < p1, left unnormalised so that
// parts merge: per head its largest score m, the sum l of exp(score - m), and acc (Hq, D) = the
// exp(score - m)-weighted sum of its V rows. `scores`: scratch.
static void attend_part(const PagedKV& kv, const float* q, int64_t p0, int64_t p1, std::vector<float>& scores,
                        float* acc, float* m, float* l) {
  const int64_t n = p1 - p0;
  scores.resize(static_cast<size_t>(kv.Hq * n));
  float* s = scores.data();
  scores_of(kv, q, p0, p1, s, n);
  for (int64_t hq = 0; hq < kv.Hq; ++hq) {
    float* sh = s + hq * n;
    const float mx = row_max(sh, n);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; ++i) {
      sh[i] = std::exp(sh[i] - mx);
      sum += sh[i];
    }
    m[hq] = mx;
    l[hq] = sum;
  }
  weighted_values(kv, p0, p1, s, n, acc);
}

// out (Hq, D) = the softmax-weighted V of `parts` partial results (attend_part's acc, m, l; acc parts
// Hq * D apart, m and l Hq apart).
static void merge_parts(int64_t parts, int64_t Hq, int64_t D, const float* acc, const float* m, const float* l,
                        float* out) {
  for (int64_t hq = 0; hq < Hq; ++hq) {
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < parts; ++j) mx = std::max(mx, m[j * Hq + hq]);
    float total = 0.f;
    for (int64_t j = 0; j < parts; ++j) total += std::exp(m[j * Hq + hq] - mx) * l[j * Hq + hq];
    float* o = out + hq * D;
    std::fill(o, o + D, 0.f);
    for (int64_t j = 0; j < parts; ++j) {
      const float f = std::exp(m[j * Hq + hq] - mx) / total;
      const float* a = acc + j * Hq * D + hq * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) o[d] += f * a[d];
    }
  }
}

// Attention of one request's Hq query heads (qb, D each) over positions [start, stop) of one layer's
// cache, read through the block table `tb`; writes (Hq, D) to `ob`. `scores` / `acc`: scratch.
static void attend_one(const float* qb, const float* cp, const int64_t* tb, int64_t start, int64_t stop,
                       int64_t bs, int64_t s_blk, int64_t s_kv, int64_t s_tok, int64_t Hq, int64_t Hkv, int64_t D,
                       float sc, std::vector<float>& scores, std::vector<float>& acc, float* ob) {
  const PagedKV kv{cp, tb, bs, s_blk, s_kv, s_tok, Hq, Hkv, D, sc};
  acc.resize(static_cast<size_t>(Hq * D + 2 * Hq));
  float* m = acc.data() + Hq * D;
  attend_part(kv, qb, start, stop, scores, acc.data(), m, m + Hq);
  merge_parts(1, Hq, D, acc.data(), m, m + Hq, ob);
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
