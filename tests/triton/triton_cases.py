"""Steps over a real page pool, run through the torch reference and through the Triton kernels.

A case is a KV layout (one full-attention layer and, with a window, one
sliding-window layer, so the pool has two groups as Mistral/Qwen2 models do),
a pool filled with random bytes-as-values, per-group block tables and one
step's sequences (start, new tokens). A step runs as the runner will run it:
the KV write, then the decode kernel for single-token sequences and the prompt
kernel for the others, on the layer's strided page views as they are, either
through the Triton kernels (`run_triton`) or through their torch reference
(`run_reference`, pd/engine/attention/triton_reference.py, itself checked
against `masked_attention` over contiguous K/V in test_triton_reference.py).
"""
from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable

import torch
from triton import knobs

from pd.engine.attention.triton_decode import paged_decode
from pd.engine.attention.triton_kv_write import write_kv
from pd.engine.attention.triton_prefill import paged_prefill
from pd.engine.attention.triton_reference import paged_decode_reference, paged_prefill_reference, write_kv_reference
from pd.engine.kv.layout import KVLayout
from pd.engine.kv.page_pool import PagePool
from pd.engine.model.config import ModelConfig

# Interpreted on the CPU (the default suite, no CUDA); compiled on the GPU where CUDA is there.
DEVICE = torch.device("cpu" if knobs.runtime.interpret or not torch.cuda.is_available() else "cuda")
TOLERANCE = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


@dataclasses.dataclass(frozen=True)
class SeqSlice:
    """The tokens one sequence computes this step: positions [start, start + num_tokens)."""

    start: int
    num_tokens: int
    block_ids: tuple[list[int], ...]  # per KV cache group, the sequence's whole block table


@dataclasses.dataclass(frozen=True)
class Kernels:
    write: Callable
    decode: Callable
    prefill: Callable


TRITON = Kernels(write_kv, paged_decode, paged_prefill)
REFERENCE = Kernels(write_kv_reference, paged_decode_reference,
                    lambda q, kc, vc, table, lens, starts, _max_len, scale, window:
                    paged_prefill_reference(q, kc, vc, table, lens, starts, scale, window))


@dataclasses.dataclass
class Case:
    layout: KVLayout
    seqs: list[SeqSlice]
    pool: PagePool
    q: torch.Tensor  # (T, Hq, D)
    k: torch.Tensor  # (T, Hkv, D)
    v: torch.Tensor

    @property
    def dtype(self) -> torch.dtype:
        return self.layout.dtype


def make_case(num_kv_heads: int, group: int, head_dim: int, dtype: str, block_size: int, window: int | None,
              steps: list[tuple[int, int]], seed: int, drop_evicted: bool = True) -> Case:
    """`steps`: per sequence (start, num_tokens). Blocks wholly behind a window hold the null block 0."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    layer_types = ("full_attention", "sliding_attention") if window else None
    cfg = ModelConfig(vocab_size=32, hidden_size=num_kv_heads * group * head_dim, intermediate_size=8, num_layers=2,
                      num_heads=num_kv_heads * group, num_kv_heads=num_kv_heads, head_dim=head_dim,
                      layer_types=layer_types, sliding_window=window, dtype=dtype)
    layout = KVLayout(cfg, block_size)
    need = [(start + n + block_size - 1) // block_size for start, n in steps]
    per_group = sum(need) + 1
    num_blocks = 1 + per_group * len(layout.groups)
    pool = PagePool(num_blocks, layout.page_size_bytes, device=DEVICE, shareable=False)
    rows = layout.bind(pool).token_rows  # old context: random values everywhere
    rows.copy_(torch.randn(rows.shape, generator=gen).to(rows.dtype))
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    seqs = []
    for (start, n), blocks in zip(steps, need, strict=True):
        tables = []
        for grp in layout.groups:
            table = [free.pop() for _ in range(blocks)]
            if grp.window is not None and drop_evicted:
                oldest_seen = max(start - grp.window + 1, 0)
                table = [0 if (j + 1) * block_size <= oldest_seen else b for j, b in enumerate(table)]
            tables.append(table)
        seqs.append(SeqSlice(start, n, tuple(tables)))
    total = sum(n for _, n in steps)
    hq = num_kv_heads * group

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen).to(cfg.torch_dtype).to(DEVICE)

    return Case(layout, seqs, pool, rand(total, hq, head_dim), rand(total, num_kv_heads, head_dim),
                rand(total, num_kv_heads, head_dim))


def clone_pool(pool: PagePool) -> PagePool:
    copy = PagePool(pool.num_blocks, pool.page_size_bytes, device=pool.device, shareable=False)
    copy.buffer.copy_(pool.buffer)
    return copy


@dataclasses.dataclass
class StepTensors:
    """The step's metadata as the kernels take it, per group (on the device)."""

    slot_mapping: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    query_start: torch.Tensor


def step_tensors(case: Case, group: int) -> StepTensors:
    bs = case.layout.block_size
    width = max(len(s.block_ids[group]) for s in case.seqs)
    table = torch.tensor([s.block_ids[group] + [0] * (width - len(s.block_ids[group])) for s in case.seqs])
    slots = [table[i, p // bs].item() * bs + p % bs
             for i, s in enumerate(case.seqs) for p in range(s.start, s.start + s.num_tokens)]
    starts = [0]
    for s in case.seqs:
        starts.append(starts[-1] + s.num_tokens)
    return StepTensors(torch.tensor(slots, device=DEVICE), table.to(torch.int32).to(DEVICE),
                       torch.tensor([s.start + s.num_tokens for s in case.seqs], dtype=torch.int32, device=DEVICE),
                       torch.tensor(starts, dtype=torch.int32, device=DEVICE))


def run_reference(case: Case, layer: int, prompts_for_all: bool = False) -> tuple[torch.Tensor, PagePool]:
    return run_triton(case, layer, prompts_for_all=prompts_for_all, kernels=REFERENCE)


def run_triton(case: Case, layer: int, pool: PagePool | None = None, prompts_for_all: bool = False,
               kernels: Kernels = TRITON) -> tuple[torch.Tensor, PagePool]:
    """KV write, then decode for 1-token sequences and prompt attention for the rest (or prompts for all)."""
    pool = clone_pool(case.pool) if pool is None else pool
    bound = case.layout.bind(pool).layers[layer]
    g, window, k_cache, v_cache = bound.group, bound.window, bound.k, bound.v
    meta = step_tensors(case, g)
    kernels.write(case.k, case.v, k_cache, v_cache, meta.slot_mapping)
    scale = case.layout.head_dim ** -0.5
    out = torch.full_like(case.q, float("nan"))
    decode = [i for i, s in enumerate(case.seqs) if s.num_tokens == 1 and not prompts_for_all]
    prompts = [i for i in range(len(case.seqs)) if i not in decode]
    starts = meta.query_start.tolist()
    if decode:
        idx = torch.tensor(decode, device=DEVICE)
        rows = torch.tensor([starts[i] for i in decode], device=DEVICE)
        out[rows] = kernels.decode(case.q[rows], k_cache, v_cache, meta.block_table[idx], meta.seq_lens[idx], scale,
                                 window)
    if prompts:
        idx = torch.tensor(prompts, device=DEVICE)
        rows = torch.cat([torch.arange(starts[i], starts[i + 1], device=DEVICE) for i in prompts])
        lens = [starts[i + 1] - starts[i] for i in prompts]
        q_start = torch.tensor([0, *lens], device=DEVICE).cumsum(0).to(torch.int32)
        out[rows] = kernels.prefill(case.q[rows], k_cache, v_cache, meta.block_table[idx], meta.seq_lens[idx], q_start,
                                  max(lens), scale, window)
    return out, pool


def assert_close(case: Case, got: torch.Tensor, want: torch.Tensor) -> None:
    tol = TOLERANCE[case.dtype]
    assert bool(torch.isfinite(got).all()), "the kernel left a row unwritten or produced a non-finite value"
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
