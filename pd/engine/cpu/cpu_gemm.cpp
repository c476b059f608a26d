// Packed-panel float32 GEMM for the CPU decode path: y[M, N] (+)= x[M, K] · W[N, K]ᵀ (+ bias).
//
// W is stored once, as panels of 16 output columns: packed[p][k][j] = W[16p + j][k] (zero rows
// pad the last panel), so one k-step of a panel is one 64-byte line. Threads split the panels
// (in chunks, through cpu_pool.cpp's chunked_for).
// Two kernels over that one layout, chosen by M at run time inside the same entry point:
// - M > kSmallRows: register tiles of up to kRows rows × 16 columns (AVX2: 6 rows, two ymm per
//   row; AVX-512: 12 rows, one zmm per row). AVX-512 (two panels a tile): each panel reused from
//   cache by every row block of x while the panels two ahead are prefetched. AVX2, up to
//   kStreamRows rows: the panel in k-chunks of 4 KiB, every row block on a chunk while it is in L1
//   (a panel of K = 576 is 36 KiB, more than Zen 3's 32 KiB L1: row block by row block, each
//   re-read it from L2), the first row block prefetching kAhead lines ahead as the small-M kernel
//   does;
// - M <= kSmallRows (decode at small batch, bound by memory bandwidth): all M rows in one tile
//   whose k-loop is unrolled over independent accumulators, streaming each thread's panels once,
//   front to back, with a software prefetch kAhead lines ahead (the panels are contiguous, so the
//   prefetch runs on into the next panel; the hardware prefetcher stops at every 4 KiB page).
// Built where the compiler targets AVX2 + FMA (the AVX-512 variant where it targets AVX-512F;
// the build is -march=native, per machine); elsewhere `packed_gemm_available()` is false and the
// callers keep at::linear on plain weights.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <array>
#include <utility>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PDKV_PACKED_GEMM 1
#endif

static constexpr int64_t kPanel = 16;  // output columns per panel (one 64-byte line per k)

#ifdef PDKV_PACKED_GEMM
#if defined(__AVX512F__)
using vec = __m512;
static constexpr int kVecs = 1;   // vectors per panel line
static constexpr int kRows = 12;  // rows of x per register tile (12 zmm accumulators)
static inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
static inline void vstore(float* p, vec v) { _mm512_storeu_ps(p, v); }
static inline vec vset1(float a) { return _mm512_set1_ps(a); }
static inline vec vzero() { return _mm512_setzero_ps(); }
// Adds the compiler may not reorder (a builtin with its rounding given, not a vector `+`): under
// -ffast-math it would regroup a tile's sums its own way per instantiation, and one panel alone or in
// a pair (NP) must add in the same order to give the same bits.
static inline vec vadd(vec a, vec b) { return _mm512_add_round_ps(a, b, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
static constexpr const char* kIsa = "avx512";
#else
using vec = __m256;
static constexpr int kVecs = 2;
static constexpr int kRows = 6;  // 12 ymm accumulators
static inline vec vload(const float* p) { return _mm256_loadu_ps(p); }
static inline void vstore(float* p, vec v) { _mm256_storeu_ps(p, v); }
static inline vec vset1(float a) { return _mm256_set1_ps(a); }
static inline vec vzero() { return _mm256_setzero_ps(); }
static inline vec vadd(vec a, vec b) {  // an add the compiler may not reorder (see the AVX-512 one)
  vec r;
  asm("vaddps %2, %1, %0" : "=x"(r) : "x"(a), "x"(b));
  return r;
}
static inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
static constexpr const char* kIsa = "avx2";
#endif
static constexpr int kWidth = kPanel / kVecs;  // floats per vector
static constexpr int64_t kChunk = 64;          // k-steps summed in registers before joining the tile's total
static constexpr int kSmallRows = 4;           // up to this many rows: the streaming small-M kernel
static constexpr int64_t kAhead = 64;          // lines (k-steps) prefetched ahead by the small-M kernel

// Independent accumulator sets in the k-loop of an MR-row tile: enough FMA chains in flight for
// the small tiles (an FMA's latency is ~4 cycles), none for the large ones.
template <int MR>
static constexpr int unroll() { return MR * kVecs >= 8 ? 1 : (MR * kVecs >= 4 ? 2 : 4); }

// C[MR, NP*16 or cols] (+)= A[MR, K] · B[K, NP*16] (+ bias) for NP adjacent panels (B, B + K*16, ...);
// cols < 16 only in a padded last panel (then NP == 1). NP == 2 halves the broadcasts of A per FMA
// (AVX-512: 12 rows x 2 panels = 24 zmm accumulators), which lifts prefill-sized tiles off the
// load ports. With `next`, also prefetches NP lines of the panels after these per k-step,
// front to back, so that DRAM reads overlap this tile's FMAs. The k-sum runs in chunks of kChunk
// whose partial sums are added up in `part` (in L1): the rounding error then grows with
// K / kChunk + kChunk rather than with K, as in a blocked sgemm. Each output's sum runs in the same
// order for any NP, so NP changes no bit of the result.
//
// Where the lines come from is `Lines`: float32 panels in memory (`F32Lines`: the 4-bit path's
// expanded panels, cpu_q4.cpp, go through this one too, so the same lines give the same bits), or the
// lm_head's int8 screen (cpu_argmax.cpp, `Int8Lines`).
struct F32Lines {
  const float* B;
  int64_t K;
  vec load(int q, int64_t k, int v) const { return vload(B + q * K * kPanel + k * kPanel + v * kWidth); }
  void begin(int64_t) {}  // lines [k, k + U) come next (U divides kChunk)
};

template <int MR, int NP, class Lines>
static inline void tile_of(const float* A, int64_t lda, Lines B, int64_t K, const float* bias,
                           bool accumulate, float* C, int64_t ldc, int64_t cols, const float* next) {
  constexpr int U = unroll<MR * NP>();
  constexpr int NV = NP * kVecs;  // vectors per row of the tile
  alignas(64) float part[MR][NP * kPanel];
  for (int64_t k0 = 0; k0 < K; k0 += kChunk) {
    vec c[U][MR][NV];
#pragma GCC unroll 16
    for (int u = 0; u < U; ++u)
      for (int i = 0; i < MR; ++i)
        for (int v = 0; v < NV; ++v) c[u][i][v] = vzero();
    const int64_t k1 = std::min(K, k0 + kChunk);
    int64_t k = k0;
    for (; k + U <= k1; k += U) {
#pragma GCC unroll 4
      for (int u = 0; u < U; ++u) {
        if (next != nullptr)
          for (int q = 0; q < NP; ++q)
            _mm_prefetch(reinterpret_cast<const char*>(next + (NP * (k + u) + q) * kPanel), _MM_HINT_T0);
        if (u == 0) B.begin(k);
        vec b[NV];
        for (int q = 0; q < NP; ++q)
          for (int v = 0; v < kVecs; ++v) b[q * kVecs + v] = B.load(q, k + u, v);
#pragma GCC unroll 16
        for (int i = 0; i < MR; ++i) {
          const vec a = vset1(A[i * lda + k + u]);
          for (int v = 0; v < NV; ++v) c[u][i][v] = vfma(a, b[v], c[u][i][v]);
        }
      }
    }
    for (; k < k1; ++k) {
      B.begin(k);
      if (next != nullptr)
        for (int q = 0; q < NP; ++q) _mm_prefetch(reinterpret_cast<const char*>(next + (NP * k + q) * kPanel), _MM_HINT_T0);
      for (int i = 0; i < MR; ++i) {
        const vec a = vset1(A[i * lda + k]);
        for (int q = 0; q < NP; ++q)
          for (int v = 0; v < kVecs; ++v)
            c[0][i][q * kVecs + v] = vfma(a, B.load(q, k, v), c[0][i][q * kVecs + v]);
      }
    }
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i)
      for (int v = 0; v < NV; ++v) {
        vec s = c[0][i][v];
        for (int u = 1; u < U; ++u) s = vadd(s, c[u][i][v]);
        if (k0 > 0) s = vadd(vload(part[i] + v * kWidth), s);
        vstore(part[i] + v * kWidth, s);
      }
  }
  if (K == 0) std::fill(&part[0][0], &part[0][0] + MR * NP * kPanel, 0.f);
  if (cols == kPanel) {
    vec z[NV];
    for (int v = 0; v < NV; ++v) z[v] = bias ? vload(bias + v * kWidth) : vzero();
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i) {
      float* out = C + i * ldc;
      for (int v = 0; v < NV; ++v) {
        vec r = vload(part[i] + v * kWidth);
        if (bias) r = vadd(r, z[v]);
        if (accumulate) r = vadd(vload(out + v * kWidth), r);
        vstore(out + v * kWidth, r);
      }
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

template <int MR, int NP = 1>
static void tile(const float* A, int64_t lda, const float* B, int64_t K, const float* bias, bool accumulate,
                 float* C, int64_t ldc, int64_t cols, const float* next) {
  tile_of<MR, NP>(A, lda, F32Lines{B, K}, K, bias, accumulate, C, ldc, cols, next);
}

using TileFn = void (*)(const float*, int64_t, const float*, int64_t, const float*, bool, float*, int64_t, int64_t,
                        const float*);
template <int NP, int... R>
static constexpr std::array<TileFn, sizeof...(R)> tiles_of(std::integer_sequence<int, R...>) {
  return {&tile<R + 1, NP>...};
}
static constexpr auto kTiles = tiles_of<1>(std::make_integer_sequence<int, kRows>{});  // kTiles[r - 1]: r rows
// Two panels per tile where that fits the registers (AVX-512: 2 x 12 accumulators; AVX2 keeps one:
// its 16 ymm hold 6 rows x 2 vectors).
static constexpr int kPairPanels = kVecs == 1 ? 2 : 1;
static constexpr auto kPairTiles = tiles_of<kPairPanels>(std::make_integer_sequence<int, kRows>{});

// One kChunk-wide k-range (n <= kChunk k-steps, A and B at its start) of an MR-row, one-panel tile,
// summed into `part` (MR x 16, in L1): part = (first ? 0 : part) + the range's sum. The sums run in
// the same order as `tile`'s (the same U accumulator sets, added up the same way, then onto the
// running total), so a panel computed range by range is bit-identical to one computed by `tile`.
// With `ahead`, also prefetches the line kAhead lines on per k-step.
template <int MR>
static void tile_krange(const float* A, int64_t lda, const float* B, int64_t n, float* part, bool first,
                        const float* ahead) {
  constexpr int U = unroll<MR>();
  vec c[U][MR][kVecs];
#pragma GCC unroll 16
  for (int u = 0; u < U; ++u)
    for (int i = 0; i < MR; ++i)
      for (int v = 0; v < kVecs; ++v) c[u][i][v] = vzero();
  int64_t k = 0;
  for (; k + U <= n; k += U) {
#pragma GCC unroll 4
    for (int u = 0; u < U; ++u) {
      if (ahead != nullptr) _mm_prefetch(reinterpret_cast<const char*>(ahead + (k + u) * kPanel), _MM_HINT_T0);
      vec b[kVecs];
      for (int v = 0; v < kVecs; ++v) b[v] = vload(B + (k + u) * kPanel + v * kWidth);
#pragma GCC unroll 16
      for (int i = 0; i < MR; ++i) {
        const vec a = vset1(A[i * lda + k + u]);
        for (int v = 0; v < kVecs; ++v) c[u][i][v] = vfma(a, b[v], c[u][i][v]);
      }
    }
  }
  for (; k < n; ++k) {
    if (ahead != nullptr) _mm_prefetch(reinterpret_cast<const char*>(ahead + k * kPanel), _MM_HINT_T0);
    for (int i = 0; i < MR; ++i) {
      const vec a = vset1(A[i * lda + k]);
      for (int v = 0; v < kVecs; ++v) c[0][i][v] = vfma(a, vload(B + k * kPanel + v * kWidth), c[0][i][v]);
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < kVecs; ++v) {
      vec s = c[0][i][v];
      for (int u = 1; u < U; ++u) s = vadd(s, c[u][i][v]);
      if (!first) s = vadd(vload(part + i * kPanel + v * kWidth), s);
      vstore(part + i * kPanel + v * kWidth, s);
    }
}

using RangeFn = void (*)(const float*, int64_t, const float*, int64_t, float*, bool, const float*);
template <int... R>
static constexpr std::array<RangeFn, sizeof...(R)> ranges_of(std::integer_sequence<int, R...>) {
  return {&tile_krange<R + 1>...};
}
static constexpr auto kRanges = ranges_of(std::make_integer_sequence<int, kRows>{});  // kRanges[r - 1]: r rows
static constexpr int64_t kStreamRows = 64;  // the k-chunk-outer schedule's row limit (its sums: 4 KiB on the stack)

// One k-range of `B` (n <= kChunk lines, A and B at its start) for rows [0, M) in row blocks of at
// most kRows, sized evenly as in panel_rows; the first block prefetches `ahead` (may be null).
static inline void rows_krange(const float* A, int64_t lda, int64_t M, const float* B, int64_t n,
                               float (*part)[kPanel], bool first, const float* ahead) {
  const int64_t blocks = (M + kRows - 1) / kRows;
  for (int64_t blk = 0, m = 0; blk < blocks; ++blk) {
    const int64_t rows = M / blocks + (blk < M % blocks ? 1 : 0);
    kRanges[rows - 1](A + m * lda, lda, B, n, part[m], first, blk == 0 ? ahead : nullptr);
    m += rows;
  }
}

// C rows [0, M), columns [0, cols) (+)= part (+ bias).
static inline void store_part(const float (*part)[kPanel], int64_t M, const float* bias, bool accumulate, float* C,
                              int64_t ldc, int64_t cols) {
  for (int64_t i = 0; i < M; ++i) {
    float* out = C + i * ldc;
    for (int64_t j = 0; j < cols; ++j) {
      const float v = part[i][j] + (bias ? bias[j] : 0.f);
      out[j] = accumulate ? out[j] + v : v;
    }
  }
}

// Rows [0, M) (M <= kStreamRows) of x against one panel, k-chunk by k-chunk: each 4 KiB chunk of the
// panel is read from memory once and used by every row block while it is in L1; the first row block
// prefetches `ahead` (may be null) as it goes. Bit-identical to panel_rows with np = 1.
static void panel_rows_streamed(const float* A, int64_t lda, int64_t M, const float* B, int64_t K, const float* bias,
                                bool accumulate, float* C, int64_t ldc, int64_t cols, const float* ahead) {
  alignas(64) float part[kStreamRows][kPanel];
  for (int64_t k0 = 0; k0 < K; k0 += kChunk)
    rows_krange(A + k0, lda, M, B + k0 * kPanel, std::min(kChunk, K - k0), part, k0 == 0,
                ahead ? ahead + k0 * kPanel : nullptr);
  if (K == 0) std::fill(&part[0][0], &part[0][0] + M * kPanel, 0.f);
  store_part(part, M, bias, accumulate, C, ldc, cols);
}

// Rows [0, M) of x against `np` adjacent full panels (1, or kPairPanels) or one padded one, in row
// blocks of at most kRows, sized evenly (32 = 6+6+5+5+5+5); the first block prefetches `next` (may be null).
static void panel_rows(const float* A, int64_t lda, int64_t M, const float* B, int64_t K, const float* bias,
                       bool accumulate, float* C, int64_t ldc, int64_t cols, const float* next, int np) {
  const auto& tiles = np == 1 ? kTiles : kPairTiles;
  const int64_t blocks = (M + kRows - 1) / kRows;
  for (int64_t blk = 0, m = 0; blk < blocks; ++blk) {
    const int64_t rows = M / blocks + (blk < M % blocks ? 1 : 0);
    tiles[rows - 1](A + m * lda, lda, B, K, bias, accumulate, C + m * ldc, ldc, cols, blk == 0 ? next : nullptr);
    m += rows;
  }
}

// One thread, panels [p0, p1) of C (M, N) (+)= A (M, K) · Wᵀ (+ bias), W packed (ceil(N/16), K, 16).
// M <= kSmallRows: one pass over the panels, front to back, prefetching kAhead lines ahead. AVX2 up
// to kStreamRows rows: the same pass, each panel k-chunk by k-chunk (panel_rows_streamed). Else
// rows of A in chunks that stay in L2 (a panel, reused by each row block, stays in L1/L2), each
// panel's first row block prefetching the panel two ahead.
static void packed_gemm_serial(const float* A, int64_t lda, int64_t M, int64_t K, const float* W, int64_t N,
                               const float* bias, bool accumulate, float* C, int64_t ldc, int64_t p0, int64_t p1) {
  if (M <= 0) return;
  if (M <= kSmallRows) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n0 = p * kPanel;
      const float* B = W + p * K * kPanel;
      kTiles[M - 1](A, lda, B, K, bias ? bias + n0 : nullptr, accumulate, C + n0, ldc, std::min(kPanel, N - n0),
                    B + kAhead * kPanel);
    }
    return;
  }
  if (kPairPanels == 1 && M <= kStreamRows) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n0 = p * kPanel;
      const float* B = W + p * K * kPanel;
      panel_rows_streamed(A, lda, M, B, K, bias ? bias + n0 : nullptr, accumulate, C + n0, ldc,
                          std::min(kPanel, N - n0), B + kAhead * kPanel);
    }
    return;
  }
  const int64_t chunk = std::max<int64_t>(kRows, (65536 / std::max<int64_t>(K, 1)) / kRows * kRows);
  for (int64_t m0 = 0; m0 < M; m0 += chunk) {
    const int64_t rows = std::min(chunk, M - m0);
    for (int64_t p = p0; p < p1;) {
      const int64_t n0 = p * kPanel;
      // kPairPanels at once where they are all full and this thread's; else one.
      const int np = (p + kPairPanels <= p1 && n0 + kPairPanels * kPanel <= N) ? kPairPanels : 1;
      const int64_t ahead = p + 2 * np;  // the panels two tiles on, prefetched from this one
      panel_rows(A + m0 * lda, lda, rows, W + p * K * kPanel, K, bias ? bias + n0 : nullptr, accumulate,
                 C + m0 * ldc + n0, ldc, np > 1 ? kPanel : std::min(kPanel, N - n0),
                 ahead + np <= p1 ? W + ahead * K * kPanel : nullptr, np);
      p += np;
    }
  }
}
#endif

// Which packed kernels this build holds: "avx512", "avx2" or "" (none: plain weights, at::linear).
std::string packed_gemm_isa() {
#ifdef PDKV_PACKED_GEMM
  return kIsa;
#else
  return "";
#endif
}

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
  // Chunks of whole panels, about 8 per thread, taken by whichever thread is free (cpu_pool.cpp).
  int64_t per = std::max<int64_t>(1, P / (8 * at::get_num_threads()));
  if (M > kSmallRows) per = (per + kPairPanels - 1) / kPairPanels * kPairPanels;  // whole pairs
  const float *xp = x.data_ptr<float>(), *wp = packed.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  chunked_for((P + per - 1) / per, [&](int64_t c) {
    packed_gemm_serial(xp, x.stride(0), M, K, wp, N, bp, accumulate, yp, y.stride(0), c * per, std::min(P, (c + 1) * per));
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
