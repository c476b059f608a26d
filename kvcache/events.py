"""KV cache events: what entered and left the prefix cache.

Plain dataclasses (msgpack/JSON friendly via `to_dict`), never pickled across
processes. The pool emits one BlockStored per cache call (for the blocks that
call actually cached), one BlockRemoved per hash key that leaves the cache, and
AllBlocksCleared on a successful reset. BlockStored carries only `group_idx`;
`KVCacheManager.take_events` fills in the group's kind and sliding window.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

MEDIUM_GPU = "GPU"


@dataclass
class BlockStored:
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM_GPU
    lora_name: str | None = None
    extra_keys: list[tuple | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"type": "BlockStored", **asdict(self)}


@dataclass
class BlockRemoved:
    block_hashes: list[bytes]
    medium: str | None = MEDIUM_GPU
    group_idx: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"type": "BlockRemoved", **asdict(self)}


@dataclass
class AllBlocksCleared:
    def to_dict(self) -> dict[str, Any]:
        return {"type": "AllBlocksCleared"}


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared
