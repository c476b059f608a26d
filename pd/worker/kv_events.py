"""A worker's KV event stream: what enters and leaves its prefix cache, over ZMQ PUB.

`KVEventPublisher` takes each engine step's kvcache events (BlockStored,
BlockRemoved, AllBlocksCleared), turns them into one batch with the next
sequence number and the engine id, signs it (`pd.cluster.kv_wire`) and
publishes it. The last `history_batches` batches stay in a ring, so a
subscriber that missed some asks `replay(after_seq)`; when the history no
longer reaches back that far, it gets a snapshot of every cached hash instead.
Every `heartbeat_s` a signed heartbeat carries the latest seq, so a subscriber
that lost the last batches knows within one heartbeat, even when the worker
then goes idle.

Events are the block pool's, as vLLM emits them: one "stored" per cached copy
of a hash and one "removed" per copy that leaves, so a hash held by two blocks
is stored twice and stays cached until it is removed twice. Subscribers count
copies (`pd.router.kv_index`); a snapshot lists a hash once per copy.

The socket is an XPUB with ZMQ CURVE: nobody without the deployment secret
completes the handshake (`pd.worker.kv_gate`: the ZAP handler admits only the
client key derived from the secret), at most `max_subscribers` are admitted,
and each one is owed at most `SEND_HWM` queued batches plus `SEND_BUFFER_BYTES`
of kernel buffer: ZMQ stops feeding a subscriber that does not read (it drops
that subscriber's batches), and the subscriber heals the gap by replay.

Guarantees:
- sequence numbers start at 1 and grow by one per batch, with no holes;
- `publish` never blocks the engine thread;
- a snapshot is taken between steps, so `(seq, hashes)` describe one state;
- memory owed to subscribers is at most `max_subscribers * (SEND_HWM batches
  + SEND_BUFFER_BYTES)`, whatever they do.
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any

import zmq

from connectors.metrics import TransferMetrics
from connectors.zmq.control.side_guard import SideChannelGuard
from kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored
from pd.cluster.kv_wire import EventBatch, curve_keys, encode_batch, encode_heartbeat, event_key
from pd.worker.kv_gate import ZAP_DOMAIN, SubscriberGate

logger = logging.getLogger(__name__)

DEFAULT_HISTORY_BATCHES = 4096
DEFAULT_MAX_SUBSCRIBERS = 8  # the router, and a few tools
DEFAULT_HEARTBEAT_S = 0.5
SEND_HWM = 64  # batches queued per subscriber; past it ZMQ drops that subscriber's batches
SEND_BUFFER_BYTES = 128 * 1024  # kernel send buffer per subscriber (no autotuning to megabytes)
HANDSHAKE_TIMEOUT_MS = 5000  # a peer that does not finish the CURVE handshake is closed by then
GATE_TICK_S = 0.05
MAX_CONNECTIONS = 64  # TCP connections at once, handshaking or not (libzmq itself has no cap)


def events_to_wire(events: list) -> list:
    """kvcache events -> `[[kind, group, [hashes]]]` (the wire's compact form)."""
    out = []
    for ev in events:
        if isinstance(ev, BlockStored):
            out.append(["stored", ev.group_idx or 0, list(ev.block_hashes)])
        elif isinstance(ev, BlockRemoved):
            out.append(["removed", ev.group_idx or 0, list(ev.block_hashes)])
        elif isinstance(ev, AllBlocksCleared):
            out.append(["cleared", -1, []])
    return out


class KVEventPublisher:
    def __init__(self, worker_id: str, engine_id: str, secret: str, host: str,
                 history_batches: int = DEFAULT_HISTORY_BATCHES, max_subscribers: int = DEFAULT_MAX_SUBSCRIBERS,
                 heartbeat_s: float = DEFAULT_HEARTBEAT_S) -> None:
        self.worker_id = worker_id
        self.engine_id = engine_id
        self.heartbeat_s = heartbeat_s
        self._key = event_key(secret)
        self._lock = threading.Lock()  # guards the sockets, seq and the ring
        self._history: collections.deque[tuple[int, list]] = collections.deque(maxlen=history_batches)
        self.seq = 0
        self.num_events = 0
        self.num_cached_copies = 0  # blocks in the prefix cache, as the events published so far say
        keys = curve_keys(secret)
        self._ctx: zmq.Context = zmq.Context()  # its own: a ZAP handler serves one context
        self._gate = SubscriberGate(self._ctx, keys.client_public, max_subscribers)
        xpub = self._ctx.socket(zmq.XPUB)
        xpub.setsockopt(zmq.XPUB_VERBOSER, 1)  # every (un)subscribe reaches us: the subscriber count
        xpub.setsockopt(zmq.SNDHWM, SEND_HWM)
        xpub.setsockopt(zmq.SNDBUF, SEND_BUFFER_BYTES)
        xpub.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_TIMEOUT_MS)
        xpub.setsockopt(zmq.LINGER, 0)
        xpub.setsockopt(zmq.CURVE_SERVER, 1)
        xpub.setsockopt(zmq.CURVE_SECRETKEY, keys.server_secret)
        xpub.setsockopt(zmq.CURVE_PUBLICKEY, keys.server_public)
        xpub.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
        port = xpub.bind_to_random_port(f"tcp://{host}")
        self.endpoint = f"tcp://{host}:{port}"
        # the producer's guard for its ROUTER: a cap on connections (a stranger's handshake holds an fd
        # for up to HANDSHAKE_TIMEOUT_MS) and no busy accept loop at the fd limit
        self._conn_guard = SideChannelGuard(xpub, self.endpoint, port, MAX_CONNECTIONS, TransferMetrics())
        self._xpub: zmq.Socket | None = xpub  # reads the subscriptions
        self._sock: zmq.Socket | None = xpub  # sends (tests may swap it to lose batches)
        self._stop = threading.Event()
        self._next_heartbeat = time.monotonic()
        self._thread = threading.Thread(target=self._run_gate, name=f"kv-events-{worker_id}", daemon=True)
        self._thread.start()

    def publish(self, events: list) -> None:
        """One batch for one step's events (called on the engine's step thread)."""
        wire = events_to_wire(events)
        if not wire:
            return
        with self._lock:
            if self._sock is None:
                return
            self.seq += 1
            self.num_events += len(wire)
            for kind, _, hashes in wire:
                self.num_cached_copies = 0 if kind == "cleared" else \
                    self.num_cached_copies + (len(hashes) if kind == "stored" else -len(hashes))
            self._history.append((self.seq, wire))
            frames = encode_batch(self._key, EventBatch(self.engine_id, self.worker_id, self.seq, wire))
            try:
                self._sock.send_multipart(frames, flags=zmq.NOBLOCK)
            except zmq.Again:  # no room for a slow subscriber: it will see the gap and replay
                logger.debug("kv event batch %d not sent (queue full)", self.seq)

    def _run_gate(self) -> None:
        """The gate thread: ZAP answers, the subscriber count, heartbeats."""
        try:
            while not self._stop.is_set():
                self._gate.serve(GATE_TICK_S)
                with self._lock:
                    if self._xpub is None or self._sock is None:
                        return
                    self._conn_guard.poll_events()
                    self._conn_guard.tick()
                    self._read_subscriptions(self._xpub)
                    now = time.monotonic()
                    if now >= self._next_heartbeat:
                        self._next_heartbeat = now + self.heartbeat_s
                        frames = encode_heartbeat(self._key, self.engine_id, self.worker_id, self.seq)
                        try:
                            self._sock.send_multipart(frames, flags=zmq.NOBLOCK)
                        except zmq.Again:
                            pass
        except zmq.ZMQError as exc:  # the context is going away
            if not self._stop.is_set():
                logger.exception("kv events: gate thread of %s stopped: %s", self.worker_id, exc)

    def _read_subscriptions(self, xpub: zmq.Socket) -> None:
        for _ in range(1024):
            try:
                self._gate.on_subscription(xpub.recv(zmq.NOBLOCK))
            except zmq.Again:
                return

    def replay(self, after_seq: int) -> list[tuple[int, list]] | None:
        """Batches with seq > `after_seq`, or None when the ring no longer holds them all."""
        with self._lock:
            if after_seq >= self.seq:
                return []
            if not self._history or self._history[0][0] > after_seq + 1:
                return None
            return [(s, ev) for s, ev in self._history if s > after_seq]

    def snapshot_answer(self, hashes_by_group: dict[int, list[bytes]]) -> dict[str, Any]:
        """Called between steps with the live cache (a hash once per copy): the snapshot at the current seq."""
        with self._lock:
            return {"seq": self.seq, "groups": {str(g): [h.hex() for h in hs] for g, hs in hashes_by_group.items()}}

    def info(self) -> dict[str, Any]:
        return {"endpoint": self.endpoint, "engine_id": self.engine_id, "seq": self.seq,
                "num_events": self.num_events, "num_cached_copies": self.num_cached_copies,
                "auth": "curve", "heartbeat_s": self.heartbeat_s,
                "num_subscribers": self._gate.num_subscribers, "max_subscribers": self._gate.max_subscribers,
                "num_refused_subscribers": self._gate.num_refused}

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)
        with self._lock:
            if self._xpub is not None:
                self._conn_guard.close()
                self._xpub.close(linger=0)
            if self._sock is not None and self._sock is not self._xpub:
                self._sock.close(linger=0)
            self._xpub = self._sock = None
        if not self._thread.is_alive():  # its socket may be closed only by it or after it
            self._gate.close()
            self._ctx.term()


def cached_copies(engine, groups) -> dict[int, list[bytes]]:
    """{group: [hash, once per cached copy]} of the engine's block pool; call it where the
    engine's step lock is held (inside `engine.kv_snapshot`)."""
    out: dict[int, list[bytes]] = {g: [] for g in groups}
    for gid, block_hash, _ in engine.kv_cache_manager.block_pool.iter_cached():
        out.setdefault(gid, []).append(block_hash)
    return out


def replay_answer(publisher: KVEventPublisher, engine, after_seq: int | None) -> dict[str, Any]:
    """The replay endpoint's JSON: the batches after `after_seq`, else (or when `after_seq` is
    None) a snapshot of every cached hash. Hashes are hex."""
    base = {"engine_id": publisher.engine_id, "worker_id": publisher.worker_id}
    batches = publisher.replay(after_seq) if after_seq is not None else None
    if batches is not None:
        wire = [{"seq": s, "events": [[k, g, [h.hex() for h in hs]] for k, g, hs in ev]} for s, ev in batches]
        return {**base, "seq": publisher.seq, "batches": wire}
    return {**base, "snapshot": engine.kv_snapshot(
        lambda groups: publisher.snapshot_answer(cached_copies(engine, groups)))}
