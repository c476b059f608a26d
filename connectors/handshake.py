"""Handshake between a consumer and a producer: compatibility and proof of a secret.

Sequence (over the producer's ZMQ side channel)::

    consumer -> HELLO     engine_id, expect_engine_id, compat, nonce_c
    producer -> CHALLENGE engine_id, nonce_p, proof_p = HMAC(secret, "producer" | transcript)
    consumer -> AUTH      proof_c = HMAC(secret, "consumer" | transcript)
    producer -> WELCOME   session token, data port, host id, shm offered
    (either side)  REFUSE reason, detail

Both sides prove knowledge of the shared secret without sending it; the
transcript binds the proofs to both nonces, both engine ids and the
compatibility hash, so a proof cannot be replayed in another handshake. A
mismatch of protocol version, compatibility hash or engine id, or a wrong
proof, is refused with a named reason; the consumer raises `HandshakeRefused`
and the producer logs and counts it.
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
from typing import Any

from connectors.wire import PROTOCOL_VERSION


class RefuseReason(str, enum.Enum):
    VERSION = "protocol_version"
    COMPAT = "compat_hash"
    ENGINE_ID = "engine_id"
    AUTH = "auth"
    SESSION = "session"
    TIMEOUT = "timeout"


class HandshakeRefused(RuntimeError):
    """The peer (or this side) refused the handshake; `reason` says why."""

    def __init__(self, reason: RefuseReason, detail: str):
        super().__init__(f"KV handshake refused ({reason.value}): {detail}")
        self.reason = reason
        self.detail = detail


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


def make_session_token() -> bytes:
    return secrets.token_bytes(32)


def transcript(nonce_c: bytes, nonce_p: bytes, compat: str, producer_id: str, consumer_id: str) -> bytes:
    parts = [str(PROTOCOL_VERSION).encode(), nonce_c, nonce_p, compat.encode(), producer_id.encode(), consumer_id.encode()]
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
