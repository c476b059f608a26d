"""The CPU step executor's weights: laid out once, at load time, for the C++ kernels.

The q/k/v and gate/up matrices are concatenated (four matmuls a layer instead of seven). Where the
packed-panel GEMM of cpu_gemm.cpp is built and the shapes allow, the layers are re-laid as panels
(packed_linear.py `packed_copy`, whose model copy the per-layer path runs), with the 4-bit codes of
matrices that are exactly 4-bit blocks (packed_q4.py), the GEMM crossovers for prefill-sized batches
(gemm_tuning.py) and an int8 screen of the lm_head for greedy tokens (greedy_head.py); elsewhere the
concatenated plain weights go through at::linear. Either way they sit in buffers Linux may back with
2 MiB pages. The engine's model is not changed.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import logging
import math

import torch

from pd.engine.cpu import gemm_tuning, packed_linear, packed_q4
from pd.engine.cpu import kernels as cpu_kernels
from pd.engine.cpu.greedy_head import GreedyHead, greedy_head_for
from pd.engine.model.llama import CausalLM

logger = logging.getLogger(__name__)

_EMPTY = torch.empty(0)
_HUGE = 1 << 21
_MADV_HUGEPAGE = 14


def on_huge_pages(shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
    """Empty float32 tensors of `shapes` in one buffer the kernel may back with 2 MiB pages (Linux THP).

    Every decode step streams all weights from memory; with 4 KiB pages that
    is a TLB miss every 4 KiB. Where madvise is unavailable the buffer is
    plain memory (same values, same results).
    """
    numels = [math.prod(s) for s in shapes]
    sizes = [(n + 15) // 16 * 16 for n in numels]  # 64-byte aligned starts
    raw = torch.empty(sum(sizes) + _HUGE // 4, dtype=torch.float32)
    start = (-raw.data_ptr()) % _HUGE // 4
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        length = (raw.numel() - start) * 4 // _HUGE * _HUGE
        libc.madvise(ctypes.c_void_p(raw.data_ptr() + start * 4), ctypes.c_size_t(length), _MADV_HUGEPAGE)
    except (OSError, AttributeError) as exc:  # not Linux: plain pages
        logger.debug("madvise unavailable: %s", exc)
    out, offset = [], start
    for shape, numel, size in zip(shapes, numels, sizes, strict=True):
        out.append(raw[offset:offset + numel].view(shape))
        offset += size
    return out


def _pack_on_huge_pages(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of `tensors` in one huge-page buffer (see `on_huge_pages`)."""
    out = on_huge_pages([tuple(t.shape) for t in tensors])
    return [o.copy_(t) for o, t in zip(out, tensors, strict=True)]


def _plain_weights(model: CausalLM) -> list[torch.Tensor]:
    weights = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        bias = _EMPTY
        if attn.q_proj.bias is not None:
            bias = torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]).contiguous()
        weights += [
            layer.input_layernorm.weight.contiguous(),
            torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]).contiguous(),
            bias,
            attn.o_proj.weight.contiguous(),
            layer.post_attention_layernorm.weight.contiguous(),
            torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).contiguous(),
            mlp.down_proj.weight.contiguous(),
        ]
    return weights


@dataclasses.dataclass
class CpuWeights:
    """The weights the C++ kernels read, and the model the per-layer path runs over them.

    Guarantees: `weights` holds seven tensors a layer in `decode_layers`' order; `model` is the given
    model where the weights are plain copies, else a copy of it whose layers read the panels (the only
    copy of the layer weights then); `q4` is empty or one code set a layer; `greedy_head` is set only
    with the packed GEMM.
    """

    model: CausalLM
    weights: list[torch.Tensor]
    packed_gemm: bool
    q4: list[torch.Tensor]
    greedy_head: GreedyHead | None

    @property
    def gemm_name(self) -> str:
        if not self.packed_gemm:
            return "at::linear"
        return f"the packed {cpu_kernels.load().packed_gemm_isa().upper()} GEMM"


def lay_out(model: CausalLM) -> CpuWeights:
    """The model's weights laid out for the C++ kernels (see the module docstring); the kernels must
    be built (`cpu_kernels.load()` not None)."""
    kernels = cpu_kernels.load()
    # Packed panels for the AVX-512/AVX2 GEMM where it is built and the shapes allow, else plain
    # (concatenated) weights through at::linear (MKL).
    if not (kernels.packed_gemm_available() and packed_linear.packable(model)):
        return CpuWeights(model, _pack_on_huge_pages(_plain_weights(model)), False, [], None)
    copy, weights = packed_linear.packed_copy(model, on_huge_pages)
    gemm_tuning.apply_crossovers(copy)  # prefill-sized batches may run faster through torch's GEMM
    # Codes of the matrices whose float32 values are exactly 4-bit blocks (packed_q4.py): steps of
    # up to 64 rows (AVX2) or 8 (AVX-512, cpu_q4.cpp) read those instead of the panels. Empty elsewhere.
    q4 = packed_q4.q4_for_layers(weights) if packed_q4.q4_enabled() and kernels.q4_gemm_available() else []
    # Greedy rows read an int8 copy of the packed lm_head, then their few candidates in float32.
    return CpuWeights(copy, weights, True, q4, greedy_head_for(copy.lm_head))
