"""The host-staged pipeline: a ring of staging slots between a page pool and the socket.

A CUDA pool's pages cannot be handed to `sendmsg` or `recv_into`; they move
through host memory in chunks of `StagingShape.chunk_bytes`. One chunk
occupies one slot of the ring; with `slots >= 2` the three stages of a
transfer overlap:

- send side (`gather_chunks`): the device-to-host copies of the next
  `slots - 1` chunks are queued on the side stream while this thread sends
  the current chunk from its slot (zero-copy: the slot is the `sendmsg`
  buffer), so the copy engine and the socket work at the same time;
- receive side (`landing_rows` / `land` / `settle`): a chunk is received
  straight into a slot, its host-to-device copy is queued and the next chunk
  is received into the next slot while the copy runs. A slot is handed out
  again only after the copy that read it finished (its event); `settle` waits
  for the last one, so a resolved transfer has no write in flight.

On a CPU pool the same ring runs with plain host memory and synchronous
copies (`StagingShape.stage_host_pools`): the chunking, slot order and byte
layout are the same code, testable without a GPU. A CPU pool normally needs
no staging at all (its pages are host memory and are sent in place).

`StagedPages` is the ring as a data stream sees it: the `PageAccess` of a CUDA
pool (the other implementation, `InPlacePages`, is a CPU pool's pages in place).

Invariant: a ring is used by one thread only (its data stream's thread).
"""
from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterator

import torch

from connectors.pages import KVPages
from connectors.zmq.paths.cuda_staging import fences_for, gather_pages, scatter_pages
from connectors.zmq.paths.page_access import PageAccess, digest

MIB = 1024 * 1024


@dataclasses.dataclass(frozen=True)
class StagingShape:
    """How a data stream stages pages: chunk size, slots in flight, and whether a CPU pool
    is staged too (off in production: a CPU pool is sent from and received into in place)."""

    chunk_bytes: int = 4 * MIB  # a few MiB: large enough for full-rate DMA, small enough to overlap stages
    slots: int = 4  # chunks in flight per stream (16 MiB pinned per stream by default)
    stage_host_pools: bool = False

    def __post_init__(self) -> None:
        if self.chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be >= 1, got {self.chunk_bytes}")
        if not 2 <= self.slots <= 64:
            raise ValueError(f"slots must be in [2, 64] (two or more overlap the stages), got {self.slots}")

    def rows(self, page_bytes: int) -> int:
        """Pages per chunk (at least one: a page larger than a chunk is a chunk of its own)."""
        return max(1, self.chunk_bytes // page_bytes)


class StagingRing:
    """`slots` host buffers of `rows` pages (pinned for a CUDA pool) and one side stream.

    Guarantees: `gather_chunks` yields each chunk's pages in order, complete in
    host memory when yielded; a slot yielded by `gather_chunks` stays untouched
    until the generator is resumed; `landing_rows` never returns a slot that
    an unfinished host-to-device copy still reads; after `settle` every copy
    `land` queued has finished.
    """

    def __init__(self, pool: KVPages, shape: StagingShape):
        self.pool = pool
        self.cuda = pool.device.type == "cuda"
        self.slots = shape.slots
        self.page_bytes = pool.page_size_bytes
        self.rows = shape.rows(self.page_bytes)
        self.stream: torch.cuda.Stream | None = None
        if self.cuda:
            with torch.cuda.device(pool.device):
                self.host = torch.empty((self.slots * self.rows, self.page_bytes), dtype=torch.uint8,
                                        pin_memory=True)
                self.stream = torch.cuda.Stream(device=pool.device)
        else:
            self.host = torch.empty((self.slots * self.rows, self.page_bytes), dtype=torch.uint8)
        self.fences = fences_for(pool)
        self._reading: list[torch.cuda.Event | None] = [None] * self.slots  # H2D copies still reading a slot
        self._last_landed: torch.cuda.Event | None = None
        self._next = 0

    def slot_rows(self, slot: int, num_pages: int) -> torch.Tensor:
        start = slot * self.rows
        return self.host[start : start + num_pages]

    def _take_slot(self, num_pages: int) -> torch.Tensor:
        """The next slot in ring order, once no host-to-device copy reads it any more."""
        if not 0 < num_pages <= self.rows:
            raise ValueError(f"{num_pages} pages do not fit a staging slot of {self.rows}")
        slot, self._next = self._next, (self._next + 1) % self.slots
        event = self._reading[slot]
        if event is not None:
            event.synchronize()  # this thread only; the compute stream is not involved
            self._reading[slot] = None
        return self.slot_rows(slot, num_pages)

    # ------------------------------------------------------------------ send side
    def gather_chunks(self, block_ids: list[int]) -> Iterator[tuple[list[int], torch.Tensor]]:
        """Yields (chunk's block ids, their rows in a slot) in order, each complete in host memory.

        The device-to-host copies of up to `slots - 1` later chunks are queued before a
        chunk is yielded, so they run while the caller sends it."""
        step = self.rows
        chunks = [block_ids[i : i + step] for i in range(0, len(block_ids), step)]
        queued: collections.deque[tuple[list[int], torch.Tensor, torch.cuda.Event | None]] = collections.deque()
        if self.stream is not None:
            self.fences.order_after_writes(self.stream)  # after the forward that wrote the pages
        issued = 0
        while issued < len(chunks) and len(queued) < self.slots:
            queued.append(self._queue_d2h(chunks[issued]))
            issued += 1
        try:
            while queued:
                ids, rows, done = queued.popleft()
                if done is not None:
                    done.synchronize()
                yield ids, rows
                # the caller is done with that slot (sent or hashed): it takes the next chunk
                if issued < len(chunks):
                    queued.append(self._queue_d2h(chunks[issued]))
                    issued += 1
        finally:  # abandoned (a send failed): no copy may still write a slot the ring hands out next
            for _, _, done in queued:
                if done is not None:
                    done.synchronize()

    def _queue_d2h(self, ids: list[int]) -> tuple[list[int], torch.Tensor, torch.cuda.Event | None]:
        rows = self._take_slot(len(ids))
        if self.stream is None:
            gather_pages(self.pool.buffer, ids, rows)
            return ids, rows, None
        with torch.cuda.device(self.pool.device), torch.cuda.stream(self.stream):
            gather_pages(self.pool.buffer, ids, rows)
            done = torch.cuda.Event()
            done.record(self.stream)
        return ids, rows, done

    def gather_into(self, block_ids: list[int], out: torch.Tensor) -> None:
        """out[i] = page(block_ids[i]) for host rows `out` outside the ring (a shared-memory
        half); complete when this returns."""
        if self.stream is None:
            gather_pages(self.pool.buffer, block_ids, out)
            return
        with torch.cuda.device(self.pool.device), torch.cuda.stream(self.stream):
            self.fences.order_after_writes(self.stream)
            gather_pages(self.pool.buffer, block_ids, out)
            done = torch.cuda.Event()
            done.record(self.stream)
        done.synchronize()

    # ------------------------------------------------------------------ receive side
    def landing_rows(self, num_pages: int) -> torch.Tensor:
        """The next free slot's first `num_pages` rows, to receive a chunk into."""
        return self._take_slot(num_pages)

    def land(self, rows: torch.Tensor, block_ids: list[int]) -> None:
        """page(block_ids[i]) = rows[i]: queued on the side stream (CUDA), the compute stream
        fenced on it; `rows` (a slot, or a shared-memory half) must stay as they are until
        `settle` (a slot is protected by the ring itself)."""
        if self.stream is None:
            scatter_pages(rows, self.pool.buffer, block_ids)
            return
        with torch.cuda.device(self.pool.device), torch.cuda.stream(self.stream):
            scatter_pages(rows, self.pool.buffer, block_ids)
            landed = torch.cuda.Event()
            landed.record(self.stream)
        self.fences.add_landed(landed)
        slot = self._slot_of(rows)
        if slot is not None:
            self._reading[slot] = landed
        self._last_landed = landed

    def settle(self) -> None:
        """Returns once every copy `land` queued has finished (one stream: the last one)."""
        event, self._last_landed = self._last_landed, None
        if event is not None:
            event.synchronize()

    def _slot_of(self, rows: torch.Tensor) -> int | None:
        offset = rows.data_ptr() - self.host.data_ptr()
        slot_bytes = self.rows * self.page_bytes
        if 0 <= offset < self.slots * slot_bytes:
            return offset // slot_bytes
        return None


DEFAULT_STAGING = StagingShape()


class StagedPages(PageAccess):
    """A pool's pages through a `StagingRing` (a CUDA pool; a CPU pool in tests)."""

    on_host = False

    def __init__(self, pool: KVPages, staging: StagingShape = DEFAULT_STAGING):
        super().__init__(pool)
        self.ring = StagingRing(pool, staging)
        self.staging_pages = self.ring.rows
        self._landing_rows: torch.Tensor | None = None

    def send_views(self, block_ids: list[int]) -> Iterator[list[memoryview]]:
        # one list per chunk, one view of its whole slot, sent while later chunks are copied out
        for _, rows in self.ring.gather_chunks(block_ids):
            yield [memoryview(rows.numpy()).cast("B")]

    def copy_out(self, block_ids: list[int], dst: torch.Tensor) -> None:
        self.ring.gather_into(block_ids, dst)

    def landing(self, block_ids: list[int]) -> list:
        self._landing_rows = self.ring.landing_rows(len(block_ids))
        rows = self._landing_rows.numpy()
        return [rows[i] for i in range(len(block_ids))]

    def commit(self, block_ids: list[int]) -> None:
        """A queued host-to-device copy (the next `landing` may already receive into another slot)."""
        rows, self._landing_rows = self._landing_rows, None
        assert rows is not None and rows.shape[0] == len(block_ids), "commit follows landing"
        self.ring.land(rows, block_ids)

    def copy_in(self, src: torch.Tensor, block_ids: list[int]) -> None:
        self.ring.land(src, block_ids)

    def settle(self) -> None:
        self._landing_rows = None
        self.ring.settle()

    def page_digests(self, block_ids: list[int]) -> list[int]:
        """Chunk by chunk through the ring."""
        out: list[int] = []
        for _, rows in self.ring.gather_chunks(block_ids):
            host = rows.numpy()
            out.extend(digest(host[i]) for i in range(host.shape[0]))
        return out
