"""Each request's block table kept across steps, one row per request, so a step writes only what changed.

`BlockRows` holds, per KV cache group, a (max_rows + 1, max_blocks) table on the host and on the engine's
device (the very tensor on the CPU). A request gets a row the first time a step holds one of its chunks
and keeps it until `release` (its request finished). Each step, `rows_for` compares every chunk's block
ids with what its row holds: equal (a decode step that gained no block) costs one list comparison and no
write; ids that extend the row (new blocks) write only the tail; anything else (a sliding window that
put the null block 0 where a block was, a preempted request's new blocks, a request id reused) rewrites
the row. The step's block table is then a gather of its rows (`gather`), on the host and on the device.

The last row (`null_row`) is all null blocks and never written: padding rows of a captured graph's bucket
gather it.
"""
from __future__ import annotations

import struct
from collections.abc import Hashable, Sequence

import torch


_PACKERS: dict[int, struct.Struct] = {}  # by length: a step's lists keep their lengths from step to step


def as_tensor(values: list[int]) -> torch.Tensor:
    """An int64 CPU tensor of `values`, packed by a compiled `struct` format: far faster than torch.tensor on
    a list, and 3-5x faster than `array.array("q", values)` at the few hundred values a decode step writes.
    A value that is no int64 raises struct.error."""
    n = len(values)
    if not n:
        return torch.empty(0, dtype=torch.long)
    packer = _PACKERS.get(n)
    if packer is None:
        if len(_PACKERS) > 64:
            _PACKERS.clear()
        packer = _PACKERS[n] = struct.Struct(f"{n}q")
    return torch.frombuffer(bytearray(packer.pack(*values)), dtype=torch.long)


class BlockRows:
    """Per-request block-table rows (see the module docstring).

    Guarantees: after `rows_for(keys, tables)`, row `rows[i]` of every group's table holds `tables[i][g]`
    followed by null blocks, on the host and (once the copies issued are done) on the device; distinct
    keys of one call get distinct rows; `null_row` stays all zeros. A call with more keys than rows raises
    ValueError (the builder sizes the rows from the scheduler's `max_num_seqs`).
    """

    def __init__(self, num_groups: int, max_rows: int, max_blocks: int, device: torch.device,
                 pin: bool = False, separate_device_copy: bool | None = None):
        self.max_rows, self.max_blocks = max_rows, max_blocks
        self.null_row = max_rows
        shape = (max_rows + 1, max_blocks)
        self.host = [torch.zeros(shape, dtype=torch.long, pin_memory=pin) for _ in range(num_groups)]
        # the device's own copy: on a GPU (or when a test asks for one on the CPU)
        separate = device.type != "cpu" if separate_device_copy is None else separate_device_copy
        self.device = ([torch.zeros(shape, dtype=torch.long, device=device) for _ in range(num_groups)]
                       if separate else self.host)
        self._row_of: dict[Hashable, int] = {}
        self._held: list[tuple[list[int], ...]] = [tuple([] for _ in range(num_groups))] * max_rows
        self._free = list(range(max_rows - 1, -1, -1))

    @property
    def num_assigned(self) -> int:
        return len(self._row_of)

    def release(self, keys: Sequence[Hashable] | frozenset) -> None:
        """Frees the rows of these requests (finished); unknown keys are ignored. The rows keep their
        contents: the next holder's first `rows_for` rewrites what differs."""
        for key in keys:
            row = self._row_of.pop(key, None)
            if row is not None:
                self._free.append(row)

    def _take(self, step_keys: set[Hashable]) -> int:
        if not self._free:  # rows of requests that left without a release (preempted, failed): not in this step
            for key in [k for k in self._row_of if k not in step_keys]:
                self._free.append(self._row_of.pop(key))
            if not self._free:
                raise ValueError(f"a step of more than {self.max_rows} sequences")
        return self._free.pop()

    def rows_for(self, keys: Sequence[Hashable], tables: Sequence[Sequence[Sequence[int]]]) -> list[int]:
        """Each key's row, brought up to its `tables[i]` (per group: block ids); keys must be distinct."""
        width, num_groups = self.max_blocks, len(self.host)
        index: list[list[int]] = [[] for _ in range(num_groups)]
        values: list[list[int]] = [[] for _ in range(num_groups)]
        dirty: set[int] = set()
        rows = []
        row_of, held_of, step_keys = self._row_of, self._held, None
        for key, table in zip(keys, tables, strict=True):
            row = row_of.get(key)
            if row is None:
                if step_keys is None:
                    step_keys = set(keys)
                row = row_of[key] = self._take(step_keys)
            rows.append(row)
            held = held_of[row]
            if table == held:  # (a tuple of lists against one: every group in one comparison)
                continue
            now = []
            for g in range(num_groups):
                ids, had = table[g], held[g]
                new = list(ids)
                now.append(new)
                if new == had:
                    continue
                n, m = len(had), len(new)
                if m > width:
                    raise ValueError(f"a block table of {m} blocks exceeds the rows' {width}")
                start = n if m >= n and new[:n] == had else 0  # only new blocks, or the whole row
                end = max(n, m)
                base = row * width
                index[g].extend(range(base + start, base + end))
                values[g].extend(new[start:])
                values[g].extend([0] * (end - m))  # a shorter table than before: null the rest
            held_of[row] = tuple(now)
            dirty.add(row)
        for g in range(num_groups):
            if index[g]:
                self.host[g].view(-1)[as_tensor(index[g])] = as_tensor(values[g])
        if dirty and self.device is not self.host:
            # (row by row from pinned memory: asynchronous; the builder waits for them before it writes again)
            for g in range(num_groups):
                for row in dirty:
                    self.device[g][row].copy_(self.host[g][row], non_blocking=True)
        return rows

    def gather(self, g: int, rows: torch.Tensor, width: int, out: torch.Tensor, on_device: bool) -> None:
        """`out` (len(rows), width) := those rows' first `width` blocks of group g, from the device's table
        (`rows` on the device) or the host's."""
        table = self.device[g] if on_device else self.host[g]
        torch.index_select(table[:, :width], 0, rows, out=out)
