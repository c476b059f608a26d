"""Sliding-window groups: right-to-left hit search, null-block replacement."""
from types import SimpleNamespace

import pytest

from kvcache import BlockPool, KVCacheBlock, RequestStatus
from kvcache.audit import assert_all_free, check_invariants
from kvcache.single_type import FullAttentionManager, SlidingWindowManager
from kvcache.testing import fa_spec, make_manager, make_request, swa_spec

# window 4 with 2-token blocks: a hit needs cdiv(4 - 1, 2) = 2 contiguous cached blocks
CASES = [
    ([False] * 10, []),
    ([True], [10]),
    ([True, False], [10]),
    ([True, True], [10, 11]),
    ([True, True, False], [10, 11]),
    ([True, True, True], [0, 11, 12]),
    ([True, True, True, False], [0, 11, 12]),
    ([True, True, False, True, False, False, True, True, False, True, True, True], [0] * 10 + [20, 21]),
    ([True, True, False, True, False, False, True, True, False, False, False], [0] * 6 + [16, 17]),
    ([False, True, True, False, True], [0, 11, 12]),
    ([True, False, True], [10]),  # a run touching block 0 needs no window before it
]


@pytest.mark.parametrize("cached,expected", CASES)
def test_sliding_window_hit_search(cached, expected):
    pool = BlockPool(40, hash_block_size=2)
    mgr = SlidingWindowManager(swa_spec(2, 4), pool, True, 0, 2)
    hashes = [f"h{i}".encode() for i in range(len(cached))]
    # cache block i (id i + 10) under hashes[i] where `cached` says so, through the
    # pool's one insertion path; only the fields cache_full_blocks reads
    req = SimpleNamespace(request_id="r", block_hashes=hashes, block_hasher=object())
    pool.cache_full_blocks(req, pool.blocks[10:10 + len(cached)], 0, len(cached), 2, 0, block_mask=cached)
    hit = mgr.find_longest_cache_hit(hashes, len(hashes) * 2, (0,), 2)[0]
    assert [b.block_id for b in hit] == expected
    assert all(b is pool.null_block for b in hit[:-2])


def test_remove_skipped_blocks_frees_only_blocks_fully_outside_the_window():
    pool = BlockPool(20, hash_block_size=2)
    mgr = SlidingWindowManager(swa_spec(2, 4), pool, True, 0, 2)
    blocks = pool.get_new_blocks(8)
    mgr.req_to_blocks["r"] = list(blocks)
    null = pool.null_block

    def pattern():
        return [b is null for b in mgr.req_to_blocks["r"]]

    mgr.remove_skipped_blocks("r", 0)
    assert not any(pattern())
    mgr.remove_skipped_blocks("r", 5)  # tokens 0,1 out of the window -> block 0
    assert pattern() == [True] + [False] * 7 and pool.get_num_free_blocks() == 12
    mgr.remove_skipped_blocks("r", 6)  # token 2 out; block 1 still holds token 3
    assert pattern() == [True] + [False] * 7
    mgr.remove_skipped_blocks("r", 7)
    assert pattern() == [True, True] + [False] * 6
    mgr.remove_skipped_blocks("r", 12)
    assert pattern() == [True] * 4 + [False] * 4 and pool.get_num_free_blocks() == 15
    mgr.free("r")
    check_invariants(pool)
    assert_all_free(pool)


def test_decode_returns_blocks_that_leave_the_window():
    mgr = make_manager(30, swa_spec(4, 8), max_model_len=400)
    r = make_request("0", list(range(20)), block_size=4)
    assert mgr.allocate_slots(r, 20).get_block_ids() == ([1, 2, 3, 4, 5],)
    r.num_computed_tokens = 20
    r.status = RequestStatus.RUNNING
    for t in range(8):
        r.append_output_token_ids(100 + t)
        assert mgr.allocate_slots(r, 1) is not None
        r.num_computed_tokens += 1
    ids = mgr.get_block_ids("0")[0]
    # 28 computed tokens: the next one attends to tokens 21..28, so blocks 0..4 are gone
    assert ids[:5] == [0, 0, 0, 0, 0] and all(i != 0 for i in ids[5:])
    assert mgr.num_free_blocks == 29 - len(ids[5:])
    mgr.free(r)
    check_invariants(mgr)
    assert_all_free(mgr)


def test_prefix_hit_pads_with_null_blocks_and_touches_only_the_window():
    mgr = make_manager(30, swa_spec(4, 8), max_model_len=400)
    a = make_request("a", list(range(30)), block_size=4)
    mgr.allocate_slots(a, 30)
    mgr.free(a)
    b = make_request("b", list(range(30)) + [7, 7], block_size=4)
    blocks, hit = mgr.get_computed_blocks(b)
    assert hit == 28
    ids = blocks.get_block_ids()[0]
    assert ids[:5] == [0] * 5 and ids[5:] == [6, 7]  # a window of 8 needs 2 blocks before token 28
    new = mgr.allocate_slots(b, b.num_tokens - hit, hit, blocks)
    held = mgr.get_block_ids("b")[0]
    assert held[:5] == [0] * 5 and held[5:7] == [6, 7] and new.get_block_ids()[0] == held[7:]
    assert [blk.ref_cnt for blk in blocks.blocks[0][5:]] == [1, 1]
    mgr.free(b)
    check_invariants(mgr)
    assert_all_free(mgr)


def test_evictable_hits_count_toward_blocks_to_allocate():
    pool = BlockPool(100, hash_block_size=16)
    mgr = FullAttentionManager(fa_spec(16), pool, True, 0, 16)
    evictable = [KVCacheBlock(i) for i in range(1, 11)]
    assert mgr.get_num_blocks_to_allocate("1", 20 * 16, evictable, 0, 20 * 16) == 20
    held = [pool.null_block] * 5 + [KVCacheBlock(i) for i in range(11, 16)]
    for b in held[5:]:
        b.ref_cnt = 1
    assert mgr.get_num_blocks_to_allocate("2", 20 * 16, held, 0, 20 * 16) == 10
    swa = SlidingWindowManager(swa_spec(16, 64), pool, True, 0, 16)
    # 200 computed tokens: the first 137 are outside the window (8 blocks skipped)
    assert swa.get_num_blocks_to_allocate("3", 20 * 16, evictable, 200, 20 * 16) == 10 + 2
