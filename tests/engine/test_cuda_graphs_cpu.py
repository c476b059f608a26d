"""The decode CUDA graphs' logic on the CPU: buckets, padding, the eager fallback, and the engine runner's
own decode forward (Triton backend, its torch reference path) compiling with torch.compile(fullgraph=True).

Capture and replay themselves need CUDA: tests/gpu/test_gpu_engine_parts.py runs them."""
from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers.decode_graph_cases import decode_engine, random_chunks
from pd.engine.runner.cuda_graphs import bucket_for, capture_sizes, plan_step
from pd.engine.sched.output import ScheduledChunk


# the engine's Triton backend on CPU tensors runs only interpreted (on a CUDA machine the suite leaves the
# interpreter off, and tests/gpu/test_gpu_engine_parts.py runs the same steps compiled)
interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="needs Triton's interpreter (TRITON_INTERPRET=1, set where CUDA is absent)")


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
    assert plan_step(64, 64, sizes, graphs_ready=True).bucket == 64
    prompt = plan_step(5, 40, sizes, graphs_ready=True)
    assert prompt.bucket is None and "prompt" in prompt.reason
    big = plan_step(65, 65, sizes, graphs_ready=True)
    assert big.bucket is None and "largest bucket" in big.reason
    off = plan_step(5, 5, sizes, graphs_ready=False)
    assert off.bucket is None and "off" in off.reason
    hooked = plan_step(5, 5, sizes, graphs_ready=True, layer_hook=True)
    assert hooked.bucket is None and "hook" in hooked.reason
    assert plan_step(0, 0, sizes, graphs_ready=True).bucket is None


@interpreted
def test_padding_rows_are_harmless_and_stale_tables_cleared():
    eng = decode_engine("cpu")
    runner = eng.runner
    assert runner.inputs.fixed_table_width  # what a graph replays: tables of one width
    wide = random_chunks(eng, 6, seed=0)
    runner.inputs.build(wide, pad_to=8)  # a previous step with more, longer tables
    chunks = random_chunks(eng, 3, seed=1)
    md = runner.inputs.build(chunks, pad_to=8)
    assert md.num_padded == 5 and md.num_seqs == 8 and md.logits_indices.tolist() == [0, 1, 2]
    assert md.input_ids[3:].tolist() == [0] * 5 and md.positions[3:].tolist() == [0] * 5
    assert md.seq_lens[3:].tolist() == [0] * 5
    assert md.slot_mapping[:, 3:].eq(0).all()  # slot 0 of the null block 0
    for g, table in enumerate(md.block_tables):
        assert table[3:].eq(0).all()
        for i, c in enumerate(chunks):
            n = len(c.block_ids[g])
            assert table[i, :n].tolist() == c.block_ids[g] and table[i, n:].eq(0).all()  # no stale entries
    with pytest.raises(ValueError, match="only a step of decode tokens pads"):
        runner.inputs.build([ScheduledChunk("p", [1, 2], 0, chunks[0].block_ids, True)], pad_to=4)


@interpreted
def test_padded_bucket_gives_the_same_rows_and_pages_as_the_exact_batch():
    """The engine's runner, Triton backend (interpreted): a batch padded to its bucket computes the same
    rows and writes the same pages, the null block aside, as the exact batch."""
    exact, padded = decode_engine("cpu"), decode_engine("cpu")
    chunks = random_chunks(exact, 5, seed=3)
    want = exact.runner.forward_hidden(exact.runner.inputs.build(chunks))
    got = padded.runner.forward_hidden(padded.runner.inputs.build(chunks, pad_to=8))
    assert got.shape[0] == 8
    torch.testing.assert_close(got[:5], want, rtol=1e-5, atol=1e-5)
    rows_a = exact.runner.kv.token_rows.view(exact.page_pool.num_blocks, -1)
    rows_b = padded.runner.kv.token_rows.view(padded.page_pool.num_blocks, -1)
    torch.testing.assert_close(rows_a[1:], rows_b[1:], rtol=1e-5, atol=1e-5)  # (GEMMs of 5 and 8 rows round apart)


@interpreted
def test_runner_without_cuda_runs_eager_and_reports_why():
    on = decode_engine("cpu")
    assert on.runner.graph_report.skipped is not None and "CUDA" in on.runner.graph_report.skipped
    assert not on.runner.graphs.graphs_ready
    off = decode_engine("cpu", cuda_graphs=False)
    assert "cuda_graphs=False" in (off.runner.graph_report.skipped or "")
    torch_backend = decode_engine("cpu", backend="torch")  # plans on the host: never graphed
    assert not torch_backend.runner.graphs.enabled and not torch_backend.runner.inputs.fixed_table_width
    chunks = random_chunks(on, 3, seed=5)
    for eng in (on, off):
        eng.runner.requests.update({c.request_id: _greedy() for c in chunks})
    assert on.runner.next_tokens(chunks) == off.runner.next_tokens(chunks)


def _greedy():
    from pd.engine.runner.model_runner import RequestSampling
    from pd.engine.sample.params import SamplingParams

    return RequestSampling(SamplingParams(), None)


@interpreted
def test_runner_decode_forward_compiles_with_fullgraph():
    """The engine runner's own decode forward (its Triton backend on the kernels' torch reference) traces
    into one graph: no host synchronisation, no data-dependent shape hides in it; and it computes what the
    eager forward does."""
    eager, compiled = decode_engine("cpu"), decode_engine("cpu")
    for eng in (eager, compiled):
        eng.runner.backend.use_reference(True)
    chunks = random_chunks(eager, 4, seed=9)
    want = eager.runner.forward_hidden(eager.runner.inputs.build(chunks, pad_to=8))
    torch._dynamo.reset()
    forward = torch.compile(compiled.runner.forward_hidden, fullgraph=True, dynamic=False)
    got = forward(compiled.runner.inputs.build(chunks, pad_to=8))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    rows_a = eager.runner.kv.token_rows
    rows_b = compiled.runner.kv.token_rows
    torch.testing.assert_close(rows_a, rows_b)  # the compiled forward wrote the same K/V


@interpreted
def test_graphs_count_as_stale_once_the_step_buffers_are_reallocated():
    eng = decode_engine("cpu")
    builder = eng.runner.inputs
    before = builder.allocations
    chunks = random_chunks(eng, 3, seed=11)
    builder.build(chunks)
    assert builder.allocations == before  # a step inside the capacity keeps the buffers
    wide = ScheduledChunk("w", [1], 40, tuple([*range(1, 12)] for _ in eng.layout.groups), True)
    builder.build([wide])  # 11 blocks: past the 8 the engine sized its tables for
    assert builder.allocations == before + 1
    assert eng.runner.graphs._captured_over == before  # what a capture recorded no longer matches
