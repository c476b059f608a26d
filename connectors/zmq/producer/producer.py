"""The producer (prefill) side: side channel, leases, and serving pulls.

Threads (all daemon, all with timeouts, none ended by bad input):
- side channel: a ZMQ ROUTER bound on (host, port) - port 0 picks a free port,
  reported as `port`. It runs the handshake (see `handshake.py`), renews
  leases on heartbeats, ends them on DONE, expires them, and seals digests;
- data listener (`data_listener.py`): a TCP socket on (host, data_port); a
  connection must ATTACH with the MAC of a session from a completed handshake
  (`session.py`) before it costs more than a slot in one selector;
- one thread per attached data stream, serving PULL requests for leased
  blocks while its session lives, in one of three modes:
  - tcp: a PAGES header (xxh3 digests) followed by the raw page bytes;
  - map (same host, CPU pool): a PAGES header only; the consumer copies the
    pages out of this pool, mapped read-only, and CREDITs when done - the
    lease stays pinned until then;
  - shm (same host, staged): pages pass through a shared-memory segment,
    double-buffered with CHUNK / CREDIT frames (page-locked for a CUDA pool);
  - cuda_ipc (same node, CUDA pool): ATTACHED carries the pool's IPC export
    (`device_path.py`); a PULL is answered with its PAGES header once the
    pages' writer finished, the consumer copies device to device and CREDITs.
A CUDA pool's tcp pages leave through a staging ring (`staging_ring.py`):
device-to-host copies of later chunks overlap the send of the current one.
"""
from __future__ import annotations

import errno
import logging
import socket
import threading
import time

import torch
import zmq

from connectors.zmq.control import handshake as hs
from connectors.zmq.paths import ipc_mapping as device_path
from connectors.zmq.control import framing, wire
from connectors.zmq.producer.data_listener import DataListener, ListenerLimits
from connectors.zmq.producer.leases import LeaseTable, PullRefused, ServedPull
from connectors.metrics import LeaseEnd, TransferMetrics
from connectors.zmq.paths.page_access import PageAccess
from connectors.zmq.producer.producer_config import ProducerConfig  # noqa: F401 -- (imported from here by its users)
from connectors.pages import KVPages
from connectors.params import valid_trace_context
from connectors.zmq.control.peer_log import WarnLimiter, quote
from connectors.zmq.control.session import ProducerSession, SessionRefused, SessionTable, welcome_mac
from connectors.zmq.paths.shm_segment import ShmSegment
from connectors.zmq.control.side_guard import SideChannelGuard
from connectors.zmq.streaming.publisher import StreamPublisher
from connectors.zmq.control.wire import MalformedMessage, MsgType

logger = logging.getLogger(__name__)

_EXPIRE_EVERY_S = 1.0  # how often idle sessions are looked for
_IDLE_S = 0.5  # an idle data stream's thread wakes this often to notice shutdown


class Producer:
    """Serves a page pool's leased blocks to authenticated consumers.

    Guarantees: only blocks of an active lease are ever sent; a lease's blocks
    are released (via `take_released`) exactly once, after every pull reading
    them has finished.
    """

    def __init__(self, config: ProducerConfig, pool: KVPages, metrics: TransferMetrics | None = None):
        self.config = config
        self.pool = pool
        self.metrics = metrics or TransferMetrics()
        self.leases = LeaseTable(config.lease_s, self.metrics)
        self.host_id = hs.local_host_id()
        self._ctx: zmq.Context = zmq.Context.instance()
        self._stop = threading.Event()
        self.sessions = SessionTable(config.max_sessions, config.session_idle_s)
        self._warn = WarnLimiter(logger)  # what strangers can trigger is rate-limited
        self._threads: list[threading.Thread] = []
        self._streams: set[socket.socket] = set()
        self._seal_access = PageAccess(pool, config.staging)
        self.stream = StreamPublisher(self.leases, self._seal_access.page_digests, self.metrics,  # streamed leases
                                      config.max_watchers)
        self._handshake = hs.ProducerHandshake(config.secret, config.compat_hash, config.engine_id,
                                               config.handshake_timeout_s)
        self.port = 0
        self.data_port = 0
        self.advertised_data_port = 0  # named in WELCOME when set (an emulated link in front); else data_port

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self._router.setsockopt(zmq.MAXMSGSIZE, wire.MAX_CONTROL_BYTES)  # zmq drops larger peers
        # a connection that does not finish the ZMTP greeting in time is dropped
        self._router.setsockopt(zmq.HANDSHAKE_IVL, int(self.config.handshake_timeout_s * 1000))
        if self.config.port:
            _bind_fixed(self._router, f"tcp://{self.config.host}:{self.config.port}")
            self.port = self.config.port
        else:
            self.port = self._router.bind_to_random_port(f"tcp://{self.config.host}")
        self._guard = SideChannelGuard(self._router, f"tcp://{self.config.host}:{self.port}", self.port,
                                       self.config.max_side_connections, self.metrics)
        listener = socket.create_server((self.config.host, self.config.data_port), backlog=64)
        self.data_port = listener.getsockname()[1]
        self._data_listener = DataListener(
            listener, self.sessions, ListenerLimits(self.config.max_preauth, self.config.handshake_timeout_s),
            self._on_attached, self.metrics, self._stop)
        for target, name in ((self._side_channel_loop, "side"), (self._data_listener.run, "accept")):
            t = threading.Thread(target=target, name=f"kv-producer-{name}", daemon=True)
            t.start()
            self._threads.append(t)
        logger.info("KV producer %s listening: side channel %s:%d, data %d",
                    self.config.engine_id, self.config.host, self.port, self.data_port)

    def shutdown(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        for s in list(self._streams):
            framing.close_quietly(s)
        for t in self._threads:
            t.join(timeout=2.0)
        self.leases.end_all(LeaseEnd.SHUTDOWN)

    # ------------------------------------------------------------------ engine-facing
    def add_lease(self, request_id: str, block_ids: list[int], lease_s: float | None = None) -> None:
        self.leases.add(request_id, block_ids, lease_s)

    def abort_lease(self, request_id: str) -> None:
        self.leases.end(request_id, LeaseEnd.ABORTED)

    def take_released(self) -> set[str]:
        return self.leases.take_released()

    # ------------------------------------------------------------------ side channel
    def _side_channel_loop(self) -> None:
        router, guard = self._router, self._guard
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        poller.register(guard.monitor, zmq.POLLIN)
        poller.register(self.stream.wake_r, zmq.POLLIN)
        next_expiry = 0.0
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(50))
                if guard.monitor in events:
                    guard.poll_events()
                guard.tick()
                if router in events:
                    try:
                        frames = router.recv_multipart(zmq.NOBLOCK, copy=True)
                    except zmq.Again:
                        frames = []
                    if len(frames) == 2:
                        try:
                            self._on_side_message(frames[0], frames[1])
                        except Exception:  # never let one message end the side channel
                            self.metrics.record_malformed()
                            logger.exception("KV producer: side-channel message failed")
                    elif frames:
                        self.metrics.record_malformed()
                self.leases.expire()
                self.leases.seal_pending(self._seal_access.page_digests)
                self.stream.flush(self._send)
                self._handshake.expire()
                now = time.monotonic()
                if now >= next_expiry:
                    next_expiry = now + _EXPIRE_EVERY_S
                    self.sessions.expire()
                    self.stream.expire()
        except Exception:  # the side channel must not die silently
            logger.exception("KV producer side channel crashed")
        finally:
            guard.close()
            router.close(linger=0)
            self.stream.close()

    def _on_side_message(self, ident: bytes, payload: bytes) -> None:
        try:
            msg_type, msg = wire.decode(payload)
        except MalformedMessage as e:
            self.metrics.record_malformed()
            logger.debug("dropped malformed side-channel frame: %s", e)
            return
        try:
            if msg_type is MsgType.HELLO:
                self._send(ident, self._handshake.on_hello(ident, msg))
                return
            if msg_type is MsgType.AUTH:
                self._welcome(ident, *self._handshake.on_auth(ident, msg))
                return
        except hs.HandshakeRefused as e:
            self._refuse(ident, e.reason, e.detail)
            return
        if msg_type is MsgType.REFUSE:  # the consumer refused us (e.g. our proof failed)
            self._handshake.forget(ident)
            reason = hs.RefuseReason.parse(msg["reason"])
            self._warn.warning("KV producer %s was refused by a consumer (%s): %s", self.config.engine_id,
                               reason.value, quote(msg["detail"], 200))
            self.metrics.record_refused(reason)
        elif msg_type in (MsgType.HEARTBEAT, MsgType.DONE, MsgType.WATCH):
            try:
                session = self.sessions.check_side(ident, msg_type, msg)
            except SessionRefused as e:
                reason = hs.RefuseReason.parse(e.reason)
                if reason is hs.RefuseReason.SESSION:  # (a consumer whose session ended: it handshakes again)
                    self._refuse(ident, reason, str(e))
                else:  # a forged or captured frame: does nothing, counted, never answered
                    self.metrics.record_refused(reason)
                    self._warn.warning("KV producer %s dropped a side-channel message (%s): %s",
                                       self.config.engine_id, reason.value, e)
                return
            if msg_type is MsgType.HEARTBEAT:
                self.leases.renew(msg["request_ids"])
            elif msg_type is MsgType.WATCH:
                self.stream.watch(session, msg["request_ids"], self._send)
            else:
                for rid in self.stream.forget(session, msg["request_ids"]):
                    self.leases.end(rid, LeaseEnd.DONE)
        else:
            self.metrics.record_malformed()

    def _welcome(self, ident: bytes, key: bytes, peer_engine_id: str) -> None:
        session = self.sessions.open(key, ident, peer_engine_id)
        self._send(ident, wire.encode(MsgType.WELCOME, session=session.session_id,
                                      mac=welcome_mac(key, session.session_id),
                                      data_port=self.advertised_data_port or self.data_port, host_id=self.host_id,
                                      shm=self.config.offer_shm, device=self._offers_device))

    @property
    def _offers_device(self) -> bool:
        return self.config.offer_device and self.pool.device.type == "cuda"

    def _refuse(self, ident: bytes, reason: hs.RefuseReason, detail: str) -> None:
        self._warn.warning("KV producer %s refused a peer (%s): %s", self.config.engine_id, reason.value, detail)
        self.metrics.record_refused(reason)
        self._send(ident, wire.encode(MsgType.REFUSE, reason=reason.value, detail=detail))

    def _send(self, ident: bytes, payload: bytes) -> None:
        try:
            self._router.send_multipart([ident, payload], zmq.NOBLOCK)
        except zmq.ZMQError:  # peer gone or its queue full: it will time out on its side
            pass

    # ------------------------------------------------------------------ data streams
    def _on_attached(self, conn: socket.socket, session: ProducerSession, attach: dict) -> None:
        """The data listener's hand-off: an authenticated connection gets its own thread."""
        if len(self._streams) >= self.config.max_streams:
            self.metrics.record_refused(hs.RefuseReason.CAPACITY)
            self._warn.warning("KV producer: %d data streams already; refusing another", len(self._streams))
            framing.close_quietly(conn)
            return
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._streams.add(conn)
        threading.Thread(target=self._stream_loop, args=(conn, session, attach["mode"]), name="kv-producer-stream",
                         daemon=True).start()

    def _stream_loop(self, conn: socket.socket, session: ProducerSession, mode: str) -> None:
        seg: ShmSegment | None = None
        try:
            conn.settimeout(self.config.io_timeout_s)
            mapped = mode == "map" and self.config.offer_shm and self.pool.shared_path is not None
            access = PageAccess(self.pool, self.config.staging)
            path = "map" if mapped else "tcp"
            if mode == "cuda_ipc":  # only an attached (MAC-checked) connection of a live session gets here
                if not self._attach_device(conn):
                    return  # the consumer falls back on a new connection
                path = "cuda_ipc"
            elif mapped:  # the consumer copies straight out of this pool (same host, CPU pool)
                framing.send_frame(conn, wire.encode(MsgType.ATTACHED, shm_name=self.pool.shared_path,
                                                     shm_bytes=self.pool.nbytes, chunk_pages=0))
            elif mode == "shm" and self.config.offer_shm:
                chunk = max(1, self.config.shm_chunk_bytes // self.pool.page_size_bytes)
                seg = ShmSegment.create(chunk, self.pool.page_size_bytes)
                if self.pool.device.type == "cuda":
                    seg.pin()  # page-locked: the D2H copies into it run at DMA rate
                framing.send_frame(conn, wire.encode(MsgType.ATTACHED, shm_name=seg.name, shm_bytes=seg.nbytes,
                                                     chunk_pages=chunk))
                path = "shm"
            else:
                framing.send_frame(conn, wire.encode(MsgType.ATTACHED, shm_name="", shm_bytes=0, chunk_pages=0))
            self._serve(conn, session, access, seg, path)
        except (ConnectionError, OSError, MalformedMessage) as e:
            if isinstance(e, MalformedMessage):
                self.metrics.record_malformed()
            logger.debug("KV producer stream ended: %s", e)
        except Exception:
            logger.exception("KV producer stream failed")
        finally:
            self._streams.discard(conn)
            framing.close_quietly(conn)
            if seg is not None:
                seg.close()

    def _attach_device(self, conn: socket.socket) -> bool:
        """Answers a cuda_ipc ATTACH: the pool's export, or why there is none (the consumer falls back)."""
        try:
            if not self.config.offer_device:
                raise device_path.DeviceUnavailable("this producer does not offer its device pool (an emulated "
                                                    "link, or shared memory disallowed)")
            export, reason = device_path.export_pool(self.pool), ""
        except device_path.DeviceUnavailable as e:
            export, reason = {}, str(e)
        except Exception as e:  # noqa: BLE001 -- any failure to export means: no device path, say why
            export, reason = {}, f"{type(e).__name__}: {e}"
        framing.send_frame(conn, wire.encode(MsgType.ATTACHED, shm_name="", shm_bytes=0, chunk_pages=0,
                                             ipc=export, ipc_error=reason))
        if reason:
            logger.info("KV producer %s: no device path for a consumer: %s", self.config.engine_id, reason)
        return bool(export)

    def _serve(self, conn: socket.socket, session: ProducerSession, access: PageAccess, seg: ShmSegment | None,
               path: str) -> None:
        # Kernel-side timeouts: a read or a send is one syscall. Idle reads wake every
        # _IDLE_S to notice shutdown; a frame, a send or a credit waits at most io_timeout_s.
        io_s = self.config.io_timeout_s
        framing.kernel_timeouts(conn, _IDLE_S, io_s)
        reader = framing.FrameReader(conn)
        page_bytes = self.pool.page_size_bytes
        device = torch.cuda.Stream(device=self.pool.device) if path == "cuda_ipc" else None
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
                sealed = lease.digests
                digests = [sealed[b] for b in block_ids] if sealed is not None else access.page_digests(block_ids)
                if path in ("map", "cuda_ipc"):
                    if device is not None:  # the consumer reads the pages on the device: their writer first
                        device_path.wait_for_writes(self.pool, device)
                    # Digests only; the lease stays pinned until the consumer says it copied.
                    framing.sendmsg_all(conn, [wire.pages_frame(xfer, digests, page_bytes)])
                    self._await_credit(reader, [True, False])
                elif seg is None:
                    self._send_pages(conn, access, wire.pages_frame(xfer, digests, page_bytes), block_ids)
                else:
                    self._send_chunks(conn, reader, access, seg, xfer, block_ids, digests)
                if reporting:  # reports on: what this pull sent, and the consumer's trace context (a peer's: checked)
                    served = ServedPull(valid_trace_context(msg.get("tc")), len(block_ids),
                                        len(block_ids) * page_bytes, path, started, time.monotonic())
            finally:
                self.leases.end_pull(lease, served)
            self.metrics.record_sent(len(block_ids), len(block_ids) * page_bytes)

    def _send_pages(self, conn, access: PageAccess, header: bytes, block_ids: list[int]) -> None:
        """The PAGES header and the page bytes: in place, one sendmsg from the pool (a view per run
        of consecutive pages); staged, one sendmsg per chunk, straight from its pinned slot while
        the next chunks' device-to-host copies run."""
        bufs: list = [header]
        for views in access.send_views(block_ids):
            framing.sendmsg_all(conn, bufs + views)
            bufs = []
        if bufs:  # no pages at all: the header alone
            framing.sendmsg_all(conn, bufs)

    def _send_chunks(self, conn, reader: framing.FrameReader, access: PageAccess, seg: ShmSegment, xfer: int,
                     block_ids: list[int], digests: list[int]) -> None:
        # Double buffering: fill one half while the consumer drains the other;
        # a half is reused only after its CREDIT came back.
        n = seg.chunk_pages
        busy = [False, False]
        for k, i in enumerate(range(0, len(block_ids), n)):
            half = k % 2
            if busy[half]:
                self._await_credit(reader, busy)
            access.copy_out(block_ids[i : i + n], seg.half(half))
            busy[half] = True
            framing.send_frame(conn, wire.encode(MsgType.CHUNK, xfer=xfer, half=half, digests=digests[i : i + n]))
        while any(busy):
            self._await_credit(reader, busy)

    def _await_credit(self, reader: framing.FrameReader, busy: list[bool]) -> None:
        msg_type, msg = reader.read(self.config.io_timeout_s)
        if msg_type is not MsgType.CREDIT or msg["half"] not in (0, 1) or not busy[msg["half"]]:
            raise MalformedMessage("expected a credit for a busy half")
        busy[msg["half"]] = False


REBIND_WAIT_S = 5.0  # how long a fixed port may stay taken by a just-closed socket of this process


def _bind_fixed(sock: zmq.Socket, endpoint: str) -> None:
    """Binds a fixed endpoint, retrying EADDRINUSE for a bounded time: libzmq releases a closed
    socket's listener asynchronously, so a producer restarted at the same address in one process
    (a restarted engine) can find its own old listener still there for a few milliseconds."""
    deadline = time.monotonic() + REBIND_WAIT_S
    while True:
        try:
            sock.bind(endpoint)
            return
        except zmq.ZMQError as e:
            if e.errno != errno.EADDRINUSE or time.monotonic() >= deadline:
                raise
            time.sleep(0.02)
