"""A layer's small ops as one Triton kernel each: residual add + RMSNorm, RoPE of q and k, SiLU-and-mul.

`TRITON_OPS` is the Triton backend's `layer_ops` (the model's seam, pd/engine/model/layer_ops.py, whose
torch ops define the results): on a GPU each call is one kernel where the torch reference runs 5-10.
Each kernel rounds where the reference does (the residual sum to the model dtype before the norm, the
norm before the weight, RoPE's two products and their sum, SiLU before the product), computing in
float32 in between, so 16-bit results match the reference's to the ulp.

Like the attention kernels, they launch compiled on CUDA and interpreted on the CPU (triton_launch.py),
read no tensor value on the host (graph-capturable), and take any row stride (q and k arrive as views
of the fused q|k|v GEMM's output; RoPE rotates them there, in place).
"""
from __future__ import annotations

import torch
import triton.language as tl

from pd.engine.attention.triton_launch import launcher, next_power_of_2

SILU_TILE = 1024  # columns of gate/up per program


def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, stride_x, stride_r, stride_o, stride_ro,
                     n_cols, eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=ok, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # the stream is kept in the model dtype
        tl.store(res_out_ptr + row * stride_ro + cols, x, mask=ok)
    x32 = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x32 * x32, 0) / n_cols + eps)
    normed = (x32 * inv).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=ok)


def _rope_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, stride_qt, stride_qh, stride_qd, stride_kt, stride_kh, stride_kd,
                 stride_ct, stride_st,
                 Q_HEADS: tl.constexpr, Q_PAD: tl.constexpr, K_HEADS: tl.constexpr, K_PAD: tl.constexpr,
                 HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr):
    # (q and k are written out twice rather than through a helper: a kernel here is one plain function,
    # jitted or interpreted by the launcher)
    token = tl.program_id(0).to(tl.int64)
    half: tl.constexpr = HEAD_DIM // 2
    dims = tl.arange(0, DIM_PAD)
    first = dims[None, :] < half
    partner = tl.where(dims < half, dims + half, dims - half)
    cos = tl.load(cos_ptr + token * stride_ct + dims, mask=dims < HEAD_DIM, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + token * stride_st + dims, mask=dims < HEAD_DIM, other=0.0).to(tl.float32)[None, :]

    heads = tl.arange(0, Q_PAD)
    ok = (heads[:, None] < Q_HEADS) & (dims[None, :] < HEAD_DIM)
    base = q_ptr + token * stride_qt + heads[:, None] * stride_qh
    x = tl.load(base + dims[None, :] * stride_qd, mask=ok, other=0.0)
    other = tl.load(base + partner[None, :] * stride_qd, mask=ok, other=0.0).to(tl.float32)
    a = (x.to(tl.float32) * cos).to(x.dtype).to(tl.float32)
    b = (tl.where(first, -other, other) * sin).to(x.dtype).to(tl.float32)
    tl.store(base + dims[None, :] * stride_qd, (a + b).to(x.dtype), mask=ok)

    heads = tl.arange(0, K_PAD)
    ok = (heads[:, None] < K_HEADS) & (dims[None, :] < HEAD_DIM)
    base = k_ptr + token * stride_kt + heads[:, None] * stride_kh
    x = tl.load(base + dims[None, :] * stride_kd, mask=ok, other=0.0)
    other = tl.load(base + partner[None, :] * stride_kd, mask=ok, other=0.0).to(tl.float32)
    a = (x.to(tl.float32) * cos).to(x.dtype).to(tl.float32)
    b = (tl.where(first, -other, other) * sin).to(x.dtype).to(tl.float32)
    tl.store(base + dims[None, :] * stride_kd, (a + b).to(x.dtype), mask=ok)


def _silu_mul_kernel(gate_up_ptr, out_ptr, stride_g, stride_o, n_cols, TILE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * TILE + tl.arange(0, TILE)
    ok = cols < n_cols
    gate = tl.load(gate_up_ptr + row * stride_g + cols, mask=ok, other=0.0)
    up = tl.load(gate_up_ptr + row * stride_g + n_cols + cols, mask=ok, other=0.0)
    g32 = gate.to(tl.float32)
    silu = (g32 / (1.0 + tl.exp(-g32))).to(gate.dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (silu * up.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=ok)


def _rows(x: torch.Tensor, name: str) -> None:
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"{name}: expected rows (T, H) with unit column stride, got shape {tuple(x.shape)} "
                         f"strides {x.stride()}")


def norm_meta(n_cols: int, residual: bool) -> dict:
    """The compile-time constants and launch options of an RMSNorm launch (what the compile check builds)."""
    return dict(HAS_RESIDUAL=residual, BLOCK=next_power_of_2(n_cols), num_warps=4 if n_cols <= 2048 else 8)


def rope_meta(q_heads: int, k_heads: int, head_dim: int) -> dict:
    # a program holds a token's q heads at once: past 2048 values 8 warps share them (4 spill at 32 x 128)
    width = next_power_of_2(q_heads) * next_power_of_2(head_dim)
    return dict(Q_HEADS=q_heads, Q_PAD=next_power_of_2(q_heads), K_HEADS=k_heads, K_PAD=next_power_of_2(k_heads),
                HEAD_DIM=head_dim, DIM_PAD=next_power_of_2(head_dim), num_warps=4 if width <= 2048 else 8)


def silu_meta(n_cols: int) -> dict:
    return dict(TILE=min(SILU_TILE, next_power_of_2(n_cols)))


class TritonOps:
    """The LayerOps (pd/engine/model/layer_ops.py) as one Triton launch each; `rope` rotates in place."""

    name = "triton"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        _rows(x, "rms_norm x")
        out = torch.empty_like(x)
        if x.shape[0]:
            launcher(_rms_norm_kernel, x.device)[(x.shape[0],)](
                x, x, weight, out, out, x.stride(0), 0, out.stride(0), 0, x.shape[1], float(eps),
                **norm_meta(x.shape[1], False))
        return out

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        _rows(x, "add_rms_norm x")
        _rows(residual, "add_rms_norm residual")
        if residual.shape != x.shape:
            raise ValueError(f"add_rms_norm: residual {tuple(residual.shape)} vs x {tuple(x.shape)}")
        out, total = torch.empty_like(x), torch.empty_like(x)
        if x.shape[0]:
            launcher(_rms_norm_kernel, x.device)[(x.shape[0],)](
                x, residual, weight, out, total, x.stride(0), residual.stride(0), out.stride(0), total.stride(0),
                x.shape[1], float(eps), **norm_meta(x.shape[1], True))
        return out, total

    def rope(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
             sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
            raise ValueError(f"rope: expected q (T, Hq, D), k (T, Hkv, D), got {tuple(q.shape)}, {tuple(k.shape)}")
        head_dim = q.shape[2]
        if head_dim % 2 or cos.shape[-1] != head_dim or sin.shape[-1] != head_dim or cos.shape[0] < q.shape[0]:
            raise ValueError(f"rope: cos/sin {tuple(cos.shape)} do not cover q {tuple(q.shape)} (even head size)")
        if cos.stride(-1) != 1 or sin.stride(-1) != 1:
            raise ValueError("rope: cos/sin need a unit stride along the head dimension")
        if q.shape[0]:
            launcher(_rope_kernel, q.device)[(q.shape[0],)](
                q, k, cos, sin, *q.stride(), *k.stride(), cos.stride(0), sin.stride(0),
                **rope_meta(q.shape[1], k.shape[1], head_dim))
        return q, k

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        _rows(gate_up, "silu_and_mul gate_up")
        if gate_up.shape[1] % 2:
            raise ValueError(f"silu_and_mul: gate_up width {gate_up.shape[1]} is odd")
        n = gate_up.shape[1] // 2
        out = torch.empty((gate_up.shape[0], n), dtype=gate_up.dtype, device=gate_up.device)
        if gate_up.shape[0]:
            meta = silu_meta(n)
            launcher(_silu_mul_kernel, gate_up.device)[(gate_up.shape[0], -(-n // meta["TILE"]))](
                gate_up, out, gate_up.stride(0), out.stride(0), n, **meta)
        return out


TRITON_OPS = TritonOps()
