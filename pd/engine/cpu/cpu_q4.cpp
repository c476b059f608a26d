// Float32 weights held losslessly as 4-bit codes: the packed GEMM of up to kStreamRows rows reading
// a sixth of the bytes (pd/engine/cpu/packed_q4.py finds such weights and proves them exact).
//
// A checkpoint dequantized from a 4-bit GGUF (Q4_1: blocks of 32 weights along K, each
// w = d * q + m with half-precision d, m and q in 0..15) holds float32 weights that are exactly
// fl(d * q + m): d * q is exact in float32 (an 11-bit significand times a 4-bit integer), so one
// fused multiply-add gives the same single rounding. Per panel line (16 outputs at one k) that is 8
// bytes of codes, plus per 32 lines a d and an m for each output, against 64 bytes of float32.
// A decode step at small batch reads every weight once, from memory: this reads 6.4x fewer bytes.
// Two ways to compute with them:
// - Up to kRows rows (a register tile's: 12 on AVX-512, 6 on AVX2; decode steps): the factored tile
//   (q4_tile) multiplies the activations by the codes' integers and applies d and m once per block,
//   in registers. The weights are the same; the sums are float32 sums rounded their own way (within
//   the bound given at q4_tile).
// - Above (AVX2 up to kStreamRows; AVX-512 only in q4_linear): the codes are expanded into float32 in
//   cache (the same values, bit for bit) and the float32 path's own tiles run on them, so the results
//   are those of the float32 panels (packed_gemm_serial), bit for bit.
//
// Layout per matrix: codes (P, K, 8) uint8, byte c of line k holding output c in its low nibble and
// output c + 8 in its high one; scales (P, K / 32, 2, 16) float16 (d and m are half-precision values in
// the GGUF, and find_q4 keeps only such: the conversion to float32 is exact), d then m per output.

#include <cstring>
#ifdef PDKV_PACKED_GEMM
static constexpr int64_t kQ4Block = 32;  // weights per (d, m) along K
static constexpr int64_t kQ4Ahead = 4;   // k-chunks of codes and scales prefetched ahead

// Lines [k0, k0 + n) (n <= kChunk; k0 and n multiples of kQ4Block) of one panel's codes and scales
// expanded into out (n, 16) float32: the exact weights.
static inline __m256 half8(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
#if defined(__AVX512F__)
static inline __m512 half16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#endif
static inline void q4_expand(const uint8_t* codes, const uint16_t* scales, int64_t k0, int64_t n, float* out) {
  const __m128i low4 = _mm_set1_epi8(0x0F);
  for (int64_t b0 = k0; b0 < k0 + n; b0 += kQ4Block) {
    const uint16_t* dm = scales + (b0 / kQ4Block) * 2 * kPanel;
#if defined(__AVX512F__)
    // one zmm a line; two lines per 16-byte load (a block has an even number of lines)
    const __m512 d = half16(dm), m = half16(dm + kPanel);
    for (int64_t k = b0; k < b0 + kQ4Block; k += 2) {
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + k * 8));
      const __m128i lo = _mm_and_si128(bytes, low4);
      const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low4);
      float* o = out + (k - k0) * kPanel;  // line k: outputs 0-7 from the low nibbles, 8-15 from the high
      _mm512_storeu_ps(o, _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi64(lo, hi))), m));
      _mm512_storeu_ps(o + kPanel,
                       _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpackhi_epi64(lo, hi))), m));
    }
#else
    const __m256 d0 = half8(dm), d1 = half8(dm + 8);
    const __m256 m0 = half8(dm + kPanel), m1 = half8(dm + kPanel + 8);
    for (int64_t k = b0; k < b0 + kQ4Block; ++k) {
      const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + k * 8));
      const __m128i lo = _mm_and_si128(bytes, low4);
      const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low4);
      float* o = out + (k - k0) * kPanel;
      _mm256_storeu_ps(o, _mm256_fmadd_ps(d0, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), m0));
      _mm256_storeu_ps(o + 8, _mm256_fmadd_ps(d1, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), m1));
    }
#endif
  }
}

// Lines [k0, k0 + n) of one panel expanded into out (see q4_expand), with the codes and scales
// kQ4Ahead chunks on prefetched (into the next panels past the end: they follow in memory).
static inline void q4_expand_ahead(const uint8_t* pc, const uint16_t* ps, int64_t k0, int64_t n, float* out) {
  const int64_t ahead = k0 + kQ4Ahead * kChunk;
  for (int64_t b = 0; b < kChunk * 8; b += 64) _mm_prefetch(reinterpret_cast<const char*>(pc + ahead * 8 + b), _MM_HINT_T0);
  for (int64_t b = 0; b < (kChunk / kQ4Block) * 2 * kPanel; b += 32)
    _mm_prefetch(reinterpret_cast<const char*>(ps + (ahead / kQ4Block) * 2 * kPanel + b), _MM_HINT_T0);
  q4_expand(pc, ps, k0, n, out);
}

// The factored tile (a step's few rows): per block of 32 lines, w = d * q + m gives
// sum_k a_k w_k = d * (sum_k a_k q_k) + m * (sum_k a_k), so the codes' small integers 0..15 are
// multiplied by the activations directly and d and m are applied once a block: one FMA a line and
// row (per vector), where expanding each weight first (fl(d * q + m)) costs a second one. At one row
// the FMAs are what bounds the step (Zen 4, SmolLM2's layer matrices: taking the expansion's FMA out
// made them 1.2x faster). The weights are the same; the sums are rounded differently: summed in blocks
// (32 lines, then K / 32 blocks), within about (32 + K / 32) units of roundoff of sum_k |a_k| (d q_k + |m|).
#if defined(__AVX512VBMI__)
// Bit offsets, in a line's 8 bytes of codes, of each 32-bit lane's nibble (lane c < 8: byte c's low
// nibble; lane c >= 8: byte c - 8's high one), at byte 0 of the lane.
static inline __m512i q4_nibble_shifts() {
  alignas(64) static const uint8_t shifts[64] = {
      0, 0, 0, 0, 8, 0, 0, 0, 16, 0, 0, 0, 24, 0, 0, 0, 32, 0, 0, 0, 40, 0, 0, 0, 48, 0, 0, 0, 56, 0, 0, 0,
      4, 0, 0, 0, 12, 0, 0, 0, 20, 0, 0, 0, 28, 0, 0, 0, 36, 0, 0, 0, 44, 0, 0, 0, 52, 0, 0, 0, 60, 0, 0, 0};
  return _mm512_load_si512(shifts);
}
#endif
// Line k's 16 codes as the floats 0..15, output j in lane j of the line's kVecs vectors.
static inline void q4_code_floats(const uint8_t* line, vec* out) {
#if defined(__AVX512VBMI__)
  int64_t bits;
  std::memcpy(&bits, line, 8);
  // each 32-bit lane's low 4 bits <- its nibble (multishift), then the float of 0..15 it names (vpermps
  // reads only those 4 bits): one shuffle-port op each, no integer-to-float conversion
  const __m512i picked = _mm512_multishift_epi64_epi8(q4_nibble_shifts(), _mm512_set1_epi64(bits));
  out[0] = _mm512_permutexvar_ps(picked, _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
#else
  const __m128i low4 = _mm_set1_epi8(0x0F);
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(line));
  const __m128i lo = _mm_and_si128(bytes, low4), hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low4);
#if defined(__AVX512F__)
  out[0] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi64(lo, hi)));
#else
  out[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
  out[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
#endif
#endif
}
// Vector v of a block's d (or m) row: 16 half-precision values per panel.
static inline vec q4_scale(const uint16_t* dm, int v) {
#if defined(__AVX512F__)
  (void)v;
  return half16(dm);
#else
  return half8(dm + v * kWidth);
#endif
}

static constexpr int64_t kQ4Lead = 8;  // blocks ahead prefetched in the codes and scales (2 KiB of codes)

// C[MR, NP*16 or cols] (+)= A[MR, K] · Wᵀ (+ bias) for NP adjacent panels (codes + q * code_bytes,
// scales + q * scale_halves), the factored way (above); asum[i * (K / 32) + b]: the sum of row i's
// activations over block b. cols < 16 only in a padded last panel (then NP == 1).
template <int MR, int NP>
static void q4_tile(const uint8_t* codes, const uint16_t* scales, int64_t code_bytes, int64_t scale_halves,
                    const float* A, int64_t lda, const float* asum, int64_t K, const float* bias, bool accumulate,
                    float* C, int64_t ldc, int64_t cols) {
  constexpr int U = unroll<MR * NP>();  // independent sums in flight per output vector (FMA latency)
  constexpr int NV = NP * kVecs;         // vectors per row of the tile
  const int64_t blocks = K / kQ4Block;
  vec total[MR][NV];  // touched once a block: where the registers run out, these are the ones spilled
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < NV; ++v) total[i][v] = vzero();
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t k0 = b * kQ4Block;
    for (int q = 0; q < NP; ++q) {
      const uint8_t* ahead = codes + q * code_bytes + (k0 + kQ4Lead * kQ4Block) * 8;  // runs on into the next panels
      for (int64_t c = 0; c < kQ4Block * 8; c += 64) _mm_prefetch(reinterpret_cast<const char*>(ahead + c), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(scales + q * scale_halves + (b + kQ4Lead) * 2 * kPanel), _MM_HINT_T0);
    }
    vec sum[U][MR][NV];
#pragma GCC unroll 16
    for (int u = 0; u < U; ++u)
      for (int i = 0; i < MR; ++i)
        for (int v = 0; v < NV; ++v) sum[u][i][v] = vzero();
    for (int64_t k = k0; k < k0 + kQ4Block; k += U) {
#pragma GCC unroll 4
      for (int u = 0; u < U; ++u) {
        vec w[NV];
        for (int q = 0; q < NP; ++q) q4_code_floats(codes + q * code_bytes + (k + u) * 8, w + q * kVecs);
#pragma GCC unroll 16
        for (int i = 0; i < MR; ++i) {
          const vec a = vset1(A[i * lda + k + u]);
          for (int v = 0; v < NV; ++v) sum[u][i][v] = vfma(a, w[v], sum[u][i][v]);
        }
      }
    }
    for (int q = 0; q < NP; ++q) {
      const uint16_t* dm = scales + q * scale_halves + b * 2 * kPanel;
      for (int v = q * kVecs; v < (q + 1) * kVecs; ++v) {
        const vec d = q4_scale(dm, v - q * kVecs), m = q4_scale(dm + kPanel, v - q * kVecs);
#pragma GCC unroll 16
        for (int i = 0; i < MR; ++i) {
          vec s = sum[0][i][v];
          for (int u = 1; u < U; ++u) s = vadd(s, sum[u][i][v]);
          total[i][v] = vfma(m, vset1(asum[i * blocks + b]), vfma(d, s, total[i][v]));
        }
      }
    }
  }
  for (int i = 0; i < MR; ++i) {
    float* out = C + i * ldc;
    if (cols == kPanel) {
      for (int v = 0; v < NV; ++v) {
        vec r = total[i][v];
        if (bias) r = vadd(r, vload(bias + v * kWidth));
        if (accumulate) r = vadd(vload(out + v * kWidth), r);
        vstore(out + v * kWidth, r);
      }
    } else {  // a padded last panel: only its first cols outputs exist
      alignas(64) float row[kPanel];
      for (int v = 0; v < kVecs; ++v) vstore(row + v * kWidth, total[i][v]);
      for (int64_t j = 0; j < cols; ++j) {
        const float r = row[j] + (bias ? bias[j] : 0.f);
        out[j] = accumulate ? out[j] + r : r;
      }
    }
  }
}
using Q4TileFn = void (*)(const uint8_t*, const uint16_t*, int64_t, int64_t, const float*, int64_t, const float*,
                          int64_t, const float*, bool, float*, int64_t, int64_t);
template <int NP, int... R>
static constexpr std::array<Q4TileFn, sizeof...(R)> q4_tiles_of(std::integer_sequence<int, R...>) {
  return {&q4_tile<R + 1, NP>...};
}
// kQ4Tiles[r - 1]: r rows, one panel; kQ4PairTiles: kPairPanels panels (as the float32 path pairs them)
static constexpr auto kQ4Tiles = q4_tiles_of<1>(std::make_integer_sequence<int, kRows>{});
static constexpr auto kQ4PairTiles = q4_tiles_of<kPairPanels>(std::make_integer_sequence<int, kRows>{});

// Each row's activations summed per block of kQ4Block, asum[i * (K / kQ4Block) + b], for q4_tile: in a
// buffer of the calling thread's own, valid until its next call; nullptr above kRows rows (no factored tile).
static const float* q4_block_sums(const float* A, int64_t lda, int64_t M, int64_t K) {
  if (M > kRows) return nullptr;
  const int64_t blocks = K / kQ4Block;
  thread_local std::vector<float> asum;
  asum.resize(static_cast<size_t>(M * blocks));
  for (int64_t i = 0; i < M; ++i)
    for (int64_t b = 0; b < blocks; ++b) {
      float t = 0.f;
      for (int64_t k = b * kQ4Block; k < (b + 1) * kQ4Block; ++k) t += A[i * lda + k];
      asum[i * blocks + b] = t;
    }
  return asum.data();
}

// One thread, panels [p0, p1) of C (M, N) (+)= A (M, K) · Wᵀ (+ bias), W given as codes and scales
// (M <= kStreamRows, K a multiple of kQ4Block). Up to kRows rows: the factored tiles (q4_tile), whose
// sums are rounded their own way. Above, bit-identical to packed_gemm_serial on the float32 panels:
// AVX2 (one panel per tile) expands each panel k-chunk by k-chunk into L1 for every row block there
// (rows_krange, whose sums run in the order of the float32 path's tiles); AVX-512 (q4_linear only)
// expands each group of panels the float32 path tiles together whole into a per-thread buffer
// (K = 1536: 96 KiB a panel, in L2) and gives it to the same tiles. asum: A's block sums
// (q4_block_sums), given where M <= kRows (the factored tiles read them).
static void q4_gemm_serial(const float* A, int64_t lda, int64_t M, int64_t K, const uint8_t* codes,
                           const uint16_t* scales, int64_t N, const float* bias, bool accumulate, float* C, int64_t ldc,
                           int64_t p0, int64_t p1, const float* asum) {
  if (M <= 0) return;
  const int64_t code_bytes = K * 8, scale_halves = (K / kQ4Block) * 2 * kPanel;
  if (M <= kRows) {
    // one panel a tile up to kSmallRows rows, else pairs where both panels are full and this thread's
    // (as packed_gemm_serial); the codes are read once, and no expanded panel goes through the caches
    for (int64_t p = p0; p < p1;) {
      const int64_t n0 = p * kPanel;
      const int np = (M > kSmallRows && p + kPairPanels <= p1 && n0 + kPairPanels * kPanel <= N) ? kPairPanels : 1;
      (np > 1 ? kQ4PairTiles : kQ4Tiles)[M - 1](
          codes + p * code_bytes, scales + p * scale_halves, code_bytes, scale_halves, A, lda, asum, K,
          bias ? bias + n0 : nullptr, accumulate, C + n0, ldc, np > 1 ? kPanel : std::min(kPanel, N - n0));
      p += np;
    }
    return;
  }
  if (kPairPanels == 1) {
    alignas(64) float part[kStreamRows][kPanel];
    alignas(64) float w[kChunk * kPanel];
    for (int64_t p = p0; p < p1; ++p) {
      const uint8_t* pc = codes + p * code_bytes;
      const uint16_t* ps = scales + p * scale_halves;
      for (int64_t k0 = 0; k0 < K; k0 += kChunk) {
        const int64_t n = std::min(kChunk, K - k0);
        q4_expand_ahead(pc, ps, k0, n, w);
        rows_krange(A + k0, lda, M, w, n, part, k0 == 0, nullptr);
      }
      if (K == 0) std::fill(&part[0][0], &part[0][0] + M * kPanel, 0.f);
      const int64_t n0 = p * kPanel;
      store_part(part, M, bias ? bias + n0 : nullptr, accumulate, C + n0, ldc, std::min(kPanel, N - n0));
    }
    return;
  }
  thread_local std::vector<float> buffer;
  buffer.resize(kPairPanels * K * kPanel + 16);
  float* w = buffer.data() + ((-reinterpret_cast<uintptr_t>(buffer.data()) / sizeof(float)) & 15);  // 64-byte aligned
  const bool pairs = M > kSmallRows;
  const int64_t row_chunk = std::max<int64_t>(kRows, (65536 / std::max<int64_t>(K, 1)) / kRows * kRows);
  for (int64_t p = p0; p < p1;) {
    const int64_t n0 = p * kPanel;
    // as packed_gemm_serial: kPairPanels at once where they are all full and this thread's; else one
    const int np = (pairs && p + kPairPanels <= p1 && n0 + kPairPanels * kPanel <= N) ? kPairPanels : 1;
    for (int q = 0; q < np; ++q)
      for (int64_t k0 = 0; k0 < K; k0 += kChunk)
        q4_expand_ahead(codes + (p + q) * code_bytes, scales + (p + q) * scale_halves, k0, std::min(kChunk, K - k0),
                        w + q * K * kPanel + k0 * kPanel);
    if (!pairs)
      kTiles[M - 1](A, lda, w, K, bias ? bias + n0 : nullptr, accumulate, C + n0, ldc, std::min(kPanel, N - n0),
                    nullptr);
    else
      for (int64_t m0 = 0; m0 < M; m0 += row_chunk)
        panel_rows(A + m0 * lda, lda, std::min(row_chunk, M - m0), w, K, bias ? bias + n0 : nullptr, accumulate,
                   C + m0 * ldc + n0, ldc, np > 1 ? kPanel : std::min(kPanel, N - n0), nullptr, np);
    p += np;
  }
}

// q4_gemm_serial for a caller that runs the whole GEMM on this thread (decode_rows): the block sums first.
static void q4_gemm_thread(const float* A, int64_t lda, int64_t M, int64_t K, const uint8_t* codes,
                           const uint16_t* scales, int64_t N, const float* bias, bool accumulate, float* C, int64_t ldc,
                           int64_t p0, int64_t p1) {
  q4_gemm_serial(A, lda, M, K, codes, scales, N, bias, accumulate, C, ldc, p0, p1, q4_block_sums(A, lda, M, K));
}
#endif

// Up to how many rows the 4-bit path runs the factored tiles (0: never; then its results are the
// float32 panels', bit for bit, at every row count).
int64_t q4_factored_rows() {
#ifdef PDKV_PACKED_GEMM
  return kRows;
#else
  return 0;
#endif
}

// Whether this build runs the 4-bit path: wherever it has the packed GEMM (AVX2 or AVX-512).
bool q4_gemm_available() {
#ifdef PDKV_PACKED_GEMM
  return true;
#else
  return false;
#endif
}

// Whether a step of M rows runs from `codes` (defined: the matrix has them).
#if defined(__AVX512F__)
// AVX-512 builds run one row block (up to kRows, the factored tiles); past that the codes cost more
// than the bytes they save (SmolLM2 layer matrices, 2 threads, 2026-12-06, with the expanding tile of
// before: 0.31-0.45x the float32 panels' time at 1-4 rows, 0.73x at 8, 0.85x at 12; 16 rows as two
// blocks of 8 would take 23.4 ms against the panels' 21.7).
static constexpr int64_t kQ4MaxRows = kRows;
#else
static constexpr int64_t kQ4MaxRows = 64;  // AVX2: chunk by chunk in L1, the packed GEMM's streamed rows
#endif

static bool q4_usable(const torch::Tensor& codes, int64_t M) {
#ifdef PDKV_PACKED_GEMM
  return codes.defined() && codes.numel() > 0 && M <= kQ4MaxRows && M <= kStreamRows;
#else
  (void)codes;
  (void)M;
  return false;
#endif
}

// y (M, N) = x · Wᵀ + bias, or y += x · Wᵀ with `accumulate`, W as codes (P, K, 8) and scales
// (P, K / 32, 2, 16); M <= kStreamRows. The threads split the panels as packed_gemm_into does (the
// same chunks, so the same pairs).
static void q4_gemm_into(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scales,
                         const torch::Tensor& bias, bool accumulate, torch::Tensor& y) {
#ifdef PDKV_PACKED_GEMM
  const int64_t M = x.size(0), K = x.size(1), N = y.size(1), P = codes.size(0);
  TORCH_CHECK(M <= kStreamRows, "the 4-bit path takes at most ", kStreamRows, " rows");
  TORCH_CHECK(codes.dtype() == torch::kUInt8 && codes.dim() == 3 && codes.size(1) == K && codes.size(2) == 8 &&
              codes.is_contiguous(), "codes must be (P, K, 8) uint8");
  TORCH_CHECK(K % kQ4Block == 0 && scales.dtype() == torch::kHalf && scales.is_contiguous() &&
              scales.numel() == P * (K / kQ4Block) * 2 * kPanel, "scales must be (P, K / 32, 2, 16) float16");
  TORCH_CHECK(P == (N + kPanel - 1) / kPanel && x.stride(1) == 1 && y.stride(1) == 1 && y.size(0) == M,
              "P = ceil(N / 16), row-major x and y");
  const bool has_bias = bias.defined() && bias.numel() > 0;
  TORCH_CHECK(!has_bias || (bias.numel() == N && bias.is_contiguous()), "bias of N values");
  const float* bp = has_bias ? bias.data_ptr<float>() : nullptr;
  int64_t per = std::max<int64_t>(1, P / (8 * at::get_num_threads()));
  if (M > kSmallRows) per = (per + kPairPanels - 1) / kPairPanels * kPairPanels;  // whole pairs, as packed_gemm_into
  const float* xp = x.data_ptr<float>();
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  float* yp = y.data_ptr<float>();
  // the block sums once for every thread's panels (the factored tiles' only per-row work besides the FMAs);
  // this thread's buffer stays put while chunked_for runs
  const float* asum = q4_block_sums(xp, x.stride(0), M, K);
  chunked_for((P + per - 1) / per, [&](int64_t c) {
    q4_gemm_serial(xp, x.stride(0), M, K, cp, sp, N, bp, accumulate, yp, y.stride(0), c * per,
                   std::min(P, (c + 1) * per), asum);
  });
#else
  TORCH_CHECK(false, "the 4-bit path needs the packed GEMM (AVX2 + FMA)");
#endif
}

// (M, K) float32 -> (M, out_features) = x · Wᵀ + bias, W as codes and scales (see above): for tests
// and benchmarks (the engine calls q4_gemm_into from decode_layers).
torch::Tensor q4_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, int64_t out_features,
                        torch::Tensor bias) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2, "float32 (M, K)");
  auto xc = x.stride(1) == 1 ? x : x.contiguous();
  auto y = torch::empty({x.size(0), out_features}, x.options());
  q4_gemm_into(xc, codes, scales, bias, false, y);
  return y;
}
