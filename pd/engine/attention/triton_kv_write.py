"""Writing a step's new K/V rows into the pages, in Triton, through the slot mapping.

Token t's K and V go to page `slot_mapping[t] // block_size`, row
`slot_mapping[t] % block_size`, of the layer's strided cache views
(num_blocks, block_size, num_kv_heads, head_dim): the same bytes
`attention/torch_paged.py` writes with `index_copy_` into the pool's token rows.
A negative slot writes nothing (a row a caller wants skipped); a padding row of
a CUDA graph bucket may instead point at the null block 0, whose contents no
attention ever reads. One program writes one token's K and V for every KV head.
The launch reads no tensor values on the host (graph-capturable).
"""
from __future__ import annotations

import torch
import triton.language as tl

from pd.engine.attention.triton_launch import launcher, next_power_of_2


def _kv_write_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                     stride_kt, stride_kh, stride_kd,
                     stride_vt, stride_vh, stride_vd,
                     stride_kcb, stride_kct, stride_kch, stride_kcd,
                     stride_vcb, stride_vct, stride_vch, stride_vcd,
                     BLOCK_SIZE: tl.constexpr,
                     NUM_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                     DIM_PAD: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, DIM_PAD)
    # (the slot test broadcast as a tensor: a scalar mask term is refused by the interpreter)
    ok = (heads[:, None] < NUM_HEADS) & (dims[None, :] < HEAD_DIM) & ((heads[:, None] * 0 + slot) >= 0)
    safe = tl.maximum(slot, 0)
    block = safe // BLOCK_SIZE
    row = safe % BLOCK_SIZE
    k = tl.load(k_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :] * stride_kd, mask=ok)
    v = tl.load(v_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :] * stride_vd, mask=ok)
    tl.store(k_cache_ptr + block * stride_kcb + row * stride_kct + heads[:, None] * stride_kch
             + dims[None, :] * stride_kcd, k.to(k_cache_ptr.dtype.element_ty), mask=ok)
    tl.store(v_cache_ptr + block * stride_vcb + row * stride_vct + heads[:, None] * stride_vch
             + dims[None, :] * stride_vcd, v.to(v_cache_ptr.dtype.element_ty), mask=ok)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store k, v (T, Hkv, D) at `slot_mapping` (T,) (block * block_size + row; < 0 = skip) in the caches."""
    if k.shape != v.shape or k.dim() != 3 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"expected k, v (T, Hkv, D) and caches (num_blocks, block_size, Hkv, D), got "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}, caches {tuple(k_cache.shape)}")
    if tuple(k.shape[1:]) != tuple(k_cache.shape[2:]):
        raise ValueError(f"k rows {tuple(k.shape[1:])} do not match the cache's (Hkv, D) {tuple(k_cache.shape[2:])}")
    if slot_mapping.shape[0] < k.shape[0]:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} slots for {k.shape[0]} tokens")
    if k.shape[0] == 0:
        return
    heads, dim = k.shape[1], k.shape[2]
    kernel = launcher(_kv_write_kernel, k.device)
    kernel[(k.shape[0],)](
        k, v, k_cache, v_cache, slot_mapping,
        *k.stride(), *v.stride(), *k_cache.stride(), *v_cache.stride(), **kv_write_meta(heads, dim, k_cache.shape[1]))


def kv_write_meta(num_kv_heads: int, head_dim: int, block_size: int) -> dict:
    """The compile-time constants of a KV write launch (what the compile check builds)."""
    return dict(BLOCK_SIZE=block_size, NUM_HEADS=num_kv_heads, HEADS_PAD=next_power_of_2(num_kv_heads),
                HEAD_DIM=head_dim, DIM_PAD=next_power_of_2(head_dim))
