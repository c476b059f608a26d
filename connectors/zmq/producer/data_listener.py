"""The producer's data-port listener: strangers cost little until they ATTACH.

One thread accepts connections and holds every not yet attached socket in one
selector (no thread per stranger). Each accepted socket is sent a fresh NONCE
at once; the consumer's ATTACH must answer it with the session key's MAC
(`session.py`). Guarantees:

- at most `max_preauth` sockets wait for their ATTACH, apart from the streams'
  own cap; one more evicts the oldest waiting socket;
- the whole ATTACH (every byte of it) must arrive within `handshake_timeout_s`
  of the accept, however slowly a peer trickles it;
- at the process's fd limit (EMFILE, ENFILE, ENOBUFS, ENOMEM) the listener is
  left alone for a back-off (50 ms, doubling to 1 s) instead of retried in a
  busy loop, and the oldest waiting socket is closed to give an fd back;
- an authenticated socket is handed, blocking again, to `on_attached`.
"""
from __future__ import annotations

import dataclasses
import errno
import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable
from typing import cast

from connectors.zmq.control import framing, wire
from connectors.zmq.control.handshake import RefuseReason, make_nonce
from connectors.metrics import TransferMetrics
from connectors.zmq.control.peer_log import WarnLimiter, quote
from connectors.zmq.control.session import ProducerSession, SessionRefused, SessionTable
from connectors.zmq.control.wire import MalformedMessage, MsgType

logger = logging.getLogger(__name__)

_MAX_ATTACH_BYTES = 1024  # an ATTACH is tiny: no big buffers for strangers
_FD_LIMIT_ERRNOS = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}
_POLL_S = 0.2  # the thread notices shutdown this often


@dataclasses.dataclass(frozen=True)
class ListenerLimits:
    max_preauth: int = 32
    handshake_timeout_s: float = 5.0
    max_backoff_s: float = 1.0


class _Waiting:
    """A socket between accept and ATTACH."""

    __slots__ = ("nonce", "deadline", "buf")

    def __init__(self, nonce: bytes, deadline: float):
        self.nonce, self.deadline, self.buf = nonce, deadline, bytearray()


class DataListener:
    """Accepts data streams for `sessions`; see the module docstring."""

    def __init__(self, listener: socket.socket, sessions: SessionTable, limits: ListenerLimits,
                 on_attached: Callable[[socket.socket, ProducerSession, dict], None],
                 metrics: TransferMetrics, stop: threading.Event):
        self._listener = listener
        self._listener.setblocking(False)
        self._sessions, self._limits, self._on_attached = sessions, limits, on_attached
        self._metrics, self._stop = metrics, stop
        self._sel = selectors.DefaultSelector()
        self._waiting: dict[socket.socket, _Waiting] = {}  # in accept order: the first is the oldest
        self._paused_until = 0.0
        self._backoff_s = 0.0
        self._warn = WarnLimiter(logger)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def run(self) -> None:
        self._sel.register(self._listener, selectors.EVENT_READ, None)
        try:
            while not self._stop.is_set():
                for key, _ in self._sel.select(self._timeout()):
                    if key.data is None:
                        self._accept_ready()
                    else:
                        self._read(cast(socket.socket, key.fileobj))  # (only sockets are registered)
                self._housekeeping()
        except Exception:  # the listener must not die silently
            logger.exception("KV producer data listener crashed")
        finally:
            for conn in list(self._waiting):
                self._drop(conn)
            self._sel.close()
            framing.close_quietly(self._listener)

    # ------------------------------------------------------------------ accept
    def _timeout(self) -> float:
        now, wake = time.monotonic(), _POLL_S
        if self._waiting:
            wake = min(wake, next(iter(self._waiting.values())).deadline - now)
        if self._paused_until:
            wake = min(wake, self._paused_until - now)
        return max(0.0, wake)

    def _accept_ready(self) -> None:
        for _ in range(16):  # a burst at a time: the selector comes round again
            try:
                conn, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                if e.errno in _FD_LIMIT_ERRNOS:
                    self._pause(e)
                    return
                continue  # e.g. ECONNABORTED: that one peer is gone
            self._backoff_s = 0.0
            self._admit(conn)

    def _pause(self, error: OSError) -> None:
        """Out of fds: stop watching the listener for a while (its backlog keeps it readable, so
        retrying now would spin) and give an fd back by closing the oldest stranger."""
        self._backoff_s = min(self._limits.max_backoff_s, max(0.05, self._backoff_s * 2))
        self._paused_until = time.monotonic() + self._backoff_s
        self._sel.unregister(self._listener)
        self._metrics.record_accept_backoff()
        if self._waiting:
            self._evict(next(iter(self._waiting)))
        self._warn.warning("KV producer data port: accept failed (%s); pausing it for %.2f s",
                           errno.errorcode.get(error.errno or 0, error.errno), self._backoff_s)

    def _admit(self, conn: socket.socket) -> None:
        if len(self._waiting) >= self._limits.max_preauth:
            self._evict(next(iter(self._waiting)))
        conn.setblocking(False)
        nonce = make_nonce()
        frame = wire.encode(MsgType.NONCE, nonce=nonce)
        try:
            conn.send(len(frame).to_bytes(4, "big") + frame)  # tiny: fits any fresh send buffer
        except OSError:
            framing.close_quietly(conn)
            return
        self._waiting[conn] = _Waiting(nonce, time.monotonic() + self._limits.handshake_timeout_s)
        self._sel.register(conn, selectors.EVENT_READ, True)

    def _evict(self, conn: socket.socket) -> None:
        self._metrics.record_refused(RefuseReason.CAPACITY)
        self._warn.warning("KV producer data port: %d connections wait for an ATTACH; closing the oldest",
                           len(self._waiting))
        self._drop(conn)

    def _drop(self, conn: socket.socket) -> None:
        if self._waiting.pop(conn, None) is not None:
            self._sel.unregister(conn)
        framing.close_quietly(conn)

    def _housekeeping(self) -> None:
        now = time.monotonic()
        if self._paused_until and now >= self._paused_until:
            self._paused_until = 0.0
            self._sel.register(self._listener, selectors.EVENT_READ, None)
        while self._waiting:
            conn, waiting = next(iter(self._waiting.items()))
            if waiting.deadline > now:
                break  # (all have the same timeout: the rest are younger)
            self._metrics.record_refused(RefuseReason.TIMEOUT)
            self._warn.warning("KV producer data port: no ATTACH within %.1f s; closing the connection",
                               self._limits.handshake_timeout_s)
            self._drop(conn)

    # ------------------------------------------------------------------ ATTACH
    def _read(self, conn: socket.socket) -> None:
        waiting = self._waiting.get(conn)
        if waiting is None:
            return
        try:
            data = conn.recv(4 + _MAX_ATTACH_BYTES - len(waiting.buf))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(conn)
            return
        waiting.buf += data
        if len(waiting.buf) < 4:
            return
        try:
            length = framing.frame_length(waiting.buf[:4], _MAX_ATTACH_BYTES)
            if len(waiting.buf) < 4 + length:
                return
            if len(waiting.buf) > 4 + length:
                raise MalformedMessage("bytes after the ATTACH, before ATTACHED")
            msg_type, msg = wire.decode(waiting.buf[4:])
            if msg_type is not MsgType.ATTACH:
                raise MalformedMessage(f"expected attach, got {msg_type.value}")
            session = self._sessions.check_attach(msg, waiting.nonce)
        except MalformedMessage as e:
            self._metrics.record_malformed()
            self._warn.warning("KV producer data port: malformed first frame (%s); closing", quote(str(e), 120))
            self._drop(conn)
            return
        except SessionRefused as e:
            self._metrics.record_refused(RefuseReason.parse(e.reason))
            self._warn.warning("KV producer data port: refused a stream (%s): %s", e.reason, e)
            self._drop(conn)
            return
        del self._waiting[conn]
        self._sel.unregister(conn)
        conn.setblocking(True)
        self._on_attached(conn, session, msg)
