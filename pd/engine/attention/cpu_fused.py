"""Engine steps through one C++ call for all layers (pd/engine/cpu/cpu_kernels.cpp `decode_layers`).

When the fused CPU kernels are available, a step of decode tokens, or of decode tokens and prompt
chunks under the row and key caps below, skips the per-layer Python path: the step's metadata is
built straight from the chunks' Python lists (a handful of small tensors, one row per token), and
the layers run in C++ with the projections through the packed-panel GEMM (pd/engine/cpu/cpu_gemm.cpp,
AVX-512 or AVX2, weights re-laid once by pd/engine/cpu/packed_linear.py), or at::linear where that GEMM
is not built. A prompt's token attends to the K/V that the chunk's earlier tokens wrote into the same
layer. The q/k/v and gate/up weights are concatenated once at construction, so each layer makes four
matmuls instead of seven.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import math
from typing import TYPE_CHECKING

import torch

from pd.engine.cpu import kernels as cpu_kernels
from pd.engine.cpu import gemm_tuning
from pd.engine.cpu import packed_linear
from pd.engine.cpu import packed_q4
from pd.engine.kv.layout import KVLayout
from pd.engine.model.llama import CausalLM

if TYPE_CHECKING:
    from pd.engine.sched.output import ScheduledChunk

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


class FusedDecoder:
    """Runs the decode and short-prompt steps of a float32 CPU model in one kernel call.

    Guarantees: writes K/V only into the slots of each chunk's own positions and
    returns float32 logits, one row per chunk with `needs_logits`, in chunk order; raises
    ValueError (before writing anything) when a token's slot would be the null
    block. Weights are read once at construction (the model's weights never
    change afterwards) and held once: the model's own layers then read the same
    storage (with the packed GEMM its linear layers become PackedLinear views of
    the panels, so prefill runs that GEMM too).
    """

    def __init__(self, model: CausalLM, layout: KVLayout, group_views: list[torch.Tensor]):
        self.model = model
        self.layout = layout
        cfg = model.config
        self.num_heads, self.num_kv_heads = cfg.num_heads, cfg.num_kv_heads
        self.eps = cfg.rms_norm_eps
        self.scale = cfg.resolved_head_dim ** -0.5
        self.caches: list[torch.Tensor] = []
        self.layer_group: list[int] = []
        for i in range(cfg.num_layers):
            g, slot = layout.layer_to_group[i]
            self.caches.append(group_views[g][:, slot])  # (num_blocks, 2, bs, H, D), no copy
            self.layer_group.append(g)
        # Packed panels for the AVX-512/AVX2 GEMM where it is built and the shapes allow, else plain
        # weights through at::linear (MKL); either way the weights are held once.
        self.panel_split_max_rows = PANEL_SPLIT_MAX_ROWS
        self.prompt_max_rows, self.prompt_max_keys = FUSED_PROMPT_MAX_ROWS, FUSED_PROMPT_MAX_KEYS
        self.prompt_max_mean_keys = FUSED_PROMPT_MAX_MEAN_KEYS
        self.packed_gemm = cpu_kernels.load().packed_gemm_available() and packed_linear.packable(model)
        # Codes of the matrices whose float32 values are exactly 4-bit blocks (packed_q4.py): steps of
        # up to 64 rows read those instead of the panels. None elsewhere.
        self.q4: list[torch.Tensor] = []
        if self.packed_gemm:
            self.weights = packed_linear.pack_model(model, _on_huge_pages)
            gemm_tuning.apply_crossovers(model)  # prefill-sized batches may run faster through torch's GEMM
            if packed_q4.q4_enabled() and cpu_kernels.load().q4_gemm_available():
                self.q4 = packed_q4.q4_for_layers(self.weights)
        else:
            self.weights = _pack_on_huge_pages(self._plain_weights())
            self._share_storage()
        logger.info("fused decode: projections through %s", self.gemm_name)

    @property
    def gemm_name(self) -> str:
        if not self.packed_gemm:
            return "at::linear"
        return f"the packed {cpu_kernels.load().packed_gemm_isa().upper()} GEMM"

    def _plain_weights(self) -> list[torch.Tensor]:
        weights = []
        for layer in self.model.model.layers:
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

    def _share_storage(self) -> None:
        """Point the model's own parameters at the packed copies (views, same values), so the
        weights are held once and the torch path reads the same pages."""
        for i, layer in enumerate(self.model.model.layers):
            norm1, qkv, bias, o, norm2, gate_up, down = self.weights[7 * i: 7 * i + 7]
            attn, mlp = layer.self_attn, layer.mlp
            layer.input_layernorm.weight.data = norm1
            layer.post_attention_layernorm.weight.data = norm2
            attn.o_proj.weight.data = o
            mlp.down_proj.weight.data = down
            projections = (attn.q_proj, attn.k_proj, attn.v_proj)
            for proj, part in zip(projections, qkv.split([p.weight.shape[0] for p in projections]), strict=True):
                proj.weight.data = part
            if bias.numel():
                for proj, part in zip(projections, bias.split([p.bias.shape[0] for p in projections]), strict=True):
                    proj.bias.data = part
            gate_up_parts = gate_up.split(mlp.gate_proj.weight.shape[0])
            for proj, part in zip((mlp.gate_proj, mlp.up_proj), gate_up_parts, strict=True):
                proj.weight.data = part

    def applies(self, chunks: list[ScheduledChunk]) -> bool:
        """Whether the step runs here: decode tokens, and prompt chunks while the step's rows (one per
        token) and the keys they attend to stay small (`FUSED_PROMPT_MAX_ROWS`, `FUSED_PROMPT_MAX_KEYS`,
        `FUSED_PROMPT_MAX_MEAN_KEYS`). Past those the torch path's GEMM and attention run a prompt faster."""
        num_rows = 0
        num_keys = 0  # an upper bound: every row counted at its chunk's end
        num_prompt_rows = 0
        num_prompt_keys = 0  # exact: row i of a chunk sees start + i + 1 keys
        for c in chunks:
            n = len(c.token_ids)
            num_rows += n
            if n > 1:
                num_keys += n * (c.start + n)
                num_prompt_rows += n
                num_prompt_keys += n * c.start + n * (n + 1) // 2
        if not num_prompt_rows:
            return all(c.needs_logits for c in chunks)
        return (num_rows <= self.prompt_max_rows and num_keys <= self.prompt_max_keys
                and num_prompt_keys <= self.prompt_max_mean_keys * num_prompt_rows)

    @torch.inference_mode()
    def execute(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """Logits of the chunks with `needs_logits`, one row each, in chunk order."""
        hidden = self.final_hidden(chunks)
        if not hidden.shape[0]:
            return torch.empty((0, self.model.config.vocab_size))
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def final_hidden(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """The final-norm hidden states of the chunks with `needs_logits`, one row each, in chunk order."""
        bs = self.layout.block_size
        positions: list[int] = []
        ids: list[int] = []
        chunk_of_row: list[int] = []
        logit_rows: list[int] = []
        for i, c in enumerate(chunks):
            positions.extend(range(c.start, c.start + len(c.token_ids)))
            ids.extend(c.token_ids)
            chunk_of_row.extend([i] * len(c.token_ids))
            if c.needs_logits:
                logit_rows.append(len(ids) - 1)
        key_end = torch.tensor([p + 1 for p in positions], dtype=torch.long)
        slot_blocks, tables, key_starts = [], [], []
        for g, grp in enumerate(self.layout.groups):
            width = max(len(c.block_ids[g]) for c in chunks)
            padded = [c.block_ids[g] + [0] * (width - len(c.block_ids[g])) for c in chunks]
            rows = [chunks[i].block_ids[g] for i in chunk_of_row]
            blocks = [r[p // bs] if p // bs < len(r) else 0 for r, p in zip(rows, positions, strict=True)]
            if 0 in blocks:
                raise ValueError(f"group {g}: a new token maps to the null block (block table too short)")
            slot_blocks.append(torch.tensor(blocks, dtype=torch.long))
            table = torch.tensor(padded, dtype=torch.long)
            tables.append(table if len(chunks) == len(ids) else table[torch.tensor(chunk_of_row)])
            key_starts.append(torch.zeros_like(key_end) if grp.window is None
                              else torch.clamp(key_end - grp.window, min=0))
        offsets = torch.tensor([p % bs for p in positions], dtype=torch.long)
        body = self.model.model
        x = body.embed_tokens(torch.tensor(ids, dtype=torch.long))
        cos, sin = body.rotary.cos_sin(torch.tensor(positions), x.dtype)
        # A prompt's rows must stay on one thread's share in the per-thread split (they would race
        # across threads), so a step holding prompt rows runs layer by layer.
        split_max = self.panel_split_max_rows if len(ids) == len(chunks) else len(ids)
        module = cpu_kernels.load()
        hidden = module.decode_layers(x, cos[:, 0].contiguous(), sin[:, 0].contiguous(), self.weights, self.caches,
                                      self.layer_group, slot_blocks, offsets, tables, key_starts, key_end,
                                      self.num_heads, self.num_kv_heads, self.eps, self.scale, split_max, self.q4)
        if len(logit_rows) != len(ids):
            hidden = hidden[torch.tensor(logit_rows, dtype=torch.long)]
        return body.norm(hidden)
