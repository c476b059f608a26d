"""Host-memory access to a KVPages's pages for the data streams.

On a CPU pool the pages *are* host memory: senders hand page views to
`sendmsg` and receivers `recv_into` the destination page, so bytes are never
copied in user space. On a CUDA pool each stream owns a pinned staging buffer
and a side stream (`connectors.zmq.cuda_staging.CudaStaging`): pages are gathered
device-to-host into staging before sending (after the compute stream's latest
forward, by event), and landed host-to-device from staging after receiving
(the compute stream waits on the landing event before a forward reads them);
copies are batched per contiguous run or one index gather, never per page.

Invariant: an instance is used by one thread only (its stream's thread).
"""
from __future__ import annotations

import numpy as np
import torch
import xxhash

from connectors.zmq.cuda_staging import CudaStaging
from connectors.pages import KVPages


def digest(view) -> int:
    """The per-page checksum carried on the wire (xxh3-64)."""
    return xxhash.xxh3_64_intdigest(view)


class PageAccess:
    def __init__(self, pool: KVPages, staging_pages: int = 64):
        self.pool = pool
        self.page_bytes = pool.page_size_bytes
        self.on_host = pool.device.type == "cpu"
        if self.on_host:
            self._host = pool.buffer.numpy()  # shares memory with the pool
            self._flat = memoryview(self._host).cast("B")  # the pool's bytes, for cheap page views
            self.staging_pages = 1 << 30  # no staging limit: pages are used in place
        else:
            self._staging = CudaStaging(pool, max(1, staging_pages))
            self.staging_pages = self._staging.rows_per_half
            self._landing_rows: torch.Tensor | None = None

    def _host_views(self, block_ids: list[int]) -> list[memoryview]:
        """CPU pool: each page as a byte slice of the pool itself (no copy, no numpy)."""
        flat, size = self._flat, self.page_bytes
        return [flat[b * size : (b + 1) * size] for b in block_ids]

    # ------------------------------------------------------------------ send side
    def gather(self, block_ids: list[int]) -> list[np.ndarray]:
        """Host views holding the pages' bytes, in order (at most `staging_pages` on CUDA)."""
        if self.on_host:
            return [self._host[b] for b in block_ids]
        assert len(block_ids) <= self.staging_pages, "caller chunks to staging_pages"
        rows = self._staging.copy_to_host(block_ids).numpy()
        return [rows[i] for i in range(len(block_ids))]

    def gather_views(self, block_ids: list[int]) -> list[memoryview]:
        """`gather` as byte memoryviews (what `sendmsg` takes; on CPU a slice per page, no numpy)."""
        if self.on_host:
            return self._host_views(block_ids)
        return [v.data.cast("B") for v in self.gather(block_ids)]

    def copy_out(self, block_ids: list[int], dst: torch.Tensor) -> None:
        """dst[i] = page(block_ids[i]) for a host tensor `dst` (shared-memory staging)."""
        if self.on_host:
            # row by row: torch's index_select/index_copy_ are far slower than memcpy here
            out = dst.numpy()
            for i, b in enumerate(block_ids):
                np.copyto(out[i], self._host[b])
            return
        self._staging.copy_to_host(block_ids, out=dst)

    # ------------------------------------------------------------------ receive side
    def landing(self, block_ids: list[int]) -> list[np.ndarray]:
        """Where to `recv_into` these pages: the pool itself on CPU, staging on CUDA."""
        if self.on_host:
            return [self._host[b] for b in block_ids]
        assert len(block_ids) <= self.staging_pages, "caller chunks to staging_pages"
        self._landing_rows = self._staging.half_rows(len(block_ids))
        rows = self._landing_rows.numpy()
        return [rows[i] for i in range(len(block_ids))]

    def landing_views(self, block_ids: list[int]) -> list[memoryview]:
        """`landing` as byte memoryviews (what `recvmsg_into` fills)."""
        if self.on_host:
            return self._host_views(block_ids)
        return [v.data.cast("B") for v in self.landing(block_ids)]

    def commit(self, block_ids: list[int]) -> None:
        """Makes pages returned by `landing` visible in the pool
        (CUDA: batched H2D on the side stream, event-fenced)."""
        if self.on_host:
            return
        rows, self._landing_rows = self._landing_rows, None
        assert rows is not None and rows.shape[0] == len(block_ids), "commit follows landing"
        # The compute stream is fenced on the landing event; this thread also waits for the copy so a
        # resolved part never has a write in flight (PullStream's guarantee, for callers without an engine).
        self._staging.copy_to_pool(rows, block_ids, wait=True)

    def copy_in(self, src: torch.Tensor, block_ids: list[int]) -> None:
        """page(block_ids[i]) = src[i] for a host tensor `src` (shared-memory staging)."""
        if self.on_host:
            rows = src.numpy()
            for i, b in enumerate(block_ids):
                np.copyto(self._host[b], rows[i])
            return
        # wait: the caller hands `src` (a shared-memory half) back to the producer next
        self._staging.copy_to_pool(src, block_ids, wait=True)

    def page_digests(self, block_ids: list[int]) -> list[int]:
        """Checksums of pool pages as they are now (CUDA: through staging, chunked)."""
        out: list[int] = []
        step = self.staging_pages
        for i in range(0, len(block_ids), step):
            out.extend(digest(v) for v in self.gather(block_ids[i : i + step]))
        return out
