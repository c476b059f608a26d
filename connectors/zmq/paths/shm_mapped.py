"""The shm_mapped data path (same host, the producer's pool on the CPU): the consumer maps the
producer's pool read-only and copies each page once, straight out of it.

A PULL is answered with the PAGES header only (digests); the consumer copies and checks the
pages, then CREDITs: the producer keeps the pull's lease pinned until that credit comes, so no
page is reused while it is read. What the user's `shm` means for a CPU pool; a stream that
cannot map the pool (another host's /proc, a producer that shares none) falls back to
`shm_staged`.
"""
from __future__ import annotations

import numpy as np

from connectors.metrics import FailureCause
from connectors.zmq.control import framing, wire
from connectors.zmq.control.wire import MsgType
from connectors.zmq.paths import answers
from connectors.zmq.paths.base import PathName, PathReceiver, PathServer, PathUnavailable, PullPart
from connectors.zmq.paths.page_access import PageAccess, digest
from connectors.zmq.paths.shm_segment import map_pool

FINAL_CREDIT = wire.encode(MsgType.CREDIT, half=0)  # shm_mapped and cuda_ipc: unpins the pull's lease


def await_credit(reader: framing.FrameReader, busy: list[bool], timeout_s: float) -> None:
    """Producer: the consumer's CREDIT for one of the busy halves (`busy[half]` cleared)."""
    msg_type, msg = reader.read(timeout_s)
    if msg_type is not MsgType.CREDIT or msg["half"] not in (0, 1) or not busy[msg["half"]]:
        raise wire.MalformedMessage("expected a credit for a busy half")
    busy[msg["half"]] = False


def serve_in_place(server: PathServer, reader: framing.FrameReader, xfer: int, digests: list[int]) -> None:
    """Producer, for a path whose consumer copies the pages itself (shm_mapped, cuda_ipc): the answer
    carries only the digests, and the lease stays pinned until the consumer's credit says it copied."""
    framing.sendmsg_all(server.conn, [wire.pages_frame(xfer, digests, server.pool.page_size_bytes)])
    await_credit(reader, [True, False], server.settings.io_timeout_s)


class ShmMappedServer(PathServer):
    name = PathName.SHM_MAPPED
    def attached(self) -> dict:
        if not self.settings.offer_shm:
            raise PathUnavailable("this producer does not offer shared memory")
        if self.pool.shared_path is None:
            raise PathUnavailable("the producer's pool is not in shared memory")
        return {"shm_name": self.pool.shared_path, "shm_bytes": self.pool.nbytes, "chunk_pages": 0}

    def serve(self, reader: framing.FrameReader, xfer: int, block_ids: list[int], digests: list[int]) -> None:
        serve_in_place(self, reader, xfer, digests)


class ShmMappedReceiver(PathReceiver):
    name = PathName.SHM_MAPPED
    _mapped: np.ndarray | None = None

    @staticmethod
    def fallback(pool) -> PathName | None:
        return PathName.SHM_STAGED

    def open(self, attached: dict) -> None:
        self._mapped = map_pool(attached["shm_name"], attached["shm_bytes"], self.pool.page_size_bytes)

    def receive(self, part: PullPart, access: PageAccess) -> None:
        head = bytearray(wire.pages_frame_size(len(part.dst_block_ids)))
        views = [memoryview(head)]
        for _, off, n, rest in framing.recv_scatter(self.conn, views):
            digests = answers.pages_header(self.conn, part, self.pool.page_size_bytes, head, off + n, views, rest)
        src = self._mapped
        assert src is not None and digests is not None  # (opened; the header came first)
        self.owed_credit = FINAL_CREDIT  # unpins the lease
        dst, step = part.dst_block_ids, access.staging_pages
        for a in range(0, len(dst), step):  # the one copy, producer's page -> our page (staged in chunks if so)
            ids = dst[a : a + step]
            for j, view in enumerate(access.landing(ids)):
                np.copyto(view, src[part.src_block_ids[a + j]])
                if digest(view) != digests[a + j]:
                    part.bad_block_ids.append(ids[j])
            access.commit(ids)
        access.settle()
        if part.bad_block_ids:
            part.cause = FailureCause.CHECKSUM

    def close(self) -> None:
        self._mapped = None
