"""Batched page copies between a page pool and host memory, and the CUDA
stream ordering around them.

Copy planning (any device, tested on CPU): a list of block ids becomes
contiguous runs; a few runs are copied as a few slice copies (no index tensor,
no temporary), many runs as one device-side index gather (or scatter) plus one
host<->device copy. Never one tiny copy per block when many blocks move.

CUDA ordering (per pool, see `StreamFences`):
- producer: the engine records an event on its compute stream after every
  forward (`mark_written`); a transfer thread's side stream waits on the
  latest such event before reading pages device-to-host, so the model's
  stream never waits for a transfer and a transfer never reads half-written
  pages;
- consumer: host-to-device copies run on the side stream and record a
  "landed" event; the engine's compute stream waits on every landed event
  (`order_reads_after_landing`) before the pages can be read by a forward.

Only transfer threads ever block on the host (on their own side stream's
events, e.g. before a pinned staging half is refilled); the engine thread
never calls a synchronize here.

`connectors.zmq.paths.staging_ring.StagingRing` owns one transfer thread's pinned
staging slots and side stream; `HostPin` page-locks memory this process did not
allocate as pinned (a shared-memory segment), so copies to and from it are DMA.
"""
from __future__ import annotations

import dataclasses
import threading
import weakref

import torch

MAX_RUN_COPIES = 8  # above this many contiguous runs, one index gather/scatter beats slice copies


@dataclasses.dataclass(frozen=True)
class CopyPlan:
    """How `num_pages` pages move: `runs` of (first block id, first row, count) in
    row order, copied one slice each unless `use_index` (one gather/scatter)."""

    runs: tuple[tuple[int, int, int], ...]
    num_pages: int
    use_index: bool

    @property
    def num_copies(self) -> int:
        """Host<->device copies the plan issues (the index path issues one)."""
        return 1 if self.use_index else len(self.runs)


def plan_copies(block_ids: list[int], max_runs: int = MAX_RUN_COPIES) -> CopyPlan:
    """Groups ascending consecutive block ids into runs; many runs -> one index copy."""
    runs: list[tuple[int, int, int]] = []
    for row, block in enumerate(block_ids):
        if not isinstance(block, int) or block < 0:
            raise ValueError(f"block ids must be non-negative ints, got {block!r}")
        if runs and runs[-1][0] + runs[-1][2] == block:
            first, start, count = runs[-1]
            runs[-1] = (first, start, count + 1)
        else:
            runs.append((block, row, 1))
    return CopyPlan(tuple(runs), len(block_ids), len(runs) > max_runs)


def _index(block_ids: list[int], device: torch.device) -> torch.Tensor:
    idx = torch.tensor(block_ids, dtype=torch.long)
    if device.type == "cuda":
        # pinned + non_blocking: the index rides the current (side) stream, not the compute stream
        idx = idx.pin_memory().to(device, non_blocking=True)
    return idx


def gather_pages(buffer: torch.Tensor, block_ids: list[int], out: torch.Tensor, plan: CopyPlan | None = None) -> None:
    """out[i] = buffer[block_ids[i]] for every i, issued on the current stream (async on CUDA)."""
    plan = plan or plan_copies(block_ids)
    n = plan.num_pages
    if n > out.shape[0]:
        raise ValueError(f"{n} pages do not fit in {out.shape[0]} staging rows")
    if plan.use_index:
        rows = buffer.index_select(0, _index(block_ids, buffer.device))  # one gather kernel
        out[:n].copy_(rows, non_blocking=True)  # one device-to-host copy
        return
    for first, row, count in plan.runs:
        out[row : row + count].copy_(buffer[first : first + count], non_blocking=True)


def scatter_pages(src: torch.Tensor, buffer: torch.Tensor, block_ids: list[int], plan: CopyPlan | None = None) -> None:
    """buffer[block_ids[i]] = src[i] for every i, issued on the current stream (async on CUDA)."""
    plan = plan or plan_copies(block_ids)
    n = plan.num_pages
    if n > src.shape[0]:
        raise ValueError(f"{n} pages but only {src.shape[0]} source rows")
    if plan.use_index:
        rows = src[:n].to(buffer.device, non_blocking=True)  # one host-to-device copy
        buffer.index_copy_(0, _index(block_ids, buffer.device), rows)  # one scatter kernel
        return
    for first, row, count in plan.runs:
        buffer[first : first + count].copy_(src[row : row + count], non_blocking=True)


class StreamFences:
    """Event ordering between one pool's compute stream and the connector's side streams.

    Guarantees (CUDA pools): a side stream that called `order_after_writes`
    runs after every forward recorded by `mark_written` so far; a forward
    issued after `order_reads_after_landing` runs after every H2D copy that
    `add_landed` saw before that call. CPU pools: every method is a no-op.
    """

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.enabled = self.device.type == "cuda"
        self._written: torch.cuda.Event | None = None
        self._landed: list[torch.cuda.Event] = []
        self._lock = threading.Lock()

    def mark_written(self) -> None:
        """Engine thread, after a forward: later transfers read what it wrote."""
        if not self.enabled:
            return
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        self._written = event  # one reference swap: readers see the old or the new event, both valid

    def order_after_writes(self, stream: torch.cuda.Stream) -> None:
        """Transfer thread: `stream` waits (on the device) for the pages' writers."""
        if not self.enabled:
            return
        event = self._written
        if event is None:  # no engine marks this pool (e.g. a bare producer): wait for the default stream
            stream.wait_stream(torch.cuda.default_stream(self.device))
        else:
            stream.wait_event(event)

    def add_landed(self, event: torch.cuda.Event) -> None:
        """Transfer thread: `event` follows an H2D copy into the pool."""
        if not self.enabled:
            return
        with self._lock:
            # drop completed events so a pool no engine drains stays bounded
            self._landed = [e for e in self._landed if not e.query()]
            self._landed.append(event)

    def order_reads_after_landing(self) -> None:
        """Engine thread, before the next forward: the compute stream waits for landed pages."""
        if not self.enabled:
            return
        with self._lock:
            events, self._landed = self._landed, []
        stream = torch.cuda.current_stream(self.device)
        for event in events:
            stream.wait_event(event)


_FENCES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_FENCES_LOCK = threading.Lock()


def fences_for(pool) -> StreamFences:
    """The one `StreamFences` of `pool` (a KVPages), shared by its engine and transfer threads."""
    with _FENCES_LOCK:
        fences = _FENCES.get(pool)
        if fences is None:
            fences = _FENCES[pool] = StreamFences(pool.device)
        return fences


class HostPin:
    """Page-locks `tensor`'s host memory for CUDA (cudaHostRegister) until `release`.

    Memory CUDA did not allocate (an mmap of `/dev/shm`) is pageable: a copy
    between it and the device goes through the driver's own small pinned
    buffer, synchronously, at a fraction of the DMA rate. Registered, the same
    memory is a DMA source and target like `pin_memory=True` tensors.
    Guarantees: the constructor raises RuntimeError when CUDA refuses (nothing
    is registered then; the memory stays usable, pageable); `release`
    unregisters once; the caller keeps the memory mapped until then
    (unmapping registered memory first is undefined).
    """

    def __init__(self, tensor: torch.Tensor):
        self._ptr = 0
        self.nbytes = tensor.numel() * tensor.element_size()
        register_host_memory(tensor.data_ptr(), self.nbytes)
        self._ptr = tensor.data_ptr()

    def release(self) -> None:
        if self._ptr:
            ptr, self._ptr = self._ptr, 0
            torch.cuda.check_error(torch.cuda.cudart().cudaHostUnregister(ptr))


_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context of the process


def register_host_memory(ptr: int, nbytes: int) -> None:
    """cudaHostRegister, or RuntimeError saying why not (the one call a refusal comes from)."""
    if not torch.cuda.is_available():
        raise RuntimeError("CUDA is not available: nothing to pin host memory for")
    cudart = torch.cuda.cudart()
    status = cudart.cudaHostRegister(ptr, nbytes, _HOST_REGISTER_PORTABLE)
    try:
        torch.cuda.check_error(status)
    except RuntimeError:
        clear = getattr(cudart, "cudaGetLastError", None)
        if clear is not None:  # a refused call is not sticky: leave no stale error for the next launch check
            clear()
        raise
