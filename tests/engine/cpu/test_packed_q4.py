"""Float32 weights held as exact 4-bit codes (pd/engine/cpu/packed_q4.py, cpu_q4.cpp).

`find_q4` keeps a matrix's codes only when they reproduce every float32 weight bit for bit. The
4-bit GEMM then computes with those same weights at every row count it takes (1..64), with bias and
accumulation, at 1 and 2 threads: within float32 rounding of the exact (float64) products always,
and bit for bit the float32 panels' results where it expands the codes (above `q4_factored_rows()`
rows, a register tile's: 12 on AVX-512 builds, 6 on AVX2 ones; up to that it runs the factored tiles).
Through the engine, a model whose weights are Q4_1-shaped gives the same greedy tokens with the codes
on and off, and logits that agree to float32 rounding (bit for bit where the step expands the codes)."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvcache.audit import assert_all_free
from tests.helpers.engine_cases import FULL_MODEL, engine_config, mixed_prompts

from pd.engine.cpu import kernels as cpu_kernels
from pd.engine.engine import Engine
from pd.engine.sched.output import ScheduledChunk
from pd.engine.cpu.packed_linear import num_panels, pack_into
from pd.engine.cpu.packed_q4 import find_q4
from pd.engine.sample.params import SamplingParams

module = cpu_kernels.load()
pytestmark = pytest.mark.skipif(module is None or not module.q4_gemm_available(),
                                reason="the 4-bit path runs on builds with the packed GEMM (AVX2 or AVX-512)")


def q4_1(weight: torch.Tensor) -> torch.Tensor:
    """`weight` (N, K) quantized as GGUF's Q4_1 and dequantized to float32 (as gguf.quants does)."""
    n, k = weight.shape
    blocks = weight.reshape(n, k // 32, 32)
    lo, hi = blocks.amin(-1, keepdim=True), blocks.amax(-1, keepdim=True)
    d, m = ((hi - lo) / 15).half().float(), lo.half().float()
    q = ((blocks - lo) / torch.where(d > 0, d, torch.ones_like(d))).round().clamp(0, 15)
    return (d * q + m).reshape(n, k)


def _packed(weight: torch.Tensor) -> torch.Tensor:
    return pack_into(weight, torch.empty(num_panels(weight.shape[0]), weight.shape[1], 16))


def _check_rounding(y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> None:
    """y = x · weightᵀ + bias to float32 rounding: |y - exact| within (64 + 2 K / 32) units of roundoff
    of sum_k |x_k| (d q_k + |m|) (+ |bias|), a bound that these products summed in blocks meet (the
    factored tiles' blocks of 32 and the float32 tiles' chunks of 64 alike; one running sum over all K
    terms could exceed it)."""
    n, k = weight.shape
    blocks = weight.double().reshape(n, k // 32, 32)
    low = blocks.amin(-1, keepdim=True)  # m: the block's smallest weight is d * 0 + m
    size = (blocks - low + low.abs()).reshape(n, k)  # d q + |m|
    exact = x.double() @ weight.double().T
    scale = x.double().abs() @ size.T
    if bias.numel():
        exact, scale = exact + bias.double(), scale + bias.double().abs()
    assert ((y.double() - exact).abs() <= scale * (64 + 2 * k / 32) * 2.0 ** -24).all()


def _expands(m: int) -> bool:
    """Whether a step of m rows runs on the expanded codes (the float32 panels' bits)."""
    return m > module.q4_factored_rows()


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(m=st.integers(1, 64), blocks=st.integers(1, 12), n=st.integers(1, 90), with_bias=st.booleans(),
       seed=st.integers(0, 2**31 - 1))
def test_codes_give_the_float32_weights_results(m, blocks, n, with_bias, seed, threads):
    gen = torch.Generator().manual_seed(seed)
    weight = q4_1(torch.randn(n, 32 * blocks, generator=gen) * 0.05)
    packed = _packed(weight)
    found = find_q4(packed)
    assert found is not None
    codes, scales = found
    assert codes.numel() + 2 * scales.numel() < packed.numel() * 4 / 6  # bytes read: about a seventh
    assert scales.dtype == torch.float16
    x = torch.randn(m, 32 * blocks, generator=gen)
    bias = torch.randn(n, generator=gen) if with_bias else torch.empty(0)
    y = module.q4_linear(x, codes, scales, n, bias)
    _check_rounding(y, x, weight, bias)
    if _expands(m):
        assert torch.equal(y, module.packed_linear(x, packed, n, bias))


@pytest.mark.parametrize("m,k,n", [(1, 1536, 576), (3, 1536, 90), (5, 1536, 48), (37, 1536, 90), (64, 1536, 33),
                                   (13, 576, 960)])
def test_long_rows_and_row_chunks(m, k, n, threads):
    """K = 1536 (SmolLM2's down projection): the AVX-512 GEMM takes more than 36 rows in chunks of 36 and
    pairs its panels above 4 rows (an odd last panel alone); the codes follow it there too."""
    gen = torch.Generator().manual_seed(m * k + n)
    weight = q4_1(torch.randn(n, k, generator=gen) * 0.05)
    packed = _packed(weight)
    codes, scales = find_q4(packed)
    x = torch.randn(m, k, generator=gen)
    bias = torch.randn(n, generator=gen)
    y = module.q4_linear(x, codes, scales, n, bias)
    _check_rounding(y, x, weight, bias)
    if _expands(m):
        assert torch.equal(y, module.packed_linear(x, packed, n, bias))


def test_factored_tiles_meet_the_bound_where_the_sums_cancel():
    """Rows whose products cancel (the activations orthogonal-ish to each weight row, large m): the
    bound is on the magnitudes, not on the result, and the factored m * sum(x) term must stay within it."""
    gen = torch.Generator().manual_seed(7)
    weight = q4_1(torch.randn(64, 576, generator=gen) * 0.05 + 3.0)  # every block far from zero: large m
    codes, scales = find_q4(_packed(weight))
    for m in range(1, module.q4_factored_rows() + 1):
        x = torch.randn(m, 576, generator=gen)
        x -= x.mean(dim=1, keepdim=True)  # sum(x) near 0: m * sum(x) cancels against the d q terms
        _check_rounding(module.q4_linear(x, codes, scales, 64, torch.empty(0)), x, weight, torch.empty(0))


def test_only_exact_blocks_are_taken():
    weight = q4_1(torch.randn(40, 96) * 0.05)
    assert find_q4(_packed(weight)) is not None
    nudged = weight.clone()
    nudged[7, 33] = torch.nextafter(nudged[7, 33], torch.tensor(1.0))  # one weight one ulp off its grid
    assert find_q4(_packed(nudged)) is None
    assert find_q4(_packed(torch.randn(40, 96))) is None  # plain float32 weights
    bad = weight.clone()
    bad[0, 0] = float("nan")
    assert find_q4(_packed(bad)) is None
    assert find_q4(_packed(q4_1(torch.randn(16, 64))[:, :48].contiguous())) is None  # K not a multiple of 32


def _q4_engine(monkeypatch, setting: str) -> Engine:
    monkeypatch.setenv("PDKV_Q4_WEIGHTS", setting)
    return Engine(engine_config(FULL_MODEL, attention_backend="fused"))


def test_engine_tokens_and_logits_with_codes_on_and_off(monkeypatch, threads):
    """A model whose layer weights are Q4_1-shaped: the fused decoder finds every matrix, and decode and
    small prompt steps give the same tokens as with the codes off, and logits equal to float32 rounding
    (bit for bit where the step expands the codes: a 9-row prompt on AVX2 builds). On
    one thread the step runs each request through all layers (decode_rows), on two layer by layer with
    the threads splitting the panels: both read the codes."""
    import pd.engine.model.llama as model_module

    build = model_module.build_model

    def q4_model(cfg, seed=0, device=None):  # the tiny model with its projections on a Q4_1 grid
        model = build(cfg, seed=seed, device=device)
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                             layer.self_attn.o_proj, layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj):
                    proj.weight.copy_(q4_1(proj.weight))
        return model

    monkeypatch.setattr("pd.engine.runner.compute.build_model", q4_model)
    prompts = mixed_prompts(n=10, lo=2, hi=40, seed=3)
    greedy = SamplingParams(max_tokens=12, ignore_eos=True)
    outs, logits = [], []
    for setting in ("on", "off"):
        engine = _q4_engine(monkeypatch, setting)
        fused = engine.runner.executor
        assert engine.runner.backend.capabilities.name == "fused" and fused is not None
        assert (len(fused.q4) == 8 * FULL_MODEL.num_layers and all(t.numel() for t in fused.q4)) == (setting == "on")
        # one step of prompt chunks (rows <= 64) straight through the runner, then the engine's own run
        tables = ([1, 2, 3],)
        chunk = ScheduledChunk("a", list(range(3, 12)), 0, tables, True)
        logits.append(engine.runner.model.compute_logits(engine.runner.final_hidden([chunk])))
        engine.page_pool.buffer.zero_()
        outs.append(engine.generate_sync(prompts, greedy))
        assert_all_free(engine.kv_cache_manager)
    if _expands(9):  # the prompt chunk's 9 rows
        assert torch.equal(logits[0], logits[1])
    else:  # the factored tiles: an error of the size of a weight would show here
        torch.testing.assert_close(logits[0], logits[1], rtol=1e-5, atol=1e-5)
    assert outs[0] == outs[1]
