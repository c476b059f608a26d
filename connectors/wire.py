"""Versioned msgpack control messages and the byte framing of data streams.

Every control message is a msgpack map ``{"v": PROTOCOL_VERSION, "t": <type>,
...fields}``. `decode` checks the version, the type and the type of every
required field before anything else looks at the message; whatever fails is
raised as `MalformedMessage` so callers can drop it and count it. Nothing is
ever unpickled: msgpack is decoded with `raw=False`, `strict_map_key=True`,
extension types refused and sizes capped.

Data streams (plain sockets) carry length-prefixed frames: 4 bytes big-endian
length, then a msgpack control message. Page bytes follow a ``pages`` header
as raw bytes, in the order the header names, so the receiver can land them
with `recv_into` straight into their destination memory.

The two frames on a transfer's latency path, PULL and PAGES, are written in
one fixed shape (`pull_frame`, `pages_frame`): msgpack that `decode` checks
like any other, and a PAGES frame's size follows from its page count. Data
sockets wait in the kernel (`kernel_timeouts`: SO_RCVTIMEO / SO_SNDTIMEO), so
a read or a send is one syscall, not a poll and then the call; a wait that
runs out surfaces as `TimeoutError` from the helpers here.
"""
from __future__ import annotations

import enum
import socket
import struct
import time
from typing import Any

import msgpack

PROTOCOL_VERSION = 2  # 2: PULL and PAGES frames in a fixed shape (see pages_frame)
MAX_CONTROL_BYTES = 4 * 1024 * 1024  # a pull of ~200k block ids still fits
MAX_LIST_LEN = 1 << 20
_LEN = struct.Struct(">I")


class MalformedMessage(ValueError):
    """A frame that is not a well-formed message of this protocol version."""


class MsgType(str, enum.Enum):
    # side channel (ZMQ): handshake and lease traffic
    HELLO = "hello"
    CHALLENGE = "challenge"
    AUTH = "auth"
    WELCOME = "welcome"
    REFUSE = "refuse"
    HEARTBEAT = "heartbeat"
    DONE = "done"
    # data streams (sockets)
    ATTACH = "attach"
    ATTACHED = "attached"
    PULL = "pull"
    PAGES = "pages"
    CHUNK = "chunk"
    CREDIT = "credit"
    ERROR = "error"


_TYPES = {t.value: t for t in MsgType}  # a dict lookup: cheaper than calling the enum


class _IntList:
    """Schema marker: a list of non-negative ints."""


class _StrList:
    """Schema marker: a list of str."""


INT_LIST = _IntList()
STR_LIST = _StrList()

# Required fields per message type; extra fields are ignored (forward compatible).
SCHEMA: dict[MsgType, dict[str, Any]] = {
    MsgType.HELLO: {"engine_id": str, "expect_engine_id": str, "compat": str, "nonce": bytes},
    MsgType.CHALLENGE: {"engine_id": str, "nonce": bytes, "proof": bytes},
    MsgType.AUTH: {"proof": bytes},
    MsgType.WELCOME: {"session": bytes, "data_port": int, "host_id": str, "shm": bool},
    MsgType.REFUSE: {"reason": str, "detail": str},
    MsgType.HEARTBEAT: {"session": bytes, "request_ids": STR_LIST},
    MsgType.DONE: {"session": bytes, "request_ids": STR_LIST},
    MsgType.ATTACH: {"session": bytes, "mode": str},
    MsgType.ATTACHED: {"shm_name": str, "shm_bytes": int, "chunk_pages": int},
    MsgType.PULL: {"xfer": int, "request_id": str, "block_ids": INT_LIST},
    MsgType.PAGES: {"xfer": int, "digests": INT_LIST, "page_bytes": int},
    MsgType.CHUNK: {"xfer": int, "half": int, "digests": INT_LIST},
    MsgType.CREDIT: {"half": int},
    MsgType.ERROR: {"xfer": int, "reason": str},
}


def encode(msg_type: MsgType, **fields: Any) -> bytes:
    """Encodes one control message; fields are checked against the schema."""
    _check_fields(msg_type, fields)
    return msgpack.packb({"v": PROTOCOL_VERSION, "t": msg_type.value, **fields}, use_bin_type=True)


def decode(data: bytes | memoryview) -> tuple[MsgType, dict[str, Any]]:
    """Decodes one control message or raises `MalformedMessage`."""
    if len(data) > MAX_CONTROL_BYTES:
        raise MalformedMessage(f"control message of {len(data)} bytes exceeds {MAX_CONTROL_BYTES}")
    try:
        obj = msgpack.unpackb(
            data, raw=False, strict_map_key=True, ext_hook=_refuse_ext,
            max_bin_len=MAX_CONTROL_BYTES, max_str_len=1 << 16,
            max_array_len=MAX_LIST_LEN, max_map_len=64,
        )
    except MalformedMessage:
        raise
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise MalformedMessage(f"not msgpack: {type(e).__name__}: {e}") from None
    if not isinstance(obj, dict):
        raise MalformedMessage(f"expected a map, got {type(obj).__name__}")
    version = obj.get("v")
    if version != PROTOCOL_VERSION:
        raise MalformedMessage(f"protocol version {version!r} != {PROTOCOL_VERSION}")
    t = obj.get("t")
    msg_type = _TYPES.get(t) if type(t) is str else None
    if msg_type is None:
        raise MalformedMessage(f"unknown message type {t!r}")
    _check_fields(msg_type, obj)
    return msg_type, obj


def _refuse_ext(code: int, data: bytes) -> Any:
    raise MalformedMessage(f"msgpack extension type {code} is not allowed")


_FIELDS = {t.value: tuple(fields.items()) for t, fields in SCHEMA.items()}  # by value: enum hashing is slow
_MISSING = object()


def _check_fields(msg_type: MsgType, fields: dict[str, Any]) -> None:
    for name, kind in _FIELDS[msg_type._value_]:  # plain loops: this runs on every frame of a transfer
        value = fields.get(name, _MISSING)
        if kind is int:
            ok = type(value) is int  # bool is not an int here
        elif kind is INT_LIST or kind is STR_LIST:
            ok = isinstance(value, list)
            if ok and kind is INT_LIST:
                for x in value:
                    if type(x) is not int or x < 0:
                        ok = False
                        break
            elif ok:
                for x in value:
                    if not isinstance(x, str):
                        ok = False
                        break
        else:
            ok = isinstance(value, kind)
        if not ok:
            what = "missing field" if value is _MISSING else "wrong type in field"
            raise MalformedMessage(f"{msg_type.value}: {what} {name!r}")


# ----------------------------------------------------------------------------- hot-path frames
# PULL and PAGES, the two frames on a transfer's latency path, are written directly (no schema
# pass: the values are the writer's own, already checked) in one fixed shape: ints as uint64, the
# request id as str16, lists as array32. Still msgpack that `decode` checks in full; and a PAGES
# frame's size follows from its page count, so the consumer reads it with one recv.
_V = bytes([PROTOCOL_VERSION])  # a positive fixint
_PULL_HEAD = b"\x85\xa1v" + _V + b"\xa1t\xa4pull\xa4xfer\xcf"
_PAGES_HEAD = b"\x85\xa1v" + _V + b"\xa1t\xa5pages\xa4xfer\xcf"
_PAGES_FIXED = len(_PAGES_HEAD) + 8 + 12 + 8 + 9 + 4  # + "page_bytes" u64, "digests" array32 header


def pages_frame_size(num_pages: int) -> int:
    """Bytes of a PAGES frame for `num_pages` pages, length prefix included."""
    return 4 + _PAGES_FIXED + 9 * num_pages


def pages_frame(xfer: int, digests: list[int], page_bytes: int) -> bytes:
    """{"v", "t": "pages", "xfer", "page_bytes", "digests"}, framed, in the fixed shape."""
    return pages_prefix(xfer, len(digests), page_bytes) + _u64_items(digests)


def pages_prefix(xfer: int, num_pages: int, page_bytes: int) -> bytes:
    """A PAGES frame up to its digests: all a receiver that knows the pull can expect."""
    return b"".join((_LEN.pack(_PAGES_FIXED + 9 * num_pages), _PAGES_HEAD, xfer.to_bytes(8, "big"),
                     b"\xaapage_bytes\xcf", page_bytes.to_bytes(8, "big"), b"\xa7digests\xdd",
                     num_pages.to_bytes(4, "big")))


def pages_digests(frame: bytes | bytearray, prefix: bytes) -> list[int] | None:
    """The digest of a one-page `frame` that is exactly `prefix` (see `pages_prefix`) and a
    uint64: then it is, byte for byte, the PAGES frame `decode` would accept, and no decode is
    needed. None for anything else, and for several pages (`decode` those)."""
    at = len(prefix)
    if len(frame) != at + 9 or frame[at] != 0xCF or not frame.startswith(prefix):
        return None
    return [int.from_bytes(frame[at + 1 :], "big")]


def pull_frame(xfer: int, request_id: str, block_ids: list[int]) -> bytes:
    """{"v", "t": "pull", "xfer", "request_id", "block_ids"}, framed; block ids are uint64."""
    rid = request_id.encode()
    if len(rid) > 0xFFFF:  # no str16: plain msgpack (the producer refuses ids this long anyway)
        body = msgpack.packb({"v": PROTOCOL_VERSION, "t": "pull", "xfer": xfer, "request_id": request_id,
                              "block_ids": block_ids})
    else:
        body = b"".join((_PULL_HEAD, xfer.to_bytes(8, "big"), b"\xaarequest_id\xda", len(rid).to_bytes(2, "big"), rid,
                         b"\xa9block_ids\xdd", len(block_ids).to_bytes(4, "big"), _u64_items(block_ids)))
    return _LEN.pack(len(body)) + body


def _u64_items(values: list[int]) -> bytes:
    """msgpack uint64 items (0xcf, then 8 bytes big-endian) of ints in [0, 2**64)."""
    n = len(values)
    if n == 1:
        return b"\xcf" + values[0].to_bytes(8, "big")
    items = bytearray(9 * n)
    items[0::9] = b"\xcf" * n
    packed = struct.pack(f">{n}Q", *values)
    for k in range(8):
        items[k + 1 :: 9] = packed[k::8]
    return bytes(items)


# ----------------------------------------------------------------------------- stream framing


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
                    body = self._view[start + 4 : start + need]
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
