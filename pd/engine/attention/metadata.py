"""A step's inputs, built once a step into persistent buffers: the one place positions, slot mappings
and block tables are made.

`StepInputBuilder.build(chunks)` turns the scheduler's chunks into a `StepMetadata` whose tensors are
views at the front of buffers allocated once, at start-up, on the engine's device: their addresses do
not change from step to step (what a captured CUDA graph replays), and a step writes them with one
host-to-device copy per buffer at most (none on the CPU, where the buffers are the host's). Every
attention backend reads the same object; what a backend derives from it (sub-batches, per-row tables)
it derives from these tensors, never from the chunks.

Layout of a step of S sequences (chunks) and T tokens, chunk order:

- `input_ids`, `positions` (T,): the tokens and their positions in their sequences;
- `slot_mapping` (G, T): per KV cache group, the slot `block * block_size + offset` each token's K/V
  is written to; `slot_blocks` (G, T) and `slot_offsets` (T,) hold the same slot as (block, offset);
- `token_seq` (T,): the chunk each token belongs to;
- `block_tables[g]` (S, W): each sequence's block table, null-padded (W: the step's widest, or the
  fixed maximum with `fixed_table_width`, as a graph needs);
- `seq_lens` (S,): context length after the step; `query_start_loc` (S + 1,): where each chunk's
  tokens start in the flat batch; `logits_indices` (R,): the flat row of each chunk that needs logits.

`host` holds the same values on the CPU (the very tensors when the engine runs there), with the
chunk lengths and starts as Python ints, for backends that plan on the host.
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

import torch

from pd.engine.kv.layout import KVLayout
from pd.engine.sched.output import ScheduledChunk

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class StepCapacity:
    """The largest step the buffers hold: the scheduler's token and sequence limits and the longest
    block table (`EngineConfig.max_num_batched_tokens`, `max_num_seqs`, max_model_len / block_size)."""

    max_num_tokens: int = 2048
    max_num_seqs: int = 256
    max_blocks_per_seq: int = 128

    def covers(self, num_tokens: int, num_seqs: int, num_blocks: int) -> bool:
        return (num_tokens <= self.max_num_tokens and num_seqs <= self.max_num_seqs
                and num_blocks <= self.max_blocks_per_seq)


@dataclasses.dataclass(frozen=True)
class StepMetadata:
    """One step's inputs (see the module docstring); tensors are views of the builder's buffers,
    valid until its next `build`."""

    num_tokens: int
    num_seqs: int
    query_lens: tuple[int, ...]  # tokens per chunk (host ints)
    starts: tuple[int, ...]  # first position of each chunk (host ints)
    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    slot_blocks: torch.Tensor
    slot_offsets: torch.Tensor
    token_seq: torch.Tensor
    block_tables: tuple[torch.Tensor, ...]
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    logits_indices: torch.Tensor
    host_copy: StepMetadata | None = None  # None: these tensors are on the CPU already

    @property
    def host(self) -> StepMetadata:
        return self if self.host_copy is None else self.host_copy

    @property
    def num_logits(self) -> int:
        return self.logits_indices.shape[0]

    @property
    def decode_only(self) -> bool:
        """One token per chunk (every chunk a decode step)."""
        return self.num_tokens == self.num_seqs


class _Buffers:
    """The persistent tensors on one device, each with room for a step of `capacity`."""

    def __init__(self, capacity: StepCapacity, num_groups: int, device: torch.device, pin: bool = False):
        t, s, b = capacity.max_num_tokens, capacity.max_num_seqs, capacity.max_blocks_per_seq

        def alloc(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.long, device=device, pin_memory=pin)

        self.input_ids, self.positions, self.token_seq, self.slot_offsets = alloc(t), alloc(t), alloc(t), alloc(t)
        self.slot_mapping, self.slot_blocks = alloc(num_groups, t), alloc(num_groups, t)
        self.block_tables = [alloc(s * b) for _ in range(num_groups)]  # flat: an (S, W) view is contiguous
        self.seq_lens, self.query_start_loc, self.logits_indices = alloc(s), alloc(s + 1), alloc(s)

    def views(self, t: int, s: int, r: int, width: int, query_lens: tuple[int, ...], starts: tuple[int, ...],
              host_copy: StepMetadata | None) -> StepMetadata:
        g = self.slot_mapping.shape[0]
        return StepMetadata(
            num_tokens=t, num_seqs=s, query_lens=query_lens, starts=starts, input_ids=self.input_ids[:t],
            positions=self.positions[:t], slot_mapping=self.slot_mapping[:, :t], slot_blocks=self.slot_blocks[:, :t],
            slot_offsets=self.slot_offsets[:t], token_seq=self.token_seq[:t],
            block_tables=tuple(self.block_tables[i][:s * width].view(s, width) for i in range(g)),
            seq_lens=self.seq_lens[:s], query_start_loc=self.query_start_loc[:s + 1],
            logits_indices=self.logits_indices[:r], host_copy=host_copy)


def _fill(dst: torch.Tensor, values: Sequence[int] | list[list[int]]) -> None:
    if len(values):
        dst.copy_(torch.tensor(values, dtype=torch.long).view(dst.shape))


class StepInputBuilder:
    """Builds every step's `StepMetadata` into buffers allocated once (see the module docstring).

    Guarantees: the buffers' addresses never change while steps fit `capacity` (a larger step, which
    an engine sized from its config never schedules, reallocates them and logs it); `build` raises
    ValueError, before anything is written to the pages, when a token's slot would be the null block.
    """

    def __init__(self, layout: KVLayout, device: torch.device | str, capacity: StepCapacity | None = None,
                 fixed_table_width: bool = False):
        self.layout = layout
        self.device = torch.device(device)
        self.fixed_table_width = fixed_table_width
        self._allocate(capacity or StepCapacity())

    def _allocate(self, capacity: StepCapacity) -> None:
        self.capacity = capacity
        groups = len(self.layout.groups)
        on_host = self.device.type == "cpu"
        self._host = _Buffers(capacity, groups, torch.device("cpu"), pin=not on_host and torch.cuda.is_available())
        self._device = self._host if on_host else _Buffers(capacity, groups, self.device)

    def build(self, chunks: Sequence[ScheduledChunk]) -> StepMetadata:
        bs = self.layout.block_size
        num_groups = len(self.layout.groups)
        query_lens = tuple(len(c.token_ids) for c in chunks)
        starts = tuple(c.start for c in chunks)
        t, s = sum(query_lens), len(chunks)
        widest = max((len(c.block_ids[g]) for c in chunks for g in range(num_groups)), default=0)
        if not self.capacity.covers(t, s, widest):
            grown = StepCapacity(max(t, self.capacity.max_num_tokens), max(s, self.capacity.max_num_seqs),
                                 max(widest, self.capacity.max_blocks_per_seq))
            logger.warning("a step of %d tokens, %d sequences, %d blocks exceeds the input buffers (%s): "
                           "reallocated to %s", t, s, widest, self.capacity, grown)
            self._allocate(grown)
        width = self.capacity.max_blocks_per_seq if self.fixed_table_width else max(widest, 1)
        ids: list[int] = []
        positions: list[int] = []
        token_seq: list[int] = []
        loc = [0]
        logits: list[int] = []
        for i, c in enumerate(chunks):
            ids.extend(c.token_ids)
            positions.extend(range(c.start, c.start + query_lens[i]))
            token_seq.extend([i] * query_lens[i])
            loc.append(len(ids))
            if c.needs_logits:
                logits.append(len(ids) - 1)
        h = self._host
        _fill(h.input_ids[:t], ids)
        _fill(h.positions[:t], positions)
        _fill(h.token_seq[:t], token_seq)
        _fill(h.slot_offsets[:t], [p % bs for p in positions])
        for g in range(num_groups):
            rows = [c.block_ids[g] for c in chunks]
            blocks = [r[p // bs] if p // bs < len(r) else 0
                      for r, n, start in zip(rows, query_lens, starts, strict=True) for p in range(start, start + n)]
            if 0 in blocks:
                raise ValueError(f"group {g}: a new token maps to the null block (block table too short)")
            _fill(h.slot_blocks[g, :t], blocks)
            _fill(h.block_tables[g][:s * width], [r + [0] * (width - len(r)) for r in rows])
        if num_groups:
            torch.add(h.slot_blocks[:, :t] * bs, h.slot_offsets[:t], out=h.slot_mapping[:, :t])
        _fill(h.seq_lens[:s], [start + n for start, n in zip(starts, query_lens, strict=True)])
        _fill(h.query_start_loc[:s + 1], loc)
        _fill(h.logits_indices[:len(logits)], logits)
        host = h.views(t, s, len(logits), width, query_lens, starts, None)
        if self._device is h:
            return host
        d = self._device
        for name in ("input_ids", "positions", "token_seq", "slot_offsets", "seq_lens", "logits_indices"):
            getattr(d, name).copy_(getattr(h, name), non_blocking=True)
        d.slot_mapping.copy_(h.slot_mapping, non_blocking=True)
        d.slot_blocks.copy_(h.slot_blocks, non_blocking=True)
        d.query_start_loc.copy_(h.query_start_loc, non_blocking=True)
        for dst, src in zip(d.block_tables, h.block_tables, strict=True):
            dst[:s * width].copy_(src[:s * width], non_blocking=True)
        return d.views(t, s, len(logits), width, query_lens, starts, host)
