"""Session keys and MACs: what binds every message after a handshake to that handshake.

Both sides derive the session key from the deployment secret and the handshake
transcript (protocol version, both nonces, the compatibility hash, both engine
ids; see `handshake.transcript`)::

    key = HMAC-SHA256(secret, "pdkv session key" | transcript)

The key never travels. The WELCOME names a session id (a public handle, not a
credential) with ``mac = HMAC(key, "welcome" | session id)``. Afterwards:

- side channel (HEARTBEAT, DONE): ``seq`` strictly increases per session and
  ``mac = HMAC(key, type | session id | seq | request ids)``; the producer
  accepts a message only from the ZMQ identity that authenticated the session
  and only with a seq above the last one it accepted, so a captured frame,
  replayed from anywhere, does nothing;
- data streams: the producer opens every accepted connection with a fresh
  NONCE; the ATTACH answers ``mac = HMAC(key, "attach" | session id | nonce |
  data path | checked)``. The connection then belongs to the session (its PULLs are served
  only while the session lives); a captured ATTACH is worthless on any other
  connection, whose nonce differs.

Producer sessions end when idle for `idle_s` (consumers send keep-alive
heartbeats) and, past `max_sessions`, the least recently used goes first.
"""
from __future__ import annotations

import dataclasses
import hashlib
import hmac
import secrets
import struct
import threading
import time

from connectors.zmq.control import wire
from connectors.zmq.control.wire import MsgType

_KEY_LABEL = b"pdkv session key"


class SessionRefused(Exception):
    """A post-handshake message that does not belong to a live session; `reason` names why
    (a `handshake.RefuseReason` value: session, identity, replay or auth)."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


def derive_key(secret: bytes, transcript: bytes) -> bytes:
    return hmac.new(secret, _KEY_LABEL + b"\x00" + transcript, hashlib.sha256).digest()


def _mac(key: bytes, *parts: bytes) -> bytes:
    h = hmac.new(key, digestmod=hashlib.sha256)
    for p in parts:  # length-prefixed: no two part lists give the same bytes
        h.update(len(p).to_bytes(4, "big"))
        h.update(p)
    return h.digest()


def welcome_mac(key: bytes, session_id: bytes) -> bytes:
    return _mac(key, b"welcome", session_id)


def side_mac(key: bytes, msg_type: MsgType, session_id: bytes, seq: int, request_ids: list[str]) -> bytes:
    return _mac(key, msg_type.value.encode(), session_id, seq.to_bytes(8, "big"), *(r.encode() for r in request_ids))


def published_mac(key: bytes, session_id: bytes, msg: dict) -> bytes:
    """The MAC of a PUBLISHED (producer -> consumer): every field but the MAC itself."""
    lists = (struct.pack(f">{len(msg[k])}Q", *msg[k]) for k in ("groups", "positions", "block_ids", "digests"))
    return _mac(key, b"published", session_id, msg["seq"].to_bytes(8, "big"), msg["request_id"].encode(),
                bytes([msg["final"], msg["ok"]]), *lists)


def attach_mac(key: bytes, session_id: bytes, nonce: bytes, mode: str, checksums: bool = False) -> bytes:
    """An ATTACH's MAC: over the connection's nonce, the data path it names and whether the
    consumer checks device pages (so neither can be changed on the way)."""
    return _mac(key, b"attach", session_id, nonce, mode.encode(), b"checked" if checksums else b"unchecked")


class ClientSession:
    """The consumer's half of one session: signs its side-channel messages (control thread
    only: the counter is not locked) and its ATTACHes (any thread)."""

    def __init__(self, session_id: bytes, key: bytes):
        self.session_id = session_id
        self._key = key
        self._seq = 0
        self._peer_seq = 0  # the last PUBLISHED counter accepted from the producer

    def check_published(self, msg: dict) -> None:
        """A PUBLISHED from this session's producer: its MAC and a counter above the last one
        (control thread only); raises `wire.MalformedMessage` otherwise."""
        if msg["session"] != self.session_id or msg["seq"] <= self._peer_seq or len(
                {len(msg[k]) for k in ("groups", "positions", "block_ids", "digests")}) != 1:
            raise wire.MalformedMessage("published: other session, replayed, or lists of unequal length")
        if any(x >= 1 << 64 for k in ("block_ids", "digests") for x in msg[k]):
            raise wire.MalformedMessage("published: a value past uint64")
        if not hmac.compare_digest(published_mac(self._key, self.session_id, msg), msg["mac"]):
            raise wire.MalformedMessage("published with a wrong MAC")
        self._peer_seq = msg["seq"]

    def side_message(self, msg_type: MsgType, request_ids: list[str]) -> bytes:
        self._seq += 1
        mac = side_mac(self._key, msg_type, self.session_id, self._seq, request_ids)
        return wire.encode(msg_type, session=self.session_id, seq=self._seq, mac=mac, request_ids=request_ids)

    def attach_message(self, nonce: bytes, mode: str, checksums: bool = False) -> bytes:
        return wire.encode(MsgType.ATTACH, session=self.session_id, mode=mode, checksums=checksums,
                           mac=attach_mac(self._key, self.session_id, nonce, mode, checksums))


@dataclasses.dataclass(eq=False)
class ProducerSession:
    session_id: bytes
    key: bytes
    ident: bytes  # the ZMQ identity that authenticated it
    peer_engine_id: str
    last_used: float
    last_seq: int = 0
    closed: bool = False  # expired or evicted: its data streams stop serving
    out_seq: int = 0  # PUBLISHED counter (the producer's side-channel thread only)

    def published_message(self, fields: dict) -> bytes:
        """A signed PUBLISHED (`wire.SCHEMA` fields but session, seq and mac)."""
        self.out_seq += 1
        msg = {**fields, "session": self.session_id, "seq": self.out_seq}
        return wire.encode(MsgType.PUBLISHED, **msg, mac=published_mac(self.key, self.session_id, msg))


class SessionTable:
    """The producer's live sessions (thread-safe). Every check raises `SessionRefused`."""

    def __init__(self, max_sessions: int = 1024, idle_s: float = 300.0):
        if max_sessions < 1 or idle_s <= 0:
            raise ValueError("max_sessions must be >= 1 and idle_s positive")
        self.max_sessions, self.idle_s = max_sessions, idle_s
        self._lock = threading.Lock()
        self._sessions: dict[bytes, ProducerSession] = {}

    def __len__(self) -> int:
        return len(self._sessions)

    def open(self, key: bytes, ident: bytes, peer_engine_id: str) -> ProducerSession:
        """A new session after a completed handshake; the least recently used one makes room."""
        session = ProducerSession(secrets.token_bytes(16), key, ident, peer_engine_id, time.monotonic())
        with self._lock:
            while len(self._sessions) >= self.max_sessions:
                self._close_locked(min(self._sessions.values(), key=lambda s: s.last_used))
            self._sessions[session.session_id] = session
        return session

    def check_side(self, ident: bytes, msg_type: MsgType, msg: dict) -> ProducerSession:
        """A HEARTBEAT or DONE: known session, valid MAC, the authenticating identity, fresh seq."""
        with self._lock:
            session = self._sessions.get(msg["session"])
            if session is None:
                raise SessionRefused("session", "no such session (unknown or expired)")
            want = side_mac(session.key, msg_type, session.session_id, msg["seq"], msg["request_ids"])
            if not hmac.compare_digest(want, msg["mac"]):
                raise SessionRefused("auth", f"{msg_type.value} with a wrong MAC")
            if ident != session.ident:
                raise SessionRefused("identity", f"{msg_type.value} from another ZMQ identity than the session's")
            if msg["seq"] <= session.last_seq:
                raise SessionRefused("replay", f"{msg_type.value} replayed (seq not above the last one)")
            session.last_seq = msg["seq"]
            session.last_used = time.monotonic()
            return session

    def check_attach(self, msg: dict, nonce: bytes) -> ProducerSession:
        """An ATTACH answering this connection's `nonce` with the session's MAC."""
        with self._lock:
            session = self._sessions.get(msg["session"])
            if session is None:
                raise SessionRefused("session", "data stream for no session (unknown or expired)")
            if not hmac.compare_digest(attach_mac(session.key, session.session_id, nonce, msg["mode"],
                                                  msg.get("checksums") is True), msg["mac"]):
                raise SessionRefused("replay", "ATTACH not made for this connection's nonce")
            session.last_used = time.monotonic()
            return session

    def expire(self) -> int:
        """Ends sessions idle longer than `idle_s`; returns how many."""
        cutoff = time.monotonic() - self.idle_s
        with self._lock:
            idle = [s for s in self._sessions.values() if s.last_used < cutoff]
            for session in idle:
                self._close_locked(session)
        return len(idle)

    def _close_locked(self, session: ProducerSession) -> None:
        session.closed = True
        del self._sessions[session.session_id]
