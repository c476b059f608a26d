"""The tcp data path: a PULL is answered with a PAGES header (the pages' xxh3 digests) and the
page bytes themselves, on the data socket.

Producer: a CPU pool's pages leave in place, one `sendmsg` with a view per run of consecutive
pages; a CUDA pool's through the pinned staging ring (`page_access.py`), one `sendmsg` per chunk
while the next chunks' device-to-host copies run. Consumer: the header and the pages arrive in
one scatter read straight into their memory (the pool, or a staging slot landed host-to-device
while the next chunk arrives); each page is checked as its bytes come.
"""
from __future__ import annotations

import time

import xxhash

from connectors.metrics import FailureCause
from connectors.zmq.control import framing, wire
from connectors.zmq.paths import answers
from connectors.zmq.paths.base import PathName, PathReceiver, PathServer, PullPart
from connectors.zmq.paths.page_access import PageAccess, digest

NO_SHM = {"shm_name": "", "shm_bytes": 0, "chunk_pages": 0}  # ATTACHED of a path without a segment


class TcpServer(PathServer):
    name = PathName.TCP

    def attached(self) -> dict:
        return dict(NO_SHM)

    def serve(self, reader: framing.FrameReader, xfer: int, block_ids: list[int], digests: list[int]) -> None:
        bufs: list = [wire.pages_frame(xfer, digests, self.pool.page_size_bytes)]
        for views in self.access.send_views(block_ids):
            framing.sendmsg_all(self.conn, bufs + views)
            bufs = []
        if bufs:  # no pages at all: the header alone
            framing.sendmsg_all(self.conn, bufs)


class TcpReceiver(PathReceiver):
    name = PathName.TCP
    spins_in_reads = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._hasher = xxhash.xxh3_64()  # pages that arrive in pieces are hashed piece by piece

    def open(self, attached: dict) -> None:
        pass  # nothing beyond the socket

    def receive(self, part: PullPart, access: PageAccess) -> None:
        """The PAGES frame (its size follows from the page count) and the pages, straight into their
        memory, in one scatter read when all is there; each page is checked as its bytes come."""
        sock, dst, bad = self.conn, part.dst_block_ids, part.bad_block_ids
        head = bytearray(wire.pages_frame_size(len(dst)))
        size, step, hasher = self.pool.page_size_bytes, access.staging_pages, self._hasher
        digests = None
        for a in range(0, len(dst), step):
            ids = dst if len(dst) <= step else dst[a : a + step]
            views = access.landing_views(ids)
            k = digests is None  # the frame rides the first scatter read
            if k:
                views.insert(0, memoryview(head))
            spin_until = time.perf_counter() + self.spin_s if self.spin_s and a == 0 else 0.0
            for i, off, n, rest in framing.recv_scatter(sock, views, spin_until):
                if i < k:
                    digests = answers.pages_header(sock, part, size, head, off + n, views, rest)
                    continue
                i -= k
                assert digests is not None  # (the header came before any page)
                if n == size:  # the whole page in one read
                    if digest(views[i + k]) != digests[a + i]:
                        bad.append(ids[i])
                    continue
                if off == 0:
                    hasher.reset()
                hasher.update(views[i + k][off : off + n])
                if off + n == size and hasher.intdigest() != digests[a + i]:
                    bad.append(ids[i])
            access.commit(ids)
        if bad:
            part.cause = FailureCause.CHECKSUM
