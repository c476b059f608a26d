"""Several KV cache groups: hybrid fixed-point hits, LCM alignment, two-phase
allocation, Mamba state blocks, annotated events."""
import logging

import pytest

from kvcache import BlockStored, RequestStatus
from kvcache.audit import assert_all_free, check_invariants
from kvcache.coordinator import HybridCoordinator, NoPrefixCacheCoordinator, UnitaryCoordinator
from kvcache.testing import fa_spec, make_manager, make_request, mamba_spec, swa_spec


def all_ids(mgr, rid):
    return [i for group in mgr.get_block_ids(rid) for i in group if i != 0]


def run_prompt(mgr, req):
    blocks, hit = mgr.get_computed_blocks(req)
    out = mgr.allocate_slots(req, req.num_tokens - hit, hit, blocks)
    assert out is not None
    req.num_computed_tokens = req.num_tokens
    req.status = RequestStatus.RUNNING
    return hit, blocks


def test_coordinator_choice():
    assert isinstance(make_manager(10, fa_spec(4)).coordinator, UnitaryCoordinator)
    assert isinstance(make_manager(10, fa_spec(4), swa_spec(4, 8)).coordinator, HybridCoordinator)
    assert isinstance(make_manager(10, fa_spec(4), swa_spec(4, 8), enable_caching=False).coordinator,
                      NoPrefixCacheCoordinator)
    with pytest.raises(ValueError):
        make_manager(10, fa_spec(4), fa_spec(4))  # one distinct spec is not hybrid


def test_attention_free_model_has_no_groups_and_no_blocks():
    from kvcache import KVCacheConfig, KVCacheManager, Request
    mgr = KVCacheManager(KVCacheConfig(num_blocks=1, groups=()), 100)
    assert isinstance(mgr.coordinator, NoPrefixCacheCoordinator)
    r = Request("a", [1, 2, 3])
    assert mgr.get_computed_blocks(r) == (mgr.empty_kv_cache_blocks, 0)
    assert mgr.allocate_slots(r, 3).blocks == () and mgr.usage == 0.0
    mgr.free(r)
    assert_all_free(mgr)


def test_hybrid_hit_is_the_length_every_group_accepts():
    mgr = make_manager(80, fa_spec(16), swa_spec(16, 32), max_model_len=1000)
    a = make_request("a", list(range(85)))
    run_prompt(mgr, a)
    mgr.free(a)
    b = make_request("b", list(range(85)))
    blocks, hit = mgr.get_computed_blocks(b)
    fa_ids, swa_ids = blocks.get_block_ids()
    assert hit == 80 and len(fa_ids) == 5
    assert swa_ids[:3] == [0, 0, 0] and 0 not in swa_ids[3:]
    # the sliding window loses a block inside its window: hit falls back to a
    # contiguous run further left, and full attention is cut to match
    mgr.evict_blocks({swa_ids[3]})
    blocks, hit = mgr.get_computed_blocks(b)
    assert hit == 48 and len(blocks.blocks[0]) == 3 and len(blocks.blocks[1]) == 3
    # full attention loses block 2: everything from there on misses
    mgr.evict_blocks({fa_ids[2]})
    blocks, hit = mgr.get_computed_blocks(b)
    assert hit == 32 and [len(g) for g in blocks.blocks] == [2, 2]
    run_prompt(mgr, b)
    assert len(set(all_ids(mgr, "b"))) == len(all_ids(mgr, "b"))
    mgr.free(b)
    check_invariants(mgr)
    assert_all_free(mgr)


def test_hits_align_to_the_lcm_of_block_sizes():
    mgr = make_manager(60, fa_spec(8), swa_spec(4, 6), max_model_len=200)  # hash blocks of 4, hits of 8
    assert mgr.scheduler_block_size == 8 and mgr.hash_block_size == 4
    a = make_request("a", list(range(30)), block_size=4)
    run_prompt(mgr, a)
    mgr.free(a)
    b = make_request("b", list(range(30)) + [99] * 10, block_size=4)
    blocks, hit = mgr.get_computed_blocks(b)
    assert hit == 24 and hit % 8 == 0  # 28 tokens are cached at 4-token granularity
    assert [len(g) for g in blocks.blocks] == [3, 6]
    run_prompt(mgr, b)
    mgr.free(b)
    assert_all_free(mgr)


def test_equal_specs_are_looked_up_together():
    mgr = make_manager(80, fa_spec(4), swa_spec(4, 7), swa_spec(4, 7), max_model_len=200)
    assert [sg.group_ids for sg in mgr.coordinator.spec_groups] == [[0], [1, 2]]
    a = make_request("a", list(range(30)), block_size=4)
    run_prompt(mgr, a)
    mgr.free(a)
    b = make_request("b", list(range(30)), block_size=4)
    blocks, hit = mgr.get_computed_blocks(b)
    assert hit == 28 and [len(g) for g in blocks.blocks] == [7, 7, 7]
    # one of the two sliding-window groups losing a block breaks the joint hit
    mgr.evict_blocks({blocks.blocks[2][6].block_id})
    blocks, hit = mgr.get_computed_blocks(b)
    assert hit < 28 and len({len(g) for g in blocks.blocks}) == 1
    assert_all_free(mgr)


def test_local_hits_and_external_tokens_never_share_block_ids():
    # pool sized so that the external-token allocation reaches the cached hits
    mgr = make_manager(9, fa_spec(4), swa_spec(4, 8), max_model_len=200)
    warm = make_request("w", list(range(16)), block_size=4)
    run_prompt(mgr, warm)
    mgr.free(warm)
    assert [b.block_id for b in mgr.block_pool.free_block_queue.get_all_free_blocks()] == [4, 3, 2, 1, 8, 7, 6, 5]
    r = make_request("r", list(range(16)) + [100, 101, 102], block_size=4)
    blocks, hit = mgr.get_computed_blocks(r)
    assert hit == 16 and blocks.get_block_ids() == ([1, 2, 3, 4], [0, 0, 7, 8])
    # every group claims its hits before any group takes blocks for external tokens
    out = mgr.allocate_slots(r, 1, hit, blocks, num_external_computed_tokens=2, delay_cache_blocks=True)
    assert out is mgr.empty_kv_cache_blocks
    assert mgr.get_block_ids("r") == ([1, 2, 3, 4, 6], [0, 0, 7, 8, 5])
    check_invariants(mgr)
    mgr.free(r)
    r.num_computed_tokens = 0
    r.status = RequestStatus.PREEMPTED
    blocks, hit = mgr.get_computed_blocks(r)
    assert mgr.allocate_slots(r, r.num_tokens - hit, hit, blocks) is not None
    ids = all_ids(mgr, "r")
    assert len(ids) == len(set(ids)) == 8
    mgr.free(r)
    check_invariants(mgr)
    assert_all_free(mgr)


def test_hybrid_caches_only_up_to_the_last_lcm_boundary():
    mgr = make_manager(40, fa_spec(4), swa_spec(8, 16), max_model_len=200)
    r = make_request("r", list(range(30)), block_size=4)
    run_prompt(mgr, r)
    fa_blocks, swa_blocks = mgr.get_blocks("r").blocks
    assert [b.block_hash is not None for b in fa_blocks] == [True] * 6 + [False] * 2  # 24 of 30 tokens
    assert [b.block_hash is not None for b in swa_blocks] == [True] * 3 + [False]
    mgr.free(r)
    assert_all_free(mgr)


def test_mamba_keeps_one_state_block_per_request():
    mgr = make_manager(20, fa_spec(16), mamba_spec(64), max_model_len=64)
    r = make_request("r", list(range(50)))
    run_prompt(mgr, r)
    fa_ids, mamba_ids = mgr.get_block_ids("r")
    assert len(fa_ids) == 4 and len(mamba_ids) == 1
    for t in range(10):
        r.append_output_token_ids(t)
        assert mgr.allocate_slots(r, 1) is not None
        r.num_computed_tokens += 1
    fa_ids, mamba_ids = mgr.get_block_ids("r")
    assert len(fa_ids) == 4 and len(mamba_ids) == 1
    mgr.free(r)
    assert_all_free(mgr)


def test_mamba_all_mode_returns_old_states():
    mgr = make_manager(40, fa_spec(4), mamba_spec(4, "all"), max_model_len=200)
    r = make_request("r", list(range(10)), block_size=4)
    run_prompt(mgr, r)
    for t in range(10):
        r.append_output_token_ids(t)
        mgr.allocate_slots(r, 1)
        r.num_computed_tokens += 1
    mamba_ids = mgr.get_block_ids("r")[1]
    # 20 computed tokens: only the state after token 19 (block 4) is still needed
    assert mamba_ids[:4] == [0, 0, 0, 0] and mamba_ids[4] != 0
    mgr.free(r)
    check_invariants(mgr)
    assert_all_free(mgr)


def test_mamba_state_cached_this_step_is_not_reusable_until_next_step():
    mgr = make_manager(40, fa_spec(4), mamba_spec(4, "all"), max_model_len=200)
    a = make_request("a", list(range(9)), block_size=4)
    run_prompt(mgr, a)
    b = make_request("b", list(range(9)), block_size=4)
    blocks, hit = mgr.get_computed_blocks(b)
    assert hit == 8
    assert mgr.allocate_slots(b, 1, hit, blocks) is None  # state produced by this step's forward
    mgr.new_step_starts()
    assert mgr.allocate_slots(b, 1, hit, blocks) is not None
    mgr.free(a)
    mgr.free(b)
    assert_all_free(mgr)


def test_events_are_annotated_with_group_kind_and_window(caplog):
    mgr = make_manager(40, fa_spec(4), swa_spec(4, 12), max_model_len=200, enable_kv_cache_events=True)
    r = make_request("r", list(range(10)), block_size=4)
    run_prompt(mgr, r)
    events = mgr.take_events()
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert [(e.group_idx, e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window) for e in stored] == [
        (0, "full_attention", None), (1, "sliding_window", 12)]
    assert all(e.block_hashes == r.block_hashes[:2] for e in stored)
    assert mgr.take_events() == []
    mgr.block_pool.kv_event_queue.append(BlockStored([b"x"], None, [1, 2, 3, 4], 4, group_idx=5))
    with caplog.at_level(logging.WARNING):
        (ev,) = mgr.take_events()
    assert ev.kv_cache_spec_kind is None and "not in KV cache metadata" in caplog.text
    assert ev.to_dict()["type"] == "BlockStored"
    mgr.free(r)
    assert_all_free(mgr)


def test_no_prefix_cache_coordinator_allocates_every_group():
    mgr = make_manager(40, fa_spec(4), swa_spec(4, 8), enable_caching=False, max_model_len=200)
    r = make_request("r", list(range(10)), block_size=4)
    assert mgr.get_computed_blocks(r) == (mgr.empty_kv_cache_blocks, 0)
    assert [len(g) for g in mgr.allocate_slots(r, 10).blocks] == [3, 3]
    assert all(b.block_hash is None for g in mgr.get_blocks("r").blocks for b in g)
    assert mgr.get_num_common_prefix_blocks("r") == [0, 0]
    mgr.free(r)
    assert_all_free(mgr)
