"""On-demand worker polls (`GET /pd/workers?refresh=1`), paced and shared.

`RefreshLimiter.refresh()` returns once a poll that started after the call
arrived has finished, so its caller always reads figures at least as new as
its own request. Guarantees:
- at most one poll starts per `min_interval_s`: a call inside the interval
  waits for the next slot; every call waiting for a slot joins the same poll;
- at most `max_waiting` calls wait at once; one more raises `RefreshBusy`
  (the router answers 429 with `Retry-After`);
- a caller that goes away never cancels the poll the others wait on.
Whether a poll may take a worker out is the poll's business (the router's
on-demand polls never do).
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Coroutine
from typing import Any

logger = logging.getLogger(__name__)

MAX_WAITING_REFRESHES = 16


class RefreshBusy(Exception):
    """Too many refreshes are waiting; retry after `retry_after_s`."""

    def __init__(self, retry_after_s: int) -> None:
        super().__init__(f"too many refreshes waiting; retry after {retry_after_s}s")
        self.retry_after_s = retry_after_s


class RefreshLimiter:
    def __init__(self, poll: Callable[[], Coroutine[Any, Any, None]], min_interval_s: float = 1.0,
                 max_waiting: int = MAX_WAITING_REFRESHES, clock: Callable[[], float] = time.monotonic) -> None:
        if min_interval_s < 0 or max_waiting < 1:
            raise ValueError("min_interval_s must be >= 0 and max_waiting >= 1")
        self._poll = poll
        self._min_interval_s = min_interval_s
        self._max_waiting = max_waiting
        self._clock = clock
        self._task: asyncio.Task | None = None
        self._task_started = -math.inf
        self.num_waiting = 0
        self.num_polls = 0
        self.last_started = -math.inf  # clock time the last poll started

    async def refresh(self) -> float:
        """Waits for a poll that started after this call; returns that poll's start (clock time)."""
        if self.num_waiting >= self._max_waiting:
            raise RefreshBusy(max(1, math.ceil(self._min_interval_s)))
        self.num_waiting += 1
        try:
            arrived = self._clock()
            while True:
                task = self._task
                if task is not None:
                    started = self._task_started
                    await asyncio.shield(task)
                    if started >= arrived:
                        return started
                    continue  # it started before this call: its figures may predate our request
                delay = self.last_started + self._min_interval_s - self._clock()
                if delay > 0:
                    await asyncio.sleep(delay)
                    continue
                self._start()
        finally:
            self.num_waiting -= 1

    def _start(self) -> None:
        self.last_started = self._task_started = self._clock()
        self.num_polls += 1
        self._task = asyncio.get_running_loop().create_task(self._poll())
        self._task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task) -> None:
        self._task = None
        if not task.cancelled() and task.exception() is not None:
            logger.warning("on-demand worker poll failed: %r", task.exception())
