"""The burst split (`EngineConfig.step_overhead_tokens`, pd/engine/sched/admission.py): a wave of prompts
arriving together is admitted over a few steps, whole prompts each, about sqrt(T * overhead) tokens a step,
while every running decode still gets its token every step; the greedy tokens are those of the unsplit
schedule, and the pool ends all free."""
import math
import random

import pytest
from kvcache.audit import assert_all_free
from tests.helpers.engine_cases import MODELS, engine_config

from pd.engine.config import EngineConfig
from pd.engine.engine import Engine
from pd.engine.sample.params import SamplingParams
from pd.engine.sched.admission import admission_tokens


def _target(total: int, overhead: int) -> int:
    return math.ceil(math.sqrt(total * overhead))


def test_admission_tokens_rule():
    assert admission_tokens(1024, 0, [30] * 32) == 1024  # off: the whole budget
    assert admission_tokens(1024, 16, [900]) == 1024  # one prompt waiting: nothing to split
    assert admission_tokens(1024, 16, []) == 1024
    for total_each, n, overhead in ((24, 32, 16), (31, 8, 16), (7, 5, 3), (100, 2, 1)):
        got = admission_tokens(1024, overhead, [total_each] * n)
        assert got == min(1024, _target(total_each * n, overhead))
        assert (got - 1) ** 2 < total_each * n * overhead <= got ** 2  # the exact integer ceiling
    assert admission_tokens(50, 16, [400] * 10) == 50  # never above the budget
    assert admission_tokens(1024, 1 << 16, [3, 3]) >= 6  # a large overhead: the burst goes in one step
    iterator = iter([5, 5, 5])  # any iterable of the waiting requests' tokens, read once
    assert admission_tokens(1024, 4, iterator) == _target(15, 4)
    with pytest.raises(ValueError, match="step_overhead_tokens"):
        EngineConfig(step_overhead_tokens=-1)


def _wave(overhead: int, prompts: dict[str, list[int]], new_tokens: int):
    """Runs the wave; returns its tokens, each step's chunks (request id, start, tokens) and the engine."""
    eng = Engine(engine_config(MODELS["full"], max_num_batched_tokens=1024, max_num_seqs=64,
                               step_overhead_tokens=overhead))
    steps: list[list[tuple[str, int, int]]] = []
    waiting_before: list[list[int]] = []
    schedule = eng.scheduler.schedule

    def recorded():
        eng_waiting = [s.request.num_tokens - s.request.num_computed_tokens for s in eng.scheduler.waiting]
        out = schedule()
        waiting_before.append(eng_waiting)
        steps.append([(c.request_id, c.start, len(c.token_ids)) for c in out.chunks])
        return out

    eng.scheduler.schedule = recorded
    out = eng.generate_sync(prompts, SamplingParams(max_tokens=new_tokens, ignore_eos=True))
    assert_all_free(eng.kv_cache_manager)
    return out, steps, waiting_before, eng


@pytest.mark.parametrize("overhead", [4, 16])
def test_a_wave_is_admitted_whole_prompts_a_few_steps_apart(overhead):
    rng = random.Random(overhead)
    prompts = {f"p{i}": [rng.randrange(256) for _ in range(rng.randint(20, 30))] for i in range(32)}
    new_tokens = 6
    out, steps, waiting_before, _ = _wave(overhead, prompts, new_tokens)
    assert all(len(tokens) == new_tokens for tokens in out.values())
    first_step: dict[str, int] = {}
    for index, (chunks, waiting) in enumerate(zip(steps, waiting_before, strict=True)):
        new = [(rid, start, n) for rid, start, n in chunks if start == 0]
        for rid, _, n in new:
            assert n == len(prompts[rid]), "a prompt is admitted whole, never split by the burst rule"
            first_step[rid] = index
        admitted = sum(n for _, _, n in new)
        if new:  # whole prompts until the step's share is spent: at most one prompt beyond it
            share = admission_tokens(1024, overhead, waiting)
            assert admitted - new[-1][2] < share, (index, admitted, share)
        # every request whose prompt was computed before this step decodes in it: a burst starves no decode
        decoding = {rid for rid, s in first_step.items() if s < index and len(out[rid]) > index - s}
        assert decoding <= {rid for rid, start, _ in chunks if start > 0}, index
    assert sorted(first_step) == sorted(prompts)
    assert list(first_step) == sorted(prompts, key=lambda rid: int(rid[1:]))  # arrival order
    # the burst is spread: the first step holds a few prompts, the last of them starts within about
    # 2 * sqrt(T / overhead) steps (each step takes at least sqrt(T_left * overhead) of the T_left tokens left)
    total = sum(len(p) for p in prompts.values())
    assert 1 < sum(1 for s in first_step.values() if s == 0) < len(prompts)
    assert max(first_step.values()) <= math.ceil(2 * math.sqrt(total / overhead))


def test_split_off_admits_the_whole_wave_in_one_step_and_tokens_match():
    rng = random.Random(5)
    prompts = {f"p{i}": [rng.randrange(256) for _ in range(rng.randint(5, 40))] for i in range(20)}
    unsplit, steps_off, _, _ = _wave(0, prompts, 8)
    split, steps_on, _, _ = _wave(8, prompts, 8)
    assert {rid for rid, start, _ in steps_off[0] if start == 0} == set(prompts)  # one step, as before
    assert len({rid for rid, start, _ in steps_on[0]}) < len(prompts)
    assert split == unsplit  # greedy tokens do not depend on which step a prompt was admitted in


def test_a_single_long_prompt_is_not_split():
    prompt = [random.Random(1).randrange(256) for _ in range(300)]
    out, steps, _, eng = _wave(16, {"long": prompt}, 3)
    assert steps[0] == [("long", 0, 300)]
    assert len(out["long"]) == 3
    assert eng.stats()["num_steps"] == 3
