"""A worker's share of one GPU: how many workers a GPU holds, and the KV page pool that fits the share.

`topology.gpus_per_worker` (the share, s in (0, 1]) is both what each worker asks Ray for and the
memory it may fill: s x the GPU's total memory holds the worker's weights, its activation reserve
and its KV page pool. Workers whose shares add up to at most 1 therefore fit on one GPU together
(P and D at 0.5 each), and a worker that would overflow its share fails at start with the numbers,
before it allocates anything, instead of running the GPU's other tenant out of memory later.

The pool's size:
- `topology.gpu_memory_fraction` = f set: the pool is f x s x GPU memory, less the weights and the
  reserve (f < 1 leaves headroom for what the reserve does not foresee);
- unset: the pool is `cache.kv_memory_mb`, checked to fit beside the weights and the reserve.

Guarantees: the arithmetic is pure (no torch at import; `worker_kv_cache_bytes` asks CUDA for the
GPU's size only on a cuda worker); a plan either fits its budget or raises `GpuShareError` naming the
budget, the weights, the reserve and the setting to change; a pool always holds at least one
`scheduler.max_model_len` request.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from typing import TYPE_CHECKING, Any

from pd.engine.sample.params import SAMPLER_BYTES_PER_LOGIT  # (no torch there)

if TYPE_CHECKING:  # torch-heavy: imported where a worker really sizes its pool
    from pd.cluster.config import DeployConfig
    from pd.engine.model.config import ModelConfig

logger = logging.getLogger(__name__)

MIB = 1024 * 1024
GIB = 1024 * MIB
# a CUDA context, cuBLAS / Triton workspaces and decode CUDA graphs: what torch's allocator never shows
CONTEXT_RESERVE_BYTES = GIB
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_EPS = 1e-9


class GpuShareError(ValueError):
    """A worker's weights, reserve and KV pool do not fit its share of the GPU."""


def workers_per_gpu(share: float) -> int:
    """How many workers of this share one GPU holds (Ray never splits a share over two GPUs)."""
    return max(1, math.floor(1.0 / share + _EPS))


def gpus_needed(num_workers: int, share: float) -> float:
    """The GPUs `num_workers` workers of `share` each need: whole GPUs packed with as many as fit."""
    if share >= 1.0:
        return num_workers * share
    return float(math.ceil(num_workers / workers_per_gpu(share)))


def weight_bytes(model: ModelConfig) -> int:
    """The bytes of the model's parameters in its serving dtype (embeddings, layers, norms, head)."""
    head_dim = model.resolved_head_dim
    q_dim, kv_dim = model.num_heads * head_dim, model.num_kv_heads * head_dim
    attention = model.hidden_size * (q_dim + 2 * kv_dim) + q_dim * model.hidden_size
    if model.attention_bias:
        attention += q_dim + 2 * kv_dim
    mlp = 3 * model.hidden_size * model.intermediate_size
    per_layer = attention + mlp + 2 * model.hidden_size  # two RMS norms
    embeddings = model.vocab_size * model.hidden_size * (1 if model.tie_word_embeddings else 2)
    count = embeddings + model.num_layers * per_layer + model.hidden_size  # final norm
    return count * _DTYPE_BYTES[model.dtype]


def activation_reserve_bytes(model: ModelConfig, max_num_batched_tokens: int, max_num_seqs: int) -> int:
    """A step's working memory at its largest, plus the context reserve.

    One layer's activations for `max_num_batched_tokens` tokens (residual, norms, q/k/v, attention out,
    the MLP's three intermediates), twice over for the allocator's double buffering, and the logits of
    `max_num_seqs` rows (the head's output and its float32 copy) with the sampler's temporaries
    (`SAMPLER_BYTES_PER_LOGIT`)."""
    head_dim = model.resolved_head_dim
    width = 4 * model.hidden_size + 2 * model.num_heads * head_dim + 2 * model.num_kv_heads * head_dim \
        + 3 * model.intermediate_size
    layer = max_num_batched_tokens * width * _DTYPE_BYTES[model.dtype]
    logits = max_num_seqs * model.vocab_size * (_DTYPE_BYTES[model.dtype] + 4 + SAMPLER_BYTES_PER_LOGIT)
    return 2 * layer + logits + CONTEXT_RESERVE_BYTES


def kv_bytes_per_token(model: ModelConfig) -> int:
    """K and V of one token over every layer (an upper bound for sliding-window layers)."""
    return model.num_layers * 2 * model.num_kv_heads * model.resolved_head_dim * _DTYPE_BYTES[model.dtype]


@dataclasses.dataclass(frozen=True)
class GpuBudget:
    """What a worker may fill: `share` of a GPU of `gpu_bytes`, of which `memory_fraction` (None: all)."""

    gpu_bytes: int
    share: float
    memory_fraction: float | None = None

    @property
    def share_bytes(self) -> int:
        return int(self.gpu_bytes * self.share)


@dataclasses.dataclass(frozen=True)
class WorkerFootprint:
    """What a worker holds besides its KV pool, and the least pool it can serve with."""

    weight_bytes: int
    reserve_bytes: int
    min_pool_bytes: int  # one max_model_len request

    @classmethod
    def of(cls, model: ModelConfig, max_num_batched_tokens: int, max_num_seqs: int,
           max_model_len: int) -> WorkerFootprint:
        return cls(weight_bytes(model), activation_reserve_bytes(model, max_num_batched_tokens, max_num_seqs),
                   kv_bytes_per_token(model) * max_model_len)


@dataclasses.dataclass(frozen=True)
class KVPoolPlan:
    """A worker's memory on its GPU share; `pool_bytes` fits beside the weights and the reserve."""

    budget: GpuBudget
    footprint: WorkerFootprint
    pool_bytes: int

    def describe(self) -> str:
        b, f = self.budget, self.footprint
        source = (f"gpu_memory_fraction {b.memory_fraction:g} of the share" if b.memory_fraction is not None
                  else "cache.kv_memory_mb")
        return (f"GPU share {b.share:g} of {b.gpu_bytes / GIB:.1f} GiB = {b.share_bytes / GIB:.2f} GiB: weights "
                f"{f.weight_bytes / GIB:.2f} GiB, reserve {f.reserve_bytes / GIB:.2f} GiB, KV pool "
                f"{self.pool_bytes / GIB:.2f} GiB ({source})")


def plan_kv_pool(budget: GpuBudget, footprint: WorkerFootprint, kv_memory_bytes: int) -> KVPoolPlan:
    """The pool of a worker on `budget`: derived from the fraction, or `kv_memory_bytes` checked to fit."""
    used = footprint.weight_bytes + footprint.reserve_bytes
    where = (f"the worker's GPU share ({budget.share:g} x {budget.gpu_bytes / GIB:.1f} GiB = "
             f"{budget.share_bytes / GIB:.2f} GiB) holds weights {footprint.weight_bytes / GIB:.2f} GiB and a "
             f"reserve of {footprint.reserve_bytes / GIB:.2f} GiB")
    if budget.memory_fraction is not None:
        usable = int(budget.share_bytes * budget.memory_fraction)
        pool = usable - used
        if pool < footprint.min_pool_bytes:
            raise GpuShareError(
                f"{where}; topology.gpu_memory_fraction {budget.memory_fraction:g} leaves "
                f"{max(pool, 0) / MIB:.0f} MiB for the KV pool, less than one scheduler.max_model_len request "
                f"needs ({footprint.min_pool_bytes / MIB:.0f} MiB): raise gpus_per_worker or gpu_memory_fraction, "
                "or lower max_model_len / max_num_batched_tokens")
        return KVPoolPlan(budget, footprint, pool)
    room = budget.share_bytes - used
    if kv_memory_bytes > room:
        raise GpuShareError(
            f"{where}; cache.kv_memory_mb {kv_memory_bytes / MIB:g} does not fit beside them (at most "
            f"{max(room, 0) // MIB} fits): lower kv_memory_mb, raise topology.gpus_per_worker, or size the pool "
            "from the share with topology.gpu_memory_fraction")
    return KVPoolPlan(budget, footprint, kv_memory_bytes)


def device_memory_bytes() -> int:
    """The total memory of this process's current CUDA device (Ray makes the worker's GPU device 0)."""
    import torch

    from pd.engine.config import check_device

    check_device("cuda")  # the engine's own message when CUDA is missing
    return int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)


def worker_kv_cache_bytes(config: DeployConfig, architecture: dict[str, Any]) -> int:
    """The KV pool bytes of one worker of `config` (`architecture`: its ModelConfig fields, for random weights).

    cpu: `cache.kv_memory_mb`. cuda: planned on this process's GPU by `plan_kv_pool`, logged."""
    kv_memory_bytes = int(config.cache.kv_memory_mb * MIB)
    topo = config.topology
    if topo.device != "cuda":
        return kv_memory_bytes
    from pd.engine.model.checkpoint import load_config
    from pd.engine.model.config import ModelConfig

    model = (load_config(config.model.path, dtype=config.model.dtype) if config.model.path
             else ModelConfig(**architecture))
    sched = config.scheduler
    footprint = WorkerFootprint.of(model, sched.max_num_batched_tokens, sched.max_num_seqs, sched.max_model_len)
    plan = plan_kv_pool(GpuBudget(device_memory_bytes(), topo.gpus_per_worker, topo.gpu_memory_fraction),
                        footprint, kv_memory_bytes)
    logger.info("KV pool: %s", plan.describe())
    return plan.pool_bytes
