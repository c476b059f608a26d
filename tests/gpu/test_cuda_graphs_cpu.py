"""The decode CUDA-graph runner's logic on the CPU: buckets, padding, the eager fallback, and a decode
forward over the persistent buffers that compiles with torch.compile(fullgraph=True).

Capture and replay themselves need CUDA: tests/gpu/test_gpu_engine_parts.py runs them."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from decode_graph_cases import decode_setup, random_batch
from pd.engine.runner.cuda_graphs import (PAD_SLOT, DecodeBatch, DecodeGraphRunner, bucket_for, capture_sizes,
                                          plan_step)


def test_capture_sizes_follow_the_documented_steps():
    assert capture_sizes(512) == (1, 2, 4, 8, *range(16, 257, 8), *range(272, 513, 16))
    assert capture_sizes(256)[-3:] == (240, 248, 256)
    assert capture_sizes(100)[-2:] == (96, 100)  # capped, the cap itself a bucket
    assert capture_sizes(3) == (1, 2, 3)
    assert capture_sizes(8) == (1, 2, 4, 8)
    with pytest.raises(ValueError):
        capture_sizes(0)


@settings(max_examples=60, deadline=None)
@given(max_num_seqs=st.integers(1, 700), num_seqs=st.integers(1, 800))
def test_bucket_is_the_smallest_capture_size_that_holds_the_batch(max_num_seqs, num_seqs):
    sizes = capture_sizes(max_num_seqs)
    assert list(sizes) == sorted(set(sizes))
    bucket = bucket_for(num_seqs, sizes)
    if num_seqs > max_num_seqs:
        assert bucket is None
    else:
        assert bucket is not None and bucket >= num_seqs
        assert all(s < num_seqs for s in sizes if s < bucket)
        assert bucket - num_seqs < max(8, num_seqs // 8 + 16)  # padding stays small


def test_plan_falls_back_to_eager_and_says_why():
    sizes = capture_sizes(64)
    assert plan_step(5, 5, sizes, graphs_ready=True).bucket == 8
    assert plan_step(64, 64, sizes, graphs_ready=True).uses_graph
    prompt = plan_step(5, 40, sizes, graphs_ready=True)
    assert not prompt.uses_graph and "prompt" in prompt.reason
    big = plan_step(65, 65, sizes, graphs_ready=True)
    assert not big.uses_graph and "largest bucket" in big.reason
    off = plan_step(5, 5, sizes, graphs_ready=False)
    assert not off.uses_graph and "off" in off.reason


def test_padding_rows_are_harmless_and_stale_tables_cleared():
    setup = decode_setup("cpu", use_triton=False)
    b = setup.buffers
    b.block_tables.fill_(7)  # a previous step's tables
    batch = random_batch(setup, 3, seed=0)
    b.load(batch, 8)
    assert b.token_ids[:3].tolist() == list(batch.token_ids) and b.token_ids[3:8].tolist() == [0] * 5
    assert b.seq_lens[3:8].tolist() == [0] * 5 and b.positions[3:8].tolist() == [0] * 5
    assert b.slot_mapping[:, 3:8].eq(PAD_SLOT).all() and PAD_SLOT < setup.layout.block_size  # the null block
    assert b.block_tables[:, 3:8].eq(0).all()
    width = len(batch.block_tables[0][0])
    assert b.block_tables[0, 0, :width].tolist() == batch.block_tables[0][0]
    assert b.block_tables[0, 0, width:].eq(0).all()
    with pytest.raises(ValueError, match="does not fit"):
        b.load(batch, b.max_num_seqs + 1)
    with pytest.raises(ValueError, match="block table"):
        b.load(DecodeBatch([1], [0], [1], [[4], [4]], [[list(range(1, 20))], [[1]]]), 1)


def test_padded_bucket_gives_the_same_rows_and_pages_as_the_exact_batch():
    """5 real rows run in a bucket of 8: their outputs and every page but the null block match a run of 5."""
    exact, padded = decode_setup("cpu", use_triton=False), decode_setup("cpu", use_triton=False)
    batch = random_batch(exact, 5, seed=3)
    exact.buffers.load(batch, 5)
    want = exact.forward(5)
    padded.buffers.load(batch, 8)
    got = padded.forward(8)[:5]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # (equal up to the GEMMs' rounding for 8 rows against 5: later layers' K/V come from those GEMMs)
    for got_view, want_view in zip(padded.layout.group_views(padded.pool), exact.layout.group_views(exact.pool),
                                   strict=True):
        torch.testing.assert_close(got_view[1:], want_view[1:], atol=1e-5, rtol=1e-5)
    assert not torch.equal(padded.pool.buffer[0], exact.pool.buffer[0])  # the padding rows wrote the null block


def test_runner_without_cuda_runs_eager_and_reports_why():
    setup = decode_setup("cpu", use_triton=False)
    calls = []

    def forward(n: int) -> torch.Tensor:
        calls.append(n)
        return setup.forward(n)

    runner = DecodeGraphRunner(forward, setup.buffers, max_num_seqs=16, enabled=True)
    report = runner.capture()
    assert report.skipped is not None and "CUDA" in report.skipped and not runner.graphs_ready
    assert "cuda_graphs=False" in (DecodeGraphRunner(forward, setup.buffers, 16, enabled=False).why_not() or "")
    batch = random_batch(setup, 3, seed=5)
    out = runner.run(batch)
    assert calls == [3] and out.shape == (3, setup.model.config.hidden_size)


def test_decode_forward_over_buffers_compiles_with_fullgraph():
    """No host sync or data-dependent shape in the decode forward (model layers, KV write, paged decode
    through the kernels' torch reference): torch.compile(fullgraph=True) traces it in one graph and
    gives the eager result. (The engine runner's own forward is to be checked the same way once the
    Triton backend is plugged in; torch.compile cannot trace the model's inference_mode decorator.)"""
    eager, compiled = decode_setup("cpu", use_triton=False), decode_setup("cpu", use_triton=False)
    batch = random_batch(eager, 4, seed=9)
    eager.buffers.load(batch, 4)
    compiled.buffers.load(batch, 4)
    want = eager.forward(4)
    torch._dynamo.reset()
    step = torch.compile(compiled.forward, fullgraph=True, dynamic=False)
    with torch.no_grad():
        got = step(4)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    for got_view, want_view in zip(compiled.layout.group_views(compiled.pool), eager.layout.group_views(eager.pool),
                                   strict=True):  # the same K/V written, up to the fused kernels' rounding
        torch.testing.assert_close(got_view, want_view, atol=1e-5, rtol=1e-5)
