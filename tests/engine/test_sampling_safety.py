"""The sampler cannot fail: over the whole range the wire model (`pd.cluster.messages.Sampling`)
accepts for every sampling field, extremes included (1e-300, 1e-320, the smallest subnormal, 0,
the maxima, top_k past the vocabulary), with and without seeds, on real torch logits (nan and inf
included), `sample` returns a valid token id for every row and never raises; settings equivalent
to greedy give the argmax, and a seed fixes the draws whatever shares the batch.

The ranges are read from the pydantic model's own constraints, so a widened range is covered here
the day it is widened. A real engine then runs the issue's poisoned requests to the end.
"""
from __future__ import annotations

import annotated_types
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tests.helpers.engine_cases import FULL_MODEL, engine_config

from kvcache.audit import assert_all_free
from pd.cluster.messages import Sampling
from pd.engine.engine import Engine
from pd.engine.sample.params import MIN_TEMPERATURE, SamplingParams
from pd.engine.sample.sampler import sample, make_generator

TINY = [1e-320, 5e-324, 1e-300, 1e-45, 1e-38, 1e-10, MIN_TEMPERATURE / 2, MIN_TEMPERATURE]


def _bounds(name: str) -> tuple[float, float, bool]:
    """(low, high, low is exclusive) of a Sampling field, from its pydantic constraints."""
    low, high, exclusive = None, None, False
    for c in Sampling.model_fields[name].metadata:
        if isinstance(c, annotated_types.Ge):
            low = c.ge
        elif isinstance(c, annotated_types.Gt):
            low, exclusive = c.gt, True
        elif isinstance(c, annotated_types.Le):
            high = c.le
        elif isinstance(c, annotated_types.Lt):
            high = c.lt - 1  # ints only (seed)
    assert low is not None and high is not None, name
    return low, high, exclusive


def _float_field(name: str) -> st.SearchStrategy[float]:
    low, high, exclusive = _bounds(name)
    edges = [v for v in [low, high, *TINY, 0.5, 1.0, 2.0] if (v > low if exclusive else v >= low) and v <= high]
    return st.one_of(st.sampled_from(edges),
                     st.floats(low, high, exclude_min=exclusive, allow_nan=False, allow_subnormal=True))


def _int_field(name: str) -> st.SearchStrategy[int]:
    low, high, _ = _bounds(name)
    return st.one_of(st.sampled_from([low, high, 0, 1, 2, 5]).filter(lambda v: low <= v <= high),
                     st.integers(int(low), int(high)))


sampling_fields = st.fixed_dictionaries({
    "temperature": _float_field("temperature"),
    "top_p": _float_field("top_p"),
    "top_k": _int_field("top_k"),
    "seed": st.none() | _int_field("seed"),
})


@st.composite
def logits_rows(draw) -> torch.Tensor:
    """(rows, vocab) float32 logits: normal noise at any scale, sometimes ties, nan or infs."""
    num_rows = draw(st.integers(1, 4))
    vocab = draw(st.integers(1, 300))
    scale = draw(st.sampled_from([0.0, 1e-30, 1e-3, 1.0, 30.0, 1e4, 1e30, 3e38]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    logits = (torch.randn(num_rows, vocab, generator=gen, dtype=torch.float64) * scale).clamp(-3e38, 3e38).float()
    for _ in range(draw(st.integers(0, 3))):
        value = draw(st.sampled_from([float("nan"), float("inf"), float("-inf"), 0.0]))
        logits[draw(st.integers(0, num_rows - 1)), draw(st.integers(0, vocab - 1))] = value
    if draw(st.booleans()):  # a whole row poisoned
        logits[0] = draw(st.sampled_from([float("nan"), float("inf"), float("-inf")]))
    return logits


def _params(fields: dict) -> SamplingParams:
    return Sampling.model_validate({"max_tokens": 4, **fields}).to_params()  # the worker's own path


def _greedy_equivalent(p: SamplingParams) -> bool:
    return p.temperature < MIN_TEMPERATURE or p.top_k == 1 or p.top_p <= 1e-300


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(logits=logits_rows(), fields=st.lists(sampling_fields, min_size=4, max_size=4))
def test_sample_never_fails_and_greedy_settings_give_argmax(logits, fields):
    params = [_params(f) for f in fields[:logits.shape[0]]]
    tokens = sample(logits, params, [make_generator(p) for p in params])
    assert len(tokens) == logits.shape[0]
    for row, (token, p) in enumerate(zip(tokens, params, strict=True)):
        assert isinstance(token, int) and 0 <= token < logits.shape[1], (token, p)
        if _greedy_equivalent(p) and bool(torch.isfinite(logits[row]).all()):
            assert token == int(torch.argmax(logits[row])), (p, logits[row])


@settings(max_examples=150, deadline=None)
@given(logits=logits_rows(), fields=sampling_fields, seed=_int_field("seed"), other=sampling_fields)
def test_seeded_draws_depend_only_on_seed_and_logits(logits, fields, seed, other):
    p = _params(dict(fields, seed=seed))
    alone_gen, batched_gen = make_generator(p), make_generator(p)
    q = _params(other)
    alone = [sample(logits[:1], [p], [alone_gen])[0] for _ in range(5)]
    batch = torch.cat([logits[:1], logits[:1].flip(-1)])
    batched = [sample(batch, [p, q], [batched_gen, make_generator(q)])[0] for _ in range(5)]
    assert alone == batched


def test_issue_values_are_greedy_and_keep_the_top_token():
    logits = torch.tensor([[0.5, 3.0, -1.0, 2.9, 3.0]])
    for fields in ({"temperature": 1e-300}, {"temperature": 1.0, "top_p": 1e-320},
                   {"temperature": 1e-320, "top_p": 5e-324}, {"temperature": 0.7, "top_k": 1 << 31}):
        p = _params(fields)
        gen = make_generator(p)
        draws = {sample(logits, [p], [gen])[0] for _ in range(20)}
        assert draws <= set(range(logits.shape[1])), (fields, draws)
        if _greedy_equivalent(p):
            assert draws == {1}, fields  # the argmax, ties to the lowest index


@pytest.mark.parametrize("fields", [{"temperature": 1e-300}, {"temperature": 1.0, "top_p": 1e-320},
                                    {"temperature": 1e4, "top_k": 1 << 31, "seed": -(1 << 63)}])
def test_engine_serves_poisoned_sampling_values(fields):
    engine = Engine(engine_config(FULL_MODEL))
    params = _params(dict(fields, max_tokens=4, ignore_eos=True))
    out = engine.generate_sync({"bad": [1, 2, 3, 4, 5], "good": [6, 7, 8]}, params)
    assert len(out["bad"]) == 4 and len(out["good"]) == 4
    assert all(0 <= t < FULL_MODEL.vocab_size for t in out["bad"] + out["good"])
    assert_all_free(engine.kv_cache_manager)
