"""What libzmq lacks for a ROUTER that listens to strangers: a connection cap, and no busy
loop at the process's fd limit.

libzmq offers `HANDSHAKE_IVL` (a connection that does not finish the ZMTP greeting in
time is dropped) and `MAXMSGSIZE` (a peer sending a larger message is dropped); the
producer sets both. It has no cap on accepted connections, and when accept() fails with
EMFILE its listener, still readable through the backlog, retries at once: about one core
spent while idle. This guard reads the ROUTER's socket monitor from the side-channel
thread:

- ACCEPTED / DISCONNECTED (whose value is the connection's fd) keep the set of live
  connections; an ACCEPTED past `max_connections` has its socket shut down (a dup of the
  fd, so libzmq's own close stays the only close): the newest is refused, established
  sessions keep theirs. An fd that libzmq closed and reused before the event was read
  could be shut instead; the check that it is a TCP socket on this port limits that to
  another side-channel connection, whose consumer reconnects;
- ACCEPT_FAILED for an fd limit unbinds the endpoint (libzmq stops polling it: no spin)
  and binds it again after a back-off (0.25 s, doubling to 4 s). Unbinding drops the
  connections libzmq accepted there; consumers reconnect on their own, and their fixed
  routing id (with ROUTER_HANDOVER) keeps their sessions. Messages in flight then may be
  lost: a lost DONE leaves that lease to expire.
"""
from __future__ import annotations

import errno
import logging
import os
import socket
import time

import zmq
from zmq.utils.monitor import parse_monitor_message

from connectors.zmq.control.handshake import RefuseReason
from connectors.metrics import TransferMetrics
from connectors.zmq.control.peer_log import WarnLimiter

logger = logging.getLogger(__name__)

_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_ACCEPT_FAILED
_FD_LIMIT_ERRNOS = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}


class SideChannelGuard:
    """Watches one bound ROUTER (see the module docstring). Call `poll_events` whenever
    `monitor` is readable and `tick` on every turn of the side-channel loop."""

    def __init__(self, router: zmq.Socket, endpoint: str, port: int, max_connections: int,
                 metrics: TransferMetrics, max_backoff_s: float = 4.0):
        self._router, self._endpoint, self._port = router, endpoint, port
        self._max_connections, self._metrics, self._max_backoff_s = max_connections, metrics, max_backoff_s
        self.monitor = router.get_monitor_socket(_EVENTS)
        self._live: set[int] = set()
        self._rebind_at = 0.0
        self._backoff_s = 0.0
        self._warn = WarnLimiter(logger)

    @property
    def num_connections(self) -> int:
        return len(self._live)

    def poll_events(self) -> None:
        for _ in range(1024):  # bounded: a flood of failures comes back next turn
            try:
                frames = self.monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            event = parse_monitor_message(frames)
            kind, value = int(event["event"]), int(event["value"])
            if kind == zmq.EVENT_ACCEPTED:
                self._live.add(value)
                self._backoff_s = 0.0
                if len(self._live) > self._max_connections:
                    self._shut(value)
            elif kind == zmq.EVENT_DISCONNECTED:
                self._live.discard(value)
            elif kind == zmq.EVENT_ACCEPT_FAILED and value in _FD_LIMIT_ERRNOS and not self._rebind_at:
                self._unbind(value)

    def tick(self) -> None:
        if self._rebind_at and time.monotonic() >= self._rebind_at:
            try:
                self._router.bind(self._endpoint)
            except zmq.ZMQError as e:  # still out of fds (or the port is taken): later
                self._schedule_rebind()
                self._warn.warning("KV producer side channel: rebind failed (%s); next try in %.2f s", e,
                                   self._backoff_s)
                return
            self._rebind_at = 0.0
            logger.info("KV producer side channel listening again on port %d", self._port)

    def close(self) -> None:
        self._router.disable_monitor()
        self.monitor.close(linger=0)

    def _shut(self, fd: int) -> None:
        self._metrics.record_refused(RefuseReason.CAPACITY)
        self._warn.warning("KV producer side channel: %d connections, cap %d; closing the newest",
                           len(self._live), self._max_connections)
        try:
            dup = socket.socket(fileno=os.dup(fd))  # (family and type read from the fd)
        except OSError:
            return  # no fd for the dup, or not a socket: it ends at HANDSHAKE_IVL or when the peer goes
        try:
            if dup.type == socket.SOCK_STREAM and dup.getsockname()[1] == self._port:
                dup.shutdown(socket.SHUT_RDWR)  # libzmq sees the end and closes its fd
        except OSError:
            pass
        finally:
            dup.close()

    def _unbind(self, error: int) -> None:
        try:
            self._router.unbind(self._endpoint)
        except zmq.ZMQError:
            pass
        self._live.clear()  # (unbinding drops them without DISCONNECTED events)
        self._metrics.record_accept_backoff()
        self._schedule_rebind()
        self._warn.warning("KV producer side channel: accept failed (%s); not listening for %.2f s",
                           errno.errorcode.get(error, error), self._backoff_s)

    def _schedule_rebind(self) -> None:
        self._backoff_s = min(self._max_backoff_s, max(0.25, self._backoff_s * 2))
        self._rebind_at = time.monotonic() + self._backoff_s
