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
"""
from __future__ import annotations

import enum
import socket
import struct
from typing import Any

import msgpack

PROTOCOL_VERSION = 1
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
    try:
        msg_type = MsgType(obj.get("t"))
    except ValueError:
        raise MalformedMessage(f"unknown message type {obj.get('t')!r}") from None
    _check_fields(msg_type, obj)
    return msg_type, obj


def _refuse_ext(code: int, data: bytes) -> Any:
    raise MalformedMessage(f"msgpack extension type {code} is not allowed")


def _check_fields(msg_type: MsgType, fields: dict[str, Any]) -> None:
    for name, kind in SCHEMA[msg_type].items():
        if name not in fields:
            raise MalformedMessage(f"{msg_type.value}: missing field {name!r}")
        value = fields[name]
        if kind is INT_LIST:
            ok = isinstance(value, list) and all(type(x) is int and x >= 0 for x in value)
        elif kind is STR_LIST:
            ok = isinstance(value, list) and all(isinstance(x, str) for x in value)
        elif kind is int:
            ok = type(value) is int  # bool is not an int here
        else:
            ok = isinstance(value, kind)
        if not ok:
            raise MalformedMessage(f"{msg_type.value}: field {name!r} has the wrong type")


# ----------------------------------------------------------------------------- stream framing


def send_frame(sock: socket.socket, payload: bytes) -> None:
    """One length-prefixed control frame (a single syscall for small frames)."""
    sock.sendall(_LEN.pack(len(payload)) + payload)


def recv_frame(sock: socket.socket, max_bytes: int = MAX_CONTROL_BYTES) -> tuple[MsgType, dict[str, Any]]:
    """Reads one length-prefixed control frame and decodes it.

    Raises `MalformedMessage` for a bad frame (the stream is then out of sync
    and must be closed), `ConnectionError` when the peer closed, and
    `TimeoutError` (socket.timeout) when the socket's timeout passes.
    """
    head = bytearray(_LEN.size)
    recv_exact(sock, memoryview(head))
    (length,) = _LEN.unpack(head)
    if length == 0 or length > max_bytes:
        raise MalformedMessage(f"frame length {length} out of range")
    body = bytearray(length)
    recv_exact(sock, memoryview(body))
    return decode(body)


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    """Fills `view` completely from `sock` (recv_into, no intermediate copy)."""
    got, n = 0, len(view)
    while got < n:
        r = sock.recv_into(view[got:], n - got)
        if r == 0:
            raise ConnectionError("peer closed the stream")
        got += r


def recv_scatter(sock: socket.socket, views: list[memoryview]):
    """Fills `views` in order with scatter reads (`recvmsg_into`: many pages per syscall,
    straight into their memory); yields each view as soon as it is complete."""
    i, off, n = 0, 0, len(views)
    while i < n:
        batch = [views[i][off:]] + views[i + 1 : i + 64]
        got = sock.recvmsg_into(batch)[0]
        if got == 0:
            raise ConnectionError("peer closed the stream")
        while got > 0:
            rest = len(views[i]) - off
            if got < rest:
                off += got
                break
            got -= rest
            yield views[i]
            i, off = i + 1, 0


def sendmsg_all(sock: socket.socket, buffers: list) -> None:
    """Sends every buffer in order, zero-copy (scatter/gather `sendmsg`)."""
    views = [memoryview(b).cast("B") for b in buffers]
    i = 0
    while i < len(views):
        batch = views[i : i + 512]  # stay under IOV_MAX
        sent = sock.sendmsg(batch)
        # skip whole buffers that went out, trim a partially sent one
        while sent > 0 and i < len(views):
            n = len(views[i])
            if sent >= n:
                sent -= n
                i += 1
            else:
                views[i] = views[i][sent:]
                sent = 0


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
