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
Hkv, D), as in `triton_decode`. One program computes a tile of query tokens
of one sequence for all the G query heads that share one KV head (GQA): the
tile's rows are tokens x heads, so each K/V tile it loads serves the whole
group, and the K/V tiles read per KV head do not scale with G (a tile holds
at least MIN_TOKENS tokens whatever G). It runs an online softmax in float32,
visiting only the key tiles its causal window can reach. Decode tokens are
the case q_len = 1, but `triton_decode` serves them (mixed steps included).
"""
from __future__ import annotations

import dataclasses

import torch
import triton.language as tl

from pd.engine.attention.triton_decode import check_cache_shapes
from pd.engine.attention.triton_launch import dot_precision, launcher, next_power_of_2, upcast_dot


@dataclasses.dataclass(frozen=True)
class PrefillTuning:
    """How a prompt launch tiles. A program's tile has ROWS rows, token-major: a token's `group` query heads
    take `row_stride` rows (the group, or with `pow2_stride` the group rounded up to a power of two, the
    extra rows masked), so it holds ROWS // row_stride query tokens. ROWS is the next power of two of
    `tokens` x row_stride, kept within [min_rows, max_rows]: `tokens` tokens a tile up to group 4, at least
    MIN_TOKENS at group 8. `key_tile` keys an iteration; max(min_warps, ROWS // rows_per_warp) warps and
    `stages` pipeline stages."""

    tokens: int
    min_rows: int
    max_rows: int
    key_tile: int
    min_warps: int
    rows_per_warp: int
    stages: int
    pow2_stride: bool

    def row_stride(self, group: int) -> int:
        return next_power_of_2(group) if self.pow2_stride else group

    def rows(self, group: int) -> int:
        return max(self.min_rows, min(self.max_rows, next_power_of_2(self.tokens * self.row_stride(group))))

    def warps(self, rows: int) -> int:
        return max(self.min_warps, rows // self.rows_per_warp)


# Chosen with the compile check (tests/triton/test_triton_compile.py: 0 spills for groups 1-8 on sm_80 and
# sm_90). 16-bit: tiles of 32-128 rows x 32 keys, 16 rows a warp (64 rows and more compile to Hopper's
# wgmma; 256 rows spilled at head size 128). float32 dots run on FMA units, whose operands take far more
# registers: 16-key tiles, a warp per 8 rows at head size 128, and power-of-two row strides (the division by
# a group of 3, 5, 6 or 7 made ptxas spill at sm_80 or sm_90).
MIN_TOKENS = 16  # query tokens a tile holds at the least (group 8): K/V tiles read per KV head stay bounded
_TUNING = {  # (float32, head size up to 64 or up to 128)
    (False, 64): PrefillTuning(32, 32, 128, 32, 4, 16, 2, pow2_stride=False),
    (False, 128): PrefillTuning(32, 32, 128, 32, 4, 16, 2, pow2_stride=False),
    (True, 64): PrefillTuning(32, 32, 128, 16, 4, 16, 1, pow2_stride=True),
    (True, 128): PrefillTuning(32, 32, 128, 16, 8, 8, 1, pow2_stride=True),
}


def _prefill_kernel(q_ptr, k_ptr, v_ptr, out_ptr, table_ptr, seq_lens_ptr, query_start_ptr,
                    stride_qt, stride_qh, stride_qd,
                    stride_kb, stride_kt, stride_kh, stride_kd,
                    stride_vb, stride_vt, stride_vh, stride_vd,
                    stride_ot, stride_oh, stride_od,
                    stride_tb, stride_tw,
                    scale, window, BLOCK_SIZE: tl.constexpr,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
                    ROWS: tl.constexpr, ROW_STRIDE: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
                    UPCAST_DOT: tl.constexpr):
    seq = tl.program_id(0)
    q_tile = tl.num_programs(1) - 1 - tl.program_id(1)  # the last tiles see the most keys: started first
    kv_head = tl.program_id(2)
    # the tile's rows are its tokens x the KV head's query group, token-major: row r is token r // ROW_STRIDE
    # of the tile, query head kv_head * GROUP + r % ROW_STRIDE (ROW_STRIDE is GROUP, or GROUP rounded up to a
    # power of two, whose extra rows are masked; rows past TOKENS * ROW_STRIDE pad the tile to a power of two)
    TOKENS: tl.constexpr = ROWS // ROW_STRIDE
    r = tl.arange(0, ROWS)
    token = r // ROW_STRIDE
    member = r % ROW_STRIDE
    head = kv_head * GROUP + member
    q_lo = tl.load(query_start_ptr + seq).to(tl.int32)
    q_len = tl.load(query_start_ptr + seq + 1).to(tl.int32) - q_lo
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    first_pos = seq_len - q_len  # position of the chunk's first query
    tile_lo = q_tile * TOKENS  # the tile's first token in the chunk
    rows = tile_lo + token
    row_ok = (token < TOKENS) & (member < GROUP) & (rows < q_len)
    q_pos = first_pos + rows
    dims = tl.arange(0, DIM_PAD)
    dim_ok = dims < HEAD_DIM
    q_off = (q_lo + rows).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :] * stride_qd
    q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    # keys this tile can see: up to its last real query, from the window's start of its first query
    tile_tokens = tl.minimum(q_len - tile_lo, TOKENS)
    key_end = tl.where(tile_tokens > 0, first_pos + tile_lo + tile_tokens, 0)
    key_start = tl.where(window > 0, tl.maximum(first_pos + tile_lo - window + 1, 0), 0)
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.full([ROWS], 0.0, tl.float32)
    acc = tl.full([ROWS, DIM_PAD], 0.0, tl.float32)
    table_row = table_ptr + seq.to(tl.int64) * stride_tb
    # each K/V tile is loaded once for the whole query group (the GQA packing)
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
    o_off = (q_lo + rows).to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :] * stride_od
    tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


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
    meta = prefill_meta(q.dtype, q.device, group, q.shape[2], k_cache.shape[1])
    launcher(_prefill_kernel, q.device)[prefill_grid(batch, max_query_len, num_kv_heads, meta)](
        q, k_cache, v_cache, out, block_table, seq_lens, query_start,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *out.stride(), *block_table.stride(),
        float(scale), int(window or 0), **meta)
    return out


def tile_tokens(meta: dict) -> int:
    """Query tokens per program: its ROWS rows hold that many tokens of each of the group's query heads."""
    return meta["ROWS"] // meta["ROW_STRIDE"]


def prefill_grid(batch: int, max_query_len: int, num_kv_heads: int, meta: dict) -> tuple[int, int, int]:
    """(sequence, query tile, KV head): one program per KV head, not per query head, so a K/V tile is
    read once for the whole query group."""
    tokens = tile_tokens(meta)
    return batch, (max_query_len + tokens - 1) // tokens, num_kv_heads


def prefill_meta(dtype: torch.dtype, device: torch.device, group: int, head_dim: int, block_size: int) -> dict:
    """The compile-time constants and launch options of a prompt launch (what the compile check builds)."""
    tune = _TUNING[dtype == torch.float32, 64 if head_dim <= 64 else 128]
    rows = tune.rows(group)
    return dict(BLOCK_SIZE=block_size, GROUP=group, HEAD_DIM=head_dim, DIM_PAD=max(16, next_power_of_2(head_dim)),
                ROWS=rows, ROW_STRIDE=tune.row_stride(group), BLOCK_N=tune.key_tile, PRECISION=dot_precision(dtype),
                UPCAST_DOT=upcast_dot(dtype, device), num_warps=tune.warps(rows), num_stages=tune.stages)
