"""The producer's data streams: one thread per attached connection, serving PULLs for leased
blocks on the data path its ATTACH named (`paths/`), while its session lives.

Each stream's path is fixed when it attaches: `paths.choice.server_for` picks the path's
producer half, which answers the ATTACH (or says why it cannot: the consumer then falls back on
a new connection) and serves every pull of the stream. The loop here is the same for every
path: read a PULL, pin its lease, the digests if the path sends them (`pull_digests`), serve,
unpin. Every wait is bounded: idle reads wake every `_IDLE_S` to notice shutdown; a frame, a
send or a credit waits at most `io_timeout_s`.
"""
from __future__ import annotations

import logging
import socket
import threading
import time

from connectors.metrics import TransferMetrics
from connectors.pages import KVPages
from connectors.params import valid_trace_context
from connectors.zmq.control import framing, wire
from connectors.zmq.control import handshake as hs
from connectors.zmq.control.peer_log import WarnLimiter
from connectors.zmq.control.session import ProducerSession
from connectors.zmq.control.wire import MalformedMessage, MsgType
from connectors.zmq.gang.gang_path import GangServer
from connectors.zmq.gang.gang_side import GangSide
from connectors.zmq.paths.base import PathName, PathServer, PathUnavailable, ServeSettings
from connectors.zmq.paths.choice import page_access_for, server_for
from connectors.zmq.paths.page_access import PageAccess
from connectors.zmq.paths.tcp import NO_SHM
from connectors.zmq.producer.leases import Lease, LeaseTable, PullRefused, ServedPull
from connectors.zmq.producer.producer_config import ProducerConfig

logger = logging.getLogger(__name__)

_IDLE_S = 0.5  # an idle data stream's thread wakes this often to notice shutdown


def pull_digests(server: PathServer, lease: Lease, access: PageAccess, block_ids: list[int]) -> list[int]:
    """The digests a pull's answer carries: none where the path sends none (cuda_ipc to a
    consumer that does not check), else the lease's sealed ones, computed now only if the
    lease is not sealed yet (a device-to-host pass for a CUDA pool)."""
    if not server.needs_digests:
        return []
    sealed = lease.digests
    return [sealed[b] for b in block_ids] if sealed is not None else access.page_digests(block_ids)


class DataStreams:
    """The attached data streams of one producer.

    Guarantees: at most `max_streams` at once (one more is closed at once, counted as a
    CAPACITY refusal); a stream serves only blocks of an active lease, and a pull's lease is
    unpinned once the path is done with its pages, whatever happened; `close_all` closes every
    stream's connection (their threads then end)."""

    def __init__(self, config: ProducerConfig, pool: KVPages, leases: LeaseTable, metrics: TransferMetrics,
                 stop: threading.Event):
        self.config = config
        self.pool = pool
        self.leases = leases
        self.metrics = metrics
        self._stop = stop
        self._warn = WarnLimiter(logger)
        self.streams: set[socket.socket] = set()
        self.gang: GangSide | None = None  # this worker's gang (a gang of one for TP 1), when it has one
        self._settings = ServeSettings(io_timeout_s=config.io_timeout_s, shm_chunk_bytes=config.shm_chunk_bytes,
                                       offer_shm=config.offer_shm, offer_device=config.offer_device)

    def on_attached(self, conn: socket.socket, session: ProducerSession, attach: dict) -> None:
        """The data listener's hand-off: an authenticated connection gets its own thread."""
        if len(self.streams) >= self.config.max_streams:
            self.metrics.record_refused(hs.RefuseReason.CAPACITY)
            self._warn.warning("KV producer: %d data streams already; refusing another", len(self.streams))
            framing.close_quietly(conn)
            return
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.streams.add(conn)
        threading.Thread(target=self._stream_loop, args=(conn, session, attach), name="kv-producer-stream",
                         daemon=True).start()

    def close_all(self) -> None:
        for s in list(self.streams):
            framing.close_quietly(s)

    def _stream_loop(self, conn: socket.socket, session: ProducerSession, attach: dict) -> None:
        server = None
        try:
            conn.settimeout(self.config.io_timeout_s)
            access = page_access_for(self.pool, self.config.staging)
            server = self._server_for(attach, conn, access)
            try:
                if self.gang is not None and self.gang.tp > 1 and server.name is not PathName.GANG:
                    raise PathUnavailable("this producer is a TP gang: only the gang path moves its KV")
                fields = server.attached()
            except (PathUnavailable, OSError, ValueError) as e:  # said to the consumer: it falls back on a new
                # connection (OSError: e.g. no room in /dev/shm for a segment)
                logger.info("KV producer %s: no %s path for a consumer: %s", self.config.engine_id,
                            server.name.value, e)
                framing.send_frame(conn, wire.encode(MsgType.ATTACHED, **NO_SHM, unavailable=str(e)))
                return
            framing.send_frame(conn, wire.encode(MsgType.ATTACHED, **fields))
            self._serve(conn, session, access, server)
        except (ConnectionError, OSError, MalformedMessage) as e:
            if isinstance(e, MalformedMessage):
                self.metrics.record_malformed()
            logger.debug("KV producer stream ended: %s", e)
        except Exception:
            logger.exception("KV producer stream failed")
        finally:
            self.streams.discard(conn)
            framing.close_quietly(conn)
            if server is not None:
                server.close()

    def _server_for(self, attach: dict, conn: socket.socket, access: PageAccess) -> PathServer:
        """The ATTACH's path; a gang of TP > 1 serves the gang path only (any other path would send
        rank 0's heads alone as if they were pages)."""
        gang = self.gang
        if attach.get("mode") == PathName.GANG.value:
            server = GangServer(conn, self.pool, access, self._settings)
            server.gang = gang
            return server
        return server_for(attach, conn, self.pool, access, self._settings)

    def _serve(self, conn: socket.socket, session: ProducerSession, access: PageAccess, server: PathServer) -> None:
        # Kernel-side timeouts: a read or a send is one syscall.
        io_s = self.config.io_timeout_s
        framing.kernel_timeouts(conn, _IDLE_S, io_s)
        reader = framing.FrameReader(conn)
        page_bytes = self.pool.page_size_bytes
        if isinstance(server, GangServer) and self.gang is not None:  # every rank sends its heads: canonical pages
            page_bytes = self.gang.canonical_page_bytes or page_bytes
        while not self._stop.is_set():
            try:
                msg_type, msg = reader.read(io_s, idle=True)
            except framing.Idle:
                continue
            if msg_type is not MsgType.PULL:
                raise MalformedMessage(f"expected pull, got {msg_type.value}")
            if session.closed:  # expired or evicted: the connection belonged to it
                logger.info("KV producer: session of %s ended; closing its data stream", session.peer_engine_id)
                return
            session.last_used = time.monotonic()
            xfer, block_ids = msg["xfer"], msg["block_ids"]
            try:
                lease = self.leases.begin_pull(msg["request_id"], block_ids)
            except PullRefused as e:
                framing.send_frame(conn, wire.encode(MsgType.ERROR, xfer=xfer, reason=str(e)))
                continue
            reporting = self.leases.reporting
            started = time.monotonic() if reporting else 0.0
            served = None
            try:
                server.serve(reader, xfer, block_ids, pull_digests(server, lease, access, block_ids))
                if reporting:  # reports on: what this pull sent, and the consumer's trace context (a peer's: checked)
                    served = ServedPull(valid_trace_context(msg.get("tc")), len(block_ids),
                                        len(block_ids) * page_bytes, server.name.value, started, time.monotonic())
            finally:
                self.leases.end_pull(lease, served)
            self.metrics.record_sent(len(block_ids), len(block_ids) * page_bytes)
