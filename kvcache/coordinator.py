"""Coordinators: fan a request's calls out to one manager per KV cache group.

All groups draw block ids from one shared BlockPool. Three flavours:
- NoPrefixCacheCoordinator: caching off (any number of groups, even 0);
- UnitaryCoordinator: exactly one group;
- HybridCoordinator: several groups; the prefix hit is the longest length every
  group accepts, found by a fixed-point search over groups with equal specs
  batched together and full attention first, aligned to the LCM of the group
  block sizes.

Guarantee: `allocate_new_computed_blocks` touches every group's hits before any
group takes fresh blocks, so one group's allocation can never evict another
group's not-yet-claimed hit.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple, Sequence

from kvcache.block_pool import BlockPool
from kvcache.blocks import KVCacheBlock
from kvcache.config import KVCacheConfig
from kvcache.hashing import hashes_at_block_size
from kvcache.mamba import MambaManager
from kvcache.single_type import FullAttentionManager, SingleTypeKVCacheManager, SlidingWindowManager
from kvcache.specs import FullAttentionSpec, KVCacheSpec, MambaSpec, SlidingWindowSpec


def make_single_type_manager(spec: KVCacheSpec, block_pool: BlockPool, enable_caching: bool,
                             group_id: int, scheduler_block_size: int, max_model_len: int,
                             max_num_batched_tokens: int) -> SingleTypeKVCacheManager:
    if isinstance(spec, FullAttentionSpec):
        cls = FullAttentionManager
    elif isinstance(spec, SlidingWindowSpec):
        cls = SlidingWindowManager
    elif isinstance(spec, MambaSpec):
        cls = MambaManager
    else:
        raise TypeError(f"no KV cache manager for spec type {type(spec).__name__}")
    cap = spec.max_admission_blocks_per_request(max_num_batched_tokens, max_model_len)
    return cls(spec, block_pool, enable_caching, group_id, scheduler_block_size, cap)


@dataclass(frozen=True)
class CoordinatorSettings:
    """Everything a coordinator is built from, validated once."""

    kv_cache_config: KVCacheConfig
    max_model_len: int
    max_num_batched_tokens: int
    enable_caching: bool
    enable_kv_cache_events: bool
    scheduler_block_size: int
    hash_block_size: int

    def __post_init__(self) -> None:
        sbs, hbs = self.scheduler_block_size, self.hash_block_size
        if hbs <= 0 or sbs % hbs or any(sbs % g.spec.block_size for g in self.kv_cache_config.groups):
            raise ValueError(f"scheduler block size {sbs} must be a multiple of the hash block size {hbs} "
                             f"and of every group's block size")


class KVCacheCoordinator:
    """Fans calls out to one single-type manager per group over one shared pool."""

    def __init__(self, settings: CoordinatorSettings) -> None:
        self.settings = settings
        self.kv_cache_config = settings.kv_cache_config
        self.max_model_len = settings.max_model_len
        self.enable_caching = settings.enable_caching
        self.scheduler_block_size = settings.scheduler_block_size
        self.hash_block_size = settings.hash_block_size
        self.block_pool = BlockPool(settings.kv_cache_config.num_blocks, settings.enable_caching,
                                    settings.hash_block_size, settings.enable_kv_cache_events)
        self.single_type_managers = tuple(
            make_single_type_manager(g.spec, self.block_pool, settings.enable_caching, i,
                                     settings.scheduler_block_size, settings.max_model_len,
                                     settings.max_num_batched_tokens)
            for i, g in enumerate(settings.kv_cache_config.groups))

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: tuple[Sequence[KVCacheBlock], ...],
                                   total_computed_tokens: int, num_tokens_main_model: int,
                                   apply_admission_cap: bool = False) -> int:
        return sum(
            m.get_num_blocks_to_allocate(request_id, num_tokens, new_computed_blocks[i], total_computed_tokens,
                                         num_tokens_main_model, apply_admission_cap)
            for i, m in enumerate(self.single_type_managers))

    def allocate_new_computed_blocks(self, request_id: str, new_computed_blocks: tuple[Sequence[KVCacheBlock], ...],
                                     num_local_computed_tokens: int, num_external_computed_tokens: int) -> None:
        managers = self.single_type_managers
        if any(request_id in m.num_cached_block for m in managers):
            assert all(len(b) == 0 for b in new_computed_blocks), "prefix hits for a running request"
            return
        # phase 1: every group claims its hits; phase 2: external-token blocks
        for i, m in enumerate(managers):
            m.add_local_computed_blocks(request_id, new_computed_blocks[i], num_local_computed_tokens,
                                        num_external_computed_tokens)
        if num_external_computed_tokens > 0:
            for m in managers:
                m.allocate_external_computed_blocks(request_id, num_local_computed_tokens,
                                                    num_external_computed_tokens)

    def allocate_new_blocks(self, request_id: str, num_tokens: int,
                            num_tokens_main_model: int) -> tuple[list[KVCacheBlock], ...]:
        return tuple(m.allocate_new_blocks(request_id, num_tokens, num_tokens_main_model)
                     for m in self.single_type_managers)

    def cache_blocks(self, request, num_computed_tokens: int) -> None:
        for m in self.single_type_managers:
            m.cache_blocks(request, num_computed_tokens)

    def free(self, request_id: str) -> None:
        for m in self.single_type_managers:
            m.free(request_id)

    def pop_blocks_for_free(self, request_id: str) -> list[KVCacheBlock]:
        blocks: list[KVCacheBlock] = []
        for m in self.single_type_managers:
            blocks.extend(m.pop_blocks_for_free(request_id))
        return blocks

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        return [m.get_num_common_prefix_blocks(running_request_id) for m in self.single_type_managers]

    def remove_skipped_blocks(self, request_id: str, total_computed_tokens: int) -> None:
        for m in self.single_type_managers:
            m.remove_skipped_blocks(request_id, total_computed_tokens)

    def get_blocks(self, request_id: str) -> tuple[list[KVCacheBlock], ...]:
        return tuple(m.req_to_blocks.get(request_id) or [] for m in self.single_type_managers)

    def new_step_starts(self) -> None:
        for m in self.single_type_managers:
            m.new_step_starts()

    def find_longest_cache_hit(self, block_hashes: Sequence[bytes],
                               max_cache_hit_length: int) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        raise NotImplementedError


class NoPrefixCacheCoordinator(KVCacheCoordinator):
    """Caching off (or no groups at all): never a hit, never caches."""

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        return [0] * len(self.single_type_managers)

    def find_longest_cache_hit(self, block_hashes, max_cache_hit_length):
        return tuple([] for _ in self.single_type_managers), 0


class UnitaryCoordinator(KVCacheCoordinator):
    """Exactly one group: its manager's hit is the hit."""

    def __init__(self, settings: CoordinatorSettings) -> None:
        super().__init__(settings)
        if len(self.single_type_managers) != 1:
            raise ValueError("UnitaryCoordinator needs exactly one KV cache group")
        self.block_size = self.single_type_managers[0].block_size
        if self.enable_caching and self.hash_block_size != self.block_size:
            raise ValueError(f"one group: hash block size {self.hash_block_size} must equal "
                             f"block size {self.block_size}")

    def find_longest_cache_hit(self, block_hashes, max_cache_hit_length):
        hits = self.single_type_managers[0].find_longest_cache_hit(
            block_hashes, max_cache_hit_length, (0,), self.block_size)
        return hits, len(hits[0]) * self.block_size


class SpecGroup(NamedTuple):
    """Groups with equal specs, looked up together."""
    spec: KVCacheSpec
    group_ids: list[int]
    manager: SingleTypeKVCacheManager


class HybridCoordinator(KVCacheCoordinator):
    """Several groups with at least two distinct specs."""

    def __init__(self, settings: CoordinatorSettings) -> None:
        super().__init__(settings)
        if any(m.block_size % self.hash_block_size for m in self.single_type_managers):
            raise ValueError("every group's block size must be a multiple of the hash block size")
        spec_groups: list[SpecGroup] = []
        for i, m in enumerate(self.single_type_managers):
            for sg in spec_groups:
                if sg.spec == m.kv_cache_spec:
                    sg.group_ids.append(i)
                    break
            else:
                spec_groups.append(SpecGroup(m.kv_cache_spec, [i], m))
        if len(spec_groups) < 2:
            raise ValueError("HybridCoordinator needs at least two distinct KV cache specs")
        # full attention first: its hits are downward closed, so it only ever
        # needs one lookup and is truncated to the agreed length afterwards
        spec_groups.sort(key=lambda sg: not isinstance(sg.spec, FullAttentionSpec))
        self.spec_groups = spec_groups
        self.num_uncached_common_prefix_tokens = 0

    def cache_blocks(self, request, num_computed_tokens: int) -> None:
        # hits are multiples of the scheduler block size: nothing past the last
        # such boundary could ever be hit
        sbs = self.scheduler_block_size
        aligned = num_computed_tokens // sbs * sbs
        for m in self.single_type_managers:
            m.cache_blocks(request, aligned)

    def find_longest_cache_hit(self, block_hashes, max_cache_hit_length):
        hbs = self.hash_block_size
        sbs = self.scheduler_block_size
        hits_by_group: list[list[KVCacheBlock] | None] = [None] * len(self.single_type_managers)
        hit_length = max_cache_hit_length
        longest = 0
        spec_groups = self.spec_groups
        simple = len(spec_groups) == 2 and isinstance(spec_groups[0].spec, FullAttentionSpec)
        while True:
            curr = hit_length
            for spec, group_ids, manager in spec_groups:
                bs = spec.block_size
                if isinstance(spec, FullAttentionSpec) and hits_by_group[group_ids[0]] is not None:
                    curr = curr // bs * bs
                    continue
                hits = manager.find_longest_cache_hit(
                    hashes_at_block_size(block_hashes, hbs, bs), curr, group_ids, sbs)
                curr = len(hits[0]) * bs
                for gid, blocks in zip(group_ids, hits):
                    hits_by_group[gid] = blocks
                if curr > longest:
                    longest = curr
            if curr >= hit_length:
                break
            hit_length = curr
            if simple:
                break
        first = spec_groups[0]
        if isinstance(first.spec, FullAttentionSpec):
            keep = hit_length // first.spec.block_size
            for gid in first.group_ids:
                blocks = hits_by_group[gid]
                if blocks is not None:
                    del blocks[keep:]
        self.num_uncached_common_prefix_tokens = longest - hit_length
        return tuple(b if b is not None else [] for b in hits_by_group), hit_length


def make_coordinator(settings: CoordinatorSettings) -> KVCacheCoordinator:
    if not settings.enable_caching or not settings.kv_cache_config.groups:
        # caching off, or an attention-free model: nothing can be cached
        return NoPrefixCacheCoordinator(replace(settings, enable_caching=False))
    if len(settings.kv_cache_config.groups) == 1:
        return UnitaryCoordinator(settings)
    return HybridCoordinator(settings)
