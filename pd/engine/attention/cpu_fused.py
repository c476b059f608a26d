"""The CPU backend: float32 on the CPU, through the C++ kernels (pd/engine/cpu/).

A step of decode tokens, or of decode tokens and prompt chunks under the row and key caps below,
runs every layer in one C++ call (cpu_kernels.cpp `decode_layers`: norms, RoPE, K/V write, attention
and SiLU in C++, the projections through the packed-panel GEMM of cpu_gemm.cpp, AVX-512 or AVX2, or
at::linear where that GEMM is not built), reading the step metadata's tensors. A prompt's token
attends to the K/V that the chunk's earlier tokens wrote into the same layer. Larger steps take the
per-layer path: the torch backend's plan, with decode tokens through the C++ paged-decode kernel.

At load time the backend lays out its own copy of the weights: the q/k/v and gate/up matrices
concatenated (four matmuls a layer instead of seven), as panels for the packed GEMM
(pd/engine/cpu/packed_linear.py `packed_copy`, whose model copy the per-layer path runs), with the
4-bit codes of matrices that are exactly 4-bit blocks (packed_q4.py) and an int8 screen of the
lm_head for greedy tokens (greedy_head.py). The engine's model is not changed.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import math

import torch

from pd.engine.attention.metadata import StepMetadata
from pd.engine.attention.torch_paged import TorchPagedBackend
from pd.engine.cpu import gemm_tuning, packed_linear, packed_q4
from pd.engine.cpu import kernels as cpu_kernels
from pd.engine.cpu.greedy_head import GreedyHead, greedy_head_for
from pd.engine.kv.layout import KVLayout
from pd.engine.kv.page_pool import PagePool
from pd.engine.model.llama import CausalLM

logger = logging.getLogger(__name__)

_EMPTY = torch.empty(0)
# Up to this many decode tokens the layers run one by one, every thread on its share of each
# projection's panels (the weights are read once per step, by all threads); above it each thread
# runs its own requests through all layers (cpu_kernels.cpp `decode_layers`). On SmolLM2-135M
# (2-core Xeon, AVX-512, contexts of ~60 tokens), with the GEMM's two-panel tiles, the panel split
# took 39 against 39 ms a step at 8 tokens, 66 against 88 at 24, 73-76 against 92-99 at 32 and 133
# against 146 at 64.
PANEL_SPLIT_MAX_ROWS = 64
# Steps with prompt chunks run here too, up to this many rows (tokens) and (row, key) pairs of
# attention (counted as if every row of a chunk saw all its keys), which the kernel computes one row
# at a time. On SmolLM2-135M (2-core Xeon, AVX-512, 2 threads) a lone prompt of 64 / 256 / 1000
# tokens took 123 / 476 / 2407 ms here against 276 / 773 / 2730 ms through the torch path, and
# 1-12 prompts of ~40 tokens at once 1.7-2x less.
FUSED_PROMPT_MAX_ROWS = 1024
FUSED_PROMPT_MAX_KEYS = 1 << 20
# ... and while the prompt rows attend to at most this many keys each on average (exact count). The
# kernel reads a row's keys one row at a time, where the torch path's attention is a GEMM, so deep
# into a long prompt the torch path wins: for one 2000-token prompt in 256-token steps on 1 thread,
# the fused step cost 0.92 / 0.94 / 0.99 / 1.49 / 2.07x the torch path's at a mean of 128 / 384 / 640
# / 896 / 1896 keys per row (1.04x at 768 in 512-token steps on 2 threads), and the whole prefill
# took 17.4 s against 10.7-11.5 s before this cap.
FUSED_PROMPT_MAX_MEAN_KEYS = 640
_HUGE = 1 << 21
_MADV_HUGEPAGE = 14


def _on_huge_pages(shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
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
    """Copies of `tensors` in one huge-page buffer (see `_on_huge_pages`)."""
    out = _on_huge_pages([tuple(t.shape) for t in tensors])
    return [o.copy_(t) for o, t in zip(out, tensors, strict=True)]


class CpuFusedBackend(TorchPagedBackend):
    """Runs the decode and short-prompt steps of a float32 CPU model in one kernel call; the others
    through the per-layer path over the backend's own copy of the model.

    Guarantees: writes K/V only into the step's slots; `run_step` returns the final-norm hidden
    states of the rows that need logits, in chunk order, or None for a step it leaves to the
    per-layer path (`applies`). Its weights are copied from the model once, here (the model's
    weights never change afterwards); the model itself is left as it was.
    """

    name = "fused"
    decode_in_kernel = True

    def __init__(self, model: CausalLM, layout: KVLayout, page_pool: PagePool):
        super().__init__(model, layout, page_pool)
        cfg = model.config
        self.num_heads, self.num_kv_heads = cfg.num_heads, cfg.num_kv_heads
        self.eps = cfg.rms_norm_eps
        self.scale = cfg.resolved_head_dim ** -0.5
        self.caches: list[torch.Tensor] = []
        self.layer_group: list[int] = []
        for i in range(cfg.num_layers):
            g, slot = layout.layer_to_group[i]
            self.caches.append(self.group_views[g][:, slot])  # (num_blocks, 2, bs, H, D), no copy
            self.layer_group.append(g)
        self.panel_split_max_rows = PANEL_SPLIT_MAX_ROWS
        self.prompt_max_rows, self.prompt_max_keys = FUSED_PROMPT_MAX_ROWS, FUSED_PROMPT_MAX_KEYS
        self.prompt_max_mean_keys = FUSED_PROMPT_MAX_MEAN_KEYS
        # Packed panels for the AVX-512/AVX2 GEMM where it is built and the shapes allow, else plain
        # (concatenated) weights through at::linear (MKL).
        self.packed_gemm = cpu_kernels.load().packed_gemm_available() and packed_linear.packable(model)
        # Codes of the matrices whose float32 values are exactly 4-bit blocks (packed_q4.py): steps of
        # up to 64 rows read those instead of the panels. Empty elsewhere.
        self.q4: list[torch.Tensor] = []
        self.greedy_head: GreedyHead | None = None
        if self.packed_gemm:
            # the per-layer path runs the copy over the panels
            self.model, self.weights = packed_linear.packed_copy(model, _on_huge_pages)
            gemm_tuning.apply_crossovers(self.model)  # prefill-sized batches may run faster through torch's GEMM
            if packed_q4.q4_enabled() and cpu_kernels.load().q4_gemm_available():
                self.q4 = packed_q4.q4_for_layers(self.weights)
            # Greedy rows read an int8 copy of the packed lm_head, then their few candidates in float32.
            self.greedy_head = greedy_head_for(self.model.lm_head)
        else:
            self.weights = _pack_on_huge_pages(self._plain_weights(model))
        logger.info("fused CPU backend: projections through %s", self.gemm_name)

    @property
    def gemm_name(self) -> str:
        if not self.packed_gemm:
            return "at::linear"
        return f"the packed {cpu_kernels.load().packed_gemm_isa().upper()} GEMM"

    @property
    def description(self) -> str:
        return f"fused (C++ CPU kernels, projections through {self.gemm_name})"

    @staticmethod
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

    def kernel_decode(self, q: torch.Tensor, layer_cache: torch.Tensor, table: torch.Tensor, key_start: torch.Tensor,
                      key_end: torch.Tensor, scale: float) -> torch.Tensor:
        return cpu_kernels.paged_decode_attention(q, layer_cache, table, key_start, key_end, scale)

    def greedy_tokens(self, hidden: torch.Tensor, num_ids: int) -> list[int | None]:
        if self.greedy_head is None:
            return [None] * hidden.shape[0]
        return self.greedy_head.tokens(hidden, num_ids)

    def applies(self, metadata: StepMetadata) -> bool:
        """Whether the step runs in one kernel call: decode tokens, and prompt chunks while the step's
        rows (one per token) and the keys they attend to stay small (`FUSED_PROMPT_MAX_ROWS`,
        `FUSED_PROMPT_MAX_KEYS`, `FUSED_PROMPT_MAX_MEAN_KEYS`). Past those the per-layer path's GEMM
        and attention run a prompt faster."""
        num_rows = 0
        num_keys = 0  # an upper bound: every row counted at its chunk's end
        num_prompt_rows = 0
        num_prompt_keys = 0  # exact: row i of a chunk sees start + i + 1 keys
        for start, n in zip(metadata.starts, metadata.query_lens, strict=True):
            num_rows += n
            if n > 1:
                num_keys += n * (start + n)
                num_prompt_rows += n
                num_prompt_keys += n * start + n * (n + 1) // 2
        if not num_prompt_rows:
            return metadata.num_logits == metadata.num_seqs
        return (num_rows <= self.prompt_max_rows and num_keys <= self.prompt_max_keys
                and num_prompt_keys <= self.prompt_max_mean_keys * num_prompt_rows)

    def prepare(self, metadata: StepMetadata) -> None:
        if not self.applies(metadata):  # (a step run in one call needs no per-layer plan)
            super().prepare(metadata)

    @torch.inference_mode()
    def run_step(self, metadata: StepMetadata) -> torch.Tensor | None:
        if not self.applies(metadata):
            return None
        m = metadata
        key_end = m.positions + 1
        tables = m.block_tables if m.decode_only else tuple(t.index_select(0, m.token_seq) for t in m.block_tables)
        key_starts = [torch.zeros_like(key_end) if grp.window is None else torch.clamp(key_end - grp.window, min=0)
                      for grp in self.layout.groups]
        body = self.model.model
        x = body.embed_tokens(m.input_ids)
        cos, sin = body.rotary.cos_sin(m.positions, x.dtype)
        # A prompt's rows must stay on one thread's share in the per-thread split (they would race
        # across threads), so a step holding prompt rows runs layer by layer.
        split_max = self.panel_split_max_rows if m.decode_only else m.num_tokens
        hidden = cpu_kernels.load().decode_layers(
            x, cos[:, 0].contiguous(), sin[:, 0].contiguous(), self.weights, self.caches, self.layer_group,
            list(m.slot_blocks), m.slot_offsets, list(tables), key_starts, key_end, self.num_heads,
            self.num_kv_heads, self.eps, self.scale, split_max, self.q4)
        if m.num_logits != m.num_tokens:
            hidden = hidden[m.logits_indices]
        return body.norm(hidden)
