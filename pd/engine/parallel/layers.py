"""Tensor-parallel linears and the sharding of a Llama block's weights, on plain weight tensors.

Megatron-style split: a column-parallel linear keeps a slice of the output features (no
communication: each rank computes its part of the output), a row-parallel linear keeps the matching
slice of the input features and all-reduces its partial output (the bias, if any, is added once,
after the sum). A Llama block uses them as

- attention: q_proj column-parallel by query heads, k_proj / v_proj by KV heads (split, or
  replicated when TP exceeds the KV heads, by the rule in `tp.py`), o_proj row-parallel by query
  heads: each rank attends with its own query heads and the KV heads they map to;
- MLP: gate_proj / up_proj column-parallel, down_proj row-parallel.

Weights are in `torch.nn.Linear`'s (out_features, in_features) layout. The slicing rule is given
as ranges (`attention_slices`, `mlp_slices`) so a checkpoint loader can read only a rank's slice of
each tensor; `shard_attention` / `shard_mlp` apply it to full tensors (random models). A fused
q/k/v or gate/up weight is the concatenation of a rank's slices, built after sharding.
"""
from __future__ import annotations

import dataclasses
from typing import Protocol

import torch
import torch.nn.functional as F

from pd.engine.parallel.tp import TPShape


class Reducer(Protocol):
    world_size: int

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor: ...


@dataclasses.dataclass(frozen=True)
class Slice:
    """Rows `start:stop` along `dim` of a full weight (dim 0: output features, dim 1: input features)."""

    dim: int
    start: int
    stop: int

    def take(self, full: torch.Tensor) -> torch.Tensor:
        if full.shape[self.dim] < self.stop:
            raise ValueError(f"a weight of shape {tuple(full.shape)} has no rows {self.start}:{self.stop} "
                             f"along dim {self.dim}")
        # a copy: a rank must not keep the full tensor alive through a view
        return full.narrow(self.dim, self.start, self.stop - self.start).clone(memory_format=torch.contiguous_format)


def even_slice(size: int, rank: int, tp: int, dim: int, what: str) -> Slice:
    """Rank `rank`'s equal part of `size` features along `dim`."""
    if size % tp:
        raise ValueError(f"TP {tp} does not divide {what} ({size})")
    per = size // tp
    return Slice(dim, rank * per, (rank + 1) * per)


def column_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """This rank's slice of the output features (weight and bias already sliced by output rows)."""
    return F.linear(x, weight, bias)


def row_parallel_linear(x: torch.Tensor, weight: torch.Tensor, group: Reducer | None,
                        bias: torch.Tensor | None = None) -> torch.Tensor:
    """The full output from this rank's slice of the input features: partial products summed over the
    group, then the (full, unsliced) bias added once."""
    out = F.linear(x, weight)
    if group is not None and group.world_size > 1:
        out = group.all_reduce(out.contiguous())
    return out if bias is None else out + bias


@dataclasses.dataclass(frozen=True)
class AttentionWeights:
    """q/k/v/o projections of one attention layer (full, or one rank's slices)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor
    q_bias: torch.Tensor | None = None
    k_bias: torch.Tensor | None = None
    v_bias: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None


@dataclasses.dataclass(frozen=True)
class MLPWeights:
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor


def attention_slices(shape: TPShape, head_dim: int, rank: int) -> dict[str, Slice | None]:
    """Per weight of `AttentionWeights`, the slice rank `rank` holds (None: the whole tensor)."""
    if shape.num_heads is None:
        raise ValueError("sharding attention needs the query heads: build the TPShape with num_heads")
    q_heads, kv_heads = shape.query_heads_of(rank), shape.heads_of(rank)
    q_rows = Slice(0, q_heads.start * head_dim, q_heads.stop * head_dim)
    kv_rows = Slice(0, kv_heads.start * head_dim, kv_heads.stop * head_dim)
    return {"q": q_rows, "k": kv_rows, "v": kv_rows, "o": Slice(1, q_rows.start, q_rows.stop),
            "q_bias": q_rows, "k_bias": kv_rows, "v_bias": kv_rows, "o_bias": None}


def mlp_slices(intermediate_size: int, rank: int, tp: int) -> dict[str, Slice]:
    rows = even_slice(intermediate_size, rank, tp, 0, "the MLP's intermediate size")
    return {"gate": rows, "up": rows, "down": Slice(1, rows.start, rows.stop)}


def _check(name: str, tensor: torch.Tensor, want: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != want:
        raise ValueError(f"{name} has shape {tuple(tensor.shape)}, the model's shape needs {want}")


def shard_attention(full: AttentionWeights, shape: TPShape, head_dim: int, rank: int) -> AttentionWeights:
    """Rank `rank`'s slices of a full attention layer (KV rows replicated on a head's owners)."""
    hidden = full.q.shape[1]
    q_out, kv_out = (shape.num_heads or 0) * head_dim, shape.num_kv_heads * head_dim
    for name, want in (("q", (q_out, hidden)), ("k", (kv_out, hidden)), ("v", (kv_out, hidden)),
                       ("o", (full.o.shape[0], q_out))):
        _check(name, getattr(full, name), want)
    slices = attention_slices(shape, head_dim, rank)
    parts = {}
    for name, piece in slices.items():
        tensor = getattr(full, name)
        parts[name] = tensor if tensor is None or piece is None else piece.take(tensor)
    return AttentionWeights(**parts)


def shard_mlp(full: MLPWeights, rank: int, tp: int) -> MLPWeights:
    """Rank `rank`'s slices of a full MLP."""
    intermediate, hidden = full.gate.shape
    _check("up", full.up, (intermediate, hidden))
    _check("down", full.down, (hidden, intermediate))
    slices = mlp_slices(intermediate, rank, tp)
    return MLPWeights(**{name: piece.take(getattr(full, name)) for name, piece in slices.items()})


def mlp_forward(x: torch.Tensor, weights: MLPWeights, group: Reducer | None = None) -> torch.Tensor:
    """SwiGLU MLP on this rank's slices; with a group, the full output on every rank."""
    gated = F.silu(column_parallel_linear(x, weights.gate)) * column_parallel_linear(x, weights.up)
    return row_parallel_linear(gated, weights.down, group)
