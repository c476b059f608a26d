"""The messages of a gang's rank agents: rank 0's commands to its ranks (over a local ZMQ socket)
and a D rank's slice pulls to a P rank (over the P rank's own data socket).

Every message is a msgpack map `{"v": AGENT_VERSION, "t": <type>, ...fields}`, checked field by
field against `SCHEMA` before anything reads it (`decode` raises `MalformedMessage`); nothing is
unpickled, extension types are refused and sizes capped, as on the connector's own wire. Page
bytes travel as a separate ZMQ frame after a `sliced` answer, never inside msgpack.

Commands (rank 0 -> agent, each answered by `ok`/`loaded` or `err` with the same `id`):
`grant` lets a P agent serve a ticket's blocks, `revoke` ends that, `load` makes a D agent pull
its heads of a load from the P ranks named, `digests` asks for checksums of pool pages, `stop`
ends the agent. Data: `slice` (D agent -> P agent) names a ticket, blocks and a head run; the
answer is `sliced` (per-block checksums of the packed heads, and the bytes when asked) or `err`.
"""
from __future__ import annotations

from typing import Any

import msgpack

from connectors.zmq.control.wire import MalformedMessage

AGENT_VERSION = 1
MAX_MESSAGE_BYTES = 4 * 1024 * 1024

_ANY_LIST = list
_SOURCE_FIELDS = {"rank": int, "tcp": str, "shm": str, "shm_bytes": int, "page_bytes": int, "first": int,
                  "count": int}
SCHEMA: dict[str, dict[str, Any]] = {
    # agent -> rank 0 (its first message): where it serves and what it holds
    "register": {"rank": int, "tcp": str, "shm": str, "shm_bytes": int, "page_bytes": int, "num_blocks": int,
                 "first": int, "count": int},
    "grant": {"id": int, "ticket": bytes, "block_ids": list, "ttl_s": float},
    "revoke": {"id": int, "ticket": bytes},
    "load": {"id": int, "ticket": bytes, "path": str, "sources": list, "src": list, "dst": list,
             "timeout_s": float},
    "digests": {"id": int, "block_ids": list},
    "stop": {"id": int},
    "ok": {"id": int},
    "loaded": {"id": int, "ok": bool, "bad": list, "cause": str, "bytes": int, "by_source": list,
               "seconds": float},
    "err": {"id": int, "reason": str},
    # D agent -> P agent, and its answer
    "slice": {"id": int, "ticket": bytes, "block_ids": list, "first": int, "count": int, "send": bool},
    "sliced": {"id": int, "digests": list},
}
_INT_LISTS = {"block_ids", "src", "dst", "bad", "digests"}


def encode(msg_type: str, **fields: Any) -> bytes:
    _check(msg_type, fields)
    return msgpack.packb({"v": AGENT_VERSION, "t": msg_type, **fields}, use_bin_type=True)


def decode(data: bytes | memoryview) -> tuple[str, dict[str, Any]]:
    """One agent message, checked, or `MalformedMessage`."""
    if len(data) > MAX_MESSAGE_BYTES:
        raise MalformedMessage(f"agent message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=True, ext_hook=_refuse_ext,
                              max_bin_len=MAX_MESSAGE_BYTES, max_str_len=1 << 16, max_array_len=1 << 20,
                              max_map_len=64)
    except Exception as e:  # noqa: BLE001 -- msgpack raises several unrelated types on garbage
        raise MalformedMessage(f"not msgpack: {type(e).__name__}: {e}") from None
    if not isinstance(obj, dict) or obj.get("v") != AGENT_VERSION:
        raise MalformedMessage("not an agent message of this version")
    t = obj.get("t")
    if not isinstance(t, str) or t not in SCHEMA:
        raise MalformedMessage(f"unknown agent message type {t!r}")
    _check(t, obj)
    return t, obj


def sources_of(msg: dict) -> list[dict]:
    """A `load`'s P ranks, each checked (`_SOURCE_FIELDS`)."""
    out = []
    for s in msg["sources"]:
        if not isinstance(s, dict):
            raise MalformedMessage("load: a source is not a map")
        _check_fields("load source", s, _SOURCE_FIELDS)
        out.append(s)
    return out


def _refuse_ext(code: int, data: bytes) -> Any:
    raise MalformedMessage(f"msgpack extension type {code} is not allowed")


def _check(msg_type: str, fields: dict[str, Any]) -> None:
    if msg_type not in SCHEMA:
        raise MalformedMessage(f"unknown agent message type {msg_type!r}")
    _check_fields(msg_type, fields, SCHEMA[msg_type])


def _check_fields(what: str, fields: dict[str, Any], schema: dict[str, Any]) -> None:
    for name, kind in schema.items():
        value = fields.get(name)
        if kind is int:
            ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
        elif kind is float:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0
        elif name == "by_source":  # [[P rank, bytes], ...]
            ok = isinstance(value, list) and all(
                isinstance(x, list) and len(x) == 2 and all(type(v) is int and v >= 0 for v in x) for x in value)
        elif kind is list and name in _INT_LISTS:
            ok = isinstance(value, list) and all(type(x) is int and x >= 0 for x in value)
        else:
            ok = isinstance(value, kind)
        if not ok:
            raise MalformedMessage(f"{what}: missing or wrong field {name!r}")
