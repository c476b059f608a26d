"""Greedy tokens through the int8 screen of the lm_head (pd/engine/cpu/greedy_head.py, cpu_argmax.cpp).

The screen must return exactly the argmax of the float32 logits: on random rows and shapes
(hypothesis), on rows built to sit on near-ties and exact ties (lowest index wins, as torch.argmax),
on a vocabulary that pads its last panel, and at 1 and 2 threads; a row that is not finite is left
to the full logits. Through the engine, greedy decoding gives the same tokens with the screen on
and off, and a batch mixing greedy and seeded rows samples the seeded ones as before."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvcache.audit import assert_all_free
from tests.helpers.engine_cases import FULL_MODEL, engine_config, mixed_prompts

from pd.engine.cpu import kernels as cpu_kernels
from pd.engine.engine import Engine
from pd.engine.cpu.greedy_head import ROWS_PER_CALL, GreedyHead
from pd.engine.cpu.packed_linear import PackedLinear, num_panels, pack_into
from pd.engine.sample.params import SamplingParams

module = cpu_kernels.load()
pytestmark = pytest.mark.skipif(module is None or not module.packed_gemm_available(),
                                reason="C++ toolchain or AVX2/FMA unavailable")


def _head(weight: torch.Tensor) -> tuple[GreedyHead, PackedLinear]:
    n, k = weight.shape
    linear = PackedLinear(pack_into(weight, torch.empty(num_panels(n), k, 16)), k, n, None)
    return GreedyHead(linear), linear


def _full_argmax(linear: PackedLinear, hidden: torch.Tensor) -> list[int]:
    return torch.argmax(linear(hidden), dim=-1).tolist()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(m=st.integers(1, 13), k=st.integers(1, 200), n=st.integers(1, 700), seed=st.integers(0, 2**31 - 1),
       spread=st.sampled_from([0.01, 1.0, 30.0]))
def test_random_rows_match_the_float32_argmax(m, k, n, seed, spread, threads):
    gen = torch.Generator().manual_seed(seed)
    head, linear = _head(torch.randn(n, k, generator=gen))
    hidden = torch.randn(m, k, generator=gen) * spread
    got = head.tokens(hidden)
    assert all(t is not None and 0 <= t < n for t in got)
    # The screen computes its candidates with the one-row tile: row by row through the full lm_head is the
    # same float32 arithmetic, so the same argmax, exactly.
    assert got == [_full_argmax(linear, hidden[i:i + 1])[0] for i in range(m)]
    full = linear(hidden)  # the batch's tile sums in another order: at most a near-tie rounds apart
    for row, token in zip(full, got, strict=True):
        assert float(row[token]) >= float(row.max()) - 1e-5 * float(row.abs().max() + 1)


@pytest.mark.parametrize("nudge,winners", [(2e-6, {18}), (-2e-6, {17, 205})], ids=["near-tie", "tie"])
def test_near_ties_and_ties(nudge, winners, threads):
    """Rows of W a few ulps apart, and identical rows in other panels (the padded last one among
    them): the winner is the float32 argmax of the kernel's own sums. Identical rows in other lanes
    tie in real arithmetic, not always in the kernel's float32 (-ffast-math may add a lane's partial
    sums in another order): whichever the float32 sums rank first wins, the lower index on a tie."""
    gen = torch.Generator().manual_seed(3)
    k, n = 96, 300
    weight = torch.randn(n, k, generator=gen) * 0.05
    base = weight[17].clone()
    weight[205] = base  # a real tie with 17, in another panel and lane
    weight[18] = base * (1 + nudge)  # above or below 17, in the same panel
    weight[299] = base * (1 - 4e-6)  # just below, in the padded last panel
    hidden = torch.randn(6, k, generator=gen) + 40 * base / base.norm() ** 2  # row 17's direction wins
    head, linear = _head(weight)
    got = head.tokens(hidden)
    assert set(got) <= winners
    assert got == [_full_argmax(linear, hidden[i:i + 1])[0] for i in range(6)]
    if len(winners) == 1:
        assert _full_argmax(linear, hidden) == got


def test_more_rows_than_one_kernel_call_takes(threads):
    gen = torch.Generator().manual_seed(11)
    head, linear = _head(torch.randn(90, 48, generator=gen))
    hidden = torch.randn(ROWS_PER_CALL * 2 + 5, 48, generator=gen)
    assert head.tokens(hidden) == [_full_argmax(linear, hidden[i:i + 1])[0] for i in range(hidden.shape[0])]


def test_non_finite_rows_are_left_to_the_full_logits(threads):
    head, linear = _head(torch.randn(100, 32))
    hidden = torch.randn(4, 32)
    hidden[1, 3] = float("nan")
    hidden[2, 0] = float("inf")
    got = head.tokens(hidden)
    assert got[1] is None and got[2] is None
    assert [got[0], got[3]] == [_full_argmax(linear, hidden[i:i + 1])[0] for i in (0, 3)]


def test_lm_head_with_bias_is_refused():
    n, k = 40, 16
    linear = PackedLinear(pack_into(torch.randn(n, k), torch.empty(num_panels(n), k, 16)), k, n, torch.zeros(n))
    with pytest.raises(ValueError, match="without bias"):
        GreedyHead(linear)


def _decode(engine: Engine, prompts: dict[str, list[int]], params: SamplingParams) -> dict[str, list[int]]:
    out = engine.generate_sync(prompts, params)
    assert_all_free(engine.kv_cache_manager)
    return out


@pytest.mark.parametrize("backend", ["fused", "torch"])
def test_engine_tokens_are_the_same_with_the_screen_on_and_off(backend, monkeypatch):
    """Greedy decoding through the engine, screen on against screen off: the same tokens; a seeded
    sampled request beside them draws the same tokens too (its row takes the full logits)."""
    prompts = mixed_prompts(n=12, lo=3, hi=60, seed=5)
    greedy = SamplingParams(max_tokens=24, ignore_eos=True)
    seeded = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.8, top_p=0.9, seed=7)
    runs = []
    for setting in ("on", "off"):
        monkeypatch.setenv("PDKV_GREEDY_SCREEN", setting)
        engine = Engine(engine_config(FULL_MODEL, attention_backend=backend))
        assert (getattr(engine.runner.executor, "greedy_head", None) is not None) == (setting == "on" and backend == "fused")
        engine.add_request("sampled", [5, 6, 7, 8], seeded)
        runs.append((_decode(engine, prompts, greedy), engine))
    (on, engine_on), (off, _) = runs
    assert on == off
    assert len(on["sampled"]) == 24
