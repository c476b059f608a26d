"""Handshake between a consumer and a producer: compatibility and proof of a secret.

Sequence (over the producer's ZMQ side channel)::

    consumer -> HELLO     engine_id, expect_engine_id, compat, nonce_c
    producer -> CHALLENGE engine_id, nonce_p, proof_p = HMAC(secret, "producer" | transcript)
    consumer -> AUTH      proof_c = HMAC(secret, "consumer" | transcript)
    producer -> WELCOME   session id + MAC, data port, host id, shm offered
    (either side)  REFUSE reason, detail

Both sides prove knowledge of the shared secret without sending it; the
transcript binds the proofs to both nonces, both engine ids and the
compatibility hash, so a proof cannot be replayed in another handshake. Both
then derive the session key from the secret and the transcript (`session.py`):
every later message of the session carries a MAC under it. A mismatch of
protocol version, compatibility hash or engine id, or a wrong proof, is
refused with a named reason (an enum: whatever a peer names outside it counts
as "other"); the consumer raises `HandshakeRefused` and the producer logs and
counts it. A refusal tells an unauthenticated peer nothing about the producer
(neither its engine id nor its compatibility hash).
"""
from __future__ import annotations

import dataclasses
import enum
import hashlib
import hmac
import json
import os
import secrets
import socket
import time
from typing import Any

from connectors.zmq.control import session as sessions
from connectors.zmq.control import wire
from connectors.zmq.control.peer_log import quote
from connectors.zmq.control.wire import PROTOCOL_VERSION, MsgType

_MAX_PENDING = 256


class RefuseReason(str, enum.Enum):
    VERSION = "protocol_version"
    COMPAT = "compat_hash"
    ENGINE_ID = "engine_id"
    AUTH = "auth"
    SESSION = "session"  # no such session (unknown or expired)
    TIMEOUT = "timeout"
    IDENTITY = "identity"  # a session's message from another ZMQ identity
    REPLAY = "replay"  # a captured message again (stale seq, an ATTACH for another connection)
    CAPACITY = "capacity"  # a connection over a cap (pre-auth sockets, streams, side channel)
    OTHER = "other"  # anything a peer names that is none of the above

    @classmethod
    def parse(cls, value: str) -> RefuseReason:
        """The member a peer's reason string names, else OTHER (never a new key)."""
        try:
            return cls(value)
        except ValueError:
            return cls.OTHER


class HandshakeRefused(RuntimeError):
    """The peer (or this side) refused the handshake; `reason` says why."""

    def __init__(self, reason: RefuseReason, detail: str, by_peer: bool = False):
        super().__init__(f"KV handshake refused ({reason.value}): {detail}")
        self.reason = reason
        self.detail = detail
        self.by_peer = by_peer  # the other side sent the refusal (else: we refuse it)

    @classmethod
    def from_message(cls, msg: dict) -> HandshakeRefused:
        return cls(RefuseReason.parse(msg["reason"]), f"refused by the peer: {quote(msg['detail'], 200)}", by_peer=True)


@dataclasses.dataclass(frozen=True)
class CompatInfo:
    """What must be identical on both sides for pages to be interchangeable.

    `groups` holds one tuple per KV cache group: (kind, num_layers, block_size,
    page_size_bytes, sliding_window or 0).
    """

    model_id: str
    dtype: str
    num_layers: int
    block_size: int
    page_size_bytes: int
    groups: tuple[tuple[str, int, int, int, int], ...]

    def __post_init__(self) -> None:
        if not self.model_id:
            raise ValueError("model_id must be non-empty")
        if self.block_size <= 0 or self.page_size_bytes <= 0 or self.num_layers <= 0:
            raise ValueError(f"block_size, page_size_bytes and num_layers must be positive: {self}")

    def hash(self) -> str:
        """Hex digest over the protocol version and every field (canonical JSON)."""
        blob = json.dumps({"protocol": PROTOCOL_VERSION, **dataclasses.asdict(self)}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()

    @classmethod
    def from_groups(cls, model_id: str, kv_cache_groups: Any, page_size_bytes: int) -> CompatInfo:
        """Derives the info from kvcache `KVCacheGroupSpec`s (duck-typed: read, never imported)."""
        groups = []
        dtypes = set()
        for g in kv_cache_groups:
            spec = g.spec
            dtype = getattr(spec, "dtype", None) or ",".join(getattr(spec, "dtypes", ()))
            dtypes.add(str(dtype))
            groups.append(
                (
                    type(spec).__name__,
                    len(g.layer_names),
                    int(spec.block_size),
                    int(spec.page_size_bytes),
                    int(getattr(spec, "sliding_window", 0) or 0),
                )
            )
        return cls(
            model_id=model_id,
            dtype="|".join(sorted(dtypes)),
            num_layers=sum(n for _, n, _, _, _ in groups),
            block_size=max(b for _, _, b, _, _ in groups),
            page_size_bytes=page_size_bytes,
            groups=tuple(groups),
        )


def make_nonce() -> bytes:
    return secrets.token_bytes(16)


def transcript(nonce_c: bytes, nonce_p: bytes, compat: str, producer_id: str, consumer_id: str) -> bytes:
    parts = [str(PROTOCOL_VERSION).encode(), nonce_c, nonce_p, compat.encode(), producer_id.encode(),
             consumer_id.encode()]
    return b"\x00".join(len(p).to_bytes(4, "big") + p for p in parts)


def proof(secret: bytes, role: str, transcript_bytes: bytes) -> bytes:
    return hmac.new(secret, role.encode() + b"\x00" + transcript_bytes, hashlib.sha256).digest()


def check_proof(secret: bytes, role: str, transcript_bytes: bytes, candidate: bytes) -> bool:
    return hmac.compare_digest(proof(secret, role, transcript_bytes), candidate)


def local_host_id() -> str:
    """Names this host's shared-memory domain: same id => `/dev/shm` is shared."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "no-boot-id"
    try:
        shm_ino = os.stat("/dev/shm").st_ino
    except OSError:
        shm_ino = 0
    return hashlib.sha256(f"{socket.gethostname()}|{boot}|{shm_ino}".encode()).hexdigest()[:32]


class ConsumerHandshake:
    """Client side of one handshake: HELLO, then CHALLENGE -> AUTH (mutual proof)."""

    def __init__(self, secret: bytes, compat: str, engine_id: str, remote_engine_id: str):
        self._secret, self._compat = secret, compat
        self._engine_id, self._remote_engine_id = engine_id, remote_engine_id
        self._nonce = make_nonce()
        self._key = b""
        self.authed = False  # AUTH sent; WELCOME expected next

    def hello(self) -> bytes:
        return wire.encode(MsgType.HELLO, engine_id=self._engine_id, expect_engine_id=self._remote_engine_id,
                           compat=self._compat, nonce=self._nonce)

    def on_challenge(self, msg: dict) -> bytes:
        """Checks the producer's identity and proof; returns the AUTH message."""
        if msg["engine_id"] != self._remote_engine_id:
            raise HandshakeRefused(RefuseReason.ENGINE_ID,
                                   f"peer is {quote(msg['engine_id'])}, expected {self._remote_engine_id!r}")
        t = transcript(self._nonce, msg["nonce"], self._compat, self._remote_engine_id, self._engine_id)
        if not check_proof(self._secret, "producer", t, msg["proof"]):
            raise HandshakeRefused(RefuseReason.AUTH, "the producer failed to prove the shared secret")
        self.authed = True
        self._key = sessions.derive_key(self._secret, t)
        return wire.encode(MsgType.AUTH, proof=proof(self._secret, "consumer", t))

    def on_welcome(self, msg: dict) -> sessions.ClientSession:
        """Checks that the WELCOME comes from the producer that saw our AUTH (its MAC)."""
        if not hmac.compare_digest(sessions.welcome_mac(self._key, msg["session"]), msg["mac"]):
            raise HandshakeRefused(RefuseReason.AUTH, "WELCOME without the session key's MAC")
        return sessions.ClientSession(msg["session"], self._key)


class ProducerHandshake:
    """Server side: answers HELLOs with challenges and checks AUTHs, per ZMQ identity.

    At most `_MAX_PENDING` challenges are outstanding (oldest dropped), each
    valid for `timeout_s`.
    """

    def __init__(self, secret: bytes, compat: str, engine_id: str, timeout_s: float):
        self._secret, self._compat, self._engine_id = secret, compat, engine_id
        self._timeout_s = timeout_s
        self._pending: dict[bytes, tuple[float, bytes, str]] = {}  # identity -> (deadline, transcript, peer id)

    def on_hello(self, ident: bytes, msg: dict) -> bytes:
        """Returns the CHALLENGE, or raises `HandshakeRefused`."""
        # The details go to a peer not yet authenticated: they name nothing of this producer.
        if msg["expect_engine_id"] != self._engine_id:
            raise HandshakeRefused(RefuseReason.ENGINE_ID,
                                   f"this producer is not engine {quote(msg['expect_engine_id'])}")
        if msg["compat"] != self._compat:
            raise HandshakeRefused(RefuseReason.COMPAT,
                                   f"compatibility hash {quote(msg['compat'], 12)} differs from the producer's "
                                   "(protocol version, model, dtype or KV layout)")
        if len(self._pending) >= _MAX_PENDING:
            self._pending.pop(next(iter(self._pending)))
        nonce_p = make_nonce()
        t = transcript(msg["nonce"], nonce_p, self._compat, self._engine_id, msg["engine_id"])
        self._pending[ident] = (time.monotonic() + self._timeout_s, t, msg["engine_id"])
        return wire.encode(MsgType.CHALLENGE, engine_id=self._engine_id, nonce=nonce_p,
                           proof=proof(self._secret, "producer", t))

    def on_auth(self, ident: bytes, msg: dict) -> tuple[bytes, str]:
        """Accepts a consumer's proof (else raises `HandshakeRefused`); returns the session key
        and the consumer's engine id."""
        entry = self._pending.pop(ident, None)
        if entry is None or entry[0] < time.monotonic():
            raise HandshakeRefused(RefuseReason.AUTH, "AUTH without a pending challenge")
        if not check_proof(self._secret, "consumer", entry[1], msg["proof"]):
            raise HandshakeRefused(RefuseReason.AUTH, "wrong proof of the shared secret")
        return sessions.derive_key(self._secret, entry[1]), entry[2]

    def forget(self, ident: bytes) -> None:
        self._pending.pop(ident, None)

    def expire(self) -> None:
        now = time.monotonic()
        for ident in [i for i, (deadline, _, _) in self._pending.items() if deadline < now]:
            del self._pending[ident]
