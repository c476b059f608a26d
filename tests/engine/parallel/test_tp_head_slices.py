"""Head-slice copies between real page pools (pd/engine/parallel/head_slices.py): a canonical pool
(what a TP 1 worker holds) of a model with a full and a sliding-window group, split into P ranks'
pools, moved by the transfer plan into D ranks' pools at other block ids; every D rank's pool must
equal its heads of the canonical pages byte for byte, untouched blocks stay zero, and each D rank
receives its share of the canonical page."""
from __future__ import annotations

import pytest
import torch

from pd.engine.kv.layout import KVLayout
from pd.engine.kv.page_pool import PagePool
from pd.engine.model.config import ModelConfig
from pd.engine.parallel.head_slices import copy_slice, gather_heads, head_view, rank_layout, scatter_heads
from pd.engine.parallel.tp import TPShape, transfer_plan

NUM_BLOCKS = 8
P_BLOCKS = [1, 3, 4, 6]
D_BLOCKS = [5, 2, 7, 1]


def _model(num_kv_heads: int) -> ModelConfig:
    return ModelConfig(hidden_size=64, num_layers=3, num_heads=8, num_kv_heads=num_kv_heads, head_dim=4,
                       layer_types=("full_attention", "sliding_attention", "full_attention"), sliding_window=8)


def _canonical(layout: KVLayout) -> PagePool:
    pool = PagePool(NUM_BLOCKS, layout.page_size_bytes, shareable=False)
    rows = layout.bind(pool).token_rows
    rows.copy_(torch.arange(rows.numel(), dtype=torch.float32).view_as(rows) + 1)  # distinct, exact, nonzero
    return pool


@pytest.mark.parametrize(("p_tp", "d_tp", "num_kv_heads"),
                         [(2, 1, 2), (1, 2, 2), (4, 2, 8), (4, 2, 2), (2, 4, 2), (4, 1, 2), (1, 1, 4), (8, 2, 4)])
def test_plan_between_real_pools_gives_each_d_rank_its_heads(p_tp, d_tp, num_kv_heads):
    layout = KVLayout(_model(num_kv_heads), block_size=4)
    canonical = head_view(layout, _canonical(layout))
    p, d = TPShape(p_tp, num_kv_heads), TPShape(d_tp, num_kv_heads)
    p_layout, d_layout = rank_layout(layout, p_tp), rank_layout(layout, d_tp)
    assert p_layout.page_size_bytes * min(p_tp, num_kv_heads) == layout.page_size_bytes
    assert p_layout.rows_per_page == layout.rows_per_page
    p_pools = [PagePool(NUM_BLOCKS, p_layout.page_size_bytes, shareable=False) for _ in range(p_tp)]
    for rank, pool in enumerate(p_pools):  # each P rank's pool: its heads of the canonical pages
        heads = p.heads_of(rank)
        everything = list(range(NUM_BLOCKS))
        scatter_heads(head_view(p_layout, pool), everything, 0,
                      gather_heads(canonical, everything, heads.start, len(heads)))
    d_pools = [PagePool(NUM_BLOCKS, d_layout.page_size_bytes, shareable=False) for _ in range(d_tp)]
    received = [0] * d_tp
    for s in transfer_plan(p_tp, d_tp, num_kv_heads):
        received[s.d_rank] += copy_slice(s, head_view(p_layout, p_pools[s.p_rank]), P_BLOCKS,
                                         head_view(d_layout, d_pools[s.d_rank]), D_BLOCKS)
    for rank, pool in enumerate(d_pools):
        heads = d.heads_of(rank)
        got = head_view(d_layout, pool)
        want = canonical[P_BLOCKS][:, :, heads.start:heads.stop]
        assert torch.equal(got[D_BLOCKS], want)
        untouched = sorted(set(range(NUM_BLOCKS)) - set(D_BLOCKS))
        assert int(pool.buffer[untouched].count_nonzero()) == 0
        assert received[rank] == len(P_BLOCKS) * layout.page_size_bytes * len(heads) // num_kv_heads
        assert received[rank] == len(P_BLOCKS) * d_layout.page_size_bytes


def test_a_head_run_lands_between_the_other_heads_untouched():
    layout = KVLayout(_model(4), block_size=4)
    src = head_view(layout, _canonical(layout))
    dst_pool = PagePool(NUM_BLOCKS, layout.page_size_bytes, shareable=False)
    dst = head_view(layout, dst_pool)
    slot = torch.empty((2, layout.rows_per_page, 2, layout.head_dim))
    packed = gather_heads(src, [3, 6], 1, 2, out=slot)
    assert packed.data_ptr() == slot.data_ptr()
    scatter_heads(dst, [0, 5], 2, packed)
    assert torch.equal(dst[[0, 5]][:, :, 2:4], src[[3, 6]][:, :, 1:3])
    assert int(dst[:, :, :2].count_nonzero()) == 0 and int(dst[[1, 2, 3, 4, 6, 7]].count_nonzero()) == 0


def test_bad_slices_are_refused():
    layout = KVLayout(_model(4), block_size=4)
    pages = head_view(layout, _canonical(layout))
    with pytest.raises(ValueError, match="heads 3..4 outside a pool of 4 KV heads"):
        gather_heads(pages, [1], 3, 2)
    with pytest.raises(ValueError, match="outside a pool of 8 blocks"):
        gather_heads(pages, [1, 8], 0, 1)
    with pytest.raises(ValueError, match="does not fit"):
        gather_heads(pages, [1, 2], 0, 2, out=torch.empty((1, layout.rows_per_page, 2, layout.head_dim)))
    with pytest.raises(ValueError, match="does not fit"):
        scatter_heads(pages, [1, 2], 0, gather_heads(pages, [1], 0, 2))
    with pytest.raises(ValueError, match="TP and the KV heads must divide one another"):
        rank_layout(layout, 3)
