"""How the model's layers map onto KV cache groups and pages.

Full-attention layers form group 0, sliding-window layers group 1 (only the
groups that exist are created, full first). A page holds one block's K and V
for every layer of one group: shape (layers_in_group, 2, block_size,
num_kv_heads, head_dim). Groups with fewer layers use a prefix of the page,
whose size is set by the largest group.

`KVLayout.bind(pool)` is the one place where each layer's K and V views of a page pool are worked out:
the runner binds them once, over the pool the engine allocated, and every attention backend and the CPU
step executor read the same `LayerKV` views.
"""
from __future__ import annotations

import dataclasses

import torch

from pd.engine.kv.page_pool import PagePool
from pd.engine.model.config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig


@dataclasses.dataclass(frozen=True)
class KVGroupLayout:
    """One KV cache group: which layers it holds and their attention window (None = full)."""

    layer_indices: tuple[int, ...]
    window: int | None


@dataclasses.dataclass(frozen=True)
class LayerKV:
    """One layer's K and V in the page pool: views, no copy (see `KVLayout.bind`)."""

    group: int  # its KV cache group (the block tables and slots it reads)
    slot: int  # its place among the group's layers
    window: int | None  # its attention window (None: full attention)
    cache: torch.Tensor  # (num_blocks, 2, block_size, Hkv, D): K then V of each page
    k: torch.Tensor  # (num_blocks, block_size, Hkv, D), strided
    v: torch.Tensor  # (num_blocks, block_size, Hkv, D), strided
    k_rows: torch.Tensor  # (num_blocks, block_size * Hkv * D): each page's K as one row (for gathers)
    v_rows: torch.Tensor
    first_row: int  # in `BoundKV.token_rows`, page row of this layer's first K (its V: block_size rows on)


@dataclasses.dataclass(frozen=True)
class BoundKV:
    """A page pool with each layer's K/V views bound once (`KVLayout.bind`).

    Guarantees: every view shares the pool's memory (no copy) and keeps its address for the pool's life;
    token t of block b of `layers[i]` has its K at `token_rows[b * rows_per_page + layers[i].first_row + t]`
    (`rows_per_page` here: the pool's page, which may be larger than the layout's).
    """

    layout: KVLayout
    pool: PagePool
    token_rows: torch.Tensor  # (num_blocks * rows_per_page, Hkv * D): the whole pool as rows of one token's K or V
    layers: tuple[LayerKV, ...]
    rows_per_page: int  # a page of the pool as rows of one token's K or V

    def group_pages(self, group: int) -> torch.Tensor:
        """Group `group`'s pages as (num_blocks, layers in the group, 2, block_size, Hkv, D) (no copy): a
        whole block of one group, K and V of each of its layers, as the connector and the KV audit see it."""
        shape = self.layout.page_shape(group)
        nb = self.pool.num_blocks
        rows = self.token_rows.view(nb, self.rows_per_page, -1)[:, :shape[0] * 2 * shape[2]]
        return rows.view(nb, *shape)


class KVLayout:
    """Layer -> (group, slot in group) map and page geometry for one model.

    Invariants: every layer belongs to exactly one group; groups are ordered
    full attention first; `page_size_bytes` fits every group's page shape.
    """

    def __init__(self, cfg: ModelConfig, block_size: int):
        self.model_config = cfg
        self.block_size = block_size
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.resolved_head_dim
        self.dtype = cfg.torch_dtype
        types = cfg.resolved_layer_types
        groups = []
        for kind, window in ((FULL_ATTENTION, None), (SLIDING_ATTENTION, cfg.sliding_window)):
            layers = tuple(i for i, t in enumerate(types) if t == kind)
            if layers:
                groups.append(KVGroupLayout(layers, window))
        self.groups: tuple[KVGroupLayout, ...] = tuple(groups)
        self.layer_to_group: dict[int, tuple[int, int]] = {
            layer: (g, slot) for g, grp in enumerate(self.groups) for slot, layer in enumerate(grp.layer_indices)
        }
        elem = torch.empty((), dtype=self.dtype).element_size()
        self.layer_page_bytes = 2 * block_size * self.num_kv_heads * self.head_dim * elem
        self.page_size_bytes = max(len(g.layer_indices) for g in self.groups) * self.layer_page_bytes

    def page_shape(self, group_idx: int) -> tuple[int, ...]:
        return (len(self.groups[group_idx].layer_indices), 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def rows_per_page(self) -> int:
        """A page seen as rows of one token's K (or V) for one layer: num_kv_heads * head_dim elements."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.page_size_bytes // (self.num_kv_heads * self.head_dim * elem)

    def bind(self, pool: PagePool) -> BoundKV:
        """Each layer's K/V views of `pool` (no copy): the one place they are worked out.

        Every view is cut from one typed tensor over the pool's storage that is not itself a view (one
        `_base`, the whole storage): what `torch.compile` can trace writes through, and a CUDA graph
        replays at the same addresses."""
        width = self.num_kv_heads * self.head_dim
        elem = torch.empty((), dtype=self.dtype).element_size()
        if pool.page_size_bytes < self.page_size_bytes or pool.page_size_bytes % (width * elem):
            raise ValueError(f"page pool pages are {pool.page_size_bytes} bytes, the layout needs "
                             f"{self.page_size_bytes} in rows of {width * elem} bytes")
        buffer = pool.buffer
        offset = buffer.storage_offset()  # (bytes: the buffer is uint8)
        if offset % elem:
            raise ValueError(f"the page pool starts at byte {offset}, not on a {self.dtype} boundary")
        bs, nb = self.block_size, pool.num_blocks
        rows = pool.page_size_bytes // (width * elem)
        pages = torch.empty(0, dtype=self.dtype, device=buffer.device).set_(
            buffer.untyped_storage(), offset // elem, (nb, rows, self.num_kv_heads, self.head_dim),
            (rows * width, width, self.head_dim, 1))
        layers = []
        for layer in range(len(self.layer_to_group)):
            g, slot = self.layer_to_group[layer]
            first = 2 * slot * bs
            k, v = pages[:, first:first + bs], pages[:, first + bs:first + 2 * bs]
            cache = pages[:, first:first + 2 * bs].view(nb, 2, bs, self.num_kv_heads, self.head_dim)
            layers.append(LayerKV(g, slot, self.groups[g].window, cache, k, v, k.reshape(nb, -1), v.reshape(nb, -1),
                                  first))
        return BoundKV(self, pool, pages.view(-1, width), tuple(layers), rows)

    def kv_cache_groups(self):
        """kvcache `KVCacheGroupSpec`s, one per group, layer names "layers.N"."""
        from kvcache import FullAttentionSpec, KVCacheGroupSpec, SlidingWindowSpec

        dtype = self.model_config.dtype
        out = []
        for grp in self.groups:
            names = tuple(f"layers.{i}" for i in grp.layer_indices)
            if grp.window is None:
                spec = FullAttentionSpec(block_size=self.block_size, num_kv_heads=self.num_kv_heads,
                                         head_size=self.head_dim, dtype=dtype)
            else:
                spec = SlidingWindowSpec(block_size=self.block_size, num_kv_heads=self.num_kv_heads,
                                         head_size=self.head_dim, dtype=dtype, sliding_window=grp.window)
            out.append(KVCacheGroupSpec(layer_names=names, spec=spec))
        return tuple(out)

    def num_blocks_for_budget(self, budget_bytes: int) -> int:
        """Pages that fit in `budget_bytes` (null block included)."""
        from kvcache.config import num_blocks_for_budget

        by_kvcache = num_blocks_for_budget(budget_bytes, self.kv_cache_groups())
        # Our page is sized by the largest group; never exceed what the bytes allow.
        return min(by_kvcache, budget_bytes // self.page_size_bytes)
