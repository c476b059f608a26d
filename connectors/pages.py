"""The narrow view of a worker's KV memory that the connector reads and writes.

The engine owns the memory (`pd.engine.kv.page_pool.PagePool` is the one
implementation); the connector only needs to know it as pages: one
contiguous row of `page_size_bytes` per block id, in a uint8 tensor that
never moves or changes size, on `device`, optionally mappable read-only by a
same-host peer through `shared_path`.
"""
from __future__ import annotations

from typing import Protocol

import torch


class KVPages(Protocol):
    num_blocks: int
    page_size_bytes: int
    device: torch.device
    buffer: torch.Tensor  # (num_blocks, page_size_bytes) uint8, fixed for the pool's life

    @property
    def shared_path(self) -> str | None: ...

    @property
    def nbytes(self) -> int: ...
