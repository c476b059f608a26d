"""The packed GEMM's small-M streaming kernel and register tiles (pd/engine/cpu/cpu_gemm.cpp, AVX-512 or AVX2),
its chunked thread split (cpu_pool.cpp), and the fused decode's two ways of splitting a step over threads.

Random shapes against torch.mm: every row count of the streaming kernel (1..4) and of the tiles above it,
odd K and N (a padded last panel), with and without bias, on 1 and 2 threads."""
import threading

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvcache.audit import assert_all_free
from tests.helpers.engine_cases import MODELS, FusedRunnerCase, engine_config, mixed_prompts

from pd.engine.cpu import kernels as cpu_kernels
from pd.engine.engine import Engine
from pd.engine.cpu.packed_linear import num_panels, pack_into
from pd.engine.sched.output import ScheduledChunk
from pd.engine.sample.params import SamplingParams

module = cpu_kernels.load()
pytestmark = pytest.mark.skipif(module is None or not module.packed_gemm_available(),
                                reason="C++ toolchain or AVX2/FMA unavailable")


def _packed(weight: torch.Tensor) -> torch.Tensor:
    return pack_into(weight, torch.empty(num_panels(weight.shape[0]), weight.shape[1], 16))


def _check(m: int, k: int, n: int, with_bias: bool, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    x, weight = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)
    bias = torch.randn(n, generator=gen) if with_bias else torch.empty(0)
    got = module.packed_linear(x, _packed(weight), n, bias)
    want = torch.mm(x, weight.t()) + (bias if with_bias else 0)
    # float32 rounding of a k-sum blocked in chunks of 64: a few ulps of the sum of |terms|
    scale = torch.mm(x.abs(), weight.abs().t()) + (bias.abs() if with_bias else 0)
    assert got.shape == (m, n)
    assert bool(((got - want).abs() <= 1e-5 * scale + 1e-6).all()), float((got - want).abs().max())


# 5..64 rows: AVX2 runs them k-chunk by k-chunk (panel_rows_streamed); 65 takes the row-block path
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 12, 13, 33, 64, 65])
@pytest.mark.parametrize("k,n", [(576, 960), (1536, 576), (1, 17), (129, 33)])
def test_every_row_count_matches_torch_mm(m, k, n, threads):
    _check(m, k, n, with_bias=True, seed=m * 7 + k + n)
    _check(m, k, n, with_bias=False, seed=m * 11 + k + n)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(m=st.integers(1, 70), k=st.integers(1, 300), n=st.integers(1, 100), with_bias=st.booleans(),
       seed=st.integers(0, 2**31 - 1))
def test_random_shapes_match_torch_mm(m, k, n, with_bias, seed, threads):
    _check(m, k, n, with_bias, seed)


def test_concurrent_callers_each_get_their_own_result():
    """Two Python threads in the GEMM at once (it releases the GIL): the second runs without the
    helper threads, which serve one call at a time; both results are exact."""
    gen = torch.Generator().manual_seed(4)
    weight = torch.randn(3000, 64, generator=gen)
    packed = _packed(weight)
    xs = [torch.randn(2, 64, generator=gen) for _ in range(2)]
    want = [module.packed_linear(x, packed, 3000, torch.empty(0)) for x in xs]
    got: dict[int, list[torch.Tensor]] = {0: [], 1: []}

    def call(i: int) -> None:
        for _ in range(50):
            got[i].append(module.packed_linear(xs[i], packed, 3000, torch.empty(0)))

    workers = [threading.Thread(target=call, args=(i,)) for i in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=60)
    assert not any(w.is_alive() for w in workers)
    for i in range(2):
        assert len(got[i]) == 50 and all(torch.equal(g, want[i]) for g in got[i])


@pytest.mark.parametrize("split", [0, 1 << 20], ids=["requests", "panels"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_both_decode_splits_match_the_reference(name, split, threads):
    """A step of a few tokens split by requests (each thread all layers) or by panels (layer by layer,
    the threads sharing each projection): the logits of both match the dense reference."""
    case = FusedRunnerCase.build(MODELS[name], (5, 21, 40), seed=2)
    runner, prompts, tables, refs = case.runner, case.prompts, case.tables, case.refs
    runner.executor.panel_split_max_rows = split
    for pos in range(max(map(len, prompts))):
        chunks = [ScheduledChunk(str(i), [p[pos]], pos, tables[i], True) for i, p in enumerate(prompts) if pos < len(p)]
        for row, c in zip(runner.model.compute_logits(runner.final_hidden(chunks)), chunks, strict=True):
            assert torch.allclose(row, refs[int(c.request_id)][pos], atol=1e-5, rtol=0)


def test_both_decode_splits_give_the_same_tokens():
    cfg = MODELS[sorted(MODELS)[0]]
    prompts = mixed_prompts(6)
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    outputs = []
    for split in (0, 1 << 20):
        eng = Engine(engine_config(cfg, attention_backend="fused"))
        eng.runner.executor.panel_split_max_rows = split
        outputs.append(eng.generate_sync(prompts, params))
        assert_all_free(eng.kv_cache_manager)
    assert outputs[0] == outputs[1]
