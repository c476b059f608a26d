// Packed-panel float32 GEMM for the CPU decode path: y[M, N] (+)= x[M, K] · W[N, K]ᵀ (+ bias).
//
// W is stored once, as panels of 16 output columns: packed[p][k][j] = W[16p + j][k] (zero rows
// pad the last panel). A 6×16 register tile (12 ymm accumulators, one broadcast of x and two
// loads of the panel per k) keeps both FMA pipes busy; each panel, contiguous in memory, is read
// from DRAM once per step and reused from cache by every row block of x. Threads split the
// panels. Built only where the compiler targets AVX2 + FMA; elsewhere `packed_gemm_available()`
// is false and the callers keep at::linear on plain weights.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PDKV_PACKED_GEMM 1
#endif

static constexpr int64_t kPanel = 16;  // output columns per panel (two ymm registers)
static constexpr int64_t kRows = 6;    // rows of x per register tile

#ifdef PDKV_PACKED_GEMM
static constexpr int64_t kChunk = 64;  // k-steps summed in registers before joining the tile's total

// C[MR, cols] (+)= A[MR, K] · B[K, 16] (+ bias[cols]); cols < 16 only in a padded last panel.
// With `next`, also prefetches that panel (one 64-byte line per k) so that its DRAM reads overlap
// this panel's FMAs (the hardware prefetcher restarts at every 4 KiB page). The k-sum runs in
// chunks of kChunk whose partial sums are added up in `part` (in L1): the rounding error then
// grows with K / kChunk + kChunk rather than with K, as in a blocked sgemm.
template <int MR>
static inline void tile(const float* A, int64_t lda, const float* B, int64_t K, const float* bias, bool accumulate,
                        float* C, int64_t ldc, int64_t cols, const float* next) {
  alignas(32) float part[MR][kPanel];
  for (int64_t k0 = 0; k0 < K; k0 += kChunk) {
    __m256 c[MR][2];
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) c[i][0] = c[i][1] = _mm256_setzero_ps();
    const int64_t k1 = std::min(K, k0 + kChunk);
    for (int64_t k = k0; k < k1; ++k) {
      if (next != nullptr) _mm_prefetch(reinterpret_cast<const char*>(next + k * kPanel), _MM_HINT_T0);
      const __m256 b0 = _mm256_loadu_ps(B + k * kPanel), b1 = _mm256_loadu_ps(B + k * kPanel + 8);
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) {
        const __m256 a = _mm256_broadcast_ss(A + i * lda + k);
        c[i][0] = _mm256_fmadd_ps(a, b0, c[i][0]);
        c[i][1] = _mm256_fmadd_ps(a, b1, c[i][1]);
      }
    }
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      if (k0 > 0) {
        c[i][0] = _mm256_add_ps(_mm256_load_ps(part[i]), c[i][0]);
        c[i][1] = _mm256_add_ps(_mm256_load_ps(part[i] + 8), c[i][1]);
      }
      _mm256_store_ps(part[i], c[i][0]);
      _mm256_store_ps(part[i] + 8, c[i][1]);
    }
  }
  if (K == 0) std::fill(&part[0][0], &part[0][0] + MR * kPanel, 0.f);
  if (cols == kPanel) {
    const __m256 z0 = bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
    const __m256 z1 = bias ? _mm256_loadu_ps(bias + 8) : _mm256_setzero_ps();
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      float* out = C + i * ldc;
      __m256 r0 = _mm256_load_ps(part[i]), r1 = _mm256_load_ps(part[i] + 8);
      if (bias) {
        r0 = _mm256_add_ps(r0, z0);
        r1 = _mm256_add_ps(r1, z1);
      }
      if (accumulate) {
        r0 = _mm256_add_ps(_mm256_loadu_ps(out), r0);
        r1 = _mm256_add_ps(_mm256_loadu_ps(out + 8), r1);
      }
      _mm256_storeu_ps(out, r0);
      _mm256_storeu_ps(out + 8, r1);
    }
    return;
  }
  for (int i = 0; i < MR; ++i) {
    float* out = C + i * ldc;
    for (int64_t j = 0; j < cols; ++j) {
      const float v = part[i][j] + (bias ? bias[j] : 0.f);
      out[j] = accumulate ? out[j] + v : v;
    }
  }
}

// Rows [0, M) of x against one panel, in row blocks of at most kRows, sized evenly (32 = 6+6+5+5+5+5);
// the first block prefetches `next` (may be null).
static void panel_rows(const float* A, int64_t lda, int64_t M, const float* B, int64_t K, const float* bias,
                       bool accumulate, float* C, int64_t ldc, int64_t cols, const float* next) {
  const int64_t blocks = (M + kRows - 1) / kRows;
  for (int64_t blk = 0, m = 0; blk < blocks; ++blk) {
    const int64_t rows = M / blocks + (blk < M % blocks ? 1 : 0);
    const float* a = A + m * lda;
    float* c = C + m * ldc;
    const float* pf = blk == 0 ? next : nullptr;
    switch (rows) {
      case 6: tile<6>(a, lda, B, K, bias, accumulate, c, ldc, cols, pf); break;
      case 5: tile<5>(a, lda, B, K, bias, accumulate, c, ldc, cols, pf); break;
      case 4: tile<4>(a, lda, B, K, bias, accumulate, c, ldc, cols, pf); break;
      case 3: tile<3>(a, lda, B, K, bias, accumulate, c, ldc, cols, pf); break;
      case 2: tile<2>(a, lda, B, K, bias, accumulate, c, ldc, cols, pf); break;
      default: tile<1>(a, lda, B, K, bias, accumulate, c, ldc, cols, pf); break;
    }
    m += rows;
  }
}

// One thread, panels [p0, p1) of C (M, N) (+)= A (M, K) · Wᵀ (+ bias), W packed (ceil(N/16), K, 16).
// Rows of A in chunks that stay in L2 (a panel, reused by each row block, stays in L1/L2); each
// panel's first row block prefetches the panel two ahead.
static void packed_gemm_serial(const float* A, int64_t lda, int64_t M, int64_t K, const float* W, int64_t N,
                               const float* bias, bool accumulate, float* C, int64_t ldc, int64_t p0, int64_t p1) {
  const int64_t chunk = std::max<int64_t>(kRows, (65536 / std::max<int64_t>(K, 1)) / kRows * kRows);
  for (int64_t m0 = 0; m0 < M; m0 += chunk) {
    const int64_t rows = std::min(chunk, M - m0);
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n0 = p * kPanel, cols = std::min(kPanel, N - n0);
      panel_rows(A + m0 * lda, lda, rows, W + p * K * kPanel, K, bias ? bias + n0 : nullptr, accumulate,
                 C + m0 * ldc + n0, ldc, cols, p + 2 < p1 ? W + (p + 2) * K * kPanel : nullptr);
    }
  }
}
#endif

bool packed_gemm_available() {
#ifdef PDKV_PACKED_GEMM
  return true;
#else
  return false;
#endif
}

// y (M, N) = x · Wᵀ + bias, or y += x · Wᵀ with `accumulate`. x: (M, K) with unit column stride;
// packed: (P, K, 16) contiguous, P = ceil(N / 16); bias: N values or undefined/empty.
static void packed_gemm_into(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& bias,
                             bool accumulate, torch::Tensor& y) {
#ifdef PDKV_PACKED_GEMM
  const int64_t M = x.size(0), K = x.size(1), N = y.size(1), P = packed.size(0);
  TORCH_CHECK(packed.dim() == 3 && packed.size(1) == K && packed.size(2) == kPanel && packed.is_contiguous(),
              "packed weight must be (ceil(N/16), K, 16) contiguous");
  TORCH_CHECK(P == (N + kPanel - 1) / kPanel, "packed weight has ", P, " panels for ", N, " outputs");
  TORCH_CHECK(x.stride(1) == 1 && y.stride(1) == 1 && y.size(0) == M, "row-major x and y");
  const bool has_bias = bias.defined() && bias.numel() > 0;
  TORCH_CHECK(!has_bias || (bias.numel() == N && bias.is_contiguous()), "bias of N values");
  const float* bp = has_bias ? bias.data_ptr<float>() : nullptr;
  at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    packed_gemm_serial(x.data_ptr<float>(), x.stride(0), M, K, packed.data_ptr<float>(), N, bp, accumulate,
                       y.data_ptr<float>(), y.stride(0), begin, end);
  });
#else
  TORCH_CHECK(false, "packed GEMM not built (no AVX2/FMA)");
#endif
}

// (M, K) float32 -> (M, out_features) = x · Wᵀ + bias, W given packed (see above).
torch::Tensor packed_linear(torch::Tensor x, torch::Tensor packed, int64_t out_features, torch::Tensor bias) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && packed.dtype() == torch::kFloat32 && x.dim() == 2, "float32 (M, K)");
  auto xc = x.stride(1) == 1 ? x : x.contiguous();
  auto y = torch::empty({x.size(0), out_features}, x.options());
  packed_gemm_into(xc, packed, bias, false, y);
  return y;
}

// Rows `ids` (< num_rows) of the (num_rows, K) matrix held packed: an embedding lookup that reads
// the tied lm_head's panels, so a tied model keeps one copy of that matrix.
torch::Tensor packed_rows(torch::Tensor packed, int64_t num_rows, torch::Tensor ids) {
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kPanel && packed.is_contiguous(), "packed (P, K, 16)");
  TORCH_CHECK(num_rows <= packed.size(0) * kPanel, "num_rows exceeds the panels");
  auto idc = ids.to(torch::kLong).contiguous();
  const int64_t T = idc.numel(), K = packed.size(1);
  auto out = torch::empty({T, K}, packed.options());
  const int64_t* ip = idc.data_ptr<int64_t>();
  const float* W = packed.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(ip[t] >= 0 && ip[t] < num_rows, "token id ", ip[t], " out of range");
  at::parallel_for(0, T, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* src = W + (ip[t] / kPanel) * K * kPanel + ip[t] % kPanel;
      float* dst = op + t * K;
      for (int64_t k = 0; k < K; ++k) dst[k] = src[k * kPanel];
    }
  });
  auto shape = ids.sizes().vec();
  shape.push_back(K);
  return out.view(shape);
}
