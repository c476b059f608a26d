"""The connector's batched copy planning and gather/scatter, on CPU tensors.

The same functions run on CUDA pools (into pinned staging, on a side stream);
here they are checked byte for byte against a per-page reference.
"""
from __future__ import annotations

import random

import pytest
import torch

from connectors.zmq.paths.cuda_staging import MAX_RUN_COPIES, StreamFences, fences_for, gather_pages, plan_copies, scatter_pages
from connectors.zmq.paths.choice import page_access_for
from pd.engine.kv.page_pool import PagePool


def test_plan_groups_consecutive_ids_into_runs():
    plan = plan_copies([4, 5, 6, 9, 10, 2])
    assert plan.runs == ((4, 0, 3), (9, 3, 2), (2, 5, 1))
    assert plan.num_pages == 6 and not plan.use_index and plan.num_copies == 3


def test_plan_many_runs_becomes_one_index_copy():
    ids = list(range(40, 0, -2))  # 20 runs of one page each
    plan = plan_copies(ids)
    assert len(plan.runs) == 20 > MAX_RUN_COPIES
    assert plan.use_index and plan.num_copies == 1


def test_plan_descending_ids_are_not_merged_and_empty_is_empty():
    assert plan_copies([3, 2, 1]).runs == ((3, 0, 1), (2, 1, 1), (1, 2, 1))
    empty = plan_copies([])
    assert empty.runs == () and empty.num_pages == 0


@pytest.mark.parametrize("bad", [[1, -1], [1, 2.0], [None]])
def test_plan_refuses_bad_ids(bad):
    with pytest.raises(ValueError, match="non-negative ints"):
        plan_copies(bad)


@pytest.mark.parametrize("seed", range(6))
def test_gather_then_scatter_is_byte_exact(seed):
    rng = random.Random(seed)
    pool = torch.randint(0, 256, (64, 96), dtype=torch.uint8)
    num = rng.randint(1, 40)
    if seed % 2:  # long runs -> slice copies
        start = rng.randint(1, 64 - num)
        ids = list(range(start, start + num))
    else:  # scattered -> index path
        ids = rng.sample(range(1, 64), num)
    staging = torch.zeros((48, 96), dtype=torch.uint8)
    gather_pages(pool, ids, staging)
    for row, block in enumerate(ids):
        assert torch.equal(staging[row], pool[block])
    dst = torch.zeros_like(pool)
    scatter_pages(staging, dst, ids)
    assert torch.equal(dst[ids], pool[ids])
    untouched = sorted(set(range(64)) - set(ids))
    assert int(dst[untouched].sum()) == 0


def test_gather_refuses_more_pages_than_staging_rows():
    pool = torch.zeros((8, 4), dtype=torch.uint8)
    with pytest.raises(ValueError, match="do not fit"):
        gather_pages(pool, [1, 2, 3], torch.zeros((2, 4), dtype=torch.uint8))
    with pytest.raises(ValueError, match="source rows"):
        scatter_pages(torch.zeros((2, 4), dtype=torch.uint8), pool, [1, 2, 3])


def test_fences_are_noops_on_a_cpu_pool():
    pool = PagePool(4, 64)
    fences = fences_for(pool)
    assert fences is fences_for(pool) and not fences.enabled
    fences.mark_written()
    fences.order_reads_after_landing()  # nothing recorded, nothing to wait for
    assert StreamFences(torch.device("cpu")).enabled is False


def test_page_access_cpu_path_round_trips_through_a_host_tensor():
    src = PagePool(16, 128)
    src.buffer.copy_(torch.randint(0, 256, src.buffer.shape, dtype=torch.uint8))
    dst = PagePool(16, 128)
    ids_src, ids_dst = [3, 4, 5, 9], [15, 1, 2, 7]
    rows = torch.zeros((4, 128), dtype=torch.uint8)
    page_access_for(src).copy_out(ids_src, rows)
    page_access_for(dst).copy_in(rows, ids_dst)
    assert torch.equal(dst.buffer[ids_dst], src.buffer[ids_src])
