"""KVCacheManager.allocate_slots_in_order against one allocate_slots call per request.

The batch call answers the requests whose blocks already hold their slots (and that complete no block
to cache) without calling allocate_slots. Here one random decode workload runs through two managers, one
growing its running requests with the batch call and one with a call per request in the same order,
stopping at the first that does not fit; every result, block id, cached block and free count must match.
"""
import random

import pytest

from kvcache import RequestStatus
from kvcache.audit import assert_all_free, check_invariants
from kvcache.testing import fa_spec, make_manager, make_request, mamba_spec, swa_spec

CONFIGS = {
    "full-cached": ((fa_spec(4),), {}),
    "full-uncached": ((fa_spec(4),), {"enable_caching": False}),
    "full-watermark": ((fa_spec(4),), {"watermark": 0.1}),
    "sliding": ((swa_spec(4, 9),), {}),
    "full+sliding": ((fa_spec(4), swa_spec(4, 9)), {}),
    "full-4+full-8": ((fa_spec(4), fa_spec(8)), {}),
    "full+mamba": ((fa_spec(4), mamba_spec(4)), {}),
}


def _one_by_one(mgr, requests, nums):
    served = []
    for request, num_new in zip(requests, nums, strict=True):
        result = mgr.allocate_slots(request, num_new)
        if result is None:
            break
        served.append(result)
    return served


def _state(mgr, rids):
    groups = range(mgr.num_kv_cache_groups)
    return (mgr.block_pool.get_num_free_blocks(), {rid: mgr.get_block_ids(rid) for rid in rids},
            [sorted(mgr.block_pool.cached_map(g)) for g in groups] if mgr.enable_caching else None)


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("seed", range(3))
def test_batch_matches_one_call_per_request(name, seed):
    specs, kwargs = CONFIGS[name]
    rng = random.Random(seed)
    batch_mgr, ref_mgr = (make_manager(48, *specs, max_model_len=80, **kwargs) for _ in range(2))
    prefix = [rng.randrange(40) for _ in range(12)]
    live: dict[str, tuple] = {}
    num_short = 0
    for step in range(150):
        if rng.random() < 0.3 or not live:  # a new request, admitted with its whole prompt
            rid = f"r{step}"
            prompt = prefix[:rng.randrange(13)] + [rng.randrange(40) for _ in range(rng.randrange(1, 14))]
            pair = tuple(make_request(rid, prompt, block_size=4) for _ in range(2))
            fits = []
            for mgr, req in zip((batch_mgr, ref_mgr), pair, strict=True):
                hits, num_hit = mgr.get_computed_blocks(req)
                fits.append(mgr.allocate_slots(req, req.num_tokens - num_hit, num_hit, hits) is not None)
                req.num_computed_tokens = req.num_tokens
                req.status = RequestStatus.RUNNING
            assert fits[0] == fits[1], step
            if fits[0]:
                live[rid] = pair
            continue
        rids = sorted(live)
        for rid in rids:  # one sampled token each (sometimes two: a chunk of more than one token)
            for _ in range(2 if rng.random() < 0.1 else 1):
                tok = rng.randrange(40)
                for req in live[rid]:
                    req.append_output_token_ids(tok)
        if name == "full-watermark" and rng.random() < 0.3:  # a re-admission among them: the watermark applies
            for req in live[rids[0]]:
                req.status = RequestStatus.PREEMPTED
        results = []
        for side, allocate in enumerate((batch_mgr.allocate_slots_in_order,
                                         lambda reqs, nums: _one_by_one(ref_mgr, reqs, nums))):
            reqs = [live[rid][side] for rid in rids]
            nums = [req.num_tokens - req.num_computed_tokens for req in reqs]
            served = allocate(reqs, nums)
            for req in reqs[:len(served)]:
                req.num_computed_tokens = req.num_tokens
                req.status = RequestStatus.RUNNING
            results.append([r.get_block_ids() for r in served])
        assert results[0] == results[1], (step, results)
        if len(results[0]) < len(rids):  # the request that did not fit leaves (preempted)
            num_short += 1
            for mgr, req in zip((batch_mgr, ref_mgr), live.pop(rids[len(results[0])]), strict=True):
                mgr.free(req)
        for rid in [r for r in rids if r in live and live[r][0].num_tokens >= 70]:
            for mgr, req in zip((batch_mgr, ref_mgr), live.pop(rid), strict=True):
                mgr.free(req)
        assert _state(batch_mgr, live) == _state(ref_mgr, live), step
        check_invariants(batch_mgr)
    assert num_short, "the workload never filled the pool: the stop at the first miss went untested"
    for pair in live.values():
        for mgr, req in zip((batch_mgr, ref_mgr), pair, strict=True):
            mgr.free(req)
    assert_all_free(batch_mgr)
    assert_all_free(ref_mgr)


def test_zero_tokens_refused_like_allocate_slots():
    mgr = make_manager(16, fa_spec(4))
    req = make_request("a", [1, 2, 3], block_size=4)
    assert mgr.allocate_slots(req, 3) is not None
    req.num_computed_tokens = 3
    with pytest.raises(ValueError, match="greater than 0"):
        mgr.allocate_slots_in_order([req], [0])
    mgr.free(req)
    assert_all_free(mgr)
