"""A mixed step through the Triton backend (under the interpreter, tests/conftest.py): its one-token chunks
run through the decode kernel and its prompt chunks through the prompt kernel, each on its part of the rows
(`StepMetadata.mixed`), and the result equals the torch reference backend's, row for row, on a GQA model
with a sliding-window layer."""
from __future__ import annotations

import sys

import pytest
import torch

from pd.engine.attention import triton_launch
from pd.engine.attention.metadata import StepInputBuilder
from pd.engine.attention.torch_paged import TorchPagedBackend
from pd.engine.attention.triton_backend import TritonBackend
from pd.engine.kv.layout import KVLayout
from pd.engine.kv.page_pool import PagePool
from pd.engine.model.config import ModelConfig
from pd.engine.sched.output import ScheduledChunk

BS = 4
# (start, tokens) per chunk: decode rows between prompt chunks, one prompt chunk after a prefix
STEP = [(9, 1), (0, 7), (22, 1), (5, 6), (13, 1), (0, 3)]
TOLERANCE = {"float32": 2e-5, "bfloat16": 2e-2}


def _chunks() -> list[ScheduledChunk]:
    chunks, next_block = [], 1
    for i, (start, n) in enumerate(STEP):
        need = (start + n + BS - 1) // BS
        tables = []
        for _ in range(2):  # two KV cache groups: full attention and the sliding window
            tables.append(list(range(next_block, next_block + need)))
            next_block += need
        chunks.append(ScheduledChunk(f"r{i}", list(range(n)), start, tuple(tables), True))
    return chunks


class Launches:
    """Every Triton launch, as (kernel name, grid), through the kernel modules' `launcher`."""

    def __init__(self, monkeypatch):
        self.seen: list[tuple[str, tuple]] = []
        real = triton_launch.launcher

        def counted(fn, device):
            kernel = real(fn, device)
            outer = self

            class Counted:
                def __getitem__(self, grid):
                    outer.seen.append((fn.__name__, tuple(grid)))
                    return kernel[grid]
            return Counted()

        for name, module in list(sys.modules.items()):
            if name.startswith("pd.engine") and getattr(module, "launcher", None) is real:
                monkeypatch.setattr(module, "launcher", counted)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_mixed_step_runs_decode_rows_through_the_decode_kernel_and_equals_the_reference(monkeypatch, dtype):
    cfg = ModelConfig(vocab_size=32, hidden_size=64, intermediate_size=8, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=16, layer_types=("full_attention", "sliding_attention"), sliding_window=6, dtype=dtype)
    layout = KVLayout(cfg, BS)
    chunks = _chunks()
    num_blocks = 1 + sum(len(t) for c in chunks for t in c.block_ids)
    gen = torch.Generator().manual_seed(7)
    pools = [PagePool(num_blocks, layout.page_size_bytes, shareable=False) for _ in range(2)]
    rows = layout.bind(pools[0]).token_rows
    rows.copy_(torch.randn(rows.shape, generator=gen).to(rows.dtype))  # earlier context: random values
    pools[1].buffer.copy_(pools[0].buffer)
    triton, reference = TritonBackend(layout.bind(pools[0])), TorchPagedBackend(layout.bind(pools[1]))
    metadata = StepInputBuilder(layout, "cpu").build(chunks)
    split = metadata.mixed
    decode = [i for i, (_, n) in enumerate(STEP) if n == 1]
    assert split is not None and split.decode_rows.tolist() == [metadata.query_start_loc[i].item() for i in decode]
    assert sorted(split.decode_rows.tolist() + split.prompt_rows.tolist()) == list(range(metadata.num_tokens))
    t = metadata.num_tokens

    def rand(heads: int) -> torch.Tensor:
        return torch.randn((t, heads, cfg.head_dim), generator=gen).to(cfg.torch_dtype)

    launches = Launches(monkeypatch)
    triton.prepare(metadata)
    reference.prepare(metadata)
    for layer in range(cfg.num_layers):
        q, k, v = rand(cfg.num_heads), rand(cfg.num_kv_heads), rand(cfg.num_kv_heads)
        launches.seen.clear()
        got = triton.forward(q, k, v, layer, metadata)
        want = reference.forward(q, k, v, layer, metadata)
        names = [name for name, _ in launches.seen]
        # the decode kernel ran once, over the decode rows only; the prompt kernel once, over the prompt chunks
        assert [grid[0] for name, grid in launches.seen if name == "_decode_kernel"] == [len(decode)], names
        assert names.count("_prefill_kernel") == 1, names
        assert got.shape == q.shape and got.dtype == q.dtype
        torch.testing.assert_close(got.float(), want.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    assert torch.equal(pools[0].buffer, pools[1].buffer), "the K/V writes differ"


def test_only_a_step_with_both_kinds_of_chunk_is_split():
    cfg = ModelConfig(vocab_size=32, hidden_size=32, intermediate_size=8, num_layers=1, num_heads=2, num_kv_heads=1,
                      head_dim=16)
    builder = StepInputBuilder(KVLayout(cfg, BS), "cpu")
    decode_only = [ScheduledChunk("a", [1], 3, ([1],), True), ScheduledChunk("b", [2], 0, ([2],), True)]
    prompts = [ScheduledChunk("a", [1, 2], 0, ([1],), True), ScheduledChunk("b", [2, 3, 4], 0, ([2],), True)]
    assert builder.build(decode_only).mixed is None
    assert builder.build(prompts).mixed is None
    mixed = builder.build([prompts[0], ScheduledChunk("c", [5], 6, ([3, 4],), True)]).mixed
    assert mixed is not None
    assert mixed.decode_rows.tolist() == [2] and mixed.decode_seq_lens.tolist() == [7]
    assert mixed.decode_tables[0].tolist() == [[3, 4]] and mixed.prompt_tables[0].tolist() == [[1, 0]]
    assert mixed.prompt_rows.tolist() == [0, 1] and mixed.prompt_query_start.tolist() == [0, 2]
    assert mixed.prompt_seq_lens.tolist() == [2] and mixed.prompt_max_query_len == 2
