// Greedy next tokens without reading the whole float32 lm_head: the exact argmax, screened through an
// int8 copy of it (see pd/engine/cpu/greedy_head.py for the bound and why it is exact).
//
// For each row h of the hidden states (M, K):
// 1. approximate logits a[n] = scale[n] * (h · q[n]) from the int8 panels q (P, K, 16), one int8 line
//    of 16 outputs per k (a quarter of the float32 panels' bytes), the threads splitting the panels;
// 2. bound[n] = |h|_2 * coef[n] bounds |a[n] - f[n]|, f[n] being h · w[n] as the float32 kernel
//    computes it (any summation order); L = max over n of a[n] - bound[n];
// 3. every n with a[n] + bound[n] >= L is a candidate (the argmax of f is one: f[argmax] >= L, and
//    every other n has f[n] <= a[n] + bound[n]); its whole float32 panel is computed with the packed
//    GEMM's one-row tile, and the token is the candidate with the largest f (the lowest index on a tie).
// A row whose |h| is not finite gets -1: the caller computes its full logits instead.
#include <cmath>
#include <cstring>
#include <limits>

#ifdef PDKV_PACKED_GEMM
static constexpr int kScreenRows = 6;  // rows per register tile: 2 x 8 accumulators each on AVX2 (16 ymm)

// An int8 panel's lines as float vectors (AVX-512: one of 16; AVX2: two of 8), for the float32 tile
// template `tile_of` (cpu_gemm.cpp): the screen's sums run as the GEMM's do (the bound holds for any
// summation order).
struct Int8Lines {
  const int8_t* Q;
  vec load(int, int64_t k, int v) const {
    const __m128i line = _mm_loadu_si128(reinterpret_cast<const __m128i*>(Q + k * kPanel));
#if defined(__AVX512F__)
    (void)v;
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(line));
#else
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v == 0 ? line : _mm_srli_si128(line, 8)));
#endif
  }
  void begin(int64_t) {}
};

// out[i][0..16) = sum over k of A[i][k] * q[k][0..16) for one int8 panel (K, 16) and MR rows of A.
template <int MR>
static void screen_tile(const float* A, int64_t lda, const int8_t* Q, int64_t K, float* out, int64_t ldo) {
  tile_of<MR, 1>(A, lda, Int8Lines{Q}, K, nullptr, false, out, ldo, kPanel, nullptr);
}

using ScreenFn = void (*)(const float*, int64_t, const int8_t*, int64_t, float*, int64_t);
static constexpr ScreenFn kScreenTiles[kScreenRows] = {screen_tile<1>, screen_tile<2>, screen_tile<3>,
                                                       screen_tile<4>, screen_tile<5>, screen_tile<6>};
#endif

// Whether x is finite, read from its bits: the kernels build with -ffast-math, under which
// std::isfinite may be folded to true.
static inline bool finite_bits(double x) {
  uint64_t u;
  std::memcpy(&u, &x, sizeof u);
  return ((u >> 52) & 0x7ff) != 0x7ff;
}

// hidden (M, K) float32; q (P, K, 16) int8; scale, coef: P * 16 float32 (padded outputs: anything);
// packed (P, K, 16) float32, the same matrix; n_out <= P * 16 real outputs. Returns (M,) int64 tokens,
// -1 where the row is not finite.
torch::Tensor screened_argmax(torch::Tensor hidden, torch::Tensor q, torch::Tensor scale, torch::Tensor coef,
                              torch::Tensor packed, int64_t n_out) {
#ifdef PDKV_PACKED_GEMM
  TORCH_CHECK(hidden.dtype() == torch::kFloat32 && hidden.dim() == 2, "hidden: float32 (M, K)");
  TORCH_CHECK(q.dtype() == torch::kInt8 && q.dim() == 3 && q.size(2) == kPanel && q.is_contiguous(), "q: (P, K, 16) int8");
  TORCH_CHECK(packed.dtype() == torch::kFloat32 && packed.sizes() == q.sizes() && packed.is_contiguous(),
              "packed: float32 like q");
  const int64_t M = hidden.size(0), K = hidden.size(1), P = q.size(0), N = P * kPanel;
  TORCH_CHECK(q.size(1) == K, "q: K = hidden's");
  TORCH_CHECK(n_out > 0 && n_out <= N, "n_out in (0, P * 16]");
  TORCH_CHECK(scale.dtype() == torch::kFloat32 && scale.is_contiguous() && scale.numel() == N &&
              coef.dtype() == torch::kFloat32 && coef.is_contiguous() && coef.numel() == N,
              "scale, coef: P * 16 float32");
  auto h = hidden.contiguous();
  auto tokens = torch::full({M}, -1, torch::kLong);
  if (M == 0) return tokens;
  const float* hp = h.data_ptr<float>();
  const int8_t* qp = q.data_ptr<int8_t>();
  const float *sp = scale.data_ptr<float>(), *cp = coef.data_ptr<float>(), *wp = packed.data_ptr<float>();
  int64_t* tp = tokens.data_ptr<int64_t>();
  std::vector<float> hn(M);  // |h|_2, rounded up; 0 marks a row that is not finite
  for (int64_t i = 0; i < M; ++i) {
    double ss = 0;
    for (int64_t k = 0; k < K; ++k) ss += static_cast<double>(hp[i * K + k]) * hp[i * K + k];
    const double norm = std::sqrt(ss) * (1 + 1e-4) + 1e-30;
    hn[i] = finite_bits(ss) && norm < 1e30 ? static_cast<float>(norm) : 0.f;
  }
  // 1. approximate logits and, per chunk of panels, each row's largest a - bound; the threads take
  //    chunks of about 8 panels each
  // (the caller's own buffer, kept between steps: a fresh 200 KB-per-row tensor each step costs page faults)
  thread_local std::vector<float> approx;
  approx.resize(static_cast<size_t>(M * N));
  float* ap = approx.data();
  const int64_t per = std::max<int64_t>(1, P / (8 * at::get_num_threads())), num_chunks = (P + per - 1) / per;
  std::vector<float> floors(M * num_chunks, -std::numeric_limits<float>::max());
  chunked_for(num_chunks, [&](int64_t c) {
    for (int64_t p = c * per; p < std::min(P, (c + 1) * per); ++p) {
      for (int64_t m0 = 0; m0 < M; m0 += kScreenRows) {
        const int64_t rows = std::min<int64_t>(kScreenRows, M - m0);
        kScreenTiles[rows - 1](hp + m0 * K, K, qp + p * K * kPanel, K, ap + m0 * N + p * kPanel, N);
      }
      const int64_t n0 = p * kPanel, n1 = std::min(n_out, n0 + kPanel);
      for (int64_t i = 0; i < M; ++i) {
        float* a = ap + i * N;
        float lo = floors[i * num_chunks + c];
        for (int64_t n = n0; n < n1; ++n) {
          a[n] *= sp[n];
          lo = std::max(lo, a[n] - hn[i] * cp[n]);
        }
        floors[i * num_chunks + c] = lo;
      }
    }
  });
  // 2-3. per row (the threads taking rows): the candidates' panels in float32, the argmax among them
  chunked_for(M, [&](int64_t i) {
    if (hn[i] == 0.f) return;
    float floor = -std::numeric_limits<float>::max();
    for (int64_t c = 0; c < num_chunks; ++c) floor = std::max(floor, floors[i * num_chunks + c]);
    const float* a = ap + i * N;
    alignas(64) float exact[kPanel];
    int64_t best = -1;
    float best_f = 0.f;
    for (int64_t p = 0; p < P; ++p) {
      const int64_t n0 = p * kPanel, n1 = std::min(n_out, n0 + kPanel);
      bool any = false;
      for (int64_t n = n0; n < n1; ++n) any |= a[n] + hn[i] * cp[n] >= floor;
      if (!any) continue;
      kTiles[0](hp + i * K, K, wp + p * K * kPanel, K, nullptr, false, exact, kPanel, kPanel, nullptr);
      for (int64_t n = n0; n < n1; ++n) {
        if (!finite_bits(exact[n - n0])) return;  // a weight overflows: the caller's full logits decide
        if (a[n] + hn[i] * cp[n] >= floor && (best < 0 || exact[n - n0] > best_f)) {
          best = n;
          best_f = exact[n - n0];
        }
      }
    }
    tp[i] = best;
  });
  return tokens;
#else
  TORCH_CHECK(false, "screened argmax needs the packed GEMM (AVX2 + FMA)");
  return torch::Tensor();
#endif
}
