"""In-process checks of the connector's pure parts: wire, params, handshake, leases, planning."""
from __future__ import annotations

import dataclasses
import socket
import threading
import time

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from connectors.zmq.control import handshake as hs
from connectors.zmq.control import framing, wire
from connectors.zmq.producer.leases import LeaseTable, PullRefused
from connectors.metrics import TransferMetrics
from connectors.noop import NoopConnector
from connectors.params import InvalidKVParams, TransferParams, make_remote_prefill_params, parse_remote_prefill
from connectors.zmq.control.wire import MalformedMessage, MsgType
from connectors.zmq.scheduler import GroupLayout, ZmqConnectorScheduler


def test_wire_round_trip_and_strict_fields():
    data = wire.encode(MsgType.PULL, xfer=3, request_id="r", block_ids=[1, 2, 3])
    assert wire.decode(data)[0] is MsgType.PULL
    with pytest.raises(MalformedMessage):
        wire.encode(MsgType.PULL, xfer=True, request_id="r", block_ids=[1])  # bool is not an int
    bad = msgpack.packb({"v": wire.PROTOCOL_VERSION, "t": "pull", "xfer": 1, "request_id": "r", "block_ids": [-1]})
    with pytest.raises(MalformedMessage):
        wire.decode(bad)
    with pytest.raises(MalformedMessage):
        wire.decode(msgpack.packb({"v": wire.PROTOCOL_VERSION, "t": "pull", "xfer": 1, "request_id": "r", "block_ids": [1],
                                   "x": msgpack.ExtType(1, b"pickle?")}))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=256))
def test_wire_decode_never_raises_anything_but_malformed(data):
    try:
        wire.decode(data)
    except MalformedMessage:
        pass


@settings(max_examples=100, deadline=None)
@given(st.dictionaries(st.sampled_from(["v", "t", "xfer", "request_id", "block_ids", "half", "session"]),
                       st.one_of(st.integers(-5, 5), st.text(max_size=8), st.binary(max_size=8),
                                 st.lists(st.integers(-2, 2), max_size=3), st.none(), st.booleans())))
def test_wire_decode_fuzzed_maps(obj):
    try:
        msg_type, msg = wire.decode(msgpack.packb(obj, use_bin_type=True))
    except MalformedMessage:
        return
    for name, kind in wire.SCHEMA[msg_type].items():
        assert name in msg


def test_stream_frame_round_trip_over_a_real_socket():
    a, b = socket.socketpair()
    with a, b:
        b.settimeout(2)
        framing.send_frame(a, wire.encode(MsgType.CREDIT, half=1))
        assert framing.recv_frame(b) == (MsgType.CREDIT, {"v": wire.PROTOCOL_VERSION, "t": "credit", "half": 1})
        a.sendall((10**8).to_bytes(4, "big"))
        with pytest.raises(MalformedMessage):
            framing.recv_frame(b)
        page = bytes(range(256)) * 1024
        a.settimeout(5)
        sender = threading.Thread(target=framing.sendmsg_all, args=(a, [b"head", memoryview(page), b"tail"]))
        sender.start()
        got = bytearray(len(page) + 8)
        framing.recv_exact(b, memoryview(got))
        sender.join(5)
        assert bytes(got) == b"head" + page + b"tail"


def _params(**over):
    return dataclasses.replace(make_remote_prefill_params("P", "127.0.0.1", 5555, "r1", [[1, 2], [3]], 20), **over)


@pytest.mark.parametrize("over", [
    {"remote_port": 0}, {"remote_port": None}, {"remote_host": ""}, {"remote_block_ids": ((1, 2),)},
    {"remote_block_ids": ((1, 0), (3,))}, {"remote_num_tokens": -1}, {"remote_num_tokens": None},
    {"remote_engine_id": None}, {"streaming": True},
])
def test_params_are_validated(over):
    with pytest.raises(InvalidKVParams):
        parse_remote_prefill(_params(**over), num_groups=2)


@pytest.mark.parametrize("bad", [
    {"remote_port": "5555"}, {"do_remote_prefill": 1}, {"remote_block_ids": [[1, True], [3]]},
    {"remote_block_ids": [1, 2]}, {"remote_hots": "h"}, {"streaming": "yes"},
])
def test_a_callers_dict_is_type_checked_once(bad):
    with pytest.raises(InvalidKVParams):
        TransferParams.from_dict({**_params().to_dict(), **bad})


def test_params_round_trip():
    rp = parse_remote_prefill(_params(), num_groups=2)
    assert rp.block_ids == ((1, 2), (3,)) and rp.num_tokens == 20 and rp.port == 5555
    assert TransferParams.from_dict(_params().to_dict()) == _params()
    assert parse_remote_prefill(TransferParams.from_dict(_params().to_dict()), num_groups=2) == rp
    with pytest.raises(InvalidKVParams):  # the connector reads the typed form only
        parse_remote_prefill(_params().to_dict(), num_groups=2)


def test_handshake_proofs_bind_the_transcript():
    secret = b"k" * 32
    t = hs.transcript(b"c" * 16, b"p" * 16, "compat", "P", "D")
    proof = hs.proof(secret, "consumer", t)
    assert hs.check_proof(secret, "consumer", t, proof)
    assert not hs.check_proof(secret, "producer", t, proof)  # roles differ
    assert not hs.check_proof(b"x" * 32, "consumer", t, proof)
    assert not hs.check_proof(secret, "consumer", hs.transcript(b"c" * 16, b"q" * 16, "compat", "P", "D"), proof)


def test_compat_hash_changes_with_layout():
    base = dict(model_id="m", dtype="float32", num_layers=2, block_size=16, page_size_bytes=8192,
                groups=(("FullAttentionSpec", 2, 16, 8192, 0),))
    h = hs.CompatInfo(**base).hash()
    assert h == hs.CompatInfo(**base).hash()
    for key, value in [("dtype", "bfloat16"), ("block_size", 32), ("page_size_bytes", 4096), ("model_id", "n")]:
        assert hs.CompatInfo(**{**base, key: value}).hash() != h


def test_lease_table_release_waits_for_pulls_and_ends_once():
    metrics = TransferMetrics()
    table = LeaseTable(10.0, metrics)
    table.add("r", [1, 2, 3])
    with pytest.raises(PullRefused):
        table.begin_pull("r", [4])
    lease = table.begin_pull("r", [1, 2])
    assert table.end("r", __import__("connectors.metrics").metrics.LeaseEnd.DONE)
    assert table.take_released() == set()  # a pull is still reading the pages
    with pytest.raises(PullRefused):
        table.begin_pull("r", [1])  # no new pull once the lease ended
    table.end_pull(lease)
    assert table.take_released() == {"r"}
    assert table.take_released() == set()
    table.add("s", [5], lease_s=0.01)
    time.sleep(0.02)
    assert table.expire() == ["s"] and table.take_released() == {"s"}
    assert metrics.snapshot()["leases_expired"] == 1


def test_plan_pairs_positions_skips_null_and_local_hits():
    sched = ZmqConnectorScheduler("D", (GroupLayout(4, None), GroupLayout(4, 2)), 30.0, lambda: ("h", 0, None))
    rp = parse_remote_prefill(make_remote_prefill_params("P", "h", 1, "r", [[11, 12, 13, 14, 15], [24, 25]], 18), 2)
    # consumer: group 0 has a 2-block local hit; group 1 (window) holds nulls outside the window
    src, dst, uncovered = sched.plan(rp, ([1, 2, 3, 4, 5], [0, 0, 0, 6, 7]), num_local=8, num_total=18)
    assert list(zip(src, dst)) == [(13, 3), (14, 4), (15, 5), (24, 6), (25, 7)] and uncovered == []
    _, _, uncovered = sched.plan(rp, ([1, 2, 3, 4, 5], [0, 0, 8, 6, 7]), num_local=8, num_total=18)
    assert uncovered == [8]  # needed but not sent: the load must fail, not leave it unfilled


def test_clip_keeps_the_window_only():
    sched = ZmqConnectorScheduler("P", (GroupLayout(4, None), GroupLayout(4, 2)), 30.0, lambda: ("h", 0, None))
    assert sched.clip(([1, 2, 3, 4, 5, 9], [0, 0, 6, 7, 8, 10]), num_tokens=18) == [[1, 2, 3, 4, 5], [7, 8]]


def test_noop_connector_moves_nothing():
    c = NoopConnector()
    assert c.scheduler.get_num_new_matched_tokens(object(), 0) == (0, False)
    assert c.scheduler.request_finished(object(), ([1],)) == (False, None)
    assert c.worker.get_finished() == (set(), set())


@pytest.mark.parametrize("path", ["tcp", "shm", "shm_staged"])
def test_many_concurrent_loads_all_land_exactly(path):
    """Real sockets, one process: many loads in flight share streams; every page verified."""
    import random

    import torch

    from connectors.zmq.consumer.consumer import Consumer, RemoteAddr
    from connectors.zmq.consumer.consumer_config import ConsumerConfig
    from pd.engine.kv.page_pool import PagePool
    from connectors.zmq.producer.producer import Producer, ProducerConfig

    secret = b"concurrency-secret-0123456789"
    src_pool, dst_pool = PagePool(200, 4096), PagePool(200, 4096)
    src_pool.buffer.random_(0, 256, generator=torch.Generator().manual_seed(5))
    prod = Producer(ProducerConfig(engine_id="P", secret=secret, compat_hash="c", shm_chunk_bytes=5 * 4096), src_pool)
    prod.start()
    cons = Consumer(ConsumerConfig(engine_id="D", secret=secret, compat_hash="c", data_path=path), dst_pool)
    cons.start()
    try:
        rng = random.Random(1)
        free_dst = list(range(1, 200))
        rng.shuffle(free_dst)
        jobs = []
        for i in range(24):
            n = rng.randint(1, 8)
            src = rng.sample(range(1, 200), n)
            dst, free_dst = free_dst[:n], free_dst[n:]
            prod.add_lease(f"r{i}", src)
            jobs.append((cons.load(f"r{i}", RemoteAddr("P", "127.0.0.1", prod.port), f"r{i}", src, dst), src, dst))
        for job, src, dst in jobs:
            assert job.done.wait(20) and job.result.ok, job.result
            assert torch.equal(dst_pool.buffer[dst], src_pool.buffer[src])
        paths = {s.path.value for session in cons._sessions.values() for s in session.streams}
        assert paths == {{"shm": "shm_mapped"}.get(path, path)}  # the user's shm, for a CPU pool: mapped
        deadline = time.monotonic() + 5
        released: set[str] = set()
        while len(released) < 24 and time.monotonic() < deadline:
            released |= prod.take_released()  # consumers report DONE after each load
            time.sleep(0.01)
        assert released == {f"r{i}" for i in range(24)}
    finally:
        cons.shutdown()
        prod.shutdown()


def test_per_peer_loads_keep_a_bounded_ring_of_warm_samples_and_a_bounded_peer_table():
    from connectors.metrics import MAX_PEERS, RECENT_LOADS_PER_PEER, FailureCause

    m = TransferMetrics()
    m.record_load(4, 4096, 0.5, peer="p0", warm=False)  # waited for a handshake: counted, not sampled
    for i in range(RECENT_LOADS_PER_PEER + 5):
        m.record_load(1, 1024 * (i + 1), 0.001 * (i + 1), peer="p0")
    m.record_failure(FailureCause.TIMEOUT, peer="p0")
    m.record_load(1, 10, 0.1)  # no peer named: only the totals
    p0 = m.snapshot()["peers"]["p0"]
    assert p0["num_loads"] == RECENT_LOADS_PER_PEER + 6 and p0["num_failed"] == 1
    assert p0["num_bytes"] == 4096 + sum(1024 * (i + 1) for i in range(RECENT_LOADS_PER_PEER + 5))
    assert len(p0["recent"]) == RECENT_LOADS_PER_PEER
    last = RECENT_LOADS_PER_PEER + 5
    assert p0["recent"][-1] == [1024 * last, pytest.approx(0.001 * last)]
    assert p0["recent"][0][0] == 1024 * 6  # the oldest samples went first
    for i in range(MAX_PEERS):
        m.record_load(1, 1, 0.001, peer=f"q{i}")
    peers = m.snapshot()["peers"]
    assert len(peers) == MAX_PEERS and "p0" not in peers  # the least recently loaded from went first
