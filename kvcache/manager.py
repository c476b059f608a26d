"""KVCacheManager: the KV cache as the scheduler sees it.

Guarantees:
- `allocate_slots` either returns the newly allocated blocks or returns None
  having changed nothing (except that blocks which left a sliding window are
  released first, which is always safe);
- admission policy: the watermark applies only to WAITING/PREEMPTED requests
  while something is scheduled; `full_sequence_must_fit` checks the whole
  current sequence (sliding windows at their recycling cap) against all free
  blocks; `reserved_blocks` is held back from this allocation only;
- `delay_cache_blocks=True` keeps newly allocated blocks out of the prefix
  cache until `cache_blocks` is called (remote KV not landed yet);
- `free` releases a request's blocks tail-first; `pop_blocks_for_free` hands
  them to the caller instead (who must `free_blocks(reversed(...))` later).

Decisions (block ids, hit lengths, None results, free counts) match vLLM
0.25.1's KVCacheManager for full-attention, sliding-window and Mamba groups.
The single full-attention group has fast paths with identical results.
"""
from __future__ import annotations

import logging
from itertools import islice
from typing import Sequence

from kvcache.blocks import KVCacheBlock
from kvcache.config import KVCacheConfig
from kvcache.coordinator import CoordinatorSettings, make_coordinator
from kvcache.events import BlockStored, KVCacheEvent
from kvcache.kv_cache_blocks import KVCacheBlocks
from kvcache.request import Request, RequestStatus
from kvcache.single_type import FullAttentionManager
from kvcache.specs import AttentionSpec, cdiv
from kvcache.stats import PrefixCacheStats

logger = logging.getLogger(__name__)

_WATERMARK_STATES = (RequestStatus.WAITING, RequestStatus.PREEMPTED)


class KVCacheManager:
    """Scheduler-facing facade over one coordinator and its BlockPool (see the
    module docstring for the guarantees)."""

    def __init__(self, kv_cache_config: KVCacheConfig, max_model_len: int, *, enable_caching: bool = True,
                 hash_block_size: int | None = None, watermark: float = 0.0, log_stats: bool = False,
                 enable_kv_cache_events: bool = False, max_num_batched_tokens: int | None = None) -> None:
        if not isinstance(max_model_len, int) or max_model_len <= 0:
            raise ValueError(f"max_model_len must be a positive int, got {max_model_len!r}")
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {watermark}")
        groups = kv_cache_config.groups
        scheduler_block_size = kv_cache_config.scheduler_block_size
        if hash_block_size is None:
            hash_block_size = kv_cache_config.default_hash_block_size
        if max_num_batched_tokens is None:
            max_num_batched_tokens = max_model_len
        self.kv_cache_config = kv_cache_config
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.log_stats = log_stats
        self.scheduler_block_size = scheduler_block_size
        self.hash_block_size = hash_block_size
        self.prefix_cache_stats = PrefixCacheStats() if log_stats else None
        self.coordinator = make_coordinator(CoordinatorSettings(
            kv_cache_config, max_model_len, max_num_batched_tokens, enable_caching, enable_kv_cache_events,
            scheduler_block_size, hash_block_size))
        self.num_kv_cache_groups = len(groups)
        self.block_pool = self.coordinator.block_pool
        self.watermark_blocks = int(watermark * kv_cache_config.num_blocks)
        self.kv_cache_event_metadata = tuple((g.spec.kind, g.spec.sliding_window_size) for g in groups)
        self.empty_kv_cache_blocks = KVCacheBlocks(tuple(() for _ in groups))
        # Fast path: one full-attention group (the common case) skips the
        # coordinator fan-out; it takes exactly the same decisions.
        managers = self.coordinator.single_type_managers
        self._fa = managers[0] if len(managers) == 1 and type(managers[0]) is FullAttentionManager else None
        self._fa_map = self.block_pool.cached_map(0) if self._fa is not None else None

    # ------------------------------------------------------------------ queries
    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.free_block_queue.num_free_blocks

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        """The stats since the previous call (None when not logging)."""
        if not self.log_stats:
            return None
        stats = self.prefix_cache_stats
        self.prefix_cache_stats = PrefixCacheStats()
        return stats

    def create_kv_cache_blocks(self, blocks: tuple[Sequence[KVCacheBlock], ...]) -> KVCacheBlocks:
        return KVCacheBlocks(blocks) if any(blocks) else self.empty_kv_cache_blocks

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        return self.create_kv_cache_blocks(self.coordinator.get_blocks(request_id))

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return self.get_blocks(request_id).get_block_ids()

    def get_block_ids_for_computed_tokens(self, request_id: str, num_computed_tokens: int) -> tuple[list[int], ...]:
        """Block ids covering the computed tokens (attention groups clipped)."""
        out = []
        for g, ids in zip(self.kv_cache_config.groups, self.get_block_ids(request_id)):
            if isinstance(g.spec, AttentionSpec):
                ids = ids[:cdiv(num_computed_tokens, g.spec.block_size)]
            out.append(ids)
        return tuple(out)

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        return self.coordinator.get_num_common_prefix_blocks(running_request_id)

    def num_blocks_needed_for_full_sequence(self, request: Request) -> int:
        """Blocks `request` still has to allocate to hold its whole current
        sequence (sliding windows counted at their recycling cap): what an
        in-flight prefill reserves against async loads."""
        full = min(request.num_tokens, self.max_model_len)
        return self.coordinator.get_num_blocks_to_allocate(
            request.request_id, full, self.empty_kv_cache_blocks.blocks, request.num_computed_tokens, full,
            apply_admission_cap=True)

    def get_num_blocks_to_allocate(self, request: Request, num_tokens: int, num_computed_tokens: int = 0) -> int:
        """Free-pool blocks needed to give `request` `num_tokens` slots (no hits)."""
        return self.coordinator.get_num_blocks_to_allocate(
            request.request_id, num_tokens, self.empty_kv_cache_blocks.blocks, num_computed_tokens, num_tokens)

    # ------------------------------------------------------------------ prefix cache
    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """Longest cached prefix of `request` (capped at num_tokens - 1 so the last
        token is recomputed for logits). Changes no state."""
        if not self.enable_caching or request.skip_reading_prefix_cache:
            return self.empty_kv_cache_blocks, 0
        hasher = request.block_hasher
        if hasher is not None and getattr(hasher, "block_size", self.hash_block_size) != self.hash_block_size:
            # hashes of another granularity would name the wrong prefixes
            raise ValueError(f"request {request.request_id} is hashed in blocks of {hasher.block_size} tokens; "
                             f"this KV cache needs {self.hash_block_size}")
        max_hit = request.num_tokens - 1
        fa = self._fa
        if fa is not None:
            bs = fa.block_size
            m = self._fa_map
            hits: list[KVCacheBlock] = []
            append = hits.append
            for h in islice(request.block_hashes, max_hit // bs):
                blk = m.get(h)
                if blk is None:
                    break
                append(blk)
            num_hit = len(hits) * bs
            result = KVCacheBlocks((hits,)) if hits else self.empty_kv_cache_blocks
        else:
            blocks, num_hit = self.coordinator.find_longest_cache_hit(request.block_hashes, max_hit)
            result = self.create_kv_cache_blocks(blocks)
        if self.log_stats:
            self.prefix_cache_stats.record(request.num_tokens, num_hit, request.num_preemptions > 0)
        return result, num_hit

    # ------------------------------------------------------------------ allocation
    def allocate_slots(self, request: Request, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks: KVCacheBlocks | None = None, num_lookahead_tokens: int = 0,
                       num_external_computed_tokens: int = 0, delay_cache_blocks: bool = False,
                       full_sequence_must_fit: bool = False, reserved_blocks: int = 0,
                       has_scheduled_reqs: bool = True) -> KVCacheBlocks | None:
        """Give `request` slots for `num_new_tokens` (+ lookahead) after its computed,
        newly hit (`new_computed_blocks`) and external tokens. Returns only the
        newly allocated blocks, or None when they do not fit."""
        fa = self._fa
        if fa is None or num_external_computed_tokens:
            return self._allocate_generic(request, num_new_tokens, num_new_computed_tokens, new_computed_blocks,
                                          num_lookahead_tokens, num_external_computed_tokens, delay_cache_blocks,
                                          full_sequence_must_fit, reserved_blocks, has_scheduled_reqs)
        # One full-attention group without external tokens: nothing is ever
        # skipped, so the arithmetic of the generic path collapses to this.
        if num_new_tokens == 0:
            raise ValueError("num_new_tokens must be greater than 0 when there are no external computed tokens")
        rid = request.request_id
        req_blocks = fa.req_to_blocks.get(rid)
        hits = ()
        explicit = new_computed_blocks is not None and new_computed_blocks.blocks is not self.empty_kv_cache_blocks.blocks
        if explicit:
            if req_blocks or rid in fa.num_cached_block:
                # hits for a request that already holds blocks: let the generic path decide
                return self._allocate_generic(request, num_new_tokens, num_new_computed_tokens, new_computed_blocks,
                                              num_lookahead_tokens, 0, delay_cache_blocks, full_sequence_must_fit,
                                              reserved_blocks, has_scheduled_reqs)
            hits = new_computed_blocks.blocks[0]
        watermark = self.watermark_blocks
        if watermark and not (has_scheduled_reqs and request.status in _WATERMARK_STATES):
            watermark = 0
        max_len = self.max_model_len
        bs = fa.block_size
        pool = self.block_pool
        held = (len(req_blocks) if req_blocks is not None else 0) + len(hits)
        evictable = 0  # free hit blocks: touching them consumes free capacity
        for blk in hits:
            if blk.ref_cnt == 0 and not blk.is_null:
                evictable += 1
        num_free = pool.free_block_queue.num_free_blocks
        if full_sequence_must_fit:
            full = request.num_tokens if request.num_tokens < max_len else max_len
            needed = -(-full // bs) - held
            if (needed if needed > 0 else 0) + evictable + watermark > num_free:
                return None
        total = request.num_computed_tokens + num_new_computed_tokens
        if total > max_len:
            total = max_len
        need = total + num_new_tokens + num_lookahead_tokens
        if need > max_len:
            need = max_len
        num_new = -(-need // bs) - held
        if num_new < 0:
            num_new = 0
        if num_new + evictable + watermark > num_free - reserved_blocks:
            return None
        if explicit:
            if self.enable_caching:
                pool.touch(hits)
            else:
                assert not hits, "prefix hits while prefix caching is disabled"
            if req_blocks is None:
                req_blocks = fa.req_to_blocks[rid] = []
            req_blocks.extend(hits)
            fa.num_cached_block[rid] = len(req_blocks)
        if num_new:
            new = pool.get_new_blocks(num_new)
            if req_blocks is None:
                req_blocks = fa.req_to_blocks[rid] = list(new)
            else:
                req_blocks.extend(new)
        else:
            new = None
            if req_blocks is None:
                req_blocks = fa.req_to_blocks[rid] = []
        if self.enable_caching and not delay_cache_blocks:
            num_cache = total + num_new_tokens
            if num_cache > request.num_tokens:
                num_cache = request.num_tokens  # unverified draft tokens are not cached
            num_full = num_cache // bs
            num_cached = fa.num_cached_block.get(rid, 0)
            if num_cached < num_full:
                pool.cache_full_blocks(request, req_blocks, num_cached, num_full, bs, 0)
                fa.num_cached_block[rid] = num_full
        return KVCacheBlocks((new,)) if new else self.empty_kv_cache_blocks

    def _allocate_generic(self, request: Request, num_new_tokens: int, num_new_computed_tokens: int,
                          new_computed_blocks: KVCacheBlocks | None, num_lookahead_tokens: int,
                          num_external_computed_tokens: int, delay_cache_blocks: bool,
                          full_sequence_must_fit: bool, reserved_blocks: int,
                          has_scheduled_reqs: bool) -> KVCacheBlocks | None:
        if num_new_tokens == 0 and num_external_computed_tokens == 0:
            raise ValueError("num_new_tokens must be greater than 0 when there are no external computed tokens")
        empty = self.empty_kv_cache_blocks
        watermark = self.watermark_blocks
        if watermark and not (has_scheduled_reqs and request.status in _WATERMARK_STATES):
            watermark = 0
        hit_blocks = new_computed_blocks.blocks if new_computed_blocks is not None else empty.blocks
        rid = request.request_id
        coord = self.coordinator
        pool = self.block_pool
        num_local = request.num_computed_tokens + num_new_computed_tokens
        total_computed = min(num_local + num_external_computed_tokens, self.max_model_len)

        if full_sequence_must_fit:
            full = min(request.num_tokens, self.max_model_len)
            needed = coord.get_num_blocks_to_allocate(rid, full, hit_blocks, total_computed, full,
                                                      apply_admission_cap=True)
            if needed + watermark > pool.get_num_free_blocks():
                return None

        num_tokens_main_model = total_computed + num_new_tokens
        num_need_slot = min(num_tokens_main_model + num_lookahead_tokens, self.max_model_len)
        # release blocks that left the window first, even if we fail below
        coord.remove_skipped_blocks(rid, total_computed)
        needed = coord.get_num_blocks_to_allocate(rid, num_need_slot, hit_blocks,
                                                  num_local + num_external_computed_tokens, num_tokens_main_model)
        if needed + watermark > pool.get_num_free_blocks() - reserved_blocks:
            return None
        if hit_blocks is not empty.blocks or num_external_computed_tokens > 0:
            coord.allocate_new_computed_blocks(rid, hit_blocks, num_local, num_external_computed_tokens)
        new_blocks = coord.allocate_new_blocks(rid, num_need_slot, num_tokens_main_model)
        if self.enable_caching and not delay_cache_blocks:
            coord.cache_blocks(request, min(total_computed + num_new_tokens, request.num_tokens))
        return self.create_kv_cache_blocks(new_blocks)

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Enter the request's full blocks up to `num_computed_tokens` into the
        prefix cache (after a delayed allocation's KV has landed)."""
        if self.enable_caching:
            self.coordinator.cache_blocks(request, num_computed_tokens)

    def remove_skipped_blocks(self, request_id: str, total_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        """Release blocks outside the attention span (sliding window / Mamba)."""
        self.coordinator.remove_skipped_blocks(request_id, total_computed_tokens)

    # ------------------------------------------------------------------ freeing
    def free(self, request: Request) -> None:
        """Release the request's blocks (tail first); unknown requests are a no-op."""
        fa = self._fa
        if fa is not None:
            fa.free(request.request_id)
        else:
            self.coordinator.free(request.request_id)

    def pop_blocks_for_free(self, request: Request) -> list[KVCacheBlock]:
        """Forget the request and return its blocks (group order, allocation order)
        without releasing them; call `block_pool.free_blocks(reversed(blocks))` later."""
        return self.coordinator.pop_blocks_for_free(request.request_id)

    def evict_blocks(self, block_ids) -> None:
        self.block_pool.evict_blocks(block_ids)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; False (and nothing changed) while any block is in use."""
        if not self.block_pool.reset_prefix_cache():
            return False
        if self.log_stats:
            self.prefix_cache_stats.reset = True
        return True

    def new_step_starts(self) -> None:
        self.coordinator.new_step_starts()

    # ------------------------------------------------------------------ events
    def take_events(self) -> list[KVCacheEvent]:
        """Drain pool events, annotating BlockStored with its group's kind and window."""
        events = self.block_pool.take_events()
        meta = self.kv_cache_event_metadata
        for ev in events:
            if not isinstance(ev, BlockStored) or ev.group_idx is None:
                continue
            if not 0 <= ev.group_idx < len(meta):
                logger.warning("Group index `%s` not in KV cache metadata", ev.group_idx)
                continue
            ev.kv_cache_spec_kind, ev.kv_cache_spec_sliding_window = meta[ev.group_idx]
        return events
