"""Decode steps as the engine's runner runs them, for the CUDA-graph tests: a small engine (GQA, a
sliding-window layer) with the Triton backend (compiled on CUDA, interpreted on the CPU), its pages
filled with random earlier context, and random decode chunks over distinct blocks."""
from __future__ import annotations

import random

import torch

from pd.engine.config import EngineConfig
from pd.engine.engine import Engine
from pd.engine.model.config import ModelConfig
from pd.engine.sched.output import ScheduledChunk

SMALL = ModelConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
                    head_dim=16, layer_types=("full_attention", "sliding_attention"), sliding_window=6,
                    bos_token_id=None, eos_token_id=None)


def decode_engine(device: str, cuda_graphs: bool = True, max_num_seqs: int = 16, dtype: str = "float32",
                  backend: str = "triton") -> Engine:
    """An engine over SMALL whose pages hold random K/V (the earlier context of `random_chunks`)."""
    eng = Engine(EngineConfig(model=SMALL, seed=0, block_size=4, num_blocks=96, max_num_seqs=max_num_seqs,
                              max_num_batched_tokens=64, max_model_len=32, device=device, dtype=dtype,
                              attention_backend=backend, cuda_graphs=cuda_graphs))
    rows = eng.runner.kv.token_rows
    gen = torch.Generator().manual_seed(1)
    rows.copy_(torch.randn(rows.shape, generator=gen).to(rows.dtype))
    return eng


def random_chunks(eng: Engine, num_seqs: int, seed: int) -> list[ScheduledChunk]:
    """Decode chunks with contexts of 1..20 tokens (the new one included) over distinct blocks per group."""
    rng = random.Random(seed)
    bs = eng.layout.block_size
    free = list(range(1, eng.page_pool.num_blocks))
    rng.shuffle(free)
    chunks = []
    for i in range(num_seqs):
        n = rng.randint(1, 20)
        tables = tuple([free.pop() for _ in range((n + bs - 1) // bs)] for _ in eng.layout.groups)
        chunks.append(ScheduledChunk(f"r{i}", [rng.randrange(SMALL.vocab_size)], n - 1, tables, True))
    return chunks
