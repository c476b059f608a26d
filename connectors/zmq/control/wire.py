"""Versioned msgpack control messages (their byte framing on data streams: `framing.py`).

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
like any other, and a PAGES frame's size follows from its page count.
"""
from __future__ import annotations

import enum
import struct
from typing import Any

import msgpack

PROTOCOL_VERSION = 4  # 2: PULL and PAGES frames in a fixed shape; 3: session keys and MACs (session.py);
# 4: ATTACH names the data path (tcp, shm_mapped, shm_staged, cuda_ipc) and whether device pages are checked
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
    WATCH = "watch"  # consumer: send me what you publish for these (streamed) requests
    PUBLISHED = "published"  # producer: these blocks of a streamed request are complete (stream.py)
    # data streams (sockets)
    NONCE = "nonce"  # the producer's first frame on every data connection
    ATTACH = "attach"
    ATTACHED = "attached"
    PULL = "pull"
    PAGES = "pages"
    CHUNK = "chunk"
    CREDIT = "credit"
    ERROR = "error"
    TICKET = "ticket"  # gang path (either side TP > 1): the P ranks serve this pull's heads for it


_TYPES = {t.value: t for t in MsgType}  # a dict lookup: cheaper than calling the enum


class _IntList:
    """Schema marker: a list of non-negative ints."""


class _StrList:
    """Schema marker: a list of str."""


INT_LIST = _IntList()
STR_LIST = _StrList()

# Required fields per message type; extra fields are ignored (forward compatible). Optional: PULL's
# "tc", the consumer's trace context (a str; `connectors.params.valid_trace_context` judges it);
# ATTACH's "checksums" (True: the consumer checks cuda_ipc pages, under the ATTACH's MAC); ATTACHED's
# "unavailable" (why the producer cannot serve the path asked for) and "ipc" (cuda_ipc's pool export).
SCHEMA: dict[MsgType, dict[str, Any]] = {
    MsgType.HELLO: {"engine_id": str, "expect_engine_id": str, "compat": str, "nonce": bytes},
    MsgType.CHALLENGE: {"engine_id": str, "nonce": bytes, "proof": bytes},
    MsgType.AUTH: {"proof": bytes},
    MsgType.WELCOME: {"session": bytes, "mac": bytes, "data_port": int, "host_id": str, "shm": bool},
    MsgType.REFUSE: {"reason": str, "detail": str},
    MsgType.HEARTBEAT: {"session": bytes, "seq": int, "mac": bytes, "request_ids": STR_LIST},
    MsgType.DONE: {"session": bytes, "seq": int, "mac": bytes, "request_ids": STR_LIST},
    MsgType.WATCH: {"session": bytes, "seq": int, "mac": bytes, "request_ids": STR_LIST},
    MsgType.PUBLISHED: {"session": bytes, "seq": int, "mac": bytes, "request_id": str, "groups": INT_LIST,
                        "positions": INT_LIST, "block_ids": INT_LIST, "digests": INT_LIST, "final": bool, "ok": bool},
    MsgType.NONCE: {"nonce": bytes},
    MsgType.ATTACH: {"session": bytes, "mode": str, "mac": bytes},
    MsgType.ATTACHED: {"shm_name": str, "shm_bytes": int, "chunk_pages": int},
    MsgType.PULL: {"xfer": int, "request_id": str, "block_ids": INT_LIST},
    MsgType.PAGES: {"xfer": int, "digests": INT_LIST, "page_bytes": int},
    MsgType.CHUNK: {"xfer": int, "half": int, "digests": INT_LIST},
    MsgType.CREDIT: {"half": int},
    MsgType.ERROR: {"xfer": int, "reason": str},
    MsgType.TICKET: {"xfer": int, "ticket": bytes},
}


def encode(msg_type: MsgType, **fields: Any) -> bytes:
    """Encodes one control message; fields are checked against the schema."""
    _check_fields(msg_type, fields)
    return msgpack.packb({"v": PROTOCOL_VERSION, "t": msg_type.value, **fields}, use_bin_type=True)


def decode(data: bytes | bytearray | memoryview) -> tuple[MsgType, dict[str, Any]]:
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
    except Exception as e:  # noqa: BLE001 -- msgpack raises several unrelated types on garbage
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
_PULL_HEAD_TC = b"\x86" + _PULL_HEAD[1:]  # the same with a sixth entry, "tc", at the end
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


def pull_frame(xfer: int, request_id: str, block_ids: list[int], trace_context: str | None = None) -> bytes:
    """{"v", "t": "pull", "xfer", "request_id", "block_ids"[, "tc"]}, framed; block ids are uint64.
    `tc`: the consumer's trace context, opaque here (at most 255 bytes; the producer validates it)."""
    rid = request_id.encode()
    tc = trace_context.encode() if trace_context else b""
    if len(rid) > 0xFFFF or len(tc) > 0xFF:  # no str16 / str8: plain msgpack (refused or ignored anyway)
        fields = {"v": PROTOCOL_VERSION, "t": "pull", "xfer": xfer, "request_id": request_id, "block_ids": block_ids}
        body = msgpack.packb({**fields, "tc": trace_context} if tc else fields)
    else:
        body = b"".join((_PULL_HEAD_TC if tc else _PULL_HEAD, xfer.to_bytes(8, "big"), b"\xaarequest_id\xda",
                         len(rid).to_bytes(2, "big"), rid, b"\xa9block_ids\xdd", len(block_ids).to_bytes(4, "big"),
                         _u64_items(block_ids), b"\xa2tc\xd9" + bytes([len(tc)]) + tc if tc else b""))
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
