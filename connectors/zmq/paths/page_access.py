"""Host-memory access to a KVPages's pages for the data streams.

On a CPU pool the pages *are* host memory: senders hand page views to
`sendmsg` (one view per run of consecutive blocks) and receivers `recv_into`
the destination page, so bytes are never copied in user space. On a CUDA pool
each stream owns a `StagingRing` (pinned slots and a side stream): pages are
gathered device-to-host a chunk at a time, later chunks' copies queued while
the current one is sent, and landed host-to-device asynchronously while the
next chunk is received (`connectors.zmq.paths.staging_ring`). Copies are batched per
contiguous run or one index gather, never per page.

Invariant: an instance is used by one thread only (its stream's thread).
"""
from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch
import xxhash

from connectors.pages import KVPages
from connectors.zmq.paths.staging_ring import StagingRing, StagingShape

DEFAULT_STAGING = StagingShape()


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


class PageAccess:
    """A data stream's view of a pool's pages as host memory: in place (`on_host`) or staged."""

    def __init__(self, pool: KVPages, staging: StagingShape = DEFAULT_STAGING):
        self.pool = pool
        self.page_bytes = pool.page_size_bytes
        self.on_host = pool.device.type == "cpu" and not staging.stage_host_pools
        self._ring: StagingRing | None = None
        self._landing_rows: torch.Tensor | None = None
        if self.on_host:
            self._host = pool.buffer.numpy()  # shares memory with the pool
            self._flat = memoryview(self._host).cast("B")  # the pool's bytes, for cheap page views
            self.staging_pages = 1 << 30  # no staging limit: pages are used in place
        else:
            self._ring = StagingRing(pool, staging)
            self.staging_pages = self._ring.rows

    @property
    def ring(self) -> StagingRing:
        assert self._ring is not None, "a staged access"
        return self._ring

    def _host_views(self, block_ids: list[int]) -> list[memoryview]:
        """CPU pool: each page as a byte slice of the pool itself (no copy, no numpy)."""
        flat, size = self._flat, self.page_bytes
        return [flat[b * size : (b + 1) * size] for b in block_ids]

    # ------------------------------------------------------------------ send side
    def send_views(self, block_ids: list[int]) -> Iterator[list[memoryview]]:
        """The pages' bytes in order, as lists of byte views for one `sendmsg` each.

        In place: one list, one view per run of consecutive blocks (fewer, larger
        iovecs). Staged: one list per chunk, one view of its whole slot; the
        views of a list stay valid until the generator is resumed."""
        if self.on_host:
            flat, size = self._flat, self.page_bytes
            yield [flat[b * size : (b + n) * size] for b, n in page_runs(block_ids)]
            return
        for _, rows in self.ring.gather_chunks(block_ids):
            yield [memoryview(rows.numpy()).cast("B")]

    def copy_out(self, block_ids: list[int], dst: torch.Tensor) -> None:
        """dst[i] = page(block_ids[i]) for host rows `dst` (shared-memory staging); done on return."""
        if self.on_host:
            # row by row: torch's index_select/index_copy_ are far slower than memcpy here
            out = dst.numpy()
            for i, b in enumerate(block_ids):
                np.copyto(out[i], self._host[b])
            return
        self.ring.gather_into(block_ids, dst)

    # ------------------------------------------------------------------ receive side
    def landing(self, block_ids: list[int]) -> list[np.ndarray]:
        """Where to put these pages' bytes: the pool itself in place, a staging slot otherwise
        (then `commit` lands them)."""
        if self.on_host:
            return [self._host[b] for b in block_ids]
        self._landing_rows = self.ring.landing_rows(len(block_ids))
        rows = self._landing_rows.numpy()
        return [rows[i] for i in range(len(block_ids))]

    def landing_views(self, block_ids: list[int]) -> list[memoryview]:
        """`landing` as byte memoryviews (what `recvmsg_into` fills)."""
        if self.on_host:
            return self._host_views(block_ids)
        return [v.data.cast("B") for v in self.landing(block_ids)]

    def commit(self, block_ids: list[int]) -> None:
        """Lands pages put where `landing` said: staged, a queued host-to-device copy (async;
        the next `landing` may already receive into another slot). `settle` waits for it."""
        if self.on_host:
            return
        rows, self._landing_rows = self._landing_rows, None
        assert rows is not None and rows.shape[0] == len(block_ids), "commit follows landing"
        self.ring.land(rows, block_ids)

    def copy_in(self, src: torch.Tensor, block_ids: list[int]) -> None:
        """page(block_ids[i]) = src[i] for host rows `src` (shared-memory staging). Staged, the
        copy is queued: `src` stays untouched until `settle` returns."""
        if self.on_host:
            rows = src.numpy()
            for i, b in enumerate(block_ids):
                np.copyto(self._host[b], rows[i])
            return
        self.ring.land(src, block_ids)

    def settle(self) -> None:
        """Returns once no copy into the pool that this access queued is still running."""
        if self._ring is not None:
            self._landing_rows = None
            self._ring.settle()

    def page_digests(self, block_ids: list[int]) -> list[int]:
        """Checksums of pool pages as they are now (staged: chunk by chunk through the ring)."""
        if self.on_host:
            return [digest(v) for v in self._host_views(block_ids)]
        out: list[int] = []
        for _, rows in self.ring.gather_chunks(block_ids):
            host = rows.numpy()
            out.extend(digest(host[i]) for i in range(host.shape[0]))
        return out
