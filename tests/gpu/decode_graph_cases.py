"""A decode forward over `DecodeBuffers`, as the CUDA-graph runner replays it: a small model whose layers
write K/V and attend through the Triton kernels (on CUDA) or their torch reference (on the CPU), reading
every input from the persistent buffers."""
from __future__ import annotations

import dataclasses
import random

import torch

from pd.engine.attention import triton_reference
from pd.engine.kv.layout import KVLayout
from pd.engine.kv.page_pool import PagePool
from pd.engine.model.config import ModelConfig
from pd.engine.model.llama import CausalLM, build_model
from pd.engine.runner.cuda_graphs import DecodeBatch, DecodeBuffers

SMALL = ModelConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
                    head_dim=16, layer_types=("full_attention", "sliding_attention"), sliding_window=6,
                    bos_token_id=None, eos_token_id=None)


class BufferDecodeAttention:
    """Attention for rows [0, n) of the buffers: KV write, then paged decode, per layer."""

    def __init__(self, layout: KVLayout, pool: PagePool, buffers: DecodeBuffers, use_triton: bool):
        self.layout, self.buffers = layout, buffers
        # One base for every layer's K/V (the pool as token rows, see KVLayout.token_rows), sliced per layer
        # inside the forward: views of one tensor are what torch.compile can trace mutations through.
        self.pages = layout.token_rows(pool).view(pool.num_blocks, layout.rows_per_page, layout.num_kv_heads,
                                                  layout.head_dim)
        if use_triton:
            from pd.engine.attention.triton_decode import paged_decode
            from pd.engine.attention.triton_kv_write import write_kv
            self.write, self.decode = write_kv, paged_decode
        else:
            self.write, self.decode = triton_reference.write_kv_reference, triton_reference.paged_decode_reference

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, metadata: object) -> torch.Tensor:
        g, _ = self.layout.layer_to_group[layer]
        n = q.shape[0]
        _, slot = self.layout.layer_to_group[layer]
        bs = self.layout.block_size
        k_cache = self.pages[:, 2 * slot * bs:(2 * slot + 1) * bs]  # the same strided views as layer_kv_views
        v_cache = self.pages[:, (2 * slot + 1) * bs:(2 * slot + 2) * bs]
        self.write(k, v, k_cache, v_cache, self.buffers.slot_mapping[g, :n])
        return self.decode(q, k_cache, v_cache, self.buffers.block_tables[g, :n], self.buffers.seq_lens[:n],
                           self.layout.head_dim ** -0.5, self.layout.groups[g].window)


@dataclasses.dataclass
class DecodeSetup:
    model: CausalLM
    layout: KVLayout
    pool: PagePool
    buffers: DecodeBuffers
    attention: BufferDecodeAttention

    def forward(self, n: int) -> torch.Tensor:
        """The decode forward of rows [0, n); call it under torch.no_grad(). (It calls the model's forward
        without its inference_mode decorator: torch.compile cannot trace through inference mode.)"""
        b = self.buffers
        return CausalLM.forward.__wrapped__(self.model, b.token_ids[:n], b.positions[:n], self.attention, None)


def decode_setup(device: str, use_triton: bool, max_num_seqs: int = 16, block_size: int = 4,
                 num_blocks: int = 96, dtype: str = "float32") -> DecodeSetup:
    cfg = dataclasses.replace(SMALL, dtype=dtype)
    model = build_model(cfg, seed=0, device=device)
    layout = KVLayout(cfg, block_size)
    pool = PagePool(num_blocks, layout.page_size_bytes, device=device, shareable=False)
    gen = torch.Generator().manual_seed(1)
    for view in layout.group_views(pool):  # earlier context: random K/V
        view.copy_(torch.randn(view.shape, generator=gen).to(view.dtype))
    buffers = DecodeBuffers(max_num_seqs, 8, len(layout.groups), device)
    return DecodeSetup(model, layout, pool, buffers, BufferDecodeAttention(layout, pool, buffers, use_triton))


def random_batch(setup: DecodeSetup, num_seqs: int, seed: int) -> DecodeBatch:
    """Sequences with contexts of 1..20 tokens over distinct blocks (1..num_blocks-1) per group."""
    rng = random.Random(seed)
    bs = setup.layout.block_size
    groups = len(setup.layout.groups)
    free = list(range(1, setup.pool.num_blocks))
    rng.shuffle(free)
    lens = [rng.randint(1, 20) for _ in range(num_seqs)]
    tables = [[[free.pop() for _ in range((n + bs - 1) // bs)] for n in lens] for _ in range(groups)]
    slots = [[tables[g][i][(n - 1) // bs] * bs + (n - 1) % bs for i, n in enumerate(lens)] for g in range(groups)]
    return DecodeBatch(token_ids=[rng.randrange(setup.model.config.vocab_size) for _ in lens],
                       positions=[n - 1 for n in lens], seq_lens=lens, slot_mapping=slots, block_tables=tables)
