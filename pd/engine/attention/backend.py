"""The attention backend contract: what the runner asks of a backend, once a step and once a layer.

A step runs as:

    metadata = builder.build(chunks)              # attention/metadata.py, once a step
    backend.prepare(metadata)                     # the backend's own plan for the step, if it needs one
    hidden = backend.run_step(metadata)           # a backend that runs the whole layer stack itself ...
    hidden = backend.model(input_ids, positions, backend, metadata)   # ... else the per-layer path:
        # each layer calls backend.forward(q, k, v, layer, metadata), which keeps the step's K/V
        # (`backend.write_kv`, or a kernel that writes and attends at once) before the queries attend
    tokens = backend.greedy_tokens(rows)          # greedy rows the backend can pick without full logits
    logits = backend.model.compute_logits(rows)   # the others, for the sampler

`backend.model` is the module whose layers run on the per-layer path: the model itself, or the
backend's own copy of it over weights it laid out for its kernels at load time (the CPU backend's packed
panels). The engine's model is never changed by a backend.

Rules a backend keeps, so a Triton backend or a graph-captured decode fits without changes:
- it reads the step's inputs only from the metadata's tensors (fixed addresses, on the device), never
  from the chunks, and derives what it needs in `prepare`;
- `forward` and `write_kv` make no host synchronisation (no `.item()`, `.tolist()`, host copies);
- it writes K/V only into the slots `metadata.slot_mapping` names.

A backend that also plans nothing on the host per step (its `prepare` and `forward` read only the
metadata's tensors, whatever their values) sets the class attribute `graph_safe = True`: on CUDA the runner
then captures its decode steps in CUDA graphs (runner/cuda_graphs.py). The Triton backend does; the torch
and CPU backends plan on the host and always run eagerly.

The runner keeps only `backend.model`: a backend with its own copy of the weights is their only holder.

A backend is chosen once, at start, by `pd.engine.attention.selector.select_backend` from
(`EngineConfig.attention_backend`, device, dtype).
"""
from __future__ import annotations

from typing import Protocol

import torch

from pd.engine.attention.metadata import StepMetadata
from pd.engine.model.llama import CausalLM


class AttentionBackend(Protocol):
    """Paged attention over the page pool for one engine (see the module docstring).

    Guarantees of every implementation: `forward` returns (T, Hq, D) in q's dtype, each token
    attending to its sequence's keys up to its own position (within its layer's window), its own
    K/V included; K/V land only in the step's slots; the same metadata gives the same result
    whichever tokens share the step (up to float rounding).
    """

    name: str
    model: CausalLM

    def prepare(self, metadata: StepMetadata) -> None:
        """Derives the backend's per-step plan from `metadata` (before the first layer runs)."""

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, layer: int, metadata: StepMetadata) -> None:
        """Writes the step's K and V (T, Hkv, D) of `layer` into their slots (`metadata.slot_mapping`)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                metadata: StepMetadata) -> torch.Tensor:
        """Attention of the step's queries (T, Hq, D) over their sequences' keys, the step's K/V
        included: they are written first (by `write_kv`, or by a kernel that writes as it attends)."""

    def run_step(self, metadata: StepMetadata) -> torch.Tensor | None:
        """The final-norm hidden states (R, hidden) of the rows that need logits when the backend runs
        the whole layer stack itself for this step, else None (the runner takes the per-layer path)."""

    def greedy_tokens(self, hidden: torch.Tensor, num_ids: int) -> list[int | None]:
        """The argmax token among ids [0, num_ids) of each row's logits over `hidden` (R, hidden) where
        the backend can find it without the full logits (the lowest id on a tie); None for the others."""

    @property
    def description(self) -> str:
        """What runs, in words (for logs and benchmark reports)."""
