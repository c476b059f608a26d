// Every decoder layer of a decode-only step in one call (see decode_layers); the attention comes
// from cpu_attention.cpp, the packed GEMM from cpu_gemm.cpp and chunked_for from cpu_pool.cpp
// (concatenated before this file).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <vector>

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

// A weight matrix as the step reads it: plain (N, K) or packed panels (P, K, 16), and where the
// panels' values are exactly 4-bit blocks (cpu_q4.cpp), their codes and scales (else undefined).
struct Weight {
  const torch::Tensor& w;
  torch::Tensor codes, scales;
};

// y = x · Wᵀ (+ b), or y += x · Wᵀ with `accumulate` (then without bias): from the 4-bit codes
// where the matrix has them and the rows are few (cpu_q4.cpp), else the packed GEMM (cpu_gemm.cpp,
// threads splitting the panels) when w is packed (3-D), else at::linear.
static void project(const torch::Tensor& x, const Weight& weight, const torch::Tensor& b, bool accumulate,
                    torch::Tensor& y, torch::Tensor& tmp) {
  const torch::Tensor& w = weight.w;
  if (q4_usable(weight.codes, x.size(0))) return q4_gemm_into(x, weight.codes, weight.scales, b, accumulate, y);
  if (w.dim() == 3) return packed_gemm_into(x, w, b, accumulate, y);
  TORCH_CHECK(w.dim() == 2, "packed weights need the packed GEMM (AVX2 + FMA)");
  if (accumulate) {
    at::linear_out(tmp, x, w);
    y.add_(tmp);
  } else if (b.defined() && b.numel() > 0) {
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
  const torch::Tensor* q4;  // codes and scales of its 4 matrices (8 tensors, undefined where none), or null
  float* cache;
  int64_t bs, s_blk, s_kv, s_tok, W;
  const int64_t* table;
  const int64_t* key_start;
  const int64_t* slot_block;
};

// Row b's token in one layer, first half: its K (RoPE'd) and V written into its slot. qkv: b's q|k|v row.
static inline void write_new_kv(const StepShape& s, const LayerView& lv, int64_t b, const float* qkv) {
  float* kdst = lv.cache + lv.slot_block[b] * lv.s_blk + s.slot_offsets[b] * lv.s_tok;
  rope_heads(qkv + s.qw, s.cos + b * s.D, s.sin + b * s.D, s.Hkv, s.D, kdst);
  std::copy(qkv + s.qw + s.kw, qkv + s.qw + 2 * s.kw, kdst + lv.s_kv);
}

// Second half: its query (RoPE'd) attends over its keys, read back through the pages (its own
// included, and those of the step's earlier tokens of the same prompt). out: Hq * D values.
static void attend_row(const StepShape& s, const LayerView& lv, int64_t b, const float* qkv,
                       std::vector<float>& qbuf, std::vector<float>& scores, std::vector<float>& acc, float* out) {
  qbuf.resize(s.qw);
  rope_heads(qkv, s.cos + b * s.D, s.sin + b * s.D, s.Hq, s.D, qbuf.data());
  attend_one(qbuf.data(), lv.cache, lv.table + b * lv.W, lv.key_start[b], s.key_end[b], lv.bs, lv.s_blk, lv.s_kv,
             lv.s_tok, s.Hq, s.Hkv, s.D, s.scale, scores, acc, out);
}

// A part of a row's keys holds at least this many: below it the threads' hand-off costs about what
// the split saves.
static constexpr int64_t kMinPartKeys = 32;

// Every row's attention, the threads sharing the work: a row each while the rows are at least as many
// as the threads; else each row's keys cut into parts (attend_part) that are merged afterwards, so
// that a lone request's attention does not leave the other threads idle. qkv: the rows' q|k|v, nqkv apart.
static void attend_rows(const StepShape& s, const LayerView& lv, int64_t B, const float* qkv, int64_t nqkv, float* out) {
  const int64_t T = at::get_num_threads();
  std::vector<int64_t> first(B + 1, 0);  // row b's parts: [first[b], first[b + 1])
  for (int64_t b = 0; b < B; ++b) {
    const int64_t keys = s.key_end[b] - lv.key_start[b];
    first[b + 1] = first[b] + (B >= T ? 1 : std::clamp<int64_t>(keys / kMinPartKeys, 1, T));
  }
  if (first[B] == B) {
    chunked_for(B, [&](int64_t b) {
      thread_local std::vector<float> qbuf, scores, acc;
      attend_row(s, lv, b, qkv + b * nqkv, qbuf, scores, acc, out + b * s.qw);
    });
    return;
  }
  const int64_t P = first[B], Hq = s.Hq, D = s.D;
  // (locals, not thread_local: the threads' lambda below must see the caller's, and a lambda does not
  // capture a thread_local, each thread would read its own)
  std::vector<float> q(B * s.qw), acc(P * Hq * D), m(P * Hq), l(P * Hq);
  std::vector<int64_t> row(P);
  for (int64_t b = 0; b < B; ++b) {
    rope_heads(qkv + b * nqkv, s.cos + b * D, s.sin + b * D, Hq, D, q.data() + b * s.qw);
    for (int64_t j = first[b]; j < first[b + 1]; ++j) row[j] = b;
  }
  chunked_for(P, [&](int64_t j) {
    thread_local std::vector<float> scores;
    const int64_t b = row[j], parts = first[b + 1] - first[b], k = j - first[b];
    const int64_t ks = lv.key_start[b], keys = s.key_end[b] - ks;
    const PagedKV kv{lv.cache, lv.table + b * lv.W, lv.bs, lv.s_blk, lv.s_kv, lv.s_tok, Hq, s.Hkv, D, s.scale};
    attend_part(kv, q.data() + b * s.qw, ks + keys * k / parts, ks + keys * (k + 1) / parts, scores,
                acc.data() + j * Hq * D, m.data() + j * Hq, l.data() + j * Hq);
  });
  for (int64_t b = 0; b < B; ++b) {
    const int64_t j = first[b];
    merge_parts(first[b + 1] - j, Hq, D, acc.data() + j * Hq * D, m.data() + j * Hq, l.data() + j * Hq,
                out + b * s.qw);
  }
}

#ifdef PDKV_PACKED_GEMM
// Rows [r0, r1) of the residual stream x (B, H) through every layer, on the calling thread alone:
// with packed weights the requests are split over the threads once per step, and no thread waits
// for another until the step ends (a request's layer l needs only its own layer l - 1). With
// `final_norm`, the rows leave through the model's final RMSNorm.
static void decode_rows(const StepShape& s, const std::vector<LayerView>& layers, int64_t r0, int64_t r1, float* x,
                        const float* final_norm) {
  const int64_t R = r1 - r0, H = s.H, I = s.I, nqkv = s.qw + 2 * s.kw;
  std::vector<float> h(R * H), qkv(R * nqkv), attn(R * s.qw), gu(R * 2 * I), act(R * I), qbuf, scores, acc;
  float* xr = x + r0 * H;
  // matrix i of the layer (0: q|k|v, 1: o, 2: gate|up, 3: down), from its 4-bit codes where it has them
  const auto gemm = [R](const LayerView& lv, int i, const float* A, int64_t K, int64_t N, const float* bias, bool acc,
                        float* C) {
    const torch::Tensor& w = lv.w[i == 0 ? 1 : i == 1 ? 3 : i == 2 ? 5 : 6];
    if (lv.q4 != nullptr && q4_usable(lv.q4[2 * i], R))
      return q4_gemm_thread(A, K, R, K, lv.q4[2 * i].data_ptr<uint8_t>(),
                            reinterpret_cast<const uint16_t*>(lv.q4[2 * i + 1].data_ptr<at::Half>()), N, bias, acc, C,
                            N, 0, w.size(0));
    packed_gemm_serial(A, K, R, K, w.data_ptr<float>(), N, bias, acc, C, N, 0, w.size(0));
  };
  for (const LayerView& lv : layers) {
    const torch::Tensor* w = lv.w;
    const float* bias = w[2].numel() ? w[2].data_ptr<float>() : nullptr;
    for (int64_t r = 0; r < R; ++r) rms_norm_row(xr + r * H, w[0].data_ptr<float>(), H, s.eps, h.data() + r * H);
    gemm(lv, 0, h.data(), H, nqkv, bias, false, qkv.data());
    for (int64_t r = 0; r < R; ++r) {  // in order: a prompt's token sees its predecessors' K/V of this layer
      write_new_kv(s, lv, r0 + r, qkv.data() + r * nqkv);
      attend_row(s, lv, r0 + r, qkv.data() + r * nqkv, qbuf, scores, acc, attn.data() + r * s.qw);
    }
    gemm(lv, 1, attn.data(), s.qw, H, nullptr, true, xr);
    for (int64_t r = 0; r < R; ++r) rms_norm_row(xr + r * H, w[4].data_ptr<float>(), H, s.eps, h.data() + r * H);
    gemm(lv, 2, h.data(), H, 2 * I, nullptr, false, gu.data());
    silu_mul_rows(gu.data(), R, I, act.data());
    gemm(lv, 3, act.data(), I, H, nullptr, true, xr);
  }
  if (final_norm != nullptr)
    for (int64_t r = 0; r < R; ++r) rms_norm_row(xr + r * H, final_norm, H, s.eps, xr + r * H);
}
#endif

// Every decoder layer for a batch of B token rows, float32 on the CPU: the per-layer small ops
// (norms, RoPE, K/V write, attention, SiLU) run here. A row is a decode token or one token of a
// prompt chunk; each has its own position, slot, block table row and key range [key_start,
// key_end), and a prompt's rows come in position order (each attends to the K/V of the rows before
// it, written in the same layer). x: (B, hidden) embeddings; positions: (B,) int64, each row's RoPE
// from rows of `rope_cos` / `rope_sin` (N, D) and its keys ending at its position. Per layer `weights` holds 7 tensors: input norm, fused q|k|v
// weight, fused q|k|v bias (may be empty), o_proj, post norm, fused gate|up weight, down_proj; the
// four matrices are all plain (N, K) or all packed (P, K, 16) with q|k|v and gate|up unpadded.
// Packed with more than `panel_split_max_rows` rows (or one thread): the rows are split over the threads
// once (by estimated cost: projections plus keys) and each thread runs its requests through all
// layers with the packed GEMM (decode_rows); a step with prompt rows must then run on one thread or
// pass panel_split_max_rows >= B, as a prompt's rows on two threads would race. Otherwise (a small batch: one thread's share of the
// requests would leave the other threads idle, or each thread would stream all the weights for a
// few rows) layer by layer, the threads splitting each projection's panels (packed) or at::linear
// (plain), and the attention by rows (by parts of a row's keys where the rows are fewer than the
// threads: attend_rows). Per group
// (`layer_group` maps layers to groups): the block and offset of each new token's slot, the block
// table and the first key position (an empty tensor: 0 for every row). `q4`: empty, or per layer the codes and scales of its four
// matrices (8 tensors; an undefined or empty pair where a matrix has none, cpu_q4.cpp): a step of at most
// kStreamRows rows (per thread, in the per-thread split) reads those instead of the float32 panels
// (cpu_q4.cpp: up to a register tile's rows, 12 or 6, the same to float32 rounding; above, the same bits). Returns
// hidden states after the last layer, through the model's final RMSNorm
// where `final_norm` holds its weight (else as they leave the last layer: an empty tensor).
torch::Tensor decode_layers(torch::Tensor x, torch::Tensor positions, torch::Tensor rope_cos, torch::Tensor rope_sin,
                            std::vector<torch::Tensor> weights, std::vector<torch::Tensor> caches,
                            std::vector<int64_t> layer_group, std::vector<torch::Tensor> slot_blocks,
                            torch::Tensor slot_offsets, std::vector<torch::Tensor> tables,
                            std::vector<torch::Tensor> key_starts, int64_t Hq, int64_t Hkv, double eps, double scale,
                            int64_t panel_split_max_rows, std::vector<torch::Tensor> q4, torch::Tensor final_norm) {
  const int64_t L = static_cast<int64_t>(caches.size());
  TORCH_CHECK(L > 0 && static_cast<int64_t>(weights.size()) == 7 * L, "7 weights per layer");
  TORCH_CHECK(q4.empty() || static_cast<int64_t>(q4.size()) == 8 * L, "q4: none, or 8 tensors per layer");
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.is_contiguous() && rope_cos.is_contiguous() && rope_sin.is_contiguous(),
              "contiguous float32 inputs");
  TORCH_CHECK(positions.dtype() == torch::kLong && positions.is_contiguous() && positions.numel() == x.size(0),
              "one int64 position per row");
  const bool packed = weights[1].dim() == 3;
  const int64_t B = x.size(0), D = rope_cos.size(1), H = x.size(1);
  const int64_t I = (packed ? weights[5].size(0) * kPanel : weights[5].size(0)) / 2;
  // Each row's cos/sin, from the tables' rows at its position, and its keys' end (its position + 1).
  const int64_t* pos = positions.data_ptr<int64_t>();
  std::vector<float> cos(B * D), sin(B * D);
  std::vector<int64_t> key_end(B), no_window(B, 0);
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(pos[b] >= 0 && pos[b] < rope_cos.size(0), "position ", pos[b], " past the RoPE tables");
    std::copy_n(rope_cos.data_ptr<float>() + pos[b] * D, D, cos.data() + b * D);
    std::copy_n(rope_sin.data_ptr<float>() + pos[b] * D, D, sin.data() + b * D);
    key_end[b] = pos[b] + 1;
  }
  const float* norm = final_norm.defined() && final_norm.numel() ? final_norm.data_ptr<float>() : nullptr;
  TORCH_CHECK(norm == nullptr || final_norm.numel() == H, "final_norm: hidden_size values");
  const StepShape s{Hq, Hkv, D, Hq * D, Hkv * D, H, I, static_cast<float>(eps), static_cast<float>(scale),
                    cos.data(), sin.data(), slot_offsets.data_ptr<int64_t>(), key_end.data()};
  std::vector<LayerView> layers;
  for (int64_t l = 0; l < L; ++l) {
    const torch::Tensor& cache = caches[l];
    TORCH_CHECK(cache.size(4) == D && cache.stride(4) == 1 && cache.stride(3) == D, "head_dim layout");
    const int64_t g = layer_group[l];
    const torch::Tensor& starts = key_starts[g];
    layers.push_back({weights.data() + 7 * l, q4.empty() ? nullptr : q4.data() + 8 * l, cache.data_ptr<float>(),
                      cache.size(2), cache.stride(0),
                      cache.stride(1), cache.stride(2), tables[g].size(1), tables[g].data_ptr<int64_t>(),
                      starts.numel() ? starts.data_ptr<int64_t>() : no_window.data(), slot_blocks[g].data_ptr<int64_t>()});
  }
  x = x.clone();  // the residual stream, updated in place
#ifdef PDKV_PACKED_GEMM
  if (packed && (B > panel_split_max_rows || at::get_num_threads() == 1)) {
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
    chunked_for(parts, [&](int64_t i) {
      if (bounds[i] < bounds[i + 1]) decode_rows(s, layers, bounds[i], bounds[i + 1], xp, norm);
    });
    return x;
  }
#endif
  // Scratch for every layer, in the calling thread's buffer kept between steps (fresh tensors of a
  // few hundred KB each step cost page faults).
  thread_local std::vector<float> scratch;
  const int64_t widths[6] = {H, H, s.qw + 2 * s.kw, s.qw, 2 * I, I};  // h, tmp, qkv, attn, gu, act
  int64_t total = 0;
  for (int64_t w : widths) total += B * w;
  scratch.resize(static_cast<size_t>(total));
  std::vector<torch::Tensor> views;
  int64_t offset = 0;
  for (int64_t w : widths) {
    views.push_back(torch::from_blob(scratch.data() + offset, {B, w}, x.options()));
    offset += B * w;
  }
  auto &h = views[0], &tmp = views[1], &qkv = views[2], &attn = views[3], &gu = views[4], &act = views[5];
  const torch::Tensor none;
  for (int64_t l = 0; l < L; ++l) {
    const LayerView& lv = layers[l];
    const torch::Tensor* w = lv.w;
    const auto matrix = [&](int i) {  // 0: q|k|v, 1: o, 2: gate|up, 3: down
      const torch::Tensor& m = w[i == 0 ? 1 : i == 1 ? 3 : i == 2 ? 5 : 6];
      return lv.q4 == nullptr ? Weight{m, none, none} : Weight{m, lv.q4[2 * i], lv.q4[2 * i + 1]};
    };
    rms_norm_rows(x, w[0], s.eps, h);
    project(h, matrix(0), w[2], false, qkv, tmp);
    const float* qkvp = qkv.data_ptr<float>();
    float* ap = attn.data_ptr<float>();
    // Every row's K/V first (a few hundred floats each), then the attention in parallel: a prompt's
    // token attends to the K/V its predecessors in the step wrote into this layer.
    for (int64_t b = 0; b < B; ++b) write_new_kv(s, lv, b, qkvp + b * qkv.size(1));
    attend_rows(s, lv, B, qkvp, qkv.size(1), ap);
    project(attn, matrix(1), none, true, x, tmp);
    rms_norm_rows(x, w[4], s.eps, h);
    project(h, matrix(2), none, false, gu, tmp);
    chunked_for((B + 7) / 8, [&](int64_t c) {
      const int64_t r0 = 8 * c, rows = std::min<int64_t>(8, B - r0);
      silu_mul_rows(gu.data_ptr<float>() + r0 * 2 * I, rows, I, act.data_ptr<float>() + r0 * I);
    });
    project(act, matrix(3), none, true, x, tmp);
  }
  if (norm != nullptr)
    for (int64_t b = 0; b < B; ++b) rms_norm_row(x.data_ptr<float>() + b * H, norm, H, s.eps, x.data_ptr<float>() + b * H);
  return x;
}

// The compute calls let go of the GIL: a worker's event loop thread (its HTTP streams, new requests)
// runs while a step computes, instead of waiting for the whole step. Arguments are converted before
// the release and the result after it, both with the GIL held.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using release = py::call_guard<py::gil_scoped_release>;
  m.def("paged_decode_attention", &paged_decode_attention, release());
  m.def("decode_layers", &decode_layers, release());
  m.def("packed_linear", &packed_linear, release());
  m.def("packed_rows", &packed_rows, release());
  m.def("screened_argmax", &screened_argmax, release());
  m.def("q4_linear", &q4_linear, release());
  m.def("q4_gemm_available", &q4_gemm_available);
  m.def("q4_factored_rows", &q4_factored_rows);
  m.def("packed_gemm_available", &packed_gemm_available);
  m.def("packed_gemm_isa", &packed_gemm_isa);
}
