"""The batched device sampler (sample/batched.py) on the engine's own path, forced in a CPU engine
(`EngineConfig.device_sampler=True`; off the CPU it is the default): greedy tokens as the CPU sampler's,
seeded draws reproducible and independent of the batch, the tokenizer's vocabulary bound kept."""
from kvcache.audit import assert_all_free
from tests.helpers.engine_cases import engine_config, mixed_prompts

from pd.engine.engine import Engine
from pd.engine.model.config import ModelConfig
from pd.engine.sample.batched import BatchedSampler
from pd.engine.sample.params import SamplingParams

MODEL = ModelConfig(num_layers=2)


def _generate(prompts, params, **kw):
    eng = Engine(engine_config(MODEL, **kw))
    out = eng.generate_sync(prompts, params)
    assert_all_free(eng.kv_cache_manager)
    return eng, out


def test_device_sampler_in_a_cpu_engine_gives_the_greedy_tokens_of_the_cpu_sampler():
    prompts = mixed_prompts(6, hi=40)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    eng, got = _generate(prompts, params, device_sampler=True)
    assert isinstance(eng.runner.batched_sampler, BatchedSampler)
    cpu, want = _generate(prompts, params)
    assert cpu.runner.batched_sampler is None  # the CPU keeps sample/sampler.py by default
    assert got == want


def test_device_sampler_seeded_draws_depend_on_the_seed_only():
    prompts = mixed_prompts(5, hi=30, seed=4)
    params = SamplingParams(max_tokens=8, ignore_eos=True, temperature=1.2, top_k=40, top_p=0.95, seed=123)
    _, together = _generate(prompts, params, device_sampler=True)
    _, again = _generate(prompts, params, device_sampler=True)
    assert together == again
    one = next(iter(prompts))
    _, alone = _generate({one: prompts[one]}, params, device_sampler=True)
    assert alone[one] == together[one]  # its neighbours in the batch change nothing
    _, other_seed = _generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True, temperature=1.2, top_k=40,
                                                      top_p=0.95, seed=124), device_sampler=True)
    assert other_seed != together


def test_device_sampler_keeps_the_tokenizer_vocabulary_bound():
    prompts = mixed_prompts(4, hi=20, seed=2)
    params = SamplingParams(max_tokens=10, ignore_eos=True, temperature=5.0, seed=7)
    _, out = _generate(prompts, params, device_sampler=True, tokenizer_vocab_size=40)
    assert all(0 <= t < 40 for tokens in out.values() for t in tokens)
