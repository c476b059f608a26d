"""Host-memory access to a KVPages's pages for the data streams: one small interface
(`PageAccess`), two implementations, chosen once per stream (`paths.choice.page_access_for`).

- `InPlacePages` (a CPU pool): the pages *are* host memory: senders hand page views to
  `sendmsg` (one view per run of consecutive blocks) and receivers `recv_into` the destination
  page, so bytes are never copied in user space;
- `StagedPages` (a CUDA pool, `staging_ring.py`): pages move through the pinned staging ring,
  a chunk at a time, device-to-host copies of later chunks queued while the current one is
  sent, host-to-device landings queued while the next chunk is received.

Copies are batched per contiguous run or one index gather, never per page.
Invariant: an instance is used by one thread only (its stream's thread).
"""
from __future__ import annotations

import abc
from collections.abc import Iterator

import numpy as np
import torch
import xxhash

from connectors.pages import KVPages


def digest(view) -> int:
    """The per-page checksum carried on the wire (xxh3-64)."""
    return xxhash.xxh3_64_intdigest(view)


def page_runs(block_ids: list[int]) -> list[tuple[int, int]]:
    """(first block, count) for each run of ascending consecutive ids, in order."""
    runs: list[tuple[int, int]] = []
    for b in block_ids:
        if runs and runs[-1][0] + runs[-1][1] == b:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((b, 1))
    return runs


class PageAccess(abc.ABC):
    """A data stream's view of a pool's pages as host memory.

    Guarantees: `send_views` yields the pages' bytes in order; what `landing` hands out is
    in the pool once `commit` (then `settle`) returned; after `settle` no copy into the pool
    that this access queued is still running."""

    on_host: bool  # the pages are host memory, used in place
    staging_pages: int  # at most this many pages are landed or sent per chunk

    def __init__(self, pool: KVPages):
        self.pool = pool
        self.page_bytes = pool.page_size_bytes

    # ------------------------------------------------------------------ send side
    @abc.abstractmethod
    def send_views(self, block_ids: list[int]) -> Iterator[list[memoryview]]:
        """The pages' bytes in order, as lists of byte views for one `sendmsg` each; the views
        of a list stay valid until the generator is resumed."""

    @abc.abstractmethod
    def copy_out(self, block_ids: list[int], dst: torch.Tensor) -> None:
        """dst[i] = page(block_ids[i]) for host rows `dst` (a shared-memory half); done on return."""

    # ------------------------------------------------------------------ receive side
    @abc.abstractmethod
    def landing(self, block_ids: list[int]) -> list[np.ndarray]:
        """Where to put these pages' bytes (then `commit` lands them)."""

    def landing_views(self, block_ids: list[int]) -> list[memoryview]:
        """`landing` as byte memoryviews (what `recvmsg_into` fills)."""
        return [v.data.cast("B") for v in self.landing(block_ids)]

    @abc.abstractmethod
    def commit(self, block_ids: list[int]) -> None:
        """Lands pages put where `landing` said (perhaps queued: `settle` waits for it)."""

    @abc.abstractmethod
    def copy_in(self, src: torch.Tensor, block_ids: list[int]) -> None:
        """page(block_ids[i]) = src[i] for host rows `src` (a shared-memory half); `src` stays
        untouched until `settle` returns."""

    @abc.abstractmethod
    def settle(self) -> None:
        """Returns once no copy into the pool that this access queued is still running."""

    @abc.abstractmethod
    def page_digests(self, block_ids: list[int]) -> list[int]:
        """Checksums of pool pages as they are now."""


class InPlacePages(PageAccess):
    """A CPU pool's pages used in place: no staging, no copy in user space."""

    on_host = True
    staging_pages = 1 << 30  # no staging limit: pages are used in place

    def __init__(self, pool: KVPages):
        super().__init__(pool)
        self._host = pool.buffer.numpy()  # shares memory with the pool
        self._flat = memoryview(self._host).cast("B")  # the pool's bytes, for cheap page views

    def _host_views(self, block_ids: list[int]) -> list[memoryview]:
        """Each page as a byte slice of the pool itself (no copy, no numpy)."""
        flat, size = self._flat, self.page_bytes
        return [flat[b * size : (b + 1) * size] for b in block_ids]

    def send_views(self, block_ids: list[int]) -> Iterator[list[memoryview]]:
        # one list, one view per run of consecutive blocks (fewer, larger iovecs)
        flat, size = self._flat, self.page_bytes
        yield [flat[b * size : (b + n) * size] for b, n in page_runs(block_ids)]

    def copy_out(self, block_ids: list[int], dst: torch.Tensor) -> None:
        # row by row: torch's index_select/index_copy_ are far slower than memcpy here
        out = dst.numpy()
        for i, b in enumerate(block_ids):
            np.copyto(out[i], self._host[b])

    def landing(self, block_ids: list[int]) -> list[np.ndarray]:
        return [self._host[b] for b in block_ids]

    def landing_views(self, block_ids: list[int]) -> list[memoryview]:
        return self._host_views(block_ids)

    def commit(self, block_ids: list[int]) -> None:
        pass  # the bytes were received into the pool itself

    def copy_in(self, src: torch.Tensor, block_ids: list[int]) -> None:
        rows = src.numpy()
        for i, b in enumerate(block_ids):
            np.copyto(self._host[b], rows[i])

    def settle(self) -> None:
        pass  # every copy was synchronous

    def page_digests(self, block_ids: list[int]) -> list[int]:
        return [digest(v) for v in self._host_views(block_ids)]
