"""The packed-panel AVX2 GEMM (pd/engine/cpu/cpu_gemm.cpp) and the modules that hold weights in its layout."""
import dataclasses

import pytest
import torch
from kvcache.audit import assert_all_free
from tests.helpers.engine_cases import FULL_MODEL, engine_config, mixed_prompts

from pd.engine.cpu import kernels as cpu_kernels
from pd.engine.engine import Engine
from pd.engine.kv.layout import KVLayout
from pd.engine.model.llama import build_model
from pd.engine.cpu.packed_linear import PackedEmbedding, PackedLinear, num_panels, pack_into, packable, unpack
from pd.engine.kv.page_pool import PagePool
from pd.engine.runner.model_runner import ModelRunner
from pd.engine.sample.params import SamplingParams

module = cpu_kernels.load()
pytestmark = pytest.mark.skipif(module is None or not module.packed_gemm_available(),
                                reason="C++ toolchain or AVX2/FMA unavailable")


def _packed(weight: torch.Tensor) -> torch.Tensor:
    return pack_into(weight, torch.empty(num_panels(weight.shape[0]), weight.shape[1], 16))


@pytest.mark.parametrize("m,k,n", [(1, 64, 260), (5, 7, 16), (32, 576, 960), (33, 100, 17), (200, 1536, 48)])
def test_packed_linear_matches_float64(m, k, n):
    """Every row-block size (1..6), a padded last panel, K across several register chunks, a bias;
    the error against float64 stays at float32 rounding (no larger than at::linear's)."""
    gen = torch.Generator().manual_seed(m * 1000 + n)
    weight, x, bias = torch.randn(n, k, generator=gen), torch.randn(m, k, generator=gen), torch.randn(n, generator=gen)
    packed = _packed(weight)
    assert torch.equal(unpack(packed, n), weight)
    exact = torch.nn.functional.linear(x.double(), weight.double(), bias.double())
    got = module.packed_linear(x, packed, n, bias)
    assert got.shape == (m, n)
    mkl_err = float((torch.nn.functional.linear(x, weight, bias).double() - exact).abs().max())
    assert float((got.double() - exact).abs().max()) <= max(2 * mkl_err, 1e-6 * k ** 0.5)
    no_bias = module.packed_linear(x, packed, n, torch.empty(0))
    torch.testing.assert_close(no_bias, got - bias, atol=1e-5, rtol=0)


def test_packed_modules_keep_nn_semantics():
    gen = torch.Generator().manual_seed(3)
    linear = torch.nn.Linear(40, 35)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(35, 40, generator=gen))
    packed = PackedLinear(_packed(linear.weight.detach()), 40, 35, linear.bias.detach())
    x = torch.randn(2, 3, 40, generator=gen)
    torch.testing.assert_close(packed(x), linear(x), atol=1e-5, rtol=0)
    assert packed.state_dict().keys() == linear.state_dict().keys()
    for name, value in linear.state_dict().items():
        assert torch.equal(packed.state_dict()[name], value), name
    embedding = PackedEmbedding(packed)
    ids = torch.tensor([[0, 34], [17, 3]])
    assert torch.equal(embedding(ids), linear.weight.detach()[ids])
    with pytest.raises(RuntimeError, match="out of range"):
        embedding(torch.tensor([35]))


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_the_cpu_backend_packs_its_own_copy_and_leaves_the_model_as_built(tied):
    """The CPU backend lays its weights out as panels at load time, in its own copy of the model:
    the copy's projections (and a tied embedding) are packed views of one buffer, the one
    `decode_layers` reads, and they give the model's logits; the engine's model keeps its nn.Linear
    modules, its parameters (same tensors, same values) and its logits."""
    cfg = dataclasses.replace(FULL_MODEL, tie_word_embeddings=tied)
    model = build_model(cfg, seed=5)
    before = {name: t.clone() for name, t in model.state_dict().items()}
    params = {name: p.data_ptr() for name, p in model.named_parameters()}
    modules = [type(m) for m in model.modules()]
    ref_logits = model.reference_logits(list(range(20)))
    layout = KVLayout(cfg, 4)
    runner = ModelRunner(model, layout, PagePool(40, layout.page_size_bytes), attention_backend="fused")
    executor = runner.executor
    # the runner keeps the step executor's copy only (the engine holds the weights once)
    assert executor.packed_gemm and runner.model is executor.model and executor.model is not model
    assert [type(m) for m in model.modules()] == modules
    assert {name: p.data_ptr() for name, p in model.named_parameters()} == params
    after = model.state_dict()
    assert after.keys() == before.keys()
    for name, value in before.items():
        assert torch.equal(after[name], value), name
    copy = executor.model
    assert not any(isinstance(m, torch.nn.Linear) for m in copy.modules())
    linears = [m for m in copy.modules() if isinstance(m, PackedLinear)]
    assert len(linears) == 4 * cfg.num_layers + 1  # q|k|v and gate|up fused, o, down; the head
    storages = {m.packed.untyped_storage().data_ptr() for m in linears}
    assert len(storages) == 1  # one buffer, shared with decode_layers' weights
    assert executor.weights[1].untyped_storage().data_ptr() in storages
    assert isinstance(copy.model.embed_tokens, PackedEmbedding) == tied
    assert not any(t.is_meta for t in list(copy.parameters()) + list(copy.buffers()))
    assert copy.state_dict().keys() == before.keys()
    torch.testing.assert_close(copy.reference_logits(list(range(20))), ref_logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(model.reference_logits(list(range(20))), ref_logits, atol=0, rtol=0)


def test_unpackable_shapes_keep_the_plain_fused_path():
    """A head size whose q/k/v do not fill whole panels: the fused kernel runs with at::linear, same tokens."""
    cfg = dataclasses.replace(FULL_MODEL, hidden_size=72, num_heads=4, num_kv_heads=2)  # head_dim 18
    assert not packable(build_model(cfg))
    prompts = mixed_prompts(8)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    want = Engine(engine_config(cfg)).generate_sync(prompts, params)
    eng = Engine(engine_config(cfg, attention_backend="fused"))
    assert eng.runner.backend.capabilities.name == "fused" and not eng.runner.executor.packed_gemm
    assert eng.generate_sync(prompts, params) == want
    assert_all_free(eng.kv_cache_manager)
