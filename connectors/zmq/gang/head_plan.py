"""Which KV heads a rank of a decode gang reads from which rank of a prefill gang, and the head
copies themselves.

The wire and the compatibility check describe canonical pages (what a TP 1 worker holds: every
KV head). A rank of a TP gang holds a run of consecutive heads of every page (`RankHeads`), the
same block ids on every rank. A D rank reads each head it holds from the *lowest* P rank that
advertises it: with replicated heads (TP above the KV head count) several P ranks hold one head
and only one of them is read, whatever the D side's TP; the heads of one P rank are read as one
run (`SlicePull`). This is the mapping rule of `pd/engine/parallel/tp.py` (`transfer_plan`),
computed from what each P rank advertises rather than from the TP degrees, so it holds for any
pair of gangs (the tests check the two agree for every pair).

A page seen as rows (one row per layer, K/V and token, `rows_per_page` of them) has its heads
innermost but one, so a run of heads is one strided piece per row: `gather` packs it into one
contiguous buffer (the unit that crosses a socket, and what a checksum covers) and `scatter`
unpacks it into the destination heads.
"""
from __future__ import annotations

import dataclasses

import torch

from connectors.pages import KVPages


@dataclasses.dataclass(frozen=True)
class RankHeads:
    """Rank `rank` of a gang holds canonical KV heads `first .. first + count - 1` (local 0 ..)."""

    rank: int
    first: int
    count: int

    def __post_init__(self) -> None:
        if self.rank < 0 or self.first < 0 or self.count < 1:
            raise ValueError(f"bad head run: rank {self.rank}, heads {self.first}+{self.count}")

    @property
    def stop(self) -> int:
        return self.first + self.count


@dataclasses.dataclass(frozen=True)
class SlicePull:
    """One copy of a D rank: `count` heads from P rank `p_rank`'s local heads `p_first ..` into the
    D rank's local heads `d_first ..` (canonical head `head ..`)."""

    p_rank: int
    p_first: int
    d_first: int
    count: int
    head: int


def plan_pulls(sources: list[RankHeads], mine: RankHeads) -> list[SlicePull]:
    """The copies that fill `mine`'s heads, each head read once, from its lowest-ranked P holder.

    Raises ValueError when some head of `mine` is held by no source (gangs of different models)."""
    pulls: list[SlicePull] = []
    head = mine.first
    while head < mine.stop:
        holders = [s for s in sources if s.first <= head < s.stop]
        if not holders:
            raise ValueError(f"KV head {head} is held by no rank of the prefill gang "
                             f"({[(s.rank, s.first, s.count) for s in sources]})")
        src = min(holders, key=lambda s: s.rank)
        run = min(mine.stop, src.stop) - head
        pulls.append(SlicePull(src.rank, head - src.first, head - mine.first, run, head))
        head += run
    return pulls


@dataclasses.dataclass(frozen=True)
class HeadGeometry:
    """How one rank's pages split into heads: `num_heads` local heads of `head_dim` elements of
    `dtype` per row (rows per page follow from the page size)."""

    num_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def row_bytes(self) -> int:
        return self.num_heads * self.head_dim * torch.empty((), dtype=self.dtype).element_size()

    def rows_per_page(self, page_bytes: int) -> int:
        if page_bytes % self.row_bytes:
            raise ValueError(f"pages of {page_bytes} bytes are not whole rows of {self.row_bytes} bytes")
        return page_bytes // self.row_bytes

    def slice_bytes(self, page_bytes: int, count: int) -> int:
        """Bytes of a run of `count` heads of one page."""
        return page_bytes // self.num_heads * count


def head_pages(buffer: torch.Tensor, geometry: HeadGeometry) -> torch.Tensor:
    """A (num_blocks, page_bytes) uint8 pool (or a mapping of one) as (num_blocks, rows, heads,
    head_dim) of the KV dtype, no copy."""
    num_blocks, page_bytes = buffer.shape
    rows = geometry.rows_per_page(page_bytes)
    return buffer.view(geometry.dtype).view(num_blocks, rows, geometry.num_heads, geometry.head_dim)


def pool_heads(pool: KVPages, geometry: HeadGeometry) -> torch.Tensor:
    return head_pages(pool.buffer, geometry)


def _index(block_ids: list[int], num_blocks: int) -> torch.Tensor:
    if any(type(b) is not int or not 0 <= b < num_blocks for b in block_ids):
        raise ValueError(f"block ids outside a pool of {num_blocks} blocks")
    return torch.tensor(block_ids, dtype=torch.long)


def _heads(pages: torch.Tensor, first: int, count: int) -> torch.Tensor:
    if count < 1 or first < 0 or first + count > pages.shape[2]:
        raise ValueError(f"heads {first}+{count} outside pages of {pages.shape[2]} heads")
    return pages.narrow(2, first, count)


def gather(pages: torch.Tensor, block_ids: list[int], first: int, count: int,
           scratch: Scratch | None = None) -> torch.Tensor:
    """Heads `first ..` of these blocks, packed: (len(block_ids), rows, count, head_dim), contiguous
    (in `scratch`'s memory when given: fresh memory costs a page fault per page on first touch)."""
    src = _heads(pages, first, count)
    index = _index(block_ids, pages.shape[0]).to(pages.device)
    if scratch is None:
        return src.index_select(0, index)
    return torch.index_select(src, 0, index, out=scratch.take((len(block_ids), *src.shape[1:]), pages.dtype,
                                                              pages.device))


class Scratch:
    """One reusable buffer (grown as needed) for packed heads; its user must be done with one
    `take`'s tensor before the next `take`."""

    def __init__(self) -> None:
        self._flat: torch.Tensor | None = None

    def take(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        n = 1
        for d in shape:
            n *= d
        nbytes = n * torch.empty((), dtype=dtype).element_size()
        if self._flat is None or self._flat.numel() < nbytes or self._flat.device != device:
            self._flat = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return self._flat[:nbytes].view(dtype).view(shape)


def scatter(pages: torch.Tensor, block_ids: list[int], first: int, packed: torch.Tensor) -> None:
    """Writes a `gather` buffer into heads `first ..` of these blocks; other heads stay as they are."""
    dst = _heads(pages, first, packed.shape[2])
    if tuple(packed.shape) != (len(block_ids), *dst.shape[1:]) or packed.dtype != pages.dtype:
        raise ValueError(f"packed heads {tuple(packed.shape)} do not fit {(len(block_ids), *dst.shape[1:])}")
    dst.index_copy_(0, _index(block_ids, pages.shape[0]).to(pages.device), packed.to(pages.device))


def block_bytes(packed: torch.Tensor) -> list[memoryview]:
    """Each block's packed heads as bytes (what one checksum covers)."""
    flat = packed.reshape(packed.shape[0], -1).view(torch.uint8)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    mv = memoryview(flat.numpy()).cast("B")
    step = flat.shape[1]
    return [mv[i * step:(i + 1) * step] for i in range(flat.shape[0])]
