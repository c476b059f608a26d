"""BlockPool: null block, ref counts, free order, prefix-cache map, events, reset."""
import pytest

from kvcache import AllBlocksCleared, BlockPool, BlockRemoved, BlockStored
from kvcache.audit import assert_all_free, check_invariants
from kvcache.testing import make_request


def queue_ids(pool):
    return [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]


def test_null_block_is_reserved():
    pool = BlockPool(8, hash_block_size=4)
    assert pool.null_block.block_id == 0 and pool.null_block.is_null
    assert pool.get_num_free_blocks() == 7 and pool.get_usage() == 0.0
    got = pool.get_new_blocks(7)
    assert 0 not in [b.block_id for b in got]
    assert pool.get_usage() == 1.0
    with pytest.raises(ValueError, match="Cannot get 1 free blocks"):
        pool.get_new_blocks(1)
    pool.free_blocks(reversed(got))
    check_invariants(pool)
    assert_all_free(pool)


def test_pool_with_only_the_null_block_reports_zero_usage():
    pool = BlockPool(1)
    assert pool.get_num_free_blocks() == 0 and pool.get_usage() == 0.0
    with pytest.raises(ValueError):
        BlockPool(0)


def test_free_puts_unhashed_first_and_hashed_last():
    pool = BlockPool(8, hash_block_size=4)
    req = make_request("r", range(8), block_size=4)
    blocks = pool.get_new_blocks(3)  # ids 1, 2, 3
    pool.cache_full_blocks(req, blocks, 0, 2, 4, 0)  # 1 and 2 hashed
    pool.free_blocks(reversed(blocks))
    assert queue_ids(pool) == [3, 4, 5, 6, 7, 2, 1]
    check_invariants(pool)
    assert_all_free(pool)


def test_touch_claims_free_cached_blocks_and_counts_refs():
    pool = BlockPool(6, hash_block_size=4)
    req = make_request("r", range(8), block_size=4)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(req, blocks, 0, 2, 4, 0)
    pool.free_blocks(reversed(blocks))
    hit = pool.get_cached_block(req.block_hashes[0], [0])
    assert hit == [blocks[0]]
    assert pool.get_cached_block(req.block_hashes[0], [1]) is None  # other group: different entry
    pool.touch(hit)
    pool.touch(hit)
    assert blocks[0].ref_cnt == 2 and 1 not in queue_ids(pool)
    pool.free_blocks(hit)
    pool.free_blocks(hit)
    check_invariants(pool)
    assert_all_free(pool)


def test_lazy_eviction_on_reuse_emits_block_removed():
    pool = BlockPool(3, hash_block_size=4, enable_kv_cache_events=True)
    req = make_request("r", range(8), block_size=4)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(req, blocks, 0, 2, 4, 7)
    stored = pool.take_events()
    assert len(stored) == 1 and isinstance(stored[0], BlockStored)
    ev = stored[0]
    assert ev.block_hashes == req.block_hashes and ev.parent_block_hash is None
    assert ev.token_ids == list(range(8)) and ev.block_size == 4 and ev.group_idx == 7
    pool.free_blocks(reversed(blocks))
    assert pool.get_cached_block(req.block_hashes[1], [7]) == [blocks[1]]  # still findable while free
    again = pool.get_new_blocks(1)  # head = block 2 (freed first): evicted now
    assert again[0].block_id == 2 and again[0].block_hash is None
    removed = pool.take_events()
    assert removed == [BlockRemoved(block_hashes=[req.block_hashes[1]], group_idx=7)]
    assert pool.get_cached_block(req.block_hashes[1], [7]) is None
    assert pool.take_events() == []
    pool.free_blocks(again)
    assert_all_free(pool)


def test_duplicate_hashes_coexist_and_lookup_returns_oldest():
    pool = BlockPool(6, hash_block_size=4)
    a = make_request("a", range(4), block_size=4)
    b = make_request("b", range(4), block_size=4)
    blk_a = pool.get_new_blocks(1)
    blk_b = pool.get_new_blocks(1)
    pool.cache_full_blocks(a, blk_a, 0, 1, 4, 0)
    pool.cache_full_blocks(b, blk_b, 0, 1, 4, 0)
    key = a.block_hashes[0]
    assert pool.get_cached_block(key, [0]) == blk_a
    assert pool.num_cached_entries() == 2
    check_invariants(pool)
    pool.evict_blocks({blk_a[0].block_id})
    assert pool.get_cached_block(key, [0]) == blk_b  # the other copy survives
    pool.evict_blocks({blk_b[0].block_id})
    assert pool.get_cached_block(key, [0]) is None
    assert blk_a[0].ref_cnt == 1  # evict only drops the cache entry
    pool.free_blocks(blk_a + blk_b)
    check_invariants(pool)
    assert_all_free(pool)


def test_evict_blocks_rejects_unknown_ids():
    pool = BlockPool(4)
    with pytest.raises(ValueError, match="invalid block id"):
        pool.evict_blocks({4})


def test_reset_prefix_cache_refused_while_in_use_then_clears():
    pool = BlockPool(5, hash_block_size=4, enable_kv_cache_events=True)
    req = make_request("r", range(8), block_size=4)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(req, blocks, 0, 2, 4, 0)
    pool.take_events()
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(req.block_hashes[0], [0]) == [blocks[0]]
    pool.free_blocks(reversed(blocks))
    assert pool.reset_prefix_cache() is True
    assert pool.get_cached_block(req.block_hashes[0], [0]) is None
    assert all(b.block_hash is None for b in pool.blocks)
    assert pool.take_events() == [AllBlocksCleared()]
    check_invariants(pool)
    assert_all_free(pool)


def test_events_disabled_returns_nothing():
    pool = BlockPool(4, hash_block_size=4)
    req = make_request("r", range(4), block_size=4)
    blocks = pool.get_new_blocks(1)
    pool.cache_full_blocks(req, blocks, 0, 1, 4, 0)
    assert pool.take_events() == []
    pool.free_blocks(blocks)
    assert_all_free(pool)


def test_cache_full_blocks_from_an_offset_records_parent_hash():
    pool = BlockPool(6, hash_block_size=4, enable_kv_cache_events=True)
    req = make_request("r", range(12), block_size=4, lora_name="ad", cache_salt="s")
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(req, blocks, 0, 1, 4, 0)
    pool.cache_full_blocks(req, blocks, 1, 3, 4, 0)
    first, second = pool.take_events()
    assert first.extra_keys == [("ad", "s")] and first.lora_name == "ad"
    assert second.parent_block_hash == req.block_hashes[0]
    assert second.block_hashes == req.block_hashes[1:3]
    assert second.token_ids == list(range(4, 12)) and second.extra_keys == [("ad",), ("ad",)]
    pool.free_blocks(reversed(blocks))
    assert_all_free(pool)
