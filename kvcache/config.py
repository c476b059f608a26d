"""KV cache configuration: groups of layers sharing a spec, and the pool size.

Guarantees (checked once in `__post_init__`): `num_blocks >= 1` (block 0 is the
null block, so usable blocks are `num_blocks - 1`); layer names are unique
across groups; every group has at least one layer.

The physical layout (see connectors/page_pool.py) is one page per block id,
shared by all groups: a page must hold one block of every layer of the largest
group, hence `page_size_bytes = max(spec.page_size_bytes * num_layers)`.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import gcd, lcm
from collections.abc import Iterable

from kvcache.specs import KVCacheSpec


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """Layers that share one block table (and therefore one spec)."""

    layer_names: tuple[str, ...]
    spec: KVCacheSpec

    def __post_init__(self) -> None:
        names = (self.layer_names,) if isinstance(self.layer_names, str) else tuple(self.layer_names)
        object.__setattr__(self, "layer_names", names)
        if not names:
            raise ValueError("a KV cache group needs at least one layer")
        if not isinstance(self.spec, KVCacheSpec):
            raise TypeError(f"spec must be a KVCacheSpec, got {type(self.spec).__name__}")

    @property
    def kv_cache_spec(self) -> KVCacheSpec:
        return self.spec

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block for every layer of this group."""
        return self.spec.page_size_bytes * len(self.layer_names)


def page_size_bytes_for_groups(groups: Iterable[KVCacheGroupSpec]) -> int:
    """Bytes per pool page: large enough for one block of any group."""
    return max((g.page_size_bytes for g in groups), default=0)


def num_blocks_for_budget(budget_bytes: int, groups: Iterable[KVCacheGroupSpec]) -> int:
    """How many blocks (null block included) fit in `budget_bytes`.

    Raises ValueError when not even the null block plus one usable block fit.
    """
    page = page_size_bytes_for_groups(tuple(groups))
    if page <= 0:
        raise ValueError("no KV cache groups: nothing to size")
    num_blocks = int(budget_bytes) // page
    if num_blocks < 2:
        raise ValueError(f"budget of {budget_bytes} bytes holds {num_blocks} pages of {page} bytes; need >= 2")
    return num_blocks


@dataclass(frozen=True)
class KVCacheConfig:
    """`num_blocks` pages shared by `groups` (block ids unique across groups)."""

    num_blocks: int
    groups: tuple[KVCacheGroupSpec, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "groups", tuple(self.groups))
        if not isinstance(self.num_blocks, int) or self.num_blocks < 1:
            raise ValueError(f"num_blocks must be an int >= 1, got {self.num_blocks!r}")
        seen: set[str] = set()
        for g in self.groups:
            if not isinstance(g, KVCacheGroupSpec):
                raise TypeError(f"groups must hold KVCacheGroupSpec, got {type(g).__name__}")
            dup = seen.intersection(g.layer_names)
            if dup:
                raise ValueError(f"layer(s) {sorted(dup)} appear in more than one group")
            seen.update(g.layer_names)

    @property
    def kv_cache_groups(self) -> tuple[KVCacheGroupSpec, ...]:
        return self.groups

    @property
    def page_size_bytes(self) -> int:
        return page_size_bytes_for_groups(self.groups)

    @property
    def scheduler_block_size(self) -> int:
        """LCM of the group block sizes: prefix hits are multiples of it."""
        return lcm(*(g.spec.block_size for g in self.groups)) if self.groups else 1

    @property
    def default_hash_block_size(self) -> int:
        """GCD of the group block sizes: the finest granularity every group can use."""
        return gcd(*(g.spec.block_size for g in self.groups)) if self.groups else 1
