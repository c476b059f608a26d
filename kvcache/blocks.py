"""Block metadata and the O(1) free queue.

`KVCacheBlock` is one physical block id's bookkeeping. `FreeKVCacheBlockQueue`
is an intrusive doubly linked list threaded through the blocks themselves
(no Python objects allocated per operation) between two sentinels, so a free
block can leave from the middle in O(1) when a prefix hit claims it.

Queue order is eviction order: the head is handed out (and evicted) first.
Invariants: a block is in the queue iff its `prev_free_block` is not None;
`num_free_blocks` equals the number of real blocks between the sentinels.
"""
from __future__ import annotations


class KVCacheBlock:
    """Metadata of one block.

    `block_hash` is the prefix hash the block is cached under (None when not in
    the prefix cache) and `hash_group_id` the KV cache group of that entry; only
    the BlockPool writes them. `ref_cnt` counts the requests holding the block
    (meaningless for the null block).
    """

    __slots__ = ("block_id", "ref_cnt", "block_hash", "hash_group_id",
                 "prev_free_block", "next_free_block", "is_null")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        self.hash_group_id = -1
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None
        self.is_null = False

    def __repr__(self) -> str:
        # neighbour ids only: printing neighbours would recurse through the list
        prev_id = self.prev_free_block.block_id if self.prev_free_block else None
        next_id = self.next_free_block.block_id if self.next_free_block else None
        return (f"KVCacheBlock(block_id={self.block_id}, ref_cnt={self.ref_cnt}, "
                f"hashed={self.block_hash is not None}, prev={prev_id}, next={next_id})")


class FreeKVCacheBlockQueue:
    """Free blocks in eviction order (head first); all operations O(1) per block."""

    __slots__ = ("num_free_blocks", "head", "tail")

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.head = KVCacheBlock(-1)
        self.tail = KVCacheBlock(-1)
        self.head.next_free_block = self.tail
        self.tail.prev_free_block = self.head
        self.num_free_blocks = 0
        self.append_n(blocks)

    def popleft(self) -> KVCacheBlock:
        block = self.head.next_free_block
        if block is self.tail:
            raise ValueError("No free blocks available")
        nxt = block.next_free_block
        self.head.next_free_block = nxt
        nxt.prev_free_block = self.head
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n <= 0:
            return []
        if n > self.num_free_blocks:
            raise ValueError(f"Cannot pop {n} blocks: only {self.num_free_blocks} free")
        out = [None] * n  # filled by index: cheaper than append per block
        block = self.head.next_free_block
        for i in range(n):
            out[i] = block
            nxt = block.next_free_block
            block.prev_free_block = block.next_free_block = None
            block = nxt
        self.head.next_free_block = block
        block.prev_free_block = self.head
        self.num_free_blocks -= n
        return out

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise RuntimeError(f"remove() of a block that is not in the free queue: {block}")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self.tail.prev_free_block
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self.tail
        self.tail.prev_free_block = block
        self.num_free_blocks += 1

    def append_n(self, blocks: list[KVCacheBlock]) -> None:
        """Append `blocks` at the tail, keeping their order (blocks[-1] becomes tail)."""
        last = self.tail.prev_free_block
        for block in blocks:
            block.prev_free_block = last
            last.next_free_block = block
            last = block
        last.next_free_block = self.tail
        self.tail.prev_free_block = last
        self.num_free_blocks += len(blocks)

    def prepend_n(self, blocks: list[KVCacheBlock]) -> None:
        """Insert `blocks` at the head, keeping their order (blocks[0] becomes head)."""
        if not blocks:
            return
        first = self.head.next_free_block
        prev = self.head
        for block in blocks:
            block.prev_free_block = prev
            prev.next_free_block = block
            prev = block
        prev.next_free_block = first
        first.prev_free_block = prev
        self.num_free_blocks += len(blocks)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Head-to-tail walk (tests and audits)."""
        out = []
        block = self.head.next_free_block
        tail = self.tail
        while block is not tail:
            out.append(block)
            block = block.next_free_block
        return out
