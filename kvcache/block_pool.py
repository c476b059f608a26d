"""BlockPool: the physical block ids, their ref counts, free queue and prefix cache.

Guarantees:
- block 0 is the null block: never in the free queue, never handed out, never
  cached; `get_num_free_blocks()` starts at `num_blocks - 1`;
- a block is in the free queue iff its ref count is 0 (null block excepted);
- eviction order: `get_new_blocks` takes from the queue head; `free_blocks`
  puts blocks that reached ref 0 back with unhashed ones at the head (reused
  first) and hashed ones at the tail (kept for hits as long as possible), each
  group in the order given (callers pass a request's blocks tail-first);
- the prefix cache maps (group id, block hash) to blocks; a free block stays
  findable until it is handed out again (lazy eviction); duplicates with the
  same key may coexist and lookups return the oldest;
- with events enabled, every cache change is recorded (see kvcache.events).
"""
from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

from kvcache.blocks import FreeKVCacheBlockQueue, KVCacheBlock
from kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from kvcache.hashing import extra_keys_for_block, hashes_at_block_size

logger = logging.getLogger(__name__)


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True, hash_block_size: int = 16,
                 enable_kv_cache_events: bool = False) -> None:
        if not isinstance(num_blocks, int) or num_blocks <= 0:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.hash_block_size = hash_block_size
        self.enable_kv_cache_events = enable_kv_cache_events
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        # group id -> {hash: oldest block}; dicts are cleared in place on reset so
        # managers may keep references to them.
        self._cached: dict[int, dict[bytes, KVCacheBlock]] = {}
        # (group id, hash) -> {block id: block} for the second and later duplicates
        self._dups: dict[tuple[int, bytes], dict[int, KVCacheBlock]] = {}
        self.kv_event_queue: list[KVCacheEvent] = []

    @property
    def num_gpu_blocks(self) -> int:
        return self.num_blocks

    # ------------------------------------------------------------------ lookup
    def cached_map(self, group_id: int) -> dict[bytes, KVCacheBlock]:
        """The live {hash: block} map of one group (read-only for callers)."""
        m = self._cached.get(group_id)
        if m is None:
            m = self._cached[group_id] = {}
        return m

    def get_cached_block(self, block_hash: bytes, kv_cache_group_ids: Sequence[int]) -> list[KVCacheBlock] | None:
        """One cached block per group for `block_hash`, or None if any group misses."""
        out = []
        for gid in kv_cache_group_ids:
            m = self._cached.get(gid)
            blk = m.get(block_hash) if m is not None else None
            if blk is None:
                return None
            out.append(blk)
        return out

    def num_cached_entries(self) -> int:
        return sum(len(m) for m in self._cached.values()) + sum(len(d) for d in self._dups.values())

    def iter_cached(self):
        """(group id, hash, block) for every prefix-cache entry."""
        for gid, m in self._cached.items():
            for h, blk in m.items():
                yield gid, h, blk
        for (gid, h), d in self._dups.items():
            for blk in d.values():
                yield gid, h, blk

    # ------------------------------------------------------------------ cache
    def _uncache_blocks(self, blocks: Iterable[KVCacheBlock], claim: bool = False) -> None:
        """Drop every given block's prefix-cache entry (blocks without one are skipped);
        with `claim`, also set each block's ref count to 1 in the same pass.

        The only place entries leave the cache (reuse, eviction, re-hashing):
        when the block was the map's entry, the oldest duplicate takes its slot
        so the prefix stays findable; one BlockRemoved per entry removed."""
        cached = self._cached
        dups = self._dups
        events = self.kv_event_queue if self.enable_kv_cache_events else None
        for blk in blocks:
            if claim:
                blk.ref_cnt = 1
            h = blk.block_hash
            if h is None:
                continue
            gid = blk.hash_group_id
            blk.block_hash = None
            blk.hash_group_id = -1
            m = cached[gid]
            if m.get(h) is blk:
                # `dups and`: without duplicates (the common case) no key tuple is built
                d = dups and dups.get((gid, h))
                if d:
                    m[h] = d.pop(next(iter(d)))
                    if not d:
                        del dups[(gid, h)]
                else:
                    del m[h]
            else:
                d = dups and dups.get((gid, h))
                if not d or d.pop(blk.block_id, None) is None:
                    continue  # a stale hash: no entry, nothing to report
                if not d:
                    del dups[(gid, h)]
            if events is not None:
                events.append(BlockRemoved(block_hashes=[h], group_idx=gid))

    def cache_full_blocks(self, request, blocks: Sequence[KVCacheBlock], num_cached_blocks: int,
                          num_full_blocks: int, block_size: int, kv_cache_group_id: int,
                          block_mask: Sequence[bool] | None = None) -> None:
        """Enter blocks[num_cached_blocks:num_full_blocks] of `request` into the
        prefix cache of group `kv_cache_group_id` (null and masked-out blocks are
        skipped)."""
        if num_cached_blocks >= num_full_blocks:
            return
        hashes = request.block_hashes
        if block_size != self.hash_block_size:
            hashes = hashes_at_block_size(hashes, self.hash_block_size, block_size)
        hasher = request.block_hasher
        if hasher is None:
            raise ValueError(f"request {request.request_id} has no block hasher but prefix caching is on")
        if getattr(hasher, "block_size", self.hash_block_size) != self.hash_block_size:
            # hashes of another granularity would cache blocks under the wrong prefixes
            raise ValueError(f"request {request.request_id} is hashed in blocks of {hasher.block_size} "
                             f"tokens; this cache needs {self.hash_block_size}")
        if len(hashes) < num_full_blocks:
            raise AssertionError(f"request {request.request_id} has {len(hashes)} block hashes, "
                                 f"{num_full_blocks} full blocks to cache")
        m = self.cached_map(kv_cache_group_id)
        events = self.enable_kv_cache_events
        stored: list[bytes] | None = [] if events else None
        extra: list = []
        dups = self._dups
        for i in range(num_cached_blocks, num_full_blocks):
            blk = blocks[i]
            if blk.is_null or (block_mask is not None and not block_mask[i - num_cached_blocks]):
                continue
            h = hashes[i]
            if blk.block_hash is not None:
                if blk.block_hash == h and blk.hash_group_id == kv_cache_group_id:
                    continue
                self._uncache_blocks((blk,))
            if m.setdefault(h, blk) is not blk:
                dups.setdefault((kv_cache_group_id, h), {})[blk.block_id] = blk
            blk.block_hash = h
            blk.hash_group_id = kv_cache_group_id
            if stored is not None:  # (events on)
                stored.append(h)
                extra.append(extra_keys_for_block(request, i * block_size))
        if stored is not None:
            parent = hashes[num_cached_blocks - 1] if num_cached_blocks > 0 else None
            self.kv_event_queue.append(BlockStored(
                block_hashes=stored,
                parent_block_hash=parent,
                token_ids=list(request.all_token_ids[num_cached_blocks * block_size:num_full_blocks * block_size]),
                block_size=block_size,
                lora_name=request.lora_name,
                extra_keys=extra or None,
                group_idx=kv_cache_group_id,
            ))

    # ------------------------------------------------------------------ alloc / free
    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take `num_blocks` from the queue head (evicting their cache entries), ref 1."""
        queue = self.free_block_queue
        if num_blocks > queue.num_free_blocks:
            raise ValueError(f"Cannot get {num_blocks} free blocks from the pool")
        blocks = queue.popleft_n(num_blocks)
        # lazy eviction: a free block kept its entry until it is reused now;
        # the same pass hands out the blocks' first reference
        self._uncache_blocks(blocks, claim=True)
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take one more reference on prefix-hit blocks (claiming free ones)."""
        queue = self.free_block_queue
        for blk in blocks:
            if blk.ref_cnt == 0 and not blk.is_null:
                queue.remove(blk)
            blk.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference per block; `ordered_blocks` first = evicted first.

        Blocks reaching ref 0 go to the queue tail if hashed (kept for hits) and
        to the head if not (reused first), each set in the given order."""
        hashed: list[KVCacheBlock] = []
        keep = hashed.append
        unhashed = None  # rare (a request's partial last block): built only when needed
        for blk in ordered_blocks:
            rc = blk.ref_cnt - 1
            blk.ref_cnt = rc
            if rc == 0 and not blk.is_null:
                if blk.block_hash is not None:
                    keep(blk)
                elif unhashed is None:
                    unhashed = [blk]
                else:
                    unhashed.append(blk)
        queue = self.free_block_queue
        if hashed:
            queue.append_n(hashed)
        if unhashed is not None:
            queue.prepend_n(unhashed)

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Remove these blocks' prefix-cache entries (e.g. their KV failed to load);
        blocks still referenced stay allocated."""
        n = len(self.blocks)
        blocks = []
        for bid in block_ids:
            if not 0 <= bid < n:
                raise ValueError(f"invalid block id {bid} (pool has {n}); a connector reported "
                                 f"a block the scheduler never allocated")
            blocks.append(self.blocks[bid])
        self._uncache_blocks(blocks)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused (False) while any block is in use."""
        num_used = self.num_blocks - self.free_block_queue.num_free_blocks
        if num_used != 1:
            logger.warning("Failed to reset prefix cache because some blocks (%d) are not freed yet",
                           num_used - 1)
            return False
        for m in self._cached.values():
            m.clear()
        self._dups.clear()
        for blk in self.blocks:
            blk.block_hash = None
            blk.hash_group_id = -1
        logger.info("Successfully reset prefix cache")
        if self.enable_kv_cache_events:
            self.kv_event_queue.append(AllBlocksCleared())
        return True

    # ------------------------------------------------------------------ queries
    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        total = self.num_blocks - 1
        if not total:
            return 0.0
        return 1.0 - self.free_block_queue.num_free_blocks / total

    def take_events(self) -> list[KVCacheEvent]:
        if not self.enable_kv_cache_events:
            return []
        events = self.kv_event_queue
        self.kv_event_queue = []
        return events
