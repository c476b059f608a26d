"""Finding which request made a step fail, so that only it fails.

A forward pass (or anything else the engine runs per chunk) that raises is
retried chunk by chunk, in batch order: chunks that succeed alone keep their
results and go on in the same step; chunks that fail alone are the cause and
fail with the error. Retrying is safe because a chunk writes K/V only into the
slots of its own positions, so running it again writes the same values, and
a failed step advanced nothing.

Also here: the engine's fault points (`engine.step`: a step computing a
marked request raises inside the isolation, as a bad input would;
`engine.loop`: it raises outside it, as a bug in the loop would, and the loop
dies). A marked request is named by id, so an unmarked one never sees them.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

from pd.engine.sched.output import ScheduledChunk

logger = logging.getLogger(__name__)

STEP = "step"
LOOP = "loop"


class InjectedStepFailure(RuntimeError):
    """Raised by a fault point (tests and fault plans only)."""


class FaultMarks:
    """Request ids marked to fail at a point (`STEP` or `LOOP`); thread-safe, empty by default."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._marks: dict[str, str] = {}

    def mark(self, request_id: str, where: str) -> None:
        if where not in (STEP, LOOP):
            raise ValueError(f"unknown engine fault point {where!r}")
        with self._lock:
            self._marks[request_id] = where

    def forget(self, request_id: str) -> None:
        if self._marks:
            with self._lock:
                self._marks.pop(request_id, None)

    def check(self, chunks: Sequence[ScheduledChunk], where: str) -> None:
        """Raises InjectedStepFailure when a chunk of a request marked for `where` is in `chunks`."""
        if not self._marks:
            return
        with self._lock:
            marked = [c.request_id for c in chunks if self._marks.get(c.request_id) == where]
        if marked:
            raise InjectedStepFailure(f"fault injection: engine.{where} failed for request {marked[0]}")


def describe(exc: BaseException) -> str:
    return f"engine step failed for this request: {type(exc).__name__}: {exc}"


def uncomputed_block_ids(chunk: ScheduledChunk, block_size: int) -> set[int]:
    """The blocks a chunk writes into (from its first position's block on; never the null block 0).
    Blocks before it hold KV computed earlier, and may be shared prefix hits."""
    first = chunk.start // block_size
    return {b for ids in chunk.block_ids for b in ids[first:] if b}


def execute_isolated(run: Callable[[list[ScheduledChunk]], dict[str, int]], chunks: list[ScheduledChunk],
                     block_size: int) -> tuple[dict[str, int], dict[str, str]]:
    """`run(chunks)` -> (sampled tokens, {}); if it raises, each chunk alone: (the tokens of those
    that ran, {request id: error} of those that failed). Only Exception is caught: a
    KeyboardInterrupt or SystemExit still ends the loop."""
    try:
        return run(chunks), {}
    except Exception as exc:  # noqa: BLE001 - attributed below
        if len(chunks) == 1:
            logger.exception("step failed for request %s", chunks[0].request_id)
            return {}, {chunks[0].request_id: describe(exc)}
        logger.warning("a step of %d chunks failed (%s: %s); running them one by one", len(chunks),
                       type(exc).__name__, exc)
    sampled: dict[str, int] = {}
    failed: dict[str, str] = {}
    for chunk in chunks:
        try:
            sampled.update(run([chunk]))
        except Exception as exc:  # noqa: BLE001 - this chunk is a cause
            logger.exception("step failed for request %s", chunk.request_id)
            failed[chunk.request_id] = describe(exc)
    bad_blocks: set[int] = set()
    for chunk in chunks:
        if chunk.request_id in failed:
            bad_blocks |= uncomputed_block_ids(chunk, block_size)
    for chunk in chunks:  # read pages a failed chunk should have written (a same-step prefix hit): garbage too
        if chunk.request_id not in failed and bad_blocks & {b for ids in chunk.block_ids for b in ids}:
            sampled.pop(chunk.request_id, None)
            failed[chunk.request_id] = "engine step failed for a request whose KV blocks this one shares"
    return sampled, failed
