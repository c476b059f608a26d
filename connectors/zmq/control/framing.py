"""Byte framing on data-stream sockets: length-prefixed control frames, scatter/gather page I/O.

Data streams (plain sockets) carry length-prefixed frames: 4 bytes big-endian
length, then a msgpack control message (`wire`). Page bytes follow a PAGES
header as raw bytes, in the order the header names, so the receiver lands
them with `recvmsg_into` straight into their destination memory.

Data sockets wait in the kernel (`kernel_timeouts`: SO_RCVTIMEO /
SO_SNDTIMEO), so a read or a send is one syscall, not a poll and then the
call; a wait that runs out surfaces as `TimeoutError` from the helpers here.
Every frame is checked like `wire.decode` checks it; a bad one raises
`wire.MalformedMessage`, after which the stream is out of sync and is closed.
"""
from __future__ import annotations

import socket
import struct
import time
from typing import Any

from connectors.zmq.control.wire import MAX_CONTROL_BYTES, MalformedMessage, MsgType, decode

_LEN = struct.Struct(">I")


def kernel_timeouts(sock: socket.socket, recv_s: float, send_s: float) -> None:
    """Makes `sock` blocking with kernel-side bounds on every wait (SO_RCVTIMEO / SO_SNDTIMEO):
    a recv or send is then one syscall, not poll + call. A wait that runs out raises
    BlockingIOError from the socket call; the helpers here turn it into TimeoutError."""
    sock.settimeout(None)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(recv_s))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(send_s))


def _timeval(seconds: float) -> bytes:
    usec = max(1, int(seconds * 1e6))
    return struct.pack("ll", usec // 1_000_000, usec % 1_000_000)


class Idle(TimeoutError):
    """`FrameReader.read(idle=True)`: one kernel wait passed and no byte of a frame came."""


class FrameReader:
    """Reads frames from a socket set up with `kernel_timeouts`, usually one recv a frame:
    what arrived goes into a reused buffer, bytes past the frame wait for the next call.
    Checks like `recv_frame` (length range, then `decode`)."""

    def __init__(self, sock: socket.socket, max_bytes: int = MAX_CONTROL_BYTES, size: int = 64 * 1024):
        self._sock = sock
        self._max = max_bytes
        self._size = size
        self._buf = bytearray(size)
        self._view = memoryview(self._buf)
        self._start = self._end = 0

    def read(self, timeout_s: float, idle: bool = False) -> tuple[MsgType, dict[str, Any]]:
        """The next frame. Raises `Idle` (when `idle`) if nothing of a frame arrived within
        one kernel wait, TimeoutError when a frame is not complete about `timeout_s` after
        the read began (or, when `idle`, after its first byte came), ConnectionError when
        the peer closed, MalformedMessage for a bad frame."""
        deadline = None
        while True:
            start, avail = self._start, self._end - self._start
            need = 4
            if avail >= 4:
                (length,) = _LEN.unpack_from(self._buf, start)
                if length == 0 or length > self._max:
                    raise MalformedMessage(f"frame length {length} out of range")
                need = 4 + length
                if avail >= need:
                    body: bytes | memoryview = self._view[start + 4 : start + need]
                    self._start = start + need
                    if self._start == self._end:
                        self._start = self._end = 0
                        if len(self._buf) > self._size:  # a rare big frame: give the memory back after it
                            body = bytes(body)
                            self._buf = bytearray(self._size)
                            self._view = memoryview(self._buf)
                    return decode(body)
            if start + need > len(self._buf):  # make room: move what we have to the front (or grow)
                grown = bytearray(max(need, self._size))
                grown[:avail] = self._view[start : self._end]
                self._buf, self._view, self._start, self._end = grown, memoryview(grown), 0, avail
            try:
                got = self._sock.recv_into(self._view[self._end :])
            except BlockingIOError:
                now = time.monotonic()
                if deadline is None:
                    if idle and self._end == self._start:
                        raise Idle("no frame") from None
                    deadline = now + timeout_s
                elif now > deadline:
                    raise TimeoutError("frame not complete in time") from None
                continue
            if got == 0:
                raise ConnectionError("peer closed the stream")
            self._end += got


def send_frame(sock: socket.socket, payload: bytes) -> None:
    """One length-prefixed control frame (a single syscall for small frames)."""
    send_frame_bytes(sock, _LEN.pack(len(payload)) + payload)


def send_frame_bytes(sock: socket.socket, data: bytes) -> None:
    """Sends bytes that are already framed (e.g. `pull_frame`), all of them."""
    try:
        sock.sendall(data)
    except BlockingIOError:
        raise TimeoutError("send timed out") from None


def recv_frame(sock: socket.socket, max_bytes: int = MAX_CONTROL_BYTES) -> tuple[MsgType, dict[str, Any]]:
    """Reads one length-prefixed control frame and decodes it (exactly its bytes, nothing past it).

    Raises `MalformedMessage` for a bad frame (the stream is then out of sync
    and must be closed), `ConnectionError` when the peer closed, and
    `TimeoutError` (socket.timeout) when the socket's timeout passes.
    """
    head = bytearray(_LEN.size)
    recv_exact(sock, memoryview(head))
    length = frame_length(head, max_bytes)
    body = bytearray(length)
    recv_exact(sock, memoryview(body))
    return decode(body)


def frame_length(head: bytes | bytearray, max_bytes: int = MAX_CONTROL_BYTES) -> int:
    """The body length a 4-byte frame head announces; MalformedMessage when out of range."""
    (length,) = _LEN.unpack(head)
    if length == 0 or length > max_bytes:
        raise MalformedMessage(f"frame length {length} out of range")
    return length


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    """Fills `view` completely from `sock` (recv_into, no intermediate copy)."""
    got, n = 0, len(view)
    try:
        while got < n:
            r = sock.recv_into(view[got:], n - got) if got else sock.recv_into(view, n)
            if r == 0:
                raise ConnectionError("peer closed the stream")
            got += r
    except BlockingIOError:
        raise TimeoutError("receive timed out") from None


def recv_scatter(sock: socket.socket, views: list[memoryview], spin_until: float = 0.0):
    """Fills byte `views` in order with scatter reads (`recvmsg_into`: many pages per
    syscall, straight into their memory). For every piece that lands it yields
    ``(index, offset, count, rest)``: `count` new bytes at `offset` of ``views[index]``
    (complete when ``offset + count == len(view)``) and `rest`, the bytes the same read
    put past that piece; so a caller can hash a page as its bytes arrive, and tell what
    followed a frame. Until the `time.perf_counter()` value `spin_until`, reads do not sleep:
    an empty socket is polled again at once (the thread stays on its core and copies bytes
    as they arrive); after it, reads block as usual."""
    i, off, n = 0, 0, len(views)
    try:
        while i < n:
            batch = [views[i][off:] if off else views[i]] + views[i + 1 : i + 64]
            if spin_until:
                try:
                    got = sock.recvmsg_into(batch, 0, socket.MSG_DONTWAIT)[0]
                except BlockingIOError:
                    if time.perf_counter() >= spin_until:
                        spin_until = 0.0
                    continue
            else:
                got = sock.recvmsg_into(batch)[0]
            if got == 0:
                raise ConnectionError("peer closed the stream")
            while got > 0:
                take = min(got, len(views[i]) - off)
                got -= take
                yield i, off, take, got
                off += take
                if off == len(views[i]):
                    i, off = i + 1, 0
    except BlockingIOError:
        raise TimeoutError("receive timed out") from None


def sendmsg_all(sock: socket.socket, buffers: list) -> None:
    """Sends every buffer in order, zero-copy (scatter/gather `sendmsg`): one syscall on a
    blocking socket. Buffers hold bytes (bytes, byte memoryviews, uint8 rows: len == nbytes)."""
    views, i = buffers, 0
    try:
        while i < len(views):
            sent = sock.sendmsg(views[i : i + 512] if i or len(views) > 512 else views)  # stay under IOV_MAX
            # skip whole buffers that went out, trim a partially sent one
            while sent > 0 and i < len(views):
                n = len(views[i])
                if sent >= n:
                    sent -= n
                    i += 1
                else:
                    if views is buffers:
                        views = list(buffers)  # (the caller's list stays as it was)
                    views[i] = memoryview(views[i]).cast("B")[sent:]
                    sent = 0
    except BlockingIOError:
        raise TimeoutError("send timed out") from None


def close_quietly(sock: socket.socket) -> None:
    """Shut a stream socket down and close it; a peer that is already gone is fine."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    try:
        sock.close()
    except OSError:
        pass
