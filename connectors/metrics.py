"""Transfer metrics: bytes and blocks moved, latency, GB/s, failures by cause,
and per producer (`peers`: remote engine id -> loads, failures, bytes and the
(bytes, seconds) of its last `RECENT_LOADS_PER_PEER` warm loads, for a cost
model of each P->D link).

`TransferMetrics` is thread-safe (one lock, counters only) and cheap enough to
update on every page. `snapshot()` returns a plain dict suitable for JSON.
"""
from __future__ import annotations

import bisect
import enum
import threading
from collections import Counter, OrderedDict, deque


class FailureCause(str, enum.Enum):
    TIMEOUT = "timeout"
    PEER_GONE = "peer_gone"
    CHECKSUM = "checksum"
    HANDSHAKE_REFUSED = "handshake_refused"
    PULL_REFUSED = "pull_refused"  # producer has no lease for it (expired, unknown, blocks not leased)
    SHUTDOWN = "shutdown"


class LeaseEnd(str, enum.Enum):
    DONE = "done"  # the consumer reported its read finished
    EXPIRED = "expired"  # no heartbeat within the lease
    ABORTED = "aborted"  # the request was aborted on the producer
    SHUTDOWN = "shutdown"


# Per producer (remote engine id): the loads of the most recent peers, and a ring of recent samples.
MAX_PEERS = 256
RECENT_LOADS_PER_PEER = 64


class _PeerLoads:
    """Loads from one producer: counts, and (bytes, seconds) of its recent warm loads."""

    __slots__ = ("num_loads", "num_failed", "num_bytes", "recent")

    def __init__(self) -> None:
        self.num_loads = 0
        self.num_failed = 0
        self.num_bytes = 0
        self.recent: deque[tuple[int, float]] = deque(maxlen=RECENT_LOADS_PER_PEER)

    def snapshot(self) -> dict:
        return {"num_loads": self.num_loads, "num_failed": self.num_failed, "num_bytes": self.num_bytes,
                "recent": [[b, s] for b, s in self.recent]}


# Upper bounds of the load-latency histogram (seconds); the +Inf bucket is `loads_ok`.
LOAD_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class TransferMetrics:
    """Counters for one connector (both directions)."""

    def __init__(self, keep_latencies: int = 1024):
        self._lock = threading.Lock()
        self.bytes_sent = 0
        self.blocks_sent = 0
        self.bytes_recv = 0
        self.blocks_recv = 0
        self.loads_ok = 0
        self.load_seconds = 0.0
        self.failures: Counter[str] = Counter()
        self.leases: Counter[str] = Counter()
        self.refused: Counter[str] = Counter()
        self.malformed_frames = 0
        self.accept_backoffs = 0  # a listener paused at the fd limit (EMFILE and the like)
        self.stream_parts_published = 0  # producer: parts of streamed prefills published (streaming/publisher.py)
        self.stream_parts_received = 0  # consumer: published parts pulled, landed and verified
        self._latencies: deque[float] = deque(maxlen=keep_latencies)
        self._load_bucket_counts = [0] * (len(LOAD_BUCKETS_S) + 1)  # per bucket, the last one past every bound
        self._peers: OrderedDict[str, _PeerLoads] = OrderedDict()  # least recently loaded from first

    def record_sent(self, num_blocks: int, num_bytes: int) -> None:
        with self._lock:
            self.blocks_sent += num_blocks
            self.bytes_sent += num_bytes

    def record_load(self, num_blocks: int, num_bytes: int, seconds: float, peer: str | None = None,
                    warm: bool = True) -> None:
        """One verified load of `seconds` (from `load()` to landed). With `peer` (the producer's
        engine id) it also counts for that peer; only a `warm` load (its session was ready: no
        handshake inside its seconds) joins the peer's `recent` samples."""
        with self._lock:
            self.loads_ok += 1
            self.blocks_recv += num_blocks
            self.bytes_recv += num_bytes
            self.load_seconds += seconds
            self._latencies.append(seconds)
            self._load_bucket_counts[bisect.bisect_left(LOAD_BUCKETS_S, seconds)] += 1
            if peer is not None:
                loads = self._peer_locked(peer)
                loads.num_loads += 1
                loads.num_bytes += num_bytes
                if warm:
                    loads.recent.append((num_bytes, seconds))

    def record_failure(self, cause: FailureCause, peer: str | None = None) -> None:
        with self._lock:
            self.failures[cause.value] += 1
            if peer is not None:
                self._peer_locked(peer).num_failed += 1

    def _peer_locked(self, peer: str) -> _PeerLoads:
        loads = self._peers.get(peer)
        if loads is None:
            loads = self._peers[peer] = _PeerLoads()
            if len(self._peers) > MAX_PEERS:
                self._peers.popitem(last=False)
        else:
            self._peers.move_to_end(peer)
        return loads

    def record_lease_end(self, end: LeaseEnd) -> None:
        with self._lock:
            self.leases[end.value] += 1

    def record_refused(self, reason: enum.Enum) -> None:
        """One refusal, by reason: a member of a code-defined enum (`handshake.RefuseReason`),
        so the keys stay few whatever peers send; anything else counts as "other"."""
        key = reason.value if isinstance(reason, enum.Enum) else "other"
        with self._lock:
            self.refused[key] += 1

    def record_accept_backoff(self) -> None:
        with self._lock:
            self.accept_backoffs += 1

    def record_stream_part(self, published: bool) -> None:
        with self._lock:
            if published:
                self.stream_parts_published += 1
            else:
                self.stream_parts_received += 1

    def record_malformed(self) -> None:
        with self._lock:
            self.malformed_frames += 1

    def snapshot(self) -> dict:
        with self._lock:
            lat = sorted(self._latencies)
            p50 = lat[len(lat) // 2] if lat else 0.0
            p99 = lat[min(len(lat) - 1, int(len(lat) * 0.99))] if lat else 0.0
            return {
                "bytes_sent": self.bytes_sent,
                "blocks_sent": self.blocks_sent,
                "bytes_recv": self.bytes_recv,
                "blocks_recv": self.blocks_recv,
                "loads_ok": self.loads_ok,
                "load_seconds": self.load_seconds,
                "load_latency_buckets": _cumulative(LOAD_BUCKETS_S, self._load_bucket_counts),
                "recv_gbps": (self.bytes_recv / self.load_seconds / 1e9) if self.load_seconds else 0.0,
                "load_latency_p50_s": p50,
                "load_latency_p99_s": p99,
                "failures": dict(self.failures),
                "leases_ended": dict(self.leases),
                "leases_expired": self.leases.get(LeaseEnd.EXPIRED.value, 0),
                "handshakes_refused": dict(self.refused),
                "malformed_frames": self.malformed_frames,
                "accept_backoffs": self.accept_backoffs,
                "stream_parts_published": self.stream_parts_published,
                "stream_parts_received": self.stream_parts_received,
                "peers": {peer: loads.snapshot() for peer, loads in self._peers.items()},
            }


def _cumulative(bounds: tuple[float, ...], counts: list[int]) -> list[list[float]]:
    """[[upper bound, loads at or under it], ...] (Prometheus bucket form, +Inf left out)."""
    out, total = [], 0
    for bound, count in zip(bounds, counts, strict=False):
        total += count
        out.append([bound, total])
    return out
