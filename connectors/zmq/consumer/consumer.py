"""The consumer (decode) side: sessions with producers and pulled loads.

One control thread owns every ZMQ socket: it connects lazily, once per remote
engine, runs the handshake (a small state machine with a deadline), sends
heartbeats for requests still waiting, DONE notices after loads, and enforces
load deadlines. Data moves on `PullStream`s (one thread each), so a slow or
vanished producer only ever stalls its own streams.

Guarantees:
- every `load` ends exactly once, in `take_finished`, as a `LoadResult`:
  ok (every page landed and matched its xxh3 digest) or failed with the
  destination blocks that must not be trusted and a `FailureCause`;
- a load ends only when no stream writes into its pages any more;
- a load never waits longer than `transfer_timeout_s` (+ `io_timeout_s` to
  break a stuck socket).
"""
from __future__ import annotations

import functools
import logging
import queue
import socket
import threading
import time

import zmq

from connectors.zmq.control import handshake as hs
from connectors.zmq.control import wire
from connectors.zmq.consumer.consumer_config import ConsumerConfig
from connectors.zmq.gang.gang_path import gang_choice
from connectors.zmq.gang.gang_side import GangSide
from connectors.zmq.paths.choice import choose_path, log_choice
from connectors.zmq.consumer.consumer_session import SessionState, RemoteSession, side_socket
from connectors.zmq.consumer.loads import LoadHandle, LoadResult, RemoteAddr
from connectors.zmq.paths.base import PullPart
from connectors.metrics import FailureCause, TransferMetrics
from connectors.pages import KVPages
from connectors.zmq.consumer.pull_stream import PullStream
from connectors.zmq.streaming.stream_load import StreamedLoad, StreamLoads
from connectors.zmq.control.wire import MalformedMessage, MsgType

logger = logging.getLogger(__name__)
_U64 = 1 << 64


class Consumer(StreamLoads):
    def __init__(self, config: ConsumerConfig, pool: KVPages, metrics: TransferMetrics | None = None):
        self.config = config
        self.pool = pool
        self.metrics = metrics or TransferMetrics()
        self.host_id = hs.local_host_id()
        self._ctx: zmq.Context = zmq.Context.instance()
        self._lock = threading.Lock()
        self._sessions: dict[RemoteAddr, RemoteSession] = {}
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._active: dict[int, LoadHandle] = {}
        self._finished: list[LoadResult] = []
        self._streamed: dict[tuple[RemoteAddr, str], StreamedLoad] = {}  # by producer and its request id
        self._heartbeats: dict[RemoteAddr, list[str]] = {}
        self._stop = threading.Event()
        self.gang: GangSide | None = None  # this worker's gang (a gang of one for TP 1), when it has one
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_w.setblocking(False)
        self._thread = threading.Thread(target=self._loop, name="kv-consumer", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def shutdown(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._wake()
        self._thread.join(timeout=5.0)

    # ------------------------------------------------------------------ engine-facing (any thread)
    def load(self, request_id: str, remote: RemoteAddr, remote_request_id: str,
             src_block_ids: list[int], dst_block_ids: list[int], trace_context: str | None = None) -> LoadHandle:
        """Starts pulling src pages of `remote` into dst pages; ends in `take_finished`. On a ready
        session the PULLs leave first, bookkeeping after (under the lock: no part ends before it).
        `trace_context` (opaque) goes along in every PULL of the load."""
        start = time.perf_counter()
        n, num_blocks = len(dst_block_ids), self.pool.num_blocks
        if n != len(src_block_ids) or not n:
            raise ValueError("a load needs as many (non-zero) source as destination blocks")
        if n == 1:  # (source ids go on the wire as uint64)
            d, s = dst_block_ids[0], src_block_ids[0]
            ok = 0 < d < num_blocks and type(s) is int and 0 <= s < _U64
        else:
            ok = (len(set(dst_block_ids)) == n and all(0 < b < num_blocks for b in dst_block_ids)
                  and all(type(b) is int and 0 <= b < _U64 for b in src_block_ids))
        if not ok:
            raise ValueError(f"bad block ids for {request_id}")
        job = LoadHandle(request_id, remote, remote_request_id, list(src_block_ids), list(dst_block_ids),
                         time.monotonic() + self.config.transfer_timeout_s, start, trace_context)
        with self._lock:
            session = self._sessions.get(remote)
            ready = session is not None and session.state is SessionState.READY
            job.warm = ready
            if session is not None and ready:
                self._dispatch_locked(session, job)
            self._active[id(job)] = job
        if not ready:
            self._inbox.put(("load", job))
            self._wake()
        return job

    def notify_done(self, remote: RemoteAddr, remote_request_ids: list[str]) -> None:
        """Tells the producer it may release these requests' blocks (no load needed)."""
        self._inbox.put(("done", remote, list(remote_request_ids)))
        self._wake()

    def set_heartbeats(self, waiting: dict[RemoteAddr, list[str]]) -> None:
        """Replaces the set of remote requests whose leases must be kept alive."""
        with self._lock:
            self._heartbeats = {r: list(ids) for r, ids in waiting.items() if ids}

    def data_paths(self) -> dict[str, list[str]]:
        """The data paths of each producer session's streams (after any fallback), by engine id."""
        return {s.remote.engine_id: [st.path.value for st in s.streams] for s in list(self._sessions.values())}

    def take_finished(self) -> list[LoadResult]:
        with self._lock:
            out, self._finished = self._finished, []
            return out

    # ------------------------------------------------------------------ dispatch
    def _dispatch_locked(self, session: RemoteSession, job: LoadHandle) -> None:
        if job.result is not None:  # already ended (deadline passed while waiting for the handshake)
            return
        if isinstance(job, StreamedLoad):  # its parts come as the producer publishes them
            session.pending_watch.append(job.remote_request_id)  # (sent by the next _flush_done)
            return
        self._send_parts(session, job, job.src, job.dst)

    def _send_parts(self, session: RemoteSession, job: LoadHandle, all_src: list[int], all_dst: list[int]) -> None:
        live = [s for s in session.streams if not s.dead] or session.streams
        n = len(all_dst)
        k = min(len(live), n // 4) if n >= 8 else 1  # tiny loads ride one stream
        per = -(-n // k)
        slices = [(i, min(n, i + per)) for i in range(0, n, per)] if k > 1 else [(0, n)]
        job.parts_left += len(slices)
        for a, b in slices:
            stream = live[session.next_stream % len(live)]
            session.next_stream += 1
            src, dst = (all_src, all_dst) if k == 1 else (all_src[a:b], all_dst[a:b])
            stream.submit(PullPart(job.remote_request_id, src, dst, functools.partial(self._on_part, job),
                                   trace_context=job.trace_context))
            job.streams.append(stream)  # (after the PULL went out: off the latency path)

    def _on_part(self, job: LoadHandle, part: PullPart) -> None:
        with self._lock:
            job.bad.extend(part.bad_block_ids)
            if part.cause is not None and job.cause is None:
                job.cause = part.cause
            job.parts_left -= 1
            if isinstance(job, StreamedLoad) and part.cause is None and not part.bad_block_ids:
                self.metrics.record_stream_part(published=False)
            if job.parts_left == 0 and job.settled():
                self._finish_locked(job)

    def _finish_locked(self, job: LoadHandle) -> None:
        seconds = time.perf_counter() - job.start
        self._active.pop(id(job), None)
        if isinstance(job, StreamedLoad) and self._streamed.get((job.remote, job.remote_request_id)) is job:
            del self._streamed[(job.remote, job.remote_request_id)]
        job.bad.extend(job.unfilled())  # a streamed load's blocks never published
        if job.bad and job.cause is None:
            job.cause = FailureCause.PULL_REFUSED
        ok = job.cause is None and not job.bad
        page_bytes = self.gang.canonical_page_bytes if self.gang is not None and self.gang.tp > 1 else 0
        nbytes = len(job.dst) * (page_bytes or self.pool.page_size_bytes) if ok else 0  # (canonical pages)
        job.result = LoadResult(job.request_id, ok, sorted(set(job.bad)), job.cause, nbytes, seconds)
        self._finished.append(job.result)
        if ok:
            self.metrics.record_load(len(job.dst), nbytes, seconds, peer=job.remote.engine_id, warm=job.warm)
        else:
            self.metrics.record_failure(job.cause or FailureCause.CHECKSUM, peer=job.remote.engine_id)
            logger.warning("KV load of %s from %s failed (%s): %d invalid blocks", job.request_id,
                           job.remote.engine_id, (job.cause or FailureCause.CHECKSUM).value, len(job.bad))
        if self.config.notify_done:
            # After PEER_GONE only while the side channel is still up (a data stream broke, the
            # producer may well live on: let it free the blocks now, not at lease expiry); never
            # reconnect just to tell a producer that is probably gone.
            session = self._sessions.get(job.remote)
            if job.cause is not FailureCause.PEER_GONE or (session is not None and session.state is SessionState.READY):
                self._inbox.put(("done", job.remote, [job.remote_request_id]))
                self._wake()
        job.done.set()

    def _fail_locked(self, job: LoadHandle, cause: FailureCause) -> None:
        if job.result is not None:  # ended already (its deadline passed while it waited for a handshake)
            return
        job.cause = job.cause or cause
        job.bad = list(job.dst)
        self._finish_locked(job)

    # ------------------------------------------------------------------ control thread
    def _wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass  # buffer full: a wake-up is already pending

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        last_hb = 0.0
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(50))
                if self._wake_r in events or self._wake_r.fileno() in events:
                    try:
                        self._wake_r.recv(4096)
                    except OSError:
                        pass
                self._drain_inbox(poller)
                for session in list(self._sessions.values()):
                    if events.get(session.sock) is not None:
                        try:
                            self._on_socket(session, poller)
                        except Exception:  # one bad peer must not end the control thread
                            logger.exception("KV consumer: session with %s failed", session.remote)
                            self._close_session(session, poller, FailureCause.PEER_GONE)
                now = time.monotonic()
                self._check_deadlines(now, poller)
                if now - last_hb >= self.config.heartbeat_interval_s:
                    last_hb = now
                    self._send_heartbeats(poller)
        except Exception:
            logger.exception("KV consumer control thread crashed")
        finally:
            for session in list(self._sessions.values()):
                self._close_session(session, poller, FailureCause.SHUTDOWN)
            with self._lock:
                for job in list(self._active.values()):
                    if job.parts_left == 0:
                        self._fail_locked(job, FailureCause.SHUTDOWN)

    def _drain_inbox(self, poller) -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            remote = item[1].remote if item[0] == "load" else item[1]
            session = self._session_for(remote, poller)
            with self._lock:
                if item[0] == "load":
                    if session.state is SessionState.READY:
                        self._dispatch_locked(session, item[1])
                    else:
                        session.pending.append(item[1])
                else:
                    session.pending_done.extend(item[2])
            if session.state is SessionState.READY:
                self._flush_done(session)

    def _session_for(self, remote: RemoteAddr, poller) -> RemoteSession:
        session = self._sessions.get(remote)
        if session is not None:
            return session
        sock = side_socket(self._ctx, remote)
        session = RemoteSession(remote, sock, time.monotonic() + self.config.handshake_timeout_s)
        with self._lock:
            self._sessions[remote] = session
        poller.register(sock, zmq.POLLIN)
        cfg = self.config
        session.handshake = hs.ConsumerHandshake(cfg.secret, cfg.compat_hash, cfg.engine_id, remote.engine_id)
        self._send(session, session.handshake.hello())
        return session

    def _on_socket(self, session: RemoteSession, poller) -> None:
        while True:
            try:
                payload = session.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg_type, msg = wire.decode(payload)
                self._on_message(session, msg_type, msg, poller)
            except MalformedMessage as e:
                self.metrics.record_malformed()
                logger.debug("dropped malformed frame from %s: %s", session.remote, e)
            except hs.HandshakeRefused as e:
                logger.error("%s (producer %s at %s:%d)", e, session.remote.engine_id, session.remote.host,
                             session.remote.port)
                self.metrics.record_refused(e.reason)
                if not e.by_peer:  # tell the producer why, so both sides log it
                    self._send(session, wire.encode(MsgType.REFUSE, reason=e.reason.value, detail=e.detail))
                self._close_session(session, poller, FailureCause.HANDSHAKE_REFUSED)
                return
            if session.sock.closed:
                return

    def _on_message(self, session: RemoteSession, msg_type: MsgType, msg: dict, poller) -> None:
        if msg_type is MsgType.REFUSE:
            raise hs.HandshakeRefused.from_message(msg)
        shaking = session.state is SessionState.HANDSHAKING
        handshake = session.handshake
        assert handshake is not None  # (set before the HELLO went out)
        if msg_type is MsgType.CHALLENGE and shaking and not handshake.authed:
            self._send(session, handshake.on_challenge(msg))
        elif msg_type is MsgType.WELCOME and shaking and handshake.authed:
            self._open_streams(session, msg)
        elif msg_type is MsgType.PUBLISHED and session.state is SessionState.READY and session.client is not None:
            session.client.check_published(msg)
            self._on_published(session, msg)
        else:
            state = session.state.name if session.state else None
            raise MalformedMessage(f"unexpected {msg_type.value} in state {state}")

    def _open_streams(self, session: RemoteSession, msg: dict) -> None:
        cfg = self.config
        choice = gang_choice(self.gang, msg, cfg.data_path) or choose_path(
            cfg.data_path, msg, self.host_id, self.pool.device.type, cfg.num_tcp_streams, cfg.num_shm_streams)
        log_choice(choice, cfg.data_path, session.remote.engine_id)
        assert session.handshake is not None  # (WELCOME comes only during the handshake)
        session.client = session.handshake.on_welcome(msg)
        session.streams = [PullStream(self.pool, session.remote.host, msg["data_port"], session.client, choice.path,
                                      cfg.io_timeout_s, cfg.spin_us / 1e6, cfg.staging, cfg.device_checksums,
                                      self.gang) for _ in range(choice.streams)]
        with self._lock:
            session.state = SessionState.READY
            for job in session.pending:
                self._dispatch_locked(session, job)
            session.pending = []
        self._flush_done(session)

    def _flush_done(self, session: RemoteSession) -> None:
        if session.pending_watch:
            ids, session.pending_watch = session.pending_watch, []
            assert session.client is not None  # (flushed once READY)
            self._send(session, session.client.side_message(MsgType.WATCH, ids))
        if session.pending_done:
            ids, session.pending_done = session.pending_done, []
            assert session.client is not None  # (flushed once READY)
            self._send(session, session.client.side_message(MsgType.DONE, ids))

    def _send_heartbeats(self, poller) -> None:
        with self._lock:
            beats = dict(self._heartbeats)
        for remote in beats.keys() - self._sessions.keys():
            self._session_for(remote, poller)
        for remote, session in list(self._sessions.items()):  # an empty heartbeat keeps an idle session alive
            if session.state is SessionState.READY:
                assert session.client is not None  # (set before READY)
                self._send(session, session.client.side_message(MsgType.HEARTBEAT, beats.get(remote, [])))

    def _check_deadlines(self, now: float, poller) -> None:
        for session in list(self._sessions.values()):
            dead_streams = session.state is SessionState.READY and any(s.dead for s in session.streams)
            if session.state is not SessionState.READY and now > session.deadline:
                logger.error("KV handshake with %s at %s:%d timed out", session.remote.engine_id,
                             session.remote.host, session.remote.port)
                self._close_session(session, poller, FailureCause.TIMEOUT)
            elif dead_streams:
                if self.config.notify_done:  # the side channel still works: let P free these now
                    with self._lock:
                        session.pending_done += [j.remote_request_id for j in self._active.values()
                                                 if j.remote == session.remote]
                    self._flush_done(session)
                self._close_session(session, poller, FailureCause.PEER_GONE)
        with self._lock:
            late = [j for j in self._active.values() if now > j.deadline]
        for job in late:
            with self._lock:
                if job.parts_left == 0:  # nothing in flight (a streamed load waiting for its next part)
                    if id(job) in self._active:
                        self._fail_locked(job, FailureCause.TIMEOUT)
                    continue
            for stream in job.streams:
                stream.abort(FailureCause.TIMEOUT)  # its part then fails; the load ends when all parts did
            if not job.streams:
                with self._lock:
                    if id(job) in self._active:
                        self._fail_locked(job, FailureCause.TIMEOUT)

    def _close_session(self, session: RemoteSession, poller, cause: FailureCause) -> None:
        with self._lock:
            if self._sessions.get(session.remote) is session:
                del self._sessions[session.remote]
            session.state = None
            pending, session.pending = session.pending, []
            for job in pending + [j for j in self._streamed.values() if j.remote == session.remote]:
                job.cause = job.cause or cause
                if job.parts_left == 0:
                    self._fail_locked(job, cause)
        for stream in session.streams:
            stream.close(cause)  # queued parts fail; the load ends through _on_part
        try:
            poller.unregister(session.sock)
        except KeyError:
            pass
        session.sock.close(linger=100)  # lets a final REFUSE reach the producer

    def _send(self, session: RemoteSession, payload: bytes) -> None:
        try:
            session.sock.send(payload, zmq.NOBLOCK)
        except zmq.ZMQError as e:
            logger.debug("side-channel send to %s failed: %s", session.remote, e)

