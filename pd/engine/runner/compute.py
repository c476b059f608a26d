"""What computes an engine's steps: the model, its KV layout, the page pool and the runner, for one
process (today's path) or for rank 0 of a tensor-parallel gang.

One process: the model (a checkpoint, or seeded random weights), its layout, a pool of
`num_blocks` (or as many as `kv_cache_bytes` holds) and a `ModelRunner` with the configured backend.

Rank 0 of a gang (`tp`, a group of more than one rank): its shard, its local layout (its KV heads
only) and a pool of the gang's common size (`pd.engine.parallel.sharded_model.setup_rank`), and a
`TPModelRunner` that sends each step's plan to the other ranks (pd/engine/parallel/follower.py) before
its own forward. v1 limits: attention `auto` is torch on the CPU (`fused` is refused) and triton on
CUDA, without CUDA graphs.

`canonical_layout` is always the TP 1 layout of the full model: what the block manager, the wire and
the compatibility hash describe, whatever the TP degree.
"""
from __future__ import annotations

import dataclasses

from pd.engine.attention.metadata import StepCapacity
from pd.engine.config import EngineConfig
from pd.engine.kv.layout import KVLayout
from pd.engine.kv.page_pool import PagePool
from pd.engine.model.checkpoint import load_checkpoint
from pd.engine.model.config import ModelConfig
from pd.engine.model.llama import build_model
from pd.engine.parallel.group import TPGroup
from pd.engine.parallel.sharded_model import model_config_of, setup_rank, tp_backend
from pd.engine.parallel.tp import TPShape
from pd.engine.runner.model_runner import ModelRunner, RunnerOptions
from pd.engine.runner.tp_runner import TPModelRunner
from kvcache.specs import cdiv


@dataclasses.dataclass
class Compute:
    """`model_config`: the full model's; `layout`, `page_pool`: this process's (a rank's heads only at
    TP > 1); `gang`: the runner again where it is a gang's rank 0, else None."""

    model_config: ModelConfig
    layout: KVLayout
    canonical_layout: KVLayout
    tp_shape: TPShape | None
    page_pool: PagePool
    runner: ModelRunner
    gang: TPModelRunner | None


def step_capacity(config: EngineConfig) -> StepCapacity:
    return StepCapacity(config.max_num_batched_tokens, config.max_num_seqs,
                        cdiv(config.resolved_max_model_len, config.block_size))


def build_compute(config: EngineConfig, shareable_pool: bool, tp: TPGroup | None = None) -> Compute:
    """The engine's model, layout, pool and runner; at TP > 1 rank 0's (collectives with the gang)."""
    if tp is not None and tp.world_size > 1:
        rank = setup_rank(config, tp)
        pool = PagePool(rank.num_blocks, rank.layout.page_size_bytes, device=config.device, shareable=shareable_pool)
        gang = TPModelRunner(rank.model, rank.layout, pool, tp_backend(config.attention_backend, config.device),
                             step_capacity(config), config.tokenizer_vocab_size,
                             RunnerOptions(False, config.device_sampler), group=tp)
        return Compute(rank.model_config, rank.layout, rank.canonical_layout, rank.shape, pool, gang, gang)
    if config.model_path:
        model = load_checkpoint(config.model_path, dtype=config.dtype, device=config.device)
    else:
        model = build_model(model_config_of(config), seed=config.seed, device=config.device)
    layout = KVLayout(model.config, config.block_size)
    num_blocks = config.num_blocks or layout.num_blocks_for_budget(config.kv_cache_bytes)
    pool = PagePool(num_blocks, layout.page_size_bytes, device=config.device, shareable=shareable_pool)
    model_config = model.config
    runner = ModelRunner(model, layout, pool, config.attention_backend, step_capacity(config),
                         config.tokenizer_vocab_size, RunnerOptions(config.cuda_graphs, config.device_sampler))
    del model  # the runner holds the backend's model; a backend's own copy must be the only one alive
    return Compute(model_config, layout, layout, None, pool, runner, None)
