"""KVCacheBlock and the intrusive free queue (eviction order lives here)."""
import pytest

from kvcache.blocks import FreeKVCacheBlockQueue, KVCacheBlock


def ids(queue):
    return [b.block_id for b in queue.get_all_free_blocks()]


def make(n):
    blocks = [KVCacheBlock(i) for i in range(n)]
    return blocks, FreeKVCacheBlockQueue(blocks)


def test_block_uses_slots_and_starts_clean():
    b = KVCacheBlock(3)
    assert not hasattr(b, "__dict__")
    with pytest.raises(AttributeError):
        b.some_new_field = 1
    assert (b.block_id, b.ref_cnt, b.block_hash, b.is_null) == (3, 0, None, False)
    assert "block_id=3" in repr(b)


def test_queue_initial_order_and_links():
    blocks, q = make(4)
    assert q.num_free_blocks == 4 and ids(q) == [0, 1, 2, 3]
    assert q.head.next_free_block is blocks[0] and blocks[0].prev_free_block is q.head
    assert q.tail.prev_free_block is blocks[3] and blocks[3].next_free_block is q.tail


def test_single_block_queue_links_to_sentinels():
    blocks, q = make(1)
    assert blocks[0].prev_free_block is q.head and blocks[0].next_free_block is q.tail


def test_popleft_remove_append_and_empty():
    blocks, q = make(5)
    first = q.popleft()
    assert first.block_id == 0 and first.prev_free_block is None and first.next_free_block is None
    q.remove(blocks[2])
    assert ids(q) == [1, 3, 4] and q.num_free_blocks == 3
    q.append(blocks[2])
    assert ids(q) == [1, 3, 4, 2]
    for _ in range(4):
        q.popleft()
    assert q.num_free_blocks == 0 and ids(q) == []
    with pytest.raises(ValueError, match="No free blocks available"):
        q.popleft()


def test_remove_of_unlinked_block_is_an_error():
    blocks, q = make(3)
    b = q.popleft()
    with pytest.raises(RuntimeError):
        q.remove(b)


def test_append_n_keeps_order():
    blocks, q = make(6)
    taken = q.popleft_n(6)
    q.append_n([])
    assert q.num_free_blocks == 0
    q.append_n([taken[3]])
    q.append_n([taken[1], taken[5], taken[0]])
    assert ids(q) == [3, 1, 5, 0] and q.num_free_blocks == 4


def test_prepend_n_puts_blocks_in_front_in_given_order():
    blocks, q = make(6)
    taken = q.popleft_n(6)
    q.append_n([taken[0]])
    q.prepend_n([taken[4], taken[5]])
    q.prepend_n([taken[1], taken[2]])
    q.prepend_n([])
    assert [q.popleft().block_id for _ in range(5)] == [1, 2, 4, 5, 0]


def test_popleft_n_counts_and_unlinks():
    blocks, q = make(5)
    assert q.popleft_n(0) == []
    got = q.popleft_n(3)
    assert [b.block_id for b in got] == [0, 1, 2]
    assert all(b.prev_free_block is None and b.next_free_block is None for b in got)
    assert ids(q) == [3, 4] and q.num_free_blocks == 2
    with pytest.raises(ValueError):
        q.popleft_n(3)
    assert ids(q) == [3, 4]
