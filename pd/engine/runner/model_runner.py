"""The model runner: one forward pass per engine step over the page pool, and the step's tokens.

Per step it writes the scheduler's chunks into the step metadata (attention/metadata.py, persistent
buffers on the engine's device), lets the attention backend plan the step, and runs it: the whole
layer stack in one backend call where the backend does that (`run_step`), else the per-layer path of
`backend.model` with the backend's attention. The rows that end a sequence then get their tokens:
greedy rows from the backend where it can pick them without the full logits, every other row from
the logits and the sampler, under the request's `SamplingParams`.

The runner keeps each request's sampling params and random generator from the step that first
schedules it (`SchedulerOutput.new_requests`) until the step after it finishes
(`SchedulerOutput.finished_request_ids`): nothing flows back from the engine or the scheduler.
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence

import torch

from pd.engine.attention.backend import AttentionBackend
from pd.engine.attention.metadata import StepCapacity, StepInputBuilder, StepMetadata
from pd.engine.attention.selector import build_backend
from pd.engine.kv.layout import KVLayout
from pd.engine.kv.page_pool import PagePool
from pd.engine.model.llama import CausalLM
from pd.engine.sample.params import SamplingParams
from pd.engine.sample.sampler import make_generator, sample
from pd.engine.sched.output import ScheduledChunk, SchedulerOutput

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class RequestSampling:
    """What the runner holds for one request: how to pick its tokens."""

    params: SamplingParams
    generator: torch.Generator | None


class ModelRunner:
    """Owns the step metadata builder, the attention backend and the requests' sampling state.

    Guarantees: a step writes K/V only into the slots of the chunks' own positions; `next_tokens`
    returns one token per chunk with `needs_logits`, in chunk order, each below `num_ids` (the ids the
    tokenizer can decode); `self.model` is the model as given, never changed (a backend that needs its
    weights laid out otherwise holds its own copy, `self.backend.model`).
    """

    def __init__(self, model: CausalLM, layout: KVLayout, page_pool: PagePool, attention_backend: str = "torch",
                 capacity: StepCapacity | None = None, num_ids: int | None = None):
        self.model = model
        self.layout = layout
        self.page_pool = page_pool
        self.device = page_pool.device
        vocab = model.config.vocab_size
        if num_ids is not None and not 0 < num_ids <= vocab:
            raise ValueError(f"the tokenizer's vocabulary ({num_ids} ids) must be positive and at most the model's "
                             f"({vocab})")
        self.num_ids = vocab if num_ids is None else num_ids
        self.inputs = StepInputBuilder(layout, self.device, capacity)
        self.backend: AttentionBackend = build_backend(attention_backend, model, layout, page_pool)
        self.requests: dict[str, RequestSampling] = {}

    # ------------------------------------------------------------------ requests
    def update_requests(self, sched: SchedulerOutput) -> None:
        """Forgets the requests finished since the previous step, then meets this step's new ones."""
        for rid in sched.finished_request_ids:
            self.requests.pop(rid, None)
        for rid, params in sched.new_requests.items():
            self.requests[rid] = RequestSampling(params, make_generator(params))

    # ------------------------------------------------------------------ step
    def next_tokens(self, chunks: Sequence[ScheduledChunk], on_layer: Callable[[int], None] | None = None) -> list[int]:
        """One token per chunk with `needs_logits`, in chunk order, under its request's params (met
        through `update_requests`). `on_layer`: see `final_hidden`."""
        hidden = self.final_hidden(chunks, on_layer)
        rows = [self.requests[c.request_id] for c in chunks if c.needs_logits]
        tokens: list[int | None] = [None] * hidden.shape[0]
        greedy = [i for i, r in enumerate(rows) if r.params.greedy]
        if greedy:
            picked = hidden if len(greedy) == len(tokens) else hidden[torch.tensor(greedy)]
            for i, token in zip(greedy, self.backend.greedy_tokens(picked, self.num_ids), strict=True):
                tokens[i] = token
        rest = [i for i, t in enumerate(tokens) if t is None]
        if rest:
            picked = hidden if len(rest) == len(tokens) else hidden[torch.tensor(rest)]
            drawn = sample(self.backend.model.compute_logits(picked), [rows[i].params for i in rest],
                           [rows[i].generator for i in rest], self.num_ids)
            for i, token in zip(rest, drawn, strict=True):
                tokens[i] = token
        return [t for t in tokens if t is not None]  # (every row has its token by now)

    def execute(self, chunks: Sequence[ScheduledChunk]) -> torch.Tensor:
        """Float32 logits, one row per chunk with `needs_logits`, in chunk order."""
        hidden = self.final_hidden(chunks)
        if not hidden.shape[0]:
            return torch.empty((0, self.model.config.vocab_size))
        return self.backend.model.compute_logits(hidden)

    def final_hidden(self, chunks: Sequence[ScheduledChunk], on_layer: Callable[[int], None] | None = None
                     ) -> torch.Tensor:
        """The final-norm hidden states (R, hidden) of the chunks with `needs_logits`, in chunk order.
        `on_layer(i)`: called once layer i's K/V are in the pages, on the per-layer path (a backend
        that runs every layer in one call tells its caller when the step is over)."""
        if not chunks:
            return torch.empty((0, self.model.config.hidden_size))
        metadata = self.inputs.build(chunks)
        return self._run(metadata, on_layer)

    def _run(self, metadata: StepMetadata, on_layer: Callable[[int], None] | None) -> torch.Tensor:
        backend = self.backend
        backend.prepare(metadata)
        hidden = backend.run_step(metadata)
        if hidden is not None:
            return hidden
        hidden = backend.model(metadata.input_ids, metadata.positions, backend, metadata, on_layer)
        return hidden[metadata.logits_indices]
