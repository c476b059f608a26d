"""Layer streaming's unit of transfer: one layer slice of a page.

A page holds one block's K and V for every layer slot of its KV cache group,
slot after slot (`pd.engine.kv.layout`): slot s is bytes [s * L, (s + 1) * L)
of the page, L bytes per layer. With `transfer.streaming: layer` a worker cuts
every page into `num_slices` equal slices of consecutive slots and its
connector moves slices, never whole pages: slice k of block b is transfer unit
`b * num_slices + k`, which is page `b * num_slices + k` of the same memory seen
as pages of page_size_bytes / num_slices bytes (`SlicedPages`). So leases,
digests, PULL/PAGES, shared memory and the checks on every id work unchanged,
on units; only the connector's edges translate (`units`, `blocks_of`).

Both sides must cut alike: the slice size is part of the handshake's
compatibility hash, so a producer and a consumer that cut differently refuse
each other at the handshake, with that reason.

`LayerClock` says when a slice is complete during a forward: slice k of group
g once the model has run the last layer whose slot in g falls in slice k.
"""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable
from typing import Any

import torch

from connectors.pages import KVPages

_LAYER_NAME = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


def choose_num_slices(num_slots: int, max_parts: int) -> int:
    """The most slices of whole slots, at most `max_parts`: the largest divisor of `num_slots`
    not above it (30 slots and 4 parts: 3 slices of 10 layers)."""
    if num_slots < 1 or max_parts < 1:
        raise ValueError("num_slots and max_parts must be >= 1")
    return max(d for d in range(1, min(num_slots, max_parts) + 1) if num_slots % d == 0)


def units(block_ids: Iterable[int], num_slices: int) -> list[int]:
    """The transfer units of these blocks, block by block, slice 0 first."""
    return [b * num_slices + k for b in block_ids for k in range(num_slices)]


def blocks_of(unit_ids: Iterable[int], num_slices: int) -> set[int]:
    """The blocks these units belong to."""
    return {u // num_slices for u in unit_ids}


class SlicedPages:
    """A `KVPages` seen as `num_slices` times as many pages, each a slice of one: the same
    memory, no copy. CPU pools only (a CUDA pool's stream ordering is kept per pool object)."""

    def __init__(self, pool: KVPages, num_slices: int):
        if pool.device.type != "cpu":
            raise ValueError(f"layer streaming needs a CPU page pool in this version, got {pool.device}")
        if num_slices < 1 or pool.page_size_bytes % num_slices:
            raise ValueError(f"a page of {pool.page_size_bytes} bytes does not cut into {num_slices} slices")
        self.base = pool
        self.num_slices = num_slices
        self.num_blocks = pool.num_blocks * num_slices
        self.page_size_bytes = pool.page_size_bytes // num_slices
        self.device = pool.device
        self.buffer: torch.Tensor = pool.buffer.view(self.num_blocks, self.page_size_bytes)

    @property
    def shared_path(self) -> str | None:
        return self.base.shared_path

    @property
    def nbytes(self) -> int:
        return self.base.nbytes


def layer_indices(layer_names: Iterable[str]) -> tuple[int, ...]:
    """Model layer numbers from kvcache layer names ("layers.7", "model.layers.7.attn")."""
    out = []
    for name in layer_names:
        m = _LAYER_NAME.search(name)
        if m is None:
            raise ValueError(f"layer streaming needs layer names with a layer number, got {name!r}")
        out.append(int(m.group(1)))
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class LayerClock:
    """When each (group, slice) is complete in a forward: after model layer `last[g][k]`
    (-1: the slice holds no layer of that group, so nothing to wait for)."""

    num_slices: int
    last: tuple[tuple[int, ...], ...]

    @classmethod
    def from_groups(cls, kv_cache_groups: Any, num_slices: int) -> LayerClock:
        """From kvcache `KVCacheGroupSpec`s: slot s of group g is its s-th layer name."""
        layers = [layer_indices(g.layer_names) for g in kv_cache_groups]
        num_slots = max(len(x) for x in layers)
        if num_slots % num_slices:
            raise ValueError(f"{num_slots} layer slots do not cut into {num_slices} slices")
        per = num_slots // num_slices
        return cls(num_slices, tuple(tuple(max(x[k * per:(k + 1) * per], default=-1) for k in range(num_slices))
                                     for x in layers))

    def due_after(self, layer: int) -> list[tuple[int, int]]:
        """(group, slice) pairs whose last layer is `layer`."""
        return [(g, k) for g, row in enumerate(self.last) for k, last in enumerate(row) if last == layer]

    def first_due(self) -> list[tuple[int, int]]:
        """(group, slice) pairs complete before any layer runs (no layer of theirs in the slice)."""
        return self.due_after(-1)
