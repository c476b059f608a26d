"""The page pool: one contiguous tensor of `num_blocks` pages per worker.

A page holds the KV of one block for every layer of one KV cache group,
contiguous in memory (block-major), so one block is one contiguous byte range:
the unit on the wire. Block ids are unique across groups, so a page belongs to
one group at a time and each group views it in its own shape.

Invariants: `buffer` is a uint8 tensor of shape (num_blocks, page_size_bytes)
that never moves or changes size after construction; `page(i)` is a view of
row i (no copy).

A shareable CPU pool (not pinned; the default) lives in an anonymous
shared-memory file (memfd) when the OS offers one: for its owner it is
ordinary zeroed memory, and a KV consumer on the same host may map it
read-only (`shared_path`) to copy pages out with a single memcpy. A pool that
no other process maps (`shareable=False`: a decode or colocated worker) is
private anonymous memory that Linux may back with 2 MiB pages (THP, where
`madvise` mode allows): attention streams the whole pool every decode step,
and huge pages spare it a TLB miss every 4 KiB. Otherwise the pool is a plain
tensor.
"""
from __future__ import annotations

import mmap
import os
import weakref

import torch


class PagePool:
    def __init__(self, num_blocks: int, page_size_bytes: int, device: str | torch.device = "cpu",
                 pin_memory: bool = False,
                 shareable: bool = True):
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is the null block), got {num_blocks}")
        if page_size_bytes <= 0:
            raise ValueError(f"page_size_bytes must be positive, got {page_size_bytes}")
        self.num_blocks = num_blocks
        self.page_size_bytes = page_size_bytes
        self.device = torch.device(device)
        self._fd: int | None = None
        pinned = pin_memory and self.device.type == "cpu" and torch.cuda.is_available()
        if self.device.type == "cpu" and not pinned and shareable and hasattr(os, "memfd_create"):
            self.buffer = self._map_memfd(num_blocks, page_size_bytes)
        elif self.device.type == "cpu" and not pinned and not shareable:
            self.buffer = _map_private(num_blocks, page_size_bytes)
        else:
            self.buffer = torch.zeros((num_blocks, page_size_bytes), dtype=torch.uint8, device=self.device)
        if pinned:
            self.buffer = self.buffer.pin_memory()

    def _map_memfd(self, num_blocks: int, page_size_bytes: int) -> torch.Tensor:
        fd = os.memfd_create("pdkv-page-pool", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, num_blocks * page_size_bytes)
            mm = mmap.mmap(fd, num_blocks * page_size_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError:
            os.close(fd)
            return torch.zeros((num_blocks, page_size_bytes), dtype=torch.uint8)
        self._fd = fd
        weakref.finalize(self, os.close, fd)  # the mapping itself lives as long as the tensor
        return torch.frombuffer(mm, dtype=torch.uint8).view(num_blocks, page_size_bytes)

    @property
    def shared_path(self) -> str | None:
        """A path a same-host process may open read-only to map this pool, or None."""
        return f"/proc/{os.getpid()}/fd/{self._fd}" if self._fd is not None else None

    def zero_blocks(self, block_ids: set[int]) -> None:
        """Zeroes these pages. A failed load may leave arbitrary bytes (NaN/Inf as floats) in its
        pages; attention masks a block's unused slots by weight 0, but 0 * NaN is NaN."""
        index = torch.tensor(sorted(block_ids), dtype=torch.long, device=self.buffer.device)
        self.buffer.index_fill_(0, index, 0)

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
        typed = (self.buffer[:, :need].view(dtype) if need == self.page_size_bytes
                 else self.buffer.view(dtype)[:, : need // elem])
        return typed.reshape((self.num_blocks, *shape))

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.page_size_bytes


_HUGE_PAGE = 1 << 21


def _map_private(num_blocks: int, page_size_bytes: int) -> torch.Tensor:
    """Zeroed private memory starting on a 2 MiB boundary, marked for transparent huge pages."""
    nbytes = num_blocks * page_size_bytes
    mm = mmap.mmap(-1, nbytes + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    start = -torch.frombuffer(mm, dtype=torch.uint8, count=1).data_ptr() % _HUGE_PAGE
    if hasattr(mm, "madvise") and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mm.madvise(mmap.MADV_HUGEPAGE, start, nbytes // _HUGE_PAGE * _HUGE_PAGE)
        except OSError:  # THP disabled or unsupported: ordinary pages, same contents
            pass
    # (a storage that starts at the aligned byte, not a view into a larger one: the layers' K/V views
    # are then plain views of one storage from its start, which torch.compile traces, kv/layout.py)
    return torch.frombuffer(mm, dtype=torch.uint8, count=nbytes, offset=start).view(num_blocks, page_size_bytes)
