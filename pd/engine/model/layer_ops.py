"""The small per-layer operations of the decoder, as plain torch: the reference and the CPU path.

A layer asks its attention backend for these (`backend.layer_ops`, this module's `TORCH_OPS` when the
backend names none): a backend that runs on a GPU may hand fused kernels instead (the Triton backend's
pd/engine/attention/triton_ops.py, one kernel per call), which these functions define the result of.

Rounding follows Hugging Face's Llama: the residual sum is rounded to the model dtype before it is
normalised, the norm is computed in float32 and rounded before the weight multiplies it; RoPE and
SiLU run in the model dtype.
"""
from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F


class LayerOps(Protocol):
    """What a layer runs between its GEMMs and attention. Every op returns new tensors or, where it says so,
    writes into its inputs (a caller never reads an input again after handing it over)."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm of the rows of x (T, H)."""

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(residual + x), residual + x): the residual stream's update and its norm at once."""

    def rope(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
             sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q (T, Hq, D) and k (T, Hkv, D) rotated by cos/sin (T, 1, D) (rotate-half); may rotate in place."""

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of gate_up (T, 2I) = [gate | up] -> (T, I)."""


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:  # one fused op, same result
        return F.rms_norm(x, weight.shape, weight, eps)
    # Normalise in float32 (as HF does) so low-precision dtypes stay stable.
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class TorchOps:
    """The reference ops in torch (see LayerOps); nothing is written in place."""

    name = "torch"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        total = residual + x
        return rms_norm(total, weight, eps), total

    def rope(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
             sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        half = gate_up.shape[-1] // 2
        return F.silu(gate_up[..., :half]) * gate_up[..., half:]


TORCH_OPS = TorchOps()
