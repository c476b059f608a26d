"""The host-staged pipeline (staging ring, chunked sends and landings) on CPU pools.

A CUDA pool always goes through the ring; `StagingShape(stage_host_pools=True)`
runs the very same ring on CPU pools, so its chunking, slot order and bytes are
checked here without a GPU: unit by unit, then end to end through real
sockets, clean and under the fault link's corrupted and delayed page bytes.
"""
from __future__ import annotations

import random

import pytest
import torch

from connectors.links.fault_link import LINK_POINTS, FaultLink
from connectors.links.faults import FaultPlan
from connectors.metrics import FailureCause
from connectors.zmq.consumer.consumer import Consumer, RemoteAddr
from connectors.zmq.consumer.consumer_config import ConsumerConfig
from connectors.zmq.paths.choice import page_access_for
from connectors.zmq.paths.page_access import page_runs
from connectors.zmq.producer.producer import Producer, ProducerConfig
from connectors.zmq.paths.staging_ring import StagingRing, StagingShape
from pd.engine.kv.page_pool import PagePool

SECRET = b"staging-test-secret-0123456789"
PAGE = 4096


def _filled(num_blocks: int, seed: int) -> PagePool:
    pool = PagePool(num_blocks, PAGE)
    pool.buffer.random_(0, 256, generator=torch.Generator().manual_seed(seed))
    return pool


def test_shape_needs_two_slots_and_a_positive_chunk():
    with pytest.raises(ValueError, match="slots"):
        StagingShape(slots=1)
    with pytest.raises(ValueError, match="chunk_bytes"):
        StagingShape(chunk_bytes=0)
    assert StagingShape(chunk_bytes=3 * PAGE).rows(PAGE) == 3
    assert StagingShape(chunk_bytes=PAGE // 2).rows(PAGE) == 1  # a page larger than a chunk: one page a chunk


@pytest.mark.parametrize("slots", [2, 3])
def test_gathered_chunks_come_in_order_and_no_later_copy_overwrites_a_yielded_slot(slots):
    pool = _filled(64, 1)
    ring = StagingRing(pool, StagingShape(chunk_bytes=3 * PAGE, slots=slots, stage_host_pools=True))
    ids = random.Random(2).sample(range(1, 64), 20)  # 7 chunks: the ring wraps around several times
    seen: list[int] = []
    for chunk, rows in ring.gather_chunks(ids):
        assert len(chunk) <= 3 and chunk == ids[len(seen) : len(seen) + len(chunk)]
        # the later chunks' copies were queued before this yield: none may have landed in this slot
        assert torch.equal(rows, pool.buffer[chunk])
        seen += chunk
    assert seen == ids


def test_landing_slots_rotate_and_land_byte_exact():
    src, dst = _filled(32, 3), PagePool(32, PAGE)
    access = page_access_for(dst, StagingShape(chunk_bytes=2 * PAGE, slots=2, stage_host_pools=True))
    assert not access.on_host and access.staging_pages == 2
    ids = [5, 9, 10, 30, 2]
    slots = []
    for a in range(0, len(ids), 2):
        chunk = ids[a : a + 2]
        rows = access.landing(chunk)
        slots.append(rows[0].ctypes.data)
        for row, b in zip(rows, chunk, strict=True):
            row[:] = src.buffer[b].numpy()
        access.commit(chunk)
    access.settle()
    assert slots[0] == slots[2] != slots[1]  # two slots, taken in turn
    assert torch.equal(dst.buffer[ids], src.buffer[ids])
    assert int(dst.buffer[sorted(set(range(32)) - set(ids))].sum()) == 0


def test_in_place_sends_one_view_per_run_of_consecutive_pages():
    pool = _filled(32, 4)
    ids = [3, 4, 5, 9, 10, 1]
    assert page_runs(ids) == [(3, 3), (9, 2), (1, 1)]
    (views,) = list(page_access_for(pool).send_views(ids))
    assert [len(v) for v in views] == [3 * PAGE, 2 * PAGE, PAGE]
    assert b"".join(bytes(v) for v in views) == pool.buffer[ids].numpy().tobytes()


def test_staged_sends_one_view_per_chunk():
    pool = _filled(32, 5)
    ids = list(range(1, 8))
    access = page_access_for(pool, StagingShape(chunk_bytes=3 * PAGE, slots=2, stage_host_pools=True))
    sent = [bytes(views[0]) for views in access.send_views(ids) if len(views) == 1]
    assert [len(b) for b in sent] == [3 * PAGE, 3 * PAGE, PAGE]
    assert b"".join(sent) == pool.buffer[ids].numpy().tobytes()
    assert access.page_digests(ids) == page_access_for(pool).page_digests(ids)


STAGED = StagingShape(chunk_bytes=3 * PAGE, slots=2, stage_host_pools=True)


def _pair(src_pool, dst_pool, data_path: str, plan: FaultPlan | None = None):
    prod = Producer(ProducerConfig(engine_id="P", secret=SECRET, compat_hash="c", staging=STAGED,
                                   shm_chunk_bytes=2 * PAGE), src_pool)
    prod.start()
    link = FaultLink("127.0.0.1", prod.port, plan).start() if plan is not None else None
    cons = Consumer(ConsumerConfig(engine_id="D", secret=SECRET, compat_hash="c", data_path=data_path,
                                   num_tcp_streams=1, transfer_timeout_s=5.0, io_timeout_s=2.0, staging=STAGED),
                    dst_pool)
    cons.start()
    remote = RemoteAddr("P", "127.0.0.1", link.port if link else prod.port)
    return prod, link, cons, remote


def _load(prod, cons, remote, rid: str, src: list[int], dst: list[int]):
    prod.add_lease(rid, src)
    job = cons.load(rid, remote, rid, src, dst)
    assert job.done.wait(20), "load did not finish"
    return job.result


def _close(prod, link, cons) -> None:
    cons.shutdown()
    if link is not None:
        link.close()
    prod.shutdown()


@pytest.mark.parametrize("data_path", ["tcp", "shm_staged"])
def test_staged_pipeline_lands_every_byte_over_real_sockets(data_path):
    src_pool, dst_pool = _filled(64, 6), PagePool(64, PAGE)
    prod, link, cons, remote = _pair(src_pool, dst_pool, data_path)
    try:
        rng = random.Random(7)
        for n in (1, 2, 3, 4, 7, 20):  # below, at and across chunk and slot boundaries
            src = rng.sample(range(1, 64), n)
            dst = rng.sample(range(1, 64), n)
            result = _load(prod, cons, remote, f"r{n}", src, dst)
            assert result.ok, result
            assert torch.equal(dst_pool.buffer[dst], src_pool.buffer[src])
        assert cons.data_paths()["P"] == [data_path]
    finally:
        _close(prod, link, cons)


def test_staged_pipeline_under_faults_reports_corruption_and_survives_a_delay():
    plan = FaultPlan.parse("data.page_bytes:corrupt,data.page_bytes:delay:0.3:after=1", LINK_POINTS)
    src_pool, dst_pool = _filled(64, 8), PagePool(64, PAGE)
    prod, link, cons, remote = _pair(src_pool, dst_pool, "tcp", plan)
    try:
        src, dst = list(range(1, 11)), list(range(63, 53, -1))
        bad = _load(prod, cons, remote, "corrupt", src, dst)  # one flipped byte: caught, never accepted
        assert not bad.ok and bad.cause is FailureCause.CHECKSUM and len(bad.invalid_block_ids) >= 1
        assert set(bad.invalid_block_ids) <= set(dst)
        late = _load(prod, cons, remote, "late", src, dst)  # late bytes, within the timeout: exact
        assert late.ok, late
        assert torch.equal(dst_pool.buffer[dst], src_pool.buffer[src])
        assert plan.fired()
    finally:
        _close(prod, link, cons)
