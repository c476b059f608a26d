"""CUDA graphs for decode steps: one graph per batch-size bucket, replayed over persistent buffers.

A decode step launches a few hundred small kernels; on a GPU, launching them
one by one from Python costs far more than running them. A CUDA graph records
the launches once and replays them with one call, but it replays fixed
addresses and fixed shapes. So:

- the inputs live in the step metadata's persistent buffers (attention/metadata.py,
  the one builder of step inputs, with fixed-width block tables): each step writes
  its rows at the front and `build(chunks, pad_to=bucket)` pads the rest of its
  bucket with harmless rows (token 0 at position 0, K/V written to slot 0
  of the null block 0, which no attention reads, sequence length 0, a block
  table of null blocks); their outputs are dropped;
- `capture_sizes` gives the buckets: 1, 2, 4, 8, then every 8 up to 256 and
  every 16 beyond, capped at `max_num_seqs` (the cap itself is a bucket, so
  every batch the scheduler can form fits one);
- `DecodeGraphs.capture` warms each bucket up, then captures it, largest
  first, all graphs sharing one memory pool, and logs the time and memory it
  took;
- `plan_step` decides per step: a graph for a pure decode batch that fits a
  bucket, eager otherwise (prompt chunks in the step, a batch above the largest
  bucket, a per-layer hook, graphs off or no CUDA), and says why.

Everything but the capture and replay is plain Python and tensor copies, so it
runs (and is tested) on the CPU.
"""
from __future__ import annotations

import bisect
import dataclasses
import logging
import time
from collections.abc import Callable, Sequence

import torch

from pd.engine.attention.metadata import StepInputBuilder, StepMetadata

logger = logging.getLogger(__name__)

SMALL_BUCKETS = (1, 2, 4, 8)
FINE_STEP, FINE_UNTIL, COARSE_STEP = 8, 256, 16


def capture_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """The batch-size buckets for `max_num_seqs` sequences, ascending, the last one `max_num_seqs`."""
    if max_num_seqs <= 0:
        raise ValueError(f"max_num_seqs must be positive, got {max_num_seqs}")
    sizes = [*SMALL_BUCKETS, *range(2 * FINE_STEP, FINE_UNTIL + 1, FINE_STEP)]
    sizes += range(FINE_UNTIL + COARSE_STEP, max_num_seqs + 1, COARSE_STEP)
    kept = [s for s in sizes if s < max_num_seqs]
    return (*kept, max_num_seqs)


def bucket_for(num_seqs: int, sizes: Sequence[int]) -> int | None:
    """The smallest bucket holding `num_seqs` rows, or None when it exceeds the largest."""
    if num_seqs <= 0 or not sizes:
        return None
    i = bisect.bisect_left(sizes, num_seqs)
    return sizes[i] if i < len(sizes) else None


@dataclasses.dataclass(frozen=True)
class GraphPlan:
    """How one step runs: `bucket` is the graph to replay (None: eager), `reason` says why not."""

    bucket: int | None
    reason: str


def plan_step(num_seqs: int, num_tokens: int, sizes: Sequence[int], graphs_ready: bool,
              layer_hook: bool = False) -> GraphPlan:
    """A graph for a step of decode tokens only (one per sequence) that fits a captured bucket, and
    whose layers nobody watches one by one (`layer_hook`: a connector streaming each layer's K/V)."""
    if not graphs_ready:
        return GraphPlan(None, "cuda graphs off (cuda_graphs=False, no CUDA, a backend that plans on the host, "
                               "or not captured)")
    if num_seqs <= 0:
        return GraphPlan(None, "an empty step")
    if layer_hook:
        return GraphPlan(None, "a per-layer hook (layer streaming) watches the step")
    if num_tokens != num_seqs:
        return GraphPlan(None, "prompt chunks in the step")
    bucket = bucket_for(num_seqs, sizes)
    if bucket is None:
        return GraphPlan(None, f"batch of {num_seqs} above the largest bucket ({sizes[-1] if sizes else 0})")
    return GraphPlan(bucket, "graph")


@dataclasses.dataclass(frozen=True)
class CaptureReport:
    sizes: tuple[int, ...]
    seconds: float
    memory_bytes: int
    skipped: str | None = None  # why nothing was captured


# forward(metadata): the step's final hidden states, one row per token (padding rows included); it must read
# its inputs only from the metadata's tensors and make no host synchronisation.
StepForward = Callable[[StepMetadata], torch.Tensor]


class DecodeGraphs:
    """Decode steps replayed from CUDA graphs captured over one `StepInputBuilder`'s buffers.

    Guarantees: a graph is replayed only for the bucket it was captured with, after `builder.build(chunks,
    pad_to=bucket)` wrote the step into the same buffers (the builder's tables have a fixed width, so every
    view keeps its address and shape); `replay` returns the forward's output for the whole bucket (rows
    past the step's own are padding, to be dropped). Nothing is captured where `why_not` says so.
    """

    def __init__(self, builder: StepInputBuilder, forward: StepForward, max_num_seqs: int, enabled: bool = True):
        self.builder = builder
        self.forward = forward
        self.sizes = capture_sizes(min(max_num_seqs, builder.capacity.max_num_seqs))
        self.enabled = enabled
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._captured_over = builder.allocations

    @property
    def graphs_ready(self) -> bool:
        """Graphs were captured, over the builder's buffers as they are now (a step larger than the
        builder's capacity, which an engine sized from its config never schedules, reallocates them)."""
        return bool(self._graphs) and self.builder.allocations == self._captured_over

    def why_not(self) -> str | None:
        """Why nothing can be captured here, or None when it can."""
        if not self.enabled:
            return "cuda_graphs=False (or a backend that plans each step on the host)"
        if self.builder.device.type != "cuda" or not torch.cuda.is_available():
            return f"the step inputs are on {self.builder.device}, graphs need CUDA"
        if not self.builder.fixed_table_width:
            return "the step builder's block tables change width from step to step"
        return None

    def capture(self, warmup_iters: int = 2) -> CaptureReport:
        """Warm up and capture every bucket, largest first, into one memory pool; logs what it took."""
        reason = self.why_not()
        if reason is not None:
            logger.info("decode CUDA graphs not captured: %s", reason)
            return CaptureReport((), 0.0, 0, skipped=reason)
        # everything on the builder's device (cuda:N), not the thread's current one: the streams, the
        # capture, the synchronisations and the memory count
        device = self.builder.device
        with torch.cuda.device(device):
            torch.cuda.synchronize(device)
            self._captured_over = self.builder.allocations
            free_before = torch.cuda.mem_get_info(device)[0]
            t0 = time.perf_counter()
            pool = torch.cuda.graph_pool_handle()
            side = torch.cuda.Stream(device)
            for size in sorted(self.sizes, reverse=True):
                metadata = self.builder.build([], pad_to=size)  # all padding: writes only to the null block
                torch.cuda.synchronize(device)
                side.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(side):  # warm-up off the capture stream (kernel compilation, autotuning)
                    for _ in range(warmup_iters):
                        self.forward(metadata)
                torch.cuda.current_stream(device).wait_stream(side)
                torch.cuda.synchronize(device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = self.forward(metadata)
                self._graphs[size] = (graph, out)
            torch.cuda.synchronize(device)
            seconds = time.perf_counter() - t0
            used = max(0, free_before - torch.cuda.mem_get_info(device)[0])
        logger.info("captured %d decode CUDA graphs (batch %d..%d) on %s in %.1f s, %.1f MiB of GPU memory",
                    len(self.sizes), self.sizes[0], self.sizes[-1], device, seconds, used / 2**20)
        return CaptureReport(tuple(self.sizes), seconds, used)

    def plan(self, num_seqs: int, num_tokens: int, layer_hook: bool = False) -> GraphPlan:
        return plan_step(num_seqs, num_tokens, self.sizes, self.graphs_ready, layer_hook)

    def replay(self, bucket: int) -> torch.Tensor:
        """Replays the bucket's graph over what the builder holds now; the output for every row of it."""
        graph, out = self._graphs[bucket]
        with torch.cuda.device(self.builder.device):  # on the device's current stream, as captured
            graph.replay()
        return out
