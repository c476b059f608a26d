"""The optional fused C++ decode kernel agrees with the torch paged path and the dense reference."""
import pytest
import torch
from kvcache.audit import assert_all_free
from pd_engine_cases import MODELS, engine_config, mixed_prompts

from pd.engine.page_pool import PagePool
from pd.engine import cpu_kernels
from pd.engine.engine import Engine
from pd.engine.kv_layout import KVLayout
from pd.engine.model import build_model
from pd.engine.runner import ModelRunner, ScheduledChunk
from pd.engine.sampling import SamplingParams

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="C++ toolchain unavailable")


@pytest.fixture(params=[1, 3], ids=["1thread", "3threads"])
def intra_op_threads(request):
    """The kernel splits requests over torch's threads by their key counts: check 1 and several."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_fused_decode_logits_match_reference(name, intra_op_threads):
    cfg = MODELS[name]
    model = build_model(cfg, seed=9)
    layout = KVLayout(cfg, 4)
    runner = ModelRunner(model, layout, PagePool(80, layout.page_size_bytes), attention_backend="fused")
    assert runner.fused_decode
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (3, 30, 45)]
    num_groups = len(layout.groups)
    tables = [tuple(list(range(1 + (i * num_groups + g) * 12, 13 + (i * num_groups + g) * 12)) for g in range(num_groups))
              for i in range(3)]
    refs = [model.reference_logits(p) for p in prompts]
    for pos in range(max(map(len, prompts))):
        chunks = [ScheduledChunk(str(i), [p[pos]], pos, tables[i], True) for i, p in enumerate(prompts) if pos < len(p)]
        rows = runner.execute(chunks)
        for row, c in zip(rows, chunks):
            assert torch.allclose(row, refs[int(c.request_id)][pos], atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_fused_engine_same_tokens_as_torch_path(name):
    cfg = MODELS[name]
    prompts = mixed_prompts(32)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    torch_out = Engine(engine_config(cfg)).generate_sync(prompts, params)
    for kw in ({}, {"num_blocks": 90}):
        eng = Engine(engine_config(cfg, attention_backend="fused", **kw))
        assert eng.generate_sync(prompts, params) == torch_out
        assert_all_free(eng.kv_cache_manager)
