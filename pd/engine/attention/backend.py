"""The attention backend contract: K/V write plus attention over the step metadata, once a layer.

A step on the per-layer path runs as:

    metadata = builder.build(chunks)              # attention/metadata.py, once a step
    backend.prepare(metadata)                     # the backend's own plan for the step, if it needs one
    hidden = model(input_ids, positions, backend, metadata)
        # each layer calls backend.forward(q, k, v, layer, metadata), which keeps the step's K/V
        # (`backend.write_kv`, or a kernel that writes and attends at once) before the queries attend

A backend does attention only: it holds no weights, runs no layer stack and picks no tokens. The runner
(runner/model_runner.py) runs the model; where a step executor applies (the CPU's, pd/engine/cpu/
step_executor.py) the runner hands it the whole step instead, and the backend is not asked.

A backend's K/V live in the views `KVLayout.bind` bound once over the page pool (`BoundKV`, given to its
constructor): no backend works out a layer's views itself.

Rules a backend keeps, so a Triton backend or a graph-captured decode fits without changes:
- it reads the step's inputs only from the metadata's tensors (fixed addresses, on the device), never
  from the chunks, and derives what it needs in `prepare`;
- `forward` and `write_kv` make no host synchronisation (no `.item()`, `.tolist()`, host copies);
- it writes K/V only into the slots `metadata.slot_mapping` names.

What a backend can run on (devices, dtypes, head and block sizes, graph capture, the C++ kernels or
Triton it needs, tensor-parallel degrees) it declares on its class as `capabilities`
(attention/capabilities.py); a backend with `capabilities.graph_safe` plans nothing on the host per step
(its `prepare` and `forward` read only the metadata's tensors, whatever their values): on CUDA the runner
then captures its decode steps in CUDA graphs (runner/cuda_graphs.py). The Triton backend does; the
torch and CPU backends plan on the host and always run eagerly.

A backend is chosen once, at start, by `pd.engine.runner.selector.select_backend` from
(`EngineConfig.attention_backend`, device, dtype), reading those declarations.
"""
from __future__ import annotations

from typing import Protocol

import torch

from pd.engine.attention.capabilities import BackendCapabilities
from pd.engine.attention.metadata import StepMetadata
from pd.engine.model.layer_ops import LayerOps


class AttentionBackend(Protocol):
    """Paged attention over the page pool for one engine (see the module docstring).

    Guarantees of every implementation: `forward` returns (T, Hq, D) in q's dtype, each token
    attending to its sequence's keys up to its own position (within its layer's window), its own
    K/V included; K/V land only in the step's slots; the same metadata gives the same result
    whichever tokens share the step (up to float rounding).
    """

    capabilities: BackendCapabilities
    # the layers' small ops (RMSNorm with the residual add, RoPE of q and k, SiLU-and-mul) the model runs with
    # this backend: the torch ops (model/layer_ops.py), or fused kernels of the backend's own (Triton)
    layer_ops: LayerOps

    def prepare(self, metadata: StepMetadata) -> None:
        """Derives the backend's per-step plan from `metadata` (before the first layer runs)."""

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, layer: int, metadata: StepMetadata) -> None:
        """Writes the step's K and V (T, Hkv, D) of `layer` into their slots (`metadata.slot_mapping`)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                metadata: StepMetadata) -> torch.Tensor:
        """Attention of the step's queries (T, Hq, D) over their sequences' keys, the step's K/V
        included: they are written first (by `write_kv`, or by a kernel that writes as it attends)."""

    @property
    def description(self) -> str:
        """What runs, in words (for logs and benchmark reports)."""
