"""The TP mapping rule (pd/engine/parallel/tp.py) for every pair of TP degrees in {1, 2, 4, 8} and
KV heads in {1, 2, 4, 8, 16}: canonical pages coded by (head, block, row, element) are split into P
ranks' shards, moved by the transfer plan into D ranks' shards, and each D shard must hold exactly its
heads, read once each, from a primary P owner only (replicas are poisoned with NaN, so a read of one
shows). Bad combinations are refused naming both numbers and the role."""
from __future__ import annotations

import itertools

import pytest
import torch

from pd.engine.parallel.tp import TPShape, check_tp, describe_plan, slices_for, transfer_plan, valid_tps

TPS = (1, 2, 4, 8)
KV_HEADS = (1, 2, 4, 8, 16)
BLOCKS, ROWS, HEAD_DIM = 3, 6, 4


def _canonical(num_kv_heads: int) -> torch.Tensor:
    """(blocks, rows, heads, head_dim), every element distinct and exact in float32."""
    n = BLOCKS * ROWS * num_kv_heads * HEAD_DIM
    return torch.arange(n, dtype=torch.float32).view(BLOCKS, ROWS, num_kv_heads, HEAD_DIM)


@pytest.mark.parametrize("num_kv_heads", KV_HEADS)
def test_each_rank_holds_its_heads_and_every_head_has_its_owners(num_kv_heads):
    for tp in TPS:
        shape = TPShape(tp, num_kv_heads, num_heads=16)
        held = [list(shape.heads_of(r)) for r in range(tp)]
        assert all(len(h) == max(1, num_kv_heads // tp) for h in held)
        for head in range(num_kv_heads):
            owners = [r for r in range(tp) if head in held[r]]
            assert owners == list(shape.owners(head)) and len(owners) == max(1, tp // num_kv_heads)
            assert shape.primary_owner(head) == owners[0] and shape.is_primary(owners[0])
            assert not any(shape.is_primary(r) for r in owners[1:])
            for r in owners:
                assert held[r][shape.local_index(r, head)] == head
        # query heads: split evenly, and each maps (GQA group) to a KV head its rank holds
        group = 16 // num_kv_heads
        q = [list(shape.query_heads_of(r)) for r in range(tp)]
        assert sorted(itertools.chain(*q)) == list(range(16))
        assert all({h // group for h in q[r]} <= set(held[r]) for r in range(tp))


@pytest.mark.parametrize(("p_tp", "d_tp", "num_kv_heads"), list(itertools.product(TPS, TPS, KV_HEADS)))
def test_the_plan_moves_each_d_rank_exactly_its_heads_from_primary_owners(p_tp, d_tp, num_kv_heads):
    canonical = _canonical(num_kv_heads)
    p, d = TPShape(p_tp, num_kv_heads, 16), TPShape(d_tp, num_kv_heads, 16)
    p_shards = []
    for rank in range(p_tp):
        shard = canonical[:, :, p.heads_of(rank).start:p.heads_of(rank).stop].clone()
        if not p.is_primary(rank):
            shard.fill_(float("nan"))  # a replica: if the plan ever reads one, D sees NaN
        p_shards.append(shard)
    d_blocks = torch.tensor([2, 0, 1])  # D's block ids differ from P's: D block d_blocks[i] <- P block i
    d_shards = [torch.full((BLOCKS, ROWS, d.heads_per_rank, HEAD_DIM), -1.0) for _ in range(d_tp)]
    plan = transfer_plan(p_tp, d_tp, num_kv_heads)
    reads: dict[tuple[int, int], int] = {}
    received = [0] * d_tp
    for s in plan:
        assert p.is_primary(s.p_rank), f"{s} reads a replica"
        src = p_shards[s.p_rank][:, :, s.p_first:s.p_first + s.count]
        d_shards[s.d_rank][d_blocks, :, s.d_first:s.d_first + s.count] = src
        received[s.d_rank] += src.numel() * src.element_size()
        for h in range(s.head, s.head + s.count):
            reads[(s.d_rank, h)] = reads.get((s.d_rank, h), 0) + 1
    assert reads == {(r, h): 1 for r in range(d_tp) for h in d.heads_of(r)}
    page_bytes = canonical.numel() * canonical.element_size()
    for rank in range(d_tp):
        heads = d.heads_of(rank)
        assert torch.equal(d_shards[rank][d_blocks], canonical[:, :, heads.start:heads.stop])
        assert received[rank] * num_kv_heads == page_bytes * d.heads_per_rank  # its share of the page
        assert slices_for(plan, rank) == tuple(s for s in plan if s.d_rank == rank)
    # one slice per (D rank, P rank) pair that shares heads, no more
    assert len({(s.d_rank, s.p_rank) for s in plan}) == len(plan)


def test_the_plan_for_the_reference_table():
    """The six cases docs/tensor-parallel.md lists, written out by hand."""
    want = {
        (2, 1, 2): "D0 <- P0: 0->0, P1: 0->1",
        (1, 2, 2): "D0 <- P0: 0->0; D1 <- P0: 1->0",
        (4, 2, 8): "D0 <- P0: 0-1->0-1, P1: 0-1->2-3; D1 <- P2: 0-1->0-1, P3: 0-1->2-3",
        (4, 2, 2): "D0 <- P0: 0->0; D1 <- P2: 0->0",
        (2, 4, 2): "D0 <- P0: 0->0; D1 <- P0: 0->0; D2 <- P1: 0->0; D3 <- P1: 0->0",
        (4, 1, 2): "D0 <- P0: 0->0, P2: 0->1",
    }
    assert {case: describe_plan(transfer_plan(*case)) for case in want} == want


@pytest.mark.parametrize(("tp", "num_heads", "num_kv_heads", "role", "names"), [
    (4, 12, 6, "prefill", ["prefill TP 4", "6 KV heads", "divide one another", "[1, 2, 3, 6, 12]"]),
    (2, 3, 3, "decode", ["decode TP 2", "3 KV heads"]),
    (8, 4, 2, "decode", ["decode TP 8", "4 query heads", "must divide the query heads"]),
    (3, 16, 8, "colocated", ["colocated TP 3", "8 KV heads"]),
    (0, 16, 8, "prefill", ["prefill TP 0", "positive integer"]),
    (2, 6, 4, "prefill", ["6 query heads and 4 KV heads"]),
])
def test_bad_combinations_are_refused_with_both_numbers_and_the_role(tp, num_heads, num_kv_heads, role, names):
    with pytest.raises(ValueError) as err:
        check_tp(tp, num_heads, num_kv_heads, role)
    assert all(n in str(err.value) for n in names), str(err.value)


def test_valid_tps_is_what_check_tp_accepts():
    for num_heads, num_kv_heads in [(16, 16), (16, 2), (32, 8), (12, 6), (14, 7), (8, 1)]:
        accepted = []
        for tp in range(1, 40):
            try:
                check_tp(tp, num_heads, num_kv_heads, "decode")
                accepted.append(tp)
            except ValueError:
                pass
        assert accepted == valid_tps(num_heads, num_kv_heads) and 1 in accepted


def test_a_transfer_between_invalid_degrees_is_refused():
    with pytest.raises(ValueError, match="prefill TP 4 and 6 KV heads"):
        transfer_plan(4, 2, 6)
    with pytest.raises(ValueError, match="decode TP 3 and 2 KV heads"):
        transfer_plan(2, 3, 2)
    with pytest.raises(ValueError, match="rank 4 is not a rank of TP 4"):
        TPShape(4, 2).heads_of(4)
