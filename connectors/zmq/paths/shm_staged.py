"""The shm_staged data path (same host, any pool): pages pass through a shared-memory segment
of two halves (`shm_segment.py`), double-buffered with CHUNK / CREDIT frames.

The producer fills one half while the consumer drains the other; a half is refilled only after
its CREDIT came back. For a CUDA pool both sides page-lock the segment so the copies between
it and the device run at DMA rate; where CUDA refuses to page-lock it (`cudaHostRegister`
fails: a locked-memory limit, a driver that will not), the side says so once in the log and
copies through the unlocked segment: slower, never a dead stream. What the user's `shm` means
for a CUDA pool, and `shm_mapped`'s fallback.
"""
from __future__ import annotations

import logging

from connectors.metrics import FailureCause
from connectors.zmq.control import framing, wire
from connectors.zmq.control.wire import MalformedMessage, MsgType
from connectors.zmq.paths import answers
from connectors.zmq.paths.base import PathName, PathReceiver, PathServer, PathUnavailable, PullPart
from connectors.zmq.paths.page_access import PageAccess, digest
from connectors.zmq.paths.shm_mapped import await_credit
from connectors.zmq.paths.shm_segment import ShmSegment, pin_for_pool

logger = logging.getLogger(__name__)


class ShmStagedServer(PathServer):
    name = PathName.SHM_STAGED
    _seg: ShmSegment | None = None

    def attached(self) -> dict:
        if not self.settings.offer_shm:
            raise PathUnavailable("this producer does not offer shared memory")
        chunk = max(1, self.settings.shm_chunk_bytes // self.pool.page_size_bytes)
        self._seg = seg = ShmSegment.create(chunk, self.pool.page_size_bytes)
        pin_for_pool(seg, self.pool.device)  # page-locked: the D2H copies into it run at DMA rate
        return {"shm_name": seg.name, "shm_bytes": seg.nbytes, "chunk_pages": chunk}

    def serve(self, reader: framing.FrameReader, xfer: int, block_ids: list[int], digests: list[int]) -> None:
        seg = self._seg
        assert seg is not None  # (attached first)
        n = seg.chunk_pages
        busy = [False, False]
        for k, i in enumerate(range(0, len(block_ids), n)):
            half = k % 2
            if busy[half]:
                await_credit(reader, busy, self.settings.io_timeout_s)
            self.access.copy_out(block_ids[i : i + n], seg.half(half))
            busy[half] = True
            framing.send_frame(self.conn, wire.encode(MsgType.CHUNK, xfer=xfer, half=half,
                                                      digests=digests[i : i + n]))
        while any(busy):
            await_credit(reader, busy, self.settings.io_timeout_s)

    def close(self) -> None:
        if self._seg is not None:
            self._seg.close()
            self._seg = None


class ShmStagedReceiver(PathReceiver):
    name = PathName.SHM_STAGED
    _seg: ShmSegment | None = None

    @staticmethod
    def fallback(pool) -> PathName | None:
        return PathName.TCP

    def open(self, attached: dict) -> None:
        if not attached["shm_name"]:
            raise PathUnavailable("the producer declined shared memory")
        self._seg = ShmSegment.open(attached["shm_name"], attached["shm_bytes"], attached["chunk_pages"],
                                    self.pool.page_size_bytes)
        pin_for_pool(self._seg, self.pool.device)  # its host-to-device copies at DMA rate, asynchronously

    def receive(self, part: PullPart, access: PageAccess) -> None:
        """Lands a pull's pages from the segment, half by half; the last half's CREDIT is owed."""
        seg = self._seg
        assert seg is not None  # (opened)
        dst, done = part.dst_block_ids, 0
        while True:
            msg = answers.expect(self.conn, MsgType.CHUNK, part.xfer)
            half, digests = msg["half"], msg["digests"]
            if half not in (0, 1) or not digests or len(digests) > seg.chunk_pages or done + len(digests) > len(dst):
                raise MalformedMessage("chunk does not match the pull")
            ids = dst[done : done + len(digests)]
            done += len(ids)
            last = done == len(dst)
            rows = seg.half(half)
            access.copy_in(rows, ids)  # staged: a queued copy, checked below while it runs
            if access.on_host and not last:  # the half is copied out: let the producer refill it now
                framing.send_frame(self.conn, wire.encode(MsgType.CREDIT, half=half))
            check = access.landing(ids) if access.on_host else [rows[j].numpy() for j in range(len(ids))]
            for j, view in enumerate(check):
                if digest(view) != digests[j]:
                    part.bad_block_ids.append(ids[j])
            access.settle()  # the copy reading the half is done: it may be refilled
            if last:
                break
            if not access.on_host:
                framing.send_frame(self.conn, wire.encode(MsgType.CREDIT, half=half))
        if part.bad_block_ids:
            part.cause = FailureCause.CHECKSUM
        self.owed_credit = wire.encode(MsgType.CREDIT, half=half)

    def close(self) -> None:
        if self._seg is not None:
            self._seg.close()
            self._seg = None
