"""The consumer's trace context in PULL frames (real msgpack frames, a real producer and consumer on
sockets) and the producer's lease reports: a valid W3C traceparent reaches the report, anything else
a peer sends is dropped without failing the pull; reports say how each lease ended."""
from __future__ import annotations

import time

import msgpack
import pytest
import torch

from connectors.params import KV_TRACE_CONTEXT_KEY
from connectors.params import MAX_TRACE_CONTEXT_LEN, valid_trace_context
from connectors.zmq.control import wire
from connectors.zmq.consumer.consumer import Consumer, RemoteAddr
from connectors.zmq.consumer.consumer_config import ConsumerConfig
from connectors.zmq.producer.producer import Producer, ProducerConfig
from connectors.zmq.control.wire import MsgType
from pd.engine.kv.page_pool import PagePool

SECRET = b"trace-context-secret-0123456789"
PAGE = 4096
GOOD = "00-" + "4bf92f3577b34da6a3ce929d0e0e4736" + "-" + "00f067aa0ba902b7" + "-01"
GARBAGE = ["", "00-zz", GOOD.upper(), GOOD + "-extra", "ff" + GOOD[2:], "00-" + "0" * 32 + GOOD[35:],
           GOOD[:36] + "0" * 16 + "-01", "x" * 300, "y" * 60_000, 7, b"00-bytes", [GOOD], {"tp": GOOD}, None]


def _decode_pull(tc) -> dict:
    """A PULL as a peer might send it: real msgpack, with `tc` of any type."""
    raw = msgpack.packb({"v": wire.PROTOCOL_VERSION, "t": "pull", "xfer": 1, "request_id": "r", "block_ids": [1],
                         "tc": tc}, use_bin_type=True)
    msg_type, msg = wire.decode(raw)
    assert msg_type is MsgType.PULL
    return msg


def test_pull_frames_carry_a_trace_context_and_garbage_is_ignored_not_refused():
    assert len(GOOD) == MAX_TRACE_CONTEXT_LEN and KV_TRACE_CONTEXT_KEY == "trace_context"
    with_tc, without = wire.pull_frame(5, "req", [3, 4], GOOD), wire.pull_frame(5, "req", [3, 4])
    assert wire.decode(with_tc[4:])[1] == {**wire.decode(without[4:])[1], "tc": GOOD}
    assert "tc" not in wire.decode(without[4:])[1]
    assert valid_trace_context(wire.decode(with_tc[4:])[1]["tc"]) == GOOD
    assert valid_trace_context(_decode_pull(GOOD)["tc"]) == GOOD
    for bad in GARBAGE:  # decodes (the pull itself is fine), and the context is dropped
        assert valid_trace_context(_decode_pull(bad)["tc"]) is None, bad
    long = wire.pull_frame(6, "req", [3], "z" * 300)  # too long for the fixed shape: plain msgpack, same fields
    assert wire.decode(long[4:])[1]["tc"] == "z" * 300 and valid_trace_context("z" * 300) is None
    over = msgpack.packb({"v": wire.PROTOCOL_VERSION, "t": "pull", "xfer": 1, "request_id": "r", "block_ids": [1],
                          "tc": "q" * 70_000})  # over the decoder's string cap: the frame is malformed, as any
    with pytest.raises(wire.MalformedMessage):
        wire.decode(over)


@pytest.fixture
def pair():
    src, dst = PagePool(32, PAGE), PagePool(32, PAGE)
    src.buffer.random_(0, 256, generator=torch.Generator().manual_seed(5))
    prod = Producer(ProducerConfig(engine_id="P", secret=SECRET, compat_hash="c", lease_s=30.0), src)
    prod.start()
    cons = Consumer(ConsumerConfig(engine_id="D", secret=SECRET, compat_hash="c", data_path="tcp",
                                   handshake_timeout_s=5.0, transfer_timeout_s=10.0, io_timeout_s=2.0), dst)
    cons.start()
    yield prod, cons, RemoteAddr("P", "127.0.0.1", prod.port)
    cons.shutdown()
    prod.shutdown()


def _reports(prod: Producer, ids: set[str], timeout_s: float = 10.0) -> dict:
    got: dict = {}
    deadline = time.monotonic() + timeout_s
    while not ids <= got.keys() and time.monotonic() < deadline:
        prod.take_released()
        got.update({r.request_id: r for r in prod.leases.take_reports()})
        time.sleep(0.01)
    assert ids <= got.keys(), (ids, sorted(got))
    return got


def test_producer_reports_a_valid_consumer_context_and_drops_a_peers_garbage(pair):
    prod, cons, remote = pair
    prod.leases.enable_reports()
    contexts = {"good": GOOD, "bad": "00-not-a-traceparent", "huge": "h" * 4000, "none": None}
    for k, (rid, tc) in enumerate(contexts.items()):
        prod.add_lease(rid, [1 + 2 * k, 2 + 2 * k])
        job = cons.load(rid, remote, rid, [1 + 2 * k, 2 + 2 * k], [20 + 2 * k, 21 + 2 * k], trace_context=tc)
        assert job.done.wait(10) and job.result.ok, job.result  # a garbage context never fails the pull
    reports = _reports(prod, set(contexts))  # the consumer said DONE after each load
    assert reports["good"].served.trace_context == GOOD
    for rid in ("bad", "huge", "none"):
        assert reports[rid].served.trace_context is None
    for r in reports.values():
        assert r.outcome == "done" and r.num_blocks == 2 and r.granted_s <= r.ended_s
        assert (r.served.num_blocks, r.served.num_bytes, r.served.data_path) == (2, 2 * PAGE, "tcp")
        assert r.served.num_pulls >= 1 and r.granted_s <= r.served.started_s <= r.served.ended_s <= r.ended_s


def test_lease_reports_say_expired_and_aborted_and_are_off_until_enabled(pair):
    prod, _, _ = pair
    prod.add_lease("quiet", [1])
    prod.abort_lease("quiet")
    assert prod.take_released() == {"quiet"} and prod.leases.take_reports() == []  # off: nothing recorded
    prod.leases.enable_reports()
    prod.add_lease("gone", [2], lease_s=0.2)  # no consumer ever heartbeats: it expires
    prod.add_lease("dropped", [3])
    prod.abort_lease("dropped")
    reports = _reports(prod, {"gone", "dropped"})
    assert (reports["gone"].outcome, reports["dropped"].outcome) == ("expired", "aborted")
    assert reports["gone"].served is None and reports["gone"].ended_s - reports["gone"].granted_s >= 0.2
