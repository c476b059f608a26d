"""Unauthenticated connections held open on a KV data port: the load a hostile or broken peer
puts on a producer before it has proved anything.

`JunkHolder(host, port, n, stop)` holds `n` TCP connections: a quarter idle, the rest
trickling `TRICKLE` (a 900-byte frame's length prefix, then its body) one byte every 0.3 s.
Whatever the producer sends is read and ignored; a connection it closes is counted and opened
again 0.5 s later. Counts: `num_opened`, `num_reopened`, `num_closed_by_peer`, and `min_open`
(the fewest held at once over the run, from the first round on). `opened` is set once the
first `n` connections were tried. Used by the load + faults tool and by the
unauthenticated-cost tests.
"""
from __future__ import annotations

import socket
import threading
import time

TRICKLE = (900).to_bytes(4, "big") + b"\x00" * 900  # a frame head, then its body a byte at a time
ROUND_S = 0.3
REOPEN_AFTER_S = 0.5


class JunkHolder(threading.Thread):
    """Holds `n` unauthenticated connections to `host:port` until `stop` is set."""

    def __init__(self, host: str, port: int, n: int, stop: threading.Event | None = None) -> None:
        super().__init__(daemon=True, name="junk-holder")
        self.addr, self.n = (host, port), n
        self.stop = stop or threading.Event()
        self.opened = threading.Event()
        self.num_opened = 0
        self.num_reopened = 0
        self.num_closed_by_peer = 0
        self.min_open = n

    def _open(self) -> socket.socket | None:
        try:
            s = socket.create_connection(self.addr, timeout=2)
        except OSError:
            return None
        s.setblocking(False)
        self.num_opened += 1
        return s

    def run(self) -> None:
        socks = [self._open() for _ in range(self.n)]
        sent, closed_at = [0] * self.n, [0.0] * self.n
        self.opened.set()
        try:
            while not self.stop.wait(ROUND_S):
                now = time.monotonic()
                for i, s in enumerate(socks):
                    if s is None:
                        if now - closed_at[i] >= REOPEN_AFTER_S:
                            socks[i], sent[i] = self._open(), 0
                            self.num_reopened += 1
                        continue
                    try:
                        self._poke(i, s, sent)
                    except OSError:
                        s.close()
                        socks[i], closed_at[i] = None, now
                        self.num_closed_by_peer += 1
                self.min_open = min(self.min_open, sum(s is not None for s in socks))
        finally:
            for s in socks:
                if s is not None:
                    s.close()

    @staticmethod
    def _poke(i: int, s: socket.socket, sent: list[int]) -> None:
        """Reads (and drops) what the producer sent; every connection but each fourth sends its
        next byte. Raises OSError once the producer has closed it."""
        try:
            if s.recv(4096) == b"":
                raise ConnectionError("closed by the producer")
        except BlockingIOError:
            pass
        if i % 4 and sent[i] < len(TRICKLE):
            try:
                sent[i] += s.send(TRICKLE[sent[i]: sent[i] + 1])
            except BlockingIOError:  # send buffer full: try again next round
                pass
