"""Page pools of TP gangs for the transfer tests: a canonical pool (what a TP 1 worker holds: every KV
head, distinct exact values) of a model with a full and a sliding-window group, each P rank's pool
holding its heads of it, empty D rank pools; the agents' geometry and heads from pd's mapping rule."""
from __future__ import annotations

import torch

from connectors.zmq.gang.head_plan import HeadGeometry, RankHeads
from pd.engine.kv.layout import KVLayout
from pd.engine.kv.page_pool import PagePool
from pd.engine.model.config import ModelConfig
from pd.engine.parallel.head_slices import gather_heads, head_view, rank_layout, scatter_heads
from pd.engine.parallel.tp import TPShape


def model_layout(num_kv_heads: int, num_layers: int = 3, block_size: int = 4, head_dim: int = 4) -> KVLayout:
    types = tuple("sliding_attention" if i % 3 == 1 else "full_attention" for i in range(num_layers))
    cfg = ModelConfig(hidden_size=64, num_layers=num_layers, num_heads=max(8, num_kv_heads), num_kv_heads=num_kv_heads,
                      head_dim=head_dim, layer_types=types, sliding_window=8)
    return KVLayout(cfg, block_size=block_size)


class GangPools:
    """Canonical pages, and the pools of a P gang of TP `p_tp` and a D gang of TP `d_tp`."""

    def __init__(self, layout: KVLayout, num_blocks: int, p_tp: int, d_tp: int, seed: int | None = None):
        self.layout, self.num_blocks = layout, num_blocks
        h = layout.num_kv_heads
        self.p_shape, self.d_shape = TPShape(p_tp, h), TPShape(d_tp, h)
        self.p_layout, self.d_layout = rank_layout(layout, p_tp), rank_layout(layout, d_tp)
        canonical = PagePool(num_blocks, layout.page_size_bytes, shareable=False)
        rows = layout.bind(canonical).token_rows
        if seed is None:
            rows.copy_(torch.arange(rows.numel(), dtype=torch.float32).view_as(rows) + 1)
        else:
            rows.copy_(torch.randn(rows.shape, generator=torch.Generator().manual_seed(seed)))
        self.canonical = head_view(layout, canonical)
        everything = list(range(num_blocks))
        self.p_pools = []
        for r in range(p_tp):
            heads = self.p_shape.heads_of(r)
            pool = PagePool(num_blocks, self.p_layout.page_size_bytes)  # memfd: mappable by D ranks
            scatter_heads(head_view(self.p_layout, pool), everything, 0,
                          gather_heads(self.canonical, everything, heads.start, len(heads)))
            self.p_pools.append(pool)
        self.d_pools = [PagePool(num_blocks, self.d_layout.page_size_bytes) for _ in range(d_tp)]

    def p_heads(self, rank: int) -> RankHeads:
        heads = self.p_shape.heads_of(rank)
        return RankHeads(rank, heads.start, len(heads))

    def d_heads(self, rank: int) -> RankHeads:
        heads = self.d_shape.heads_of(rank)
        return RankHeads(rank, heads.start, len(heads))

    def p_geometry(self) -> HeadGeometry:
        return HeadGeometry(self.p_layout.num_kv_heads, self.p_layout.head_dim, torch.float32)

    def d_geometry(self) -> HeadGeometry:
        return HeadGeometry(self.d_layout.num_kv_heads, self.d_layout.head_dim, torch.float32)

    def d_holds(self, rank: int, p_blocks: list[int], d_blocks: list[int]) -> bool:
        """Whether D rank `rank` holds its heads of canonical blocks `p_blocks` at `d_blocks`."""
        heads = self.d_shape.heads_of(rank)
        got = head_view(self.d_layout, self.d_pools[rank])[d_blocks]
        return torch.equal(got, self.canonical[p_blocks][:, :, heads.start:heads.stop])

    def d_share(self, rank: int, num_blocks: int) -> int:
        """Bytes D rank `rank` must receive for `num_blocks` canonical pages: its heads' part."""
        return num_blocks * self.layout.page_size_bytes * len(self.d_shape.heads_of(rank)) // self.layout.num_kv_heads
