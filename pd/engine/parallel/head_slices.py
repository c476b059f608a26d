"""Copying a run of KV heads of some pages from one rank's pool into another's.

A page is `(layers, 2, block_size, num_kv_heads, head_dim)` (`pd/engine/kv/layout.py`). Seen as
rows (`BoundKV.token_rows`), it is `rows_per_page` rows of `num_kv_heads * head_dim` elements, one
row per (layer, K/V, token), the same for every KV cache group (a group with fewer layers uses a
prefix of the rows). A rank of a TP worker holds the same rows over its own heads only.

A run of heads is therefore strided inside a page: one contiguous piece of `count * head_dim`
elements per row, `rows_per_page` pieces per page (per layer, K/V and token), which is the cost a
head-split transfer pays with this layout (a layout with heads outermost would make it one piece
per page). `gather_heads` packs those pieces into one contiguous buffer (the unit a transfer moves
in one piece) and `scatter_heads` unpacks it; each is one torch index op over a strided view, so
on the CPU it is a loop of small copies and on a GPU one kernel. When the run covers every head of
the pool (TP 1 on that side) the pieces are whole rows and the copy is contiguous.
"""
from __future__ import annotations

import dataclasses

import torch

from pd.engine.kv.layout import KVLayout
from pd.engine.kv.page_pool import PagePool
from pd.engine.parallel.tp import HeadSlice, TPShape


def rank_layout(layout: KVLayout, tp: int) -> KVLayout:
    """The KV layout of one rank of a TP `tp` worker of `layout`'s model: same groups, block size
    and rows, `max(1, H // tp)` KV heads (and `num_heads // tp` query heads)."""
    cfg = layout.model_config
    shape = TPShape(tp, cfg.num_kv_heads, cfg.num_heads)
    local = dataclasses.replace(cfg, num_heads=cfg.num_heads // tp, num_kv_heads=shape.heads_per_rank,
                                head_dim=cfg.resolved_head_dim)
    return KVLayout(local, layout.block_size)


def head_view(layout: KVLayout, pool: PagePool) -> torch.Tensor:
    """The whole pool as (num_blocks, rows_per_page, num_kv_heads, head_dim), no copy."""
    kv = layout.bind(pool)
    return kv.token_rows.view(pool.num_blocks, kv.rows_per_page, layout.num_kv_heads, layout.head_dim)


def _index(block_ids: list[int] | torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
    index = torch.as_tensor(block_ids, dtype=torch.long, device=pages.device)
    if index.dim() != 1:
        raise ValueError(f"block ids must be a flat list, got shape {tuple(index.shape)}")
    if index.numel() and (int(index.min()) < 0 or int(index.max()) >= pages.shape[0]):
        raise ValueError(f"block ids {index.tolist()} outside a pool of {pages.shape[0]} blocks")
    return index


def _heads(pages: torch.Tensor, first: int, count: int) -> torch.Tensor:
    if count < 1 or first < 0 or first + count > pages.shape[2]:
        raise ValueError(f"heads {first}..{first + count - 1} outside a pool of {pages.shape[2]} KV heads")
    return pages.narrow(2, first, count)


def gather_heads(pages: torch.Tensor, block_ids: list[int] | torch.Tensor, first: int, count: int,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """Heads `first .. first + count - 1` of these blocks as one contiguous
    (len(block_ids), rows_per_page, count, head_dim) tensor (`out` when given: a staging slot)."""
    index = _index(block_ids, pages)
    src = _heads(pages, first, count)
    if out is None:
        return src.index_select(0, index)
    want = (index.numel(), *src.shape[1:])
    if tuple(out.shape) != want or out.dtype != pages.dtype or not out.is_contiguous():
        raise ValueError(f"staging buffer {tuple(out.shape)} {out.dtype} does not fit {want} {pages.dtype}")
    return torch.index_select(src, 0, index, out=out)


def scatter_heads(pages: torch.Tensor, block_ids: list[int] | torch.Tensor, first: int,
                  packed: torch.Tensor) -> None:
    """Writes a `gather_heads` buffer into heads `first ..` of these blocks (other heads untouched)."""
    index = _index(block_ids, pages)
    if packed.dim() != 4:
        raise ValueError(f"buffer of shape {tuple(packed.shape)}: want (blocks, rows, heads, head_dim)")
    dst = _heads(pages, first, packed.shape[2])
    if tuple(packed.shape) != (index.numel(), *dst.shape[1:]) or packed.dtype != pages.dtype:
        raise ValueError(f"buffer {tuple(packed.shape)} {packed.dtype} does not fit "
                         f"{(index.numel(), *dst.shape[1:])} {pages.dtype}")
    dst.index_copy_(0, index, packed)  # writes through the strided view into the pool


def copy_slice(step: HeadSlice, p_pages: torch.Tensor, p_blocks: list[int], d_pages: torch.Tensor,
               d_blocks: list[int]) -> int:
    """Carries out one slice of a transfer plan between two ranks' pools (P block `p_blocks[i]` into
    D block `d_blocks[i]`); returns the bytes moved."""
    if len(p_blocks) != len(d_blocks):
        raise ValueError(f"{len(p_blocks)} source blocks for {len(d_blocks)} destination blocks")
    packed = gather_heads(p_pages, p_blocks, step.p_first, step.count)
    scatter_heads(d_pages, d_blocks, step.d_first, packed)
    return packed.numel() * packed.element_size()
