"""Optional fused paged decode kernels for CPUs (a small C++ extension, the cpu_*.cpp files beside this one).

The torch path gathers each request's K/V out of the pages into a scratch
buffer and then runs attention over it: three passes over the context. This
kernel reads every K and V element once, straight from the pages through the
block table, with no padding between requests of different lengths.

It is built on first use with torch's cpp_extension (needs a C++ compiler;
the build is cached under ~/.cache/torch_extensions). When the build fails
or the dtype is not float32, `load()` returns None and callers keep the torch
path, which is the reference.

`decode_layers` goes further for steps made only of decode tokens: every
decoder layer in one call (norms, RoPE, K/V write, attention and SiLU in C++,
the projections through the packed-panel AVX2 GEMM of cpu_gemm.cpp where the
CPU has AVX2 + FMA (`packed_gemm_available()`), else at::linear), so no
per-layer Python or small torch ops.
"""
from __future__ import annotations

import logging
import pathlib
import threading

import torch

logger = logging.getLogger(__name__)

# One translation unit, in this order: cpu_kernels.cpp calls the other two.
_SOURCE_PATHS = [pathlib.Path(__file__).with_name(name)
                 for name in ("cpu_gemm.cpp", "cpu_attention.cpp", "cpu_kernels.cpp")]

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
                    name="pdkv_paged_decode_v11", cpp_sources=[path.read_text() for path in _SOURCE_PATHS],
                    functions=["paged_decode_attention", "decode_layers", "packed_gemm_available",
                               "packed_linear", "packed_rows"],
                    extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math"], extra_ldflags=["-fopenmp"],
                    verbose=False)
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
