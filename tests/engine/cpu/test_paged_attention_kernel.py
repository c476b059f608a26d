"""The C++ paged decode attention (cpu_attention.cpp) against a dense float64 softmax, and a lone
request's long context cut into parts over the threads (cpu_kernels.cpp `attend_rows`) against the
model's dense reference."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tests.helpers.engine_cases import MODELS, torch_threads

from pd.engine.cpu import kernels as cpu_kernels
from pd.engine.kv.layout import KVLayout
from pd.engine.kv.page_pool import PagePool
from pd.engine.model.llama import build_model
from pd.engine.runner.model_runner import ModelRunner
from pd.engine.sched.output import ScheduledChunk

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="C++ toolchain unavailable")


def dense_attention(q, cache, table, start, end, scale):
    """(Hq, D) float64: softmax(q k / scale) v over positions [start, end) read through `table`."""
    hq, d = q.shape
    bs, hkv = cache.shape[2], cache.shape[3]
    pos = torch.arange(start, end)
    blocks = table[pos // bs]
    k = cache[blocks, 0, pos % bs].double().repeat_interleave(hq // hkv, 1)  # (n, Hq, D)
    v = cache[blocks, 1, pos % bs].double().repeat_interleave(hq // hkv, 1)
    w = torch.softmax(torch.einsum("hd,nhd->hn", q.double(), k) * scale, dim=-1)
    return torch.einsum("hn,nhd->hd", w, v)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hkv=st.sampled_from([1, 2, 3]), group=st.sampled_from([1, 2, 3, 4, 5, 8]),
       d=st.sampled_from([8, 16, 40, 64, 80, 128]), bs=st.sampled_from([1, 3, 8, 16]),
       spans=st.lists(st.tuples(st.integers(0, 300), st.integers(1, 300)), min_size=1, max_size=4),
       threads=st.sampled_from([1, 2, 3]), seed=st.integers(0, 2**16))
def test_paged_decode_attention_matches_dense_softmax(hkv, group, d, bs, spans, threads, seed):
    """Every head grouping, head size (vector widths and the portable tail) and page size, keys that
    start and end inside a page (a sliding window's start), one request or several over the threads."""
    gen = torch.Generator().manual_seed(seed)
    hq = hkv * group
    width = max(-(-(s + n) // bs) for s, n in spans)
    num_blocks = len(spans) * width + 3
    cache = torch.randn(num_blocks, 2, bs, hkv, d, generator=gen)
    tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:width] for _ in spans])
    q = torch.randn(len(spans), hq, d, generator=gen)
    start = torch.tensor([s for s, _ in spans])
    end = torch.tensor([s + n for s, n in spans])
    scale = d ** -0.5
    with torch_threads(threads):
        out = cpu_kernels.load().paged_decode_attention(q, cache, tables, start, end, scale)
    for b in range(len(spans)):
        ref = dense_attention(q[b], cache, tables[b], int(start[b]), int(end[b]), scale)
        assert torch.allclose(out[b].double(), ref, atol=2e-5, rtol=0)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_lone_request_parts_match_reference(name, threads):
    """One request decoding alone past 200 tokens: its keys are cut into 1-3 parts per layer (a part
    holds at least 32 keys), computed over the threads and merged; every logit row agrees with the
    dense reference, at every context length along the way (each part count, uneven cuts)."""
    cfg = MODELS[name]
    model = build_model(cfg, seed=5)
    layout = KVLayout(cfg, 8)
    per_group = 30  # blocks of 8 tokens: room for 240
    num_groups = len(layout.groups)
    runner = ModelRunner(model, layout, PagePool(1 + num_groups * per_group, layout.page_size_bytes),
                         attention_backend="fused")
    assert runner.backend.capabilities.name == "fused"
    prompt = torch.randint(0, 256, (230,), generator=torch.Generator().manual_seed(3)).tolist()
    table = tuple(list(range(1 + g * per_group, 1 + (g + 1) * per_group)) for g in range(num_groups))
    ref = model.reference_logits(prompt)
    with torch_threads(threads):
        first = 40  # the prompt's first 40 tokens as one chunk, then one token a step
        runner.final_hidden([ScheduledChunk("0", prompt[:first], 0, table, True)])
        for pos in range(first, len(prompt)):
            row = runner.model.compute_logits(runner.final_hidden([ScheduledChunk("0", [prompt[pos]], pos, table, True)]))
            assert torch.allclose(row[0], ref[pos], atol=1e-5, rtol=0), pos
