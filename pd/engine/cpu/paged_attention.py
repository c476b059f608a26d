"""The CPU attention backend (`fused`): the torch backend's plan, with decode tokens through the C++
paged-decode kernel (cpu_attention.cpp) instead of gathered sub-batches.

It runs the steps the CPU step executor (step_executor.py) leaves to the per-layer path: steps with
prompt chunks past the executor's caps. Its prompt chunks take the torch plan (`TorchPagedBackend.plan`
over the prompt sequences); its decode tokens read their keys straight from the pages, through the
layer's K/V views bound once over the pool (`KVLayout.bind`).
"""
from __future__ import annotations

import dataclasses

import torch

from pd.engine.attention.capabilities import CAPABILITIES, BackendCapabilities
from pd.engine.attention.metadata import StepMetadata
from pd.engine.attention.torch_paged import TorchPagedBackend
from pd.engine.cpu import kernels as cpu_kernels


@dataclasses.dataclass
class _KernelDecode:
    """A step's decode tokens for the kernel: no gather, no padding."""

    token_index: torch.Tensor  # (B,) flat index of each decode token
    key_end: torch.Tensor  # (B,) context length including the new token
    groups: list[tuple[torch.Tensor, torch.Tensor]]  # per group: (block table (B, W), first key position (B,))


class CpuPagedAttention(TorchPagedBackend):
    """Paged attention on the CPU, float32: decode tokens through the C++ kernel, prompt chunks through
    the torch plan. Guarantees those of the contract (attention/backend.py), K/V only in the step's slots."""

    capabilities: BackendCapabilities = CAPABILITIES["fused"]
    decode: _KernelDecode | None = None

    @property
    def description(self) -> str:
        return "fused (C++ paged decode, torch prompts)"

    def prepare(self, metadata: StepMetadata) -> None:
        host = metadata.host
        starts, counts = list(host.starts), list(host.query_lens)
        members = [i for i, n in enumerate(counts) if n == 1]
        self.decode = None
        if members:
            idx = torch.tensor(members)
            key_end = torch.tensor([starts[i] + 1 for i in members])
            per_group = []
            for g, grp in enumerate(self.layout.groups):
                key_start = torch.zeros_like(key_end) if grp.window is None else torch.clamp(key_end - grp.window,
                                                                                              min=0)
                per_group.append((host.block_tables[g][idx].contiguous(), key_start))
            self.decode = _KernelDecode(host.query_start_loc[:-1][idx], key_end, per_group)
        self.plan(metadata, [])  # the prompt chunks

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                metadata: StepMetadata) -> torch.Tensor:
        self.write_kv(k, v, layer, metadata)
        if self.decode is None:
            return self.attend(q, k, v, layer, None)
        lkv = self.kv.layers[layer]
        table, key_start = self.decode.groups[lkv.group]
        out = torch.empty_like(q)
        index = self.decode.token_index
        out[index] = cpu_kernels.paged_decode_attention(q[index], lkv.cache, table, key_start, self.decode.key_end,
                                                        q.shape[2] ** -0.5)
        return self.attend(q, k, v, layer, out)
