"""A worker's KV event stream: what enters and leaves its prefix cache, over ZMQ PUB.

`KVEventPublisher` takes each engine step's kvcache events (BlockStored,
BlockRemoved, AllBlocksCleared), turns them into one batch with the next
sequence number and the engine id, signs it (`pd.cluster.kv_wire`) and
publishes it. The last `history_batches` batches stay in a ring, so a
subscriber that missed some asks `replay(after_seq)`; when the history no
longer reaches back that far, it gets a snapshot of every cached hash instead.

Guarantees:
- sequence numbers start at 1 and grow by one per batch, with no holes;
- `publish` never blocks the engine thread (PUB drops for slow subscribers;
  the ring and replay heal that);
- a snapshot is taken between steps, so `(seq, hashes)` describe one state.
"""
from __future__ import annotations

import collections
import logging
import threading
from typing import Any

import zmq

from kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored
from pd.cluster.kv_wire import EventBatch, encode_batch, event_key

logger = logging.getLogger(__name__)

DEFAULT_HISTORY_BATCHES = 4096
SEND_HWM = 10_000


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
                 history_batches: int = DEFAULT_HISTORY_BATCHES) -> None:
        self.worker_id = worker_id
        self.engine_id = engine_id
        self._key = event_key(secret)
        self._lock = threading.Lock()  # guards the socket, seq and the ring
        self._history: collections.deque[tuple[int, list]] = collections.deque(maxlen=history_batches)
        self.seq = 0
        self.num_events = 0
        self._ctx: zmq.Context = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PUB)
        self._sock.setsockopt(zmq.SNDHWM, SEND_HWM)
        self._sock.setsockopt(zmq.LINGER, 0)
        port = self._sock.bind_to_random_port(f"tcp://{host}")
        self.endpoint = f"tcp://{host}:{port}"

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
            self._history.append((self.seq, wire))
            frames = encode_batch(self._key, EventBatch(self.engine_id, self.worker_id, self.seq, wire))
            try:
                self._sock.send_multipart(frames, flags=zmq.NOBLOCK)
            except zmq.Again:  # no room for a slow subscriber: it will see the gap and replay
                logger.debug("kv event batch %d not sent (queue full)", self.seq)

    def replay(self, after_seq: int) -> list[tuple[int, list]] | None:
        """Batches with seq > `after_seq`, or None when the ring no longer holds them all."""
        with self._lock:
            if after_seq >= self.seq:
                return []
            if not self._history or self._history[0][0] > after_seq + 1:
                return None
            return [(s, ev) for s, ev in self._history if s > after_seq]

    def snapshot_answer(self, hashes_by_group: dict[int, list[bytes]]) -> dict[str, Any]:
        """Called between steps with the live cache: the snapshot at the current seq."""
        with self._lock:
            return {"seq": self.seq, "groups": {str(g): [h.hex() for h in hs] for g, hs in hashes_by_group.items()}}

    def info(self) -> dict[str, Any]:
        return {"endpoint": self.endpoint, "engine_id": self.engine_id, "seq": self.seq,
                "num_events": self.num_events}

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close(linger=0)
                self._sock = None


def replay_answer(publisher: KVEventPublisher, engine, after_seq: int | None) -> dict[str, Any]:
    """The replay endpoint's JSON: the batches after `after_seq`, else (or when `after_seq` is
    None) a snapshot of every cached hash. Hashes are hex."""
    base = {"engine_id": publisher.engine_id, "worker_id": publisher.worker_id}
    batches = publisher.replay(after_seq) if after_seq is not None else None
    if batches is not None:
        wire = [{"seq": s, "events": [[k, g, [h.hex() for h in hs]] for k, g, hs in ev]} for s, ev in batches]
        return {**base, "seq": publisher.seq, "batches": wire}
    return {**base, "snapshot": engine.kv_snapshot(publisher.snapshot_answer)}
