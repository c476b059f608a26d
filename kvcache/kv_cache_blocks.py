"""KVCacheBlocks: the immutable per-group block lists the scheduler receives.

`blocks[i][j]` is block j of KV cache group i (groups are the outer dimension
because they may hold different numbers of blocks). Callers must not mutate
the lists; the manager hands out one shared empty instance for "no blocks".
"""
from __future__ import annotations

from collections.abc import Sequence

from kvcache.blocks import KVCacheBlock


class KVCacheBlocks:
    """Immutable allocation result: `blocks[i][j]` is block j of KV cache group i."""

    __slots__ = ("blocks",)

    def __init__(self, blocks: tuple[Sequence[KVCacheBlock], ...]) -> None:
        self.blocks = blocks

    def __add__(self, other: KVCacheBlocks) -> KVCacheBlocks:
        return KVCacheBlocks(tuple(list(a) + list(b) for a, b in zip(self.blocks, other.blocks, strict=True)))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, KVCacheBlocks):
            return NotImplemented
        return len(self.blocks) == len(other.blocks) and all(
            [b.block_id for b in x] == [b.block_id for b in y] for x, y in zip(self.blocks, other.blocks, strict=True))

    __hash__ = None  # type: ignore[assignment]  # mutable contents: unhashable, as the data model spells it

    def __repr__(self) -> str:
        return f"KVCacheBlocks({self.get_block_ids()})"

    def get_block_ids(self, allow_none: bool = False) -> tuple[list[int], ...] | None:
        if allow_none and all(len(g) == 0 for g in self.blocks):
            return None
        return tuple([b.block_id for b in g] for g in self.blocks)

    def get_unhashed_block_ids(self) -> list[int]:
        """Ids of blocks not in the prefix cache (single group only)."""
        if len(self.blocks) != 1:
            raise ValueError("get_unhashed_block_ids only supports one KV cache group")
        return [b.block_id for b in self.blocks[0] if b.block_hash is None]

    def get_unhashed_block_ids_all_groups(self) -> list[list[int]]:
        """Per group, ids of real blocks not in the prefix cache (where remote KV lands)."""
        return [[b.block_id for b in g if b.block_hash is None and not b.is_null] for g in self.blocks]

    def new_empty(self) -> KVCacheBlocks:
        return KVCacheBlocks(tuple(() for _ in self.blocks))
