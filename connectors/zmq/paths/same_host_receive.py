"""A consumer stream's receive steps for the same-host and same-node data paths.

- shm (`recv_shm_chunks`): pages come through a shared-memory segment, one half
  at a time; a half is credited back once nothing reads it any more;
- map (`copy_mapped`): pages are copied out of the producer's CPU pool,
  mapped read-only;
- cuda_ipc (`copy_device`): pages are copied device to device out of the
  producer's pool, mapped through CUDA IPC.

Each step marks the destination pages whose checksum fails in
`part.bad_block_ids` (cause CHECKSUM) and returns with no copy into the pool
still running. The last credit of a pull is left to the caller (sent after the
part is reported, off the latency path).
"""
from __future__ import annotations

import socket
from collections.abc import Callable

import numpy as np

from connectors.metrics import FailureCause
from connectors.zmq.control import framing, wire
from connectors.zmq.paths.ipc_mapping import MappedPool
from connectors.zmq.consumer.loads import PullPart
from connectors.zmq.paths.page_access import PageAccess, digest
from connectors.zmq.paths.shm_segment import ShmSegment
from connectors.zmq.control.wire import MalformedMessage, MsgType

FINAL_CREDIT = wire.encode(MsgType.CREDIT, half=0)  # map and cuda_ipc: unpins the pull's lease


def recv_shm_chunks(conn: socket.socket, seg: ShmSegment, part: PullPart, access: PageAccess,
                    expect: Callable[[MsgType, int], dict]) -> bytes:
    """Lands a pull's pages from the segment; returns the final CREDIT (for the caller to send)."""
    dst = part.dst_block_ids
    done = 0
    while True:
        msg = expect(MsgType.CHUNK, part.xfer)
        half, digests = msg["half"], msg["digests"]
        if half not in (0, 1) or not digests or len(digests) > seg.chunk_pages or done + len(digests) > len(dst):
            raise MalformedMessage("chunk does not match the pull")
        ids = dst[done : done + len(digests)]
        done += len(ids)
        last = done == len(dst)
        rows = seg.half(half)
        access.copy_in(rows, ids)  # staged: a queued copy, checked below while it runs
        if access.on_host and not last:  # the half is copied out: let the producer refill it now
            framing.send_frame(conn, wire.encode(MsgType.CREDIT, half=half))
        check = access.landing(ids) if access.on_host else [rows[j].numpy() for j in range(len(ids))]
        for j, view in enumerate(check):
            if digest(view) != digests[j]:
                part.bad_block_ids.append(ids[j])
        access.settle()  # the copy reading the half is done: it may be refilled
        if last:
            break
        if not access.on_host:
            framing.send_frame(conn, wire.encode(MsgType.CREDIT, half=half))
    if part.bad_block_ids:
        part.cause = FailureCause.CHECKSUM
    return wire.encode(MsgType.CREDIT, half=half)


def copy_mapped(src: np.ndarray, part: PullPart, access: PageAccess, digests: list[int]) -> None:
    """map: the one copy, producer's page -> our page (through staging chunks when staged)."""
    dst, step = part.dst_block_ids, access.staging_pages
    for a in range(0, len(dst), step):
        ids = dst[a : a + step]
        for j, view in enumerate(access.landing(ids)):
            np.copyto(view, src[part.src_block_ids[a + j]])
            if digest(view) != digests[a + j]:
                part.bad_block_ids.append(ids[j])
        access.commit(ids)
    access.settle()
    if part.bad_block_ids:
        part.cause = FailureCause.CHECKSUM


def copy_device(mapped: MappedPool, part: PullPart, access: PageAccess, digests: list[int], verify: bool) -> None:
    """cuda_ipc: pages copied device to device; with `verify`, checked against the producer's digests
    (a device-to-host pass and a host hash of every page: optional, it costs more than the copy)."""
    if len(digests) != len(part.dst_block_ids):
        raise MalformedMessage("pages header does not match the pull")
    mapped.copy_pages(part.src_block_ids, part.dst_block_ids)
    if verify:
        got = access.page_digests(part.dst_block_ids)
        part.bad_block_ids.extend(b for b, want, have in zip(part.dst_block_ids, digests, got, strict=True)
                                  if want != have)
        if part.bad_block_ids:
            part.cause = FailureCause.CHECKSUM
