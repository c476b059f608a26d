"""Unauthenticated connections held open on a server's port: the load a hostile or broken peer
puts on a KV producer's data port or on an HTTP server (router, worker API) before it has
proved anything.

`JunkHolder(host, port, n, stop)` holds `n` TCP connections: by default (`kinds="mixed"`) a
quarter idle, the rest trickling `payload` one byte every 0.3 s (`TRICKLE`, a 900-byte frame's
length prefix then its body; `HTTP_TRICKLE` for HTTP servers, a request head that never
ends). `kinds="idle"` or `"trickle"` makes all of them one kind. Whatever the server sends is
read and ignored; a connection it closes is counted and, with `reopen` (the default), opened
again 0.5 s later. `source_host` binds the client side to that address (127.0.0.x: another
peer address on one machine). Counts: `num_opened`, `num_reopened`, `num_closed_by_peer`,
`min_open` (the fewest held at once over the run, from the first round on), `max_open`, `num_open`, and
`closed_after_s` (each connection the server closed: seconds from its open to the round that
saw it closed, with its kind). `opened` is set once the first `n` connections were tried.
Used by the load + faults tool and by the unauthenticated-cost and connection-limit tests.
"""
from __future__ import annotations

import socket
import threading
import time

TRICKLE = (900).to_bytes(4, "big") + b"\x00" * 900  # a frame head, then its body a byte at a time
HTTP_TRICKLE = b"GET /health HTTP/1.1\r\nHost: pdkv\r\nX-Trickle: " + b"a" * 4000  # a head that never ends
ROUND_S = 0.3
REOPEN_AFTER_S = 0.5
KINDS = ("mixed", "idle", "trickle")


class JunkHolder(threading.Thread):
    """Holds `n` unauthenticated connections to `host:port` until `stop` is set."""

    def __init__(self, host: str, port: int, n: int, stop: threading.Event | None = None, *,
                 payload: bytes = TRICKLE, kinds: str = "mixed", reopen: bool = True,
                 source_host: str | None = None) -> None:
        super().__init__(daemon=True, name="junk-holder")
        if kinds not in KINDS:
            raise ValueError(f"kinds must be one of {KINDS}, got {kinds!r}")
        self.addr, self.n = (host, port), n
        self.stop = stop or threading.Event()
        self.payload, self.kinds, self.reopen = payload, kinds, reopen
        self.source = (source_host, 0) if source_host else None
        self.opened = threading.Event()
        self.num_opened = 0
        self.num_reopened = 0
        self.num_closed_by_peer = 0
        self.num_open = 0
        self.min_open = n
        self.max_open = 0
        self.closed_after_s: list[tuple[str, float]] = []

    def trickles(self, i: int) -> bool:
        return self.kinds == "trickle" or (self.kinds == "mixed" and i % 4 != 0)

    def _open(self) -> socket.socket | None:
        try:
            s = socket.create_connection(self.addr, timeout=2, source_address=self.source)
        except OSError:
            return None
        s.setblocking(False)
        self.num_opened += 1
        return s

    def run(self) -> None:
        socks = []
        opened_at = []
        for _ in range(self.n):
            socks.append(self._open())
            opened_at.append(time.monotonic())
        sent, closed_at = [0] * self.n, [0.0] * self.n
        self.num_open = sum(s is not None for s in socks)
        self.opened.set()
        try:
            while not self.stop.wait(ROUND_S):
                now = time.monotonic()
                for i, s in enumerate(socks):
                    if s is None:
                        if self.reopen and now - closed_at[i] >= REOPEN_AFTER_S:
                            socks[i], sent[i], opened_at[i] = self._open(), 0, now
                            self.num_reopened += 1
                        continue
                    try:
                        self._poke(s, sent, i)
                    except OSError:
                        s.close()
                        socks[i], closed_at[i] = None, now
                        self.num_closed_by_peer += 1
                        self.closed_after_s.append(("trickle" if self.trickles(i) else "idle", now - opened_at[i]))
                self.num_open = sum(s is not None for s in socks)
                self.min_open = min(self.min_open, self.num_open)
                self.max_open = max(self.max_open, self.num_open)
        finally:
            for s in socks:
                if s is not None:
                    s.close()
            self.num_open = 0

    def _poke(self, s: socket.socket, sent: list[int], i: int) -> None:
        """Reads (and drops) what the server sent; a trickling connection sends its next byte.
        Raises OSError once the server has closed it."""
        try:
            if s.recv(4096) == b"":
                raise ConnectionError("closed by the server")
        except BlockingIOError:
            pass
        if self.trickles(i) and sent[i] < len(self.payload):
            try:
                sent[i] += s.send(self.payload[sent[i]: sent[i] + 1])
            except BlockingIOError:  # send buffer full: try again next round
                pass
