"""The shared leak check and the invariant check report what is wrong."""
import pytest

from kvcache import BlockPool
from kvcache.audit import assert_all_free, check_invariants
from kvcache.testing import fa_spec, make_manager, make_request


def test_assert_all_free_names_leaked_blocks_and_refs():
    mgr = make_manager(6, fa_spec(4))
    req = make_request("r", list(range(6)), block_size=4)
    mgr.allocate_slots(req, 6)
    with pytest.raises(AssertionError) as info:
        assert_all_free(mgr)
    msg = str(info.value)
    assert "3 of 5 blocks free" in msg and "1(ref=1, hashed)" in msg and "2(ref=1)" in msg
    assert "tracks requests" in msg and "'r'" in msg
    mgr.free(req)
    assert_all_free(mgr)


def test_assert_all_free_accepts_pool_manager_or_owner():
    pool = BlockPool(4)
    assert_all_free(pool)

    class Engine:
        kv_cache_manager = make_manager(4, fa_spec(4))

    assert_all_free(Engine())
    with pytest.raises(TypeError):
        assert_all_free(object())


def test_assert_all_free_catches_pop_without_free():
    mgr = make_manager(6, fa_spec(4))
    req = make_request("r", list(range(6)), block_size=4)
    mgr.allocate_slots(req, 6)
    blocks = mgr.pop_blocks_for_free(req)  # bookkeeping gone, blocks still held
    with pytest.raises(AssertionError, match="blocks still in use"):
        assert_all_free(mgr)
    mgr.block_pool.free_blocks(reversed(blocks))
    assert_all_free(mgr)


def test_check_invariants_detects_corruption():
    pool = BlockPool(6, hash_block_size=4)
    check_invariants(pool)
    blocks = pool.get_new_blocks(2)
    blocks[0].ref_cnt = 0  # used but unreferenced
    with pytest.raises(AssertionError, match="neither free nor referenced"):
        check_invariants(pool)
    blocks[0].ref_cnt = 1
    free_block = pool.free_block_queue.get_all_free_blocks()[0]
    free_block.ref_cnt = 2
    with pytest.raises(AssertionError, match="free blocks with ref != 0"):
        check_invariants(pool)
    free_block.ref_cnt = 0
    blocks[1].block_hash = b"stale"  # hashed but not in the map
    with pytest.raises(AssertionError, match="missing from the prefix cache"):
        check_invariants(pool)
    blocks[1].block_hash = None
    pool.free_block_queue.num_free_blocks += 1
    with pytest.raises(AssertionError, match="counts"):
        check_invariants(pool)
    pool.free_block_queue.num_free_blocks -= 1
    pool.free_blocks(blocks)
    check_invariants(pool)
    assert_all_free(pool)
