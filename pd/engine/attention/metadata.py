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

import array
import dataclasses
import logging
from collections.abc import Sequence
from typing import Protocol

import torch

from pd.engine.kv.layout import KVLayout

logger = logging.getLogger(__name__)


class StepChunk(Protocol):
    """What the builder reads of a chunk (the scheduler's `ScheduledChunk`; attention does not import
    the scheduler): tokens [start, start + len(token_ids)) of one sequence."""

    @property
    def token_ids(self) -> Sequence[int]: ...

    @property
    def start(self) -> int: ...

    @property
    def block_ids(self) -> Sequence[Sequence[int]]: ...  # per KV cache group

    @property
    def needs_logits(self) -> bool: ...


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
    num_padded: int = 0  # padding rows at the end (`StepInputBuilder.build(pad_to=)`), counted in num_tokens/num_seqs

    @property
    def host(self) -> StepMetadata:
        return self if self.host_copy is None else self.host_copy

    @property
    def num_logits(self) -> int:
        return self.logits_indices.shape[0]

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens, default=0)

    @property
    def decode_only(self) -> bool:
        """One token per chunk (every chunk a decode step)."""
        return self.num_tokens == self.num_seqs


class _Buffers:
    """The persistent tensors on one device, each with room for a step of `capacity`. The per-token
    rows share one matrix and the per-sequence rows another, so a step fills (and, on a GPU, copies)
    each in one call."""

    def __init__(self, capacity: StepCapacity, num_groups: int, device: torch.device, pin: bool = False):
        t, s, b = capacity.max_num_tokens, capacity.max_num_seqs, capacity.max_blocks_per_seq

        def alloc(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.long, device=device, pin_memory=pin)

        # rows: input ids, positions, token -> chunk, slot offsets, then per group slot blocks, slot mapping
        self.per_token = alloc(4 + 2 * num_groups, t)
        self.input_ids, self.positions, self.token_seq, self.slot_offsets = self.per_token[:4]
        self.slot_blocks = self.per_token[4:4 + num_groups]
        self.slot_mapping = self.per_token[4 + num_groups:]
        # rows: sequence lengths, query start offsets (one more), logits indices
        self.per_seq = alloc(3, s + 1)
        self.seq_lens, self.query_start_loc, self.logits_indices = self.per_seq
        self.block_tables = [alloc(s * b) for _ in range(num_groups)]  # flat: an (S, W) view is contiguous

    def views(self, t: int, s: int, r: int, width: int, query_lens: tuple[int, ...], starts: tuple[int, ...],
              host_copy: StepMetadata | None, num_padded: int = 0) -> StepMetadata:
        return StepMetadata(
            num_tokens=t, num_seqs=s, query_lens=query_lens, starts=starts, input_ids=self.input_ids[:t],
            positions=self.positions[:t], slot_mapping=self.slot_mapping[:, :t], slot_blocks=self.slot_blocks[:, :t],
            slot_offsets=self.slot_offsets[:t], token_seq=self.token_seq[:t],
            block_tables=tuple(table[:s * width].view(s, width) for table in self.block_tables),
            seq_lens=self.seq_lens[:s], query_start_loc=self.query_start_loc[:s + 1],
            logits_indices=self.logits_indices[:r], host_copy=host_copy, num_padded=num_padded)


def _as_tensor(values: list[int]) -> torch.Tensor:
    """An int64 CPU tensor of `values` (through a C array: far faster than torch.tensor on a list)."""
    if not values:
        return torch.empty(0, dtype=torch.long)
    return torch.frombuffer(array.array("q", values), dtype=torch.long)


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
        # how many times the buffers were (re)allocated: what was captured over older ones is stale
        self.allocations = getattr(self, "allocations", 0) + 1
        groups = len(self.layout.groups)
        on_host = self.device.type == "cpu"
        self._host = _Buffers(capacity, groups, torch.device("cpu"), pin=not on_host and torch.cuda.is_available())
        self._device = self._host if on_host else _Buffers(capacity, groups, self.device)
        self._copied: torch.cuda.Event | None = None  # the previous step's host-to-device copies

    def build(self, chunks: Sequence[StepChunk], pad_to: int | None = None) -> StepMetadata:
        """The step's metadata. `pad_to`: a step of decode tokens only is padded to this many rows (a
        captured graph's bucket): each padding row is a sequence of its own with token 0 at position 0,
        its K/V going to slot 0 of the null block (which no attention reads), sequence length 0 and a
        block table of null blocks; no logits index points at it (`num_padded` counts them)."""
        if self._copied is not None:  # the host mirror is rewritten below: the last copies must be done
            self._copied.synchronize()
        bs = self.layout.block_size
        num_groups = len(self.layout.groups)
        query_lens = tuple(len(c.token_ids) for c in chunks)
        starts = tuple(c.start for c in chunks)
        t, s = sum(query_lens), len(chunks)
        pad = 0 if pad_to is None else pad_to - s
        if pad < 0 or (pad and t != s):
            raise ValueError(f"only a step of decode tokens pads, to at least its {s} rows (pad_to={pad_to})")
        t, s = t + pad, s + pad
        widest = max((len(ids) for c in chunks for ids in c.block_ids), default=0)
        if not self.capacity.covers(t, s, widest):
            grown = StepCapacity(max(t, self.capacity.max_num_tokens), max(s, self.capacity.max_num_seqs),
                                 max(widest, self.capacity.max_blocks_per_seq))
            logger.warning("a step of %d tokens, %d sequences, %d blocks exceeds the input buffers (%s): "
                           "reallocated to %s", t, s, widest, self.capacity, grown)
            self._allocate(grown)
        width = self.capacity.max_blocks_per_seq if self.fixed_table_width else max(widest, 1)
        if t == s:  # decode tokens only: one row per chunk (and the padding rows)
            ids = [c.token_ids[0] for c in chunks] + [0] * pad
            positions = list(starts) + [0] * pad
            token_seq = list(range(s))
            loc = list(range(s + 1))
            logits = [i for i, c in enumerate(chunks) if c.needs_logits]
        else:
            ids, positions, token_seq, loc, logits = [], [], [], [0], []
            for i, c in enumerate(chunks):
                ids += c.token_ids
                positions += range(c.start, c.start + query_lens[i])
                token_seq += [i] * query_lens[i]
                loc.append(len(ids))
                if c.needs_logits:
                    logits.append(len(ids) - 1)
        rows = [ids, positions, token_seq, [p % bs for p in positions]]
        seq_of = token_seq if t != s else None
        for g in range(num_groups):
            tables = [c.block_ids[g] for c in chunks]
            try:
                if seq_of is None:
                    blocks = [table[p // bs] for table, p in zip(tables, positions, strict=False)]
                else:
                    blocks = [tables[i][p // bs] for i, p in zip(seq_of, positions, strict=True)]
            except IndexError:
                blocks = [0]
            if 0 in blocks:
                raise ValueError(f"group {g}: a new token maps to the null block (block table too short)")
            rows.append(blocks + [0] * pad)
            tables += [[]] * pad
            padded: list[int] = []
            for table in tables:
                padded += table
                padded += [0] * (width - len(table))
            self._host.block_tables[g][:s * width].copy_(_as_tensor(padded))
        h = self._host
        h.per_token[:len(rows), :t].copy_(_as_tensor([v for row in rows for v in row]).view(len(rows), t))
        torch.add(h.slot_blocks[:, :t] * bs, h.slot_offsets[:t], out=h.slot_mapping[:, :t])
        seq_lens = [start + n for start, n in zip(starts, query_lens, strict=True)] + [0] * pad
        per_seq = seq_lens + [0] + loc + logits + [0] * (s + 1 - len(logits))
        h.per_seq[:, :s + 1].copy_(_as_tensor(per_seq).view(3, s + 1))
        if pad:
            query_lens, starts = query_lens + (1,) * pad, starts + (0,) * pad
        host = h.views(t, s, len(logits), width, query_lens, starts, None, pad)
        if self._device is h:
            return host
        d = self._device
        # whole buffers: contiguous, so the copies stay asynchronous from pinned memory (a few hundred KB)
        d.per_token.copy_(h.per_token, non_blocking=True)
        d.per_seq.copy_(h.per_seq, non_blocking=True)
        for dst, src in zip(d.block_tables, h.block_tables, strict=True):
            dst[:s * width].copy_(src[:s * width], non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record(torch.cuda.current_stream(self.device))  # where the copies ran: cuda:N's stream
        return d.views(t, s, len(logits), width, query_lens, starts, host, pad)
