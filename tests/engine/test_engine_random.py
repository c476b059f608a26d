"""Randomised engine runs: adds, aborts, preemption, prefix sharing; pool invariants every step."""
import random

import pytest
from kvcache.audit import assert_all_free, check_invariants
from tests.helpers.engine_cases import MODELS, engine_config

from pd.engine.engine import Engine
from pd.engine.sample.params import SamplingParams


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_random_traffic_keeps_the_pool_consistent(name, seed):
    rng = random.Random(seed)
    eng = Engine(engine_config(MODELS[name], num_blocks=40, max_num_batched_tokens=48,
                               long_prefill_token_threshold=rng.choice([0, 16]), max_num_seqs=6))
    shared = [rng.randrange(256) for _ in range(24)]
    finished: dict[str, int] = {}
    live: set[str] = set()
    for step in range(150):
        if step < 100 and rng.random() < 0.4:
            rid = f"r{step}"
            prompt = (shared if rng.random() < 0.5 else []) + [rng.randrange(256) for _ in range(rng.randint(1, 40))]
            params = SamplingParams(max_tokens=rng.randint(1, 12), ignore_eos=True,
                                    temperature=rng.choice([0.0, 0.9]), seed=rng.randrange(100))
            eng.add_request(rid, prompt, params)
            live.add(rid)
        if live and rng.random() < 0.1:
            eng.abort_request(rng.choice(sorted(live)))
        for out in eng.step():
            if out.finished:
                finished[out.request_id] = finished.get(out.request_id, 0) + 1
                live.discard(out.request_id)
        check_invariants(eng.kv_cache_manager)
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                finished[out.request_id] = finished.get(out.request_id, 0) + 1
                live.discard(out.request_id)
    assert not live
    assert all(n == 1 for n in finished.values())  # exactly one final output per request
    assert eng.stats()["num_preemptions"] > 0
    assert_all_free(eng.kv_cache_manager)
