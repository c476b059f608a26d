"""Feeds the router's `KVIndex` from every worker's KV event stream.

One ZMQ SUB socket per worker (its endpoint comes from the worker's health /
stats answer, `kv_events`), read by one asyncio task. The socket is a CURVE
client with the key pair derived from the deployment secret, the only one the
worker's publisher admits (`pd.worker.kv_gate`). Each batch is verified (HMAC
under the deployment secret, strict msgpack shape): one that fails is dropped
and counted, and never touches the index. A gap (a missed seq, or a heartbeat
whose seq is ahead of the index: lost trailing batches show within one
heartbeat), a restart (new engine id or a new endpoint in the worker's stats)
or a worker whose published seq stays ahead of the index for two polls sends
that worker to DEGRADED and starts a resync over the worker's replay endpoint
(batches after our seq, else a snapshot; always a snapshot once the index
dropped the worker's entries). A worker over its index share stays DEGRADED:
it is resynchronised again only when its poll says its cache fits in the share, and
one that hovers at its share (over it again within 10 polls of that snapshot) only once
its cache is 10% below it (`RefitGate`), so it is not snapshotted and dropped over and over.
A worker that leaves the rotation loses its entries.

Guarantees: every wait has a timeout; no exception in one worker's stream
stops another's; `close()` cancels every task and closes every socket.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging

import zmq
import zmq.asyncio

from pd.cluster.kv_wire import TOPIC, BatchError, curve_keys, decode_batch, event_key
from pd.router.kv_index import IndexState, KVIndex
from pd.router.worker_client import WorkerCallError, WorkerClient

logger = logging.getLogger(__name__)

RESYNC_TIMEOUT_S = 5.0
RESYNC_RETRY_S = 0.2
MAX_RESYNC_ATTEMPTS = 20
REFIT_MARGIN = 0.1  # a worker that hovers at its share is re-snapshotted once this far below it
HOLD_POLLS = 10  # a worker over its share again within this many polls of its re-snapshot hovers


def refit_limit(share: int) -> int:
    """The cache size (blocks) at which a worker hovering at its share is re-snapshotted: at
    least one block and `REFIT_MARGIN` of the share below it."""
    return share - max(1, int(share * REFIT_MARGIN))


@dataclasses.dataclass
class RefitGate:
    """When to re-snapshot a worker over its index share, poll by poll (hysteresis): the first
    time once its cache fits in the share; if it is over the share again within `HOLD_POLLS`
    polls of that snapshot (or the snapshot itself did not fit), it hovers at its share, and
    the next snapshot waits until its cache is `refit_limit` blocks or less, so a worker
    hovering at its share is not snapshotted and dropped on every other poll."""

    refitted: bool = False  # a re-snapshot was asked for, and not yet judged
    num_exact_polls: int = 0  # EXACT polls since that re-snapshot
    hovering: bool = False

    def over_share(self, num_copies: int, share: int) -> bool:
        """At a poll of a worker over its share (no resync running): True to re-snapshot it now."""
        if self.refitted:  # over again after a re-snapshot
            self.hovering, self.refitted = self.num_exact_polls < HOLD_POLLS, False
        if num_copies > (refit_limit(share) if self.hovering else share):
            return False
        self.refitted, self.num_exact_polls = True, 0
        return True

    def exact(self) -> None:
        """At a poll of an EXACT worker: once its re-snapshot held `HOLD_POLLS` polls, it no longer hovers."""
        if self.refitted:
            self.num_exact_polls += 1
            if self.num_exact_polls >= HOLD_POLLS:
                self.refitted = self.hovering = False


@dataclasses.dataclass
class _Stream:
    worker_id: str
    url: str
    endpoint: str
    socket: zmq.asyncio.Socket
    reader: asyncio.Task
    resync: asyncio.Task | None = None
    lagging_seq: int | None = None  # the worker's seq seen ahead of ours at the last poll
    refit: RefitGate = dataclasses.field(default_factory=RefitGate)


class KVFeed:
    def __init__(self, index: KVIndex, secret: str, client: WorkerClient, metrics) -> None:
        self.index = index
        self._key = event_key(secret)
        self._curve = curve_keys(secret)
        self._client = client
        self._metrics = metrics
        self._ctx = zmq.asyncio.Context.instance()
        self._streams: dict[str, _Stream] = {}

    def connect(self, worker_id: str, url: str, info: dict) -> None:
        """Subscribes to a worker's stream (`info`: its `kv_events` answer); raises
        HashingMismatch when it hashes prefixes differently from the router."""
        self.index.check_identity(worker_id, info["hashing"])
        self.index.add_worker(worker_id)
        self._close_stream(worker_id)
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.CURVE_SERVERKEY, self._curve.server_public)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self._curve.client_public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self._curve.client_secret)
        sock.setsockopt(zmq.SUBSCRIBE, TOPIC)
        sock.connect(info["endpoint"])
        stream = _Stream(worker_id, url, info["endpoint"], sock, asyncio.create_task(self._read(worker_id, sock)))
        self._streams[worker_id] = stream
        self.request_resync(worker_id, "subscribed")

    def observe(self, worker_id: str, url: str, info: dict | None) -> None:
        """Called with each poll's `kv_events`: notices restarts and lost trailing batches."""
        if not info:
            return
        stream = self._streams.get(worker_id)
        if stream is None or stream.endpoint != info.get("endpoint"):
            self.index.mark_degraded(worker_id, "new event endpoint (restart)")
            self.connect(worker_id, url, info)
            return
        described = self.index.describe(worker_id) or {}
        if described.get("engine_id") not in (None, info.get("engine_id")):
            self.request_resync(worker_id, "new engine id")
            return
        if described.get("over_share"):  # a snapshot is worth fetching only once the cache fits
            copies = info.get("num_cached_copies")
            resyncing = stream.resync is not None and not stream.resync.done()
            if not resyncing and isinstance(copies, int) and stream.refit.over_share(copies, self.index.share()):
                self.request_resync(worker_id, f"cache of {copies} blocks fits in the share again")
            return
        if described.get("state") == IndexState.EXACT.value:
            stream.refit.exact()
        ours, theirs = described.get("seq", 0), int(info.get("seq", 0))
        # the worker was at `lagging_seq` one poll ago and we still are not: its batches were lost
        if theirs > ours and stream.lagging_seq is not None and ours < stream.lagging_seq:
            self.request_resync(worker_id, f"index at seq {ours}, worker at {theirs}")
        stream.lagging_seq = theirs if theirs > ours else None

    def drop(self, worker_id: str) -> None:
        self._close_stream(worker_id)
        self.index.drop_worker(worker_id)

    async def close(self) -> None:
        for worker_id in list(self._streams):
            self._close_stream(worker_id)

    def request_resync(self, worker_id: str, reason: str) -> None:
        stream = self._streams.get(worker_id)
        if stream is None or (stream.resync is not None and not stream.resync.done()):
            return
        self.index.mark_degraded(worker_id, reason)
        stream.resync = asyncio.create_task(self._resync(stream))

    # -- internals ---------------------------------------------------------
    def _close_stream(self, worker_id: str) -> None:
        stream = self._streams.pop(worker_id, None)
        if stream is None:
            return
        for task in (stream.reader, stream.resync):
            if task is not None:
                task.cancel()
        stream.socket.close(linger=0)

    async def _read(self, worker_id: str, sock: zmq.asyncio.Socket) -> None:
        while True:
            frames = await sock.recv_multipart()
            try:
                batch = decode_batch(self._key, frames)
            except BatchError as exc:
                self._metrics.record_kv_batch(exc.reason)
                logger.warning("kv events from %s: dropped a batch: %s", worker_id, exc)
                continue
            if batch.worker_id != worker_id:
                self._metrics.record_kv_batch("wrong_worker")
                continue
            outcome = self.index.apply(batch)
            self._metrics.record_kv_batch(outcome)
            if outcome in ("gap", "restart"):
                self.request_resync(worker_id, outcome)

    async def _resync(self, stream: _Stream) -> None:
        wid = stream.worker_id
        for attempt in range(MAX_RESYNC_ATTEMPTS):
            described = self.index.describe(wid)
            if described is None:
                return
            after = self.index.resume_seq(wid) if attempt == 0 else None
            path = "/internal/kv_events" + (f"?after={after}" if after is not None else "")
            try:
                answer = await self._client.get_json(stream.url, path, timeout_s=RESYNC_TIMEOUT_S)
                if self.index.resync(wid, answer):
                    self._metrics.record_kv_resync("snapshot" if "snapshot" in answer else "replay")
                    now = self.index.describe(wid)
                    logger.info("kv index: worker %s EXACT again at seq %s", wid,
                                now["seq"] if now is not None else None)
                    return
                if (self.index.describe(wid) or {}).get("over_share"):
                    logger.info("kv index: worker %s stays DEGRADED: its cache is over the index's share", wid)
                    return
            except (WorkerCallError, KeyError, TypeError, ValueError) as exc:
                logger.warning("kv index: resync of %s failed: %s", wid, exc)
            await asyncio.sleep(RESYNC_RETRY_S)
        logger.warning("kv index: worker %s stays DEGRADED after %d resync attempts", wid, MAX_RESYNC_ATTEMPTS)

    async def wait_exact(self, worker_ids, timeout_s: float = 10.0) -> bool:
        """True once every worker in `worker_ids` is EXACT (for start-up and tests)."""
        with contextlib.suppress(asyncio.TimeoutError):
            async with asyncio.timeout(timeout_s):
                while any(self.index.state(w) is not IndexState.EXACT for w in worker_ids):
                    await asyncio.sleep(0.02)
        return all(self.index.state(w) is IndexState.EXACT for w in worker_ids)
