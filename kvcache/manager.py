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
- with `block_ids_only_grow` (no group drops leading blocks: no sliding window,
  no Mamba), a request's block ids change only by `allocate_slots` appending
  the blocks it returns, until the request is freed: a caller may keep a
  running request's ids and extend them itself instead of asking again.

Decisions (block ids, hit lengths, None results, free counts) match vLLM
0.25.1's KVCacheManager for full-attention, sliding-window and Mamba groups.
The facade holds policy only: allocation, hit search and freeing each have one
implementation, in the coordinator and the single-type managers below it.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence

from kvcache.blocks import KVCacheBlock
from kvcache.config import KVCacheConfig
from kvcache.coordinator import CoordinatorSettings, make_coordinator
from kvcache.events import BlockStored, KVCacheEvent
from kvcache.kv_cache_blocks import KVCacheBlocks
from kvcache.request import Request, RequestStatus
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
        # the coordinator's instance: its `.blocks` is also the "no hits" marker
        self.empty_kv_cache_blocks = self.coordinator.empty_kv_cache_blocks
        self._no_blocks = self.empty_kv_cache_blocks.blocks
        self.block_ids_only_grow = not self.coordinator.skipping_managers  # (see the module docstring)

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
        # (read straight from each group's list, with no KVCacheBlocks made: the scheduler asks for every
        # scheduled chunk, every step)
        return tuple([b.block_id for b in m.req_to_blocks.get(request_id, ())]
                     for m in self.coordinator.single_type_managers)

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
        blocks, num_hit = self.coordinator.find_longest_cache_hit(request.block_hashes, request.num_tokens - 1)
        result = self.empty_kv_cache_blocks if blocks is self._no_blocks else self.create_kv_cache_blocks(blocks)
        if self.prefix_cache_stats is not None:  # (log_stats)
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
        if num_new_tokens == 0 and num_external_computed_tokens == 0:
            raise ValueError("num_new_tokens must be greater than 0 when there are no external computed tokens")
        # the watermark keeps room for running requests: it holds back only
        # requests entering (or re-entering) while something is scheduled
        watermark = self.watermark_blocks
        if watermark and not (has_scheduled_reqs and request.status in _WATERMARK_STATES):
            watermark = 0
        return self.coordinator.allocate_slots(
            request, num_new_tokens, num_new_computed_tokens,
            None if new_computed_blocks is None else new_computed_blocks.blocks, num_lookahead_tokens,
            num_external_computed_tokens, watermark, reserved_blocks, full_sequence_must_fit,
            self.enable_caching and not delay_cache_blocks)

    def allocate_slots_in_order(self, requests: Sequence[Request],
                                num_new_tokens: Sequence[int]) -> list[KVCacheBlocks]:
        """`allocate_slots(request, n)` for each pair in turn (the plain call, as running requests make it
        every step), stopping at the first that does not fit. Returns one result per request served, in
        order: a list shorter than `requests` means `requests[len(result)]` did not fit, and it and the ones
        after it were left as they were (windows released aside). One call for a whole decode batch: the
        requests whose blocks already hold their slots cost no call each."""
        if min(num_new_tokens, default=1) <= 0:
            raise ValueError("num_new_tokens must be greater than 0 when there are no external computed tokens")
        if self.watermark_blocks and any(r.status in _WATERMARK_STATES for r in requests):
            served: list[KVCacheBlocks] = []
            for request, num_new in zip(requests, num_new_tokens, strict=True):
                result = self.allocate_slots(request, num_new)
                if result is None:
                    break
                served.append(result)
            return served
        return self.coordinator.allocate_slots_in_order(requests, num_new_tokens, self.enable_caching)

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
        if self.prefix_cache_stats is not None:  # (log_stats)
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
