"""Admission control for the router: bounded concurrency and a bounded, timed queue.

`AdmissionGate.acquire(n)` admits a request of `n` prompts when `n` more fit
under the limit and nobody queued before it; otherwise it waits in a FIFO
queue of at most `max_queued` requests for at most `queue_timeout_s`.

Guarantees:
- a request is refused at once with `Overloaded(429)` when the queue is full,
  and with `Overloaded(503)` when its queue wait times out; both carry
  `retry_after_s` for the `Retry-After` header. Nothing waits unboundedly;
- admission is FIFO: a large request at the head is not starved by small ones;
- `release(n)` after every successful `acquire(n)` keeps `num_in_flight`
  exact; a request larger than the whole limit is clamped to the limit (it
  then runs alone) rather than refused forever.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
from collections.abc import Callable


class Overloaded(Exception):
    def __init__(self, status: int, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.status, self.message, self.retry_after_s = status, message, retry_after_s


@dataclasses.dataclass(frozen=True)
class AdmissionLimits:
    max_queued: int
    queue_timeout_s: float
    retry_after_s: int

    def __post_init__(self) -> None:
        if self.max_queued < 0 or self.queue_timeout_s <= 0 or self.retry_after_s < 1:
            raise ValueError(f"bad admission limits: {self}")


class AdmissionGate:
    """`limit()` is read on every decision, so it follows workers joining or dying."""

    def __init__(self, limit: Callable[[], int], limits: AdmissionLimits) -> None:
        self._limit = limit
        self._limits = limits
        self.num_in_flight = 0
        self._queue: collections.deque[tuple[int, asyncio.Future]] = collections.deque()
        self.num_refused = 0
        self.num_timed_out = 0

    @property
    def num_queued(self) -> int:
        return len(self._queue)

    def _clamp(self, n: int) -> int:
        return max(1, min(n, max(1, self._limit())))

    async def acquire(self, n: int) -> int:
        """Admits `n` prompts (clamped); returns the count to pass to `release`."""
        n = self._clamp(n)
        if not self._queue and self.num_in_flight + n <= max(1, self._limit()):
            self.num_in_flight += n
            return n
        lim = self._limits
        if len(self._queue) >= lim.max_queued:
            self.num_refused += 1
            raise Overloaded(429, f"server overloaded: {self.num_in_flight} prompts running and "
                                  f"{len(self._queue)} requests queued; retry later", lim.retry_after_s)
        fut = asyncio.get_running_loop().create_future()
        entry = (n, fut)
        self._queue.append(entry)
        try:
            await asyncio.wait_for(asyncio.shield(fut), lim.queue_timeout_s)
            return n
        except asyncio.TimeoutError:
            self._drop(entry)
            self.num_timed_out += 1
            raise Overloaded(503, f"no capacity within {lim.queue_timeout_s:g}s; retry later",
                             lim.retry_after_s) from None
        except asyncio.CancelledError:  # the client went away while queued
            self._drop(entry)
            raise

    def _drop(self, entry: tuple[int, asyncio.Future]) -> None:
        n, fut = entry
        if fut.done() and not fut.cancelled():  # admitted in the same instant: give the slot back
            self.release(n)
        elif entry in self._queue:
            self._queue.remove(entry)
            fut.cancel()
        self._wake()

    def release(self, n: int) -> None:
        self.num_in_flight = max(0, self.num_in_flight - n)
        self._wake()

    def _wake(self) -> None:
        limit = max(1, self._limit())
        while self._queue:
            n, fut = self._queue[0]
            if fut.done():
                self._queue.popleft()
                continue
            if self.num_in_flight + n > limit:
                return
            self._queue.popleft()
            self.num_in_flight += n
            fut.set_result(None)
