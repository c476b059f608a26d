"""Engine API behaviour: aborts, stop conditions, sampling, admission policies, async generate, stats."""
import asyncio
import dataclasses

import pytest
from kvcache import RequestStatus
from kvcache.audit import assert_all_free
from tests.helpers.engine_cases import FULL_MODEL, HYBRID_MODEL, engine_config, mixed_prompts

from pd.engine.engine import Engine
from pd.engine.sample.params import SamplingParams

GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)
PROMPTS = mixed_prompts(8, 5, 60, seed=3)


def drain(eng: Engine) -> dict[str, list]:
    """Step until idle; every request's outputs in order."""
    outs: dict[str, list] = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            outs.setdefault(o.request_id, []).append(o)
    return outs


def test_abort_waiting_prefilling_decoding_and_unknown():
    eng = Engine(engine_config(FULL_MODEL, long_prefill_token_threshold=8, max_num_batched_tokens=64))
    long_prompt = list(range(100))
    eng.add_request("waiting", [1, 2, 3], GREEDY)
    eng.abort_request("waiting")  # before it was ever scheduled
    eng.add_request("prefill", long_prompt, GREEDY)
    eng.add_request("decode", [4, 5, 6], SamplingParams(max_tokens=50, ignore_eos=True))
    eng.add_request("keep", [7, 8, 9], GREEDY)
    first = eng.step()
    assert {o.request_id for o in first if o.finished} == {"waiting"}
    seen = list(first)
    req = eng.scheduler.requests["prefill"].request
    assert 0 < req.num_computed_tokens < len(long_prompt)  # mid chunked prefill
    seen += eng.step()
    eng.abort_request("prefill")
    seen += eng.step()
    assert [o.finish_reason for o in seen if o.request_id == "prefill"] == ["abort"]
    eng.abort_request("decode")
    eng.abort_request("no-such-request")
    outs = drain(eng)
    for o in reversed(seen):
        outs.setdefault(o.request_id, []).insert(0, o)
    assert outs["decode"][-1].finish_reason == "abort" and outs["decode"][-1].finished
    assert outs["keep"][-1].finish_reason == "length"
    assert sum(len(o.new_token_ids) for o in outs["keep"]) == GREEDY.max_tokens
    eng.abort_request("keep")  # already finished: no-op
    assert eng.step() == []
    assert_all_free(eng.kv_cache_manager)


def test_stop_token_eos_and_max_model_len():
    base = Engine(engine_config(FULL_MODEL)).generate_sync({"a": PROMPTS["req0"]}, GREEDY)["a"]
    stop_tok = base[4]
    eng = Engine(engine_config(FULL_MODEL))
    eng.add_request("stop", PROMPTS["req0"], SamplingParams(max_tokens=10, stop_token_ids=(stop_tok,), ignore_eos=True))
    outs = drain(eng)["stop"]
    toks = [t for o in outs for t in o.new_token_ids]
    assert toks == base[: base.index(stop_tok) + 1] and outs[-1].finish_reason == "stop"
    assert_all_free(eng.kv_cache_manager)

    eos_model = dataclasses.replace(FULL_MODEL, eos_token_id=stop_tok)
    eng = Engine(engine_config(eos_model))
    eng.add_request("eos", PROMPTS["req0"], SamplingParams(max_tokens=10))
    eng.add_request("ignore", PROMPTS["req0"], SamplingParams(max_tokens=10, ignore_eos=True))
    outs = drain(eng)
    assert outs["eos"][-1].finish_reason == "stop" and outs["eos"][-1].new_token_ids == [stop_tok]
    assert [t for o in outs["ignore"] for t in o.new_token_ids] == base
    assert_all_free(eng.kv_cache_manager)

    n = len(PROMPTS["req0"])
    eng = Engine(engine_config(FULL_MODEL, max_model_len=n + 3))
    eng.add_request("capped", PROMPTS["req0"], GREEDY)
    outs = drain(eng)["capped"]
    assert [t for o in outs for t in o.new_token_ids] == base[:3] and outs[-1].finish_reason == "length"
    assert_all_free(eng.kv_cache_manager)


@pytest.mark.parametrize("model", [FULL_MODEL, HYBRID_MODEL], ids=["full", "hybrid"])
def test_request_that_can_never_fit_the_pool_is_refused(model):
    # 12 blocks of 4 tokens (block 0 is the null block): 11 usable
    eng = Engine(engine_config(model, num_blocks=12 * (2 if model is HYBRID_MODEL else 1)))
    with pytest.raises(ValueError, match="KV blocks"):
        eng.add_request("huge", list(range(3, 200)), SamplingParams(max_tokens=200, ignore_eos=True))
    eng.add_request("fits", list(range(3, 20)), SamplingParams(max_tokens=8, ignore_eos=True))
    out = drain(eng)
    assert set(out) == {"fits"} and len(out["fits"]) == 8
    assert_all_free(eng.kv_cache_manager)


def test_bad_requests_are_rejected_without_side_effects():
    eng = Engine(engine_config(FULL_MODEL, max_model_len=32))
    eng.add_request("x", [1, 2], GREEDY)
    with pytest.raises(ValueError, match="already in use"):
        eng.add_request("x", [1, 2], GREEDY)
    with pytest.raises(ValueError, match="max_model_len"):
        eng.add_request("long", list(range(40)), GREEDY)
    with pytest.raises(ValueError, match="outside"):
        eng.add_request("bad", [10_000], GREEDY)
    out = drain(eng)
    assert set(out) == {"x"}
    # text prompts go through the byte tokenizer
    eng.add_request("text", "hello", GREEDY)
    assert set(drain(eng)) == {"text"}
    assert_all_free(eng.kv_cache_manager)


@pytest.mark.parametrize("model", [FULL_MODEL, HYBRID_MODEL], ids=["full", "hybrid"])
def test_seeded_sampling_does_not_depend_on_the_batch(model):
    params = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, top_k=40, seed=1234)
    alone = Engine(engine_config(model)).generate_sync({"s": PROMPTS["req1"]}, params)["s"]
    eng = Engine(engine_config(model))
    eng.add_request("s", PROMPTS["req1"], params)
    for rid, prompt in PROMPTS.items():
        eng.add_request(rid, prompt, SamplingParams(max_tokens=8, temperature=1.0))
    outs = drain(eng)
    assert [t for o in outs["s"] for t in o.new_token_ids] == alone
    assert_all_free(eng.kv_cache_manager)


def test_max_num_seqs_limits_running():
    eng = Engine(engine_config(FULL_MODEL, max_num_seqs=3))
    for rid, prompt in PROMPTS.items():
        eng.add_request(rid, prompt, GREEDY)
    peak = 0
    while eng.has_unfinished_requests():
        eng.step()
        peak = max(peak, eng.stats()["num_running"])
    assert peak == 3
    assert_all_free(eng.kv_cache_manager)


def test_full_sequence_must_fit_gates_admission():
    prompts = {"a": list(range(60)), "b": list(range(100, 160))}
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    results = {}
    for strict in (False, True):
        # 25 usable blocks of 4 tokens; step 1: "a" takes 60 tokens (15 blocks), 8 tokens of budget remain.
        eng = Engine(engine_config(FULL_MODEL, num_blocks=26, max_num_batched_tokens=68, full_sequence_must_fit=strict))
        for rid, p in prompts.items():
            eng.add_request(rid, p, params)
        eng.step()
        # loose: "b" starts its first chunk (2 blocks); strict: its 15 blocks do not fit in the 10 free ones
        expected = RequestStatus.WAITING if strict else RequestStatus.RUNNING
        assert eng.scheduler.requests["b"].request.status == expected
        results[strict] = {r: [t for o in v for t in o.new_token_ids] for r, v in drain(eng).items()}
        assert_all_free(eng.kv_cache_manager)
    assert results[True]["b"] == results[False]["b"]


def test_watermark_blocks_admission_only_when_something_runs():
    # 40 usable blocks, watermark 50%: a 60-token prompt (15 blocks) + 20 reserve > 40 - 15 free for the second
    eng = Engine(engine_config(FULL_MODEL, num_blocks=41, watermark=0.5))
    eng.add_request("a", list(range(60)), SamplingParams(max_tokens=3, ignore_eos=True))
    eng.add_request("b", list(range(100, 160)), SamplingParams(max_tokens=3, ignore_eos=True))
    eng.step()
    assert eng.scheduler.requests["a"].request.status == RequestStatus.RUNNING
    assert eng.scheduler.requests["b"].request.status == RequestStatus.WAITING
    outs = drain(eng)
    assert outs["b"][-1].finish_reason == "length"
    assert_all_free(eng.kv_cache_manager)


def test_async_generate_keeps_event_loop_free():
    eng = Engine(engine_config(HYBRID_MODEL))
    ticks = 0

    async def ticker(stop: asyncio.Event):
        nonlocal ticks
        while not stop.is_set():
            ticks += 1
            await asyncio.sleep(0)

    async def one(rid, prompt):
        toks, last = [], None
        async for out in eng.generate(rid, prompt, GREEDY):
            toks += out.new_token_ids
            last = out
        return toks, last

    async def main():
        stop = asyncio.Event()
        tick_task = asyncio.create_task(ticker(stop))
        results = await asyncio.gather(*(one(rid, p) for rid, p in PROMPTS.items()))
        # a consumer that walks away early aborts its request
        agen = eng.generate("early", [1, 2, 3], SamplingParams(max_tokens=10_000, ignore_eos=True))
        async for _ in agen:
            break
        await agen.aclose()
        stop.set()
        await tick_task
        return results

    try:
        results = asyncio.run(main())
        for _ in range(200):  # the loop thread applies the abort on its next step
            if not eng.has_unfinished_requests():
                break
            asyncio.run(asyncio.sleep(0.01))
    finally:
        eng.shutdown()
    assert ticks > 0
    for toks, last in results:
        assert len(toks) == GREEDY.max_tokens and last.finished and last.finish_reason == "length"
    sync = Engine(engine_config(HYBRID_MODEL)).generate_sync(PROMPTS, GREEDY)
    assert [r[0] for r in results] == [sync[rid] for rid in PROMPTS]
    assert not eng.has_unfinished_requests()
    assert_all_free(eng.kv_cache_manager)


def test_stats_report_engine_state():
    eng = Engine(engine_config(FULL_MODEL))
    for rid, prompt in PROMPTS.items():
        eng.add_request(rid, prompt, GREEDY)
    eng.step()
    s = eng.stats()
    assert s["num_running"] + s["num_waiting"] == len(PROMPTS)
    assert 0 < s["kv_cache_usage"] <= 1
    for key in ("prefix_cache_hit_rate", "num_preemptions", "num_free_blocks", "num_waiting_for_remote_kvs"):
        assert key in s
    drain(eng)
    assert eng.stats()["kv_cache_usage"] == 0
    assert_all_free(eng.kv_cache_manager)


def test_shutdown_unblocks_generate():
    eng = Engine(engine_config(FULL_MODEL, max_model_len=2000))

    async def main():
        agen = eng.generate("r", [1, 2, 3], SamplingParams(max_tokens=1990, ignore_eos=True))
        await agen.__anext__()
        await asyncio.get_running_loop().run_in_executor(None, eng.shutdown)
        with pytest.raises(RuntimeError, match="shut down"):
            async for _ in agen:
                pass

    asyncio.run(main())
    eng.step()  # applies the abort that generate() queued on its way out
    assert not eng.has_unfinished_requests()
    assert_all_free(eng.kv_cache_manager)


def test_timing_counts_the_batch_a_prompt_shared():
    """The first token's timing says what the request computed and what other requests' tokens
    shared its steps (the planner fits per-token costs from both)."""
    eng = Engine(engine_config(FULL_MODEL, max_num_batched_tokens=64))
    eng.add_request("alone", list(range(1, 11)), SamplingParams(max_tokens=40, ignore_eos=True))
    first = eng.step()
    timing = first[0].timing
    assert timing is not None and timing.num_computed_tokens == 10 and timing.num_batched_tokens == 0
    assert timing.compute_s > 0 and timing.load_s == 0
    # "alone" now decodes one token per step beside the 150-token prompt: 63 + 63 + 24 tokens over 3 steps.
    eng.add_request("long", list(range(100, 250)), GREEDY)  # (no prefix shared with the others)
    timings = {}
    for _ in range(3):
        for o in eng.step():
            if o.timing is not None:
                timings[o.request_id] = o.timing
            assert o.request_id != "alone" or o.timing is None  # the timing comes once, on the first token
    assert timings["long"].num_computed_tokens == 150 and timings["long"].num_batched_tokens == 3
    # Two prompts admitted in one step share it: each counts the other's tokens and the decode's.
    eng.add_request("a", [7] * 20, GREEDY)
    eng.add_request("b", [9] * 30, GREEDY)
    got = {o.request_id: o.timing for o in eng.step() if o.timing is not None}
    assert got["a"].num_batched_tokens == 30 + 2 and got["b"].num_batched_tokens == 20 + 2  # "alone", "long"
    drain(eng)
    assert_all_free(eng.kv_cache_manager)


def test_timing_restarts_when_the_computed_prompt_is_dropped():
    """A preempted request (or a failed load recomputed) reports the compute of its last attempt only:
    its batch count starts again and its compute time runs from the re-admission."""
    import time

    from pd.engine.sched.request_state import RequestState

    state = RequestState(request=None, params=GREEDY)
    state.admitted_s = time.perf_counter()
    state.num_batched_tokens = 50
    time.sleep(0.05)
    state.restart_compute()
    assert state.num_batched_tokens == 0
    time.sleep(0.05)  # back in the queue: no compute of its prompt either
    t_admit = time.perf_counter()
    state.mark_admitted()
    state.num_batched_tokens += 7
    timing = state.take_timing(num_prompt_tokens=30)
    t_end = time.perf_counter()
    assert timing is not None and timing.num_batched_tokens == 7 and timing.num_computed_tokens == 30
    # counted from the last admission only (from the first it would be >= 0.1 s), whatever the machine's pace
    assert timing.compute_s <= t_end - t_admit and time.perf_counter() - state.admitted_s >= 0.1
    state.restart_compute()  # after the first token: nothing to restart
    assert state.num_batched_tokens == 7
