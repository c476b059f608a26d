"""A KV session is bound to its handshake (issue 13, finding 1).

A relay between D and P captures a real handshake and the session's traffic. Replaying
what it saw, verbatim or with another request id, from another ZMQ identity or another TCP
connection (DONE, HEARTBEAT, ATTACH then PULL) must do nothing: no lease ends early, no
page leaves P, every attempt is counted, and the good transfers still move their KV.
"""
from __future__ import annotations

import collections
import dataclasses
import socket
import time

import msgpack
import zmq

from connectors.zmq.control import framing, wire
from connectors.links.fault_link import LINK_POINTS, FaultLink
from connectors.links.faults import FaultPlan
from connectors.zmq.control.wire import MalformedMessage, MsgType
from rel_pair import Pair, Side, prompt, reference


class CaptureLink(FaultLink):
    """A relay that forwards everything unchanged and keeps a copy of each frame, by point."""

    def __init__(self, target_port: int):
        super().__init__("127.0.0.1", target_port, FaultPlan.parse("side.error:drop", LINK_POINTS))
        self.captured: dict[str, list[bytes]] = collections.defaultdict(list)

    def _apply(self, point: str, frames: list[bytes]) -> list[bytes]:
        if point != "data.page_bytes":
            self.captured[point].append(frames[0])
        return super()._apply(point, frames)


def _with_request_ids(payload: bytes, request_ids: list[str]) -> bytes:
    obj = msgpack.unpackb(payload, raw=False)
    obj["request_ids"] = request_ids
    return msgpack.packb(obj, use_bin_type=True)


def _retyped(payload: bytes, msg_type: str) -> bytes:
    obj = msgpack.unpackb(payload, raw=False)
    obj["t"] = msg_type
    return msgpack.packb(obj, use_bin_type=True)


def _frames_after(sock: socket.socket, timeout_s: float = 3.0) -> list[str]:
    """Types of the frames the producer sends on `sock` until it closes it (or `timeout_s`)."""
    sock.settimeout(timeout_s)
    seen = []
    try:
        while True:
            msg_type, _ = framing.recv_frame(sock)
            seen.append(msg_type.value)
    except (ConnectionError, OSError, MalformedMessage):
        pass
    return seen


def _wait_refused(pair: Pair, want: dict[str, int], timeout_s: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        refused = pair.p.connector.stats()["handshakes_refused"]
        if all(refused.get(k, 0) >= n for k, n in want.items()) or time.monotonic() > deadline:
            return refused
        time.sleep(0.05)


def test_a_captured_handshake_replayed_does_nothing(fault_record):
    toks1, toks2 = prompt(40, start=3), prompt(56, start=9)
    want1, want2 = reference(toks1, 6), reference(toks2, 6)
    with Pair(Side("prefill-0", lease_s=20.0), Side("decode-0", heartbeat_s=0.2)) as pair:
        link = CaptureLink(pair.p.connector.port).start()
        try:
            params1 = dataclasses.replace(pair.prefill("r1", toks1), remote_port=link.port)
            outs = {"r1": pair.add_decode("r1", toks1, params1, 6)}
            pair.drive(outs, timeout_s=30)
            assert outs["r1"]["tokens"] == want1
            deadline = time.monotonic() + 10  # the DONE and (keep-alive) heartbeats cross the relay
            while not (link.captured["side.heartbeat"] and link.captured["side.done"]) and time.monotonic() < deadline:
                time.sleep(0.05)
            done = link.captured["side.done"][0]
            beat = (link.captured["side.heartbeat"] or [_retyped(done, "heartbeat")])[-1]
            attach = link.captured["data.attach"][0]

            producer = pair.p.connector.worker.producer
            params2 = dataclasses.replace(pair.prefill("r2", toks2), remote_port=link.port)  # P leases r2's blocks
            deadline = time.monotonic() + 10
            while not producer.leases.is_sealed("r2"):
                assert time.monotonic() < deadline
                time.sleep(0.02)
            before = dict(pair.p.connector.stats()["handshakes_refused"])

            # Another TCP connection replays the ATTACH, then asks for r2's pages.
            sock = socket.create_connection(("127.0.0.1", producer.data_port), timeout=5)
            sock.sendall(attach)
            time.sleep(0.3)  # (as a consumer would: the PULL after the ATTACH was taken)
            try:
                sock.sendall(wire.pull_frame(7, "r2", list(params2.remote_block_ids[0])))
            except OSError:  # already closed by the producer
                pass
            answered = _frames_after(sock)
            sock.close()
            # Another ZMQ identity replays the session's DONE and HEARTBEAT, and forges a DONE for r2.
            dealer = zmq.Context.instance().socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(f"tcp://127.0.0.1:{pair.p.connector.port}")
            for frame in (done, beat, _with_request_ids(done, ["r2"]), _with_request_ids(beat, ["r2"])):
                dealer.send(frame)
            refused = _wait_refused(pair, {"identity": before.get("identity", 0) + 2,
                                           "auth": before.get("auth", 0) + 2, "replay": before.get("replay", 0) + 1})
            dealer.close()

            assert "pages" not in answered, answered  # no page left P for the replayed ATTACH
            assert producer.leases.is_sealed("r2"), "a replayed or forged DONE ended r2's lease"
            assert refused.get("identity", 0) - before.get("identity", 0) >= 2, refused  # verbatim replays
            assert refused.get("auth", 0) - before.get("auth", 0) >= 2, refused  # r2 under the old MAC
            assert refused.get("replay", 0) - before.get("replay", 0) >= 1, refused  # the ATTACH

            outs = {"r2": pair.add_decode("r2", toks2, params2, 6)}  # the good transfer still works
            pair.drive(outs, timeout_s=30)
            assert outs["r2"]["tokens"] == want2 and outs["r2"]["error"] is None
            assert pair.d.connector.stats()["loads_ok"] == 2
            assert pair.d.scheduler.stats.num_load_failures_recomputed == 0
            pair.assert_all_free()
        finally:
            link.close()
    fault_record(fault="captured handshake replayed (DONE, HEARTBEAT, ATTACH + PULL) from another identity "
                       "and connection", where="P side channel / data port",
                 user_saw="correct tokens, KV transferred", pdkv_did=f"all refused and counted ({refused}); "
                 f"the replayed ATTACH got {answered}", pools="all free")


def test_an_idle_session_expires_oldest_first():
    from connectors.zmq.control.session import SessionTable

    table = SessionTable(max_sessions=3, idle_s=0.3)
    first, second, third = (table.open(bytes([i]) * 32, b"id%d" % i, f"d{i}") for i in range(3))
    second.last_used = first.last_used - 1  # the least recently used
    fourth = table.open(b"\x04" * 32, b"id4", "d4")
    assert second.closed and not first.closed and len(table) == 3
    time.sleep(0.35)
    fourth.last_used = time.monotonic()
    assert table.expire() == 2 and first.closed and third.closed and not fourth.closed
