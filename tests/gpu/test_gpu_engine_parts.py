"""The GPU engine's parts on a CUDA device: the compiled Triton kernels against their torch reference at the
models' real head shapes, decode CUDA graphs captured and replayed against eager, and the batched sampler
making no host synchronisation before its one copy."""
from __future__ import annotations

import pytest
import torch

from tests.helpers.decode_graph_cases import decode_engine, random_chunks
from pd.engine.attention.triton_decode import paged_decode
from pd.engine.attention.triton_kv_write import write_kv
from pd.engine.attention.triton_prefill import paged_prefill
from pd.engine.attention.triton_reference import paged_decode_reference, paged_prefill_reference, write_kv_reference
from pd.engine.runner.model_runner import RequestSampling
from pd.engine.sample.batched import BatchedSampler, RowRng
from pd.engine.sample.params import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
TOL = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def _paged(dtype, kv_heads, head_dim, num_blocks=300, block_size=16, layers=3):
    """A pool-like layer view: (blocks, layers, 2, bs, H, D), K/V of layer 1 as strided views."""
    pages = torch.randn(num_blocks, layers, 2, block_size, kv_heads, head_dim, device="cuda").to(dtype)
    return pages, pages[:, 1, 0], pages[:, 1, 1]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("heads,kv_heads,head_dim,window", [(14, 2, 64, None), (14, 2, 64, 100), (32, 8, 128, None)])
def test_compiled_kernels_match_the_reference(dtype, heads, kv_heads, head_dim, window):
    gen = torch.Generator().manual_seed(0)
    _, k_cache, v_cache = _paged(dtype, kv_heads, head_dim)
    lens = torch.randint(1, 700, (24,), generator=gen)
    table = torch.randint(1, 300, (24, 44), generator=gen).to(torch.int32).cuda()  # (sequences may share pages)
    seq_lens = lens.to(torch.int32).cuda()
    q = torch.randn(24, heads, head_dim, generator=gen).to(dtype).cuda()
    got = paged_decode(q, k_cache, v_cache, table, seq_lens, head_dim ** -0.5, window)
    want = paged_decode_reference(q, k_cache, v_cache, table, seq_lens, head_dim ** -0.5, window)
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])
    q_lens = torch.randint(1, 300, (6,), generator=gen)
    starts = torch.cat([torch.zeros(1, dtype=torch.long), q_lens.cumsum(0)]).to(torch.int32).cuda()
    ctx = (q_lens + torch.randint(0, 300, (6,), generator=gen)).to(torch.int32).cuda()
    qp = torch.randn(int(q_lens.sum()), heads, head_dim, generator=gen).to(dtype).cuda()
    got = paged_prefill(qp, k_cache, v_cache, table[:6], ctx, starts, int(q_lens.max()), head_dim ** -0.5, window)
    want = paged_prefill_reference(qp, k_cache, v_cache, table[:6], ctx, starts, head_dim ** -0.5, window)
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


def test_compiled_kv_write_matches_the_reference():
    pages_a, k_a, v_a = _paged(torch.bfloat16, 2, 64)
    pages_b = pages_a.clone()
    k_b, v_b = pages_b[:, 1, 0], pages_b[:, 1, 1]
    k = torch.randn(50, 2, 64, device="cuda").bfloat16()
    v = torch.randn(50, 2, 64, device="cuda").bfloat16()
    slots = torch.randperm(299 * 16, device="cuda")[:50] + 16
    slots[7] = -1
    write_kv(k, v, k_a, v_a, slots)
    write_kv_reference(k, v, k_b, v_b, slots)
    assert torch.equal(pages_a, pages_b)


def test_decode_graphs_replay_what_eager_computes():
    """The engine's runner on CUDA: graphs captured at start for every bucket; a decode step replays its
    bucket's graph and gives the rows and tokens an engine without graphs computes eagerly."""
    graphed = decode_engine("cuda", max_num_seqs=16)
    eager = decode_engine("cuda", cuda_graphs=False, max_num_seqs=16)
    report = graphed.runner.graph_report
    assert report.skipped is None and report.sizes == (1, 2, 4, 8, 16) and graphed.runner.graphs.graphs_ready
    assert eager.runner.graph_report.skipped is not None
    for n, seed in ((3, 1), (8, 2), (13, 3), (1, 4)):
        chunks = random_chunks(graphed, n, seed)
        assert graphed.runner.graphs.plan(n, n).bucket is not None
        got = graphed.runner.final_hidden(chunks).clone()
        want = eager.runner.final_hidden(chunks)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        for eng in (graphed, eager):
            eng.runner.requests.update({c.request_id: RequestSampling(SamplingParams(), None, None) for c in chunks})
        assert graphed.runner.next_tokens(chunks) == eager.runner.next_tokens(chunks)


def test_graphed_decode_step_makes_no_host_sync_before_the_token_copy():
    """After the step's inputs are written, a graphed decode step (replay, logits, greedy argmax) runs with
    CUDA's sync debug mode set to error: the only sync of the step is the token copy that follows."""
    eng = decode_engine("cuda", max_num_seqs=16)
    runner = eng.runner
    chunks = random_chunks(eng, 5, seed=7)
    bucket = runner.graphs.plan(5, 5).bucket
    assert bucket == 8
    metadata = runner.inputs.build(chunks, pad_to=bucket)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        hidden = runner.graphs.replay(bucket)[metadata.logits_indices]
        tokens = torch.argmax(runner.model.compute_logits(hidden)[:, :runner.num_ids], dim=1)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len(tokens.tolist()) == 5


def test_engine_on_cuda_runs_triton_graphs_and_device_sampling():
    """A whole engine on CUDA (auto: the Triton backend, graphs, the device sampler) gives the tokens of the
    same engine without graphs, its pool all free at the end."""
    from kvcache.audit import assert_all_free

    from pd.engine.config import EngineConfig
    from pd.engine.engine import Engine
    from tests.helpers.decode_graph_cases import SMALL

    prompts = {f"r{i}": [(7 * i + j) % 90 for j in range(3 + 5 * i)] for i in range(6)}
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    outs = []
    for graphs in (True, False):
        eng = Engine(EngineConfig(model=SMALL, seed=0, block_size=4, num_blocks=200, max_num_seqs=8,
                                  device="cuda", attention_backend="auto", cuda_graphs=graphs))
        assert eng.runner.backend.capabilities.name == "triton" and eng.runner.batched_sampler is not None
        assert eng.runner.graphs.graphs_ready == graphs
        outs.append(eng.generate_sync(prompts, params))
        assert_all_free(eng.kv_cache_manager)
    assert outs[0] == outs[1]


def test_sampler_synchronises_only_for_its_one_copy():
    logits = torch.randn(64, 32000, device="cuda")
    params = [SamplingParams(temperature=0.9, top_k=50, top_p=0.9, seed=i) if i % 2 else SamplingParams()
              for i in range(64)]
    sampler = BatchedSampler(num_ids=31000)
    rows = logits[:, :31000]
    drawn = [i for i, p in enumerate(params) if not p.greedy]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        sampler._draw(rows, drawn, params, [RowRng(i) for i in drawn])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    on_gpu = sampler.sample(logits, params, [RowRng(i) for i in range(64)])
    on_cpu = sampler.sample(logits.cpu(), params, [RowRng(i) for i in range(64)])
    assert on_gpu[::2] == on_cpu[::2]  # greedy rows: identical
    agree = sum(a == b for a, b in zip(on_gpu[1::2], on_cpu[1::2], strict=True))
    assert agree >= 28  # the noise is device-independent; only float rounding at a filter's edge may differ
