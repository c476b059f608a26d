"""One consumer data stream: a socket, the data path it attached with (`paths/`: tcp,
shm_mapped, shm_staged or cuda_ipc, chosen once), and the thread that runs pulls over it, one
after another. A stream whose path cannot attach says why in the log and falls back along the
path's `fallback` (cuda_ipc -> a host path, shm_mapped -> shm_staged -> tcp).

Guarantees:
- every `PullPart` handed to `submit` is resolved exactly once (landed and
  verified, landed with some pages failing their checksum, or failed);
- when a part is resolved the stream thread no longer writes into any of its
  destination pages, so the engine may reuse them at once;
- every socket wait is bounded by `io_timeout_s`; `abort` breaks a wait at once;
- an idle stream whose producer closes (or sends what nobody asked for) is dropped
  at once (`dead`), never left readable under the thread's poll.
"""
from __future__ import annotations

import collections
import contextlib
import logging
import select
import socket
import threading
import time

from connectors.metrics import FailureCause
from connectors.pages import KVPages
from connectors.zmq.control import framing, wire
from connectors.zmq.control.peer_log import quote
from connectors.zmq.control.session import ClientSession
from connectors.zmq.control.wire import MalformedMessage, MsgType
from connectors.zmq.gang.gang_path import GangReceiver
from connectors.zmq.gang.gang_side import GangSide
from connectors.zmq.paths.base import PathName, PathReceiver, PathUnavailable, PullPart, Refused
from connectors.zmq.paths.choice import RECEIVERS, page_access_for
from connectors.zmq.paths.page_access import PageAccess
from connectors.zmq.paths.staging_ring import DEFAULT_STAGING, StagingShape

logger = logging.getLogger(__name__)


class PullStream:
    """Runs pulls on one data stream to one producer."""

    def __init__(self, pool: KVPages, host: str, data_port: int, session: ClientSession, path: PathName,
                 io_timeout_s: float, spin_s: float = 0.0, staging: StagingShape = DEFAULT_STAGING,
                 device_checksums: bool = False, gang: GangSide | None = None):
        self._pool = pool
        self._gang = gang  # the gang path's: this worker's gang (every D rank pulls its heads)
        self._staging = staging
        self._device_checksums = device_checksums
        self._receiver: PathReceiver | None = None  # the path's consumer half, once attached
        self._spin_s = spin_s
        self._spin_poller = select.poll()  # the data socket alone, polled without sleeping
        self._addr = (host, data_port)
        self._session = session
        self.path = PathName(path)  # after any fallback: the path the stream runs on
        self._io_timeout_s = io_timeout_s
        self._parts: collections.deque[PullPart] = collections.deque()  # guarded by _send_lock
        self._closing = False
        self._final_credit: bytes | None = None  # the path's owed credit, sent once its part is reported
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_w.setblocking(False)
        self._poller = select.poll()  # the wake socket, and the data socket while it is open
        self._poller.register(self._wake_r, select.POLLIN)
        self._polled_fd = -1
        self._sock: socket.socket | None = None
        self._xfer = 0
        self._send_lock = threading.Lock()  # PULLs go out in queue order, from either thread
        self._ready = False
        self._abort_cause: FailureCause | None = None
        self.dead = False
        self._thread = threading.Thread(target=self._run, name=f"kv-pull-{self.path.value}", daemon=True)
        self._thread.start()

    def submit(self, part: PullPart) -> None:
        """Queues a part. On an idle, open stream its PULL leaves at once from the caller's
        thread and the stream thread (waiting on the socket) first wakes when the answer
        arrives: one thread wake-up per transfer, which matters on a busy host."""
        with self._send_lock:
            idle = (self._ready and not self._parts and self._final_credit is None
                    and self._abort_cause is None and not self.dead)
            self._parts.append(part)
            if idle:
                try:
                    # Sent: wake the stream thread only if it is to spin on the answer (it then wakes
                    # while the PULL is in flight, off the latency path).
                    if self._send_pull(part, blocking=False) and not self._spin_s:
                        return
                except OSError:
                    part.xfer = 0  # the stream thread finds the stream broken and fails it
        self._wake()

    def close(self, cause: FailureCause = FailureCause.SHUTDOWN) -> None:
        """No more parts after this; queued parts fail with `cause`, the thread exits."""
        self._closing = True
        self.abort(cause)
        self._wake()

    def _wake(self) -> None:
        with contextlib.suppress(OSError):  # full: a wake-up is pending anyway
            self._wake_w.send(b"x")

    def abort(self, cause: FailureCause) -> None:
        """Breaks the stream now: the part in flight fails with `cause`."""
        if self._abort_cause is None:
            self._abort_cause = cause
        sock = self._sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    @property
    def _conn(self) -> socket.socket:
        """The data socket, for the steps that run only after `_connect`."""
        assert self._sock is not None
        return self._sock

    # ------------------------------------------------------------------ thread
    def _run(self) -> None:
        access = None
        try:
            self._connect()
            access = page_access_for(self._pool, self._staging)
            with self._send_lock:
                self._ready = True
        except Exception as e:  # noqa: BLE001 -- the stream thread reports any failure to open as a dead stream
            logger.warning("KV data stream to %s:%d failed to open: %s", *self._addr, e)
            self.dead = True
        while True:
            with self._send_lock:  # (a part's PULL fields are written under it)
                part = self._parts[0] if self._parts else None
            if part is None:
                if self._closing:
                    break
                self._idle_wait()
                continue
            if self.dead or self._abort_cause is not None or access is None:  # (no access: it failed to open)
                part.fail(self._abort_cause or FailureCause.PEER_GONE)
                self.dead = True
            else:
                self._run_part(part, access)
            with self._send_lock:
                self._parts.popleft()
            part.on_done(part)
            if self._final_credit is not None:
                self._send_final_credit()
        self._teardown()

    def _idle_wait(self) -> None:
        """Sleeps until a part is queued, its answer arrives, or close() (bounded)."""
        try:
            events = self._poller.poll(500)
        except OSError:
            events = []
        for fd, _ in events:
            if fd != self._polled_fd:
                with contextlib.suppress(OSError):
                    self._wake_r.recv(4096)
            elif not self._parts:  # (a part's answer: the loop reads it)
                self._idle_readable()

    def _idle_readable(self) -> None:
        data: bytes | OSError
        """Readable with no part queued, so no PULL outstanding: the producer closed (or died) or
        sent what nobody asked for. The stream is over; left alone, poll would report it forever."""
        with self._send_lock:  # a part submitted since the check above sent its PULL under this lock
            if self._parts or self.dead or self._sock is None:
                return
            try:
                data = self._sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                return  # nothing there after all
            except OSError as e:  # (reset)
                data = e
            if self._abort_cause is None:  # (after abort() our own shutdown reads as the end)
                what = "closed by the producer" if data == b"" else f"broken while idle ({data!r})"
                logger.warning("KV data stream to %s:%d %s; dropping it", *self._addr, what)
            self._break()

    def _connect(self) -> None:
        """Attaches on the stream's path, falling back along the paths' `fallback` until one attaches."""
        while True:
            try:
                return self._attach()
            except PathUnavailable as e:  # (a broken connection is no reason to try another path)
                fallback = _receiver_type(self.path).fallback(self._pool)
                if fallback is None:
                    raise
                level = logging.INFO if self.path is PathName.SHM_MAPPED else logging.WARNING
                logger.log(level, "KV data path %s to %s:%d unavailable: %s; falling back to %s", self.path.value,
                           *self._addr, e, fallback.value)
                self._break()
                self.dead = False
                self.path = fallback

    def _attach(self) -> None:
        sock = socket.create_connection(self._addr, timeout=self._io_timeout_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock = sock
        msg_type, msg = framing.recv_frame(sock, max_bytes=1024)  # the producer opens with this connection's nonce
        if msg_type is not MsgType.NONCE:
            raise MalformedMessage(f"expected nonce, got {msg_type.value}")
        checksums = self._device_checksums and self.path is PathName.CUDA_IPC
        framing.send_frame(sock, self._session.attach_message(msg["nonce"], self.path.value, checksums))
        msg_type, msg = framing.recv_frame(sock)
        if msg_type is not MsgType.ATTACHED:
            raise MalformedMessage(f"expected attached, got {msg_type.value}")
        framing.kernel_timeouts(sock, self._io_timeout_s, self._io_timeout_s)  # one syscall per read or send
        self._poller.register(sock, select.POLLIN)
        self._spin_poller.register(sock, select.POLLIN)
        self._polled_fd = sock.fileno()
        if msg.get("unavailable"):
            raise PathUnavailable(f"the producer: {quote(msg['unavailable'], 200)}")
        receiver = _receiver_type(self.path)(sock, self._pool, self._spin_s, self._device_checksums)
        if isinstance(receiver, GangReceiver):
            receiver.gang = self._gang
        try:
            receiver.open(msg)
        except (OSError, ValueError) as e:  # e.g. /proc not readable, a segment of the wrong size
            raise PathUnavailable(str(e)) from e
        self._receiver = receiver

    def _send_pull(self, part: PullPart, blocking: bool = True) -> bool:
        """Sends the part's PULL (under _send_lock). Non-blocking from the caller's thread:
        whatever does not fit in the (idle, so empty) send buffer at once is left in
        `part.unsent` for the stream thread, so the engine's thread never waits on the network."""
        self._xfer += 1
        part.xfer = self._xfer
        frame = wire.pull_frame(self._xfer, part.remote_request_id, part.src_block_ids, part.trace_context)
        if blocking:
            framing.send_frame_bytes(self._conn, frame)
        else:
            try:
                sent = self._conn.send(frame, socket.MSG_DONTWAIT)
            except BlockingIOError:
                sent = 0
            if sent != len(frame):
                part.unsent = frame[sent:]
                return False
        if len(part.dst_block_ids) == 1:  # (made while the producer works on the PULL)
            part.expect = wire.pages_prefix(part.xfer, 1, self._pool.page_size_bytes)
        return True

    def _run_part(self, part: PullPart, access: PageAccess) -> None:
        try:
            if not part.xfer:
                with self._send_lock:
                    self._send_pull(part)
            elif part.unsent:
                framing.send_frame_bytes(self._conn, part.unsent)
                part.unsent = b""
            receiver = self._receiver
            assert receiver is not None  # (attached before any part runs)
            if self._spin_s and not receiver.spins_in_reads:
                self._spin_until_readable()
            receiver.receive(part, access)
        except Refused as e:
            logger.warning("KV pull of %s refused by the producer: %s", part.remote_request_id, e)
            part.fail(FailureCause.PULL_REFUSED)
        except (TimeoutError, BlockingIOError):  # (BlockingIOError: a kernel timeout)
            part.fail(self._abort_cause or FailureCause.TIMEOUT)
            self._break()
        except (ConnectionError, OSError, MalformedMessage) as e:
            logger.warning("KV data stream to %s:%d broke: %s", *self._addr, e)
            part.fail(self._abort_cause or FailureCause.PEER_GONE)
            self._break()
        except Exception:  # a bug or a hostile peer: fail this part, keep the thread
            logger.exception("KV pull of %s failed unexpectedly", part.remote_request_id)
            part.fail(FailureCause.PEER_GONE)
            self._break()
        finally:
            access.settle()  # resolved only with no copy into its pages still running
            if self._receiver is not None:
                self._final_credit = self._receiver.take_owed_credit()  # sent after the part is reported

    def _spin_until_readable(self) -> None:
        """Polls for the answer without sleeping, for at most `spin_s`, then leaves the wait to the
        blocking read: a thread that stays on its core reads the pages as they arrive, where a
        sleeping one is woken late (often on the sender's core, after the send). A bounded burst
        of CPU per pull, traded for that wake-up."""
        poll, end = self._spin_poller.poll, time.perf_counter() + self._spin_s
        while not poll(0) and time.perf_counter() < end:
            pass

    def _send_final_credit(self) -> None:
        # Sent before any later PULL can go out: a direct send needs an empty `_parts`,
        # and `submit` takes the same lock.
        with self._send_lock:
            credit, self._final_credit = self._final_credit, None
            assert credit is not None  # (the caller saw it set; only this thread clears it)
            try:
                framing.send_frame(self._conn, credit)
            except OSError:
                self._break()

    def _break(self) -> None:
        self.dead = True
        if self._polled_fd >= 0:  # a closed socket would read as ready to poll forever
            self._poller.unregister(self._polled_fd)
            self._spin_poller.unregister(self._polled_fd)
            self._polled_fd = -1
        if self._sock is not None:
            framing.close_quietly(self._sock)

    def _teardown(self) -> None:
        self._break()
        for s in (self._wake_r, self._wake_w):
            s.close()
        if self._receiver is not None:
            self._receiver.close()  # unmaps the segment or the producer's pool


def _receiver_type(path: PathName) -> type[PathReceiver]:
    return GangReceiver if path is PathName.GANG else RECEIVERS[path]
