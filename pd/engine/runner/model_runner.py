"""The model runner: one forward pass per engine step over the page pool.

Per step it turns the scheduler's chunks (which tokens of which request, at
which positions, with which block table) into one flat token batch, runs the
model with paged attention (new K/V written into pages, context read through
block tables) and returns logits for the chunks that end a sequence.
"""
from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from pd.engine.kv.page_pool import PagePool
from pd.engine.cpu import kernels as cpu_kernels
from pd.engine.attention.cpu_fused import FusedDecoder
from pd.engine.cpu.greedy_head import greedy_head_for
from pd.engine.kv.layout import KVLayout
from pd.engine.model.llama import CausalLM
from pd.engine.sched.output import ScheduledChunk
from pd.engine.attention.torch_paged import PagedAttention, SeqSlice, Workspace
from pd.engine.sample.params import SamplingParams
from pd.engine.sample.sampler import sample

logger = logging.getLogger(__name__)


def use_fused_decode(attention_backend: str, dtype: torch.dtype, device: torch.device) -> bool:
    """Resolves an `EngineConfig.attention_backend`: whether decode runs the fused C++ kernel.

    `auto` picks it wherever it is valid and falls back to torch quietly; `fused`
    where it is not valid raises ValueError saying why (at engine start, never mid-request).
    """
    if attention_backend == "torch":
        return False
    why = None
    if dtype != torch.float32:
        why = f"the model runs in {dtype}, the kernel is float32 only"
    elif device.type != "cpu":
        why = f"the model runs on {device}, the kernel is for the CPU"
    elif cpu_kernels.load() is None:
        why = "the C++ kernel could not be built here (is a C++ compiler installed? see the log)"
    if why is None:
        return True
    if attention_backend == "fused":
        raise ValueError(f"attention_backend 'fused' is not usable: {why}; use 'auto' or 'torch'")
    logger.info("attention_backend auto: using torch (%s)", why)
    return False


class ModelRunner:
    """Owns the model and the typed views of the page pool.

    Guarantees: `execute` writes K/V only into the slots of the chunks' own
    positions, and returns float32 logits, one row per chunk with
    `needs_logits`, in chunk order.
    """

    def __init__(self, model: CausalLM, layout: KVLayout, page_pool: PagePool, attention_backend: str = "torch"):
        self.model = model
        self.layout = layout
        self.page_pool = page_pool
        self.group_views = layout.group_views(page_pool)
        self.token_rows = layout.token_rows(page_pool)
        self.device = page_pool.device
        self.workspace = Workspace()
        # fused: decode tokens use the C++ kernel (float32 on CPU), and so do prompt chunks in the
        # steps FusedDecoder.applies to.
        self.fused_decode = use_fused_decode(attention_backend, layout.dtype, self.device)
        # Steps of decode tokens and short prompt chunks skip the per-layer Python path entirely.
        self.fused_decoder = FusedDecoder(model, layout, self.group_views) if self.fused_decode else None
        # Greedy rows read an int8 copy of the packed lm_head, then their few candidates in float32.
        self.greedy_head = greedy_head_for(model.lm_head) if self.fused_decoder is not None else None

    def execute(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        hidden = self.final_hidden(chunks)
        if not hidden.shape[0]:
            return torch.empty((0, self.model.config.vocab_size))
        return self.model.compute_logits(hidden)

    def next_tokens(self, chunks: list[ScheduledChunk], params: list[SamplingParams],
                    generators: list[torch.Generator | None],
                    on_layer: Callable[[int], None] | None = None) -> list[int]:
        """One sampled token per chunk with `needs_logits` (params and generators in that order). Greedy
        rows go through the int8-screened exact argmax where the runner has one (`greedy_head.py`);
        the others (and any row the screen leaves) through the full logits and `sample`.
        `on_layer`: see `final_hidden`."""
        hidden = self.final_hidden(chunks, on_layer)
        tokens: list[int | None] = [None] * hidden.shape[0]
        head = self.greedy_head
        greedy = [i for i, p in enumerate(params) if p.greedy] if head is not None else []
        if head is not None and greedy:
            rows = hidden if len(greedy) == len(tokens) else hidden[torch.tensor(greedy)]
            for i, token in zip(greedy, head.tokens(rows), strict=True):
                tokens[i] = token
        rest = [i for i, t in enumerate(tokens) if t is None]
        if rest:
            rows = hidden if len(rest) == len(tokens) else hidden[torch.tensor(rest)]
            drawn = sample(self.model.compute_logits(rows), [params[i] for i in rest], [generators[i] for i in rest])
            for i, token in zip(rest, drawn, strict=True):
                tokens[i] = token
        return [t for t in tokens if t is not None]  # (every row has its token by now)

    def final_hidden(self, chunks: list[ScheduledChunk], on_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """The final-norm hidden states (R, hidden) of the chunks with `needs_logits`, in chunk order.
        `on_layer(i)`: called once layer i's K/V are in the pages, on the per-layer path (the fused
        kernel runs every layer in one call: its caller learns of them when the step is over)."""
        if not chunks:
            return torch.empty((0, self.model.config.hidden_size))
        if self.fused_decoder is not None and self.fused_decoder.applies(chunks):
            return self.fused_decoder.final_hidden(chunks)
        seqs = [SeqSlice(c.start, len(c.token_ids), c.block_ids) for c in chunks]
        backend = PagedAttention(self.layout, self.group_views, seqs, self.token_rows, self.workspace,
                                 self.fused_decode)
        flat: list[int] = []
        logit_rows: list[int] = []
        for c in chunks:
            flat.extend(c.token_ids)
            if c.needs_logits:
                logit_rows.append(len(flat) - 1)
        ids = torch.tensor(flat, dtype=torch.long, device=self.device)
        hidden = self.model(ids, backend.positions.to(self.device), backend, on_layer)
        return hidden[torch.tensor(logit_rows, dtype=torch.long, device=self.device)]
