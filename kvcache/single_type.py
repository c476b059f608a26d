"""Per-group block bookkeeping: one manager per KV cache group.

A manager owns `req_to_blocks[request_id]` (logical block index -> block; the
null block fills positions that hold no KV, e.g. tokens that left a sliding
window) and `num_cached_block[request_id]` (how many leading blocks are in the
prefix cache). Presence in `num_cached_block` marks a request whose prefix has
already been settled, so new prefix hits may no longer be added.

Subclasses differ in which blocks a request still needs (`get_num_skipped_tokens`),
how a prefix hit is found (`find_longest_cache_hit`) and which full blocks are
worth caching (`reachable_block_mask`).
"""
from __future__ import annotations

from itertools import islice
from collections.abc import Iterable, Sequence

from kvcache.block_pool import BlockPool
from kvcache.blocks import KVCacheBlock
from kvcache.specs import KVCacheSpec, cdiv


class SingleTypeKVCacheManager:
    def __init__(self, spec: KVCacheSpec, block_pool: BlockPool, enable_caching: bool,
                 kv_cache_group_id: int, scheduler_block_size: int,
                 max_admission_blocks_per_request: int | None = None) -> None:
        self.kv_cache_spec = spec
        self.block_size = spec.block_size
        self.block_pool = block_pool
        self.enable_caching = enable_caching
        self.kv_cache_group_id = kv_cache_group_id
        self.scheduler_block_size = scheduler_block_size
        self.max_admission_blocks_per_request = max_admission_blocks_per_request
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_block: dict[str, int] = {}
        self._null_block = block_pool.null_block
        # subclass hooks that are the base no-ops are not called on hot paths
        cls = type(self)
        self.skips = cls.get_num_skipped_tokens is not SingleTypeKVCacheManager.get_num_skipped_tokens
        self._masks = cls.reachable_block_mask is not SingleTypeKVCacheManager.reachable_block_mask
        # the pool clears its maps in place, so this reference stays live
        self._own_cached_map = block_pool.cached_map(kv_cache_group_id)

    # ---------------------------------------------------------------- sizing
    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Leading tokens whose KV is no longer needed (0: keep everything)."""
        return 0

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: Sequence[KVCacheBlock],
                                   total_computed_tokens: int, num_tokens_main_model: int,
                                   apply_admission_cap: bool = False) -> int:
        """Free-pool blocks an allocation to `num_tokens` slots would consume,
        including free prefix-hit blocks that touching would take off the queue."""
        # cdiv and max written out: this runs on every decode step of every request
        num_required = -(-num_tokens // self.block_size)
        if apply_admission_cap:
            cap = self.max_admission_blocks_per_request
            if cap is not None and cap < num_required:
                num_required = cap
        req_blocks = self.req_to_blocks.get(request_id)
        num_req_blocks = len(req_blocks) if req_blocks is not None else 0
        if request_id in self.num_cached_block:
            assert not new_computed_blocks, "prefix hits for a request that already holds blocks"
            num_new = num_required - num_req_blocks
            return num_new if num_new > 0 else 0
        num_skipped_blocks = (self.get_num_skipped_tokens(total_computed_tokens) // self.block_size
                              if self.skips else 0)
        num_local = len(new_computed_blocks) + num_req_blocks
        num_new = num_required - (num_skipped_blocks if num_skipped_blocks > num_local else num_local)
        if num_new < 0:
            num_new = 0
        skip_hits = num_skipped_blocks - num_req_blocks
        hits: Iterable[KVCacheBlock] = new_computed_blocks
        if skip_hits > 0:
            hits = islice(new_computed_blocks, skip_hits, None)
        for blk in hits:
            if blk.ref_cnt == 0 and not blk.is_null:
                num_new += 1  # a free hit block: touching it takes it off the queue
        return num_new

    # ---------------------------------------------------------------- allocation
    def add_local_computed_blocks(self, request_id: str, new_computed_blocks: Sequence[KVCacheBlock],
                                  num_local_computed_tokens: int, num_external_computed_tokens: int) -> None:
        """First allocation only: take references on the prefix-hit blocks."""
        req_blocks = self.req_to_blocks.setdefault(request_id, [])
        assert not req_blocks, f"request {request_id} already holds blocks"
        total = num_local_computed_tokens + num_external_computed_tokens
        num_skipped_blocks = self.get_num_skipped_tokens(total) // self.block_size if self.skips else 0
        if num_skipped_blocks > 0:
            new_computed_blocks = new_computed_blocks[num_skipped_blocks:]
        if self.enable_caching:
            self.block_pool.touch(new_computed_blocks)
        else:
            assert not new_computed_blocks, "prefix hits while prefix caching is disabled"
        if num_skipped_blocks:
            req_blocks.extend([self._null_block] * num_skipped_blocks)
        req_blocks.extend(new_computed_blocks)
        self.num_cached_block[request_id] = len(req_blocks)

    def allocate_external_computed_blocks(self, request_id: str, num_local_computed_tokens: int,
                                          num_external_computed_tokens: int) -> None:
        """Fresh (unhashed) blocks for tokens a connector will provide."""
        total = num_local_computed_tokens + num_external_computed_tokens
        num_skipped = self.get_num_skipped_tokens(total)
        if num_skipped > 0:
            # part of the external range already fell out of the window
            num_external_computed_tokens = min(total - num_skipped, num_external_computed_tokens)
        if num_external_computed_tokens <= 0:
            return
        req_blocks = self.req_to_blocks.setdefault(request_id, [])
        req_blocks.extend(self.block_pool.get_new_blocks(cdiv(total, self.block_size) - len(req_blocks)))

    def allocate_new_blocks(self, request_id: str, num_tokens: int, num_tokens_main_model: int) -> list[KVCacheBlock]:
        """Grow the request to at least `num_tokens` slots; returns the new blocks."""
        req_blocks = self.req_to_blocks.get(request_id)
        if req_blocks is None:
            req_blocks = self.req_to_blocks[request_id] = []
        num_new = -(-num_tokens // self.block_size) - len(req_blocks)
        if num_new <= 0:
            return []
        new_blocks = self.block_pool.get_new_blocks(num_new)
        req_blocks.extend(new_blocks)
        return new_blocks

    # ---------------------------------------------------------------- caching
    def reachable_block_mask(self, start_block: int, end_block: int) -> list[bool] | None:
        """Which of blocks [start, end) can ever serve a hit (None: all)."""
        return None

    def cache_blocks(self, request, num_tokens: int) -> None:
        """Enter the request's full blocks up to `num_tokens` into the prefix cache."""
        rid = request.request_id
        num_cached = self.num_cached_block.get(rid, 0)
        num_full = num_tokens // self.block_size
        if num_cached >= num_full:
            return
        self.block_pool.cache_full_blocks(
            request, self.req_to_blocks[rid], num_cached, num_full, self.block_size,
            self.kv_cache_group_id, self.reachable_block_mask(num_cached, num_full) if self._masks else None)
        self.num_cached_block[rid] = num_full

    # ---------------------------------------------------------------- freeing
    def pop_blocks_for_free(self, request_id: str) -> list[KVCacheBlock]:
        """Forget the request; return its blocks in allocation order, refs untouched."""
        self.num_cached_block.pop(request_id, None)
        return self.req_to_blocks.pop(request_id, [])

    def free(self, request_id: str) -> None:
        """Forget the request and release its blocks, tail first (no-op if unknown)."""
        self.num_cached_block.pop(request_id, None)  # pop_blocks_for_free, without the call
        blocks = self.req_to_blocks.pop(request_id, None)
        if blocks:
            blocks.reverse()  # tail blocks first: they are the least likely to be shared
            self.block_pool.free_blocks(blocks)

    def _remove_blocks_in_range(self, request_id: str, first_block: int, last_block: int) -> None:
        """Null out and free blocks in [first, last), walking backwards until a
        block that is already null (everything before it was freed earlier)."""
        blocks = self.req_to_blocks.get(request_id)
        if blocks is None or first_block >= last_block:
            return
        null = self._null_block
        freed = []
        for i in range(min(last_block, len(blocks)) - 1, first_block - 1, -1):
            blk = blocks[i]
            if blk is null:
                break
            freed.append(blk)
            blocks[i] = null
        if freed:
            self.block_pool.free_blocks(freed)

    def remove_skipped_blocks(self, request_id: str, total_computed_tokens: int) -> None:
        """Return blocks that fell out of the attention span to the pool."""
        num_skipped = self.get_num_skipped_tokens(total_computed_tokens)
        if num_skipped <= 0:
            return
        blocks = self.req_to_blocks.setdefault(request_id, [])
        self._remove_blocks_in_range(request_id, 0, min(num_skipped // self.block_size, len(blocks)))

    # ---------------------------------------------------------------- misc
    def get_num_common_prefix_blocks(self, running_request_id: str) -> int:
        return 0

    def new_step_starts(self) -> None:
        pass

    def find_longest_cache_hit(self, block_hashes, max_length: int, group_ids: Sequence[int],
                               alignment_tokens: int) -> tuple[list[KVCacheBlock], ...]:
        raise NotImplementedError


class FullAttentionManager(SingleTypeKVCacheManager):
    """Keeps every block; a hit is the longest run of cached blocks from the start."""

    def find_longest_cache_hit(self, block_hashes, max_length: int, group_ids: Sequence[int],
                               alignment_tokens: int) -> tuple[list[KVCacheBlock], ...]:
        bs = self.block_size
        own = self.kv_cache_group_id
        limit = max_length // bs
        computed: list[list[KVCacheBlock]] = []
        # Group by group: each later group searches only as far as the previous
        # ones hit, so the final (shortest) length is the first block any group
        # misses -- exactly a block-by-block search over all groups at once.
        for gid in group_ids:
            m = self._own_cached_map if gid == own else self.block_pool.cached_map(gid)
            hits: list[KVCacheBlock] = []
            append = hits.append
            for h in islice(block_hashes, limit):
                blk = m.get(h)
                if blk is None:
                    break  # chained hashes: nothing after a miss can hit
                append(blk)
            limit = len(hits)
            computed.append(hits)
        if len(computed) > 1:
            for hits in computed:
                del hits[limit:]
        if bs != alignment_tokens:
            while len(computed[0]) * bs % alignment_tokens:
                for lst in computed:
                    lst.pop()
        return (hits,) if len(computed) == 1 else tuple(computed)

    def get_num_common_prefix_blocks(self, running_request_id: str) -> int:
        n_reqs = len(self.req_to_blocks)
        count = 0
        for blk in self.req_to_blocks.get(running_request_id, ()):
            if blk.ref_cnt != n_reqs:
                break
            count += 1
        return count


class SlidingWindowManager(SingleTypeKVCacheManager):
    """Keeps only blocks overlapping the last `sliding_window` tokens; a hit needs
    a contiguous run of cached blocks covering one window, searched from the right."""

    def __init__(self, spec, block_pool: BlockPool, enable_caching: bool, kv_cache_group_id: int,
                 scheduler_block_size: int, max_admission_blocks_per_request: int | None = None) -> None:
        super().__init__(spec, block_pool, enable_caching, kv_cache_group_id, scheduler_block_size,
                         max_admission_blocks_per_request)
        self.sliding_window = spec.sliding_window
        # blocks of a run that covers window-1 earlier tokens
        self.contiguous_blocks_for_hit = cdiv(spec.sliding_window - 1, spec.block_size)

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        # the next token attends to the last `window` tokens including itself
        return max(0, num_computed_tokens - self.sliding_window + 1)

    def find_longest_cache_hit(self, block_hashes, max_length: int, group_ids: Sequence[int],
                               alignment_tokens: int) -> tuple[list[KVCacheBlock], ...]:
        bs = self.block_size
        pool = self.block_pool
        need = self.contiguous_blocks_for_hit
        max_blocks = max_length // bs
        null = pool.null_block
        computed = tuple([null] * max_blocks for _ in group_ids)
        single_map = pool.cached_map(group_ids[0]) if len(group_ids) == 1 else None
        aligned = bs == alignment_tokens
        run = 0
        matched = False
        for i in range(max_blocks - 1, -1, -1):
            if single_map is not None:
                blk = single_map.get(block_hashes[i])
                found: Sequence[KVCacheBlock] | None = None if blk is None else (blk,)
            else:
                found = pool.get_cached_block(block_hashes[i], group_ids)
            if found is None:
                run = 0
                continue
            if run == 0 and not aligned and (i + 1) * bs % alignment_tokens:
                continue  # a run must end on an alignment boundary
            for lst, blk in zip(computed, found, strict=True):
                lst[i] = blk
            run += 1
            if run >= need:
                for lst in computed:
                    del lst[i + run:]
                matched = True
                break
        if not matched:
            # only a run starting at block 0 is usable (nothing before it is needed)
            for lst in computed:
                del lst[run:]
            if not aligned:
                while len(computed[0]) * bs % alignment_tokens:
                    for lst in computed:
                        lst.pop()
        return computed

    def reachable_block_mask(self, start_block: int, end_block: int) -> list[bool] | None:
        # Hits end on scheduler-block boundaries, so within each aligned segment
        # only the last `need` blocks can ever be part of a hit.
        per_segment = self.scheduler_block_size // self.block_size
        need = self.contiguous_blocks_for_hit
        if need >= per_segment:
            return None
        lo = per_segment - need
        return [i % per_segment >= lo for i in range(start_block, end_block)]
