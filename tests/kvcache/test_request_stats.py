"""Request state fields and prefix-cache hit statistics."""
from kvcache import PrefixCacheStats, Request, RequestStatus
from kvcache.stats import CachingMetrics
from kvcache.testing import hasher


def test_request_state_fields():
    params = {"do_remote_decode": True}
    r = Request("r1", [1, 2, 3, 4, 5], block_hasher=hasher(4), max_tokens=7, cache_salt="s", lora_name="l",
                skip_reading_prefix_cache=True, kv_transfer_params=params)
    assert (r.request_id, r.num_prompt_tokens, r.num_tokens, r.max_tokens) == ("r1", 5, 5, 7)
    assert r.prompt_token_ids == [1, 2, 3, 4, 5] and r.output_token_ids == []
    assert (r.cache_salt, r.lora_name, r.skip_reading_prefix_cache) == ("s", "l", True)
    assert r.kv_transfer_params is params and r.status == RequestStatus.WAITING
    assert r.num_computed_tokens == 0 and r.num_preemptions == 0 and len(r.block_hashes) == 1
    r.append_output_token_ids([6, 7, 8])
    assert r.num_tokens == 8 and r.num_output_tokens == 3 and len(r.block_hashes) == 2
    assert r.prompt_token_ids == [1, 2, 3, 4, 5]  # the prompt is not extended
    r.status = RequestStatus.FINISHED_LENGTH_CAPPED
    assert r.is_finished() and r.get_finished_reason() == "length"
    r.spec_token_ids = [9, 9]
    assert r.num_tokens_with_spec == 10


def test_prefix_cache_stats_and_sliding_metrics():
    s = PrefixCacheStats()
    s.record(100, 40, preempted=False)
    s.record(50, 50, preempted=True)
    assert (s.requests, s.queries, s.hits) == (1, 100, 40) and s.hit_rate == 0.4
    assert (s.preempted_requests, s.preempted_queries, s.preempted_hits) == (1, 50, 50)
    m = CachingMetrics(max_recent_requests=2)
    assert m.empty and m.hit_rate == 0.0
    m.observe(s)
    m.observe(PrefixCacheStats())  # empty intervals are ignored
    assert m.hit_rate == 0.4
    m.observe(PrefixCacheStats(requests=2, queries=100, hits=100))
    assert m.hit_rate == 1.0  # the oldest interval dropped out of the window
    m.observe(PrefixCacheStats(reset=True, requests=1, queries=10, hits=0))
    assert m.hit_rate == 0.0 and m.aggregated_requests == 1
