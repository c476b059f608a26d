"""What a load is: where it comes from, its handle while in flight, and its result."""
from __future__ import annotations

import dataclasses
import threading
import time

from connectors.metrics import FailureCause


@dataclasses.dataclass(frozen=True)
class RemoteAddr:
    """A producer's side channel, named by its engine id."""

    engine_id: str
    host: str
    port: int


@dataclasses.dataclass
class LoadResult:
    """How a load ended: `ok` (every page landed and verified) or the blocks not to trust."""

    request_id: str
    ok: bool
    invalid_block_ids: list[int]
    cause: FailureCause | None
    num_bytes: int
    seconds: float


class Done:
    """A one-shot event with `threading.Event`'s wait / set / is_set that costs one lock to
    make (an Event builds a Condition: microseconds on a load's latency path). Set at most
    once, under the consumer's lock."""

    __slots__ = ("_lock", "_set")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()  # held until set(): waiters block on it
        self._set = False

    def set(self) -> None:
        if not self._set:
            self._set = True
            self._lock.release()

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout: float | None = None) -> bool:
        if self._set:
            return True
        if self._lock.acquire(timeout=-1 if timeout is None else max(0.0, timeout)):
            self._lock.release()  # let the next waiter through
            return True
        return self._set


class LoadHandle:
    """One load in flight; `done` is set once `result` is final (exactly once)."""

    __slots__ = ("request_id", "remote", "remote_request_id", "src", "dst", "deadline", "start", "parts_left",
                 "streams", "bad", "cause", "done", "result", "warm", "trace_context")

    def __init__(self, request_id, remote, remote_request_id, src, dst, deadline, start: float | None = None,
                 trace_context: str | None = None):
        self.request_id = request_id
        self.remote = remote
        self.remote_request_id = remote_request_id
        self.src, self.dst = src, dst
        self.deadline = deadline
        self.start = time.perf_counter() if start is None else start  # when load() was called
        self.parts_left = 0
        self.streams: list = []  # the PullStreams carrying its parts (loads sit below streams)
        self.bad: list[int] = []
        self.cause: FailureCause | None = None
        self.done = Done()
        self.result: LoadResult | None = None
        self.warm = False  # its session was ready when it started: no handshake inside its time
        self.trace_context = trace_context  # opaque, into each of its PULLs (`connectors.params.KV_TRACE_CONTEXT_KEY`)

    def settled(self) -> bool:
        """Whether it may end once no part is in flight (a streamed load waits for its last part)."""
        return True

    def unfilled(self) -> list[int]:
        """Destination blocks no part was asked to fill (a streamed load's unpublished ones)."""
        return []
