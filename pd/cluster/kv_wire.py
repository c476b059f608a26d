"""The KV event stream's wire format and the deployment's hashing identity.

Shared by the worker's publisher (`pd.worker.kv_events`) and the router's
index (`pd.router.kv_index`), so both sides agree byte for byte.

A batch travels as a ZMQ multipart message `[TOPIC, payload, mac]`:
- `payload` is msgpack `{"v": 1, "engine_id": str, "worker_id": str, "seq": int,
  "events": [[kind, group, [hash bytes...]], ...]}` with kind one of
  `stored`, `removed`, `cleared` (a `cleared` event has group -1 and no hashes);
- `mac` is HMAC-SHA256 over `payload` under a key derived from the deployment
  secret. Nothing is pickled; `decode_batch` refuses anything that does not
  verify or does not have exactly this shape (`BatchError`, with the reason).

A heartbeat travels the same way with payload `{"v": 1, "engine_id", "worker_id",
"seq", "heartbeat": true}` and no events: `seq` (0 before the first batch) is the
last batch published before it, so a subscriber behind it has lost batches.

The stream itself is ZMQ CURVE (`curve_keys`): the publisher's key pair and the one
client key pair it admits are both derived from the deployment secret, so only a
holder of the secret completes the handshake, and nothing is sent in clear.

The hash seed is derived from the deployment secret too (unless
`PDKV_HASH_SEED` is set), so every worker and the router hash a prompt alike,
and nobody without the secret can predict a block's hash.
"""
from __future__ import annotations

import dataclasses
import hashlib
import hmac
import os

import msgpack
import zmq
from zmq.utils import z85

from kvcache.hashing import HASH_SEED_ENV, BlockHasher

WIRE_VERSION = 1
TOPIC = b"kv"
KINDS = ("stored", "removed", "cleared")
MAX_PAYLOAD_BYTES = 8 * 1024 * 1024


class BatchError(ValueError):
    """A batch that must be dropped; `reason` is a short metric label."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclasses.dataclass(frozen=True)
class EventBatch:
    engine_id: str
    worker_id: str
    seq: int
    events: list  # [[kind, group, [hash bytes]]]
    heartbeat: bool = False  # no events: `seq` is the publisher's latest


@dataclasses.dataclass(frozen=True)
class CurveKeys:
    """Z85 CURVE keys of a deployment's KV event stream (publisher = server, router = client)."""
    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes


def _key(secret: str | bytes, purpose: bytes) -> bytes:
    raw = secret.encode() if isinstance(secret, str) else secret
    return hmac.new(raw, purpose, hashlib.sha256).digest()


def event_key(secret: str | bytes) -> bytes:
    return _key(secret, b"pdkv-kv-events-v1")


def curve_keys(secret: str | bytes) -> CurveKeys:
    """Both key pairs, derived from the secret (any 32 bytes are a Curve25519 secret key)."""
    server_secret = z85.encode(_key(secret, b"pdkv-kv-events-curve-server-v1"))
    client_secret = z85.encode(_key(secret, b"pdkv-kv-events-curve-client-v1"))
    return CurveKeys(zmq.curve_public(server_secret), server_secret, zmq.curve_public(client_secret), client_secret)


def deployment_hash_seed(secret: str | bytes) -> str:
    """The prefix-cache hash seed of a deployment: `PDKV_HASH_SEED` when set, else from its secret."""
    env = os.environ.get(HASH_SEED_ENV)
    return env if env is not None else _key(secret, b"pdkv-hash-seed-v1").hex()


def hashing_identity(hasher: BlockHasher, groups: list[dict]) -> dict:
    """What must match between a worker and the router for hashes to mean the same prefix:
    algorithm, block size, the seed's digest, and the KV cache groups (kind, block size, window)."""
    return {"algorithm": hasher.algorithm, "block_size": hasher.block_size,
            "seed_digest": hasher.none_hash.hex(), "groups": groups}


def encode_batch(key: bytes, batch: EventBatch) -> list[bytes]:
    payload = msgpack.packb({"v": WIRE_VERSION, "engine_id": batch.engine_id, "worker_id": batch.worker_id,
                             "seq": batch.seq, "events": batch.events}, use_bin_type=True)
    return [TOPIC, payload, hmac.new(key, payload, hashlib.sha256).digest()]


def encode_heartbeat(key: bytes, engine_id: str, worker_id: str, seq: int) -> list[bytes]:
    payload = msgpack.packb({"v": WIRE_VERSION, "engine_id": engine_id, "worker_id": worker_id, "seq": seq,
                             "heartbeat": True}, use_bin_type=True)
    return [TOPIC, payload, hmac.new(key, payload, hashlib.sha256).digest()]


def decode_batch(key: bytes, frames: list[bytes]) -> EventBatch:
    if len(frames) != 3 or frames[0] != TOPIC:
        raise BatchError("malformed", f"expected 3 frames starting with {TOPIC!r}, got {len(frames)}")
    payload, mac = frames[1], frames[2]
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise BatchError("malformed", f"payload of {len(payload)} bytes is over {MAX_PAYLOAD_BYTES}")
    if not hmac.compare_digest(mac, hmac.new(key, payload, hashlib.sha256).digest()):
        raise BatchError("bad_mac", "batch MAC does not verify")
    try:
        body = msgpack.unpackb(payload, raw=False, strict_map_key=True, ext_hook=_refuse_ext)
    except BatchError:
        raise
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise BatchError("malformed", f"payload is not msgpack: {exc}") from None
    return EventBatch(*_checked_body(body))


def _refuse_ext(code: int, data: bytes):
    raise BatchError("malformed", f"msgpack extension type {code} is not allowed")


def _checked_body(body) -> tuple:
    if not isinstance(body, dict) or body.get("v") != WIRE_VERSION:
        raise BatchError("malformed", "payload must be a map with v=1")
    engine_id, worker_id, seq, events = (body.get(k) for k in ("engine_id", "worker_id", "seq", "events"))
    if not isinstance(engine_id, str) or not isinstance(worker_id, str):
        raise BatchError("malformed", "engine_id and worker_id must be strings")
    heartbeat = body.get("heartbeat", False)
    if heartbeat is True and events is None and set(body) == {"v", "engine_id", "worker_id", "seq", "heartbeat"}:
        if type(seq) is not int or seq < 0:
            raise BatchError("malformed", "a heartbeat's seq must be a non-negative integer")
        return engine_id, worker_id, seq, [], True
    if heartbeat is not False:
        raise BatchError("malformed", "a heartbeat has exactly v, engine_id, worker_id, seq and heartbeat")
    if type(seq) is not int or seq < 1:
        raise BatchError("malformed", "seq must be a positive integer")
    return engine_id, worker_id, seq, checked_events(events), False


def checked_events(events) -> list:
    """The events list, validated (BatchError naming what is wrong)."""
    if not isinstance(events, list):
        raise BatchError("malformed", "events must be a list")
    for ev in events:
        if (not isinstance(ev, list) or len(ev) != 3 or ev[0] not in KINDS or type(ev[1]) is not int
                or not isinstance(ev[2], list) or not all(isinstance(h, bytes) for h in ev[2])):
            raise BatchError("malformed", "each event must be [kind, group, [hash bytes]]")
    return events
