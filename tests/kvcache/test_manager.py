"""KVCacheManager with one full-attention group: hits, allocation, freeing, stats."""
import pytest

from kvcache import KVCacheBlocks, RequestStatus
from kvcache.audit import assert_all_free, check_invariants
from kvcache.testing import fa_spec, make_manager, make_request

BS = 16


def queue_ids(mgr):
    return [b.block_id for b in mgr.block_pool.free_block_queue.get_all_free_blocks()]


def schedule(mgr, req, num_new=None, **kw):
    blocks, num_hit = mgr.get_computed_blocks(req)
    if num_new is None:
        num_new = req.num_tokens - num_hit
    out = mgr.allocate_slots(req, num_new, num_hit, blocks, **kw)
    if out is not None:
        req.num_computed_tokens = num_hit + num_new
        req.status = RequestStatus.RUNNING
    return out, num_hit, blocks


def test_prefill_hit_free_order_and_eviction_order():
    mgr = make_manager(11, fa_spec(BS))
    common = list(range(3 * BS))
    req0 = make_request("0", common + [3] * 7)
    blocks, hit = mgr.get_computed_blocks(req0)
    assert hit == 0 and blocks is mgr.empty_kv_cache_blocks
    new = mgr.allocate_slots(req0, 55, hit, blocks)
    assert new.get_block_ids() == ([1, 2, 3, 4],)
    assert [b.ref_cnt for b in new.blocks[0]] == [1, 1, 1, 1]
    assert [b.block_hash is not None for b in new.blocks[0]] == [True, True, True, False]

    req1 = make_request("1", common + [5] * 5)
    blocks, hit = mgr.get_computed_blocks(req1)
    assert hit == 3 * BS and blocks.get_block_ids() == ([1, 2, 3],)
    new = mgr.allocate_slots(req1, 5, hit, blocks)
    assert new.get_block_ids() == ([5],)
    assert [b.ref_cnt for b in blocks.blocks[0]] == [2, 2, 2]
    assert mgr.get_block_ids("1") == ([1, 2, 3, 5],)

    mgr.free(req0)
    mgr.free(req1)
    # unhashed tails reused first, then never-used blocks, then cached blocks LRU
    assert queue_ids(mgr) == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]
    check_invariants(mgr)

    # a miss that needs every block takes them in exactly that order
    req2 = make_request("2", [99] * (10 * BS))
    new, hit, _ = schedule(mgr, req2)
    assert hit == 0 and new.get_block_ids() == ([5, 4, 6, 7, 8, 9, 10, 3, 2, 1],)
    assert mgr.num_free_blocks == 0
    mgr.free(req2)
    assert_all_free(mgr)


def test_decode_fills_last_block_then_allocates_and_caches_when_full():
    mgr = make_manager(11, fa_spec(BS))
    req = make_request("0", list(range(55)))
    new, _, _ = schedule(mgr, req)
    assert new.get_block_ids() == ([1, 2, 3, 4],)
    last = new.blocks[0][3]
    for tok in range(9):
        req.append_output_token_ids(1000 + tok)
        out = mgr.allocate_slots(req, 1)
        req.num_computed_tokens += 1
        assert out is mgr.empty_kv_cache_blocks
    assert req.num_tokens == 64 and last.block_hash is not None  # block 4 is full and cached
    req.append_output_token_ids(7)
    out = mgr.allocate_slots(req, 1)
    assert out.get_block_ids() == ([5],) and out.blocks[0][0].block_hash is None
    mgr.free(req)
    assert_all_free(mgr)


def test_free_order_is_lru_with_tail_first():
    mgr = make_manager(11, fa_spec(BS))
    req0 = make_request("0", list(range(5 * BS + 7)))
    assert schedule(mgr, req0)[0].get_block_ids() == ([1, 2, 3, 4, 5, 6],)
    req1 = make_request("1", list(range(5 * BS + 7, 8 * BS + 7)))
    assert schedule(mgr, req1)[0].get_block_ids() == ([7, 8, 9],)
    mgr.free(req0)
    mgr.free(req1)
    assert queue_ids(mgr) == [6, 10, 5, 4, 3, 2, 1, 9, 8, 7]
    # a hit takes its blocks out of the middle of the queue
    req2 = make_request("2", list(range(2 * BS + 3)))
    new, hit, blocks = schedule(mgr, req2)
    assert hit == 2 * BS and blocks.get_block_ids() == ([1, 2],)
    assert new.get_block_ids() == ([6],)
    assert queue_ids(mgr) == [10, 5, 4, 3, 9, 8, 7]
    mgr.free(req2)
    assert_all_free(mgr)


def test_reused_block_loses_its_old_hash():
    mgr = make_manager(2, fa_spec(BS))
    req = make_request("0", list(range(BS)))
    blk = schedule(mgr, req)[0].blocks[0][0]
    assert blk.block_hash is not None
    mgr.free(req)
    req2 = make_request("1", [7] * (BS - 1))
    new = schedule(mgr, req2)[0]
    assert new.blocks[0][0] is blk and blk.block_hash is None
    assert mgr.get_computed_blocks(make_request("2", list(range(BS)) + [1]))[1] == 0
    mgr.free(req2)
    assert_all_free(mgr)


def test_hit_blocks_are_not_evicted_by_their_own_allocation():
    mgr = make_manager(3, fa_spec(BS))
    req0 = make_request("0", list(range(BS)))
    req1 = make_request("1", list(range(100, 100 + BS)))
    assert schedule(mgr, req0)[0].get_block_ids() == ([1],)
    assert schedule(mgr, req1)[0].get_block_ids() == ([2],)
    mgr.free(req0)
    mgr.free(req1)
    assert queue_ids(mgr) == [1, 2]  # block 1 is at the head, next to be evicted
    req2 = make_request("2", list(range(2 * BS)))
    new, hit, blocks = schedule(mgr, req2)
    assert hit == BS and blocks.get_block_ids() == ([1],)
    assert new.get_block_ids() == ([2],)
    mgr.free(req2)
    assert_all_free(mgr)


def test_full_hit_still_recomputes_the_last_token():
    mgr = make_manager(11, fa_spec(BS))
    req0 = make_request("0", list(range(3 * BS)))
    schedule(mgr, req0)
    mgr.free(req0)
    _, hit = mgr.get_computed_blocks(make_request("1", list(range(3 * BS))))
    assert hit == 2 * BS  # 47 tokens could hit; blocks are whole, so 32
    _, hit = mgr.get_computed_blocks(make_request("2", list(range(3 * BS + 1))))
    assert hit == 3 * BS
    assert_all_free(mgr)


def test_failed_allocation_changes_nothing():
    mgr = make_manager(6, fa_spec(BS))
    req0 = make_request("0", list(range(2 * BS)))
    schedule(mgr, req0)
    mgr.free(req0)  # blocks 1, 2 cached and free
    before = queue_ids(mgr)
    req1 = make_request("1", list(range(2 * BS)) + [9] * (4 * BS))
    blocks, hit = mgr.get_computed_blocks(req1)
    assert hit == 2 * BS
    assert mgr.allocate_slots(req1, req1.num_tokens - hit, hit, blocks) is None
    assert [b.ref_cnt for b in blocks.blocks[0]] == [0, 0]
    assert queue_ids(mgr) == before and mgr.get_block_ids("1") == ([],)
    check_invariants(mgr)
    assert_all_free(mgr)


def test_caching_disabled_never_hits_or_hashes():
    mgr = make_manager(11, fa_spec(BS), enable_caching=False)
    req0 = make_request("0", list(range(3 * BS + 2)))
    new = schedule(mgr, req0)[0]
    assert all(b.block_hash is None for b in new.blocks[0])
    mgr.free(req0)
    assert mgr.get_computed_blocks(make_request("1", list(range(3 * BS + 2)))) == (mgr.empty_kv_cache_blocks, 0)
    check_invariants(mgr)
    assert_all_free(mgr)


def test_skip_reading_prefix_cache_still_writes_it():
    mgr = make_manager(11, fa_spec(BS), log_stats=True)
    req0 = make_request("0", list(range(3 * BS + 2)), skip_reading_prefix_cache=True)
    new, hit, _ = schedule(mgr, req0)
    assert hit == 0 and new.get_block_ids() == ([1, 2, 3, 4],)
    req1 = make_request("1", list(range(3 * BS + 2)), skip_reading_prefix_cache=True)
    assert mgr.get_computed_blocks(req1)[1] == 0
    assert mgr.get_computed_blocks(make_request("2", list(range(3 * BS + 2))))[1] == 3 * BS
    stats = mgr.make_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits) == (1, 3 * BS + 2, 3 * BS)  # skipped lookups not counted
    mgr.free(req0)
    assert_all_free(mgr)


def test_cache_salt_separates_caches():
    mgr = make_manager(20, fa_spec(BS))
    toks = list(range(3 * BS + 1))
    req0 = make_request("0", toks, cache_salt="a")
    schedule(mgr, req0)
    assert mgr.get_computed_blocks(make_request("1", toks))[1] == 0
    assert mgr.get_computed_blocks(make_request("2", toks, cache_salt="b"))[1] == 0
    assert mgr.get_computed_blocks(make_request("3", toks, cache_salt="a"))[1] == 3 * BS
    mgr.free(req0)
    assert_all_free(mgr)


def test_prefix_cache_stats_split_preempted_and_reset():
    mgr = make_manager(20, fa_spec(BS), log_stats=True)
    req0 = make_request("0", list(range(2 * BS + 1)))
    schedule(mgr, req0)
    again = make_request("1", list(range(2 * BS + 1)))
    again.num_preemptions = 1
    mgr.get_computed_blocks(again)
    stats = mgr.make_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits) == (1, 33, 0)
    assert (stats.preempted_requests, stats.preempted_queries, stats.preempted_hits) == (1, 33, 32)
    assert mgr.make_prefix_cache_stats().requests == 0  # handed out and restarted
    mgr.free(req0)
    assert mgr.reset_prefix_cache() is True
    assert mgr.make_prefix_cache_stats().reset is True
    assert make_manager(4, fa_spec(BS)).make_prefix_cache_stats() is None
    assert_all_free(mgr)


def test_reset_prefix_cache_only_when_everything_is_free():
    mgr = make_manager(11, fa_spec(BS))
    req = make_request("0", list(range(2 * BS + 1)))
    schedule(mgr, req)
    assert mgr.reset_prefix_cache() is False
    mgr.free(req)
    assert mgr.reset_prefix_cache() is True
    assert mgr.get_computed_blocks(make_request("1", list(range(2 * BS + 1))))[1] == 0
    assert_all_free(mgr)


def test_allocate_nothing_is_an_error():
    mgr = make_manager(4, fa_spec(BS))
    with pytest.raises(ValueError, match="num_new_tokens"):
        mgr.allocate_slots(make_request("0", [1, 2, 3]), 0)
    assert_all_free(mgr)


def test_lookahead_tokens_get_slots():
    mgr = make_manager(10, fa_spec(4))
    req = make_request("0", [1, 2, 3], block_size=4)
    assert mgr.allocate_slots(req, 3, num_lookahead_tokens=2).get_block_ids() == ([1, 2],)
    assert mgr.get_block_ids("0") == ([1, 2],)
    mgr.free(req)
    assert_all_free(mgr)


def test_max_model_len_caps_slots():
    mgr = make_manager(10, fa_spec(4), max_model_len=8)
    req = make_request("0", list(range(7)), block_size=4)
    assert mgr.allocate_slots(req, 7, num_lookahead_tokens=5).get_block_ids() == ([1, 2],)
    mgr.free(req)
    assert_all_free(mgr)


def test_kv_cache_blocks_api():
    mgr = make_manager(10, fa_spec(4))
    a = make_request("a", list(range(9)), block_size=4)
    first = mgr.allocate_slots(a, 9)
    a.num_computed_tokens = 9
    a.append_output_token_ids(list(range(9, 13)))
    second = mgr.allocate_slots(a, 4)
    both = first + second
    assert both.get_block_ids() == ([1, 2, 3, 4],) and first.get_block_ids() == ([1, 2, 3],)
    assert both == mgr.get_blocks("a")
    assert both.get_unhashed_block_ids() == [4]
    assert both.get_unhashed_block_ids_all_groups() == [[4]]
    empty = both.new_empty()
    assert empty.get_block_ids() == ([],) and empty.get_block_ids(allow_none=True) is None
    assert mgr.empty_kv_cache_blocks.blocks == ((),)
    assert isinstance(mgr.get_blocks("unknown"), KVCacheBlocks) and mgr.get_block_ids("unknown") == ([],)
    mgr.free(a)
    mgr.free(a)  # freeing twice (or an unknown request) is harmless
    assert_all_free(mgr)


def test_usage_and_free_counts():
    mgr = make_manager(11, fa_spec(4))
    assert mgr.usage == 0.0 and mgr.num_free_blocks == 10
    req = make_request("0", list(range(20)), block_size=4)
    mgr.allocate_slots(req, 20)
    assert mgr.usage == pytest.approx(0.5) and mgr.block_pool.get_num_free_blocks() == 5
    mgr.free(req)
    assert_all_free(mgr)


def test_common_prefix_blocks_count_blocks_shared_by_all_holders():
    mgr = make_manager(20, fa_spec(4))
    a = make_request("a", list(range(13)), block_size=4)
    b = make_request("b", list(range(9)) + [50, 51, 52], block_size=4)
    schedule(mgr, a)
    schedule(mgr, b)
    assert mgr.get_num_common_prefix_blocks("a") == [2]
    mgr.free(a)
    mgr.free(b)
    assert_all_free(mgr)


def test_hasher_granularity_must_match_the_cache():
    mgr = make_manager(20, fa_spec(BS))
    wrong = make_request("0", list(range(40)), block_size=8)
    with pytest.raises(ValueError, match="blocks of 8 tokens"):
        mgr.get_computed_blocks(wrong)
    with pytest.raises(ValueError, match="blocks of 8 tokens"):
        mgr.allocate_slots(wrong, 40)
    mgr.free(wrong)
    from kvcache import Request
    unhashed = Request("1", list(range(40)))
    with pytest.raises(ValueError, match="no block hasher"):
        mgr.allocate_slots(unhashed, 40)
    mgr.free(unhashed)
    assert_all_free(mgr)
