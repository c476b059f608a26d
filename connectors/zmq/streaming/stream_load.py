"""KV streaming, consumer side: one streamed load while its producer still prefills.

The load knows its destination blocks by (group, position) (`wanted`: the
positions past this engine's own prefix hit, window-clipped, from the scheduler
half) but not the producer's block ids: those come with each PUBLISHED. Every
part (the wanted blocks a publication names that were not asked for yet) is
pulled at once as an ordinary PULL on the session's data streams, so the
pages and their digests travel, and are verified, exactly as in a whole load.

The load ends (exactly once, as a `LoadResult`) when the producer said its
prefill is over (`final`) and no part is in flight; wanted blocks that were
never published are then reported invalid. Its deadline is a progress
deadline: `transfer_timeout_s` from the last publication (or from the start).
"""
from __future__ import annotations

import queue
import threading
import time
from typing import TYPE_CHECKING, Any

from connectors.metrics import FailureCause
from connectors.zmq.consumer.loads import LoadHandle, RemoteAddr

if TYPE_CHECKING:
    from connectors.pages import KVPages
    from connectors.zmq.consumer.consumer_config import ConsumerConfig


class StreamedLoad(LoadHandle):
    __slots__ = ("wanted", "asked", "final", "timeout_s", "num_parts")

    def __init__(self, request_id: str, remote: RemoteAddr, remote_request_id: str,
                 wanted: dict[tuple[int, int], int], timeout_s: float, trace_context: str | None = None):
        super().__init__(request_id, remote, remote_request_id, [], list(wanted.values()),
                         time.monotonic() + timeout_s, trace_context=trace_context)
        self.wanted = wanted  # (group, position) -> destination block id
        self.asked: set[tuple[int, int]] = set()
        self.final = False
        self.timeout_s = timeout_s
        self.num_parts = 0  # parts pulled so far (publications that named a wanted block)

    def take(self, msg: dict) -> tuple[list[int], list[int]]:
        """(src, dst) of the wanted blocks a PUBLISHED names for the first time; the progress
        deadline moves on. A position named twice keeps its first block."""
        self.deadline = time.monotonic() + self.timeout_s
        src, dst = [], []
        for key, block_id in zip(zip(msg["groups"], msg["positions"], strict=True), msg["block_ids"], strict=True):
            d = self.wanted.get(key)
            if d is not None and key not in self.asked and block_id > 0:
                self.asked.add(key)
                src.append(block_id)
                dst.append(d)
        if msg["final"]:
            self.final = True
        if src:
            self.num_parts += 1
        return src, dst

    def settled(self) -> bool:
        return self.final or self.cause is not None

    def unfilled(self) -> list[int]:
        return [d for key, d in self.wanted.items() if key not in self.asked]


class StreamLoads:
    """The consumer's streamed loads (`Consumer` mixes this in; its lock, tables and threads)."""

    config: ConsumerConfig
    pool: KVPages
    _lock: threading.Lock
    _active: dict[int, LoadHandle]
    _streamed: dict[tuple[RemoteAddr, str], StreamedLoad]
    _inbox: queue.SimpleQueue

    def _wake(self) -> None: ...
    def _fail_locked(self, job: LoadHandle, cause: FailureCause) -> None: ...
    def _finish_locked(self, job: LoadHandle) -> None: ...
    def _send_parts(self, session: Any, job: LoadHandle, all_src: list[int], all_dst: list[int]) -> None: ...

    def load_streamed(self, request_id: str, remote: RemoteAddr, remote_request_id: str,
                      wanted: dict[tuple[int, int], int], trace_context: str | None = None) -> StreamedLoad:
        """Starts a streamed load (`stream_load.py`): WATCHes the producer's request and pulls each
        part it publishes into `wanted` ((group, position) -> destination block)."""
        dst = list(wanted.values())
        if not dst or len(set(dst)) != len(dst) or not all(0 < b < self.pool.num_blocks for b in dst):
            raise ValueError(f"bad block ids for {request_id}")
        job = StreamedLoad(request_id, remote, remote_request_id, dict(wanted), self.config.transfer_timeout_s,
                           trace_context)
        with self._lock:
            self._active[id(job)] = job
            self._streamed[(remote, remote_request_id)] = job
        self._inbox.put(("load", job))
        self._wake()
        return job

    def cancel(self, request_id: str) -> None:
        """Ends a streamed load of `request_id` now (its request was aborted here)."""
        with self._lock:
            for job in [j for j in self._streamed.values() if j.request_id == request_id]:
                job.cause = job.cause or FailureCause.SHUTDOWN
                if job.parts_left == 0:
                    self._fail_locked(job, FailureCause.SHUTDOWN)

    def _on_published(self, session: Any, msg: dict) -> None:
        with self._lock:
            job = self._streamed.get((session.remote, msg["request_id"]))
            if job is None or job.result is not None:
                return
            if not msg["ok"]:  # the prefill ended badly on the producer
                job.cause = job.cause or FailureCause.PEER_GONE
            src, dst = job.take(msg)
            if src and job.cause is None:
                self._send_parts(session, job, src, dst)
            if job.parts_left == 0 and job.settled():
                self._finish_locked(job)

