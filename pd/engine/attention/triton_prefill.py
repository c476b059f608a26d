"""Paged attention for prompt chunks in Triton: varlen, causal, over the block table.

Sequence b contributes the query tokens [query_start[b], query_start[b + 1])
of the flat q (T, Hq, D); they sit at the last positions of its context, so
query i of b has position seq_lens[b] - q_len[b] + i. Each query attends
causally to every key position at or before its own (and, with a window, less
than `window` positions back), all read from the pages through the block
table: keys written by earlier steps (a prefix-cache hit, an earlier chunk)
and this step's, which the KV write stored first. That is the semantics of
`masked_attention` over the masks `attention/torch_paged.py` builds.

The caches are the per-layer strided page views (num_blocks, block_size,
Hkv, D), as in `triton_decode`. One program computes BLOCK_M queries of one
query head of one sequence with an online softmax in float32, visiting only
the key tiles its causal window can reach. Decode tokens are the case
q_len = 1, but `triton_decode` serves them with one program per KV head.
"""
from __future__ import annotations

import torch
import triton.language as tl

from pd.engine.attention.triton_decode import check_cache_shapes
from pd.engine.attention.triton_launch import dot_precision, launcher, next_power_of_2, upcast_dot

QUERY_TILE = 32
KEY_TILE = 32


def _prefill_kernel(q_ptr, k_ptr, v_ptr, out_ptr, table_ptr, seq_lens_ptr, query_start_ptr,
                    stride_qt, stride_qh, stride_qd,
                    stride_kb, stride_kt, stride_kh, stride_kd,
                    stride_vb, stride_vt, stride_vh, stride_vd,
                    stride_ot, stride_oh, stride_od,
                    stride_tb, stride_tw,
                    scale, window, BLOCK_SIZE: tl.constexpr,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
                    UPCAST_DOT: tl.constexpr):
    seq = tl.program_id(0)
    q_tile = tl.program_id(1)
    head = tl.program_id(2)
    kv_head = head // GROUP
    q_lo = tl.load(query_start_ptr + seq).to(tl.int32)
    q_len = tl.load(query_start_ptr + seq + 1).to(tl.int32) - q_lo
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    first_pos = seq_len - q_len  # position of the chunk's first query
    rows = q_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < q_len
    q_pos = first_pos + rows
    dims = tl.arange(0, DIM_PAD)
    dim_ok = dims < HEAD_DIM
    q = tl.load(q_ptr + (q_lo + rows).to(tl.int64)[:, None] * stride_qt + head * stride_qh
                + dims[None, :] * stride_qd, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    # keys this tile can see: up to its last real query, from the window's start of its first query
    tile_rows = tl.minimum(q_len - q_tile * BLOCK_M, BLOCK_M)
    key_end = tl.where(tile_rows > 0, first_pos + q_tile * BLOCK_M + tile_rows, 0)
    key_start = tl.where(window > 0, tl.maximum(first_pos + q_tile * BLOCK_M - window + 1, 0), 0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, DIM_PAD], 0.0, tl.float32)
    table_row = table_ptr + seq.to(tl.int64) * stride_tb
    for tile_start in range((key_start // BLOCK_N) * BLOCK_N, key_end, BLOCK_N):
        k_pos = tile_start + tl.arange(0, BLOCK_N)
        k_ok = (k_pos >= key_start) & (k_pos < key_end)
        block = tl.load(table_row + (k_pos // BLOCK_SIZE) * stride_tw, mask=k_ok, other=0).to(tl.int64)
        row = (k_pos % BLOCK_SIZE).to(tl.int64)
        k = tl.load(k_ptr + block[:, None] * stride_kb + row[:, None] * stride_kt + kv_head * stride_kh
                    + dims[None, :] * stride_kd, mask=k_ok[:, None] & dim_ok[None, :], other=0.0)
        if UPCAST_DOT:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q.to(k.dtype), tl.trans(k), input_precision=PRECISION)
        s = s * scale
        delta = q_pos[:, None] - k_pos[None, :]
        seen = k_ok[None, :] & (delta >= 0) & ((window <= 0) | (delta < window))
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no visible key so far
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + block[:, None] * stride_vb + row[:, None] * stride_vt + kv_head * stride_vh
                    + dims[None, :] * stride_vd, mask=k_ok[:, None] & dim_ok[None, :], other=0.0)
        if UPCAST_DOT:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + (q_lo + rows).to(tl.int64)[:, None] * stride_ot + head * stride_oh
             + dims[None, :] * stride_od, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                  seq_lens: torch.Tensor, query_start: torch.Tensor, max_query_len: int, scale: float,
                  window: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of prompt chunks over their pages.

    q: (T, Hq, D), the chunks' queries back to back; query_start: (B + 1,) offsets into q
    (query_start[0] = 0 and query_start[B] = T); seq_lens: (B,) context length after this step
    (the chunk's K/V already in the pages); block_table: (B, W); max_query_len: the longest
    chunk (a host integer: it sizes the launch). Returns (T, Hq, D) in q's dtype.
    """
    num_kv_heads, group = check_cache_shapes(q, k_cache, v_cache)
    batch = query_start.shape[0] - 1
    if block_table.shape[0] < batch or seq_lens.shape[0] < batch:
        raise ValueError(f"block_table {tuple(block_table.shape)} / seq_lens {tuple(seq_lens.shape)} "
                         f"cover fewer than {batch} sequences")
    if out is None:
        out = torch.empty_like(q)
    if batch <= 0 or max_query_len <= 0 or q.shape[0] == 0:
        return out
    head_dim = q.shape[2]
    kernel = launcher(_prefill_kernel, q.device)
    grid = (batch, (max_query_len + QUERY_TILE - 1) // QUERY_TILE, q.shape[1])
    kernel[grid](
        q, k_cache, v_cache, out, block_table, seq_lens, query_start,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *out.stride(), *block_table.stride(),
        float(scale), int(window or 0), **prefill_meta(q.dtype, q.device, group, head_dim, k_cache.shape[1]))
    return out


def prefill_meta(dtype: torch.dtype, device: torch.device, group: int, head_dim: int, block_size: int) -> dict:
    """The compile-time constants and launch options of a prompt launch (what the compile check builds)."""
    return dict(BLOCK_SIZE=block_size, GROUP=group, HEAD_DIM=head_dim, DIM_PAD=max(16, next_power_of_2(head_dim)),
                BLOCK_M=QUERY_TILE, BLOCK_N=KEY_TILE, PRECISION=dot_precision(dtype),
                UPCAST_DOT=upcast_dot(dtype, device), **_launch_options(dtype))


def _launch_options(dtype: torch.dtype) -> dict:
    # float32 tiles are twice the registers of 16-bit ones: 8 warps share them without spilling at head size
    # 128 (the compile check, tests/triton/test_triton_compile.py, holds every configuration at 0 spills)
    return dict(num_warps=8, num_stages=1) if dtype == torch.float32 else dict(num_warps=4, num_stages=2)
