"""Ids at or above `EngineConfig.tokenizer_vocab_size` (a padded embedding's extra rows) are never
sampled: not by the sampler in any mode, not by the CPU backend's int8-screened greedy head, not by
the engine on either attention backend, even where the padded ids hold the largest logits."""
import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kvcache.audit import assert_all_free
from tests.helpers.engine_cases import FULL_MODEL, engine_config, mixed_prompts

from pd.engine.cpu import kernels as cpu_kernels
from pd.engine.cpu.greedy_head import GreedyHead
from pd.engine.cpu.packed_linear import PackedLinear, num_panels, pack_into
from pd.engine.engine import Engine
from pd.engine.model.llama import build_model
from pd.engine.sample.params import SamplingParams
from pd.engine.sample.sampler import make_generator, sample

MODES = {
    "greedy": SamplingParams(),
    "temperature": SamplingParams(temperature=1.0, seed=1),
    "top_k": SamplingParams(temperature=0.7, top_k=3, seed=2),
    "top_p": SamplingParams(temperature=1.3, top_p=0.8, seed=3),
}


@settings(max_examples=60, deadline=None)
@given(num_ids=st.integers(1, 40), num_padded=st.integers(1, 24), rows=st.integers(1, 4),
       lead=st.floats(0.0, 1e4), seed=st.integers(0, 2 ** 31 - 1), mode=st.sampled_from(sorted(MODES)))
def test_the_sampler_never_draws_a_padded_id(num_ids, num_padded, rows, lead, seed, mode):
    """Logits whose padded ids hold the row's maximum (by `lead`, up to 1e4 above): every token is a
    real id; greedy takes the argmax of the real ids (the lowest on a tie)."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, num_ids + num_padded, generator=gen) * 3
    logits[:, num_ids:] = logits.max() + lead + torch.rand(rows, num_padded, generator=gen)
    params = [MODES[mode]] * rows
    tokens = sample(logits, params, [make_generator(p) for p in params], num_ids)
    assert all(0 <= t < num_ids for t in tokens), tokens
    if mode == "greedy":
        assert tokens == torch.argmax(logits[:, :num_ids], dim=-1).tolist()
    unmasked = sample(logits, params, [make_generator(p) for p in params])
    assert mode != "greedy" or all(t >= num_ids for t in unmasked)  # (what the bound prevents)


needs_screen = pytest.mark.skipif(cpu_kernels.load() is None or not cpu_kernels.load().packed_gemm_available(),
                                  reason="the int8 screen needs the C++ kernels with the packed GEMM (AVX2 + FMA)")


@needs_screen
@settings(max_examples=25, deadline=None)
@given(num_ids=st.integers(1, 70), num_padded=st.integers(1, 40), seed=st.integers(0, 2 ** 31 - 1))
def test_the_greedy_head_never_picks_a_padded_id(num_ids, num_padded, seed):
    """The screened argmax over ids [0, num_ids), padded rows aligned with the hidden state so their
    logits lead every real one: the exact float32 argmax of the real ids."""
    gen = torch.Generator().manual_seed(seed)
    k = 48
    weight = torch.randn(num_ids + num_padded, k, generator=gen) * 0.1
    hidden = torch.randn(3, k, generator=gen)
    direction = hidden.sum(0)
    real = weight[:num_ids] @ hidden.T
    for j in range(num_ids, num_ids + num_padded):  # logit >= every real logit + 1 on every row
        weight[j] = direction / direction.norm() * (float(real.abs().max()) + 1 + j) * 10 / hidden.norm(dim=1).min()
    n = weight.shape[0]
    linear = PackedLinear(pack_into(weight, torch.empty(num_panels(n), k, 16)), k, n, None)
    head = GreedyHead(linear)
    full = hidden @ weight.T
    assert (full[:, num_ids:].max(dim=1).values > full[:, :num_ids].max(dim=1).values).all()
    want = torch.argmax(linear(hidden)[:, :num_ids], dim=-1).tolist()
    assert head.tokens(hidden, num_ids) == want
    assert all(t is not None and t >= num_ids for t in head.tokens(hidden))  # unbounded: a padded id wins


def _padded_lead_model(cfg, seed, device, num_ids):
    """A model whose padded ids (from `num_ids` on) hold the largest logit of every row: they are
    +-1000 times copies of real rows of the lm_head, so one of them scores 1000 max |real logit|."""
    model = build_model(cfg, seed=seed, device=device)
    with torch.no_grad():
        head = model.lm_head.weight
        for j in range(num_ids, cfg.vocab_size):
            i = (j - num_ids) // 2
            head[j] = head[i] * (1000.0 if (j - num_ids) % 2 == 0 else -1000.0)
    return model


@pytest.mark.parametrize("backend", ["torch", "fused"])
def test_the_engine_never_emits_a_padded_id(backend, monkeypatch):
    if backend == "fused" and cpu_kernels.load() is None:
        pytest.skip("the C++ kernels cannot be built here")
    num_ids = FULL_MODEL.vocab_size - 20
    monkeypatch.setattr("pd.engine.runner.compute.build_model",
                        lambda cfg, seed, device: _padded_lead_model(cfg, seed, device, num_ids))
    prompts = mixed_prompts(n=6, lo=2, hi=30, seed=4)
    for mode, params in MODES.items():
        params = dataclasses.replace(params, max_tokens=6, ignore_eos=True)
        eng = Engine(engine_config(FULL_MODEL, attention_backend=backend, tokenizer_vocab_size=num_ids))
        out = eng.generate_sync({f"{mode}-{r}": p for r, p in prompts.items()}, params)
        assert all(0 <= t < num_ids for tokens in out.values() for t in tokens), (mode, out)
        assert all(len(tokens) == 6 for tokens in out.values())
        assert_all_free(eng.kv_cache_manager)
    unbounded = Engine(engine_config(FULL_MODEL, attention_backend=backend))
    out = unbounded.generate_sync(prompts, SamplingParams(max_tokens=3, ignore_eos=True))
    assert all(t >= num_ids for tokens in out.values() for t in tokens)  # the model as built: padded ids lead
