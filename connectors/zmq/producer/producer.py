"""The producer (prefill) side: side channel, leases, and serving pulls.

Threads (all daemon, all with timeouts, none ended by bad input):
- side channel: a ZMQ ROUTER bound on (host, port) - port 0 picks a free port,
  reported as `port`. It runs the handshake (see `handshake.py`), renews
  leases on heartbeats, ends them on DONE, expires them, and seals digests;
- data listener (`data_listener.py`): a TCP socket on (host, data_port); a
  connection must ATTACH with the MAC of a session from a completed handshake
  (`session.py`) before it costs more than a slot in one selector;
- one thread per attached data stream (`data_stream.py`), serving PULL
  requests for leased blocks while its session lives, on the data path its
  ATTACH named (tcp, shm_mapped, shm_staged or cuda_ipc: `paths/`).
"""
from __future__ import annotations

import errno
import logging
import socket
import threading
import time

import zmq

from connectors.zmq.control import handshake as hs
from connectors.zmq.control import wire
from connectors.zmq.producer.data_listener import DataListener, ListenerLimits
from connectors.zmq.producer.data_stream import DataStreams
from connectors.zmq.producer.leases import LeaseTable
from connectors.metrics import LeaseEnd, TransferMetrics
from connectors.zmq.paths.choice import page_access_for
from connectors.zmq.producer.producer_config import ProducerConfig  # noqa: F401 -- (imported from here by its users)
from connectors.pages import KVPages
from connectors.zmq.control.peer_log import WarnLimiter, quote
from connectors.zmq.control.session import SessionRefused, SessionTable, welcome_mac
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
        self.data_streams = DataStreams(config, pool, self.leases, self.metrics, self._stop)
        self._seal_access = page_access_for(pool, config.staging)
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
            self.data_streams.on_attached, self.metrics, self._stop)
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
        self.data_streams.close_all()
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
        gang = self.data_streams.gang
        tp = {"tp": gang.tp} if gang is not None and gang.tp > 1 else {}  # (TP 1: today's WELCOME, byte for byte)
        self._send(ident, wire.encode(MsgType.WELCOME, session=session.session_id,
                                      mac=welcome_mac(key, session.session_id),
                                      data_port=self.advertised_data_port or self.data_port, host_id=self.host_id,
                                      shm=self.config.offer_shm, device=self._offers_device, **tp))

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
