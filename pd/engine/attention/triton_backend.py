"""The Triton attention backend: K/V written through the slot mapping, attention read through the block
tables, by the kernels of triton_kv_write.py, triton_decode.py and triton_prefill.py.

Each layer's K and V are the strided views of the page pool bound once by `KVLayout.bind` (`LayerKV.k`,
`.v`, views of the pool's one storage): a CUDA graph replays them at the same addresses. A step of
decode tokens only takes the decode kernel (one query per sequence); a prompt step the prompt kernel
(varlen chunks); a mixed step both: its one-token chunks (decode rows) through the decode kernel and
its prompt chunks through the prompt kernel, each on its part of the rows as the metadata builder split
them (`StepMetadata.mixed`), the outputs put back in row order. A decode row in the prompt kernel
would use one token's rows of a tile of at least 16 tokens. Nothing here reads a tensor's value on the host, and
`prepare` has nothing to plan: the kernels read positions, slots, tables and the mixed split straight
from the step metadata, so a decode step can be captured in a CUDA graph as it is.

`use_reference(True)` swaps the kernels for their plain-torch reference (triton_reference.py), with
the same arguments: what `torch.compile(fullgraph=True)` traces on the CPU to check that the decode
forward holds no host synchronisation.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from pd.engine.attention import triton_reference
from pd.engine.attention.capabilities import CAPABILITIES, BackendCapabilities
from pd.engine.attention.metadata import StepMetadata
from pd.engine.kv.layout import BoundKV
from pd.engine.model.layer_ops import TORCH_OPS, LayerOps


@dataclasses.dataclass(frozen=True)
class AttentionOps:
    """The three operations of a step, as Triton kernels or their torch reference."""

    write_kv: Callable[..., None]
    decode: Callable[..., torch.Tensor]
    prefill: Callable[..., torch.Tensor]  # (q, k_cache, v_cache, tables, seq_lens, query_start, max_query_len,
    #                                        scale, window)


def triton_layer_ops() -> LayerOps:
    from pd.engine.attention.triton_ops import TRITON_OPS

    return TRITON_OPS


def triton_ops() -> AttentionOps:
    from pd.engine.attention.triton_decode import paged_decode
    from pd.engine.attention.triton_kv_write import write_kv
    from pd.engine.attention.triton_prefill import paged_prefill

    return AttentionOps(write_kv, paged_decode, paged_prefill)


def _prefill_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                       seq_lens: torch.Tensor, query_start: torch.Tensor, max_query_len: int, scale: float,
                       window: int | None = None) -> torch.Tensor:
    return triton_reference.paged_prefill_reference(q, k_cache, v_cache, block_table, seq_lens, query_start, scale,
                                                    window)


REFERENCE_OPS = AttentionOps(triton_reference.write_kv_reference, triton_reference.paged_decode_reference,
                             _prefill_reference)


class TritonBackend:
    """Paged attention through the Triton kernels (see the module docstring).

    Guarantees: K/V land only in `metadata.slot_mapping`'s slots; `forward` and `write_kv` read no tensor
    value on the host (a decode step is graph-capturable, `capabilities.graph_safe`).
    """

    capabilities: BackendCapabilities = CAPABILITIES["triton"]

    def __init__(self, kv: BoundKV):
        self.kv = kv
        self.scale = kv.layout.head_dim ** -0.5
        self.use_reference(False)

    def use_reference(self, on: bool) -> None:
        """Run the kernels' torch reference instead of the kernels (`on`), or the kernels again."""
        self.ops = REFERENCE_OPS if on else triton_ops()
        # the layers' norms, RoPE and SiLU-and-mul (the model's seam, model/layer_ops.py): one kernel each
        self.layer_ops: LayerOps = TORCH_OPS if on else triton_layer_ops()

    @property
    def description(self) -> str:
        kind = "torch reference of the Triton kernels" if self.ops is REFERENCE_OPS else "Triton kernels"
        return f"triton ({kind})"

    def prepare(self, metadata: StepMetadata) -> None:
        """Nothing to plan: the kernels read the metadata's tensors."""

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, layer: int, metadata: StepMetadata) -> None:
        lkv = self.kv.layers[layer]
        self.ops.write_kv(k, v, lkv.k, lkv.v, metadata.slot_mapping[lkv.group])

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                metadata: StepMetadata) -> torch.Tensor:
        lkv = self.kv.layers[layer]
        g = lkv.group
        self.ops.write_kv(k, v, lkv.k, lkv.v, metadata.slot_mapping[g])
        if metadata.decode_only:
            return self.ops.decode(q, lkv.k, lkv.v, metadata.block_tables[g], metadata.seq_lens, self.scale,
                                   lkv.window)
        split = metadata.mixed
        if split is None:
            return self.ops.prefill(q, lkv.k, lkv.v, metadata.block_tables[g], metadata.seq_lens,
                                    metadata.query_start_loc, metadata.max_query_len, self.scale, lkv.window)
        out = torch.empty_like(q)
        decoded = self.ops.decode(q.index_select(0, split.decode_rows), lkv.k, lkv.v, split.decode_tables[g],
                                  split.decode_seq_lens, self.scale, lkv.window)
        out.index_copy_(0, split.decode_rows, decoded)
        prompted = self.ops.prefill(q.index_select(0, split.prompt_rows), lkv.k, lkv.v, split.prompt_tables[g],
                                    split.prompt_seq_lens, split.prompt_query_start, split.prompt_max_query_len,
                                    self.scale, lkv.window)
        out.index_copy_(0, split.prompt_rows, prompted)
        return out


def why_not_triton(device: torch.device) -> str | None:
    """Why the Triton backend cannot run on `device` here, or None when it can."""
    import importlib.util
    import os

    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (pip install triton, or the package's gpu extra)"
    if device.type == "cuda":
        return None
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
        return None  # Triton's interpreter: correct, slow, what the CPU tests run
    return (f"the model runs on {device}: Triton compiles for CUDA; on the CPU it runs only through its "
            "interpreter (TRITON_INTERPRET=1 set before triton is imported), which is for tests")
