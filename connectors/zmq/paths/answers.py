"""Reading the producer's answer to a PULL on a data stream, for every path: a whole frame of
an expected type (`expect`), or a PAGES header read in the same scatter read as the first pages
(`pages_header`, tcp and shm_mapped). An ERROR for the pull raises `Refused`; anything else
unexpected raises `MalformedMessage` (the stream breaks)."""
from __future__ import annotations

import socket

from connectors.zmq.control import framing, wire
from connectors.zmq.control.wire import MalformedMessage, MsgType
from connectors.zmq.paths.base import PullPart, Refused


def expect(conn: socket.socket, want: MsgType, xfer: int) -> dict:
    """The next frame, which must be `want` for transfer `xfer`."""
    msg_type, msg = framing.recv_frame(conn)
    if msg_type is MsgType.ERROR and msg["xfer"] == xfer:
        raise Refused(msg["reason"])
    if msg_type is not want or msg["xfer"] != xfer:
        raise MalformedMessage(f"expected {want.value} for transfer {xfer}, got {msg_type.value}")
    return msg


def pages_header(conn: socket.socket, part: PullPart, page_bytes: int, head: bytearray, have: int, views: list,
                 rest: int) -> list[int] | None:
    """The digests once `head` holds the whole PAGES frame (`have` bytes so far; `views` and
    `rest` are the scatter read's). Any other frame (a refusal, a broken peer) is read whole and
    raised as such."""
    if have >= 4 and int.from_bytes(head[:4], "big") != len(head) - 4:
        _not_pages(conn, part, head, have, views, rest)
    if have < len(head):
        return None
    if part.expect:  # one page: check the exact bytes we expect, no decode
        digests = wire.pages_digests(head, part.expect)
        if digests is not None:
            return digests
    msg_type, msg = wire.decode(memoryview(head)[4:])
    if msg_type is MsgType.PAGES and msg["xfer"] == part.xfer:
        if len(msg["digests"]) != len(part.dst_block_ids) or msg["page_bytes"] != page_bytes:
            raise MalformedMessage("pages header does not match the pull")
        return msg["digests"]
    if msg_type is MsgType.ERROR and msg["xfer"] == part.xfer and not rest:
        raise Refused(msg["reason"])
    raise MalformedMessage(f"expected pages for transfer {part.xfer}, got {msg_type.value}")


def _not_pages(conn: socket.socket, part: PullPart, head: bytearray, have: int, views: list, rest: int) -> None:
    length = framing.frame_length(head[:4])
    frame = bytearray(head[4:have])
    for v in views[1:]:  # what the same read put past `head` (into the first pages)
        if rest <= 0:
            break
        frame += v[: min(rest, len(v))]
        rest -= len(v)
    if len(frame) > length:  # more than that frame came: out of sync
        raise MalformedMessage("bytes after a frame")
    more = bytearray(length - len(frame))
    framing.recv_exact(conn, memoryview(more))
    msg_type, msg = wire.decode(frame + more)
    if msg_type is MsgType.ERROR and msg["xfer"] == part.xfer:
        raise Refused(msg["reason"])
    raise MalformedMessage(f"expected pages for transfer {part.xfer}, got {msg_type.value} ({length} bytes)")
