"""Leak and consistency checks shared by every test in the project.

`assert_all_free(pool_or_manager)`: every block except the null block is back
in the free queue (and, for a manager, no request is still tracked).
`check_invariants(pool)`: the pool's bookkeeping is self-consistent.
Both raise AssertionError with the offending block ids and ref counts.
"""
from __future__ import annotations

from kvcache.block_pool import BlockPool


def _pool_of(obj) -> BlockPool:
    if isinstance(obj, BlockPool):
        return obj
    pool = getattr(obj, "block_pool", None)
    if pool is None:
        kv = getattr(obj, "kv_cache_manager", None)
        pool = getattr(kv, "block_pool", None)
    if not isinstance(pool, BlockPool):
        raise TypeError(f"expected a BlockPool or an object with .block_pool, got {type(obj).__name__}")
    return pool


def _describe(blocks, limit: int = 20) -> str:
    shown = ", ".join(f"{b.block_id}(ref={b.ref_cnt}{', hashed' if b.block_hash is not None else ''})"
                      for b in blocks[:limit])
    more = f" ... and {len(blocks) - limit} more" if len(blocks) > limit else ""
    return shown + more


def assert_all_free(pool_or_manager) -> None:
    """Raise AssertionError unless all blocks but the null block are free."""
    pool = _pool_of(pool_or_manager)
    problems = []
    expected = pool.num_blocks - 1
    free = pool.get_num_free_blocks()
    if free != expected:
        problems.append(f"{free} of {expected} blocks free")
    in_use = [b for b in pool.blocks if not b.is_null and b.ref_cnt != 0]
    if in_use:
        problems.append(f"blocks still in use: {_describe(in_use)}")
    queued = {b.block_id for b in pool.free_block_queue.get_all_free_blocks()}
    missing = [b for b in pool.blocks if not b.is_null and b.block_id not in queued]
    if missing and not in_use:
        problems.append(f"blocks missing from the free queue: {_describe(missing)}")
    coord = getattr(getattr(pool_or_manager, "coordinator", None), "single_type_managers", None)
    if coord is None:
        kv = getattr(pool_or_manager, "kv_cache_manager", None)
        coord = getattr(getattr(kv, "coordinator", None), "single_type_managers", None)
    for gid, mgr in enumerate(coord or ()):
        holders = {rid: [b.block_id for b in blks] for rid, blks in mgr.req_to_blocks.items() if blks}
        if holders:
            problems.append(f"group {gid} still tracks requests: {dict(list(holders.items())[:10])}")
    if problems:
        raise AssertionError("KV block pool is not all free: " + "; ".join(problems))


def check_invariants(pool_or_manager) -> None:
    """Raise AssertionError if the pool's ref counts, free queue and prefix-cache
    map disagree."""
    pool = _pool_of(pool_or_manager)
    problems = []
    queue = pool.free_block_queue
    walked = []
    seen = set()
    prev = queue.head
    blk = queue.head.next_free_block
    while blk is not None and blk is not queue.tail:
        if blk.block_id in seen:
            problems.append(f"free queue has a cycle at block {blk.block_id}")
            break
        if blk.prev_free_block is not prev:
            problems.append(f"free queue back-link broken at block {blk.block_id}")
        seen.add(blk.block_id)
        walked.append(blk)
        prev = blk
        blk = blk.next_free_block
    if blk is None:
        problems.append("free queue does not reach its tail sentinel")
    if len(walked) != queue.num_free_blocks:
        problems.append(f"free queue holds {len(walked)} blocks but counts {queue.num_free_blocks}")
    null = pool.null_block
    if null.block_id in seen or not null.is_null or null.block_id != 0:
        problems.append("null block is wrong or in the free queue")
    if null.block_hash is not None:
        problems.append("null block has a hash")
    bad_free = [b for b in walked if b.ref_cnt != 0]
    if bad_free:
        problems.append(f"free blocks with ref != 0: {_describe(bad_free)}")
    bad_used = [b for b in pool.blocks if not b.is_null and b.block_id not in seen and b.ref_cnt <= 0]
    if bad_used:
        problems.append(f"blocks neither free nor referenced: {_describe(bad_used)}")
    stray = [b for b in pool.blocks if not b.is_null and b.block_id not in seen
             and (b.prev_free_block is not None or b.next_free_block is not None)]
    if stray:
        problems.append(f"used blocks still linked into the free queue: {_describe(stray)}")
    entries = {}
    for gid, h, b in pool.iter_cached():
        if b.block_hash != h or b.hash_group_id != gid:
            problems.append(f"cache entry (group {gid}) points at block {b.block_id} whose hash differs")
        if b.block_id in entries:
            problems.append(f"block {b.block_id} appears twice in the prefix cache")
        entries[b.block_id] = (gid, h)
    hashed = [b for b in pool.blocks if b.block_hash is not None and b.block_id not in entries]
    if hashed:
        problems.append(f"hashed blocks missing from the prefix cache: {_describe(hashed)}")
    if not pool.enable_caching and entries:
        problems.append("prefix cache entries while caching is disabled")
    if problems:
        raise AssertionError("KV block pool invariants violated: " + "; ".join(problems))
