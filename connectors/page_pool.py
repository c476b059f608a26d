"""The page pool: one contiguous tensor of `num_blocks` pages per worker.

A page holds the KV of one block for every layer of one KV cache group,
contiguous in memory (block-major), so one block is one contiguous byte range:
the unit on the wire. Block ids are unique across groups, so a page belongs to
one group at a time and each group views it in its own shape.

Invariants: `buffer` is a uint8 tensor of shape (num_blocks, page_size_bytes)
that never moves or changes size after construction; `page(i)` is a view of
row i (no copy).
"""
from __future__ import annotations

import torch


class PagePool:
    def __init__(self, num_blocks: int, page_size_bytes: int, device: str | torch.device = "cpu", pin_memory: bool = False):
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is the null block), got {num_blocks}")
        if page_size_bytes <= 0:
            raise ValueError(f"page_size_bytes must be positive, got {page_size_bytes}")
        self.num_blocks = num_blocks
        self.page_size_bytes = page_size_bytes
        self.device = torch.device(device)
        self.buffer = torch.zeros((num_blocks, page_size_bytes), dtype=torch.uint8, device=self.device)
        if pin_memory and self.device.type == "cpu" and torch.cuda.is_available():
            self.buffer = self.buffer.pin_memory()

    def page(self, block_id: int) -> torch.Tensor:
        """Row `block_id` as a uint8 view (no copy)."""
        return self.buffer[block_id]

    def view(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """The whole pool viewed as (num_blocks, *shape) of `dtype`, no copy.

        `shape` must describe at most one page's bytes; a group whose layout is
        smaller than the page uses a prefix of each page.
        """
        elem = torch.empty((), dtype=dtype).element_size()
        need = elem
        for d in shape:
            need *= d
        if need > self.page_size_bytes:
            raise ValueError(f"layout {shape} of {dtype} needs {need} bytes > page size {self.page_size_bytes}")
        typed = self.buffer[:, :need].view(dtype) if need == self.page_size_bytes else self.buffer.view(dtype)[:, : need // elem]
        return typed.reshape((self.num_blocks, *shape))

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.page_size_bytes
