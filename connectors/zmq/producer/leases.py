"""Producer-side leases on the blocks a finished prefill keeps for its consumer.

Lifecycle of one lease::

    ACTIVE --(done | expiry | abort)--> DRAINING --(no pull in flight)--> RELEASED

A lease names exactly the block ids a consumer may read for one request (a
per-request capability: pulls for other blocks are refused). It ends once,
for the first of: the consumer reports done, the lease passes its expiry with
no heartbeat, or the request is aborted. Its blocks are handed back (through
`take_released`, which feeds `finished_sending`) only when no pull is still
reading them, so a page is never reused while it is on the wire.

With reports on (`enable_reports`, the connector's `report_leases`), each released lease leaves a
`LeaseReport` (its outcome, and what its pulls sent) for `take_reports`; off, nothing is recorded.

Digests are sealed when the lease is created or soon after (`seal_pending`),
so a page overwritten by mistake between lease and pull is caught by the
consumer's checksum rather than served as good data.
"""
from __future__ import annotations

import dataclasses
import enum
import logging
import threading
import time
from collections.abc import Callable

from connectors.base import LeaseReport, PullsServed
from connectors.metrics import LeaseEnd, TransferMetrics

logger = logging.getLogger(__name__)


class LeaseState(enum.Enum):
    ACTIVE = "active"
    DRAINING = "draining"
    RELEASED = "released"


@dataclasses.dataclass
class Lease:
    request_id: str
    block_ids: frozenset[int]
    expiry: float
    state: LeaseState = LeaseState.ACTIVE
    end: LeaseEnd | None = None
    active_pulls: int = 0
    digests: dict[int, int] | None = None
    granted_s: float = 0.0  # time.monotonic() at `add`
    served: ServedPull | None = None  # what its pulls sent so far (reports on only)
    stream: StreamState | None = None  # a streamed lease: its blocks arrive while the prefill runs


@dataclasses.dataclass
class StreamState:
    """A streamed lease's publications: (group, position, block id) entries waiting for their
    digests, those published (with digests), and whether the prefill is over."""

    pending: list[tuple[int, int, int]] = dataclasses.field(default_factory=list)
    published: list[tuple[int, int, int, int]] = dataclasses.field(default_factory=list)
    final: bool = False
    final_sent: bool = False
    num_parts: int = 0


@dataclasses.dataclass(frozen=True)
class Publication:
    """What a producer tells a streamed request's consumer: newly complete blocks, with digests."""

    request_id: str
    entries: list[tuple[int, int, int, int]]  # (group, position, block id, digest)
    final: bool


@dataclasses.dataclass
class ServedPull:
    """One pull a producer served, or (as `Lease.served`) the sum of a lease's pulls."""

    trace_context: str | None
    num_blocks: int
    num_bytes: int
    data_path: str
    started_s: float
    ended_s: float
    num_pulls: int = 1


class PullRefused(Exception):
    """A pull that names no active lease or blocks outside it."""


class LeaseTable:
    """Thread-safe table of leases; released request ids queue up for the engine."""

    def __init__(self, lease_s: float, metrics: TransferMetrics):
        if lease_s <= 0:
            raise ValueError(f"lease_s must be positive, got {lease_s}")
        self.lease_s = lease_s
        self._metrics = metrics
        self._lock = threading.Lock()
        self._leases: dict[str, Lease] = {}
        self._released: set[str] = set()
        self._reports: list[LeaseReport] | None = None  # None: reports off
        self._ended_streams: dict[str, float] = {}  # streamed leases released: never created again

    def enable_reports(self) -> None:
        with self._lock:
            if self._reports is None:
                self._reports = []

    @property
    def reporting(self) -> bool:
        return self._reports is not None

    def take_reports(self) -> list[LeaseReport]:
        with self._lock:
            out = self._reports or []
            if self._reports is not None:
                self._reports = []
            return out

    def add(self, request_id: str, block_ids: list[int], lease_s: float | None = None) -> None:
        with self._lock:
            if request_id in self._leases:
                raise ValueError(f"request {request_id!r} already holds a lease")
            now = time.monotonic()
            expiry = now + (lease_s if lease_s is not None else self.lease_s)
            self._leases[request_id] = Lease(request_id, frozenset(block_ids), expiry, granted_s=now)

    def publish(self, request_id: str, entries: list[tuple[int, int, int]], final: bool) -> bool:
        """A streamed lease's newly complete blocks, (group, position, block id); the first call
        creates the lease. Their digests are computed off the engine's thread (`seal_published`),
        and only then may they be pulled. False when the lease has ended (nothing to publish to)."""
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is None:
                if request_id in self._ended_streams:
                    return False
                now = time.monotonic()
                lease = Lease(request_id, frozenset(), now + self.lease_s, digests={}, granted_s=now,
                              stream=StreamState())
                self._leases[request_id] = lease
            if lease.state is not LeaseState.ACTIVE or lease.stream is None or lease.stream.final:
                return False
            lease.stream.pending += entries
            lease.stream.final = final
            return True

    def seal_published(self, compute: Callable[[list[int]], list[int]]) -> list[Publication]:
        """Digests of every streamed lease's pending blocks; those blocks become pullable."""
        with self._lock:
            todo = []
            for lease in self._leases.values():
                st = lease.stream
                due = st is not None and (st.pending or (st.final and not st.final_sent))
                if st is not None and due and lease.state is LeaseState.ACTIVE:
                    todo.append((lease, st.pending, st.final))
                    st.pending, st.final_sent = [], st.final
                    st.num_parts += 1
                    lease.active_pulls += 1  # keep the blocks while reading them
        out = []
        for lease, entries, final in todo:
            try:
                digests = compute([b for _, _, b in entries]) if entries else []
                done = [(g, p, b, d) for (g, p, b), d in zip(entries, digests, strict=True)]
                with self._lock:
                    assert lease.digests is not None and lease.stream is not None  # (a streamed lease)
                    lease.digests.update((b, d) for _, _, b, d in done)
                    lease.block_ids = lease.block_ids | {b for _, _, b, _ in done}
                    lease.stream.published += done
                out.append(Publication(lease.request_id, done, final))
            finally:
                self.end_pull(lease)
        return out

    def published(self, request_id: str) -> Publication | None:
        """Everything a streamed lease published so far (for a consumer that asks late)."""
        with self._lock:
            lease = self._leases.get(request_id)
            st = lease.stream if lease is not None and lease.state is LeaseState.ACTIVE else None
            if st is None or not st.num_parts:
                return None
            return Publication(request_id, list(st.published), st.final_sent)

    def close_stream(self, request_id: str) -> None:
        """The consumer is done with a streamed request that has no lease yet (its load failed or
        was cancelled before the first publication): `publish` creates none for it later."""
        with self._lock:
            if request_id not in self._leases:
                self._ended_streams[request_id] = time.monotonic()

    def stream_closed(self, request_id: str) -> bool:
        """Whether `publish` refuses `request_id` (its streamed lease ended, or was closed unborn)."""
        with self._lock:
            return request_id in self._ended_streams and request_id not in self._leases

    def holds(self, request_id: str) -> bool:
        """Whether the lease still holds its blocks (not yet handed back through `take_released`)."""
        with self._lock:
            return request_id in self._leases or request_id in self._released

    def end(self, request_id: str, end: LeaseEnd) -> bool:
        """Ends a lease (first cause wins); False when there is no active lease."""
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is None or lease.state is not LeaseState.ACTIVE:
                return False
            lease.state, lease.end = LeaseState.DRAINING, end
            self._maybe_release_locked(lease)
            return True

    def renew(self, request_ids: list[str]) -> int:
        """Heartbeat: pushes expiry to max(old, now + 2/3 lease). Returns how many were renewed."""
        now = time.monotonic()
        renewed = 0
        with self._lock:
            for rid in request_ids:
                lease = self._leases.get(rid)
                if lease is not None and lease.state is LeaseState.ACTIVE:
                    lease.expiry = max(lease.expiry, now + self.lease_s * 2 / 3)
                    renewed += 1
        return renewed

    def expire(self) -> list[str]:
        """Ends every lease past its expiry; returns their ids."""
        now = time.monotonic()
        with self._lock:
            for rid in [r for r, t in self._ended_streams.items() if t < now - 2 * self.lease_s]:
                del self._ended_streams[rid]
            expired = [lz for lz in self._leases.values() if lz.state is LeaseState.ACTIVE and lz.expiry <= now]
            for lease in expired:
                lease.state, lease.end = LeaseState.DRAINING, LeaseEnd.EXPIRED
                self._maybe_release_locked(lease)
        for lease in expired:
            logger.warning("KV lease for request %s expired without a heartbeat; releasing its blocks",
                           lease.request_id)
        return [lz.request_id for lz in expired]

    def begin_pull(self, request_id: str, block_ids: list[int]) -> Lease:
        """Pins a lease for one pull; raises `PullRefused` if the pull is not covered."""
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is None or lease.state is not LeaseState.ACTIVE:
                raise PullRefused(f"no active lease for request {request_id!r}")
            if not lease.block_ids.issuperset(block_ids):
                outside = set(block_ids) - lease.block_ids
                raise PullRefused(f"blocks {sorted(outside)[:8]} are not leased to request {request_id!r}")
            lease.active_pulls += 1
            return lease

    def end_pull(self, lease: Lease, served: ServedPull | None = None) -> None:
        """Unpins a lease after a pull; `served` (reports on): what the pull sent."""
        with self._lock:
            if served is not None:
                _add_served(lease, served)
            lease.active_pulls -= 1
            self._maybe_release_locked(lease)

    def seal_pending(self, compute: Callable[[list[int]], list[int]], limit: int = 8) -> None:
        """Computes digests for up to `limit` unsealed active leases (outside the lock)."""
        with self._lock:
            todo = [lz for lz in self._leases.values() if lz.digests is None and lz.state is LeaseState.ACTIVE][:limit]
            for lease in todo:
                lease.active_pulls += 1  # keep the blocks while reading them
        for lease in todo:
            ids = sorted(lease.block_ids)
            try:
                lease.digests = dict(zip(ids, compute(ids), strict=True))
            finally:
                self.end_pull(lease)

    def is_sealed(self, request_id: str) -> bool:
        with self._lock:
            lease = self._leases.get(request_id)
            return lease is not None and lease.digests is not None

    def take_released(self) -> set[str]:
        with self._lock:
            out, self._released = self._released, set()
            return out

    def end_all(self, end: LeaseEnd) -> None:
        with self._lock:
            ids = [rid for rid, lz in self._leases.items() if lz.state is LeaseState.ACTIVE]
        for rid in ids:
            self.end(rid, end)

    def _maybe_release_locked(self, lease: Lease) -> None:
        if lease.state is LeaseState.DRAINING and lease.active_pulls == 0:
            lease.state = LeaseState.RELEASED
            del self._leases[lease.request_id]
            self._released.add(lease.request_id)
            if lease.stream is not None:
                self._ended_streams[lease.request_id] = time.monotonic()
            if lease.end is not None:
                self._metrics.record_lease_end(lease.end)
            if self._reports is not None:
                s = lease.served
                self._reports.append(LeaseReport(
                    lease.request_id, (lease.end or LeaseEnd.SHUTDOWN).value, len(lease.block_ids), lease.granted_s,
                    time.monotonic(), None if s is None else PullsServed(
                        s.trace_context, s.num_pulls, s.num_blocks, s.num_bytes, s.data_path, s.started_s,
                        s.ended_s)))


def _add_served(lease: Lease, pull: ServedPull) -> None:
    total = lease.served
    if total is None:
        lease.served = dataclasses.replace(pull)
        return
    total.num_pulls += 1
    total.num_blocks += pull.num_blocks
    total.num_bytes += pull.num_bytes
    total.trace_context = total.trace_context or pull.trace_context
    total.started_s, total.ended_s = min(total.started_s, pull.started_s), max(total.ended_s, pull.ended_s)
