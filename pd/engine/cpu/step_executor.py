"""The CPU step executor: a float32 step run through every layer in one C++ call, and greedy tokens
picked without the full logits.

A step of decode tokens, or of decode tokens and prompt chunks under the row and key caps below, runs
every layer in one C++ call (cpu_kernels.cpp `decode_layers`: norms, RoPE, K/V write, attention and SiLU
in C++, the projections through the packed-panel GEMM of cpu_gemm.cpp, AVX-512 or AVX2, or at::linear
where that GEMM is not built), reading the step metadata's tensors and the layers' K/V views bound once
over the page pool (`KVLayout.bind`). A prompt's token attends to the K/V that the chunk's earlier
tokens wrote into the same layer. Larger steps the runner takes through the per-layer path of
`executor.model` (the copy over the executor's weights, weight_layout.py) with the CPU attention
backend (paged_attention.py).
"""
from __future__ import annotations

import logging

import torch

from pd.engine.attention.metadata import StepMetadata
from pd.engine.cpu import kernels as cpu_kernels
from pd.engine.cpu.greedy_head import GreedyHead
from pd.engine.cpu.weight_layout import lay_out
from pd.engine.kv.layout import BoundKV
from pd.engine.model.llama import CausalLM

logger = logging.getLogger(__name__)

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


class CpuStepExecutor:
    """Runs the decode and short-prompt steps of a float32 CPU model in one kernel call (`applies`).

    Guarantees: writes K/V only into the step's slots; `run_step` returns the final-norm hidden states
    of the rows that need logits, in chunk order; `greedy_tokens` gives the argmax of a row's logits
    (lowest id on a tie) or None where it cannot tell without the full logits. Its weights are laid out
    from the model once, here (the model's weights never change afterwards); the model itself is left
    as it was, and `model` is what the per-layer path runs (the model, or a copy over the panels).
    """

    def __init__(self, model: CausalLM, kv: BoundKV):
        cfg = model.config
        self.layout = kv.layout
        self.num_heads, self.num_kv_heads = cfg.num_heads, cfg.num_kv_heads
        self.eps = cfg.rms_norm_eps
        self.scale = cfg.resolved_head_dim ** -0.5
        self.caches = [layer.cache for layer in kv.layers]  # (num_blocks, 2, bs, H, D), no copy
        self.layer_group = [layer.group for layer in kv.layers]
        self.panel_split_max_rows = PANEL_SPLIT_MAX_ROWS
        self.prompt_max_rows, self.prompt_max_keys = FUSED_PROMPT_MAX_ROWS, FUSED_PROMPT_MAX_KEYS
        self.prompt_max_mean_keys = FUSED_PROMPT_MAX_MEAN_KEYS
        laid = lay_out(model)
        self.model, self.weights, self.q4 = laid.model, laid.weights, laid.q4
        self.packed_gemm = laid.packed_gemm
        self.greedy_head: GreedyHead | None = laid.greedy_head
        self.gemm_name = laid.gemm_name
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None  # see _rope_tables
        self._from_zero = torch.empty(0, dtype=torch.int64)  # key starts of a group without a window
        logger.info("CPU step executor: projections through %s", self.gemm_name)

    @property
    def description(self) -> str:
        return f"fused (C++ CPU kernels, projections through {self.gemm_name})"

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

    def _rope_tables(self, num_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin (N, head_dim) of positions [0, N), N >= num_positions: computed once and grown
        (doubling) when a step reaches past them, so that a step only looks its rows up (each torch op
        of a step's host work costs tens of microseconds once the step's weights have streamed
        through the caches). The same values as the model's `rotary.cos_sin`."""
        if self._rope is None or self._rope[0].shape[0] < num_positions:
            n = max(num_positions, 2 * (0 if self._rope is None else self._rope[0].shape[0]), 256)
            cos, sin = self.model.model.rotary.cos_sin(torch.arange(n), torch.float32)
            self._rope = (cos[:, 0].contiguous(), sin[:, 0].contiguous())
        return self._rope

    @torch.inference_mode()
    def run_step(self, metadata: StepMetadata) -> torch.Tensor:
        """The final-norm hidden states (R, hidden) of the rows that need logits, for a step it `applies` to."""
        m = metadata
        tables = m.block_tables if m.decode_only else tuple(t.index_select(0, m.token_seq) for t in m.block_tables)
        key_starts = [self._from_zero if grp.window is None else torch.clamp(m.positions + (1 - grp.window), min=0)
                      for grp in self.layout.groups]
        body = self.model.model
        x = body.embed_tokens(m.input_ids)
        cos, sin = self._rope_tables(max(s + n for s, n in zip(m.starts, m.query_lens, strict=True)))
        # A prompt's rows must stay on one thread's share in the per-thread split (they would race
        # across threads), so a step holding prompt rows runs layer by layer.
        split_max = self.panel_split_max_rows if m.decode_only else m.num_tokens
        hidden = cpu_kernels.load().decode_layers(
            x, m.positions, cos, sin, self.weights, self.caches, self.layer_group, list(m.slot_blocks),
            m.slot_offsets, list(tables), key_starts, self.num_heads, self.num_kv_heads, self.eps, self.scale,
            split_max, self.q4, body.norm.weight)
        if m.num_logits != m.num_tokens:
            hidden = hidden[m.logits_indices]
        return hidden
