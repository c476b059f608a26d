"""Coordinators: fan a request's calls out to one manager per KV cache group.

All groups draw block ids from one shared BlockPool. Three flavours:
- NoPrefixCacheCoordinator: caching off (any number of groups, even 0);
- UnitaryCoordinator: exactly one group;
- HybridCoordinator: several groups; the prefix hit is the longest length every
  group accepts, found by a fixed-point search over groups with equal specs
  batched together and full attention first, aligned to the LCM of the group
  block sizes.

`allocate_slots` is the one allocation sequence (UnitaryCoordinator runs it for
its one group without the per-group loops and tuples). Guarantees: it changes
nothing but window releases when the blocks do not fit; it touches every
group's hits before any group takes fresh blocks, so one group's allocation can
never evict another group's not-yet-claimed hit; all groups allocate before any
group caches (the KV event order vLLM emits).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple
from collections.abc import Sequence

from kvcache.block_pool import BlockPool
from kvcache.blocks import KVCacheBlock
from kvcache.config import KVCacheConfig
from kvcache.hashing import hashes_at_block_size
from kvcache.kv_cache_blocks import KVCacheBlocks
from kvcache.mamba import MambaManager
from kvcache.single_type import FullAttentionManager, SingleTypeKVCacheManager, SlidingWindowManager
from kvcache.specs import FullAttentionSpec, KVCacheSpec, MambaSpec, SlidingWindowSpec


def make_single_type_manager(spec: KVCacheSpec, block_pool: BlockPool, enable_caching: bool,
                             group_id: int, scheduler_block_size: int, max_model_len: int,
                             max_num_batched_tokens: int) -> SingleTypeKVCacheManager:
    cls: type[SingleTypeKVCacheManager]
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
        # managers that ever drop leading blocks (windows, Mamba): full attention
        # never does, so its groups skip that call on every allocation
        self.skipping_managers = tuple(m for m in self.single_type_managers if m.skips)
        # caching stops at a multiple of this many tokens (1: at every group's block boundary)
        self.cache_alignment = 1
        # (group index, manager) pairs built once: zip() per call costs more than the loop body
        self._indexed_managers = tuple(enumerate(self.single_type_managers))
        # "no blocks in any group": the shared empty result and "no prefix hits"
        self.no_blocks: tuple[Sequence[KVCacheBlock], ...] = tuple(() for _ in self.single_type_managers)
        self.empty_kv_cache_blocks = KVCacheBlocks(self.no_blocks)
        # per group (blocks by request, block size, cached-block counts) where every group sizes with the base
        # formula and never skips: `allocate_slots_in_order` can then tell a no-op allocation by itself
        plain = not self.skipping_managers and all(
            type(m).get_num_blocks_to_allocate is SingleTypeKVCacheManager.get_num_blocks_to_allocate
            for m in self.single_type_managers)
        self._plain_groups = tuple((m.req_to_blocks, m.block_size, m.num_cached_block)
                                   for m in self.single_type_managers) if plain else None

    def allocate_slots(self, request, num_new_tokens: int, num_new_computed_tokens: int,
                       new_computed_blocks: tuple[Sequence[KVCacheBlock], ...] | None,
                       num_lookahead_tokens: int, num_external_computed_tokens: int, headroom: int,
                       reserved_blocks: int, full_sequence_must_fit: bool,
                       cache: bool) -> KVCacheBlocks | None:
        """Claim the hits, allocate slots for the new (+ lookahead) tokens after the
        computed and external ones, and cache the full blocks when `cache`.

        Returns the newly allocated blocks (`empty_kv_cache_blocks` when none), or
        None when they do not fit in the free pool less `headroom` and
        `reserved_blocks`; with `full_sequence_must_fit` the whole current
        sequence must fit in the free pool less `headroom`. The caller owns the
        policy that sets those numbers."""
        rid = request.request_id
        max_len = self.max_model_len
        queue = self.block_pool.free_block_queue
        hits = self.no_blocks if new_computed_blocks is None else new_computed_blocks
        num_local = request.num_computed_tokens + num_new_computed_tokens
        num_computed = num_local + num_external_computed_tokens
        # clamps written as comparisons: this runs on every decode step (no builtin calls)
        total_computed = num_computed if num_computed < max_len else max_len
        if full_sequence_must_fit:
            full = min(request.num_tokens, max_len)
            needed = self.get_num_blocks_to_allocate(rid, full, hits, total_computed, full,
                                                     apply_admission_cap=True)
            if needed + headroom > queue.num_free_blocks:
                return None
        num_main = total_computed + num_new_tokens
        num_slots = num_main + num_lookahead_tokens
        if num_slots > max_len:
            num_slots = max_len
        # release blocks that left the window first, even if we fail below
        for m in self.skipping_managers:
            m.remove_skipped_blocks(rid, total_computed)
        needed = 0
        for i, m in self._indexed_managers:
            needed += m.get_num_blocks_to_allocate(rid, num_slots, hits[i], num_computed, num_main)
        if needed + headroom > queue.num_free_blocks - reserved_blocks:
            return None
        if hits is not self.no_blocks or num_external_computed_tokens > 0:
            self.allocate_new_computed_blocks(rid, hits, num_local, num_external_computed_tokens)
        # `needed` counts every block any group will take from the pool, so 0
        # means no group grows (most decode steps)
        new = self.allocate_new_blocks(rid, num_slots, num_main) if needed else None
        if cache:
            # unverified draft tokens (past num_tokens) are never cached
            num_tokens = request.num_tokens
            self.cache_blocks(request, num_main if num_main < num_tokens else num_tokens)
        return KVCacheBlocks(new) if new is not None and any(new) else self.empty_kv_cache_blocks

    def allocate_slots_in_order(self, requests: Sequence, num_new_tokens: Sequence[int],
                                cache: bool) -> list[KVCacheBlocks]:
        """`allocate_slots(request, n)` with no hits, external tokens, lookahead, headroom or reserve, for each
        pair in turn, stopping at the first that does not fit (`KVCacheManager.allocate_slots_in_order`).
        With `_plain_groups`, a request whose blocks hold the slots already and that completes no block to
        cache is answered here, with no call: its allocation would change nothing."""
        served: list[KVCacheBlocks] = []
        empty, max_len, align, plain = self.empty_kv_cache_blocks, self.max_model_len, self.cache_alignment, \
            self._plain_groups
        for request, num_new in zip(requests, num_new_tokens, strict=True):
            if plain is not None:
                rid, num_main = request.request_id, request.num_computed_tokens
                num_main = (num_main if num_main < max_len else max_len) + num_new
                num_slots = num_main if num_main < max_len else max_len
                num_cache = num_main if num_main < request.num_tokens else request.num_tokens
                num_cache = num_cache // align * align
                for req_to_blocks, block_size, num_cached_block in plain:
                    blocks = req_to_blocks.get(rid)
                    if (blocks is None or num_slots > len(blocks) * block_size
                            or (cache and num_cache // block_size > num_cached_block.get(rid, 0))):
                        break
                else:
                    served.append(empty)
                    continue
            result = self.allocate_slots(request, num_new, 0, None, 0, 0, 0, 0, False, cache)
            if result is None:
                break
            served.append(result)
        return served

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
        new = []  # a plain loop: a generator would cost a frame on every call
        for m in self.single_type_managers:
            new.append(m.allocate_new_blocks(request_id, num_tokens, num_tokens_main_model))
        return tuple(new)

    def cache_blocks(self, request, num_computed_tokens: int) -> None:
        """Enter each group's full blocks up to `num_computed_tokens` into the prefix cache."""
        align = self.cache_alignment
        if align > 1:
            num_computed_tokens = num_computed_tokens // align * align
        rid = request.request_id
        for m in self.single_type_managers:
            # a group gains a full block only at its block boundaries: most decode
            # steps complete none, and skipping the call is what keeps them cheap
            if num_computed_tokens // m.block_size > m.num_cached_block.get(rid, 0):
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
    """Exactly one group (the common full-attention model): its manager's hit is
    the hit. `allocate_slots` makes the generic path's manager calls in the same
    order; the block operations live only in the manager and the pool."""

    def __init__(self, settings: CoordinatorSettings) -> None:
        super().__init__(settings)
        if len(self.single_type_managers) != 1:
            raise ValueError("UnitaryCoordinator needs exactly one KV cache group")
        m = self.manager = self.single_type_managers[0]
        self.block_size = m.block_size
        if self.enable_caching and self.hash_block_size != self.block_size:
            raise ValueError(f"one group: hash block size {self.hash_block_size} must equal "
                             f"block size {self.block_size}")
        self.skips = bool(self.skipping_managers)
        # Invariant used by allocate_slots: a manager that never skips and sizes
        # with the base formula needs 0 blocks when there are no hits and the
        # request's blocks already hold every slot (most decode steps), so it is
        # not asked then.
        self.sizing_is_plain = not self.skips and (
            type(m).get_num_blocks_to_allocate is SingleTypeKVCacheManager.get_num_blocks_to_allocate)
        self._req_to_blocks = m.req_to_blocks
        self.free = m.free  # type: ignore[method-assign]  # bound once; shadows the per-group loop
        self._find = m.find_longest_cache_hit
        self._num_blocks_to_allocate = m.get_num_blocks_to_allocate
        self._num_cached_block = m.num_cached_block

    def allocate_slots(self, request, num_new_tokens: int, num_new_computed_tokens: int,
                       new_computed_blocks: tuple[Sequence[KVCacheBlock], ...] | None,
                       num_lookahead_tokens: int, num_external_computed_tokens: int, headroom: int,
                       reserved_blocks: int, full_sequence_must_fit: bool,
                       cache: bool) -> KVCacheBlocks | None:
        """KVCacheCoordinator.allocate_slots for one group (same contract)."""
        m = self.manager
        rid = request.request_id
        max_len = self.max_model_len
        # as in the generic path: an explicit hit result (even empty) or external tokens settle the prefix
        if new_computed_blocks is None or new_computed_blocks is self.no_blocks:
            hits: Sequence[KVCacheBlock] = ()
            settle = num_external_computed_tokens > 0
        else:
            hits = new_computed_blocks[0]
            settle = True
        num_local = request.num_computed_tokens + num_new_computed_tokens
        num_computed = num_local + num_external_computed_tokens
        total_computed = num_computed if num_computed < max_len else max_len
        num_free = self.block_pool.free_block_queue.num_free_blocks
        if full_sequence_must_fit:
            full = min(request.num_tokens, max_len)
            if self._num_blocks_to_allocate(rid, full, hits, total_computed, full,
                                            apply_admission_cap=True) + headroom > num_free:
                return None
        num_main = total_computed + num_new_tokens
        num_slots = num_main + num_lookahead_tokens
        if num_slots > max_len:
            num_slots = max_len
        if self.skips:
            m.remove_skipped_blocks(rid, total_computed)
            num_free = self.block_pool.free_block_queue.num_free_blocks
        req_blocks = self._req_to_blocks.get(rid)
        if (not hits and req_blocks is not None and self.sizing_is_plain
                and num_slots <= len(req_blocks) * self.block_size):
            needed = 0
        else:
            needed = self._num_blocks_to_allocate(rid, num_slots, hits, num_computed, num_main)
        if needed + headroom > num_free - reserved_blocks:
            return None
        if settle:
            if rid in self._num_cached_block:
                assert not hits, "prefix hits for a running request"
            else:
                m.add_local_computed_blocks(rid, hits, num_local, num_external_computed_tokens)
                if num_external_computed_tokens > 0:
                    m.allocate_external_computed_blocks(rid, num_local, num_external_computed_tokens)
        new = m.allocate_new_blocks(rid, num_slots, num_main) if needed else None
        if cache:
            num_tokens = request.num_tokens
            if num_main > num_tokens:
                num_main = num_tokens  # unverified draft tokens are never cached
            if num_main // self.block_size > self._num_cached_block.get(rid, 0):
                m.cache_blocks(request, num_main)
        return KVCacheBlocks((new,)) if new else self.empty_kv_cache_blocks

    def find_longest_cache_hit(self, block_hashes, max_cache_hit_length):
        """The manager's hit; a miss is reported as `no_blocks` (the shared marker)."""
        hits = self._find(block_hashes, max_cache_hit_length, (0,), self.block_size)
        num_blocks = len(hits[0])
        if not num_blocks:
            return self.no_blocks, 0
        return hits, num_blocks * self.block_size


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
        # hits are multiples of the scheduler block size: nothing past the last
        # such boundary could ever be hit, so nothing past it is cached
        self.cache_alignment = self.scheduler_block_size
        self.num_uncached_common_prefix_tokens = 0

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
                for gid, blocks in zip(group_ids, hits, strict=True):
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
