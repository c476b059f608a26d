"""A step that raises fails only the request that caused it (real engine, real model, real pool):
the others finish with the tokens of an undisturbed run, the failed one ends with one error output,
its half-written blocks never serve as a prefix hit, and the pool is all free afterwards. A loop
that dies anyway says so (`dead`, `on_death`) and refuses new requests."""
from __future__ import annotations

import asyncio

import pytest
from tests.helpers.engine_cases import FULL_MODEL, engine_config, mixed_prompts

from kvcache.audit import assert_all_free, check_invariants
from pd.engine.engine import Engine
from pd.engine.outputs import FinishReason
from pd.engine.sample.params import SamplingParams

PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)


def run(engine: Engine, prompts: dict[str, list[int]]) -> tuple[dict[str, list[int]], dict[str, object]]:
    for rid, ids in prompts.items():
        engine.add_request(rid, ids, PARAMS)
    tokens: dict[str, list[int]] = {rid: [] for rid in prompts}
    last = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finished:
                assert out.request_id not in last, "two final outputs"
                last[out.request_id] = out
    return tokens, last


@pytest.mark.parametrize("victim_index", [0, 5, 11])
def test_failing_step_fails_only_its_request(victim_index):
    prompts = mixed_prompts(12, lo=5, hi=60, seed=3)
    want, _ = run(Engine(engine_config(FULL_MODEL)), prompts)
    engine = Engine(engine_config(FULL_MODEL))
    victim = f"req{victim_index}"
    engine.fault_marks.mark(victim, "step")
    got, last = run(engine, prompts)
    assert last[victim].finish_reason is FinishReason.ERROR
    assert "engine.step failed" in last[victim].error
    for rid in prompts:
        if rid != victim:
            assert last[rid].finish_reason is FinishReason.LENGTH and got[rid] == want[rid], rid
    check_invariants(engine.kv_cache_manager)
    assert_all_free(engine.kv_cache_manager)
    # the victim's prompt again, unmarked: served correctly (no stale prefix-cache hit on unwritten pages)
    again, _ = run(engine, {"again": prompts[victim]})
    assert again["again"] == want[victim]
    assert engine.stats()["num_errors"] == 1 and engine.dead is None
    assert_all_free(engine.kv_cache_manager)


def test_dead_loop_reports_and_refuses():
    engine = Engine(engine_config(FULL_MODEL))
    deaths: list[BaseException] = []
    engine.on_death = deaths.append

    async def main():
        engine.fault_marks.mark("bad", "loop")
        with pytest.raises(RuntimeError, match="engine stopped"):
            async for _ in engine.generate("bad", [1, 2, 3], PARAMS):
                pass
        with pytest.raises(RuntimeError, match="engine step loop died"):
            async for _ in engine.generate("later", [1, 2, 3], PARAMS):
                pass

    try:
        asyncio.run(main())
        assert engine.dead is not None and len(deaths) == 1 and deaths[0] is engine.dead
    finally:
        engine.shutdown()


def test_steps_failing_for_every_request_end_the_loop():
    """A broken engine (every forward raises: a device error, memory exhausted) must not fail request
    after request as if each were the cause: after MAX_FAILED_STEPS such steps in a row the step raises,
    which ends the loop, so the worker reports itself and is restarted."""
    from pd.engine.engine import MAX_FAILED_STEPS

    engine = Engine(engine_config(FULL_MODEL))

    def broken(chunks):
        raise RuntimeError("device lost")

    engine.runner.final_hidden = broken  # (the fault: the real model's forward, replaced by one that always fails)
    errors = []
    with pytest.raises(RuntimeError, match="in a row failed for every request"):
        for step in range(MAX_FAILED_STEPS):
            for i in range(2):
                engine.add_request(f"s{step}-{i}", [1, 2, 3, 4 + i], PARAMS)
            errors += [o for o in engine.step() if o.finished and o.finish_reason is FinishReason.ERROR]
    assert len(errors) == 2 * (MAX_FAILED_STEPS - 1)  # the steps before: each failed its requests cleanly
    for i in range(2):  # (the last step's requests: a restarted process would not have them either)
        engine.scheduler.abort_request(f"s{MAX_FAILED_STEPS - 1}-{i}")
    assert_all_free(engine.kv_cache_manager)
