"""One rank's shard of a Llama model, and everything a rank of a TP gang sets up before its first step.

The shard is the model of pd/engine/model/llama.py built over a config with the rank's part of the
model (`local_config`: its query heads, its KV heads, its share of the MLP width; the hidden size,
vocabulary, norms and RoPE unchanged), holding exactly the slices of `layers.py`'s rule:

- q/k/v (the fused `qkv_proj`): column-parallel by query heads and by KV heads, a KV head replicated
  on its owners when TP exceeds the KV heads (`tp.py`); gate/up (`gate_up_proj`): column-parallel;
- o_proj and down_proj: row-parallel, their partial outputs summed over the group
  (`Attention.reduce` / `MLP.reduce`: gloo on the CPU, NCCL on CUDA, the same call);
- embeddings, norms and RoPE: replicated; the final norm too (it is cheap, and every rank's forward
  stays the model's own), the LM head on rank 0 only: only rank 0 computes logits and samples, and on a
  large vocabulary the head is the biggest single tensor a follower would otherwise hold for nothing.

Random weights: the full seeded model is built and narrowed, so a rank's weights are exactly TP 1's
(TP N and TP 1 can be compared token for token). A checkpoint: each rank reads only its slices
(`fill_from_checkpoint` with safetensors' `get_slice`).

`setup_rank` is what rank 0's engine and every follower do identically, in the same order (the
group's collectives must match): check the TP degree against the model, build the shard and the
rank's KV layout, and agree on the pool size (the smallest over the ranks).
"""
from __future__ import annotations

import dataclasses
import logging

import torch
from torch import nn

from pd.engine.config import EngineConfig
from pd.engine.kv.layout import KVLayout
from pd.engine.model.checkpoint import fill_from_checkpoint, load_config
from pd.engine.model.config import ModelConfig
from pd.engine.model.llama import CausalLM, build_model
from pd.engine.parallel.group import TPGroup
from pd.engine.parallel.head_slices import rank_layout
from pd.engine.parallel.layers import Slice, attention_slices, mlp_slices
from pd.engine.parallel.tp import TPShape

log = logging.getLogger(__name__)


class _NoHead(nn.Module):
    """A follower's LM head: it holds no weights and computes no logits (rank 0 does)."""

    def __init__(self, rank: int):
        super().__init__()
        self.rank = rank

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        raise RuntimeError(f"TP rank {self.rank} holds no LM head: only rank 0 computes logits")


def local_config(cfg: ModelConfig, shape: TPShape) -> ModelConfig:
    """The config of one rank's shard (the same for every rank)."""
    if cfg.intermediate_size % shape.tp:
        raise ValueError(f"{shape.role} TP {shape.tp} and an MLP intermediate size of {cfg.intermediate_size}: "
                         "TP must divide the intermediate size")
    return dataclasses.replace(cfg, num_heads=cfg.num_heads // shape.tp, num_kv_heads=shape.heads_per_rank,
                               head_dim=cfg.resolved_head_dim, intermediate_size=cfg.intermediate_size // shape.tp)


def weight_slice(name: str, cfg: ModelConfig, shape: TPShape, rank: int) -> Slice | None:
    """The part of the full tensor `name` (HF names) rank `rank` holds; None: all of it (replicated)."""
    parts = name.split(".")
    if len(parts) < 3:
        return None
    module, kind = parts[-2], parts[-1]
    if module in ("q_proj", "k_proj", "v_proj", "o_proj") and ".self_attn." in name:
        key = module[0] if kind == "weight" else f"{module[0]}_bias"
        return attention_slices(shape, cfg.resolved_head_dim, rank)[key]
    if module in ("gate_proj", "up_proj", "down_proj") and ".mlp." in name and kind == "weight":
        return mlp_slices(cfg.intermediate_size, rank, shape.tp)[module.split("_")[0]]
    return None


def _empty_shard(cfg: ModelConfig, shape: TPShape, rank: int) -> CausalLM:
    model = CausalLM(local_config(cfg, shape))
    if rank != 0:
        model.lm_head = _NoHead(rank)  # type: ignore[assignment]  # (compute_logits is rank 0's only)
    return model


def shard_of(full: CausalLM, shape: TPShape, rank: int) -> CausalLM:
    """Rank `rank`'s shard of `full`, weights copied (the full model can be dropped)."""
    cfg = full.config
    model = _empty_shard(cfg, shape, rank)
    wanted = model.state_dict(keep_vars=True)
    state = {}
    for name, tensor in full.state_dict().items():
        if name in wanted:
            piece = weight_slice(name, cfg, shape, rank)
            state[name] = tensor if piece is None else piece.take(tensor)
    model.load_state_dict(state, strict=True)
    return model.requires_grad_(False)


def build_shard(config: EngineConfig, shape: TPShape, rank: int) -> CausalLM:
    """Rank `rank`'s shard of the engine's model (random: the seeded full model narrowed; a checkpoint:
    only this rank's slices read), on the engine's device, with no group attached yet."""
    if config.model_path:
        cfg = load_config(config.model_path, config.dtype)
        model = _empty_shard(cfg, shape, rank)
        with torch.device("meta"):  # the full tensors' shapes, without their memory
            full_shapes = {n: tuple(t.shape) for n, t in CausalLM(cfg).state_dict().items()}

        def slice_of(name: str) -> tuple[int, int, int] | None:
            piece = weight_slice(name, cfg, shape, rank)
            return None if piece is None else (piece.dim, piece.start, piece.stop)

        fill_from_checkpoint(config.model_path, model, full_shapes, slice_of)
    else:
        cfg = config.model if config.dtype is None else dataclasses.replace(config.model, dtype=config.dtype)
        model = shard_of(build_model(cfg, seed=config.seed), shape, rank)
    return model.requires_grad_(False).to(device=config.device, dtype=cfg.torch_dtype).eval()


def attach_group(model: CausalLM, group: TPGroup) -> CausalLM:
    """Makes `model`'s row-parallel outputs (o_proj, down_proj) sums over `group`'s ranks."""
    for layer in model.model.layers:
        layer.self_attn.reduce = group.all_reduce
        layer.mlp.reduce = group.all_reduce
    return model


def model_config_of(config: EngineConfig) -> ModelConfig:
    """The full model's config (what TP 1 runs), without loading weights."""
    if config.model_path:
        return load_config(config.model_path, config.dtype)
    return config.model if config.dtype is None else dataclasses.replace(config.model, dtype=config.dtype)


@dataclasses.dataclass
class RankSetup:
    """What one rank of a gang holds before its first step. `model_config` and `canonical_layout`
    describe the full model (TP 1); `model` and `layout` this rank's shard and pages."""

    shape: TPShape
    model_config: ModelConfig
    model: CausalLM
    layout: KVLayout
    canonical_layout: KVLayout
    num_blocks: int


def setup_rank(config: EngineConfig, group: TPGroup, role: str = "worker") -> RankSetup:
    """Checks the TP degree against the model (both numbers named), builds this rank's shard and KV
    layout, and agrees with the other ranks on the pool size (one collective: every rank calls this
    once, in the same order relative to the group's other collectives)."""
    cfg = model_config_of(config)
    shape = TPShape(group.world_size, cfg.num_kv_heads, cfg.num_heads, role=role)
    local_config(cfg, shape)  # (refuses an MLP width TP does not divide)
    if group.world_size > 1 and config.attention_backend == "fused":
        raise ValueError(f"attention_backend 'fused' cannot run with TP {group.world_size}: the CPU step executor "
                         "runs the whole layer stack in one C++ call, with no place for the all-reduce after "
                         "o_proj and down_proj; use 'auto' (torch on the CPU) or 'torch'")
    if group.world_size > 1 and config.kv_audit_rate > 0:
        raise ValueError(f"kv_audit_rate {config.kv_audit_rate} with TP {group.world_size}: the KV audit recomputes "
                         "a block on rank 0 alone, which a sharded model cannot do; set it to 0")
    model = attach_group(build_shard(config, shape, group.rank), group)
    canonical = KVLayout(cfg, config.block_size)
    layout = rank_layout(canonical, shape.tp)
    mine = config.num_blocks or layout.num_blocks_for_budget(config.kv_cache_bytes)
    num_blocks = group.min_int(mine)
    log.info("TP rank %d/%d: KV heads %s, %d KV blocks of %d bytes (this rank could hold %d)", group.rank,
             shape.tp, list(shape.heads_of(group.rank)), num_blocks, layout.page_size_bytes, mine)
    return RankSetup(shape, cfg, model, layout, canonical, num_blocks)


def tp_backend(choice: str, device: torch.device | str) -> str:
    """The attention backend choice at TP > 1: `auto` means torch on the CPU (the fused CPU executor
    cannot all-reduce mid-stack) and stays `auto` on CUDA (triton where it runs)."""
    if choice == "auto" and torch.device(device).type == "cpu":
        return "torch"
    return choice
