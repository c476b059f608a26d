"""Paged decode attention in Triton: one query token per sequence, keys read through the block table.

`paged_decode` computes, for every sequence b and query head h,
softmax(q[b, h] . K / sqrt-scale) V over the keys at positions
[max(0, seq_lens[b] - window), seq_lens[b]) of that sequence, where key
position p lives in page `block_table[b, p // block_size]`, row
`p % block_size`. That is the semantics of `masked_attention` with the decode
mask of `attention/torch_paged.py` (window = tokens seen, the query included).

The caches are the per-layer strided views of the page pool, shape
(num_blocks, block_size, num_kv_heads, head_dim), passed with their strides
as they are (block-major pages: K and V of one layer are not contiguous).
One program serves one (sequence, KV head) pair, or one share of its keys when the
batch is too small to fill the GPU (split-KV, `decode_splits`: the shares' partial
softmax sums are combined by `_decode_reduce_kernel`), and all the query heads that
share it (GQA of any ratio: the group is padded to a power of two, at least
16 for the tensor-core `tl.dot`), walking the keys in tiles with an online
softmax in float32. Only positions inside the window and before the sequence
length are loaded: out-of-window table entries (the null block 0) and unwritten
page tails are never read. A sequence of length 0 (a padding row of a CUDA
graph bucket) gets zeros.

The launch reads no tensor values on the host, so it can be captured in a
CUDA graph.
"""
from __future__ import annotations

import torch
import triton.language as tl

from pd.engine.attention.triton_launch import dot_precision, launcher, next_power_of_2, upcast_dot

# Keys per inner iteration. 64 keys x 128 dims of bf16 fit comfortably in registers and shared memory.
KEY_TILE = 64
MIN_DOT = 16  # tl.dot needs every dimension to be at least 16
# Split-KV: a batch whose (sequence, KV head) pairs are fewer than about a GPU's SMs (132 on an H100) splits each
# context over up to MAX_SPLITS programs, combined by a second kernel (one more launch a layer)
TARGET_PROGRAMS = 128
MAX_SPLITS = 8


def _decode_kernel(q_ptr, k_ptr, v_ptr, out_ptr, table_ptr, seq_lens_ptr, part_ptr, stats_ptr, num_q_heads,
                   stride_qt, stride_qh, stride_qd,
                   stride_kb, stride_kt, stride_kh, stride_kd,
                   stride_vb, stride_vt, stride_vh, stride_vd,
                   stride_ot, stride_oh, stride_od,
                   stride_tb, stride_tw,
                   scale, window, BLOCK_SIZE: tl.constexpr,
                   GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
                   TILE: tl.constexpr, PRECISION: tl.constexpr,
                   UPCAST_DOT: tl.constexpr, SPLITS: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    g = tl.arange(0, GROUP_PAD)
    heads = kv_head * GROUP + g
    head_ok = g < GROUP
    dims = tl.arange(0, DIM_PAD)
    dim_ok = dims < HEAD_DIM
    q = tl.load(q_ptr + seq.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + dims[None, :] * stride_qd,
                mask=head_ok[:, None] & dim_ok[None, :], other=0.0)
    start = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    table_row = table_ptr + seq.to(tl.int64) * stride_tb
    # split-KV: this program's share of the context's key tiles (all of them when SPLITS is 1)
    first = (start // TILE) * TILE
    tiles = (tl.maximum(seq_len - first, 0) + TILE - 1) // TILE
    share = (tiles + SPLITS - 1) // SPLITS * TILE
    lo = first + split * share
    for tile_start in range(lo, tl.minimum(seq_len, lo + share), TILE):
        pos = tile_start + tl.arange(0, TILE)
        valid = (pos >= start) & (pos < seq_len)
        block = tl.load(table_row + (pos // BLOCK_SIZE) * stride_tw, mask=valid, other=0).to(tl.int64)
        row = (pos % BLOCK_SIZE).to(tl.int64)
        k = tl.load(k_ptr + block[:, None] * stride_kb + row[:, None] * stride_kt + kv_head * stride_kh
                    + dims[None, :] * stride_kd, mask=valid[:, None] & dim_ok[None, :], other=0.0)
        if UPCAST_DOT:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q.to(k.dtype), tl.trans(k), input_precision=PRECISION)
        s = s * scale
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + block[:, None] * stride_vb + row[:, None] * stride_vt + kv_head * stride_vh
                    + dims[None, :] * stride_vd, mask=valid[:, None] & dim_ok[None, :], other=0.0)
        if UPCAST_DOT:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    if SPLITS == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + seq.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + dims[None, :] * stride_od,
                 out.to(out_ptr.dtype.element_ty), mask=head_ok[:, None] & dim_ok[None, :])
    else:  # the share's running max, sum and unnormalised output, combined by _decode_reduce_kernel
        row = (seq.to(tl.int64) * num_q_heads + heads) * SPLITS + split
        tl.store(part_ptr + row[:, None] * DIM_PAD + dims[None, :], acc, mask=head_ok[:, None])
        tl.store(stats_ptr + row * 2, m_i, mask=head_ok)
        tl.store(stats_ptr + row * 2 + 1, l_i, mask=head_ok)


def _decode_reduce_kernel(part_ptr, stats_ptr, out_ptr, num_q_heads, stride_ot, stride_oh, stride_od,
                          HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, SPLITS: tl.constexpr):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    rows = (seq * num_q_heads + head) * SPLITS + tl.arange(0, SPLITS)
    dims = tl.arange(0, DIM_PAD)
    m = tl.load(stats_ptr + rows * 2)
    l_s = tl.load(stats_ptr + rows * 2 + 1)
    m_all = tl.max(m, 0)
    weight = tl.exp(m - tl.where(m_all == float("-inf"), 0.0, m_all))  # a share that saw no key weighs 0
    total = tl.sum(weight * l_s, 0)
    acc = tl.sum(tl.load(part_ptr + rows[:, None] * DIM_PAD + dims[None, :]) * weight[:, None], 0)
    out = acc / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + seq * stride_ot + head * stride_oh + dims * stride_od, out.to(out_ptr.dtype.element_ty),
             mask=dims < HEAD_DIM)


def check_cache_shapes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int]:
    """(num_kv_heads, GQA group) after checking q (T, Hq, D) against the caches (N, block_size, Hkv, D)."""
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"expected q (T, Hq, D) and caches (num_blocks, block_size, Hkv, D), got q {tuple(q.shape)}, "
                         f"k {tuple(k_cache.shape)}, v {tuple(v_cache.shape)}")
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    if q.shape[2] != head_dim or q.shape[1] % num_kv_heads:
        raise ValueError(f"q {tuple(q.shape)} does not fit {num_kv_heads} KV heads of size {head_dim}")
    if q.device != k_cache.device or q.dtype != k_cache.dtype:
        raise ValueError(f"q is {q.dtype} on {q.device}, the cache {k_cache.dtype} on {k_cache.device}")
    return num_kv_heads, q.shape[1] // num_kv_heads


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float, window: int | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of one query per sequence over its pages.

    q: (B, Hq, D); k_cache, v_cache: (num_blocks, block_size, Hkv, D) views, any strides;
    block_table: (B, W) integer block ids; seq_lens: (B,) keys per sequence, the new token
    included (its K/V must already be in the pages); window: the layer's sliding window or None.
    Returns (B, Hq, D) in q's dtype (written into `out` when given).
    """
    num_kv_heads, group = check_cache_shapes(q, k_cache, v_cache)
    batch, head_dim = q.shape[0], q.shape[2]
    if block_table.shape[0] < batch or seq_lens.shape[0] < batch:
        raise ValueError(f"block_table {tuple(block_table.shape)} / seq_lens {tuple(seq_lens.shape)} "
                         f"cover fewer than {batch} sequences")
    if out is None:
        out = torch.empty_like(q)
    if batch == 0:
        return out
    splits = decode_splits(batch, num_kv_heads)
    meta = decode_meta(q.dtype, q.device, group, head_dim, k_cache.shape[1], splits)
    part = stats = out  # (unused by one split)
    if splits > 1:
        part = torch.empty((batch, q.shape[1], splits, meta["DIM_PAD"]), dtype=torch.float32, device=q.device)
        stats = torch.empty((batch, q.shape[1], splits, 2), dtype=torch.float32, device=q.device)
    launcher(_decode_kernel, q.device)[(batch, num_kv_heads, splits)](
        q, k_cache, v_cache, out, block_table, seq_lens, part, stats, q.shape[1],
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *out.stride(), *block_table.stride(),
        float(scale), int(window or 0), **meta)
    if splits > 1:
        launcher(_decode_reduce_kernel, q.device)[(batch, q.shape[1])](
            part, stats, out, q.shape[1], *out.stride(), **reduce_meta(head_dim, splits))
    return out


def decode_splits(batch: int, num_kv_heads: int) -> int:
    """How many programs share a sequence's keys (split-KV): enough (a power of two, at most MAX_SPLITS) that
    the batch's (sequence, KV head) pairs fill about TARGET_PROGRAMS programs, 1 once they do alone."""
    splits = 1
    while splits < MAX_SPLITS and batch * num_kv_heads * splits < TARGET_PROGRAMS:
        splits *= 2
    return splits


def reduce_meta(head_dim: int, splits: int) -> dict:
    return dict(HEAD_DIM=head_dim, DIM_PAD=max(MIN_DOT, next_power_of_2(head_dim)), SPLITS=splits)


def decode_meta(dtype: torch.dtype, device: torch.device, group: int, head_dim: int, block_size: int,
                splits: int = 1) -> dict:
    """The compile-time constants and launch options of a decode launch (what the compile check builds)."""
    return dict(BLOCK_SIZE=block_size, SPLITS=splits, GROUP=group, GROUP_PAD=max(MIN_DOT, next_power_of_2(group)),
                HEAD_DIM=head_dim, DIM_PAD=max(MIN_DOT, next_power_of_2(head_dim)), TILE=KEY_TILE,
                PRECISION=dot_precision(dtype), UPCAST_DOT=upcast_dot(dtype, device), **_launch_options(dtype))


def _launch_options(dtype: torch.dtype) -> dict:
    # float32 tiles are twice the registers of 16-bit ones: 8 warps share them without spilling at head size
    # 128 (the compile check, tests/triton/test_triton_compile.py, holds every configuration at 0 spills)
    return dict(num_warps=8, num_stages=1) if dtype == torch.float32 else dict(num_warps=4, num_stages=2)
