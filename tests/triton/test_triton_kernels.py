"""The Triton paged-attention kernels against their torch reference, on the real page pool.

Without CUDA they run through Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET=1 before anything imports Triton); `test_triton_runs_interpreted`
proves it. With CUDA (and the variable unset) the same cases run the compiled
kernels on the GPU. Every case writes the step's K/V with the Triton KV write and
compares both the attention output and every byte of the pool with the
reference's.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from triton import knobs

from pd.engine.attention import triton_launch, triton_prefill
from pd.engine.attention.triton_decode import _decode_kernel, paged_decode
from pd.engine.attention.triton_kv_write import write_kv
from triton_cases import DEVICE, assert_close, make_case, run_reference, run_triton, step_tensors

DTYPES = ("float32", "bfloat16", "float16")
# no shrinking: each example runs the interpreter (a failure's example is printed as found)
FAST = settings(max_examples=8, deadline=None, derandomize=True, phases=[Phase.explicit, Phase.generate],
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@st.composite
def shapes(draw):
    return dict(num_kv_heads=draw(st.sampled_from([1, 2])), group=draw(st.sampled_from([1, 2, 3, 4, 7, 8])),
                head_dim=draw(st.sampled_from([64, 128])), dtype=draw(st.sampled_from(DTYPES)),
                block_size=draw(st.sampled_from([4, 5, 16])),
                window=draw(st.one_of(st.none(), st.integers(1, 40))))


def _check_layers(case, prompts_for_all: bool = False, layers: tuple[int, ...] = (0, 1)) -> None:
    for layer in layers:
        want, want_pool = run_reference(case, layer, prompts_for_all)
        got, got_pool = run_triton(case, layer, prompts_for_all=prompts_for_all)
        assert torch.equal(got_pool.buffer, want_pool.buffer), "the KV write differs from the reference's"
        assert_close(case, got, want)


@FAST
@given(shape=shapes(), contexts=st.lists(st.integers(0, 90), min_size=1, max_size=4), seed=st.integers(0, 99))
def test_triton_decode_matches_torch_reference(shape, contexts, seed):
    """One new token per sequence after `contexts` earlier tokens: GQA, windows, head sizes, dtypes."""
    case = make_case(**shape, steps=[(c, 1) for c in contexts], seed=seed)
    _check_layers(case)


@FAST
@given(shape=shapes(), chunks=st.lists(st.tuples(st.integers(0, 50), st.integers(1, 24)), min_size=1, max_size=3),
       seed=st.integers(0, 99))
def test_triton_prompt_chunks_match_torch_reference(shape, chunks, seed):
    """Prompt chunks after a prefix already in the pages (a prefix hit or an earlier chunk): varlen, causal."""
    case = make_case(**shape, steps=chunks, seed=seed)
    _check_layers(case, prompts_for_all=True)


@FAST
@given(shape=shapes(), steps=st.lists(st.tuples(st.integers(0, 60), st.sampled_from([1, 1, 5, 17])), min_size=2,
                                      max_size=4), seed=st.integers(0, 99))
def test_triton_mixed_step_matches_torch_reference(shape, steps, seed):
    """A step as the runner sends it: decode tokens through the decode kernel, prompt chunks through the other."""
    case = make_case(**shape, steps=steps, seed=seed)
    _check_layers(case)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", range(1, 9))
def test_triton_prompt_kernel_packs_every_gqa_group(group, head_dim):
    """The prompt kernel's tile holds tokens x a KV head's whole query group: every group 1-8 (row strides
    exact and rounded up to a power of two), chunks longer than a tile after a prefix in the pages, a
    fresh prompt and a one-token chunk, two KV heads; windows, block sizes and dtypes taken in turn."""
    turn = group + head_dim // 64
    dtype, block_size, window = DTYPES[turn % 3], (4, 5, 16)[group % 3], (None, 11)[turn % 2]
    case = make_case(2, group, head_dim, dtype, block_size, window, steps=[(29, 50), (0, 23), (70, 1)], seed=group)
    _check_layers(case, prompts_for_all=True, layers=(0, 1) if window else (0,))  # (without one, 2 alike layers)


@pytest.mark.parametrize("window", [None, 6])
def test_triton_prompt_kernel_small_head_size(window):
    """Head size 16 (the engine tests' tiny models), padded to the dot's minimum."""
    case = make_case(2, 3, 16, "float32", 4, window, steps=[(9, 40), (0, 5)], seed=4)
    _check_layers(case, prompts_for_all=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_prompt_launch_has_one_program_per_kv_head_and_query_tile(monkeypatch, dtype, head_dim):
    """K/V tiles are read once per KV head: the launch is (sequence, query tile, KV head), each program walks
    its keys once for its whole query group, and a tile holds at least MIN_TOKENS tokens whatever the group,
    so the programs of a KV head, and the K/V tiles they read, have one bound whatever the group."""
    torch_dtype = getattr(torch, dtype)
    batch, longest, kv_heads = 3, 200, 2
    programs_per_kv_head = {}
    for group in range(1, 9):
        meta = triton_prefill.prefill_meta(torch_dtype, DEVICE, group, head_dim, 16)
        tokens = triton_prefill.tile_tokens(meta)
        assert tokens >= triton_prefill.MIN_TOKENS and meta["ROWS"] >= tokens * group
        grid = triton_prefill.prefill_grid(batch, longest, kv_heads, meta)
        assert grid == (batch, -(-longest // tokens), kv_heads)
        programs_per_kv_head[group] = grid[0] * grid[1]
        # the launch itself uses that grid (recorded, not run)
        launched: list[tuple] = []
        monkeypatch.setattr(triton_prefill, "launcher", lambda fn, device, seen=launched: _Recorder(seen))
        case = make_case(kv_heads, group, head_dim, dtype, 16, None, steps=[(0, 1)], seed=0)
        layer = case.layout.bind(case.pool).layers[0]
        q = torch.zeros(longest, kv_heads * group, head_dim, dtype=torch_dtype, device=DEVICE)
        table = torch.zeros(batch, 1, dtype=torch.int32, device=DEVICE)
        starts = torch.tensor([0, 1, 2, longest], dtype=torch.int32, device=DEVICE)
        triton_prefill.paged_prefill(q, layer.k, layer.v, table, starts[1:], starts, longest, 1.0)
        assert launched == [grid]
    assert max(programs_per_kv_head.values()) <= batch * -(-longest // triton_prefill.MIN_TOKENS)


class _Recorder:
    def __init__(self, grids: list):
        self.grids = grids

    def __getitem__(self, grid):
        self.grids.append(tuple(grid))
        return lambda *args, **kwargs: None


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_triton_decode_qwen_and_llama_head_sizes(head_dim, dtype):
    """Both model families' head sizes (Qwen2.5-0.5B: 14 q / 2 KV heads of 64; Llama: groups of 4 of 128)."""
    group, kv = (7, 2) if head_dim == 64 else (4, 2)
    case = make_case(kv, group, head_dim, dtype, 16, None, steps=[(0, 1), (17, 1), (63, 1), (100, 1)], seed=3)
    _check_layers(case)


def test_triton_decode_reads_only_the_window_and_the_written_positions():
    """NaN in the null block, in out-of-window pages and in every unwritten page tail leaves the result unchanged."""
    case = make_case(2, 4, 64, "float32", 8, 12, steps=[(3, 1), (30, 1), (41, 1)], seed=5)
    clean, _ = run_triton(case, layer=1)
    poisoned = case.pool
    layout = case.layout
    bound = layout.bind(poisoned)
    bound.token_rows.view(poisoned.num_blocks, -1)[0].fill_(float("nan"))  # the null block
    window = bound.layers[1]
    assert window.window == 12
    meta = step_tensors(case, 1)
    bs = layout.block_size
    for i, seq in enumerate(case.seqs):
        seq_len = int(meta.seq_lens[i])
        for j, block in enumerate(seq.block_ids[1]):
            positions = range(j * bs, (j + 1) * bs)
            for row, pos in enumerate(positions):
                if pos >= seq_len or pos < seq_len - 12:  # after the token or behind the window
                    window.cache[block, :, row].fill_(float("nan"))  # K and V of the window layer
    got, _ = run_triton(case, layer=1, pool=poisoned)
    assert bool(torch.isfinite(got).all())
    torch.testing.assert_close(got, clean, atol=0, rtol=0)


def test_triton_padding_rows_are_harmless():
    """A CUDA-graph bucket's padding rows: slot -1 writes nothing, sequence length 0 yields zeros, not NaN."""
    case = make_case(2, 2, 64, "bfloat16", 16, None, steps=[(5, 1)], seed=7)
    layer = case.layout.bind(case.pool).layers[case.layout.groups[0].layer_indices[0]]
    k_cache, v_cache = layer.k, layer.v
    before = case.pool.buffer.clone()
    write_kv(case.k, case.v, k_cache, v_cache, torch.tensor([-1], device=DEVICE))
    assert torch.equal(case.pool.buffer, before)
    q = torch.randn(3, 4, 64, device=DEVICE).to(torch.bfloat16)
    table = torch.tensor([[1], [0], [0]], dtype=torch.int32, device=DEVICE)
    out = paged_decode(q, k_cache, v_cache, table, torch.tensor([0, 0, 0], device=DEVICE), 0.125)
    assert torch.equal(out, torch.zeros_like(out))


def test_triton_rejects_mismatched_shapes():
    case = make_case(2, 2, 64, "float32", 16, None, steps=[(5, 1)], seed=1)
    layer = case.layout.bind(case.pool).layers[0]
    k_cache, v_cache = layer.k, layer.v
    with pytest.raises(ValueError, match="KV heads"):
        paged_decode(torch.randn(1, 3, 64, device=DEVICE), k_cache, v_cache, torch.ones(1, 1, dtype=torch.int32),
                     torch.ones(1, dtype=torch.int32), 1.0)
    with pytest.raises(ValueError, match="slots"):
        write_kv(case.k, case.v, k_cache, v_cache, torch.empty(0, dtype=torch.long))


@pytest.mark.skipif(DEVICE.type != "cpu", reason="the interpreter runs the CPU suite; CUDA compiles the kernels")
def test_triton_runs_interpreted():
    """The default suite really executes the kernels in Triton's interpreter (no silent skip, no stub)."""
    from triton.runtime.interpreter import InterpretedFunction

    assert knobs.runtime.interpret
    assert isinstance(triton_launch.launcher(_decode_kernel, torch.device("cpu")), InterpretedFunction)


@pytest.mark.parametrize("target_programs", [1, 12, 128], ids=["one split", "two splits", "eight splits"])
def test_split_kv_decode_matches_the_reference_at_every_split_count(monkeypatch, target_programs):
    """Split-KV (decode_splits): long and empty contexts, a window, shares that see no key; one split is the
    single-program path, the others go through the reduce kernel."""
    from pd.engine.attention import triton_decode

    monkeypatch.setattr(triton_decode, "TARGET_PROGRAMS", target_programs)
    case = make_case(num_kv_heads=2, group=3, head_dim=64, dtype="float32", block_size=5, window=23,
                     steps=[(0, 1), (150, 1), (7, 1)], seed=11)
    splits = triton_decode.decode_splits(len(case.seqs), 2)
    assert splits == {1: 1, 12: 2, 128: 8}[target_programs]
    _check_layers(case)
