"""Mamba (recurrent state) manager: a request only needs its latest state.

Each block holds the state after a block-aligned prefix. Only the last
computed state matters, so everything before it is returned to the pool
(replaced by the null block); with block_size >= max_model_len ("none" mode)
that is exactly one state block per request. A prefix hit is the single
right-most cached state whose end is alignment-aligned.

A state cached in the current step cannot be used by another request in the
same step (its KV is produced by that step's forward pass), so such a hit is
reported as impossible to allocate until `new_step_starts()`.
"""
from __future__ import annotations

from collections.abc import Sequence

from kvcache.blocks import KVCacheBlock
from kvcache.single_type import SingleTypeKVCacheManager


class MambaManager(SingleTypeKVCacheManager):
    def __init__(self, spec, block_pool, enable_caching: bool, kv_cache_group_id: int,
                 scheduler_block_size: int, max_admission_blocks_per_request: int | None = None) -> None:
        super().__init__(spec, block_pool, enable_caching, kv_cache_group_id, scheduler_block_size,
                         max_admission_blocks_per_request)
        self.num_speculative_blocks = spec.num_speculative_blocks
        self.cached_blocks_this_step: set[tuple[int, bytes]] = set()

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return num_computed_tokens - 1

    def remove_skipped_blocks(self, request_id: str, total_computed_tokens: int) -> None:
        # speculative tokens may still be rejected: keep the states they need
        super().remove_skipped_blocks(request_id, max(0, total_computed_tokens - self.num_speculative_blocks))

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: Sequence[KVCacheBlock],
                                   total_computed_tokens: int, num_tokens_main_model: int,
                                   apply_admission_cap: bool = False) -> int:
        if new_computed_blocks:
            last = new_computed_blocks[-1]
            if (last.hash_group_id, last.block_hash) in self.cached_blocks_this_step:
                return self.block_pool.num_blocks + 1  # never fits: retry next step
        num_tokens += self.block_size * self.num_speculative_blocks
        return super().get_num_blocks_to_allocate(request_id, num_tokens, new_computed_blocks,
                                                  total_computed_tokens, num_tokens_main_model,
                                                  apply_admission_cap)

    def allocate_new_blocks(self, request_id: str, num_tokens: int, num_tokens_main_model: int) -> list[KVCacheBlock]:
        return super().allocate_new_blocks(
            request_id, num_tokens + self.block_size * self.num_speculative_blocks, num_tokens_main_model)

    def cache_blocks(self, request, num_tokens: int) -> None:
        rid = request.request_id
        before = self.num_cached_block.get(rid, 0)
        super().cache_blocks(request, num_tokens)
        after = self.num_cached_block.get(rid, 0)
        if after > before:
            for blk in self.req_to_blocks[rid][before:after]:
                if not blk.is_null and blk.block_hash is not None:
                    self.cached_blocks_this_step.add((blk.hash_group_id, blk.block_hash))

    def new_step_starts(self) -> None:
        self.cached_blocks_this_step.clear()

    def find_longest_cache_hit(self, block_hashes, max_length: int, group_ids: Sequence[int],
                               alignment_tokens: int) -> tuple[list[KVCacheBlock], ...]:
        bs = self.block_size
        pool = self.block_pool
        computed: tuple[list[KVCacheBlock], ...] = tuple([] for _ in group_ids)
        for i in range(max_length // bs - 1, -1, -1):
            found = pool.get_cached_block(block_hashes[i], group_ids)
            if found is None:
                continue
            if bs != alignment_tokens and (i + 1) * bs % alignment_tokens:
                continue
            for lst, blk in zip(computed, found, strict=True):
                lst.extend([pool.null_block] * i)
                lst.append(blk)
            break  # only the latest state is needed
        return computed
