"""Host-memory access to a PagePool's pages for the data streams.

On a CPU pool the pages *are* host memory: senders hand page views to
`sendmsg` and receivers `recv_into` the destination page, so bytes are never
copied in user space. On a CUDA pool each stream owns a pinned staging buffer
of `staging_pages` pages and a side stream: pages are gathered device-to-host
into staging before sending, and landed host-to-device from staging after
receiving (the copy is synchronised before the load is reported).

Invariant: an instance is used by one thread only (its stream's thread).
"""
from __future__ import annotations

import numpy as np
import torch
import xxhash

from connectors.page_pool import PagePool


def digest(view) -> int:
    """The per-page checksum carried on the wire (xxh3-64)."""
    return xxhash.xxh3_64_intdigest(view)


class PageAccess:
    def __init__(self, pool: PagePool, staging_pages: int = 64):
        self.pool = pool
        self.page_bytes = pool.page_size_bytes
        self.on_host = pool.device.type == "cpu"
        if self.on_host:
            self._host = pool.buffer.numpy()  # shares memory with the pool
            self.staging_pages = 1 << 30  # no staging limit: pages are used in place
        else:
            self.staging_pages = max(1, staging_pages)
            self._staging_t = torch.empty((self.staging_pages, self.page_bytes), dtype=torch.uint8).pin_memory()
            self._host = self._staging_t.numpy()
            self._stream = torch.cuda.Stream(device=pool.device)

    # ------------------------------------------------------------------ send side
    def gather(self, block_ids: list[int]) -> list[np.ndarray]:
        """Host views holding the pages' bytes, in order (at most `staging_pages` on CUDA)."""
        if self.on_host:
            return [self._host[b] for b in block_ids]
        n = len(block_ids)
        assert n <= self.staging_pages, "caller chunks to staging_pages"
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.pool.device)
        self._stream.wait_stream(torch.cuda.default_stream(self.pool.device))  # the forward wrote these pages
        with torch.cuda.stream(self._stream):
            self._staging_t[:n].copy_(self.pool.buffer.index_select(0, idx), non_blocking=True)
        self._stream.synchronize()
        return [self._host[i] for i in range(n)]

    def copy_out(self, block_ids: list[int], dst: torch.Tensor) -> None:
        """dst[i] = page(block_ids[i]) for a host tensor `dst` (shared-memory staging)."""
        if self.on_host:
            # row by row: torch's index_select/index_copy_ are far slower than memcpy here
            out = dst.numpy()
            for i, b in enumerate(block_ids):
                np.copyto(out[i], self._host[b])
            return
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.pool.device)
        self._stream.wait_stream(torch.cuda.default_stream(self.pool.device))
        with torch.cuda.stream(self._stream):
            dst[: len(block_ids)].copy_(self.pool.buffer.index_select(0, idx))
            self._stream.synchronize()

    # ------------------------------------------------------------------ receive side
    def landing(self, block_ids: list[int]) -> list[np.ndarray]:
        """Where to `recv_into` these pages: the pool itself on CPU, staging on CUDA."""
        if self.on_host:
            return [self._host[b] for b in block_ids]
        assert len(block_ids) <= self.staging_pages, "caller chunks to staging_pages"
        return [self._host[i] for i in range(len(block_ids))]

    def commit(self, block_ids: list[int]) -> None:
        """Makes pages returned by `landing` visible in the pool (CUDA: H2D copy, synchronised)."""
        if self.on_host:
            return
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.pool.device)
        with torch.cuda.stream(self._stream):
            src = self._staging_t[: len(block_ids)].to(self.pool.device, non_blocking=True)
            self.pool.buffer.index_copy_(0, idx, src)
        self._stream.synchronize()

    def copy_in(self, src: torch.Tensor, block_ids: list[int]) -> None:
        """page(block_ids[i]) = src[i] for a host tensor `src` (shared-memory staging)."""
        if self.on_host:
            rows = src.numpy()
            for i, b in enumerate(block_ids):
                np.copyto(self._host[b], rows[i])
            return
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.pool.device)
        with torch.cuda.stream(self._stream):
            self.pool.buffer.index_copy_(0, idx, src[: len(block_ids)].to(self.pool.device, non_blocking=True))
            self._stream.synchronize()

    def page_digests(self, block_ids: list[int]) -> list[int]:
        """Checksums of pool pages as they are now (CUDA: through staging, chunked)."""
        out: list[int] = []
        step = self.staging_pages
        for i in range(0, len(block_ids), step):
            out.extend(digest(v) for v in self.gather(block_ids[i : i + step]))
        return out
