"""Finding which request made a step fail, so that only it fails.

A forward pass (or anything else the engine runs per chunk) that raises is
retried chunk by chunk, in batch order: chunks that succeed alone keep their
results and go on in the same step; chunks that fail alone are the cause and
fail with the error. Retrying is safe because a chunk writes K/V only into the
slots of its own positions, so running it again writes the same values, and
a failed step advanced nothing. This module only finds the causes: what their
failure does to the pool and to other requests (those sharing the blocks a
failed chunk was writing fail too) is the scheduler's one rule,
`Scheduler.fail_chunks`.

A device fault is different (`is_device_fault`: CUDA out of memory, an
illegal memory access, a device-side assert, any CUDA error): on a GPU it
poisons the process, so nothing is retried. Every request of the step fails
with it, its blocks are freed as for any failed chunk, and the engine's
`FaultMarks` latch it (`device_fault`): the next step's loop check raises it,
so the loop ends before anything runs on that device again, and the worker
(which watches the latch) reports itself unhealthy and restarts its process.

Also here: the engine's fault points (`engine.step`: a step computing a
marked request raises inside the isolation, as a bad input would;
`engine.loop`: it raises outside it, as a bug in the loop would, and the loop
dies; `engine.device_oom` / `engine.device_error`: the step raises the
exceptions torch raises for CUDA out of memory and an illegal memory access).
A marked request is named by id, so an unmarked one never sees them.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

from pd.engine.sched.output import ScheduledChunk

logger = logging.getLogger(__name__)

STEP = "step"
LOOP = "loop"
DEVICE_OOM = "device_oom"
DEVICE_ERROR = "device_error"
PERTURB_KV = "perturb_kv"  # not a failure: P sends this request's KV shifted (`pd.engine.runner.kv_audit`)
POINTS = (STEP, LOOP, DEVICE_OOM, DEVICE_ERROR, PERTURB_KV)

# What torch says when a CUDA call failed, for builds that raise a plain RuntimeError
_DEVICE_FAULT_TEXTS = ("CUDA error", "CUDA out of memory", "device-side assert", "illegal memory access",
                       "CUBLAS_STATUS_", "CUDNN_STATUS_", "NCCL error")


class InjectedStepFailure(RuntimeError):
    """Raised by a fault point (tests and fault plans only)."""


class DeviceFault(RuntimeError):
    """A step failed on the device: this engine must not step again (a CUDA error poisons its process).
    `request_ids`: the requests of that step, each failed with `describe_device_fault(cause)`."""

    def __init__(self, cause: BaseException, request_ids: Sequence[str]) -> None:
        super().__init__(f"device fault in a step of {len(request_ids)} request(s): {type(cause).__name__}: {cause}")
        self.cause_text = f"{type(cause).__name__}: {cause}"
        self.request_ids = frozenset(request_ids)


def is_device_fault(exc: BaseException) -> bool:
    """True for the errors torch raises when the device failed (out of memory included)."""
    import torch  # (the engine has it loaded; this module stays importable without a device)

    kinds = tuple(k for k in (getattr(torch, "OutOfMemoryError", None), getattr(torch, "AcceleratorError", None),
                              getattr(torch.cuda, "OutOfMemoryError", None), getattr(torch.cuda, "CudaError", None))
                  if isinstance(k, type))
    if isinstance(exc, kinds):
        return True
    return isinstance(exc, RuntimeError) and any(text in str(exc) for text in _DEVICE_FAULT_TEXTS)


def _injected_device_fault(where: str, request_id: str) -> RuntimeError:
    """The exception torch raises for that CUDA failure (AcceleratorError exists from torch 2.8 on)."""
    import torch

    if where == DEVICE_OOM:
        return torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate 20.00 GiB (fault injection: "
                                      f"engine.device_oom for request {request_id})")
    kind = getattr(torch, "AcceleratorError", RuntimeError)
    return kind(f"CUDA error: an illegal memory access was encountered (fault injection: engine.device_error "
                f"for request {request_id})")


_running = threading.local()  # the FaultMarks of the step this thread runs (set by its STEP check)


class FaultMarks:
    """The engine's checks in each step: request ids marked to fail at a point (`POINTS`), and the
    device-fault latch (`device_fault`, set once a step failed on the device; from then on the loop
    check raises it). Thread-safe; no marks and no latch by default."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._marks: dict[str, str] = {}
        self.device_fault: DeviceFault | None = None

    def mark(self, request_id: str, where: str) -> None:
        if where not in POINTS:
            raise ValueError(f"unknown engine fault point {where!r}")
        with self._lock:
            self._marks[request_id] = where

    def forget(self, request_id: str) -> None:
        if self._marks:
            with self._lock:
                self._marks.pop(request_id, None)

    @property
    def has_marks(self) -> bool:
        return bool(self._marks)

    def is_marked(self, request_id: str, where: str) -> bool:
        if not self._marks:
            return False
        with self._lock:
            return self._marks.get(request_id) == where

    def check(self, chunks: Sequence[ScheduledChunk], where: str) -> None:
        """`LOOP` (once a step, before it computes): raises the latched DeviceFault, or
        InjectedStepFailure for a chunk marked `loop`. `STEP` (inside the isolation, before the
        forward): raises InjectedStepFailure, or the device error, for a chunk marked so."""
        if where == LOOP and self.device_fault is not None:
            raise self.device_fault
        if where == STEP:
            _running.marks = self
        if not self._marks:
            return
        with self._lock:
            marked = [(c.request_id, self._marks[c.request_id]) for c in chunks if c.request_id in self._marks]
        for request_id, point in marked:
            if point == where:
                raise InjectedStepFailure(f"fault injection: engine.{where} failed for request {request_id}")
            if where == STEP and point in (DEVICE_OOM, DEVICE_ERROR):
                raise _injected_device_fault(point, request_id)


def describe(exc: BaseException) -> str:
    return f"engine step failed for this request: {type(exc).__name__}: {exc}"


def describe_device_fault(exc: BaseException) -> str:
    return (f"the worker's device failed in the step that computed this request ({type(exc).__name__}: {exc}); "
            "the worker restarts, retry the request")


def _device_fault(exc: BaseException, chunks: list[ScheduledChunk]) -> tuple[dict[str, int], dict[str, str]]:
    """Every request of the step fails (no retry on a poisoned device); the engine's marks latch it."""
    ids = [c.request_id for c in chunks]
    logger.error("device fault in a step of %d request(s): %s: %s; failing them, the engine stops stepping",
                 len(ids), type(exc).__name__, exc)
    marks = getattr(_running, "marks", None)
    if marks is not None:
        marks.device_fault = DeviceFault(exc, ids)
    else:  # the run never passed its STEP check: nothing to latch on (the requests still fail)
        logger.warning("device fault outside a checked step: the engine is not stopped")
    return {}, {rid: describe_device_fault(exc) for rid in ids}


def execute_isolated(run: Callable[[list[ScheduledChunk]], dict[str, int]], chunks: list[ScheduledChunk]
                     ) -> tuple[dict[str, int], dict[str, str]]:
    """`run(chunks)` -> (sampled tokens, {}); if it raises, each chunk alone: (the tokens of those
    that ran, {request id: error} of those that failed alone, in chunk order). Only Exception is
    caught: a KeyboardInterrupt or SystemExit still ends the loop. A device fault fails every chunk
    at once."""
    _running.marks = None
    try:
        return run(chunks), {}
    except Exception as exc:  # noqa: BLE001 - attributed below
        if is_device_fault(exc):
            return _device_fault(exc, chunks)
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
            if is_device_fault(exc):
                return _device_fault(exc, chunks)
            logger.exception("step failed for request %s", chunk.request_id)
            failed[chunk.request_id] = describe(exc)
    return sampled, failed
