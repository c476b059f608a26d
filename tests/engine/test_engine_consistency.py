"""Greedy outputs are the same tokens in every scheduling situation, and equal to a dense reference."""
import pytest
import torch
from kvcache.audit import assert_all_free

from pd.engine.engine import Engine
from pd.engine.sample.params import SamplingParams

from tests.helpers.engine_cases import MODELS, engine_config, mixed_prompts

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)
PROMPTS = mixed_prompts(32)


def dense_greedy(engine: Engine, prompt: list[int], n: int) -> list[int]:
    """Greedy decode with the plain non-paged forward (re-runs the whole sequence each token)."""
    model = engine.runner.model
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(torch.argmax(model.reference_logits(seq)[-1])))
    return seq[len(prompt):]


def run(config, prompts, params=GREEDY) -> tuple[dict[str, list[int]], Engine]:
    eng = Engine(config)
    out = eng.generate_sync(prompts, params)
    assert_all_free(eng.kv_cache_manager)
    return out, eng


@pytest.fixture(scope="module")
def alone_outputs():
    """Each request alone in a fresh engine, per model."""
    cache = {}
    for name, model in MODELS.items():
        outs = {}
        for rid, prompt in PROMPTS.items():
            eng = Engine(engine_config(model))
            outs.update(eng.generate_sync({rid: prompt}, GREEDY))
            assert_all_free(eng.kv_cache_manager)
        cache[model] = outs
    return cache


def test_alone_matches_dense_reference(model_config, alone_outputs):
    eng = Engine(engine_config(model_config))
    for rid in list(PROMPTS)[:6]:
        assert alone_outputs[model_config][rid] == dense_greedy(eng, PROMPTS[rid], GREEDY.max_tokens), rid


def test_batch_of_32_mixed_lengths(model_config, alone_outputs):
    out, eng = run(engine_config(model_config), PROMPTS)
    assert out == alone_outputs[model_config]
    assert eng.stats()["num_steps"] < 32 * GREEDY.max_tokens  # really batched


def test_chunked_prefill_at_64(model_config, alone_outputs):
    out, eng = run(engine_config(model_config, long_prefill_token_threshold=64, max_num_batched_tokens=256), PROMPTS)
    assert out == alone_outputs[model_config]


def test_token_budget_smaller_than_prompts(model_config, alone_outputs):
    out, _ = run(engine_config(model_config, max_num_batched_tokens=64, max_num_seqs=8), PROMPTS)
    assert out == alone_outputs[model_config]


def test_prefix_cache_hit(model_config, alone_outputs):
    eng = Engine(engine_config(model_config))
    rids = [r for r in PROMPTS if len(PROMPTS[r]) > 20][:8]
    first = eng.generate_sync({rid: PROMPTS[rid] for rid in rids}, GREEDY)
    again = eng.generate_sync({rid + "-again": PROMPTS[rid] for rid in rids}, GREEDY)
    stats = eng.stats()
    assert stats["prefix_cache_hits"] > 0 and stats["prefix_cache_hit_rate"] > 0.3
    for rid in rids:
        assert first[rid] == again[rid + "-again"] == alone_outputs[model_config][rid]
    # a new request sharing a long prefix with a finished one, plus its own suffix
    shared = PROMPTS[rids[0]] + [7, 8, 9]
    hits_before = eng.stats()["prefix_cache_hits"]
    got = eng.generate_sync({"suffix": shared}, GREEDY)["suffix"]
    assert eng.stats()["prefix_cache_hits"] > hits_before
    fresh, _ = run(engine_config(model_config), {"suffix": shared})
    assert got == fresh["suffix"]
    assert_all_free(eng.kv_cache_manager)


def test_preemption_and_resume(model_config, alone_outputs):
    out, eng = run(engine_config(model_config, num_blocks=90, max_num_batched_tokens=256), PROMPTS)
    assert eng.stats()["num_preemptions"] > 0
    assert out == alone_outputs[model_config]


def test_preemption_without_prefix_caching(model_config, alone_outputs):
    out, eng = run(engine_config(model_config, num_blocks=90, enable_prefix_caching=False), PROMPTS)
    assert eng.stats()["num_preemptions"] > 0
    assert out == alone_outputs[model_config]
