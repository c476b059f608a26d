"""`PrefixAware`'s rule, on given figures (no processes: the choice is a pure function of them)."""
from __future__ import annotations

import random

import pytest

from kvcache.hashing import BlockHasher
from pd.cluster.router_config import RouterSection
from pd.cluster.roles import Role, WorkerEndpoint
from pd.router.choice import PrefixAware, RoundRobin, WorkerLoad, WorkerPool
from pd.router.kv_index import KVIndex


def _load(wid: str, queued: int = 0, in_flight: int = 0, waiting: int = 0, pool: int = 0) -> WorkerLoad:
    return WorkerLoad(WorkerEndpoint(wid, Role.PREFILL, f"http://{wid}"), num_in_flight=in_flight,
                      num_queued_tokens=queued, num_waiting=waiting, num_pool_tokens=pool)


def _rule(policy: PrefixAware, load: WorkerLoad, hit: int | None) -> float:
    survives = 1.0
    if policy.evict_aware and load.num_pool_tokens:
        taken = load.num_queued_tokens / load.num_pool_tokens
        survives = min(1.0, max(0.0, 1 - (taken - policy.evict_from) / (1 - policy.evict_from)))
    return ((hit or 0) * survives - policy.queue_weight * load.num_queued_tokens
            - policy.running_weight * load.num_in_flight)


def test_the_deployment_default_is_the_measured_rule():
    policy = PrefixAware()
    assert (policy.queue_weight, policy.running_weight) == (0.25, 16.0)
    assert (policy.evict_aware, policy.evict_from) == (True, 0.5)
    section = RouterSection()
    assert (section.prefix_queue_weight, section.prefix_running_weight) == (0.25, 16.0)


def test_a_busy_worker_keeps_its_conversation_until_its_queue_outweighs_the_hit():
    # p0 holds 480 tokens of the prompt but has 1200 tokens queued and 2 requests in flight; p1
    # holds only the shared preamble (80) and is idle
    p0, p1 = _load("p0", queued=1200, in_flight=2), _load("p1")
    hits = {"p0": 480, "p1": 80}
    default = PrefixAware()
    assert _rule(default, p0, 480) == 480 - 300 - 32 and _rule(default, p1, 80) == 80
    assert default.choose([p0, p1], hits) is p0
    myopic = PrefixAware(queue_weight=1.0)  # the TTFT-of-this-request weight sends it away
    assert _rule(myopic, p0, 480) < _rule(myopic, p1, 80)
    assert myopic.choose([p0, p1], hits) is p1
    # past 4 queued tokens per hit token of difference (plus 16 per request), p1 wins
    p0.num_queued_tokens = 4 * (480 - 80 - 32) + 4
    assert _rule(default, p0, 480) < 80 and default.choose([p0, p1], hits) is p1


@pytest.mark.parametrize("seed", range(5))
def test_the_choice_is_the_best_score_for_any_figures(seed):
    rng = random.Random(seed)
    policy = PrefixAware(queue_weight=rng.choice([0.0, 0.25, 1.0]), running_weight=rng.choice([0.0, 16.0]),
                         evict_aware=rng.choice([True, False]), evict_from=rng.choice([0.0, 0.5]))
    for _ in range(200):
        loads = [_load(f"w{i}", rng.randrange(0, 4000), rng.randrange(0, 5), pool=rng.choice([0, 3072]))
                 for i in range(3)]
        hits = {w.endpoint.worker_id: rng.choice([None, 0, 16 * rng.randrange(0, 40)]) for w in loads}
        chosen = policy.choose(loads, hits)
        best = max(_rule(policy, w, hits[w.endpoint.worker_id]) for w in loads)
        assert _rule(policy, chosen, hits[chosen.endpoint.worker_id]) == best


def test_degraded_counts_as_no_hit_and_ties_go_least_loaded():
    policy = PrefixAware()
    a, b = _load("a", in_flight=0, waiting=3), _load("b", in_flight=0, waiting=0)
    assert policy.choose([a, b], {"a": None, "b": 0}) is b  # equal scores: fewer waiting on the worker
    a.num_waiting = 0
    assert policy.choose([a, b], {"a": 64, "b": None}) is a  # a DEGRADED worker's hit is 0


def test_a_hit_counts_less_once_the_queue_ahead_takes_over_half_the_pool():
    # 192 blocks of 16 tokens: the work queued ahead evicts cached blocks before the prompt runs
    policy = PrefixAware()
    assert policy.surviving_hit(_load("a", queued=1536, pool=3072), 480) == 480  # half the pool: whole
    assert policy.surviving_hit(_load("a", queued=2304, pool=3072), 480) == 240  # 3/4: half of it
    assert policy.surviving_hit(_load("a", queued=4000, pool=3072), 480) == 0  # past the pool: nothing
    assert policy.surviving_hit(_load("a", queued=2304, pool=0), 480) == 480  # pool not known yet: whole
    assert PrefixAware(evict_aware=False).surviving_hit(_load("a", queued=2304, pool=3072), 480) == 480
    assert PrefixAware(evict_from=0.0).surviving_hit(_load("a", queued=1536, pool=3072), 480) == 240
    # p0 holds 720 tokens behind 2304 queued (3/4 of its pool); p1 holds the preamble and is idle
    p0, p1 = _load("p0", queued=2304, in_flight=1, pool=3072), _load("p1", pool=3072)
    hits = {"p0": 720, "p1": 80}
    assert _rule(policy, p0, 720) == 360 - 576 - 16 and policy.choose([p0, p1], hits) is p1
    whole = PrefixAware(evict_aware=False)  # counted whole, the hit keeps p0: 720 - 576 - 16 > 80
    assert whole.choose([p0, p1], hits) is p0
    with pytest.raises(ValueError, match="evict_from"):
        PrefixAware(evict_from=1.0)


def _pool(policy=None) -> WorkerPool:
    pool = WorkerPool(policy or PrefixAware())
    for wid in ("p0", "p1"):
        pool.add(WorkerEndpoint(wid, Role.PREFILL, f"http://{wid}"))
    return pool


def test_queued_prefill_tokens_leave_at_the_first_token_and_never_twice():
    pool = _pool()
    prompt = list(range(100))
    a = pool.acquire(Role.PREFILL, prompt, "r1")
    assert a.num_queued_tokens == 100 and a.num_in_flight == 1  # no index: nothing predicted cached
    b = pool.acquire(Role.PREFILL, prompt[:40], "r2")
    assert b is not a and b.num_queued_tokens == 40  # p0 has 100 queued: p1 is cheaper
    pool.prefilled(a, "r1")  # r1's prompt is computed; it still decodes (in flight)
    assert (a.num_queued_tokens, a.num_in_flight) == (0, 1)
    pool.prefilled(a, "r1")
    pool.release(a, "r1")  # its tokens were taken off once, at the first token
    assert (a.num_queued_tokens, a.num_in_flight) == (0, 0)
    pool.release(b, "r2")  # ended before its first token (an abort, a failure): taken off here
    assert (b.num_queued_tokens, b.num_in_flight, pool.num_leases()) == (0, 0, 0)


def test_two_leases_under_one_key_are_kept_apart():
    # a retry on the same worker, or callers without a request id: one release must not undo the other
    pool = _pool(RoundRobin())
    first = pool.acquire(Role.PREFILL, list(range(30)))
    pool.release(pool.acquire(Role.PREFILL, [1]))  # rotate: the next lease lands on p0 again
    second = pool.acquire(Role.PREFILL, list(range(50)))
    assert first is second and first.num_queued_tokens == 80 and pool.num_leases() == 2
    pool.prefilled(second)
    pool.release(second)
    pool.release(first)
    assert (first.num_queued_tokens, first.num_in_flight, pool.num_leases()) == (0, 0, 0)
    pool.release(first, "unknown")  # a release without a lease takes off nothing and never goes below 0
    assert (first.num_queued_tokens, first.num_in_flight) == (0, 0)


def _indexed_pool(pending_hits: bool) -> WorkerPool:
    index = KVIndex(BlockHasher(block_size=16, seed="route-test"))
    pool = WorkerPool(PrefixAware(pending_hits=pending_hits), index)
    for wid in ("p0", "p1"):
        pool.add(WorkerEndpoint(wid, Role.PREFILL, f"http://{wid}"))
        index.add_worker(wid)
    return pool


def test_a_burst_of_one_prefix_follows_the_first_prompt_while_it_is_computed():
    # four prompts share 480 tokens (a tenant's system prompt) and arrive at once; no cache holds it yet
    system = list(range(1, 481))
    prompts = [system + [1000 + i] * 40 for i in range(4)]
    pool = _indexed_pool(pending_hits=True)
    first = pool.acquire(Role.PREFILL, prompts[0], "r0")
    assert first.pending_blocks[pool.index.prompt_hashes(prompts[0])[0]] == 1
    # each later one expects 480 tokens computed ahead on `first`: 480 - 0.25 * queued - 16 * in flight
    # beats the idle worker's 0 while the queue stays under 4 x (480 - 16 x in flight) tokens
    chosen = [pool.acquire(Role.PREFILL, p, f"r{i}").endpoint.worker_id for i, p in enumerate(prompts[1:], 1)]
    assert chosen == [first.endpoint.worker_id] * 3
    # the first computes all 520 tokens; each later one only its 40 past the 480 that the first computes
    assert first.num_queued_tokens == 520 + 3 * 40
    for i in range(4):
        pool.prefilled(first, f"r{i}")
        pool.release(first, f"r{i}")
    assert not first.pending_blocks and first.num_queued_tokens == 0 and pool.num_leases() == 0
    # without the pending blocks the burst is spread by load: the system prompt is computed on both
    plain = _indexed_pool(pending_hits=False)
    assert len({plain.acquire(Role.PREFILL, p, f"r{i}").endpoint.worker_id for i, p in enumerate(prompts)}) == 2


def test_blocks_that_queued_prompts_touch_are_not_expected_to_be_evicted():
    policy = PrefixAware()
    busy = _load("p0", queued=4000, pool=3072)  # past its pool: an untouched hit is expected evicted
    assert policy.surviving_hit(busy, 480) == 0
    assert policy.surviving_hit(busy, 480, fresh=320) == 320  # what the queue computes or reuses stays
    assert policy.surviving_hit(busy, 480, fresh=999) == 480
