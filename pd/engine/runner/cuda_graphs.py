"""CUDA graphs for decode steps: one graph per batch-size bucket, replayed over persistent buffers.

A decode step launches a few hundred small kernels; on a GPU, launching them
one by one from Python costs far more than running them. A CUDA graph records
the launches once and replays them with one call, but it replays fixed
addresses and fixed shapes. So:

- the inputs live in `DecodeBuffers`, allocated once: each step writes its
  rows at the front and pads the rest of its bucket with harmless rows (token
  0 at position 0, K/V written to slot `PAD_SLOT` of the null block 0, which
  no attention reads, sequence length 0, a block table of null blocks); their
  outputs are dropped;
- `capture_sizes` gives the buckets: 1, 2, 4, 8, then every 8 up to 256 and
  every 16 beyond, capped at `max_num_seqs` (the cap itself is a bucket, so
  every batch the scheduler can form fits one);
- `DecodeGraphRunner.capture` warms each bucket up, then captures it, largest
  first, all graphs sharing one memory pool, and logs the time and memory it
  took;
- `plan_step` decides per step: a graph for a pure decode batch that fits a
  bucket, eager otherwise (prompt chunks in the step, a batch above the largest
  bucket, graphs off or no CUDA), and says why.

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

logger = logging.getLogger(__name__)

PAD_SLOT = 0  # row 0 of the null block 0: written by padding rows, never read by attention
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

    @property
    def uses_graph(self) -> bool:
        return self.bucket is not None


def plan_step(num_seqs: int, num_tokens: int, sizes: Sequence[int], graphs_ready: bool) -> GraphPlan:
    """A graph for a step of decode tokens only (one per sequence) that fits a captured bucket."""
    if not graphs_ready:
        return GraphPlan(None, "cuda graphs off (cuda_graphs=False, no CUDA, or not captured)")
    if num_tokens != num_seqs:
        return GraphPlan(None, "prompt chunks in the step")
    bucket = bucket_for(num_seqs, sizes)
    if bucket is None:
        return GraphPlan(None, f"batch of {num_seqs} above the largest bucket ({sizes[-1] if sizes else 0})")
    return GraphPlan(bucket, "graph")


@dataclasses.dataclass(frozen=True)
class DecodeBatch:
    """One decode step's rows on the host: per sequence one token, its position, its context length
    (the new token included), and per KV cache group its slot and block table."""

    token_ids: Sequence[int]
    positions: Sequence[int]
    seq_lens: Sequence[int]
    slot_mapping: Sequence[Sequence[int]]  # (groups, B)
    block_tables: Sequence[Sequence[Sequence[int]]]  # (groups, B, blocks)

    @property
    def num_seqs(self) -> int:
        return len(self.token_ids)


class DecodeBuffers:
    """The decode step's inputs at fixed addresses: room for `max_num_seqs` rows and block tables of
    `max_blocks_per_seq` entries per KV cache group.

    Guarantees: the tensors are never reallocated; `load` writes a batch's rows at the front and pads
    rows [num_seqs, bucket) with the harmless row described in the module docstring.
    """

    def __init__(self, max_num_seqs: int, max_blocks_per_seq: int, num_groups: int, device: torch.device | str):
        self.device = torch.device(device)
        self.max_num_seqs = max_num_seqs
        self.max_blocks_per_seq = max_blocks_per_seq
        self.num_groups = num_groups

        def zeros(*shape: int, dtype: torch.dtype = torch.long) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=self.device)

        self.token_ids, self.positions = zeros(max_num_seqs), zeros(max_num_seqs)
        self.seq_lens = zeros(max_num_seqs, dtype=torch.int32)
        self.slot_mapping = zeros(num_groups, max_num_seqs)
        self.block_tables = zeros(num_groups, max_num_seqs, max_blocks_per_seq, dtype=torch.int32)

    def load(self, batch: DecodeBatch, bucket: int) -> None:
        """Write `batch` into rows [0, num_seqs) and padding into [num_seqs, bucket)."""
        n = batch.num_seqs
        if not n <= bucket <= self.max_num_seqs:
            raise ValueError(f"a batch of {n} rows padded to {bucket} does not fit {self.max_num_seqs} rows")
        if len(batch.slot_mapping) != self.num_groups or len(batch.block_tables) != self.num_groups:
            raise ValueError(f"expected slots and block tables for {self.num_groups} KV cache group(s)")
        width = max((len(row) for table in batch.block_tables for row in table), default=0)
        if width > self.max_blocks_per_seq:
            raise ValueError(f"a block table of {width} blocks exceeds the buffers' {self.max_blocks_per_seq}")
        pad = bucket - n
        host_tables = torch.zeros((self.num_groups, bucket, max(width, 1)), dtype=torch.int32)
        for g, table in enumerate(batch.block_tables):
            for i, row in enumerate(table):
                host_tables[g, i, :len(row)] = torch.tensor(row, dtype=torch.int32)
        self.token_ids[:bucket].copy_(torch.tensor([*batch.token_ids, *[0] * pad], dtype=torch.long))
        self.positions[:bucket].copy_(torch.tensor([*batch.positions, *[0] * pad], dtype=torch.long))
        self.seq_lens[:bucket].copy_(torch.tensor([*batch.seq_lens, *[0] * pad], dtype=torch.int32))
        self.slot_mapping[:, :bucket].copy_(
            torch.tensor([[*slots, *[PAD_SLOT] * pad] for slots in batch.slot_mapping], dtype=torch.long))
        # stale entries beyond this step's width are null blocks: no row may read another step's pages
        self.block_tables[:, :bucket].zero_()
        self.block_tables[:, :bucket, :host_tables.shape[2]].copy_(host_tables)


@dataclasses.dataclass(frozen=True)
class CaptureReport:
    sizes: tuple[int, ...]
    seconds: float
    memory_bytes: int
    skipped: str | None = None  # why nothing was captured


# forward(n): the decode forward over the buffers' first n rows; returns a tensor whose first n rows
# are the outputs (it must read inputs only from the buffers, and allocate nothing it keeps).
DecodeForward = Callable[[int], torch.Tensor]


class DecodeGraphRunner:
    """Runs decode steps through captured CUDA graphs where `plan_step` allows, eagerly otherwise.

    Guarantees: `run` returns the first `batch.num_seqs` rows of the forward's output for the batch,
    graph or not; a graph is replayed only for the bucket it was captured with, over the same buffers.
    """

    def __init__(self, forward: DecodeForward, buffers: DecodeBuffers, max_num_seqs: int, enabled: bool = True):
        self.forward = forward
        self.buffers = buffers
        self.sizes = capture_sizes(min(max_num_seqs, buffers.max_num_seqs))
        self.enabled = enabled
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    @property
    def graphs_ready(self) -> bool:
        return bool(self._graphs)

    def why_not(self) -> str | None:
        """Why this runner cannot capture here, or None when it can."""
        if not self.enabled:
            return "cuda_graphs=False"
        if self.buffers.device.type != "cuda" or not torch.cuda.is_available():
            return f"the buffers are on {self.buffers.device}, graphs need CUDA"
        return None

    def capture(self, warmup_iters: int = 2) -> CaptureReport:
        """Warm up and capture every bucket, largest first, into one memory pool; logs what it took."""
        reason = self.why_not()
        if reason is not None:
            logger.info("decode CUDA graphs not captured: %s", reason)
            return CaptureReport((), 0.0, 0, skipped=reason)
        empty = DecodeBatch((), (), (), [[] for _ in range(self.buffers.num_groups)],
                            [[] for _ in range(self.buffers.num_groups)])
        torch.cuda.synchronize()
        free_before = torch.cuda.mem_get_info()[0]
        t0 = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()
        for size in sorted(self.sizes, reverse=True):
            self.buffers.load(empty, size)  # all padding: the capture writes only to the null block
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up off the capture stream (kernel compilation, autotuning)
                for _ in range(warmup_iters):
                    self.forward(size)
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self.forward(size)
            self._graphs[size] = (graph, out)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        used = max(0, free_before - torch.cuda.mem_get_info()[0])
        logger.info("captured %d decode CUDA graphs (batch %d..%d) in %.1f s, %.1f MiB of GPU memory",
                    len(self.sizes), self.sizes[0], self.sizes[-1], seconds, used / 2**20)
        return CaptureReport(tuple(self.sizes), seconds, used)

    def plan(self, num_seqs: int, num_tokens: int) -> GraphPlan:
        return plan_step(num_seqs, num_tokens, self.sizes, self.graphs_ready)

    def run(self, batch: DecodeBatch) -> torch.Tensor:
        """The decode forward's outputs for `batch` (num_seqs rows)."""
        n = batch.num_seqs
        plan = self.plan(n, n)
        if plan.bucket is not None:
            self.buffers.load(batch, plan.bucket)
            graph, out = self._graphs[plan.bucket]
            graph.replay()
            return out[:n]
        self.buffers.load(batch, n)
        return self.forward(n)[:n]
