"""EmulatedLink on real loopback sockets: the bandwidth and latency it is set to, shared by
parallel connections, bytes intact and in order, bounded buffers, and what happens when a
side vanishes or stops reading. Figures are measured, with tolerances for a shared box."""
from __future__ import annotations

import hashlib
import socket
import statistics
import threading
import time

import pytest

from connectors.links.emulated_link import EmulatedLink
from connectors.links.link_shape import LinkShape


class _Server:
    """A listener on a random loopback port whose accepted connections run `handle` on a
    thread each; `close()` closes every socket it made and joins its threads."""

    def __init__(self, handle, rcvbuf: int | None = None):
        self._listener = socket.socket()
        if rcvbuf is not None:  # (inherited by accepted sockets)
            self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(8)
        self._listener.settimeout(0.1)
        self.port = self._listener.getsockname()[1]
        self._handle = handle
        self._stop = threading.Event()
        self._socks: list[socket.socket] = []
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            conn.settimeout(10.0)
            self._socks.append(conn)
            t = threading.Thread(target=self._run, args=(conn,), daemon=True)
            self._threads.append(t)
            t.start()

    def _run(self, conn: socket.socket) -> None:
        try:
            self._handle(conn)
        except OSError:
            pass

    def close(self) -> None:
        self._stop.set()
        self._threads[0].join(timeout=2.0)  # the accept thread: no handler starts after this
        for t in self._threads[1:]:
            t.join(timeout=12.0)
        for s in [self._listener, *self._socks]:
            s.close()


@pytest.fixture
def own():
    """own(x) -> x; every server, link and client socket it was given is closed at teardown."""
    things: list = []
    yield lambda thing: things.append(thing) or thing
    for thing in reversed(things):
        thing.close()


def _sink(results: list):
    def handle(conn):
        digest, n, first, last = hashlib.sha256(), 0, None, None
        while True:
            data = conn.recv(1 << 20)
            now = time.perf_counter()
            if not data:
                break
            first = first or now
            last = now
            digest.update(data)
            n += len(data)
        results.append({"bytes": n, "sha": digest.hexdigest(), "first": first, "last": last, "eof": now})
    return handle


def _wait_for(results: list, n: int, timeout_s: float = 10.0) -> list:
    deadline = time.monotonic() + timeout_s
    while len(results) < n and time.monotonic() < deadline:
        time.sleep(0.01)
    return results


def _echo(conn):
    while data := conn.recv(65536):
        conn.sendall(data)


def _connect(own, port: int) -> socket.socket:
    sock = own(socket.create_connection(("127.0.0.1", port), timeout=10.0))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _send_all_and_close(sock: socket.socket, payload: bytes) -> float:
    t0 = time.perf_counter()
    sock.sendall(payload)
    sock.shutdown(socket.SHUT_WR)
    return t0


def _send_until_closed(sock: socket.socket, timeout_s: float) -> bool:
    """Sends until the connection is closed (EOF, reset or broken pipe): True, or False at timeout."""
    sock.settimeout(0.2)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            sock.send(b"x" * 65536)
            if sock.recv(1, socket.MSG_DONTWAIT) == b"":
                return True
        except (BlockingIOError, TimeoutError):
            continue  # nothing to read yet / send buffer full
        except OSError:
            return True
    return False


def _rtt_ms(sock: socket.socket, n: int = 15) -> float:
    rtts = []
    for i in range(n):
        t0 = time.perf_counter()
        sock.sendall(bytes([i]))
        assert sock.recv(16) == bytes([i])
        rtts.append((time.perf_counter() - t0) * 1000)
    return statistics.median(rtts)


def test_throughput_and_latency_are_what_the_link_is_set_to(own):
    """A bulk send takes size/bandwidth + one latency (the latency rides along every chunk, it
    is not paid per chunk), arrives intact and in order, and then the close arrives."""
    shape = LinkShape(bandwidth_mbps=100, latency_ms=20)
    results: list = []
    sink = own(_Server(_sink(results)))
    link = own(EmulatedLink(shape))
    relay = link.relay("127.0.0.1", sink.port)
    payload = bytes(range(250)) * 16_000  # 4 MB: 0.32 s at 100 Mbit/s
    t0 = _send_all_and_close(_connect(own, relay.port), payload)
    (got,) = _wait_for(results, 1)
    assert got["bytes"] == len(payload) and got["sha"] == hashlib.sha256(payload).hexdigest()
    elapsed = got["last"] - t0
    expected = len(payload) / shape.bytes_per_s + shape.latency_s
    # The floor is the rule (never faster than the link); the ceiling only bounds how late a loaded
    # machine schedules the relay's threads.
    assert expected * 0.9 < elapsed < expected * 1.15 + 0.25, (elapsed, expected)
    mbps = len(payload) * 8 / (got["last"] - got["first"]) / 1e6
    assert mbps < 1.15 * shape.bandwidth_mbps, mbps
    stats = link.stats()
    assert stats["bytes_forward"] == len(payload) and stats["bytes_reverse"] == 0
    assert stats["max_queued_bytes"] <= shape.buffer_bytes


def test_round_trip_adds_twice_the_one_way_latency(own):
    shape = LinkShape(bandwidth_mbps=200, latency_ms=15)
    echo = own(_Server(_echo))
    direct = _rtt_ms(_connect(own, echo.port))
    link = own(EmulatedLink(shape))
    relayed = _rtt_ms(_connect(own, link.relay("127.0.0.1", echo.port).port))
    added = relayed - direct
    assert 2 * shape.latency_ms - 1.0 < added < 2 * shape.latency_ms + 15.0, (direct, relayed)


def test_parallel_connections_share_the_bandwidth(own):
    """Four streams through one link move their bytes in the time one stream would need for all:
    the pacer is the link's, not each connection's."""
    shape = LinkShape(bandwidth_mbps=160, latency_ms=2)
    results: list = []
    sink = own(_Server(_sink(results)))
    link = own(EmulatedLink(shape))
    relay = link.relay("127.0.0.1", sink.port)
    payload = b"\x5a" * 1_000_000
    socks = [_connect(own, relay.port) for _ in range(4)]
    t0 = time.perf_counter()
    senders = [threading.Thread(target=_send_all_and_close, args=(s, payload)) for s in socks]
    for t in senders:
        t.start()
    for t in senders:
        t.join(10)
    assert sorted(r["bytes"] for r in _wait_for(results, 4)) == [len(payload)] * 4
    elapsed = max(r["last"] for r in results) - t0
    expected = 4 * len(payload) / shape.bytes_per_s + shape.latency_s
    assert expected * 0.9 < elapsed < expected * 1.15 + 0.25, (elapsed, expected)
    assert link.stats()["num_connections_accepted"] == 4


def test_a_vanishing_peer_closes_the_other_side_and_the_relay_lives_on(own):
    """The target resets its connection mid-stream: the sender's connection is closed within a
    bounded time, no connection stays open, and a new connection works."""
    def read_some_then_reset(conn):
        conn.recv(50_000)
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        conn.close()  # (linger 0: RST, as a crashed peer)

    vanishing = own(_Server(read_some_then_reset))
    echo = own(_Server(_echo))
    link = own(EmulatedLink(LinkShape(bandwidth_mbps=400, latency_ms=5)))
    relay = link.relay("127.0.0.1", vanishing.port)
    sock = _connect(own, relay.port)
    t0 = time.monotonic()
    assert _send_until_closed(sock, timeout_s=5.0), "the link kept the sender's connection open"
    assert time.monotonic() - t0 < 5.0
    deadline = time.monotonic() + 3.0
    while link.stats()["num_connections_open"] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert link.stats()["num_connections_open"] == 0
    again = _connect(own, link.relay("127.0.0.1", echo.port).port)
    assert _rtt_ms(again, 3) < 200  # (it works; 5 ms each way plus a loaded machine's scheduling)


def test_a_destination_that_stops_reading_is_dropped_and_the_buffer_stays_bounded(own):
    shape = LinkShape(bandwidth_mbps=800, latency_ms=1, stall_timeout_s=0.5)
    stop = threading.Event()
    stuck = own(_Server(lambda conn: stop.wait(10), rcvbuf=4096))
    link = own(EmulatedLink(shape))
    sock = _connect(own, link.relay("127.0.0.1", stuck.port).port)
    sock.settimeout(0.2)
    sent, t0 = 0, time.monotonic()
    while time.monotonic() - t0 < 8.0:
        try:
            sent += sock.send(b"y" * 65536)
        except TimeoutError:
            if link.stats()["num_connections_stalled"]:
                break
        except OSError:
            break
    stop.set()
    stats = link.stats()
    assert stats["num_connections_stalled"] == 1, stats
    assert stats["max_queued_bytes"] <= shape.buffer_bytes
    assert time.monotonic() - t0 < 6.0
    assert sent < 200 * 1024 * 1024  # backpressure reached the sender: it could not push without limit


@pytest.mark.parametrize("kwargs, message", [
    ({"bandwidth_mbps": 0}, "bandwidth_mbps must be a positive number"),
    ({"bandwidth_mbps": float("inf")}, "bandwidth_mbps must be a positive number"),
    ({"bandwidth_mbps": 10, "latency_ms": -1}, r"latency_ms must be in \[0, 10000\]"),
    ({"bandwidth_mbps": 10, "stall_timeout_s": 0}, "stall_timeout_s must be positive"),
])
def test_link_shape_refuses_bad_values_naming_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LinkShape(**kwargs)
