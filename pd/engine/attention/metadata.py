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
  fixed maximum with `fixed_table_width`, as a graph needs), gathered from per-request rows kept across
  steps (attention/block_rows.py: a step writes only the blocks its requests gained);
- `seq_lens` (S,): context length after the step; `query_start_loc` (S + 1,): where each chunk's
  tokens start in the flat batch; `logits_indices` (R,): the flat row of each chunk that needs logits.

A mixed step (one-token chunks beside prompt chunks) also carries `mixed` (`MixedSplit`): its rows split by
kernel, the one-token chunks (decode rows) apart from the prompt chunks, each part with its own
sequence lengths, block tables and (the prompt part) query starts, so that a backend runs each part
through its own kernel without planning on the host. The builder knows the chunk lengths as ints and
makes the split there; mixed steps are never graph-captured, so the split's tensors are fresh each step.

`host` holds the same values on the CPU (the very tensors when the engine runs there), with the
chunk lengths and starts as Python ints, for backends that plan on the host.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Sequence
from typing import Protocol

import torch

from pd.engine.attention.block_rows import BlockRows, as_tensor as _as_tensor
from pd.engine.kv.layout import KVLayout

logger = logging.getLogger(__name__)


class StepChunk(Protocol):
    """What the builder reads of a chunk (the scheduler's `ScheduledChunk`; attention does not import
    the scheduler): tokens [start, start + len(token_ids)) of one sequence."""

    @property
    def request_id(self) -> str: ...  # keys the request's block-table row (`BlockRows`)

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
class MixedSplit:
    """A mixed step's rows split by kernel (see the module docstring), on the step's device. Each part keeps
    chunk order; `decode_rows` and `prompt_rows` together name every flat row exactly once."""

    decode_rows: torch.Tensor  # (D,) the flat row of each one-token chunk
    decode_seq_lens: torch.Tensor  # (D,)
    decode_tables: tuple[torch.Tensor, ...]  # per KV cache group, (D, W)
    prompt_rows: torch.Tensor  # (P_tokens,) the flat rows of the other chunks, in order
    prompt_seq_lens: torch.Tensor  # (P,)
    prompt_query_start: torch.Tensor  # (P + 1,) where each prompt chunk starts among `prompt_rows`
    prompt_tables: tuple[torch.Tensor, ...]  # per KV cache group, (P, W)
    prompt_max_query_len: int


def mixed_split(metadata: StepMetadata) -> MixedSplit | None:
    """The split of a step with both one-token and longer chunks (None for any other step), from the host's
    chunk lengths; the index tensors are made on the host and copied once, the gathers run on the device."""
    lens = metadata.query_lens
    if metadata.decode_only or 1 not in lens:
        return None
    decode_seqs: list[int] = []
    decode_rows: list[int] = []
    prompt_seqs: list[int] = []
    prompt_rows: list[int] = []
    prompt_loc = [0]
    row = 0
    for i, n in enumerate(lens):
        if n == 1:
            decode_seqs.append(i)
            decode_rows.append(row)
        else:
            prompt_seqs.append(i)
            prompt_rows.extend(range(row, row + n))
            prompt_loc.append(prompt_loc[-1] + n)
        row += n
    d, p, r = len(decode_seqs), len(prompt_seqs), len(prompt_rows)
    device = metadata.seq_lens.device
    packed = _as_tensor(decode_seqs + decode_rows + prompt_seqs + prompt_rows + prompt_loc).to(device, copy=True)
    dec_seqs, dec_rows, pr_seqs, pr_rows, pr_loc = packed.split([d, d, p, r, p + 1])
    return MixedSplit(dec_rows, metadata.seq_lens.index_select(0, dec_seqs),
                      tuple(t.index_select(0, dec_seqs) for t in metadata.block_tables),
                      pr_rows, metadata.seq_lens.index_select(0, pr_seqs), pr_loc,
                      tuple(t.index_select(0, pr_seqs) for t in metadata.block_tables),
                      max(lens[i] for i in prompt_seqs))


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
    mixed: MixedSplit | None = None  # a mixed step's rows split by kernel (on the device metadata only)

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
        # rows: sequence lengths, query start offsets (one more), logits indices, each sequence's `BlockRows` row
        self.per_seq = alloc(4, s + 1)
        self.seq_lens, self.query_start_loc, self.logits_indices, self.table_rows = self.per_seq
        self.block_tables = [alloc(s * b) for _ in range(num_groups)]  # flat: an (S, W) view is contiguous
        self._views: dict[tuple[int, int, int, int], tuple] = {}

    def table_views(self, s: int, width: int) -> tuple[torch.Tensor, ...]:
        return tuple(table[:s * width].view(s, width) for table in self.block_tables)

    def views(self, t: int, s: int, r: int, width: int, query_lens: tuple[int, ...], starts: tuple[int, ...],
              host_copy: StepMetadata | None, num_padded: int = 0) -> StepMetadata:
        key = (t, s, r, width)
        v = self._views.get(key)
        if v is None:  # the same views serve every step of this shape (a decode batch, step after step)
            if len(self._views) > 64:
                self._views.clear()
            v = self._views[key] = (
                self.input_ids[:t], self.positions[:t], self.slot_mapping[:, :t], self.slot_blocks[:, :t],
                self.slot_offsets[:t], self.token_seq[:t], self.table_views(s, width), self.seq_lens[:s],
                self.query_start_loc[:s + 1], self.logits_indices[:r])
        ids, pos, slots, slot_blocks, offsets, token_seq, tables, seq_lens, loc, logits = v
        return StepMetadata(t, s, query_lens, starts, ids, pos, slots, slot_blocks, offsets, token_seq, tables,
                            seq_lens, loc, logits, host_copy=host_copy, num_padded=num_padded)


class StepInputBuilder:
    """Builds every step's `StepMetadata` into buffers allocated once (see the module docstring).

    Guarantees: the buffers' addresses never change while steps fit `capacity` (a larger step, which
    an engine sized from its config never schedules, reallocates them and logs it); `build` raises
    ValueError, before anything is written to the pages, when a token's slot would be the null block.
    Block tables come from per-request rows kept across steps (`BlockRows`): a step writes only the
    blocks its requests gained (or rows that changed otherwise), then gathers its rows; `release`
    frees the rows of finished requests.
    """

    def __init__(self, layout: KVLayout, device: torch.device | str, capacity: StepCapacity | None = None,
                 fixed_table_width: bool = False, separate_device_rows: bool | None = None):
        self.layout = layout
        self.device = torch.device(device)
        self.fixed_table_width = fixed_table_width
        self._separate_rows = separate_device_rows  # (tests: a device copy of the rows on the CPU too)
        self._allocate(capacity or StepCapacity())

    def _allocate(self, capacity: StepCapacity) -> None:
        self.capacity = capacity
        # how many times the buffers were (re)allocated: what was captured over older ones is stale
        self.allocations = getattr(self, "allocations", 0) + 1
        groups = len(self.layout.groups)
        on_host = self.device.type == "cpu"
        pin = not on_host and torch.cuda.is_available()
        self._host = _Buffers(capacity, groups, torch.device("cpu"), pin=pin)
        self._device = self._host if on_host else _Buffers(capacity, groups, self.device)
        self.rows = BlockRows(groups, capacity.max_num_seqs, capacity.max_blocks_per_seq, self.device, pin,
                              self._separate_rows)
        self._copied: torch.cuda.Event | None = None  # the previous step's host-to-device copies

    def release(self, request_ids: Sequence[str] | frozenset[str]) -> None:
        """Forgets finished requests: their block-table rows go back to the free list."""
        self.rows.release(request_ids)

    def build(self, chunks: Sequence[StepChunk], pad_to: int | None = None) -> StepMetadata:
        """The step's metadata. `pad_to`: a step of decode tokens only is padded to this many rows (a
        captured graph's bucket): each padding row is a sequence of its own with token 0 at position 0,
        its K/V going to slot 0 of the null block (which no attention reads), sequence length 0 and a
        block table of null blocks; no logits index points at it (`num_padded` counts them)."""
        if self._copied is not None:  # the host mirror is rewritten below: the last copies must be done
            self._copied.synchronize()
        bs = self.layout.block_size
        query_lens = tuple([len(c.token_ids) for c in chunks])
        starts = tuple([c.start for c in chunks])
        t, s = sum(query_lens), len(chunks)
        pad = 0 if pad_to is None else pad_to - s
        if pad < 0 or (pad and t != s):
            raise ValueError(f"only a step of decode tokens pads, to at least its {s} rows (pad_to={pad_to})")
        t, s = t + pad, s + pad
        tables = [c.block_ids for c in chunks]
        widest = max(map(len, itertools.chain.from_iterable(tables)), default=0)
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
            loc = token_seq + [s]
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
        for g in range(len(self.layout.groups)):  # each new token's block (lists: cheaper than tensor ops here)
            try:
                if t == s:
                    blocks = [table[g][p // bs] for table, p in zip(tables, positions, strict=False)]
                else:
                    blocks = [tables[i][g][p // bs] for i, p in zip(token_seq, positions, strict=True)]
            except IndexError:
                blocks = [0]
            if 0 in blocks:
                raise ValueError(f"group {g}: a new token maps to the null block (block table too short)")
            rows.append(blocks + [0] * pad)
        table_rows = self.rows.rows_for(_row_keys(chunks), tables) + [self.rows.null_row] * pad
        h = self._host
        h.per_token[:len(rows), :t].copy_(_as_tensor(list(itertools.chain.from_iterable(rows))).view(len(rows), t))
        torch.add(h.slot_blocks[:, :t] * bs, h.slot_offsets[:t], out=h.slot_mapping[:, :t])
        seq_lens = [start + n for start, n in zip(starts, query_lens, strict=True)] + [0] * pad
        per_seq = seq_lens + [0] + loc + logits + [0] * (s + 1 - len(logits)) + table_rows + [0]
        h.per_seq[:, :s + 1].copy_(_as_tensor(per_seq).view(4, s + 1))
        for g, out in enumerate(h.table_views(s, width)):
            self.rows.gather(g, h.table_rows[:s], width, out, on_device=False)
        if pad:
            query_lens, starts = query_lens + (1,) * pad, starts + (0,) * pad
        host = h.views(t, s, len(logits), width, query_lens, starts, None, pad)
        if self._device is h:
            return _with_split(host)
        d = self._device
        # whole buffers: contiguous, so the copies stay asynchronous from pinned memory (a few hundred KB)
        d.per_token.copy_(h.per_token, non_blocking=True)
        d.per_seq.copy_(h.per_seq, non_blocking=True)
        for g, out in enumerate(d.table_views(s, width)):  # the step's rows, gathered on the device
            self.rows.gather(g, d.table_rows[:s], width, out, on_device=True)
        self._copied = torch.cuda.Event()
        self._copied.record(torch.cuda.current_stream(self.device))  # where the copies ran: cuda:N's stream
        return _with_split(d.views(t, s, len(logits), width, query_lens, starts, host, pad))


def _with_split(metadata: StepMetadata) -> StepMetadata:
    split = mixed_split(metadata)
    return metadata if split is None else dataclasses.replace(metadata, mixed=split)


def _row_keys(chunks: Sequence[StepChunk]) -> list[object]:
    """One key per chunk for its block-table row: the request id (a chunk without one, or a second chunk of
    one request in a step, gets a key of its own)."""
    try:
        keys: list[object] = [c.request_id for c in chunks]
    except AttributeError:
        keys = [getattr(c, "request_id", None) for c in chunks]
    if None in keys or len(set(keys)) != len(keys):
        seen: set[object] = set()
        for i, key in enumerate(keys):
            if key is None or key in seen:
                keys[i] = (key, i)
            seen.add(keys[i])
    return keys
