"""The optional fused C++ decode kernel agrees with the torch paged path and the dense reference."""
import pytest
import torch
from kvcache.audit import assert_all_free
from tests.helpers.engine_cases import MODELS, FusedRunnerCase, engine_config, mixed_prompts, torch_threads

from pd.engine.kv.page_pool import PagePool
from pd.engine.cpu import kernels as cpu_kernels
from pd.engine.engine import Engine
from pd.engine.kv.layout import KVLayout
from pd.engine.model.llama import build_model
from pd.engine.runner.model_runner import ModelRunner
from pd.engine.sched.output import ScheduledChunk
from pd.engine.sample.params import SamplingParams

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="C++ toolchain unavailable")


@pytest.fixture(params=[1, 3], ids=["1thread", "3threads"])
def intra_op_threads(request):
    """The kernel splits requests over torch's threads by their key counts: check 1 and several."""
    with torch_threads(request.param) as n:
        yield n


@pytest.mark.parametrize("name", sorted(MODELS))
def test_fused_decode_logits_match_reference(name, intra_op_threads):
    case = FusedRunnerCase.build(MODELS[name], (3, 30, 45), seed=1)
    runner, prompts, tables, refs = case.runner, case.prompts, case.tables, case.refs
    assert runner.backend.capabilities.name == "fused"
    for pos in range(max(map(len, prompts))):
        chunks = [ScheduledChunk(str(i), [p[pos]], pos, tables[i], True) for i, p in enumerate(prompts) if pos < len(p)]
        rows = runner.model.compute_logits(runner.final_hidden(chunks))
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


@pytest.mark.parametrize("split", [0, 1 << 20], ids=["requests", "panels"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_fused_prompt_chunks_match_reference(name, split, intra_op_threads):
    """Steps that mix prompt chunks (each token attending to the chunk's earlier tokens, written in
    the same layer) with decode tokens run through the fused kernel and agree with the dense
    reference, whichever split the decode-only steps use."""
    case = FusedRunnerCase.build(MODELS[name], (3, 30, 45), seed=2)
    runner, prompts, tables, refs = case.runner, case.prompts, case.tables, case.refs
    runner.executor.panel_split_max_rows = split
    # Chunk sizes per step and prompt (0: the prompt has ended): 1-token chunks beside prompt chunks,
    # chunks that end inside a block and ones that cross several.
    plan = [(3, 5, 1), (1, 11, 6), (1, 1, 17), (1, 13, 1), (1, 0, 20)]
    done = [0, 0, 0]
    for sizes in plan:
        chunks = []
        for i, n in enumerate(sizes):
            n = min(n, len(prompts[i]) - done[i])
            if n:
                chunks.append(ScheduledChunk(str(i), prompts[i][done[i]:done[i] + n], done[i], tables[i], True))
                done[i] += n
        assert runner.executor.applies(runner.inputs.build(chunks))
        rows = runner.model.compute_logits(runner.final_hidden(chunks))
        assert rows.shape[0] == len(chunks)
        for row, c in zip(rows, chunks):
            end = c.start + len(c.token_ids) - 1
            assert torch.allclose(row, refs[int(c.request_id)][end], atol=1e-5, rtol=0)
    assert done == [len(p) for p in prompts]


def test_fused_prompt_rows_only_where_small():
    """Prompt chunks go to the fused kernel only under its row and key caps; the rows that need no
    logits return none."""
    cfg = MODELS[sorted(MODELS)[0]]
    model = build_model(cfg, seed=9)
    layout = KVLayout(cfg, 4)
    runner = ModelRunner(model, layout, PagePool(80, layout.page_size_bytes), attention_backend="fused")
    fused = runner.executor
    table = tuple([list(range(1, 40))] * len(layout.groups))
    small = [ScheduledChunk("a", list(range(10)), 0, table, False)]
    assert fused.applies(runner.inputs.build(small))
    assert runner.model.compute_logits(runner.final_hidden(small)).shape == (0, cfg.vocab_size)
    fused.prompt_max_rows = 9
    assert not fused.applies(runner.inputs.build(small))
    fused.prompt_max_rows, fused.prompt_max_keys = 10, 99
    assert not fused.applies(runner.inputs.build(small))
    fused.prompt_max_keys = 100
    assert fused.applies(runner.inputs.build(small))
    assert fused.applies(runner.inputs.build([ScheduledChunk("b", [1], 50, table, True)] * 3))
    # deep into a long prompt the rows see many keys each: the torch path takes the chunk (the step's
    # inputs are only built here, never run: the block ids need not exist in the pool)
    table = tuple([list(range(1, 200))] * len(layout.groups))
    fused.prompt_max_rows, fused.prompt_max_keys = 1024, 1 << 20
    assert fused.applies(runner.inputs.build([ScheduledChunk("c", list(range(64)), 600, table, False)]))  # mean 632.5 keys
    assert not fused.applies(runner.inputs.build([ScheduledChunk("c", list(range(64)), 610, table, False)]))  # mean 642.5
    fused.prompt_max_mean_keys = 650
    assert fused.applies(runner.inputs.build([ScheduledChunk("c", list(range(64)), 610, table, False)]))
