"""pd.tools.engine_wave: the served workload fed straight to the engine (the in-process rate
the peer bench holds served figures against), on the tiny model of deploy/local.yaml."""
import asyncio
from pathlib import Path

import torch

from kvcache.audit import assert_all_free
from pd.tools.engine_wave import engine_for, run_waves, wave_questions

LOCAL = str(Path(__file__).resolve().parents[2] / "deploy" / "local.yaml")


def test_questions_never_repeat_within_or_across_waves():
    seen = [q for wave in range(4) for q in wave_questions(32, wave)]
    assert len(seen) == len(set(seen)) == 128


def test_waves_run_every_token_and_free_the_pool():
    threads = torch.get_num_threads()  # engine_for sets the process's count: the suite's other tests keep theirs
    eng = engine_for(LOCAL)  # a disaggregated config: built as a colocated worker of it
    try:
        figures = asyncio.run(run_waves(eng, [1, 3], new_tokens=5, num_waves=1))
        assert [(f.concurrency, f.num_tokens) for f in figures] == [(1, 5), (3, 15)]
        assert all(f.tokens_per_s > 0 and f.ttft_p50_s > 0 and f.cpu_ms_per_token > 0 for f in figures)
        assert eng.num_threads == 1  # local.yaml: cpus_per_worker 0.25, threads_per_worker unset
        assert not eng.has_unfinished_requests()
        assert_all_free(eng.kv_cache_manager)
    finally:
        eng.shutdown()
        torch.set_num_threads(threads)


def test_settings_side_by_side_each_get_their_waves_and_the_config_comes_back():
    threads = torch.get_num_threads()
    eng = engine_for(LOCAL)
    base = eng.scheduler.config
    seen = []
    schedule = eng.scheduler.schedule

    def recorded():
        seen.append(eng.scheduler.config.step_overhead_tokens)
        return schedule()

    eng.scheduler.schedule = recorded
    try:
        figures = asyncio.run(run_waves(eng, [4], new_tokens=3, num_waves=2, step_overheads=[0, 8]))
        assert [(f.concurrency, f.step_overhead_tokens, f.num_tokens) for f in figures] == [(4, 0, 12), (4, 8, 12)]
        assert all(f.ttft_cpu_p50_s > 0 and f.ttft_p50_s > 0 for f in figures)
        assert set(seen) == {0, 8}  # the steps really ran under each setting
        assert eng.scheduler.config == base
        assert_all_free(eng.kv_cache_manager)
    finally:
        eng.shutdown()
        torch.set_num_threads(threads)
