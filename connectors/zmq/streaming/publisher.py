"""KV streaming, producer side: what a streamed prefill publishes, and to whom.

A streamed request (`transfer.streaming: chunk` or `layer`) has its lease from the first
publication on (`LeaseTable.publish`). After each prefill step that completed
some of its blocks (layer: after each slice of layers of the step, during the
forward; the ids are then transfer units, `layer_slices.py`), the engine's
thread hands them here (`publish`); the
side-channel thread seals their digests (`LeaseTable.seal_published`: only
then may they be pulled) and sends one PUBLISHED per part to the consumer that
WATCHes the request, signed with its session's key and counter (`session.py`).
A consumer that watches late gets everything published so far at once. A
stream that ends badly (the request aborted or failed on the producer) ends
its lease (`LeaseEnd.ABORTED`) and tells the watcher at once (PUBLISHED with
`ok` false), so the consumer fails its load rather than wait for its deadline.

Watchers are kept at most `2 x lease_s` without a lease (a WATCH that came
before the request reached the engine, or for one that never will), and at
most `max_watchers` at once: past that a WATCH for a new request is refused
(counted as `capacity`). A request is watched by the first live session that
names it: a WATCH or DONE for it from any other session is refused (counted as
`claimed`) and changes nothing, so one authenticated peer can neither divert
another's stream nor end it.
"""
from __future__ import annotations

import contextlib
import enum
import logging
import socket
import threading
import time
from collections.abc import Callable

from connectors.metrics import LeaseEnd, TransferMetrics
from connectors.zmq.producer.leases import LeaseTable, Publication
from connectors.zmq.control.session import ProducerSession

logger = logging.getLogger(__name__)

Send = Callable[[bytes, bytes], None]  # (ZMQ identity, payload)


class WatchRefused(str, enum.Enum):
    """Why a WATCH or DONE changed nothing (metric keys: `TransferMetrics.record_refused`)."""
    CAPACITY = "capacity"  # max_watchers live watchers already
    CLAIMED = "claimed"  # another live session watches the request


class StreamPublisher:
    def __init__(self, leases: LeaseTable, seal: Callable[[list[int]], list[int]], metrics: TransferMetrics,
                 max_watchers: int = 4096):
        if max_watchers < 1:
            raise ValueError("max_watchers must be >= 1")
        self.max_watchers = max_watchers
        self._leases = leases
        self._seal = seal
        self._metrics = metrics
        self._lock = threading.Lock()
        self._watchers: dict[str, tuple[ProducerSession, float]] = {}  # side-channel thread only
        self._failed: dict[str, float] = {}  # request id -> when its stream failed (guarded by _lock)
        self._fresh_failures: list[str] = []  # failures not yet told (guarded by _lock)
        self.wake_r, self._wake_w = socket.socketpair()
        self.wake_r.setblocking(False)
        self._wake_w.setblocking(False)

    # ------------------------------------------------------------------ engine's thread
    def publish(self, request_id: str, entries: list[tuple[int, int, int]], final: bool) -> bool:
        """Newly complete (group, position, block id) of a streamed request; False when its lease
        has ended (the consumer is done or gone: publish no more)."""
        if not self._leases.publish(request_id, entries, final):
            return False
        self._wake()
        return True

    def fail(self, request_id: str) -> None:
        """The streamed request ended badly on this engine: its lease ends, its watcher is told."""
        self._leases.end(request_id, LeaseEnd.ABORTED)
        with self._lock:
            self._failed[request_id] = time.monotonic()
            self._fresh_failures.append(request_id)
        self._wake()

    # ------------------------------------------------------------------ side-channel thread
    def watch(self, session: ProducerSession, request_ids: list[str], send: Send) -> None:
        now = time.monotonic()
        for rid in dict.fromkeys(request_ids):  # (a name listed twice is told once)
            if not self._claim(session, rid, now):
                continue
            with self._lock:
                failed = rid in self._failed
            if failed:
                self._tell(rid, Publication(rid, [], True), send, ok=False)
                continue
            sofar = self._leases.published(rid)
            if sofar is not None:
                self._tell(rid, sofar, send)

    def is_watched(self, request_id: str) -> bool:
        """Whether a consumer WATCHes `request_id` now (a read: any thread)."""
        return request_id in self._watchers

    def forget(self, session: ProducerSession, request_ids: list[str]) -> list[str]:
        """DONE: the consumer needs nothing more for these; one not yet published never will be
        (else a prefill that starts late would lease its blocks until expiry, for nobody). Returns
        the ids whose lease may end: all but those another live session watches."""
        done = []
        for rid in request_ids:
            watcher = self._watchers.get(rid)
            if watcher is not None and watcher[0] is not session and not watcher[0].closed:
                self._metrics.record_refused(WatchRefused.CLAIMED)
                continue
            done.append(rid)
            if self._watchers.pop(rid, None) is not None:
                self._leases.close_stream(rid)
        return done

    def _claim(self, session: ProducerSession, rid: str, now: float) -> bool:
        """Makes `session` the watcher of `rid`, unless another live session is, or the table is full."""
        watcher = self._watchers.get(rid)
        if watcher is not None and watcher[0] is not session and not watcher[0].closed:
            self._metrics.record_refused(WatchRefused.CLAIMED)
            return False
        if watcher is None and len(self._watchers) >= self.max_watchers:
            self.expire()
            if len(self._watchers) >= self.max_watchers:
                self._metrics.record_refused(WatchRefused.CAPACITY)
                return False
        self._watchers[rid] = (session, now)
        return True

    def flush(self, send: Send) -> None:
        """Seals and sends what was published since the last call; expires old watchers."""
        with contextlib.suppress(OSError):
            self.wake_r.recv(4096)
        for pub in self._leases.seal_published(self._seal):
            self._metrics.record_stream_part(published=True)
            if pub.request_id in self._watchers:
                self._tell(pub.request_id, pub, send)
        with self._lock:
            fresh, self._fresh_failures = self._fresh_failures, []
        for rid in fresh:
            if rid in self._watchers:
                self._tell(rid, Publication(rid, [], True), send, ok=False)

    def expire(self) -> None:
        cutoff = time.monotonic() - 2 * self._leases.lease_s
        for rid, (session, since) in list(self._watchers.items()):
            if session.closed or (since < cutoff and not self._leases.holds(rid)):
                del self._watchers[rid]
        with self._lock:
            for rid in [r for r, t in self._failed.items() if t < cutoff]:
                del self._failed[rid]

    def _tell(self, rid: str, pub: Publication, send: Send, ok: bool = True) -> None:
        session, _ = self._watchers[rid]
        if session.closed:
            del self._watchers[rid]
            return
        e = pub.entries
        send(session.ident, session.published_message({
            "request_id": rid, "groups": [x[0] for x in e], "positions": [x[1] for x in e],
            "block_ids": [x[2] for x in e], "digests": [x[3] for x in e], "final": pub.final, "ok": ok}))
        if pub.final or not ok:
            del self._watchers[rid]

    def _wake(self) -> None:
        with contextlib.suppress(OSError):  # full: a wake-up is pending anyway
            self._wake_w.send(b"x")

    def close(self) -> None:
        for s in (self.wake_r, self._wake_w):
            s.close()
