"""The decode step's host fast paths give what the plain ones gave: chunks and outputs built in one pass
equal the constructors' values, a running request's reused block ids equal the KV cache manager's at every
step (through preemption, sliding windows and prefix hits), and the stop rule precomputed per request
ends requests exactly where max_tokens, the model length, EOS and stop ids say."""
import dataclasses
import random

import pytest
from kvcache.audit import assert_all_free
from tests.helpers.engine_cases import MODELS, engine_config

from pd.engine.engine import Engine
from pd.engine.outputs import FinishReason, RequestOutput, RequestTiming
from pd.engine.sample.params import SamplingParams
from pd.engine.sched.output import ScheduledChunk


def test_one_pass_values_equal_the_constructors():
    chunk = ScheduledChunk.of("r1", [5, 6], 10, ([1, 2], [3]), True)
    assert chunk == ScheduledChunk("r1", [5, 6], 10, ([1, 2], [3]), True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        chunk.start = 3  # type: ignore[misc]
    timing = RequestTiming(0.1, 0.0, 0.2, 7, 0, 0)
    out = RequestOutput.step_tokens("r1", [9], 4, timing)
    assert out == RequestOutput("r1", [9], num_cached_tokens=4, timing=timing)
    assert list(vars(out)) == [f.name for f in dataclasses.fields(RequestOutput)]  # every field, none more
    assert dataclasses.asdict(RequestOutput.step_tokens("r2", [1])) == dataclasses.asdict(RequestOutput("r2", [1]))
    with pytest.raises(dataclasses.FrozenInstanceError):
        out.finished = True  # type: ignore[misc]


@pytest.mark.parametrize("caching", [True, False], ids=["prefix-cache", "no-prefix-cache"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_reused_block_ids_match_the_manager_every_step(name, caching):
    eng = Engine(engine_config(MODELS[name], num_blocks=60, max_num_batched_tokens=64, max_num_seqs=8,
                               enable_prefix_caching=caching))
    sched, mgr = eng.scheduler, eng.kv_cache_manager
    schedule = sched.schedule
    checked = []

    def checked_schedule():
        out = schedule()
        for chunk in out.chunks:  # (before the forward: what the runner writes the step's slots from)
            assert chunk.block_ids == mgr.get_block_ids(chunk.request_id), chunk.request_id
        checked.append(len(out.chunks))
        return out

    sched.schedule = checked_schedule
    rng = random.Random(3)
    shared = [rng.randrange(256) for _ in range(20)]
    prompts = {f"r{i}": (shared if i % 2 else []) + [rng.randrange(256) for _ in range(rng.randint(1, 30))]
               for i in range(16)}
    out = eng.generate_sync(prompts, SamplingParams(max_tokens=40, ignore_eos=True))
    assert all(len(tokens) == 40 for tokens in out.values())
    assert eng.stats()["num_preemptions"] > 0  # the pool was too small: requests were dropped and re-admitted
    assert sum(checked) > 16 * 40
    assert_all_free(mgr)


def test_stop_rule():
    model = MODELS["full"]
    eng = Engine(engine_config(model, max_model_len=40))
    prompt = [3, 1, 4, 1, 5]
    free_run = eng.generate_sync({"free": prompt}, SamplingParams(max_tokens=30, ignore_eos=True))["free"]
    assert len(free_run) == 30
    stop_at = 6
    stop_id = free_run[stop_at]
    first = free_run.index(stop_id)  # the first time it is sampled ends the request
    finals: dict[str, RequestOutput] = {}
    tokens: dict[str, list[int]] = {}
    cases = {"max-tokens": SamplingParams(max_tokens=7, ignore_eos=True),
             "model-length": SamplingParams(max_tokens=100, ignore_eos=True),
             "stop-id": SamplingParams(max_tokens=30, ignore_eos=True, stop_token_ids=(stop_id,))}
    for rid, params in cases.items():
        eng.add_request(rid, prompt, params)
    while eng.has_unfinished_requests():
        for out in eng.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                assert out.request_id not in finals
                finals[out.request_id] = out
    assert tokens["max-tokens"] == free_run[:7] and finals["max-tokens"].finish_reason == FinishReason.LENGTH
    # the model length (40) counts the prompt's 5 tokens
    assert len(tokens["model-length"]) == 35 and finals["model-length"].finish_reason == FinishReason.LENGTH
    assert tokens["stop-id"] == free_run[:first + 1] and finals["stop-id"].finish_reason == FinishReason.STOP
    eos_eng = Engine(engine_config(dataclasses.replace(model, eos_token_id=stop_id), max_model_len=40))
    got = eos_eng.generate_sync({"eos": prompt}, SamplingParams(max_tokens=30))["eos"]
    assert got == free_run[:first + 1]  # EOS ends it, unless ignore_eos
    assert eos_eng.generate_sync({"eos2": prompt}, SamplingParams(max_tokens=30, ignore_eos=True))["eos2"] == free_run
    assert_all_free(eng.kv_cache_manager)
    assert_all_free(eos_eng.kv_cache_manager)
