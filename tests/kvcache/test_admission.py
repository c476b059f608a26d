"""Admission policy of allocate_slots: watermark, full sequence, reservations,
delayed caching for remote KV, deferred frees."""
from kvcache import RequestStatus
from kvcache.audit import assert_all_free, check_invariants
from kvcache.testing import fa_spec, make_manager, make_request, swa_spec

BS = 4


def req(rid, n, start=0, **kw):
    return make_request(rid, list(range(start, start + n)), block_size=BS, **kw)


def test_watermark_applies_only_to_waiting_requests_while_others_run():
    mgr = make_manager(11, fa_spec(BS), watermark=0.2)  # int(0.2 * 11) = 2 blocks
    assert mgr.watermark_blocks == 2
    r = req("0", 9 * BS)
    assert mgr.allocate_slots(r, 9 * BS, has_scheduled_reqs=True) is None  # 9 + 2 > 10
    r.status = RequestStatus.PREEMPTED
    assert mgr.allocate_slots(r, 9 * BS, has_scheduled_reqs=True) is None
    assert mgr.allocate_slots(r, 8 * BS, has_scheduled_reqs=True) is not None  # 8 + 2 <= 10
    mgr.free(r)
    # nothing scheduled yet: the first admission is never blocked by the watermark
    r.status = RequestStatus.WAITING
    assert mgr.allocate_slots(r, 9 * BS, has_scheduled_reqs=False).get_block_ids() is not None
    mgr.free(r)
    # running requests grow without the watermark
    r.status = RequestStatus.RUNNING
    assert mgr.allocate_slots(r, 10 * BS) is not None
    mgr.free(r)
    assert_all_free(mgr)


def test_watermark_can_refuse_even_when_no_block_is_needed():
    mgr = make_manager(11, fa_spec(BS), watermark=0.2)
    hog = req("hog", 9 * BS)
    hog.status = RequestStatus.RUNNING
    mgr.allocate_slots(hog, 9 * BS)
    r = req("0", 2, start=500)
    r.status = RequestStatus.RUNNING
    assert mgr.allocate_slots(r, 1) is not None  # one block, free 1 -> 0
    r.status = RequestStatus.WAITING
    assert mgr.allocate_slots(r, 1) is None  # 0 blocks needed, but 0 + 2 > 0 free
    mgr.free(r)
    mgr.free(hog)
    assert_all_free(mgr)


def test_full_sequence_must_fit_rejects_a_prompt_whose_first_chunk_fits():
    mgr = make_manager(6, fa_spec(BS))  # 5 usable blocks
    r = req("0", 8 * BS)
    assert mgr.allocate_slots(r, 2 * BS, full_sequence_must_fit=True) is None
    assert mgr.num_free_blocks == 5
    assert mgr.allocate_slots(r, 2 * BS).get_block_ids() == ([1, 2],)
    mgr.free(r)
    small = req("1", 5 * BS)
    assert mgr.allocate_slots(small, 2 * BS, full_sequence_must_fit=True) is not None
    mgr.free(small)
    assert_all_free(mgr)


def test_full_sequence_gate_uses_the_sliding_window_cap():
    # window 8, 8 batched tokens: a request never holds more than cdiv(7 + 8, 4) + 1 = 5 blocks
    mgr = make_manager(7, swa_spec(BS, 8), max_model_len=200, max_num_batched_tokens=8)
    r = req("0", 40 * BS)
    out = mgr.allocate_slots(r, 8, full_sequence_must_fit=True)
    assert out is not None and len(out.blocks[0]) == 2
    mgr.free(r)
    full = make_manager(7, fa_spec(BS), max_model_len=200, max_num_batched_tokens=8)
    r2 = req("1", 40 * BS)
    assert full.allocate_slots(r2, 8, full_sequence_must_fit=True) is None
    assert_all_free(mgr)
    assert_all_free(full)


def test_full_sequence_gate_counts_evictable_hits_and_ignores_reservation():
    mgr = make_manager(6, fa_spec(BS))
    warm = req("w", 3 * BS)
    mgr.allocate_slots(warm, 3 * BS)
    mgr.free(warm)  # 3 cached free blocks
    r = req("0", 5 * BS + 1)
    blocks, hit = mgr.get_computed_blocks(r)
    assert hit == 3 * BS
    # whole sequence: 3 hits (free, so they use capacity) + 3 new = 6 > 5 free
    assert mgr.allocate_slots(r, BS, hit, blocks, full_sequence_must_fit=True) is None
    r2 = req("1", 5 * BS)
    blocks, hit = mgr.get_computed_blocks(r2)
    # 3 hits + 2 new = 5 fits the full-sequence gate; the reservation only limits this chunk
    assert mgr.allocate_slots(r2, BS, hit, blocks, full_sequence_must_fit=True, reserved_blocks=2) is None
    assert mgr.allocate_slots(r2, BS, hit, blocks, full_sequence_must_fit=True, reserved_blocks=1) is not None
    mgr.free(r2)
    assert_all_free(mgr)


def test_reserved_blocks_are_held_back_from_this_allocation():
    mgr = make_manager(11, fa_spec(BS))
    r = req("0", 6 * BS)
    assert mgr.allocate_slots(r, 6 * BS, reserved_blocks=5) is None  # 6 > 10 - 5
    assert mgr.num_free_blocks == 10
    assert mgr.allocate_slots(r, 6 * BS, reserved_blocks=4) is not None
    mgr.free(r)
    assert_all_free(mgr)


def test_delay_cache_blocks_keeps_remote_blocks_out_of_the_cache_until_landed():
    mgr = make_manager(20, fa_spec(BS))
    r = req("0", 4 * BS + 2)
    blocks, hit = mgr.get_computed_blocks(r)
    # all but the last token arrive from a remote worker
    out = mgr.allocate_slots(r, 0, hit, blocks, num_external_computed_tokens=4 * BS + 1, delay_cache_blocks=True)
    assert out is mgr.empty_kv_cache_blocks  # external blocks are not "new" blocks
    ids = mgr.get_block_ids("0")
    assert ids == ([1, 2, 3, 4, 5],)
    assert mgr.get_blocks("0").get_unhashed_block_ids_all_groups() == [[1, 2, 3, 4, 5]]
    assert mgr.get_computed_blocks(req("other", 4 * BS + 2))[1] == 0
    r.num_computed_tokens = 4 * BS + 1
    mgr.cache_blocks(r, r.num_computed_tokens)
    assert mgr.get_blocks("0").get_unhashed_block_ids_all_groups() == [[5]]
    assert mgr.get_computed_blocks(req("other", 4 * BS + 2))[1] == 4 * BS
    mgr.free(r)
    assert_all_free(mgr)


def test_local_hits_plus_external_tokens():
    mgr = make_manager(20, fa_spec(BS))
    warm = req("w", 2 * BS)
    mgr.allocate_slots(warm, 2 * BS)
    r = req("0", 5 * BS)
    blocks, hit = mgr.get_computed_blocks(r)
    assert hit == 2 * BS
    new = mgr.allocate_slots(r, 1, hit, blocks, num_external_computed_tokens=5 * BS - hit - 1,
                             delay_cache_blocks=True)
    assert new is mgr.empty_kv_cache_blocks  # hits and external blocks cover every slot
    assert mgr.get_block_ids("0") == ([1, 2, 3, 4, 5],)
    assert [b.ref_cnt for b in mgr.get_blocks("0").blocks[0]] == [2, 2, 1, 1, 1]
    mgr.free(warm)
    mgr.free(r)
    check_invariants(mgr)
    assert_all_free(mgr)


def test_pop_blocks_for_free_defers_the_release():
    mgr = make_manager(11, fa_spec(BS))
    r = req("0", 3 * BS + 1)
    mgr.allocate_slots(r, r.num_tokens)
    popped = mgr.pop_blocks_for_free(r)
    assert [b.block_id for b in popped] == [1, 2, 3, 4]
    assert [b.ref_cnt for b in popped] == [1, 1, 1, 1]
    assert mgr.get_block_ids("0") == ([],) and mgr.num_free_blocks == 6
    mgr.block_pool.free_blocks(reversed(popped))
    assert [b.block_id for b in mgr.block_pool.free_block_queue.get_all_free_blocks()][-3:] == [3, 2, 1]
    assert_all_free(mgr)


def test_blocks_needed_for_full_sequence():
    mgr = make_manager(30, fa_spec(BS))
    r = req("0", 25)
    assert mgr.num_blocks_needed_for_full_sequence(r) == 7
    mgr.allocate_slots(r, 8)
    r.num_computed_tokens = 8
    assert mgr.num_blocks_needed_for_full_sequence(r) == 5
    mgr.free(r)
    swa = make_manager(30, swa_spec(BS, 8), max_model_len=400, max_num_batched_tokens=8)
    long = req("1", 200)
    assert swa.num_blocks_needed_for_full_sequence(long) == 5  # capped: cdiv(7 + 8, 4) + 1
    assert_all_free(mgr)
    assert_all_free(swa)
