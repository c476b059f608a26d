"""EmulatedLink: a slow network link on real sockets, for tests and benchmarks only.

A machine with only fast loopback cannot show what a slow P<->D link costs.
`EmulatedLink(LinkShape(bandwidth_mbps=200, latency_ms=5))` is that link:
`link.relay(host, port)` listens on a port of its own and relays every TCP
connection it accepts to (host, port), byte for byte, shaped like a pipe:

- each direction has one pacer (a token bucket with a one-chunk burst) shared
  by every connection and every relay of the link, so parallel streams split
  the bandwidth instead of multiplying it;
- a chunk read at t leaves the link when the pacer has sent it (t + its size
  / bandwidth, later behind other traffic) and reaches the other side
  `latency_ms` after that: latency is added to every chunk but is never
  serialized behind the bandwidth (many chunks are in flight at once);
- bytes arrive in order; at most `LinkShape.buffer_bytes` wait inside the link
  per direction of a connection (backpressure to the sender beyond that);
- when a side closes, the link first delivers what it still carries from that
  side, then closes both sides; when a side breaks (reset), both close at once;
- every wait is bounded: a destination that takes no byte for
  `stall_timeout_s` loses its connection; threads notice `close()` within
  `_POLL_S`.

The link is protocol-blind (ZMQ's ZMTP or pdkv's data frames alike) and
counts the bytes it moved each way. One Python thread per direction reads and
one writes, so it is meant for links up to about 1-2 Gbit/s.
"""
from __future__ import annotations

import collections
import logging
import socket
import threading
import time

from connectors.links.link_shape import LinkShape
from connectors.zmq.control import framing

logger = logging.getLogger(__name__)

_POLL_S = 0.1  # every blocked thread wakes this often to notice close()
_CONNECT_TIMEOUT_S = 5.0


class Pacer:
    """A token bucket of `rate` bytes/s holding at most `burst` bytes, as a virtual clock:
    `reserve(n)` books n bytes and says when their last byte has left. Thread-safe."""

    def __init__(self, rate: float, burst: int):
        self._rate, self._burst_s = rate, burst / rate
        self._free_at = 0.0
        self._lock = threading.Lock()

    def reserve(self, num_bytes: int) -> float:
        with self._lock:
            start = max(self._free_at, time.monotonic() - self._burst_s)
            self._free_at = start + num_bytes / self._rate
            return self._free_at


class _Counters:
    """A link's figures, shared by its relays and their connections."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.bytes_forward = 0  # client -> target
        self.bytes_reverse = 0  # target -> client
        self.num_accepted = 0
        self.num_open = 0
        self.num_stalled = 0  # dropped: a destination took nothing for stall_timeout_s
        self.num_failed_connects = 0
        self.max_queued_bytes = 0  # the most one direction of one connection ever held


class _Connection:
    """One relayed connection: two sockets, two pipes, four threads. Both sockets are
    shut down by `close()` (which wakes every thread) and closed by the last thread out."""

    def __init__(self, client: socket.socket, target: socket.socket, link: EmulatedLink, on_end):
        self.closed = threading.Event()
        self._socks = (client, target)
        self._on_end = on_end
        self._threads_left = 4
        self._lock = threading.Lock()
        shape, counters = link.shape, link.counters
        for sock in self._socks:
            framing.kernel_timeouts(sock, _POLL_S, shape.stall_timeout_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # the link adds the delay, not Nagle
        self._pipes = (_Pipe(self, client, target, link.forward, shape, counters, forward=True),
                       _Pipe(self, target, client, link.reverse, shape, counters, forward=False))

    def start(self) -> None:
        for pipe in self._pipes:
            pipe.start()

    def close(self) -> None:
        if self.closed.is_set():
            return
        self.closed.set()
        for pipe in self._pipes:
            pipe.wake()
        for sock in self._socks:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def thread_done(self) -> None:
        with self._lock:
            self._threads_left -= 1
            last = self._threads_left == 0
        if last:  # nobody uses the fds any more: closing cannot hit a reused number
            for sock in self._socks:
                framing.close_quietly(sock)
            self._on_end(self)


_EOF = b""  # queued after the last chunk when the sender closed


class _Pipe:
    """One direction of a connection: the reader paces chunks through the link's pacer,
    the writer hands each to the destination `latency_s` after it left the link."""

    def __init__(self, conn: _Connection, src: socket.socket, dst: socket.socket, pacer: Pacer, shape: LinkShape,
                 counters: _Counters, forward: bool):
        self._conn, self._src, self._dst, self._pacer = conn, src, dst, pacer
        self._shape, self._counters, self._forward = shape, counters, forward
        self._queue: collections.deque[tuple[float, bytes]] = collections.deque()
        self._queued_bytes = 0
        self._cond = threading.Condition()

    def start(self) -> None:
        name = "fwd" if self._forward else "rev"
        for target, role in ((self._read_loop, "read"), (self._write_loop, "write")):
            threading.Thread(target=self._run, args=(target,), name=f"emulated-link-{name}-{role}",
                             daemon=True).start()

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def _run(self, loop) -> None:
        try:
            if loop():  # the writer delivered the close (or gave up): the connection ends
                self._conn.close()
        except OSError as e:  # a side broke (reset, shut down): the whole connection ends
            logger.debug("emulated link connection ended: %s", e)
            self._conn.close()
        except Exception:
            logger.exception("emulated link relay thread failed")
            self._conn.close()
        finally:
            self._conn.thread_done()

    # ------------------------------------------------------------------ reader
    def _read_loop(self) -> bool:
        """Returns False: after the sender's close the writer still delivers what is in flight."""
        buf = bytearray(self._shape.chunk_bytes)
        closed = self._conn.closed
        while not closed.is_set():
            try:
                n = self._src.recv_into(buf)
            except BlockingIOError:
                continue  # idle: look at `closed` again
            if n == 0:  # the sender closed: what is in flight still arrives, then the close
                self._put(time.monotonic() + self._shape.latency_s, _EOF)
                return False
            # The reader books link time and runs ahead (up to buffer_bytes); the writer hands
            # each chunk over at its due time. Due times come from the pacer's clock, not from
            # when a thread woke, so a late wake-up (a busy CPU) delays a chunk, never the rate.
            # (A burst leaves "in the past" on that clock; it still arrives latency_s from now.)
            left_at = self._pacer.reserve(n)
            self._put(max(left_at, time.monotonic()) + self._shape.latency_s, bytes(buf[:n]))
        return False

    def _put(self, due: float, data: bytes) -> None:
        limit = self._shape.buffer_bytes
        with self._cond:
            # (a chunk always fits into an empty buffer; chunks are far smaller than the limit)
            while self._queue and self._queued_bytes + len(data) > limit:
                if self._conn.closed.is_set():
                    return
                self._cond.wait(_POLL_S)
            self._queue.append((due, data))
            self._queued_bytes += len(data)
            self._cond.notify_all()
            queued = self._queued_bytes
        c = self._counters
        if queued > c.max_queued_bytes:
            with c.lock:
                c.max_queued_bytes = max(c.max_queued_bytes, queued)

    # ------------------------------------------------------------------ writer
    def _write_loop(self) -> bool:
        """Returns True once the sender's close was delivered or the destination stalled."""
        closed = self._conn.closed
        while not closed.is_set():
            with self._cond:
                if not self._queue:
                    self._cond.wait(_POLL_S)
                    continue
                due, data = self._queue[0]
            wait = due - time.monotonic()
            if wait > 0 and closed.wait(wait):
                return False
            if not data:  # the close, after everything sent before it
                return True
            try:
                self._dst.sendall(data)
            except BlockingIOError:
                with self._counters.lock:
                    self._counters.num_stalled += 1
                logger.warning("emulated link: a destination took no byte for %.1f s; dropping the connection",
                               self._shape.stall_timeout_s)
                return True
            with self._cond:
                self._queue.popleft()
                self._queued_bytes -= len(data)
                self._cond.notify_all()
            with self._counters.lock:
                if self._forward:
                    self._counters.bytes_forward += len(data)
                else:
                    self._counters.bytes_reverse += len(data)
        return False


class Relay:
    """Accepts on (host, `port`) and relays each connection to the target through its link."""

    def __init__(self, link: EmulatedLink, target: tuple[str, int], host: str):
        self._link, self._target = link, target
        self._listener = socket.create_server((host, 0), backlog=64)
        self._listener.settimeout(_POLL_S)
        self.port: int = self._listener.getsockname()[1]
        self._stop = threading.Event()
        self._conns: set[_Connection] = set()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._accept_loop, name="emulated-link-accept", daemon=True)
        self._thread.start()

    def close(self, timeout_s: float = 2.0) -> None:
        """Stops accepting, severs every connection and waits (bounded) until their sockets are closed."""
        self._stop.set()
        self._thread.join(timeout=timeout_s)
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            conn.close()
        deadline = time.monotonic() + timeout_s
        while self._conns and time.monotonic() < deadline:
            time.sleep(0.01)

    def _accept_loop(self) -> None:
        counters = self._link.counters
        try:
            while not self._stop.is_set():
                try:
                    client, _ = self._listener.accept()
                except TimeoutError:
                    continue
                except OSError as e:  # e.g. out of fds: try again after a pause, never spin
                    logger.warning("emulated link: accept failed: %s", e)
                    self._stop.wait(_POLL_S)
                    continue
                try:
                    target = socket.create_connection(self._target, timeout=_CONNECT_TIMEOUT_S)
                except OSError as e:
                    logger.debug("emulated link: target %s:%d unreachable: %s", *self._target, e)
                    with counters.lock:
                        counters.num_failed_connects += 1
                    framing.close_quietly(client)
                    continue
                conn = _Connection(client, target, self._link, self._ended)
                with self._lock:
                    self._conns.add(conn)
                with counters.lock:
                    counters.num_accepted += 1
                    counters.num_open += 1
                conn.start()
        finally:
            framing.close_quietly(self._listener)

    def _ended(self, conn: _Connection) -> None:
        with self._lock:
            self._conns.discard(conn)
        with self._link.counters.lock:
            self._link.counters.num_open -= 1


class EmulatedLink:
    """One shaped link: a pacer per direction, shared by all of its relays' connections."""

    def __init__(self, shape: LinkShape):
        self.shape = shape
        self.forward = Pacer(shape.bytes_per_s, shape.chunk_bytes)  # towards the targets
        self.reverse = Pacer(shape.bytes_per_s, shape.chunk_bytes)  # back to the clients
        self.counters = _Counters()
        self._relays: list[Relay] = []

    def relay(self, target_host: str, target_port: int, host: str = "127.0.0.1") -> Relay:
        """A started relay on (host, any free port) to (target_host, target_port)."""
        relay = Relay(self, (target_host, target_port), host)
        self._relays.append(relay)
        return relay

    def close(self) -> None:
        """Stops accepting and severs every relayed connection; returns once their sockets are closed
        (or after a bounded wait)."""
        for relay in self._relays:
            relay.close()

    def stats(self) -> dict:
        c = self.counters
        with c.lock:
            return {
                "bandwidth_mbps": self.shape.bandwidth_mbps,
                "latency_ms": self.shape.latency_ms,
                "bytes_forward": c.bytes_forward,
                "bytes_reverse": c.bytes_reverse,
                "num_connections_accepted": c.num_accepted,
                "num_connections_open": c.num_open,
                "num_connections_stalled": c.num_stalled,
                "num_failed_connects": c.num_failed_connects,
                "max_queued_bytes": c.max_queued_bytes,
            }
