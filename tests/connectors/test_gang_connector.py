"""The real ZMQ connector between TP gangs (connectors/zmq/gang/gang_path.py): a Producer whose rank 0
holds P rank 0's pool and a Consumer whose rank 0 holds D rank 0's pool, the other ranks' agents
threads here with their own pools (`test_gang_processes.py`: processes). The handshake, the session,
leases and DONE run between the rank 0s as for TP 1; every D rank pulls its own heads.

Checked: P TP 2 -> D TP 1 and P TP 1 -> D TP 2 (and 4 -> 2 replicated) on tcp and shm land every D
rank's heads byte for byte, each D rank receiving its share and nothing else; the producer's lease
is released after the load; a plain consumer cannot pull from a gang (it would get rank 0's heads
alone); TP 1 <-> TP 1 does not take the gang path and its WELCOME has no `tp`.
"""
from __future__ import annotations

import time

import pytest

from connectors.metrics import FailureCause
from connectors.zmq.consumer.consumer import Consumer, RemoteAddr
from connectors.zmq.consumer.consumer_config import ConsumerConfig
from connectors.zmq.gang.gang_control import GangControl
from connectors.zmq.gang.gang_side import GangSide
from connectors.zmq.gang.rank_agent import RankAgent
from connectors.zmq.producer.producer import Producer, ProducerConfig
from tests.helpers.gang_pools import GangPools, model_layout

SECRET = b"gang-connector-test-secret-0123"
NUM_BLOCKS = 12
P_BLOCKS = [1, 3, 4, 6, 9, 10, 11, 2]
D_BLOCKS = [5, 2, 7, 1, 8, 3, 11, 10]


def _gang(pools: GangPools, prefill: bool):
    """Rank 0's GangSide and the other ranks' agents (threads) of one side."""
    tp = pools.p_shape.tp if prefill else pools.d_shape.tp
    geometry = pools.p_geometry() if prefill else pools.d_geometry()
    heads = pools.p_heads if prefill else pools.d_heads
    own = pools.p_pools if prefill else pools.d_pools
    control = GangControl(tp) if tp > 1 else None
    agents = [RankAgent(control.address, own[r], geometry, heads(r), serve=prefill) for r in range(1, tp)]
    side = GangSide(tp, heads(0), geometry, control, load_timeout_s=10.0)
    side.attach_pool(own[0], serve=prefill)
    return side, agents


def _pair(pools: GangPools, data_path: str, consumer_gang: bool = True):
    p_side, p_agents = _gang(pools, prefill=True)
    prod = Producer(ProducerConfig(engine_id="P", secret=SECRET, compat_hash="c", lease_s=30.0), pools.p_pools[0])
    prod.data_streams.gang = p_side
    prod.start()
    cons = Consumer(ConsumerConfig(engine_id="D", secret=SECRET, compat_hash="c", data_path=data_path,
                                   transfer_timeout_s=20.0), pools.d_pools[0])
    d_side, d_agents = _gang(pools, prefill=False) if consumer_gang else (None, [])
    cons.gang = d_side
    cons.start()
    return prod, cons, (p_side, d_side), p_agents + d_agents


def _close(prod, cons, sides):
    cons.shutdown()
    prod.shutdown()
    for side in sides:
        if side is not None:
            side.close()


def _wait(pred, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not pred() and time.monotonic() < deadline:
        time.sleep(0.01)
    return pred()


@pytest.mark.parametrize("data_path", ["tcp", "shm"])
@pytest.mark.parametrize(("p_tp", "d_tp", "num_kv_heads"), [(2, 1, 2), (1, 2, 2), (4, 2, 2)])
def test_a_load_between_gangs_moves_each_rank_its_heads(p_tp, d_tp, num_kv_heads, data_path):
    pools = GangPools(model_layout(num_kv_heads), NUM_BLOCKS, p_tp, d_tp)
    prod, cons, sides, agents = _pair(pools, data_path)
    try:
        remote = RemoteAddr("P", "127.0.0.1", prod.port)
        for rid, (src, dst) in {"a": (P_BLOCKS, D_BLOCKS), "b": ([5], [4])}.items():
            prod.add_lease(rid, src)
            job = cons.load(rid, remote, rid, src, dst)
            assert job.done.wait(20) and job.result.ok, job.result
            assert _wait(lambda rid=rid: rid in prod.take_released() or not prod.leases.holds(rid))
        assert cons.data_paths()["P"] == ["gang", "gang"]
        d_agents = [sides[1]._agent] + [a for a in agents if a.server is None]
        for r in range(d_tp):
            assert pools.d_holds(r, P_BLOCKS, D_BLOCKS) and pools.d_holds(r, [5], [4])
            assert d_agents[r].received_bytes == pools.d_share(r, len(P_BLOCKS) + 1)
        p_agents = [sides[0]._agent] + [a for a in agents if a.server is not None]
        assert all(a.received_bytes == 0 for a in p_agents)  # P ranks only serve
        if p_tp > num_kv_heads:  # replicas hold a head another rank serves: never read
            assert [a.server.served_slices > 0 for a in p_agents] == [True, False] * (p_tp // 2)
        assert all(a.server.live_tickets() == 0 for a in p_agents)  # every ticket revoked with its pull
    finally:
        _close(prod, cons, sides)


def test_a_consumer_without_a_gang_cannot_pull_from_a_gang():
    pools = GangPools(model_layout(2), NUM_BLOCKS, 2, 1)
    prod, cons, sides, _ = _pair(pools, "tcp", consumer_gang=False)
    try:
        prod.add_lease("x", [1, 2])
        job = cons.load("x", RemoteAddr("P", "127.0.0.1", prod.port), "x", [1, 2], [3, 4])
        assert job.done.wait(20) and not job.result.ok and job.result.invalid_block_ids == [3, 4]
        assert job.result.cause is FailureCause.PEER_GONE
        assert int(pools.d_pools[0].buffer.count_nonzero()) == 0
    finally:
        _close(prod, cons, sides)


def test_single_rank_gangs_keep_the_plain_paths():
    pools = GangPools(model_layout(2), NUM_BLOCKS, 1, 1)
    prod, cons, sides, _ = _pair(pools, "tcp")
    try:
        prod.add_lease("y", [1, 2])
        job = cons.load("y", RemoteAddr("P", "127.0.0.1", prod.port), "y", [1, 2], [3, 4])
        assert job.done.wait(20) and job.result.ok
        assert set(cons.data_paths()["P"]) == {"tcp"}
        assert all(side._control is None for side in sides)  # a gang of one never started
        assert pools.d_holds(0, [1, 2], [3, 4])
    finally:
        _close(prod, cons, sides)
