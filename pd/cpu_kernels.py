"""Optional fused paged decode attention for CPUs (a small C++ extension).

The torch path gathers each request's K/V out of the pages into a scratch
buffer and then runs attention over it: three passes over the context. This
kernel reads every K and V element once, straight from the pages through the
block table, with no padding between requests of different lengths.

It is built on first use with torch's cpp_extension (needs a C++ compiler;
the build is cached under ~/.cache/torch_extensions). When the build fails
or the dtype is not float32, `load()` returns None and callers keep the torch
path, which is the reference.
"""
from __future__ import annotations

import logging
import threading

import torch

logger = logging.getLogger(__name__)

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <vector>
#include <limits>

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
  const int64_t G = Hq / Hkv;
  const int64_t s_blk = cache.stride(0), s_kv = cache.stride(1), s_tok = cache.stride(2);
  const int64_t W = block_table.size(1);
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* cp = cache.data_ptr<float>();
  const int64_t* tp = block_table.data_ptr<int64_t>();
  const int64_t* ks = key_start.data_ptr<int64_t>();
  const int64_t* ke = key_end.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  // One request per task: every K/V row (all heads of one token) is read once, whole.
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> acc(Hq * D);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t start = ks[b], stop = ke[b], n = stop - start;
      scores.assign(Hq * n, 0.f);
      const float* qb = qp + b * Hq * D;
      for (int64_t p = start; p < stop; ++p) {
        const float* krow = cp + tp[b * W + p / bs] * s_blk + (p % bs) * s_tok;
        if (p + bs < stop) {  // same slot of the next block: its first touch is a cache miss otherwise
          const char* nxt = reinterpret_cast<const char*>(cp + tp[b * W + (p + bs) / bs] * s_blk + (p % bs) * s_tok);
          for (int64_t off = 0; off < Hkv * D * 4; off += 64) __builtin_prefetch(nxt + off);
        }
        for (int64_t hq = 0; hq < Hq; ++hq) {
          const float* k = krow + (hq / G) * D;
          const float* qh = qb + hq * D;
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < D; ++d) s += qh[d] * k[d];
          scores[hq * n + (p - start)] = s * sc;
        }
      }
      for (int64_t hq = 0; hq < Hq; ++hq) {
        float* sh = scores.data() + hq * n;
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t j = 0; j < n; ++j) mx = std::max(mx, sh[j]);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < n; ++j) { sh[j] = std::exp(sh[j] - mx); sum += sh[j]; }
        const float inv = 1.f / sum;
#pragma omp simd
        for (int64_t j = 0; j < n; ++j) sh[j] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t p = start; p < stop; ++p) {
        const float* vrow = cp + tp[b * W + p / bs] * s_blk + s_kv + (p % bs) * s_tok;
        if (p + bs < stop) {
          const char* nxt = reinterpret_cast<const char*>(cp + tp[b * W + (p + bs) / bs] * s_blk + s_kv + (p % bs) * s_tok);
          for (int64_t off = 0; off < Hkv * D * 4; off += 64) __builtin_prefetch(nxt + off);
        }
        for (int64_t hq = 0; hq < Hq; ++hq) {
          const float w = scores[hq * n + (p - start)];
          const float* v = vrow + (hq / G) * D;
          float* a = acc.data() + hq * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) a[d] += w * v[d];
        }
      }
      std::copy(acc.begin(), acc.end(), op + b * Hq * D);
    }
  });
  return out;
}
"""

_lock = threading.Lock()
_module = None
_failed = False


def load():
    """The compiled module, or None when it cannot be built here."""
    global _module, _failed
    with _lock:
        if _module is None and not _failed:
            try:
                from torch.utils.cpp_extension import load_inline

                _module = load_inline(
                    name="pdkv_paged_decode_v3", cpp_sources=_SOURCE, functions=["paged_decode_attention"],
                    extra_cflags=["-O3", "-march=native", "-fopenmp-simd", "-ffast-math"], verbose=False)
            except Exception as exc:  # noqa: BLE001 - any build problem means "use the torch path"
                logger.warning("fused CPU decode attention unavailable, using the torch path: %s", exc)
                _failed = True
        return _module


def paged_decode_attention(q: torch.Tensor, layer_cache: torch.Tensor, block_table: torch.Tensor,
                           key_start: torch.Tensor, key_end: torch.Tensor, scale: float) -> torch.Tensor:
    """q (B, Hq, D) attends to positions [key_start, key_end) of its request, read through block_table."""
    module = load()
    assert module is not None, "call load() first and fall back when it returns None"
    return module.paged_decode_attention(q.contiguous(), layer_cache, block_table, key_start, key_end, scale)
